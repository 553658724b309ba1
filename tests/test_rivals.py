"""lib/rivals.py: MUDDFormer and Depth-Attention against float64 loops of their papers' equations
(logits and every gradient), what holds at init, the KV cache and generation, parameter and FLOP
counts by hand, the configuration's refusals.

As in test_mhar.py: each test compares the code with something independent of it (a float64 loop
over the model's own weights, a baseline model, a count by hand), and was seen failing on a bug
planted by hand in lib/rivals.py before it was kept.
"""
import dataclasses
import json
import math

import pytest
import torch

import mhar
from lib import rivals
from helpers import rel_err

WIDE = dict(n_head=6, n_kv_head=2, head_dim=8, tie_embeddings=False, rope_theta=1e6)  # 6 x 8 != 64
SHAPES = {"4x16-gqa2": {}, "6x8-untied": WIDE, "4x16-mha": dict(n_kv_head=4),
          "4x16-gqa2-T0.3": dict(route_temperature=0.3)}  # depth logits / (sqrt(hd) 0.3)


def tiny(residual, **overrides):
    """The tiny preset's shape (small vocabulary, three blocks) in rivals.Config or mhar.Config."""
    fields = dict(vocab_size=128, seq_len=32, n_layer=3, n_embd=64, n_head=4, n_kv_head=2,
                  ffn_hidden=192, residual=residual)
    return rivals.config_of({**fields, **overrides})


def perturbed(model, seed, scale=0.2):
    """Every weight moved off its init (MUDD's W2 off zero, its biases off one-hot), in float64."""
    torch.manual_seed(seed)
    model.double()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn_like(p))
    return model


# ----------------------------------------------------------------------------------------------
# Float64 loops of the papers' equations over the model's own weights.

def rms(x, weight, eps):
    x = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return x if weight is None else x * weight


def rotate(v, model):
    """v (B, T, hd) with pairs (i, i + hd/2) turned by the model's angle tables, as complex numbers."""
    T, half = v.size(1), v.size(-1) // 2
    turn = torch.complex(model.rope_cos[:T].double(), model.rope_sin[:T].double())   # (T, hd/2)
    z = torch.complex(v[..., :half], v[..., half:]) * turn
    return torch.cat((z.real, z.imag), -1)


def projections(attn, xq, xk, xv, eps):
    """Per head, unrotated: queries [nh x (B, T, hd)], keys and values [nkv x (B, T, hd)]."""
    hd = attn.head_dim
    rows = lambda name, h: getattr(attn, name).weight[h * hd:(h + 1) * hd]          # noqa: E731
    q = [rms(xq @ rows("q_proj", h).T, attn.q_norm.weight, eps) for h in range(attn.n_head)]
    k = [rms(xk @ rows("k_proj", g).T, attn.k_norm.weight, eps) for g in range(attn.n_kv_head)]
    v = [xv @ rows("v_proj", g).T for g in range(attn.n_kv_head)]
    return q, k, v


def sequence_attention(attn, model, q, k, v):
    """Causal softmax(q.k / sqrt(hd)) over positions, rotated q and k; query head h reads KV head
    h // (nh / nkv); the heads concatenated through o_proj."""
    T, group = q[0].size(1), attn.n_head // attn.n_kv_head
    later = torch.ones(T, T, dtype=torch.bool).triu(1)
    heads = []
    for h, query in enumerate(q):
        scores = rotate(query, model) @ rotate(k[h // group], model).transpose(1, 2)
        scores = (scores / math.sqrt(attn.head_dim)).masked_fill(later, float("-inf"))
        heads.append(scores.softmax(-1) @ v[h // group])
    return torch.cat(heads, -1) @ attn.o_proj.weight.T


def mlp_loop(mlp, x, eps):
    h = rms(x, mlp.norm.weight, eps)
    gate = h @ mlp.gate_proj.weight.T
    return (gate * torch.sigmoid(gate) * (h @ mlp.up_proj.weight.T)) @ mlp.down_proj.weight.T


def head(model, x):
    return rms(x, model.norm.weight, model.config.norm_eps) @ model.lm_head.weight.T


def mudd_loop(model, idx):
    """MUDDFormer (arXiv:2502.12170): after block i, A = GELU(RMSNorm(X_i) W1) W2 + a over
    X_0..X_i in 4 ways (query, key, value, residual; 1 way after the last block); block i+1:
    H = X^R + Attn(Norm_Q X^Q, Norm_K X^K, Norm_V X^V), X_{i+1} = H + MLP(H)."""
    c, eps = model.config, model.config.norm_eps
    X = [model.embed.weight[idx]]
    q_in = k_in = v_in = r = X[0]
    for b in range(c.n_layer):
        attn, mlp, connection = model.layers[2 * b], model.layers[2 * b + 1], model.connections[b]
        xq = rms(q_in, attn.norm.weight, eps)
        if b == 0:                                  # the three inputs are X_0: one pre-norm
            xk = xv = xq
        else:
            xk, xv = rms(k_in, attn.key_norm.weight, eps), rms(v_in, attn.value_norm.weight, eps)
        h = r + sequence_attention(attn, model, *projections(attn, xq, xk, xv, eps))
        X.append(h + mlp_loop(mlp, h, eps))
        z = rms(X[-1], None, eps) @ connection.w1.weight.T
        gelu = 0.5 * z * (1 + torch.erf(z / math.sqrt(2)))
        ways = 1 if b == c.n_layer - 1 else 4
        A = (gelu @ connection.w2.weight.T).view(*idx.shape, ways, b + 2) + connection.bias
        mixed = [sum(A[..., w, j, None] * X[j] for j in range(b + 2)) for w in range(ways)]
        if ways == 4:
            q_in, k_in, v_in, r = mixed
        else:
            r = mixed[0]
    return head(model, r)


def depth_loop(model, idx):
    """Depth-Attention (arXiv:2606.05014): in layer l, KV head g's value becomes the softmax over
    depth n in [anchors before l, l] of <mean of its group's queries, k_n,g> / (sqrt(hd) tau) mixing v_n,g,
    anchors every (n_layer // 2)-th layer from 0 keeping their mixed values. The scores use rotated
    q and k, as the authors' code (unrotated would differ by the float32 tables' cos^2 + sin^2 - 1)."""
    c, eps = model.config, model.config.norm_eps
    stride, anchors = max(1, c.n_layer // 2), []
    group = c.n_head // c.n_kv_head
    x = model.embed.weight[idx]
    for layer in range(c.n_layer):
        attn, mlp = model.layers[2 * layer], model.layers[2 * layer + 1]
        h = rms(x, attn.norm.weight, eps)
        q, k, v = projections(attn, h, h, h, eps)
        if anchors:
            for g in range(c.n_kv_head):
                mean_query = rotate(sum(q[g * group:(g + 1) * group]) / group, model)
                keys = [rotate(key[g], model) for key, _ in anchors] + [rotate(k[g], model)]
                values = [value[g] for _, value in anchors] + [v[g]]
                scale = math.sqrt(c.head_width) * c.route_temperature
                scores = torch.stack([(mean_query * key).sum(-1) / scale
                                      for key in keys])
                alpha = scores.softmax(0)
                v[g] = sum(alpha[n, ..., None] * values[n] for n in range(len(values)))
        if layer % stride == 0:
            anchors.append((k, list(v)))
        x = x + sequence_attention(attn, model, q, k, v)
        x = x + mlp_loop(mlp, x, eps)
    return head(model, x)


LOOPS = {"muddformer": mudd_loop, "depth-attention": depth_loop}
CASES = [("muddformer", 3, "4x16-gqa2"), ("muddformer", 3, "6x8-untied"), ("muddformer", 2, "4x16-mha"),
         ("depth-attention", 3, "4x16-gqa2"), ("depth-attention", 4, "6x8-untied"),
         ("depth-attention", 4, "4x16-mha"), ("depth-attention", 2, "4x16-gqa2"),
         ("depth-attention", 3, "4x16-gqa2-T0.3")]


@pytest.mark.parametrize("seed", [0, 1, 2], ids=lambda s: f"seed{s}")
@pytest.mark.parametrize("residual, n_layer, shape", CASES,
                         ids=[f"{r}-L{n}-{s}" for r, n, s in CASES])
def test_model_and_every_gradient_match_the_float64_loop(residual, n_layer, shape, seed):
    """L3 reads 3 anchors by the last layer (the mixing recursive), L4 anchors 0 and 2 only."""
    model = perturbed(rivals.GPT(tiny(residual, n_layer=n_layer, **SHAPES[shape])), seed)
    idx = torch.randint(0, 128, (2, 7))
    logits = model.lm_head(model.hidden(idx))           # forward's logits before its .float()
    assert torch.equal(model(idx)[0], logits.float())
    expected = LOOPS[residual](model, idx)
    assert rel_err(logits, expected) < 1e-9
    direction = torch.randn_like(logits)
    names, params = zip(*model.named_parameters())
    grads = torch.autograd.grad((logits * direction).sum(), params)
    wanted = torch.autograd.grad((expected * direction).sum(), params)
    for name, got, want in zip(names, grads, wanted):
        assert want.abs().max() > 0, name                # every weight reaches the loss
        assert rel_err(got, want) < 1e-9, name


# ----------------------------------------------------------------------------------------------
# At initialisation.

@pytest.mark.parametrize("n_layer", [1, 3], ids=lambda n: f"L{n}")
def test_muddformer_starts_as_the_baseline_exactly(n_layer):
    """W2 = 0 and a_i one-hot on X_i in every way: each block reads X_i for q, k, v and residual,
    the output is X_L: the baseline's logits bit for bit, whatever the shared matrices (the norms
    at their init of ones, as the key and value ways' own pre-norms)."""
    torch.manual_seed(0)
    baseline = mhar.GPT(tiny("baseline", n_layer=n_layer))
    with torch.no_grad():
        for p in baseline.parameters():
            p.add_(0.1 * torch.randn_like(p) * (p.dim() == 2))
    mudd = rivals.GPT(tiny("muddformer", n_layer=n_layer))
    missing, unexpected = mudd.load_state_dict(baseline.state_dict(), strict=False)
    assert not unexpected and all(".key_norm." in k or ".value_norm." in k or k.startswith("connections.")
                                  for k in missing)
    idx = torch.randint(0, 128, (2, 9))
    assert torch.equal(mudd(idx)[0], baseline(idx)[0])
    d = mudd.config.n_embd
    w1 = torch.cat([c.w1.weight.flatten() for c in mudd.connections])
    assert 0.85 < w1.std().item() * d ** 0.5 < 1.15                # W1 ~ N(0, 1/d)


def test_depth_attention_adds_no_parameters_and_keeps_the_baseline_cache():
    """No new weight (a baseline checkpoint loads strictly); the cache holds one (B, nkv, T, hd)
    key and value per layer, as the baseline's."""
    torch.manual_seed(0)
    depth, baseline = rivals.GPT(tiny("depth-attention")), mhar.GPT(tiny("baseline"))
    depth.load_state_dict(baseline.state_dict())
    assert depth.num_params() == baseline.num_params()
    assert depth.num_params(non_embedding=True) == baseline.num_params(non_embedding=True)
    idx = torch.randint(0, 128, (2, 9))
    caches = {}
    for name, model in (("depth", depth), ("baseline", baseline)):
        caches[name] = [mhar.KVCache() for _ in model.layers]
        model.hidden(idx, cache=caches[name])
    shapes = [(c.keys.shape, c.values.shape) for c in caches["depth"] if c.keys is not None]
    assert shapes == [(c.keys.shape, c.values.shape) for c in caches["baseline"] if c.keys is not None]
    assert shapes == [((2, 2, 9, 16),) * 2] * 3


# ----------------------------------------------------------------------------------------------
# The KV cache and generation.

@pytest.mark.parametrize("residual, shape", [(r, s) for r in rivals.RESIDUALS for s in ("4x16-gqa2", "6x8-untied")],
                         ids=lambda v: v)
def test_cache_gives_the_full_forward_logits(residual, shape):
    """A prefix of 4, then 5 tokens one at a time through the cache: the full forward's logits.
    Depth-Attention's cache holds the mixed values; MUDD's the keys and values of its ways."""
    model = perturbed(rivals.GPT(tiny(residual, n_layer=4, **SHAPES[shape])), seed=0)
    idx = torch.randint(0, 128, (2, 9))
    full = model.lm_head(model.hidden(idx))
    cache = [mhar.KVCache() for _ in model.layers]
    steps = [model.lm_head(model.hidden(idx[:, :4], cache=cache))]
    steps += [model.lm_head(model.hidden(idx[:, t:t + 1], cache=cache)) for t in range(4, 9)]
    assert rel_err(torch.cat(steps, 1), full) < 1e-9


@pytest.mark.parametrize("residual", rivals.RESIDUALS)
def test_generate_with_and_without_the_cache(residual):
    model = perturbed(rivals.GPT(tiny(residual, seq_len=16)), seed=1)
    prompt = torch.randint(0, 128, (2, 5))
    cached = model.generate(prompt, 14, temperature=0)                  # past the window of 16 too
    assert torch.equal(cached, model.generate(prompt, 14, temperature=0, cache=False))
    assert not torch.equal(cached[:, 5:], cached[:, 5:6].expand(-1, 14))   # not one token repeated


@pytest.mark.parametrize("residual", rivals.RESIDUALS)
def test_causality(residual):
    model = perturbed(rivals.GPT(tiny(residual)), seed=0)
    idx = torch.randint(0, 128, (2, 12))
    changed = idx.clone()
    changed[:, 7] = (idx[:, 7] + 1) % 128
    a, b = model(idx)[0], model(changed)[0]
    assert torch.equal(a[:, :7], b[:, :7]) and (a[:, 7:] - b[:, 7:]).abs().max() > 1e-4


@pytest.mark.parametrize("residual", rivals.RESIDUALS)
def test_checkpointing_computes_the_same(residual):
    model = perturbed(rivals.GPT(tiny(residual)), seed=0)
    again = rivals.GPT(tiny(residual, checkpointing=True)).double()
    again.load_state_dict(model.state_dict())
    idx = torch.randint(0, 128, (2, 7))
    grads = [torch.autograd.grad(m(idx, idx)[1], list(m.parameters())) for m in (model, again)]
    for got, want in zip(*grads):
        assert rel_err(got, want) < 1e-12


# ----------------------------------------------------------------------------------------------
# Counts by hand.

def mudd_extra_params(d, L):
    """Per block i (1..L), over its N = i + 1 states: W1 (d x K), W2 (K x C N), a (C N), K = C N,
    C = 4; the last C = 1, K = 4 N. Blocks 2..L: pre-norms of the key and value ways (2d)."""
    total = 2 * d * (L - 1)
    for i in range(1, L + 1):
        N, C = i + 1, 1 if i == L else 4
        K = C * N * (4 if i == L else 1)
        total += d * K + K * C * N + C * N
    return total


@pytest.mark.parametrize("name", ["tiny-L3", "100m"])
def test_parameter_counts(name):
    """100m: the preset's fields (route_heads=8 included, unused as by mhar's baseline)."""
    if name == "100m":
        fields = dataclasses.asdict(mhar.preset("100m"))
        configs = {r: rivals.config_of({**fields, "residual": r}) for r in ("baseline", *rivals.RESIDUALS)}
    else:
        configs = {r: tiny(r) for r in ("baseline", *rivals.RESIDUALS)}
    with torch.device("meta"):
        counts = {r: rivals.model(c).num_params() for r, c in configs.items()}
    c = configs["baseline"]
    assert counts["depth-attention"] == counts["baseline"]
    assert counts["muddformer"] - counts["baseline"] == mudd_extra_params(c.n_embd, c.n_layer)


@pytest.mark.parametrize("n_layer, sources", [(2, 2), (3, 5), (4, 7), (5, 10)],
                         ids=lambda v: str(v))
def test_flops_per_token(n_layer, sources):
    """Depth-Attention: 12 nkv hd per source read (anchors before the layer and itself), layers
    1..L-1 (L4: anchors 0, 2: 2 + 2 + 3 = 7; L5: anchors 0, 2, 4: 2 + 2 + 3 + 3). MUDD: its weight
    MLPs 6 FLOPs a weight, 6 d per way and state mixed."""
    base = mhar.GPT(tiny("baseline", n_layer=n_layer)).flops_per_token()
    depth = rivals.GPT(tiny("depth-attention", n_layer=n_layer)).flops_per_token()
    assert depth - base == 12 * 2 * 16 * sources
    mudd = rivals.GPT(tiny("muddformer", n_layer=n_layer))
    d, L = 64, n_layer
    weights = mudd_extra_params(d, L) - 2 * d * (L - 1) - sum(4 * (i + 1) for i in range(1, L)) - (L + 1)
    mixed = sum(4 * (i + 1) for i in range(1, L)) + (L + 1)
    assert mudd.flops_per_token() - base == 6 * weights + 6 * d * mixed


# ----------------------------------------------------------------------------------------------
# The configuration.

@pytest.mark.parametrize("residual, overrides, field, fix", [
    ("muddformer", dict(fused=True), "fused", "drop --fused"),
    ("depth-attention", dict(fused=True), "fused", "drop --fused"),
    ("muddformer", dict(route_temperature=2.0), "route_temperature", "drop --route_temperature"),
    ("depth-attention", dict(route_temperature=0.0), "route_temperature", "positive"),
    ("depth-attention", dict(route_temperature=float("inf")), "route_temperature", "positive"),
    ("depth-attention", dict(route_block=2), "route_block", "drop --route_block"),
    ("muddformer", dict(delta=True), "delta", "drop --delta"),
    ("depth-attention", dict(n_layer=1), "n_layer", "use n_layer >= 2"),
    ("muddformer", dict(n_kv_head=3), "n_kv_head", "use a divisor"),           # mhar's own check
    ("depth-attention", dict(n_head=64), "head_dim", "rotary"),
    ("muddformer", dict(norm_eps=0.0), "norm_eps", "positive"),
], ids=lambda v: v if isinstance(v, str) and " " not in v else "")
def test_impossible_config_raises_one_line_naming_field_and_fix(residual, overrides, field, fix):
    with pytest.raises(ValueError) as error:
        tiny(residual, **overrides)
    message = str(error.value)
    assert message.startswith(f"Config.{field}:") and fix in message and "\n" not in message


def test_config_of_and_model_pick_the_class():
    assert type(tiny("mhar")) is mhar.Config and type(tiny("muddformer")) is rivals.Config
    assert type(rivals.model(tiny("baseline"))) is mhar.GPT
    assert type(rivals.model(tiny("depth-attention"))) is rivals.GPT
    with pytest.raises(ValueError, match=r"^Config\.residual: 'mhar' is not a rival"):
        rivals.Config(residual="mhar")
    assert tiny("muddformer", route_heads=8, hc_streams=2).route_heads == 8   # unused, as in mhar
    with pytest.raises(ValueError, match=r"^visit: muddformer has no routing sites"):
        rivals.GPT(tiny("muddformer")).hidden(torch.zeros(1, 2, dtype=torch.long), visit=print)


# %% In the scripts: train.py, its resume, sample.py, probe.py, export.py and compare.py take them by name

@pytest.fixture(scope="module")
def rival_runs(data, tmp_path_factory):
    """{(residual, "whole"): run folder} of a tiny train.py run of each rival and of the baseline, 6 steps;
    {(residual, "stopped"): ...} of each rival's same run stopped at step 3 and resumed."""
    import train
    runs = {}
    for residual in ("baseline", *rivals.RESIDUALS):
        for name, extra in (("whole", []), ("stopped", ["--stop_step", "3"]))[:1 if residual == "baseline" else 2]:
            out = tmp_path_factory.mktemp(f"{residual}-{name}")
            train.main(["--preset", "tiny", "--data", str(data), "--out_dir", str(out), "--residual", residual,
                        "--seq_len", "32", "--batch_size", "4", "--max_steps", "6", "--eval_interval", "3",
                        "--eval_batches", "2", "--log_interval", "1", *extra])
            runs[residual, name] = out
        if residual != "baseline":
            train.main(["--out_dir", str(runs[residual, "stopped"]), "--resume"])
    return runs


@pytest.mark.parametrize("residual", rivals.RESIDUALS)
def test_train_py_trains_a_rival_and_resumes_it_bitwise(residual, rival_runs):
    whole, resumed = rival_runs[residual, "whole"], rival_runs[residual, "stopped"]
    summary = json.loads((whole / "summary.json").read_text())
    assert summary["finished"] and summary["residual"] == residual and summary["route_heads"] == 0
    assert json.loads((whole / "config.json").read_text())["config"]["residual"] == residual
    log = [json.loads(line) for line in (whole / "log.jsonl").read_text().splitlines()]
    assert (whole / "log.jsonl").read_text().count('"val_loss"') == 2           # steps 3 and 6
    assert log[-1]["val_loss"] < log[1]["loss"]                     # it learned
    baseline = [json.loads(line) for line in (rival_runs["baseline", "whole"] / "log.jsonl").read_text().splitlines()]
    assert log[-1]["val_loss"] != baseline[-1]["val_loss"]           # the rival's model, not the baseline's
    assert any(k.startswith("connections.") for k in torch.load(whole / "ckpt.pt", weights_only=True)["model"]) == (
        residual == "muddformer")
    a = torch.load(whole / "ckpt.pt", weights_only=True)["model"]
    b = torch.load(resumed / "ckpt.pt", weights_only=True)["model"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("residual", rivals.RESIDUALS)
def test_sample_probe_and_export_read_a_rival_run(residual, rival_runs, tmp_path):
    from helpers import one_error_line, run_script
    run = rival_runs[residual, "whole"]
    sampled = run_script("sample.py", "--ckpt", run / "ckpt.pt", "--max_new_tokens", "4", "--num_samples", "1")
    assert sampled.returncode == 0, sampled.stderr
    probed = run_script("scripts/probe.py", "--ckpt", run / "ckpt.pt", "--batches", "1")
    assert probed.returncode == 0 and f"residual={residual} has no routing to probe" in probed.stdout, probed.stderr
    exported = run_script("scripts/export.py", run / "ckpt.pt", tmp_path / "hf")
    assert one_error_line(exported, "export.py", 2) == (
        f"export.py: error: hf.save: {residual} (lib/rivals.py) has no export: its modeling code is not written "
        f"beside the weights; export mhar, attnres, hyper or a baseline")
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("argv, says", [
    (["--residual", "muddformer", "--fused"], "Config.fused: muddformer has no routing sites to fuse; drop --fused"),
    (["--residual", "depth-attention", "--n_layer", "1"],
     "Config.n_layer: depth-attention with 1 block has no earlier layer to read; use n_layer >= 2"),
    (["--residual", "muddformer", "--route_temperature", "4"],
     "Config.route_temperature: muddformer has no routing sites; drop --route_temperature"),
], ids=["mudd-fused", "depth-one-layer", "mudd-temperature"])
def test_a_rival_train_py_cannot_build_is_one_line(argv, says, data, tmp_path, capsys):
    import train
    from helpers import error_line
    line = error_line(capsys, train.main, ["--preset", "tiny", "--data", data, "--out_dir", tmp_path / "r", *argv])
    assert line == f"train.py: error: {says}"


def test_compare_takes_the_rivals_as_methods(capsys, tmp_path):
    """compare.py --methods baseline,muddformer,depth-attention: each a run of its own residual, its parameters
    the rival model's (--plan builds each on the meta device; nothing trains, nothing is written)."""
    from scripts import compare
    compare.main(["--methods", "baseline,muddformer,depth-attention", "--preset", "tiny", "--plan",
                  "--out_dir", str(tmp_path / "cmp")])
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ") for line in capsys.readouterr().out.splitlines()
            if line.startswith("| ") and "-s0" in line}
    assert list(rows) == ["baseline-s0", "muddformer-s0", "depth-attention-s0"]
    for residual in ("baseline", *rivals.RESIDUALS):
        model = rivals.model(rivals.preset("tiny", residual=residual))
        assert rows[f"{residual}-s0"][1] == f"{model.num_params():,}"
    assert not (tmp_path / "cmp").exists()
