"""Helpers every test file shares: one relative error, one builder of route inputs, the tiny models, an
lm-eval task over local files."""
import json
import os
from pathlib import Path

import pytest
import torch

from mhar import preset

ROOT = Path(__file__).resolve().parent.parent  # the repository
VOCAB = 64  # the vocabulary of the training tests' corpus (the `data` fixture)
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# fused kernels on CPU tensors: in the Triton interpreter, which conftest.py switches on without a GPU
interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason=(
    "runs the fused kernels on CPU tensors, in the Triton interpreter: on a GPU machine the compiled "
    "kernels are tested in test_gpu.py"))


def rel_err(a, b):
    """Norm-wise ||a - b|| / ||b|| in float64; exact zeros on both sides count as a match."""
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def error_line(capsys, main, argv, status=2):
    """Run a script's main(argv) on bad input: it exits with `status` and writes one line,
    "<script>.py: error: ...", and no traceback. Returns that line."""
    with pytest.raises(SystemExit) as exit:
        main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert exit.value.code == status, err
    script = main.__module__
    assert err.startswith(f"{script}.py: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err, err
    return err.strip()


def tiny(residual="mhar", **overrides):
    """The tiny preset with a small vocabulary, so a test model has few parameters."""
    return preset("tiny", residual=residual, vocab_size=128, seq_len=32, **overrides)


def route_inputs(N, B, T, d, dtype=torch.float64, seed=0, device="cpu"):
    """Sources V (N, B, T, d) of unequal scales, a nonzero query q and norm weight g (d,) in float32 or
    float64, and an output gradient dout (B, T, d). A zero query would route uniformly and hide the logits."""
    gen = torch.Generator().manual_seed(seed)
    V = torch.randn(N, B, T, d, generator=gen, dtype=torch.float64) * (1 + torch.rand(N, 1, 1, 1, generator=gen,
                                                                                      dtype=torch.float64))
    q = 0.5 * torch.randn(d, generator=gen, dtype=torch.float64)
    g = 1 + 0.3 * torch.randn(d, generator=gen, dtype=torch.float64)
    dout = torch.randn(B, T, d, generator=gen, dtype=torch.float64)
    param_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    return (V.to(device, dtype), q.to(device, param_dtype), g.to(device, param_dtype), dout.to(device, dtype))


def route_and_grads(route, V, q, g, dout, heads):
    """Output and (dV, dq, dg) of one route call (mhar.route, kernel.fused_route)."""
    V, q, g = (x.clone().requires_grad_() for x in (V, q, g))
    out = route(V, q, g, heads)
    out.backward(dout.to(out.dtype))
    return out, V.grad, q.grad, g.grad


def gpt_pair(device="cpu", **overrides):
    """A fused tiny model and its readable twin with the same weights: (fused, readable). Queries
    are nonzero and delta's gates open, so that the logit path and the route are both in play."""
    import mhar
    torch.manual_seed(0)
    readable = mhar.GPT(tiny(**overrides)).to(device)
    with torch.no_grad():
        for site in readable.sites:
            site.query.normal_(0, 0.3)                        # zero queries would hide the logit path
            if site.gate is not None:
                site.gate.fill_(0.5)                          # a closed gate would hide the route
    fused = mhar.GPT(tiny(fused=True, **overrides)).to(device)
    fused.load_state_dict(readable.state_dict())
    return fused, readable


def save_tiny_qwen3(directory, tied=True, head_dim=16, n_kv_head=2, rope_theta=1e6,
                    max_shard_size=None, seed=0):
    """A tiny random Qwen3ForCausalLM that transformers saves into `directory` (offline): d 64, 2
    layers, 4 heads of width head_dim (16 = d / n_head), vocabulary 100. Every tensor is perturbed,
    norms included, so that a tensor read into the wrong place changes the logits. Returns the
    transformers model (eval mode)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=n_kv_head, head_dim=head_dim,
                         max_position_embeddings=64, tie_word_embeddings=tied,
                         rope_parameters={"rope_theta": rope_theta, "rope_type": "default"})
    model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(torch.randn_like(p) * (0.3 if "norm" in name else 0.02))
    shards = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, **shards)
    return model


def write_task(folder, name, rows, **config):
    """An lm-eval task that needs no network: a YAML file over a JSON-lines file of rows."""
    import yaml  # a dependency of datasets, which lm-eval needs
    data = folder / f"{name}.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = dict(task=name, dataset_path="json", test_split="test",
                  dataset_kwargs={"data_files": {"test": str(data)}}, **config)
    (folder / f"{name}.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
