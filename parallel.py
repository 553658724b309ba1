"""
Sharded data parallelism for train.py --fsdp, with PyTorch's FSDP2 (torch.distributed.fsdp.fully_shard).

DDP keeps the whole training state on every GPU: fp32 parameters, gradients and both Adam moments,
16 bytes per parameter, 128 GB at 8B before a single activation. Fully sharded data parallelism
(Zhao et al., 2023, "PyTorch FSDP: Experiences on Scaling Fully Sharded Data Parallel",
arXiv:2304.11277; ZeRO-3 in Rajbhandari et al., 2019, arXiv:1910.02054) keeps 1/N of each tensor on
each of N ranks: a sublayer's parameters are all-gathered just before it runs and freed after, and its
gradients are reduce-scattered, so each rank ends the backward holding the gradient of its own shard,
which its optimizer updates. The batches, the loss and the update are those of DDP.

    shard(model, mesh, dtype)         one FSDP unit per sublayer, the rest at the root; bf16 compute
    build_sharded(build, device, dtype)   rank 0 builds the model, the others its shape: one full copy
    save(folder, model, optimizer)    a sharded checkpoint (torch.distributed.checkpoint): each rank its shard
    load(folder, model, optimizer)    ... read back into a sharded model, whatever its number of ranks
"""
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict, set_model_state_dict,
                                                     set_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import mhar


def device_mesh(device):
    """All ranks of the default process group (NCCL on GPUs, gloo on CPUs) in one dimension: every tensor
    is split over all of them."""
    return init_device_mesh(device.type, (dist.get_world_size(),))


def mixed_precision(dtype):
    """Compute in `dtype` (bf16 on GPUs), keep the sharded parameters, the gradients' reduction and Adam
    in fp32: bf16 sums over many ranks would lose the small gradients. float32 changes nothing."""
    param_dtype = None if dtype == torch.float32 else dtype  # None: the parameters' own dtype
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)


def shard(model, mesh, dtype):
    """Turn an mhar.GPT into FSDP units in place: one per sublayer (its parameters are gathered only while it
    runs, forward and backward) and the root holding the rest (embedding, routing sites, final norm).

    The routing sites stay at the root: the forward reads their query and norm weight directly, not
    through a module call, and FSDP gathers a unit's parameters in its module's forward hook. Tied input
    and output embeddings must share one unit; untied ones (large vocabularies) get one each, so neither
    stays gathered for the whole step.
    """
    policy = mixed_precision(dtype)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    if model.lm_head.weight is not model.embed.weight:
        fully_shard(model.embed, mesh=mesh, mp_policy=policy)
        fully_shard(model.lm_head, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def build_sharded(build, device, dtype):
    """A sharded model whose full copy exists on rank 0's CPU alone.

    `build()` runs on rank 0 only and returns the model as a single process would build it (initialized
    from the seed, converted from a baseline, or loaded from pretrained weights): the sharded model then
    starts from exactly those values. The other ranks build only the shape, on the meta device (no
    memory), shard it, and receive their shards from rank 0 one tensor at a time. An 8B model thus needs
    one full fp32 copy (32 GB) in rank 0's CPU memory, not one per GPU.
    """
    rank = dist.get_rank()
    full = build() if rank == 0 else None
    shape = [full.config if full is not None else None]
    dist.broadcast_object_list(shape, src=0)  # the config: build() may have read it from a checkpoint
    with torch.device("meta"):
        model = mhar.GPT(shape[0])
    shard(model, device_mesh(device), dtype)
    model.to_empty(device=device)  # allocates each rank's shards, uninitialized
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, full.state_dict() if full is not None else {}, options=options)
    for name, buffer in model.named_buffers():  # what is not in the state dict: the rotary tables
        if full is not None:
            buffer.copy_(full.get_buffer(name))
        dist.broadcast(buffer, src=0)
    return model


# -----------------------------------------------------------------------------
# Sharded checkpoints: every rank writes its own shards into one folder (torch.distributed.checkpoint);
# the folder's .metadata, written last by rank 0, maps each tensor to its pieces, so any number of ranks
# (one process included, see common.load_model) can read it back.

def save(folder, model, optimizer):
    """Write the model's and the optimizer's shards into `folder`, replacing what was there; every rank
    calls it. It returns on every rank once the folder is complete, or raises on every rank."""
    folder = Path(folder)
    if dist.get_rank() == 0 and folder.exists():
        shutil.rmtree(folder)
    dist.barrier()  # nobody writes into the folder before it is empty
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=folder)


def load(folder, model, optimizer):
    """Read the shards of `save` into a sharded model and its optimizer (each rank reads the pieces its
    shards need, resharding when the number of ranks changed)."""
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=Path(folder))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
