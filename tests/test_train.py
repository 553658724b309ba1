"""train.py: batches, training of every mode against a reference loop, conversion,
resume, signals, the output folder's lock, failed saves, logs, bad input, DDP (tiny preset, the
64-token corpus of the `data` fixture, a few steps each)."""
import builtins
import contextlib
import dataclasses
import errno
import functools
import importlib.util
import io
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import mhar
import train
from lib import common, head
from lib.common import adamw, load_model, sample_rows, seed_of
from helpers import ROOT, VOCAB, error_line, interrupted_while_importing, sigint_as_in_a_terminal


def flags(data, out, *extra):
    return ["--preset", "tiny", "--data", str(data), "--out_dir", str(out), "--seq_len", "32",
            "--batch_size", "4", "--max_steps", "8", "--warmup_steps", "2", "--eval_interval", "4",
            "--eval_batches", "2", "--log_interval", "1", "--lr", "1e-2", *extra]


def run(data, out, *extra):
    return train.main(flags(data, out, *extra))


def read_log(out):
    return [json.loads(line) for line in (Path(out) / "log.jsonl").read_text().splitlines()]


def losses(out):
    """What must not depend on timing: step, loss, lr, val_loss of every log.jsonl line."""
    return [{k: e[k] for k in ("step", "loss", "lr", "val_loss") if k in e} for e in read_log(out)]


def load(out):
    return torch.load(Path(out) / "ckpt.pt", map_location="cpu", weights_only=True)


def assert_same_state(a, b):
    """Two checkpoints hold bitwise the same weights and Adam moments."""
    assert a["step"] == b["step"] and a["model"].keys() == b["model"].keys()
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    for sa, sb in zip(a["optimizer"]["state"].values(), b["optimizer"]["state"].values(),
                      strict=True):
        assert all(torch.equal(sa[k], sb[k]) for k in sa)


def error_of(capsys, argv, status=2):
    """Run train.py in-process on bad input: the exit status, one line on stderr, no traceback."""
    return error_line(capsys, train.main, argv, status)


# -----------------------------------------------------------------------------
# The batches

def test_batches_are_a_pure_function_of_the_step_and_split_freely():
    tokens, vocab = np.arange(1000, dtype=np.uint16), 1000
    whole = sample_rows(tokens, ("train", 0, 7), 8, 0, 8, 16, vocab)
    assert torch.equal(whole, sample_rows(tokens, ("train", 0, 7), 8, 0, 8, 16, vocab))
    assert torch.equal(whole[4:6], sample_rows(tokens, ("train", 0, 7), 8, 4, 6, 16, vocab))
    assert (whole[:, 1:] - whole[:, :-1] == 1).all()  # contiguous windows of the corpus
    assert not torch.equal(whole, sample_rows(tokens, ("train", 0, 8), 8, 0, 8, 16, vocab))
    assert not torch.equal(whole, sample_rows(tokens, ("train", 1, 7), 8, 0, 8, 16, vocab))


def windows(tokens, step, seed=0, n=8, seq_len=32):
    """The n rows of step `step` written out by hand: windows of seq_len + 1 tokens starting at
    offsets drawn from a generator seeded by the hash of ("train", seed, step)."""
    g = torch.Generator().manual_seed(seed_of("train", seed, step))
    starts = torch.randint(len(tokens) - seq_len, (n,), generator=g).tolist()
    return torch.tensor(np.stack([tokens[s:s + seq_len + 1] for s in starts]).astype(np.int64))


def test_the_loop_reads_each_steps_own_rows(data, tmp_path, monkeypatch):
    """Steps 0, 1, 2 of the real loop feed the model (in micro-batches of 4) the rows drawn for
    their own step: a batch that depended on the seed alone would repeat."""
    seen, forward = [], mhar.GPT.forward

    def recording(self, idx, targets=None, **options):
        if self.training:
            seen.append(idx.clone())
        return forward(self, idx, targets, **options)
    monkeypatch.setattr(mhar.GPT, "forward", recording)
    run(data, tmp_path, "--max_steps", "3", "--eval_interval", "3")
    tokens = np.fromfile(data / "train.bin", dtype=np.uint16)
    assert len(seen) == 6  # 3 steps x 2 micro-steps
    for step in range(3):
        rows = windows(tokens, step)
        assert torch.equal(torch.cat(seen[2 * step:2 * step + 2]), rows[:, :-1]), step
    assert not torch.equal(seen[0], seen[2]) and not torch.equal(seen[2], seen[4])


# -----------------------------------------------------------------------------
# Training against a reference loop written out here

def reference_training(data, config, steps, lr=1e-2, warmup=2, max_steps=8, accum=2, micro=4,
                       logits=False):
    """What train.py must compute: AdamW (0.9, 0.95), eps 1e-8, weight decay 0.1, one group per
    role, lr warmed up linearly then cosine to 0.1x, the loss averaged over micro-steps, gradient
    norm clipped at 1. The loss without the logits, as train.py asks for it; logits=True: from
    the full logits. Returns (the model, the loss of every step)."""
    torch.manual_seed(0)
    model = mhar.GPT(config)
    optimizer = adamw(model, 0.1, lr, (0.9, 0.95), 1e-8, "cpu")
    tokens = np.fromfile(data / "train.bin", dtype=np.uint16)
    step_losses = []
    for step in range(steps):
        if step < warmup:
            factor = (step + 1) / warmup
        else:
            progress = (step - warmup) / (max_steps - warmup)
            factor = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))
        for group in optimizer.param_groups:
            group["lr"] = lr * factor
        rows = windows(tokens, step, n=accum * micro)
        total = 0.0
        for m in range(accum):
            chunk = rows[m * micro:(m + 1) * micro]
            _, loss = model(chunk[:, :-1], chunk[:, 1:],
                            loss_fn=None if logits else head.linear_cross_entropy)
            (loss / accum).backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step_losses.append(total / accum)
    return model, step_losses


@pytest.mark.parametrize("residual, extra", [
    ("baseline", []), ("hyper", ["--hc_streams", "2"]), ("attnres", []), ("mhar", []),
    ("mhar", ["--route_block", "2"]), ("mhar", ["--delta", "--route_block", "2"]),
], ids=["baseline", "hyper-2streams", "attnres", "mhar", "mhar-block2", "mhar-delta"])
def test_every_residual_mode_trains_as_the_reference_loop(data, tmp_path, residual, extra, capsys):
    """Five steps of train.py give the reference loop's weights and losses (the loop's
    schedule, batches, accumulation, clipping and optimizer, for every residual mode). Delta
    routing from scratch, a mode of its own (docs/methods.md), says so in its header, once."""
    summary = run(data, tmp_path, "--residual", residual, *extra, "--stop_step", "5")
    out = capsys.readouterr().out
    assert out.count("note: --delta without --init_from trains delta routing from scratch") == (
        "--delta" in extra), out
    config = json.loads((tmp_path / "config.json").read_text())["config"]
    assert (config["residual"], config["hc_streams"], config["route_block"], config["delta"]) == (
        residual, 2 if "--hc_streams" in extra else 4, 2 if "--route_block" in extra else 1,
        "--delta" in extra)
    model, ref_losses = reference_training(data, mhar.Config(**config), steps=5)
    ckpt = load(tmp_path)
    assert summary["step"] == ckpt["step"] == 5
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(ckpt["model"][name], tensor, rtol=1e-5, atol=1e-6, msg=name)
    logged = [e["loss"] for e in read_log(tmp_path) if "loss" in e]
    assert logged == pytest.approx(ref_losses, rel=1e-5)
    # the losses of the full logits (the head before it was chunked); Adam amplifies the float
    # order of the tiniest gradients past the weights' tolerance above, not the losses'
    _, full_losses = reference_training(data, mhar.Config(**config), steps=5, logits=True)
    assert logged == pytest.approx(full_losses, rel=1e-5)


def test_loss_falls_far_below_the_unigram_entropy(data, tmp_path):
    """The corpus is a 97-token cycle with 10% noise: its next token is predictable, so 40 steps
    take the model well under the unigram entropy (the loss of ignoring the context)."""
    summary = run(data, tmp_path, "--max_steps", "40", "--eval_interval", "20")
    log = [e for e in read_log(tmp_path) if "loss" in e]
    assert log[0]["loss"] == pytest.approx(math.log(VOCAB), abs=0.1)  # starts as a uniform guess
    assert summary["final_val_loss"] < 0.4 * summary["unigram_entropy"] < 0.4 * math.log(VOCAB)


def test_tail_mean_covers_exactly_the_last_k_evaluations(data, tmp_path):
    summary = run(data, tmp_path, "--max_steps", "5", "--eval_interval", "1", "--tail_evals", "3")
    evals = [e["val_loss"] for e in read_log(tmp_path) if "val_loss" in e]
    assert len(evals) == 5 and len(set(evals)) == 5
    assert summary["tail_evals"] == 3
    assert summary["tail_val_loss"] == pytest.approx(sum(evals[-3:]) / 3, rel=1e-12)
    assert summary["final_val_loss"] == evals[-1] and summary["best_val_loss"] == min(evals)
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=False)     # the checkpoint says the same
    assert (ckpt["val_loss"], ckpt["best_val_loss"]) == (evals[-1], min(evals))


# -----------------------------------------------------------------------------
# Conversion and resuming

def test_conversion_continues_the_baseline_run_exactly(data, tmp_path, capsys):
    """--init_from: the converted model starts with the baseline's logits (difference 0) and
    validation loss, its first step has the loss of the baseline's own next step, and its routing
    group has its own lr."""
    run(data, tmp_path / "baseline", "--residual", "baseline", "--stop_step", "4")
    source = tmp_path / "baseline-step4.pt"
    source.write_bytes((tmp_path / "baseline" / "ckpt.pt").read_bytes())
    run(data, tmp_path / "baseline", "--residual", "baseline", "--resume")
    # --residual left out: a conversion takes the baseline's flags but its routing ones (the
    # preset's mhar here), and delta routing
    capsys.readouterr()
    run(data, tmp_path / "converted", "--init_from", str(source), "--route_block", "2",
        "--routing_lr", "5e-3")
    assert "note: --delta" not in capsys.readouterr().out  # delta routing, by conversion
    baseline, converted = read_log(tmp_path / "baseline"), read_log(tmp_path / "converted")
    assert converted[0] == {"step": 4, "conversion_max_logit_diff": 0.0}
    val_at_4 = [e["val_loss"] for e in baseline if e.get("val_loss") is not None and e["step"] == 4]
    assert converted[1]["step"] == 4 and converted[1]["val_loss"] == val_at_4[0]
    baseline_loss = {e["step"]: e["loss"] for e in baseline if "loss" in e}
    first = [e for e in converted if "loss" in e][0]
    assert first["step"] == 5 and first["loss"] == baseline_loss[5]
    ckpt = load(tmp_path / "converted")
    assert ckpt["config"]["delta"] and ckpt["config"]["residual"] == "mhar"
    groups = {g["name"]: g for g in ckpt["optimizer"]["param_groups"]}
    assert groups["routing"]["initial_lr"] == 5e-3 and groups["matrices"]["initial_lr"] == 1e-2
    gates = [v for k, v in ckpt["model"].items() if k.endswith(".gate")]
    assert len(gates) == 5 and all(g.item() != 0 for g in gates)  # opened by non-zero gradients


def test_conversion_refuses_a_routed_checkpoint(data, tmp_path, capsys):
    run(data, tmp_path / "mhar", "--residual", "mhar", "--max_steps", "2", "--eval_interval", "2")
    err = error_of(capsys, flags(data, tmp_path / "converted", "--init_from",
                                 str(tmp_path / "mhar" / "ckpt.pt")))
    assert "converts a baseline checkpoint" in err


def test_resume_reproduces_the_uninterrupted_run_bitwise(data, tmp_path):
    run(data, tmp_path / "straight")
    run(data, tmp_path / "resumed", "--stop_step", "3")  # interrupted after step 3 (no eval there)
    assert load(tmp_path / "resumed")["step"] == 3
    assert not (tmp_path / "resumed" / "summary.json").exists()
    train.main(["--resume", "--out_dir", str(tmp_path / "resumed")])  # the rest from the checkpoint
    assert losses(tmp_path / "resumed") == losses(tmp_path / "straight")
    a, b = load(tmp_path / "straight"), load(tmp_path / "resumed")
    assert a["step"] == b["step"] == 8 and a.keys() == b.keys()
    assert_same_state(a, b)


def test_resume_drops_a_half_written_last_log_line(data, tmp_path, capsys):
    """A run that died in the middle of a log line (a crash, a full disk) resumes: the torn line
    goes like the lines after the checkpoint's step, and the log is the uninterrupted run's. A
    broken line elsewhere is no torn write: one line that names it."""
    run(data, tmp_path / "straight")
    out = tmp_path / "resumed"
    run(data, out, "--stop_step", "3")
    with open(out / "log.jsonl", "a") as f:
        f.write('{"step": 4, "loss": 3.1')
    train.main(["--resume", "--out_dir", str(out)])
    assert losses(out) == losses(tmp_path / "straight")
    lines = (out / "log.jsonl").read_text().splitlines()
    (out / "log.jsonl").write_text("\n".join([lines[0], "{torn", *lines[1:]]) + "\n")
    err = error_of(capsys, ["--resume", "--out_dir", str(out)])
    assert f"{out / 'log.jsonl'}, line 2, is not a line train.py wrote" in err
    assert (out / "log.jsonl").read_text().splitlines()[1] == "{torn"  # left as it was


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads Linux's /proc/self/maps")
def test_a_resumed_run_does_not_keep_the_old_checkpoint_mapped(data, tmp_path, monkeypatch):
    """ckpt.pt is read memory-mapped; once the resumed run's next save has replaced it, no page
    of the old file may stay mapped (its disk space would stay in use for the whole run)."""
    run(data, tmp_path, "--stop_step", "3")
    real_save, mapped = train.save_checkpoint, []

    def save_and_look(path, ckpt):
        real_save(path, ckpt)
        mapped.append([line.split()[-2:] for line in open("/proc/self/maps")
                       if str(tmp_path / "ckpt.pt") in line])
    monkeypatch.setattr(train, "save_checkpoint", save_and_look)
    train.main(["--resume", "--out_dir", str(tmp_path)])
    assert mapped == [[], []]  # after the saves of steps 4 and 8: no "ckpt.pt (deleted)"


def test_resume_refuses_flags_that_contradict_the_checkpoint(data, tmp_path, capsys):
    run(data, tmp_path, "--max_steps", "2")
    resume = ["--resume", "--out_dir", str(tmp_path)]
    assert "--residual mhar, not baseline" in error_of(capsys, [*resume, "--residual", "baseline"])
    assert "--n_layer 2, not 3" in error_of(capsys, [*resume, "--n_layer", "3"])
    assert "global batch" in error_of(capsys, [*resume, "--grad_accum", "3"])


def copy_data(data, folder):
    shutil.copytree(data, folder)
    return folder


def test_resume_refuses_data_prepared_anew(data, tmp_path, capsys):
    """The checkpoint remembers its data's fingerprint: the same folder with other tokens is
    refused on --resume, unless --allow_data_change."""
    corpus = copy_data(data, tmp_path / "corpus")
    run(corpus, tmp_path / "out", "--stop_step", "2")
    tokens = np.fromfile(corpus / "train.bin", dtype=np.uint16)
    np.roll(tokens, 1).tofile(corpus / "train.bin")  # same size and vocabulary, other order
    resume = ["--resume", "--out_dir", str(tmp_path / "out")]
    assert "not the data this checkpoint was trained on" in error_of(capsys, resume)
    assert train.main([*resume, "--allow_data_change"])["step"] == 8


def test_checkpoint_of_the_old_layout_loads(tmp_path):
    """Checkpoints written before the sites' g was renamed (sites.j.norm.weight) load unchanged:
    common.read_checkpoint renames the key, for --resume and common.load_model alike."""
    torch.manual_seed(0)
    config = mhar.Config(vocab_size=VOCAB, seq_len=16, n_layer=2, n_embd=32, n_head=2,
                         n_kv_head=1, ffn_hidden=64, delta=True)
    model = mhar.GPT(config)
    with torch.no_grad():
        for site in model.sites:
            site.norm_weight.uniform_(0.5, 1.5)
    old = {key.replace(".norm_weight", ".norm.weight"): value
           for key, value in model.state_dict().items()}
    assert "sites.0.norm.weight" in old and "sites.0.norm_weight" not in old
    torch.save({"model": old, "config": dataclasses.asdict(config)}, tmp_path / "ckpt.pt")
    loaded, _ = load_model(tmp_path / "ckpt.pt")  # strict: every key found
    for a, b in zip(loaded.sites, model.sites):
        assert torch.equal(a.norm_weight, b.norm_weight)


# -----------------------------------------------------------------------------
# Stopping on a signal, one run per folder, failed saves, the closing sample

def start_training(data, out, *extra):
    """A train.py process (one thread, as in-process runs: bitwise comparable), long enough to
    be stopped, SIGINT reaching it as a terminal's Ctrl-C; returns it once its log has a step."""
    command = [sys.executable, "train.py", *flags(data, out, "--max_steps", "100000",
                                                  "--eval_interval", "100000", *extra)]
    p = subprocess.Popen(command, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=sigint_as_in_a_terminal)
    log, deadline = Path(out) / "log.jsonl", time.time() + 120
    while not (log.exists() and log.read_text().count("\n") >= 2):
        assert p.poll() is None and time.time() < deadline, p.communicate()
        time.sleep(0.02)
    return p


def test_ctrl_c_saves_the_step_and_resume_continues_bitwise(data, tmp_path, capsys):
    """A second run on a folder in use is refused and changes nothing; a real SIGINT stops the
    first after its step with a checkpoint and status 130; --resume then reproduces the
    uninterrupted run bitwise."""
    out = tmp_path / "interrupted"
    p = start_training(data, out)
    log_before = (out / "log.jsonl").read_text()
    err = error_of(capsys, flags(data, out, "--max_steps", "2"))  # if not refused: done soon
    assert "in use by another run" in err and f"pid {p.pid}" in err
    assert (out / "log.jsonl").read_text().startswith(log_before)  # untouched by the second run
    p.send_signal(signal.SIGINT)
    stdout, stderr = p.communicate(timeout=120)
    assert p.returncode == 130, stderr
    assert "Traceback" not in stderr and "SIGINT" in stderr
    stopped = load(out)["step"]
    assert f"stopped after step {stopped} (SIGINT); continue with: python train.py --out_dir " \
           f"{out} --resume" in stdout
    end = ["--max_steps", "100000", "--eval_interval", "100000", "--stop_step", str(stopped + 3)]
    train.main(["--resume", "--out_dir", str(out), "--stop_step", str(stopped + 3)])
    run(data, tmp_path / "straight", *end)
    assert losses(out) == losses(tmp_path / "straight")
    assert_same_state(load(out), load(tmp_path / "straight"))


def test_sigterm_saves_the_step_and_exits_143(data, tmp_path):
    p = start_training(data, tmp_path)
    p.send_signal(signal.SIGTERM)
    stdout, stderr = p.communicate(timeout=120)
    assert p.returncode == 143 and "Traceback" not in stderr
    assert f"stopped after step {load(tmp_path)['step']} (SIGTERM)" in stdout


def test_a_second_signal_stops_at_once_but_not_a_forwarded_copy():
    """torchrun forwards a terminal's Ctrl-C to ranks that already got it: a repeat within a
    second is that copy; a later one stops at once (status 130)."""
    stop = train.StopSignals("train.py", master=False)
    stop.handle(signal.SIGINT, None)
    stop.handle(signal.SIGINT, None)  # the forwarded copy: ignored
    assert stop.signum == signal.SIGINT
    stop.first_at -= 2
    with pytest.raises(SystemExit) as exit:
        stop.handle(signal.SIGINT, None)
    assert exit.value.code == 130


@pytest.mark.parametrize("stop_signal", [0, signal.SIGINT, signal.SIGTERM],
                         ids=["finished", "stopped-by-ctrl-c", "stopped-by-sigterm"])
def test_a_run_that_is_over_ignores_signals_until_its_process_ends(stop_signal, monkeypatch):
    """Once train() has returned, the run finished or stopped with its checkpoint, main has the
    script's process ignore SIGINT and SIGTERM (common.ignore_stop_signals, which does so only in
    train.py's own process): a Ctrl-C then is too late, and the interpreter's teardown, which puts
    the signals back to their defaults, would otherwise die of it without a word. A real run held
    as it exits: test_scripts.py's test_ctrl_c_once_the_run_has_finished_is_too_late, for
    sample.py and prepare.py, which end as train.py does."""
    ignored = []
    monkeypatch.setattr(train, "train", lambda args, given: {"stop_signal": stop_signal})
    monkeypatch.setattr(train, "ignore_stop_signals", ignored.append)
    if stop_signal:
        with pytest.raises(SystemExit) as e:
            train.main([])
        assert e.value.code == 128 + stop_signal
    else:
        assert train.main([]) == {"stop_signal": 0}
    assert ignored == ["train.py"]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_more_signals_while_a_stopped_run_exits_keep_its_status_and_checkpoint(data, tmp_path,
                                                                              signum):
    """A stopped run's process takes about a second to exit once its checkpoint is written
    (torch's teardown). The same signal again and again meanwhile, every 20 ms until it is gone,
    neither kills it without a word (status -2 or -15, once Python has put the signal back to its
    default) nor raises a traceback: the status stays 128 + the signal's number, stderr holds
    train.py's lines alone, and the checkpoint is the stopped step's, whole."""
    p = start_training(data, tmp_path)
    p.send_signal(signum)
    stdout = ""
    while "stopped after step" not in stdout:
        line = p.stdout.readline()
        assert line, p.communicate()
        stdout += line
    while p.poll() is None:
        p.send_signal(signum)
        time.sleep(0.02)
    stderr = p.stderr.read()
    assert p.returncode == 128 + signum, stderr
    assert stderr and all(line.startswith("train.py: ") for line in stderr.splitlines()), stderr
    assert f"stopped after step {load(tmp_path)['step']} ({signum.name})" in stdout
    assert sorted(f.name for f in tmp_path.iterdir()) == ["ckpt.pt", "config.json", "log.jsonl",
                                                          "train.lock"]


def test_a_dead_runs_lock_is_taken_over(data, tmp_path):
    """A process that held the folder's lock and was killed (SIGKILL: no cleanup at all) leaves
    train.lock behind; the next run takes it over."""
    tmp_path.mkdir(exist_ok=True)
    holder = ("import fcntl, os, signal, sys; f = open(sys.argv[1], 'a+'); "
              "fcntl.flock(f, fcntl.LOCK_EX); f.write('host x, pid 1\\n'); f.flush(); "
              "os.kill(os.getpid(), signal.SIGKILL)")
    p = subprocess.run([sys.executable, "-c", holder, str(tmp_path / "train.lock")])
    assert p.returncode == -signal.SIGKILL
    assert run(data, tmp_path, "--max_steps", "2")["step"] == 2
    assert f"pid {os.getpid()}" in (tmp_path / "train.lock").read_text()


def test_a_failed_save_says_why_in_one_line_and_keeps_the_last_checkpoint(data, tmp_path, capsys,
                                                                          monkeypatch):
    """The second checkpoint meets a full disk the way torch.save does (a short write, then the
    OSError): one line that says why, status 1, no ckpt.pt.tmp left, the first checkpoint kept."""
    real_save, saves = torch.save, []

    def full_disk(obj, f):
        saves.append(obj["step"])
        if len(saves) == 1:
            return real_save(obj, f)
        f.write(b"PK\x03\x04 partial")
        try:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704")
        except RuntimeError:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(torch, "save", full_disk)
    err = error_of(capsys, flags(data, tmp_path), status=1)
    assert "No space left on device" in err and "the previous one is kept" in err
    assert saves == [4, 8] and not list(tmp_path.glob("*.tmp"))
    assert load(tmp_path)["step"] == 4


class FullDisk:
    """A file that the disk fills up under: its first write stores a few bytes, then fails as a
    full disk does (ENOSPC)."""

    def __init__(self, f):
        self.f = f

    def write(self, data):
        self.f.write(data[:7])
        self.f.flush()
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


def fill_the_disk(monkeypatch, name, after=0):
    """The disk is full from the (after + 1)-th time that a file whose name starts with `name` is
    opened (by open or pathlib) in this process."""
    real_open, opened = open, []

    def full_open(path, *args, **kwargs):
        f = real_open(path, *args, **kwargs)
        if isinstance(path, (str, Path)) and Path(path).name.startswith(name):
            opened.append(path)
            if len(opened) > after:
                return FullDisk(f)
        return f
    monkeypatch.setattr(builtins, "open", full_open)
    monkeypatch.setattr(io, "open", full_open)


def test_a_full_disk_at_the_summary_leaves_no_half_file(data, tmp_path, capsys, monkeypatch):
    """The last checkpoint is saved, then summary.json meets a full disk: one line that names it,
    status 1, no summary.json (whole or none) and no temporary file; --resume then writes it."""
    fill_the_disk(monkeypatch, "summary.json")
    err = error_of(capsys, flags(data, tmp_path), status=1)
    assert f"could not write {tmp_path / 'summary.json'} (No space left on device)" in err
    assert f"--out_dir {tmp_path} --resume writes it" in err
    assert not (tmp_path / "summary.json").exists() and not list(tmp_path.glob("*.tmp"))
    assert load(tmp_path)["step"] == 8
    monkeypatch.undo()
    summary = train.main(["--resume", "--out_dir", str(tmp_path)])
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["finished"] and saved["final_val_loss"] == summary["final_val_loss"]


def test_a_full_disk_in_a_log_line_is_one_line_and_resume_drops_the_torn_line(data, tmp_path,
                                                                                capsys,
                                                                                monkeypatch):
    """log.jsonl's line of step 6 is cut short by a full disk: one line that names the file,
    status 1; --resume (from step 4) then gives the uninterrupted run's log."""
    fill_the_disk(monkeypatch, "log.jsonl", after=6)  # steps 1-4, the eval, step 5
    err = error_of(capsys, flags(data, tmp_path / "out"), status=1)
    assert f"could not write {tmp_path / 'out' / 'log.jsonl'} (No space left on device)" in err
    assert (tmp_path / "out" / "log.jsonl").read_text().endswith('\n{"step"')
    monkeypatch.undo()
    train.main(["--resume", "--out_dir", str(tmp_path / "out")])
    run(data, tmp_path / "straight")
    assert losses(tmp_path / "out") == losses(tmp_path / "straight")


def test_compile_says_that_the_first_step_compiles(data, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch, "compile", lambda model, **kwargs: model)  # the note, not the wait
    run(data, tmp_path, "--max_steps", "1", "--compile")
    assert train.COMPILE_NOTE in capsys.readouterr().out
    assert "first step compiles the model" in train.COMPILE_NOTE


def test_compile_mode_reaches_torch_compile(data, tmp_path, monkeypatch):
    """--compile_mode reduce-overhead (CUDA graphs of the whole step) is torch.compile's mode."""
    modes = []
    monkeypatch.setattr(torch, "compile", lambda model, mode=None, **kwargs: modes.append(mode) or model)
    run(data, tmp_path, "--max_steps", "1", "--compile", "--compile_mode", "reduce-overhead")
    run(data, tmp_path / "default", "--max_steps", "1", "--compile")
    assert modes == ["reduce-overhead", "default"]


def test_ctrl_c_while_train_py_imports_exits_130_with_one_line(tmp_path):
    """SIGINT while torch is being imported: the line and status of an interrupted start, no
    traceback. A sitecustomize.py makes the import of torch wait (after a marker file) until the
    signal comes."""
    status, stdout, stderr = interrupted_while_importing(
        ["train.py", "--out_dir", tmp_path / "out"], "torch", tmp_path)
    assert status == 130, stderr
    assert stderr == "train.py: error: interrupted before training started\n" and not stdout
    assert not (tmp_path / "out").exists()


def gpt2_data(data, folder):
    """The fixture's tokens (ids 0-63 are GPT-2 tokens too) labelled as GPT-2 text."""
    copy_data(data, folder)
    (folder / "meta.json").write_text(json.dumps({"tokenizer": "gpt2", "vocab_size": 50257}))
    return folder


def test_the_sample_never_draws_a_padded_id(data, tmp_path, monkeypatch, capsys):
    """The model's vocabulary is padded past GPT-2's 50,257 ids. With the padded ids made the
    likeliest, the closing sample still decodes: generate is told the tokenizer's vocabulary."""
    head = mhar.LMHead.forward

    def padded_favourite(self, hidden):
        logits = head(self, hidden)
        if not torch.is_grad_enabled():  # generate, not the training steps
            logits = logits.clone()
            logits[..., 50257:] += 100
        return logits
    monkeypatch.setattr(mhar.LMHead, "forward", padded_favourite)
    summary = run(gpt2_data(data, tmp_path / "gpt2"), tmp_path / "out", "--max_steps", "1")
    out = capsys.readouterr().out
    assert summary["finished"] and "no sample" not in out
    assert "sample: the first " in out and "tokens of val.bin, then <|model|>" in out


def test_nothing_after_the_last_checkpoint_fails_the_run(data, tmp_path, monkeypatch, capsys):
    def broken(*args, **kwargs):
        raise RuntimeError("the sampler broke")
    monkeypatch.setattr(mhar.GPT, "generate", broken)
    summary = run(gpt2_data(data, tmp_path / "gpt2"), tmp_path / "out", "--max_steps", "1")
    assert summary["finished"] and (tmp_path / "out" / "summary.json").exists()
    assert "no sample: RuntimeError: the sampler broke" in capsys.readouterr().out


# -----------------------------------------------------------------------------
# Outputs, flags and bad input

def test_log_checkpoint_and_summary_carry_the_documented_fields(data, tmp_path):
    summary = run(data, tmp_path)
    log = read_log(tmp_path)
    steps = [e for e in log if "loss" in e]
    evals = [e for e in log if "val_loss" in e]
    assert [e["step"] for e in steps] == list(range(1, 9)) and [e["step"] for e in evals] == [4, 8]
    assert {"step", "loss", "lr", "ms", "tokens_per_s", "tokens", "peak_mem"} <= steps[0].keys()
    assert steps[-1]["tokens"] == 8 * 8 * 32 and steps[0]["peak_mem"] > 0
    assert {"step", "val_loss", "tokens", "peak_mem"} <= evals[0].keys()
    ckpt = load(tmp_path)
    assert {"model", "optimizer", "step", "config", "args", "data_position", "rng", "evals",
            "val_loss", "best_val_loss", "tokens", "global_batch",
            "data_fingerprint"} <= ckpt.keys()
    assert ckpt["config"]["residual"] == "mhar" and ckpt["config"]["vocab_size"] == VOCAB
    assert {"torch", "numpy", "python", "cuda"} <= ckpt["rng"].keys()
    assert [e["val_loss"] for e in ckpt["evals"]] == [e["val_loss"] for e in evals]
    assert summary["tail_val_loss"] == pytest.approx(sum(e["val_loss"] for e in evals) / 2)
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert {"final_val_loss", "tail_val_loss", "tail_evals", "tokens", "tokens_per_s", "peak_mem",
            "unigram_entropy"} <= saved.keys()
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["args"]["grad_accum"] == 2 and config["config"]["n_layer"] == 2
    assert not list(tmp_path.glob("*.tmp"))  # written atomically


def test_the_whole_val_split_is_scored_once_at_the_end(data, tmp_path):
    """summary.json's full_val_loss: the mean cross-entropy of every val.bin token but the first, each read
    from the tokens before it in its window of seq_len (the data's 3,999 targets: 124 windows of 32 and one
    of 31), recomputed here in float64 from the final weights, one window at a time."""
    summary = run(data, tmp_path)
    val = torch.from_numpy(np.fromfile(data / "val.bin", dtype=np.uint16).astype(np.int64))
    model, _ = load_model(tmp_path / "ckpt.pt")
    model.double()
    total = 0.0
    with torch.no_grad():
        for start in range(0, len(val) - 1, 32):
            window = val[start:start + 33]
            logits, _ = model(window[None, :-1])
            total += torch.nn.functional.cross_entropy(logits[0].double(), window[1:], reduction="sum").item()
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["full_val_tokens"] == summary["full_val_tokens"] == len(val) - 1 == 3999
    assert saved["full_val_loss"] == pytest.approx(total / (len(val) - 1), rel=1e-5)
    assert abs(saved["full_val_loss"] - saved["final_val_loss"]) > 1e-4  # not the sampled batches' loss


@pytest.mark.parametrize("world", [2, 3, 5], ids=lambda w: f"{w}-ranks")
@pytest.mark.parametrize("whole", [True, False], ids=["whole", "sampled"])
def test_evaluation_shared_over_ranks_is_one_processs(data, monkeypatch, world, whole):
    """evaluate on each of `world` ranks (all_reduce summing what they return): every rank runs the same
    number of forwards, a rank past the last batch repeats it and counts nothing, and the total is one
    process's (32 whole-split batches, 7 sampled ones: uneven over 3 and 5 ranks)."""
    args = train.parse_args(flags(data, "unused", "--eval_batches", "7"))[0]
    args.vocab_size, args.seq_len = VOCAB, 32
    torch.manual_seed(0)
    model = mhar.GPT(mhar.preset("tiny", vocab_size=VOCAB, seq_len=32))
    val = np.fromfile(data / "val.bin", dtype=np.uint16)
    cpu, autocast = torch.device("cpu"), contextlib.nullcontext()
    one = train.evaluate(model, val, args, 0, 1, cpu, autocast, whole)
    forwards, parts = [], []
    monkeypatch.setattr(train.dist, "all_reduce", lambda total: parts.append(total.clone()))
    for rank in range(world):
        calls = []
        monkeypatch.setattr(model, "forward", functools.partial(counted, calls, type(model).forward, model))
        train.evaluate(model, val, args, rank, world, cpu, autocast, whole)
        forwards.append(len(calls))
    total = sum(parts)
    assert len(set(forwards)) == 1 and forwards[0] == -(-(32 if whole else 7) // world)
    assert int(total[1]) == one[1] == (3999 if whole else 7 * 4 * 32)
    assert (total[0] / total[1]).item() == pytest.approx(one[0], rel=1e-6)


def counted(calls, forward, model, *args, **kwargs):
    calls.append(1)
    return forward(model, *args, **kwargs)


def test_a_run_stopped_early_has_no_whole_split_score(data, tmp_path):
    summary = run(data, tmp_path, "--stop_step", "4")
    assert summary["full_val_loss"] is None and summary["full_val_tokens"] == 0
    summary = run(data, tmp_path, "--resume")
    assert summary["full_val_tokens"] == 3999 and math.isfinite(summary["full_val_loss"])


def test_every_config_field_is_a_flag(data, tmp_path):
    """The model flags come from mhar.Config: a field added there is a flag here."""
    args, given = train.parse_args(["--n_layer", "3", "--n_embd", "48", "--n_head", "2",
                                    "--n_kv_head", "1", "--ffn_hidden", "96"])
    assert given == {"n_layer", "n_embd", "n_head", "n_kv_head", "ffn_hidden"}
    assert {f for f in train.CONFIG_FIELDS} <= set(vars(args))
    run(data, tmp_path, "--max_steps", "1", "--n_layer", "3", "--n_embd", "48", "--n_head", "2",
        "--n_kv_head", "1", "--ffn_hidden", "96", "--route_heads", "4")
    config = load(tmp_path)["config"]
    assert (config["n_layer"], config["n_embd"], config["n_head"], config["n_kv_head"],
            config["ffn_hidden"], config["route_heads"]) == (3, 48, 2, 1, 96, 4)


def test_a_presets_built_in_corpus_is_its_default_data(tmp_path, monkeypatch):
    """--preset small-bytes without --data prepares and trains on the standard library's bytes, split by
    near-duplicate family with 3.5 % of the bytes in val, and its model's vocabulary is the bytes' 257 ids padded
    (a checkpoint records the folder, so a resume reads it again). The whole split's score reads its first
    batch alone here (the whole: 1.1M tokens)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(train, "whole_split", lambda *args: common.whole_split(*args)[:1])
    summary = train.main(["--preset", "small-bytes", "--out_dir", "out", "--max_steps", "1", "--batch_size", "2",
                          "--seq_len", "32", "--eval_batches", "1", "--n_layer", "1"])
    assert math.isfinite(summary["final_val_loss"]) and summary["full_val_tokens"] == 2 * 32
    meta = json.loads((tmp_path / "data" / "pystdlib-bytes-families" / "meta.json").read_text())
    assert (meta["tokenizer"], meta["vocab_size"], meta["split"]) == ("bytes", 257, "families")
    assert 0.03 <= meta["tokens"]["val"] / sum(meta["tokens"].values()) <= 0.035 * 1.1
    ckpt = load(tmp_path / "out")
    assert (ckpt["args"]["data"], ckpt["config"]["vocab_size"]) == ("data/pystdlib-bytes-families", 320)


def test_synthetic_data_needs_no_files(tmp_path):
    summary = train.main(["--preset", "tiny", "--data", "synthetic", "--vocab_size", "128",
                          "--out_dir", str(tmp_path), "--max_steps", "2", "--batch_size", "2",
                          "--seq_len", "16", "--eval_batches", "1"])
    assert math.isfinite(summary["final_val_loss"]) and summary["unigram_entropy"] is None


BAD_FLAGS = [
    (["--batch_size", "0"], "--batch_size: must be > 0"),
    (["--batch_size", "-4"], "--batch_size: must be > 0"),
    (["--grad_accum", "0"], "--grad_accum: must be > 0"),
    (["--eval_interval", "0"], "--eval_interval: must be > 0"),
    (["--log_interval", "0"], "--log_interval: must be > 0"),
    (["--eval_batches", "0"], "--eval_batches: must be > 0"),
    (["--lr", "nan"], "--lr: must be > 0"),
    (["--lr", "-1"], "--lr: must be > 0"),
    (["--device", "gpu"], "unknown device 'gpu'"),
    (["--route_heads", "3"], "route_heads"),
    (["--vocab_size", "32"], "smaller than the data's vocabulary of 64"),
    (["--vocab_size", "0"], "Config.vocab_size: must be >= 1, not 0"),
    (["--seq_len", "0"], "Config.seq_len: must be >= 1, not 0"),
    (["--seq_len", "-5"], "Config.seq_len: must be >= 1, not -5"),
    (["--n_layer", "0"], "Config.n_layer: must be >= 1, not 0"),
    (["--n_head", "0"], "Config.n_head: must be >= 1, not 0"),
    (["--head_dim", "-2"], "Config.head_dim: must be >= 0"),
    (["--n_embd", "1000000"], "the model on cpu does not fit in memory (could not allocate "
                              "3,725.3 GiB): lower --n_embd"),
    (["--grad_accum", str(10**12)], "a step's batch of token ids does not fit in memory (could "
                                    "not allocate 29,802.3 GiB): lower --grad_accum"),
    (["--min_lr_ratio", "1.5"], "--min_lr_ratio: must be <= 1"),
    (["--stop_step", "9"], "--stop_step 9 is past the run's end, --max_steps 8"),
    (["--route_temperature", "0"], "Config.route_temperature: must be a positive number, not 0.0"),
    (["--residual", "baseline", "--route_temperature", "2"],
     "Config.route_temperature: baseline has no routing sites"),
    (["--residual", "baseline", "--route_heads", "4"], "--route_heads is for --residual mhar alone"),
    (["--residual", "attnres", "--route_heads", "4"], "--route_heads is for --residual mhar alone"),
    (["--residual", "mhar", "--hc_streams", "2"], "--hc_streams is for --residual hyper alone"),
    (["--rope_theta", "0"], "Config.rope_theta: must be a positive number, not 0.0"),
    (["--norm_eps", "-1"], "Config.norm_eps: must be a positive number, not -1.0"),
    (["--query_init_std", "-1"], "Config.query_init_std: must be >= 0"),
    (["--compile_mode", "reduce-overhead"], "--compile_mode is torch.compile's mode: pass --compile"),
]


@pytest.mark.parametrize("extra, message", BAD_FLAGS, ids=[" ".join(f) for f, _ in BAD_FLAGS])
def test_bad_flags_give_one_line_and_write_nothing(data, tmp_path, capsys, extra, message):
    assert message in error_of(capsys, flags(data, tmp_path / "out", *extra))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("out_dir", ["notes.txt", "notes.txt/run"], ids=["a-file", "inside-a-file"])
def test_an_out_dir_that_is_a_file_is_the_users_mistake(data, tmp_path, capsys, out_dir):
    """Status 2 and one line naming the file (it was 1, "File exists" or "Not a directory", as for
    a failure of the machine); the file is left as it was."""
    (tmp_path / "notes.txt").write_text("mine")
    assert "notes.txt is a file, not a folder" in error_of(capsys, flags(data, tmp_path / out_dir))
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_a_warmup_past_the_runs_end_is_said_in_help_and_in_the_header(data, tmp_path, capsys):
    """--help gives each schedule flag's bounds, and what a warmup longer than the run means:
    the run ends inside it (here after 4 of 10 warmup steps: at 0.4x the peak), as its header
    line says; the lr logged follows the warmup to its last step."""
    usage = " ".join(train.build_parser().format_help().split())
    assert "the cosine's floor, a fraction of the peak, in [0, 1]" in usage
    assert ("linear warmup steps; more than max_steps: the run ends inside the warmup, at "
            "max_steps / warmup_steps of the peak") in usage
    assert "at most max_steps (default: max_steps)" in usage
    run(data, tmp_path, "--max_steps", "4", "--warmup_steps", "10")
    assert "warmup 10, past the run's end: the lr ends at 0.4x the peak |" in capsys.readouterr().out
    assert [e["lr"] for e in read_log(tmp_path) if "lr" in e] == pytest.approx(
        [1e-3, 2e-3, 3e-3, 4e-3])


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_a_gpu_gives_one_line(data, tmp_path, capsys):
    assert "no CUDA GPU" in error_of(capsys, flags(data, tmp_path / "out", "--device", "cuda"))
    if not os.environ.get("TRITON_INTERPRET"):
        assert "CUDA" in error_of(capsys, flags(data, tmp_path / "out", "--fused"))
    assert not (tmp_path / "out").exists()


def corrupt(folder, kind):
    """The fixture's data, broken in one way."""
    if kind == "odd-length train.bin":
        with open(folder / "train.bin", "ab") as f:
            f.write(b"\0")
    elif kind == "empty val.bin":
        (folder / "val.bin").write_bytes(b"")
    elif kind == "missing val.bin":
        (folder / "val.bin").unlink()
    elif kind == "malformed meta.json":
        (folder / "meta.json").write_text('{"vocab_size": 64,')
    elif kind == "meta.json a list":
        (folder / "meta.json").write_text("[64]")
    elif kind == "train.bin shorter than meta.json says":  # still a whole number of tokens
        (folder / "meta.json").write_text(json.dumps({"tokenizer": "none", "vocab_size": VOCAB,
                                                      "tokens": {"train": 40_000, "val": 4_000}}))
        with open(folder / "train.bin", "r+b") as f:
            f.truncate(2 * 30_000)
    elif kind == "ids beyond the vocabulary":  # no meta.json: the files are read for the largest id
        (folder / "meta.json").unlink()
        np.full(100, 200, dtype=np.uint16).tofile(folder / "val.bin")


BAD_DATA = [("odd-length train.bin", "not a whole number of uint16"),
            ("empty val.bin", "is empty"), ("missing val.bin", "no val.bin in"),
            ("malformed meta.json", "is not valid JSON"), ("meta.json a list", "JSON list"),
            ("ids beyond the vocabulary", "largest token id in the data, plus one, which is 201"),
            ("train.bin shorter than meta.json says",
             "train.bin has 30000 tokens, but {corpus}/meta.json records 40000: it is truncated")]


@pytest.mark.parametrize("kind, message", BAD_DATA, ids=[k for k, _ in BAD_DATA])
def test_bad_data_gives_one_line_and_writes_nothing(data, tmp_path, capsys, kind, message):
    corrupt(copy_data(data, tmp_path / "corpus"), kind)
    extra = ["--vocab_size", "64"] if kind == "ids beyond the vocabulary" else []
    err = error_of(capsys, flags(tmp_path / "corpus", tmp_path / "out", *extra))
    assert message.format(corpus=tmp_path / "corpus") in err
    assert not (tmp_path / "out").exists()


def test_corrupt_or_foreign_checkpoints_give_one_clear_error(data, tmp_path, capsys):
    run(data, tmp_path, "--max_steps", "2")
    ckpt = tmp_path / "ckpt.pt"
    whole = ckpt.read_bytes()
    ckpt.write_bytes(whole[: len(whole) // 2])
    assert "truncated" in error_of(capsys, ["--resume", str(ckpt)])
    ckpt.write_bytes(b"not a checkpoint at all")
    assert "cannot read checkpoint" in error_of(capsys, ["--resume", str(ckpt)])
    torch.save({"model": {}}, ckpt)
    assert "missing optimizer" in error_of(capsys, ["--resume", str(ckpt)])
    assert "no checkpoint at" in error_of(capsys, ["--resume", str(tmp_path / "nowhere.pt")])


def test_wandb_without_the_package_gives_one_line(data, tmp_path, capsys):
    if importlib.util.find_spec("wandb"):
        pytest.skip("wandb is installed here")
    assert "pip install wandb" in error_of(capsys, flags(data, tmp_path, "--wandb"))


def test_command_line_error_exits_2_without_traceback(data, tmp_path):
    (tmp_path / "ckpt.pt").write_bytes(b"garbage")
    p = subprocess.run([sys.executable, "train.py", "--resume", str(tmp_path / "ckpt.pt")],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stderr.startswith("train.py: error: cannot read checkpoint")
    assert "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1


def test_torchrun_two_ranks_match_one_process_with_the_same_global_batch(data, tmp_path):
    """2 ranks x grad_accum 1 and 1 process x grad_accum 2 see the same 8 sequences per step."""
    steps = ["--max_steps", "4", "--eval_interval", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc_per_node=2", "train.py",
                        *flags(data, tmp_path / "ddp", *steps, "--grad_accum", "1")],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    run(data, tmp_path / "one", *steps, "--grad_accum", "2")
    ddp, one = losses(tmp_path / "ddp"), losses(tmp_path / "one")
    assert [e.keys() for e in ddp] == [e.keys() for e in one]  # rank 0 alone writes the log
    for a, b in zip(ddp, one):
        for k in a:
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-6), (k, a, b)
    a, b = load(tmp_path / "ddp"), load(tmp_path / "one")
    assert a["args"]["global_batch"] == b["args"]["global_batch"] == 8
    whole = [json.loads((tmp_path / name / "summary.json").read_text()) for name in ("ddp", "one")]
    assert whole[0]["full_val_tokens"] == whole[1]["full_val_tokens"] == 3999  # 32 batches over 2 ranks
    assert whole[0]["full_val_loss"] == pytest.approx(whole[1]["full_val_loss"], rel=1e-4)
    for k in a["model"]:
        torch.testing.assert_close(a["model"][k], b["model"][k], rtol=1e-4, atol=1e-5)


# (flags, ranks, micro-batch, grad_accum): the baseline and fused routing take the preset's
# lean_batch_size, reduced to what the global batch divides into over the ranks; the readable
# routed path and hyper-connections keep batch_size; a flag wins
RUN_SIZES = {
    "100m mhar readable": (["--preset", "100m"], 1, 4, 16),
    "100m mhar fused": (["--preset", "100m", "--fused"], 1, 8, 8),
    "100m baseline": (["--preset", "100m", "--residual", "baseline"], 1, 8, 8),
    "350m baseline": (["--preset", "350m", "--residual", "baseline"], 1, 16, 2),
    "350m attnres fused 2 ranks": (["--preset", "350m", "--residual", "attnres", "--fused"], 2, 16, 1),
    "350m baseline 4 ranks": (["--preset", "350m", "--residual", "baseline"], 4, 8, 1),
    "350m baseline 8 ranks": (["--preset", "350m", "--residual", "baseline"], 8, 4, 1),
    "350m baseline 32 ranks": (["--preset", "350m", "--residual", "baseline"], 32, 1, 1),
    "1b baseline 16 ranks": (["--preset", "1b", "--residual", "baseline"], 16, 2, 1),
    "350m --no-fused": (["--preset", "350m", "--no-fused"], 1, 2, 16),
    "1b hyper": (["--preset", "1b", "--residual", "hyper"], 1, 1, 32),
    "1b fused, batch_size given": (["--preset", "1b", "--fused", "--batch_size", "2"], 1, 2, 16),
    "tiny baseline (no lean size)": (["--preset", "tiny", "--residual", "baseline"], 1, 8, 1),
}


@pytest.mark.parametrize("flags,ranks,micro,accum", RUN_SIZES.values(), ids=RUN_SIZES.keys())
def test_the_micro_batch_follows_the_path_and_keeps_the_global_batch(flags, ranks, micro, accum):
    args = train.parse_args(flags)[0]
    train.fill_run_sizes(args, ranks)
    assert (args.batch_size, args.grad_accum) == (micro, accum)
    assert args.global_batch == train.RUNS[args.preset]["global_batch"]


def test_a_world_the_global_batch_does_not_divide_is_refused_in_one_line(capsys):
    args = train.parse_args(["--preset", "350m", "--residual", "baseline"])[0]
    with pytest.raises(SystemExit) as stop:
        train.fill_run_sizes(args, 3)
    assert stop.value.code == 2
    assert capsys.readouterr().err == ("train.py: error: the global batch 32 is not a multiple of "
                                       "--batch_size 2 x 3 ranks: pass --batch_size or --grad_accum\n")
