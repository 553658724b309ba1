"""
Ranks and devices for train.py, and sharded data parallelism (--fsdp) with PyTorch's FSDP2
(fully_shard).

    Session, start_session(args)    this process's rank, world, device and precision (torchrun's
                                    RANK, WORLD_SIZE, LOCAL_RANK; NCCL on GPUs, gloo on CPUs)
    start_sharding, set_precision   --fsdp and --dtype on that session
    wrap_model(gpt, args, session)  DDP and torch.compile around the model, as asked

DDP keeps the whole training state on every GPU: fp32 parameters, gradients and both Adam
moments, 16 bytes per parameter, 128 GB at 8B before a single activation. Fully sharded data
parallelism (Zhao et al., 2023, "PyTorch FSDP: Experiences on Scaling Fully Sharded Data
Parallel", arXiv:2304.11277; ZeRO-3 in Rajbhandari et al., 2019, arXiv:1910.02054) keeps 1/N of
each tensor on each of N ranks: a sublayer's parameters are all-gathered just before it runs and
freed after, and its gradients are reduce-scattered, so each rank ends the backward holding the
gradient of its own shard, which its optimizer updates. The batches, the loss and the update are
those of DDP.

    shard(model, mesh, dtype)       one FSDP unit per sublayer, the rest at the root; bf16 compute
    distribute(full, optimizer, device, dtype, make_optimizer)
                                    rank 0's whole model (and optimizer state) into shards
    gathered(model)                 the root's parameters whole, for generate()
    regather(model)                 forget gathered copies after the shards changed in place
    save(out, step, model, optimizer) / load(folder, model, optimizer)    sharded checkpoints
"""
import dataclasses
import os
import shutil
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict,
                                                     set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import (FSDPModule, MixedPrecisionPolicy, fully_shard,
                                    register_fsdp_forward_method)
from torch.nn.parallel import DistributedDataParallel as DDP

from lib import rivals
from lib.common import UserError, pick_device

# -------------------------------------------------------------------------------------------
# The ranks, the device, precision, the wrapper around the model.

@dataclasses.dataclass
class Session:
    """This process's part of the run: its rank among `world` ranks, its device, its precision."""
    ddp: bool              # the ranks share a process group: torchrun (or --fsdp alone: 1 rank)
    fsdp: bool             # the model is sharded over the ranks (else DDP copies it)
    rank: int
    world: int
    device: torch.device
    dtype: torch.dtype     # of the autocast region (float32: none)
    autocast: object       # the context every forward runs in
    control: object = None  # a gloo group of the ranks, for max_over_ranks

    @property
    def master(self):
        return self.rank == 0  # logs, evaluates (with the others' help) and saves

    @property
    def replicated(self):
        return self.ddp and not self.fsdp  # every rank holds the whole model, in DDP

    def max_over_ranks(self, value):
        """The largest of an integer over the ranks (without torchrun: the value). The loop asks it
        every step (a signal stops every rank after the same step): a host-side all-reduce over a
        gloo group, made at the first call (every rank makes it), so that the GPU is never waited
        for; an NCCL all-reduce's .item() would wait for the step to finish."""
        if not self.ddp:
            return value
        if self.control is None:
            gloo = backend(self.device) == "gloo"
            self.control = dist.group.WORLD if gloo else dist.new_group(backend="gloo")
        t = torch.tensor(value)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.control)
        return int(t)

    def any_rank(self, flag):
        """Whether `flag` holds on any rank, the same answer on every rank."""
        return self.max_over_ranks(int(flag)) > 0


def start_session(args):
    """The Session of --device. torchrun sets RANK and WORLD_SIZE; each rank takes its own GPU
    (LOCAL_RANK), and the ranks talk NCCL on GPUs, gloo on CPUs. float32 until set_precision."""
    ddp = int(os.environ.get("RANK", -1)) != -1
    rank, world = (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])) if ddp else (0, 1)
    device = pick_device(args.device)
    if device.type == "cuda" and ddp:
        device = torch.device(f"cuda:{os.environ.get('LOCAL_RANK', 0)}")
    elif device.type == "cuda" and device.index is None:   # "cuda": set_device needs an index
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    if ddp and not dist.is_initialized():
        dist.init_process_group(backend(device))
    return Session(ddp, False, rank, world, device, torch.float32, nullcontext())


def backend(device):
    return "nccl" if device.type == "cuda" else "gloo"


def start_sharding(session, args):
    """--fsdp (the checkpoint's on --resume): the model will be sharded over the ranks; without
    torchrun over a process group of this one process (its shards are the whole model)."""
    if not args.fsdp:
        return
    if session.device.type not in ("cuda", "cpu"):
        raise UserError(f"--fsdp shards over CUDA GPUs (NCCL) or CPU processes (gloo), not "
                        f"{session.device.type}: pass --device cuda or cpu, or leave --fsdp out")
    if not session.ddp:
        dist.init_process_group(backend(session.device), store=dist.HashStore(), rank=0,
                                world_size=1)
    session.ddp = session.fsdp = True


def set_precision(session, args):
    """--dtype (the checkpoint's on --resume): bf16 autocast on CUDA by default."""
    dtype = {"auto": torch.bfloat16 if session.device.type == "cuda" else torch.float32,
             "float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    session.dtype = dtype
    if dtype != torch.float32:
        session.autocast = torch.autocast(session.device.type, dtype=dtype)


def wrap_model(gpt, args, session):
    """The model the loop trains: wrapped for data parallelism and compiled as asked (a sharded
    model is its own wrapper). DDP is compiled, not wrapped around a compiled model: so
    torch.compile splits the graph at DDP's gradient buckets, and each all-reduce overlaps the
    rest of the backward (PyTorch's DDP and torch.compile notes)."""
    model = gpt
    if session.replicated:
        device = session.device
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    return torch.compile(model, mode=getattr(args, "compile_mode", "default")) if args.compile else model


def graph_grads(model, args):
    """Whether the model runs as CUDA graphs (torch.compile's reduce-overhead mode: cudagraph trees),
    after giving each trainable parameter that has none a zeroed .grad, allocated here, outside any
    graph. Under cudagraph trees a .grad that the first micro-step's backward allocates lives in the
    graphs' memory pool, and the next replay overwrites it: gradient accumulation would read garbage.
    torch's cudagraph_trees.py names this case ("accessing gradient tensor output of CUDAGraphs that
    has been overwritten by a subsequent run", CUDAGraphTreeManager.format_dealloc_msg) and asks for
    zeroed .grad buffers allocated outside capture; train_step then zeroes them in place."""
    if not (args.compile and getattr(args, "compile_mode", "default") == "reduce-overhead"):
        return False
    for p in model.parameters():
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)
    return True


# -------------------------------------------------------------------------------------------
# Sharding: FSDP2 units, rank 0's model handed out as shards.


def device_mesh(device):
    """All ranks of the default process group (NCCL on GPUs, gloo on CPUs) in one dimension:
    every tensor is split over all of them."""
    return init_device_mesh(device.type, (dist.get_world_size(),))


def mixed_precision(dtype):
    """Compute in `dtype` (bf16 on GPUs), keep the sharded parameters, the gradients' reduction
    and Adam in fp32: bf16 sums over many ranks would lose the small gradients. float32 changes
    nothing."""
    param_dtype = None if dtype == torch.float32 else dtype  # None: the parameters' own dtype
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)


def shard(model, mesh, dtype):
    """Turn an mhar.GPT into FSDP units in place: one per sublayer (its parameters are gathered
    only while it runs, forward and backward) and the root holding the rest (embedding, routing
    sites, final norm).

    The routing sites stay at the root: the forward reads their query and norm weight directly,
    not through a module call, and FSDP gathers a unit's parameters in its module's forward hook.
    Tied input and output embeddings must share one unit; untied ones (large vocabularies) get
    one each, so neither stays gathered for the whole step.
    """
    policy = mixed_precision(dtype)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    if model.lm_head.weight is not model.embed.weight:
        fully_shard(model.embed, mesh=mesh, mp_policy=policy)
        fully_shard(model.lm_head, mesh=mesh, mp_policy=policy)
        register_fsdp_forward_method(model.lm_head, "loss")  # gathers the head as forward does
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def distribute(full, optimizer, device, dtype, make_optimizer):
    """(sharded model, its optimizer) from a model whose whole copy exists on rank 0 alone.

    `full` on rank 0 is the model as one process builds it (initialized from the seed, converted
    from a baseline, or read from pretrained weights), on its CPU; the other ranks pass None or
    the same model built on the meta device (no memory). Every rank builds the shape on the meta
    device, shards it, and receives its shards from rank 0 one tensor at a time: an 8B model
    needs one full fp32 copy (32 GB) in rank 0's CPU memory, not one per GPU. `optimizer` (rank
    0's, over `full`; None elsewhere or for a fresh start) hands over its state, e.g. the Adam
    moments a conversion carries; make_optimizer(model) builds the optimizer of the shards.
    """
    master = dist.get_rank() == 0
    config = [full.config if master else None]
    dist.broadcast_object_list(config, src=0)  # the shape: rank 0 may have read it from files
    state = {k: vector(v) for k, v in full.state_dict().items()} if master else {}
    buffers = dict(full.named_buffers()) if master else {}  # not in the state dict: rotary tables
    carried = carried_state(full, optimizer) if master and optimizer is not None else None
    del full
    with torch.device("meta"):
        model = vectorize_scalars(rivals.model(config[0]))
    shard(model, device_mesh(device), dtype)
    model.to_empty(device=device)  # allocates each rank's shards, uninitialized
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, state, options=options)
    for name, buffer in model.named_buffers():
        if master:
            buffer.copy_(buffers[name])
        dist.broadcast(buffer, src=0)
    sharded_optimizer = make_optimizer(model)
    has_state = [carried is not None and list(carried["state"])]
    dist.broadcast_object_list(has_state, src=0)
    if has_state[0] is not False:
        partial = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
        set_optimizer_state_dict(model, sharded_optimizer, carried or {}, options=partial)
        for name, p in model.named_parameters():  # loading made state for all; fresh stay fresh
            if name not in has_state[0]:
                sharded_optimizer.state.pop(p, None)
    return model, sharded_optimizer


def vectorize_scalars(model):
    """FSDP shards no 0-d parameter (delta routing's gates): each becomes a vector of one element,
    which broadcasts as the scalar did. The shards keep them so; common.load_model reads them
    back into scalars."""
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if p.dim() == 0:
                setattr(module, name, torch.nn.Parameter(p.reshape(1)))
    return model


def vector(tensor):
    """A 0-d tensor as a vector of one element (see vectorize_scalars); others as they are."""
    return tensor.reshape(1) if torch.is_tensor(tensor) and tensor.dim() == 0 else tensor


def carried_state(model, optimizer):
    """An optimizer's state dict keyed by parameter names rather than positions, the form
    set_optimizer_state_dict reads."""
    names = {id(p): name for name, p in model.named_parameters()}
    order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    saved = optimizer.state_dict()
    state = {order[i]: {k: v if k == "step" else vector(v) for k, v in s.items()}
             for i, s in saved["state"].items()}
    return dict(state=state,
                param_groups=[{**g, "params": [order[i] for i in g["params"]]}
                              for g in saved["param_groups"]])


@contextmanager
def gathered(model):
    """The root unit's parameters whole for calls that bypass its forward (model.generate calls
    model.hidden; the sublayers gather their own). Every rank must enter it. A plain model:
    nothing to do."""
    if not isinstance(model, FSDPModule):
        yield
        return
    model.unshard()
    try:
        yield
    finally:
        model.reshard()


def regather(model):
    """Drop every gathered copy of the parameters, so the next forward gathers the shards anew:
    needed after the shards were changed in place outside the optimizer (a weight average
    swapped in), since FSDP2 keeps the root unit's gathered parameters after a forward that no
    backward follows. A plain model: nothing to do."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


# -------------------------------------------------------------------------------------------
# Sharded checkpoints: every rank writes its own shards into one folder
# (torch.distributed.checkpoint); the folder's .metadata, written last by rank 0, maps each tensor
# to its pieces, so any number of ranks (one process included, see common.read_shards) can read
# it back.

def save(out, step, model, optimizer, extra=None):
    """Write the model's and the optimizer's shards (and `extra`, a dict of more sharded state,
    e.g. a weight average) into a new folder out/shards-STEP[.n] and return its name; every rank
    calls it. The folder the last ckpt.pt names is never touched: a crash leaves that checkpoint
    whole (remove_stale deletes the old folder once the new ckpt.pt names the new one)."""
    name = [None]
    if dist.get_rank() == 0:
        name[0], n = f"shards-{step}", 1
        while (Path(out) / name[0]).exists():  # the same step saved again (a stop after an eval)
            name[0], n = f"shards-{step}.{n}", n + 1
    dist.broadcast_object_list(name, src=0)
    state = {"model": get_model_state_dict(model), **(extra or {})}
    if optimizer.state:  # none before the first step: get_optimizer_state_dict would make one
        state["optimizer"] = get_optimizer_state_dict(model, optimizer)  # by a step AdamW counts
    dcp.save(state, checkpoint_id=Path(out) / name[0])
    return name[0]


def remove_stale(out, keep):
    """Delete every shards-* folder in `out` but `keep` (rank 0, once ckpt.pt names `keep`)."""
    for folder in Path(out).glob("shards-*"):
        if folder.name != keep:
            shutil.rmtree(folder, ignore_errors=True)


def load(folder, model, optimizer):
    """Read the shards of `save` into a sharded model and its optimizer (each rank reads the
    pieces its shards need, resharding when the number of ranks changed)."""
    saved = dcp.FileSystemReader(folder).read_metadata().state_dict_metadata
    state = {"model": get_model_state_dict(model)}
    if any(name.startswith("optimizer.") for name in saved):  # not saved before the first step
        state["optimizer"] = get_optimizer_state_dict(model, optimizer)
    dcp.load(state, checkpoint_id=Path(folder))
    set_model_state_dict(model, state["model"])
    if "optimizer" in state:
        set_optimizer_state_dict(model, optimizer, state["optimizer"])


def load_extra(folder, state):
    """Read what `save` wrote under `extra` into `state`'s sharded tensors, in place (e.g.
    {"ema": {name: DTensor}}); every rank calls it."""
    dcp.load(state, checkpoint_id=Path(folder))
