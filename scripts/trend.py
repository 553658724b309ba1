"""
How a comparison's paired differences move along one flag: compare.py run once per width (or depth, ...),
each in a folder of its own, read back and set side by side.

    python -m scripts.trend runs/width-d64 runs/width-d128 runs/width-d256 --out_dir results/width
    python -m scripts.trend runs/depth-L2 runs/depth-L4 runs/depth-L8 --flag n_layer --metric tail_val_loss

The flag. The folders' comparisons are told apart by the train.py flags their runs were trained with (each
run's config.json): the flag is the first one, in train.py's order, whose value differs between folders
(n_embd for a width study that also scales n_head and ffn_hidden), or --flag. The folders are read in the
flag's order; two folders at the same value are refused.

The differences. Every paired difference compare.py reported in a folder: each method minus the baseline,
and each routed method minus each --versus method (a difference and its reverse are one: attnres-T4 -
attnres is kept, attnres - attnres-T4 left out). Each is the mean over the seeds both runs were trained at,
± its standard error, with the paired t and its degrees of freedom (n - 1), of --metric: full_val_loss (the
whole validation split, train.py's score at a run's end) where every run has it, else the tail mean of the
sampled evaluations. The trend of a difference is its change from the flag's first value to its last: the
seeds of two widths are different models, so the two means are unpaired, and the change carries Welch's
standard error sqrt(se_first^2 + se_last^2) and his degrees of freedom; so does the change between every two
values. Where three seeds' spreads differ between values by more than chance tells apart, the spread pooled
over the values (each difference's variances weighted by their degrees of freedom: 2 per value of three seeds)
gives each value's t and the change's a reading to set beside: trend.md tables both, with the ratio of the
largest spread to the smallest.

Along training. Each difference at every sampled evaluation that both runs of each seed logged (log.jsonl):
trend.md reads it at the evaluations nearest a quarter, a half, three quarters and the end of each run, and
paired_differences_along_training.png draws it against the tokens trained, one line per value of the flag
(a longer run beside a shorter one: python -m scripts.trend runs/d128 runs/d128-long --flag max_steps).

The probe. Where a routed run's folder holds probe.json (python -m scripts.probe --ckpt RUN/ckpt.pt), the table
adds how much its routing disagrees, against the probe's null (random queries of the same norm): a
multi-head run's head deviation (mean |α_h - mean over heads|), a single-head run's width disagreement (the
KL of its query's slices from the shared α); the mean over the seeds probed, and the mean z.

Writes trend.md, trend.json and, with matplotlib, paired_differences_by_<flag>.png (the differences against
the flag, ± one standard error; the flag's axis in log scale) and the figure along training into --out_dir. A folder without compare.py's
results.json, a flag that does not differ, or a metric some run lacks is one line and exit status 2.
"""
import os

INTERRUPTED = b"trend.py: error: interrupted (Ctrl-C); nothing written\n"
try:  # the script's first instruction: a Ctrl-C until the files begin is this line at once (interrupts.py)
    from lib import interrupts
    interrupts.guard(__name__, INTERRUPTED)
except KeyboardInterrupt:  # one in the microseconds before
    os.write(2, INTERRUPTED)
    os._exit(130)

import json  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from lib.common import FlagParser, MachineError, UserError, exit_error, output_folder, staged  # noqa: E402
from scripts import compare, probe  # noqa: E402

# train.py's flags that belong to one run of a comparison, not to the comparison: never its axis
PER_RUN = ("residual", "route_heads", "route_temperature", "seed", "out_dir", "resume", "init_from", "delta")
METRICS = ("full_val_loss", "tail_val_loss")


def settings(folder, results):
    """{train.py flag: value} that every run of a comparison folder shares (its runs' config.json "args"),
    without the per-run ones. UserError when a run's config.json is missing or unreadable."""
    shared = None
    for row in results["rows"]:
        record = compare.read_json(Path(folder) / row["name"] / "config.json")
        if record is None or not isinstance(record.get("args"), dict):
            raise UserError(f"{Path(folder) / row['name']} has no readable config.json (train.py's record of the "
                            f"run): the folder is not compare.py's as it was written")
        args = {k: v for k, v in record["args"].items() if k not in PER_RUN}
        shared = args if shared is None else {k: v for k, v in shared.items() if args.get(k) == v}
    return shared or {}


def axis(settings_of, flag=None):
    """The flag the folders differ by: `flag`, or the first (in train.py's order) whose value is not the
    same in every folder. UserError when there is none, or `flag` does not differ."""
    first = settings_of[0]
    differing = [k for k in first if any(s.get(k) != first[k] for s in settings_of[1:])]
    if flag is None:
        if not differing:
            raise UserError("the folders' runs were trained with the same flags: nothing to set side by side")
        return differing[0]
    if flag not in differing:
        raise UserError(f"--flag {flag} has the same value in every folder" + (
            f": choose from {', '.join(differing)}" if differing else ""))
    return flag


def differences(results, metric):
    """{"variant - paired with": pair} of one comparison's results.json: each method minus the baseline, then
    each routed method minus each --versus method, a difference whose reverse came before left out. A pair:
    compare.paired's dict of `metric` (seeds, deltas, n, mean, se), with "tail_val_loss" beside it when the
    metric is another."""
    found = {}
    for pair in results["pairs"] + [p for pairs in results["versus"].values() for p in pairs]:
        label = f"{pair['variant']} - {pair['baseline']}"
        if label in found or f"{pair['baseline']} - {pair['variant']}" in found:
            continue
        stats = pair if metric == "tail_val_loss" else pair[metric]
        found[label] = {**stats, "tail_val_loss": {k: pair[k] for k in ("n", "mean", "se")}}
    return found


def change(first, last):
    """last - first of two unpaired means (dicts with n, mean, se): {"mean", "se", "df", "t"}; se, df and t
    are None when either has no standard error (one seed) or both have none to add."""
    diff = last["mean"] - first["mean"]
    if first["se"] is None or last["se"] is None or first["se"] == last["se"] == 0:
        return dict(mean=diff, se=None, df=None, t=None)
    a, b = first["se"] ** 2, last["se"] ** 2
    se = math.sqrt(a + b)
    df = (a + b) ** 2 / (a ** 2 / (first["n"] - 1) + b ** 2 / (last["n"] - 1))  # Welch-Satterthwaite
    return dict(mean=diff, se=se, df=df, t=diff / se)


def disagreement(folder, results):
    """{variant: {"statistic", "value", "null", "z", "n"}} over the routed runs whose folder holds probe.json:
    the mean over those seeds of head deviation (H > 1) or width disagreement (H = 1), its null, and z."""
    by_variant = {}
    for row in results["rows"]:
        summary = compare.read_json(Path(folder) / row["name"] / "probe" / "probe.json")
        if summary is None:
            continue
        if "head_deviation" in summary:
            name, o = "head deviation", summary["head_deviation"]["overall"]
            measured = (o["mean_abs"], o["null_mean"], o["z"])
        elif "width_disagreement" in summary:
            name, w = "width disagreement (KL)", summary["width_disagreement"]
            measured = (w["kl_mean"], w["null_mean"], w["z"])
        else:
            continue
        by_variant.setdefault(row["variant"], (name, []))[1].append(measured)
    return {variant: dict(statistic=name, n=len(seen), **{k: mean_of([m[i] for m in seen])
                                                           for i, k in enumerate(("value", "null", "z"))})
            for variant, (name, seen) in by_variant.items()}


def mean_of(values):
    """The mean of the values that are not None (z is None where a null has no spread); None if none is."""
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def gather(folders, flag=None, metric=None):
    """The folders' comparisons along their flag: {"flag", "metric", "points": [{folder, value, differences,
    disagreement}] in the flag's order, "trend": {label: change from the first value to the last}}."""
    read = []
    for folder in folders:
        path = Path(folder) / "results.json"
        results = compare.read_json(path)
        if results is None or not all(k in results for k in ("rows", "pairs", "versus")):
            if path.exists():   # torn, or another tool's: compare.py writes it whole, last
                raise UserError(f"{path} is not a whole results.json of compare.py: run its compare.py command "
                                f"again (it reuses the finished runs and writes the file anew)")
            raise UserError(f"{folder} holds no results.json of compare.py: run python -m scripts.compare with "
                            f"--out_dir {folder} first")
        read.append((folder, results, settings(folder, results)))
    if len(read) < 2:
        raise UserError("give at least two comparison folders")
    flag = axis([s for _, _, s in read], flag)
    values = [s.get(flag) for _, _, s in read]
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        raise UserError(f"{flag} is not a number in every folder ({', '.join(map(str, values))}): the trend needs "
                        f"a numeric flag, e.g. --flag n_embd")
    twice = next((v for i, v in enumerate(values) if v in values[:i]), None)
    if twice is not None:
        raise UserError(f"two folders have {flag} = {twice}: one comparison per value")
    whole = all("full_val_loss" in row for _, results, _ in read for row in results["rows"])
    if metric is None:
        metric = "full_val_loss" if whole else "tail_val_loss"
    elif metric == "full_val_loss" and not whole:
        raise UserError("--metric full_val_loss: some runs have no whole-split score (trained before train.py "
                        "scored it); use --metric tail_val_loss")
    points = sorted((dict(folder=str(folder), value=value, differences=differences(results, metric),
                          disagreement=disagreement(folder, results), along=along(folder, results))
                     for (folder, results, _), value in zip(read, values)), key=lambda p: p["value"])
    labels = dict.fromkeys(label for p in points for label in p["differences"])
    if not labels:
        raise UserError("the folders hold no paired difference (each comparison trained one method alone): "
                        "compare at least one method with the baseline in each")
    trend, changes, pooled = {}, {}, {}
    for label in labels:
        at = [(p["value"], p["differences"][label]) for p in points if label in p["differences"]]
        if len(at) > 1:
            trend[label] = change(at[0][1], at[-1][1])
            changes[label] = {f"{a} → {b}": change(x, y) for i, (a, x) in enumerate(at) for b, y in at[i + 1:]}
            pooled[label] = pooled_spread(at)
    return dict(flag=flag, metric=metric, points=points, trend=trend, changes=changes, pooled=pooled)


def pooled_spread(at):
    """A difference's seed spread pooled over the flag's values, [(value, pair)]: the pairs' sample variances
    weighted by their degrees of freedom, s_p^2 = sum (n_i - 1) s_i^2 / sum (n_i - 1), which is the spread to
    use where the values' spreads differ more than three seeds each can tell apart from chance. {"ratio": the
    largest standard deviation over the smallest (None where one is 0), "sd", "df", "at": {value: {"mean", "se",
    "df", "t"}} with se = s_p / sqrt(n), "change": the first value's to the last's, se = s_p sqrt(1/n_a + 1/n_b)};
    None where a value has one seed."""
    if any(pair["se"] is None for _, pair in at):
        return None
    sds = [pair["se"] * math.sqrt(pair["n"]) for _, pair in at]
    df = sum(pair["n"] - 1 for _, pair in at)
    sd = math.sqrt(sum((pair["n"] - 1) * s ** 2 for (_, pair), s in zip(at, sds)) / df)

    def tested(mean, se):
        return dict(mean=mean, se=se, df=df, t=mean / se if se else None)
    (_, first), (_, last) = at[0], at[-1]
    return dict(ratio=max(sds) / min(sds) if min(sds) > 0 else None, sd=sd, df=df,
                at={value: tested(pair["mean"], sd / math.sqrt(pair["n"])) for value, pair in at},
                change=tested(last["mean"] - first["mean"], sd * math.sqrt(1 / first["n"] + 1 / last["n"])))


def along(folder, results):
    """Each paired difference of a comparison folder (differences()' labels) along training, on the sampled
    evaluations of its runs' log.jsonl: {label: {"steps", "tokens", "mean", "se"}}, each a list over the
    evaluations that every seed's two runs logged (a run without log.jsonl has none). UserError when a
    log.jsonl is not train.py's."""
    rows = results["rows"]
    logs = {}
    for row in rows:
        log = Path(folder) / row["name"] / "log.jsonl"
        try:
            logs[row["name"]] = probe.read_log(log) if log.is_file() else []
        except ValueError as e:  # a line that is not JSON
            raise UserError(str(e)) from None
    tokens = {e["step"]: e["tokens"] for log in logs.values() for e in log if "val_loss" in e and "tokens" in e}
    curves = {f"{variant} - baseline": curve for variant, curve in compare.paired_curves(rows, logs).items()}
    for routed in results["versus"]:
        curves.update({f"{variant} - {routed}": curve
                       for variant, curve in compare.paired_curves(compare.versus(rows, routed), logs).items()
                       if f"{routed} - {variant}" not in curves})
    return {label: dict(steps=steps, tokens=[tokens.get(s) for s in steps], mean=means, se=ses)
            for label, (steps, means, ses) in curves.items() if steps}


def metric_name(metric):
    return {"full_val_loss": "whole-split val loss", "tail_val_loss": "tail-mean val loss"}[metric]


def mean_se(stats):
    """"+0.0123 ± 0.0021" of a difference's {"mean", "se"}; "—" where it was not measured (None)."""
    return "—" if stats is None else compare.signed(stats["mean"], stats["se"])


def welch(c):
    return "—" if c["t"] is None else f"t({c['df']:.1f}) = {c['t']:+.1f}"


def changed(c):
    """"-0.0316 ± 0.0085, t(3.1) = -3.7" of a change (or a pooled difference: its df a whole number)."""
    if c is None:
        return "—"
    return mean_se(c) + ("" if c["t"] is None else f", t({c['df']:.{0 if c['df'] == int(c['df']) else 1}f}) "
                                                    f"= {c['t']:+.1f}")


ALONG_FIGURE = "paired_differences_along_training.png"
ALONG = (("¼", 0.25), ("½", 0.5), ("¾", 0.75), ("end", 1.0))  # where trend.md reads a difference along training


def labels_of(points, key):
    return list(dict.fromkeys(label for p in points for label in p[key]))


def nearest(curve, fraction):
    """The index of the evaluation nearest `fraction` of the curve's last step (the earlier one at a tie)."""
    target = fraction * curve["steps"][-1]
    return min(range(len(curve["steps"])), key=lambda i: abs(curve["steps"][i] - target))


def sampled(curve, fraction):
    i = nearest(curve, fraction)
    return f"{mean_se(dict(mean=curve['mean'][i], se=curve['se'][i]))} ({curve['steps'][i]})"


def report(gathered):
    """trend.md: a table of paired differences per value of the flag, the trend of each difference, and the
    probe's disagreement where the runs were probed."""
    flag, metric, points = gathered["flag"], gathered["metric"], gathered["points"]
    name = metric_name(metric)
    columns = [("difference", lambda lp: lp[0]),
               ("seeds", lambda lp: ",".join(map(str, lp[1]["seeds"]))),
               ("n", lambda lp: str(lp[1]["n"])),
               (f"Δ {name} (mean ± s.e.)", lambda lp: mean_se(lp[1])),
               ("t (df)", lambda lp: compare.t_of(lp[1]))]
    if metric != "tail_val_loss":
        columns.append(("Δ tail-mean val loss (mean ± s.e.)",
                        lambda lp: mean_se(lp[1]["tail_val_loss"])))
    parts = [f"Paired differences along {flag} (compare.py's pairs: same initialization seed, same batches), "
             f"of the {name}; mean ± standard error over the n seeds, the paired t with n - 1 degrees of freedom."]
    for p in points:
        parts.append(f"{flag} = {p['value']} ({p['folder']}):\n\n" + compare.markdown(columns,
                                                                                      p["differences"].items()))
    first, last = points[0]["value"], points[-1]["value"]
    trend_columns = ([("difference", lambda lc: lc[0])]
                     + [(f"{flag} {p['value']}", lambda lc, p=p: mean_se(p["differences"].get(lc[0])))
                        for p in points]
                     + [(f"change {first} → {last}", lambda lc: mean_se(lc[1])),
                        ("Welch t (df)", lambda lc: welch(lc[1]))])
    parts.append(f"The trend: each difference at every {flag}, and its change from the first {flag} it was "
                 f"measured at to the last (unpaired: Welch's standard error and degrees of freedom).\n\n"
                 + compare.markdown(trend_columns, gathered["trend"].items()))
    pair_names = list(dict.fromkeys(c for changes in gathered["changes"].values() for c in changes))
    change_columns = ([("difference", lambda lc: lc[0])]
                      + [(f"change {c}", lambda lc, c=c: changed(lc[1].get(c))) for c in pair_names])
    parts.append(f"Every change between two values of {flag} (unpaired: Welch's standard error and degrees of "
                 f"freedom).\n\n" + compare.markdown(change_columns, gathered["changes"].items()))
    pooled = [(label, p) for label, p in gathered["pooled"].items() if p is not None]
    if pooled:
        pooled_columns = ([("difference", lambda lp: lp[0]),
                           ("spread ratio", lambda lp: "—" if lp[1]["ratio"] is None else f"{lp[1]['ratio']:.1f}"),
                           ("pooled s.d.", lambda lp: f"{lp[1]['sd']:.4f}")]
                          + [(f"{flag} {p['value']}", lambda lp, v=p["value"]: changed(lp[1]["at"].get(v)))
                             for p in points]
                          + [(f"change {first} → {last}", lambda lp: changed(lp[1]["change"]))])
        parts.append(f"The same with the seeds' spread pooled over every {flag} (each difference's sample variances "
                     f"weighted by their degrees of freedom, which the t's then carry): the reading to set beside "
                     f"the one above where the spreads differ by more than 3x (the spread ratio: the largest "
                     f"standard deviation over the smallest).\n\n" + compare.markdown(pooled_columns, pooled))
    along_columns = [("difference", lambda lp: lp[0]), (flag, lambda lp: str(lp[1]))] + [
        (f"{name} (step)", lambda lp, f=f: sampled(lp[2], f)) for name, f in ALONG]
    along_rows = [(label, p["value"], p["along"][label]) for label in labels_of(points, "along")
                  for p in points if label in p["along"]]
    if along_rows:
        parts.append("Along training, on the sampled evaluations (log.jsonl): each difference at the evaluation "
                     "nearest a quarter, a half, three quarters of the run and at its end; mean ± s.e. over the "
                     "seeds.\n\n" + compare.markdown(along_columns, along_rows))
    probed = dict.fromkeys(v for p in points for v in p["disagreement"])
    if probed:
        def cell(d):
            if d is None:
                return "—"
            z = "" if d["z"] is None else f", z {d['z']:.1f}"
            return f"{d['value']:.4f} (null {d['null']:.4f}{z}; n {d['n']})"
        probe_columns = ([("method", lambda v: v),
                          ("statistic", lambda v: next(p["disagreement"][v]["statistic"] for p in points
                                                       if v in p["disagreement"]))]
                         + [(f"{flag} {p['value']}", lambda v, p=p: cell(p["disagreement"].get(v))) for p in points])
        parts.append("How much the routing disagrees (probe.py on the final checkpoints), against random queries "
                     "of the same norm: the mean over the seeds probed, and the mean z.\n\n"
                     + compare.markdown(probe_columns, probed))
    return "\n\n".join(parts)


def plot(plt, gathered, path):
    """The paired differences against the flag, ± one standard error: those to the baseline on the left,
    those between routed methods on the right (when there are any)."""
    flag, points = gathered["flag"], gathered["points"]
    labels = list(dict.fromkeys(label for p in points for label in p["differences"]))
    panels = [[l for l in labels if l.split(" - ")[1].startswith("baseline")],
              [l for l in labels if not l.split(" - ")[1].startswith("baseline")]]
    panels = [panel for panel in panels if panel]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 3.8), constrained_layout=True,
                             squeeze=False)
    values = [p["value"] for p in points]
    for ax, panel in zip(axes[0], panels):
        ax.axhline(0, color="black", linewidth=0.8)
        for i, label in enumerate(panel):
            shift = 1.03 ** (i - (len(panel) - 1) / 2)  # side by side, not on top of each other
            at = [(p["value"] * shift, p["differences"][label]) for p in points if label in p["differences"]]
            ax.errorbar([x for x, _ in at], [d["mean"] for _, d in at], yerr=[d["se"] or 0 for _, d in at],
                        fmt="o-", color=f"C{labels.index(label)}", capsize=3, markersize=4, label=label)
        ax.set_xscale("log", base=2)
        ax.set_xticks(values, [str(v) for v in values])
        ax.minorticks_off()
        ax.set_xlabel(flag)
        ax.set_ylabel(f"Δ {metric_name(gathered['metric'])} (nats/token)")
        ax.legend(fontsize=8)
    axes[0][0].set_title("minus the baseline: mean over seeds ± s.e.", fontsize=10)
    if len(panels) > 1:
        axes[0][1].set_title("between routed methods", fontsize=10)
    fig.savefig(path, dpi=probe.FIGURE_DPI)
    plt.close(fig)


def plot_along(plt, gathered, path):
    """Each paired difference along training, one panel each: one line per value of the flag against the
    tokens trained, ± one standard error shaded."""
    points, labels = gathered["points"], labels_of(gathered["points"], "along")
    columns = min(3, len(labels))
    rows = -(-len(labels) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(4.6 * columns, 3.2 * rows), constrained_layout=True,
                             squeeze=False)
    for ax, label in zip(axes.flat, labels):
        ax.axhline(0, color="black", linewidth=0.8)
        for i, p in enumerate(points):
            curve = p["along"].get(label)
            if curve is None:
                continue
            ax.plot(curve["tokens"], curve["mean"], "o-", color=f"C{i}", markersize=2.5,
                    label=f"{gathered['flag']} {p['value']}")
            if all(se is not None for se in curve["se"]):
                ax.fill_between(curve["tokens"], [m - e for m, e in zip(curve["mean"], curve["se"])],
                                [m + e for m, e in zip(curve["mean"], curve["se"])], color=f"C{i}", alpha=0.2,
                                linewidth=0)
        ax.set_title(label, fontsize=10)
        ax.set_xlabel("tokens trained")
        ax.set_ylabel("Δ sampled val loss")
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(labels):]:
        ax.set_visible(False)
    fig.savefig(path, dpi=probe.FIGURE_DPI)
    plt.close(fig)


def parse_args(argv=None):
    p = FlagParser(prog="trend.py", description=__doc__.split("\n\n")[0].strip())
    p.add_argument("folders", nargs="+", help="compare.py --out_dir folders, one per value of the flag")
    p.add_argument("--flag", help="the train.py flag the folders differ by (default: the first that differs)")
    p.add_argument("--metric", choices=METRICS, help="the loss the differences are of (default full_val_loss "
                                                     "where every run has it, else tail_val_loss)")
    p.add_argument("--out_dir", default="runs/trend", help="where trend.md, trend.json and the figure go "
                                                           "(default runs/trend)")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    try:
        out_dir = output_folder(args.out_dir, "--out_dir")
        gathered = gather(args.folders, args.flag, args.metric)
    except UserError as e:
        exit_error("trend.py", e)
    text = report(gathered)
    plt = probe.pyplot()
    figure = f"paired_differences_by_{gathered['flag']}.png"
    interrupts.begin()  # the files begin: a Ctrl-C unwinds through staged(), which removes them
    try:
        with staged(out_dir) as tmp:
            (tmp / "trend.md").write_text(text + "\n")
            (tmp / "trend.json").write_text(json.dumps(gathered, indent=1))
            if plt is not None:
                plot(plt, gathered, tmp / figure)
                if any(p["along"] for p in gathered["points"]):
                    plot_along(plt, gathered, tmp / ALONG_FIGURE)
    except MachineError as e:
        exit_error("trend.py", e, status=1)
    except KeyboardInterrupt:
        exit_error("trend.py", "interrupted (Ctrl-C); nothing written", status=130)
    print(text)
    drawn = [figure] + ([ALONG_FIGURE] if any(p["along"] for p in gathered["points"]) else [])
    written = ["trend.md", "trend.json"] + (drawn if plt is not None else [])
    print(f"\nwrote {', '.join(str(out_dir / w) for w in written)}"
          + ("" if plt is not None else " (the figure: pip install matplotlib, then run again)"))


if __name__ == "__main__":
    main(sys.argv[1:])
