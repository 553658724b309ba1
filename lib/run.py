"""
A training run's machinery, which train.py calls: where the run stands (what a checkpoint keeps
besides the weights), what resuming and converting read, the weight average (--ema), the reports
(the console, log.jsonl, Weights & Biases, the summary's line) and the timer. Its errors are
exceptions (common.UserError, MachineError), each one line that the script prints. Importing this
file has no side effects.
"""
import dataclasses
import json
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from lib import hf, midtrain, parallel
from lib.common import (MachineError, UserError, fingerprint, load_optimizer, logged_until,
                        os_error, read_checkpoint, write_text)

# -----------------------------------------------------------------------------
# Where a run stands, and what resuming or converting reads besides it.

@dataclasses.dataclass
class Progress:
    """Where the run stands: what a checkpoint saves besides the weights and the optimizer."""
    step: int = 0
    evals: list = dataclasses.field(default_factory=list)   # [{"step", "val_loss"}]
    tokens: int = 0                                         # training tokens seen
    wandb_id: str = None


def load_checkpoint(path):
    """read_checkpoint for a run to resume or convert, its shards' folder found from here."""
    ckpt = read_checkpoint(path)
    if "sharded" in ckpt:  # a --fsdp run's: its shards lie in a folder next to it
        ckpt["sharded"] = Path(path).parent / ckpt["sharded"]
    return ckpt


def pretrained_directory(init_from):
    """Whether --init_from names a Hugging Face model (a directory, or a hub id such as
    Qwen/Qwen3-0.6B) rather than a checkpoint of this project (a file)."""
    path = Path(init_from)
    return path.is_dir() or (not path.exists() and path.suffix not in (".pt", ".pth")
                             and hf.HUB_ID.fullmatch(init_from) is not None)


def take_pretrained_flags(args, given):
    """--init_from DIR: the model's shape from DIR/config.json, the mid-training recipe for every
    flag left out (midtrain.take_flags); returns DIR (a hub id: its local snapshot)."""
    directory = hf.local_dir(args.init_from)
    shape = hf.config_from_hf(hf.read_json(directory / "config.json"), directory / "config.json")
    midtrain.take_flags(args, given, directory, shape)
    args.init_from = str(directory)
    return directory


def check_same_data(ckpt, data, args):
    """--resume reads the data the checkpoint was trained on (its fingerprint): data prepared
    anew under the same name would silently change the run."""
    saved = ckpt.get("data_fingerprint")
    if saved is None or saved == fingerprint(data) or args.allow_data_change:
        return
    raise UserError(f"{args.data} is not the data this checkpoint was trained on (then: {saved}; "
                    f"now: {fingerprint(data)}): point --data at that data, or pass "
                    f"--allow_data_change to continue on this one")


def carry_optimizer_state(saved, optimizer):
    """A baseline run's Adam moments into a converted model's optimizer, group by group: the
    shared parameters keep their order inside each group (mhar.GPT.param_groups), and the new
    routing group starts fresh."""
    state = optimizer.state_dict()
    groups = {group["name"]: group for group in state["param_groups"]}
    for old in saved["param_groups"]:
        new = groups[old["name"]]
        for i, j in zip(old["params"], new["params"], strict=True):
            if i in saved["state"]:
                state["state"][j] = saved["state"][i]
    load_optimizer(optimizer, state)


# -----------------------------------------------------------------------------
# The weight average (--ema).

class WeightAverage:
    """An exponential moving average of a model's weights (--ema): after every optimizer step,
    average <- average + (1 - decay) * (weights - average), from the weights the run starts with.
    It lives beside the model in the weights' dtype (float32: one more copy of the model), is
    saved in the checkpoint ("ema", under the model's own state-dict names) so that --resume
    continues it exactly, and is evaluated by swapping it into the model."""

    def __init__(self, model, decay, ckpt=None):
        self.model, self.decay = model, decay
        self.params = list(model.parameters())  # each once: a tied embedding and head are one
        self.averages = [p.detach().clone() for p in self.params]
        if ckpt:
            if "ema" not in ckpt:
                raise UserError(f"the checkpoint has no weight average, but --ema {decay} asks "
                                f"for one")
            if "sharded" in ckpt:  # a --fsdp run's average lies in its shards, as its weights
                parallel.load_extra(ckpt["sharded"], {"ema": self.state_dict()})
            else:
                self.load_state_dict(ckpt["ema"])

    @torch.no_grad()
    def update(self):
        for average, p in zip(self.averages, self.params):
            average.lerp_(p, 1 - self.decay)

    def names(self):
        """(state-dict name, average): every name of the model, tied ones sharing an average."""
        by_param = {id(p): a for p, a in zip(self.params, self.averages)}
        state = self.model.state_dict(keep_vars=True)
        assert all(id(t) in by_param for t in state.values()), "a persistent buffer"
        return [(name, by_param[id(t)]) for name, t in state.items()]

    def state_dict(self):
        return dict(self.names())

    @torch.no_grad()
    def load_state_dict(self, state):
        for name, average in self.names():
            average.copy_(state[name])

    @contextmanager
    def swapped_in(self):
        """The model holds the average inside the block, its own weights again after it. The
        values are exchanged in place, one tensor at a time: FSDP2 gathers its parameters from
        their own storage, which a swap of `.data` would leave behind."""
        @torch.no_grad()
        def swap():
            for p, average in zip(self.params, self.averages):
                held = p.detach().clone()
                p.copy_(average)
                average.copy_(held)
            parallel.regather(self.model)
        swap()
        try:
            yield
        finally:
            swap()


# -----------------------------------------------------------------------------
# Reporting: the console, log.jsonl, Weights & Biases; timing and the summary's line.

def fmt_count(n):
    """A count as the console shows it: 950, 12.3k, 4.56M, 1.23B."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.{1 if unit == 'k' else 2}f}{unit}"
    return f"{n:.0f}"


class Report:
    """Where a run reports (rank 0 alone): the console, log.jsonl and Weights & Biases."""

    def __init__(self, out, master):
        self.log_path, self.master, self.wandb = out / "log.jsonl", master, None
        self.peak_mem = 0       # the largest peak_mem recorded: the run's

    def print(self, message):
        if self.master:
            print(message, flush=True)

    def record(self, entry):
        """A line of log.jsonl (and of wandb)."""
        self.peak_mem = max(self.peak_mem, entry.get("peak_mem", 0))
        if self.master:
            try:  # a line cut short by a full disk is dropped by --resume (logged_until)
                with open(self.log_path, "a") as f:
                    f.write(json.dumps(entry) + "\n")
            except OSError as e:
                raise MachineError(f"could not write {self.log_path} ({os_error(e)}): free some "
                                   f"space or fix the permissions, then --resume") from None
            if self.wandb is not None:
                self.wandb.log({k: v for k, v in entry.items() if k != "step"}, step=entry["step"])


def start_wandb(report, args, progress):
    """--wandb: rank 0 logs to a Weights & Biases run as well, a resumed run under its own id."""
    if not args.wandb:
        return
    try:
        import wandb
    except ImportError:
        raise UserError("--wandb needs the wandb package: pip install wandb (or leave --wandb "
                        "out: log.jsonl has it all)") from None
    if report.master:
        report.wandb = wandb.init(project=args.wandb, config=vars(args), id=progress.wandb_id,
                                  resume="allow" if progress.wandb_id else None)
        progress.wandb_id = report.wandb.id


def start_outputs(run):
    """The output folder: log.jsonl cut back to the checkpoint's step (a new run: emptied),
    config.json, and the header on the console."""
    args, config, gpt, s, data = run.args, run.config, run.gpt, run.session, run.data
    if s.master:
        run.out.mkdir(parents=True, exist_ok=True)
        log_path = run.out / "log.jsonl"
        if log_path.exists():  # keep the lines the checkpoint covers (none for a new run)
            kept = logged_until(log_path, run.progress.step)
            write_text(log_path, "".join(line + "\n" for line in kept))
        write_text(run.out / "config.json", json.dumps(dict(
            config=dataclasses.asdict(config), args=vars(args), world_size=s.world,
            params=gpt.num_params()), indent=2))
    params = (f"{fmt_count(gpt.num_params())} params "
              f"({fmt_count(gpt.num_params(non_embedding=True))} non-embedding)")
    model = args.init_from if args.init_from and Path(args.init_from).is_dir() else args.preset
    run.report.print(f"model {model} | residual {config.residual}"
                     + (f" (H={config.depth_heads})" if config.routed else "") + f" | {params}"
                     + f" | {s.device} {str(s.dtype).removeprefix('torch.')}"
                     + (f" | {s.world} rank{'s' if s.world > 1 else ''}" if s.ddp else "")
                     + (" sharded (FSDP2)" if s.fsdp else ""))
    if config.delta and not args.init_from:  # said, not refused: a mode one may want, knowingly
        run.report.print("note: --delta without --init_from trains delta routing from scratch, "
                         "a mode of its own (docs/methods.md), not the paper's (a conversion)")
    run.report.print(
        f"data synthetic: uniform random tokens over {args.vocab_size} ids" if data is None else
        f"data {data.folder}: {fmt_count(len(data.train))} train / {fmt_count(len(data.val))} "
        f"val tokens | unigram entropy {run.entropy:.3f} nats/token")
    run.report.print(
        f"batch {args.batch_size} x {args.grad_accum} accum x {s.world} ranks x {args.seq_len} "
        f"tokens = {args.global_batch * args.seq_len:,} tokens/step | steps "
        f"{run.progress.step}->{args.max_steps} | lr {args.lr:g}, warmup {args.warmup_steps}, "
        + (f"past the run's end: the lr ends at {args.max_steps / args.warmup_steps:.3g}x the "
           f"peak" if args.warmup_steps > args.max_steps else f"cosine to {args.min_lr_ratio:g}x")
        + f" | weight decay {args.weight_decay:g} on "
        f"{args.decay_on}" + (f" | z-loss {args.z_loss:g}" if args.z_loss else "")
        + (f" | EMA {args.ema:g}" if args.ema else "") + f" | out {run.out}")


def summary_line(s):
    """The last line of a finished run: its losses, then tokens, speed, memory and time."""
    return (f"done: val loss {s['final_val_loss']:.4f} | tail-mean of the last {s['tail_evals']} "
            f"evals {s['tail_val_loss']:.4f}"
            + (f" | EMA weights {s['final_ema_val_loss']:.4f}" if "final_ema_val_loss" in s
               else "")
            + (f" | whole val split {s['full_val_loss']:.4f} ({fmt_count(s['full_val_tokens'])} "
               f"tokens)" if s.get("full_val_loss") is not None else "")
            + (f" | unigram entropy {s['unigram_entropy']:.4f}" if s["unigram_entropy"] else "")
            + f" | {fmt_count(s['tokens'])} tokens"
            + (f" | {fmt_count(s['tokens_per_s'])} tok/s" if s["tokens_per_s"] else "")
            + f" | peak mem {s['peak_mem'] / 2**30:.2f} GiB | {s['wall_s']:.0f} s")


class Timer:
    """Training time and throughput, evaluations left out."""

    def __init__(self):
        self.t0, self.steps, self.train_time, self.trained_steps = time.perf_counter(), 0, 0.0, 0

    def lap(self, tokens_per_step):
        """(ms per step, tokens per second) over the steps since the last lap."""
        dt = time.perf_counter() - self.t0
        self.train_time, self.trained_steps = self.train_time + dt, self.trained_steps + self.steps
        ms, tok_s = 1000 * dt / self.steps, self.steps * tokens_per_step / dt
        self.t0, self.steps = time.perf_counter(), 0
        return ms, tok_s

    @contextmanager
    def paused(self):
        start = time.perf_counter()
        yield
        self.t0 += time.perf_counter() - start
