"""
The paper's comparison in one command: train each method with the same seed and data order, then
print the table (tail-mean validation loss, its difference to the baseline, parameters, tokens/s,
peak memory) and draw the loss curves.

    python compare.py                                               # the four methods, small preset, CPU
    python compare.py --methods baseline,mhar --seeds 0,1           # two seeds of each
    python compare.py --baseline_seeds 1,2                          # the four, and the baseline's noise level
    python compare.py --route_heads 1,2,4,8                         # the H sweep (the paper's U-curve)
    python compare.py --preset 100m --out_dir runs/100m --nproc_per_node 8   # GPUs: each run under torchrun

Any other flag goes to every train.py run unchanged (--preset, --max_steps, --batch_size, ...), but
--fused, which only the routed runs (attnres, mhar) take.
Each run is a train.py process of its own (so its peak memory is its own) writing
runs/compare/<method>-s<seed>/; a finished run is not trained again. The comparison writes
results.md, results.json and loss_curves.png (with matplotlib) into --out_dir.
"""
import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import probe

HERE = Path(__file__).resolve().parent
METHODS = ("baseline", "hyper", "attnres", "mhar")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="compare.py", description=__doc__.split("\n\n")[0].strip())
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated residual modes ({','.join(METHODS)})")
    p.add_argument("--route_heads", help="comma-separated head counts: train mhar once per H instead of --methods")
    p.add_argument("--seeds", default="0", help="comma-separated seeds of every run (default 0)")
    p.add_argument("--baseline_seeds", default="", help="extra seeds for the baseline alone: the noise level")
    p.add_argument("--out_dir", default="runs/compare", help="one folder per run inside (default runs/compare)")
    p.add_argument("--nproc_per_node", type=int, default=1, help="processes per run; > 1 launches torchrun (DDP)")
    args, train_flags = p.parse_known_args(argv)
    for flag in ("--residual", "--out_dir", "--seed", "--resume"):
        if any(f == flag or f.startswith(flag + "=") for f in train_flags):
            p.error(f"{flag} is set per run by compare.py; leave it out")
    try:
        args.seeds = [int(s) for s in args.seeds.split(",")]
        args.baseline_seeds = [int(s) for s in args.baseline_seeds.split(",") if s]
        args.route_heads = [int(h) for h in args.route_heads.split(",")] if args.route_heads else None
    except ValueError:
        p.error("--seeds and --route_heads take comma-separated integers, e.g. --seeds 0,1")
    args.methods = args.methods.split(",")
    unknown = [m for m in args.methods if m not in METHODS]
    if unknown:
        p.error(f"unknown method {unknown[0]!r}: choose from {', '.join(METHODS)}")
    return args, train_flags


def runs_of(args):
    """(name, train.py flags) for every run of the comparison."""
    if args.route_heads:
        variants = [(f"mhar-H{h}", ["--residual", "mhar", "--route_heads", str(h)]) for h in args.route_heads]
    else:
        variants = [(m, ["--residual", m]) for m in args.methods]
    runs = [(f"{name}-s{seed}", [*flags, "--seed", str(seed)]) for seed in args.seeds for name, flags in variants]
    trained = {name for name, _ in runs}
    return runs + [(f"baseline-s{seed}", ["--residual", "baseline", "--seed", str(seed)])
                   for seed in args.baseline_seeds if f"baseline-s{seed}" not in trained]


def train_once(command, out_dir):
    """Train one run in its own process, unless its folder already holds a finished one; returns its summary."""
    summary_path = out_dir / "summary.json"
    if not summary_path.is_file():
        if subprocess.run(command).returncode != 0:
            sys.exit(f"compare.py: error: the run {out_dir} failed (its output is above); fix it and run again")
    return json.loads(summary_path.read_text())


def table(rows, baseline_loss):
    """The paper-style table, as markdown."""
    lines = ["| run | parameters | tail-mean val loss | Δ vs baseline | tokens/s | peak memory |",
             "|---|---|---|---|---|---|"]
    for row in rows:
        delta = "—" if baseline_loss is None else f"{row['tail_val_loss'] - baseline_loss:+.4f}"
        lines.append(f"| {row['name']} | {row['params']:,} | {row['tail_val_loss']:.4f} | {delta} | "
                     f"{row['tokens_per_s']:,.0f} | {row['peak_mem'] / 2**30:.2f} GiB |")
    return "\n".join(lines)


def main(argv=None):
    args, train_flags = parse_args(argv)
    out_dir = Path(args.out_dir)
    rows = []
    launcher = [sys.executable] + (["-m", "torch.distributed.run", "--standalone",
                                    f"--nproc_per_node={args.nproc_per_node}"] if args.nproc_per_node > 1 else [])
    for name, flags in runs_of(args):
        routed = flags[1] in ("attnres", "mhar")  # --fused applies to the routed runs alone
        shared = [f for f in train_flags if routed or f != "--fused"]
        command = [*launcher, str(HERE / "train.py"), *shared, *flags, "--out_dir", str(out_dir / name)]
        print(f"=== {name}: {' '.join(command[1:])}", flush=True)
        summary = train_once(command, out_dir / name)
        rows.append(dict(name=name, params=summary["params"], tail_val_loss=summary["tail_val_loss"],
                         tokens_per_s=summary["tokens_per_s"] or 0.0, peak_mem=summary["peak_mem"] or 0,
                         path=str(out_dir / name)))
    # Δ against the mean of the baselines (of every seed), when there are any
    baselines = [r["tail_val_loss"] for r in rows if r["name"].startswith("baseline-")]
    baseline_loss = statistics.mean(baselines) if baselines else None
    results = table(rows, baseline_loss)
    if len(baselines) > 1:
        results += (f"\n\nBaseline over {len(baselines)} seeds: {baseline_loss:.4f} ± "
                    f"{statistics.stdev(baselines):.4f} (sample standard deviation): the noise level.")
    print("\n" + results)
    (out_dir / "results.md").write_text(results + "\n")
    (out_dir / "results.json").write_text(json.dumps(dict(rows=rows, baseline_loss=baseline_loss,
                                                          train_flags=train_flags), indent=2))
    plt = probe.pyplot()
    if plt is None:
        print("loss curves: pip install matplotlib, then run this command again (the trained runs are reused)")
        return
    runs = [(row["path"], row["name"], probe.read_log(row["path"])) for row in rows]
    probe.plot_loss_curves(plt, runs, out_dir / "loss_curves.png")
    print(f"wrote {out_dir / 'results.md'} and {out_dir / 'loss_curves.png'}")


if __name__ == "__main__":
    main(sys.argv[1:])
