"""sample.py: sampling from checkpoints, deterministic per seed."""
import dataclasses

import pytest
import torch

import mhar
import sample
from common import load_model
from helpers import VOCAB
from mhar import GPT


def test_sample_is_deterministic_for_a_seed(probe_runs, capsys):
    def run(seed):
        sample.main(["--ckpt", str(probe_runs["mhar"] / "ckpt.pt"), "--prompt", "1 2 3", "--max_new_tokens", "12",
                     "--num_samples", "2", "--seed", str(seed), "--top_k", "10"])
        return capsys.readouterr().out

    first = run(0)
    samples = first.strip().split("\n" + "-" * 40 + "\n")
    assert len(samples) == 2 and all(len(s.split()) == 3 + 12 and s.startswith("1 2 3 ") for s in samples)
    assert all(0 <= int(t) < VOCAB for s in samples for t in s.split())
    assert run(0) == first and run(1) != first
    with pytest.raises(SystemExit):  # a vocabulary that is not GPT-2's takes token ids
        sample.main(["--ckpt", str(probe_runs["mhar"] / "ckpt.pt"), "--prompt", "hello"])
    assert "token ids" in capsys.readouterr().err


def test_sample_decodes_gpt2_text(tmp_path):
    torch.manual_seed(0)
    config = mhar.preset("tiny", seq_len=32)  # GPT-2's padded vocabulary, untrained
    torch.save(dict(model=GPT(config).state_dict(), config=dataclasses.asdict(config), args={}, step=0),
               tmp_path / "ckpt.pt")
    model, _ = load_model(tmp_path / "ckpt.pt")
    codec = sample.Codec(model.config.vocab_size)
    texts = sample.sample(model, codec, "def main(", num_samples=2, max_new_tokens=8, seed=3)
    assert texts == sample.sample(model, codec, "def main(", num_samples=2, max_new_tokens=8, seed=3)
    assert all(t.startswith("def main(") for t in texts) and texts[0] != texts[1]
    assert codec.decode([50256, 50300]) == "<|endoftext|><|50300|>"  # padding ids print as ids
    new_document = sample.sample(model, codec, "", max_new_tokens=4, seed=3)[0]
    assert not new_document.startswith("<|endoftext|>")


