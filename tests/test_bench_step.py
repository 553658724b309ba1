"""bench_step.py: the step's roofline against counts made by hand and against the model's own FLOPs
formula, the host's measure, and its command line."""
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import mhar
from helpers import ROOT
from scripts import bench_step


def test_meter_counts_ops_flops_and_bytes_and_sums_each_ops_roofline():
    a, b = torch.randn(8, 16), torch.randn(16, 4)
    with bench_step.Meter() as meter:
        c = a @ b                       # 2·8·16·4 FLOPs; 4·(128 + 64 + 32) bytes
        c.t()                           # a view: no bytes
        c + 1.0                         # 32 elements in and out
    matmul, add = 4 * (8 * 16 + 16 * 4 + 8 * 4), 4 * 2 * 32
    assert (meter.ops, meter.flops, meter.bytes) == (3, 2 * 8 * 16 * 4, matmul + add)
    expected = (max(2 * 8 * 16 * 4 / bench_step.H200_FLOPS, matmul / bench_step.H200_BYTES)
                + add / bench_step.H200_BYTES)
    assert meter.seconds == pytest.approx(expected, rel=1e-12)


def test_cpu_attention_flops_are_four_b_h_t_s_hd_forward_and_two_and_a_half_times_backward():
    q, k, v = (torch.randn(2, 3, 8, 4, requires_grad=True) for _ in range(3))
    with bench_step.Meter() as forward:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    with bench_step.Meter() as backward:
        out.sum().backward()
    assert forward.flops == 4 * 2 * 3 * 8 * 8 * 4
    assert backward.flops == int(2.5 * 4 * 2 * 3 * 8 * 8 * 4)


@pytest.mark.parametrize("residual", ["baseline", "mhar"])
def test_the_fake_step_counts_the_flops_the_model_accounts_for(residual):
    """The fake 100m micro-step's FLOPs (matmuls and attention) against GPT.flops_per_token, an
    independent count: within 6 % (the formula also counts the routing's and norms' elementwise
    work, which flop_counter does not)."""
    config = mhar.preset("100m", residual=residual)
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        gpt = mhar.GPT(config)
        with bench_step.Meter() as meter:
            bench_step.micro_step(gpt, 1, config.seq_len)
    model = gpt.flops_per_token() * config.seq_len
    assert 0.94 * model <= meter.flops <= model


def test_device_time_and_memory_grow_with_the_micro_batch_and_fused_adds_the_kernels():
    one, one_memory = bench_step.device_time("100m", "baseline", 1)
    two, two_memory = bench_step.device_time("100m", "baseline", 2)
    params = sum(p.numel() for p in mhar.GPT(mhar.preset("100m", residual="baseline")).parameters())
    assert 1.8 * one < two < 2 * one            # the weights' reads do not double
    assert 16 * params < one_memory < two_memory < 16 * params + 2 * (one_memory - 16 * params)
    fused, memory = bench_step.device_time("100m", "mhar fused", 1)
    config = mhar.PRESETS["100m"]
    sources = (2 * config.n_layer + 1) * config.seq_len * config.n_embd * 2     # bf16; and rests
    assert one < fused < 1.2 * one and one_memory + 2 * sources < memory < one_memory + 3 * sources
    assert bench_step.device_time("100m", "mhar", 1)[0] > 3 * fused     # readable: stacked reads


def test_device_time_chunks_the_head_as_on_a_gpu_and_puts_the_cpus_budget_back(monkeypatch):
    from lib import head
    budgets, chunks = {"cpu": 7 << 20, "cuda": 3 << 28}, []      # this test's: any order of tests
    monkeypatch.setattr(head, "HEAD_CHUNK_BYTES", dict(budgets))
    monkeypatch.setattr(head, "head_chunk", lambda vocab, device, chunk=head.head_chunk:
                        chunks.append(chunk(vocab, device)) or chunks[-1])
    bench_step.device_time("100m", "baseline", 1)
    vocab = mhar.PRESETS["100m"].vocab_size
    assert chunks and set(chunks) == {budgets["cuda"] // (4 * vocab)}
    assert head.HEAD_CHUNK_BYTES == budgets


def test_memory_is_16_bytes_a_parameter_and_the_saved_tensors_and_fused_adds_what_it_keeps():
    """Against the saved tensors counted here (each storage once), and bench_kernel.traffic."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from scripts import bench_kernel
    config, saved = mhar.preset("100m", residual="baseline"), {}

    def keep(tensor):
        saved[tensor.untyped_storage()._cdata] = tensor.untyped_storage().nbytes()
        return tensor

    _, memory = bench_step.device_time("100m", "baseline", 2)
    from lib import head
    with pytest.MonkeyPatch.context() as patched:
        patched.setitem(head.HEAD_CHUNK_BYTES, "cpu", head.HEAD_CHUNK_BYTES["cuda"])
        with FakeTensorMode(), torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            gpt = mhar.GPT(config)
            bench_step.micro_step(gpt, 2, config.seq_len)
    params = sum(p.numel() for p in gpt.parameters())
    assert memory == 16 * params + sum(saved.values())
    _, fused = bench_step.device_time("100m", "mhar fused", 2)
    routed, tokens = mhar.preset("100m"), 2 * config.seq_len
    kept = bench_kernel.traffic(routed.n_layer, routed.n_embd, 8, tokens)["saved"]
    assert fused == memory + (2 * routed.n_layer + 1) * tokens * routed.n_embd * 2 + kept


def test_host_time_counts_every_op_of_a_micro_step():
    ops, seconds = bench_step.host_time("100m", "baseline", repeats=1)
    config = mhar.preset("100m", residual="baseline", **bench_step.TINY)
    gpt = mhar.GPT(config)
    for _ in range(2):      # warm, as host_time's: the first step makes what later ones reuse
        bench_step.micro_step(gpt, 1, config.seq_len)
    with bench_step.Meter() as meter:
        bench_step.micro_step(gpt, 1, config.seq_len)
    assert ops == meter.ops and seconds > 0


def test_host_time_is_the_best_of_its_repeats_on_one_thread(monkeypatch):
    """A fake thread clock: each timed micro-step takes its given seconds; host_time keeps the least,
    runs every micro-step of one sequence on one thread (warm twice, counted once, then `repeats`),
    and gives the threads back."""
    threads, steps = torch.get_num_threads(), []
    monkeypatch.setattr(bench_step, "micro_step", lambda gpt, batch, seq_len: steps.append(
        (batch, seq_len, torch.get_num_threads())))
    ticks = iter([0, 5, 10, 13, 20, 24, 30, 36, 40, 47])     # five repeats: 5, 3, 4, 6, 7 s
    monkeypatch.setattr(bench_step.time, "thread_time", lambda: next(ticks))
    ops, seconds = bench_step.host_time("100m", "baseline")        # five repeats by default
    assert seconds == 3 and ops == 0 and next(ticks, None) is None
    assert steps == [(1, bench_step.TINY["seq_len"], 1)] * (2 + 1 + 5)
    assert torch.get_num_threads() == threads


FUSED_HOST = """
import kernel
import mhar
from scripts import bench_kernel, bench_step
assert not kernel.INTERPRETED
fused, readable = (bench_step.host_time("100m", mode, repeats=1)[0] for mode in ("mhar fused", "mhar"))
config = mhar.preset("100m", **bench_step.MODES["mhar fused"], **bench_step.TINY)
with bench_kernel.stand_in_gpu() as launched:       # the same count, by hand
    gpt = mhar.GPT(config)
    for _ in range(2):
        bench_step.micro_step(gpt, 1, config.seq_len)
    before = launched()
    with bench_step.Meter() as meter:
        bench_step.micro_step(gpt, 1, config.seq_len)
    print(fused, readable, meter.ops, launched() - before)
"""


@pytest.mark.skipif(shutil.which("gcc") is None and shutil.which("cc") is None,
                    reason="the stand-in driver needs a C compiler")
def test_host_time_of_the_fused_path_counts_its_launches():
    """In a process without the interpreter (the launches go through Triton's launcher to the
    stand-in driver): fewer ops than the readable path's, at least a launch a site each way."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", FUSED_HOST], env=env, capture_output=True,
                          text=True, cwd=ROOT,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    fused, readable, ops, launches = map(int, done.stdout.split())
    sites = 2 * mhar.PRESETS["100m"].n_layer + 1
    assert fused == ops + launches and launches >= 2 * sites and fused < readable


def test_interpreted_the_table_is_refused_in_one_line(capsys):
    import kernel
    assert kernel.INTERPRETED       # the suite's (tests/conftest.py)
    with pytest.raises(SystemExit) as stop:
        bench_step.main(["--preset", "100m"])
    assert stop.value.code == 2
    assert capsys.readouterr().err == ("bench_step.py: error: the fused path's host time goes "
                                       "through Triton's launcher, which the interpreter "
                                       "replaces: unset TRITON_INTERPRET\n")


@pytest.mark.parametrize("flag", ["0", "", "a", "2,-1", "1.5", "1,,2"])
def test_bad_micro_batches_are_one_line_and_status_2(flag, capsys):
    with pytest.raises(SystemExit) as stop:
        bench_step.parse_args(["--micro_batches", flag])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("bench_step.py: error: --micro_batches: comma-separated positive integers")
    assert err.count("\n") == 1


def test_micro_batches_and_presets_parse():
    args = bench_step.parse_args(["--micro_batches", "1,32", "--preset", "1b", "--preset", "350m"])
    assert args.micro_batches == [1, 32] and args.preset == ["1b", "350m"]
    with pytest.raises(SystemExit):             # no abbreviations: --micro is not --micro_batches
        bench_step.parse_args(["--micro", "4"])
    assert bench_step.parse_args([]).micro_batches == [1, 2, 4, 8, 16, 32]
    with pytest.raises(SystemExit):
        bench_step.parse_args(["--preset", "small"])


def test_the_table_prints_a_row_per_preset_mode_and_micro_batch_and_marks_device_bound_ones(
        monkeypatch, capsys):
    """With host and device times stubbed: device >= MARGIN x host, and only that, is marked;
    every column as computed; the rows returned; each preset and mode measured once."""
    asked = []
    monkeypatch.setattr(bench_step, "host_time", lambda preset, mode: asked.append((preset, mode))
                        or (1, 0.5))
    device = {1: 0.9999, 2: 1.0, 4: 1.0001}       # MARGIN x host = 1 s: one less, equal, one more
    monkeypatch.setattr(bench_step, "device_time", lambda preset, mode, batch: asked.append(
        (preset, mode, batch)) or (device[batch], batch * 2**30 * 1.5))
    rows = bench_step.table(["100m", "1b"], [1, 2, 4], modes=("baseline", "mhar"))
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == ("one micro-step, host (measured here, per op) against device (roofline, "
                        "H200: 989 TFLOPS bf16, 4.8 TB/s); device-bound: device >= 2 x host")
    assert lines[1].split() == ["preset", "mode", "micro", "ops", "us/op", "host", "ms", "device",
                                "ms", "dev/host", "memory", "GiB"]
    assert [line.split() for line in lines[2:5]] == [
        ["100m", "baseline", "1", "1", "500000.0", "500.0", "999.9", "2.00", "1.5"],
        ["100m", "baseline", "2", "1", "500000.0", "500.0", "1000.0", "2.00*", "3.0"],
        ["100m", "baseline", "4", "1", "500000.0", "500.0", "1000.1", "2.00*", "6.0"]]
    assert len(lines) == 2 + 2 * 2 * 3
    assert asked == [step for preset in ("100m", "1b") for mode in ("baseline", "mhar")
                     for step in [(preset, mode)] + [(preset, mode, b) for b in (1, 2, 4)]]
    assert rows == {(preset, mode, b): (0.5, device[b], b * 2**30 * 1.5) for preset in ("100m", "1b")
                    for mode in ("baseline", "mhar") for b in (1, 2, 4)}


def test_main_prints_the_table_of_the_presets_asked_for(monkeypatch):
    asked = []
    monkeypatch.setattr(bench_step.bench_kernel.kernel, "INTERPRETED", False)
    monkeypatch.setattr(bench_step, "table", lambda presets, batches: asked.append((presets, batches)))
    bench_step.main(["--micro_batches", "3"])
    bench_step.main(["--preset", "1b"])
    assert asked == [(["100m", "350m", "1b"], [3]), (["1b"], [1, 2, 4, 8, 16, 32])]


@pytest.mark.parametrize("error, status, message", [
    (RuntimeError("the stand-in driver needs a C compiler (gcc), as Triton's launcher does"), 1,
     "the stand-in driver needs a C compiler (gcc), as Triton's launcher does"),
    (OSError(28, "No space left on device"), 1, "[Errno 28] No space left on device"),
    (KeyboardInterrupt(), 130, "interrupted (Ctrl-C): what finished is printed above")],
    ids=["no compiler", "a full disk", "Ctrl-C"])
def test_what_stops_the_table_is_one_line(monkeypatch, capsys, error, status, message):
    monkeypatch.setattr(bench_step.bench_kernel.kernel, "INTERPRETED", False)

    def stopped(presets, batches):
        raise error
    monkeypatch.setattr(bench_step, "table", stopped)
    with pytest.raises(SystemExit) as stop:
        bench_step.main([])
    assert stop.value.code == status
    assert capsys.readouterr().err == f"bench_step.py: error: {message}\n"
