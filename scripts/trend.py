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
standard error sqrt(se_first^2 + se_last^2) and his degrees of freedom.

The probe. Where a routed run's folder holds probe.json (python -m scripts.probe --ckpt RUN/ckpt.pt), the table
adds how much its routing disagrees, against the probe's null (random queries of the same norm): a
multi-head run's head deviation (mean |α_h - mean over heads|), a single-head run's width disagreement (the
KL of its query's slices from the shared α); the mean over the seeds probed, and the mean z.

Writes trend.md, trend.json and, with matplotlib, paired_differences_by_<flag>.png (the differences against
the flag, ± one standard error; the flag's axis in log scale) into --out_dir. A folder without compare.py's
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
                          disagreement=disagreement(folder, results))
                     for (folder, results, _), value in zip(read, values)), key=lambda p: p["value"])
    labels = dict.fromkeys(label for p in points for label in p["differences"])
    if not labels:
        raise UserError("the folders hold no paired difference (each comparison trained one method alone): "
                        "compare at least one method with the baseline in each")
    trend = {}
    for label in labels:
        at = [p["differences"][label] for p in points if label in p["differences"]]
        if len(at) > 1:
            trend[label] = change(at[0], at[-1])
    return dict(flag=flag, metric=metric, points=points, trend=trend)


def metric_name(metric):
    return {"full_val_loss": "whole-split val loss", "tail_val_loss": "tail-mean val loss"}[metric]


def mean_se(stats):
    """"+0.0123 ± 0.0021" of a difference's {"mean", "se"}; "—" where it was not measured (None)."""
    return "—" if stats is None else compare.signed(stats["mean"], stats["se"])


def welch(c):
    return "—" if c["t"] is None else f"t({c['df']:.1f}) = {c['t']:+.1f}"


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
    except MachineError as e:
        exit_error("trend.py", e, status=1)
    except KeyboardInterrupt:
        exit_error("trend.py", "interrupted (Ctrl-C); nothing written", status=130)
    print(text)
    written = ["trend.md", "trend.json"] + ([figure] if plt is not None else [])
    print(f"\nwrote {', '.join(str(out_dir / w) for w in written)}"
          + ("" if plt is not None else " (the figure: pip install matplotlib, then run again)"))


if __name__ == "__main__":
    main(sys.argv[1:])
