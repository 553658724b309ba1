"""common.py's pieces that every script leans on, where a bug would go unnoticed elsewhere: token
files longer than meta.json says, the peak resident set's unit, a write interrupted half-way, a
staged write into folders it made, which weights a checkpoint gives."""
import json
import os
import re
import resource
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

import common
import mhar
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
    script.write_text("import signal, common\n"
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
