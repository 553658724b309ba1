"""
Train an MHAR language model (or one of its baselines) on a CPU, one GPU or several GPUs.

    python train.py                                   # CPU demo: prepares the default corpus, trains the
                                                      # small preset, evaluates, samples (~5 min, 2 cores)
    python train.py --preset 100m                     # one GPU: the paper's 100M shape and recipe
    torchrun --standalone --nproc_per_node=8 train.py --preset 350m --residual attnres   # DDP
    python train.py --preset 100m --data synthetic --max_steps 50 --compile              # speed only
    python train.py --out_dir out --resume            # continue an interrupted run, bit for bit

The global batch is batch_size x grad_accum x world size; by default grad_accum makes it the preset's
(the paper's 64 x 2048 tokens at 100M). The data order is a pure function of (seed, step): every method
trained with one seed sees the same batches, a resumed run continues exactly, and 8 GPUs see the same
samples as 1 GPU. --out_dir gets config.json, log.jsonl (a line per log step and per evaluation),
ckpt.pt (written atomically at every evaluation) and summary.json.
"""
import argparse
import dataclasses
import json
import math
import os
import random
import sys
import time
from contextlib import nullcontext
from pathlib import Path

# Set before torch starts OpenMP: threads waiting at a barrier sleep instead of spinning. On a CPU shared
# with another busy process, spinning threads starve their siblings: the CPU demo measured 4x slower steps.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import mhar  # noqa: E402
from common import (CheckpointError, UserError, exit_error, one_line, pick_device, read_checkpoint,  # noqa: E402
                    read_tokens, sample_rows, unwrapped)

# The paper's recipe (DESIGN §5): AdamW (0.9, 0.95), eps 1e-8, weight decay 0.1, clip 1.0, peak lr 1e-3,
# 1000 warmup steps then cosine to 0.1x, 20K steps, eval every 500, the tail-mean of the last 11 evals.
BETAS, ADAM_EPS = (0.9, 0.95), 1e-8
RECIPE = dict(residual="mhar", route_heads=0, route_block=1, hc_streams=4, delta=False, batch_size=8, lr=1e-3, min_lr_ratio=0.1, weight_decay=0.1,
              grad_clip=1.0, max_steps=20_000, warmup_steps=1000, eval_interval=500, eval_batches=20,
              log_interval=10, tail_evals=11, seed=0, out_dir="out", dtype="auto", compile=False, fused=False)
# Per preset: micro-batch (sequences per rank) and global batch (sequences per step). The paper's global
# batches at 100M-1B, micro-batches that fit 80 GB on the readable path (1b: use --compile or --fused).
# small is the `python train.py` demo: 200 steps of 2k tokens, 4-8 minutes on 2 CPU cores (4k tokens per
# micro-step is slower per token there: the 50k-vocabulary logits outgrow the caches); tiny is for tests.
RUNS = {
    "tiny": dict(batch_size=8, global_batch=8, max_steps=200, warmup_steps=20, eval_interval=50, eval_batches=4,
                 lr=3e-3),
    "small": dict(batch_size=8, global_batch=8, max_steps=200, warmup_steps=20, eval_interval=40, eval_batches=8,
                  lr=3e-3),
    "100m": dict(batch_size=4, global_batch=64),
    "350m": dict(batch_size=2, global_batch=32),
    "1b": dict(batch_size=1, global_batch=32),
}
DEFAULT_PRESET = "small"
# On --resume the flags left out take the checkpoint's values. STRICT ones define the run: another value is
# an error (start a new --out_dir instead); the MACHINE ones are never taken from the checkpoint.
STRICT = ("preset", "residual", "route_heads", "route_block", "hc_streams", "delta", "vocab_size", "seq_len", "seed",
          "lr", "routing_lr", "min_lr_ratio", "warmup_steps", "weight_decay", "grad_clip")
MACHINE = ("resume", "init_from", "out_dir", "stop_step", "device", "grad_accum")
# --init_from continues a baseline run as a converted one: it takes the run's flags but these.
CONVERSION = ("residual", "route_heads", "route_block", "hc_streams", "delta", "routing_lr")


def die(msg):
    """One line that says what is wrong and what to do, exit status 2 (like argparse)."""
    exit_error("train.py", msg)


# -----------------------------------------------------------------------------
# Schedule and data: pure functions of the step, so the step is all a resumed run needs.

def lr_factor(step, warmup_steps, max_steps, min_lr_ratio):
    """Multiplier of each group's peak lr at update `step` (0-based): linear warmup, cosine to min_lr_ratio."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def to_device(rows, device):
    """(..., T + 1) rows -> inputs and targets (..., T) on the device (pinned: the copy is async on CUDA)."""
    if device.type == "cuda":
        rows = rows.pin_memory()
    rows = rows.to(device, non_blocking=True)
    return rows[..., :-1].contiguous(), rows[..., 1:].contiguous()


def open_data(path, rank, ddp):
    """(folder, train, val, meta): the token files of prepare.py as memmaps (common.read_tokens), and meta.json.
    The default corpus is prepared (by rank 0) when it is missing."""
    import prepare
    default = Path("data") / prepare.DEFAULT_NAME
    path = Path(path or default)
    if not (path / "train.bin").exists():
        if path != default:
            die(f"no train.bin in {path}: run python prepare.py first (see its --help), or use --data synthetic")
        if rank == 0:
            print(f"preparing the default corpus into {path} (once) ...", flush=True)
            try:
                prepare.prepare(name=prepare.DEFAULT_NAME, out=str(path.parent))
            except prepare.PrepareError as e:
                die(f"preparing the default corpus failed: {e}")
        if ddp:
            dist.barrier()
    try:
        tokens = read_tokens(path)
    except UserError as e:
        die(str(e))
    return path, tokens.train, tokens.val, tokens.meta


def unigram_entropy(tokens, limit=50_000_000):
    """Entropy in nats of the token frequencies of (the first 50M tokens of) train.bin: the loss of a model
    that ignores the context, an honest yardstick for a short run."""
    counts = np.bincount(tokens[:limit])
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


@torch.no_grad()
def evaluate(model, val, args, rank, world, device, autocast):
    """Mean loss over the fixed validation batches i = 0..eval_batches-1 (the same for every method and seed),
    shared out over the ranks and all-reduced."""
    model.eval()
    total = torch.zeros((), device=device)
    for i in range(rank, args.eval_batches, world):
        rows = sample_rows(val, ("val", i), args.batch_size, 0, args.batch_size, args.seq_len, args.vocab_size)
        with autocast:
            total += model(*to_device(rows, device))[1].float()
    if world > 1:
        dist.all_reduce(total)
    model.train()
    return total.item() / args.eval_batches


# -----------------------------------------------------------------------------
# Checkpoints: everything needed to continue the run exactly, loadable with weights_only=True.

def rng_states():
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return dict(torch=torch.get_rng_state(), python=random.getstate(),
                numpy=(kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss),
                cuda=torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)


def set_rng_states(s):
    torch.set_rng_state(s["torch"])
    random.setstate(s["python"])
    kind, keys, pos, has_gauss, gauss = s["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    if s["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])


def carry_optimizer_state(saved, optimizer):
    """A baseline run's Adam moments into a converted model's optimizer, group by group: the shared parameters
    keep their order inside each group (mhar.GPT.param_groups), and the new routing group starts fresh."""
    state = optimizer.state_dict()
    groups = {group["name"]: group for group in state["param_groups"]}
    for old in saved["param_groups"]:
        new = groups[old["name"]]
        for i, j in zip(old["params"], new["params"], strict=True):
            if i in saved["state"]:
                state["state"][j] = saved["state"][i]
    optimizer.load_state_dict(state)


def save_checkpoint(path, ckpt):
    """Write a temporary file, flush it to disk, then rename it: a crash never leaves half a checkpoint."""
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        torch.save(ckpt, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_checkpoint(path):
    """read_checkpoint for a run to resume or convert: its error is the run's one line."""
    try:
        return read_checkpoint(path)
    except CheckpointError as e:
        die(str(e))


# -----------------------------------------------------------------------------
# Flags: all default to None, then take the first of: given, the checkpoint's, the preset's run, the recipe.

def per_preset(key):
    return ", ".join(f"{name} {RUNS.get(name, {}).get(key, RECIPE.get(key))}" for name in mhar.PRESETS)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="train.py", description=__doc__.split("\n\n")[0].strip())
    a = p.add_argument
    a("--preset", help=f"model shape and run size: {', '.join(mhar.PRESETS)} (default {DEFAULT_PRESET})")
    a("--residual", choices=["baseline", "hyper", "attnres", "mhar"], help="residual variant (default mhar)")
    a("--route_heads", type=int, help="routing heads H of mhar; 0 = n_kv_head (default 0)")
    a("--route_block", type=int, help="sublayers per routing block; 1 = full routing (default 1)")
    a("--hc_streams", type=int, help="residual streams of --residual hyper (default 4)")
    a("--delta", action="store_true", default=None, help="delta routing: the baseline's residual plus a gated route")
    a("--init_from", help="convert this baseline checkpoint into a delta-routed model (--residual attnres/mhar) "
                          "and continue its run from its step")
    a("--routing_lr", type=float, help="peak learning rate of the parameters routing adds (default: --lr)")
    a("--data", help="a prepare.py folder (train.bin, val.bin, meta.json), or 'synthetic': random tokens, no "
                     "files (default data/pystdlib, prepared when missing)")
    a("--vocab_size", type=int, help="model vocabulary (default: meta.json's padded to a multiple of 64; the "
                                     "preset's for synthetic data)")
    a("--batch_size", type=int, help=f"micro-batch in sequences per rank ({per_preset('batch_size')})")
    a("--grad_accum", type=int, help="micro-steps per step (default: the global batch / (batch_size x ranks); "
                                     f"global batches {per_preset('global_batch')})")
    a("--seq_len", type=int, help="tokens per sequence (default: the preset's)")
    a("--max_steps", type=int, help=f"optimizer steps; the cosine ends here ({per_preset('max_steps')})")
    a("--stop_step", type=int, help="stop after this step as if interrupted (checkpoint saved; --resume goes on)")
    a("--lr", type=float, help=f"peak learning rate ({per_preset('lr')})")
    a("--min_lr_ratio", type=float, help="the cosine's floor, a fraction of the peak (default 0.1)")
    a("--warmup_steps", type=int, help=f"linear warmup steps ({per_preset('warmup_steps')})")
    a("--weight_decay", type=float, help="AdamW weight decay on all parameters (default 0.1)")
    a("--grad_clip", type=float, help="clip the gradient norm at this; 0 = off (default 1.0)")
    a("--eval_interval", type=int, help=f"steps between evaluations and checkpoints ({per_preset('eval_interval')})")
    a("--eval_batches", type=int, help=f"fixed validation batches ({per_preset('eval_batches')})")
    a("--log_interval", type=int, help="steps between log lines (default 10)")
    a("--tail_evals", type=int, help="the summary's tail-mean covers the last K evaluations (default 11)")
    a("--out_dir", help="output folder (default out)")
    a("--resume", nargs="?", const="", help="continue from out_dir/ckpt.pt, or from the checkpoint given")
    a("--seed", type=int, help="model init and data order (default 0)")
    a("--device", help="auto (cuda > mps > cpu), cpu, cuda, mps (default auto)")
    a("--dtype", choices=["auto", "float32", "bfloat16"], help="auto: bf16 autocast on CUDA, float32 elsewhere")
    a("--compile", action="store_true", default=None, help="torch.compile the model")
    a("--fused", action="store_true", default=None, help="route with the Triton kernels of kernel.py")
    a("--wandb", nargs="?", const="mhar", help="also log to Weights & Biases (project name, default mhar)")
    return p.parse_args(argv)


def resolve(args, world, saved=None, strict=True):
    """Fill in every flag left out; `saved` are the resolved flags of the checkpoint being resumed (strict:
    a flag given with another value is an error) or converted (not strict)."""
    given = {k for k, v in vars(args).items() if v is not None}
    for k, v in (saved or {}).items():
        if k in MACHINE or not hasattr(args, k):
            continue
        if k in given and strict and k in STRICT and getattr(args, k) != v:
            die(f"the checkpoint was trained with --{k} {v}, not {getattr(args, k)}: drop the flag, or start "
                f"a new run in another --out_dir")
        if k not in given:
            setattr(args, k, v)
    args.preset = args.preset or DEFAULT_PRESET
    if args.preset not in mhar.PRESETS:
        die(f"unknown --preset {args.preset}: choose from {', '.join(mhar.PRESETS)}")
    defaults = {**RECIPE, **RUNS.get(args.preset, {}), "seq_len": mhar.PRESETS[args.preset].seq_len}
    global_batch = defaults.pop("global_batch", None) if saved is None else saved.get("global_batch")
    for k, v in defaults.items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    if args.grad_accum is None:
        global_batch = global_batch or args.batch_size * world
        if global_batch % (args.batch_size * world):
            die(f"the global batch {global_batch} is not a multiple of --batch_size {args.batch_size} x {world} "
                f"ranks: pass --batch_size or --grad_accum")
        args.grad_accum = global_batch // (args.batch_size * world)
    args.global_batch = args.batch_size * args.grad_accum * world
    if saved is not None and global_batch is not None and args.global_batch != global_batch:
        die(f"global batch {args.global_batch} (batch_size x grad_accum x ranks) differs from the checkpoint's "
            f"{global_batch}: choose --batch_size and --grad_accum that multiply to it")
    args.stop_step = min(args.stop_step or args.max_steps, args.max_steps)
    args.routing_lr = args.routing_lr or args.lr
    return args


def fmt_count(n):
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.{1 if unit == 'k' else 2}f}{unit}"
    return f"{n:.0f}"


def peak_memory(device):
    """Peak bytes: of allocated tensors on CUDA, the process's maximum resident set elsewhere."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


# -----------------------------------------------------------------------------

def train(args):
    """Run, or continue, one training run; returns the summary (also written to summary.json)."""
    t_start = time.time()
    ddp = int(os.environ.get("RANK", -1)) != -1  # launched by torchrun
    rank, world = (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])) if ddp else (0, 1)
    master = rank == 0  # logs, evaluates (with the others' help) and saves
    log = print if master else (lambda *a, **k: None)
    try:
        device = pick_device(args.device)
    except UserError as e:
        die(str(e))
    if device.type == "cuda" and ddp:
        device = torch.device(f"cuda:{os.environ.get('LOCAL_RANK', 0)}")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    if ddp and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")

    ckpt = source = None
    if args.resume is not None:
        if args.init_from:
            die("--init_from starts a converted run and --resume continues one: pass one of them")
        if args.resume and args.out_dir is None:
            args.out_dir = os.path.dirname(args.resume) or "."
        ckpt = load_checkpoint(args.resume or os.path.join(args.out_dir or RECIPE["out_dir"], "ckpt.pt"))
        args = resolve(args, world, ckpt["args"])
    elif args.init_from:
        source = load_checkpoint(args.init_from)
        if source["config"]["residual"] != "baseline":
            die(f"--init_from converts a baseline checkpoint; {args.init_from} is a {source['config']['residual']} run")
        args.delta = True
        args = resolve(args, world, {k: v for k, v in source["args"].items() if k not in CONVERSION}, strict=False)
    else:
        args = resolve(args, world)
    if args.wandb:
        try:
            import wandb
        except ImportError:
            die("--wandb needs the wandb package: pip install wandb (or leave --wandb out: log.jsonl has it all)")
    dtype = {"auto": torch.bfloat16 if device.type == "cuda" else torch.float32,
             "float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    autocast = torch.autocast(device.type, dtype=dtype) if dtype != torch.float32 else nullcontext()

    # data
    synthetic = args.data == "synthetic"
    data_path, train_tokens, val_tokens, meta = (None, None, None, {}) if synthetic else open_data(args.data, rank, ddp)
    if args.vocab_size is None and meta.get("vocab_size"):
        args.vocab_size = -(-meta["vocab_size"] // 64) * 64  # a multiple of 64: 50257 -> 50304
    if args.vocab_size and meta.get("vocab_size", 0) > args.vocab_size:
        die(f"--vocab_size {args.vocab_size} is smaller than the data's vocabulary of {meta['vocab_size']}")
    for split, tokens in (("train", train_tokens), ("val", val_tokens)):
        if tokens is not None and len(tokens) <= args.seq_len + 1:
            die(f"{split}.bin has {len(tokens)} tokens, not one sequence of --seq_len {args.seq_len}")

    # model and optimizer, from the checkpoint when resuming
    try:
        if ckpt:
            config = mhar.Config(**{**ckpt["config"], "fused": bool(args.fused)})
        else:
            model_flags = dict(residual=args.residual, route_heads=args.route_heads, route_block=args.route_block,
                               hc_streams=args.hc_streams, delta=args.delta, seq_len=args.seq_len,
                               vocab_size=args.vocab_size, fused=bool(args.fused))
            config = mhar.preset(args.preset, **{k: v for k, v in model_flags.items() if v is not None})
        torch.manual_seed(args.seed)
        if source:  # the baseline's shape and weights, routing added with closed gates
            config = dataclasses.replace(config, **{k: v for k, v in source["config"].items() if k not in CONVERSION
                                                    and k != "fused"})
            gpt = mhar.GPT.from_baseline(unwrapped(source["model"]), config).to(device)
        else:
            gpt = mhar.GPT(config).to(device)
    except (ValueError, TypeError, RuntimeError, ImportError) as e:  # a bad flag, or --fused without a GPU
        die(one_line(e))
    args.residual, args.route_heads, args.route_block = config.residual, config.route_heads, config.route_block
    args.seq_len, args.vocab_size = config.seq_len, config.vocab_size
    optimizer = gpt.configure_optimizers(args.weight_decay, args.lr, BETAS, ADAM_EPS, device.type)
    for group in optimizer.param_groups:
        if group["name"] == "routing":
            group["lr"] = args.routing_lr
        group.setdefault("initial_lr", group["lr"])  # the schedule scales each group's own peak
    step, evals, tokens_seen, wandb_id = 0, [], 0, None
    if ckpt:
        try:
            gpt.load_state_dict(unwrapped(ckpt["model"]))
            optimizer.load_state_dict(ckpt["optimizer"])
            set_rng_states(ckpt["rng"])
        except (RuntimeError, ValueError, KeyError, TypeError) as e:
            die(f"the checkpoint does not fit this model: {one_line(e)}")
        step, evals, tokens_seen, wandb_id = ckpt["step"], ckpt["evals"], ckpt.get("tokens", 0), ckpt.get("wandb_id")
        del ckpt
    baseline = None
    if source:  # continue the baseline's run: its step, data position and Adam moments
        carry_optimizer_state(source["optimizer"], optimizer)
        step, tokens_seen = source["step"], source.get("tokens", 0)
        baseline = mhar.GPT(mhar.Config(**source["config"])).to(device)  # kept for the identity check below
        baseline.load_state_dict(unwrapped(source["model"]))
        del source
    model = torch.compile(gpt) if args.compile else gpt
    if ddp:
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    eval_model = model.module if ddp else model

    # output folder and header
    out, tokens_per_step = Path(args.out_dir), args.global_batch * args.seq_len
    log_path = out / "log.jsonl"
    entropy = None if synthetic else unigram_entropy(train_tokens)
    if master:
        out.mkdir(parents=True, exist_ok=True)
        if log_path.exists():  # keep the lines the checkpoint covers (none for a new run)
            lines = [ln for ln in log_path.read_text().splitlines() if ln and json.loads(ln)["step"] <= step]
            log_path.write_text("".join(ln + "\n" for ln in lines))
        (out / "config.json").write_text(json.dumps(dict(config=dataclasses.asdict(config), args=vars(args),
                                                         world_size=world, params=gpt.num_params()), indent=2))
    log(f"model {args.preset} | residual {config.residual}" + (f" (H={config.heads})" if config.routed else "")
        + f" | {fmt_count(gpt.num_params())} params ({fmt_count(gpt.num_params(non_embedding=True))} non-embedding)"
        + f" | {device} {str(dtype).removeprefix('torch.')}" + (f" | {world} ranks" if ddp else ""))
    log(f"data synthetic: uniform random tokens over {args.vocab_size} ids" if synthetic else
        f"data {data_path}: {fmt_count(len(train_tokens))} train / {fmt_count(len(val_tokens))} val tokens | "
        f"unigram entropy {entropy:.3f} nats/token")
    log(f"batch {args.batch_size} x {args.grad_accum} accum x {world} ranks x {args.seq_len} tokens = "
        f"{tokens_per_step:,} tokens/step | steps {step}->{args.max_steps} | lr {args.lr:g}, warmup "
        f"{args.warmup_steps}, cosine to {args.min_lr_ratio:g}x | out {out}")
    run = None
    if args.wandb and master:
        run = wandb.init(project=args.wandb, config=vars(args), id=wandb_id, resume="allow" if wandb_id else None)
        wandb_id = run.id

    def record(entry):  # a line of log.jsonl (and of wandb)
        if master:
            with open(log_path, "a") as f:
                f.write(json.dumps(entry) + "\n")
            if run is not None:
                run.log({k: v for k, v in entry.items() if k != "step"}, step=entry["step"])

    def checkpoint():
        if master:
            val_losses = [e["val_loss"] for e in evals]
            save_checkpoint(out / "ckpt.pt", dict(
                model=gpt.state_dict(), optimizer=optimizer.state_dict(), step=step, data_position=step,
                config=dataclasses.asdict(config), args=vars(args), global_batch=args.global_batch, evals=evals,
                val_loss=val_losses[-1] if evals else None, best_val_loss=min(val_losses, default=None),
                tokens=tokens_seen, rng=rng_states(), wandb_id=wandb_id))

    def run_eval():
        val_loss = evaluate(eval_model, val_tokens, args, rank, world, device, autocast)
        evals.append(dict(step=step, val_loss=val_loss))
        record(dict(step=step, val_loss=val_loss, tokens=tokens_seen, peak_mem=peak_memory(device)))
        log(f"step {step}/{args.max_steps} | val loss {val_loss:.4f}"
            + (f" (unigram entropy {entropy:.4f})" if entropy else ""))
        checkpoint()

    if baseline is not None:  # the conversion is exact: the baseline's logits, so its validation loss
        rows = sample_rows(val_tokens, ("val", 0), args.batch_size, 0, args.batch_size, args.seq_len, args.vocab_size)
        with torch.no_grad(), autocast:
            x = to_device(rows, device)[0]
            diff = (gpt(x)[0] - baseline(x)[0]).abs().max().item()
        record(dict(step=step, conversion_max_logit_diff=diff))
        log(f"converted {args.init_from} at step {step}: max |logit difference| to the baseline {diff:g}")
        del baseline
        run_eval()

    # the loop: one optimizer step per iteration; gradients are synchronized on the last micro-step only
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    loss_sum = torch.zeros((), device=device)
    train_time, trained_tokens, t0, steps_timed = 0.0, 0, time.perf_counter(), 0
    lo, rows_per_rank = rank * args.batch_size * args.grad_accum, args.batch_size * args.grad_accum
    while step < args.stop_step:
        scale = lr_factor(step, args.warmup_steps, args.max_steps, args.min_lr_ratio)
        for group in optimizer.param_groups:
            group["lr"] = group["initial_lr"] * scale
        rows = sample_rows(train_tokens, ("train", args.seed, step), args.global_batch, lo, lo + rows_per_rank,
                           args.seq_len, args.vocab_size)
        xs, ys = to_device(rows.view(args.grad_accum, args.batch_size, -1), device)
        loss_sum.zero_()
        for micro in range(args.grad_accum):
            with model.no_sync() if ddp and micro < args.grad_accum - 1 else nullcontext():
                with autocast:
                    _, loss = model(xs[micro], ys[micro])
                (loss / args.grad_accum).backward()
            loss_sum += loss.detach()
        if args.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step, steps_timed, tokens_seen = step + 1, steps_timed + 1, tokens_seen + tokens_per_step
        if step % args.log_interval == 0 or step == args.stop_step:
            if ddp:
                dist.all_reduce(loss_sum)  # summed over ranks, divided below: the global batch's mean loss
            loss = loss_sum.item() / (args.grad_accum * world)
            dt = time.perf_counter() - t0
            train_time, trained_tokens = train_time + dt, trained_tokens + steps_timed * tokens_per_step
            ms, tok_s = 1000 * dt / steps_timed, steps_timed * tokens_per_step / dt
            mfu = gpt.estimate_mfu(tok_s / world, device_name)  # None on CPUs and unknown GPUs
            record(dict(step=step, loss=loss, lr=args.lr * scale, ms=ms, tokens_per_s=tok_s, tokens=tokens_seen,
                        peak_mem=peak_memory(device), **({"mfu": mfu} if mfu is not None else {})))
            log(f"step {step}/{args.max_steps} | loss {loss:.4f} | lr {args.lr * scale:.2e} | {ms:.1f} ms | "
                f"{fmt_count(tok_s)} tok/s" + (f" | mfu {100 * mfu:.1f}%" if mfu is not None else ""))
            if not math.isfinite(loss):
                die(f"the loss is {loss} at step {step}: lower --lr, or check the data")
            t0, steps_timed = time.perf_counter(), 0
        if step % args.eval_interval == 0 and step < args.max_steps:
            t_eval = time.perf_counter()
            run_eval()
            t0 += time.perf_counter() - t_eval  # evaluation is not training time
    if step < args.max_steps:  # --stop_step: as if interrupted
        if not evals or evals[-1]["step"] != step:
            checkpoint()
        log(f"stopped after step {step} (--stop_step); continue with: python train.py --out_dir {out} --resume")
    elif not evals or evals[-1]["step"] != step:
        run_eval()

    # summary (the paper's metric: the mean of the last K evaluations) and a sample
    tail = [e["val_loss"] for e in evals[-args.tail_evals:]]
    summary = dict(
        step=step, max_steps=args.max_steps, finished=step >= args.max_steps, residual=config.residual,
        route_heads=config.heads, params=gpt.num_params(), final_val_loss=tail[-1] if tail else None,
        tail_val_loss=sum(tail) / len(tail) if tail else None, tail_evals=len(tail),
        best_val_loss=min((e["val_loss"] for e in evals), default=None), unigram_entropy=entropy,
        tokens=tokens_seen, tokens_per_s=trained_tokens / train_time if train_time else None,
        peak_mem=peak_memory(device), wall_s=time.time() - t_start, world_size=world)
    if master and summary["finished"]:
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
        log(f"done: val loss {tail[-1]:.4f} | tail-mean of the last {len(tail)} evals {summary['tail_val_loss']:.4f}"
            + (f" | unigram entropy {entropy:.4f}" if entropy else "") + f" | {fmt_count(tokens_seen)} tokens"
            + (f" | {fmt_count(summary['tokens_per_s'])} tok/s" if summary["tokens_per_s"] else "")
            + f" | peak mem {summary['peak_mem'] / 2**30:.2f} GiB | {summary['wall_s']:.0f} s")
        if meta.get("tokenizer") == "gpt2":
            import prepare
            enc = prepare.get_encoding()
            torch.manual_seed(args.seed)
            with autocast:
                idx = gpt.generate(torch.tensor([[enc.eot_token]], device=device), 200, temperature=0.8, top_k=50)
            log("sample:\n" + enc.decode(idx[0, 1:].tolist()))
    if run is not None:
        run.finish()
    if ddp:
        dist.destroy_process_group()
    return summary


def main(argv=None):
    train(parse_args(argv))


if __name__ == "__main__":
    main()
