"""compromise.py: the task's targets, the frozen codes and their rotation, the frozen embedding
through training, the table's paired statistics, a tiny run end to end (in this process and on
two workers, which must agree), bad flags, an --out_dir that cannot be written, and the stop
signals (Ctrl-C, SIGTERM) with the workers they must end."""
import errno
import json
import math
import os
import select
import signal
import subprocess
import sys
import time
from contextlib import suppress
from pathlib import Path

import pytest
import torch

import compromise
from helpers import (PNG_SIGNATURE, ROOT, error_line, files_in, interrupted_while_importing,
                     sigint_as_in_a_terminal)


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
    assert compromise.lr_factor(step, steps) == pytest.approx(factor)


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
    from types import SimpleNamespace
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
    assert "is a file, not a folder" in line
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
    status, _, err = interrupted_while_importing(["compromise.py"], "torch", tmp_path)
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
    p = subprocess.Popen([sys.executable, "compromise.py", "--steps", "100000", "--seeds", "0",
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
