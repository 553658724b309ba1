"""On a CUDA GPU: the compiled kernels against mhar.route, bitwise determinism, inductor, no host-device
synchronization in a fused step, a bf16 fused training step of every routed mode, the fused chain
replayed in a CUDA graph and a captured step against eager, and train.py on one
GPU, alone and under torchrun. Skipped, with the reason, where there is no GPU (the CPU runs the same
code in the interpreter: test_kernel.py, test_gpu_path.py)."""
import json
import subprocess
import sys

import pytest
import torch

import mhar
from helpers import ROOT, fused_history, gpt_pair, rel_err, route_and_grads, route_inputs, tiny

pytestmark = pytest.mark.gpu
CUDA = "cuda"


@pytest.fixture(autouse=True)
def a_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU: none here (the interpreter tests cover this code on the CPU)")
    import kernel
    assert not kernel.INTERPRETED, "TRITON_INTERPRET=1 is set: these tests are for the compiled kernels"


@pytest.mark.parametrize("N,d,heads", [(1, 40, 2), (9, 520, 8), (25, 1280, 8), (49, 1024, 8)],
                         ids=["one-source", "odd-width", "1b-width", "350m-deepest"])
def test_compiled_kernels_match_the_route_fp32(N, d, heads):
    from kernel import fused_route
    V, q, g, dout = route_inputs(N, 2, 65, d, dtype=torch.float32, device=CUDA)
    fused = route_and_grads(fused_route, V, q, g, dout, heads)
    reference = route_and_grads(mhar.route, V, q, g, dout, heads)
    for name, a, b in zip(("out", "dV", "dq", "dg"), fused, reference):
        assert rel_err(a, b) < 1e-5, f"{name}: {rel_err(a, b):.2e}"


def test_compiled_chain_bf16_as_close_to_float64_as_the_readable_path():
    from test_kernel import ReadableHistory, chain_grads
    exact = chain_grads(lambda q, g: ReadableHistory(q, g, 4), torch.float64, 0, device=CUDA)
    errors = {}
    for name, history in (("readable", lambda q, g: ReadableHistory(q, g, 4)),
                          ("one-pass", lambda q, g: fused_history(q, g, 4, group=1)),
                          ("grouped", lambda q, g: fused_history(q, g, 4, group=0))):
        results = chain_grads(history, torch.bfloat16, 0, device=CUDA)
        errors[name] = [rel_err(a, b) for a, b in zip(results, exact)]
    for name in ("one-pass", "grouped"):
        assert all(f <= 1.1 * r for f, r in zip(errors[name], errors["readable"])), errors


def gpt_step(model, idx):
    with torch.autocast(CUDA, dtype=torch.bfloat16):
        loss = model(idx, idx)[1]
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def fused_gpt():
    """A tiny fused model on the GPU and a batch for it."""
    torch.manual_seed(0)
    return mhar.GPT(tiny(fused=True)).to(CUDA), torch.randint(0, 128, (2, 32), device=CUDA)


def test_fused_step_is_bitwise_deterministic():
    model, idx = fused_gpt()
    first = gpt_step(model, idx)
    model.zero_grad(set_to_none=True)
    second = gpt_step(model, idx)
    assert torch.equal(first[0], second[0])
    assert all(torch.equal(a, b) for a, b in zip(first[1], second[1]))


MODES = {"full": dict(), "block": dict(route_block=2), "delta": dict(delta=True, route_block=2),
         "attnres": dict(residual="attnres"), "mhar-H4": dict(route_heads=4)}


@pytest.mark.parametrize("overrides", MODES.values(), ids=MODES.keys())
def test_fused_bf16_training_step_matches_readable(overrides):
    fused, readable = gpt_pair(CUDA, **overrides)
    idx = torch.randint(0, 128, (2, 32), device=CUDA)
    (loss, grads), (fused_loss, fused_grads) = gpt_step(readable, idx), gpt_step(fused, idx)
    assert rel_err(fused_loss, loss) < 1e-2
    assert rel_err(torch.cat([g.flatten() for g in fused_grads]),
                   torch.cat([g.flatten() for g in grads])) < 2e-2


def test_fused_model_compiles_with_inductor_in_one_graph():
    model, idx = fused_gpt()
    eager = gpt_step(model, idx)
    model.zero_grad(set_to_none=True)
    compiled = gpt_step(torch.compile(model, fullgraph=True), idx)
    assert rel_err(compiled[0], eager[0]) < 1e-2


def test_fused_step_never_synchronizes_the_host():
    """set_sync_debug_mode("error") raises at any synchronizing call (a pageable copy, .item())."""
    model, idx = fused_gpt()
    gpt_step(model, idx)                                   # compiles the kernels first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        gpt_step(model, idx)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_a_replayed_fused_chain_is_bit_for_bit_eager():
    """The fused chain at parity's shape (25 sites, d 512) captured in a torch.cuda.graph, its kernels
    bound before the capture, replayed on new inputs: every output and gradient as eager's."""
    from scripts import gpu_check
    r = gpu_check.replayed_chain(gpu_check.PARITY["gpu"], CUDA)
    assert r["ok"], r


def test_a_captured_step_with_accumulation_computes_what_eager_does():
    """train.py's --compile --fused --compile_mode reduce-overhead --grad_accum 4 step (100m at 4
    layers) against the eager fused step at lr 0: losses, every gradient, an evaluation, no CUDA
    graph skipped (gpu_check.captured_numbers)."""
    from scripts import gpu_check
    with gpu_check.compile_backend("inductor"):
        r = gpu_check.captured_numbers("100m-4L")
    assert r["ok"], r


def train_on_one_gpu(tmp_path, launcher):
    out = tmp_path / "out"
    command = [*launcher, "train.py", "--preset", "tiny", "--data", "synthetic", "--vocab_size", "256",
               "--out_dir", str(out), "--max_steps", "4", "--batch_size", "2", "--seq_len", "32",
               "--eval_batches", "1", "--eval_interval", "2", "--fused", "--device", "cuda"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads((out / "summary.json").read_text())


def test_train_py_on_one_gpu(tmp_path):
    summary = train_on_one_gpu(tmp_path, [sys.executable])
    assert summary["finished"] and summary["peak_mem"] > 0


def test_torchrun_one_process_on_one_gpu(tmp_path):
    summary = train_on_one_gpu(tmp_path, [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                          "--nproc_per_node", "1"])
    assert summary["finished"] and summary["world_size"] == 1
