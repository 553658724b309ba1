"""
Fused Triton kernels for the multi-head depth route of MHAR (DESIGN §2.2, §4).

The readable reference is `mhar.route(V, q, g, heads)`: sources V (N, B, T, d), a pseudo-query q
and an RMSNorm weight g of width d, H heads of width K = d / H. Per position and source n:
r_n = rsqrt(mean(V_n²) + eps) over the full width, logits ℓ[n, h] = r_n·<q_h ⊙ g_h, V_n,h>,
α[:, h] = softmax over n, output slice h = Σ_n α[n, h]·V_n,h.

Memory traffic, counted in bytes per source element (bf16 storage, E = B·T·d elements per
source, a site reads N sources). Routing is memory-bound, so these counts are the cost:

  readable eager forward   ≈ 68 B: torch.stack (read 2 + write 2), V.float() twice (2 + 4 each),
                           then pow, mean, ·r, ·g, ·q, sum over K, α·V, sum over n: each reads
                           and most write an fp32 copy of all N·E elements; autograd keeps
                           several of those copies alive for backward (why it runs out of memory).
  fused forward            = 2 B: each source row is read once; the RMS statistic, norm, logits,
                           online softmax and mix happen in registers. Per site, not per source:
                           the output (2 B·E) and α (4·N·B·T·H bytes, a factor d/H below V).
  fused backward           = 12 B: pass 1 reads the rows (2) for the softmax coupling term, pass 2
                           reads them again (2) and read-modify-writes the fp32 source-gradient
                           buffer (4 + 4). Per site: dout (2 B·E), the dq/dg partials (2·4 B·E
                           written, read again by the torch sum).

So a whole network (2L + 1 sites, Σ_j N_j = (2L+1)(2L+2)/2 source rows) moves at least
14 B·E·Σ_j N_j with this one-pass-per-site algorithm: the floor DESIGN §5 quotes
(2.9 / 5.4 / 14.8 ms on an H100 at the paper's 100M / 350M / 1B kernel-table shapes).
`FusedHistory` adds one copy per site (2 + 2 B·E) to write each source into the shared buffer.

The backward is bitwise deterministic: every position is owned by one program, which
read-modify-writes its own rows of the gradient buffer (no atomics), and dq, dg leave as
per-position partials that torch sums in a fixed order.

Without a CUDA GPU the kernels run in the Triton interpreter, on CPU tensors, when
TRITON_INTERPRET=1 is set before this file is imported (slow; for tests). `python kernel.py`
checks the kernels against `mhar.route`, then benchmarks them when a GPU is present.
"""
import os
from functools import partial

import torch

if __name__ == "__main__" and not torch.cuda.is_available():
    # `python kernel.py` without a GPU runs its check in the interpreter, which triton.jit
    # consults when it decorates the kernels below: switch it on before importing triton.
    os.environ.setdefault("TRITON_INTERPRET", "1")

UNAVAILABLE = ("fused routing needs a CUDA GPU, or TRITON_INTERPRET=1 set before triton is imported "
               "to run the kernels on the CPU (slow; for tests)")
try:
    import triton
    import triton.language as tl
except ImportError as error:
    raise RuntimeError(f"{UNAVAILABLE}; triton is not installed (pip install triton)") from error

# One program holds a position's whole row of width d as an (H_PAD, K_PAD) fp32 tile, several
# times over (the source, q·g, dout, the output or the dq/dg accumulator). At 16 warps ptxas
# (sm_90) keeps an 8192-element tile in registers; at 16384 the backward spills heavily.
MAX_TILE = 8192
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)


# N and M stay runtime integers: triton would turn a value of 1 into a constexpr (no `.to`), and
# specializing on N's divisibility by 16 would compile more variants for no gain.
@triton.jit(do_not_specialize=["N", "M"])
def _route_forward_kernel(
    sources_ptr,        # [rows, M, D] source buffer (fp32 or bf16); rows [0, N) are read
    q_ptr,              # [D] pseudo-query of the site
    g_ptr,              # [D] RMSNorm weight of the site
    out_ptr,            # [M, D] routed output, written in the sources' dtype
    alpha_ptr,          # [N, M, H] fp32 routing weights, written: the only thing backward keeps
    N,                  # number of sources this site reads
    M,                  # number of positions B·T (= the number of programs)
    eps,                # RMSNorm epsilon
    D: tl.constexpr,    # width d
    H: tl.constexpr,    # heads
    K: tl.constexpr,    # head width d / H
    H_PAD: tl.constexpr,  # next power of two >= H
    K_PAD: tl.constexpr,  # next power of two >= K
    N_PAD: tl.constexpr,  # next power of two >= N: the logits of all sources stay in registers
):
    position = tl.program_id(0).to(tl.int64)
    row_stride = M.to(tl.int64) * D                  # int64: rows · B·T·d passes 2^31 at large batches
    alpha_stride = M.to(tl.int64) * H
    heads = tl.arange(0, H_PAD)
    lanes = tl.arange(0, K_PAD)
    rows = tl.arange(0, N_PAD)                       # source indices
    # The row of width d seen as H head slices of width K; K need not be a power of two.
    cols = heads[:, None] * K + lanes[None, :]                           # (H_PAD, K_PAD)
    mask = (heads[:, None] < H) & (lanes[None, :] < K)
    # ℓ[n, h] = r_n·<q_h ⊙ g_h, V_n,h>: fold g into the query once instead of norming every source.
    qg = (tl.load(q_ptr + cols, mask=mask, other=0.0).to(tl.float32)
          * tl.load(g_ptr + cols, mask=mask, other=0.0).to(tl.float32))

    row_max = tl.full([H_PAD], float("-inf"), tl.float32)                # online softmax, per head
    row_sum = tl.zeros([H_PAD], tl.float32)
    acc = tl.zeros([H_PAD, K_PAD], tl.float32)                           # Σ_n exp(ℓ_n - max)·V_n
    logits = tl.zeros([N_PAD, H_PAD], tl.float32)
    for n in range(0, N):
        v = tl.load(sources_ptr + n * row_stride + position * D + cols, mask=mask, other=0.0).to(tl.float32)
        r = tl.rsqrt(tl.sum(tl.sum(v * v, axis=1), axis=0) / D + eps)   # RMS over the full width
        logit = r * tl.sum(v * qg, axis=1)                               # (H_PAD,)
        new_max = tl.maximum(row_max, logit)
        rescale = tl.exp(row_max - new_max)
        weight = tl.exp(logit - new_max)
        row_sum = row_sum * rescale + weight
        acc = acc * rescale[:, None] + weight[:, None] * v
        row_max = new_max
        logits = tl.where(rows[:, None] == n, logit[None, :], logits)

    out = acc / row_sum[:, None]
    tl.store(out_ptr + position * D + cols, out.to(out_ptr.dtype.element_ty), mask=mask)
    alpha = tl.exp(logits - row_max[None, :]) / row_sum[None, :]
    alpha_mask = (rows[:, None] < N) & (heads[None, :] < H)
    tl.store(alpha_ptr + rows[:, None] * alpha_stride + position * H + heads[None, :], alpha, mask=alpha_mask)


@triton.jit(do_not_specialize=["N", "M"])
def _route_backward_kernel(
    sources_ptr,        # [rows, M, D] source buffer (fp32 or bf16); rows [0, N) are read
    q_ptr,              # [D] pseudo-query of the site
    g_ptr,              # [D] RMSNorm weight of the site
    alpha_ptr,          # [N, M, H] fp32 routing weights saved by the forward
    dout_ptr,           # [M, D] gradient of the routed output
    dsources_ptr,       # [rows, M, D] fp32 source gradients: rows [0, N) accumulated in place
    dq_ptr,             # [M, D] fp32 per-position partials of dq, written
    dg_ptr,             # [M, D] fp32 per-position partials of dg, written
    N,                  # number of sources this site reads
    M,                  # number of positions B·T (= the number of programs)
    eps,                # RMSNorm epsilon
    D: tl.constexpr,    # width d
    H: tl.constexpr,    # heads
    K: tl.constexpr,    # head width d / H
    H_PAD: tl.constexpr,  # next power of two >= H
    K_PAD: tl.constexpr,  # next power of two >= K
):
    position = tl.program_id(0).to(tl.int64)
    row_stride = M.to(tl.int64) * D
    alpha_stride = M.to(tl.int64) * H
    heads = tl.arange(0, H_PAD)
    lanes = tl.arange(0, K_PAD)
    cols = heads[:, None] * K + lanes[None, :]                           # (H_PAD, K_PAD)
    mask = (heads[:, None] < H) & (lanes[None, :] < K)
    head_mask = heads < H
    qg = (tl.load(q_ptr + cols, mask=mask, other=0.0).to(tl.float32)
          * tl.load(g_ptr + cols, mask=mask, other=0.0).to(tl.float32))
    dout = tl.load(dout_ptr + position * D + cols, mask=mask, other=0.0).to(tl.float32)

    # Pass 1: the softmax couples the sources, dℓ[n, h] = α[n, h]·(<dout_h, V_n,h> − S_h) with
    # S_h = Σ_n α[n, h]·<dout_h, V_n,h>, so S must be complete before any dV_n can be emitted.
    coupling = tl.zeros([H_PAD], tl.float32)
    for n in range(0, N):
        v = tl.load(sources_ptr + n * row_stride + position * D + cols, mask=mask, other=0.0).to(tl.float32)
        a = tl.load(alpha_ptr + n * alpha_stride + position * H + heads, mask=head_mask, other=0.0)
        coupling += a * tl.sum(v * dout, axis=1)

    # Pass 2: recompute r_n (cheaper than saving it: backward reads the row anyway) and emit
    # dV_n = r·(g ⊙ dk) − (r³/d)·<g ⊙ dk, V_n>·V_n + α_n ⊙ dout, with dk = dℓ_n ⊗ q per head.
    qg_grad = tl.zeros([H_PAD, K_PAD], tl.float32)                       # Σ_n dℓ_n·r_n·V_n
    for n in range(0, N):
        v = tl.load(sources_ptr + n * row_stride + position * D + cols, mask=mask, other=0.0).to(tl.float32)
        a = tl.load(alpha_ptr + n * alpha_stride + position * H + heads, mask=head_mask, other=0.0)
        r = tl.rsqrt(tl.sum(tl.sum(v * v, axis=1), axis=0) / D + eps)
        dlogit = a * (tl.sum(v * dout, axis=1) - coupling)               # (H_PAD,)
        g_dk = dlogit[:, None] * qg
        dv = r * g_dk - (r * r * r / D) * tl.sum(tl.sum(g_dk * v, axis=1), axis=0) * v + a[:, None] * dout
        # This program owns the position, so the read-modify-write of its rows needs no atomics.
        dsources = dsources_ptr + n * row_stride + position * D + cols
        tl.store(dsources, tl.load(dsources, mask=mask, other=0.0) + dv, mask=mask)
        qg_grad += (dlogit * r)[:, None] * v

    # ℓ = <q, r·V ⊙ g> per head: dq = Σ_n dℓ_n·r_n·V_n ⊙ g and dg = Σ_n dℓ_n·r_n·V_n ⊙ q.
    # q and g are loaded again rather than kept: one tile fewer in registers during the loops.
    g = tl.load(g_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(dq_ptr + position * D + cols, qg_grad * g, mask=mask)
    q = tl.load(q_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(dg_ptr + position * D + cols, qg_grad * q, mask=mask)


# True when TRITON_INTERPRET=1 was set before import: triton.jit then made interpreted functions.
INTERPRETED = not isinstance(_route_forward_kernel, triton.runtime.JITFunction)


def _launch_config(sources, q, g, heads):
    """Tile shape and warps for the kernels; raises on what they cannot run."""
    d = sources.shape[-1]
    if sources.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"fused routing stores sources in float32 or bfloat16, got {sources.dtype}")
    if q.shape != (d,) or g.shape != (d,):
        raise ValueError(f"q and g must have shape ({d},) to match the sources, "
                         f"got {tuple(q.shape)} and {tuple(g.shape)}")
    if d % heads != 0:
        raise ValueError(f"the width d={d} must be divisible by heads={heads}")
    h_pad, k_pad = triton.next_power_of_2(heads), triton.next_power_of_2(d // heads)
    if h_pad * k_pad > MAX_TILE:
        raise ValueError(f"fused routing holds a row of width d={d} as a {h_pad}x{k_pad} tile; past {MAX_TILE} "
                         f"elements it does not fit in one program: use fused=False for this width")
    # About 8 elements of each tile per thread: one 16-byte load of bf16 (two of fp32), and few
    # enough that the tiles a program keeps stay in registers (ptxas, sm_90: no spills up to MAX_TILE).
    num_warps = min(max(h_pad * k_pad // 256, 1), 16)
    return dict(D=d, H=heads, K=d // heads, H_PAD=h_pad, K_PAD=k_pad, num_warps=num_warps)


def route_forward(sources, n, q, g, heads, eps):
    """Route over rows [0, n) of a contiguous source buffer [rows, B, T, d]:
    returns the output (B, T, d) in the sources' dtype and α [n, B·T, H] fp32."""
    config = _launch_config(sources, q, g, heads)
    rows, B, T, d = sources.shape
    out = torch.empty((B, T, d), dtype=sources.dtype, device=sources.device)
    alpha = torch.empty((n, B * T, heads), dtype=torch.float32, device=sources.device)
    _route_forward_kernel[(B * T,)](
        sources, q.contiguous(), g.contiguous(), out, alpha, n, B * T, eps,
        N_PAD=triton.next_power_of_2(n), **config,
    )
    return out, alpha


def route_backward(sources, n, q, g, alpha, dout, heads, eps, dsources):
    """Add the source gradients of rows [0, n) into the fp32 buffer dsources [rows, B, T, d]
    (in place) and return dq, dg (fp32, summed over positions)."""
    config = _launch_config(sources, q, g, heads)
    rows, B, T, d = sources.shape
    dq = torch.empty((B * T, d), dtype=torch.float32, device=sources.device)
    dg = torch.empty((B * T, d), dtype=torch.float32, device=sources.device)
    _route_backward_kernel[(B * T,)](
        sources, q.contiguous(), g.contiguous(), alpha, dout.contiguous(), dsources, dq, dg, n, B * T, eps,
        **config,
    )
    return dq.sum(0), dg.sum(0)


class _FusedRoute(torch.autograd.Function):
    """mhar.route on a stacked V: saves V (an input anyway) and α, not a single fp32 copy of V."""

    @staticmethod
    def forward(ctx, V, q, g, heads, eps):
        V = V.contiguous()
        out, alpha = route_forward(V, V.shape[0], q, g, heads, eps)
        ctx.save_for_backward(V, q, g, alpha)
        ctx.heads, ctx.eps = heads, eps
        return out

    @staticmethod
    def backward(ctx, dout):
        V, q, g, alpha = ctx.saved_tensors
        dV = torch.zeros(V.shape, dtype=torch.float32, device=V.device)
        dq, dg = route_backward(V, V.shape[0], q, g, alpha, dout, ctx.heads, ctx.eps, dV)
        return dV.to(V.dtype), dq.to(q.dtype), dg.to(g.dtype), None, None


class _HistoryRoute(torch.autograd.Function):
    """One site of a FusedHistory. Saves q, g and α; the source buffer stays outside autograd
    (later sites write later rows of it in place, which a saved tensor would forbid)."""

    @staticmethod
    def forward(ctx, source, q, g, history):
        site = history._append(source)
        out, alpha = route_forward(history.sources, site + 1, q, g, history.heads, history.eps)
        ctx.save_for_backward(q, g, alpha)
        ctx.history, ctx.site = history, site
        return out

    @staticmethod
    def backward(ctx, dout):
        history, site = ctx.history, ctx.site
        q, g, alpha = ctx.saved_tensors
        grads = history._backward_rows(site)
        dq, dg = route_backward(history.sources, site + 1, q, g, alpha, dout, history.heads, history.eps, grads)
        # Sites after this one have already added their share of row `site` (they ran first),
        # and sites before it never read it: its gradient is complete.
        dsource = grads[site].to(history.source_dtypes[site])
        return dsource, dq.to(q.dtype), dg.to(g.dtype), None


def check_available(device=None):
    """Raise unless the kernels can run: compiled on a CUDA GPU, or interpreted (on CPU tensors).
    With a device, the tensors that will be routed must be on it; without, any GPU will do."""
    on_gpu = torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda")
    if not (INTERPRETED or on_gpu):
        raise RuntimeError(UNAVAILABLE)


def fused_route(V, q, g, heads, eps=1e-6):
    """The multi-head depth route, fused: same contract as mhar.route (V (N, B, T, d) -> (B, T, d)
    in V.dtype, computed in float32; gradients in the dtypes of V, q, g)."""
    check_available(V.device)
    return _FusedRoute.apply(V, q, g, heads, eps)


class FusedHistory:
    """The depth history of ONE forward pass, in one shared buffer [n_sources, B, T, d].

    Each call to `route(source, q, g)` writes `source` into the next row and routes over all rows
    written so far. Backward accumulates every site's source gradients into one fp32 buffer;
    that is exact only if the sites backpropagate once each, last site first — which autograd
    does for a chain where each site's output feeds the sublayer that produces the next source.
    Activation checkpointing (re-running forwards) and a second backward through the same graph
    break that; both raise.
    """

    def __init__(self, n_sources, heads, eps=1e-6):
        self.n_sources, self.heads, self.eps = n_sources, heads, eps
        self.sources = None             # [n_sources, B, T, d] in the first source's dtype, at the first route
        self.source_dtypes = []         # dtype of each appended source: its gradient leaves in it
        self.grads = None               # [n_sources, B, T, d] fp32, at the first backward
        self.last_backward = None       # the site whose backward ran last: the next must be earlier

    def route(self, source, q, g):
        """Append `source` (B, T, d) as the next row and route over all rows: (B, T, d)."""
        return _HistoryRoute.apply(source, q, g, self)

    def _append(self, source):
        site = len(self.source_dtypes)
        if self.last_backward is not None:
            raise RuntimeError("FusedHistory.route ran after backward began; activation checkpointing re-runs "
                               "forwards during backward, which the shared buffer cannot support: "
                               "use fused=False or no activation checkpointing")
        if site == self.n_sources:
            raise RuntimeError(f"FusedHistory.route called more than n_sources={self.n_sources} times; a history "
                               f"serves one forward pass (activation checkpointing re-running the forward also "
                               f"does this: use fused=False or no activation checkpointing)")
        if self.sources is None:
            check_available(source.device)
            self.sources = torch.empty((self.n_sources, *source.shape), dtype=source.dtype, device=source.device)
        elif source.shape != self.sources.shape[1:]:
            raise ValueError(f"source {site} has shape {tuple(source.shape)}, "
                             f"the history holds {tuple(self.sources.shape[1:])}")
        self.sources[site].copy_(source)
        self.source_dtypes.append(source.dtype)
        return site

    def _backward_rows(self, site):
        """The fp32 gradient buffer, after checking that backward runs in reverse site order."""
        if self.last_backward is not None and site >= self.last_backward:
            raise RuntimeError(f"FusedHistory: the backward of routing site {site} ran after that of site "
                               f"{self.last_backward}; the shared gradient buffer needs each site to backpropagate "
                               f"once, last site first. A second backward through the same graph (retain_graph) "
                               f"or activation checkpointing (torch.utils.checkpoint) breaks that: use fused=False "
                               f"or no activation checkpointing, and one backward per forward")
        self.last_backward = site
        if self.grads is None:
            self.grads = torch.zeros(self.sources.shape, dtype=torch.float32, device=self.sources.device)
        return self.grads


def _stacked_network(route, s0, qs, gs, heads, sublayer):
    """Every site of a network, stacking the sources for each site as the readable path does;
    `sublayer` turns site j's output into source j+1."""
    sources = [s0]
    h = route(torch.stack(sources), qs[0], gs[0], heads)
    for q, g in zip(qs[1:], gs[1:]):
        sources.append(sublayer(h))
        h = route(torch.stack(sources), q, g, heads)
    return h


def _fused_network(s0, qs, gs, heads, sublayer):
    """The same network through one FusedHistory."""
    history = FusedHistory(len(qs), heads)
    h = history.route(s0, qs[0], gs[0])
    for q, g in zip(qs[1:], gs[1:]):
        h = history.route(sublayer(h), q, g)
    return h


def _relative_error(a, b):
    # clamped: with one source the softmax is constant and dq = dg = 0 exactly on both sides
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def _check(device, shapes, sites):
    """fused_route and FusedHistory against mhar.route: output and every gradient, fp32 and bf16.
    bf16 is compared with the float32 reference on the same bf16-rounded inputs."""
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 1e-2}             # bf16 outputs and dV are rounded to 8 bits
    # Along a chain of sites the two paths' roundings compound, and dq, dg come from a
    # cancellation (<dout, V_n> − S) that magnifies them: ~1e-5 in fp32 at 25 sites, a few % in bf16.
    chain_tolerance = {torch.float32: 1e-4, torch.bfloat16: 5e-2}
    failed = False
    for dtype in SUPPORTED_DTYPES:
        for N, B, T, d, heads in shapes:
            V = torch.randn(N, B, T, d, device=device).to(dtype)
            q, g = 0.3 * torch.randn(d, device=device), 1 + 0.1 * torch.randn(d, device=device)
            dout = torch.randn(B, T, d, device=device).to(dtype)
            results = []
            for route, inputs in ((fused_route, (V, q, g)), (mhar.route, (V.float(), q, g))):
                inputs = [x.clone().requires_grad_() for x in inputs]
                out = route(*inputs, heads)
                out.backward(dout.to(out.dtype))
                results.append([out] + [x.grad for x in inputs])
            errors = [_relative_error(a, b) for a, b in zip(*results)]
            failed |= max(errors) > tolerance[dtype]
            print(f"fused_route   {str(dtype)[6:]:8} N={N:<3} B·T={B * T:<5} d={d:<5} H={heads:<2} "
                  + "  ".join(f"{name} {e:.1e}" for name, e in zip(("out", "dV", "dq", "dg"), errors)))

        N, B, T, d, heads = shapes[-1]
        s0 = torch.randn(B, T, d, device=device).to(dtype)
        qs = [0.3 * torch.randn(d, device=device) for _ in range(sites)]
        gs = [1 + 0.1 * torch.randn(d, device=device) for _ in range(sites)]
        dout = torch.randn(B, T, d, device=device).to(dtype)
        results = []
        for network in (_fused_network, partial(_stacked_network, mhar.route)):
            leaves = [x.clone().requires_grad_() for x in [s0, *qs, *gs]]
            # sin as the sublayer: an identity would make later sources copies of mixes of earlier ones
            out = network(leaves[0], leaves[1:sites + 1], leaves[sites + 1:], heads, torch.sin)
            out.backward(dout)
            # dq and dg of all sites as one vector each: at site 0 (one source) they are exactly zero
            results.append([out, leaves[0].grad, torch.cat([x.grad for x in leaves[1:sites + 1]]),
                            torch.cat([x.grad for x in leaves[sites + 1:]])])
        errors = [_relative_error(a, b) for a, b in zip(*results)]
        failed |= max(errors) > chain_tolerance[dtype]
        print(f"FusedHistory  {str(dtype)[6:]:8} {sites} sites, B·T={B * T:<5} d={d:<5} H={heads:<2} "
              + "  ".join(f"{name} {e:.1e}" for name, e in zip(("out", "ds0", "dq", "dg"), errors)))
    print("check FAILED" if failed else "check passed")
    return not failed


# DESIGN §5, the paper's kernel table: (preset, d, L, B, T, H = n_kv_head), bf16 sources.
KERNEL_TABLE = [("100m", 512, 12, 2, 2048, 4), ("350m", 1024, 24, 1, 1024, 8), ("1b", 1280, 36, 1, 1024, 8)]


def _benchmark():
    """Route every site of a network (identity sublayers), forward and forward+backward: readable,
    compiled, fused. Returns the fused forward+backward ms per shape."""
    from triton.testing import do_bench
    x = torch.empty(2**28, device="cuda")
    y = torch.empty_like(x)
    bandwidth = 2 * x.nbytes / do_bench(lambda: y.copy_(x), return_mode="median") / 1e6   # GB/s, read + write
    del x, y
    print(f"\n{torch.cuda.get_device_name()}: copy bandwidth {bandwidth:.0f} GB/s. GB/s below count the one-pass "
          f"floor's bytes (bf16 reads: 2 B per source element forward, 14 B forward+backward) over the time taken.")
    compiled = torch.compile(mhar.route, dynamic=True)
    networks = {"eager": partial(_stacked_network, mhar.route), "compile": partial(_stacked_network, compiled),
                "fused": _fused_network}
    identity = torch.nn.Identity()                                      # only the routing is timed
    routing = {}                                                        # fused fwd+bwd ms per shape
    print(f"{'shape':6} {'method':8} {'fwd ms':>9} {'GB/s':>7} {'fwd+bwd ms':>11} {'GB/s':>7} {'% of copy':>9}")
    for preset, d, L, B, T, heads in KERNEL_TABLE:
        sites = 2 * L + 1
        elements = sites * (sites + 1) // 2 * B * T * d                 # Σ_j N_j source rows of B·T·d
        floor_forward, floor = 2 * elements, 14 * elements              # bytes
        print(f"{preset:6} {'floor':8} {floor_forward / bandwidth / 1e6:9.2f} {bandwidth:7.0f} "
              f"{floor / bandwidth / 1e6:11.2f} {bandwidth:7.0f} {100:9.0f}")
        s0 = torch.randn(B, T, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        qs = [(0.02 * torch.randn(d, device="cuda")).requires_grad_() for _ in range(sites)]
        gs = [torch.ones(d, device="cuda", requires_grad=True) for _ in range(sites)]
        dout = torch.randn(B, T, d, device="cuda", dtype=torch.bfloat16)
        for method, network in networks.items():
            try:
                with torch.no_grad():
                    forward = do_bench(lambda: network(s0, qs, gs, heads, identity), return_mode="median")
                both = do_bench(lambda: network(s0, qs, gs, heads, identity).backward(dout),
                                grad_to_none=[s0, *qs, *gs], return_mode="median")
            except torch.cuda.OutOfMemoryError:
                print(f"{preset:6} {method:8} {'OOM':>9}")
                continue
            finally:
                torch.cuda.empty_cache()
            print(f"{preset:6} {method:8} {forward:9.2f} {floor_forward / forward / 1e6:7.0f} {both:11.2f} "
                  f"{floor / both / 1e6:7.0f} {100 * floor / both / 1e6 / bandwidth:9.0f}")
            if method == "fused":
                routing[preset] = both
    return routing


def _step_benchmark(routing):
    """A whole training step (forward + backward, bf16 autocast, one microbatch of the kernel-table
    shape): MHAR eager and fused against the baseline, and the fused routing's share of the step."""
    from triton.testing import do_bench
    print(f"\n{'shape':6} {'baseline ms':>11} {'MHAR eager ms':>13} {'MHAR fused ms':>13} {'fused speed':>11} "
          f"{'routing share':>13}   (speed: baseline ms / fused ms, the paper's 0.88 / 0.71 / 0.55)")
    for preset, d, L, B, T, heads in KERNEL_TABLE:
        idx = torch.randint(0, 50257, (B, T), device="cuda")
        step_ms = {}
        for name, overrides in (("baseline", dict(residual="baseline")), ("eager", dict(residual="mhar")),
                                ("fused", dict(residual="mhar", fused=True))):
            model = mhar.GPT(mhar.preset(preset, **overrides)).cuda()

            def step():
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = model(idx, idx)[1]
                loss.backward()
            try:
                step_ms[name] = do_bench(step, grad_to_none=list(model.parameters()), return_mode="median")
            except torch.cuda.OutOfMemoryError:
                step_ms[name] = float("nan")                            # the paper's eager 1B runs out too
            finally:
                del model
                torch.cuda.empty_cache()
        print(f"{preset:6} {step_ms['baseline']:11.1f} {step_ms['eager']:13.1f} {step_ms['fused']:13.1f} "
              f"{step_ms['baseline'] / step_ms['fused']:10.2f}x {100 * routing[preset] / step_ms['fused']:12.0f}%")


if __name__ == "__main__":
    import sys

    import mhar

    torch.manual_seed(0)
    if torch.cuda.is_available() and not INTERPRETED:
        # (N, B, T, d, H): one source; odd widths; the 1B width; the deepest site of 350M at H = 4
        shapes = [(1, 2, 33, 40, 8), (9, 3, 65, 520, 8), (25, 1, 257, 1280, 8), (49, 1, 129, 1024, 4)]
        ok = _check("cuda", shapes, sites=25)
        _step_benchmark(_benchmark())
    else:
        print("no CUDA GPU: checking the kernels in the Triton interpreter on small shapes; no benchmark")
        ok = _check("cpu", [(1, 1, 3, 24, 2), (2, 3, 5, 40, 8), (9, 3, 5, 40, 4)], sites=5)
    sys.exit(0 if ok else 1)
