"""MHAR: Multi-Head Attention Residuals (Luo, Cai, Hu, 2026), the whole model in one file.

A Transformer keeps one running residual sum: every sublayer reads x = s_0 + s_1 + ... + s_j.
Attention Residuals (Kimi Team, 2026) let every sublayer read a learned softmax mix over the raw
outputs s_0..s_j of all earlier sublayers instead; MHAR splits that read into H heads, each with
its own softmax over depth for its own slice of the width. At a routing site with query q and key
norm weight g, over sources V = [s_0, ..., s_j]:

    r_n      = 1 / sqrt(mean(V_n^2) + eps)          RMS statistic over the full width d
    l[n, h]  = < q_[h], (r_n V_n * g)_[h] >         one logit per source n and head h
    a[:, h]  = softmax_n l[:, h]                    H independent softmaxes over depth
    out_[h]  = sum_n a[n, h] V_n,[h]                head h mixes only its slice

Sublayer j reads out, and its raw output is appended as s_{j+1}; H = 1 is Attention Residuals.
The decoder is Qwen3-style: pre-norm RMSNorm, rotary embeddings, grouped-query attention with
QK-norm, SwiGLU, no biases or dropout, tied embeddings by default, a KV cache for generation.

Residual modes (Config.residual): attnres (H = 1), mhar (H = route_heads), baseline (the running
sum), hyper (hyper-connections, Zhu et al., 2024). Routed, route_block = S > 1 is Block AttnRes
(Kimi Team, 2026), over sums of S sublayer outputs; delta = True converts a trained baseline:
h = x + gate * route(null, D_0, D_1, ...) over block deltas D_i, with a zero gate at the start.

Reading order: Config; the route and its depth history; the Transformer's pieces; GPT, its routed
forward first; the other modes (block and delta routing, baseline, hyper-connections); the checks;
the presets. Elsewhere: kernel.py (Config.fused), lib/head.py (the loss), lib/hf.py (Hugging Face).
"""

from dataclasses import dataclass, replace
from typing import ClassVar, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


@dataclass
class Config:
    vocab_size: int = 50304      # the vocabulary: GPT-2's 50257 tokens padded to 50304
    seq_len: int = 1024          # tokens per sequence, the longest the model reads
    n_layer: int = 12            # blocks; each block is two sublayers (attention, MLP)
    n_embd: int = 768            # model width d
    n_head: int = 12             # attention heads
    n_kv_head: int = 4           # grouped-query attention: n_head / n_kv_head queries share a key
    head_dim: int = 0            # head width, 0 = n_embd // n_head (Qwen3-0.6B: 128, not 1024/16)
    ffn_hidden: int = 2048       # SwiGLU hidden width
    rope_theta: float = 1e4      # rotary embedding base (Qwen3 checkpoints: 1e6)
    norm_eps: float = 1e-6       # RMSNorm epsilon
    tie_embeddings: bool = True  # the LM head is the input embedding (untied from Qwen3-4B up)
    residual: str = "mhar"       # "attnres" | "mhar" | "baseline" | "hyper"
    route_heads: int = 0         # mhar's heads H, 0 = n_kv_head (attnres: H = 1; others: unused)
    query_init_std: float = 0.0  # routing queries start at 0 (uniform α); > 0: N(0, std^2)
    route_temperature: float = 1.0  # tau divides every routing logit: a control for H
    route_block: int = 1         # Block AttnRes block size in sublayers; 1 = full routing
    delta: bool = False          # additive (delta) routing for conversion
    hc_streams: int = 4          # hyper-connection streams
    fused: bool = False          # route with the Triton kernels of kernel.py
    fused_group: int = 0         # fused: sites per shared read of the sources, 0 = auto
    checkpointing: bool = False  # recompute each sublayer's activations in backward (saves memory)

    # what routing is (a conversion chooses it anew); how a model runs, not what it computes
    ROUTING: ClassVar = ("residual", "route_heads", "route_block", "delta", "hc_streams",
                         "query_init_std", "route_temperature")
    RUNTIME: ClassVar = ("fused", "fused_group", "checkpointing")

    def __post_init__(self):
        check_config(self)  # the mistakes a user can make, each with its fix (at the file's end)

    @property
    def head_width(self):
        return self.head_dim or self.n_embd // self.n_head

    @property
    def routed(self):
        return self.residual in ("attnres", "mhar")

    @property
    def depth_heads(self):  # H, a site's softmaxes over depth
        return {"attnres": 1, "mhar": self.route_heads or self.n_kv_head}.get(self.residual, 0)


# ----------------------------------------------------------------------------------------------
# The route, the readable reference of the method, and the depth history that it reads.
#
# The temperature: Config.route_temperature = tau divides every logit (the query q / tau). A head's
# logit sums d/H coordinates, AttnRes's all d: MHAR's softmaxes start flatter; AttnRes at tau = H is
# the control for that (docs/methods.md, "The temperature control"; scripts/compare.py, attnres-T4).

def route_weights(V, q, g, heads, eps=1e-6):
    """α[n, b, t, h]: how much head h of the site reads source n (a softmax over depth n).
    The keys' RMS statistic is over the full width d; each head dots only its slice of width d/H."""
    N, B, T, d = V.shape
    V = V.float()
    keys = V * torch.rsqrt(V.pow(2).mean(-1, keepdim=True) + eps) * g.float()  # (N, B, T, d)
    logits = (keys.view(N, B, T, heads, -1) * q.float().view(heads, -1)).sum(-1)  # (N, B, T, H)
    return logits.softmax(dim=0)                                     # H softmaxes over depth n


def route(V, q, g, heads, eps=1e-6):
    """The multi-head depth route: sources V (N, B, T, d) -> (B, T, d) in V.dtype, fp32 inside."""
    N, B, T, d = V.shape
    alpha = route_weights(V, q, g, heads, eps)                       # (N, B, T, H)
    slices = V.float().view(N, B, T, heads, d // heads)              # (N, B, T, H, K)
    out = (alpha.unsqueeze(-1) * slices).sum(0)                      # (B, T, H, K): per-head mix
    return out.reshape(B, T, d).to(V.dtype)


class DepthHistory:
    """The sources of one forward pass for full routing, readable: a list, stacked at every read.
    append(source) adds s_0 (the embedding), then each sublayer's raw output; read(site) routes
    over all appended so far with the query queries[site] and the norm weight norms[site].
    Stacking costs O(L^2) memory; kernel.py's FusedHistory reads in place, several sites at once."""

    def __init__(self, queries, norms, heads, eps):
        self.queries, self.norms, self.heads, self.eps = queries, norms, heads, eps
        self.sources = []                                            # s_0, s_1, ...: (B, T, d) each
        self.visit = None             # for analysis: visit(V, q, g) sees every read's inputs first

    def append(self, source):
        self.sources.append(source)

    def stack(self):
        return torch.stack(self.sources)                             # (N, B, T, d)

    def read(self, site):
        V, q, g = self.stack(), self.queries[site], self.norms[site]
        if self.visit is not None:
            self.visit(V, q, g)
        return route(V, q, g, self.heads, self.eps)


# ----------------------------------------------------------------------------------------------
# The Transformer's pieces.

class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):  # weight in x's dtype (bf16 under autocast): the fused kernel's need
        return F.rms_norm(x, (x.size(-1),), self.weight.to(x.dtype), self.eps)


def rotary_tables(seq_len, head_dim, theta, device=None):
    """cos and sin of the rotation angles, (seq_len, head_dim / 2) each, fp32, made on the CPU."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device="cpu").float() / head_dim)
    angles = torch.outer(torch.arange(seq_len, device="cpu").float(), inv_freq)
    return angles.cos().to(device), angles.sin().to(device)


def apply_rotary(x, cos, sin):
    """Rotate channel pairs (i, i + hd/2) of x (B, nh, T, hd) by the angles of its positions."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class Positions(NamedTuple):
    """The T tokens' rotary cos and sin, (T, hd/2) or per row (B, 1, T, hd/2), and the keys each
    reads: None, causal (after a cache: all); else bool, (T, S + T) or (B, 1, T, S + T)."""
    cos: torch.Tensor
    sin: torch.Tensor
    allowed: torch.Tensor | None = None


def token_positions(cos, sin, start, T):
    """Causal Positions of T tokens after `start` cached ones, from the tables (seq_len, hd/2)."""
    if start + T > len(cos):
        raise ValueError(f"sequence of {start + T} tokens is longer than Config.seq_len={len(cos)}")
    cos, sin = cos[start:start + T], sin[start:start + T]                           # (T, hd/2)
    if start == 0 or T <= 1:
        return Positions(cos, sin)                 # causal; one token after a cache reads every key
    # SDPA's is_causal would align query i with key i, not with its own key start + i
    causal = torch.ones(T, start + T, dtype=torch.bool, device=cos.device).tril(start)  # (T, S + T)
    return Positions(cos, sin, causal)


class Attention(nn.Module):
    """Pre-norm causal self-attention with grouped-query heads and QK-norm."""

    def __init__(self, config):
        super().__init__()
        self.n_head, self.n_kv_head = config.n_head, config.n_kv_head
        self.head_dim = config.head_width
        self.norm = RMSNorm(config.n_embd, config.norm_eps)
        self.q_proj = nn.Linear(config.n_embd, self.n_head * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.n_embd, self.n_kv_head * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.n_embd, self.n_kv_head * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_head * self.head_dim, config.n_embd, bias=False)
        self.q_norm = RMSNorm(self.head_dim, config.norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.norm_eps)

    def forward(self, x, at, cache=None):
        """x (B, T, d) at Positions `at`; cache: the earlier tokens' keys and values, extended."""
        B, T, _ = x.size()
        x = self.norm(x)
        nh, nkv, hd = self.n_head, self.n_kv_head, self.head_dim
        q = self.q_norm(self.q_proj(x).view(B, T, nh, hd)).transpose(1, 2)     # (B, nh, T, hd)
        k = self.k_norm(self.k_proj(x).view(B, T, nkv, hd)).transpose(1, 2)    # (B, nkv, T, hd)
        v = self.v_proj(x).view(B, T, nkv, hd).transpose(1, 2)                 # (B, nkv, T, hd)
        q, k = apply_rotary(q, at.cos, at.sin), apply_rotary(k, at.cos, at.sin)
        # a Python bool: under torch.compile a comparison of sizes is symbolic, which SDPA refuses
        causal = at.allowed is None and (cache is None or cache.length == 0)
        if cache is not None:
            k, v = cache.extend(k, v)                                  # (B, nkv, S + T, hd)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=at.allowed, is_causal=causal,
                                           enable_gqa=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, nh * hd))  # y: (B, nh, T, hd)


class MLP(nn.Module):
    """Pre-norm SwiGLU feed-forward."""

    def __init__(self, config):
        super().__init__()
        self.norm = RMSNorm(config.n_embd, config.norm_eps)
        self.gate_proj = nn.Linear(config.n_embd, config.ffn_hidden, bias=False)
        self.up_proj = nn.Linear(config.n_embd, config.ffn_hidden, bias=False)
        self.down_proj = nn.Linear(config.ffn_hidden, config.n_embd, bias=False)

    def forward(self, x, at=None, cache=None):  # every sublayer takes the same arguments
        x = self.norm(x)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class KVCache:
    """Generation's memory of one attention sublayer: the keys and values of the tokens so far."""

    def __init__(self):
        self.keys = self.values = None                                 # (B, nkv, T, hd) each

    @property
    def length(self):
        return 0 if self.keys is None else self.keys.size(2)

    def extend(self, k, v):
        if self.keys is not None:
            k, v = torch.cat((self.keys, k), dim=2), torch.cat((self.values, v), dim=2)
        self.keys, self.values = k, v
        return k, v


class RouteSite(nn.Module):
    """One routing site's parameters: the pseudo-query q (zero: routing starts uniform), the keys'
    RMSNorm weight g and, for delta routing, the gate (zero: closed until training opens it)."""

    def __init__(self, config):
        super().__init__()
        self.query_init_std = config.query_init_std
        self.query = nn.Parameter(torch.zeros(config.n_embd))
        self.norm_weight = nn.Parameter(torch.ones(config.n_embd))
        self.gate = nn.Parameter(torch.zeros(())) if config.delta else None

    def init_weights(self):
        nn.init.zeros_(self.query)
        if self.query_init_std > 0:  # the paper's earlier protocol
            nn.init.normal_(self.query, std=self.query_init_std)
        nn.init.ones_(self.norm_weight)
        if self.gate is not None:
            nn.init.zeros_(self.gate)


class LMHead(nn.Linear):
    """The projection to the vocabulary. Called, the logits; loss(hidden, targets, loss_fn), a loss
    from its weight without them (lib/head.py): a method, so that FSDP can gather a sharded head."""

    def __init__(self, config):
        super().__init__(config.n_embd, config.vocab_size, bias=False)

    def loss(self, hidden, targets, loss_fn):
        return loss_fn(hidden, self.weight, targets)


def compute_dtype(x):
    """The dtype autocast computes in (bf16 under train.py on GPUs), else x's own."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


ADDED_BY_RESIDUAL = ("sites.", "connections.", "null")  # names a baseline checkpoint lacks


# ----------------------------------------------------------------------------------------------
# The model.

class GPT(nn.Module):
    """The decoder with config.residual's residual; forward(idx, targets) -> (logits, loss)."""

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
        n_sites, hyper = 2 * config.n_layer + 1, config.residual == "hyper"  # 2L + 1 sites
        self.sites = nn.ModuleList([RouteSite(config) for _ in range(n_sites)]
                                   ) if config.routed else None
        self.connections = nn.ModuleList([HyperConnection(config, j) for j in range(n_sites - 1)]
                                         ) if hyper else None
        self.null = nn.Parameter(torch.zeros(config.n_embd)) if config.delta else None
        self.norm = RMSNorm(config.n_embd, config.norm_eps)
        self.lm_head = LMHead(config)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.weight  # tied input and output embeddings
        self.register_buffer("rope_cos", None, persistent=False)  # computed, not stored: (T, hd/2)
        self.register_buffer("rope_sin", None, persistent=False)
        self.init_weights()

    def forward_routed(self, x, at, history, cache=None):
        """The routed Transformer (attnres, mhar): each sublayer reads a route over the raw outputs
        before it and appends its own; the final site reads all 2L + 1 sources."""
        history.append(x.to(compute_dtype(x)))  # s_0, stored as the sublayer outputs (bf16 on GPUs)
        for j in range(len(self.layers)):
            history.append(self.sublayer(j, history.read(j), at, cache))  # s_{j+1}
        return history.read(len(self.layers))

    def hidden(self, idx, visit=None, cache=None, at=None):
        """The final normed hidden state (B, T, d) of tokens idx (B, T). visit(V, q, g), for
        analysis, sees every routing site's sources and parameters; cache, when generating, is one
        KVCache per sublayer holding the tokens before idx; at: a padded batch's Positions."""
        if at is None:
            start = 0 if cache is None else cache[0].length
            at = token_positions(self.rope_cos, self.rope_sin, start, idx.size(1))
        x = self.embed(idx)                                          # (B, T, d): source s_0
        if self.config.delta:
            x = forward_delta(self, x, at, self.new_history(visit), cache)
        elif self.config.routed:
            x = self.forward_routed(x, at, self.new_history(visit), cache)
        elif self.config.residual == "hyper":
            x = forward_hyper(self, x, at, cache)
        else:
            x = forward_baseline(self, x, at, cache)
        return self.norm(x)

    def forward(self, idx, targets=None, loss_fn=None):
        """(logits (B, T, vocab) in fp32, mean cross-entropy with targets (B, T)) of tokens idx
        (B, T). loss_fn(hidden, weight, targets) (lib.head.linear_cross_entropy, in training and
        validation) computes the loss without the B * T * vocab logits: then (None, loss)."""
        h = self.hidden(idx)                                         # (B, T, d)
        if loss_fn is not None:
            return None, self.lm_head.loss(h, targets, loss_fn)
        logits = self.lm_head(h).float()                             # (B, T, vocab)
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))

    def sublayer(self, j, x, at, cache=None):
        """Sublayer j (attention for even j, MLP for odd j) on its input x (B, T, d); with
        config.checkpointing, only x is kept and the activations recomputed in backward."""
        cache = None if cache is None else cache[j]  # a cache would take the recomputed keys too
        if self.config.checkpointing and torch.is_grad_enabled() and cache is None:
            return checkpoint(self.layers[j], x, at, cache, use_reentrant=False)
        return self.layers[j](x, at, cache)

    def new_history(self, visit=None):
        """An empty depth history for one forward pass: readable, or routed by kernel.py's Triton
        kernels (config.fused); visit(V, q, g), for analysis, sees each read of a readable one."""
        c = self.config
        queries = [site.query / c.route_temperature if c.route_temperature != 1 else site.query
                   for site in self.sites]                           # q / tau of each site, (d,)
        norms = [site.norm_weight for site in self.sites]            # g of each site, (d,)
        history = depth_history(queries, norms, c.depth_heads, c.norm_eps, c.route_block, self.null)
        if visit is not None:
            history.visit = visit
        elif c.fused:
            import kernel
            reads = site_reads(len(self.sites), c.route_block, c.delta)
            return kernel.FusedHistory(history, reads, group=c.fused_group)
        return history

    def init_weights(self, modules=None):
        """Every tensor's start, or these modules' alone (e.g. those a checkpoint lacks)."""
        for module in self.modules() if modules is None else modules:
            if module is self:  # the rotary tables (computed, never stored), delta's null source
                self.compute_rotary(self.embed.weight.device)
                if self.null is not None:
                    nn.init.zeros_(self.null)
            elif isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
            elif isinstance(module, (RouteSite, HyperConnection)):
                module.init_weights()

    def _apply(self, fn, recurse=True):  # .to(dtype) would round the rotary angles: kept fp32
        super()._apply(fn, recurse)
        if self.rope_cos.dtype != torch.float32:
            self.compute_rotary(self.rope_cos.device)
        return self

    def compute_rotary(self, device):
        c = self.config
        self.rope_cos, self.rope_sin = rotary_tables(c.seq_len, c.head_width, c.rope_theta, device)

    # Analysis and conversion.
    @torch.no_grad()
    def routing_weights(self, idx):
        """α of every site for a batch: 2L+1 tensors (N_j, B, T, H), N_j as site_reads says."""
        c = self.config
        if not c.routed:
            raise ValueError(f"routing_weights: residual={c.residual!r} has no routing sites")
        alphas, H = [], c.depth_heads
        self.hidden(idx, visit=lambda V, q, g: alphas.append(route_weights(V, q, g, H, c.norm_eps)))
        return alphas

    @classmethod
    def from_baseline(cls, state_dict, config):
        """Identity-preserving conversion: a trained baseline's weights in a delta-routed model,
        whose zero gates make it compute exactly what the baseline did."""
        if not config.delta:
            raise ValueError("from_baseline: only delta routing starts as the baseline; "
                             "set Config.delta=True")
        model = cls(config)
        missing, unexpected = model.load_state_dict(state_dict, strict=False)
        missing = [k for k in missing if not k.startswith(ADDED_BY_RESIDUAL)]
        if missing or unexpected:
            raise ValueError(f"from_baseline: the checkpoint does not fit this shape (missing "
                             f"{missing[:3]}, unexpected {unexpected[:3]}); convert with the "
                             f"baseline's own preset and sizes")
        return model

    # Generation.
    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, vocab_limit=None,
                 cache=True, on_token=None):
        """Append max_new_tokens tokens to idx (B, T), sampled (temperature 0: the argmax; top_k: of
        the k likeliest; never an id >= vocab_limit, e.g. GPT-2's 50257). cache keeps the keys and
        values, each new token running alone (routing is per position); past the window (seq_len)
        each step runs the cropped window afresh, as uncached. on_token(ids (B, 1)) sees each."""
        kv = None                                                      # one KVCache per sublayer
        for _ in range(max_new_tokens):
            if cache and kv is not None and kv[0].length < self.config.seq_len:
                h = self.hidden(idx[:, -1:], cache=kv)                  # the newest token alone
            else:                     # uncached, the first step or a full cache: the whole window
                kv = [KVCache() for _ in self.layers] if cache else None
                h = self.hidden(idx[:, -self.config.seq_len:], cache=kv)
            logits = self.lm_head(h[:, -1]).float()                    # (B, vocab)
            if vocab_limit is not None:
                logits[:, vocab_limit:] = float("-inf")                # ids the tokenizer lacks
            if temperature == 0:
                next_id = logits.argmax(-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                next_id = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)
            idx = torch.cat((idx, next_id), dim=1)
            if on_token is not None:
                on_token(next_id)
        return idx

    # Accounting.
    def num_params(self, non_embedding=False):
        """Parameter count (a tied embedding and LM head counted once); non_embedding leaves out
        the input embedding, a lookup (an untied LM head is a matmul and stays in)."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.embed.weight.numel() if non_embedding else n

    def flops_per_token(self):
        """Training FLOPs per token (forward + backward), the routing included. Matmuls: 6 per
        weight (PaLM, arXiv:2204.02311, appendix B), the LM head's included, the embedding's (a
        lookup) not. Attention: 12 * L * n_head * head_dim * T (causal masking not discounted).
        Routing: ~8d per source read forward (norm, logit, mix), twice that backward.
        Hyper-connections: ~4 d n (n+2) per sublayer forward, twice that backward."""
        c = self.config
        matmul = sum(m.weight.numel() for m in self.modules() if isinstance(m, nn.Linear))
        attention = 12 * c.n_layer * c.n_head * c.head_width * c.seq_len
        reads = site_reads(2 * c.n_layer + 1, c.route_block, c.delta) if c.routed else ()
        routing = 24 * c.n_embd * sum(committed + partial for committed, partial in reads)
        n = c.hc_streams
        hyper = 2 * c.n_layer * 12 * c.n_embd * n * (n + 2) if c.residual == "hyper" else 0
        return 6 * matmul + attention + routing + hyper

    def param_groups(self):
        """Parameters by role: {"embedding", "matrices", "norms", "routing"}, each in exactly one;
        "routing" is what a residual mode adds to the baseline (sites, null source, connections)."""
        groups = {"embedding": [self.embed.weight], "matrices": [], "norms": [], "routing": []}
        for name, p in self.named_parameters():
            if p is self.embed.weight:
                continue
            added = name.startswith(ADDED_BY_RESIDUAL)
            groups["routing" if added else "matrices" if p.dim() == 2 else "norms"].append(p)
        assert sum(map(len, groups.values())) == len(list(self.parameters())), "a lost parameter"
        return groups


# ----------------------------------------------------------------------------------------------
# The other residual modes: block and delta routing, the baseline, hyper-connections.

class BlockHistory(DepthHistory):
    """Block routing (Block AttnRes, Kimi Team, 2026) with blocks of S sublayers: b_0 = s_0, then
    b_n = the sum of the outputs of the S sublayers of block n. A site reads the completed blocks,
    plus the current block's partial sum once it has begun; S = 1 is full routing."""

    def __init__(self, queries, norms, heads, eps, block):
        super().__init__(queries, norms, heads, eps)                 # self.sources: b_0, b_1, ...
        self.block = block
        self.partial, self.in_block = None, 0      # the current block's sum, of how many outputs

    def append(self, source):
        if not self.sources:
            self.sources.append(source)                              # b_0 = s_0, the embedding
            return
        self.partial = source if self.partial is None else self.partial + source
        self.in_block += 1
        if self.in_block == self.block:                              # the block is complete
            self.sources.append(self.partial)
            self.partial, self.in_block = None, 0

    def stack(self):
        partial = [] if self.partial is None else [self.partial]
        return torch.stack(self.sources + partial)                   # (N, B, T, d)


class DeltaHistory(BlockHistory):
    """Delta routing reads [null, D_0, D_1, ...]: a learnable null source (zero at init), s_0, the
    completed block deltas D_i = h_end - h_start; the current one is in the residual x."""

    def __init__(self, queries, norms, heads, eps, block, null):
        super().__init__(queries, norms, heads, eps, block)
        self.null = null                                             # (d,)

    def append(self, source):
        if not self.sources:                                         # null, then D_0 = s_0
            self.sources += [self.null.to(source.dtype).expand_as(source), source]
        else:
            super().append(source)

    def stack(self):
        return torch.stack(self.sources)                             # (N, B, T, d): no partial sum


def depth_history(queries, norms, heads, eps, block=1, null=None):
    """An empty readable history: full routing, Block AttnRes (block > 1), delta routing (null)."""
    if null is not None:
        return DeltaHistory(queries, norms, heads, eps, block, null)
    if block > 1:
        return BlockHistory(queries, norms, heads, eps, block)
    return DepthHistory(queries, norms, heads, eps)


def site_reads(n_sites, block=1, delta=False):
    """((committed, partial), ...) per site: after the (j+1)-th append, site j reads the first
    `committed` sources of its depth history and, if partial, its block's partial sum."""
    if delta:
        return tuple((2 + j // block, False) for j in range(n_sites))
    return tuple((1 + j // block, j % block != 0) for j in range(n_sites))


def forward_delta(gpt, x, at, history, cache=None):
    """Delta routing: the baseline's residual x plus a gated route over [null, D_0, D_1, ...]."""
    history.append(x.to(compute_dtype(x)))   # D_0 = s_0, stored as the block deltas (bf16 on GPUs)
    for j, site in enumerate(gpt.sites[:-1]):
        y = gpt.sublayer(j, x + site.gate * history.read(j), at, cache)
        history.append(y)  # the history sums these into block deltas D_i = h_end - h_start
        x = x + y
    return x + gpt.sites[-1].gate * history.read(len(gpt.layers))


def forward_baseline(gpt, x, at, cache=None):
    """The pre-norm residual stream: x = x + f(RMSNorm(x)) after every sublayer."""
    for j in range(len(gpt.layers)):
        x = x + gpt.sublayer(j, x, at, cache)
    return x


def forward_hyper(gpt, x, at, cache=None):
    """n residual streams, each starting as s_0; every sublayer reads, mixes and writes them."""
    streams = x.unsqueeze(2).repeat(1, 1, gpt.config.hc_streams, 1)  # (B, T, n, d)
    for j, connection in enumerate(gpt.connections):
        streams = connection(streams, lambda h: gpt.sublayer(j, h, at, cache))
    # Zhu et al. sum the streams; their mean starts as the baseline exactly, not up to eps
    return streams.mean(2)


class HyperConnection(nn.Module):
    """Hyper-connections (Zhu et al., 2024, arXiv:2409.19606) around one sublayer, over n residual
    streams H (B, T, n, d): the sublayer reads h = sum_i read[i] H_i and its output y is written
    back as H'_k = sum_i mix[i, k] H_i + write[k] y. Each of read (n), mix (n x n) and write (n) is
    a static parameter plus a dynamic, per-token part scale * tanh(RMSNorm(H) W). At init read is
    one-hot on stream j mod n, mix = I, write = 1, W = 0, the scales 0.01 (small, learnable, as Zhu
    et al.): every stream carries the plain residual sum, and the network starts as the baseline."""

    def __init__(self, config, index):
        super().__init__()
        n, d = config.hc_streams, config.n_embd
        self.index = index                                  # the stream the static read starts on
        self.static_read = nn.Parameter(torch.zeros(n))
        self.static_mix = nn.Parameter(torch.zeros(n, n))
        self.static_write = nn.Parameter(torch.zeros(n))
        self.norm = RMSNorm(d, config.norm_eps)
        self.dynamic_read_mix = nn.Parameter(torch.zeros(d, n + 1))  # stream i: read[i], mix[i, :]
        self.dynamic_write = nn.Parameter(torch.zeros(d, 1))          # stream i -> write[i]
        self.read_mix_scale = nn.Parameter(torch.zeros(()))
        self.write_scale = nn.Parameter(torch.zeros(()))

    def init_weights(self):
        n = self.static_read.numel()
        with torch.no_grad():
            self.static_read.copy_(F.one_hot(torch.tensor(self.index % n), n))
            self.static_mix.copy_(torch.eye(n))
            self.static_write.fill_(1.0)
            self.dynamic_read_mix.zero_()
            self.dynamic_write.zero_()
            self.read_mix_scale.fill_(0.01)
            self.write_scale.fill_(0.01)

    def forward(self, streams, sublayer):
        """streams (B, T, n, d) -> (B, T, n, d); sublayer maps its input (B, T, d) to its output."""
        normed = self.norm(streams)                                               # (B, T, n, d)
        read_mix = self.read_mix_scale * torch.tanh(normed @ self.dynamic_read_mix)  # (B,T,n,n+1)
        read = self.static_read + read_mix[..., 0]                                # (B, T, n)
        mix = self.static_mix + read_mix[..., 1:]                                 # (B, T, n, n)
        dynamic_write = torch.tanh(normed @ self.dynamic_write).squeeze(-1)       # (B, T, n)
        write = self.static_write + self.write_scale * dynamic_write              # (B, T, n)
        y = sublayer(torch.einsum("btn,btnd->btd", read, streams))                # (B, T, d)
        return torch.einsum("btik,btid->btkd", mix, streams) + write.unsqueeze(-1) * y.unsqueeze(2)


# ----------------------------------------------------------------------------------------------
# The config's checks, and the presets.

def check_config(c):
    """A ValueError naming the field and the fix for each mistake a user can make in a Config."""
    def check(ok, message):
        if not ok:
            raise ValueError(f"Config.{message}")
    for size in ("vocab_size", "seq_len", "n_layer", "n_embd", "n_head", "n_kv_head", "ffn_hidden"):
        check(getattr(c, size) >= 1, f"{size}: must be >= 1, not {getattr(c, size)}")
    check(c.head_dim >= 0, f"head_dim: must be >= 0 (0 = n_embd / n_head), not {c.head_dim}")
    modes = ("attnres", "mhar", "baseline", "hyper")
    check(c.residual in modes, f"residual: unknown {c.residual!r}; use one of {modes}")
    d, H, unrouted = c.n_embd, c.depth_heads, f"{c.residual} has no routing sites"
    check(c.head_dim or d % c.n_head == 0, f"n_head: {c.n_head} heads do not divide n_embd={d}; "
          f"or set head_dim")
    check(c.head_width % 2 == 0, "head_dim: rotary embeddings need an even head width")
    check(c.n_head % c.n_kv_head == 0,
          f"n_kv_head: {c.n_kv_head} does not divide n_head={c.n_head}; use a divisor of it")
    check(not c.routed or H > 0 and d % H == 0, f"route_heads: H={H} must divide n_embd={d}")
    for name in ("rope_theta", "norm_eps", "route_temperature"):
        check(0 < getattr(c, name) < float("inf"),
              f"{name}: must be a positive number, not {getattr(c, name)}")
    check(0 <= c.query_init_std < float("inf"), f"query_init_std: must be >= 0 (0: zero queries), "
          f"not {c.query_init_std}")
    check(c.route_block >= 1, "route_block: must be >= 1; 1 is full routing")
    for name in ("route_temperature", "route_block", "delta", "fused"):  # at their defaults
        check(c.routed or getattr(c, name) == getattr(Config, name),
              f"{name}: {unrouted}; use mhar or attnres")
    check(c.fused_group >= 0, "fused_group: must be >= 0; 0 is automatic, 1 one pass per site")
    check(c.hc_streams >= 1, "hc_streams: hyper-connections need at least one stream")


# The paper's shapes with H = 8 routing heads, its later version's choice at every scale (earlier:
# H = n_kv_head and random queries, query_init_std=0.02). The CPU-sized presets keep H = n_kv_head:
# tiny for the tests, small for the CPU demo, small-bytes (on UTF-8 bytes) for CPU comparisons.
PRESETS = {
    "tiny":  Config(seq_len=64, n_layer=2, n_embd=64, n_head=4, n_kv_head=2, ffn_hidden=192),
    "small": Config(seq_len=256, n_layer=4, n_embd=128, n_head=4, n_kv_head=2, ffn_hidden=384),
    "small-bytes": Config(vocab_size=320, seq_len=256, n_layer=4, n_embd=128, n_head=4, n_kv_head=2,
                          ffn_hidden=384),  # small on UTF-8 bytes: 257 ids padded to 320
    "100m":  Config(seq_len=2048, n_layer=12, n_embd=512, n_head=8, n_kv_head=4, ffn_hidden=1536,
                    route_heads=8),
    "350m":  Config(seq_len=1024, n_layer=24, n_embd=1024, n_head=16, n_kv_head=8, ffn_hidden=4096,
                    route_heads=8),
    "1b":    Config(seq_len=1024, n_layer=36, n_embd=1280, n_head=16, n_kv_head=8, ffn_hidden=5120,
                    route_heads=8),
}


def preset(name, **overrides):
    """A preset Config with some fields replaced, e.g. preset("100m", residual="attnres")."""
    if name not in PRESETS:
        raise ValueError(f"preset {name!r} is unknown; use one of {sorted(PRESETS)}")
    return replace(PRESETS[name], **overrides)
