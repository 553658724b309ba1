"""
MHAR: Multi-Head Attention Residuals, the whole model in one file.

A Transformer keeps one running residual sum: every sublayer reads x = s_0 + s_1 + ... + s_j.
Attention Residuals (Kimi Team, 2026) let every sublayer read a learned softmax mix over the
raw outputs of all earlier sublayers instead; MHAR (Luo, Cai, Hu, 2026) splits that read into
H heads, each with its own softmax over depth for its own slice of the width.

    r_n      = 1 / sqrt(mean(V_n^2) + eps)                   RMS statistic over the full width d
    l[n, h]  = < q_[h], (r_n V_n * g)_[h] >                  one logit per source n and head h
    a[:, h]  = softmax_n l[:, h]                             H independent softmaxes over depth
    out_[h]  = sum_n a[n, h] V_n,[h]                         head h mixes only its slice

The decoder is Qwen3-style: pre-norm, RMSNorm, rotary embeddings, grouped-query attention with
per-head RMSNorm on queries and keys, SwiGLU MLP, no biases, no dropout, tied embeddings.

Residual modes (Config.residual):
    baseline  x = x + f(RMSNorm(x)) after every sublayer
    hyper     hyper-connections (Zhu et al., 2024): n residual streams, learned read / mix / write
    attnres   every sublayer reads route(s_0..s_j) with H = 1 (Attention Residuals)
    mhar      the same with H = route_heads heads (default n_kv_head)
and, for attnres and mhar, route_block = S > 1: Block AttnRes (Kimi Team, 2026), where the
history holds sums of S consecutive sublayer outputs instead of every output; delta = True: the
additive form for converting a trained baseline, h = x + gate * route(null, D_0, D_1, ...) on top of
the ordinary residual x, with block deltas D_i and a zero gate (so it starts as the baseline exactly).
"""

from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class Config:
    vocab_size: int = 50304      # GPT-2's 50257 tokens padded to a multiple of 128
    seq_len: int = 1024
    n_layer: int = 12            # blocks; each block is two sublayers (attention, MLP)
    n_embd: int = 768
    n_head: int = 12
    n_kv_head: int = 4           # grouped-query attention: n_head / n_kv_head queries share a key
    ffn_hidden: int = 2048       # SwiGLU hidden width
    rope_theta: float = 1e4
    norm_eps: float = 1e-6
    residual: str = "mhar"       # "baseline" | "hyper" | "attnres" | "mhar"
    route_heads: int = 0         # MHAR heads H; 0 = n_kv_head (the paper's default)
    route_block: int = 1         # Block AttnRes block size in sublayers; 1 = full routing
    delta: bool = False          # additive (delta) routing for conversion
    hc_streams: int = 4          # hyper-connection streams
    fused: bool = False          # route with the Triton kernels of kernel.py

    def __post_init__(self):
        def check(ok, field, problem, fix):
            if not ok:
                raise ValueError(f"Config.{field}: {problem}; {fix}")

        for field in ("vocab_size", "seq_len", "n_layer", "n_embd", "n_head", "n_kv_head", "ffn_hidden",
                      "route_block", "hc_streams"):
            value = getattr(self, field)
            check(isinstance(value, int) and value > 0, field, f"must be a positive integer, got {value!r}",
                  "set it to a positive integer")
        check(self.norm_eps > 0, "norm_eps", f"must be positive, got {self.norm_eps}", "use e.g. 1e-6")
        check(self.rope_theta > 0, "rope_theta", f"must be positive, got {self.rope_theta}", "use e.g. 1e4")
        check(self.n_embd % self.n_head == 0, "n_head", f"{self.n_head} does not divide n_embd={self.n_embd}",
              "choose n_head so that n_embd % n_head == 0")
        check((self.n_embd // self.n_head) % 2 == 0, "n_head", f"head width {self.n_embd // self.n_head} is odd",
              "rotary embeddings rotate pairs of channels: choose n_head so that n_embd / n_head is even")
        check(self.n_head % self.n_kv_head == 0, "n_kv_head", f"{self.n_kv_head} does not divide n_head={self.n_head}",
              "choose n_kv_head so that n_head % n_kv_head == 0")
        modes = ("baseline", "hyper", "attnres", "mhar")
        check(self.residual in modes, "residual", f"unknown mode {self.residual!r}", f"use one of {modes}")
        check(isinstance(self.route_heads, int) and self.route_heads >= 0, "route_heads",
              f"must be a non-negative integer, got {self.route_heads!r}", "use 0 for n_kv_head, or a head count")
        check(self.residual != "attnres" or self.route_heads in (0, 1), "route_heads",
              f"attnres is single-head routing but route_heads={self.route_heads}",
              "use residual='mhar' for several heads, or route_heads=1")
        check(self.routed or self.route_heads == 0, "route_heads", f"{self.residual} has no routing sites",
              "leave route_heads at 0, or use residual='mhar'")
        check(self.routed or self.route_block == 1, "route_block", f"{self.residual} has no routing sites",
              "leave route_block at 1, or use residual='attnres'/'mhar'")
        if self.routed:
            check(self.n_embd % self.heads == 0, "route_heads", f"{self.heads} heads do not divide n_embd={self.n_embd}",
                  "choose route_heads so that n_embd % route_heads == 0")
        check(not self.delta or self.routed, "delta", f"delta routing needs routing sites, not {self.residual}",
              "use residual='attnres' or 'mhar' with delta=True")
        check(not self.fused or self.routed, "fused", f"{self.residual} has no routing to fuse",
              "use fused=False, or residual='attnres'/'mhar'")

    @property
    def routed(self):
        return self.residual in ("attnres", "mhar")

    @property
    def heads(self):
        """Routing heads H: 1 for attnres, route_heads (or n_kv_head) for mhar, 0 for baseline."""
        if self.residual == "attnres":
            return 1
        if self.residual == "mhar":
            return self.route_heads or self.n_kv_head
        return 0


# The paper's shapes (Qwen3-style, its Table of model sizes) plus two CPU-sized presets.
PRESETS = {
    "tiny":  Config(seq_len=64, n_layer=2, n_embd=64, n_head=4, n_kv_head=2, ffn_hidden=192),       # tests
    "small": Config(seq_len=256, n_layer=4, n_embd=128, n_head=4, n_kv_head=2, ffn_hidden=384),     # CPU demo
    "100m":  Config(seq_len=2048, n_layer=12, n_embd=512, n_head=8, n_kv_head=4, ffn_hidden=1536),
    "350m":  Config(seq_len=1024, n_layer=24, n_embd=1024, n_head=16, n_kv_head=8, ffn_hidden=4096),
    "1b":    Config(seq_len=1024, n_layer=36, n_embd=1280, n_head=16, n_kv_head=8, ffn_hidden=5120),
}


def preset(name, **overrides):
    """A preset Config with some fields replaced, e.g. preset("100m", residual="attnres")."""
    if name not in PRESETS:
        raise ValueError(f"preset {name!r} is unknown; use one of {sorted(PRESETS)}")
    return replace(PRESETS[name], **overrides)


# ----------------------------------------------------------------------------------------------
# The route: the readable reference of the method.

def route_weights(V, q, g, heads, eps=1e-6):
    """α[n, b, t, h]: how much head h of the site reads source n (a softmax over depth n)."""
    N, B, T, d = V.shape
    V = V.float()
    keys = V * torch.rsqrt(V.pow(2).mean(-1, keepdim=True) + eps) * g.float()      # (N, B, T, d): RMS over the full width
    logits = (keys.view(N, B, T, heads, -1) * q.float().view(heads, -1)).sum(-1)  # (N, B, T, H): one dot per head slice
    return logits.softmax(dim=0)                                                   # (N, B, T, H): H softmaxes over depth


def route(V, q, g, heads, eps=1e-6):
    """The multi-head depth route: sources V (N, B, T, d) -> (B, T, d) in V.dtype, float32 inside."""
    N, B, T, d = V.shape
    alpha = route_weights(V, q, g, heads, eps)                                     # (N, B, T, H)
    slices = V.float().view(N, B, T, heads, d // heads)                            # (N, B, T, H, K)
    out = (alpha.unsqueeze(-1) * slices).sum(0)                                    # (B, T, H, K): head h mixes only its slice
    return out.reshape(B, T, d).to(V.dtype)


class DepthHistory:
    """The sources of one forward pass, kept as a list and stacked at every site (readable, O(L^2) memory).

    With block size S > 1 (Block AttnRes) the history holds b_0 = s_0, then the sum of each completed
    block of S sublayer outputs, then the partial sum of the current block when it has begun. S = 1
    keeps every source as it is: full routing. Delta routing starts the history with its null source
    and reads completed blocks only (the partial block is already in the residual stream).
    kernel.FusedHistory has the same interface for full routing and writes each source once into a
    shared buffer; `route_fn` = kernel.fused_route fuses each read here.
    """

    def __init__(self, heads, eps, block=1, null=None, visit=None, route_fn=route):
        self.heads, self.eps, self.block, self.route_fn = heads, eps, block, route_fn
        self.null = null        # delta routing's learnable null source (d,), or None
        self.blocks = []        # b_0 = s_0, then completed block sums b_1, b_2, ...
        self.partial = None     # sum of the current block's outputs so far
        self.in_block = 0       # how many outputs that sum holds
        self.visit = visit      # for analysis: called as visit(V, q, g) at every site

    def route(self, source, q, g):
        """Append `source` (B, T, d) to the history, then read the whole history with query q, norm weight g."""
        if not self.blocks:
            self.blocks.append(source)                                             # b_0 = s_0, the embedding
        else:
            self.partial = source if self.partial is None else self.partial + source
            self.in_block += 1
            if self.in_block == self.block:                                        # the block is complete
                self.blocks.append(self.partial)
                self.partial, self.in_block = None, 0
        sources = list(self.blocks)
        if self.null is not None:
            sources.insert(0, self.null.to(source.dtype).expand_as(source))
        elif self.partial is not None:
            sources.append(self.partial)
        V = torch.stack(sources)                                                   # (N, B, T, d)
        if self.visit is not None:
            self.visit(V, q, g)
        return self.route_fn(V, q, g, self.heads, self.eps)


# ----------------------------------------------------------------------------------------------
# The Transformer.

class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return F.rms_norm(x, (x.size(-1),), self.weight, self.eps)


def rotary_tables(seq_len, head_dim, theta):
    """cos and sin of the rotation angles, (seq_len, head_dim / 2) each."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rotary(x, cos, sin):
    """Rotate channel pairs (i, i + hd/2) of x (B, nh, T, hd) by position-dependent angles."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class Attention(nn.Module):
    """Pre-norm causal self-attention with grouped-query heads and QK-norm."""

    def __init__(self, config):
        super().__init__()
        self.n_head, self.n_kv_head = config.n_head, config.n_kv_head
        self.head_dim = config.n_embd // config.n_head
        self.norm = RMSNorm(config.n_embd, config.norm_eps)
        self.q_proj = nn.Linear(config.n_embd, self.n_head * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.n_embd, self.n_kv_head * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.n_embd, self.n_kv_head * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_head * self.head_dim, config.n_embd, bias=False)
        self.q_norm = RMSNorm(self.head_dim, config.norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.norm_eps)

    def forward(self, x, rope):
        B, T, C = x.size()
        x = self.norm(x)
        q = self.q_norm(self.q_proj(x).view(B, T, self.n_head, self.head_dim)).transpose(1, 2)     # (B, nh, T, hd)
        k = self.k_norm(self.k_proj(x).view(B, T, self.n_kv_head, self.head_dim)).transpose(1, 2)  # (B, nkv, T, hd)
        v = self.v_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)               # (B, nkv, T, hd)
        cos, sin = rope
        q, k = apply_rotary(q, cos[:T], sin[:T]), apply_rotary(k, cos[:T], sin[:T])
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)              # (B, nh, T, hd)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    """Pre-norm SwiGLU feed-forward."""

    def __init__(self, config):
        super().__init__()
        self.norm = RMSNorm(config.n_embd, config.norm_eps)
        self.gate_proj = nn.Linear(config.n_embd, config.ffn_hidden, bias=False)
        self.up_proj = nn.Linear(config.n_embd, config.ffn_hidden, bias=False)
        self.down_proj = nn.Linear(config.ffn_hidden, config.n_embd, bias=False)

    def forward(self, x, rope=None):  # rope unused: every sublayer takes the same arguments
        x = self.norm(x)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class RouteSite(nn.Module):
    """One routing site: a pseudo-query (zero: routing starts as a uniform average), a key norm and,
    for delta routing, the gate (zero: the route is not added until training opens it)."""

    def __init__(self, config):
        super().__init__()
        self.query = nn.Parameter(torch.zeros(config.n_embd))
        self.norm = RMSNorm(config.n_embd, config.norm_eps)
        self.gate = nn.Parameter(torch.zeros(())) if config.delta else None


class HyperConnection(nn.Module):
    """Hyper-connections (Zhu et al., 2024) around one sublayer, over n residual streams H (B, T, n, d).

    The sublayer reads h = sum_i read[i] H_i and its output y is written back as
    H'_k = sum_i mix[i, k] H_i + write[k] y. Each of read (n), mix (n x n) and write (n) is a static
    parameter plus a dynamic, per-token part scale * tanh(RMSNorm(H) W). At init read is one-hot on
    stream j mod n, mix = I, write = 1 and W = 0: every stream then carries the plain residual sum, so
    the network starts exactly as the pre-norm baseline.
    """

    def __init__(self, config, index):
        super().__init__()
        n, d = config.hc_streams, config.n_embd
        self.index = index                                         # which stream the static read starts on
        self.static_read = nn.Parameter(torch.zeros(n))
        self.static_mix = nn.Parameter(torch.zeros(n, n))
        self.static_write = nn.Parameter(torch.zeros(n))
        self.norm = RMSNorm(d, config.norm_eps)
        self.dynamic_read_mix = nn.Parameter(torch.zeros(d, n + 1))   # stream i -> (read[i], mix[i, :])
        self.dynamic_write = nn.Parameter(torch.zeros(d, 1))          # stream i -> write[i]
        self.read_mix_scale = nn.Parameter(torch.zeros(()))
        self.write_scale = nn.Parameter(torch.zeros(()))

    def forward(self, streams, layer, rope):
        normed = self.norm(streams)                                                        # (B, T, n, d)
        read_mix = self.read_mix_scale * torch.tanh(normed @ self.dynamic_read_mix)        # (B, T, n, n+1)
        read = self.static_read + read_mix[..., 0]                                         # (B, T, n)
        mix = self.static_mix + read_mix[..., 1:]                                          # (B, T, n, n)
        write = self.static_write + self.write_scale * torch.tanh(normed @ self.dynamic_write).squeeze(-1)
        y = layer(torch.einsum("btn,btnd->btd", read, streams), rope)                      # (B, T, d)
        return torch.einsum("btik,btid->btkd", mix, streams) + write.unsqueeze(-1) * y.unsqueeze(2)


ADDED_BY_RESIDUAL = ("sites.", "connections.", "null")  # parameter names a baseline checkpoint lacks


class GPT(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.config = config
        if config.fused:
            import kernel  # only the fused path needs Triton
            kernel.check_available()
        self.embed = nn.Embedding(config.vocab_size, config.n_embd)
        # 2L sublayers: attention, MLP, attention, MLP, ...; sublayer j's output is source s_{j+1}
        self.layers = nn.ModuleList([Attention(config) if j % 2 == 0 else MLP(config)
                                     for j in range(2 * config.n_layer)])
        # 2L + 1 sites: one in front of each sublayer, one in front of the final norm
        self.sites = nn.ModuleList([RouteSite(config) for _ in range(2 * config.n_layer + 1)]) if config.routed else None
        self.connections = nn.ModuleList([HyperConnection(config, j) for j in range(2 * config.n_layer)]
                                         ) if config.residual == "hyper" else None
        self.null = nn.Parameter(torch.zeros(config.n_embd)) if config.delta else None  # delta's null source
        self.norm = RMSNorm(config.n_embd, config.norm_eps)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.embed.weight  # tied input and output embeddings
        cos, sin = rotary_tables(config.seq_len, config.n_embd // config.n_head, config.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.init_weights()

    @classmethod
    def from_baseline(cls, state_dict, config):
        """Identity-preserving conversion: a trained baseline's weights in a delta-routed model.

        The gates start at zero, so the converted model computes exactly what the baseline did.
        """
        if not config.delta:
            raise ValueError("from_baseline: only delta routing starts as the baseline; set Config.delta=True")
        model = cls(config)
        missing, unexpected = model.load_state_dict(state_dict, strict=False)
        missing = [k for k in missing if not k.startswith(ADDED_BY_RESIDUAL)]
        if missing or unexpected:
            raise ValueError(f"from_baseline: the checkpoint does not fit this shape (missing {missing[:3]}, "
                             f"unexpected {unexpected[:3]}); convert with the baseline's own preset and sizes")
        return model

    def init_weights(self):
        """How every tensor starts:

        | tensor                                  | init          |
        |-----------------------------------------|---------------|
        | embedding (= LM head), every projection | N(0, 0.02^2)  |
        | every RMSNorm weight (sites' included)  | 1             |
        | routing queries                         | 0 (uniform α) |
        | delta routing: gates, null source       | 0 (starts as the baseline) |
        | hyper-connections: static read          | one-hot on stream j mod n |
        | static mix, static write                | identity, 1 |
        | dynamic projections                     | 0 |
        | dynamic scales                          | 0.01 (small, learnable; Zhu et al.) |
        """
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
            elif isinstance(module, RouteSite):
                nn.init.zeros_(module.query)
                if module.gate is not None:
                    nn.init.zeros_(module.gate)
            elif isinstance(module, HyperConnection):
                n = module.static_read.numel()
                with torch.no_grad():
                    module.static_read.copy_(F.one_hot(torch.tensor(module.index % n), n))
                    module.static_mix.copy_(torch.eye(n))
                    module.static_write.fill_(1.0)
                    module.dynamic_read_mix.zero_()
                    module.dynamic_write.zero_()
                    module.read_mix_scale.fill_(0.01)
                    module.write_scale.fill_(0.01)

    def forward(self, idx, targets=None):
        logits = self.lm_head(self.hidden(idx)).float()                            # (B, T, vocab)
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))

    def hidden(self, idx, visit=None):
        """The final normed hidden state (B, T, d); `visit(V, q, g)` sees every site's sources and parameters."""
        B, T = idx.size()
        if T > self.config.seq_len:
            raise ValueError(f"sequence of {T} tokens is longer than Config.seq_len={self.config.seq_len}")
        rope = (self.rope_cos, self.rope_sin)
        x = self.embed(idx)                                                        # (B, T, d): source s_0
        if self.config.residual == "baseline":
            for layer in self.layers:
                x = x + layer(x, rope)
            return self.norm(x)
        if self.config.residual == "hyper":
            streams = x.unsqueeze(2).repeat(1, 1, self.config.hc_streams, 1)       # (B, T, n, d): each starts as s_0
            for layer, connection in zip(self.layers, self.connections):
                streams = connection(streams, layer, rope)
            # Zhu et al. sum the streams; the final RMSNorm removes that factor n up to its eps, and the
            # mean removes it exactly, so the network starts as exactly the baseline
            return self.norm(streams.mean(2))
        if self.config.delta:  # the baseline's residual x, plus a gated route over [null, D_0, D_1, ...]
            history = self.new_history(visit)
            source = x                                                             # D_0 = s_0, the embedding
            for layer, site in zip(self.layers, self.sites):
                source = layer(x + site.gate * history.route(source, site.query, site.norm.weight), rope)
                x = x + source  # the history sums the same outputs into block deltas D_i = h_end - h_start
            site = self.sites[-1]
            return self.norm(x + site.gate * history.route(source, site.query, site.norm.weight))
        if torch.is_autocast_enabled(x.device.type):  # sources are stored in the compute dtype (bf16 on GPUs)
            x = x.to(torch.get_autocast_dtype(x.device.type))
        history = self.new_history(visit)
        site = self.sites[0]
        h = history.route(x, site.query, site.norm.weight)
        for layer, site in zip(self.layers, self.sites[1:]):
            h = history.route(layer(h, rope), site.query, site.norm.weight)  # sublayer j's raw output is s_{j+1}
        return self.norm(h)

    def new_history(self, visit=None):
        c = self.config
        if c.fused and visit is None:
            from kernel import FusedHistory, fused_route
            if c.route_block == 1 and not c.delta:  # one shared buffer for the whole forward
                return FusedHistory(2 * c.n_layer + 1, c.heads, c.norm_eps)
            return DepthHistory(c.heads, c.norm_eps, c.route_block, self.null, route_fn=fused_route)
        return DepthHistory(c.heads, c.norm_eps, c.route_block, self.null, visit)

    @torch.no_grad()
    def routing_weights(self, idx):
        """α of every site for a batch: a list of 2L+1 tensors (N_j, B, T, H), N_j = j + 1."""
        if not self.config.routed:
            raise ValueError("routing_weights: residual='baseline' has no routing sites")
        alphas, c = [], self.config
        self.hidden(idx, visit=lambda V, q, g: alphas.append(route_weights(V, q, g, c.heads, c.norm_eps)))
        return alphas

    # ------------------------------------------------------------------------------------------
    # Accounting and training helpers.

    def num_params(self, non_embedding=False):
        """Parameter count (the tied embedding/LM head counted once)."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.embed.weight.numel() if non_embedding else n

    def flops_per_token(self):
        """Training FLOPs per token (forward + backward), the routing included.

        Matmuls: 6 per weight (PaLM appendix B), the tied LM head included. Attention scores and
        values: 12 * L * d * T (the PaLM convention, causal masking not discounted). Routing: a site
        reads each of its sources once for the norm, the logit and the mix (~8d flops forward, twice
        that backward); full routing reads sum_j (j + 1) = (2L+1)(2L+2)/2 sources. Hyper-connections:
        per sublayer, the dynamic projections and the read, mix and write over n streams, ~4 d n (n+2)
        flops forward, twice that backward.
        """
        c = self.config
        matmul = sum(p.numel() for name, p in self.named_parameters()
                     if p.dim() == 2 and not name.startswith("connections."))
        attention = 12 * c.n_layer * c.n_embd * c.seq_len
        routing = 24 * c.n_embd * sum(self.site_sources(j) for j in range(2 * c.n_layer + 1)) if c.routed else 0
        n = c.hc_streams
        hyper = 2 * c.n_layer * 12 * c.n_embd * n * (n + 2) if c.residual == "hyper" else 0
        return 6 * matmul + attention + routing + hyper

    def site_sources(self, j):
        """How many sources site j reads: j + 1, or with blocks of S the completed blocks plus a partial."""
        S = self.config.route_block
        return 1 + j // S + (j % S > 0)

    # Dense bf16 tensor-core peaks (vendor datasheets); unknown devices get no MFU rather than a wrong one.
    PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "B200": 2250e12}

    def estimate_mfu(self, tokens_per_s, device_name):
        """Model FLOPs utilization for a throughput on a device named like torch.cuda.get_device_name()."""
        peak = next((f for name, f in self.PEAK_FLOPS.items() if name in (device_name or "")), None)
        return None if peak is None else self.flops_per_token() * tokens_per_s / peak

    def param_groups(self):
        """Parameters by role: {"embedding", "matrices", "norms", "routing"}; each lands in exactly one.

        "routing" holds what a residual mode adds to the baseline: the sites (and delta's null source),
        or the hyper-connections.
        """
        groups = {"embedding": [self.embed.weight], "matrices": [], "norms": [], "routing": []}
        for name, p in self.named_parameters():
            if p is self.embed.weight:
                continue
            role = "routing" if name.startswith(ADDED_BY_RESIDUAL) else "matrices" if p.dim() == 2 else "norms"
            groups[role].append(p)
        assert sum(len(ps) for ps in groups.values()) == len(list(self.parameters())), "a parameter has no group"
        return groups

    def configure_optimizers(self, weight_decay=0.1, learning_rate=1e-3, betas=(0.9, 0.95), eps=1e-8,
                             device_type="cpu"):
        """AdamW with the paper's recipe: weight decay on all parameters (DESIGN §5), one group per role."""
        groups = [{"name": name, "params": ps, "weight_decay": weight_decay, "lr": learning_rate}
                  for name, ps in self.param_groups().items() if ps]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, eps=eps, fused=device_type == "cuda")

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None):
        """Append max_new_tokens sampled tokens to idx (B, T); temperature 0 picks the argmax."""
        for _ in range(max_new_tokens):
            logits, _ = self(idx[:, -self.config.seq_len:])
            logits = logits[:, -1, :]                                              # (B, vocab)
            if temperature == 0:
                next_id = logits.argmax(-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                next_id = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)
            idx = torch.cat((idx, next_id), dim=1)
        return idx

    # ------------------------------------------------------------------------------------------
    # Hugging Face checkpoints: the mapping lives in hf.py (it needs safetensors; transformers never).

    @classmethod
    def from_pretrained(cls, path, **overrides):
        """A Hugging Face Qwen3 directory (or hub id, or this project's export) as a GPT: the baseline, or,
        with residual="mhar" (route_heads, route_block), delta routing that starts as it exactly.
        dtype=torch.bfloat16 builds it in bf16; see hf.load."""
        import hf
        return hf.load(path, **overrides)

    def save_pretrained(self, directory, **options):
        """Write a Hugging Face directory: a Qwen3 checkpoint transformers loads for a baseline, this
        project's export for a routed model (from_pretrained reads both); see hf.save."""
        import hf
        return hf.save(self, directory, **options)
