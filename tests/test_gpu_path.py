"""The CUDA-only paths, checked on the CPU: the session's device setup with CUDA faked, a resume on a
machine with fewer GPUs, and every routed mode under bf16 autocast (the GPU's precision), fused and
readable, checkpointed and compiled. Tests that need a real GPU carry the `gpu` marker (test_gpu.py)."""
import argparse

import pytest
import torch

import mhar
import train
from lib import parallel
from helpers import fused_history, gpt_pair, interpreted, rel_err, tiny


# ----------------------------------------------------------------------------------------------
# Device setup with CUDA faked: torch.cuda reports GPUs, set_device refuses what the real one does.

@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda with two GPUs: set_device records the index it is given and, like torch's,
    refuses a device without one; process groups are recorded, not made."""
    calls = {"set_device": [], "init_process_group": [], "set_rng_state": []}

    def set_device(device):
        calls["set_device"].append(torch.cuda._utils._get_device_index(device))  # raises as torch does

    def set_rng_state(state, device):
        if device >= torch.cuda.device_count():
            raise RuntimeError(f"invalid device ordinal {device}")
        calls["set_rng_state"].append(device)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    monkeypatch.setattr(torch.cuda, "set_rng_state", set_rng_state)
    monkeypatch.setattr(torch.cuda.random, "set_rng_state", set_rng_state)
    monkeypatch.setattr(train.dist, "init_process_group",
                        lambda backend, **kwargs: calls["init_process_group"].append(backend))
    monkeypatch.setattr(train.dist, "is_initialized", lambda: bool(calls["init_process_group"]))
    return calls


@pytest.mark.parametrize("device,torchrun,fsdp,expected", [
    ("cuda", False, False, 0), ("auto", False, False, 0), ("cuda:1", False, False, 1),
    ("cuda", True, False, 1), ("cuda", False, True, 0), ("auto", True, True, 1)],
    ids=["one-gpu", "one-gpu-auto", "one-gpu-index", "torchrun", "fsdp-alone", "torchrun-fsdp"])
def test_session_takes_an_indexed_gpu(fake_cuda, monkeypatch, device, torchrun, fsdp, expected):
    """`python train.py --device cuda` (one process) sets an indexed device; under torchrun each rank
    takes its LOCAL_RANK's GPU; --fsdp makes an NCCL group, of one process without torchrun."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    if torchrun:
        monkeypatch.setenv("RANK", "1"), monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("LOCAL_RANK", "1")
    args = argparse.Namespace(device=device, fsdp=fsdp)
    session = train.start_session(args)
    train.start_sharding(session, args)
    assert session.device == torch.device("cuda", expected)
    assert fake_cuda["set_device"] == [expected]
    assert fake_cuda["init_process_group"] == (["nccl"] if torchrun or fsdp else [])


@pytest.mark.parametrize("gpus", [1, 0], ids=["fewer-gpus", "no-gpu"])
def test_resume_restores_the_rng_of_the_gpus_there_are(fake_cuda, monkeypatch, gpus):
    """A checkpoint saved where 2 GPUs were visible resumes where there is one, or none."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [torch.zeros(16, dtype=torch.uint8)] * 2)
    states = train.rng_states()
    train.set_rng_states(states)
    assert fake_cuda["set_rng_state"] == list(range(gpus))


# ----------------------------------------------------------------------------------------------
# bf16 autocast on the CPU: every routed mode, fused and readable, checkpointed, compiled.

MODES = {   # id: Config overrides
    "full": dict(), "block": dict(route_block=2), "delta": dict(delta=True, route_block=2),
    "attnres": dict(residual="attnres"), "mhar-H4": dict(route_heads=4)}
VARIANTS = {"eager": dict(), "checkpointed": dict(checkpointing=True)}


def bf16_loss_and_grads(model, idx, module=None):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, loss = model(idx, idx)
    loss.backward()
    return logits.detach(), {name: p.grad for name, p in (module or model).named_parameters()}


@interpreted
@pytest.mark.parametrize("variant", VARIANTS.values(), ids=VARIANTS.keys())
@pytest.mark.parametrize("overrides", MODES.values(), ids=MODES.keys())
def test_fused_matches_readable_under_bf16_autocast(overrides, variant):
    """Under the same bf16 autocast, fused and readable give the same logits and gradients within
    bf16 rounding: all gradients as one vector within 2e-2, and each tensor's no further from the
    readable one than 3x the readable one's own distance from the fp32 model's, + 3e-2 (a gate's
    gradient, one sum over every position, loses digits to cancellation on both paths)."""
    fused, readable = gpt_pair(**overrides, **variant)
    idx = torch.randint(0, 128, (1, 6))  # 2 rows for each of the interpreter's 3 programs
    logits, grads = bf16_loss_and_grads(readable, idx)
    fused_logits, fused_grads = bf16_loss_and_grads(fused, idx)
    readable.zero_grad()
    readable(idx, idx)[1].backward()                                  # fp32, no autocast
    exact = {name: p.grad for name, p in readable.named_parameters()}
    assert rel_err(fused_logits, logits) < 2e-2
    assert rel_err(torch.cat([g.flatten() for g in fused_grads.values()]),
                   torch.cat([g.flatten() for g in grads.values()])) < 2e-2
    excess = {name: rel_err(fused_grads[name], grads[name]) - 3 * rel_err(grads[name], exact[name])
              for name in grads}
    assert max(excess.values()) < 3e-2, sorted(excess.items(), key=lambda kv: -kv[1])[:3]


@interpreted
@pytest.mark.parametrize("overrides", MODES.values(), ids=MODES.keys())
def test_fused_compiles_under_bf16_autocast(overrides):
    """torch.compile (aot_eager, one graph) of the fused model under bf16 autocast gives its eager
    logits and gradients."""
    fused, _ = gpt_pair(**overrides, n_layer=1)
    idx = torch.randint(0, 128, (1, 5))
    logits, grads = bf16_loss_and_grads(fused, idx)
    grads = {name: g.clone() for name, g in grads.items()}
    fused.zero_grad()
    compiled = torch.compile(fused, fullgraph=True, backend="aot_eager")
    compiled_logits, compiled_grads = bf16_loss_and_grads(compiled, idx, module=fused)
    assert rel_err(compiled_logits, logits) < 1e-2
    assert max(rel_err(compiled_grads[name], grads[name]) for name in grads) < 2e-2


@interpreted
def test_fused_history_names_a_source_of_another_dtype():
    """A source in another dtype than the first is refused with what to do, not by the kernel."""
    q, g = torch.zeros(24), torch.ones(24)
    history = fused_history([q, q], [g, g], 2)
    history.append(torch.randn(1, 3, 24))
    history.read(0)
    with pytest.raises(ValueError, match="append the embedding in the sublayers' dtype"):
        history.append(torch.randn(1, 3, 24, dtype=torch.bfloat16))


# ----------------------------------------------------------------------------------------------
# The training loop's GPU habits: DDP compiled (not wrapped around a compiled model), peaks reset.

def test_ddp_is_compiled_not_wrapped_around_a_compiled_model(monkeypatch):
    """torch.compile(DDP(model)) lets each gradient bucket's all-reduce overlap the backward;
    DDP(torch.compile(model)) does not. One gloo process stands in for the ranks."""
    from torch.nn.parallel import DistributedDataParallel
    train.dist.init_process_group("gloo", store=train.dist.HashStore(), rank=0, world_size=1)
    try:
        session = train.Session(True, False, 0, 1, torch.device("cpu"), torch.float32, None)
        model = train.wrap_model(mhar.GPT(tiny()), argparse.Namespace(compile=True), session)
        assert isinstance(model._orig_mod, DistributedDataParallel)
        assert model.no_sync is not None                    # the loop's gradient accumulation
    finally:
        train.dist.destroy_process_group()


def test_cuda_peak_memory_is_reset_after_each_reading(monkeypatch):
    """A logged peak is the peak since the previous log line (a step's, not an evaluation's)."""
    peaks = [5, 3]
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: peaks[0])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device: peaks.pop(0))
    cuda = torch.device("cuda", 0)
    assert train.peak_memory(cuda) == 5 and train.peak_memory(cuda) == 3


def test_the_per_step_agreement_of_the_ranks_never_waits_for_the_gpu(monkeypatch):
    """Every step the ranks agree on whether a signal stops them (Session.max_over_ranks): over a
    gloo group, on CPU tensors, never an NCCL all-reduce of a CUDA tensor whose .item() would wait
    for the step's kernels. The group is made once, at the first call."""
    groups, reduced = [], []
    monkeypatch.setattr(parallel.dist, "new_group", lambda backend: groups.append(backend) or "gloo")
    monkeypatch.setattr(parallel.dist, "all_reduce",
                        lambda t, op, group: reduced.append((t.device.type, group)) or t.fill_(7))
    session = parallel.Session(True, False, 0, 2, torch.device("cuda", 0), torch.bfloat16, None)
    assert [session.max_over_ranks(0) for _ in range(3)] == [7, 7, 7]
    assert groups == ["gloo"] and reduced == [("cpu", "gloo")] * 3
    assert session.any_rank(False)                                   # 7 > 0 on another rank


@pytest.mark.parametrize("accum", [1, 3], ids=["one-micro-step", "three-micro-steps"])
def test_captured_steps_keep_their_grad_buffers_and_train_as_eager_steps(monkeypatch, accum):
    """--compile --compile_mode reduce-overhead: under CUDA graph trees a .grad that a captured backward
    allocates is overwritten by the next replay (torch's cudagraph_trees.py says so), so train_step gives
    every parameter a .grad before the first micro-step and zeroes it in place after each step: the same
    storage, step after step; each micro-step begins a graph iteration. The losses and the weights after
    two steps are the default mode's, bit for bit. (The model runs eager: a CPU has no CUDA graphs; what
    is checked is the step around them.)"""
    marks = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(len(marks)))
    gen = torch.Generator().manual_seed(0)
    xs, ys = torch.randint(0, 128, (2, accum, 2, 16), generator=gen)
    session = argparse.Namespace(replicated=False, autocast=torch.autocast("cpu", enabled=False))
    ready = []

    def two_steps(mode):
        torch.manual_seed(0)
        model = mhar.GPT(tiny("mhar"))
        ready.clear()  # at each forward: does every parameter hold its .grad already (outside capture)?
        model.register_forward_pre_hook(lambda m, args: ready.append(all(p.grad is not None
                                                                           for p in m.parameters())))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        args = argparse.Namespace(grad_accum=accum, grad_clip=1.0, compile=True, compile_mode=mode)
        losses, grads = [], []
        for _ in range(2):
            losses.append(train.train_step(model, optimizer, xs, ys, args, session, None))
            grads.append([p.grad for p in model.parameters()])
        return model, losses, grads

    eager, eager_losses, eager_grads = two_steps("default")
    assert marks == [] and all(g is None for step in eager_grads for g in step)  # set to None, as before
    captured, losses, grads = two_steps("reduce-overhead")
    assert len(marks) == 2 * accum
    assert all(a is b and a.eq(0).all() for a, b in zip(*grads))                  # kept, zeroed in place
    assert ready == [True] * (2 * accum)                           # allocated before the first backward
    assert torch.equal(torch.stack(losses), torch.stack(eager_losses))
    for (name, p), q in zip(captured.named_parameters(), eager.parameters()):
        assert torch.equal(p, q), name
