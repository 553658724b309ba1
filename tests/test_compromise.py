"""compromise.py: the task's targets, the frozen codes and their rotation, the frozen embedding
through training, the table's paired statistics, a tiny run end to end (in this process and on
two workers, which must agree), bad flags, an --out_dir that cannot be written, and the stop
signals (Ctrl-C, SIGTERM) with the workers they must end."""
import errno
import io
import json
import math
import multiprocessing
import os
import select
import signal
import statistics
import subprocess
import sys
import time
import warnings
from contextlib import suppress
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lib.common import duration
from helpers import (PNG_SIGNATURE, ROOT, error_line, files_in, interrupted_while_importing,
                     sigint_as_in_a_terminal)
from scripts import compromise


@pytest.mark.parametrize("n", [1, 7], ids=["one-sequence", "seven-sequences"])
def test_the_target_keeps_a_and_fetches_b_from_two_tokens_back(n):
    idx, targets = compromise.batch(torch.Generator().manual_seed(0), n)
    assert idx.shape == targets.shape == (n, compromise.SEQ_LEN)
    assert idx.min() >= 0 and idx.max() < compromise.VOCAB
    for row, target in zip(idx.tolist(), targets.tolist()):
        assert target[:2] == [compromise.IGNORE] * 2       # nothing to fetch two tokens back
        for t in range(2, len(row)):
            assert target[t] == (row[t] // 16) * 16 + row[t - 2] % 16


@pytest.mark.parametrize("d", [32, 64], ids=["d32", "d64"])
def test_the_codes_put_a_in_the_first_half_and_b_in_the_second(d):
    U, W = compromise.half_codes(d, seed=0)
    e = compromise.codes(d, seed=0)
    assert U.shape == W.shape == (16, d // 2) and e.shape == (256, d)
    identity = torch.eye(16)
    torch.testing.assert_close(U @ U.T, identity, atol=1e-5, rtol=0)   # orthonormal rows
    torch.testing.assert_close(W @ W.T, identity, atol=1e-5, rtol=0)
    for a in range(16):
        for b in range(16):
            assert torch.equal(e[a * 16 + b], torch.cat([U[a], W[b]]))  # e(a, b) = [U_a ; W_b]
    pairs = e.view(16, 16, d)                                           # (a, b, d)
    assert torch.equal(pairs[:, :, :d // 2], pairs[:, :1, :d // 2].expand(16, 16, d // 2))  # no b
    assert torch.equal(pairs[:, :, d // 2:], pairs[:1, :, d // 2:].expand(16, 16, d // 2))  # no a
    assert not torch.equal(compromise.codes(d, seed=1), e)             # each seed its own codes


@pytest.mark.parametrize("d", [32, 64], ids=["d32", "d64"])
def test_the_rotation_is_orthogonal_and_rotates_the_same_codes(d):
    R = compromise.rotation(d, seed=0)
    torch.testing.assert_close(R @ R.T, torch.eye(d), atol=1e-5, rtol=0)
    e, rotated = compromise.codes(d, seed=0), compromise.codes(d, seed=0, rotated=True)
    assert torch.equal(rotated, e @ R)
    torch.testing.assert_close(rotated.norm(dim=1), e.norm(dim=1), atol=1e-5, rtol=0)
    torch.testing.assert_close(rotated @ rotated.T, e @ e.T, atol=1e-5, rtol=0)
    pairs = rotated.view(16, 16, d)  # the halves mix: the first half now depends on b too
    assert (pairs[:, :, :d // 2] - pairs[:, :1, :d // 2]).abs().max() > 0.1


@pytest.mark.parametrize("method", list(compromise.METHODS))
def test_training_leaves_the_frozen_embedding_and_its_tied_head_alone(method):
    net = compromise.model(method, d=32, heads=2, seed=0)
    codes = compromise.codes(32, seed=0, rotated=compromise.METHODS[method][1])
    assert torch.equal(net.embed.weight, codes) and net.lm_head.weight is net.embed.weight
    before = {name: p.detach().clone() for name, p in net.named_parameters()}
    compromise.fit(net, seed=0, steps=3)
    assert torch.equal(net.embed.weight, codes)
    moved = [name for name, p in net.named_parameters() if not torch.equal(p, before[name])]
    assert "layers.0.q_proj.weight" in moved and "embed.weight" not in moved


def test_the_temperature_control_is_attnres_with_its_logits_divided_by_h():
    """attnres-tau routes as AttnRes whose queries are divided by H: the same logits as attnres once its
    queries are H times smaller (its alphas at nonzero queries, against the plain model's)."""
    tau_net, plain = compromise.model("attnres-tau", 32, 4, 0), compromise.model("attnres", 32, 4, 0)
    assert (tau_net.config.route_temperature, plain.config.route_temperature) == (4.0, 1.0)
    with torch.no_grad():
        for a, b in zip(tau_net.sites, plain.sites):
            a.query.normal_(0, 1)
            b.query.copy_(a.query / 4)
    idx = compromise.batch(torch.Generator().manual_seed(0), 2)[0]
    for a, b in zip(tau_net.routing_weights(idx), plain.routing_weights(idx)):
        torch.testing.assert_close(a, b)


def test_every_method_of_a_seed_starts_from_the_same_weights_and_sees_the_same_batches(
        monkeypatch):
    nets = {m: compromise.model(m, d=32, heads=2, seed=0) for m in compromise.METHODS}
    shared = {k: v for k, v in nets["baseline"].state_dict().items()
              if k not in ("embed.weight", "lm_head.weight")}                  # the codes
    for method, net in nets.items():
        state = net.state_dict()
        assert all(torch.equal(state[k], v) for k, v in shared.items()), method
    other = compromise.model("baseline", d=32, heads=2, seed=1).state_dict()
    assert not torch.equal(other["layers.0.q_proj.weight"], shared["layers.0.q_proj.weight"])
    seen, draw = {}, compromise.batch

    def recording(generator, n):
        idx, targets = draw(generator, n)
        seen.setdefault(method, []).append(idx)
        return idx, targets
    monkeypatch.setattr(compromise, "batch", recording)
    for method in ("attnres", "mhar-rotated"):
        compromise.fit(nets[method], seed=0, steps=2)
    assert len(seen["attnres"]) == 2
    assert all(torch.equal(a, b) for a, b in zip(seen["attnres"], seen["mhar-rotated"]))


def test_paired_differences_and_their_standard_error():
    def runs(losses):
        return {seed: {"val_loss": loss} for seed, loss in enumerate(losses)}
    diff, se, ratio = compromise.paired(runs([1.0, 2.0, 4.0]), runs([2.0, 2.0, 3.0]))
    assert diff == pytest.approx(0.0)                           # differences -1, 0, +1
    assert se == pytest.approx(1 / math.sqrt(3))               # sample std 1, over sqrt(3)
    assert ratio == pytest.approx(1.0)                          # 7 over 7
    diff, se, ratio = compromise.paired(runs([1.0]), runs([4.0]))
    assert diff == -3.0 and math.isnan(se) and ratio == 0.25


@pytest.mark.parametrize("method, residual, rotated, temperature", [
    ("baseline", "baseline", False, 1.0), ("attnres", "attnres", False, 1.0),
    ("attnres-tau", "attnres", False, 2.0), ("mhar", "mhar", False, 1.0),
    ("attnres-rotated", "attnres", True, 1.0), ("mhar-rotated", "mhar", True, 1.0),
], ids=["baseline", "attnres", "attnres-tau", "mhar", "attnres-rotated", "mhar-rotated"])
def test_each_method_is_built_on_the_codes_and_routing_it_names(method, residual, rotated,
                                                               temperature):
    """Written out, not read from METHODS: a control on the wrong codes (a rotated method on the
    aligned ones) would compare nothing with nothing, and no other test would notice."""
    net = compromise.model(method, d=32, heads=2, seed=0)
    assert torch.equal(net.embed.weight, compromise.codes(32, seed=0, rotated=rotated))
    assert not torch.equal(net.embed.weight, compromise.codes(32, seed=0, rotated=not rotated))
    assert net.config.residual == residual and net.config.route_temperature == temperature
    assert net.config.depth_heads == {"baseline": 0, "attnres": 1, "mhar": 2}[residual]


def test_the_paired_statistics_use_only_the_seeds_both_methods_ran():
    """runs has seeds 0, 1, 2 and the reference 1, 2, 3: only 1 and 2 are pairs. Over every seed
    of each, the ratio would be 6.5 / 10 and the difference meaningless."""
    runs = {0: {"val_loss": 4.0}, 1: {"val_loss": 1.0}, 2: {"val_loss": 1.5}}
    reference = {1: {"val_loss": 2.0}, 2: {"val_loss": 2.5}, 3: {"val_loss": 5.5}}
    diff, se, ratio = compromise.paired(runs, reference)
    assert ratio == pytest.approx(2.5 / 4.5)                   # (1 + 1.5) / (2 + 2.5)
    assert diff == pytest.approx(-1.0)                         # differences -1, -1
    assert se == pytest.approx(0.0)
    diff, se, ratio = compromise.paired(runs, {2: {"val_loss": 3.0}, 5: {"val_loss": 1.0}})
    assert (diff, ratio) == (pytest.approx(-1.5), pytest.approx(0.5)) and math.isnan(se)


@pytest.mark.parametrize("step, steps, factor", [
    (0, 250, 1 / 30), (1, 250, 2 / 30), (28, 250, 29 / 30), (29, 250, 1.0), (30, 250, 1.0),
    (249, 250, 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 219 / 220))), (250, 250, 0.1),
    (0, 3, 1 / 30), (2, 3, 3 / 30),
], ids=["first-step", "second-step", "warmup-one-before-last", "warmup-last", "peak",
        "last-step", "past-the-end", "short-run-first", "short-run-last"])
def test_the_learning_rate_warms_up_from_its_first_step_then_decays_to_a_tenth(step, steps,
                                                                              factor):
    schedule = compromise.lr_factor(step, compromise.WARMUP, steps, compromise.MIN_LR_RATIO)
    assert schedule == pytest.approx(factor)


def test_the_first_update_is_taken_at_a_nonzero_learning_rate(monkeypatch):
    """An update at lr 0 is a step lost: fit sets each step's lr before the update."""
    seen, make = [], compromise.adamw

    def recording(*args, **kwargs):
        opt = make(*args, **kwargs)
        update = opt.step

        def step(*a, **k):
            seen.append([group["lr"] for group in opt.param_groups])
            return update(*a, **k)
        opt.step = step
        return opt
    monkeypatch.setattr(compromise, "adamw", recording)
    compromise.fit(compromise.model("mhar", d=32, heads=2, seed=0), seed=0, steps=2)
    groups = len(seen[0])                                 # every group at the same lr
    assert seen == [[pytest.approx(compromise.LR / 30)] * groups,
                    [pytest.approx(2 * compromise.LR / 30)] * groups]


def test_the_mean_alpha_is_over_the_scored_positions_of_every_sequence():
    """α (N_j, B, T, H) of a stand-in model: the first LAG positions, not scored, hold 100; a mean
    that kept them, or that cut sequences instead of positions, would not be 0.5 + ... below."""
    N, B, T, H, lag = 2, 3, 6, 2, compromise.LAG
    alpha = torch.arange(N * B * T * H, dtype=torch.float64).view(N, B, T, H) / 1000
    alpha[:, :, :lag] = 100.0
    net = SimpleNamespace(config=SimpleNamespace(routed=True), routing_weights=lambda idx: [alpha])
    expected = [[sum(alpha[n, b, t, h].item() for b in range(B) for t in range(lag, T))
                 / (B * (T - lag)) for h in range(H)] for n in range(N)]
    torch.testing.assert_close(torch.tensor(compromise.mean_alphas(net, None)),
                               torch.tensor([expected]), rtol=1e-12, atol=0)
    assert max(max(row) for row in expected) < 1                   # no 100 got in
    baseline = SimpleNamespace(config=SimpleNamespace(routed=False))
    assert compromise.mean_alphas(baseline, None) is None


def tiny_run(out, capsys, seeds, jobs):
    compromise.main(["--steps", "3", "--seeds", seeds, "--d", "32", "--out_dir", str(out),
                     "--jobs", str(jobs)])
    return json.loads((out / "results.json").read_text())["runs"], capsys.readouterr().out


def test_a_tiny_run_writes_every_method_and_its_alphas_the_same_on_two_workers(tmp_path, capsys):
    out = tmp_path / "out"
    runs, printed = tiny_run(out, capsys, seeds="0,1", jobs=1)
    assert [(r["method"], r["seed"]) for r in runs] == [
        (m, s) for s in (0, 1) for m in compromise.METHODS]
    for r in runs:
        assert r["d"] == 32 and r["steps"] == 3 and 0 <= r["val_accuracy"] <= 1
        assert r["curve"] == [[3, pytest.approx(r["val_loss"])]]
        if r["method"] == "baseline":
            assert r["alphas"] is None and r["heads"] == 0
            continue
        H = 1 if r["method"].startswith("attnres") else 2
        assert r["heads"] == H and len(r["alphas"]) == 5              # 2L + 1 sites
        for j, site in enumerate(r["alphas"]):                        # site j reads s_0..s_j
            assert len(site) == j + 1 and all(len(source) == H for source in site)
            for h in range(H):
                assert sum(source[h] for source in site) == pytest.approx(1, abs=1e-5)
    table = printed.split("method ")[1].splitlines()[1:8]  # mhar's second reference: a line of its own
    assert [line.split()[0] for line in table if not line.startswith(" ")] == list(compromise.METHODS)
    assert table[3].startswith("mhar ") and "vs attnres " in table[3] and "vs attnres-tau" in table[4]
    assert "vs attnres-rotated" in table[6] and "(the reference)" in table[1]
    assert (out / "depth_maps.png").read_bytes()[:8] == PNG_SIGNATURE
    assert files_in(out) == ["depth_maps.png", "results.json"]
    pooled, _ = tiny_run(tmp_path / "pooled", capsys, seeds="1", jobs=2)  # seed 1 on its own
    assert [(r["val_loss"], r["alphas"]) for r in pooled] == \
        [(r["val_loss"], r["alphas"]) for r in runs if r["seed"] == 1]


def test_without_matplotlib_the_results_are_written_and_the_figure_named(tmp_path, capsys,
                                                                         monkeypatch):
    monkeypatch.setattr(compromise, "pyplot", lambda: None)
    out = tmp_path / "out"
    runs, printed = tiny_run(out, capsys, seeds="0", jobs=1)
    assert len(runs) == len(compromise.METHODS) and files_in(out) == ["results.json"]
    assert "depth_maps.png not drawn: pip install matplotlib" in printed.splitlines()
    assert "(one seed)" in printed


def test_results_json_is_the_flags_and_runs_one_value_a_line(tmp_path, capsys, monkeypatch):
    """results.json holds the flags and the runs as they are, indented over many lines (a reader, or a diff of
    two runs, sees one value a line), not one long line."""
    monkeypatch.setattr(compromise, "pyplot", lambda: None)
    args = SimpleNamespace(d=32, seeds=[0, 1], out_dir="o")
    runs = [result("attnres", 0), result("baseline", 1)]
    written = compromise.write_results(tmp_path / "out", args, runs)
    assert written == [tmp_path / "out" / "results.json"]
    text = written[0].read_text()
    assert json.loads(text) == dict(args=vars(args), runs=runs)
    lines = text.splitlines()
    assert len(lines) > 20 and all(len(line) < 80 for line in lines)
    assert sum(line.strip().rstrip(",") == '"d": 32' for line in lines) == 3  # the flag's, each run's


@pytest.mark.parametrize("argv, fragment", [
    (["--d", "36"], "--d 36: use a multiple of 8"),
    (["--d", "33"], "--d 33: use a multiple of 8"),
    (["--d", "16"], "--d 16: use a multiple of 8 of at least 32"),
    (["--d", "abc"], "argument --d: must be a whole number"),
    (["--heads", "3"], "--heads 3: use an even number that divides --d 64"),
    (["--heads", "6"], "--heads 6: use an even number"),
    (["--seeds", "abc"], "argument --seeds: must be integers separated by commas"),
    (["--seeds", "0,0"], "argument --seeds: lists a seed twice"),
    (["--steps", "0"], "argument --steps: must be at least 1"),
    (["--jobs", "-1"], "argument --jobs: must be at least 1"),
], ids=["width-not-a-multiple-of-8", "odd-width", "too-narrow-for-16-codes", "width-not-a-number",
        "odd-heads", "heads-not-dividing-the-width", "seeds-not-numbers", "a-seed-twice",
        "no-steps", "negative-jobs"])
def test_bad_flags_are_one_line_and_status_2(argv, fragment, tmp_path, capsys):
    line = error_line(capsys, compromise.main, argv + ["--out_dir", tmp_path / "out"])
    assert fragment in line, line
    assert files_in(tmp_path) == []


def untrained(*args):
    pytest.fail("it trained: the mistake should have been found before")


@pytest.mark.parametrize("given", ["file", "file/out"], ids=["a-file", "inside-a-file"])
def test_an_out_dir_that_is_or_lies_in_a_file_is_one_line_and_status_2(given, tmp_path, capsys,
                                                                       monkeypatch):
    (tmp_path / "file").write_text("")
    monkeypatch.setattr(compromise, "run_all", untrained)
    line = error_line(capsys, compromise.main, ["--out_dir", tmp_path / given])
    assert line.startswith(f"compromise.py: error: --out_dir {tmp_path / given}: "
                           f"{tmp_path / 'file'} is a file, not a folder"), line
    assert files_in(tmp_path) == ["file"]


def failing_open(fault):
    """open() as compromise.py calls it, in a read-only folder (no file can be created) or on a
    full disk (the file is created, its bytes go to /dev/full, whose writes fail with ENOSPC).
    We run as root, whom chmod does not stop, and mounting a small file system needs privileges."""
    def failing(path, mode="r", *args, **kwargs):
        if fault == "read-only":
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        open(path, mode).close()
        return open("/dev/full", mode)
    return failing


@pytest.mark.parametrize("fault, reason", [("read-only", "Read-only file system"),
                                           ("full", "No space left on device")],
                         ids=["read-only", "full-disk"])
@pytest.mark.parametrize("exists", [True, False], ids=["existing-folder", "new-folders"])
def test_an_out_dir_that_cannot_be_written_into_is_found_before_training(
        fault, reason, exists, tmp_path, capsys, monkeypatch):
    """Status 1 (the machine's problem, not the command's), before minutes of training that could
    not be saved; the folders made for the probe are gone again, a folder that was there is kept."""
    out = tmp_path / "out" if exists else tmp_path / "new" / "out"
    if exists:
        out.mkdir()
        (out / "kept").write_text("")
    monkeypatch.setattr(compromise, "open", failing_open(fault), raising=False)
    monkeypatch.setattr(compromise, "run_all", untrained)
    line = error_line(capsys, compromise.main, ["--out_dir", out], status=1)
    assert line == (f"compromise.py: error: cannot write into {out} ({reason}), found before "
                    f"training: free some space or write elsewhere")
    assert files_in(tmp_path) == (["out", "out/kept"] if exists else [])


def test_an_os_error_without_a_reason_is_named_by_its_message(tmp_path, monkeypatch):
    """An OSError with no strerror (raised with a message alone, as some file systems' drivers and
    wrappers do) still says what went wrong: its message's first line."""
    def failing(path, mode="r", *args, **kwargs):
        raise OSError("quota exceeded for this project\nsecond line")
    monkeypatch.setattr(compromise, "open", failing, raising=False)
    with pytest.raises(compromise.MachineError) as refused:
        compromise.check_writable(tmp_path / "out")
    assert str(refused.value) == (f"cannot write into {tmp_path / 'out'} (quota exceeded for this project), "
                                  f"found before training: free some space or write elsewhere")
    assert files_in(tmp_path) == []


def test_the_probe_writes_its_bytes_to_disk_and_leaves_the_folder_as_it_was(tmp_path,
                                                                           monkeypatch):
    synced, fsync = [], os.fsync

    def recording(fd):
        synced.append(os.fstat(fd).st_size)                   # what reached the file by then
        return fsync(fd)
    monkeypatch.setattr(os, "fsync", recording)
    compromise.check_writable(tmp_path / "new" / "out")       # folders made for it: removed
    assert files_in(tmp_path) == [] and synced == [compromise.PROBE_BYTES]
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "kept").write_text("")
    compromise.check_writable(tmp_path / "out")               # a folder that was there: kept
    assert files_in(tmp_path) == ["out", "out/kept"] and len(synced) == 2


def test_a_disk_that_fills_during_training_leaves_neither_file(tmp_path, capsys, monkeypatch):
    """results.json and the figure are written together: the figure's failure takes results.json
    with it, and the folders made for them."""
    def full(plt, results, path):
        (path.parent / "depth_maps.png").write_bytes(b"half")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
    monkeypatch.setattr(compromise, "pyplot", lambda: "matplotlib")  # installed or not
    monkeypatch.setattr(compromise, "plot_depth_maps", full)
    monkeypatch.setattr(compromise, "VAL_SEQUENCES", 8)              # a quicker run, in process
    out = tmp_path / "new" / "out"
    line = error_line(capsys, compromise.main, ["--steps", "1", "--seeds", "0", "--d", "32",
                                                "--jobs", "1", "--out_dir", out], status=1)
    assert f"cannot write into {out} (No space left on device): nothing written" in line
    assert files_in(tmp_path) == []


@pytest.fixture
def stray_sigterm():
    """SIGTERM at a handler that fails the test: a SIGTERM that main's handler does not catch would
    otherwise end pytest itself."""
    def stray(signum, frame):
        raise AssertionError("SIGTERM reached the test's own handler: main installed none")
    before = signal.signal(signal.SIGTERM, stray)
    yield
    signal.signal(signal.SIGTERM, before)


def test_a_signal_while_the_files_are_written_waits_for_both(tmp_path, capsys, monkeypatch,
                                                               stray_sigterm):
    """SIGTERM as the files are being written: it stops the run once they are whole, rather than
    throwing the finished runs away."""
    write = compromise.write_results

    def interrupted(out_dir, args, results):
        os.kill(os.getpid(), signal.SIGTERM)                     # main's handler: held
        return write(out_dir, args, results)
    monkeypatch.setattr(compromise, "write_results", interrupted)
    monkeypatch.setattr(compromise, "pyplot", lambda: None)       # results.json alone: quicker
    monkeypatch.setattr(compromise, "VAL_SEQUENCES", 8)
    out = tmp_path / "out"
    line = error_line(capsys, compromise.main, ["--steps", "1", "--seeds", "0", "--d", "32",
                                                "--jobs", "1", "--out_dir", out], status=143)
    assert line == (f"compromise.py: error: interrupted (SIGTERM) after {out / 'results.json'} "
                    f"had been written whole")
    assert files_in(tmp_path) == ["out", "out/results.json"]
    assert len(json.loads((out / "results.json").read_text())["runs"]) == len(compromise.METHODS)


def test_ctrl_c_while_it_imports_says_as_much_as_later(tmp_path):
    """torch takes seconds to import; the import is held until the signal comes."""
    status, _, err = interrupted_while_importing(["-m", "scripts.compromise"], "torch", tmp_path)
    assert status == 130 and err == ("compromise.py: error: interrupted (SIGINT): nothing "
                                     "written; the same command runs it again from the start\n")


HANDLERS = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: compromise.interrupt}


@pytest.fixture
def stop_handlers():
    """SIGINT and SIGTERM as in compromise.py's main process under a terminal (both raise
    KeyboardInterrupt); the suite's own handlers back afterwards."""
    before = {s: signal.signal(s, handler) for s, handler in HANDLERS.items()}
    yield
    for s, handler in before.items():
        signal.signal(s, handler)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_while_the_workers_start_is_held_and_they_never_hear_ctrl_c(signum,
                                                                               stop_handlers):
    reached = False
    with pytest.raises(KeyboardInterrupt) as stopped:
        with compromise.starting_workers():
            os.kill(os.getpid(), signum)                      # a stop as the workers start
            child = subprocess.run([sys.executable, "-c", "import signal; print(sorted(signal."
                                    "pthread_sigmask(signal.SIG_BLOCK, [])))"],
                                   capture_output=True, text=True)
            reached = True
    assert reached and str(stopped.value) == ("SIGTERM" if signum == signal.SIGTERM else "")
    assert child.stdout == f"[{signal.SIGINT!r}]\n", child  # inherited: SIGINT alone blocked
    assert all(signal.getsignal(s) is h for s, h in HANDLERS.items())  # restored


@pytest.mark.parametrize("sent, raised", [
    ([], None), ([signal.SIGTERM], "SIGTERM"), ([signal.SIGINT], ""),
    ([signal.SIGTERM, signal.SIGINT, signal.SIGTERM], "SIGTERM"),
    ([signal.SIGINT, signal.SIGTERM], ""),
], ids=["none", "SIGTERM", "SIGINT", "three-the-first-acted-on", "SIGINT-first"])
def test_signals_held_act_on_the_first_once_the_block_ends(sent, raised, stop_handlers):
    done = False
    try:
        with compromise.signals_held():
            for signum in sent:
                os.kill(os.getpid(), signum)
            done = True
        outcome = None
    except KeyboardInterrupt as e:
        outcome = str(e)
    assert done and outcome == raised
    assert all(signal.getsignal(s) is h for s, h in HANDLERS.items())


def test_signals_held_leave_an_ignored_one_ignored_and_drop_one_when_the_run_is_ending(
        stop_handlers):
    signal.signal(signal.SIGINT, signal.SIG_IGN)                # started in the background
    with compromise.signals_held():
        os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    with pytest.raises(ZeroDivisionError):                      # its error stops the run already
        with compromise.signals_held():
            os.kill(os.getpid(), signal.SIGTERM)
            1 / 0
    assert signal.getsignal(signal.SIGTERM) is compromise.interrupt
    with compromise.signals_held(act=False):                   # a stop already under way
        os.kill(os.getpid(), signal.SIGTERM)
    assert signal.getsignal(signal.SIGTERM) is compromise.interrupt


def children(pid):
    """The processes `pid` has started and not yet reaped (Linux: /proc/PID/task/*/children)."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with suppress(OSError):                              # a thread that just ended
            found += [int(c) for c in (task / "children").read_text().split()]
    return found


def running(pid):
    """Whether the process exists and has not ended (a zombie, waiting for init, has)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("signum, everyone", [
    (signal.SIGINT, True), (signal.SIGINT, False), (signal.SIGTERM, False),
], ids=["ctrl-c-in-a-terminal", "SIGINT-to-the-main-process", "SIGTERM-to-the-main-process"])
def test_a_stop_signal_ends_every_process_with_one_line(signum, everyone, tmp_path):
    """A terminal's Ctrl-C reaches the whole process group: the workers, training, stay silent. A
    scheduler's SIGTERM, or a kill of the main process's pid, reaches the main process alone: it
    must stop the workers itself (they trained on before, and the resource tracker with them). It
    writes nothing and exits 128 + the signal, and its processes end with it: the workers before
    it (it waits for them), the resource tracker right after (at the end of its pipe from every
    other process: a moment, here a few ms, so it gets a few seconds)."""
    out = tmp_path / "out"
    p = subprocess.Popen([sys.executable, "-m", "scripts.compromise", "--steps", "100000", "--seeds", "0",
                          "--d", "32", "--out_dir", str(out)], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"},
                         preexec_fn=sigint_as_in_a_terminal)
    try:
        if not select.select([p.stdout], [], [], 120)[0]:  # its first line: the runs are starting
            pytest.fail("compromise.py printed nothing for 2 minutes")
        deadline = time.time() + 60
        while len(started := children(p.pid)) < 3:          # the resource tracker and two workers
            assert p.poll() is None and time.time() < deadline, started
            time.sleep(0.05)
        time.sleep(1)                                        # the workers importing, training
        if everyone:
            os.killpg(p.pid, signum)
        else:
            p.send_signal(signum)
        try:
            _, err = p.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail(f"processes {[c for c in started if running(c)]} outlived compromise.py")
    finally:
        with suppress(ProcessLookupError):  # what a failure left running (start_new_session:
            os.killpg(p.pid, signal.SIGKILL)  # the group is this run's)
        p.wait()
    name = signal.Signals(signum).name
    assert p.returncode == 128 + signum, err
    assert err == (f"compromise.py: error: interrupted ({name}): nothing written; the same "
                   f"command runs it again from the start\n"), err
    deadline = time.time() + 5
    while (left := [c for c in started if running(c)]) and time.time() < deadline:
        time.sleep(0.05)
    assert left == []
    assert files_in(tmp_path) == []


@pytest.mark.parametrize("step, steps, factor", [
    (30, 30, 1.0), (30, 31, 1.0), (31, 31, 0.1), (251, 250, 0.1),
], ids=["run-as-long-as-the-warmup", "one-step-of-cosine-starts-at-the-peak",
        "one-step-of-cosine-ends-at-a-tenth", "past-the-end-stays-at-a-tenth"])
def test_the_cosine_of_a_run_barely_longer_than_the_warmup(step, steps, factor):
    """The cosine spans the steps - WARMUP updates after the warmup however few: over one it goes
    from the peak to the floor; a run no longer than the warmup does not divide by zero."""
    schedule = compromise.lr_factor(step, compromise.WARMUP, steps, compromise.MIN_LR_RATIO)
    assert schedule == pytest.approx(factor)


def test_fit_takes_each_step_at_the_schedules_rate(monkeypatch):
    """Each update's lr is set before it: the warmup (WARMUP 2 here), then the cosine over the
    updates that remain (2 of 4). The optimizer takes the module's weight decay and betas (set
    here apart from common.adamw's defaults, which are the same numbers)."""
    seen, made, make = [], [], compromise.adamw

    def recording(*args, **kwargs):
        opt = make(*args, **kwargs)
        made.append(opt)
        update = opt.step

        def step(*a, **k):
            seen.append({round(group["lr"] / compromise.LR, 9) for group in opt.param_groups})
            return update(*a, **k)
        opt.step = step
        return opt
    monkeypatch.setattr(compromise, "adamw", recording)
    monkeypatch.setattr(compromise, "WARMUP", 2)
    monkeypatch.setattr(compromise, "WEIGHT_DECAY", 0.25)
    monkeypatch.setattr(compromise, "BETAS", (0.8, 0.9))
    compromise.fit(compromise.model("attnres", d=32, heads=2, seed=0), seed=0, steps=4)
    assert seen == [{0.5}, {1.0}, {1.0}, {0.55}]                # every group at the same lr
    opt, = made
    assert {(g["weight_decay"], g["betas"]) for g in opt.param_groups} == {(0.25, (0.8, 0.9))}


def recorded_batches(monkeypatch):
    seen, draw = [], compromise.batch

    def recording(generator, n):
        idx, targets = draw(generator, n)
        seen.append(idx)
        return idx, targets
    monkeypatch.setattr(compromise, "batch", recording)
    return seen


def test_each_seed_trains_on_its_own_batches_the_same_every_time(monkeypatch):
    seen = recorded_batches(monkeypatch)
    net = compromise.model("baseline", d=32, heads=2, seed=0)
    for seed in (0, 1, 0):
        compromise.fit(net, seed=seed, steps=1)
    assert [idx.shape for idx in seen] == [(compromise.BATCH_SIZE, compromise.SEQ_LEN)] * 3
    assert not torch.equal(seen[0], seen[1]) and torch.equal(seen[0], seen[2])


@pytest.mark.parametrize("steps, with_val, curve", [
    (3, True, []), (4, True, [3]), (6, True, [3]), (7, True, [3, 6]), (4, False, []),
], ids=["as-long-as-one-interval", "one-more", "two-intervals-the-last-left-out",
        "two-intervals-and-one-more", "without-a-validation-set"])
def test_the_curve_is_the_validation_loss_every_interval_before_the_last_step(
        steps, with_val, curve, monkeypatch):
    """EVAL_EVERY 3: after updates 3, 6, ... but not after the last (train adds that one), each
    point the loss evaluate returns for this net on the validation set."""
    calls = []

    def evaluate(net, val):
        calls.append((net, val))
        return 10.0 * len(calls), -1.0                      # (loss, accuracy)
    monkeypatch.setattr(compromise, "evaluate", evaluate)
    monkeypatch.setattr(compromise, "EVAL_EVERY", 3)
    net, val = compromise.model("mhar", d=32, heads=2, seed=0), object()
    got = compromise.fit(net, seed=0, steps=steps, val=val if with_val else None)
    assert got == [[step, 10.0 * (k + 1)] for k, step in enumerate(curve)]
    assert all(c[0] is net and c[1] is val for c in calls)


@pytest.mark.parametrize("kwargs, built, steps", [
    ({}, (64, 2), 250), (dict(d=32, heads=4, steps=7), (32, 4), 7),
], ids=["the-experiments-defaults", "given"])
def test_a_run_reports_its_measurements_and_time(kwargs, built, steps, monkeypatch):
    """train's defaults are the command's (d 64, H 2, 250 steps); the result names the run, the
    routing heads the model has, the loss and accuracy at the end appended to the curve, α over
    the validation sequences and the seconds to a tenth."""
    val = (torch.zeros(2, 3), torch.ones(2, 3))
    net = SimpleNamespace(config=SimpleNamespace(depth_heads=3))
    calls = []
    clock = iter([100.0, 112.34])
    monkeypatch.setattr(compromise, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
    monkeypatch.setattr(compromise, "validation", lambda: val)
    monkeypatch.setattr(compromise, "model", lambda *a: calls.append(("model", a)) or net)
    monkeypatch.setattr(compromise, "fit", lambda *a: calls.append(("fit", a)) or [[5, 2.5]])
    monkeypatch.setattr(compromise, "evaluate", lambda *a: calls.append(("evaluate", a)) or (0.25, 0.75))
    monkeypatch.setattr(compromise, "mean_alphas", lambda *a: calls.append(("alphas", a)) or "α")
    result = compromise.train("mhar", 5, **kwargs)
    assert result == dict(method="mhar", seed=5, d=built[0], heads=3, steps=steps, val_loss=0.25,
                          val_accuracy=0.75, curve=[[5, 2.5], [steps, 0.25]], alphas="α",
                          seconds=12.3)
    assert calls == [("model", ("mhar", *built, 5)), ("fit", (net, 5, steps, val)),
                     ("evaluate", (net, val)), ("alphas", (net, val[0]))]


def test_the_validation_set_is_fixed():
    idx, targets = compromise.validation()
    again = compromise.validation()
    assert idx.shape == (compromise.VAL_SEQUENCES, compromise.SEQ_LEN)
    assert torch.equal(idx, again[0]) and torch.equal(targets, again[1])


@pytest.mark.parametrize("d", [32, 64], ids=["d32", "d64"])
def test_each_seed_has_its_own_rotation(d):
    R = compromise.rotation(d, seed=0)
    assert torch.equal(R, compromise.rotation(d, seed=0))
    assert not torch.equal(R, compromise.rotation(d, seed=1))


@pytest.mark.parametrize("method, heads, depth_heads", [
    ("mhar", 2, 2), ("mhar", 4, 4), ("mhar", 32, 32), ("mhar-rotated", 4, 4), ("attnres", 4, 1),
], ids=["mhar-H2", "mhar-H4", "mhar-one-coordinate-a-head", "mhar-rotated-H4", "attnres-one-head"])
def test_the_model_is_two_blocks_of_four_heads_over_two_with_an_mlp_of_4d(method, heads,
                                                                         depth_heads):
    """The module docstring's model: 2 blocks, 4 attention heads over 2 key-value heads, a SwiGLU
    of 4d, the task's vocabulary and length, and MHAR's H = --heads routing heads."""
    config = compromise.model(method, d=32, heads=heads, seed=0).config
    assert (config.vocab_size, config.seq_len, config.n_layer, config.n_embd) == (256, 32, 2, 32)
    assert (config.n_head, config.n_kv_head, config.ffn_hidden) == (4, 2, 128)
    assert config.depth_heads == depth_heads


def test_paired_statistics_are_exact_in_double_precision_and_silent_for_one_seed():
    """Against statistics' float64 mean and stdev: a paired difference of 1e-5 on losses of
    about ln 16 (the README's untrained variant) keeps its digits. One seed: nan, and no warning
    from the standard deviation of a single difference."""
    losses = [2.7861234567, 2.7859876543, 2.7862468024]
    reference = [2.7861134567, 2.7859976543, 2.7862268024]
    diffs = [a - b for a, b in zip(losses, reference)]
    runs = {s: {"val_loss": v} for s, v in enumerate(losses)}
    refs = {s: {"val_loss": v} for s, v in enumerate(reference)}
    diff, se, ratio = compromise.paired(runs, refs)
    assert diff == pytest.approx(statistics.mean(diffs), rel=1e-12, abs=0)
    assert se == pytest.approx(statistics.stdev(diffs) / math.sqrt(3), rel=1e-12, abs=0)
    assert ratio == pytest.approx(sum(losses) / sum(reference), rel=1e-15, abs=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        diff, se, ratio = compromise.paired({4: runs[0]}, {4: refs[0]})
    assert diff == pytest.approx(diffs[0], rel=1e-12) and math.isnan(se)


def test_results_are_grouped_by_method_then_seed():
    results = [dict(method=m, seed=s) for s in (3, 1) for m in ("mhar", "attnres")]
    assert compromise.by_method(results) == {
        "mhar": {3: results[0], 1: results[2]}, "attnres": {3: results[1], 1: results[3]}}
    assert list(compromise.by_method(results)) == ["mhar", "attnres"]  # in the order of results


@pytest.mark.parametrize("n_layer, labels", [
    (1, ["s0 embed", "s1 attn 0", "s2 mlp 0"]),
    (2, ["s0 embed", "s1 attn 0", "s2 mlp 0", "s3 attn 1", "s4 mlp 1"]),
    (3, ["s0 embed", "s1 attn 0", "s2 mlp 0", "s3 attn 1", "s4 mlp 1", "s5 attn 2", "s6 mlp 2"]),
], ids=["one-block", "two-blocks", "three-blocks"])
def test_the_final_sites_sources_are_the_embedding_then_each_sublayer(n_layer, labels,
                                                                      monkeypatch):
    monkeypatch.setattr(compromise, "N_LAYER", n_layer)
    assert compromise.source_labels() == labels


def result(method, seed, loss=0.5, early=1.0, accuracy=1.0, heads=None, final=None, d=32,
           steps=7):
    """A result as train returns it: alphas over the 5 sites of 2 blocks (site j reads j + 1
    sources, each H values), the final site's given (default: its source n holds n / 10 + h / 100
    + seed / 20)."""
    heads = ({"baseline": 0, "attnres": 1, "attnres-tau": 1, "attnres-rotated": 1}.get(method, 2)
             if heads is None else heads)
    if final is None:
        final = [[n / 10 + h / 100 + seed / 20 for h in range(heads)] for n in range(5)]
    alphas = None if heads == 0 else (
        [[[0.9 - j / 10] * heads for _ in range(j + 1)] for j in range(4)] + [final])
    return dict(method=method, seed=seed, d=d, heads=heads, steps=steps, val_loss=loss,
                val_accuracy=accuracy, curve=[[3, early], [6, early / 2], [steps, loss]],
                alphas=alphas, seconds=1.0)


def test_the_table_pairs_each_method_with_its_references_seed_by_seed():
    """baseline on two seeds, attnres-tau on seed 1 alone (one seed against each reference),
    mhar against both its references (the second on a line of its own); then α on the embedding
    at the final site (source 0 of the last site), per head, the mean over the seeds."""
    results = [
        result("baseline", 0, 0.5, 2.0, 0.75), result("baseline", 1, 0.7, 3.0, 1.0),
        result("attnres", 0, 0.4, 1.0, 1.0, final=[[0.3], [0.1], [0.2], [0.2], [0.2]]),
        result("attnres", 1, 0.5, 1.5, 0.5, final=[[0.5], [0.1], [0.1], [0.1], [0.2]]),
        result("attnres-tau", 1, 0.45, 1.25, 1.0, final=[[0.2], [0.2], [0.2], [0.2], [0.2]]),
        result("mhar", 0, 0.3, 0.5, 1.0, final=[[0.25, 0.125]] + [[0.1875, 0.21875]] * 4),
        result("mhar", 1, 0.35, 0.75, 1.0, final=[[0.35, 0.175]] + [[0.1625, 0.20625]] * 4),
    ]
    assert compromise.report(results).split("\n") == [
        "method           val loss   at step 3  accuracy   paired difference                    ratio",
        "baseline           0.6000      2.5000     87.5%   +0.1500 ± 0.0500 vs attnres           1.33",
        "attnres            0.4500      1.2500     75.0%   (the reference)",
        "attnres-tau        0.4500      1.2500    100.0%   -0.0500 (one seed) vs attnres         0.90",
        "mhar               0.3250      0.6250    100.0%   -0.1250 ± 0.0250 vs attnres           0.72",
        "                                                  -0.1000 (one seed) vs attnres-tau     0.78",
        "α on s0 (the embedding) at the final site, per head: attnres 0.40, attnres-tau 0.20, "
        "mhar 0.30/0.15"]


@pytest.mark.parametrize("method", ["attnres", "mhar"], ids=["attnres", "mhar-without-its-references"])
def test_a_table_of_one_run_is_its_own_reference(method):
    assert compromise.report([result(method, 0, 0.4, 1.0, 1.0)]).split("\n") == [
        "method           val loss   at step 3  accuracy   paired difference                    ratio",
        f"{method:<16}   0.4000      1.0000    100.0%   (the reference)",
        f"α on s0 (the embedding) at the final site, per head: {method} "
        + ("0.00" if method == "attnres" else "0.00/0.01")]


def bar_heights_and_errors(ax):
    """Per bar series of an axes: (label, x positions, heights, error half-lengths or None)."""
    from matplotlib.container import BarContainer
    series = []
    for container in (c for c in ax.containers if isinstance(c, BarContainer)):
        xs = [p.get_x() + p.get_width() / 2 for p in container.patches]
        heights = [p.get_height() for p in container.patches]
        errors = None
        if container.errorbar is not None:
            segments = container.errorbar.lines[2][0].get_segments()
            errors = [(s[1][1] - s[0][1]) / 2 for s in segments]
        series.append((container.get_label(), xs, heights, errors,
                       container.patches[0].get_width()))
    return series


def drawn_depth_maps(plt, monkeypatch, tmp_path, seeds, **rc):
    """(the figure, its axes, the PNG's bytes) of plot_depth_maps on result()'s runs of attnres and mhar,
    under matplotlib settings rc."""
    figures, subplots = [], plt.subplots

    def recording(*args, **kwargs):
        figures.append(subplots(*args, **kwargs))
        return figures[-1]
    monkeypatch.setattr(plt, "subplots", recording)
    results = [result(m, s) for s in range(seeds)
               for m in ("attnres", "mhar", "attnres-rotated", "mhar-rotated")]
    with plt.rc_context(rc):
        compromise.plot_depth_maps(plt, results, tmp_path / "depth_maps.png")
    (fig, axes), = figures
    return fig, axes, (tmp_path / "depth_maps.png").read_bytes()


@pytest.mark.parametrize("seeds", [1, 2], ids=["one-seed-no-error-bars", "two-seeds"])
def test_the_depth_maps_draw_each_heads_alpha_per_source(seeds, tmp_path, monkeypatch):
    """Two panels on one y scale (aligned, rotated codes); a bar per head of attnres and mhar at
    every source of the final site, side by side around it: the mean over the seeds, their
    standard deviation as error bars when there are several; the PNG at the figure DPI, closed."""
    plt = compromise.pyplot()
    if plt is None:
        pytest.skip("needs matplotlib: pip install -r requirements-test.txt")
    fig, axes, png = drawn_depth_maps(plt, monkeypatch, tmp_path, seeds)
    assert not plt.fignum_exists(fig.number)
    assert png[:8] == PNG_SIGNATURE
    width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
    assert (width, height) == tuple(round(x * compromise.FIGURE_DPI) for x in fig.get_size_inches())
    assert [ax.get_title() for ax in axes] == ["aligned codes", "rotated codes"]
    assert axes[0].get_ylabel() == "mean α at the final site"
    assert axes[0].get_shared_y_axes().joined(axes[0], axes[1])
    assert fig._suptitle.get_text() == (f"(a_t, b_(t-2)) with frozen codes: d 32, 7 steps, mean of "
                                        f"{seeds} seeds")
    width = 0.8 / 3
    for ax, names in zip(axes, (["attnres (one head)", "mhar head 0 (a-half)", "mhar head 1 (b-half)"],
                                ["attnres (one head)", "mhar head 0", "mhar head 1"])):
        assert [t.get_text() for t in ax.get_xticklabels()] == compromise.source_labels()
        assert list(ax.get_xticks()) == list(range(5))
        assert [t.get_text() for t in ax.get_legend().get_texts()] == names
        series = bar_heights_and_errors(ax)
        assert [s[0] for s in series] == names
        for k, (label, xs, heights, errors, bar_width) in enumerate(series):
            h = 0 if k == 0 else k - 1
            values = torch.tensor([[n / 10 + h / 100 + s / 20 for n in range(5)] for s in range(seeds)],
                                  dtype=torch.float64)
            assert bar_width == pytest.approx(width)
            assert xs == pytest.approx([n + (k - 1) * width for n in range(5)])
            assert heights == pytest.approx(values.mean(0).tolist())
            if seeds == 1:
                assert errors is None
            else:
                assert errors == pytest.approx(values.std(0).tolist(), rel=1e-5)


def test_the_depth_maps_are_two_panels_side_by_side_at_the_size_of_the_readmes_figure(tmp_path,
                                                                                      monkeypatch):
    """One row of two panels (aligned left, rotated right, at the same height), laid out by
    constrained layout, in a PNG of the pixel size of the README's assets/compromise_depth_maps.png
    (drawn by the same function)."""
    plt = compromise.pyplot()
    if plt is None:
        pytest.skip("needs matplotlib: pip install -r requirements-test.txt")
    from matplotlib.layout_engine import ConstrainedLayoutEngine
    fig, axes, png = drawn_depth_maps(plt, monkeypatch, tmp_path, 1)
    assert isinstance(fig.get_layout_engine(), ConstrainedLayoutEngine)
    left, right = (ax.get_position() for ax in axes)
    assert (left.y0, left.y1) == pytest.approx((right.y0, right.y1)) and left.x1 < right.x0
    readme = (ROOT / "assets" / "compromise_depth_maps.png").read_bytes()
    assert png[16:24] == readme[16:24]                  # width, height in pixels


def test_the_depth_maps_text_and_caps_keep_their_sizes_whatever_the_defaults(tmp_path, monkeypatch):
    """The README figure's sizes, set explicitly (under defaults of 10 pt text and no caps they would
    differ): tick labels 8 pt, the panel titles and the suptitle 9 pt, the legends 7 pt, error bars capped
    2 points either side."""
    plt = compromise.pyplot()
    if plt is None:
        pytest.skip("needs matplotlib: pip install -r requirements-test.txt")
    fig, axes, _ = drawn_depth_maps(plt, monkeypatch, tmp_path, 2, **{
        "font.size": 10, "axes.titlesize": 10, "legend.fontsize": 10, "figure.titlesize": 10,
        "xtick.labelsize": 10, "errorbar.capsize": 0})
    assert fig._suptitle.get_fontsize() == 9
    for ax in axes:
        assert {t.get_fontsize() for t in ax.get_xticklabels()} == {8}
        assert ax.title.get_fontsize() == 9
        assert {t.get_fontsize() for t in ax.get_legend().get_texts()} == {7}
        caps = [line for c in ax.containers if getattr(c, "errorbar", None) is not None
                for line in c.errorbar.lines[1]]
        assert caps and {line.get_markersize() for line in caps} == {2 * 2}  # capsize 2: 4 points wide


def test_the_depth_maps_are_a_png_whatever_format_matplotlib_saves_by_default(tmp_path, monkeypatch):
    plt = compromise.pyplot()
    if plt is None:
        pytest.skip("needs matplotlib: pip install -r requirements-test.txt")
    *_, png = drawn_depth_maps(plt, monkeypatch, tmp_path, 1, **{"savefig.format": "svg"})
    assert png[:8] == PNG_SIGNATURE


@pytest.mark.parametrize("argv, expected", [
    ([], dict(d=64, heads=2, seeds=[0, 1, 2], steps=250, jobs=2, out_dir="runs/compromise")),
    (["--d", "32"], dict(d=32)),
    (["--d", "40", "--heads", "8"], dict(d=40, heads=8)),
    (["--d", "32", "--heads", "32"], dict(d=32, heads=32)),
    (["--steps", "1", "--jobs", "1"], dict(steps=1, jobs=1)),
    (["--seeds", "7"], dict(seeds=[7])),
    (["--seeds", "3,-1,2", "--out_dir", "elsewhere"], dict(seeds=[3, -1, 2], out_dir="elsewhere")),
], ids=["defaults", "the-narrowest-width", "a-width-between", "one-coordinate-a-head",
        "one-step-one-job", "one-seed", "seeds-in-their-order"])
def test_the_flags_at_and_inside_their_bounds_are_taken(argv, expected):
    args = vars(compromise.parse_args(argv))
    assert {k: args[k] for k in expected} == expected


@pytest.mark.parametrize("argv, fragment", [
    (["--d", "24"], "--d 24: use a multiple of 8 of at least 32"),
    (["--d", "32", "--heads", "34"], "--heads 34: use an even number that divides --d 32"),
    (["--steps", "-5"], "argument --steps: must be at least 1, not -5"),
    (["--jobs", "1.5"], "argument --jobs: must be a whole number, not '1.5'"),
    (["--seeds", ""], "argument --seeds: must be integers separated by commas, e.g. 0,1,2; not ''"),
    (["--seeds", "1,2,1"], "argument --seeds: lists a seed twice: '1,2,1'"),
], ids=["the-multiple-of-8-below-32", "more-heads-than-coordinates", "negative-steps",
        "fractional-jobs", "no-seeds", "a-seed-twice-apart"])
def test_flags_just_outside_their_bounds_are_one_line(argv, fragment, tmp_path, capsys):
    line = error_line(capsys, compromise.main, argv + ["--out_dir", tmp_path / "out"])
    assert fragment in line, line


def test_help_gives_the_purpose_the_examples_and_each_flags_bounds_and_default(capsys,
                                                                               monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")                             # each flag's help on a line
    with pytest.raises(SystemExit) as exit:
        compromise.main(["--help"])
    assert exit.value.code == 0
    out = capsys.readouterr().out
    title, examples = compromise.__doc__.split("\n\n")[:2]
    assert out.startswith("usage: compromise.py ") and f"\n\n{title.strip()}\n\n" in out
    assert examples in out                                           # as written, line by line
    for flag, text in [
            ("--d D", "model width: a multiple of 8, at least 32 (default 64)"),
            ("--heads HEADS", "MHAR's routing heads: even, dividing --d (default 2)"),
            ("--seeds SEEDS", "paired seeds, separated by commas (default 0,1,2)"),
            ("--steps STEPS", "training steps (default 250)"),
            ("--jobs JOBS", "runs trained at a time, one thread each (default 2)"),
            ("--out_dir OUT_DIR", "where results.json and depth_maps.png go (default runs/compromise)")]:
        line, = [line for line in out.splitlines() if line.strip().startswith(flag)]
        assert line.endswith(" " + text), line


def test_a_worker_trains_on_one_thread_and_returns_its_runs_index(monkeypatch):
    torch.set_num_threads(2)                                         # the suite's fixture restores it
    compromise.one_thread()
    assert torch.get_num_threads() == 1
    monkeypatch.setattr(compromise, "train", lambda **run: ("trained", run))
    assert compromise.indexed_run((3, dict(method="mhar", seed=1))) == (
        3, ("trained", dict(method="mhar", seed=1)))


class FakePool:
    """multiprocessing's Pool as run_all uses it, in this process: the runs finish in reverse
    order, each after `waits` timeouts of the wait for it; terminate() may send a signal (a stop
    as the workers are being stopped)."""
    def __init__(self, log, jobs, initializer, signal_on_terminate=None, stop_after=None, waits=0):
        self.log, self.signal, self.stop_after = log, signal_on_terminate, stop_after
        self.waits = waits
        log.append(("Pool", jobs, initializer))

    def imap_unordered(self, function, items):
        return FakeResults(self, function, list(reversed(items)))

    def terminate(self):
        self.log.append("terminate")
        if self.signal is not None:
            os.kill(os.getpid(), self.signal)

    def join(self):
        self.log.append("join")


class FakeResults:
    """Pool.imap_unordered's iterator: next(timeout) gives the next result, or raises
    multiprocessing.TimeoutError `waits` times before each."""
    def __init__(self, pool, function, items):
        self.pool, self.function, self.items, self.taken, self.timeouts = pool, function, items, 0, 0

    def next(self, timeout=None):
        if self.timeouts < self.pool.waits:
            self.timeouts += 1
            self.pool.log.append(("timeout", timeout))
            raise multiprocessing.TimeoutError
        if self.taken == self.pool.stop_after:
            raise KeyboardInterrupt("")                                 # Ctrl-C while training
        self.timeouts, self.taken = 0, self.taken + 1
        return self.function(self.items[self.taken - 1])


def fake_pool(monkeypatch, **behaviour):
    log = []

    def get_context(method):
        log.append(("context", method))
        return SimpleNamespace(Pool=lambda jobs, initializer: FakePool(log, jobs, initializer,
                                                                       **behaviour))
    monkeypatch.setattr(compromise, "get_context", get_context)
    monkeypatch.setattr(compromise, "train", lambda **run: dict(run, trained=True))
    return log


RUNS = [dict(method=m, seed=s) for s in (0, 1) for m in ("attnres", "mhar")]


@pytest.mark.parametrize("jobs, runs", [(2, RUNS), (3, RUNS[:1]), (2, [])],
                         ids=["two-workers", "more-workers-than-runs", "no-runs"])
def test_the_workers_results_come_back_in_the_order_of_the_runs(jobs, runs, monkeypatch):
    """On spawned workers that start on one thread: each result handed to done as it finishes,
    all of them returned in the order of the runs, and the pool stopped and waited for."""
    log, finished = fake_pool(monkeypatch), []
    results = compromise.run_all(runs, jobs, finished.append)
    assert results == [dict(run, trained=True) for run in runs]
    assert finished == results[::-1]
    assert log == [("context", "spawn"), ("Pool", jobs, compromise.one_thread), "terminate", "join"]


@pytest.mark.parametrize("waits", [0, 1, 2], ids=["none", "one", "two"])
def test_a_wait_without_a_result_is_reported_after_every_interval(monkeypatch, waits):
    """waiting() after each `every_s` seconds that brings no result (a run of minutes on a busy
    machine): once per timeout, none when results come in time; every result still handed on."""
    log, finished, calls = fake_pool(monkeypatch, waits=waits), [], []
    results = compromise.run_all(RUNS, 2, finished.append, lambda: calls.append(len(finished)),
                                 every_s=7)
    assert results == [dict(run, trained=True) for run in RUNS] and len(finished) == 4
    assert calls == [k for k in range(4) for _ in range(waits)]        # waits before each result
    assert [entry for entry in log if entry[0] == "timeout"] == [("timeout", 7)] * (4 * waits)


def test_the_wait_is_a_minute_unless_told(monkeypatch):
    """compromise.py's waiting line comes after a minute without a result (its docstring's "every minute")."""
    log = fake_pool(monkeypatch, waits=1)
    compromise.run_all(RUNS, 2, lambda r: None, lambda: None)
    assert {entry for entry in log if entry[0] == "timeout"} == {("timeout", 60)}


@pytest.mark.parametrize("runs", [RUNS, RUNS[:1], []], ids=["four-runs", "one-run", "no-runs"])
def test_one_job_trains_in_this_process_in_order(runs, monkeypatch):
    log, finished = fake_pool(monkeypatch), []
    results = compromise.run_all(runs, 1, finished.append)
    assert results == finished == [dict(run, trained=True) for run in runs]
    assert log == []                                                 # no pool


def test_a_signal_while_the_finished_pool_stops_is_acted_on_once_it_has(monkeypatch,
                                                                        stop_handlers):
    log = fake_pool(monkeypatch, signal_on_terminate=signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt) as stopped:
        compromise.run_all(RUNS, 2, lambda r: None)
    assert str(stopped.value) == "SIGTERM" and log[-2:] == ["terminate", "join"]


def test_a_second_signal_while_a_stopped_pool_stops_is_dropped(monkeypatch, stop_handlers):
    """Ctrl-C while training, SIGTERM as the workers are being stopped: the first one names the
    stop, and the pool is still waited for."""
    log, finished = fake_pool(monkeypatch, signal_on_terminate=signal.SIGTERM, stop_after=1), []
    with pytest.raises(KeyboardInterrupt) as stopped:
        compromise.run_all(RUNS, 2, finished.append)
    assert str(stopped.value) == "" and log[-2:] == ["terminate", "join"]
    assert finished == [dict(RUNS[-1], trained=True)]


def test_the_probe_leaves_an_empty_folder_that_was_there(tmp_path):
    (tmp_path / "empty").mkdir()
    compromise.check_writable(tmp_path / "empty")
    assert files_in(tmp_path) == ["empty"]


def fake_training(monkeypatch, stop=None, waits=()):
    """run_all without training: each run's result made up (result()), done called for each as it
    would be, in order; the runs and jobs it was given recorded. stop: KeyboardInterrupt(stop)
    instead. waits: waiting() called before the k-th run ends, for each k in it."""
    given = []

    def run_all(runs, jobs, done, waiting=None):
        given.append((runs, jobs))
        if stop is not None:
            raise KeyboardInterrupt(stop)
        results = []
        for k, run in enumerate(runs):
            if k in waits:
                waiting()
            results.append(dict(result(run["method"], run["seed"], loss=0.1 + k / 100,
                                       accuracy=k / 8, d=run["d"], steps=run["steps"]),
                                seconds=2.5 + k))
            done(results[-1])
        return results
    monkeypatch.setattr(compromise, "run_all", run_all)
    return given


def drawn(plt, results, path):
    path.write_bytes(PNG_SIGNATURE)


@pytest.mark.parametrize("seeds, jobs, at_a_time", [
    ("0,1", "2", 2), ("4", "5", 5), ("4", "6", 6), ("4", "7", 6), ("4", "1", 1),
], ids=["two-of-twelve", "one-less-than-the-runs", "as-many-as-the-runs", "one-more-than-the-runs",
        "one"])
def test_a_run_prints_its_progress_and_the_table_and_writes_both_files(
        seeds, jobs, at_a_time, tmp_path, capsys, monkeypatch):
    """Every method for every seed (seed by seed), on at most as many workers as runs, on one
    thread here; a line per finished run with its time and what is left (a run every 10 s here:
    the time to go is 10 s per run left), the table, the files written and named."""
    given = fake_training(monkeypatch)
    clock = iter(range(0, 1000, 10))                                  # began at 0, a run per 10 s
    monkeypatch.setattr(compromise, "time", SimpleNamespace(monotonic=lambda: next(clock)))
    monkeypatch.setattr(compromise, "pyplot", lambda: "matplotlib")
    monkeypatch.setattr(compromise, "plot_depth_maps", drawn)
    torch.set_num_threads(2)                                          # the suite's fixture restores it
    out = tmp_path / "out"
    results = compromise.main(["--d", "32", "--heads", "4", "--steps", "7", "--seeds", seeds,
                               "--jobs", jobs, "--out_dir", str(out)])
    assert torch.get_num_threads() == 1
    seed_list = [int(s) for s in seeds.split(",")]
    runs = [dict(method=m, seed=s, d=32, heads=4, steps=7) for s in seed_list for m in compromise.METHODS]
    assert given == [(runs, at_a_time)]
    n = len(runs)
    left = [f"{n - k - 1} left, about {duration(10 * (n - k - 1))} to go" for k in range(n - 1)]
    progress = [f"[{k + 1:>2}/{n}] {r['method']:<16} seed {r['seed']}: val loss {0.1 + k / 100:.4f}, "
                f"accuracy {k / 8:.1%} ({2.5 + k:.0f} s; {k + 1} of {n} done"
                + (f", {left[k]})" if k < n - 1 else ")") for k, r in enumerate(runs)]
    assert capsys.readouterr().out.split("\n") == [
        f"compromise.py: 6 methods x {len(seed_list)} seeds, d 32, H 4, 7 steps, {at_a_time} at a time",
        *progress, *compromise.report(results).split("\n"),
        f"wrote {out / 'results.json'}, {out / 'depth_maps.png'}", ""]
    assert json.loads((out / "results.json").read_text()) == dict(
        args=dict(d=32, heads=4, seeds=seed_list, steps=7, jobs=int(jobs), out_dir=str(out)),
        runs=results)
    assert files_in(tmp_path) == ["out", "out/depth_maps.png", "out/results.json"]


def test_a_wait_says_how_many_runs_go_on_and_the_time_so_far(tmp_path, capsys, monkeypatch):
    """waiting() (a minute without a finished run): the runs still under way (--jobs, fewer once
    fewer are left), what is done and the time to go at the pace so far, the time since the start."""
    fake_training(monkeypatch, waits=(0, 2, 5))
    clock = iter(1000 + t for t in [0, 15, 20, 95, 97, 99, 107, 109, 115, 190, 192, 195, 201, 207, 210])
    monkeypatch.setattr(compromise, "time", SimpleNamespace(monotonic=lambda: next(clock)))
    monkeypatch.setattr(compromise, "pyplot", lambda: None)
    compromise.main(["--d", "32", "--steps", "7", "--seeds", "0", "--jobs", "4", "--out_dir",
                     str(tmp_path / "o")])
    waits = [line for line in capsys.readouterr().out.split("\n") if "under way" in line]
    assert waits == ["     4 runs under way (0 of 6 done, 6 left; 20 s so far)",  # the clock read twice
                     "     4 runs under way (2 of 6 done, 4 left, about 3 min 18 s to go; 1 min 47 s so far)",
                     "     1 run under way (5 of 6 done, 1 left, about 38 s to go; 3 min 15 s so far)"]


def test_the_first_lines_reach_a_pipe_as_they_are_printed(tmp_path, monkeypatch):
    """Through a pipe stdout is block-buffered: the run's first line and each run's line are
    flushed as printed, so that whoever watches (or waits for the runs to start) sees them."""
    raw = io.BytesIO()
    monkeypatch.setattr("sys.stdout", io.TextIOWrapper(raw, encoding="utf-8"))
    seen, make = [], compromise.report

    def flushed(*args):
        seen.append(raw.getvalue().decode().count("\n"))
    monkeypatch.setattr(compromise, "report", lambda results: flushed() or make(results))
    given = fake_training(monkeypatch, waits=(0, 3))
    run_all = compromise.run_all

    def watched(runs, jobs, done, waiting):
        flushed()
        return run_all(runs, jobs, lambda r: (done(r), flushed()), lambda: (waiting(), flushed()))
    monkeypatch.setattr(compromise, "run_all", watched)
    monkeypatch.setattr(compromise, "pyplot", lambda: None)
    compromise.main(["--d", "32", "--steps", "7", "--seeds", "0", "--out_dir", str(tmp_path / "o")])
    # the header, a waiting line, 3 runs' lines, a waiting line, 3 more: each on the pipe when printed
    assert len(given[0][0]) == 6 and seen == [1, 2, 3, 4, 5, 6, 7, 8, 9, 9]


@pytest.mark.parametrize("stop, name, status", [
    ("", "SIGINT", 130), ("SIGTERM", "SIGTERM", 143),
], ids=["ctrl-c", "SIGTERM"])
def test_a_stop_while_training_is_one_line_and_128_plus_the_signal(stop, name, status, tmp_path,
                                                                   capsys, monkeypatch):
    """In this process (the stop-signal tests above run the script): Ctrl-C's KeyboardInterrupt
    carries no name, SIGTERM's (interrupt) its own; nothing is written, the probe's folders gone."""
    fake_training(monkeypatch, stop=stop)
    line = error_line(capsys, compromise.main, ["--d", "32", "--out_dir", tmp_path / "new" / "out"],
                      status=status)
    assert line == (f"compromise.py: error: interrupted ({name}): nothing written; the same "
                    f"command runs it again from the start")
    assert files_in(tmp_path) == []


def test_a_stop_while_both_files_are_written_names_both(tmp_path, capsys, monkeypatch,
                                                        stray_sigterm):
    fake_training(monkeypatch)
    monkeypatch.setattr(compromise, "pyplot", lambda: "matplotlib")
    monkeypatch.setattr(compromise, "plot_depth_maps", drawn)
    write = compromise.write_results

    def interrupted(out_dir, args, results):
        os.kill(os.getpid(), signal.SIGTERM)                         # held until both are whole
        return write(out_dir, args, results)
    monkeypatch.setattr(compromise, "write_results", interrupted)
    out = tmp_path / "out"
    line = error_line(capsys, compromise.main, ["--d", "32", "--seeds", "0", "--out_dir", out],
                      status=143)
    assert line == (f"compromise.py: error: interrupted (SIGTERM) after {out / 'results.json'} and "
                    f"{out / 'depth_maps.png'} had been written whole")
    assert files_in(tmp_path) == ["out", "out/depth_maps.png", "out/results.json"]

