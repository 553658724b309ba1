"""Two rival residual modes on mhar.py's decoder (Qwen3-style: pre-norm RMSNorm, rotary, GQA with
QK-norm, SwiGLU), each from its paper's equations. Config.residual picks one; mhar.py is unchanged.

muddformer: MUDDFormer, "Breaking Residual Bottlenecks in Transformers via Multiway Dynamic Dense
Connections" (Xiao, Meng, Li, Yuan; ICML 2025; arXiv:2502.12170). X_0 is the embedding, X_i the
output of block i (i = 1..L). After block i, from X_i, per token, C weights over X_0..X_i:

    A_i      = GELU(RMSNorm(X_i) W1_i) W2_i + a_i      (C, i+1): W1_i d x K_i, W2_i K_i x C(i+1)
    X_i^c    = sum_j A_i[c, j] X_j                     c = Q, K, V, R (C = 4 ways)
    H        = X_i^R + Attn(Norm_Q(X_i^Q), Norm_K(X_i^K), Norm_V(X_i^V))      block i+1
    X_{i+1}  = H + MLP(Norm(H))

The last block has one way (C = 1), the final output X_L^R, read by the final norm. RMSNorm in A_i
has no weight; K_i = C(i+1), 4(L+1) for the last block; init W1 ~ N(0, 1/d), W2 = 0, a_i one-hot
on X_i in every way: the model starts as the baseline exactly. Separate pre-norms for the three
attention inputs from block 2 on (block 1's are all X_0: one norm). These defaults are those of the
authors' public code (Caiyun-AI/MUDDFormer: pytorch/muddformer config.json "sepln", "expand_last";
jax/MaxText/layers/llama2.py init; its hidden widths rounded up to 64 are not taken). The optional
pre/post normalisation ("mudd_prenorm/postnorm" there) is not used: the tiny models train without.

depth-attention: Depth-Attention, "Depth-Attention: Cross-Layer Value Mixing for Language Models"
(Zeng, Hao, Wang et al., LUMIA-Group; arXiv:2606.05014). Inside attention layer l, before the
sequence softmax, each KV head g's value at a token becomes a softmax over depth of the same token's
values in the anchor layers n < l and in layer l itself, scored with the group's mean query:

    qbar_g   = mean over the query heads h of group g of q_h        (after QK-norm and rotary)
    s_n      = < qbar_g, k_n,g > / sqrt(head_dim)                   k_n: layer n's normed key
    vmix_g   = sum_n softmax_n(s)_n v_n,g                           n in anchors(< l) + [l]

Sequence attention then reads (k, vmix); the KV cache stores vmix (per KV head: the baseline's
size); an anchor's v_n is its own vmix (the mixing is recursive), layer l's own is its raw value.
Anchors are the layers n = 0, S, 2S, ... with stride S = n_layer // 2 (at least 1), no recent
window; no parameters are added. Config.route_temperature = tau divides the depth logits further,
s_n / tau (tau = 1: the paper's); tau = 1 / sqrt(head_dim) leaves them undivided, as MHAR's heads'
(whose logits sum d / H coordinates undivided: at d = 128, H = 4, as many as a head's 32).
Rotary cancels at one position: <R q, R k> = <q, k>. Defaults from the authors' code
(LUMIA-Group/Depth-Attention, README "half the layer count", released 3B config stride 24 of 48
layers; modeling_llama_depth_attention.py: GQA by the group's mean query).
"""

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import mhar

RESIDUALS = ("muddformer", "depth-attention")
WAYS = 4  # MUDD's query, key, value and residual ways


@dataclass
class Config(mhar.Config):
    residual: str = "muddformer"  # "muddformer" | "depth-attention"

    def __post_init__(self):
        check_config(self)

    @property
    def depth_anchors(self):
        """The layers whose (key, mixed value) later layers read: every n_layer // 2-th from 0."""
        return tuple(range(0, self.n_layer, max(1, self.n_layer // 2)))


def check_config(c):
    """mhar.check_config's checks on the shape, and the rivals' own: a ValueError naming the field."""
    def check(ok, message):
        if not ok:
            raise ValueError(f"Config.{message}")
    check(c.residual in RESIDUALS, f"residual: {c.residual!r} is not a rival; use one of "
          f"{RESIDUALS} (mhar.Config takes the others; config_of picks)")
    check(not c.fused, f"fused: {c.residual} has no routing sites to fuse; drop --fused")
    tempered = ("route_block", "delta") if c.residual == "depth-attention" else ("route_temperature",
                                                                              "route_block", "delta")
    for name in tempered:  # at their defaults
        check(getattr(c, name) == getattr(mhar.Config, name),
              f"{name}: {c.residual} has no routing sites; drop --{name}")
    check(0 < c.route_temperature < float("inf"),
          f"route_temperature: must be a positive number, not {c.route_temperature}")
    mhar.check_config(mhar.Config(**{**asdict(c), "residual": "baseline", "route_temperature": 1.0}))
    check(c.residual != "depth-attention" or c.n_layer >= 2, f"n_layer: depth-attention with "
          f"{c.n_layer} block has no earlier layer to read; use n_layer >= 2")


def model(config):
    """The model of any Config: a rival's GPT, or mhar.GPT."""
    return GPT(config) if config.residual in RESIDUALS else mhar.GPT(config)


def config_of(fields):
    """The Config of a dict of its fields (a checkpoint's, a run's config.json): a rival's or mhar's."""
    return Config(**fields) if fields.get("residual") in RESIDUALS else mhar.Config(**fields)


def preset(name, **overrides):
    """mhar.preset, a rival's residual included: preset("100m", residual="muddformer")."""
    if overrides.get("residual") not in RESIDUALS:
        return mhar.preset(name, **overrides)
    return Config(**{**asdict(mhar.preset(name)), **overrides})


# ----------------------------------------------------------------------------------------------
# Attention, split in two: projections of (normed) inputs, then the causal attention.

def rotate(x, at):
    """mhar.apply_rotary, except in float64 for float64 x (which mhar's rounds to float32)."""
    if x.dtype != torch.float64:
        return mhar.apply_rotary(x, at.cos, at.sin)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * at.cos - x2 * at.sin, x2 * at.cos + x1 * at.sin), dim=-1)


def project(attn, xq, xk, xv, at):
    """An mhar.Attention's q (B, nh, T, hd), normed rotated k and v (B, nkv, T, hd) of normed inputs."""
    B, T, _ = xq.shape
    nh, nkv, hd = attn.n_head, attn.n_kv_head, attn.head_dim
    q = attn.q_norm(attn.q_proj(xq).view(B, T, nh, hd)).transpose(1, 2)
    k = attn.k_norm(attn.k_proj(xk).view(B, T, nkv, hd)).transpose(1, 2)
    v = attn.v_proj(xv).view(B, T, nkv, hd).transpose(1, 2)
    return rotate(q, at), rotate(k, at), v


def attend(attn, q, k, v, at, cache=None):
    """mhar.Attention's causal grouped-query attention and output projection -> (B, T, d)."""
    B, _, T, _ = q.shape
    causal = at.allowed is None and (cache is None or cache.length == 0)
    if cache is not None:
        k, v = cache.extend(k, v)                                      # (B, nkv, S + T, hd)
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=at.allowed, is_causal=causal,
                                       enable_gqa=True)               # (B, nh, T, hd)
    return attn.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class MuddAttention(mhar.Attention):
    """Attention whose query, key and value read three ways, each through its own pre-norm (norm,
    key_norm, value_norm); block 1's ways are all X_0, read through `norm` alone."""

    def __init__(self, config, block):
        super().__init__(config)
        separate = block > 0
        self.key_norm = mhar.RMSNorm(config.n_embd, config.norm_eps) if separate else None
        self.value_norm = mhar.RMSNorm(config.n_embd, config.norm_eps) if separate else None

    def forward(self, x, at, cache=None, keys_in=None, values_in=None):
        xq = self.norm(x)
        xk, xv = (xq, xq) if self.key_norm is None else (self.key_norm(keys_in),
                                                         self.value_norm(values_in))
        return attend(self, *project(self, xq, xk, xv, at), at, cache)


class DepthAttention(mhar.Attention):
    """Attention whose values are first mixed over depth; forward(x, at, cache, earlier) -> (output
    (B, T, d), its key and mixed value (B, nkv, T, hd)), earlier: the anchors' (key, value) pairs."""

    def __init__(self, config):
        super().__init__(config)
        self.temperature = config.route_temperature  # divides the depth logits beyond 1 / sqrt(hd)

    def forward(self, x, at, cache=None, earlier=()):
        x = self.norm(x)
        q, k, v = project(self, x, x, x, at)
        if earlier:
            v = depth_mix(q, k, v, earlier, self.temperature)
        return attend(self, q, k, v, at, cache), k, v


def depth_mix(q, k, v, earlier, temperature=1.0):
    """Each KV head's value (B, nkv, T, hd) mixed over [earlier..., own] by a softmax over depth of
    the group's mean query against the keys, at 1 / (sqrt(hd) temperature); in float32 at least."""
    B, nh, T, hd = q.shape
    nkv, dtype = k.size(1), torch.promote_types(q.dtype, torch.float32)
    query = q.to(dtype).view(B, nkv, nh // nkv, T, hd).mean(2)                  # (B, nkv, T, hd)
    keys = torch.stack([key for key, _ in earlier] + [k]).to(dtype)             # (N, B, nkv, T, hd)
    values = torch.stack([value for _, value in earlier] + [v]).to(dtype)       # (N, B, nkv, T, hd)
    scores = (keys * query).sum(-1) / (math.sqrt(hd) * temperature)             # (N, B, nkv, T)
    alpha = scores.softmax(dim=0)
    return (alpha.unsqueeze(-1) * values).sum(0).to(v.dtype)


class DenseConnection(nn.Module):
    """MUDD's connection after block i = block + 1: from X_i, the C ways (C, B, T, d) over X_0..X_i."""

    def __init__(self, config, block):
        super().__init__()
        last = block == config.n_layer - 1
        self.ways, self.sources, self.eps = 1 if last else WAYS, block + 2, config.norm_eps
        width = self.ways * self.sources * (4 if last else 1)                   # K_i
        self.w1 = nn.Linear(config.n_embd, width, bias=False)
        self.w2 = nn.Linear(width, self.ways * self.sources, bias=False)
        self.bias = nn.Parameter(torch.zeros(self.ways, self.sources))          # a_i

    def init_weights(self):
        nn.init.normal_(self.w1.weight, std=self.w1.in_features ** -0.5)
        nn.init.zeros_(self.w2.weight)
        with torch.no_grad():
            self.bias.copy_(F.one_hot(torch.tensor(self.sources - 1), self.sources).expand(
                self.ways, -1))                                                # every way: X_i

    def forward(self, states):
        x = states[-1]                                                           # X_i (B, T, d)
        hidden = F.gelu(self.w1(F.rms_norm(x, (x.size(-1),), eps=self.eps)))
        weights = self.w2(hidden).unflatten(-1, (self.ways, self.sources)) + self.bias  # (B,T,C,N)
        weights = weights.movedim(-2, 0).unsqueeze(-1)                          # (C, B, T, N, 1)
        # a sum of products (not an einsum, which autocast would round to bf16): the stream stays fp32
        return sum(weights[..., j, :] * state for j, state in enumerate(states))  # (C, B, T, d)


# ----------------------------------------------------------------------------------------------
# The model.

class GPT(mhar.GPT):
    """mhar.GPT (embedding, sublayers, final norm, LM head, init, generation, accounting) with
    config.residual's rival residual; forward(idx, targets) -> (logits, loss)."""

    def __init__(self, config):
        super().__init__(config)             # the baseline's shape (no sites, no connections)
        mudd = config.residual == "muddformer"
        for block in range(config.n_layer):
            self.layers[2 * block] = MuddAttention(config, block) if mudd else DepthAttention(config)
        if mudd:
            self.connections = nn.ModuleList([DenseConnection(config, block)
                                              for block in range(config.n_layer)])
        self.init_weights()

    def hidden(self, idx, visit=None, cache=None, at=None):
        """The final normed hidden state (B, T, d) of tokens idx (B, T); cache, when generating, one
        KVCache per sublayer; at: a padded batch's Positions. visit: refused (no routing sites)."""
        if visit is not None:
            raise ValueError(f"visit: {self.config.residual} has no routing sites to visit")
        if at is None:
            start = 0 if cache is None else cache[0].length
            at = mhar.token_positions(self.rope_cos, self.rope_sin, start, idx.size(1))
        forward = forward_mudd if self.config.residual == "muddformer" else forward_depth
        return self.norm(forward(self, self.embed(idx), at, cache))

    def sublayer(self, j, x, at, cache=None, *inputs):
        """mhar.GPT.sublayer, with a sublayer's further inputs (MUDD's key and value ways, the
        depth anchors) passed on, through checkpointing too."""
        cache = None if cache is None else cache[j]
        if self.config.checkpointing and torch.is_grad_enabled() and cache is None:
            return checkpoint(self.layers[j], x, at, cache, *inputs, use_reentrant=False)
        return self.layers[j](x, at, cache, *inputs)

    def init_weights(self, modules=None):
        super().init_weights(modules)
        for module in self.modules() if modules is None else modules:
            if isinstance(module, DenseConnection):
                module.init_weights()

    def flops_per_token(self):
        """mhar's accounting (see mhar.GPT.flops_per_token; MUDD's weight MLPs are matmuls there),
        plus the mixing: MUDD ~2d per way and state read forward, twice that backward;
        Depth-Attention ~4 head_dim per KV head and source (logit, mix) forward, twice backward."""
        c = self.config
        if c.residual == "muddformer":
            extra = 6 * c.n_embd * sum(m.ways * m.sources for m in self.connections)
        else:
            sources = sum(1 + sum(n < layer for n in c.depth_anchors) for layer in range(1, c.n_layer))
            extra = 12 * c.n_kv_head * c.head_width * sources
        return super().flops_per_token() + extra


def forward_mudd(gpt, x, at, cache=None):
    """Blocks reading MUDD's ways; the last connection's one way is the output."""
    states = [x]                                                   # X_0, X_1, ...: (B, T, d) each
    queries = keys = values = residual = x
    for block, connection in enumerate(gpt.connections):
        h = residual + gpt.sublayer(2 * block, queries, at, cache, keys, values)
        states.append(h + gpt.sublayer(2 * block + 1, h, at, cache))
        ways = connection(states)                                  # (C, B, T, d)
        queries, keys, values, residual = ways if len(ways) == WAYS else (None, None, None, ways[0])
    return residual


def forward_depth(gpt, x, at, cache=None):
    """The baseline's pre-norm residual stream; attention layers mix their values over depth."""
    anchors, kept = [], set(gpt.config.depth_anchors)                # (key, mixed value) pairs
    for layer in range(gpt.config.n_layer):
        y, k, v = gpt.sublayer(2 * layer, x, at, cache, tuple(anchors))
        if layer in kept:
            anchors.append((k, v))
        x = x + y
        x = x + gpt.sublayer(2 * layer + 1, x, at, cache)
    return x
