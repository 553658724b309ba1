"""gpu_check.py's CPU part: the whole check at tiny shapes (kernels in the Triton interpreter,
compiled configurations traced with aot_eager, the GPU's timings faked), its table's rows and
columns and the arithmetic behind them, its budget's boundary; Ctrl-C in it and in
bench_kernel.py's check, one line and status 130."""
import io
import os
import select
import signal
import subprocess
import sys
import time
from contextlib import redirect_stdout
from types import SimpleNamespace

import pytest
import torch

import bench_kernel
import gpu_check
import train
from bench_kernel import HEADS, traffic
from helpers import (ROOT, error_line, interpreted, interrupted_while_importing,
                     sigint_as_in_a_terminal)


def takes_compile_mode():
    try:
        train.parse_args(["--compile", "--compile_mode", "reduce-overhead"])
        return True
    except SystemExit:
        return False


@pytest.fixture(scope="module")
def check():
    """(rows, verdict, printed) of one tiny run, shared by the tests below: on one thread, tl.sum
    computed directly (as tests/test_kernel.py does: the interpreter's own re-patches the language
    at every call, half the kernels' time)."""
    import triton.language as tl
    printed, threads = io.StringIO(), torch.get_num_threads()
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as patch, redirect_stdout(printed):
        patch.setattr(tl, "sum", lambda x, axis=None, keep_dims=False: tl.reduce(
            x, axis, tl.standard._sum_combine, keep_dims=keep_dims))
        rows, verdict = gpu_check.run_check(tiny=True)
    torch.set_num_threads(threads)
    return rows, verdict, printed.getvalue()


@interpreted
def test_every_path_agrees_with_float64(check):
    _, verdict, printed = check
    assert verdict == "parity: every path within its tolerance", printed
    for dtype in ("float32", "bfloat16"):
        for path in ("readable", "fused", "compiled"):
            assert f"   {dtype:8} {path:15} " in printed


@interpreted
def test_one_row_per_configuration_every_one_measured(check):
    rows, _, printed = check
    assert [(r["shape"], r["config"]) for r in rows] == [("tiny", c) for c in gpu_check.CONFIGS]
    for row in rows:
        if row["config"] == "captured" and not takes_compile_mode():
            assert "does not take" in row["note"]            # until train.py has --compile_mode
            continue
        assert "note" not in row, row
        assert row["tok/s"] > 0 and row["peak GiB"] > 0 and row["first s"] > 0
        compiled = "--compile" in gpu_check.CONFIGS[row["config"]]
        assert (row["graphs"], row["recompiles"]) == ((1, 0) if compiled else (0, 0)), row
    assert rows[0]["x base"] == 1.0


@interpreted
def test_the_table_prints_every_column_and_the_fake_bandwidth_adds_up(check):
    rows, _, printed = check
    table = printed[printed.index("\nThe GPU check: "):].splitlines()
    assert "no GPU: kernel times and bandwidth FAKE" in table[1]
    assert table[2].split() == " ".join(gpu_check.TABLE_COLUMNS).split()
    assert len(table) == 3 + len(rows) + 2 and table[-1].startswith("parity")
    # no GPU: every made-up figure marked "*", every interpreter's pace "~", where it is printed
    cells = {line.split()[1]: line.split() for line in table[3:3 + len(rows)]}
    assert cells["fused"][-4:] == ["0.50*", "1.00*", cells["fused"][-2], cells["fused"][-1]]
    assert cells["fused"][-2].endswith("~") and cells["fused"][-1].endswith("*")
    assert all(cells[c][3].endswith("~") and cells[c][4].endswith("~") for c in ("fused", "captured"))
    assert not any(cells[c][3].endswith(("~", "*")) for c in ("baseline", "readable", "compiled"))
    assert table[-2].startswith("* fake: no GPU measured it") and "~ the kernels in Triton's CPU" in table[-2]
    routing = printed[printed.index("2. routing"):printed.index("3. train.py")].splitlines()
    assert routing[0].endswith("GB/s*") and [c[-1] for c in routing[2].split()[2:]] == ["*", "*", "~", "*", "*"]
    fused = next(r for r in rows if r["config"] == "fused")
    _, d, L, B, T = gpu_check.TINY_ROUTING[0]
    moved = traffic(L, d, HEADS, B * T, 0, source_bytes=2)
    moved = sum(sum(moved[way].values()) for way in ("forward", "backward"))
    clock = gpu_check.FakeClock
    assert fused["kernel ms"] == clock.KERNEL_MS and fused["route ms"] == clock.KERNEL_MS / 2
    assert fused["% copy"] == pytest.approx(100 * moved / (clock.KERNEL_MS / 1e3) / clock.BANDWIDTH)


@pytest.mark.parametrize("column, config, fake, marked", [
    ("kernel ms", "routing", True, "*"), ("% copy", "fused", True, "*"), ("host ms", "routing", True, "~"),
    ("tok/s", "captured", True, "~"), ("x base", "compiled+fused", True, "~"), ("tok/s", "compiled", True, ""),
    ("host ms", "baseline", True, ""), ("peak GiB", "fused", True, ""), ("kernel ms", "routing", False, ""),
    ("tok/s", "fused", False, ""),
], ids=["kernel-fake", "copy-fake", "host-interpreted", "captured-interpreted", "x-base-interpreted",
        "compiled-measured", "baseline-host", "peak-measured", "gpu-kernel", "gpu-fused"])
def test_a_figure_is_marked_where_no_gpu_measured_it(column, config, fake, marked):
    assert gpu_check.mark(column, config, fake) == marked


def test_budget_skips_what_would_end_past_it(monkeypatch):
    budget = gpu_check.Budget(30, enforce=True)
    monkeypatch.setitem(gpu_check.EXPECTED_S, "parity", 25)
    assert budget.fits("parity")
    monkeypatch.setattr(budget, "elapsed", lambda: 10.0)
    assert not budget.fits("parity") and gpu_check.Budget(30, enforce=False).fits("parity")


def test_a_failure_is_a_row_not_the_end_of_the_run():
    def out_of_memory():
        raise torch.OutOfMemoryError("CUDA out of memory")
    assert gpu_check.measured("x", out_of_memory) == "out of memory"
    assert gpu_check.measured("x", lambda: 1 / 0) == "x failed: ZeroDivisionError: division by zero"
    rows, verdict = gpu_check.table([("float32", "fused", [0.1] * 4, False)],
                                    {"1b": "skipped: over the budget"}, {})
    assert rows == [{"shape": "1b", "config": "routing", "note": "skipped: over the budget"}]
    assert verdict == "parity FAILED: float32 fused"


def test_the_plan_fits_five_minutes_with_every_captured_step(capsys):
    """The expected times (docs/kernels.md: how they were estimated) leave the default budget's
    run under five minutes on an H200 with every part but one in it (the 350m compiled readable
    model, run last), the captured steps of both shapes included."""
    rows, total = gpu_check.plan()
    assert total <= 300
    assert [part for part, _, run in rows if not run] == [("350m", "compiled")]
    gpu_check.main(["--plan"])
    assert capsys.readouterr().out.splitlines()[-1].split()[:3] == ["in", "all", str(total)]


@pytest.mark.parametrize("budget, runs", [(25, True), (24, False), (26, True), (0, False)],
                         ids=["equal-runs", "one-less-skips", "one-more-runs", "none"])
def test_a_part_that_ends_exactly_at_the_budget_runs(budget, runs, monkeypatch):
    monkeypatch.setitem(gpu_check.EXPECTED_S, "parity", 25)
    check = gpu_check.Budget(budget, enforce=True)
    monkeypatch.setattr(check, "elapsed", lambda: 0.0)
    assert check.fits("parity") is runs
    monkeypatch.setattr(check, "elapsed", lambda: 7.0)             # later: 7 + 25 against it
    assert check.fits("parity") is (budget >= 32)
    parts, _ = gpu_check.plan(budget)                              # the plan decides alike
    assert parts[0] == ("parity", 25, runs)


@pytest.mark.parametrize("spent, runs", [(22 + 3, True), (22 + 3 - 1, False)],
                         ids=["two-parts-exactly", "one-second-short"])
def test_the_plan_runs_a_part_that_ends_exactly_at_the_budget(spent, runs):
    """parity (22 s) then the 100m routing (3 s): a budget of their sum runs both."""
    parts, _ = gpu_check.plan(spent)
    assert parts[1] == (("routing", "100m"), 3, runs) and parts[0][2] == (spent >= 22)


def test_tokens_per_second_count_every_timed_step_and_no_other(monkeypatch):
    """A stand-in step advances a stand-in clock: the first (compiling) 2 s, each later one 0.25 s.
    Four timed steps of batch 1 x 8 tokens in 1 s: 32 tok/s; the first step's time apart."""
    clock, durations = [0.0], iter([2.0] + [0.25] * 10)

    def step(*args):
        clock[0] += next(durations)
    monkeypatch.setattr(train, "train_step", step)
    monkeypatch.setattr(gpu_check, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    flags = gpu_check.step_config("tiny", "baseline", tiny=True)
    assert flags[flags.index("--batch_size") + 1] == "1"
    assert flags[flags.index("--seq_len") + 1] == "8"
    r = gpu_check.train_steps(flags, gpu_check.FakeClock(), steps=4, warm=2)
    assert r["first s"] == 2.0 and r["tok/s"] == pytest.approx(4 * 1 * 8 / (4 * 0.25))
    assert next(durations) == 0.25 and clock[0] == 2.0 + 6 * 0.25  # 1 + 2 warm + 4 timed


def test_x_base_is_the_row_tokens_per_second_over_the_baseline_s():
    """A row twice as fast as the baseline reads 2.00x, half as fast 0.50x; without a measured
    baseline (skipped, failed) no row has one."""
    def steps(tok_s):
        return {"first s": 1.0, "tok/s": tok_s, "peak GiB": 1.0, "graphs": 0, "recompiles": 0,
                "cudagraph skips": 0}
    stepped = {("100m", "baseline"): steps(1000.0), ("100m", "readable"): steps(500.0),
               ("100m", "fused"): steps(2000.0), ("350m", "baseline"): "skipped: over the budget",
               ("350m", "fused"): steps(700.0)}
    rows, _ = gpu_check.table([], {}, stepped)
    assert [row.get("x base") for row in rows] == [1.0, 0.5, 2.0, None, None]
    assert [gpu_check.cell(row["x base"], "x base") for row in rows[:3]] == ["1.00", "0.50", "2.00"]


def interrupted(*args):
    raise KeyboardInterrupt


@pytest.mark.parametrize("part", ["parity", "routing", "train_steps"])
def test_ctrl_c_in_the_gpu_check_is_one_line_and_status_130(part, monkeypatch, capsys):
    """Each part runs inside measured(), which makes a failure a row of the table: Ctrl-C is not a
    failure, it ends the check (before: 63 lines of traceback)."""
    for name in ("parity", "routing", "train_steps"):
        monkeypatch.setattr(gpu_check, name, interrupted if name == part else
                            (lambda *args: "stand-in: a row"))
    try:
        line = error_line(capsys, gpu_check.main, ["--tiny"], status=130)
    except KeyboardInterrupt:  # escaping, it would stop pytest itself
        pytest.fail("gpu_check.main let the KeyboardInterrupt through")
    assert line == ("gpu_check.py: error: interrupted (Ctrl-C): no table; what finished is "
                    "printed above")


def test_ctrl_c_in_the_kernel_check_is_one_line_and_status_130(monkeypatch, capsys):
    monkeypatch.setattr(bench_kernel, "_check", interrupted)  # the CPU's check, or the GPU's
    try:
        line = error_line(capsys, bench_kernel.main, [], status=130)
    except KeyboardInterrupt:
        pytest.fail("bench_kernel.main let the KeyboardInterrupt through")
    assert line == "bench_kernel.py: error: interrupted (Ctrl-C): what finished is printed above"


@pytest.mark.parametrize("script", ["gpu_check", "bench_kernel"])
def test_ctrl_c_while_a_kernel_script_imports_is_one_line(script, tmp_path):
    """torch and triton take seconds to import; the import of torch is held until the signal."""
    status, _, stderr = interrupted_while_importing([f"{script}.py"], "torch", tmp_path)
    assert status == 130 and stderr == f"{script}.py: error: interrupted (Ctrl-C)\n", stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's check: without a GPU")
@pytest.mark.parametrize("delay", [0.0, 1.0], ids=["as-it-starts", "a-second-in"])
def test_ctrl_c_in_bench_kernels_cpu_check_is_one_line_and_status_130(delay):
    """The real thing, in the Triton interpreter, at two moments after the check has begun."""
    p = subprocess.Popen([sys.executable, "bench_kernel.py"], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, preexec_fn=sigint_as_in_a_terminal,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        assert select.select([p.stdout], [], [], 120)[0], "bench_kernel.py printed nothing"
        assert p.stdout.readline().startswith("no CUDA GPU: checking the kernels")
        time.sleep(delay)
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=60)
    finally:
        p.kill()
        p.wait()
    assert p.returncode == 130, err
    assert err == ("bench_kernel.py: error: interrupted (Ctrl-C): what finished is printed "
                   "above\n"), err
