"""common.py's pieces that every script leans on, where a bug would go unnoticed elsewhere: token
files longer than meta.json says, the peak resident set's unit, a write interrupted half-way, a
staged write into folders it made, which weights a checkpoint gives."""
import argparse
import hashlib
import json
import os
import re
import resource
import signal
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

import mhar
from lib import common
from helpers import ROOT, files_in, tiny


def token_folder(folder, train, val, recorded):
    """A prepare.py-style folder: train.bin and val.bin of uint16 ids, meta.json's token counts."""
    folder.mkdir()
    for split, n in (("train", train), ("val", val)):
        np.arange(n, dtype=np.uint16).tofile(folder / f"{split}.bin")
    (folder / "meta.json").write_text(json.dumps(dict(vocab_size=64, dtype="uint16", tokens=recorded)))
    return folder


@pytest.mark.parametrize("train", [99, 101], ids=["shorter", "longer"])
def test_token_files_other_than_meta_json_records_are_refused(tmp_path, train):
    folder = token_folder(tmp_path / "data", train, 10, dict(train=100, val=10))
    with pytest.raises(common.UserError, match=f"has {train} tokens, but .* records 100"):
        common.read_tokens(folder)
    (folder / "train.bin").write_bytes(np.arange(100, dtype=np.uint16).tobytes())
    assert len(common.read_tokens(folder).train) == 100


def test_the_peak_resident_set_is_in_bytes():
    """Linux's getrusage counts KiB (macOS bytes): this process, torch imported, holds more than
    10 MiB and less than the machine."""
    peak = common.max_resident_bytes(resource.getrusage(resource.RUSAGE_SELF))
    with open("/proc/self/status") as f:
        hwm = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) * 1024
    assert 10 << 20 < peak <= hwm


@pytest.mark.parametrize("failure", [KeyboardInterrupt, OSError], ids=["ctrl-c", "disk-full"])
def test_a_write_stopped_half_way_leaves_the_previous_file_and_no_temporary(tmp_path, failure):
    path = tmp_path / "results.json"
    path.write_text("previous")

    def half(f):
        f.write(b"half of the new")
        raise failure()
    with pytest.raises(failure):
        common.write_atomically(path, half)
    assert path.read_text() == "previous" and files_in(tmp_path) == ["results.json"]


def test_a_failed_staged_write_removes_every_folder_it_made(tmp_path):
    """Three missing levels: a full disk half-way leaves none of them, and the folder that was
    there before stays."""
    target = tmp_path / "a" / "b" / "c"
    with pytest.raises(common.MachineError, match="No space left"):
        with common.staged(target) as tmp:
            (tmp / "figure.png").write_bytes(b"half")
            raise OSError(28, "No space left on device")
    assert files_in(tmp_path) == []
    with common.staged(target) as tmp:                               # and a write that ends well
        (tmp / "figure.png").write_bytes(b"whole")
    assert files_in(tmp_path) == ["a", "a/b", "a/b/c", "a/b/c/figure.png"]


@pytest.mark.parametrize("average", [False, True], ids=["raw", "average"])
def test_a_checkpoint_with_a_weight_average_gives_the_weights_asked_for(tmp_path, average):
    """load_model gives the trained weights unless asked for the average (train.py --ema)."""
    torch.manual_seed(0)
    config = tiny()
    trained, averaged = mhar.GPT(config).state_dict(), mhar.GPT(config).state_dict()
    assert not torch.equal(trained["embed.weight"], averaged["embed.weight"])
    torch.save(dict(model=trained, ema=averaged, config=vars(config), step=3, args={}, evals=[],
                    optimizer={}, rng={}), tmp_path / "ckpt.pt")
    model, _ = common.load_model(tmp_path / "ckpt.pt", average=average)
    expected = averaged if average else trained
    assert all(torch.equal(v, expected[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("meta", [dict(vocab_size="50257"), dict(vocab_size=0), dict(vocab_size=True),
                                  dict(vocab_size=64.5), dict(tokens=[100, 10]),
                                  dict(tokens=dict(train="100"))],
                         ids=["vocab-string", "vocab-zero", "vocab-bool", "vocab-float", "tokens-list",
                              "count-string"])
def test_a_meta_json_of_the_wrong_types_is_one_clear_error(tmp_path, meta):
    """Not a TypeError in train.py, nor a vocabulary of 0 quietly replaced by the preset's."""
    folder = token_folder(tmp_path / "data", 100, 10, dict(train=100, val=10))
    (folder / "meta.json").write_text(json.dumps({**dict(dtype="uint16", vocab_size=64,
                                                         tokens=dict(train=100, val=10)), **meta}))
    with pytest.raises(common.UserError, match="meta.json: vocab_size must be a whole number"):
        common.read_tokens(folder)


@pytest.mark.parametrize("size, padded", [(0, 0), (1, 64), (63, 64), (64, 64), (65, 128), (257, 320),
                                          (50257, 50304), (2**32 - 1, 2**32)],
                         ids=["empty", "one", "one-less", "equal", "one-more", "bytes", "gpt2", "largest"])
def test_a_vocabulary_is_padded_up_to_the_next_multiple_of_64(size, padded):
    assert common.padded_vocab(size) == padded


@pytest.mark.parametrize("seconds, words", [
    (-1, "0 s"), (0, "0 s"), (0.4, "0 s"), (42, "42 s"), (59, "59 s"), (59.6, "1 min 0 s"), (60, "1 min 0 s"),
    (61, "1 min 1 s"), (3599, "59 min 59 s"), (3600, "1 h 0 min"), (3661, "1 h 1 min"), (10**7, "2777 h 46 min"),
])
def test_duration_in_words(seconds, words):
    assert common.duration(seconds) == words


@pytest.mark.parametrize("done, total, elapsed, words", [
    (0, 4, 100, "0 of 4 done, 4 left"), (1, 4, None, "1 of 4 done, 3 left"), (1, 4, 0, "1 of 4 done, 3 left"),
    (1, 4, 50, "1 of 4 done, 3 left, about 2 min 30 s to go"), (3, 4, 50, "3 of 4 done, 1 left, about 17 s to go"),
    (4, 4, 50, "4 of 4 done"), (5, 4, 50, "5 of 4 done"), (1, 2, 7200, "1 of 2 done, 1 left, about 2 h 0 min to go"),
], ids=["none-done", "no-clock", "no-time-yet", "one-done", "one-left", "all-done", "more-than-all", "hours"])
def test_progress_gives_the_time_to_go_at_the_pace_so_far(done, total, elapsed, words):
    assert common.progress(done, total, elapsed) == words


@pytest.mark.parametrize("mistake", ["another-tokenizer", "uint16-read-as-uint32"])
def test_token_ids_past_the_vocabulary_stop_the_run_in_one_line(tmp_path, capsys, mistake):
    """meta.json says 64 ids, the files hold up to 99 (another tokenizer's), or uint16 ids that
    meta.json declares uint32 (two ids read as one): one line before the first step, not an
    IndexError in the embedding (on a GPU, a device-side assert)."""
    import train
    from helpers import error_line
    folder = token_folder(tmp_path / "data", 400, 200, dict(train=400, val=200))
    if mistake == "another-tokenizer":
        np.tile(np.arange(100, dtype=np.uint16), 4).tofile(folder / "train.bin")
    else:  # 400 uint16 ids below 64 are 200 uint32 ids of (b << 16) + a
        meta = dict(vocab_size=64, dtype="uint32", tokens=dict(train=200, val=100))
        (folder / "meta.json").write_text(json.dumps(meta))
    line = error_line(capsys, train.main, ["--preset", "tiny", "--data", folder, "--max_steps", 2,
                                           "--out_dir", tmp_path / "out", "--seq_len", 16])
    assert re.search(r"token id (6[4-9]|[7-9]\d|\d{5,}) at or past the model's vocabulary of 64",
                     line), line
    assert not (tmp_path / "out" / "ckpt.pt").exists()


def test_a_script_exiting_on_a_signal_ignores_more_but_a_test_calling_it_does_not(tmp_path):
    """exit_error with 128 + a signal's number: the script's own process then ignores SIGINT and
    SIGTERM (its teardown must not die of a second Ctrl-C, status -2); this process, which runs
    pytest and calls scripts' main() in it, keeps its handlers, as its children would inherit an
    ignored signal."""
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    with pytest.raises(SystemExit):
        common.exit_error("sample.py", "interrupted (Ctrl-C)", status=130)
    assert {s: signal.getsignal(s) for s in before} == before
    script = tmp_path / "sample.py"
    script.write_text("import signal\nfrom lib import common\n"
                      "try:\n"
                      "    common.exit_error('sample.py', 'interrupted (Ctrl-C)', status=130)\n"
                      "finally:\n"
                      "    print([signal.getsignal(s) is signal.SIG_IGN\n"
                      "           for s in (signal.SIGINT, signal.SIGTERM)])\n")
    p = subprocess.run([sys.executable, script], env={**os.environ, "PYTHONPATH": str(ROOT)},
                       capture_output=True, text=True)
    assert (p.returncode, p.stdout, p.stderr) == (130, "[True, True]\n",
                                                  "sample.py: error: interrupted (Ctrl-C)\n")


@pytest.mark.parametrize("text, value", [("0", 0), ("1", 1), (str(common.SEED_MAX), common.SEED_MAX),
                                         (str(common.SEED_MAX + 1), None), ("-1", None),
                                         ("99999999999999999999999", None), ("", None), ("1.5", None)],
                         ids=["zero", "one", "largest", "one-past", "negative", "huge", "empty", "fraction"])
def test_a_seed_is_an_int64_at_or_above_zero(text, value):
    """Every script's --seed (and compare.py's --seeds): [0, 2**63 - 1], else argparse's one line that
    names the range; the boundaries either side."""
    import argparse
    if value is None:
        with pytest.raises(argparse.ArgumentTypeError, match=r"must be a whole number in \[0, 9223372036854775807\]"):
            common.seed(text)
    else:
        assert common.seed(text) == value


@pytest.mark.parametrize("count", [-1, -(2**63), 0, 1, 2**63 - 1],
                         ids=["minus-one", "most-negative", "zero", "one", "largest"])
def test_a_negative_token_count_in_meta_json_is_refused_in_one_line(tmp_path, capsys, count):
    """prepare.py records how many tokens each split holds: a count below zero is no count (read_tokens
    would compare the file's size with a negative number of bytes), one line; zero and above are counts."""
    from helpers import error_line
    folder = token_folder(tmp_path / "data", 100, 10, dict(train=count, val=10))
    if count >= 0:
        assert common.read_meta(folder)["tokens"] == dict(train=count, val=10)
        return
    with pytest.raises(common.UserError, match=re.escape(f"whole counts >= 0, not 64 and {{'train': {count}")):
        common.read_meta(folder)
    with pytest.raises(common.UserError, match="whole counts >= 0"):
        common.read_tokens(folder)
    import train
    line = error_line(capsys, train.main, ["--preset", "tiny", "--data", folder, "--max_steps", 1,
                                           "--out_dir", tmp_path / "out", "--seq_len", 16])
    assert "meta.json: vocab_size must be a whole number >= 1 and tokens an object of whole counts >= 0" in line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("largest, refused", [(62, False), (63, False), (64, True), (65, True), (65535, True)],
                         ids=["two-below", "vocab-minus-one", "vocab", "vocab-plus-one", "uint16-max"])
def test_a_token_id_at_the_vocabulary_size_is_refused(largest, refused):
    """sample_rows, every row a batch holds: ids 0 .. vocab_size - 1 are tokens, vocab_size and past it
    would index past the embedding (an IndexError on a CPU, a device-side assert on a GPU)."""
    tokens = (np.arange(100) * 7 % 60).astype(np.uint16)
    tokens[57] = largest
    rows = lambda: common.sample_rows(tokens, ("train", 0), 2, 0, 2, 99, 64)  # noqa: E731 each row all 100
    if refused:
        with pytest.raises(common.UserError, match=f"token id {largest} at or past the model's vocabulary of 64"):
            rows()
        return
    assert torch.equal(rows(), torch.from_numpy(tokens.astype(np.int64)).expand(2, -1))


@pytest.mark.parametrize("lo, hi", [(0, 0), (3, 3), (0, 1), (2, 4), (0, 4)],
                         ids=["none-first", "none-last", "first", "last-two", "all"])
def test_a_ranks_slice_of_the_drawn_rows_is_those_rows(lo, hi):
    """sample_rows(lo, hi) is rows lo:hi of the n drawn, whatever the slice: none (a rank without a row), one,
    all; and the synthetic draw's slices have the same shapes."""
    tokens = (np.arange(1000) * 7 % 64).astype(np.uint16)
    every = common.sample_rows(tokens, ("train", 3), 4, 0, 4, 16, 64)
    rows = common.sample_rows(tokens, ("train", 3), 4, lo, hi, 16, 64)
    assert rows.dtype == torch.int64 and torch.equal(rows, every[lo:hi])
    assert len(set(map(tuple, every.tolist()))) == 4  # four different rows: a wrong slice shows
    synthetic = common.sample_rows(None, ("train", 3), 4, lo, hi, 16, 64)
    assert synthetic.shape == rows.shape == (hi - lo, 17)


@pytest.mark.parametrize("n_tokens", [0, 1, 2, 7, 8, 9, 10, 23, 24, 25, 26],
                         ids=lambda n: f"{n}-tokens")
@pytest.mark.parametrize("batch_size", [1, 2, 3, 4])
def test_the_whole_split_is_every_target_once_in_windows_of_seq_len(n_tokens, batch_size):
    """whole_split at seq_len 8: targets 1 .. n - 1 each exactly once, in order; every window but the last
    predicts 8 tokens, the last the 1 .. 7 left over (none when 8 divides n - 1); at most batch_size windows a
    batch, each full batch but the last full; nothing for a split of 0 or 1 tokens (no target)."""
    seq_len = 8
    batches = common.whole_split(n_tokens, seq_len, batch_size)
    windows = [(start, length) for starts, length in batches for start in starts]
    targets = [t for start, length in windows for t in range(start + 1, start + length + 1)]
    assert targets == list(range(1, n_tokens))
    assert all(length == seq_len for _, length in windows[:-1])
    assert not windows or 1 <= windows[-1][1] <= seq_len
    full = [starts for starts, length in batches if length == seq_len]
    assert all(len(starts) == batch_size for starts in full[:-1]) and all(1 <= len(s) <= batch_size for s in full)
    assert all(len(starts) == 1 for starts, length in batches if length < seq_len)


def test_rows_at_reads_each_window_from_its_start():
    tokens = (np.arange(40) * 3 % 50).astype(np.uint16)
    rows = common.rows_at(tokens, [0, 5, 31], 8, 64)
    assert rows.dtype == torch.int64 and rows.shape == (3, 9)
    assert torch.equal(rows[1], torch.from_numpy(tokens[5:14].astype(np.int64)))
    assert torch.equal(rows[2], torch.from_numpy(tokens[31:40].astype(np.int64)))
    assert common.rows_at(tokens, [], 8, 64).shape == (0, 9)


# ----------------------------------------------------------------------------------------------
# What tests/mutate.py found unpinned in common.py: each function's behaviour at its edges, in this process


@pytest.mark.parametrize("status, ignores", [(1, False), (2, False), (128, False), (129, True), (130, True),
                                             (143, True)],
                         ids=["machine", "input", "128", "first-signal", "sigint", "sigterm"])
def test_exit_error_is_one_line_and_a_signals_status_ignores_more(capsys, monkeypatch, status, ignores):
    """`prog: error: message` on stderr alone, the status asked for; above 128 (128 + a signal's number)
    the script then ignores SIGINT and SIGTERM (ignore_stop_signals)."""
    asked = []
    monkeypatch.setattr(common, "ignore_stop_signals", asked.append)
    with pytest.raises(SystemExit) as exit:
        common.exit_error("sample.py", "what is wrong: what to do", status=status)
    assert exit.value.code == status and asked == (["sample.py"] if ignores else [])
    assert capsys.readouterr() == ("", "sample.py: error: what is wrong: what to do\n")


def test_exit_error_says_bad_input_by_default_and_flags_say_where_the_list_is(capsys):
    with pytest.raises(SystemExit) as exit:
        common.exit_error("probe.py", "no such run")
    assert exit.value.code == 2 and capsys.readouterr().err == "probe.py: error: no such run\n"
    parser = common.FlagParser(prog="train.py")
    parser.add_argument("--steps", type=common.STEPS)
    with pytest.raises(SystemExit) as exit:
        parser.parse_args(["--steps", "-1"])
    assert exit.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == ("train.py: error: argument --steps: must be >= 0, not -1 "
                                                        "(python train.py --help lists the flags)")


@pytest.mark.parametrize("kind, minimum, strict, text, value", [
    (int, 0, True, "1", 1), (int, 0, True, "0", "must be > 0, not 0"), (int, 0, True, "-1", "must be > 0, not -1"),
    (int, 0, False, "0", 0), (int, 0, False, "-1", "must be >= 0, not -1"),
    (int, 3, False, "3", 3), (int, 3, False, "2", "must be >= 3, not 2"), (int, 3, True, "4", 4),
    (int, 3, True, "3", "must be > 3, not 3"),
    (float, 0, True, "1e-9", 1e-9), (float, 0, True, "0", "must be > 0, not 0"), (float, 0, False, "0", 0.0),
    (float, 0, False, "-1e-9", "must be >= 0, not -1e-9"), (float, 0, False, "inf", "must be >= 0, not inf"),
    (float, 0, False, "nan", "must be >= 0, not nan"), (float, 0, True, "2.5", 2.5),
    (int, 0, False, "1.5", "'1.5' is not a number of type int"),
    (float, 0, False, "", "'' is not a number of type float"),
], ids=["int>0-one", "int>0-zero", "int>0-minus-one", "int>=0-zero", "int>=0-minus-one", "int>=3-three",
        "int>=3-two", "int>3-four", "int>3-three", "float>0-tiny", "float>0-zero", "float>=0-zero",
        "float>=0-minus-tiny", "float-inf", "float-nan", "float-non-trivial", "int-fraction", "float-empty"])
def test_a_number_flag_is_finite_and_past_its_minimum(kind, minimum, strict, text, value):
    parse = common.number(kind, minimum, strict)
    if isinstance(value, str):
        with pytest.raises(argparse.ArgumentTypeError) as refused:
            parse(text)
        assert str(refused.value) == value
        return
    parsed = parse(text)
    assert parsed == value and type(parsed) is kind


@pytest.mark.parametrize("parse, text, value", [
    (common.fraction, "0", 0.0), (common.fraction, "0.25", 0.25), (common.fraction, "1", 1.0),
    (common.fraction, "1.000001", "must be <= 1 (a fraction of the peak), not 1.000001"),
    (common.fraction, "-0.5", "must be >= 0, not -0.5"),
    (common.decay_rate, "0", 0.0), (common.decay_rate, "0.999", 0.999),
    (common.decay_rate, "1", "must be < 1 (0 = off), not 1"),
    (common.decay_rate, "1.5", "must be < 1 (0 = off), not 1.5"),
    (common.decay_rate, "-0.1", "must be >= 0, not -0.1"),
], ids=["fraction-zero", "fraction-quarter", "fraction-one", "fraction-past-one", "fraction-negative", "decay-off",
        "decay-just-below-one", "decay-one", "decay-past-one", "decay-negative"])
def test_a_fraction_is_in_0_1_and_a_decay_in_0_1_open(parse, text, value):
    if isinstance(value, str):
        with pytest.raises(argparse.ArgumentTypeError) as refused:
            parse(text)
        assert str(refused.value) == value
        return
    assert parse(text) == value


def test_a_file_written_whole_is_on_disk_before_it_takes_its_name(tmp_path, monkeypatch):
    """write_atomically: the new bytes flushed and fsync'd in a temporary file beside `path`, then renamed over it
    (the previous file readable until then); nothing else left in the folder."""
    path = tmp_path / "results.json"
    path.write_text("previous")
    events, fsync, replace = [], os.fsync, os.replace

    def synced(fd):
        (tmp,) = [p for p in tmp_path.iterdir() if p != path]
        events.append(("fsync", tmp.read_bytes(), path.read_text()))  # what the file holds on disk by now
        fsync(fd)

    def renamed(source, target):
        events.append(("replace", Path(source).parent, Path(target)))
        replace(source, target)
    monkeypatch.setattr(os, "fsync", synced)
    monkeypatch.setattr(os, "replace", renamed)
    common.write_atomically(path, lambda f: f.write(b"the new text"))
    assert events == [("fsync", b"the new text", "previous"), ("replace", tmp_path, path)]
    assert path.read_text() == "the new text" and files_in(tmp_path) == ["results.json"]


def test_a_write_that_cannot_start_raises_its_own_error(tmp_path):
    """No folder to write in: the OSError of opening the temporary file, not one of removing what was never made
    (which would carry the first as its context)."""
    with pytest.raises(FileNotFoundError) as error:
        common.write_atomically(tmp_path / "missing" / "results.json", lambda f: f.write(b"x"))
    assert error.value.filename == f"{tmp_path / 'missing' / 'results.json'}.tmp"
    assert error.value.__context__ is None


def chained(outer, inner, how):
    """`outer` raised while handling `inner` (how="context") or from it (how="cause")."""
    try:
        try:
            raise inner
        except BaseException as e:
            if how == "cause":
                raise outer from e
            raise outer
    except BaseException as e:
        return e


@pytest.mark.parametrize("error, reason", [
    (OSError(28, "No space left on device"), "No space left on device"),
    (OSError(13, "Permission denied", "/data/out/ckpt.pt"), "Permission denied: /data/out/ckpt.pt"),
    (chained(RuntimeError("short write"), OSError(28, "No space left on device"), "cause"), "No space left on device"),
    (chained(RuntimeError("short write"), OSError(5, "Input/output error", "f"), "context"), "Input/output error: f"),
    (chained(RuntimeError("a\nb"), ValueError("not an OSError"), "cause"), "a"),
    (chained(RuntimeError("outer"), OSError("no strerror"), "cause"), "outer"),
    (OSError("no strerror"), "no strerror"),
], ids=["oserror", "with-filename", "cause", "context", "no-oserror-first-line", "oserror-without-reason", "bare"])
def test_os_error_is_the_systems_reason_along_the_chain(error, reason):
    assert common.os_error(error) == reason


@pytest.mark.parametrize("then", [None, "write elsewhere"], ids=["default", "said"])
def test_write_text_writes_a_whole_file_or_says_why_not(tmp_path, then):
    extra = {} if then is None else dict(then=then)
    common.write_text(tmp_path / "a.txt", "héllo\n", **extra)
    assert (tmp_path / "a.txt").read_bytes() == "héllo\n".encode()
    missing = tmp_path / "missing" / "a.txt"
    with pytest.raises(common.MachineError) as error:
        common.write_text(missing, "x", **extra)
    assert str(error.value) == (f"could not write {missing} (No such file or directory: {missing}.tmp): "
                                f"{then or 'free some space or fix the permissions'}")
    assert error.value.__cause__ is None and error.value.__suppress_context__


@pytest.mark.parametrize("where, refused", [("out", None), ("out/a/b", None), (".", None), ("file", "file"),
                                            ("file/a/b", "file")],
                         ids=["new", "new-nested", "existing", "a-file", "under-a-file"])
def test_an_output_folder_cannot_be_or_be_under_a_file(tmp_path, monkeypatch, where, refused):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "file").write_text("")
    if refused is None:
        path = common.output_folder(where, "--out_dir")
        assert path == Path(where) and isinstance(path, Path)
        assert files_in(tmp_path) == ["file"]  # nothing made
        return
    with pytest.raises(common.UserError) as error:
        common.output_folder(where, "--out_dir")
    assert str(error.value) == (f"--out_dir {where}: {refused} is a file, not a folder: give a folder (it is "
                                f"created if it does not exist)")


@pytest.mark.parametrize("staging, occupied", [(False, None), (True, None), ("gone", None), (True, "a/b"),
                                              (True, "a")],
                         ids=["no-staging-yet", "all-empty", "staging-already-gone", "middle-occupied",
                              "top-occupied"])
def test_remove_staging_removes_what_it_made_up_to_an_occupied_folder(tmp_path, staging, occupied):
    """The staging folder (with its files; one already gone is no error: this cleans up after another), then
    the made folders deepest first, stopping at the first that holds something else: it and those above it
    stay."""
    made = [tmp_path / "a" / "b" / "c", tmp_path / "a" / "b", tmp_path / "a"]
    made[0].mkdir(parents=True)
    tmp = None if not staging else made[0] / ".tmp-x"
    if staging is True:
        (tmp / "sub").mkdir(parents=True)
        (tmp / "sub" / "results.json").write_text("{}")
    if occupied:
        (tmp_path / occupied / "other").write_text("")
    common.remove_staging(tmp, made)
    expected = {None: [], "a/b": ["a", "a/b", "a/b/other"], "a": ["a", "a/other"]}[occupied]
    assert files_in(tmp_path) == expected


@pytest.mark.parametrize("platform, expected", [("linux", 3 * 1024), ("darwin", 3)], ids=["linux-kib", "macos-bytes"])
def test_the_maximum_resident_set_is_counted_in_bytes_on_each_system(monkeypatch, platform, expected):
    monkeypatch.setattr(sys, "platform", platform)
    assert common.max_resident_bytes(types.SimpleNamespace(ru_maxrss=3)) == expected


def test_a_gpus_peak_is_allocated_bytes_since_the_last_call(monkeypatch):
    """On CUDA, torch's allocated peak, whose counter is then reset (a step's peak is not an evaluation's); on the
    CPU, the process's maximum resident set."""
    calls = []
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: calls.append(("peak", device)) or 5 << 20)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device: calls.append(("reset", device)))
    device = torch.device("cuda", 1)
    assert common.peak_memory(device) == 5 << 20 and calls == [("peak", device), ("reset", device)]
    calls.clear()
    resident = common.max_resident_bytes(resource.getrusage(resource.RUSAGE_SELF))
    assert common.peak_memory(torch.device("cpu")) == resident
    assert calls == []


@pytest.mark.parametrize("name, mfu", [("NVIDIA H100 80GB HBM3", 0.5), ("NVIDIA A100-SXM4-40GB", 989 / 312 * 0.5),
                                       ("NVIDIA H100", None), ("cpu", None)],
                         ids=["h100-sxm", "a100", "a-name-merely-containing-h100", "unknown"])
def test_mfu_is_flops_over_the_devices_peak_and_none_when_it_is_unknown(name, mfu):
    value = common.estimate_mfu(989e9 / 2, 1000, name)  # half an H100 SXM's 989 TFLOPS
    assert value == (None if mfu is None else pytest.approx(mfu, rel=1e-12))


@pytest.mark.parametrize("text, refusal", [
    (None, None), ("{}", None), ("{not json", "is not valid JSON (Expecting property name"),
    (b"\xff\xfe", "is not valid JSON"), ("[1, 2]", "holds a JSON list, not an object: run prepare.py again"),
    ('{"vocab_size": 1}', None), ('{"tokens": {}}', None),
], ids=["none", "empty-object", "broken", "not-utf8", "a-list", "vocab-one", "no-counts"])
def test_read_meta_reads_an_object_and_refuses_anything_else(tmp_path, text, refusal):
    if text is not None:
        (tmp_path / "meta.json").write_bytes(text if isinstance(text, bytes) else text.encode())
    if refusal is None:
        assert common.read_meta(tmp_path) == (json.loads(text) if text else {})
        return
    with pytest.raises(common.UserError) as error:
        common.read_meta(tmp_path)
    assert str(error.value).startswith(f"{tmp_path / 'meta.json'}") and refusal in str(error.value)


@pytest.mark.parametrize("case, refusal", [
    ("uint32", None), ("no-dtype-uint16", None), ("train-only", None),
    ("int16", "meta.json: unknown token dtype 'int16' (expected one of ('uint16', 'uint32'))"),
    ("no-val", "no val.bin in {folder}: run python prepare.py first (see its --help)"),
    ("empty-val", "{folder}/val.bin is empty: run prepare.py again"),
    ("odd-bytes", "{folder}/train.bin has 21 bytes, not a whole number of uint16 token ids: it is truncated or not a "
                  "prepare.py file; run prepare.py again"),
], ids=["uint32", "uint16-by-default", "only-the-split-asked-for", "unknown-dtype", "missing-split", "empty-split",
        "half-a-token"])
def test_read_tokens_maps_each_split_asked_for(tmp_path, case, refusal):
    dtype = "uint32" if case == "uint32" else "uint16"
    np.arange(10, dtype=dtype).tofile(tmp_path / "train.bin")
    np.arange(4, dtype=dtype).tofile(tmp_path / "val.bin")
    meta = {} if case == "no-dtype-uint16" else dict(dtype="int16" if case == "int16" else dtype)
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    if case in ("no-val", "train-only"):
        (tmp_path / "val.bin").unlink()
    if case == "empty-val":
        (tmp_path / "val.bin").write_bytes(b"")
    if case == "odd-bytes":
        (tmp_path / "train.bin").write_bytes(bytes(21))
    splits = ("train",) if case == "train-only" else ("train", "val")
    if refusal:
        with pytest.raises(common.UserError) as error:
            common.read_tokens(tmp_path, splits)
        assert refusal.format(folder=tmp_path) in str(error.value)
        return
    tokens = common.read_tokens(tmp_path, splits)
    assert tokens.folder == tmp_path and tokens.meta == meta and tokens.train.dtype == np.dtype(dtype)
    with pytest.raises(ValueError, match="read-only"):  # mapped for reading: training never writes the data
        tokens.train[0] = 1
    assert tokens.train.tolist() == list(range(10))
    assert tokens.val is None if case == "train-only" else tokens.val.tolist() == [0, 1, 2, 3]


def fingerprint_of(train, val):
    return common.fingerprint(common.Tokens(Path("."), np.asarray(train, np.uint16), np.asarray(val, np.uint16), {}))


def test_read_tokens_of_the_val_split_alone_needs_no_train_bin(tmp_path):
    """splits=("val",): val.bin mapped, train None, a missing train.bin never looked at."""
    np.arange(4, dtype=np.uint16).tofile(tmp_path / "val.bin")
    (tmp_path / "meta.json").write_text(json.dumps(dict(dtype="uint16", tokens=dict(train=10, val=4))))
    tokens = common.read_tokens(tmp_path, ("val",))
    assert tokens.train is None and tokens.val.tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("length", [10, 1024, 16 * 1024, 100_000], ids=["shorter-than-a-block", "one-block",
                                                                         "sixteen-blocks", "spread-blocks"])
def test_the_data_fingerprint_sees_each_splits_ends_and_size(length):
    """The sizes of train and val, and a hash of 16 blocks of 1,024 tokens from each, the first and the last
    among them: a token changed at either end of either split changes it (and the same data gives the same)."""
    train, val = np.arange(length) % 50_000, np.arange(length // 2 + 1) % 777
    same = fingerprint_of(train, val)
    assert same == fingerprint_of(train.copy(), val.copy())
    assert re.fullmatch(rf"{length} \+ {length // 2 + 1} tokens, blake2b [0-9a-f]{{16}}", same)
    for split, at in (("train", 0), ("train", -1), ("val", 0), ("val", -1)):
        changed = {"train": train.copy(), "val": val.copy()}
        changed[split][at] += 1
        assert fingerprint_of(changed["train"], changed["val"]) != same, (split, at)
    assert common.fingerprint(None) == "synthetic"


@pytest.mark.parametrize("train_length, val_length", [(1024 + 15 * 100, 10), (1024, 1024 + 15 * 7)],
                         ids=["train-spread-val-short", "train-one-block-val-spread"])
def test_the_data_fingerprint_is_the_hash_of_16_blocks_of_1024_tokens(train_length, val_length):
    """The fingerprint a checkpoint stores, computed the readable way: 16 blocks of 1,024 tokens from each split,
    the k-th starting at k/15 of the way to the last full block (lengths where that is a whole number), the
    whole split where it is shorter than a block; a checkpoint's stays the same from one version to the next."""
    train, val = (np.arange(n, dtype=np.uint16) % m for n, m in ((train_length, 50_000), (val_length, 777)))
    h = hashlib.blake2b(digest_size=8)
    for split in (train, val):
        last = max(0, len(split) - 1024)
        assert last % 15 == 0
        for k in range(16):
            h.update(split[k * last // 15:k * last // 15 + 1024].tobytes())
    assert fingerprint_of(train, val) == f"{train_length} + {val_length} tokens, blake2b {h.hexdigest()}"


@pytest.mark.parametrize("length", [17, 18, 40], ids=["one-row-exactly", "one-spare-token", "many"])
def test_sampled_rows_are_whole_windows_of_the_tokens(length):
    """Each row is seq_len + 1 consecutive tokens starting anywhere a whole row fits, the last token included
    (a tokens array of exactly one row gives that row every time); the same keys draw the same rows, others not."""
    tokens = np.arange(length, dtype=np.uint16)
    rows = common.sample_rows(tokens, ("train", 1), 400, 0, 400, 16, 1000)
    starts = rows[:, 0]
    assert rows.shape == (400, 17) and torch.equal(rows, starts[:, None] + torch.arange(17))
    assert set(starts.tolist()) == set(range(length - 16))  # every start drawn, in 400 draws of so few
    assert torch.equal(rows, common.sample_rows(tokens, ("train", 1), 400, 0, 400, 16, 1000))
    if length > 17:
        assert not torch.equal(rows, common.sample_rows(tokens, ("train", 2), 400, 0, 400, 16, 1000))


def test_synthetic_rows_are_uniform_ids_below_the_vocabulary():
    rows = common.sample_rows(None, ("train", 0), 50, 0, 50, 15, 7)
    assert rows.shape == (50, 16) and rows.dtype == torch.int64 and set(rows.unique().tolist()) == set(range(7))
    assert torch.equal(rows, common.sample_rows(None, ("train", 0), 50, 0, 50, 15, 7))


def test_restored_random_states_draw_again_what_they_drew(tmp_path):
    """rng_states, saved and loaded as a checkpoint is (weights_only), then set_rng_states: torch, Python and
    NumPy draw the same numbers again."""
    import random
    np.random.standard_normal()  # NumPy now holds the second of a pair of normals: its state says so
    torch.save(common.rng_states(), tmp_path / "rng.pt")
    draws = lambda: (torch.rand(3).tolist(), random.random(), np.random.rand(3).tolist(),  # noqa: E731
                     np.random.standard_normal())
    first = draws()
    common.set_rng_states(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert draws() == first
    assert common.rng_states()["cuda"] is None or torch.cuda.is_available()
    keys = common.rng_states()["numpy"][1]  # NumPy's 624 uint32 keys, whole in int64 (no float rounding)
    assert keys.dtype == torch.int64 and torch.equal(keys, torch.from_numpy(np.random.get_state()[1].astype(np.int64)))


@pytest.mark.parametrize("gpus", [None, 1, 2], ids=["no-cuda", "one-gpu", "two-gpus"])
def test_saved_random_states_hold_every_gpus_where_there_is_cuda(monkeypatch, gpus):
    """rng_states on a machine with `gpus` GPUs (None: no CUDA, faked): torch.cuda's states of all of them, or
    None without CUDA."""
    states = None if gpus is None else [torch.full((4,), i, dtype=torch.uint8) for i in range(gpus)]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus is not None)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: list(states))
    saved = common.rng_states()["cuda"]
    assert saved is None if gpus is None else saved == states


@pytest.mark.parametrize("saved, here", [(None, 2), (0, 2), (1, 2), (2, 2), (3, 2), (2, None)],
                         ids=["saved-without-cuda", "saved-no-gpu-state", "fewer-saved", "as-many", "more-saved",
                              "no-cuda-here"])
def test_restored_gpu_states_are_those_of_the_gpus_both_machines_have(monkeypatch, saved, here):
    """set_rng_states on a machine with `here` GPUs (None: no CUDA) of a checkpoint whose process saw `saved`
    (None: no CUDA): GPU i takes the i-th state saved, for the GPUs both have; none without CUDA on either side."""
    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: here is not None)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: here or 0)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, index: restored.append((index, state)))
    states = None if saved is None else [torch.full((4,), i, dtype=torch.uint8) for i in range(saved)]
    common.set_rng_states({**common.rng_states(), "cuda": states})
    both = min(saved or 0, here or 0)
    assert [i for i, _ in restored] == list(range(both))
    assert all(state is states[i] for i, state in restored)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_adamw_defaults_are_the_papers_recipe_one_group_per_role(device, monkeypatch):
    model = mhar.GPT(tiny(vocab_size=64))
    built = {}
    monkeypatch.setattr(torch.optim, "AdamW", lambda groups, **kw: built.update(groups=groups, **kw) or built)
    common.adamw(model, device_type=device)
    roles = {name: ps for name, ps in model.param_groups().items() if ps}
    assert [g["name"] for g in built["groups"]] == list(roles)
    assert all(list(map(id, g["params"])) == list(map(id, roles[g["name"]])) and g["weight_decay"] == 0.1
               and g["lr"] == 1e-3 for g in built["groups"])
    assert (built["lr"], built["betas"], built["eps"], built["fused"]) == (1e-3, (0.9, 0.95), 1e-8, device == "cuda")
    mine = [{"params": list(model.parameters()), "lr": 0.5}]
    common.adamw(model, weight_decay=0.0, lr=2e-3, betas=(0.8, 0.9), eps=1e-6, groups=mine)
    assert built["groups"] is mine and (built["lr"], built["betas"], built["eps"]) == (2e-3, (0.8, 0.9), 1e-6)


def test_a_loaded_optimizers_state_is_its_own_not_the_checkpoints(tmp_path):
    """load_optimizer: the Adam moments and step counters copied out of the memory-mapped checkpoint, the same
    values."""
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    for p in model.parameters():  # as after a step (a real one would import torch._dynamo: seconds)
        optimizer.state[p] = dict(step=torch.tensor(1.0), exp_avg=torch.rand_like(p), exp_avg_sq=torch.rand_like(p))
    torch.save(optimizer.state_dict(), tmp_path / "opt.pt")
    state = torch.load(tmp_path / "opt.pt", weights_only=True, mmap=True)
    fresh = torch.optim.AdamW(model.parameters())
    common.load_optimizer(fresh, state)
    loaded = [v for values in fresh.state.values() for v in values.values() if torch.is_tensor(v)]
    saved = [v for values in state["state"].values() for v in values.values() if torch.is_tensor(v)]
    assert len(loaded) == len(saved) == 6  # step, exp_avg, exp_avg_sq of the weight and the bias
    assert all(torch.equal(a, b) and a.data_ptr() != b.data_ptr() for a, b in zip(loaded, saved))


def test_a_loaded_optimizers_plain_values_are_kept_as_they_are(tmp_path):
    """load_optimizer on an optimizer whose state holds numbers beside tensors (L-BFGS's counters): the numbers
    as they were, the tensors copied out of the checkpoint."""
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.LBFGS(model.parameters())
    first = next(iter(model.parameters()))
    optimizer.state[first] = dict(func_evals=3, n_iter=2, d=torch.rand(8))
    torch.save(optimizer.state_dict(), tmp_path / "opt.pt")
    state = torch.load(tmp_path / "opt.pt", weights_only=True, mmap=True)
    fresh = torch.optim.LBFGS(model.parameters())
    common.load_optimizer(fresh, state)
    (loaded,) = fresh.state.values()
    assert (loaded["func_evals"], loaded["n_iter"]) == (3, 2)
    saved = next(iter(state["state"].values()))["d"]
    assert torch.equal(loaded["d"], saved) and loaded["d"].data_ptr() != saved.data_ptr()


@pytest.mark.parametrize("name, today", [
    ("sites.3.norm.weight", "sites.3.norm_weight"), ("sites.12.norm.weight", "sites.12.norm_weight"),
    ("_orig_mod.sites.0.norm.weight", "_orig_mod.sites.0.norm_weight"), ("layers.0.norm.weight", None),
    ("xsites.0.norm.weight", None), ("sites.0.norm.weight.bak", None), ("sites.a.norm.weight", None),
    ("sites.0.query", None)],
    ids=["site", "two-digit-site", "compiled", "a-layers-norm", "another-prefix", "more-after", "no-index", "query"])
def test_a_checkpoints_old_site_norm_names_read_as_todays(name, today):
    assert list(common.current_names({name: 1})) == [today or name]


def checkpoint(**entries):
    return dict(model={"sites.0.norm.weight": torch.ones(2)}, optimizer={}, step=3, config={}, args={}, evals=[],
                rng={}, **entries)


@pytest.mark.parametrize("case, refusal", [
    ("whole", None), ("with-ema", None), ("missing", "no checkpoint at {path}: train one first (python train.py "
                                                     "--out_dir DIR writes DIR/ckpt.pt)"),
    ("garbage", "cannot read checkpoint {path}: it is truncated or not a train.py checkpoint ("),
    ("a-list", "{path} is not a train.py checkpoint (missing model, optimizer, step, config, args, evals, rng)"),
    ("no-step-no-rng", "{path} is not a train.py checkpoint (missing step, rng)"),
    ("sharded-without-folder", "{path} keeps its model in the folder shards next to it, which is missing or "
                               "incomplete: copy the folder along with ckpt.pt"),
    ("sharded", None),
], ids=["whole", "with-ema", "missing", "garbage", "a-list", "two-keys-missing", "sharded-without-folder", "sharded"])
def test_read_checkpoint_gives_a_whole_checkpoint_in_todays_names(tmp_path, case, refusal):
    path = tmp_path / "ckpt.pt"
    ckpt = checkpoint(**(dict(ema={"sites.1.norm.weight": torch.ones(2)}) if case == "with-ema" else {}))
    if case in ("sharded", "sharded-without-folder"):
        del ckpt["model"], ckpt["optimizer"]
        ckpt["sharded"] = "shards"
    if case == "sharded":
        (tmp_path / "shards").mkdir()
        (tmp_path / "shards" / ".metadata").write_bytes(b"")
    if case == "no-step-no-rng":
        del ckpt["step"], ckpt["rng"]
    if case == "garbage":
        path.write_bytes(b"not a zip")
    elif case != "missing":
        torch.save([ckpt] if case == "a-list" else ckpt, path)
    if refusal:
        with pytest.raises(common.CheckpointError) as error:
            common.read_checkpoint(path)
        assert str(error.value).startswith(refusal.format(path=path))
        return
    read = common.read_checkpoint(path)
    assert read["step"] == 3
    assert "model" not in read if case == "sharded" else list(read["model"]) == ["sites.0.norm_weight"]
    assert case != "with-ema" or list(read["ema"]) == ["sites.1.norm_weight"]


def test_a_checkpoint_saved_on_a_gpu_reads_onto_the_cpu(tmp_path, monkeypatch):
    """A checkpoint whose tensors were saved from a GPU (torch.save records each storage's device: faked here as
    cuda:0) reads on the CPU, on any machine, with the values saved."""
    import torch.serialization
    weight = torch.arange(4.0)
    with monkeypatch.context() as m:
        m.setattr(torch.serialization, "location_tag", lambda storage: "cuda:0")
        torch.save(checkpoint(ema={"embed.weight": weight}), tmp_path / "ckpt.pt")
    read = common.read_checkpoint(tmp_path / "ckpt.pt")
    assert read["ema"]["embed.weight"].device == torch.device("cpu")
    assert torch.equal(read["ema"]["embed.weight"], weight)


@pytest.mark.skipif(not Path("/proc/self/maps").is_file(), reason="reads Linux's /proc/self/maps")
def test_read_checkpoint_maps_the_file_rather_than_reading_it(tmp_path):
    """torch.load(mmap=True): the checkpoint's tensors are pages of the file, mapped into the process (which the
    ranks of a machine share), for as long as they are held."""
    path = tmp_path / "ckpt.pt"
    torch.save(checkpoint(), path)
    read = common.read_checkpoint(path)
    assert str(path) in Path("/proc/self/maps").read_text()
    assert torch.equal(read["model"]["sites.0.norm_weight"], torch.ones(2))


@pytest.mark.parametrize("case", ["pickled-object", "not-a-zip"])
def test_an_unreadable_checkpoint_names_torchs_error_in_120_characters(tmp_path, case):
    """A checkpoint that holds a pickled object (loading it could run any code: weights_only refuses it) or that
    is no zip: CheckpointError naming torch's error, its type and the first 120 characters of its first line
    (both of these run longer)."""
    import argparse
    path = tmp_path / "ckpt.pt"
    if case == "pickled-object":
        torch.save({**checkpoint(), "args": argparse.Namespace(data="corpus")}, path)
    else:
        path.write_bytes(b"not a zip")
    with pytest.raises(Exception) as torchs:  # the reference: torch's own error for the read asked for
        torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    first = str(torchs.value).strip().splitlines()[0]
    assert len(first) > 120 and (case == "not-a-zip" or torchs.type.__name__ == "UnpicklingError")
    with pytest.raises(common.CheckpointError) as error:
        common.read_checkpoint(path)
    assert str(error.value) == (f"cannot read checkpoint {path}: it is truncated or not a train.py checkpoint "
                                f"({torchs.type.__name__}: {first[:120]})")


def test_a_checkpoint_of_a_bare_tensor_is_not_a_train_py_checkpoint(tmp_path):
    """torch.save of a tensor (weights_only reads it): the one CheckpointError naming what is missing, not
    the tensor's own error at `"model" in tensor`."""
    torch.save(torch.zeros(3), tmp_path / "ckpt.pt")
    with pytest.raises(common.CheckpointError, match=r"is not a train.py checkpoint \(missing model, "):
        common.read_checkpoint(tmp_path / "ckpt.pt")


def test_read_checkpoint_asks_only_for_the_keys_named(tmp_path):
    torch.save(dict(model={}, config={}), tmp_path / "ckpt.pt")
    assert common.read_checkpoint(tmp_path / "ckpt.pt", keys=("model", "config")) == dict(model={}, config={})


@pytest.mark.parametrize("fault", ["none", "oserror", "short-write"])
def test_a_checkpoint_is_saved_whole_or_the_previous_one_kept(tmp_path, monkeypatch, fault):
    path = tmp_path / "ckpt.pt"
    common.save_checkpoint(path, dict(step=1))
    if fault != "none":
        def fail(obj, f):
            f.write(b"half")
            if fault == "oserror":
                raise OSError(28, "No space left on device")
            raise RuntimeError("PytorchStreamWriter failed writing file") from OSError(28, "No space left on device")
        monkeypatch.setattr(torch, "save", fail)
        with pytest.raises(common.MachineError) as error:
            common.save_checkpoint(path, dict(step=2))
        assert str(error.value) == (f"could not write the checkpoint {path} (No space left on device); the previous "
                                    f"one is kept: free some space or fix the permissions, then --resume")
        monkeypatch.undo()
    else:
        common.save_checkpoint(path, dict(step=2))
    assert torch.load(path)["step"] == (1 if fault != "none" else 2) and files_in(tmp_path) == ["ckpt.pt"]


@pytest.mark.parametrize("args, data", [(None, None), ({}, None), ({"data": None}, None),
                                        ({"data": "synthetic"}, "synthetic"), ({"data": "FOLDER"}, "FOLDER")],
                         ids=["no-args", "no-data", "data-none", "synthetic", "a-folder"])
def test_training_data_is_the_runs_data_and_its_meta(tmp_path, monkeypatch, args, data):
    """train.py's default, data/pystdlib, where the run named none (here a folder without meta.json: {});
    no meta for synthetic data."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "meta.json").write_text('{"vocab_size": 64}')
    args = args if args is None or args.get("data") != "FOLDER" else {"data": "corpus"}
    named = {None: str(Path("data") / "pystdlib"), "synthetic": "synthetic", "FOLDER": "corpus"}[data]
    meta = {"vocab_size": 64} if data == "FOLDER" else {}
    assert common.training_data({"args": args}) == (named, meta)


def test_synthetic_data_has_no_meta_even_beside_a_folder_so_named(tmp_path, monkeypatch):
    """--data synthetic is no folder: a folder named synthetic in the working directory, with a meta.json, is
    not read (a folder of another name is)."""
    monkeypatch.chdir(tmp_path)
    for name in ("synthetic", "synthetics"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "meta.json").write_text('{"vocab_size": 64}')
    assert common.training_data({"args": {"data": "synthetic"}}) == ("synthetic", {})
    assert common.training_data({"args": {"data": "synthetics"}}) == ("synthetics", {"vocab_size": 64})


def test_a_second_lock_on_a_file_is_refused_until_the_first_is_released(tmp_path):
    """lock_file: the holder's host and pid in the file, which a refused second opener leaves as it was."""
    import socket
    path = tmp_path / "train.lock"
    first = common.lock_file(path)
    holder = f"host {socket.gethostname()}, pid {os.getpid()}\n"
    assert path.read_text() == holder
    assert common.lock_file(path) is False and path.read_text() == holder
    first.close()
    again = common.lock_file(path)
    assert again and path.read_text() == holder
    again.close()


@pytest.mark.parametrize("fault", ["no-flock", "no-fcntl"])
def test_without_locks_a_run_goes_on_with_a_warning(tmp_path, monkeypatch, capsys, fault):
    import fcntl

    def refused(f, how):
        raise OSError(37, "No locks available")
    if fault == "no-flock":
        monkeypatch.setattr(fcntl, "flock", refused)
    else:
        monkeypatch.setitem(sys.modules, "fcntl", None)  # Windows: the import fails
    assert common.lock_file(tmp_path / "train.lock") is None
    assert capsys.readouterr().err == ("" if fault == "no-fcntl" else
                                       f"train.py: warning: cannot lock {tmp_path / 'train.lock'} (No locks "
                                       f"available): make sure no other run uses {tmp_path}\n")


@pytest.mark.parametrize("step, kept", [(0, [0]), (1, [0, 1]), (2, [0, 1, 2]), (9, [0, 1, 2])],
                         ids=["first", "middle", "last", "past-the-end"])
def test_the_log_is_kept_up_to_the_resumed_step(tmp_path, step, kept):
    """Lines at or before `step`, blank lines left out, a half-written last line dropped."""
    path = tmp_path / "log.jsonl"
    path.write_bytes(b'{"step": 0}\n\n{"step": 1, "loss": 2.5}\n{"step": 2}\n{"step": 3, "lo\xff')
    lines = ['{"step": 0}', '{"step": 1, "loss": 2.5}', '{"step": 2}']
    assert common.logged_until(path, step) == [lines[i] for i in kept]


@pytest.mark.parametrize("bad", ['{"loss": 1}', "[1, 2]", "garbage", '{"step": 1'],
                         ids=["no-step", "a-list", "not-json", "half-a-line"])
def test_a_broken_line_before_the_last_is_refused_naming_it(tmp_path, bad):
    path = tmp_path / "log.jsonl"
    path.write_text(f'{{"step": 0}}\n{bad}\n{{"step": 1}}\n')
    with pytest.raises(common.UserError) as error:
        common.logged_until(path, 5)
    assert str(error.value) == (f"{path}, line 2, is not a line train.py wrote ({bad[:40]!r}): delete it, then "
                                f"--resume again")
    path.write_text(f'{{"step": 0}}\n{bad}')
    assert common.logged_until(path, 5) == ['{"step": 0}']  # the last line: dropped


@pytest.mark.parametrize("length", [39, 40, 41, 120], ids=["39-chars", "40-chars", "41-chars", "long"])
def test_a_broken_lines_refusal_quotes_its_first_40_characters(tmp_path, length):
    """The refusal of a broken line quotes at most its first 40 characters, whole below that."""
    bad = ("x" * 38 + "0123456789" * 10)[:length]
    path = tmp_path / "log.jsonl"
    path.write_text(f'{{"step": 0}}\n{bad}\n{{"step": 1}}\n')
    with pytest.raises(common.UserError) as error:
        common.logged_until(path, 5)
    quoted = re.search(r"wrote \('(x*[0-9]*)'\): delete it", str(error.value))
    assert quoted and quoted[1] == bad[:40] and len(quoted[1]) == min(length, 40)


@pytest.fixture
def stop_signals_restored():
    """SIGINT's and SIGTERM's handlers as they were before the test."""
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield before
    for s, handler in before.items():
        signal.signal(s, handler)


@pytest.mark.parametrize("main_file, ignored", [("/somewhere/train.py", True), ("/somewhere/sample.py", False),
                                                (None, False)],
                         ids=["the-script", "another-script", "no-script"])
def test_stop_signals_are_ignored_only_by_the_scripts_own_process(monkeypatch, stop_signals_restored, main_file,
                                                                  ignored):
    main = types.SimpleNamespace(**({} if main_file is None else {"__file__": main_file}))
    monkeypatch.setitem(sys.modules, "__main__", main)
    assert common.ignore_stop_signals("train.py") is ignored
    now = [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)]
    assert now == ([signal.SIG_IGN] * 2 if ignored else list(stop_signals_restored.values()))


def test_stop_signals_hold_the_handlers_inside_the_block_only(stop_signals_restored):
    with common.StopSignals("train.py", master=True) as stop:
        assert (stop.signum, stop.first_at, stop.master) == (0, 0.0, True)
        assert signal.getsignal(signal.SIGINT) == stop.handle == signal.getsignal(signal.SIGTERM)
    assert {s: signal.getsignal(s) for s in stop_signals_restored} == stop_signals_restored


@pytest.mark.parametrize("stopped, script, restored", [(False, "train.py", True), (True, "pytest", True),
                                                       (True, "train.py", False)],
                         ids=["not-stopped", "stopped-in-a-test", "stopped-in-train-py"])
def test_a_stopped_runs_process_keeps_ignoring_signals(monkeypatch, stop_signals_restored, stopped, script,
                                                       restored):
    monkeypatch.setitem(sys.modules, "__main__", types.SimpleNamespace(__file__=f"/x/{script}"))
    with common.StopSignals("train.py", master=False) as stop:
        if stopped:
            stop.handle(signal.SIGTERM, None)
    now = {s: signal.getsignal(s) for s in stop_signals_restored}
    assert now == (stop_signals_restored if restored else {s: signal.SIG_IGN for s in now})


@pytest.mark.parametrize("master", [True, False], ids=["master", "other-rank"])
@pytest.mark.parametrize("after, stops", [(0.5, False), (1.0, False), (1.001, True), (30.0, True)],
                         ids=["half-a-second", "one-second", "just-past", "much-later"])
def test_a_signal_asks_for_a_checkpoint_and_a_second_past_a_second_stops_at_once(capfd, monkeypatch, master,
                                                                                 after, stops):
    """The first: noted (the step ends, with a checkpoint), one line from rank 0; a second within a second of it
    (torchrun's forward of the same Ctrl-C) changes nothing; one later exits at once, 128 + its number."""
    clock = iter([100.0, 100.0 + after])
    monkeypatch.setattr(common, "time", types.SimpleNamespace(monotonic=lambda: next(clock)))
    stop = common.StopSignals("train.py", master=master)
    stop.handle(signal.SIGTERM, None)
    assert (stop.signum, stop.first_at) == (signal.SIGTERM, 100.0)
    first = "train.py: SIGTERM: stopping after this step, with a checkpoint (again to stop at once)\n"
    assert capfd.readouterr().err == (first if master else "")
    if not stops:
        stop.handle(signal.SIGINT, None)
        assert (stop.signum, stop.first_at, capfd.readouterr().err) == (signal.SIGTERM, 100.0, "")
        return
    with pytest.raises(SystemExit) as exit:
        stop.handle(signal.SIGINT, None)
    assert exit.value.code == 130
    assert capfd.readouterr().err == "train.py: SIGINT again: stopped at once, without a checkpoint of this step\n"
