"""gpu_check.py's CPU part: the whole check at tiny shapes (kernels in the Triton interpreter,
compiled configurations traced with aot_eager, the GPU's timings faked), its table's rows and
columns and the arithmetic behind them."""
import io
from contextlib import redirect_stdout

import pytest
import torch

import gpu_check
import train
from bench_kernel import HEADS, traffic
from helpers import interpreted


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
    assert len(table) == 3 + len(rows) + 1 and table[-1].startswith("parity")
    fused = next(r for r in rows if r["config"] == "fused")
    _, d, L, B, T = gpu_check.TINY_ROUTING[0]
    moved = traffic(L, d, HEADS, B * T, 0, source_bytes=2)
    moved = sum(sum(moved[way].values()) for way in ("forward", "backward"))
    clock = gpu_check.FakeClock
    assert fused["kernel ms"] == clock.KERNEL_MS and fused["route ms"] == clock.KERNEL_MS / 2
    assert fused["% copy"] == pytest.approx(100 * moved / (clock.KERNEL_MS / 1e3) / clock.BANDWIDTH)


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
