"""trend.py: compare.py's folders read back along one flag; differences, their change and the probe's
disagreement against hand computations."""
import json
import math
import re
from pathlib import Path

import pytest

from lib.common import MachineError
from helpers import PNG_SIGNATURE, ROOT, error_line, files_in, one_error_line, run_script
from scripts import compare, trend

VARIANTS = ("baseline", "attnres", "attnres-T4", "mhar-H4")


def comparison(folder, width, full, tail_shift=0.1, versus=("attnres", "attnres-T4"), seeds=(0, 1, 2),
               extra_args=None):
    """A compare.py folder as comparison() writes it (results.json from compare.results_of), each run with a
    config.json: full = {variant: [whole-split loss per seed]} (None: a run without one), tail = full + shift."""
    folder = Path(folder)
    rows = []
    for variant, losses in full.items():
        for s, loss in zip(seeds, losses):
            rows.append(dict(name=f"{variant}-s{s}", variant=variant, seed=s,
                             baseline=None if variant == "baseline" else "baseline", params=1000,
                             tail_val_loss=(loss or 2.0) + tail_shift, tokens_per_s=1.0, peak_mem=1,
                             path=str(folder / f"{variant}-s{s}"), **({} if loss is None else {"full_val_loss": loss})))
            args = {**dict(preset="small-bytes", seed=s, out_dir=rows[-1]["path"], n_layer=4, n_embd=width,
                           n_head=width // 32, ffn_hidden=3 * width, residual=variant.split("-")[0],
                           route_heads=4 * variant.startswith("mhar")), **(extra_args or {})}
            (folder / rows[-1]["name"]).mkdir(parents=True)
            (folder / rows[-1]["name"] / "config.json").write_text(json.dumps(dict(args=args)))
    whole = all("full_val_loss" in r for r in rows)
    results = compare.results_of(rows, ["full_val_loss"] if whole else [], versus)
    (folder / "results.json").write_text(json.dumps(results))
    return folder


def losses(base, gaps):
    """{variant: per-seed losses}: the baseline's, and each variant's as the baseline's plus its gaps."""
    return {"baseline": base, **{v: [b + g for b, g in zip(base, gaps[v])] for v in gaps}}


GAPS = {64: {"attnres": [0.01, 0.02, 0.03], "attnres-T4": [-0.01, -0.02, 0.0], "mhar-H4": [-0.02, -0.03, -0.01]},
        128: {"attnres": [0.02, 0.02, 0.05], "attnres-T4": [-0.01, 0.0, -0.02], "mhar-H4": [-0.04, -0.03, -0.05]},
        256: {"attnres": [0.04, 0.03, 0.05], "attnres-T4": [0.0, -0.01, -0.02], "mhar-H4": [-0.06, -0.05, -0.07]}}


@pytest.fixture
def widths(tmp_path):
    return [comparison(tmp_path / f"d{w}", w, losses([1.5, 1.6, 1.55], GAPS[w])) for w in (128, 256, 64)]


def mean_se(deltas):
    mean = sum(deltas) / len(deltas)
    return mean, math.sqrt(sum((d - mean) ** 2 for d in deltas) / (len(deltas) - 1) / len(deltas))


def test_the_differences_at_each_width_are_the_paired_ones_in_the_flags_order(widths):
    gathered = trend.gather(widths)
    assert gathered["flag"] == "n_embd"  # n_head and ffn_hidden differ too: n_embd comes first
    assert gathered["metric"] == "full_val_loss"
    assert [p["value"] for p in gathered["points"]] == [64, 128, 256]
    for point in gathered["points"]:
        gaps = GAPS[point["value"]]
        expected = {"attnres - baseline": gaps["attnres"], "attnres-T4 - baseline": gaps["attnres-T4"],
                    "mhar-H4 - baseline": gaps["mhar-H4"],
                    "attnres-T4 - attnres": [t - a for t, a in zip(gaps["attnres-T4"], gaps["attnres"])],
                    "mhar-H4 - attnres": [m - a for m, a in zip(gaps["mhar-H4"], gaps["attnres"])],
                    "mhar-H4 - attnres-T4": [m - t for m, t in zip(gaps["mhar-H4"], gaps["attnres-T4"])]}
        assert list(point["differences"]) == list(expected)  # attnres - attnres-T4: the reverse, left out
        for label, deltas in expected.items():
            found = point["differences"][label]
            assert found["deltas"] == pytest.approx(deltas, abs=1e-12)
            assert (found["mean"], found["se"]) == pytest.approx(mean_se(deltas), abs=1e-12)
            assert found["n"] == 3 and found["seeds"] == [0, 1, 2]
            # the tail mean is the whole-split loss + 0.1 in every run: the same differences
            assert found["tail_val_loss"]["mean"] == pytest.approx(mean_se(deltas)[0], abs=1e-12)


def test_the_change_from_the_first_width_to_the_last_is_welchs(widths):
    gathered = trend.gather(widths)
    first, last = mean_se(GAPS[64]["mhar-H4"]), mean_se(GAPS[256]["mhar-H4"])
    c = gathered["trend"]["mhar-H4 - baseline"]
    se = math.sqrt(first[1] ** 2 + last[1] ** 2)
    df = se ** 4 / (first[1] ** 4 / 2 + last[1] ** 4 / 2)
    assert (c["mean"], c["se"], c["df"], c["t"]) == pytest.approx((last[0] - first[0], se, df,
                                                                   (last[0] - first[0]) / se))


@pytest.mark.parametrize("first, last, expected", [
    (dict(n=3, mean=0.0, se=0.003), dict(n=3, mean=-0.01, se=0.004), (-0.01, 0.005, 0.005 ** 4 / (
        0.003 ** 4 / 2 + 0.004 ** 4 / 2), -2.0)),
    (dict(n=2, mean=0.5, se=0.0), dict(n=5, mean=0.2, se=0.1), (-0.3, 0.1, 4.0, -3.0)),  # df: the other's n - 1
    (dict(n=1, mean=0.0, se=None), dict(n=3, mean=0.1, se=0.01), (0.1, None, None, None)),  # one seed: no s.e.
    (dict(n=3, mean=0.0, se=0.02), dict(n=1, mean=0.1, se=None), (0.1, None, None, None)),
    (dict(n=3, mean=0.1, se=0.0), dict(n=3, mean=0.1, se=0.0), (0.0, None, None, None)),   # no spread at all
], ids=["both", "first-without-spread", "first-one-seed", "last-one-seed", "neither-spread"])
def test_change_at_its_edges(first, last, expected):
    c = trend.change(first, last)
    assert c["mean"] == pytest.approx(expected[0])
    for key, value in zip(("se", "df", "t"), expected[1:]):
        assert c[key] == (None if value is None else pytest.approx(value)), key


def test_a_run_without_a_whole_split_score_falls_back_to_the_tail_mean(widths, tmp_path):
    old = comparison(tmp_path / "d512", 512, {**losses([1.5, 1.6, 1.55], GAPS[256]), "baseline": [1.5, None, 1.55]})
    gathered = trend.gather(widths + [old])
    assert gathered["metric"] == "tail_val_loss" and gathered["points"][-1]["value"] == 512
    assert gathered["points"][0]["differences"]["mhar-H4 - baseline"]["mean"] == pytest.approx(-0.02)
    with pytest.raises(trend.UserError) as error:
        trend.gather(widths + [old], metric="full_val_loss")
    assert str(error.value) == ("--metric full_val_loss: some runs have no whole-split score (trained before "
                                "train.py scored it); use --metric tail_val_loss")


def test_a_difference_some_folders_lack_has_a_dash_there_and_a_trend_over_the_others(widths, tmp_path):
    two = comparison(tmp_path / "d32", 32, {"baseline": [1.0, 1.1], "mhar-H4": [0.9, 1.05]}, versus=(),
                     seeds=(0, 1))
    gathered = trend.gather(widths + [two])
    assert list(gathered["points"][0]["differences"]) == ["mhar-H4 - baseline"]
    text = trend.report(gathered)
    assert "| attnres - baseline | — | +0.0200 ± 0.0058 |" in text
    c = gathered["trend"]["attnres - baseline"]
    assert c["mean"] == pytest.approx(mean_se(GAPS[256]["attnres"])[0] - mean_se(GAPS[64]["attnres"])[0])
    assert gathered["trend"]["mhar-H4 - baseline"]["mean"] == pytest.approx(-0.06 - (-0.075))


@pytest.mark.parametrize("case, message", [
    ("one", "^give at least two comparison folders$"),
    ("same", "the same flags: nothing to set side by side"),
    ("flag-same", "--flag n_layer has the same value in every folder: choose from n_embd, n_head, ffn_hidden"),
    ("flag-text", r"^preset is not a number in every folder \(small-bytes, small\): the trend needs a numeric "
                  r"flag, e\.g\. --flag n_embd$"),
    ("twice", "two folders have n_embd = 64"),
    ("no-results", r"^\S+/b holds no results\.json of compare\.py: run python -m scripts\.compare with --out_dir \S+/b "
                   r"first$"),
    ("torn", r"^\S+/b/results\.json is not a whole results\.json of compare\.py: run its compare\.py command again "
             r"\(it reuses the finished runs and writes the file anew\)$"),
    ("no-pairs", r"^\S+/b/results\.json is not a whole results\.json of compare\.py: run its compare\.py command "
                 r"again \(it reuses the finished runs and writes the file anew\)$"),
    ("no-config", "has no readable config.json"),
    ("baseline-alone", r"^the folders hold no paired difference \(each comparison trained one method alone\): "
                       r"compare at least one method with the baseline in each$"),
], ids=["one", "same", "flag-same", "flag-text", "twice", "no-results", "torn", "no-pairs", "no-config",
        "baseline-alone"])
def test_folders_that_cannot_make_a_trend_are_one_line(case, message, tmp_path):
    a = comparison(tmp_path / "a", 64, losses([1.5, 1.6, 1.55], GAPS[64]))
    b = comparison(tmp_path / "b", 64 if case == "same" else 128, losses([1.5, 1.6, 1.55], GAPS[128]),
                   extra_args={"preset": "small"} if case == "flag-text" else None)
    if case == "baseline-alone":  # (before: a traceback from the figure, which had no difference to plot)
        a = comparison(tmp_path / "a0", 64, {"baseline": [1.5, 1.6, 1.55]}, versus=())
        b = comparison(tmp_path / "b0", 128, {"baseline": [1.4, 1.5, 1.45]}, versus=())
    folders, flag = [a, b], {"flag-same": "n_layer", "flag-text": "preset"}.get(case)
    if case == "one":
        folders = [a]
    if case == "twice":  # 64, 128, 64
        folders.append(comparison(tmp_path / "c", 64, losses([1.5, 1.6, 1.55], GAPS[64])))
    if case == "no-results":
        (b / "results.json").unlink()
    if case == "torn":
        (b / "results.json").write_text('{"rows": [')
    if case == "no-pairs":
        results = json.loads((b / "results.json").read_text())
        del results["pairs"]
        (b / "results.json").write_text(json.dumps(results))
    if case == "no-config":
        (b / "mhar-H4-s1" / "config.json").write_text("{")
    with pytest.raises(trend.UserError, match=message):
        trend.gather(folders, flag)


def probe_json(run, heads, value, null, z):
    (run / "probe").mkdir()
    key = "head_deviation" if heads > 1 else "width_disagreement"
    stats = dict(mean_abs=value, null_mean=null, z=z) if heads > 1 else dict(kl_mean=value, null_mean=null, z=z)
    (run / "probe" / "probe.json").write_text(json.dumps({key: {"overall": stats} if heads > 1 else stats}))


def test_the_probes_disagreement_is_the_mean_over_the_seeds_probed(widths):
    d64 = widths[2]
    probe_json(d64 / "mhar-H4-s0", 4, 0.02, 0.01, 3.0)
    probe_json(d64 / "mhar-H4-s1", 4, 0.04, 0.02, None)  # a null without spread: no z
    probe_json(d64 / "attnres-s2", 1, 0.3, 0.1, 2.0)
    (d64 / "baseline-s0" / "probe").mkdir()              # baseline: probe.json has neither
    (d64 / "baseline-s0" / "probe" / "probe.json").write_text(json.dumps({"notes": ["no routing"]}))
    gathered = trend.gather(widths)
    found = gathered["points"][0]["disagreement"]
    assert found["mhar-H4"] == dict(statistic="head deviation", n=2, value=pytest.approx(0.03),
                                    null=pytest.approx(0.015), z=3.0)
    assert found["attnres"] == dict(statistic="width disagreement (KL)", n=1, value=0.3, null=0.1, z=2.0)
    assert set(found) == {"mhar-H4", "attnres"} and gathered["points"][1]["disagreement"] == {}
    text = trend.report(gathered)
    assert "| mhar-H4 | head deviation | 0.0300 (null 0.0150, z 3.0; n 2) | — | — |" in text


@pytest.mark.slow
def test_trend_writes_its_tables_and_figure(widths, tmp_path):
    out = tmp_path / "out"
    done = run_script("scripts/trend.py", *widths, "--out_dir", out)
    assert done.returncode == 0, done.stderr
    assert "n_embd = 64 (" in done.stdout and "| mhar-H4 - attnres-T4 | 0,1,2 | 3 |" in done.stdout
    assert json.loads((out / "trend.json").read_text())["flag"] == "n_embd"
    assert (out / "trend.md").read_text().strip() in done.stdout
    pytest.importorskip("matplotlib")
    assert (out / "paired_differences_by_n_embd.png").stat().st_size > 10_000
    assert files_in(out) == ["paired_differences_by_n_embd.png", "trend.json", "trend.md"]


@pytest.mark.parametrize("argv, message", [
    (["--metric", "loss"], "argument --metric: invalid choice: 'loss'"),
    (["--flag", "n_layer"], "--flag n_layer has the same value in every folder"),
    (["--out_dir", "{file}"], "--out_dir {file}: {file} is a file, not a folder"),
], ids=["bad-metric", "flag-same", "out-dir-a-file"])
def test_bad_input_is_one_line(argv, message, widths, tmp_path, capsys):
    (tmp_path / "file").write_text("mine")
    err = error_line(capsys, trend.main, [*widths, *[a.format(file=tmp_path / "file") for a in argv]])
    assert message.format(file=tmp_path / "file") in err
    assert (tmp_path / "file").read_text() == "mine" and files_in(tmp_path / "out") == []


@pytest.mark.slow
def test_main_prints_the_tables_and_says_what_it_wrote(widths, tmp_path, capsys):
    """In this process (the test above runs the script): trend.md as printed, trend.json as gather() returns it,
    the figure; the last line names the three files."""
    pytest.importorskip("matplotlib")
    out = tmp_path / "out"
    trend.main([str(w) for w in widths] + ["--out_dir", str(out)])
    printed = capsys.readouterr().out
    assert printed == (out / "trend.md").read_text() + f"\nwrote {out / 'trend.md'}, {out / 'trend.json'}, " \
                                                        f"{out / 'paired_differences_by_n_embd.png'}\n"
    assert json.loads((out / "trend.json").read_text()) == json.loads(json.dumps(trend.gather(widths)))
    assert (out / "paired_differences_by_n_embd.png").read_bytes().startswith(PNG_SIGNATURE)


def test_without_matplotlib_the_tables_are_written_and_the_figure_named(widths, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(trend.probe, "pyplot", lambda: None)
    out = tmp_path / "out"
    trend.main([str(w) for w in widths] + ["--out_dir", str(out)])
    assert capsys.readouterr().out.endswith(f"\nwrote {out / 'trend.md'}, {out / 'trend.json'} (the figure: pip "
                                            f"install matplotlib, then run again)\n")
    assert files_in(out) == ["trend.json", "trend.md"]


@pytest.mark.slow
def test_the_figure_has_a_panel_for_the_baseline_and_one_between_methods(widths, tmp_path, monkeypatch):
    """Each difference a line of error bars (mean ± s.e.) at the widths it was measured at, in its panel; one
    panel when no difference is between routed methods."""
    plt = pytest.importorskip("matplotlib.pyplot")
    close, figures = plt.close, []
    monkeypatch.setattr(plt, "close", figures.append)  # keep each figure to read it
    trend.plot(plt, trend.gather(widths), tmp_path / "a.png")
    alone = comparison(tmp_path / "b64", 64, {"baseline": [1.0, 1.1], "mhar-H4": [0.9, 1.05]}, versus=(), seeds=(0, 1))
    other = comparison(tmp_path / "b128", 128, {"baseline": [1.0, 1.1], "mhar-H4": [0.8, 1.0]}, versus=(), seeds=(0, 1))
    trend.plot(plt, trend.gather([alone, other]), tmp_path / "b.png")
    left, right = figures[0].axes
    assert [t.get_text() for t in left.get_legend().get_texts()] == [
        "attnres - baseline", "attnres-T4 - baseline", "mhar-H4 - baseline"]
    assert [t.get_text() for t in right.get_legend().get_texts()] == [
        "attnres-T4 - attnres", "mhar-H4 - attnres", "mhar-H4 - attnres-T4"]
    assert [tick.get_text() for tick in left.get_xticklabels()] == ["64", "128", "256"]
    points, _, (bars,) = left.containers[2].lines  # mhar-H4 - baseline, shifted right of the middle
    means, ses = zip(*(mean_se(GAPS[w]["mhar-H4"]) for w in (64, 128, 256)))
    assert list(points.get_ydata()) == pytest.approx(means)
    assert list(points.get_xdata()) == pytest.approx([64 * 1.03, 128 * 1.03, 256 * 1.03])
    assert [segment[:, 1].tolist() for segment in bars.get_segments()] == [
        pytest.approx([m - e, m + e]) for m, e in zip(means, ses)]
    assert len(figures[1].axes) == 1 and (tmp_path / "a.png").is_file() and (tmp_path / "b.png").is_file()
    for figure in figures:
        close(figure)


@pytest.mark.slow
@pytest.mark.parametrize("fault, reason", [("full", "No space left on device"), ("read-only", "Read-only file system")],
                         ids=["full_disk", "read_only_folder"])
def test_trend_onto_a_full_disk_or_into_a_read_only_folder(widths, tmp_path, fault, reason):
    """One line, status 1; no half-written table or figure, no folder left behind."""
    (tmp_path / "disk").mkdir()
    done = run_script("scripts/trend.py", *widths, "--out_dir", tmp_path / "disk" / "trend", fault=fault,
                      under=tmp_path / "disk")
    err = one_error_line(done, "trend.py", status=1)
    assert f"cannot write into {tmp_path / 'disk' / 'trend'} ({reason}): nothing written" in err, err
    assert files_in(tmp_path / "disk") == []


@pytest.mark.parametrize("values, expected", [([], None), ([None], None), ([None, None], None), ([2.0], 2.0),
                                              ([1.0, None, 4.0], 2.5), ([-1.0, 1.0], 0.0)],
                         ids=["empty", "one-none", "all-none", "one", "a-none-among-them", "opposite"])
def test_mean_of_leaves_out_what_was_not_measured(values, expected):
    assert trend.mean_of(values) == expected


def test_the_flags_reach_gather_and_their_defaults_hold(widths, tmp_path, capsys, monkeypatch):
    """--metric and --flag as given reach the tables; --out_dir's default is runs/trend; --help is the
    docstring's first paragraph and the flags."""
    monkeypatch.setattr(trend.probe, "pyplot", lambda: None)
    out = tmp_path / "out"
    trend.main([str(w) for w in widths] + ["--metric", "tail_val_loss", "--flag", "ffn_hidden", "--out_dir", str(out)])
    written = json.loads((out / "trend.json").read_text())
    assert (written["metric"], written["flag"]) == ("tail_val_loss", "ffn_hidden")
    assert [p["value"] for p in written["points"]] == [192, 384, 768]
    assert trend.parse_args(["a", "b"]).out_dir == "runs/trend"
    capsys.readouterr()
    with pytest.raises(SystemExit):
        trend.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    first, second = (" ".join(p.split()) for p in trend.__doc__.split("\n\n")[:2])
    assert first in text and second not in text and "--metric {full_val_loss,tail_val_loss}" in text


@pytest.mark.parametrize("c, cell", [(dict(mean=-0.01, se=None, df=None, t=None), "—"),
                                     (dict(mean=-0.01, se=0.005, df=3.7093, t=-2.0), "t(3.7) = -2.0"),
                                     (dict(mean=0.3, se=0.1, df=4.0, t=3.04), "t(4.0) = +3.0")],
                         ids=["no-spread", "negative", "positive"])
def test_welchs_cell(c, cell):
    assert trend.welch(c) == cell


def test_the_trend_table_gives_each_change_with_welchs_t(widths):
    text = trend.report(trend.gather(widths))
    c = trend.change(*(dict(zip(("mean", "se"), mean_se(GAPS[w]["mhar-H4"])), n=3) for w in (64, 256)))
    assert (f"| mhar-H4 - baseline | {trend.mean_se(dict(zip(('mean', 'se'), mean_se(GAPS[64]['mhar-H4']))))} |"
            in text)
    assert text.count(f"| {trend.mean_se(c)} | t({c['df']:.1f}) = {c['t']:+.1f} |") == 1


@pytest.mark.parametrize("fault, line, status", [
    (MachineError("cannot write into out (No space left on device): nothing written; free some space"),
     "trend.py: error: cannot write into out (No space left on device): nothing written; free some space", 1),
    (KeyboardInterrupt(), "trend.py: error: interrupted (Ctrl-C); nothing written", 130),
], ids=["full-disk", "ctrl-c"])
def test_a_failed_write_or_a_ctrl_c_is_one_line(fault, line, status, widths, tmp_path, capsys, monkeypatch):
    """In this process (the fault tests above run the script): the line and the status of each."""
    pytest.importorskip("matplotlib")  # the fault comes from the figure

    def failing(*args):
        raise fault
    monkeypatch.setattr(trend, "plot", failing)
    assert error_line(capsys, trend.main, [*widths, "--out_dir", tmp_path / "out"], status=status) == line
    assert files_in(tmp_path / "out") == []


def test_a_flag_the_runs_of_one_folder_differ_in_is_not_the_folders(tmp_path):
    folder = comparison(tmp_path / "d64", 64, losses([1.5, 1.6, 1.55], GAPS[64]))
    for run, n_layer in (("mhar-H4-s1", 3), ("mhar-H4-s2", 5)):  # the middle run, and the last
        record = json.loads((folder / run / "config.json").read_text())
        (folder / run / "config.json").write_text(json.dumps({"args": {**record["args"], "n_layer": n_layer}}))
    shared = trend.settings(folder, json.loads((folder / "results.json").read_text()))
    assert "n_layer" not in shared and shared["n_embd"] == 64 and "seed" not in shared and "residual" not in shared


def test_a_flag_that_differs_nowhere_names_no_choice(tmp_path):
    a = comparison(tmp_path / "a", 64, losses([1.5, 1.6, 1.55], GAPS[64]))
    b = comparison(tmp_path / "b", 64, losses([1.5, 1.6, 1.55], GAPS[128]))
    with pytest.raises(trend.UserError) as e:
        trend.gather([a, b], "n_layer")
    assert str(e.value) == "--flag n_layer has the same value in every folder"


def test_whole_split_and_tail_mean_differences_are_each_their_own(tmp_path):
    """Runs whose tail-mean and whole-split losses move differently: each metric's pairs are its own."""
    full = losses([1.5, 1.6, 1.55], GAPS[64])
    folders = []
    for width, shift in ((64, 0.1), (128, 0.3)):
        folders.append(comparison(tmp_path / f"d{width}", width, full, tail_shift=shift))
        results = json.loads((folders[-1] / "results.json").read_text())
        for r in results["rows"]:  # mhar's tail-mean 0.05 higher than its whole-split loss suggests
            r["tail_val_loss"] += 0.05 * r["variant"].startswith("mhar")
        rows = results["rows"]
        (folders[-1] / "results.json").write_text(json.dumps(compare.results_of(rows, ["full_val_loss"],
                                                                                ["attnres", "attnres-T4"])))
    whole, tail = trend.gather(folders), trend.gather(folders, metric="tail_val_loss")
    gap = mean_se(GAPS[64]["mhar-H4"])[0]
    assert whole["points"][0]["differences"]["mhar-H4 - baseline"]["mean"] == pytest.approx(gap)
    assert tail["points"][0]["differences"]["mhar-H4 - baseline"]["mean"] == pytest.approx(gap + 0.05)
    assert whole["points"][0]["differences"]["mhar-H4 - baseline"]["tail_val_loss"]["mean"] == pytest.approx(gap + 0.05)
    assert [p["folder"] for p in whole["points"]] == [str(f) for f in folders]


def test_a_difference_measured_at_one_value_has_no_trend(tmp_path):
    a = comparison(tmp_path / "a", 64, {"baseline": [1.0, 1.1], "mhar-H4": [0.9, 1.05], "mhar-H8": [0.95, 1.0]},
                   versus=(), seeds=(0, 1))
    b = comparison(tmp_path / "b", 128, {"baseline": [1.0, 1.1], "mhar-H4": [0.8, 1.0]}, versus=(), seeds=(0, 1))
    assert list(trend.gather([a, b])["trend"]) == ["mhar-H4 - baseline"]
    old = comparison(tmp_path / "c", 256, {"baseline": [1.0, None], "mhar-H4": [0.8, 1.0]}, versus=(), seeds=(0, 1))
    assert trend.gather([a, b, old], metric="tail_val_loss")["metric"] == "tail_val_loss"


@pytest.mark.parametrize("metric", ["full_val_loss", "tail_val_loss"])
def test_each_widths_table_row_by_row(metric, widths):
    """A header naming the metric, and per difference: its seeds, n, mean ± s.e., the paired t; with the
    whole split, the tail-mean's beside it. The trend's header spans the first width to the last."""
    text = trend.report(trend.gather(widths, metric=metric))
    name = trend.metric_name(metric)
    mean, se = mean_se(GAPS[64]["mhar-H4"])
    cells = f"| mhar-H4 - baseline | 0,1,2 | 3 | {mean:+.4f} ± {se:.4f} | t(2) = {mean / se:+.1f} |"
    table = text.split("n_embd = 64 (")[1].split("\n\n", 2)[1]
    if metric == "full_val_loss":
        assert table.startswith(f"| difference | seeds | n | Δ {name} (mean ± s.e.) | t (df) | Δ tail-mean val loss "
                                f"(mean ± s.e.) |\n")
        assert cells + f" {mean:+.4f} ± {se:.4f} |" in table.split("\n")
    else:
        assert table.startswith(f"| difference | seeds | n | Δ {name} (mean ± s.e.) | t (df) |\n")
        assert cells in table.split("\n")
    assert "| difference | n_embd 64 | n_embd 128 | n_embd 256 | change 64 → 256 | Welch t (df) |" in text


# The width tables' row labels (docs/comparison.md's) -> trend.py's differences
DIFFERENCES = {"mhar H4 − baseline": "mhar-H4 - baseline", "attnres-T4 − baseline": "attnres-T4 - baseline",
               "attnres − baseline": "attnres - baseline", "mhar H4 − attnres": "mhar-H4 - attnres",
               "mhar H4 − attnres-T4": "mhar-H4 - attnres-T4", "attnres-T4 − attnres": "attnres-T4 - attnres"}
README_PROBES = {"AttnRes's width disagreement (KL; null)": "attnres", "MHAR's head deviation (null)": "mhar-H4",
                 "the control's width disagreement (KL; null)": "attnres-T4"}
WIDTH_FOLDERS = [ROOT / "results" / f"width-d{width}" for width in (64, 128, 256)]


def width_table(text, heading="### Does the gain grow with width?"):
    """The first table of differences under a heading (the README's: "Does the gain grow with width?"):
    {row label: [cell, ...]} as written, bold dropped, the cells' minus signs as ASCII hyphens."""
    section = text.split(heading + "\n")[1]
    rows = {}
    for line in section.split("\n\n| difference |")[1].split("\n\n")[0].splitlines()[2:]:
        label, *cells = [c.strip().replace("**", "") for c in line.strip("|").split("|")]
        rows[label] = [cell.replace("−", "-") for cell in cells]
    return rows


def width_cell_problems(cell, pair):
    """What a README cell ("m ± se", maybe "(t = x)") says that a paired difference does not, rounded as
    written."""
    m = re.fullmatch(r"([+-]\d\.\d{4}) ± (\d\.\d{4})(?: \(t = ([+-]\d+\.\d)\))?", cell)
    if m is None:
        return [f"{cell!r}: not 'mean ± se'"]
    said = [float(m[1]), float(m[2])] + ([float(m[3])] if m[3] else [])
    true = [round(pair["mean"], 4), round(pair["se"], 4), round(pair["mean"] / pair["se"], 1)][:len(said)]
    return [] if said == true else [f"{cell!r}: the results say {true}"]


def width_row_problems(label, cells, points):
    """width_cell_problems of a row's cells, one a width, against trend.gather's points."""
    return [f"{label}, d {point['value']}: {problem}" for cell, point in zip(cells, points)
            for problem in width_cell_problems(cell, point["differences"][DIFFERENCES[label]])]


def headline_rows(text):
    """The README's table under "What it shows": [(difference, value)], the experiment column carried down to
    the rows that leave it empty: {(experiment, difference): value}, minus signs as ASCII hyphens."""
    section = text.split("## What it shows\n")[1].split("\n## ")[0]
    rows, experiment = {}, None
    for line in section.split("| experiment |")[1].split("\n\n")[0].splitlines()[2:]:
        cells = [c.strip().replace("−", "-") for c in line.strip("|").split("|")]
        experiment = cells[0] or experiment
        rows[(experiment, cells[1])] = cells[2]
    return rows


def headline_cell(pair, resolved=True):
    """A pair's cell as the README writes it: "m ± se, t(2) = x" (or "m ± se" and, unresolved, a note)."""
    cell = f"{pair['mean']:+.4f} ± {pair['se']:.4f}"
    t = pair["mean"] / pair["se"]
    if abs(t) > 4.30:                               # two-sided p < 0.05 at 2 degrees of freedom
        return f"{cell}, t(2) = {t:+.1f}"
    return cell if resolved else f"{cell} (not resolved)"


def compromise_pair(runs, variant, reference):
    """The paired difference of the final val losses of two methods of compromise.py's results, by seed."""
    loss = {(r["method"], r["seed"]): r["val_loss"] for r in runs}
    seeds = sorted(seed for method, seed in loss if method == variant)
    return mean_se_pair([loss[(variant, seed)] - loss[(reference, seed)] for seed in seeds])


def mean_se_pair(deltas):
    mean = sum(deltas) / len(deltas)
    return {"mean": mean, "se": math.sqrt(sum((d - mean) ** 2 for d in deltas) / (len(deltas) - 1) / len(deltas))}


def test_the_readmes_headline_table_is_the_committed_results():
    """Every figure of the README's "What it shows" table, recomputed from the committed results: the forced
    compromise's paired differences from results/compromise/results.json, the CPU comparison's from
    results/compare-bytes/results.json, the width study's by trend.gather from results/width-d*/, the rivals'
    from results/width-d128/results.json (whole-split losses paired by seed)."""
    rows = headline_rows((ROOT / "README.md").read_text())
    runs = json.loads((ROOT / "results" / "compromise" / "results.json").read_text())["runs"]
    cpu = json.loads((ROOT / "results" / "compare-bytes" / "results.json").read_text())
    cpu_pairs = {(p["variant"], p["baseline"]): p for p in cpu["pairs"] + cpu["versus"]["attnres-T4"]}
    width = {p["value"]: p["differences"] for p in trend.gather(WIDTH_FOLDERS)["points"]}
    loss = {(r["variant"], r["seed"]): r["full_val_loss"] for r in
            json.loads((ROOT / "results" / "width-d128" / "results.json").read_text())["rows"]}
    rivals = {(a, b): mean_se_pair([loss[a, s] - loss[b, s] for s in (0, 1, 2)])
              for a in ("muddformer", "depth-attention") for b in ("baseline", "mhar-H4")}
    expected = [
        (compromise_pair(runs, "mhar", "attnres"), True),
        (compromise_pair(runs, "mhar-rotated", "attnres-rotated"), True),
        (cpu_pairs[("mhar-H4", "baseline")], True), (cpu_pairs[("mhar-H4", "attnres-T4")], True),
        (width[256]["mhar-H4 - baseline"], True), (width[256]["mhar-H4 - attnres-T4"], True),
        (width[64]["mhar-H4 - baseline"], False),
        (rivals[("muddformer", "baseline")], True), (rivals[("depth-attention", "baseline")], True),
        (rivals[("muddformer", "mhar-H4")], False)]
    assert len(rows) == len(expected), rows
    problems = [f"{key}: {value!r}, the results say {headline_cell(pair, resolved)!r}"
                for (key, value), (pair, resolved) in zip(rows.items(), expected)
                if value != headline_cell(pair, resolved).replace("−", "-")]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("pair, resolved, cell", [
    ({"mean": -0.04876, "se": 0.00617}, True, "-0.0488 ± 0.0062, t(2) = -7.9"),
    ({"mean": -0.0043, "se": 0.001}, True, "-0.0043 ± 0.0010"),             # t = -4.30: not beyond 4.30
    ({"mean": -0.00431, "se": 0.001}, True, "-0.0043 ± 0.0010, t(2) = -4.3"),
    ({"mean": 0.0008, "se": 0.0002}, True, "+0.0008 ± 0.0002"),
    ({"mean": -0.0052, "se": 0.0051}, False, "-0.0052 ± 0.0051 (not resolved)"),
], ids=["resolved", "at-the-edge", "past-the-edge", "positive-unresolved-unmarked", "unresolved"])
def test_a_headline_cell_gives_t_only_where_it_is_resolved(pair, resolved, cell):
    assert headline_cell(pair, resolved) == cell


@pytest.mark.parametrize("cell, problems", [
    ("-0.0488 ± 0.0062 (t = -7.9)", 0), ("-0.0488 ± 0.0062", 0), ("-0.0489 ± 0.0062", 1),
    ("-0.0488 ± 0.0061", 1), ("-0.0488 ± 0.0062 (t = -8.0)", 1), ("-0.0488", 1), ("", 1),
], ids=["whole", "no-t", "mean-off", "se-off", "t-off", "no-se", "empty"])
def test_a_width_cell_is_checked_to_its_last_digit(cell, problems):
    pair = {"mean": -0.04876, "se": 0.00617}       # t = -7.90
    assert len(width_cell_problems(cell, pair)) == problems


def test_the_width_studys_table_in_docs_is_trend_py_on_the_committed_results():
    """docs/comparison.md's per-width table: the whole-split differences (mean ± s.e., t) at each width
    and the tail-mean ones at d 256, recomputed from results/width-d*/ as committed."""
    gathered = trend.gather(WIDTH_FOLDERS)
    rows = width_table((ROOT / "docs" / "comparison.md").read_text(), "## The width study")
    assert set(rows) == set(DIFFERENCES)
    problems = []
    for label, (*widths, tail) in rows.items():
        problems += width_row_problems(label, widths, gathered["points"])
        last = gathered["points"][-1]["differences"][DIFFERENCES[label]]["tail_val_loss"]
        problems += [f"{label}, d 256 tail: {problem}" for problem in width_cell_problems(tail, last)]
    assert not problems, "\n".join(problems)


# %% Every change, the pooled spread, and the differences along training

def test_every_change_between_two_widths_is_welchs_of_those_two(widths):
    gathered = trend.gather(widths)
    for label, changes in gathered["changes"].items():
        assert list(changes) == ["64 → 128", "64 → 256", "128 → 256"]
        at = {p["value"]: p["differences"][label] for p in gathered["points"]}
        for name, c in changes.items():
            first, last = (int(v) for v in name.split(" → "))
            assert c == pytest.approx(trend.change(at[first], at[last]))
        assert changes["64 → 256"] == gathered["trend"][label]


def test_the_pooled_spread_weights_each_widths_variance_by_its_degrees_of_freedom(widths):
    """By hand on GAPS: s_p^2 = (2 s_64^2 + 2 s_128^2 + 2 s_256^2) / 6; each width's se s_p / sqrt(3) with
    6 degrees of freedom; the change's s_p sqrt(1/3 + 1/3); the ratio of the largest s.d. to the smallest."""
    pooled = trend.gather(widths)["pooled"]["attnres - baseline"]
    deltas = {w: GAPS[w]["attnres"] for w in (64, 128, 256)}
    sds = {w: mean_se(d)[1] * math.sqrt(3) for w, d in deltas.items()}
    sd = math.sqrt(sum(2 * s ** 2 for s in sds.values()) / 6)
    assert (pooled["sd"], pooled["df"], pooled["ratio"]) == pytest.approx(
        (sd, 6, max(sds.values()) / min(sds.values())))
    for w, d in deltas.items():
        mean = sum(d) / 3
        assert pooled["at"][w] == pytest.approx(dict(mean=mean, se=sd / math.sqrt(3), df=6, t=mean / (sd / math.sqrt(3))))
    change = sum(deltas[256]) / 3 - sum(deltas[64]) / 3
    assert pooled["change"] == pytest.approx(dict(mean=change, se=sd * math.sqrt(2 / 3), df=6,
                                                  t=change / (sd * math.sqrt(2 / 3))))


@pytest.mark.parametrize("pairs, expected", [
    ([dict(n=3, mean=0.1, se=0.01), dict(n=3, mean=0.2, se=0.02)], dict(ratio=2.0, df=4)),
    ([dict(n=2, mean=0.1, se=0.01), dict(n=4, mean=0.2, se=0.01)],          # df 1 + 3; sds 0.01 sqrt 2, 0.02
     dict(ratio=0.02 / (0.01 * math.sqrt(2)), df=4)),
    ([dict(n=3, mean=0.1, se=0.0), dict(n=3, mean=0.2, se=0.02)], dict(ratio=None, df=4)),   # one without spread
    ([dict(n=1, mean=0.1, se=None), dict(n=3, mean=0.2, se=0.02)], None),                  # one seed: no spread
], ids=["two-widths", "unequal-seeds", "a-zero-spread", "one-seed"])
def test_the_pooled_spread_at_its_edges(pairs, expected):
    pooled = trend.pooled_spread(list(zip((64, 128), pairs)))
    if expected is None:
        assert pooled is None
        return
    assert pooled["ratio"] == (None if expected["ratio"] is None else pytest.approx(expected["ratio"]))
    assert pooled["df"] == expected["df"]
    variances = [(p["n"] - 1) * p["se"] ** 2 * p["n"] for p in pairs]
    assert pooled["sd"] == pytest.approx(math.sqrt(sum(variances) / expected["df"]))


def write_logs(folder, offsets, steps=(50, 100, 150, 200), tokens_per_step=100):
    """log.jsonl of every run of a comparison() folder: a training line and an evaluation at each step, the
    val loss 2 - step/1000 + offsets[variant][seed] * step / 100."""
    for run in Path(folder).iterdir():
        if run.is_dir():
            variant, seed = run.name.rsplit("-s", 1)
            lines = []
            for step in steps:
                lines.append({"step": step, "loss": 3.0, "tokens": step * tokens_per_step})
                lines.append({"step": step, "val_loss": 2 - step / 1000 + offsets[variant][int(seed)] * step / 100,
                              "tokens": step * tokens_per_step})
            (run / "log.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))


OFFSETS = {"baseline": [0.0, 0.01, -0.01], "attnres": [0.02, 0.03, 0.01], "attnres-T4": [-0.01, 0.0, -0.03],
           "mhar-H4": [-0.03, -0.02, -0.05]}


def test_the_differences_along_training_are_paired_at_every_evaluation(widths):
    for folder in widths:
        write_logs(folder, OFFSETS)
    gathered = trend.gather(widths)
    along = gathered["points"][0]["along"]
    assert list(along) == list(gathered["points"][0]["differences"])      # no reverse of a difference
    for label, curve in along.items():
        variant, reference = label.split(" - ")
        assert curve["steps"] == [50, 100, 150, 200] and curve["tokens"] == [5000, 10000, 15000, 20000]
        for i, step in enumerate(curve["steps"]):
            deltas = [(OFFSETS[variant][s] - OFFSETS[reference][s]) * step / 100 for s in range(3)]
            assert (curve["mean"][i], curve["se"][i]) == pytest.approx(mean_se(deltas), abs=1e-12)


def test_a_run_without_its_log_has_no_curve_and_a_torn_one_is_one_line(widths):
    gathered = trend.gather(widths)
    assert all(p["along"] == {} for p in gathered["points"])
    write_logs(widths[0], OFFSETS)
    log = widths[0] / "mhar-H4-s1" / "log.jsonl"
    log.write_text("not json\n" + log.read_text())
    with pytest.raises(trend.UserError, match="line 1 is not JSON"):
        trend.gather(widths)


@pytest.mark.parametrize("steps, fraction, index", [
    ([50, 100, 150, 200], 0.25, 0), ([50, 100, 150, 200], 0.5, 1), ([50, 100, 150, 200], 1.0, 3),
    ([100, 200, 300, 400], 0.375, 0), ([750], 0.25, 0), ([50, 100, 150, 200, 250, 300, 350, 400, 450, 500, 550,
                                                           600, 650, 700, 750], 0.25, 3),
], ids=["quarter", "half", "end", "tie-the-earlier", "one-evaluation", "750-steps-quarter-is-200"])
def test_the_evaluation_nearest_a_fraction_of_training(steps, fraction, index):
    assert trend.nearest({"steps": steps}, fraction) == index


def test_the_report_reads_each_difference_at_the_quarters_and_the_figure_is_drawn(widths, tmp_path):
    for folder in widths:
        write_logs(folder, OFFSETS)
    gathered = trend.gather(widths)
    text = trend.report(gathered)
    deltas = [(OFFSETS["mhar-H4"][s] - OFFSETS["baseline"][s]) * 2 for s in range(3)]   # at step 200
    mean, se = mean_se(deltas)
    assert (f"| mhar-H4 - baseline | 256 | {compare.signed(mean / 4, se / 4)} (50) | "
            f"{compare.signed(mean / 2, se / 2)} (100) | {compare.signed(mean * 3 / 4, se * 3 / 4)} (150) | "
            f"{compare.signed(mean, se)} (200) |") in text
    pooled = gathered["pooled"]["attnres - baseline"]
    assert f"| attnres - baseline | {pooled['ratio']:.1f} | {pooled['sd']:.4f} | " in text
    assert "| mhar-H4 - attnres-T4 | — | " in text             # a width without spread: no ratio
    c = gathered["changes"]["attnres - baseline"]["128 → 256"]
    assert f"{compare.signed(c['mean'], c['se'])}, t({c['df']:.1f}) = {c['t']:+.1f} |" in text
    plt = pytest.importorskip("matplotlib.pyplot")
    trend.plot_along(plt, gathered, tmp_path / "along.png")
    assert (tmp_path / "along.png").read_bytes().startswith(PNG_SIGNATURE)


@pytest.mark.parametrize("c, cell", [
    (dict(mean=-0.0316, se=0.0085, df=3.07, t=-3.72), "-0.0316 ± 0.0085, t(3.1) = -3.7"),
    (dict(mean=-0.0094, se=0.0083, df=6, t=-1.13), "-0.0094 ± 0.0083, t(6) = -1.1"),
    (dict(mean=0.1, se=None, df=None, t=None), "+0.1000"), (None, "—"),
], ids=["welch", "pooled-whole-df", "no-spread", "not-measured"])
def test_a_changed_cell(c, cell):
    assert trend.changed(c) == cell


# %% The README's width reading, every figure recomputed

FIGURE = re.compile(r"([+-]\d\.\d{4} ± \d\.\d{4})|(t\(\d+(?:\.\d)?\) = [+-]\d+\.\d)")


def readme_width_reading(text):
    """The README's bullet on width ("Width: read with care"), one line, minus signs as ASCII hyphens."""
    section = text.split("- **Width: read with care.**")[1].split("\n\n")[0].split("\n- ")[0]
    return " ".join(section.replace("−", "-").split())


def quoted_figures(reading):
    """Each "m ± se" of a reading, with the "t(df) = x" that follows it before the next one (None if none):
    "m ± se, t(df) = x" or "m ± se"; and the t's that follow no "m ± se" (none should)."""
    cells, orphans = [], []
    for match in FIGURE.finditer(reading):
        if match[1]:
            cells.append(match[1])
        elif cells and "t(" not in cells[-1]:
            cells[-1] += f", {match[2]}"
        else:
            orphans.append(match[2])
    return cells, orphans


def trend_figures(gathered):
    """Every figure trend.py computes of a width study, each as its tables print it: each width's paired
    difference with its t(2), every change with Welch's t, the pooled ones with t(6), each difference along
    training at every evaluation; each also without its t."""
    cells = set()
    for p in gathered["points"]:
        cells |= {f"{compare.signed(d['mean'], d['se'])}, {compare.t_of(d)}" for d in p["differences"].values()}
        cells |= {compare.signed(m, se) for curve in p["along"].values() for m, se in zip(curve["mean"], curve["se"])}
    cells |= {trend.changed(c) for changes in gathered["changes"].values() for c in changes.values()}
    cells |= {trend.changed(c) for pooled in gathered["pooled"].values() if pooled
              for c in [*pooled["at"].values(), pooled["change"]]}
    return cells | {cell.split(", t(")[0] for cell in cells}


def test_every_figure_of_the_readmes_width_reading_is_trend_py_on_the_committed_results():
    """Each "m ± se" of the README's width bullet, with the t (and degrees of freedom) after it, is a figure
    that trend.gather computes from results/width-d*/ as committed, to its last digit; so is the ratio of
    the seed spreads it quotes."""
    reading = readme_width_reading((ROOT / "README.md").read_text())
    gathered = trend.gather(WIDTH_FOLDERS)
    cells, orphans = quoted_figures(reading)
    assert len(cells) >= 12 and not orphans, (cells, orphans)
    unknown = [cell for cell in cells if cell not in trend_figures(gathered)]
    assert not unknown, unknown
    ratios = {f"{p['ratio']:.1f}" for p in gathered["pooled"].values() if p and p["ratio"]}
    quoted = re.findall(r"(\d+\.\d) times apart", reading)
    assert quoted and set(quoted) <= ratios, quoted


@pytest.mark.parametrize("edit", [("−0.0436 ± 0.0080", "−0.0437 ± 0.0080"), ("t(3.9) = −5.4", "t(2) = −5.4"),
                                  ("−0.0316 ± 0.0085", "−0.0316 ± 0.0086"), ("12.9 times", "13.9 times"),
                                  ("t(6) = −2.3", "t(2) = −2.3"), ("−0.1016 ± 0.0089", "−0.1016 ± 0.0098")],
                         ids=["a-mean", "a-df", "an-se", "the-ratio", "pooled-df-as-paired", "along-se"])
def test_a_planted_edit_of_the_readmes_width_reading_is_caught(edit):
    before, after = (e.replace("−", "-") for e in edit)
    reading = readme_width_reading((ROOT / "README.md").read_text())
    assert before in reading
    reading = reading.replace(before, after, 1)
    gathered = trend.gather(WIDTH_FOLDERS)
    cells, _ = quoted_figures(reading)
    ratios = {f"{p['ratio']:.1f}" for p in gathered["pooled"].values() if p and p["ratio"]}
    caught = [c for c in cells if c not in trend_figures(gathered)] or \
        not set(re.findall(r"(\d+\.\d) times apart", reading)) <= ratios
    assert caught


def test_every_figure_of_the_width_studys_reading_in_docs_is_trend_py_on_the_committed_results():
    """docs/comparison.md's reading of the width study (its decomposition table included): each "m ± se"
    with the t after it is a figure of trend.gather on results/width-d*/, and so is every t quoted alone."""
    text = (ROOT / "docs" / "comparison.md").read_text()
    reading = text.split("The reading, as strong as three seeds a width allow")[1].split("![The paired")[0]
    cells, orphans = quoted_figures(" ".join(reading.replace("−", "-").split()))
    figures = trend_figures(trend.gather(WIDTH_FOLDERS))
    ts = {cell.split(", ")[-1] for cell in figures if ", t(" in cell}
    assert len(cells) >= 20 and orphans, (cells, orphans)
    assert not [cell for cell in cells if cell not in figures] and not [t for t in orphans if t not in ts]


def test_the_tokens_along_training_are_the_evaluations_own(widths):
    """An evaluation at a step with no training line (--log_interval not dividing --eval_interval) still has
    its tokens: read from the evaluation's own line."""
    write_logs(widths[0], OFFSETS)
    for log in widths[0].glob("*/log.jsonl"):
        lines = [json.loads(line) for line in log.read_text().splitlines()]
        log.write_text("".join(json.dumps(line) + "\n" for line in lines if "val_loss" in line))
    curve = trend.gather(widths)["points"][1]["along"]["mhar-H4 - baseline"]     # widths[0]: d 128
    assert curve["tokens"] == [5000, 10000, 15000, 20000]


def sweep_rows(results):
    """The d 128 temperature sweep's table as docs/comparison.md writes it, from a comparison's results.json:
    {tau: [mean whole-split loss, AttnRes at tau - baseline, MHAR H4 - AttnRes at tau]}, minus signs ASCII."""
    loss = {(r["variant"], r["seed"]): r["full_val_loss"] for r in results["rows"]}

    def paired(a, b):
        mean, se = mean_se([loss[a, s] - loss[b, s] for s in (0, 1, 2)])
        return f"{mean:+.4f} ± {se:.4f}, t(2) = {mean / se:+.1f}"
    variants = {1: "attnres", **{tau: f"attnres-T{tau}" for tau in (2, 4, 8, 16)}}
    return {str(tau): [f"{sum(loss[v, s] for s in (0, 1, 2)) / 3:.4f}", paired(v, "baseline"), paired("mhar-H4", v)]
            for tau, v in variants.items()}


def test_the_temperature_sweeps_table_in_docs_is_the_committed_runs():
    """docs/comparison.md's d 128 sweep (every tau on seeds 0-2), recomputed from results/width-d128 as
    committed; and the tau it says was chosen is the one with the lowest mean."""
    text = (ROOT / "docs" / "comparison.md").read_text()
    section = text.split("**The sweep at d 128, seeds 0–2**")[1].split("\n\n| τ |")[1].split("\n\n")[0]
    written = {cells[0]: cells[1:] for cells in ([c.strip().replace("−", "-") for c in line.strip("|").split("|")]
                                                 for line in section.splitlines()[2:])}
    expected = sweep_rows(json.loads((ROOT / "results" / "width-d128" / "results.json").read_text()))
    assert written == expected
    chosen = min(expected, key=lambda tau: float(expected[tau][0]))
    assert f"The choice at d 128: τ = {chosen} " in text


def rivals_rows(results, width):
    """The rivals' rows of docs/comparison.md's table at one width, from a comparison's results.json: {(d, method):
    [method - baseline, method - MHAR H4]}, each "m ± se, t(2) = x" over seeds 0-2, minus signs ASCII."""
    loss = {(r["variant"], r["seed"]): r["full_val_loss"] for r in results["rows"]}

    def paired(a, b):
        mean, se = mean_se([loss[a, s] - loss[b, s] for s in (0, 1, 2)])
        return f"{mean:+.4f} ± {se:.4f}, t(2) = {mean / se:+.1f}"
    rivals = ("muddformer", "depth-attention", "depth-attention-T0.1768")   # the last: at MHAR's temperature
    return {(str(width), m): [paired(m, "baseline"), paired(m, "mhar-H4")] for m in rivals if (m, 0) in loss}


def test_the_rivals_table_in_docs_is_the_committed_runs():
    """docs/comparison.md's table of the rivals, each width's rows recomputed from results/width-d<d> as
    committed (paired with the baseline and with MHAR H4 of the same seeds)."""
    text = (ROOT / "docs" / "comparison.md").read_text()
    section = text.split("### The rivals in the same comparison")[1].split("\n\n| d |")[1].split("\n\n")[0]
    written = {(cells[0], cells[1]): cells[2:] for cells in
               ([c.strip().replace("−", "-") for c in line.strip("|").split("|")] for line in section.splitlines()[2:])}
    expected = {}
    for width in sorted({int(d) for d, _ in written}):
        expected |= rivals_rows(json.loads((ROOT / "results" / f"width-d{width}" / "results.json").read_text()), width)
    assert written and written == expected



def test_depth_attention_at_mhars_temperature_against_its_own_is_the_committed_runs():
    """docs/comparison.md's sentence pairing depth-attention-T0.1768 with depth-attention, per width, recomputed."""
    text = (ROOT / "docs" / "comparison.md").read_text().replace("−", "-")
    cells = []
    for width in (64, 128):
        results = json.loads((ROOT / "results" / f"width-d{width}" / "results.json").read_text())
        loss = {(r["variant"], r["seed"]): r["full_val_loss"] for r in results["rows"]}
        mean, se = mean_se([loss["depth-attention-T0.1768", s] - loss["depth-attention", s] for s in (0, 1, 2)])
        cells.append(f"{mean:+.4f} ± {se:.4f}, t(2) = {mean / se:+.1f} at d {width}")
    assert f"`depth-attention`, paired): {cells[0]}; {cells[1]}." in text


def test_the_d256_sweep_sentence_in_docs_is_the_committed_runs():
    """docs/comparison.md's d 256 sweep: each tau's mean whole-split loss over seeds 0-2 and the choice (the lowest),
    recomputed from results/width-d256/results.json."""
    text = (ROOT / "docs" / "comparison.md").read_text()
    rows = json.loads((ROOT / "results" / "width-d256" / "results.json").read_text())["rows"]
    loss = {(r["variant"], r["seed"]): r["full_val_loss"] for r in rows}
    means = {tau: sum(loss[variant, s] for s in (0, 1, 2)) / 3
             for tau, variant in (("1", "attnres"), ("4", "attnres-T4"), ("8", "attnres-T8"), ("16", "attnres-T16"))}
    sentence = ", ".join(f"τ = {tau} {mean:.4f}" for tau, mean in means.items())
    others = {v: sum(loss[v, s] for s in (0, 1, 2)) / 3 for v in ("baseline", "mhar-H4")}
    assert f"whole-split means {sentence} (the baseline {others['baseline']:.4f}, MHAR H4 {others['mhar-H4']:.4f})" \
        in text.replace("\n", " ")
    assert f"The choice at d 256: τ = {min(means, key=means.get)}," in text.replace("\n", " ")
