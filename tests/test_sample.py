"""sample.py: the tokenizer the model was trained with, only decodable ids, flags checked; every sample is checked
against a reference computed without sample.py (the model's logits, the tokenizer)."""
import dataclasses
import json
import os
import select
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

import mhar
import prepare
import sample
from mhar import GPT
from lib.common import load_model
from helpers import ROOT, VOCAB, error_line, sigint_as_in_a_terminal

PADDING_LOGIT = 1e3  # the scale of the padding rows below: their logits dwarf every real token's


def favour_padding(model, limit):
    """Make the padding ids (limit..vocab_size-1) win every draw: their rows of the tied embedding are
    +-PADDING_LOGIT along the first coordinates, so some padding logit is PADDING_LOGIT x the largest |coordinate|
    of the final hidden state."""
    with torch.no_grad():
        for n, i in enumerate(range(limit, model.config.vocab_size)):
            model.embed.weight[i] = 0
            model.embed.weight[i, n // 2] = PADDING_LOGIT * (-1) ** n
    return model


def save_model(folder, vocab_size, limit, data):
    """A train.py-style checkpoint of an untrained tiny model whose padding ids (limit..vocab_size-1) would win
    every draw (favour_padding)."""
    torch.manual_seed(0)
    config = mhar.preset("tiny", vocab_size=vocab_size, seq_len=32)
    model = favour_padding(GPT(config), limit)
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(dict(model=model.state_dict(), config=dataclasses.asdict(config), args=dict(data=str(data)), step=0),
               folder / "ckpt.pt")
    return folder / "ckpt.pt", model.eval()


def gpt2_data(folder):
    """A prepare.py folder's meta.json for GPT-2's BPE (sample.py reads only the meta)."""
    folder.mkdir(parents=True)
    (folder / "meta.json").write_text(json.dumps({"tokenizer": "gpt2", "vocab_size": 50257, "eot": 50256}))
    return folder


@torch.no_grad()
def reference_logits(model, rows, limit):
    """The next-token logits after every prefix of rows (B, T), over the ids below limit: (B, T, limit)."""
    return model(rows)[0][..., :limit]


def run(capsys, *argv):
    sample.main([*map(str, argv)])
    return capsys.readouterr().out.strip().split("\n" + "-" * 40 + "\n")


def test_greedy_text_is_the_argmax_of_the_decodable_ids(tmp_path, capsys):
    ckpt, model = save_model(tmp_path / "run", 50304, 50257, gpt2_data(tmp_path / "data"))
    enc = prepare.get_encoding()
    prompt = enc.encode_ordinary("def main(")
    assert model(torch.tensor([prompt]))[0][0, -1].argmax() >= 50257  # unconstrained, a padding id would win
    idx = torch.tensor([prompt])
    for _ in range(8):  # the reference: plain greedy decoding, a full forward per token, padding excluded
        idx = torch.cat([idx, reference_logits(model, idx, 50257)[:, -1].argmax(-1, keepdim=True)], 1)
    texts = run(capsys, "--ckpt", ckpt, "--prompt", "def main(", "--temperature", "0", "--max_new_tokens", 8,
                "--num_samples", 2)
    assert texts == [enc.decode(idx[0].tolist())] * 2


def test_top_k_samples_only_among_the_k_likeliest_decodable_ids(tmp_path):
    _, model = save_model(tmp_path / "run", 50304, 50257, "synthetic")
    codec = sample.Codec(None, 50304)  # ids in and out, so the draws can be read back exactly
    codec.vocab_limit = 50257  # as for GPT-2's tokenizer
    draws = []
    for seed in (0, 1):
        texts = sample.sample(model, codec, "50256", num_samples=3, max_new_tokens=10, temperature=1.0, top_k=3,
                              seed=seed)
        rows = torch.tensor([list(map(int, t.split())) for t in texts])                        # (3, 11)
        top3 = reference_logits(model, rows[:, :-1], 50257).topk(3).indices                     # (3, 10, 3)
        assert (top3 == rows[:, 1:, None]).any(-1).all()  # every draw is one of its step's three likeliest
        draws.append(rows)
    assert not torch.equal(draws[0], draws[1])  # the seed matters


def test_the_seed_fixes_the_draws(probe_runs, capsys):
    """A token-id model: the printed ids are the model's own draws, one sample after the other, after
    torch.manual_seed(seed)."""
    model, _ = load_model(probe_runs["mhar"] / "ckpt.pt")
    for seed in (0, 1):
        torch.manual_seed(seed)
        expected = [model.generate(torch.tensor([[1, 2, 3]]), 12, temperature=0.8, top_k=10, vocab_limit=VOCAB,
                                   cache=True)[0] for _ in range(2)]
        samples = run(capsys, "--ckpt", probe_runs["mhar"] / "ckpt.pt", "--prompt", "1 2 3", "--max_new_tokens", 12,
                      "--num_samples", 2, "--seed", seed, "--top_k", 10)
        assert samples == [" ".join(map(str, row.tolist())) for row in expected]
    # trained without a tokenizer: the prompt is token ids
    err = error_line(capsys, sample.main, ["--ckpt", probe_runs["mhar"] / "ckpt.pt", "--prompt", "hello"])
    assert "token ids" in err


def test_a_model_trained_with_its_own_tokenizer_samples_with_it(tmp_path, capsys):
    """prepare.py --tokenizer DIR records DIR in meta.json; sample.py decodes with it, and never samples the model's
    padding ids (61..63 of 64) that the tokenizer cannot decode."""
    tokenizers = pytest.importorskip("tokenizers", reason="prepare.py --tokenizer needs it: pip install tokenizers")
    words = {f"w{i}": i for i in range(60)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(words, unk_token="w0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([tokenizers.AddedToken("<eos>", special=True)])  # id 60
    model_dir = tmp_path / "wordlevel"
    model_dir.mkdir()
    tok.save(str(model_dir / "tokenizer.json"))
    (model_dir / "config.json").write_text(json.dumps({"eos_token_id": 60}))
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"w{i} w{(i * 7) % 60} w5"}) + "\n" for i in range(20)))
    data = prepare.prepare([corpus], out=tmp_path, tokenizer=model_dir, val_fraction=0.5, quiet=True)
    ckpt, model = save_model(tmp_path / "run", VOCAB, 61, data)
    idx = torch.tensor([[3, 1, 4]])
    for _ in range(6):
        idx = torch.cat([idx, reference_logits(model, idx, 61)[:, -1].argmax(-1, keepdim=True)], 1)
    assert model(idx)[0][0, -1].argmax() >= 61  # unconstrained, a padding id would win
    argv = ["--ckpt", ckpt, "--prompt", "w3 w1 w4", "--temperature", "0", "--max_new_tokens", 6, "--num_samples", 1]
    assert run(capsys, *argv) == [tok.decode(idx[0].tolist(), skip_special_tokens=False)]
    # the model folder moved: the recorded path is gone; --tokenizer names the new place
    model_dir.rename(tmp_path / "moved")
    assert "pass the model folder with --tokenizer DIR" in error_line(capsys, sample.main, argv)
    assert run(capsys, *argv, "--tokenizer", tmp_path / "moved") == [tok.decode(idx[0].tolist(),
                                                                               skip_special_tokens=False)]


def test_the_prompt_may_hold_end_of_text(tmp_path):
    ckpt, _ = save_model(tmp_path / "run", 50304, 50257, gpt2_data(tmp_path / "data"))
    model, ckpt_dict = load_model(ckpt)
    codec = sample.codec_for(model, ckpt_dict)
    assert codec.encode("a<|endoftext|>b") == [64, 50256, 65] and codec.encode("") == [50256]
    assert codec.vocab_limit == 50257


@pytest.mark.parametrize("flags,message", [
    (["--top_k", "-5"], "--top_k must be at least 0, got -5"),
    (["--num_samples", "0"], "--num_samples must be at least 1, got 0"),
    (["--max_new_tokens", "-1"], "--max_new_tokens must be at least 1, got -1"),
    (["--temperature", "-1"], "--temperature must be a finite number >= 0 (0 = greedy), got -1.0"),
    (["--temperature", "nan"], "--temperature must be a finite number >= 0 (0 = greedy), got nan"),
    (["--device", "gpu"], "unknown device 'gpu': use auto, cpu, cuda, cuda:N or mps"),
    (["--device", "cuda"], "--device cuda: this machine has no CUDA GPU that torch can use"),
], ids=["top_k_negative", "no_samples", "no_tokens", "temperature_negative", "temperature_nan", "device_gpu",
        "device_cuda_without_gpu"])
def test_bad_flags_are_one_line_and_exit_2(flags, message, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the same answer on a GPU machine
    err = error_line(capsys, sample.main, ["--ckpt", tmp_path / "never_read.pt", *flags])
    assert err.startswith(f"sample.py: error: {message}"), err


def test_tokens_are_printed_as_they_are_drawn(probe_runs, capsys, monkeypatch):
    """Each new token's text is on stdout before the model runs for the next one, and what was printed piece by
    piece is the samples' text."""
    events, hidden = [], GPT.hidden

    def counted(self, *args, **kwargs):
        events.append("forward")
        return hidden(self, *args, **kwargs)
    monkeypatch.setattr(GPT, "hidden", counted)
    monkeypatch.setattr(sys.stdout, "write", lambda text: events.append(text))
    samples = sample.main(["--ckpt", str(probe_runs["mhar"] / "ckpt.pt"), "--prompt", "1 2 3", "--max_new_tokens",
                           "5", "--num_samples", "2"])
    monkeypatch.undo()
    printed = [e for e in events if e != "forward"]
    assert "".join(printed) == samples[0] + "\n" + "-" * 40 + "\n" + samples[1] + "\n"
    after = [i for i, e in enumerate(events) if e == "forward"]
    assert len(after) == 10  # one forward per token
    # between two forwards of a sample, the token the first one drew is printed
    assert all(any(e != "forward" for e in events[a + 1:b]) for a, b in zip(after, after[1:]))


@pytest.mark.parametrize("flags, drawn", [
    ([], "3 samples of 2 tokens from {ckpt} (mhar, step {step}) on cpu, temperature 0.8, top-k 200, seed 0"),
    (["--num_samples", "1", "--temperature", "0", "--seed", "7"],
     "1 sample of 2 tokens from {ckpt} (mhar, step {step}) on cpu, greedy, seed 7"),
    (["--temperature", "1.5", "--top_k", "0"],
     "3 samples of 2 tokens from {ckpt} (mhar, step {step}) on cpu, temperature 1.5, top-k all, seed 0"),
], ids=["defaults", "one-greedy", "all-tokens"])
def test_what_is_drawn_is_said_on_stderr_before_the_first_token(probe_runs, monkeypatch, flags, drawn):
    """One line on stderr (stdout holds the samples alone), before the model's first forward."""
    ckpt = probe_runs["mhar"] / "ckpt.pt"
    events, hidden = [], GPT.hidden
    monkeypatch.setattr(GPT, "hidden", lambda self, *args, **kwargs: events.append("forward")
                        or hidden(self, *args, **kwargs))
    monkeypatch.setattr(sys.stderr, "write", lambda text: events.append(("stderr", text)))
    monkeypatch.setattr(sys.stdout, "write", lambda text: None)
    sample.main(["--ckpt", str(ckpt), "--prompt", "1 2 3", "--max_new_tokens", "2", "--device", "cpu", *flags])
    monkeypatch.undo()
    said = "".join(text for event, text in (e for e in events if e != "forward"))
    step = load_model(ckpt)[1]["step"]
    assert said == f"sample.py: {drawn.format(ckpt=ckpt, step=step)}\n"
    assert events[0][0] == "stderr" and "forward" in events


def test_ctrl_c_while_sampling_is_one_line_and_status_130(probe_runs):
    """A real SIGINT once the first tokens are out (streamed): one line on stderr, status 130."""
    p = subprocess.Popen([sys.executable, "sample.py", "--ckpt", str(probe_runs["mhar"] / "ckpt.pt"), "--prompt",
                          "1 2 3", "--max_new_tokens", "1000000"], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                         preexec_fn=sigint_as_in_a_terminal)
    if not select.select([p.stdout], [], [], 120)[0]:  # the prompt and the first tokens: sampling has begun
        p.kill()
        pytest.fail("sample.py printed nothing for 2 minutes")
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    drawn = f"sample.py: 3 samples of 1000000 tokens from {probe_runs['mhar'] / 'ckpt.pt'} (mhar, step"
    said, stopped = err.splitlines()
    assert p.returncode == 130 and said.startswith(drawn) and stopped == "sample.py: error: interrupted (Ctrl-C)"


def test_a_model_trained_on_token_files_samples_only_the_datas_ids(tmp_path, capsys):
    """Token files without a tokenizer hold 50 ids (meta.json's vocab_size); train.py pads the model's vocabulary
    to 64. With the padding ids made the likeliest, every sampled id is still below 50."""
    import train
    data = tmp_path / "data"
    data.mkdir()
    rng = np.random.default_rng(0)
    for split, n in (("train", 4000), ("val", 400)):
        rng.integers(0, 50, n).astype(np.uint16).tofile(data / f"{split}.bin")
    (data / "meta.json").write_text(json.dumps({"tokenizer": "none", "vocab_size": 50}))
    train.main(["--preset", "tiny", "--data", str(data), "--out_dir", str(tmp_path / "run"), "--seq_len", "16",
                "--batch_size", "2", "--grad_accum", "1", "--max_steps", "2", "--eval_interval", "2",
                "--eval_batches", "1"])
    ckpt = torch.load(tmp_path / "run" / "ckpt.pt", weights_only=True)
    model, _ = load_model(tmp_path / "run" / "ckpt.pt")
    assert model.config.vocab_size == 64
    ckpt["model"] = favour_padding(model, 50).state_dict()
    torch.save(ckpt, tmp_path / "run" / "ckpt.pt")
    assert model(torch.tensor([[3, 1, 4]]))[0][0, -1].argmax() >= 50  # unconstrained, a padding id would win
    capsys.readouterr()
    texts = run(capsys, "--ckpt", tmp_path / "run" / "ckpt.pt", "--prompt", "3 1 4", "--max_new_tokens", 20,
                "--num_samples", 2, "--temperature", 1, "--top_k", 0)
    ids = [int(i) for text in texts for i in text.split()]
    assert len(ids) == 2 * 23 and max(ids) < 50, texts


def sample_command(probe_runs, tokens):
    return [sys.executable, "sample.py", "--ckpt", str(probe_runs["mhar"] / "ckpt.pt"), "--prompt", "1 2 3",
            "--max_new_tokens", str(tokens)]


def test_a_reader_that_stops_early_ends_the_samples_quietly(probe_runs):
    """sample.py | head -1: the reader closes the pipe after its line; sample.py ends at its next write, status
    0, nothing on stderr but what it draws (before: a BrokenPipeError traceback)."""
    p = subprocess.Popen(sample_command(probe_runs, 100000), cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if not select.select([p.stdout], [], [], 120)[0]:
        p.kill()
        pytest.fail("sample.py printed nothing for 2 minutes")
    p.stdout.read1(1)
    p.stdout.close()                                       # as head does once it has its line
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 0 and err.count("\n") == 1 and err.startswith("sample.py: 3 samples"), err


def test_samples_onto_a_full_disk_are_one_line_and_status_1(probe_runs):
    with open("/dev/full", "w") as full:
        p = subprocess.run(sample_command(probe_runs, 4), cwd=ROOT, stdout=full, stderr=subprocess.PIPE,
                           text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    said, error = p.stderr.splitlines()
    assert p.returncode == 1 and said.startswith("sample.py: 3 samples"), p.stderr
    assert error == "sample.py: error: cannot write the samples to standard output (No space left on device)"
