"""compare.py: the runs of a comparison or a grid, their pairing with the baseline, the tables; then tiny real runs."""
import errno
import io
import json
import math
import os
import random
import signal
import subprocess
import sys
import time
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import mhar
import prepare
from helpers import PNG_SIGNATURE, ROOT, VOCAB, error_line, files_in, needs, write_task
from lib.common import PEAK_FLOPS
from scripts import compare


def runs(*argv):
    args, train_flags = compare.parse_args(list(argv))
    return compare.runs_of(args), train_flags


# ----------------------------------------------------------------------------------------------
# The runs and their pairs (nothing trains).

def test_the_four_methods_and_extra_baseline_seeds():
    listed, _ = runs("--methods", "baseline,mhar", "--baseline_seeds", "0,1")
    assert [(r.name, r.baseline) for r in listed] == [("baseline-s0", None), ("mhar-s0", "baseline"),
                                                      ("baseline-s1", None)]  # seed 0's baseline is trained once
    listed, _ = runs()
    assert [r.name for r in listed] == ["baseline-s0", "hyper-s0", "attnres-s0", "mhar-s0"]
    assert listed[1].flags == ["--residual", "hyper", "--seed", "0"]


def test_the_head_sweep_trains_its_baseline_and_passes_other_flags_through():
    listed, train_flags = runs("--route_heads", "1,2,4", "--baseline_seeds", "0,3", "--max_steps", "5")
    assert [r.name for r in listed] == ["baseline-s0", "mhar-H1-s0", "mhar-H2-s0", "mhar-H4-s0", "baseline-s3"]
    assert listed[2].flags == ["--residual", "mhar", "--route_heads", "2", "--seed", "0"]
    assert {r.baseline for r in listed[1:4]} == {"baseline"} and train_flags == ["--max_steps", "5"]


def test_the_kv_by_heads_grid_pairs_each_cell_with_the_baseline_of_its_shape_and_seed():
    listed, _ = runs("--route_heads", "1,4", "--n_head", "8", "--n_kv_head", "2,8", "--seeds", "0,1")
    names = [r.name for r in listed]
    assert names == [f"{variant}-s{seed}" for seed in (0, 1) for kv in (2, 8)
                     for variant in (f"baseline-kv{kv}", f"mhar-H1-kv{kv}", f"mhar-H4-kv{kv}")]
    by_name = {r.name: r for r in listed}
    cell = by_name["mhar-H4-kv8-s1"]
    assert cell.flags == ["--residual", "mhar", "--route_heads", "4", "--n_head", "8", "--n_kv_head", "8",
                          "--seed", "1"]  # --n_head: one value, for every run, not in the names
    baseline = by_name[f"{cell.baseline}-s{cell.seed}"]
    assert baseline.name == "baseline-kv8-s1"
    assert baseline.flags == ["--residual", "baseline", "--n_head", "8", "--n_kv_head", "8", "--seed", "1"]
    for r in listed:  # every pair differs in the residual and its heads alone: same shape, same seed
        if r.baseline is not None:
            partner = by_name[f"{r.baseline}-s{r.seed}"]
            assert r.flags[4:] == partner.flags[2:]  # after --residual mhar --route_heads H


def test_a_temperature_method_is_attnres_at_its_route_temperature():
    listed, train_flags = runs("--methods", "baseline,attnres,attnres-T4,mhar-T0.5,depth-attention-T0.25",
                               "--seeds", "1")
    assert [(r.name, r.method, r.baseline) for r in listed] == [
        ("baseline-s1", "baseline", None), ("attnres-s1", "attnres", "baseline"),
        ("attnres-T4-s1", "attnres", "baseline"), ("mhar-T0.5-s1", "mhar", "baseline"),
        ("depth-attention-T0.25-s1", "depth-attention", "baseline")]
    assert listed[2].flags == ["--residual", "attnres", "--route_temperature", "4", "--seed", "1"]
    assert listed[4].flags == ["--residual", "depth-attention", "--route_temperature", "0.25", "--seed", "1"]
    compare.check_shapes(listed, train_flags)  # every one builds


@pytest.mark.parametrize("argv,message", [
    (["--route_heads", "1,2", "--n_kv_head", "3", "--preset", "tiny"],
     "run baseline-s0 cannot be built at preset tiny: Config.n_kv_head: 3 does not divide n_head=4"),
    (["--route_heads", "3", "--preset=tiny"], "run mhar-H3-s0 cannot be built at preset tiny: Config.route_heads"),
    (["--residual", "mhar"], "--residual is set per run by compare.py; leave it out"),
    (["--methods", "baseline,transformer"], "unknown method 'transformer': choose from baseline, hyper, attnres, "
                                            "mhar, muddformer, depth-attention, or attnres-T<tau> / mhar-T<tau> / "
                                            "depth-attention-T<tau> (at --route_temperature tau)"),
    (["--methods", "baseline", "--route_heads", "2"], "--route_heads sweeps mhar's heads: add mhar to --methods"),
    (["--n_kv_head", "1,x"], "--route_heads and the shape flags take comma-separated integers, e.g. "
                             "--route_heads 1,2,4"),
    (["--seeds", ""], "--seeds needs at least one seed, e.g. --seeds 0"),
    (["--methods", "baseline,attnres-T0", "--preset", "tiny"],
     "run attnres-T0-s0 cannot be built at preset tiny: Config.route_temperature: must be a positive number"),
    (["--methods", "baseline-T2"], "unknown method 'baseline-T2'"),
    (["--methods", "baseline,mhar,baseline"], "--methods names a method twice: baseline,mhar,baseline"),
    (["--nproc_per_node", "0"], "--nproc_per_node must be at least 1, got 0"),
    (["--methods", ""], "unknown method ''"),
    (["--jobs", "0"], "--jobs must be at least 1"),
    (["--methods", "baseline,mhar,attnres-T4", "--versus", "attnres"],
     "--versus attnres is not a routed method of this comparison: choose from attnres-T4, mhar"),
    (["--methods", "baseline,mhar", "--versus", "baseline"], "--versus baseline is not a routed method of this"),
], ids=["kv_not_dividing_heads", "heads_not_dividing_width", "per_run_flag", "unknown_method", "heads_without_mhar",
        "not_integers", "no_seeds", "temperature_zero", "baseline_temperature", "method_twice", "no_processes", "no_methods", "no_jobs", "versus_not_run",
        "versus_baseline"])
def test_bad_comparisons_stop_before_training_with_one_line(argv, message, tmp_path, capsys, no_run_starts):
    err = error_line(capsys, compare.main, [*argv, "--out_dir", tmp_path])
    assert err.startswith(f"compare.py: error: {message}"), err
    assert not any(tmp_path.iterdir())


def test_a_bad_value_for_train_py_stops_before_training_with_train_pys_line(tmp_path, capsys):
    """A train flag compare.py passes on: train.py's parser judges it before the first run."""
    err = error_line(capsys, compare.main, ["--methods", "baseline", "--lr", "abc", "--out_dir",
                                            tmp_path / "cmp"], prog="train")
    assert "--lr" in err and "abc" in err and not (tmp_path / "cmp").exists()


def test_an_out_dir_inside_a_file_stops_before_training_with_one_line(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    err = error_line(capsys, compare.main, ["--methods", "baseline", "--out_dir", tmp_path / "notes.txt"])
    assert f"--out_dir {tmp_path / 'notes.txt'}: {tmp_path / 'notes.txt'} is a file, not a folder" in err
    assert files_in(tmp_path) == ["notes.txt"]


@pytest.mark.parametrize("flag", ["--residual", "--seed", "--resume"])
def test_the_flags_compare_sets_per_run_are_refused_in_every_spelling(flag, tmp_path, capsys, no_run_starts):
    """train.py's --seed is not taken for compare.py's --seeds (no abbreviations): it is refused as the others."""
    for given in ([flag, "1"], [f"{flag}=1"]):
        err = error_line(capsys, compare.main, ["--preset", "tiny", *given, "--out_dir", tmp_path])
        assert err == f"compare.py: error: {flag} is set per run by compare.py; leave it out"


def test_the_defaults_and_the_types_of_compares_own_flags():
    args, train_flags = compare.parse_args([])
    assert (args.out_dir, args.jobs, args.eval_batch_size, args.nproc_per_node) == ("runs/compare", 1, 8, 1)
    assert (args.seeds, args.baseline_seeds, args.versus, args.eval_tasks) == ([0], [], [], [])
    args, _ = compare.parse_args(["--eval_tasks", "t", "--eval_batch_size", "4", "--jobs", "3"])
    assert (args.eval_batch_size, args.jobs) == (4, 3)
    args, _ = compare.parse_args(["--methods", "baseline,attnres,attnres-T4,mhar", "--versus", "attnres,attnres-T4,"])
    assert args.versus == ["attnres", "attnres-T4"]


def test_eval_batch_size_takes_one_and_refuses_zero(capsys):
    assert compare.parse_args(["--eval_tasks", "t", "--eval_batch_size", "1"])[0].eval_batch_size == 1
    err = error_line(capsys, compare.parse_args, ["--eval_tasks", "t", "--eval_batch_size", "0"])
    assert err == "compare.py: error: --eval_batch_size must be at least 1, got 0"


@pytest.mark.parametrize("given, limit", [("0.5", 0.5), ("0.999", 0.999), ("1", 1), ("1.0", 1), ("2", 2), ("2.5", 2)],
                         ids=["fraction", "just-below-one", "one", "one-as-float", "count", "count-rounded-down"])
def test_eval_limit_below_one_is_a_fraction_and_from_one_a_count(given, limit):
    """lm-eval's convention: a float below 1 is a share of each task's documents, from 1 on a whole count."""
    args, _ = compare.parse_args(["--eval_tasks", "t", "--eval_limit", given])
    assert args.eval_limit == limit and type(args.eval_limit) is type(limit)


@pytest.mark.parametrize("flag, text, seeds", [
    ("--seeds", "0", [0]), ("--seeds", "3,1,2", [3, 1, 2]), ("--seeds", "9223372036854775807", [2**63 - 1]),
    ("--baseline_seeds", "", []), ("--baseline_seeds", " 5 , 6 ", [5, 6]),
    ("--seeds", "9223372036854775808", "must be a whole number in [0, 9223372036854775807] (an int64), not "
                                       "'9223372036854775808'"),
    ("--seeds", "99999999999999999999999", "must be a whole number in [0, 9223372036854775807]"),
    ("--baseline_seeds", "1,-1", "must be a whole number in [0, 9223372036854775807] (an int64), not '-1'"),
    ("--seeds", "0,x", "must be a whole number in [0, 9223372036854775807] (an int64), not 'x'"),
], ids=["one", "three", "largest", "none", "spaces", "one_past_the_largest", "huge", "negative", "not_a_number"])
def test_seeds_are_int64s_at_least_zero(flag, text, seeds, capsys):
    if isinstance(seeds, list):
        assert getattr(compare.parse_args([flag, text])[0], flag[2:]) == seeds
    else:
        err = error_line(capsys, compare.parse_args, [flag, text], prog="compare")
        assert err.startswith(f"compare.py: error: argument {flag}: {seeds}"), err


# ----------------------------------------------------------------------------------------------
# Run folders reused only for the run asked for; every mistake of a run's first second before the first run;
# a failed run or a signal stops the queue (no train.py runs: its processes are stand-ins).

TINY = ["--preset", "tiny", "--seq_len", "32", "--batch_size", "2", "--max_steps", "4", "--warmup_steps", "1",
        "--eval_interval", "2", "--eval_batches", "1", "--device", "cpu"]


class StandIn:
    """A train.py process that trains nothing: it exits with `status` once polled `polls` times (None: it
    runs until a signal stops it, and fails the test after 50 polls without one); `on_wait` runs when
    compare.py first polls or waits on it (a signal arriving then). A signal it is sent ends it with
    128 + its number, as train.py's stop does."""

    def __init__(self, command, status=0, polls=0, on_wait=None):
        self.name = Path(command[command.index("--out_dir") + 1]).name
        self.command, self.status, self.polls, self.on_wait = command, status, polls, on_wait
        self.returncode, self.signals, self.waited = None, [], 0

    def poll(self):
        if self.on_wait:
            self.on_wait, on_wait = None, self.on_wait
            on_wait(self)
        if self.returncode is None and self.signals:
            self.returncode = 128 + self.signals[0]
        elif self.returncode is None and self.polls is None:
            self.waited += 1
            if self.waited > 50:
                pytest.fail(f"{self.name} never got a signal")
        elif self.returncode is None:
            self.returncode, self.polls = (self.status if self.polls <= 0 else None), self.polls - 1
        return self.returncode

    def wait(self):
        while self.poll() is None:
            pass
        return self.returncode

    def send_signal(self, signum):
        self.signals.append(signum)


@pytest.fixture
def stand_ins(monkeypatch):
    """compare.py's runs as StandIn processes: (the list of those started, in order; plan[run name]: the
    StandIn's keyword arguments, and on_start: called while Popen starts it)."""
    started, plan = [], {}

    def popen(command, **options):
        kwargs = dict(plan.get(Path(command[command.index("--out_dir") + 1]).name, {}))
        on_start = kwargs.pop("on_start", None)
        started.append(StandIn(command, **kwargs))
        if on_start:
            on_start()
        return started[-1]
    monkeypatch.setattr(compare, "subprocess", SimpleNamespace(Popen=popen, STDOUT=subprocess.STDOUT))
    return started, plan


@pytest.fixture
def no_run_starts(monkeypatch):
    """The test fails if compare.py starts a run."""
    def popen(command, **options):
        pytest.fail(f"a run started: {command}")
    monkeypatch.setattr(compare, "subprocess", SimpleNamespace(Popen=popen, STDOUT=subprocess.STDOUT))


def resolved(argv, out):
    """(the runs of compare.py argv, {run name: the flags train.py would resolve for it}, the data's
    fingerprint), as compare.main sees them."""
    args, train_flags = compare.parse_args([str(a) for a in argv])
    listed = compare.runs_of(args)
    return (listed, *compare.resolve_runs(listed, train_flags, args.nproc_per_node, Path(out)))


def record_run(folder, flags, finished=True, ckpt=None, data_print=None):
    """A run folder as train.py leaves it, without training: config.json of these resolved flags, and
    summary.json when `finished`; a ckpt.pt (its flags: `ckpt`, else the same) remembering data_print."""
    import train
    folder.mkdir(parents=True, exist_ok=True)
    config = {k: flags[k] for k in train.CONFIG_FIELDS}
    (folder / "config.json").write_text(json.dumps(dict(config=config, args=flags, world_size=1, params=1000)))
    if finished:
        (folder / "summary.json").write_text(json.dumps(dict(
            step=flags["max_steps"], finished=True, params=1000, tail_val_loss=3.0, tokens_per_s=1.0, peak_mem=0)))
    if ckpt is not None or data_print is not None:
        saved = ckpt or flags
        torch.save(dict(args=saved, config={k: saved[k] for k in train.CONFIG_FIELDS},
                        data_fingerprint=data_print), folder / "ckpt.pt")


@pytest.mark.parametrize("change, message", [
    (dict(n_layer=3), "with --n_layer 3, not 2"),
    (dict(data="elsewhere"), "with --data elsewhere, not "),
    (dict(seed=1), "with --seed 1, not 0"),
    (dict(max_steps=8), "with --max_steps 8, not 4"),
    (dict(residual="attnres"), "with --residual attnres, not mhar"),
    (dict(route_temperature=2.0), "with --route_temperature 2.0, not 1.0"),
    (dict(tie_embeddings=False), "with no --tie_embeddings, not with it"),
    (dict(global_batch=16), "with a global batch of 16 sequences, not 8"),
    (dict(n_layer=3, stopped=True), "with --n_layer 3, not 2"),
    (dict(data_print="40000 + 4000 tokens, blake2b 0"), "with other data than "),
    (dict(foreign=True), "holds a summary.json but no config.json"),
    (dict(file=True), "is a file, not a run's folder"),
], ids=["n_layer", "data", "seed", "max_steps", "method", "temperature", "untied", "global_batch", "stopped_run",
        "data_content", "foreign", "a_file"])
def test_a_folder_holding_another_run_stops_before_training(change, message, data, tmp_path, capsys, no_run_starts):
    """A run folder is reused (or resumed) only for the run asked for: a 3-layer model, other data, another
    seed, schedule, method ... stop the comparison with one line naming the first difference, status 2."""
    out, argv = tmp_path / "cmp", ["--methods", "mhar", "--out_dir", tmp_path / "cmp", "--data", data, *TINY]
    _, asked, data_print = resolved(argv, out)
    flags, folder = dict(asked["mhar-s0"]), out / "mhar-s0"
    stopped, foreign, is_file = (change.pop(k, False) for k in ("stopped", "foreign", "file"))
    recorded_print = change.pop("data_print", data_print)
    flags.update(change)
    if is_file:
        out.mkdir()
        folder.write_text("not a run")
    elif stopped:  # no summary: a checkpoint that --resume would continue
        record_run(folder, asked["mhar-s0"], finished=False, ckpt=flags, data_print=data_print)
    else:
        record_run(folder, flags, data_print=recorded_print)
    if foreign:
        (folder / "config.json").unlink()
    err = error_line(capsys, compare.main, argv)
    assert err.startswith(f"compare.py: error: {folder} ") and message in err, err
    assert err.endswith("move it away or choose another --out_dir"), err


@pytest.mark.parametrize("summary, message", [
    (dict(step=4, max_steps=4), "step 4, not 2"),
    (dict(step=3, max_steps=3), "step 3, not 2"),
    (dict(step=2, max_steps=3), "max_steps 3, not 2"),
    (dict(residual="baseline"), "residual 'baseline', not 'mhar'"),
    (dict(route_heads=1), "route_heads 1, not 2"),
    (dict(tokens="T+1"), "tokens T+1, not T"),
    (dict(step=2, max_steps=2, residual="mhar", route_heads=2, tokens="T"), None),
], ids=["more-steps", "one-more-step", "another-schedule", "another-method", "other-heads", "one-more-token",
        "agrees"])
def test_a_finished_runs_summary_must_be_of_the_run_its_config_records(summary, message, data, tmp_path, capsys):
    """A summary.json of another run beside a config.json that says this one (before: its loss tabled as this
    run's): one line naming the first number that differs, status 2; one that agrees is reused."""
    out, argv = tmp_path / "cmp", ["--methods", "mhar", "--out_dir", tmp_path / "cmp", "--data", data, *TINY,
                                   "--max_steps", "2"]
    _, asked, data_print = resolved(argv, out)
    folder, tokens = out / "mhar-s0", 2 * asked["mhar-s0"]["global_batch"] * asked["mhar-s0"]["seq_len"]
    if "tokens" in summary:  # T: the tokens of 2 steps
        summary = {**summary, "tokens": tokens + summary["tokens"].count("+1")}
        message = message and message.replace("T+1", str(tokens + 1)).replace("T", str(tokens))
    record_run(folder, asked["mhar-s0"], data_print=data_print)
    written = json.loads((folder / "summary.json").read_text())
    (folder / "summary.json").write_text(json.dumps({**written, **summary}))
    if message is None:
        assert compare.prior_run(folder, asked["mhar-s0"], data_print) == "finished"
        return
    with pytest.raises(compare.UserError) as refused:
        compare.prior_run(folder, asked["mhar-s0"], data_print)
    assert str(refused.value) == (f"{folder}'s summary.json is not of the run its config.json and this command "
                                  f"describe ({message}): move it away or choose another --out_dir")


@pytest.mark.parametrize("init_from, disagreement", [(None, "tokens 999, not T"), ("", "tokens 999, not T"),
                                                     ("models/Qwen3-0.6B", None)],
                         ids=["from-scratch", "init_from-empty", "converted"])
def test_a_converted_runs_tokens_count_its_source_too(init_from, disagreement, data, tmp_path):
    """A run converted from a pretrained model (train.py --init_from) counts the tokens its source saw: its
    summary's tokens are not judged; a run from scratch's are."""
    out = tmp_path / "cmp"
    _, asked, _ = resolved(["--methods", "mhar", "--out_dir", out, "--data", data, *TINY], out)
    asked = {**asked["mhar-s0"], "init_from": init_from}
    tokens = asked["max_steps"] * asked["global_batch"] * asked["seq_len"]
    said = compare.summary_disagreement(dict(tokens=999), asked)
    assert said == (disagreement and disagreement.replace("T", str(tokens)))


@pytest.mark.parametrize("change", [
    dict(), dict(device="cuda", grad_accum=2, batch_size=4, compile=True, out_dir="elsewhere"),
    dict(log_interval=1, wandb="mhar", fused=True, fused_group=2, checkpointing=True),
    dict(data="{data}/../{name}"), dict(data="{link}"), dict(route_temperature=1),
], ids=["same", "machine_flags", "how_not_what", "data_spelled_otherwise", "data_through_a_link", "int_for_float"])
def test_a_run_trained_as_asked_is_reused(change, data, tmp_path):
    """What may differ: the machine's flags (--grad_accum: at the same global batch) and those that say how
    a run computes or reports; another path to the same data; 1 for 1.0."""
    out = tmp_path / "cmp"
    _, asked, data_print = resolved(["--methods", "mhar", "--out_dir", out, "--data", data, *TINY], out)
    (tmp_path / "link").symlink_to(data)
    flags = {**asked["mhar-s0"], **{k: v.format(data=data, name=data.name, link=tmp_path / "link")
                                    if isinstance(v, str) else v for k, v in change.items()}}
    record_run(out / "mhar-s0", flags, data_print=data_print)
    assert compare.prior_run(out / "mhar-s0", asked["mhar-s0"], data_print) == "finished"


def test_a_reused_run_is_said_and_flushed_before_any_run_starts(data, tmp_path, monkeypatch):
    """Through a pipe stdout is block-buffered: the line of each reused run is on it when printed, before the
    runs to train start writing to the same terminal; the runs to train are the others, in order."""
    out = tmp_path / "cmp"
    runs, asked, data_print = resolved(["--methods", "baseline,mhar", "--seeds", "0,1", "--out_dir", out,
                                        "--data", data, *TINY], out)
    record_run(out / "mhar-s0", asked["mhar-s0"], data_print=data_print)
    raw = io.BytesIO()
    monkeypatch.setattr("sys.stdout", io.TextIOWrapper(raw, encoding="utf-8"))
    commands = compare.planned(runs, TINY, asked, data_print, out, ["python"])
    assert raw.getvalue().decode() == "=== mhar-s0: trained before with these flags, reused\n"
    assert list(commands) == [out / "baseline-s0", out / "baseline-s1", out / "mhar-s1"]


@pytest.mark.parametrize("nproc, launcher", [
    (1, [sys.executable]),
    (2, [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]),
], ids=["one-process", "torchrun"])
def test_each_run_is_launched_by_python_or_by_torchrun(nproc, launcher, data, tmp_path, monkeypatch):
    """--nproc_per_node 1: python train.py; more: python -m torch.distributed.run --standalone with that many."""
    given = []
    monkeypatch.setattr(compare, "train_all", lambda commands, jobs: given.append(commands) or sys.exit(0))
    with pytest.raises(SystemExit):
        compare.main(["--methods", "baseline", "--out_dir", str(tmp_path / "cmp"), "--nproc_per_node", str(nproc),
                      "--data", str(data), *TINY])
    (command,) = given[0].values()
    assert command[:len(launcher) + 1] == launcher + [str(ROOT / "train.py")]


@pytest.mark.parametrize("flags, device", [([], "auto"), (["--device", "cpu"], "cpu")], ids=["default", "given"])
def test_the_runs_are_evaluated_on_their_own_device(flags, device, data, tmp_path, monkeypatch):
    """--eval_tasks: each finished run evaluated on the device the runs trained on (train.py's --device, "auto"
    when the flags leave it out)."""
    out = tmp_path / "cmp"
    argv = ["--methods", "baseline", "--out_dir", out, "--data", data, *[f for f in TINY if f not in
                                                                       ("--device", "cpu")], *flags]
    _, asked, data_print = resolved(argv, out)
    record_run(out / "baseline-s0", asked["baseline-s0"], data_print=data_print)
    seen = []
    monkeypatch.setattr(compare, "check_eval", lambda args, train_flags: "a manager")
    monkeypatch.setattr(compare, "evaluate_once", lambda folder, step, args, device, manager:
                        seen.append((folder.name, device, manager)) or {"task/acc": 0.5})
    monkeypatch.setattr(compare, "write_figures", lambda rows, out_dir: None)
    compare.main([str(a) for a in argv] + ["--eval_tasks", "task"])
    assert seen == [("baseline-s0", device, "a manager")]
    results = json.loads((out / "results.json").read_text())
    assert (results["train_flags"], results["eval_tasks"]) == ([str(a) for a in argv[4:]], ["task"])


@pytest.mark.parametrize("scored", [(), ("baseline-s0",), ("baseline-s0", "mhar-s0")], ids=["none", "one", "both"])
def test_the_whole_split_is_a_column_only_when_every_run_scored_it(scored, data, tmp_path, monkeypatch):
    """Runs of a train.py from before the whole-split score (no full_val_loss in summary.json) beside newer ones:
    the tables pair the tail-mean alone, not a column with holes."""
    out = tmp_path / "cmp"
    argv = ["--methods", "baseline,mhar", "--out_dir", out, "--data", data, *TINY]
    _, asked, data_print = resolved(argv, out)
    for name in asked:
        record_run(out / name, asked[name], data_print=data_print)
        if name in scored:
            summary = json.loads((out / name / "summary.json").read_text())
            (out / name / "summary.json").write_text(json.dumps({**summary, "full_val_loss": 2.5}))
    monkeypatch.setattr(compare, "write_figures", lambda rows, out_dir: None)
    compare.main([str(a) for a in argv])
    results = json.loads((out / "results.json").read_text())
    whole = len(scored) == 2
    assert ("full_val_loss" in results["pairs"][0]) == whole
    assert all(("full_val_loss" in r) == whole for r in results["rows"])
    assert ("Δ full_val_loss" in (out / "results.md").read_text()) == whole


def test_each_runs_speed_and_memory_come_from_its_summary(data, tmp_path, monkeypatch):
    """tokens/s and peak memory as train.py recorded them; a run that could not measure one (None: no step
    timed, no memory counter on its device) shows 0."""
    out = tmp_path / "cmp"
    argv = ["--methods", "baseline,mhar", "--out_dir", out, "--data", data, *TINY]
    _, asked, data_print = resolved(argv, out)
    measured = {"baseline-s0": (1234.5, 3 * 2**30), "mhar-s0": (None, None)}
    for name, (speed, memory) in measured.items():
        record_run(out / name, asked[name], data_print=data_print)
        summary = json.loads((out / name / "summary.json").read_text())
        (out / name / "summary.json").write_text(json.dumps({**summary, "tokens_per_s": speed, "peak_mem": memory}))
    monkeypatch.setattr(compare, "write_figures", lambda rows, out_dir: None)
    compare.main([str(a) for a in argv])
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert [(r["name"], r["tokens_per_s"], r["peak_mem"]) for r in rows] == [
        ("baseline-s0", 1234.5, 3 * 2**30), ("mhar-s0", 0.0, 0)]


def test_the_tables_printed_are_results_md_with_the_versus_tables(data, tmp_path, monkeypatch, capsys):
    out = tmp_path / "cmp"
    argv = ["--methods", "baseline,attnres,mhar", "--versus", "attnres", "--out_dir", out, "--data", data, *TINY]
    _, asked, data_print = resolved(argv, out)
    for name in asked:
        record_run(out / name, asked[name], data_print=data_print)
    monkeypatch.setattr(compare, "write_figures", lambda rows, out_dir: None)
    compare.main([str(a) for a in argv])
    printed, text = capsys.readouterr().out, (out / "results.md").read_text()
    assert "\n\n" + text + "loss curves: pip install matplotlib" in printed and text.endswith(" |\n")
    assert "Paired with attnres: each routed method minus attnres at the same seed.\n\n| method |" in text
    assert list(json.loads((out / "results.json").read_text())["versus"]) == ["attnres"]


@pytest.mark.parametrize("figures", [["loss_curves.png"], ["loss_curves.png", "paired_curves.png"]],
                         ids=["one", "two"])
def test_the_last_line_names_the_tables_and_the_figures(figures, data, tmp_path, monkeypatch, capsys):
    out = tmp_path / "cmp"
    argv = ["--methods", "baseline", "--out_dir", out, "--data", data, *TINY]
    _, asked, data_print = resolved(argv, out)
    record_run(out / "baseline-s0", asked["baseline-s0"], data_print=data_print)
    monkeypatch.setattr(compare, "write_figures", lambda rows, out_dir: [out_dir / f for f in figures])
    compare.main([str(a) for a in argv])
    assert capsys.readouterr().out.splitlines()[-1] == (f"wrote {out / 'results.md'}, "
                                                        + " and ".join(str(out / f) for f in figures))


@pytest.mark.parametrize("unfinished", [("mhar-s0",), ("baseline-s0", "mhar-s0")], ids=["the-last", "both"])
def test_runs_that_ended_before_their_last_step_are_one_line(unfinished, data, tmp_path, monkeypatch, capsys):
    """train.py ended well but early (--stop_step), or another process broke a run since: no tables, one line
    naming the first such run, status 1; the same command goes on."""
    out = tmp_path / "cmp"
    argv = ["--methods", "baseline,mhar", "--out_dir", out, "--data", data, *TINY]
    _, asked, data_print = resolved(argv, out)
    for name in asked:
        record_run(out / name, asked[name], finished=name not in unfinished, data_print=data_print)
    monkeypatch.setattr(compare, "train_all", lambda commands, jobs: None)  # the runs end, unfinished
    err = error_line(capsys, compare.main, argv, status=1)
    assert err == (f"compare.py: error: the run {out / unfinished[0]} ended before its last step (no finished "
                   f"summary.json): run the same command to go on")
    assert not (out / "results.md").exists()


@pytest.mark.parametrize("recorded_value, asked_value, difference", [
    (True, False, "--delta, not without it"), (False, True, "no --delta, not with it"),
    (0.5, True, "--delta 0.5, not True"),
], ids=["recorded-with", "recorded-without", "not-both-switches"])
def test_a_switch_that_differs_is_said_in_words(recorded_value, asked_value, difference, data, tmp_path):
    _, asked, _ = resolved(["--methods", "mhar", "--out_dir", tmp_path, "--data", data, *TINY], tmp_path)
    asked = {**asked["mhar-s0"], "delta": asked_value}
    assert compare.first_difference({**asked, "delta": recorded_value}, asked) == difference


@pytest.mark.parametrize("missing, asked_value, difference", [
    ("ema", 0.0, None), ("ema", 0.5, "--ema 0.0, not 0.5"), ("global_batch", 8, None),
    ("n_layer", 2, "--n_layer 12, not 2"),
], ids=["at_its_default", "off_its_default", "no_global_batch", "model_field_at_the_config_default"])
def test_a_record_of_an_older_train_py_had_the_flags_it_lacks_at_their_defaults(missing, asked_value, difference,
                                                                               data, tmp_path):
    """A flag train.py gained later was at its default before (a model field: mhar.Config's); a record
    without the global batch is compared without it."""
    _, asked, _ = resolved(["--methods", "mhar", "--out_dir", tmp_path, "--data", data, *TINY], tmp_path)
    asked = {**asked["mhar-s0"], missing: asked_value}
    recorded = {k: v for k, v in asked.items() if k != missing}
    assert compare.first_difference(recorded, asked) == difference
    assert compare.first_difference(asked, asked) is None


@pytest.mark.parametrize("summary", ["", '{"step": 4, "finished": tr', "[]", '{"finished": false}'],
                         ids=["empty", "torn", "not_an_object", "unfinished"])
@pytest.mark.parametrize("with_ckpt", [True, False], ids=["resumed", "rerun"])
def test_a_torn_summary_is_a_run_that_did_not_finish(summary, with_ckpt, data, tmp_path, stand_ins, capsys):
    """A summary.json that is empty, torn or not train.py's: the run goes on from its checkpoint, or
    starts again without one; never a JSONDecodeError."""
    started, plan = stand_ins
    out, argv = tmp_path / "cmp", ["--methods", "baseline", "--out_dir", tmp_path / "cmp", "--data", data, *TINY]
    _, asked, data_print = resolved(argv, out)
    record_run(out / "baseline-s0", asked["baseline-s0"], finished=False,
               data_print=data_print if with_ckpt else None)
    (out / "baseline-s0" / "summary.json").write_text(summary)
    plan["baseline-s0"] = dict(status=1)  # and then fails: nothing to tabulate
    err = error_line(capsys, compare.main, argv, status=1)
    assert "the run" in err and "baseline-s0 failed" in err
    assert [run.name for run in started] == ["baseline-s0"]
    assert (started[0].command[-1] == "--resume") == with_ckpt


@pytest.mark.parametrize("argv, message", [
    (["--methods", "baseline,mhar-T2,mhar-T2.0"], "mhar-T2-s0 and mhar-T2.0-s0 are the same run"),
    (["--methods", "baseline,mhar,mhar-T1"], "mhar-s0 and mhar-T1-s0 are the same run"),
    (["--methods", "baseline,depth-attention,depth-attention-T1"],
     "depth-attention-s0 and depth-attention-T1-s0 are the same run"),
    (["--methods", "baseline", "--seeds", "0,0"], "baseline-s0 is asked for twice"),
    (["--methods", "baseline", "--seeds", "0", "--baseline_seeds", "1,1"], "baseline-s1 is asked for twice"),
    (["--route_heads", "4,4"], "mhar-H4-s0 is asked for twice"),
    (["--methods", "baseline", "--n_kv_head", "2,2"], "baseline-kv2-s0 is asked for twice"),
], ids=["temperature_spelled_twice", "temperature_at_its_default", "depth_temperature_at_its_default",
        "seed_twice", "baseline_seed_twice",
        "heads_twice", "grid_value_twice"])
def test_two_runs_that_train_alike_are_refused(argv, message, data, tmp_path, capsys, no_run_starts):
    err = error_line(capsys, compare.main, [*argv, "--out_dir", tmp_path / "cmp", "--data", data, *TINY])
    assert err.startswith(f"compare.py: error: {message}"), err
    assert err.endswith("give each seed, method and shape once") and not (tmp_path / "cmp").exists()


def test_a_baseline_seed_also_in_seeds_is_trained_once(data, tmp_path):
    listed, asked, _ = resolved(["--methods", "baseline,mhar", "--seeds", "0,1", "--baseline_seeds", "1,2",
                                 "--out_dir", tmp_path, "--data", data, *TINY], tmp_path)
    assert [r.name for r in listed] == ["baseline-s0", "mhar-s0", "baseline-s1", "mhar-s1", "baseline-s2"]
    compare.check_duplicates(listed, asked)


@pytest.mark.parametrize("argv, message, prog", [
    (["--device", "cuda"], "--device cuda: this machine has no CUDA GPU", "compare"),
    (["--device", "tpu"], "unknown device 'tpu'", "compare"),
    (["--data", "{tmp}/missing"], "no train.bin in", "compare"),
    (["--fused"], "triton is not installed (pip install triton); or leave --fused out", "compare"),
    (["--seq_len", "0"], "run baseline-s0 cannot be built at preset tiny: Config.seq_len: must be >= 1", "compare"),
    (["--n_embd", "30"], "run baseline-s0 cannot be built at preset tiny: Config.n_head", "compare"),
    (["--vocab_size", "32"], "the model's vocabulary of 32 (--vocab_size) is smaller than", "train"),
    (["--seq_len", "40000"], "train.bin has 40000 tokens, not one sequence of --seq_len 40000", "train"),
    (["--batch_size", "3"], "the global batch 8 is not a multiple of --batch_size 3", "train"),
    (["--warmup_steps", "-1"], "argument --warmup_steps: must be >= 0", "train"),
], ids=["no_gpu", "unknown_device", "no_data", "fused_without_triton", "seq_len_zero", "heads_not_dividing",
        "vocabulary_too_small", "data_shorter_than_a_sequence", "global_batch", "bad_value"])
def test_a_mistake_a_run_meets_in_its_first_second_stops_before_the_first_run(argv, message, prog, data, tmp_path,
                                                                              capsys, monkeypatch, no_run_starts):
    """One line, status 2, and no run started (not each run's failure, then "the run ... failed"): compare.py's
    own words, or train.py's where its checks say it (the run sizes, the data against the model)."""
    if "--device" in argv and "cuda" in argv and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    if "--fused" in argv:  # no triton here (a machine without it): kernel.py's import fails
        monkeypatch.setitem(sys.modules, "triton", None)
        monkeypatch.delitem(sys.modules, "kernel", raising=False)
    argv = [a.format(tmp=tmp_path) for a in argv]
    flags = [*TINY, "--data", str(data), *argv]  # the later value of a flag wins
    err = error_line(capsys, compare.main, ["--methods", "baseline,mhar", "--out_dir", tmp_path / "cmp", *flags],
                     prog=prog)
    assert message in err, err
    assert not (tmp_path / "cmp").exists()


@pytest.mark.parametrize("method, fused", [("baseline", False), ("attnres", True), ("mhar", True),
                                           ("attnres-T4", True)])
def test_fused_goes_to_the_routed_runs_alone(method, fused):
    """--fused is passed to the runs that route (attnres and mhar, at any temperature); a baseline has no
    routing to fuse. The run's folder is under out_dir, or the working folder's by default."""
    run = runs("--methods", method)[0][0]
    argv = compare.train_argv(run, ["--compile", "--fused"], "cmp")
    assert argv == ["--compile", *(["--fused"] if fused else []), *run.flags, "--out_dir", str(Path("cmp") / run.name)]
    assert compare.train_argv(run, [])[-2:] == ["--out_dir", run.name]


def test_resolved_flags_are_what_train_py_records(data, tmp_path):
    """Each run's resolved flags are what its config.json's "args" will say: its own folder under --out_dir,
    its seed, its method; the data's vocabulary taken in."""
    out = tmp_path / "cmp"
    listed, asked, data_print = resolved(["--methods", "baseline,mhar", "--seeds", "0,1", "--out_dir", out,
                                          "--data", data, *TINY], out)
    for run in listed:
        assert asked[run.name]["out_dir"] == str(out / run.name)
        assert (asked[run.name]["seed"], asked[run.name]["residual"]) == (run.seed, run.method)
        assert asked[run.name]["vocab_size"] == VOCAB  # the data's meta.json (a multiple of 64 already)


def test_synthetic_data_resolves_without_a_corpus(tmp_path):
    out = tmp_path / "cmp"
    _, asked, data_print = resolved(["--methods", "baseline", "--out_dir", out, "--data", "synthetic", *TINY], out)
    assert data_print == "synthetic" and asked["baseline-s0"]["data"] == "synthetic"


def test_a_missing_built_in_corpus_is_prepared_once_before_the_runs(data, tmp_path, monkeypatch, capsys):
    """A built-in corpus not yet prepared is prepared by compare.py itself (as rank 0 of a run would), once for
    all runs, in this process (no process group to wait on)."""
    import shutil
    import train
    corpus = tmp_path / "data" / "corpus"
    monkeypatch.setattr(train, "BUILT_IN_DATA", {corpus: dict(tokenizer="t")})
    calls = []

    def prepare_(name, out, **options):
        calls.append((name, out, options))
        shutil.copytree(data, Path(out) / name)
    monkeypatch.setattr(train.prepare, "prepare", prepare_)
    out = tmp_path / "cmp"
    listed, asked, data_print = resolved(["--methods", "baseline,mhar", "--out_dir", out, "--data", corpus, *TINY],
                                         out)
    assert calls == [("corpus", str(corpus.parent), dict(tokenizer="t"))]
    assert f"preparing the built-in corpus into {corpus} (once)" in capsys.readouterr().out
    assert len(asked) == 2 and data_print != "synthetic"


def test_init_from_a_baseline_checkpoint_resolves_as_train_py_converts_it(data, tmp_path):
    """--init_from (a conversion comparison): each run takes the checkpoint's shape unless given, and is delta
    routing, as train.py would run it."""
    import train
    out = tmp_path / "cmp"
    _, asked, _ = resolved(["--methods", "baseline", "--out_dir", out, "--data", data, *TINY], out)
    flags = {**asked["baseline-s0"], "n_layer": 3}
    ckpt = tmp_path / "base.pt"
    torch.save(dict(model={}, optimizer={}, step=4, evals=[], rng={}, args=flags,
                    config={k: flags[k] for k in train.CONFIG_FIELDS}), ckpt)
    _, asked, _ = resolved(["--methods", "mhar", "--out_dir", out, "--data", data, *TINY, "--init_from", ckpt], out)
    assert asked["mhar-s0"]["n_layer"] == 3 and asked["mhar-s0"]["delta"] is True


@pytest.mark.parametrize("argv, message", [
    (["--data", "{tmp}/missing"], "no train.bin in"),
    (["--device", "cuda"], "--device cuda: this machine has no CUDA GPU"),
], ids=["no_data", "no_gpu"])
def test_a_comparison_of_one_run_checks_it_before_it_starts(argv, message, data, tmp_path, capsys, no_run_starts):
    """The device and the data are checked at the first run, which may be the only one."""
    if "cuda" in argv and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    flags = [*TINY, "--data", str(data), *(a.format(tmp=tmp_path) for a in argv)]
    err = error_line(capsys, compare.main, ["--methods", "baseline", "--out_dir", tmp_path / "cmp", *flags])
    assert message in err, err


def test_a_stopped_runs_checkpoint_without_its_flags_is_one_line(data, tmp_path, capsys, no_run_starts):
    """A checkpoint to resume must say how its run was trained: without its config, one line, status 2."""
    out, argv = tmp_path / "cmp", ["--methods", "baseline", "--out_dir", tmp_path / "cmp", "--data", data, *TINY]
    _, asked, data_print = resolved(argv, out)
    (out / "baseline-s0").mkdir(parents=True)
    torch.save(dict(model={}, optimizer={}, step=2, evals=[], rng={}, args=asked["baseline-s0"],
                    data_fingerprint=data_print), out / "baseline-s0" / "ckpt.pt")
    err = error_line(capsys, compare.main, argv)
    assert "is not a train.py checkpoint (missing config)" in err, err


def test_a_finished_runs_checkpoint_is_read_for_its_datas_fingerprint_alone(data, tmp_path):
    """A finished run is judged by its config.json; of its checkpoint only the data's fingerprint is read
    (a checkpoint slimmed to it still names the data)."""
    out = tmp_path / "cmp"
    _, asked, data_print = resolved(["--methods", "baseline", "--out_dir", out, "--data", data, *TINY], out)
    record_run(out / "baseline-s0", asked["baseline-s0"])
    torch.save(dict(data_fingerprint=data_print), out / "baseline-s0" / "ckpt.pt")
    assert compare.prior_run(out / "baseline-s0", asked["baseline-s0"], data_print) == "finished"
    torch.save(dict(data_fingerprint="other"), out / "baseline-s0" / "ckpt.pt")
    with pytest.raises(compare.UserError, match="other data than"):
        compare.prior_run(out / "baseline-s0", asked["baseline-s0"], data_print)


@pytest.mark.parametrize("recorded_layers, outcome", [(2, "finished"), (3, "--n_layer 3, not 2")],
                         ids=["same", "other"])
def test_a_record_whose_args_lack_a_model_field_is_judged_by_its_config(recorded_layers, outcome, data, tmp_path):
    """The model's fields are in config.json's "config" (an older train.py left them out of "args", or left
    them unset there): the record is judged by them."""
    out = tmp_path / "cmp"
    _, asked, data_print = resolved(["--methods", "baseline", "--out_dir", out, "--data", data, *TINY], out)
    record_run(out / "baseline-s0", {**asked["baseline-s0"], "n_layer": recorded_layers})
    record = json.loads((out / "baseline-s0" / "config.json").read_text())
    del record["args"]["n_layer"]
    (out / "baseline-s0" / "config.json").write_text(json.dumps(record))
    if outcome == "finished":
        assert compare.prior_run(out / "baseline-s0", asked["baseline-s0"], data_print) == "finished"
    else:
        with pytest.raises(compare.UserError, match=outcome):
            compare.prior_run(out / "baseline-s0", asked["baseline-s0"], data_print)


@pytest.fixture
def read_only(tmp_path, monkeypatch):
    """A folder that cannot be written: chmod 0o500, and where that does not stop this user (root), its
    folders' creation refused as the system would refuse it (PermissionError)."""
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o500)
    if os.access(folder, os.W_OK):
        mkdir = os.mkdir

        def refused(path, *args, **kwargs):
            if os.path.realpath(path).startswith(os.path.realpath(folder) + os.sep) or \
                    os.path.realpath(path) == os.path.realpath(folder):
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
            return mkdir(path, *args, **kwargs)
        monkeypatch.setattr(os, "mkdir", refused)
    yield folder
    folder.chmod(0o700)


@pytest.mark.parametrize("inside", [False, True], ids=["itself", "a_new_folder_in_it"])
def test_an_out_dir_that_cannot_be_written_is_one_line(inside, read_only, data, tmp_path, capsys, no_run_starts):
    """Status 1, as a full disk (the machine, not the command): one line before the first run, not each
    run's line and then "the run ... failed"."""
    out = read_only / "cmp" if inside else read_only
    err = error_line(capsys, compare.main, ["--methods", "baseline", "--out_dir", out, "--data", data, *TINY],
                     status=1)
    assert err.startswith(f"compare.py: error: --out_dir: cannot write into {out} (Permission denied)"), err
    assert files_in(read_only) == []


def error_and_output(capsys, argv, status):
    """error_line's one line of compare.main(argv), and what it printed on stdout before it."""
    with pytest.raises(SystemExit) as exit:
        compare.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert exit.value.code == status and err.count("\n") == 1 and err.startswith("compare.py: error: "), err
    return err.strip(), out


@pytest.mark.parametrize("jobs", [1, 2])
def test_after_a_run_fails_no_other_starts(jobs, data, tmp_path, stand_ins, capsys):
    """--jobs 1: the failed run was the only one under way; --jobs 2: the one beside it finishes (it ends
    after two more polls), and no other starts."""
    started, plan = stand_ins
    plan.update({"baseline-s0": dict(status=1), "hyper-s0": dict(polls=2)})
    err, out = error_and_output(capsys, ["--out_dir", tmp_path, "--data", data, "--jobs", jobs, *TINY], status=1)
    assert [run.name for run in started] == ["baseline-s0", "hyper-s0"][:jobs]
    left = 4 - jobs
    assert f"{tmp_path / 'baseline-s0'} failed" in err and f"{left} other runs not started" in err, err
    assert "=== baseline-s0: failed after 0 s (exit status 1)" in out
    assert ("=== hyper-s0: finished in 0 s (1 of 4 done, 3 left" in out) == (jobs == 2)  # (then the time to go)


@pytest.mark.parametrize("jobs", [1, 2])
@pytest.mark.parametrize("checkpoint", [False, True], ids=["none_yet", "resumed_run"])
@pytest.mark.parametrize("moment", ["waiting", "starting"])
def test_ctrl_c_while_the_runs_start_says_whether_a_checkpoint_exists(moment, jobs, checkpoint, data, tmp_path,
                                                                     stand_ins, capsys):
    """The Ctrl-C comes while compare.py waits on its first runs, or while it starts the first (before that
    run is among those under way), which have saved nothing yet (a run that goes on from an earlier
    checkpoint has one). Every run under way gets it, no other starts, status 130."""
    started, plan = stand_ins
    out, argv = tmp_path / "cmp", ["--out_dir", tmp_path / "cmp", "--data", data, "--jobs", jobs, *TINY]
    if checkpoint:
        _, asked, data_print = resolved(argv, out)
        record_run(out / "baseline-s0", asked["baseline-s0"], finished=False, data_print=data_print)
    ctrl_c = {"on_wait" if moment == "waiting" else "on_start": lambda *run: signal.raise_signal(signal.SIGINT)}
    plan["baseline-s0"] = dict(polls=None, **ctrl_c)
    plan["hyper-s0"] = dict(polls=None)
    err = error_line(capsys, compare.main, argv, status=130)
    under_way = jobs if moment == "waiting" else 1  # a Ctrl-C while the first starts: the second never does
    assert [(run.name, run.signals) for run in started] == [(f"{n}-s0", [signal.SIGINT]) for n in
                                                            ("baseline", "hyper")][:under_way]
    if checkpoint:
        assert err.startswith("compare.py: error: interrupted (SIGINT); baseline-s0 stopped at a checkpoint"), err
    else:
        assert "had no checkpoint yet" in err and "stopped at a checkpoint" not in err, err
    assert err.endswith("run the same command to go on")


def test_ctrl_c_before_the_runs_start_is_one_line(data, tmp_path, capsys, monkeypatch, no_run_starts):
    """Before any run starts (while lm-eval's tasks are indexed, say): status 130 and one line, not a
    KeyboardInterrupt traceback."""
    def interrupted(*args):
        raise KeyboardInterrupt
    monkeypatch.setattr(compare, "check_eval", interrupted)
    try:
        err = error_line(capsys, compare.main, ["--out_dir", tmp_path, "--data", data, *TINY], status=130)
    except KeyboardInterrupt:  # escaping, it would stop pytest itself
        pytest.fail("compare.main let the KeyboardInterrupt through")
    assert err == ("compare.py: error: interrupted (SIGINT) while no run was training; the finished runs are kept: "
                   "run the same command to go on")


def test_each_finished_run_says_how_long_it_took_and_what_is_left(tmp_path, stand_ins, capsys, monkeypatch):
    """Runs of 42 s, 75 s and 3,700 s on the clock compare.py reads when each starts and ends (and once
    before the first): the time to go at the pace so far, 42 s a run, then 117 / 2."""
    clock = iter([0, 0, 42, 42, 117, 117, 3817])
    monkeypatch.setattr(compare, "time", SimpleNamespace(monotonic=lambda: next(clock), sleep=time.sleep))
    commands = {tmp_path / name: ["python", "train.py", "--out_dir", str(tmp_path / name)] for name in "abc"}
    compare.train_all(commands, jobs=1)
    lines = [line for line in capsys.readouterr().out.splitlines() if "finished in" in line]
    assert lines == ["=== a: finished in 42 s (1 of 3 done, 2 left, about 1 min 24 s to go)",
                     "=== b: finished in 1 min 15 s (2 of 3 done, 1 left, about 58 s to go)",
                     "=== c: finished in 1 h 1 min (3 of 3 done)"]



@pytest.mark.parametrize("done, total, words", [
    (0, 0, "0 of 0 done"), (0, 1, "0 of 1 done, 1 left"), (1, 1, "1 of 1 done"), (3, 8, "3 of 8 done, 5 left"),
    (7, 8, "7 of 8 done, 1 left"),
])
def test_progress_in_words(done, total, words):
    assert compare.progress(done, total) == words


def test_a_wait_of_minutes_says_which_runs_are_under_way_and_where(tmp_path, monkeypatch):
    """wait_any calls the heartbeat after each `every_s` seconds without an exit (none before the first
    interval, none once a run has ended); under_way names each run with the last step its output logged."""
    clock = iter([0, 0, 30, 59.9, 60, 60, 90, 120, 120, 150])  # the start, each poll, the restart at a beat
    monkeypatch.setattr(compare, "time", SimpleNamespace(monotonic=lambda: next(clock), sleep=lambda s: None))
    polls, beats = iter([None] * 7 + [0]), []
    running = SimpleNamespace(poll=lambda: next(polls))
    assert compare.wait_any([running], heartbeat=lambda: beats.append(len(beats)), every_s=60) is running
    assert beats == [0, 1]                                            # at 60 and at 120, not at 59.9
    (tmp_path / "a.out").write_text("model tiny\nstep 10/750 | loss 5.1\nstep 300/750 | val loss 4.2\n"
                                    "saved ckpt.pt\n")
    (tmp_path / "b.out").write_text("preparing the built-in corpus (once) ...\n")
    runs = [(tmp_path / "a", open(tmp_path / "a.out"), 0), (tmp_path / "b", open(tmp_path / "b.out"), 0),
            (tmp_path / "c", None, 0)]
    assert compare.under_way(runs) == "a at step 300/750, b starting, c running"
    assert compare.last_step(tmp_path / "gone.out") == "starting"
    (tmp_path / "long.out").write_text("step 5/9 | loss 1\n" + "x" * 9000)        # past the tail read
    assert compare.last_step(tmp_path / "long.out") == "starting"
    assert compare.last_step(tmp_path / "long.out", tail_bytes=10**5) == "at step 5/9"
    line = b"step 7/9 | loss 1\n"                     # the tail's first bytes, 8192 of them by default
    (tmp_path / "edge.out").write_bytes(b"step 6/9 | loss 1\n" + line + b"x" * (8192 - len(line)))
    assert compare.last_step(tmp_path / "edge.out") == "at step 7/9"
    (tmp_path / "edge.out").write_bytes(b"step 6/9 | loss 1\n" + line + b"x" * (8192 - len(line) + 1))
    assert compare.last_step(tmp_path / "edge.out") == "starting"  # its "s" one byte outside: cut


@pytest.mark.parametrize("saved, unsaved, words", [
    ([], [], "no run was under way"), (["a"], [], "a stopped at a checkpoint"),
    ([], ["a", "b"], "a, b had no checkpoint yet (started again next time)"),
    (["a"], ["b"], "a stopped at a checkpoint; b had no checkpoint yet"),
])
def test_the_interrupted_line_says_which_runs_have_a_checkpoint(saved, unsaved, words):
    line = compare.interrupted(signal.SIGTERM, [Path(n) for n in saved], [Path(n) for n in unsaved])
    assert line.startswith(f"interrupted (SIGTERM); {words}") and line.endswith(": run the same command to go on")


@pytest.mark.parametrize("text, whole", [
    ("", False), ("{", False), ('{"finished": true', False), ("[1]", False), ('{"finished": true}', False),
    ('{"finished": false, "params": 1, "tail_val_loss": 3, "tokens_per_s": 1, "peak_mem": 0, "step": 4}', False),
    ('{"finished": true, "params": 1, "tail_val_loss": 3, "tokens_per_s": null, "peak_mem": 0, "step": 4}', True),
], ids=["empty", "brace", "torn", "list", "no_numbers", "unfinished", "finished"])
def test_a_summary_is_finished_only_whole_and_finished(text, whole, tmp_path):
    (tmp_path / "summary.json").write_bytes(text.encode())
    assert compare.finished(compare.read_json(tmp_path / "summary.json")) == whole
    assert compare.read_json(tmp_path / "absent.json") is None


def row(name, variant, baseline, seed, loss):
    return dict(name=name, variant=variant, baseline=baseline, seed=seed, tail_val_loss=loss, params=1000,
                tokens_per_s=1.0, peak_mem=2**30)


def test_paired_differences_on_hand_made_losses():
    rows = [row(f"baseline-s{s}", "baseline", None, s, loss) for s, loss in ((0, 3.0), (1, 3.5), (2, 2.75))]
    rows += [row(f"mhar-s{s}", "mhar", "baseline", s, loss) for s, loss in ((0, 2.75), (1, 3.5), (2, 3.0))]
    rows += [row("hyper-s1", "hyper", "baseline", 1, 3.25), row("hyper-s7", "hyper", "baseline", 7, 1.0)]
    pairs = {p["variant"]: p for p in compare.paired(rows)}
    # mhar - baseline per seed: -0.25, 0, +0.25: mean 0, sample std 0.25, standard error 0.25 / sqrt(3)
    assert pairs["mhar"]["deltas"] == [-0.25, 0.0, 0.25] and pairs["mhar"]["seeds"] == [0, 1, 2]
    assert (pairs["mhar"]["n"], pairs["mhar"]["mean"]) == (3, 0.0)
    assert pairs["mhar"]["se"] == pytest.approx(0.25 / math.sqrt(3))
    assert (pairs["hyper"]["n"], pairs["hyper"]["mean"], pairs["hyper"]["se"]) == (1, -0.25, None)  # no baseline-s7
    deltas = {r["name"]: r["delta"] for r in compare.with_deltas(rows)}
    assert deltas == {"baseline-s0": None, "baseline-s1": None, "baseline-s2": None, "mhar-s0": -0.25,
                      "mhar-s1": 0.0, "mhar-s2": 0.25, "hyper-s1": -0.25, "hyper-s7": None}
    text = compare.report(rows)
    assert "| mhar | baseline | 0,1,2 | 3 | +0.0000 ± 0.1443 |" in text
    assert "| hyper | baseline | 1 | 1 | -0.2500 |" in text
    assert "| mhar-s0 | 1,000 | 2.7500 | -0.2500 | 1 | 1.00 GiB |" in text
    assert "| hyper-s7 | 1,000 | 1.0000 | — | 1 | 1.00 GiB |" in text
    assert "baseline over 3 seeds: 3.0833 ± 0.3819 (sample standard deviation)" in text


def test_versus_pairs_every_routed_method_with_the_control_at_the_same_seed():
    rows = [row("baseline-s0", "baseline", None, 0, 3.0), row("attnres-T4-s0", "attnres-T4", "baseline", 0, 2.9),
            row("mhar-H4-s0", "mhar-H4", "baseline", 0, 2.8), row("baseline-s1", "baseline", None, 1, 3.1),
            row("attnres-T4-s1", "attnres-T4", "baseline", 1, 3.0), row("mhar-H4-s1", "mhar-H4", "baseline", 1, 2.95)]
    (pair,) = compare.paired(compare.versus(rows, "attnres-T4"))
    assert (pair["variant"], pair["baseline"], pair["seeds"]) == ("mhar-H4", "attnres-T4", [0, 1])
    assert pair["deltas"] == pytest.approx([-0.1, -0.05]) and pair["mean"] == pytest.approx(-0.075)
    assert pair["se"] == pytest.approx(0.025)  # sample std 0.05 / sqrt(2), over sqrt(2)
    text = compare.report(rows, against=["attnres-T4"])
    assert "Paired with attnres-T4" in text and "| mhar-H4 | attnres-T4 | 0,1 | 2 | -0.0750 ± 0.0250 |" in text
    assert "| attnres-T4 | baseline | 0,1 | 2 | -0.1000 ± 0.0000 |" in text  # the baseline's table is kept


def test_paired_curves_average_the_seeds_differences_at_the_steps_both_evaluated():
    rows = [row("baseline-s0", "baseline", None, 0, 0), row("mhar-s0", "mhar", "baseline", 0, 0),
            row("baseline-s1", "baseline", None, 1, 0), row("mhar-s1", "mhar", "baseline", 1, 0)]
    val = lambda *losses: [{"step": 10 * (i + 1), "val_loss": v} for i, v in enumerate(losses)]  # noqa: E731
    logs = {"baseline-s0": val(3.0, 2.5) + [{"step": 25, "loss": 2.0}], "mhar-s0": val(2.9, 2.3, 2.2),
            "baseline-s1": val(3.2, 2.6), "mhar-s1": val(3.0, 2.5)}
    steps, means, ses = compare.paired_curves(rows, logs)["mhar"]
    assert steps == [10, 20]  # step 30: mhar-s0 alone; step 25: a training line
    assert means == pytest.approx([-0.15, -0.15]) and ses == pytest.approx([0.05, 0.05])


def test_paired_curves_keep_each_method_to_its_own_runs():
    """Two methods over one baseline, and a second shape with its own: each curve is its own runs minus their
    baseline, never another method's differences mixed in."""
    val = lambda *losses: [{"step": 10 * (i + 1), "val_loss": v} for i, v in enumerate(losses)]  # noqa: E731
    rows = [row("baseline-s0", "baseline", None, 0, 0), row("attnres-s0", "attnres", "baseline", 0, 0),
            row("mhar-s0", "mhar", "baseline", 0, 0), row("baseline-kv2-s0", "baseline-kv2", None, 0, 0),
            row("mhar-kv2-s0", "mhar-kv2", "baseline-kv2", 0, 0)]
    logs = {"baseline-s0": val(3.0, 2.5), "attnres-s0": val(2.75, 2.0), "mhar-s0": val(2.5, 1.5),
            "baseline-kv2-s0": val(4.0, 3.0), "mhar-kv2-s0": val(3.0, 2.75)}
    assert compare.paired_curves(rows, logs) == {"attnres": ([10, 20], [-0.25, -0.5], [None, None]),
                                                 "mhar": ([10, 20], [-0.5, -1.0], [None, None]),
                                                 "mhar-kv2": ([10, 20], [-1.0, -0.25], [None, None])}


def test_the_tables_take_extra_columns(monkeypatch):
    """A later metric (an lm-eval score, say) is one more entry in the column lists and the rows."""
    rows = [{**row("baseline-s0", "baseline", None, 0, 3.0), "hellaswag": 0.25},
            {**row("mhar-s0", "mhar", "baseline", 0, 2.9), "hellaswag": 0.375}]
    monkeypatch.setattr(compare, "RUN_COLUMNS", compare.RUN_COLUMNS + [("hellaswag", lambda r: f"{r['hellaswag']:.3f}")])
    text = compare.report(rows)
    assert text.splitlines()[-1].endswith("| 0.375 |") and "| hellaswag |" in text
    assert compare.paired(rows, key="hellaswag")[0]["deltas"] == [0.125]


def test_results_json_holds_the_rows_pairs_versus_tables_flags_and_tasks():
    rows = [{**row(f"{v}-s{s}", v, None if v == "baseline" else "baseline", s, loss), "full_val_loss": loss - 0.5}
            for v, losses in (("baseline", (3.0, 3.5)), ("attnres", (3.25, 3.25)), ("mhar", (2.75, 3.0)))
            for s, loss in enumerate(losses)]
    results = compare.results_of(rows, ["full_val_loss"], ["attnres"], ("--preset", "tiny"), ("hellaswag",))
    assert list(results) == ["rows", "pairs", "versus", "train_flags", "eval_tasks"]
    assert [r["delta"] for r in results["rows"]] == [None, None, 0.25, -0.25, -0.25, -0.5]
    assert [(p["variant"], p["mean"], p["full_val_loss"]["mean"]) for p in results["pairs"]] == [
        ("attnres", 0.0, 0.0), ("mhar", -0.375, -0.375)]
    assert [(p["variant"], p["baseline"], p["deltas"]) for p in results["versus"]["attnres"]] == [
        ("mhar", "attnres", [-0.5, -0.25])]
    assert (results["train_flags"], results["eval_tasks"]) == (["--preset", "tiny"], ["hellaswag"])
    assert json.loads(json.dumps(results)) == results  # as results.json holds it


def test_results_md_is_its_parts_each_after_a_blank_line():
    """The paired table, each --versus table, the per-run table and the baselines' spread: blocks separated by one
    blank line, each table's header its block's first line after its sentence."""
    rows = [row(f"{v}-s{s}", v, None if v == "baseline" else "baseline", s, loss)
            for v, losses in (("baseline", (3.0, 3.5)), ("attnres", (3.25, 3.25)), ("mhar", (2.75, 3.0)))
            for s, loss in enumerate(losses)]
    blocks = compare.report(rows, against=["attnres"]).split("\n\n")
    assert [b.split("\n")[0][:12] for b in blocks] == [
        "Paired: each", "| method | p", "Paired with ", "| method | p", "| run | para", "baseline ove"]
    assert blocks[0] == ("Paired: each method minus the baseline of the same shape and seed (same initialization "
                         "seed, same batches); mean ± standard error over the n seeds (n = 1: no error bar).")
    assert blocks[2] == "Paired with attnres: each routed method minus attnres at the same seed."
    assert blocks[-1] == "baseline over 2 seeds: 3.2500 ± 0.3536 (sample standard deviation): the noise between seeds."


def test_only_baselines_draw_the_loss_curves_alone(tmp_path):
    """No run is paired (--methods baseline): loss_curves.png, and no paired_curves.png (it would be empty)."""
    pytest.importorskip("matplotlib")
    rows = []
    for s in (0, 1):
        (tmp_path / f"baseline-s{s}").mkdir()
        (tmp_path / f"baseline-s{s}" / "log.jsonl").write_text(
            "".join(json.dumps(dict(step=k, loss=3.0 - k / 10, val_loss=3.1 - k / 10)) + "\n" for k in (1, 2)))
        rows.append({**row(f"baseline-s{s}", "baseline", None, s, 3.0), "path": str(tmp_path / f"baseline-s{s}")})
    assert compare.write_figures(rows, tmp_path) == [tmp_path / "loss_curves.png"]
    assert not (tmp_path / "paired_curves.png").exists()
    rows.append({**row("mhar-s0", "mhar", "baseline", 0, 2.9), "path": str(tmp_path / "baseline-s1")})
    assert compare.write_figures(rows, tmp_path) == [tmp_path / "loss_curves.png", tmp_path / "paired_curves.png"]


@pytest.mark.parametrize("signum", [None, signal.SIGTERM], ids=["runs-ended", "a-signal-stopped-them"])
def test_compare_as_the_script_takes_signals_again_once_its_runs_end(signum, tmp_path, stand_ins, monkeypatch):
    """compare.py as the script (its __main__): once every run has ended, SIGINT and SIGTERM have their handlers
    of before (a Ctrl-C while the runs are evaluated or the tables written stops it: one line, 130); once a
    signal stopped the runs, compare.py is exiting and ignores any other (no traceback in its teardown)."""
    monkeypatch.setattr(sys.modules["__main__"], "__file__", str(ROOT / "compare.py"))
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        commands = {tmp_path / "a-s0": ["python", "train.py", "--out_dir", str(tmp_path / "a-s0")]}
        if signum is None:
            compare.train_all(commands, jobs=1)
            assert {s: signal.getsignal(s) for s in before} == before
        else:
            started, plan = stand_ins
            plan["a-s0"] = dict(on_start=lambda: os.kill(os.getpid(), signum))
            with pytest.raises(SystemExit):
                compare.train_all(commands, jobs=1)
            assert {s: signal.getsignal(s) for s in before} == {s: signal.SIG_IGN for s in before}
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


# ----------------------------------------------------------------------------------------------
# --plan: each run's parameters, tokens, FLOPs and hours, without training, data or a GPU.

def plan_of(capsys, argv):
    """compare.py --plan's output: ({run: its table row's cells by column}, the text above the table, the
    total line)."""
    compare.main([str(a) for a in [*argv, "--plan"]])
    head, table, total = capsys.readouterr().out.strip().split("\n\n")
    header, _, *lines = [[cell.strip() for cell in line.strip("|").split("|")] for line in table.splitlines()]
    return {cells[0]: dict(zip(header, cells)) for cells in lines}, head, total


def number(cell):
    return float(cell.replace(",", ""))


@pytest.mark.parametrize("flags, device, mfu", [
    ([], "NVIDIA H100 80GB HBM3", 0.4),
    (["--plan_device", "NVIDIA A100-SXM4-80GB", "--plan_mfu", "1"], "NVIDIA A100-SXM4-80GB", 1.0),
    (["--plan_device", "NVIDIA H100 PCIe", "--plan_mfu", "0.25"], "NVIDIA H100 PCIe", 0.25),
], ids=["default-h100-at-0.4", "a100-at-1", "h100-pcie-at-0.25"])
def test_the_plan_is_a_line_per_run_of_its_parameters_tokens_flops_and_hours(flags, device, mfu, tmp_path, capsys,
                                                                             no_run_starts):
    """Each run's parameters are those of its model built the normal way (the vocabulary of --data's meta.json),
    its tokens max_steps x the global batch x seq_len, its FLOPs flops_per_token() x tokens, its hours those
    FLOPs at mfu of the device's peak; the total is their sum, said to be an estimate at the assumed MFU."""
    meta_only = tmp_path / "data"  # no token files: the plan reads none
    meta_only.mkdir()
    (meta_only / "meta.json").write_text(json.dumps({"tokenizer": "none", "vocab_size": VOCAB}))
    rows, head, total = plan_of(capsys, ["--methods", "baseline,mhar", "--seeds", "0,1", "--data", meta_only,
                                         "--out_dir", tmp_path / "cmp", *TINY, *flags])
    assert list(rows) == ["baseline-s0", "mhar-s0", "baseline-s1", "mhar-s1"]
    tokens, peak, hours = 4 * 8 * 32, PEAK_FLOPS[device], 0  # --max_steps 4 x tiny's global batch 8 x --seq_len 32
    for name, row in rows.items():
        model = mhar.GPT(mhar.preset("tiny", vocab_size=VOCAB, seq_len=32, residual=name.split("-")[0]))
        flops = model.flops_per_token() * tokens
        assert number(row["parameters"]) == model.num_params()
        assert (row["steps x batch x seq_len"], number(row["tokens"])) == ("4 x 8 x 32", tokens)
        assert number(row["training FLOPs/token"]) == model.flops_per_token()
        assert number(row["training FLOPs"]) == pytest.approx(flops, rel=1e-3)
        assert number(row["hours"]) == pytest.approx(flops / (peak * mfu) / 3600, rel=5e-3)
        hours += flops / (peak * mfu) / 3600
    assert number(total.split()[1]) == pytest.approx(hours, rel=5e-3)
    for text in (head, total):
        assert f"on one {device} ({peak / 1e12:g} TFLOP/s" in text and f"assumed MFU of {mfu:g}" in text
        assert "an estimate from the FLOP count" in text and "not a measurement" in text
    assert files_in(tmp_path) == ["data", "data/meta.json"]  # no --out_dir


@pytest.mark.parametrize("preset, flags, params", [
    ("tiny", [], "3,318,784"),
    ("100m", ["--device", "cuda", "--fused"], "63,544,320"),
], ids=["tiny", "100m-cuda-fused-on-a-cpu"])
def test_the_plan_writes_nothing_reads_no_data_and_needs_no_gpu(preset, flags, params, tmp_path, monkeypatch, capsys,
                                                               no_run_starts):
    """Not the --out_dir, nor the preset's built-in corpus (which training would prepare); --device cuda and
    --fused are not checked (here without triton: kernel.py's import fails), and a 100m model is built without
    its memory."""
    monkeypatch.setitem(sys.modules, "triton", None)
    monkeypatch.delitem(sys.modules, "kernel", raising=False)
    monkeypatch.chdir(tmp_path)
    rows, _, _ = plan_of(capsys, ["--preset", preset, "--methods", "baseline,mhar", *flags])
    assert rows["mhar-s0"]["parameters"] == params and files_in(tmp_path) == []


@pytest.mark.parametrize("argv, message", [
    (["--plan_device", "H100"], "--plan_device 'H100' has no peak in lib/common.PEAK_FLOPS: choose from "
                                + ", ".join(map(repr, PEAK_FLOPS))),
    (["--plan_mfu", "0"], "--plan_mfu must be in (0, 1] (a share of the peak, e.g. 0.4), got 0.0"),
    (["--plan_mfu", "-1"], "--plan_mfu must be in (0, 1] (a share of the peak, e.g. 0.4), got -1.0"),
    (["--plan_mfu", "1.5"], "--plan_mfu must be in (0, 1] (a share of the peak, e.g. 0.4), got 1.5"),
    (["--plan_mfu", "nan"], "--plan_mfu must be in (0, 1] (a share of the peak, e.g. 0.4), got nan"),
    (["--plan_mfu", "inf"], "--plan_mfu must be in (0, 1] (a share of the peak, e.g. 0.4), got inf"),
    (["--plan_mfu", "high"], "argument --plan_mfu: invalid float value: 'high'"),
], ids=["unknown_device", "mfu_zero", "mfu_negative", "mfu_above_one", "mfu_nan", "mfu_inf", "mfu_a_word"])
def test_a_bad_plan_device_or_mfu_is_one_line(argv, message, tmp_path, capsys, no_run_starts):
    err = error_line(capsys, compare.main, ["--preset", "tiny", "--plan", *argv, "--out_dir", tmp_path / "cmp"])
    assert err.startswith(f"compare.py: error: {message}"), err
    assert not (tmp_path / "cmp").exists()


@pytest.mark.parametrize("flag, value", [("--plan_device", "NVIDIA H200"), ("--plan_mfu", "0.5")])
def test_the_plans_flags_without_plan_are_one_line(flag, value, capsys):
    err = error_line(capsys, compare.parse_args, [flag, value])
    assert err == "compare.py: error: --plan_device and --plan_mfu go with --plan"


# ----------------------------------------------------------------------------------------------
# Tiny real runs, evaluated with eval.py on lm-eval tasks over local files (offline).

WORDS = "the a cat dog man sat ran on to by mat rug sea hill old big".split()
EVAL_TASKS = "words_choice,words_next,words_text"
METRICS = ["words_choice/acc", "words_next/exact_match", "words_text/word_perplexity"]


@pytest.fixture(scope="module")
def words(tmp_path_factory):
    """(a prepare.py corpus of random sentences, written by a BPE tokenizer of 64 ids; a folder of three
    offline lm-eval tasks over the same words: multiple choice, generation, perplexity)."""
    needs("tokenizers"), needs("lm_eval")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    folder = tmp_path_factory.mktemp("words")
    rng = random.Random(0)
    sentences = [" ".join(rng.choices(WORDS, k=8)) + "." for _ in range(800)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<|endoftext|>"])
    tok.train_from_iterator(sentences, trainer)
    (folder / "tokenizer").mkdir()
    tok.save(str(folder / "tokenizer" / "tokenizer.json"))
    corpus = folder / "corpus.jsonl"  # a document of 10 sentences per line
    corpus.write_text("".join(json.dumps({"text": " ".join(sentences[i:i + 10])}) + "\n"
                              for i in range(0, len(sentences), 10)))
    data = prepare.main(["--input", str(corpus), "--tokenizer", str(folder / "tokenizer"),
                         "--out", str(folder), "--name", "words", "--val_fraction", "0.1", "--quiet"])
    tasks = folder / "tasks"
    tasks.mkdir()
    write_task(tasks, "words_choice", [dict(context=" ".join(rng.choices(WORDS, k=5)),
                                            choices=[" " + w for w in rng.sample(WORDS, 3)], label=0)
                                       for _ in range(4)],
               output_type="multiple_choice", doc_to_text="{{context}}", doc_to_choice="{{choices}}",
               doc_to_target="{{label}}", target_delimiter="", metric_list=[{"metric": "acc"}])
    write_task(tasks, "words_next", [dict(prompt=s[:20], answer=s[20:]) for s in sentences[:3]],
               output_type="generate_until", doc_to_text="{{prompt}}", doc_to_target="{{answer}}",
               generation_kwargs={"until": ["."], "max_gen_toks": 8}, metric_list=[{"metric": "exact_match"}])
    write_task(tasks, "words_text", [dict(text=" ".join(sentences[:6]))], output_type="loglikelihood_rolling",
               doc_to_text="", doc_to_target="{{text}}", metric_list=[{"metric": "word_perplexity"}])
    return data, tasks


@pytest.fixture(scope="module")
def compared(words, tmp_path_factory):
    """One comparison: baseline and mhar at seed 0, the baseline at seed 1, each evaluated on the three
    tasks."""
    data, tasks = words
    out = tmp_path_factory.mktemp("compare")
    argv = ["--methods", "baseline,mhar", "--baseline_seeds", "1", "--out_dir", str(out),
            "--eval_tasks", EVAL_TASKS, "--eval_include", str(tasks),
            "--preset", "tiny", "--data", str(data), "--seq_len", "32", "--batch_size", "4", "--max_steps", "4",
            "--warmup_steps", "1", "--eval_interval", "2", "--eval_batches", "2", "--log_interval", "1",
            "--device", "cpu"]
    compare.main(argv)
    rows = {r["name"]: r for r in json.loads((out / "results.json").read_text())["rows"]}
    return out, argv, rows


@pytest.mark.slow
def test_compare_trains_each_method_then_writes_the_tables_and_the_figure(compared):
    out, _, rows = compared
    results = json.loads((out / "results.json").read_text())
    assert list(rows) == ["baseline-s0", "mhar-s0", "baseline-s1"]
    c = mhar.preset("tiny", vocab_size=VOCAB, seq_len=32)
    assert rows["mhar-s0"]["params"] - rows["baseline-s0"]["params"] == (2 * c.n_layer + 1) * 2 * c.n_embd
    summaries = {name: json.loads((out / name / "summary.json").read_text()) for name in rows}
    for name, r in rows.items():  # each row is the run's own summary.json
        assert r["tail_val_loss"] == summaries[name]["tail_val_loss"] and summaries[name]["finished"]
        assert r["full_val_loss"] == summaries[name]["full_val_loss"] != r["tail_val_loss"]
    delta = summaries["mhar-s0"]["tail_val_loss"] - summaries["baseline-s0"]["tail_val_loss"]  # seed 0 with seed 0
    whole = summaries["mhar-s0"]["full_val_loss"] - summaries["baseline-s0"]["full_val_loss"]
    assert results["pairs"][0]["full_val_loss"]["deltas"] == [whole]  # the whole split's paired too
    assert rows["mhar-s0"]["delta"] == delta and rows["baseline-s1"]["delta"] is None
    (pair,) = results["pairs"]
    assert {k: pair[k] for k in ("variant", "baseline", "seeds", "deltas", "n", "mean", "se")} == dict(
        variant="mhar", baseline="baseline", seeds=[0], deltas=[delta], n=1, mean=delta, se=None)
    table = (out / "results.md").read_text()
    assert f"| mhar | baseline | 0 | 1 | {delta:+.4f} |" in table and "baseline over 2 seeds" in table
    assert (out / "loss_curves.png").read_bytes()[:8] == PNG_SIGNATURE
    assert (out / "paired_curves.png").read_bytes()[:8] == PNG_SIGNATURE


class FinishedProcess:
    """A train.py process that has already ended well."""
    returncode = 0

    def poll(self):
        return 0

    def wait(self):
        return 0


@pytest.mark.parametrize("cores, jobs, preset, threads", [
    (8, 1, None, None), (8, 2, None, "4"), (8, 3, None, "2"), (8, 8, None, "1"), (8, 9, None, "1"),
    (None, 2, None, "1"), (8, 2, "5", "5"),
], ids=["one-job-inherits", "two-jobs", "three-jobs-rounded-down", "a-core-each", "more-jobs-than-cores",
        "cores-unknown", "the-users-setting-kept"])
def test_each_job_takes_its_share_of_the_cores(cores, jobs, preset, threads, tmp_path, monkeypatch, capsys):
    """--jobs N: every run's OMP_NUM_THREADS is the cores / N, rounded down, at least 1; one job, or a value the
    user set, is left as it is."""
    envs = []
    monkeypatch.setattr(compare.subprocess, "Popen", lambda command, env, **kwargs: envs.append(env)
                        or FinishedProcess())
    monkeypatch.setattr(compare.os, "cpu_count", lambda: cores)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    if preset:
        monkeypatch.setenv("OMP_NUM_THREADS", preset)
    compare.train_all({tmp_path / "a-s0": ["python", "train.py"], tmp_path / "b-s0": ["python", "train.py"]}, jobs)
    assert len(envs) == 2 and all(env.get("OMP_NUM_THREADS") == threads for env in envs)


@pytest.mark.parametrize("ends_at, beats", [(59.5, 0), (60.5, 1), (120.5, 2)], ids=["59.5-s", "60.5-s", "120.5-s"])
def test_the_heartbeat_comes_each_minute_of_waiting(ends_at, beats, monkeypatch):
    """wait_any's heartbeat: after every 60 s that no run ends (by default), none before."""
    clock = [0.0]
    monkeypatch.setattr(compare.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(compare.time, "sleep", lambda s: clock.__setitem__(0, clock[0] + s))
    process = types.SimpleNamespace(poll=lambda: 0 if clock[0] >= ends_at else None)
    calls = []
    assert compare.wait_any([process], poll_s=0.5, heartbeat=lambda: calls.append(clock[0])) is process
    assert calls == [60.0 * (k + 1) for k in range(beats)]


@pytest.mark.slow
def test_jobs_train_runs_side_by_side_each_with_its_output_in_a_file(data, tmp_path):
    """--jobs 2: both runs train at once, each writing <run>.out; the temperature reaches the run's model."""
    out = tmp_path / "runs"
    compare.main(["--methods", "baseline,attnres-T4", "--jobs", "2", "--out_dir", str(out), "--preset", "tiny",
                  "--data", str(data), "--seq_len", "32", "--batch_size", "2", "--max_steps", "2",
                  "--warmup_steps", "1", "--eval_interval", "2", "--eval_batches", "1", "--device", "cpu"])
    rows = {r["name"]: r for r in json.loads((out / "results.json").read_text())["rows"]}
    assert list(rows) == ["baseline-s0", "attnres-T4-s0"]
    for name in rows:
        assert f"out {out / name}" in (out / f"{name}.out").read_text()  # train.py's header line
        assert json.loads((out / name / "summary.json").read_text())["finished"]
    config = json.loads((out / "attnres-T4-s0" / "config.json").read_text())
    assert config["config"]["route_temperature"] == 4.0


@pytest.mark.slow
def test_a_run_stopped_before_its_end_goes_on_from_its_checkpoint(data, tmp_path, capsys):
    """A comparison interrupted mid-run (train.py stopped at step 2 of 4, as Ctrl-C stops it) continues that run
    with --resume: its first steps are not trained again, and it ends as the uninterrupted run does."""
    import train
    out, shared = tmp_path / "runs", ["--preset", "tiny", "--data", str(data), "--seq_len", "32", "--batch_size",
                                      "2", "--max_steps", "4", "--warmup_steps", "1", "--eval_interval", "2",
                                      "--eval_batches", "1", "--log_interval", "1", "--device", "cpu"]
    train.main([*shared, "--residual", "baseline", "--seed", "0", "--out_dir", str(out / "baseline-s0"),
                "--stop_step", "2"])
    first = (out / "baseline-s0" / "log.jsonl").read_text()
    capsys.readouterr()
    compare.main(["--methods", "baseline", "--out_dir", str(out), *shared])
    assert "--out_dir " + str(out / "baseline-s0") + " --resume" in capsys.readouterr().out
    log = (out / "baseline-s0" / "log.jsonl").read_text()
    assert log.startswith(first) and json.loads(log.splitlines()[-1])["step"] == 4
    train.main([*shared, "--residual", "baseline", "--seed", "0", "--out_dir", str(tmp_path / "whole")])
    ended = [json.loads((folder / "summary.json").read_text()) for folder in (out / "baseline-s0", tmp_path / "whole")]
    assert ended[0]["final_val_loss"] == ended[1]["final_val_loss"]


@pytest.mark.slow
def test_eval_tasks_add_eval_pys_metrics_as_columns(compared, words):
    from scripts import eval
    out, _, rows = compared
    # the columns are eval.py's own numbers for the same run folder
    direct = eval.main(["--ckpt", str(out / "mhar-s0"), "--tasks", EVAL_TASKS,
                        "--include_path", str(words[1]), "--output", str(out / "direct.json"),
                        "--device", "cpu"])
    assert {m: rows["mhar-s0"][m] for m in METRICS} == eval.metrics(direct)
    for name in rows:  # each run's eval.json, as eval.py wrote it
        written = eval.metrics(json.loads((out / name / "eval.json").read_text()))
        assert {m: rows[name][m] for m in METRICS} == written
    delta = {m: rows["mhar-s0"][m] - rows["baseline-s0"][m] for m in METRICS}
    assert delta["words_text/word_perplexity"] != 0  # the runs differ, so a wrong pairing shows
    (pair,) = json.loads((out / "results.json").read_text())["pairs"]
    assert {m: (pair[m]["deltas"], pair[m]["se"]) for m in METRICS} == {
        m: ([delta[m]], None) for m in METRICS}
    table = (out / "results.md").read_text()
    # the whole val split's loss first (every run scored it), then the metrics; one seed: no t
    assert ("| Δ full_val_loss (mean ± s.e.) | t (df) of full_val_loss | Δ words_choice/acc (mean ± s.e.) | "
            "t (df) of words_choice/acc | Δ words_next/exact_match (mean ± s.e.) |") in table
    whole = rows["mhar-s0"]["full_val_loss"] - rows["baseline-s0"]["full_val_loss"]
    cells = " | ".join(f"{d:+.4f} | —" for d in (whole, *delta.values()))
    assert f"| mhar | baseline | 0 | 1 | {pair['mean']:+.4f} | — | {cells} |" in table
    run_cells = " | ".join(f"{rows['baseline-s1'][m]:.4f}" for m in ("full_val_loss", *METRICS))
    assert table.rstrip().splitlines()[-3].endswith(f" | {run_cells} |")  # before the seeds' spread


@pytest.mark.slow
def test_a_rerun_reuses_runs_and_evaluations(compared, monkeypatch):
    from scripts import eval
    out, argv, _ = compared
    first_log, table = (out / "baseline-s0" / "log.jsonl").read_text(), (out / "results.md").read_text()
    monkeypatch.setattr(eval, "evaluate", lambda *args, **kwargs: pytest.fail("evaluated again"))
    compare.main(argv)  # finished runs are neither trained nor evaluated again
    assert (out / "baseline-s0" / "log.jsonl").read_text() == first_log
    assert (out / "results.md").read_text() == table
    asked = []  # other settings evaluate again

    def evaluate(folder, tasks, **options):
        asked.append((folder.name, options["limit"]))
        return json.loads((folder / "eval.json").read_text())
    monkeypatch.setattr(eval, "evaluate", evaluate)
    compare.main(argv + ["--eval_limit", "2"])
    assert asked == [("baseline-s0", 2), ("mhar-s0", 2), ("baseline-s1", 2)]
    results = json.loads((out / "mhar-s0" / "eval.json").read_text())
    results["config"]["step"] -= 1  # an evaluation of an earlier checkpoint
    (out / "mhar-s0" / "eval.json").write_text(json.dumps(results))
    asked.clear()
    compare.main(argv)
    assert asked == [("mhar-s0", None)]


@pytest.mark.slow
@pytest.mark.parametrize("room", [0, 1], ids=["full-before-the-first", "full-after-the-first"])
def test_tables_that_cannot_be_written_keep_the_previous_ones(compared, monkeypatch, capsys, room):
    """The disk fills up before the tables are written, or between them: one line, exit status 1,
    results.md and results.json both as they were (never a new one beside an old one), no temporary
    file; the runs are kept for a rerun."""
    from scripts import eval
    out, argv, _ = compared
    before = {name: (out / name).read_text() for name in ("results.md", "results.json")}
    monkeypatch.setattr(eval, "evaluate", lambda folder, tasks, **options: json.loads(
        (folder / "eval.json").read_text()))                    # what the runs' evaluations said
    synced, fsync = [], os.fsync

    def full_disk(fd):
        if len(synced) == room:
            raise OSError(errno.ENOSPC, "No space left on device")
        synced.append(fsync(fd))
    monkeypatch.setattr(os, "fsync", full_disk)
    monkeypatch.setattr(compare, "report", lambda *args: "the new table")       # differs from before
    with pytest.raises(SystemExit) as exit:
        compare.main(argv)
    last = capsys.readouterr().err.splitlines()[-1]
    assert exit.value.code == 1 and last.startswith("compare.py: error: the tables: cannot write"), last
    assert "No space" in last
    assert {name: (out / name).read_text() for name in before} == before
    assert not list(out.glob(".tmp*")) and not list(out.glob("*.tmp"))


@pytest.mark.slow
def test_figures_that_cannot_be_written_keep_the_previous_ones(compared, monkeypatch, capsys):
    """The disk fills up while the loss curves are drawn, after the tables (half a PNG written): one line,
    exit status 1, not matplotlib's OSError traceback; both figures as they were, no staging folder."""
    from scripts import eval, probe
    out, argv, _ = compared
    before = {name: (out / name).read_bytes() for name in ("loss_curves.png", "paired_curves.png")}
    monkeypatch.setattr(eval, "evaluate", lambda folder, tasks, **options: json.loads(
        (folder / "eval.json").read_text()))                    # what the runs' evaluations said

    def full_disk(plt, curves, path):
        path.write_bytes(before["loss_curves.png"][:100])
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(probe, "plot_loss_curves", full_disk)
    with pytest.raises(SystemExit) as exit:
        compare.main(argv)
    last = capsys.readouterr().err.splitlines()[-1]
    assert exit.value.code == 1 and last.startswith("compare.py: error: the figures: cannot write into"), last
    assert "No space left on device" in last and "the tables are written" in last
    assert {name: (out / name).read_bytes() for name in before} == before
    assert not list(out.glob(".tmp*")) and not list(out.glob("*.tmp"))


def test_paired_metric_columns_on_hand_made_scores():
    rows = [{**row(f"baseline-s{s}", "baseline", None, s, 3.0), "t/acc": acc}
            for s, acc in enumerate((0.5, 0.25))]
    rows += [{**row(f"mhar-s{s}", "mhar", "baseline", s, 2.9), "t/acc": acc}
             for s, acc in enumerate((0.75, 0.75))]
    text = compare.report(rows, ["t/acc"])
    # mhar - baseline: +0.25, +0.5: mean 0.375, sample std 0.25 / sqrt(2), standard error 0.125, t = 3 with
    # 1 degree of freedom; the loss's differences are equal: no spread, no t
    assert "| mhar | baseline | 0,1 | 2 | -0.1000 ± 0.0000 | — | +0.3750 ± 0.1250 | t(1) = +3.0 |" in text
    assert "| mhar-s1 | 1,000 | 2.9000 | -0.1000 | 1 | 1.00 GiB | 0.7500 |" in text


@pytest.mark.parametrize("flags,message", [
    (["--eval_tasks", "words_choice,nope"], "unknown task nope: `lm-eval ls tasks` lists them"),
    (["--eval_tasks", "words_choice", "--eval_include", "missing"], "--eval_include missing is not a folder"),
    (["--eval_limit", "3"], "--eval_include and --eval_limit go with --eval_tasks"),
    (["--eval_tasks", "words_choice", "--eval_limit", "0"], "--eval_limit must be positive"),
    (["--eval_tasks", "words_choice", "--token_ids"], "--eval_tasks: "),
], ids=["unknown_task", "include_not_a_folder", "limit_without_tasks", "limit_zero", "token_ids_data"])
def test_bad_eval_flags_stop_before_training_with_one_line(flags, message, words, data, tmp_path, capsys,
                                                           monkeypatch):
    import lm_eval.tasks
    task_manager = lm_eval.tasks.TaskManager  # lm-eval's own ~15,000 tasks left out: indexing them takes 20 s
    monkeypatch.setattr(lm_eval.tasks, "TaskManager", lambda include_path=None, **kwargs:
                        task_manager(include_path=include_path, include_defaults=False))
    data_flag = str(data) if "--token_ids" in flags else str(words[0])
    flags = [f for f in flags if f != "--token_ids"]
    if "--eval_include" not in flags:
        flags += ["--eval_include", str(words[1])] if "--eval_tasks" in flags else []
    err = error_line(capsys, compare.main, [*flags, "--methods", "baseline", "--preset", "tiny",
                                            "--data", data_flag, "--out_dir", tmp_path / "runs"])
    assert err.startswith(f"compare.py: error: {message}"), err
    assert not (tmp_path / "runs").exists()


def running(pid):
    """Whether a process runs (a zombie does not: it has exited, unreaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
def test_a_signal_to_compare_alone_stops_its_run_at_a_checkpoint(data, tmp_path):
    """`kill PID` (or `timeout`) reaches compare.py alone: it passes the signal on to the run under way,
    which saves a checkpoint and stops; compare.py waits for it, then exits with 128 + the signal's number
    and one line; no run is left running, none other started, and the same command goes on from the
    checkpoint. (Their output goes to files: a run left running would hold a pipe open.)"""
    out, signum = tmp_path / "cmp", signal.SIGTERM  # SIGINT takes the same path (test_ctrl_c_while_the_runs_...)
    argv = ["--methods", "baseline,mhar", "--out_dir", out, "--data", data, *TINY, "--max_steps", "100000",
            "--eval_interval", "100000"]  # no checkpoint until the signal's
    with open(tmp_path / "stdout", "w") as stdout, open(tmp_path / "stderr", "w") as stderr:
        p = subprocess.Popen([sys.executable, "-m", "scripts.compare", *map(str, argv)], cwd=ROOT, stdout=stdout, stderr=stderr,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
    child, config = None, out / "baseline-s0" / "config.json"  # written once train.py handles the signals
    try:
        deadline = time.time() + 120
        while not config.exists():
            assert p.poll() is None and time.time() < deadline, (tmp_path / "stderr").read_text()
            time.sleep(0.05)
        child = int((out / "baseline-s0" / "train.lock").read_text().split("pid")[1])
        p.send_signal(signum)
        p.wait(timeout=120)
        stderr = (tmp_path / "stderr").read_text()
        ours = [line for line in stderr.splitlines() if line.startswith("compare.py")]
        assert p.returncode == 128 + signum and "Traceback" not in stderr, stderr
        assert ours == [f"compare.py: error: interrupted ({signal.Signals(signum).name}); baseline-s0 stopped at a "
                        f"checkpoint: run the same command to go on"], stderr
        assert not running(child) and not (out / "mhar-s0").exists()
    finally:  # nothing of this test left running, whatever failed
        for pid in (p.pid, child):
            if pid and running(pid):
                os.kill(pid, signal.SIGKILL)
        p.wait()
    assert "=== baseline-s0: stopped after" in (tmp_path / "stdout").read_text()
    assert (out / "baseline-s0" / "ckpt.pt").is_file() and not (out / "baseline-s0" / "summary.json").exists()
    _, asked, data_print = resolved(argv, out)
    assert compare.prior_run(out / "baseline-s0", asked["baseline-s0"], data_print) == "stopped"  # --resume
