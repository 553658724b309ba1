"""
Train an MHAR language model (or one of its baselines) on a CPU, one GPU or several GPUs.

    python train.py                                # CPU demo: prepares the default corpus, trains
                                                   # the small preset, evaluates and samples
    python train.py --preset 100m                  # one GPU: the paper's 100M shape and recipe
    torchrun --standalone --nproc_per_node=8 train.py --preset 350m --residual attnres   # DDP
    torchrun --standalone --nproc_per_node=8 train.py --preset 1b --fsdp   # sharded (FSDP2)
    python train.py --preset 100m --data synthetic --max_steps 50 --compile   # speed only
    python train.py --out_dir out --resume         # continue an interrupted run, bit for bit
    python train.py --init_from models/Qwen3-0.6B --data data/corpus-qwen3   # mid-train a Qwen3

The global batch is batch_size x grad_accum x world size; by default grad_accum makes it the
preset's (the paper's 64 x 2048 tokens at 100M). The data order is a pure function of (seed, step):
every method trained with one seed sees the same batches, a resumed run continues exactly, and 8
GPUs see the same samples as 1 GPU. --out_dir gets config.json, log.jsonl (a line per log step and
per evaluation), ckpt.pt (at every evaluation) and summary.json, both written atomically.

The file reads top to bottom: the recipe and run sizes, the flags, resuming and converting, data
and batches, the model and its optimizer, train() and the step it repeats, then what the loop does
besides stepping (log lines, evaluations, checkpoints, the end). The run's machinery (reports, the
timer, the weight average) is lib/run.py's, the schedule lib/schedule.py's, a run's safety
(checkpoint files, the out_dir's lock, signals) lib/common.py's, ranks and devices lib/parallel.py's.
"""
import os
import sys

INTERRUPTED = b"train.py: error: interrupted before training started\n"
try:  # the first instruction: a Ctrl-C until main() begins is this line at once (interrupts.py)
    from lib import interrupts
    interrupts.guard(__name__, INTERRUPTED)
except KeyboardInterrupt:  # one in the microseconds before
    os.write(2, INTERRUPTED)
    os._exit(130)

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import inspect  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import signal  # noqa: E402
import time  # noqa: E402
from contextlib import nullcontext, suppress  # noqa: E402
from pathlib import Path  # noqa: E402

# Set before torch starts OpenMP: threads waiting at a barrier sleep instead of spinning. On a
# CPU shared with another busy process, spinning threads starve their siblings (the CPU demo
# measured 4x slower steps).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import mhar  # noqa: E402
import prepare  # noqa: E402
from lib import head, hf, midtrain, parallel, rivals  # noqa: E402
from lib.common import (DEFAULT_CORPUS, CheckpointError, FlagParser, MachineError,  # noqa: E402
                        StopSignals, UserError, AMOUNT, COUNT, RATE, STEPS, adamw, claim_out_dir,
                        decay_rate, estimate_mfu, exit_error, fingerprint, fraction,
                        ignore_stop_signals, largest_id, load_optimizer, memory_for, one_line,
                        os_error, padded_vocab, peak_memory, read_tokens, rng_states, rows_at,
                        sample_rows, save_checkpoint, seed as SEED, set_rng_states, unigram_entropy,
                        unwrapped, whole_split, write_text)
from lib.parallel import Session, set_precision, start_session, start_sharding, wrap_model  # noqa: E402
from lib.run import (Progress, Report, Timer, WeightAverage, carry_optimizer_state,  # noqa: E402
                     check_same_data, fmt_count, load_checkpoint, pretrained_directory,
                     start_outputs, start_wandb, summary_line, take_pretrained_flags)
from lib.schedule import lr_factor  # noqa: E402

# -----------------------------------------------------------------------------
# The recipe (Multi-Head Attention Residuals, Luo, Cai, Hu 2026, "Training and reproducibility
# details"): AdamW (0.9, 0.95), eps 1e-8, weight decay 0.1 on all parameters, clip 1.0, 1000
# warmup steps then cosine to 0.1x, 20K steps, an evaluation every 500, and as the metric the
# tail-mean of the last 11 evaluations. The flags below default to it. Peak lr 5e-4 for every
# method, as in the paper's later version (its main table); the earlier version used 1e-3
# (docs/comparison.md, "Reproducing the paper").
BETAS, ADAM_EPS = (0.9, 0.95), 1e-8
PAPER_RUN = dict(max_steps=20_000, warmup_steps=1000, eval_interval=500, eval_batches=20, lr=5e-4)
# Run sizes per preset: the micro-batch (sequences per rank) and the global batch (sequences per
# step). The paper's global batches at 100M-1B, with micro-batches that fit 80 GB on the readable
# path (1b: use --compile or --fused); the baseline and --fused take lean_batch_size, at which an
# H200 runs their eager micro-step in at least twice the host's time to issue it (bench_step.py).
# small: the `python train.py` demo, 2k tokens a step (4k are slower per token on a CPU: its caches
# cannot hold the 50k-vocabulary logits); tiny: tests.
BYTES_DATA = Path("data") / f"{DEFAULT_CORPUS}-bytes-families"  # as UTF-8 bytes (docs/data.md)
RUNS = {
    "tiny": dict(batch_size=8, global_batch=8, max_steps=200, warmup_steps=20, eval_interval=50,
                 eval_batches=4, lr=3e-3),
    "small": dict(batch_size=8, global_batch=8, max_steps=200, warmup_steps=20, eval_interval=40,
                  eval_batches=8, lr=3e-3),
    # the small model on bytes, the CPU comparison's: 750 steps of 4k tokens, 6-16 min on a thread
    "small-bytes": dict(batch_size=16, global_batch=16, max_steps=750, warmup_steps=50,
                        eval_interval=50, eval_batches=8, lr=3e-3, data=BYTES_DATA),
    "100m": dict(batch_size=4, lean_batch_size=8, global_batch=64, **PAPER_RUN),
    "350m": dict(batch_size=2, lean_batch_size=16, global_batch=32, **PAPER_RUN),
    "1b": dict(batch_size=1, lean_batch_size=8, global_batch=32, **PAPER_RUN),
}
DEFAULT_PRESET = "small"
DEFAULT_DATA = Path("data") / DEFAULT_CORPUS  # a preset's corpus, unless its row of RUNS names one
# Built-in corpora, made when missing: folder -> prepare.py's flags (pystdlib-bytes: the old split)
BUILT_IN_DATA = {DEFAULT_DATA: {}, Path("data") / f"{DEFAULT_CORPUS}-bytes": dict(tokenizer=prepare.BYTES),
                 BYTES_DATA: dict(tokenizer=prepare.BYTES, split="families", val_fraction=0.035)}


def die(msg):
    """One line that says what is wrong and what to do, exit status 2 (like argparse)."""
    exit_error("train.py", msg)


def fail(msg):
    """One line for a failure of the machine rather than of the input (a full disk): status 1."""
    exit_error("train.py", msg, status=1)


# -----------------------------------------------------------------------------
# Flags. Every flag shows its default where it is defined; the run-size flags default to their
# preset's row of RUNS, and the model flags (one per field of mhar.Config) to the preset's Config.
# Each flag also says what a checkpoint decides for it when a run is resumed or converted:

RUN = "run"          # defines the run: the checkpoint's; on --resume another value is an error
ROUTING = "routing"  # as RUN, but --init_from chooses it anew (a baseline has no routing)
SETTING = "setting"  # the checkpoint's unless given: may change between sessions of a run
MACHINE = "machine"  # this session's alone: never taken from a checkpoint

# What a model flag's help says beyond its mhar.Config field's comment (add_model_flags)
FLAG_NOTES = {"vocab_size": "default: meta.json's vocab_size to a multiple of 64, or the preset's",
              "residual": "or a rival of lib/rivals.py: " + " | ".join(f'"{r}"' for r in rivals.RESIDUALS)
              + " (default mhar)"}
CONFIG_FIELDS = [f.name for f in dataclasses.fields(mhar.Config)]


class Flags(FlagParser):
    """argparse (one line for a bad flag) that remembers each flag's role."""

    def __init__(self):
        super().__init__(prog="train.py", description=__doc__.split("\n\n")[0].strip(),
                         allow_abbrev=False)
        self.roles, self.group = {}, self

    def section(self, title):
        """The flags defined next are listed under `title` in --help."""
        self.group = self.add_argument_group(title)

    def flag(self, name, role, help, **kwargs):
        self.group.add_argument(f"--{name}", help=help, **kwargs)
        self.roles[name] = role


def per_preset(key, lead="per preset: "):
    """The default of a run-size flag, as its help shows it: 'per preset: tiny 8, small 8, ...'
    (the presets whose row of RUNS has it)."""
    return lead + ", ".join(f"{name} {run[key]}" for name, run in RUNS.items() if key in run)


def preset_values(field):
    """The default of a model flag, as its help shows it: one value, or each preset's."""
    values = {name: getattr(config, field) for name, config in mhar.PRESETS.items()}
    if len(set(values.values())) == 1:
        return f"default {next(iter(values.values()))}"
    return "per preset: " + ", ".join(f"{name} {value}" for name, value in values.items())


def build_parser():
    p = Flags()
    add_run_flags(p)
    add_optimizer_flags(p)
    add_machine_flags(p)
    add_model_flags(p)
    return p


def add_run_flags(p):
    p.section("the run")
    p.flag("preset", RUN, default=DEFAULT_PRESET, choices=list(mhar.PRESETS),
           help=f"model shape and run size (default {DEFAULT_PRESET})")
    p.flag("data", SETTING, default=None,
           help="a prepare.py folder (train.bin, val.bin, meta.json), or 'synthetic': random "
                f"tokens, no files (default: the preset's built-in corpus, prepared when missing: "
                f"{DEFAULT_DATA}, small-bytes {RUNS['small-bytes']['data']})")
    p.flag("out_dir", MACHINE, default="out", help="output folder (default out)")
    p.flag("resume", MACHINE, nargs="?", const="", default=None,
           help="continue from out_dir/ckpt.pt, or from the checkpoint given")
    p.flag("init_from", MACHINE, default=None,
           help="convert this baseline checkpoint into a delta-routed model (--residual attnres "
                "or mhar) and continue its run from its step; or convert a Hugging Face Qwen3 "
                "directory (or hub id) and start a new run with the paper's mid-training recipe "
                "as the defaults (docs/conversion.md: Grafting MHAR onto Qwen3)")
    p.flag("seed", RUN, type=SEED, default=0, help="model init and data order (default 0)")
    p.flag("allow_data_change", MACHINE, action="store_true", default=False,
           help="--resume onto data that changed since the checkpoint (by default an error)")

    p.section("its size (default: the preset's row of RUNS)")
    p.flag("batch_size", SETTING, type=COUNT, default=None,
           help=f"micro-batch in sequences per rank ({per_preset('batch_size')}; "
                f"the baseline or --fused {per_preset('lean_batch_size', lead='')})")
    p.flag("grad_accum", MACHINE, type=COUNT, default=None, help="micro-steps per step (default: "
           f"the global batch / (batch_size x ranks); global batches {per_preset('global_batch')})")
    p.flag("max_steps", SETTING, type=COUNT, default=None,
           help=f"optimizer steps; the cosine ends here ({per_preset('max_steps')})")
    p.flag("stop_step", MACHINE, type=COUNT, default=None,
           help="stop after this step as if interrupted (checkpoint saved; --resume goes on); at "
                "most max_steps (default: max_steps)")
    p.flag("eval_interval", SETTING, type=COUNT, default=None,
           help=f"steps between evaluations and checkpoints ({per_preset('eval_interval')})")
    p.flag("eval_batches", SETTING, type=COUNT, default=None,
           help=f"fixed validation batches ({per_preset('eval_batches')})")
    p.flag("log_interval", SETTING, type=COUNT, default=10,
           help="steps between log lines (default 10)")
    p.flag("tail_evals", SETTING, type=COUNT, default=11,
           help="the summary's tail-mean covers the last K evaluations (default 11)")


def add_optimizer_flags(p):
    p.section("the optimizer: AdamW, linear warmup, cosine decay")
    p.flag("lr", RUN, type=RATE, default=None, help=f"peak learning rate ({per_preset('lr')})")
    p.flag("routing_lr", ROUTING, type=RATE, default=None,
           help="peak learning rate of the parameters routing adds (default: --lr)")
    p.flag("min_lr_ratio", RUN, type=fraction, default=0.1,
           help="the cosine's floor, a fraction of the peak, in [0, 1] (default 0.1)")
    p.flag("warmup_steps", RUN, type=STEPS, default=None,
           help="linear warmup steps; more than max_steps: the run ends inside the warmup, at "
                f"max_steps / warmup_steps of the peak ({per_preset('warmup_steps')})")
    p.flag("weight_decay", RUN, type=AMOUNT, default=0.1,
           help="AdamW weight decay (default 0.1; --init_from DIR: 0.05)")
    p.flag("decay_on", RUN, choices=["all", "matrices"], default="all",
           help="the parameters weight decay applies to: all, or the matrices alone (not the "
                "embedding, norms, routing) (default all; --init_from DIR: matrices)")
    p.flag("z_loss", RUN, type=AMOUNT, default=0.0,
           help="add this x the mean squared log-partition of the logits to the training loss; "
                "the logged losses stay the cross-entropy (default 0; --init_from DIR: 1e-4)")
    p.flag("ema", RUN, type=decay_rate, default=0.0,
           help="keep an exponential moving average of the weights with this decay, evaluated "
                "beside them and saved (export.py writes it); 0 = off (default 0; --init_from "
                "DIR: 0.999)")
    p.flag("grad_clip", RUN, type=AMOUNT, default=1.0,
           help="clip the gradient norm at this; 0 = off (default 1.0)")


def add_machine_flags(p):
    p.section("the machine")
    p.flag("device", MACHINE, default="auto",
           help="auto (cuda > mps > cpu), cpu, cuda, cuda:N, mps (default auto)")
    p.flag("dtype", SETTING, choices=["auto", "float32", "bfloat16"], default="auto",
           help="auto: bf16 autocast on CUDA, float32 elsewhere (default auto)")
    p.flag("compile", MACHINE, action="store_true", default=False,
           help="torch.compile the model (default off)")
    p.flag("compile_mode", MACHINE, choices=["default", "reduce-overhead", "max-autotune"],
           default="default", help="torch.compile's mode, with --compile: reduce-overhead captures "
                                   "the step in CUDA graphs (default default)")
    p.flag("fsdp", RUN, action="store_true", default=False,
           help="shard parameters, gradients and Adam moments over the ranks (FSDP2; checkpoints "
                "are folders of shards; one process is a run of one rank) (default off: DDP)")
    p.flag("wandb", SETTING, nargs="?", const="mhar", default=None,
           help="also log to Weights & Biases (project name, default mhar)")


def add_model_flags(p):
    """A flag for every field of mhar.Config, so a new field is a flag without a line here; its
    help is the field's comment in mhar.py, written once there."""
    p.section("the model: mhar.Config's fields (default: the preset's)")
    comments = dict(re.findall(r"^    (\w+): [^#\n]*#\s*(.+)$", inspect.getsource(mhar.Config),
                               re.MULTILINE))
    for field in dataclasses.fields(mhar.Config):
        name = field.name
        role = (ROUTING if name in mhar.Config.ROUTING else
                SETTING if name in mhar.Config.RUNTIME else RUN)
        what = comments.get(name, f"mhar.Config.{name}")
        default = f"; {FLAG_NOTES[name]}" if name in FLAG_NOTES else f" ({preset_values(name)})"
        kind = {"int": int, "float": float, "str": str, "bool": bool}.get(
            getattr(field.type, "__name__", field.type), str)
        if kind is bool:
            p.flag(name, role, action=argparse.BooleanOptionalAction, default=None,
                   help=what + default)
        else:
            p.flag(name, role, type=kind, default=None, help=what + default)


PARSER = build_parser()
ROLES = PARSER.roles


def parse_args(argv=None):
    """(the flags, every default filled in; the names of the flags given on the command line).
    argparse fills in a default only where the namespace has no value yet: every flag starts as
    `unset`, so those still unset after parsing were not given."""
    unset = object()
    args = PARSER.parse_args(argv, argparse.Namespace(**dict.fromkeys(PARSER.roles, unset)))
    given = {name for name, value in vars(args).items() if value is not unset}
    for name in PARSER.roles.keys() - given:
        setattr(args, name, PARSER.get_default(name))
    return args, given


# -----------------------------------------------------------------------------
# Resuming and converting: what the checkpoint decides, what the command line may change.

def saved_flags(ckpt):
    """The resolved flags of a checkpoint's run, its model's Config fields included."""
    return {**ckpt["args"], **ckpt["config"]}


def take_saved_flags(args, given, saved, strict):
    """Each flag left out takes the saved value (MACHINE flags never do). strict (--resume): a
    RUN or ROUTING flag given with another value is an error."""
    for name, value in saved.items():
        role = ROLES.get(name)
        if role in (None, MACHINE):
            continue
        if name not in given:
            setattr(args, name, value)
        elif strict and role in (RUN, ROUTING) and getattr(args, name) != value:
            die(f"the checkpoint was trained with --{name} {value}, not {getattr(args, name)}: "
                f"drop the flag, or start a new run in another --out_dir")


def fill_run_sizes(args, world, saved_global_batch=None, sizes=None):
    """The run-size flags still unset take `sizes` (default: the preset's row of RUNS); grad_accum
    keeps the global batch (theirs, or the checkpoint's) over however many ranks this session
    has."""
    sizes = sizes or RUNS[args.preset]
    args.data = args.data or str(sizes.get("data", DEFAULT_DATA))
    global_batch = saved_global_batch or sizes["global_batch"]
    preset = mhar.PRESETS[args.preset]  # the baseline and --fused (routed alone) hold less: lean
    fused = preset.fused if args.fused is None else args.fused
    lean = (args.residual or preset.residual) == "baseline" or fused
    if args.batch_size is None and lean and "lean_batch_size" in sizes:
        # the largest micro-batch up to it that the global batch divides into over the ranks
        args.batch_size = next((b for b in range(sizes["lean_batch_size"], 0, -1)
                                if global_batch % (b * world) == 0), None)
    for key in ("batch_size", "max_steps", "warmup_steps", "eval_interval", "eval_batches", "lr"):
        if getattr(args, key) is None:
            setattr(args, key, sizes[key])
    if args.grad_accum is None:
        if global_batch % (args.batch_size * world):
            die(f"the global batch {global_batch} is not a multiple of --batch_size "
                f"{args.batch_size} x {world} ranks: pass --batch_size or --grad_accum")
        args.grad_accum = global_batch // (args.batch_size * world)
    args.global_batch = args.batch_size * args.grad_accum * world
    if saved_global_batch is not None and args.global_batch != saved_global_batch:
        die(f"global batch {args.global_batch} (batch_size x grad_accum x ranks) differs from the "
            f"checkpoint's {saved_global_batch}: choose --batch_size and --grad_accum that "
            f"multiply to it")
    if args.stop_step is not None and args.stop_step > args.max_steps:
        die(f"--stop_step {args.stop_step} is past the run's end, --max_steps {args.max_steps}: "
            f"leave it out to train to the end")
    args.stop_step = args.stop_step or args.max_steps
    args.routing_lr = args.routing_lr or args.lr


def resolve_flags(args, given, world):
    """(args, ckpt, source): the run's flags, the checkpoint a --resume continues (or None), and
    what an --init_from converts (or None): a baseline checkpoint (a dict), or a Hugging Face
    directory (a Path)."""
    ckpt = source = saved_global_batch = None
    if args.resume is not None:
        if args.init_from:
            die("--init_from starts a converted run and --resume continues one: pass one of them")
        if args.resume and "out_dir" not in given:
            args.out_dir = os.path.dirname(args.resume) or "."
        ckpt = load_checkpoint(args.resume or os.path.join(args.out_dir, "ckpt.pt"))
        take_saved_flags(args, given, saved_flags(ckpt), strict=True)
        saved_global_batch = ckpt["args"].get("global_batch")
        # where the run started, for the record (export.py copies a Qwen3 directory's tokenizer);
        # the checkpoint holds all it needs, the directory is not read again
        args.init_from = ckpt["args"].get("init_from")
    elif args.init_from and pretrained_directory(args.init_from):
        source = take_pretrained_flags(args, given)
        fill_run_sizes(args, world, sizes=midtrain.RUN)
        return args, ckpt, source
    elif args.init_from:
        source = load_checkpoint(args.init_from)
        if source["config"]["residual"] != "baseline":
            die(f"--init_from converts a baseline checkpoint; {args.init_from} is a "
                f"{source['config']['residual']} run")
        saved = {k: v for k, v in saved_flags(source).items() if ROLES.get(k) != ROUTING}
        take_saved_flags(args, given, saved, strict=False)
        args.delta = True  # conversion is delta routing: the baseline's residual kept
        saved_global_batch = source["args"].get("global_batch")
    fill_run_sizes(args, world, saved_global_batch)
    return args, ckpt, source


# -----------------------------------------------------------------------------
# Data: prepare.py's token files, or uniform random tokens (--data synthetic).

def open_data(args, rank, ddp):
    """common.Tokens of --data (None for synthetic); a built-in corpus is prepared (by rank 0)
    when it is missing."""
    if args.data == "synthetic":
        return None
    path = Path(args.data)
    if path in BUILT_IN_DATA and not (path / "train.bin").exists():
        if rank == 0:
            print(f"preparing the built-in corpus into {path} (once) ...", flush=True)
            try:
                prepare.prepare(name=path.name, out=str(path.parent), **BUILT_IN_DATA[path])
            except prepare.PrepareError as e:
                die(f"preparing the built-in corpus {path} failed: {e}")
        if ddp:
            dist.barrier()
    return read_tokens(path)


def model_config(args, meta):
    """The mhar.Config of the run: the preset's, with the model flags given (or resumed)."""
    if args.vocab_size is None and meta.get("vocab_size"):
        args.vocab_size = padded_vocab(meta["vocab_size"])
    flags = {name: getattr(args, name) for name in CONFIG_FIELDS}
    try:
        config = rivals.preset(args.preset, **{k: v for k, v in flags.items() if v is not None})
    except (ValueError, TypeError) as e:  # an impossible shape: Config names the field and fix
        die(one_line(e))
    for name in CONFIG_FIELDS:  # what the run records: every field, as resolved
        setattr(args, name, getattr(config, name))
    return config


def check_data(tokens, config):
    """Every split holds a sequence, and every token id is one the model has: meta.json's
    vocabulary fits the model's (without meta.json, the largest id found in the files)."""
    if tokens is None:
        return
    if "vocab_size" in tokens.meta:
        vocab, what = tokens.meta["vocab_size"], "the data's vocabulary of"
    else:  # a token file of another tool: read it all (once, in chunks)
        vocab = 1 + max(largest_id(tokens.train), largest_id(tokens.val))
        what = "the largest token id in the data, plus one, which is"
    if vocab > config.vocab_size:
        die(f"the model's vocabulary of {config.vocab_size} (--vocab_size) is smaller than {what} "
            f"{vocab}: pass --vocab_size {padded_vocab(vocab)}, or check the data")
    for split, split_tokens in (("train", tokens.train), ("val", tokens.val)):
        if len(split_tokens) <= config.seq_len + 1:
            die(f"{split}.bin has {len(split_tokens)} tokens, not one sequence of --seq_len "
                f"{config.seq_len}")


# -----------------------------------------------------------------------------
# Batches: pure functions of the step, as the schedule (lib/schedule.py), so the step is all a
# resumed run needs.

def to_device(rows, device):
    """(..., T + 1) rows -> inputs and targets (..., T) on the device (pinned: the copy is async
    on CUDA)."""
    if device.type == "cuda":
        rows = rows.pin_memory()
    rows = rows.to(device, non_blocking=True)
    return rows[..., :-1].contiguous(), rows[..., 1:].contiguous()


def train_batch(tokens, args, step, rank):
    """This rank's rows of step `step`'s global batch, (grad_accum, batch_size, seq_len + 1)."""
    rows_per_rank = args.batch_size * args.grad_accum
    lo = rank * rows_per_rank
    rows = sample_rows(tokens, ("train", args.seed, step), args.global_batch, lo,
                       lo + rows_per_rank, args.seq_len, args.vocab_size)
    return rows.view(args.grad_accum, args.batch_size, -1)


def val_batch(tokens, args, i):
    """Validation batch i: the same for every method, seed and step."""
    return sample_rows(tokens, ("val", i), args.batch_size, 0, args.batch_size, args.seq_len,
                       args.vocab_size)


# -----------------------------------------------------------------------------
# The model and its optimizer.

def build_model(args, config, ckpt, source, session):
    """(gpt, optimizer, progress, baseline): a new model, or the checkpoint's, or a converted
    baseline (then `baseline` is the original, kept to check that the conversion is exact).
    With --fsdp rank 0 builds the whole model on its CPU (the other ranks its shape on the meta
    device, no memory), and parallel.distribute hands every rank its shards."""
    torch.manual_seed(args.seed)
    device, sharded = session.device, args.fsdp
    pretrained = isinstance(source, Path)  # a Hugging Face directory, not a checkpoint of ours
    shape_only = sharded and not session.master  # this rank receives its shards from rank 0
    try:
        with memory_for(f"the model on {device}", MODEL_SIZE_FLAGS), \
                torch.device("meta") if shape_only else nullcontext():
            if pretrained and not shape_only:  # its weights, routing added with closed gates
                gpt = hf.load(source, **dataclasses.asdict(config))
            elif source and not pretrained:  # the baseline's weights, routing with closed gates
                gpt = mhar.GPT.from_baseline(unwrapped(source["model"]), config)
            else:
                gpt = rivals.model(config)
    except (ValueError, TypeError, RuntimeError, ImportError, CheckpointError) as e:
        die(one_line(e))  # e.g. --fused without a GPU, a broken safetensors file
    with memory_for(f"the model and its optimizer on {device}", MODEL_SIZE_FLAGS):
        gpt = gpt if sharded else gpt.to(device)
        optimizer = make_optimizer(gpt, args, "cpu" if sharded else device.type)
    progress, baseline = Progress(), None
    if source and not pretrained:  # continue the baseline's run: its step, data, Adam moments
        carry_optimizer_state(source["optimizer"], optimizer)  # (a directory has none: cold)
        progress = Progress(source["step"], [], source.get("tokens", 0))
    if source and not shape_only:  # the model before conversion, to check that it is exact
        if pretrained:
            baseline = hf.load(source, seq_len=config.seq_len)
        else:
            baseline = mhar.GPT(mhar.Config(**source["config"]))
            baseline.load_state_dict(unwrapped(source["model"]))
    if sharded:
        carried = optimizer if source and not pretrained else None
        gpt, optimizer = parallel.distribute(gpt, carried, device, session.dtype,
                                             lambda model: make_optimizer(model, args, device.type))
        if source:  # sharded as well: no rank holds a whole copy of it
            baseline, _ = parallel.distribute(baseline, None, device, session.dtype,
                                              lambda model: None)
    elif baseline is not None:
        baseline = baseline.to(device)
    if ckpt:
        try:
            if sharded:
                parallel.load(ckpt["sharded"], gpt, optimizer)
            else:
                gpt.load_state_dict(unwrapped(ckpt["model"]))
                load_optimizer(optimizer, ckpt["optimizer"])
            set_rng_states(ckpt["rng"])
        except (RuntimeError, ValueError, KeyError, TypeError) as e:
            die(f"the checkpoint does not fit this model: {one_line(e)}")
        progress = Progress(ckpt["step"], ckpt["evals"], ckpt.get("tokens", 0),
                            ckpt.get("wandb_id"))
    return gpt, optimizer, progress, baseline


MODEL_SIZE_FLAGS = "--n_embd, --n_layer, --ffn_hidden or --vocab_size (or a smaller --preset)"


def make_optimizer(gpt, args, device_type):
    """AdamW over mhar.GPT.param_groups (weight decay on all parameters), or with --decay_on
    matrices over midtrain.param_groups (the mid-training recipe: not the embedding, norms,
    routing); the routing group at --routing_lr."""
    groups = midtrain.param_groups(gpt, args.lr, args.weight_decay) if args.decay_on == "matrices" else None
    optimizer = adamw(gpt, args.weight_decay, args.lr, BETAS, ADAM_EPS, device_type, groups)
    for group in optimizer.param_groups:
        if group["name"] == "routing":
            group["lr"] = args.routing_lr
        group.setdefault("initial_lr", group["lr"])  # the schedule scales each group's own peak
    return optimizer


# -----------------------------------------------------------------------------
# The run: what the loop works on, and the loop.

@dataclasses.dataclass
class Run:
    args: argparse.Namespace
    config: mhar.Config
    session: Session
    gpt: mhar.GPT          # the model itself (its weights are what a checkpoint saves)
    model: torch.nn.Module  # what the loop calls: gpt compiled and/or wrapped in DDP
    optimizer: torch.optim.Optimizer
    progress: Progress
    data: object           # common.Tokens, or None for synthetic data
    out: Path
    report: Report
    entropy: float         # unigram entropy of train.bin (None for synthetic data)
    data_fingerprint: str  # what a checkpoint remembers of the data (see fingerprint)
    ema: object = None     # WeightAverage of gpt's weights (--ema), or None


# torch.compile works for a while before the first step, in silence (docs/training.md: how long)
COMPILE_NOTE = ("--compile: the first step compiles the model, and the first evaluation its graph: "
                "on a CPU about a minute for the small preset, longer for larger models")


def train(args, given=frozenset()):
    """Run, or continue, one training run; returns its summary (also written to summary.json).
    `given`: the flags typed on the command line (on --resume they must agree with the
    checkpoint; the others take its values)."""
    t_start = time.time()
    # setup: ranks and device, the flags (a resumed run's from its checkpoint), data, shape
    s = start_session(args)
    args, ckpt, source = resolve_flags(args, given, s.world)
    set_precision(s, args)
    start_sharding(s, args)
    data = open_data(args, s.rank, s.ddp)
    if ckpt:
        check_same_data(ckpt, data, args)
    config = model_config(args, data.meta if data else {})
    for flag, mode in (("route_heads", "mhar"), ("hc_streams", "hyper")):  # not silently unused
        if flag in given and config.residual != mode:
            die(f"--{flag} is for --residual {mode} alone: leave it out, or pass --residual {mode}")
    if "compile_mode" in given and not args.compile:
        die("--compile_mode is torch.compile's mode: pass --compile with it")
    if isinstance(source, Path):
        midtrain.check_tokenizer(data, source, config.vocab_size)
    check_data(data, config)

    # the model, its optimizer, and where the run stands
    gpt, optimizer, progress, baseline = build_model(args, config, ckpt, source, s)
    ema = WeightAverage(gpt, args.ema, ckpt) if args.ema else None
    del ckpt, source
    # the first step's batch, before anything is written: one too large for memory stops here
    with memory_for("a step's batch of token ids", "--grad_accum or --batch_size"):
        rows = train_batch(data.train if data else None, args, progress.step, s.rank)
    out = Path(args.out_dir)
    with claim_out_dir(out, s), StopSignals("train.py", s.master) as stop:
        run = Run(args, config, s, gpt, wrap_model(gpt, args, s), optimizer, progress, data, out,
                  Report(out, s.master), None if data is None else unigram_entropy(data.train),
                  fingerprint(data), ema)
        start_wandb(run.report, args, progress)
        start_outputs(run)
        if baseline is not None:
            check_conversion(run, baseline)
            del baseline

        # the loop: one optimizer step per iteration
        device_name = s.device.type if s.device.type != "cuda" else torch.cuda.get_device_name()
        if args.compile:
            run.report.print(COMPILE_NOTE)
        # one object for the whole run: a new one each step would make torch.compile recompile
        loss_fn = functools.partial(head.linear_cross_entropy, z_loss=args.z_loss)
        timer, stop_signal = Timer(), 0
        while progress.step < args.stop_step and not stop_signal:
            scale = lr_factor(progress.step, args.warmup_steps, args.max_steps, args.min_lr_ratio)
            for group in optimizer.param_groups:
                group["lr"] = group["initial_lr"] * scale
            loss_sum = train_step(run.model, optimizer, *to_device(rows, s.device), args, s, loss_fn)
            if ema:
                ema.update()
            progress.step += 1
            rows = train_batch(data.train if data else None, args, progress.step, s.rank)  # next
            progress.tokens += args.global_batch * args.seq_len
            timer.steps += 1
            if progress.step % args.log_interval == 0 or progress.step == args.stop_step:
                log_step(run, loss_sum, args.lr * scale, timer, device_name)
            if progress.step % args.eval_interval == 0 and progress.step < args.max_steps:
                with timer.paused():  # evaluation is not training time
                    evaluate_and_save(run)
            stop_signal = s.max_over_ranks(stop.signum)  # every rank stops after the same step
        return finish(run, timer, t_start, stop_signal)


def train_step(model, optimizer, xs, ys, args, session, loss_fn):
    """One optimizer step over grad_accum micro-batches; returns the summed micro-batch losses.
    DDP synchronizes the gradients on the last micro-step only; FSDP reduce-scatters them after
    every micro-step, so that no rank ever holds more than its shard of them. loss_fn: the chunked
    head's loss (head.linear_cross_entropy) with the run's z-loss, in the gradient alone. As CUDA
    graphs, the .grad buffers stay allocated (parallel.graph_grads); a micro-step, an iteration."""
    graphs = parallel.graph_grads(model, args)
    loss_sum = torch.zeros((), device=xs.device)
    for micro in range(args.grad_accum):
        last = micro == args.grad_accum - 1
        if graphs:  # the previous micro-step's outputs are read (loss_sum): the pool may reuse them
            torch.compiler.cudagraph_mark_step_begin()
        with model.no_sync() if session.replicated and not last else nullcontext():
            with session.autocast:
                _, loss = model(xs[micro], ys[micro], loss_fn=loss_fn)
            (loss / args.grad_accum).backward()
        loss_sum += loss.detach()
    if args.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=not graphs)
    return loss_sum


# -----------------------------------------------------------------------------
# What the loop does besides stepping: log lines, evaluations and checkpoints, the end.

def log_step(run, loss_sum, lr, timer, device_name):
    """A log line: the step's loss (mean over micro-steps and ranks), lr, speed, memory."""
    args, s, p = run.args, run.session, run.progress
    if s.ddp:
        dist.all_reduce(loss_sum)  # summed over the ranks, divided below
    loss = loss_sum.item() / (args.grad_accum * s.world)
    ms, tok_s = timer.lap(args.global_batch * args.seq_len)
    mfu = estimate_mfu(run.gpt.flops_per_token(), tok_s / s.world, device_name)  # None: unknown
    run.report.record(dict(step=p.step, loss=loss, lr=lr, ms=ms, tokens_per_s=tok_s,
                           tokens=p.tokens, peak_mem=peak_memory(s.device),
                           **({"mfu": mfu} if mfu is not None else {})))
    run.report.print(f"step {p.step}/{args.max_steps} | loss {loss:.4f} | lr {lr:.2e} | "
                     f"{ms:.1f} ms | {fmt_count(tok_s)} tok/s"
                     + (f" | mfu {100 * mfu:.1f}%" if mfu is not None else ""))
    if not math.isfinite(loss):
        die(f"the loss is {loss} at step {p.step}: lower --lr, or check the data")


@torch.no_grad()
def evaluate(model, val, args, rank, world, device, autocast, whole=False):
    """(mean loss per target, targets) of the fixed validation batches 0..eval_batches-1, or (whole)
    of every token of the split once (common.whole_split); shared out over the ranks, all-reduced."""
    model.eval()
    batches = ([lambda b=b: rows_at(val, *b, args.vocab_size)  # each batch's rows, when called
                for b in whole_split(len(val), args.seq_len, args.batch_size)] if whole else
               [lambda i=i: val_batch(val, args, i) for i in range(args.eval_batches)])
    total = torch.zeros(2, device=device)  # the batches' summed losses, their targets
    for k in range(-(-len(batches) // world)):  # the same count on every rank: FSDP's
        i = rank + k * world                      # forwards are collectives
        rows = batches[min(i, len(batches) - 1)]()
        with autocast:
            loss = model(*to_device(rows, device), loss_fn=head.linear_cross_entropy)[1].float()
        targets = rows.numel() - len(rows) if i < len(batches) else 0
        total += torch.stack([loss * targets, torch.tensor(targets, device=device)])
    if world > 1:
        dist.all_reduce(total)
    model.train()
    return (total[0] / total[1]).item(), int(total[1])


def evaluate_and_save(run):
    """The validation loss at the current step, logged; then a checkpoint."""
    s, p = run.session, run.progress
    # not through DDP, whose forwards broadcast buffers (under torch.compile: the eager model)
    eval_model = run.gpt if s.replicated else run.model
    val = run.data.val if run.data else None
    val_loss = evaluate(eval_model, val, run.args, s.rank, s.world, s.device, s.autocast)[0]
    ema_loss = {}
    if run.ema:  # the same batches through the averaged weights
        with run.ema.swapped_in():
            ema_loss["ema_val_loss"] = evaluate(eval_model, val, run.args, s.rank, s.world,
                                                s.device, s.autocast)[0]
    p.evals.append(dict(step=p.step, val_loss=val_loss, **ema_loss))
    run.report.record(dict(step=p.step, val_loss=val_loss, **ema_loss, tokens=p.tokens,
                           peak_mem=peak_memory(s.device)))
    run.report.print(f"step {p.step}/{run.args.max_steps} | val loss {val_loss:.4f}"
                     + (f" | EMA weights {ema_loss['ema_val_loss']:.4f}" if ema_loss else "")
                     + (f" (unigram entropy {run.entropy:.4f})" if run.entropy else ""))
    save(run)


def check_conversion(run, baseline):
    """A converted model computes exactly what its baseline did: the logits on validation batch
    0 (their largest difference is logged), and so the validation loss (evaluated here)."""
    s, val = run.session, run.data.val if run.data else None
    with torch.no_grad(), s.autocast:
        x = to_device(val_batch(val, run.args, 0), s.device)[0]
        diff = (run.gpt(x)[0] - baseline(x)[0]).abs().max().item()
    run.report.record(dict(step=run.progress.step, conversion_max_logit_diff=diff))
    run.report.print(f"converted {run.args.init_from} at step {run.progress.step}: max |logit "
                     f"difference| to the baseline {diff:g}")
    evaluate_and_save(run)


def save(run):
    """The checkpoint of the run's current step (rank 0 writes it). A sharded run's ranks first
    write their shards into a new folder, which ckpt.pt then names in place of the weights."""
    s, p = run.session, run.progress
    if s.fsdp:
        folder = save_shards(run)
        state = dict(sharded=folder)
    elif s.master:
        state = dict(model=run.gpt.state_dict(), optimizer=run.optimizer.state_dict())
    if not s.master:
        return
    val_losses = [e["val_loss"] for e in p.evals]
    save_checkpoint(run.out / "ckpt.pt", dict(
        **state, step=p.step, data_position=p.step, config=dataclasses.asdict(run.config),
        args=vars(run.args), global_batch=run.args.global_batch, evals=p.evals,
        val_loss=val_losses[-1] if val_losses else None,
        best_val_loss=min(val_losses, default=None), tokens=p.tokens, rng=rng_states(),
        wandb_id=p.wandb_id, data_fingerprint=run.data_fingerprint,
        **({"ema": run.ema.state_dict() if not s.fsdp else True} if run.ema else {})))
    if s.fsdp:  # ckpt.pt names the new folder: the previous one can go
        parallel.remove_stale(run.out, keep=folder)


def save_shards(run):
    """parallel.save (with the weight average, if any), a failed write (a full disk) as one line
    on every rank."""
    extra = {"ema": run.ema.state_dict()} if run.ema else {}
    try:
        return parallel.save(run.out, run.progress.step, run.gpt, run.optimizer, extra)
    except BaseException as e:  # torch.distributed.checkpoint's CheckpointException included
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        fail(f"could not write the shards of step {run.progress.step} into {run.out} "
             f"({os_error(e)}); the previous checkpoint is kept: free some space or fix the "
             f"permissions, then --resume")


def finish(run, timer, t_start, stop_signal):
    """The end of a session: a checkpoint when it stops early (a signal or --stop_step), the
    final evaluation when it is done; then the summary (the paper's metric: the mean of the last
    K evaluations), and for a finished run summary.json and a sample."""
    args, s, p = run.args, run.session, run.progress
    evaluated = p.evals and p.evals[-1]["step"] == p.step
    if stop_signal or p.step < args.max_steps:
        if not evaluated:
            save(run)
        why = signal.Signals(stop_signal).name if stop_signal else "--stop_step"
        run.report.print(f"stopped after step {p.step} ({why}); continue with: python train.py "
                         f"--out_dir {run.out} --resume")
    elif not evaluated:
        evaluate_and_save(run)
    whole = (evaluate(run.gpt, run.data.val, args, s.rank, s.world, s.device, s.autocast, True)
             if run.data and p.step >= args.max_steps and not stop_signal else (None, 0))  # eager
    tail = [e["val_loss"] for e in p.evals[-args.tail_evals:]]
    trained_tokens = timer.trained_steps * args.global_batch * args.seq_len
    summary = dict(
        step=p.step, max_steps=args.max_steps, finished=p.step >= args.max_steps,
        residual=run.config.residual, route_heads=run.config.depth_heads,
        params=run.gpt.num_params(), final_val_loss=tail[-1] if tail else None,
        tail_val_loss=sum(tail) / len(tail) if tail else None, tail_evals=len(tail),
        full_val_loss=whole[0], full_val_tokens=whole[1],
        best_val_loss=min((e["val_loss"] for e in p.evals), default=None),
        unigram_entropy=run.entropy, tokens=p.tokens,
        tokens_per_s=trained_tokens / timer.train_time if timer.train_time else None,
        peak_mem=max(run.report.peak_mem, peak_memory(s.device)), wall_s=time.time() - t_start,
        world_size=s.world, stop_signal=stop_signal)
    if run.ema and p.evals:  # the averaged weights at the last evaluation (the paper's metric)
        summary["final_ema_val_loss"] = p.evals[-1]["ema_val_loss"]
    if s.master and summary["finished"] and not stop_signal:
        write_text(run.out / "summary.json", json.dumps(summary, indent=2),
                   then=f"the run is done and its checkpoint saved; free some space, then "
                        f"python train.py --out_dir {run.out} --resume writes it")
        run.report.print(summary_line(summary))
    if (s.master or s.fsdp) and summary["finished"] and not stop_signal:
        print_sample(run)  # a sharded model samples on every rank: its forwards are collectives
    if run.report.wandb is not None:
        with suppress(Exception):  # the run is saved: the dashboard's goodbye cannot fail it
            run.report.wandb.finish()
    if s.ddp:
        # Every rank's gloo work finished first: a worker thread still freeing the last all-reduce's
        # tensors needs the GIL, which the main thread holds while the process group's destructor
        # joins that thread (a deadlock seen about once in four runs on a loaded 2-core machine).
        dist.barrier()
        run.model = None            # DDP's reducer, the last holder of the group with it
        dist.destroy_process_group()
    return summary


def print_sample(run, prompt_tokens=48, new_tokens=128):
    """The model continues the start of the first validation document (its whole lines among
    the first 48 tokens): sampled from nothing, a small model writes mostly indentation. Only for
    GPT-2 token files, and only ids the tokenizer has are drawn (the model's vocabulary is
    padded past it). The run is over and saved: nothing here can fail it."""
    if run.data is None or run.data.meta.get("tokenizer") != "gpt2":
        return
    try:
        enc = prepare.get_encoding()
        prompt = [int(t) for t in run.data.val[:prompt_tokens]]
        line_ends = [i for i, t in enumerate(prompt) if "\n" in enc.decode([t])]
        prompt = prompt[:line_ends[-1] + 1] if line_ends else prompt
        torch.manual_seed(run.args.seed)
        with run.session.autocast, parallel.gathered(run.gpt):
            idx = run.gpt.generate(torch.tensor([prompt], device=run.session.device), new_tokens,
                                   temperature=0.8, top_k=50, vocab_limit=enc.n_vocab)
        continuation = enc.decode(idx[0, len(prompt):].tolist())
        run.report.print(f"sample: the first {len(prompt)} tokens of val.bin, then <|model|> and "
                         f"the model's next {new_tokens} (temperature 0.8, top-k 50):\n"
                         f"{enc.decode(prompt)}<|model|>{continuation}")
    except Exception as e:
        run.report.print(f"no sample: {type(e).__name__}: {one_line(e)}")


def main(argv=None):
    """Train; the exit status is 0, or 128 + the number of the signal that stopped the run."""
    try:
        interrupts.begin()  # KeyboardInterrupt until training starts, then StopSignals
        args, given = parse_args(argv)
        summary = train(args, given)
    except UserError as e:  # bad input: a flag, a file, a folder in use
        die(str(e))
    except MachineError as e:  # a full disk
        fail(str(e))
    except OSError as e:  # making the output folder or its lock: a read-only folder
        fail(f"could not write {e.filename or 'the outputs'}: {e.strerror or one_line(e)}")
    except KeyboardInterrupt:  # Ctrl-C before training started: nothing to save
        exit_error("train.py", "interrupted before training started", status=130)
    finally:  # the run is over (or --help): a signal is too late, ignored (teardown included)
        ignore_stop_signals("train.py")
    if summary["stop_signal"]:
        sys.exit(128 + summary["stop_signal"])
    return summary


if __name__ == "__main__":
    main()
