"""
What the scripts share (train.py, sample.py, probe.py, compare.py, prepare.py, bench_head.py):
one-line errors, files written whole, the device (its peak memory and FLOPs, what did not fit in
it), the token files of prepare.py and the batches drawn from them, checkpoints, and a training
run's safety (one run per output folder, a clean stop on a signal).
Importing this file has no side effects.
"""
import argparse
import hashlib
import json
import math
import os
import random
import re
import shutil
import signal
import socket
import sys
import tempfile
import time
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent  # the repository: what `python -m scripts.NAME` runs from

# -----------------------------------------------------------------------------
# Errors a user can fix: one line that says what is wrong and what to do, exit status 2.

class UserError(Exception):
    """Bad input (a flag, a file, a folder); the message is one line: what is wrong, what to do."""


class CheckpointError(UserError):
    """A missing, unreadable or foreign checkpoint."""


class MachineError(Exception):
    """A failure of the machine rather than of the input (a full disk, a read-only folder): one
    line, exit status 1."""


def one_line(e):
    """The first line of an exception's message, short enough for an error line."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]


def duration(seconds):
    """A wall time in words, as precise as a reader of minutes-long runs needs: "42 s", "3 min 5 s",
    "2 h 7 min"."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60} min"


def progress(done, total, elapsed=None):
    """How far a batch of runs is: "3 of 8 done, 5 left", with `elapsed` seconds since the first
    started ", about 8 min 20 s to go" (the pace so far, held: elapsed / done per run), "8 of 8 done"."""
    if done >= total:
        return f"{done} of {total} done"
    to_go = f", about {duration(elapsed / done * (total - done))} to go" if elapsed and done else ""
    return f"{done} of {total} done, {total - done} left{to_go}"


def exit_error(prog, message, status=2):
    """Print `prog: error: message` on stderr and exit with `status`: 2, as argparse does, for
    bad input; 1 for a failure of the machine (a full disk); 128 + a signal's number (130 for
    Ctrl-C) when one stopped the script, which then ignores any other (ignore_stop_signals)."""
    if status > 128:
        ignore_stop_signals(prog)
    print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
    sys.exit(status)


def command(prog):
    """How a user runs the script `prog` from the repository's root: python train.py, or for one in a
    folder of its own python -m scripts.compare (python -m lib.hf)."""
    for package in ("scripts", "lib"):
        if (ROOT / package / prog).is_file():
            return f"python -m {package}.{Path(prog).stem}"
    return f"python {prog}"


class FlagParser(argparse.ArgumentParser):
    """Every script's argparse: a bad flag is one line and exit status 2, as every other mistake
    of the user's (argparse itself prints its usage block first)."""

    def error(self, message):
        exit_error(self.prog, f"{message} ({command(self.prog)} --help lists the flags)")


# argparse types for flags: a value out of range is argparse's one-line error
def number(kind, minimum, strict):
    """An argparse type: a finite `kind` (int or float) > minimum (strict) or >= minimum."""
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number of type {kind.__name__}")
        if not (math.isfinite(value) and (value > minimum if strict else value >= minimum)):
            raise argparse.ArgumentTypeError(f"must be {'>' if strict else '>='} {minimum}, "
                                             f"not {text}")
        return value
    return parse


COUNT, STEPS = number(int, 0, strict=True), number(int, 0, strict=False)  # >= 1, >= 0
RATE, AMOUNT = number(float, 0, strict=True), number(float, 0, strict=False)  # > 0, >= 0


SEED_MAX = 2**63 - 1  # a seed is an int64 everywhere it is stored (torch's generators take up to 2**64 - 1)


def seed(text):
    """An argparse type: a seed, an integer in [0, 2**63 - 1]; any other value's refusal names the range."""
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or not 0 <= value <= SEED_MAX:
        raise argparse.ArgumentTypeError(f"must be a whole number in [0, {SEED_MAX}] (an int64), not {text!r}")
    return value


def fraction(text):
    """An argparse type: a fraction in [0, 1]."""
    value = AMOUNT(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"must be <= 1 (a fraction of the peak), not {text}")
    return value


def decay_rate(text):
    """An argparse type: a decay in [0, 1) (1 would never move the average)."""
    value = AMOUNT(text)
    if value >= 1:
        raise argparse.ArgumentTypeError(f"must be < 1 (0 = off), not {text}")
    return value


# -----------------------------------------------------------------------------
# Files written whole or not at all.

def write_atomically(path, write):
    """Write a file whole or not at all: write(f) fills a temporary file next to it (opened
    "wb"), which is flushed to disk and then renamed over `path`. A crash never leaves half a
    file; a failed write (a full disk, no permission) removes the temporary file, keeps the
    previous `path` and raises (a short write of torch.save: RuntimeError from its OSError)."""
    tmp = f"{path}.tmp"
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with suppress(OSError):
            os.remove(tmp)
        raise


def os_error(e):
    """The operating system's reason behind an exception (e.g. 'No space left on device'), found
    along its chain of causes; else its own first line."""
    seen = e
    while seen is not None:
        if isinstance(seen, OSError) and seen.strerror:
            return seen.strerror + (f": {seen.filename}" if seen.filename else "")
        seen = seen.__cause__ or seen.__context__
    return one_line(e)


def write_text(path, text, then="free some space or fix the permissions"):
    """A whole text file at once (write_atomically); a failed write leaves the previous file, or
    none, and raises MachineError naming the file and what to do `then`."""
    try:
        write_atomically(path, lambda f: f.write(text.encode()))
    except OSError as e:
        raise MachineError(f"could not write {path} ({os_error(e)}): {then}") from None


# -----------------------------------------------------------------------------
# Output folders: their files appear whole, or none of them.

def output_folder(path, flag):
    """`path` as a Path, or UserError when it, or the folder it would be created in, is a file."""
    path = Path(path)
    existing = next(d for d in (path, *path.parents) if d.exists())
    if not existing.is_dir():
        raise UserError(f"{flag} {path}: {existing} is a file, not a folder: give a folder (it is "
                        f"created if it does not exist)")
    return path


def remove_staging(tmp, created):
    """Remove a staging folder (None: none was made yet) and then the folders made to hold it,
    deepest first, as long as they are empty."""
    if tmp is not None:
        shutil.rmtree(tmp, ignore_errors=True)
    for d in created:
        try:
            d.rmdir()
        except OSError:  # not empty: something else lives there now
            break


@contextmanager
def staged(folder):
    """A hidden temporary folder inside `folder` to write into; once the block ends, its files move
    into `folder` (os.replace: each appears whole). On any failure they and the folders this made
    are removed, so a full disk or a read-only folder leaves nothing half-written behind: an
    OSError becomes a MachineError that names the folder and the reason."""
    folder = Path(folder)
    created = [d for d in (folder, *folder.parents) if not d.exists()]  # deepest first
    tmp = None
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=folder))
        yield tmp
        for file in sorted(tmp.iterdir()):
            os.replace(file, folder / file.name)
        tmp.rmdir()
    except BaseException as e:
        remove_staging(tmp, created)
        if isinstance(e, OSError):
            raise MachineError(f"cannot write into {folder} ({e.strerror or one_line(e)}): nothing "
                               f"written; free some space or write elsewhere") from None
        raise


# -----------------------------------------------------------------------------
# The device.

def pick_device(name=None):
    """The named device; "auto" (or None) picks cuda, else mps, else cpu. UserError for one that
    is absent."""
    if name in (None, "auto"):
        name = ("cuda" if torch.cuda.is_available() else
                "mps" if torch.backends.mps.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UserError(f"unknown device {name!r}: use auto, cpu, cuda, cuda:N or mps") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device {name}: this machine has no CUDA GPU that torch can use; use "
                        f"--device cpu (or auto)")
    count = torch.cuda.device_count()
    if device.type == "cuda" and device.index is not None and device.index >= count:
        raise UserError(f"--device {name}: there are only {count} GPUs")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise UserError(f"--device {name}: MPS is not available here; use --device cpu (or auto)")
    if device.type not in ("cpu", "cuda", "mps"):
        raise UserError(f"--device {name}: use auto, cpu, cuda, cuda:N or mps")
    return device


def max_resident_bytes(usage):
    """The maximum resident set of a resource usage (getrusage, wait4), in bytes (Linux: KiB)."""
    return usage.ru_maxrss * (1 if sys.platform == "darwin" else 1024)


def peak_memory(device):
    """Peak bytes: on CUDA of allocated tensors since the previous call (the counter is reset, so
    that a step's figure is not an evaluation's); elsewhere the process's maximum resident set (the
    kernel keeps no other)."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        return peak
    import resource
    return max_resident_bytes(resource.getrusage(resource.RUSAGE_SELF))


# Dense bf16 tensor-core peaks (vendor datasheets), by the exact name torch.cuda.get_device_name()
# gives; unknown devices get no MFU, not a wrong one (an H100 PCIe peaks at 756 TFLOPS, an NVL
# at 835: a name that merely contains "H100" is not enough).
PEAK_FLOPS = {"NVIDIA H100 80GB HBM3": 989e12,          # H100 SXM5
              "NVIDIA H100 PCIe": 756e12, "NVIDIA H100 NVL": 835e12,
              "NVIDIA H200": 989e12, "NVIDIA B200": 2250e12,
              "NVIDIA A100-SXM4-80GB": 312e12, "NVIDIA A100-SXM4-40GB": 312e12,
              "NVIDIA A100-PCIE-40GB": 312e12, "NVIDIA A100 80GB PCIe": 312e12}


def estimate_mfu(flops_per_token, tokens_per_s, device_name):
    """Model FLOPs utilization at a throughput (mhar.GPT.flops_per_token() per token), on a device
    named as by torch.cuda.get_device_name(); None for a device not in PEAK_FLOPS."""
    peak = PEAK_FLOPS.get(device_name)
    return None if peak is None else flops_per_token * tokens_per_s / peak


@contextmanager
def memory_for(what, flags):
    """An allocation that fails inside the block becomes a UserError: what did not fit in memory,
    how much was asked for, and which flags to lower (the allocator's own message names neither)."""
    try:
        yield
    except (RuntimeError, MemoryError) as e:  # torch.OutOfMemoryError is a RuntimeError
        asked = re.search(r"allocate (\d+ bytes|[\d.]+ [KMGTP]i?B)", str(e), re.IGNORECASE)
        if not (isinstance(e, (MemoryError, torch.OutOfMemoryError)) or asked):
            raise
        size = asked and asked[1]
        if size and size.endswith(" bytes"):
            size = f"{int(size.split()[0]) / 2**30:,.1f} GiB"
        raise UserError(f"{what} does not fit in memory"
                        + (f" (could not allocate {size})" if size else "")
                        + f": lower {flags}") from None


# -----------------------------------------------------------------------------
# Token files: prepare.py's train.bin / val.bin (token ids, uint16 or uint32) and meta.json.

TOKEN_DTYPES = ("uint16", "uint32")
DEFAULT_CORPUS = "pystdlib"  # data/pystdlib/: the built-in corpus, the standard library's sources


def padded_vocab(size):
    """The model's vocabulary for a tokenizer's `size` ids: a multiple of 64 (GPT-2: 50257 -> 50304),
    which keeps the embedding's and the LM head's matmuls on aligned shapes."""
    return -(-size // 64) * 64


@dataclass
class Tokens:
    folder: Path
    train: np.ndarray       # memmap of the training split's token ids
    val: np.ndarray         # memmap of the validation split's token ids
    meta: dict              # meta.json ({} when there is none)


def read_meta(folder):
    """meta.json of a prepare.py folder as a dict, {} when there is none; UserError when it is
    broken."""
    path = Path(folder) / "meta.json"
    if not path.is_file():
        return {}
    try:
        meta = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{path} is not valid JSON ({one_line(e)}): run prepare.py again") from None
    if not isinstance(meta, dict):
        raise UserError(f"{path} holds a JSON {type(meta).__name__}, not an object: run prepare.py "
                        f"again")
    counts = meta.get("tokens", {})
    vocab_size = meta.get("vocab_size", 1)
    if not (type(vocab_size) is int and vocab_size >= 1 and isinstance(counts, dict)
            and all(type(n) is int and n >= 0 for n in counts.values())):
        raise UserError(f"{path}: vocab_size must be a whole number >= 1 and tokens an object of "
                        f"whole counts >= 0, not {meta.get('vocab_size')!r} and "
                        f"{meta.get('tokens')!r}: run prepare.py again")
    return meta


def read_tokens(folder, splits=("train", "val")):
    """The token files of a prepare.py folder as memmaps; UserError for missing, empty or
    truncated files."""
    folder = Path(folder)
    meta = read_meta(folder)
    dtype = meta.get("dtype", "uint16")
    if dtype not in TOKEN_DTYPES:
        raise UserError(f"{folder}/meta.json: unknown token dtype {dtype!r} (expected one of "
                        f"{TOKEN_DTYPES})")
    arrays = {}
    for split in ("train", "val"):
        path = folder / f"{split}.bin"
        if split not in splits:
            arrays[split] = None
            continue
        if not path.is_file():
            raise UserError(f"no {split}.bin in {folder}: run python prepare.py first (see its "
                            f"--help)")
        size, itemsize = path.stat().st_size, np.dtype(dtype).itemsize
        if size == 0:
            raise UserError(f"{path} is empty: run prepare.py again")
        if size % itemsize:
            raise UserError(f"{path} has {size} bytes, not a whole number of {dtype} token ids: it "
                            f"is truncated or not a prepare.py file; run prepare.py again")
        recorded = (meta.get("tokens") or {}).get(split)  # prepare.py's count of the tokens
        if recorded is not None and size != recorded * itemsize:
            raise UserError(f"{path} has {size // itemsize} tokens, but {folder}/meta.json records "
                            f"{recorded}: it is truncated or not the file prepare.py wrote; run "
                            f"prepare.py again")
        arrays[split] = np.memmap(path, dtype=dtype, mode="r")
    return Tokens(folder, arrays["train"], arrays["val"], meta)


def largest_id(tokens, chunk=1 << 24):
    """The largest token id in a token array, read in chunks (a memmap is never loaded whole)."""
    return max(int(tokens[i:i + chunk].max()) for i in range(0, len(tokens), chunk))


def unigram_entropy(tokens, limit=50_000_000):
    """Entropy in nats of the token frequencies of (the first 50M tokens of) train.bin: the loss
    of a model that ignores the context, an honest yardstick for a short run."""
    counts = np.bincount(tokens[:limit])
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def fingerprint(tokens, blocks=16, block=1024):
    """What a checkpoint remembers of its data: the sizes of train.bin and val.bin and a hash of
    16 blocks of 1,024 tokens spread over each. Re-prepared data almost surely changes it, and it
    costs the same at 10B tokens as at 10M."""
    if tokens is None:
        return "synthetic"
    h = hashlib.blake2b(digest_size=8)
    for split in (tokens.train, tokens.val):
        for start in np.linspace(0, max(0, len(split) - block), blocks, dtype=np.int64):
            h.update(np.asarray(split[start:start + block]).tobytes())
    return f"{len(tokens.train)} + {len(tokens.val)} tokens, blake2b {h.hexdigest()}"


def seed_of(*keys):
    """A 64-bit seed hashed from keys such as ("train", seed, step): the same in every process
    and run."""
    return int.from_bytes(hashlib.blake2b(repr(keys).encode(), digest_size=8).digest(), "little")


def sample_rows(tokens, keys, n, lo, hi, seq_len, vocab_size):
    """Rows lo:hi of the n sequences (seq_len + 1 tokens) drawn for `keys`, int64
    (hi - lo, seq_len + 1). All n offsets are drawn and each rank keeps its slice, so how the n
    rows are split over ranks and micro-steps changes nothing. tokens=None (--data synthetic)
    draws uniform random tokens."""
    g = torch.Generator().manual_seed(seed_of(*keys))
    if tokens is None:
        return torch.randint(vocab_size, (n, seq_len + 1), generator=g)[lo:hi]
    starts = torch.randint(len(tokens) - seq_len, (n,), generator=g)[lo:hi].tolist()
    return rows_at(tokens, starts, seq_len, vocab_size)


def rows_at(tokens, starts, seq_len, vocab_size):
    """The rows of seq_len + 1 tokens that begin at `starts`, int64 (len(starts), seq_len + 1)."""
    rows = np.stack([tokens[s:s + seq_len + 1] for s in starts]).astype(np.int64) if starts else \
        np.empty((0, seq_len + 1), np.int64)  # no row (lo == hi), as the synthetic draw gives
    if rows.size and rows.max() >= vocab_size:  # past the embedding: an IndexError, a GPU's assert
        raise UserError(f"token id {rows.max()} at or past the model's vocabulary of {vocab_size}: "
                        f"the token files do not hold what meta.json says (its vocab_size, its "
                        f"dtype); run prepare.py again")
    return torch.from_numpy(rows)


def whole_split(n_tokens, seq_len, batch_size):
    """Batches that score every token of a split of n_tokens once, [(starts, length)]: windows of
    length + 1 tokens at a stride of seq_len, each predicting the `length` tokens after its first, at
    most batch_size of them per batch; the last n_tokens - 1 mod seq_len targets, a shorter window
    of their own. Each window reads only itself, as the sampled rows of an evaluation do."""
    full = (n_tokens - 1) // seq_len if n_tokens > 1 else 0
    batches = [(list(range(i * seq_len, min(i + batch_size, full) * seq_len, seq_len)), seq_len)
               for i in range(0, full, batch_size)]
    rest = max(n_tokens - 1 - full * seq_len, 0)
    return batches + ([([full * seq_len], rest)] if rest else [])


# -----------------------------------------------------------------------------
# Checkpoints of train.py.

CKPT_KEYS = ("model", "optimizer", "step", "config", "args", "evals", "rng")
# A train.py --fsdp run's ckpt.pt names, under "sharded", the folder next to it that holds the
# model and the optimizer as shards (torch.distributed.checkpoint); the rest is as above.
SHARDED_KEYS = ("model", "optimizer")


def rng_states():
    """Every random generator's state, in tensors and plain values (weights_only=True loads it)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return dict(torch=torch.get_rng_state(), python=random.getstate(),
                numpy=(kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss),
                cuda=torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)


def set_rng_states(s):
    """Restore rng_states(): a resumed run draws what the uninterrupted one would have."""
    torch.set_rng_state(s["torch"])
    random.setstate(s["python"])
    kind, keys, pos, has_gauss, gauss = s["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    if s["cuda"] is not None and torch.cuda.is_available():
        # one state per GPU the saving process saw; a machine with fewer restores those it has
        for index, state in enumerate(s["cuda"][:torch.cuda.device_count()]):
            torch.cuda.set_rng_state(state, index)


def adamw(model, weight_decay=0.1, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, device_type="cpu",
          groups=None):
    """AdamW over groups, by default the paper's recipe: weight decay on all parameters, one group
    per role (mhar.GPT.param_groups), each at lr; fused on CUDA."""
    groups = groups or [{"name": name, "params": ps, "weight_decay": weight_decay, "lr": lr}
                        for name, ps in model.param_groups().items() if ps]
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=device_type == "cuda")


def load_optimizer(optimizer, state):
    """optimizer.load_state_dict, its tensors copied out of the checkpoint. load_state_dict keeps
    a tensor already on its parameter's device as it is: on a CPU the Adam moments (and the step
    counters on any device) would stay views into the memory-mapped ckpt.pt, which would then
    stay mapped for the whole run, its disk space held after the next save replaces it."""
    optimizer.load_state_dict(state)
    for values in optimizer.state.values():
        for key, value in values.items():
            if torch.is_tensor(value) and value.device.type == "cpu":
                values[key] = value.clone()


def read_checkpoint(path, keys=CKPT_KEYS):
    """The checkpoint dict, or CheckpointError for a missing, truncated, foreign or incomplete
    file. A sharded checkpoint's model and optimizer stay in their folder: read the model with
    read_shards."""
    if not os.path.isfile(path):
        raise CheckpointError(f"no checkpoint at {path}: train one first (python train.py "
                              f"--out_dir DIR writes DIR/ckpt.pt)")
    try:  # mmap: the ranks of a machine share the pages
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:
        raise CheckpointError(f"cannot read checkpoint {path}: it is truncated or not a train.py "
                              f"checkpoint ({type(e).__name__}: {one_line(e)[:120]})") from None
    ckpt = ckpt if isinstance(ckpt, dict) else {}
    missing = [k for k in keys if k not in ckpt and not ("sharded" in ckpt and k in SHARDED_KEYS)]
    if missing:
        raise CheckpointError(f"{path} is not a train.py checkpoint (missing {', '.join(missing)})")
    if "sharded" in ckpt and not (Path(path).parent / ckpt["sharded"] / ".metadata").is_file():
        raise CheckpointError(f"{path} keeps its model in the folder {ckpt['sharded']} next to "
                              f"it, which is missing or incomplete: copy the folder along with "
                              f"ckpt.pt")
    for key in ("model", "ema"):
        if isinstance(ckpt.get(key), dict):
            ckpt[key] = current_names(ckpt[key])
    return ckpt


def current_names(state):
    """A model state dict in today's names: checkpoints written before a routing site's key
    norm g had its own name kept it as the weight of an RMSNorm module (sites.j.norm.weight)."""
    return {re.sub(r"(^|\.)(sites\.\d+)\.norm\.weight$", r"\1\2.norm_weight", k): v
            for k, v in state.items()}


def save_checkpoint(path, ckpt):
    """Write a checkpoint atomically (write_atomically): a crash never leaves half of one. A
    failed write (a full disk, no permission) keeps the previous checkpoint and raises
    MachineError."""
    try:
        write_atomically(path, lambda f: torch.save(ckpt, f))
    except (OSError, RuntimeError) as e:  # torch reports a short write as RuntimeError
        raise MachineError(f"could not write the checkpoint {path} ({os_error(e)}); the previous "
                           f"one is kept: free some space or fix the permissions, then "
                           f"--resume") from None


def read_shards(folder, prefix="model."):
    """The tensors of a sharded checkpoint folder (train.py --fsdp) whose names start with
    `prefix`, without it: {"embed.weight": ...} for the model. Read whole in this one process (no
    collective, also inside a distributed run), on the CPU, in the dtypes they were saved in;
    CheckpointError when a file is broken."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    try:
        reader = dcp.FileSystemReader(folder)
        state = {name: torch.empty(meta.size, dtype=meta.properties.dtype)
                 for name, meta in reader.read_metadata().state_dict_metadata.items()
                 if name.startswith(prefix) and isinstance(meta, TensorStorageMetadata)}
        with warnings.catch_warnings():  # no_dist is what we ask for
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
            dcp.load(state, storage_reader=reader, no_dist=True)
    except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
        raise CheckpointError(f"cannot read the shards in {folder}: a file is truncated or "
                              f"missing ({type(e).__name__}: {one_line(e)[:120]})") from None
    return {name.removeprefix(prefix): tensor for name, tensor in state.items()}


def unwrapped(state):
    """A model state dict without torch.compile's prefix."""
    return {k.removeprefix("_orig_mod."): v for k, v in state.items()}


def load_model(path, device="cpu", average=False):
    """(model in eval mode, checkpoint dict) from a train.py ckpt.pt; CheckpointError if it
    cannot be used. average=True: the run's weight average (train.py --ema) in place of its
    weights, when it kept one.

    The model is built with fused=False: reading the routing weights and sampling run the readable
    route on any device (a checkpoint trained with --fused on a GPU loads on a CPU).
    """
    from lib import rivals
    ckpt = read_checkpoint(path, keys=("model", "config"))
    try:
        model = rivals.model(rivals.config_of({**ckpt["config"], "fused": False}))
        key = "ema" if average and ckpt.get("ema") else "model"
        if "sharded" in ckpt:  # the shards hold 0-d parameters as vectors of one element
            own, folder = model.state_dict(), Path(path).parent / ckpt["sharded"]
            state = {k: v.reshape(own[k].shape) if k in own and v.numel() == own[k].numel()
                     else v for k, v in read_shards(folder, prefix=key + ".").items()}
        else:
            state = ckpt[key]
        model.load_state_dict(unwrapped(state))
    except (TypeError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"checkpoint {path} does not fit this mhar.py: "
                              f"{one_line(e)}") from None
    return model.to(device).eval(), ckpt


def training_data(ckpt):
    """(the --data a train.py checkpoint was trained on, that folder's meta.json): "synthetic" or a folder,
    train.py's default data/pystdlib when the run named none; the meta is {} for synthetic data or a folder
    that is gone. UserError when the meta.json is broken."""
    data = (ckpt.get("args") or {}).get("data") or str(Path("data") / DEFAULT_CORPUS)
    return data, ({} if data == "synthetic" else read_meta(data))


# -----------------------------------------------------------------------------
# A training run's safety: one run per output folder, and a clean stop on Ctrl-C or SIGTERM.

@contextmanager
def claim_out_dir(out, session):
    """Hold --out_dir for this run (session: a parallel.Session): a second run on it stops with one line before writing
    anything. The lock is fcntl.flock on out_dir/train.lock, which the operating system releases
    when the process ends, however it ends: a crashed or killed run leaves no stale lock to clean
    up, and the next run takes over. flock works across machines on NFSv4 and the cluster file
    systems that support it (Lustre: mounted with -o flock); where it is refused, the run goes on
    with a warning. The file also says who holds it (host and pid), for the refusal's message."""
    held, out = None, output_folder(out, "--out_dir")  # a file there is the user's mistake
    if session.master:
        out.mkdir(parents=True, exist_ok=True)
        held = lock_file(out / "train.lock")
    if session.any_rank(held is False):  # every rank stops when rank 0 could not take it
        if held is False:
            holder = (out / "train.lock").read_text().strip() or "another process"
            raise UserError(f"{out} is in use by another run ({holder}): wait for it to end, or "
                            f"stop it, or choose another --out_dir")
        sys.exit(2)
    try:
        yield
    finally:
        if held:
            held.close()  # releases the lock (the file stays: deleting it would race a newcomer)


def lock_file(path):
    """The open, locked file; False when another process holds the lock; None without locks."""
    try:
        import fcntl
    except ImportError:  # Windows: no flock
        return None
    f = open(path, "a+")  # "a+": opening must not erase what the holder wrote
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        return False
    except OSError as e:  # a file system without flock
        f.close()
        print(f"train.py: warning: cannot lock {path} ({e.strerror}): make sure no other run "
              f"uses {path.parent}", file=sys.stderr, flush=True)
        return None
    f.seek(0)
    f.truncate()
    f.write(f"host {socket.gethostname()}, pid {os.getpid()}\n")
    f.flush()
    return f


def logged_until(path, step):
    """The lines of log.jsonl up to `step`. Its last line may be half-written (the run crashed, or
    the disk filled up, in the middle of it): it is dropped, like the lines after `step`."""
    lines = path.read_bytes().decode(errors="replace").splitlines()
    kept = []
    for number, line in enumerate(lines, 1):
        if not line:
            continue
        try:
            entry = json.loads(line)
            logged = entry["step"]
        except (ValueError, TypeError, KeyError):
            if number == len(lines):
                break
            raise UserError(f"{path}, line {number}, is not a line train.py wrote "
                            f"({line[:40]!r}): delete it, then --resume again") from None
        if logged <= step:
            kept.append(line)
    return kept


def ignore_stop_signals(prog):
    """SIGINT and SIGTERM ignored from here on in the process of script `prog`, which is exiting
    because of one, or whose work is done (a signal then is too late to stop anything). Its teardown (torch's takes about a second) would otherwise meet a second
    Ctrl-C with a KeyboardInterrupt traceback, or, once Python has put the signals back to their
    defaults, die of it without a word (status -2, not 128 + the first signal's number). A process
    that runs another main, as a test calling `prog`'s main(), keeps its signals: False."""
    script = getattr(sys.modules.get("__main__"), "__file__", None) or ""
    if Path(script).name != prog:
        return False
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, signal.SIG_IGN)
    return True


class StopSignals:
    """SIGINT (Ctrl-C) or SIGTERM (how clusters preempt a job) inside the block asks script `prog`
    to stop where it safely can: `signum` holds the first one's number (0 while none came), and the
    script exits with 128 + it (130, 143). Once a stopped script leaves the block, its process only
    exits: further signals are ignored (ignore_stop_signals). Who stops, and how:

    - a training run (train.py): after the step in progress, with a checkpoint of it, said on rank
      0 (`master`). A second signal stops it at once, without a checkpoint of that step. One
      second's grace: under torchrun a terminal's Ctrl-C reaches each rank twice, directly and
      forwarded.
    - a queue of runs (compare.py; `running`: the processes under way, read at each signal): each
      run gets every signal too and stops as above, and no other run starts. A `kill PID` or
      `timeout` reaches compare.py alone, and its runs would otherwise go on writing without it; a
      terminal's Ctrl-C reaches them directly as well, which train.py's grace takes as one."""

    def __init__(self, prog, master=True, running=None):
        self.prog, self.master, self.running = prog, master, running
        self.signum, self.first_at = 0, 0.0

    def __enter__(self):
        self.previous = {s: signal.signal(s, self.handle) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def __exit__(self, *exc):
        if self.signum and ignore_stop_signals(self.prog):  # the stopped script's process exits
            return
        for s, handler in self.previous.items():
            signal.signal(s, handler)

    def handle(self, signum, frame):
        if self.running is not None:  # a queue: its runs stop themselves, and it waits for them
            self.signum = self.signum or signum
            for process in list(self.running):
                self.forward(process, signum)
            return
        name = signal.Signals(signum).name
        if not self.signum:
            self.signum, self.first_at = signum, time.monotonic()
            if self.master:  # os.write: print() is not safe inside a signal handler
                os.write(2, f"{self.prog}: {name}: stopping after this step, with a checkpoint "
                            f"(again to stop at once)\n".encode())
        elif time.monotonic() - self.first_at > 1.0:
            os.write(2, f"{self.prog}: {name} again: stopped at once, without a checkpoint of "
                        f"this step\n".encode())
            raise SystemExit(128 + signum)

    @staticmethod
    def forward(process, signum):
        """Pass a signal on to a run's process (one that has just ended is not signalled:
        send_signal checks)."""
        with suppress(OSError):
            process.send_signal(signum)
