"""compare.py: the runs of a comparison or a grid, their pairing with the baseline, the tables; then tiny real runs."""
import errno
import json
import math
import os
import random

import pytest

import compare
import mhar
import prepare
from helpers import PNG_SIGNATURE, VOCAB, error_line, files_in, needs, write_task


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
    listed, train_flags = runs("--methods", "baseline,attnres,attnres-T4,mhar-T0.5", "--seeds", "1")
    assert [(r.name, r.method, r.baseline) for r in listed] == [
        ("baseline-s1", "baseline", None), ("attnres-s1", "attnres", "baseline"),
        ("attnres-T4-s1", "attnres", "baseline"), ("mhar-T0.5-s1", "mhar", "baseline")]
    assert listed[2].flags == ["--residual", "attnres", "--route_temperature", "4", "--seed", "1"]
    compare.check_shapes(listed, train_flags)  # every one builds


@pytest.mark.parametrize("argv,message", [
    (["--route_heads", "1,2", "--n_kv_head", "3", "--preset", "tiny"],
     "run baseline-s0 cannot be built at preset tiny: Config.n_kv_head: 3 does not divide n_head=4"),
    (["--route_heads", "3", "--preset=tiny"], "run mhar-H3-s0 cannot be built at preset tiny: Config.route_heads"),
    (["--residual", "mhar"], "--residual is set per run by compare.py; leave it out"),
    (["--methods", "baseline,transformer"], "unknown method 'transformer'"),
    (["--methods", "baseline", "--route_heads", "2"], "--route_heads sweeps mhar's heads: add mhar to --methods"),
    (["--n_kv_head", "1,x"], "--route_heads and the shape flags take comma-separated integers"),
    (["--methods", "baseline,attnres-T0", "--preset", "tiny"],
     "run attnres-T0-s0 cannot be built at preset tiny: Config.route_temperature: must be a positive number"),
    (["--methods", "baseline-T2"], "unknown method 'baseline-T2'"),
    (["--methods", "baseline,mhar,baseline"], "--methods names a method twice"),
    (["--methods", ""], "unknown method ''"),
    (["--jobs", "0"], "--jobs must be at least 1"),
    (["--methods", "baseline,mhar", "--versus", "attnres"], "--versus attnres is not a routed method of this"),
    (["--methods", "baseline,mhar", "--versus", "baseline"], "--versus baseline is not a routed method of this"),
], ids=["kv_not_dividing_heads", "heads_not_dividing_width", "per_run_flag", "unknown_method", "heads_without_mhar",
        "not_integers", "temperature_zero", "baseline_temperature", "method_twice", "no_methods", "no_jobs", "versus_not_run",
        "versus_baseline"])
def test_bad_comparisons_stop_before_training_with_one_line(argv, message, tmp_path, capsys):
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
    assert "notes.txt is a file, not a folder" in err and files_in(tmp_path) == ["notes.txt"]


@pytest.mark.parametrize("flag, text, seeds", [
    ("--seeds", "0", [0]), ("--seeds", "3,1,2", [3, 1, 2]), ("--seeds", "9223372036854775807", [2**63 - 1]),
    ("--baseline_seeds", "", []), ("--baseline_seeds", " 5 , 6 ", [5, 6]),
    ("--seeds", "9223372036854775808", "must be in [0, 9223372036854775807] (an int64), not 9223372036854775808"),
    ("--seeds", "99999999999999999999999", "must be in [0, 9223372036854775807]"),
    ("--baseline_seeds", "1,-1", "must be >= 0, not -1"), ("--seeds", "0,x", "'x' is not a number"),
], ids=["one", "three", "largest", "none", "spaces", "one_past_the_largest", "huge", "negative", "not_a_number"])
def test_seeds_are_int64s_at_least_zero(flag, text, seeds, capsys):
    if isinstance(seeds, list):
        assert getattr(compare.parse_args([flag, text])[0], flag[2:]) == seeds
    else:
        err = error_line(capsys, compare.parse_args, [flag, text], prog="compare")
        assert err.startswith(f"compare.py: error: argument {flag}: {seeds}"), err


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


def test_the_tables_take_extra_columns(monkeypatch):
    """A later metric (an lm-eval score, say) is one more entry in the column lists and the rows."""
    rows = [{**row("baseline-s0", "baseline", None, 0, 3.0), "hellaswag": 0.25},
            {**row("mhar-s0", "mhar", "baseline", 0, 2.9), "hellaswag": 0.375}]
    monkeypatch.setattr(compare, "RUN_COLUMNS", compare.RUN_COLUMNS + [("hellaswag", lambda r: f"{r['hellaswag']:.3f}")])
    text = compare.report(rows)
    assert text.splitlines()[-1].endswith("| 0.375 |") and "| hellaswag |" in text
    assert compare.paired(rows, key="hellaswag")[0]["deltas"] == [0.125]


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


def test_compare_trains_each_method_then_writes_the_tables_and_the_figure(compared):
    out, _, rows = compared
    results = json.loads((out / "results.json").read_text())
    assert list(rows) == ["baseline-s0", "mhar-s0", "baseline-s1"]
    c = mhar.preset("tiny", vocab_size=VOCAB, seq_len=32)
    assert rows["mhar-s0"]["params"] - rows["baseline-s0"]["params"] == (2 * c.n_layer + 1) * 2 * c.n_embd
    summaries = {name: json.loads((out / name / "summary.json").read_text()) for name in rows}
    for name, r in rows.items():  # each row is the run's own summary.json
        assert r["tail_val_loss"] == summaries[name]["tail_val_loss"] and summaries[name]["finished"]
    delta = summaries["mhar-s0"]["tail_val_loss"] - summaries["baseline-s0"]["tail_val_loss"]  # seed 0 with seed 0
    assert rows["mhar-s0"]["delta"] == delta and rows["baseline-s1"]["delta"] is None
    (pair,) = results["pairs"]
    assert {k: pair[k] for k in ("variant", "baseline", "seeds", "deltas", "n", "mean", "se")} == dict(
        variant="mhar", baseline="baseline", seeds=[0], deltas=[delta], n=1, mean=delta, se=None)
    table = (out / "results.md").read_text()
    assert f"| mhar | baseline | 0 | 1 | {delta:+.4f} |" in table and "baseline over 2 seeds" in table
    assert (out / "loss_curves.png").read_bytes()[:8] == PNG_SIGNATURE
    assert (out / "paired_curves.png").read_bytes()[:8] == PNG_SIGNATURE


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


def test_eval_tasks_add_eval_pys_metrics_as_columns(compared, words):
    import eval
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
    assert "| Δ words_choice/acc (mean ± s.e.) | Δ words_next/exact_match (mean ± s.e.) |" in table
    cells = " | ".join(f"{delta[m]:+.4f}" for m in METRICS)
    assert f"| mhar | baseline | 0 | 1 | {pair['mean']:+.4f} | {cells} |" in table
    run_cells = " | ".join(f"{rows['baseline-s1'][m]:.4f}" for m in METRICS)
    assert table.rstrip().splitlines()[-3].endswith(f" | {run_cells} |")  # before the seeds' spread


def test_a_rerun_reuses_runs_and_evaluations(compared, monkeypatch):
    import eval
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


@pytest.mark.parametrize("room", [0, 1], ids=["full-before-the-first", "full-after-the-first"])
def test_tables_that_cannot_be_written_keep_the_previous_ones(compared, monkeypatch, capsys, room):
    """The disk fills up before the tables are written, or between them: one line, exit status 1,
    results.md and results.json both as they were (never a new one beside an old one), no temporary
    file; the runs are kept for a rerun."""
    import eval
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


def test_figures_that_cannot_be_written_keep_the_previous_ones(compared, monkeypatch, capsys):
    """The disk fills up while the loss curves are drawn, after the tables (half a PNG written): one line,
    exit status 1, not matplotlib's OSError traceback; both figures as they were, no staging folder."""
    import eval
    import probe
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
    # mhar - baseline: +0.25, +0.5: mean 0.375, sample std 0.25 / sqrt(2), standard error 0.125
    assert "| mhar | baseline | 0,1 | 2 | -0.1000 ± 0.0000 | +0.3750 ± 0.1250 |" in text
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
