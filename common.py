"""
What the scripts share (train.py, sample.py, probe.py, compare.py, prepare.py, bench_head.py):
one-line errors, the device and its peak memory, the token files of prepare.py, the batches drawn
from them, and checkpoints.
Importing this file has no side effects.
"""
import hashlib
import json
import os
import shutil
import sys
import tempfile
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

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


def exit_error(prog, message, status=2):
    """Print `prog: error: message` on stderr and exit with `status`: 2, as argparse does, for
    bad input; 1 for a failure of the machine (a full disk)."""
    print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
    sys.exit(status)


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


# -----------------------------------------------------------------------------
# Output folders: a file is written whole or not at all.

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


# -----------------------------------------------------------------------------
# Token files: prepare.py's train.bin / val.bin (token ids, uint16 or uint32) and meta.json.

TOKEN_DTYPES = ("uint16", "uint32")


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
    return torch.from_numpy(np.stack([tokens[s:s + seq_len + 1] for s in starts]).astype(np.int64))


# -----------------------------------------------------------------------------
# Checkpoints of train.py.

CKPT_KEYS = ("model", "optimizer", "step", "config", "args", "evals", "rng")
# A train.py --fsdp run's ckpt.pt names, under "sharded", the folder next to it that holds the
# model and the optimizer as shards (torch.distributed.checkpoint); the rest is as above.
SHARDED_KEYS = ("model", "optimizer")


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
    return ckpt


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
    import mhar
    ckpt = read_checkpoint(path, keys=("model", "config"))
    try:
        model = mhar.GPT(mhar.Config(**{**ckpt["config"], "fused": False}))
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
    import prepare  # for the default corpus's name; imported here because prepare.py imports this file
    data = (ckpt.get("args") or {}).get("data") or str(Path("data") / prepare.DEFAULT_NAME)
    return data, ({} if data == "synthetic" else read_meta(data))
