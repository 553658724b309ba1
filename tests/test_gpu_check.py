"""gpu_check.py's CPU part: the whole check at tiny shapes (each part in a process of its own, kernels
in the Triton interpreter, compiled configurations traced with aot_eager, the GPU's timings faked), its
table's rows and columns, the files it writes and the arithmetic behind them; its plan and budget; a
part that overruns (killed, with what it started) or crashes is a row and the next part runs; Ctrl-C in
it and in bench_kernel.py's check, one line and status 130; SIGTERM and SIGHUP as Ctrl-C, nothing left
running; an --out that cannot be written, one line and nothing half-written."""
import builtins
import contextlib
import io
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from contextlib import redirect_stdout
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import train
from helpers import (ROOT, error_line, files_in, interpreted, interrupted_while_importing,
                     one_error_line, run_script, script_path, sigint_as_in_a_terminal)
from scripts import bench_kernel, gpu_check
from scripts.bench_kernel import HEADS, traffic


def takes_compile_mode():
    try:
        train.parse_args(["--compile", "--compile_mode", "reduce-overhead"])
        return True
    except SystemExit:
        return False


@pytest.fixture(scope="module")
def check(tmp_path_factory):
    """(rows, verdict, printed, out) of one tiny run, shared by the tests below: each part in a
    process of its own, as on a GPU; out: the folder it wrote its table to."""
    printed, out = io.StringIO(), tmp_path_factory.mktemp("gpu_check")
    with redirect_stdout(printed):
        rows, verdict = gpu_check.run_check("tiny", out=out)
    return rows, verdict, printed.getvalue(), out


@interpreted
def test_every_path_agrees_with_float64(check):
    _, verdict, printed, _ = check
    assert verdict == ("parity: every path within its tolerance; CUDA graphs: as eager (replay, numbers "
                       "tiny)"), printed
    for dtype in ("float32", "bfloat16"):
        for path in ("readable", "fused", "compiled"):
            assert f"   {dtype:8} {path:15} " in printed


@interpreted
def test_one_row_per_configuration_every_one_measured(check):
    """captured+accum included: reduce-overhead's graphs over 4 micro-steps a step (traced with
    aot_eager here, train_step's graph_grads path taken all the same)."""
    rows, _, printed, _ = check
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
    rows, _, printed, _ = check
    table = printed[printed.index("\nThe GPU check: "):printed.index("written: ")].splitlines()
    assert "no GPU: kernel times and bandwidth FAKE" in table[1]
    assert table[2].split() == " ".join(gpu_check.TABLE_COLUMNS).split()
    assert len(table) == 3 + len(rows) + 2 and table[-1].startswith("parity")
    # no GPU: every made-up figure marked "*", every interpreter's pace "~", where it is printed
    cells = {line.split()[1]: line.split() for line in table[3:3 + len(rows)]}
    assert cells["fused"][-4:] == ["0.50*", "1.00*", cells["fused"][-2], cells["fused"][-1]]
    assert cells["fused"][-2].endswith("~") and cells["fused"][-1].endswith("*")
    assert all(cells[c][3].endswith("~") and cells[c][4].endswith("~")
               for c in ("fused", "captured", "captured+accum"))
    assert not any(cells[c][3].endswith(("~", "*")) for c in ("baseline", "readable", "compiled"))
    assert table[-2].startswith("* fake: no GPU measured it") and "~ the kernels in Triton's CPU" in table[-2]
    routing = printed[printed.index("1. routing"):printed.index("2. parity")].splitlines()
    assert routing[0].endswith("GB/s*") and [c[-1] for c in routing[2].split()[2:]] == ["*", "*", "~", "*", "*"]
    fused = next(r for r in rows if r["config"] == "fused")
    _, d, L, B, T = gpu_check.ROUTES["tiny"]
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


def test_budget_skips_what_would_end_past_it_and_kills_at_it(monkeypatch):
    budget = gpu_check.Budget(30, enforce=True)
    assert budget.fits(25) and budget.timeout(10) == pytest.approx(20, abs=0.5)  # 2x its 10 s
    monkeypatch.setattr(budget, "elapsed", lambda: 10.0)
    assert not budget.fits(25) and budget.timeout(15) == 20                # what is left: 20 s
    assert gpu_check.Budget(30, enforce=False).fits(25)
    assert gpu_check.Budget(30, enforce=False).timeout(5) == gpu_check.TINY_TIMEOUT_S


@pytest.mark.parametrize("budget, runs", [(25, True), (24, False), (26, True), (0, False)],
                         ids=["equal-runs", "one-less-skips", "one-more-runs", "none"])
def test_a_part_that_ends_exactly_at_the_budget_runs(budget, runs, monkeypatch):
    check = gpu_check.Budget(budget, enforce=True)
    monkeypatch.setattr(check, "elapsed", lambda: 0.0)
    assert check.fits(25) is runs
    monkeypatch.setattr(check, "elapsed", lambda: 7.0)             # later: 7 + 25 against it
    assert check.fits(25) is (budget >= 32)


@pytest.mark.parametrize("mode, most", [("full", 240), ("quick", 140)])
def test_the_plan_fits_its_minutes_with_every_captured_step(mode, most, capsys):
    """The expected times (docs/kernels.md: how they were estimated), each part's process start
    included, leave the default budget's run within four minutes (--quick: 140 s) on an H200, with
    the captured steps of 100m in it, with and without gradient accumulation, each in a process
    of its own; each part's hard timeout at least its expected seconds, never past the budget."""
    parts, total = gpu_check.plan(mode)
    assert total <= most
    numbers = [["replay"], ["numbers 100m-4L"]]   # the captured numbers next, each part alone
    if mode == "full":  # the kernel timings first, in a part that a later kill cannot cost them
        assert [rows for rows, _, _ in parts[:4]] == [["routing 100m", "routing 350m", "routing 1b"],
                                                      *numbers, ["parity"]]
    else:
        assert [rows for rows, _, _ in parts[:3]] == [*numbers, ["parity"]]
    alone = [rows[0] for rows, _, timeout in parts if len(rows) == 1 and timeout is not None]
    shape = "100m" if mode == "full" else "100m-4L"
    assert {f"{shape} captured", f"{shape} compiled+fused", "replay", "numbers 100m-4L"} <= set(alone)
    assert mode == "quick" or "100m captured+accum" in alone       # --quick's: numbers' step
    assert any({"100m readable", "100m fused"} <= set(rows) for rows, _, t in parts if t)
    start = gpu_check.EXPECTED_S["start"]
    for rows, expected, timeout in parts:
        if timeout is not None:
            assert expected <= timeout <= most - start
            assert timeout == min(gpu_check.timeout_factor(rows) * expected, most - start)
            start += expected
    gpu_check.main(["--plan"] + (["--quick"] if mode == "quick" else []))
    printed = capsys.readouterr().out.splitlines()
    assert printed[-1].split()[:3] == ["in", "all", str(total)]
    assert ("100m captured+accum" if mode == "full" else "numbers 100m-4L") in "\n".join(printed)
    assert len(printed) == 3 + len(parts) + 1


@pytest.mark.parametrize("budget, runs", [(10 + 27 + 14 + 30, True), (10 + 27 + 14 + 30 - 1, False)],
                         ids=["three-parts-exactly", "one-second-short"])
def test_the_plan_runs_a_part_that_ends_exactly_at_the_budget(budget, runs):
    """The start (10 s), the routing (27 s), the replay (14 s) then the captured step's numbers
    (30 s): a budget of their sum runs all three, and gives each part what is left as its timeout
    when that is less than its factor times its expected seconds."""
    parts, _ = gpu_check.plan("full", budget)
    assert [p[1] for p in parts[:3]] == [27, 14, 30] and parts[2][0] == gpu_check.PLANS["full"][2]
    assert parts[0][2] == budget - 10 and parts[1][2] == budget - 10 - 27
    assert parts[2][2] == (budget - 10 - 27 - 14 if runs else None)


@pytest.mark.parametrize("rows, factor", [
    (["parity"], "COLD"), (["routing 100m", "routing 350m"], "COLD"), (["100m captured"], "COLD"),
    (["100m-4L compiled+fused"], "COLD"), (["350m compiled"], "COLD"),
    (["replay"], "COLD"), (["numbers 100m-4L"], "COLD"),
    (["100m baseline", "100m readable", "100m fused"], "TIMEOUT"),
], ids=["parity", "routing", "captured", "compiled-fused", "compiled", "replay", "numbers", "eager"])
def test_a_part_that_compiles_gets_the_cold_factor(rows, factor):
    """A fresh machine's caches are empty: a part that compiles (parity, the routing's kernels, a
    --compile step) is killed later than an eager one, the budget still bounding it (above)."""
    assert gpu_check.COLD_FACTOR > gpu_check.TIMEOUT_FACTOR
    assert gpu_check.timeout_factor(rows) == getattr(gpu_check, f"{factor}_FACTOR")
    assert gpu_check.Budget(1000, enforce=True).timeout(10, gpu_check.timeout_factor(rows)) == \
        pytest.approx(10 * getattr(gpu_check, f"{factor}_FACTOR"), abs=0.5)


@pytest.mark.parametrize("mode, flag", [("quick", "--quick"), ("tiny", "--tiny"), ("full", None)])
def test_every_part_runs_in_its_mode(mode, flag, monkeypatch, tmp_path, capsys):
    """The command line of every part the check starts (its rows, its JSON file) names the check's
    mode: --quick's parts time --quick's steps, not the full check's."""
    commands = []

    def run_process(command, timeout):
        commands.append(command)
        return 0, ""
    monkeypatch.setattr(gpu_check, "run_process", run_process)
    gpu_check.run_check(mode, budget=1e6, out=tmp_path)             # every part starts
    assert [c[c.index("--part") + 1:c.index("--json")] for c in commands] == gpu_check.PLANS[mode]
    for command in commands:
        assert command[:3] == [sys.executable, "-m", "scripts.gpu_check"]
        modes = [a for a in command if a in ("--quick", "--tiny")]
        assert modes == ([flag] if flag else []), command


@pytest.mark.parametrize("config, micro", [("baseline", 1), ("captured+accum", 4)])
def test_tokens_per_second_count_every_timed_step_and_no_other(config, micro, monkeypatch):
    """A stand-in step advances a stand-in clock: the first (compiling) 2 s, each later one 0.25 s.
    Four timed steps of batch 1 x 8 tokens in 1 s: 32 tok/s, 4x that with 4 micro-steps a step;
    the first step's time apart."""
    clock, durations = [0.0], iter([2.0] + [0.25] * 10)

    def step(*args):
        clock[0] += next(durations)
    monkeypatch.setattr(train, "train_step", step)
    monkeypatch.setattr(gpu_check, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    flags = gpu_check.step_config("tiny", config)
    assert flags[flags.index("--batch_size") + 1] == "1"
    assert flags[flags.index("--seq_len") + 1] == "8"
    assert flags.count("--grad_accum") == 1 and flags[flags.index("--grad_accum") + 1] == str(micro)
    r = gpu_check.train_steps(flags, gpu_check.FakeClock(), steps=4, warm=2)
    assert r["first s"] == 2.0 and r["tok/s"] == pytest.approx(micro * 4 * 1 * 8 / (4 * 0.25))
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


def alive(pid):
    """Whether process `pid` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        return " Z " not in Path(f"/proc/{pid}/stat").read_text().split(")")[-1][:4]
    except FileNotFoundError:
        return False


def sleeper(pids):
    """A part's stand-in that prints a line, starts a process of its own (as inductor's compile
    workers), writes both ids to `pids` and sleeps."""
    return [sys.executable, "-c", "import subprocess, sys, time; print('asleep'); "
            "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            f"open({str(pids)!r}, 'w').write(f'{{child.pid}}'); time.sleep(60)"]


def writer(rows, path):
    """A part's stand-in that writes a measured row for each of `rows`."""
    r = {"first s": 1.0, "tok/s": 100.0, "peak GiB": 1.0, "graphs": 0, "recompiles": 0,
         "cudagraph skips": 0}
    return [sys.executable, "-c", f"import json; json.dump({dict.fromkeys(rows, r)!r}, "
            f"open({str(path)!r}, 'w'))"]


def two_parts(monkeypatch, first):
    """The tiny check cut to two parts, tiny baseline then tiny readable, the first run by the
    command `first` with a timeout of 1 s, the second writing its row."""
    monkeypatch.setitem(gpu_check.PLANS, "tiny", [["tiny baseline"], ["tiny readable"]])
    monkeypatch.setattr(gpu_check, "TINY_TIMEOUT_S", 1)
    monkeypatch.setattr(gpu_check, "part_command", lambda rows, mode, path: (
        first if rows == ["tiny baseline"] else writer(rows, path)))


def test_a_part_that_overruns_is_killed_and_the_next_still_runs(monkeypatch, tmp_path, capsys):
    """Killed at its timeout with the processes it started; its row says so; what it printed
    came through; the next part runs, and the table is written."""
    two_parts(monkeypatch, sleeper(tmp_path / "pids"))
    start = time.perf_counter()
    rows, verdict = gpu_check.run_check("tiny", out=tmp_path)
    assert time.perf_counter() - start < 20
    assert rows[0] == {"shape": "tiny", "config": "baseline", "note": "timed out after 1 s"}
    assert rows[1]["config"] == "readable" and rows[1]["tok/s"] == 100.0 and verdict == "parity: not run"
    printed = capsys.readouterr().out
    assert "asleep\n" in printed and "   tiny    baseline        timed out after 1 s\n" in printed
    assert not alive(int((tmp_path / "pids").read_text()))
    assert json.loads((tmp_path / "tiny.json").read_text())["rows"] == rows


@pytest.mark.parametrize("code, why", [
    ("raise RuntimeError('CUDA error: an illegal memory access was encountered')",
     "crashed: exit status 1: RuntimeError: CUDA error: an illegal memory access was encountered"),
    ("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)", "crashed: killed by SIGSEGV"),
], ids=["exception", "signal"])
def test_a_part_that_crashes_is_a_row_with_its_error(code, why, monkeypatch, tmp_path, capsys):
    two_parts(monkeypatch, [sys.executable, "-c", code])
    rows, _ = gpu_check.run_check("tiny", out=tmp_path)
    assert rows[0]["note"] == why and rows[1]["tok/s"] == 100.0
    assert why in (tmp_path / "tiny.md").read_text()


def test_a_part_writes_each_row_as_it_ends_and_flushes_each_line(tmp_path):
    """A part's process, killed once its first row is printed: the line came at once (stdout a
    pipe), and the row is in its JSON file."""
    path = tmp_path / "part.json"
    p = subprocess.Popen([sys.executable, "-m", "scripts.gpu_check", "--tiny", "--part", "tiny baseline",
                          "tiny readable", "--json", str(path)], cwd=ROOT, stdout=subprocess.PIPE,
                         text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        assert select.select([p.stdout], [], [], 120)[0], "the part printed nothing"
        line = p.stdout.readline()
        p.kill()
    finally:
        p.kill()
        p.wait()
    assert line.split()[:2] == ["tiny", "baseline"]
    assert list(json.loads(path.read_text())) == ["tiny baseline"]


@interpreted
def test_the_tiny_check_writes_its_table_as_markdown_and_json(check):
    rows, verdict, _, out = check
    found = json.loads((out / "tiny.json").read_text())
    assert found["rows"] == json.loads(json.dumps(rows)) and found["verdict"] == verdict
    assert found["device"] == "no GPU (CPU, interpreter)" and found["torch"] == torch.__version__
    md = (out / "tiny.md").read_text().splitlines()
    assert md[0].startswith("# The GPU check (tiny): no GPU (CPU, interpreter), torch ")
    table = [line.split(" | ") for line in md if line.startswith("| tiny")]
    assert [line[1] for line in table] == [row["config"] for row in rows] == list(gpu_check.CONFIGS)
    assert "| float32 | fused |" in "\n".join(md) and md[-1].startswith(verdict)
    assert "4. CUDA graphs: the fused chain replayed on 2 new inputs: bit for bit as eager" in md
    assert list(found["numbers"]) == ["replay", "numbers tiny"]
    assert found["numbers"]["numbers tiny"]["ok"] and found["numbers"]["numbers tiny"]["batch diff"] > 0.1


@pytest.mark.parametrize("argv, says", [
    (["--out", "{file}"], "is a file"), (["--out", "{file}/table"], "is a file, not a folder"),
    (["--tiny", "--quick"], "neither"),
    (["--tiny", "--plan"], "neither"), (["--part", "parity"], "--json"),
    (["--budget", "-1"], "--budget"), (["--quick", "--budget", "x"], "--budget"),
    (["--budget", "inf"], "--budget: must be a finite number of seconds >= 0, not inf"),
], ids=["out-a-file", "out-under-a-file", "tiny-quick", "tiny-plan", "part-no-json", "negative-budget",
        "budget-nan", "budget-inf"])
def test_a_bad_flag_is_one_line_and_status_2(argv, says, capsys, tmp_path):
    (tmp_path / "a file").write_text("")
    argv = [a.format(file=tmp_path / "a file") for a in argv]
    assert says in error_line(capsys, gpu_check.main, argv)


def test_ctrl_c_in_the_gpu_check_is_one_line_and_status_130(monkeypatch, capsys, tmp_path):
    """Ctrl-C while a part runs kills it (and what it started) and ends the check: one line."""
    two_parts(monkeypatch, sleeper(tmp_path / "pids"))
    monkeypatch.setattr(gpu_check, "TINY_TIMEOUT_S", 60)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(3, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    try:
        line = error_line(capsys, gpu_check.main, ["--tiny", "--out", tmp_path], status=130)
    except KeyboardInterrupt:  # escaping, it would stop pytest itself
        pytest.fail("gpu_check.main let the KeyboardInterrupt through")
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, previous)
    assert line == ("gpu_check.py: error: interrupted (Ctrl-C): what finished is printed above and "
                    f"written to {tmp_path}")
    assert not alive(int((tmp_path / "pids").read_text()))
    assert json.loads((tmp_path / "tiny.json").read_text())["rows"][0]["note"] == "stopped by Ctrl-C"


def parts_running(folder):
    """{pid: command line} of every live process of a check's part (`--part`) whose command line names
    `folder` (its JSON file lies in a temporary folder there: the check run with TMPDIR=folder)."""
    found = {}
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            line = cmdline.read_bytes().replace(b"\0", b" ").decode()
        except OSError:  # ended meanwhile
            continue
        if "--part" in line and str(folder) in line and alive(int(cmdline.parent.name)):
            found[int(cmdline.parent.name)] = line
    return found


def stop_signals_at_default():
    """preexec_fn of a child that a test stops with SIGINT, SIGTERM or SIGHUP, as a terminal, `timeout`
    or a closed terminal would: each at its default (a suite run under nohup ignores SIGHUP)."""
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_DFL)


@pytest.mark.parametrize("signum, during", [(signal.SIGTERM, "tiny baseline"), (signal.SIGHUP, "routing tiny")],
                         ids=["sigterm-in-the-second-part", "sighup-in-the-first"])
def test_a_terminate_or_hangup_signal_stops_the_check_as_ctrl_c_does(signum, during, tmp_path):
    """`timeout -s TERM 25 python -m scripts.gpu_check --tiny` (or the terminal closed) while the part
    with the row `during` runs: the part is killed, nothing of the check is left running; the table of
    what finished is written (the first part's rows, when the second is stopped); one line, exit status
    128 + the signal's number."""
    out, name = tmp_path / "out", signal.Signals(signum).name
    p = subprocess.Popen([sys.executable, "-m", "scripts.gpu_check", "--tiny", "--out", str(out)], cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=stop_signals_at_default,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path)})
    try:
        deadline = time.time() + 240
        while not any(during in line for line in parts_running(tmp_path).values()):
            assert p.poll() is None and time.time() < deadline, p.communicate()
            time.sleep(0.05)
        p.send_signal(signum)
        printed, err = p.communicate(timeout=60)
        left = parts_running(tmp_path)
    finally:
        p.kill()
        p.wait()
        for pid in parts_running(tmp_path):  # what a stop that does not kill its part leaves
            os.kill(pid, signal.SIGKILL)
    assert not left, left
    assert p.returncode == 128 + signum, err
    assert err == (f"gpu_check.py: error: stopped by {name}: what finished is printed above and "
                   f"written to {out}\n")
    found = json.loads((out / "tiny.json").read_text())
    notes = {row["config"]: row.get("note") for row in found["rows"]}
    if during == "tiny baseline":                # the first part, routing and parity, finished
        assert notes == {"baseline": f"stopped by {name}", "readable": f"stopped by {name}",
                         "fused": f"stopped by {name}", "compiled+fused": f"stopped by {name}",
                         "compiled": f"stopped by {name}"}
        assert found["verdict"] == ("parity: every path within its tolerance; CUDA graphs: not run "
                                    "(replay, numbers tiny)"), found
    else:
        assert notes == {"routing": f"stopped by {name}"}
        assert found["verdict"] == f"parity not run: stopped by {name}; CUDA graphs: not run (replay, numbers tiny)"
    assert f"{found['verdict']}; " in (out / "tiny.md").read_text() and "written: " in printed


def test_a_disk_that_fills_during_the_check_leaves_no_half_written_table(monkeypatch, capsys, tmp_path):
    """The folder took the probe's file, then the disk filled: the table's files are written whole or
    not at all (no 0-byte tiny.md); one line, status 1."""
    two_parts(monkeypatch, [sys.executable, "-c", "pass"])
    open_ = io.open

    def full(file, mode="r", *args, **kwargs):  # as tests/helpers.py's FAULTS: created, its bytes lost
        if str(file).startswith(str(tmp_path)) and set(mode) & set("wax+"):
            open_(file, mode, *args, **kwargs).close()
            return open_("/dev/full", "wb" if "b" in mode else "w", *args, **kwargs)
        return open_(file, mode, *args, **kwargs)
    monkeypatch.setattr(gpu_check, "writable", lambda out: out.mkdir(parents=True, exist_ok=True))
    monkeypatch.setattr(builtins, "open", full)
    monkeypatch.setattr(io, "open", full)
    line = error_line(capsys, gpu_check.main, ["--tiny", "--out", tmp_path / "gc"], status=1)
    assert line.startswith(f"gpu_check.py: error: could not write {tmp_path / 'gc' / 'tiny.md'} (No space ")
    assert files_in(tmp_path) == ["gc"]


@pytest.mark.parametrize("fault, existing, says", [
    ("read-only", False, "cannot make --out {out} (Read-only file system)"),
    ("read-only", True, "could not write {out}/.gpu_check-probe (Read-only file system"),
    ("full", False, "could not write {out}/.gpu_check-probe (No space left on device"),
], ids=["read-only", "read-only-existing", "full-disk"])
def test_an_out_that_cannot_be_written_is_one_line_before_any_part_runs(fault, existing, says, tmp_path):
    """A read-only folder or a full disk: one line, status 1, before the check's minutes are spent;
    nothing written."""
    out = tmp_path / "gc"
    if existing:
        out.mkdir()
    p = run_script("scripts/gpu_check.py", "--tiny", "--out", out, fault=fault, under=tmp_path)
    assert says.format(out=out) in one_error_line(p, "gpu_check.py", 1)
    assert "GPU check" not in p.stdout and files_in(out) == []


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
    status, _, stderr = interrupted_while_importing([script_path(script)], "torch", tmp_path)
    assert status == 130 and stderr == f"{script}.py: error: interrupted (Ctrl-C)\n", stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's check: without a GPU")
@pytest.mark.parametrize("delay", [0.0, 1.0], ids=["as-it-starts", "a-second-in"])
def test_ctrl_c_in_bench_kernels_cpu_check_is_one_line_and_status_130(delay):
    """The real thing, in the Triton interpreter, at two moments after the check has begun."""
    p = subprocess.Popen([sys.executable, "-m", "scripts.bench_kernel"], cwd=ROOT, stdout=subprocess.PIPE,
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


@pytest.mark.parametrize("config", list(gpu_check.CONFIGS))
@pytest.mark.parametrize("shape", ["100m", "350m", "100m-4L", "tiny"])
def test_every_configuration_of_a_shape_steps_at_the_readable_paths_micro_batch(shape, config):
    """The plan's rows compare configurations at one micro-batch, train.py's batch_size, although
    the baseline and --fused alone would take lean_batch_size; every row's shape has its flags."""
    import train
    shapes = {row.split(" ", 1)[0] for parts in gpu_check.PLANS.values() for rows in parts
              for row in rows if row.split(" ", 1)[-1] in gpu_check.CONFIGS}
    assert shapes == {"tiny", "100m", "350m", "100m-4L"}       # each with its flags, below
    args = train.parse_args(gpu_check.step_config(shape, config))[0]
    train.fill_run_sizes(args, 1)
    assert args.batch_size == (1 if shape == "tiny" else train.RUNS[args.preset]["batch_size"])


# %% Numbers under CUDA graphs: the checks fail on what they are for

def test_a_captured_step_that_reads_a_stale_batch_fails_the_numbers(monkeypatch):
    """A replay that reads the first step's batch where the step gives a new one (a stale input
    address) errs in the gradients by about as much as two batches' gradients differ: not ok."""
    real, first, calls = train.train_step, [], [0]

    def stale(model, optimizer, xs, ys, *rest):
        calls[0] += 1
        first.append((xs, ys)) if not first else None
        if calls[0] % 2 == 0:        # the captured run's step (recorded_step: eager first)
            xs, ys = first[0]
        return real(model, optimizer, xs, ys, *rest)
    monkeypatch.setattr(train, "train_step", stale)
    try:
        with gpu_check.compile_backend("eager"):
            r = gpu_check.captured_numbers("tiny")
    finally:  # dynamo's caches hold this model's graphs: a later test compiling the same code would count them
        torch._dynamo.reset()
    assert calls[0] == 2 * gpu_check.NUMBERS_STEPS
    assert r["grad err"] > gpu_check.NUMBERS_FRACTION * r["batch diff"] > 0 and not r["ok"], r


@pytest.mark.parametrize("changed, ok", [
    ({}, True), ({"grad err": 0.1 * 0.5}, True), ({"grad err": 0.1 * 0.5 * (1 + 1e-9)}, False),
    ({"loss err": 1e-2}, True), ({"loss err": 1.01e-2}, False), ({"eval err": 1.01e-2}, False),
    ({"cudagraph skips": 1}, False), ({"batch diff": 0.0, "grad err": 0.0}, True),
], ids=["all-zero", "gradients-at-the-bound", "gradients-just-over", "loss-at-the-bound",
        "loss-just-over", "evaluation-just-over", "one-cudagraph-skip", "one-batch-no-error"])
def test_the_numbers_pass_within_their_bounds_and_no_further(changed, ok):
    assert (gpu_check.NUMBERS_FRACTION, gpu_check.LOSS_TOLERANCE) == (0.1, 1e-2)
    r = {"loss err": 0.0, "grad err": 0.0, "eval err": 0.0, "batch diff": 0.5, "cudagraph skips": 0, **changed}
    assert gpu_check.numbers_ok(r) is ok


@interpreted
def test_a_replay_that_does_not_recompute_is_not_bitwise(monkeypatch):
    """The stand-in of a graph whose replay leaves the first inputs' outputs in place (a kernel that
    reads a stale address): the replayed chain is not bit for bit eager's; the real stand-in is."""
    shape = gpu_check.PARITY["tiny"]
    assert gpu_check.replayed_chain(shape, "cpu") == {"replays": 2, "bitwise": True, "max diff": 0.0, "ok": True}

    class Stale:
        def __init__(self, fn, device):
            fn()
            self.replay = lambda: None
    monkeypatch.setattr(gpu_check, "Replay", Stale)
    r = gpu_check.replayed_chain(shape, "cpu")
    assert not r["bitwise"] and not r["ok"] and r["max diff"] > 1e-2, r


@pytest.mark.parametrize("results, verdict", [
    ({"replay": {"ok": True}, "numbers tiny": {"ok": True}}, "CUDA graphs: as eager (replay, numbers tiny)"),
    ({"replay": {"ok": False}, "numbers tiny": {"ok": True}}, "CUDA graphs FAILED: replay"),
    ({"replay": {"ok": True}, "numbers tiny": "numbers failed: RuntimeError: x"},
     "CUDA graphs FAILED: numbers tiny"),
    ({"replay": "timed out after 56 s"}, "CUDA graphs FAILED: replay"),
    ({"replay": {"ok": True}, "numbers 100m-4L": "skipped: over the budget"},
     "CUDA graphs: not run (numbers 100m-4L)"),
    ({"replay": "stopped by SIGTERM"}, "CUDA graphs: not run (replay)"),
    ({}, None),
], ids=["both-ok", "replay-differs", "numbers-crashed", "timed-out", "skipped", "stopped", "none-planned"])
def test_the_numbers_verdict_fails_on_any_failure_and_says_what_did_not_run(results, verdict):
    assert gpu_check.numbers_verdict(results) == verdict


def test_a_replay_on_a_gpu_warms_up_on_a_side_stream_then_captures_once(monkeypatch):
    """Replay's CUDA branch with torch.cuda's stream and graph calls faked (no GPU here): three
    warm-up calls on a side stream that waits for the current one (they compile and bind the kernels
    outside the capture), the current stream waiting for them, then one call inside the capture;
    replay is the graph's own."""
    events = []

    class Stream:
        def __init__(self, name="side"):
            self.name = name

        def wait_stream(self, other):
            events.append(f"{self.name} waits for {other.name}")

    @contextlib.contextmanager
    def inside(what):
        events.append(f"enter {what}")
        yield
        events.append(f"leave {what}")

    class CUDAGraph:
        def replay(self):
            events.append("replay")
    current = Stream("current")
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: current)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: inside(f"{s.name} stream"))
    monkeypatch.setattr(torch.cuda, "CUDAGraph", CUDAGraph)
    monkeypatch.setattr(torch.cuda, "graph", lambda g: inside("capture"))
    graph = gpu_check.Replay(lambda: events.append("call"), "cuda")
    assert events == ["side waits for current", "enter side stream", "call", "call", "call",
                      "leave side stream", "current waits for side", "enter capture", "call", "leave capture"]
    graph.replay()
    assert events[-1] == "replay" and len(events) == 11
