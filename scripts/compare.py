"""
The paper's comparison in one command: train each method with the same seeds and data order, then print
the paired differences to the baseline and every run's row, and draw the loss curves.

    python -m scripts.compare                                               # the four methods, small preset, CPU
    python -m scripts.compare --methods baseline,mhar --seeds 0,1,2         # three seeds: paired Δ ± standard error
    python -m scripts.compare --baseline_seeds 1,2                          # the four, and the baseline's noise level
    python -m scripts.compare --route_heads 1,2,4,8                         # the H sweep (the U-curve), with the baseline
    python -m scripts.compare --route_heads 1,2,4,8 --n_head 8 --n_kv_head 1,2,4,8   # the KV x H grid, a baseline per KV
    python -m scripts.compare --preset small-bytes --methods baseline,attnres,attnres-T4,mhar --route_heads 2,4,8 \
        --seeds 0,1,2 --jobs 2 --versus attnres,attnres-T4          # the CPU comparison of the README
    python -m scripts.compare --preset 100m --out_dir runs/100m --nproc_per_node 8   # GPUs: each run under torchrun
    python -m scripts.compare --methods baseline,mhar --eval_tasks hellaswag,lambada_openai  # and benchmarks
    python -m scripts.compare --preset 100m --methods baseline,mhar --seeds 0,1,2 --plan  # its cost: GPU-hours

Runs. A run is a method (with --route_heads: mhar once per H, named mhar-H<h>), a model shape and a seed.
A routed method with -T<tau> (attnres-T4, mhar-T0.5) trains at train.py's --route_temperature tau: attnres-T4
is AttnRes with its logits divided by 4, the temperature control for mhar at H = 4 (docs/methods.md);
depth-attention-T0.1768 divides Depth-Attention's depth logits by 0.1768 beyond their 1/sqrt(head_dim).
A shape flag (--n_layer, --n_embd, --n_head, --n_kv_head, --ffn_hidden) given a comma-separated list is a
grid axis: every method is trained at every combination, and the run's name carries its value
(mhar-H4-kv2-s0 and baseline-kv2-s0); one value goes to every run and stays out of the names. Every
combination is checked against mhar.Config before anything trains. Any other flag goes to every train.py
run unchanged (--preset, --max_steps, --batch_size, ...), but --fused, which only the routed runs
(attnres, mhar) take. Each run is a train.py process of its own (so its peak memory is its own) writing
runs/compare/<name>/; a finished run is not trained again, and one stopped before its end (Ctrl-C,
SIGTERM) goes on from its checkpoint (train.py --resume), so the same command continues a comparison.
A run folder is reused or resumed only when the run it holds was trained as this one would be: its
config.json (a finished run) or ckpt.pt (a stopped one) records the same preset, model, data (path and
content), schedule, seed and method (only flags that say how a run computes or reports, as --device,
--batch_size at the same global batch or --fused, may differ), and a finished run's summary.json agrees
(its steps, method and tokens). Any other run there, or a summary.json without a config.json, stops the
comparison before anything trains; a torn summary.json is a run that did not finish. Two runs that would train alike (--seeds 0,0, --methods mhar-T2,mhar-T2.0) are refused too.
--jobs N trains N runs at a time, each with 1/N of the cores (OMP_NUM_THREADS, unless set) and its output
in runs/compare/<name>.out. A line says when each run ends, in how long, and how many are left. After a
run fails no other starts (those under way finish). SIGINT or SIGTERM to compare.py reaches every run
under way: each saves a checkpoint and stops, and compare.py exits with 128 + the signal's number once
they have; the same command goes on from there.

Pairs. Each run is paired with the baseline of the same shape and the same seed: the same initialization
seed and the same batches, so their difference is free of most of the noise that separates two seeds. The
paired table gives, per method and shape, the mean over seeds of (method - baseline) and its standard
error (sample standard deviation / sqrt(n), n = the seeds with both runs; one seed: no error bar). The
per-run table gives each run's own difference to its baseline. --baseline_seeds trains the baseline alone
at more seeds: the spread between seeds, the noise that unpaired differences carry. --versus attnres-T4 adds
a paired table of every other routed method minus attnres-T4 at the same seed (mhar-H4 - attnres-T4: what
routing each slice alone adds over the flatter softmax).

Benchmarks. --eval_tasks evaluates each finished run with eval.py (lm-evaluation-harness, `pip install
lm-eval`; only this path imports it) on those tasks, its own or ones that YAML files in --eval_include define
over local files, and writes <run>/eval.json; a run whose eval.json holds the same tasks at the same
--eval_limit for its final step is not evaluated again. Every metric becomes a column of the per-run table,
and its paired difference to the baseline a column of the paired table.

Plan. --plan trains nothing: it prints one line per run, its parameters, the tokens it would train on
(--max_steps x the global batch x --seq_len, as train.py resolves them), its training FLOPs per token
(mhar.GPT.flops_per_token(), the model built on the meta device: no memory, no time) and in all, and the hours
those FLOPs take on one --plan_device at --plan_mfu of its dense bf16 peak (lib/common.PEAK_FLOPS); then the
total. The hours are an estimate from the FLOP count at that assumed utilisation, not a measurement. Every run
is planned, also one already finished in --out_dir (which is neither read nor created); no data is read (only
--data's meta.json, for the vocabulary) and no GPU is needed.

Writes results.md (both tables), results.json, and with matplotlib loss_curves.png (every run) and
paired_curves.png (each method's paired difference to the baseline at every evaluation, mean ± s.e. over
the seeds) into --out_dir.
A flag out of range, an impossible shape, or any mistake a run would meet in its first second (a device
or data that is not there, --fused without triton, a bad train.py flag) is one line on stderr and exit
status 2 before the first run starts; an --out_dir that cannot be written, one line and status 1.
"""
import argparse
import dataclasses
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

import mhar
import prepare
from lib import rivals
from lib.common import (PEAK_FLOPS, ROOT, FlagParser, MachineError, StopSignals, UserError, duration, exit_error,
                        fingerprint, one_line, output_folder, pick_device, progress, read_checkpoint, seed, staged,
                        training_data, write_atomically)
from scripts import probe

DEFAULT_METHODS = ("baseline", "hyper", "attnres", "mhar")
METHODS = (*DEFAULT_METHODS, *rivals.RESIDUALS)  # and the rivals: lib/rivals.py (muddformer, depth-attention)
TEMPERATURE = re.compile(r"(?P<method>attnres|mhar|depth-attention)-T(?P<tau>\d+(\.\d+)?)")  # attnres-T4: tau 4
# the shape fields of mhar.Config that a grid can sweep, and their tags in run names (n_head "nh": "H" is
# --route_heads)
SHAPE_FLAGS = {"n_layer": "L", "n_embd": "d", "n_head": "nh", "n_kv_head": "kv", "ffn_hidden": "ffn"}
PLAN_DEVICE, PLAN_MFU = "NVIDIA H100 80GB HBM3", 0.4  # --plan's GPU (a key of PEAK_FLOPS) and its utilisation


@dataclass
class Run:
    name: str               # its folder under --out_dir: variant + "-s<seed>"
    variant: str            # method and shape without the seed ("mhar-H4-kv2"): its seeds are averaged
    baseline: str           # the variant it is paired with ("baseline-kv2"); None for a baseline
    method: str             # its --residual
    seed: int
    flags: list = field(default_factory=list)  # train.py flags of this run (the shared ones come first)


def int_list(text):
    return [int(v) for v in text.split(",") if v.strip()]


def seed_list(text):
    """An argparse type: comma-separated seeds, each one common.seed takes (an int64 >= 0), e.g. "0,1,2"."""
    return [seed(v.strip()) for v in text.split(",") if v.strip()]


def parse_args(argv=None):
    # no abbreviations: a flag compare.py does not take goes to train.py as typed (train.py's --seed is not
    # compare.py's --seeds)
    p = FlagParser(prog="compare.py", description=__doc__.split("\n\n")[0].strip(), allow_abbrev=False)
    p.add_argument("--methods", help=f"comma-separated residual modes of {','.join(METHODS)} (default "
                                     f"{','.join(DEFAULT_METHODS)}; with "
                                     "--route_heads: baseline,mhar)")
    p.add_argument("--route_heads", help="comma-separated head counts: train mhar once per H")
    for name in SHAPE_FLAGS:
        p.add_argument(f"--{name}", help=f"train.py's --{name}; a comma-separated list is a grid axis")
    p.add_argument("--seeds", type=seed_list, default="0", help="comma-separated seeds of every run (default 0)")
    p.add_argument("--baseline_seeds", type=seed_list, default="",
                   help="extra seeds for the baseline alone: the noise level")
    p.add_argument("--out_dir", default="runs/compare", help="one folder per run inside (default runs/compare)")
    p.add_argument("--nproc_per_node", type=int, default=1, help="processes per run; > 1 launches torchrun (DDP)")
    p.add_argument("--versus", default="", help="comma-separated methods (e.g. attnres,attnres-T4): a paired table "
                                                "each, of every other routed method minus it at the same seed")
    p.add_argument("--jobs", type=int, default=1, help="runs trained at a time, each on 1/jobs of the cores "
                                                       "(default 1)")
    p.add_argument("--eval_tasks", help="comma-separated lm-eval tasks: evaluate every finished run on them "
                                        "with eval.py, one column per metric")
    p.add_argument("--eval_include", metavar="DIR",
                   help="a folder of task YAML files (tasks over local files)")
    p.add_argument("--eval_limit", type=float, help="at most this many documents per task (< 1: a fraction)")
    p.add_argument("--eval_batch_size", type=int, default=8, help="sequences per forward (default 8)")
    p.add_argument("--plan", action="store_true",
                   help="train nothing: print each run's parameters, tokens, training FLOPs and the hours they "
                        "would take on one --plan_device at --plan_mfu (an estimate, not a measurement); every "
                        "run is planned, also those already finished in --out_dir, which is not created")
    p.add_argument("--plan_device", metavar="NAME", help="--plan: the GPU, a name of lib/common.PEAK_FLOPS "
                                                         f"(default {PLAN_DEVICE!r})")
    p.add_argument("--plan_mfu", type=float, help="--plan: the model-FLOPs utilisation assumed, in (0, 1] "
                                                  f"(default {PLAN_MFU})")
    args, train_flags = p.parse_known_args(argv)
    for flag in ("--residual", "--seed", "--resume"):  # (--out_dir is compare.py's own)
        if any(f == flag or f.startswith(flag + "=") for f in train_flags):
            exit_error("compare.py", f"{flag} is set per run by compare.py; leave it out")
    try:
        args.route_heads = int_list(args.route_heads) if args.route_heads else None
        args.shape = {k: int_list(getattr(args, k)) for k in SHAPE_FLAGS if getattr(args, k)}
    except ValueError:
        exit_error("compare.py", "--route_heads and the shape flags take comma-separated integers, e.g. "
                                 "--route_heads 1,2,4")
    if not args.seeds:
        exit_error("compare.py", "--seeds needs at least one seed, e.g. --seeds 0")
    default = ("baseline", "mhar") if args.route_heads else DEFAULT_METHODS
    args.methods = (",".join(default) if args.methods is None else args.methods).split(",")
    unknown = [m for m in args.methods if m not in METHODS and not TEMPERATURE.fullmatch(m)]
    if unknown:
        exit_error("compare.py", f"unknown method {unknown[0]!r}: choose from {', '.join(METHODS)}, or "
                                 f"attnres-T<tau> / mhar-T<tau> / depth-attention-T<tau> (at --route_temperature tau)")
    if len(set(args.methods)) < len(args.methods):
        exit_error("compare.py", f"--methods names a method twice: {','.join(args.methods)}")
    if args.route_heads and "mhar" not in args.methods:
        exit_error("compare.py", "--route_heads sweeps mhar's heads: add mhar to --methods")
    if args.nproc_per_node < 1:
        exit_error("compare.py", f"--nproc_per_node must be at least 1, got {args.nproc_per_node}")
    if args.jobs < 1:
        exit_error("compare.py", f"--jobs must be at least 1, got {args.jobs}")
    args.versus = [v for v in args.versus.split(",") if v]
    variants = {run.variant for run in runs_of(args)}
    missing = [v for v in args.versus if v not in variants or v.startswith("baseline")]
    if missing:
        exit_error("compare.py", f"--versus {missing[0]} is not a routed method of this comparison: choose from "
                                 f"{', '.join(sorted(v for v in variants if not v.startswith('baseline')))}")
    check_eval_and_plan(args)
    return args, train_flags


def check_eval_and_plan(args):
    """parse_args' judgement of the lm-eval flags and of --plan's: each mistake one line, status 2; the
    defaults filled in."""
    args.eval_tasks = [t.strip() for t in (args.eval_tasks or "").split(",") if t.strip()]
    if not args.eval_tasks and (args.eval_include or args.eval_limit is not None):
        exit_error("compare.py", "--eval_include and --eval_limit go with --eval_tasks: name the tasks")
    if args.eval_include and not Path(args.eval_include).is_dir():
        exit_error("compare.py", f"--eval_include {args.eval_include} is not a folder (of task YAML files)")
    if args.eval_limit is not None and not args.eval_limit > 0:
        exit_error("compare.py", f"--eval_limit must be positive, got {args.eval_limit}")
    if args.eval_limit is not None and args.eval_limit >= 1:
        args.eval_limit = int(args.eval_limit)  # a count; below 1, a fraction (lm-eval's convention)
    if args.eval_batch_size < 1:
        exit_error("compare.py", f"--eval_batch_size must be at least 1, got {args.eval_batch_size}")
    if not args.plan and (args.plan_device is not None or args.plan_mfu is not None):
        exit_error("compare.py", "--plan_device and --plan_mfu go with --plan")
    args.plan_device = PLAN_DEVICE if args.plan_device is None else args.plan_device
    args.plan_mfu = PLAN_MFU if args.plan_mfu is None else args.plan_mfu
    if args.plan_device not in PEAK_FLOPS:
        exit_error("compare.py", f"--plan_device {args.plan_device!r} has no peak in lib/common.PEAK_FLOPS: "
                                 f"choose from {', '.join(map(repr, PEAK_FLOPS))}")
    if not 0 < args.plan_mfu <= 1:  # nan too
        exit_error("compare.py", f"--plan_mfu must be in (0, 1] (a share of the peak, e.g. {PLAN_MFU}), "
                                 f"got {args.plan_mfu}")


def shapes_of(args):
    """Every combination of the shape axes: [(name suffix, {field: value})], e.g. ("-kv2", {"n_kv_head": 2})"""
    cells = [("", {})]
    for name, values in args.shape.items():
        tag = SHAPE_FLAGS[name] if len(values) > 1 else None  # one value: for every run, not in names
        cells = [(suffix + (f"-{tag}{v}" if tag else ""), {**shape, name: v}) for suffix, shape in cells
                 for v in values]
    return cells


def runs_of(args):
    """Every Run: per seed, per shape, the methods in order; then the extra baseline seeds."""
    variants = []  # (method name, --residual, its own flags)
    for method in args.methods:
        tempered = TEMPERATURE.fullmatch(method)
        if method == "mhar" and args.route_heads:
            variants += [(f"mhar-H{h}", "mhar", ["--route_heads", str(h)]) for h in args.route_heads]
        elif tempered:
            variants.append((method, tempered["method"], ["--route_temperature", tempered["tau"]]))
        else:
            variants.append((method, method, []))

    def run(name, method, flags, suffix, shape, seed):
        shape_flags = [f for k, v in shape.items() for f in (f"--{k}", str(v))]
        return Run(name=f"{name}{suffix}-s{seed}", variant=name + suffix, seed=seed, method=method,
                   baseline=None if method == "baseline" else "baseline" + suffix,
                   flags=["--residual", method, *flags, *shape_flags, "--seed", str(seed)])

    runs = [run(*variant, *cell, seed)
            for seed in args.seeds for cell in shapes_of(args) for variant in variants]
    names = {r.name for r in runs}
    runs += [r for seed in args.baseline_seeds for cell in shapes_of(args)
             for r in [run("baseline", "baseline", [], *cell, seed)] if r.name not in names]
    return runs


def train_argv(run, train_flags, out_dir="."):
    """The flags of `run`'s train.py: the shared ones (--fused only for the routed runs, the others have no
    routing to fuse), then the run's own, then its folder under out_dir."""
    routed = run.method in ("attnres", "mhar")
    return [*(f for f in train_flags if routed or f != "--fused"), *run.flags, "--out_dir",
            str(Path(out_dir) / run.name)]


def check_shapes(runs, train_flags):
    """Build every run's mhar.Config (at the preset the runs train, with every model flag) before anything
    trains: a grid cell that cannot exist (n_kv_head not dividing n_head, --seq_len 0, ...) stops the
    comparison at once, with one line; so does a flag train.py does not take, or a bad value of one (train.py's
    own line)."""
    import train  # its flags
    train.parse_args([*train_flags, *runs[0].flags])
    for run in runs:
        args, _ = train.parse_args(train_argv(run, train_flags))
        fields = {k: getattr(args, k) for k in train.CONFIG_FIELDS if getattr(args, k) is not None}
        try:
            rivals.preset(args.preset, **fields)
        except (ValueError, TypeError) as e:
            exit_error("compare.py", f"run {run.name} cannot be built at preset {args.preset}: {one_line(e)}")


# train.py's flags that say how a run computes or reports, not what it trains: a run may differ in them and
# still be the run asked for (train.py lets a resumed run change them too). --batch_size splits the global
# batch, which is compared instead; the machine's flags (--device, --grad_accum, ...) are never compared.
HOW_NOT_WHAT = ("batch_size", "log_interval", "wandb", "fused", "fused_group", "checkpointing")


def identity_keys():
    """The resolved flags that make a run what it is, in train.py's order: the preset, the data, the seed,
    the schedule, the model and its routing (the method); then the global batch."""
    import train
    return [k for k, role in train.ROLES.items() if role != train.MACHINE and k not in HOW_NOT_WHAT] + \
        ["global_batch"]


def resolve_runs(runs, train_flags, world, out_dir, plan=False):
    """({run name: the flags train.py would resolve for it (its config.json's "args": the run sizes of its
    preset, every mhar.Config field), JSON's values}, the data's fingerprint), without writing anything. On
    the way, every mistake a run would meet in its first second stops the comparison here, with one line: a
    device that is not there, data that is not there or does not fit the model, --fused without triton. A
    built-in corpus that is missing is prepared now, once (every run would). plan (--plan): neither the
    device nor the data is checked, only --data's meta.json read (the vocabulary; none: the preset's), and
    the fingerprint is "synthetic"."""
    import train
    resolved, tokens, meta = {}, None, {}
    for i, run in enumerate(runs):
        args, given = train.parse_args(train_argv(run, train_flags, out_dir))
        args = train.resolve_flags(args, given, world)[0]
        if i == 0:  # the data and the device: every run's
            try:
                if plan:
                    meta = training_data({"args": vars(args)})[1]
                else:
                    pick_device(args.device)
                    tokens = train.open_data(args, 0, False)
                    meta = tokens.meta if tokens else {}
            except UserError as e:
                exit_error("compare.py", e)
        config = train.model_config(args, meta)
        if i == 0:
            train.check_data(tokens, config)  # the vocabulary and --seq_len: the same for every run
        if config.fused and not plan:
            check_fused()
        resolved[run.name] = json.loads(json.dumps(vars(args)))  # as train.py writes config.json
    return resolved, fingerprint(tokens)


def check_fused():
    """--fused: the kernels can run in the runs' processes (triton is there, and a GPU or the interpreter),
    as train.py checks when it builds the model."""
    try:
        import kernel
        kernel.check_available()
    except (ImportError, RuntimeError) as e:
        exit_error("compare.py", f"--fused: {one_line(e)}; or leave --fused out")


def check_duplicates(runs, resolved):
    """Two runs that train.py would train alike (the same seed, method and shape, whatever their names:
    --seeds 0,0, --methods mhar-T2,mhar-T2.0, --route_heads 4,4) stop the comparison with one line."""
    keys, seen = identity_keys(), {}
    for run in runs:
        same = seen.setdefault(tuple(json.dumps(resolved[run.name].get(k)) for k in keys), run)
        if same is run:
            continue
        what = f"{run.name} is asked for twice" if same.name == run.name else \
            f"{same.name} and {run.name} are the same run (train.py would train both with the same flags)"
        exit_error("compare.py", f"{what}: give each seed, method and shape once")


def flag_default(name):
    """What a run recorded before train.py had the flag `name` trained with: its default (a model flag's:
    mhar.Config's)."""
    import train
    fields = {f.name: f.default for f in dataclasses.fields(mhar.Config)}
    return fields[name] if name in fields else train.PARSER.get_default(name)


def same_data(then, now):
    """Whether two --data values name the same folder: the same path, or two paths to one folder."""
    if os.path.normpath(then) == os.path.normpath(now):
        return True
    try:
        return os.path.samefile(then, now)
    except OSError:  # one of them is not there (or synthetic)
        return False


def first_difference(recorded, asked):
    """The first flag (in train.py's order, identity_keys) whose value a run recorded differs from the one
    asked for, as words ("--n_layer 3, not 4"), or None when none differs. A flag the record lacks (a run of
    an older train.py) had its default; a global batch it lacks is not compared."""
    for key in identity_keys():
        if key == "global_batch" and key not in recorded:
            continue
        then, now = recorded.get(key, flag_default(key)), asked.get(key)
        if then == now or key == "data" and isinstance(then, str) and isinstance(now, str) and same_data(then, now):
            continue
        if key == "global_batch":
            return f"a global batch of {then} sequences, not {now} (--batch_size x --grad_accum x ranks)"
        if isinstance(then, bool) and isinstance(now, bool):
            return f"--{key}, not without it" if then else f"no --{key}, not with it"
        return f"--{key} {then}, not {now}"
    return None


def read_json(path):
    """The JSON object in a file, or None: the file is missing, empty, torn (a crash mid-write by another
    tool) or not an object."""
    try:
        value = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def finished(summary):
    """Whether a summary.json (read_json's) is a finished train.py run's, with the numbers the tables take."""
    return summary is not None and summary.get("finished") is True and all(
        k in summary for k in ("params", "tail_val_loss", "tokens_per_s", "peak_mem", "step"))


def prior_run(folder, asked, data_print):
    """What `folder` holds of the run `asked` (its resolved flags): "finished" (reused), "stopped" (a
    checkpoint to resume) or None (nothing to reuse: trained from its start). UserError when it holds
    another run, or one whose flags cannot be read (a summary.json without config.json: not train.py's).
    A finished run's flags are its config.json's; a stopped one's its checkpoint's, which train.py --resume
    would continue; the checkpoint also remembers the data's content (common.fingerprint)."""
    if folder.exists() and not folder.is_dir():
        raise UserError(f"{folder} is a file, not a run's folder: move it away or choose another --out_dir")
    summary = read_json(folder / "summary.json")
    done = finished(summary)
    ckpt_path = folder / "ckpt.pt"
    ckpt = read_checkpoint(ckpt_path, keys=() if done else ("args", "config")) if ckpt_path.is_file() else None
    if done:
        record = read_json(folder / "config.json")
        if record is None or not isinstance(record.get("args"), dict):
            raise UserError(f"{folder} holds a summary.json but no config.json that says how its run was trained: "
                            f"move it away or choose another --out_dir")
        recorded = {**record["args"], **(record.get("config") or {})}
    elif ckpt is not None:
        recorded = {**ckpt["args"], **ckpt["config"]}
    else:
        return None
    difference = first_difference(recorded, asked)
    saved = (ckpt or {}).get("data_fingerprint")
    if difference is None and saved is not None and saved != data_print:
        difference = f"other data than {asked['data']} holds now (then: {saved}; now: {data_print})"
    if difference is not None:
        raise UserError(f"{folder} holds a run trained with {difference}: move it away or choose another "
                        f"--out_dir")
    disagreement = summary_disagreement(summary, asked) if done else None
    if disagreement is not None:
        raise UserError(f"{folder}'s summary.json is not of the run its config.json and this command describe "
                        f"({disagreement}): move it away or choose another --out_dir")
    return "finished" if done else "stopped"


def config_of(asked):
    """The Config (mhar's, or a rival's: lib/rivals.py) of a run's resolved flags (resolve_runs')."""
    return rivals.config_of({f.name: asked[f.name] for f in dataclasses.fields(mhar.Config) if f.name in asked})


def tokens_of(asked):
    """The tokens a run trains on, from its resolved flags: --max_steps x the global batch x --seq_len."""
    return asked["max_steps"] * asked["global_batch"] * asked["seq_len"]


def summary_disagreement(summary, asked):
    """The first number a finished run's summary.json records (its steps, its method, the tokens it saw) that
    the run `asked` (its resolved flags) would not have, as "step 4, not 2"; None when they agree. A number
    the summary does not record (an older train.py's) is not judged."""
    config = config_of(asked)
    steps = asked["max_steps"]
    expected = dict(step=steps, max_steps=steps, residual=config.residual, route_heads=config.depth_heads,
                    **({} if asked.get("init_from") else  # a converted run counts its source's tokens too
                       dict(tokens=tokens_of(asked))))
    return next((f"{name} {summary[name]!r}, not {value!r}" for name, value in expected.items()
                 if name in summary and summary[name] != value), None)


def check_eval(args, train_flags):
    """Before anything trains: lm-eval is installed, the training data is text that a tokenizer wrote,
    and every --eval_tasks name is known. Returns lm-eval's index of the tasks (built once for all runs),
    None without --eval_tasks."""
    if not args.eval_tasks:
        return None
    from scripts import eval as benchmarks  # imports lm-eval: only with --eval_tasks
    data = argparse.ArgumentParser(add_help=False)
    data.add_argument("--data")
    data, meta = training_data({"args": vars(data.parse_known_args(train_flags)[0])})
    try:
        benchmarks.require_lm_eval()
        if meta and prepare.tokenizer_of(meta) is None:
            raise UserError(f"--eval_tasks: {data} holds token ids that no text tokenizer wrote "
                            f"(meta.json: tokenizer {meta.get('tokenizer')!r}), and lm-eval's tasks "
                            f"are text: train on a prepare.py corpus")
        return benchmarks.task_manager(args.eval_tasks, args.eval_include)
    except UserError as e:
        exit_error("compare.py", e)


def names(folders):
    return ", ".join(folder.name for folder in folders)


def interrupted(signum, saved, unsaved):
    """The line of a comparison that a signal stopped: which of the runs under way stopped at a checkpoint
    (`saved`, their folders), which had none yet (`unsaved`: they start again), and what to do."""
    what = [f"{names(saved)} stopped at a checkpoint"] if saved else []
    what += [f"{names(unsaved)} had no checkpoint yet (started again next time)"] if unsaved else []
    return (f"interrupted ({signal.Signals(signum).name}); " + ("; ".join(what) or "no run was under way")
            + ": run the same command to go on")


def train_all(commands, jobs):
    """Train each run (its folder: its train.py command) in a process of its own, `jobs` at a time, each on
    1/jobs of the cores with its output in <folder>.out (one at a time: on this terminal), and say when
    each ends. After a run fails no other starts (the runs under way finish), and compare.py exits with one
    line, status 1; after SIGINT or SIGTERM (passed on to the runs under way: common.StopSignals), once every
    run under way has stopped, with one line and 128 + the signal's number."""
    todo = list(commands.items())
    env = dict(os.environ)
    if jobs > 1:
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // jobs)))
    running, failed, stopped, done = {}, [], [], 0  # running: process -> (its folder, output file, start time)
    began = time.monotonic()

    def heartbeat():  # minutes pass between the lines of runs whose output goes to files
        print(f"=== under way: {under_way(running.values())} "
              f"({progress(done, len(commands), time.monotonic() - began)})", flush=True)
    with StopSignals("compare.py", running=running) as signals:
        while todo and not failed and not signals.signum or running:
            while todo and len(running) < jobs and not failed and not signals.signum:
                out_dir, command = todo.pop(0)
                print(f"=== {out_dir.name}: {' '.join(command[1:])}", flush=True)
                output = None
                if jobs > 1:
                    out_dir.parent.mkdir(parents=True, exist_ok=True)
                    output = open(out_dir.parent / f"{out_dir.name}.out", "a")  # a resumed run: appended
                    print(f"    (its output: {output.name})", flush=True)
                process = subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT
                                           if output else None)
                running[process] = (out_dir, output, time.monotonic())
                if signals.signum:  # it came while this run was being started
                    signals.forward(process, signals.signum)
            process = next(iter(running)) if jobs == 1 else wait_any(running, heartbeat=heartbeat)
            process.wait()
            out_dir, output, start = running.pop(process)
            if output:
                output.close()
            now, status = time.monotonic(), process.returncode
            took = duration(now - start)
            if status == 0:
                done += 1
                print(f"=== {out_dir.name}: finished in {took} ({progress(done, len(commands), now - began)})",
                      flush=True)
            elif signals.signum:
                print(f"=== {out_dir.name}: stopped after {took}", flush=True)
                stopped.append(out_dir)
            else:
                print(f"=== {out_dir.name}: failed after {took} (exit status {status})", flush=True)
                failed.append(out_dir)
        if signals.signum:
            exit_error("compare.py", interrupted(signals.signum, [f for f in stopped if (f / "ckpt.pt").is_file()],
                                                 [f for f in stopped if not (f / "ckpt.pt").is_file()]),
                       status=128 + signals.signum)
    if failed:
        where = "its output is above" if jobs == 1 else f"see {failed[0].parent / failed[0].name}.out"
        exit_error("compare.py", f"the run {failed[0]} failed ({where}); "
                                 + (f"{len(todo)} other run{'s' if len(todo) > 1 else ''} not started; "
                                    if todo else "")
                                 + "fix it and run the same command again", status=1)


def wait_any(processes, poll_s=0.2, heartbeat=None, every_s=60):
    """The first of the processes to exit (polled: a fifth of a second is nothing to runs of minutes, and
    the line of a run that ended comes at once); heartbeat(), when given, after each `every_s` seconds of
    waiting."""
    last = time.monotonic()
    while True:
        for process in processes:
            if process.poll() is not None:
                return process
        if heartbeat is not None and time.monotonic() - last >= every_s:
            heartbeat()
            last = time.monotonic()
        time.sleep(poll_s)


LOGGED_STEP = re.compile(rb"step (\d+)/(\d+) \|")  # train.py's log and evaluation lines: "step 300/750 | ..."


def under_way(runs):
    """Each run under way (its folder, its output file, its start) with the last step its output logged:
    "mhar-s0 at step 300/750, baseline-s1 starting"."""
    return ", ".join(f"{out_dir.name} {last_step(output.name) if output else 'running'}"
                     for out_dir, output, _ in runs)


def last_step(path, tail_bytes=8192):
    """"at step 300/750": the last train.py log line in a run's output file (read from its last
    `tail_bytes`); "starting" before the first."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - tail_bytes))
            steps = LOGGED_STEP.findall(f.read())
    except OSError:
        steps = []
    return f"at step {steps[-1][0].decode()}/{steps[-1][1].decode()}" if steps else "starting"


def evaluate_once(out_dir, step, args, device, manager):
    """{task/metric: value} of a finished run on --eval_tasks: read from out_dir/eval.json when that
    holds these tasks at this --eval_limit for the run's final step, else evaluated now by eval.py,
    which writes it."""
    from scripts import eval as benchmarks
    try:
        results = json.loads((out_dir / "eval.json").read_text())
    except (OSError, ValueError):  # none yet (ValueError: not JSON)
        results = None
    if isinstance(results, dict) and isinstance(results.get("config"), dict):
        asked = (results.get("tasks"), results["config"].get("limit"), results["config"].get("step"))
        if asked == (args.eval_tasks, args.eval_limit, step):
            return benchmarks.metrics(results)
    print(f"=== {out_dir.name}: eval.py on {','.join(args.eval_tasks)}", flush=True)
    try:
        results = benchmarks.evaluate(out_dir, args.eval_tasks, device=device, manager=manager,
                                      batch_size=args.eval_batch_size, limit=args.eval_limit,
                                      include_path=args.eval_include)
    except UserError as e:
        exit_error("compare.py", f"evaluating {out_dir}: {one_line(e)}")
    return benchmarks.metrics(results)


# ----------------------------------------------------------------------------------------------
# Pairs and tables: pure functions of the rows (one dict per run, as in results.json).

def paired(rows, key="tail_val_loss"):
    """Per non-baseline variant: its differences to the baseline of the same shape at each seed both were
    trained at, their mean and standard error (None for one seed). Works for any per-run metric `key`."""
    value = {(r["variant"], r["seed"]): r[key] for r in rows}
    pairs = {}
    for r in rows:
        if r["baseline"] is not None and (r["baseline"], r["seed"]) in value:
            pairs.setdefault(r["variant"], dict(variant=r["variant"], baseline=r["baseline"], seeds=[],
                                                deltas=[]))
            pairs[r["variant"]]["seeds"].append(r["seed"])
            pairs[r["variant"]]["deltas"].append(r[key] - value[r["baseline"], r["seed"]])
    for p in pairs.values():
        p["n"], p["mean"] = len(p["deltas"]), statistics.mean(p["deltas"])
        p["se"] = statistics.stdev(p["deltas"]) / math.sqrt(p["n"]) if p["n"] > 1 else None
    return list(pairs.values())


def versus(rows, variant):
    """The rows re-paired: every routed run of the same shape as `variant` paired with it instead of the
    baseline (the baselines and `variant` itself unpaired), for paired() and with_deltas()."""
    shape_baseline = next(r["baseline"] for r in rows if r["variant"] == variant)
    return [{**r, "baseline": variant if r["baseline"] == shape_baseline and r["variant"] != variant else None}
            for r in rows]


def with_deltas(rows, key="tail_val_loss"):
    """The rows, each with "delta": its `key` minus its baseline's at the same seed (None without one)."""
    value = {(r["variant"], r["seed"]): r[key] for r in rows}
    return [{**r, "delta": None if (r["baseline"], r["seed"]) not in value else
             r[key] - value[r["baseline"], r["seed"]]} for r in rows]


def paired_curves(rows, logs):
    """Per non-baseline variant, its validation loss minus its baseline's at every evaluation both logged, over
    the seeds: {variant: (steps, means, standard errors (None for one seed))}. logs: {run name: log entries}."""
    name = {(r["variant"], r["seed"]): r["name"] for r in rows}
    val = {run: {e["step"]: e["val_loss"] for e in log if "val_loss" in e} for run, log in logs.items()}
    curves = {}
    for variant in dict.fromkeys(r["variant"] for r in rows if r["baseline"] is not None):
        deltas = {}  # step -> the seeds' differences
        for r in rows:
            if r["variant"] != variant or (r["baseline"], r["seed"]) not in name:
                continue
            ours, theirs = val[r["name"]], val[name[r["baseline"], r["seed"]]]
            for step in sorted(ours.keys() & theirs.keys()):
                deltas.setdefault(step, []).append(ours[step] - theirs[step])
        steps = sorted(deltas)
        curves[variant] = (steps, [statistics.mean(deltas[s]) for s in steps],
                           [statistics.stdev(deltas[s]) / math.sqrt(len(deltas[s])) if len(deltas[s]) > 1
                            else None for s in steps])
    return curves


def plot_paired_curves(plt, curves, path):
    """Each method's paired difference to the baseline along training: the mean over seeds, ± one standard
    error shaded."""
    fig, ax = plt.subplots(figsize=(7, 3.8), constrained_layout=True)
    ax.axhline(0, color="black", linewidth=0.8)
    for i, (variant, (steps, means, ses)) in enumerate(curves.items()):
        ax.plot(steps, means, "o-", color=f"C{i}", markersize=3, label=variant)
        if all(se is not None for se in ses):
            ax.fill_between(steps, [m - e for m, e in zip(means, ses)], [m + e for m, e in zip(means, ses)],
                            color=f"C{i}", alpha=0.2, linewidth=0)
    late = [v for steps, means, _ in curves.values() for step, v in zip(steps, means) if step >= steps[-1] / 4]
    if late:  # the first evaluations differ most and say least: the y-range is the last three quarters'
        margin = 0.25 * (max(late) - min(late)) + 1e-3
        ax.set_ylim(min(min(late), 0) - margin, max(max(late), 0) + margin)
    ax.set_xlabel("step")
    ax.set_ylabel("Δ val loss vs the baseline (nats/token)")
    ax.set_title("paired with the baseline: mean over seeds ± s.e.")
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=probe.FIGURE_DPI)
    plt.close(fig)


def signed(x, se=None):
    return "—" if x is None else f"{x:+.4f}" + ("" if se is None else f" ± {se:.4f}")


def t_of(pair):
    """The paired t statistic (mean / standard error) with its degrees of freedom, "t(2) = -10.1"; "—" without
    a spread (one seed, or equal differences)."""
    return f"t({pair['n'] - 1}) = {pair['mean'] / pair['se']:+.1f}" if pair["se"] else "—"


# The tables' columns: (header, cell of a row). A metric added to the rows (an lm-eval score, say) becomes a
# column by appending it here, and a paired column by paired(rows, key=its name).
PAIR_COLUMNS = [
    ("method", lambda p: p["variant"]),
    ("paired with", lambda p: p["baseline"]),
    ("seeds", lambda p: ",".join(map(str, p["seeds"]))),
    ("n", lambda p: str(p["n"])),
    ("Δ tail-mean val loss (mean ± s.e.)", lambda p: signed(p["mean"], p["se"])),
    ("t (df)", t_of),
]
RUN_COLUMNS = [
    ("run", lambda r: r["name"]),
    ("parameters", lambda r: f"{r['params']:,}"),
    ("tail-mean val loss", lambda r: f"{r['tail_val_loss']:.4f}"),
    ("Δ vs its baseline", lambda r: signed(r["delta"])),
    ("tokens/s", lambda r: f"{r['tokens_per_s']:,.0f}"),
    ("peak memory", lambda r: f"{r['peak_mem'] / 2**30:.2f} GiB"),
]


def markdown(columns, rows):
    lines = ["| " + " | ".join(header for header, _ in columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(cell(row) for _, cell in columns) + " |" for row in rows])


def with_metrics(rows, metrics):
    """paired(rows): the pairs of the loss, each with the paired differences of every other per-run metric
    under its name: {"mean", "se", ...} as paired() gives them."""
    pairs = paired(rows)
    for metric in metrics:
        by_variant = {p["variant"]: p for p in paired(rows, key=metric)}
        pairs = [{**p, metric: by_variant[p["variant"]]} for p in pairs]
    return pairs


def results_of(rows, metrics=(), against=(), train_flags=(), eval_tasks=()):
    """results.json: the runs with their differences, the pairs with the metrics', each --versus method's
    pairs, and the flags and tasks of the comparison."""
    return dict(rows=with_deltas(rows), pairs=with_metrics(rows, metrics),
                versus={v: with_metrics(versus(rows, v), metrics) for v in against},
                train_flags=list(train_flags), eval_tasks=list(eval_tasks))


def report(rows, metrics=(), against=()):
    """results.md: the paired table, the per-run table, and the baselines' spread over seeds. `metrics`:
    keys of the rows (lm-eval's task/metric) that add a paired column and a per-run column each; `against`:
    routed variants that add a paired table each (every other routed method minus that one)."""
    pairs, rows = with_metrics(rows, metrics), with_deltas(rows)
    pair_columns = PAIR_COLUMNS + [column for m in metrics for column in (
        (f"Δ {m} (mean ± s.e.)", lambda p, m=m: signed(p[m]["mean"], p[m]["se"])),
        (f"t (df) of {m}", lambda p, m=m: t_of(p[m])))]
    run_columns = RUN_COLUMNS + [(m, lambda r, m=m: f"{r[m]:.4f}") for m in metrics]
    parts = []
    if pairs:
        parts.append("Paired: each method minus the baseline of the same shape and seed (same initialization "
                     "seed, same batches); mean ± standard error over the n seeds (n = 1: no error bar).\n\n"
                     + markdown(pair_columns, pairs))
    for variant in against:
        parts.append(f"Paired with {variant}: each routed method minus {variant} at the same seed.\n\n"
                     + markdown(pair_columns, with_metrics(versus(rows, variant), metrics)))
    parts.append(markdown(run_columns, rows))
    for variant in dict.fromkeys(r["variant"] for r in rows if r["baseline"] is None):
        losses = [r["tail_val_loss"] for r in rows if r["variant"] == variant]
        if len(losses) > 1:
            parts.append(f"{variant} over {len(losses)} seeds: {statistics.mean(losses):.4f} ± "
                         f"{statistics.stdev(losses):.4f} (sample standard deviation): the noise between "
                         f"seeds.")
    return "\n\n".join(parts)


def main(argv=None):
    try:
        comparison(argv)
    except KeyboardInterrupt:  # Ctrl-C while no run trains (train_all passes it on to the runs under way)
        exit_error("compare.py", "interrupted (SIGINT) while no run was training; the finished runs are kept: run "
                                 "the same command to go on", status=130)


def planned(runs, train_flags, asked, data_print, out_dir, launcher):
    """{run folder: its train.py command} of the runs to train now: those whose folder holds nothing to
    reuse, and those stopped before their end (Ctrl-C, a preemption), which go on from their checkpoint
    (--resume); a finished one is reused, with a line. A folder holding another run stops the comparison
    (prior_run)."""
    commands = {}
    for run in runs:
        try:
            prior = prior_run(out_dir / run.name, asked[run.name], data_print)
        except UserError as e:
            exit_error("compare.py", e)
        if prior == "finished":
            print(f"=== {run.name}: trained before with these flags, reused", flush=True)
            continue
        resume = ["--resume"] if prior == "stopped" else []
        commands[out_dir / run.name] = [*launcher, str(ROOT / "train.py"), *train_argv(run, train_flags, out_dir),
                                        *resume]
    return commands


def plan(runs, asked, peak, mfu):
    """Per run, what training it costs: dict(name, params, steps, global_batch, seq_len, tokens,
    flops_per_token, flops, hours), the hours those FLOPs take at `mfu` of `peak` FLOP/s. asked: {run name: its
    resolved flags} (resolve_runs'). Each model is built on the meta device: its shapes, no memory."""
    rows = []
    for run in runs:
        flags = asked[run.name]
        with torch.device("meta"):  # unfused: the same weights and FLOPs, without triton
            model = rivals.model(dataclasses.replace(config_of(flags), fused=False))
        tokens, flops_per_token = tokens_of(flags), model.flops_per_token()
        flops = flops_per_token * tokens
        rows.append(dict(name=run.name, params=model.num_params(), steps=flags["max_steps"],
                         global_batch=flags["global_batch"], seq_len=flags["seq_len"], tokens=tokens,
                         flops_per_token=flops_per_token, flops=flops, hours=flops / (peak * mfu) / 3600))
    return rows


def hours(h):
    """Hours to three significant digits below 10 ("0.0412", "9.87"), to the tenth from 10 on ("1,234.5")."""
    return f"{h:,.1f}" if h >= 10 else f"{h:.3g}"


PLAN_COLUMNS = [
    ("run", lambda r: r["name"]),
    ("parameters", lambda r: f"{r['params']:,}"),
    ("steps x batch x seq_len", lambda r: f"{r['steps']:,} x {r['global_batch']} x {r['seq_len']}"),
    ("tokens", lambda r: f"{r['tokens']:,}"),
    ("tokens/parameter", lambda r: f"{r['tokens'] / r['params']:.3g}"),
    ("training FLOPs/token", lambda r: f"{r['flops_per_token']:,}"),
    ("training FLOPs", lambda r: f"{r['flops']:.4g}"),
    ("hours", lambda r: hours(r["hours"])),
]


def print_plan(args, train_flags):
    """--plan: every run of the comparison checked and resolved as for training, then a line per run (plan's
    table) and the total hours; nothing is trained or written, no data read, no device needed."""
    runs = runs_of(args)
    check_shapes(runs, train_flags)
    asked = resolve_runs(runs, train_flags, args.nproc_per_node, Path(args.out_dir), plan=True)[0]
    check_duplicates(runs, asked)
    peak, mfu = PEAK_FLOPS[args.plan_device], args.plan_mfu
    rows = plan(runs, asked, peak, mfu)
    what = (f"on one {args.plan_device} ({peak / 1e12:g} TFLOP/s dense bf16 peak) at an assumed MFU of {mfu:g}: "
            f"an estimate from the FLOP count (mhar.GPT.flops_per_token() x tokens), not a measurement")
    print(f"Plan: {len(rows)} runs, every one (runs finished in {args.out_dir} are not looked for); hours {what}."
          f"\n\n{markdown(PLAN_COLUMNS, rows)}\n\ntotal: {hours(sum(r['hours'] for r in rows))} hours {what}")


def comparison(argv):
    """The runs of argv's comparison, checked, trained (or reused) and evaluated; then their tables and figures;
    with --plan, their cost instead (print_plan)."""
    args, train_flags = parse_args(argv)
    if args.plan:
        print_plan(args, train_flags)
        return
    try:  # before the first run starts, not when train.py makes the first run's folder
        out_dir = output_folder(args.out_dir, "--out_dir")
    except UserError as e:
        exit_error("compare.py", e)
    runs = runs_of(args)
    check_shapes(runs, train_flags)
    asked, data_print = resolve_runs(runs, train_flags, args.nproc_per_node, out_dir)
    check_duplicates(runs, asked)
    manager = check_eval(args, train_flags)
    device = argparse.ArgumentParser(add_help=False)
    device.add_argument("--device", default="auto")  # the runs' device evaluates them too
    device = device.parse_known_args(train_flags)[0].device
    launcher = [sys.executable] + (["-m", "torch.distributed.run", "--standalone",
                                    f"--nproc_per_node={args.nproc_per_node}"] if args.nproc_per_node > 1 else [])
    commands = planned(runs, train_flags, asked, data_print, out_dir, launcher)
    if commands:
        try:  # a folder the runs cannot write: one line now, not each run's and then this one's
            with staged(out_dir):
                pass
        except MachineError as e:
            exit_error("compare.py", f"--out_dir: {e}", status=1)
        train_all(commands, args.jobs)
    summaries = [read_json(out_dir / run.name / "summary.json") for run in runs]
    unfinished = [run.name for run, summary in zip(runs, summaries) if not finished(summary)]
    if unfinished:  # train.py ended early but well (--stop_step), or another process broke it since
        exit_error("compare.py", f"the run {out_dir / unfinished[0]} ended before its last step (no finished "
                                 f"summary.json): run the same command to go on", status=1)
    # metrics: the whole val split's loss when every run scored it (train.py since 2026-12-05), then lm-eval's
    # task/metric names, in order
    whole = all(summary.get("full_val_loss") is not None for summary in summaries)
    rows, metrics = [], dict.fromkeys(["full_val_loss"] if whole else [])
    for run, summary in zip(runs, summaries):
        rows.append(dict(name=run.name, variant=run.variant, baseline=run.baseline, seed=run.seed,
                         params=summary["params"], tail_val_loss=summary["tail_val_loss"],
                         tokens_per_s=summary["tokens_per_s"] or 0.0, peak_mem=summary["peak_mem"] or 0,
                         path=str(out_dir / run.name), **({"full_val_loss": summary["full_val_loss"]} if whole
                                                           else {})))
        if manager:
            scores = evaluate_once(out_dir / run.name, summary["step"], args, device, manager)
            rows[-1].update(scores)
            metrics.update(dict.fromkeys(scores))
    metrics = list(metrics)
    results = report(rows, metrics, args.versus)
    print("\n" + results)
    tables = {"results.md": results + "\n",
              "results.json": json.dumps(results_of(rows, metrics, args.versus, train_flags, args.eval_tasks),
                                         indent=2)}
    try:            # both whole or neither: a disk that fills up keeps the previous pair together
        with staged(out_dir) as tmp:
            for name, text in tables.items():
                write_atomically(tmp / name, lambda f: f.write(text.encode()))
    except MachineError as e:
        exit_error("compare.py", f"the tables: {e} (the same command again writes them from the trained runs)",
                   status=1)
    figures = write_figures(rows, out_dir)
    if figures is None:
        print("loss curves: pip install matplotlib, then run this command again (the trained runs are reused)")
        return
    print(f"wrote {out_dir / 'results.md'}, {' and '.join(map(str, figures))}")


def write_figures(rows, out_dir):
    """loss_curves.png (every run) and, with baselines, paired_curves.png, drawn into a staging folder and
    moved in whole: a full disk or a read-only folder keeps the previous figures and is one line, status 1.
    Their paths, or None without matplotlib."""
    plt = probe.pyplot()
    if plt is None:
        return None
    curves = [(row["path"], row["name"], probe.read_log(row["path"])) for row in rows]
    names = ["loss_curves.png"] + (["paired_curves.png"] if any(row["baseline"] for row in rows) else [])
    try:
        with staged(out_dir) as tmp:
            probe.plot_loss_curves(plt, curves, tmp / names[0])
            if len(names) > 1:
                plot_paired_curves(plt, paired_curves(rows, {name: log for _, name, log in curves}),
                                   tmp / names[1])
    except MachineError as e:
        exit_error("compare.py", f"the figures: {e} (the tables are written; the same command again draws "
                                 f"the figures from the trained runs)", status=1)
    return [out_dir / name for name in names]


if __name__ == "__main__":
    main(sys.argv[1:])
