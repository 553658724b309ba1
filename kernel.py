"""
Fused Triton kernels for the multi-head depth route of MHAR.

The contract is `mhar.route(V, q, g, heads)`: sources V (N, B, T, d), a pseudo-query q and an
RMSNorm weight g of width d, H heads of width K = d / H. Per position and source n:

    r_n      = rsqrt(mean(V_n²) + eps)                  over the full width d
    ℓ[n, h]  = r_n · <(q ⊙ g)_h, V_n,h>                  one logit per source and head
    α[:, h]  = softmax_n ℓ[:, h]
    out_h    = Σ_n α[n, h] · V_n,h

computed in float32 for float32 or bfloat16 sources, returned in the sources' dtype. Routing is
memory-bound: a site does a few flops per element it reads, so the bytes moved are the cost.

Two algorithms, one pair of kernels (`Config.fused_group`):

  one pass per site (group 1)   each site reads all its sources once forward; backward reads them
      again and read-modify-writes an fp32 gradient row per source. A network of S = 2L+1 sites
      reads Σ_j (j+1) ≈ S²/2 source rows: ≈ 6·S² bytes per element of a bf16 source.
  grouped (the default)         q and g are parameters, not activations, so G consecutive sites
      j0..j0+G-1 can share one read of the sources written before the group. Phase 1 reads
      sources 0..j0 once and keeps G online-softmax states; the group's first site is then
      complete, and each later site merges its partial state (normalized output + log-sum-exp)
      with the few sources written inside the group (phase 2). Backward mirrors it: phase 1
      updates each gradient row once for all G sites. ≈ 6·S²/G + 6·S·G bytes per element.

`traffic()` counts every byte the kernels load and store (exactly: a test compares it with what
the Triton interpreter loads and stores), and separately the torch ops around them;
`python kernel.py --traffic` prints both algorithms at the paper's kernel-table shapes.

Autograd without Python-side state. Each launch is a torch custom operator with a functional
signature (a list of source tensors, which the kernel reads through a table of addresses: no
copies), so `torch.compile(fullgraph=True)` traces a fused model; eager code runs the same
launch through a torch.autograd.Function, whose dispatch costs the host far less. The fp32
source-gradient buffer travels backward as the gradient of a "carrier" tensor (no memory) that each launch hands to the
next; each launch adds its share into the buffer in place and returns, in their own dtype, the
final gradients of the sources it read first (it is the last to touch them in backward). Nothing
is zero-filled: the first launch to touch a row in backward writes it instead of adding to it.
No atomics: every position belongs to one program, and dq, dg come from one per-program partial
of Σ dℓ·r·V that torch sums in a fixed order, so the backward is bitwise deterministic.

Without a CUDA GPU the kernels run in the Triton interpreter, on CPU tensors, when
TRITON_INTERPRET=1 is set before this file is imported (slow; for tests). `python kernel.py`
checks the kernels against `mhar.route`, then benchmarks them when a GPU is present; `--host`
measures the Python time per site with the launches stubbed.
"""
import array
import functools
import os
import sys
from collections import namedtuple
from typing import Optional

import torch
from torch import Tensor

if __name__ == "__main__" and (not torch.cuda.is_available() or "--host" in sys.argv):
    # `python kernel.py` without a GPU (and --host anywhere) runs in the interpreter, which
    # triton.jit consults when it decorates the kernels below: switch it on before importing triton.
    os.environ.setdefault("TRITON_INTERPRET", "1")

UNAVAILABLE = ("fused routing needs a CUDA GPU, or TRITON_INTERPRET=1 set before triton is "
               "imported to run the kernels on the CPU (slow; for tests)")
try:
    import triton
    import triton.language as tl
except ImportError as error:
    raise RuntimeError(f"{UNAVAILABLE}; triton is not installed (pip install triton)") from error

SOURCE_TYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16}
# A program keeps three (G, H, K) fp32 tiles of its G sites in registers through the backward's
# loop (q ⊙ g, the output gradients, the gradient of q ⊙ g). Compiled for sm_90 at 8 warps, 8192
# lanes (8 sites at d = 1024) take 251 registers per thread without spilling; 10240 (8 sites at
# d = 1280) spill at 4, 8 and 16 warps. Larger groups are refused.
MAX_TILE = 8192
# Each program routes a contiguous block of positions, so that dq and dg leave as one partial per
# program. 256 programs fill the 132 SMs of an H100/H200 about twice.
PROGRAMS = 256
INTERPRETED_PROGRAMS = 3    # the interpreter runs programs one after another: few, of many positions
NUM_STAGES = 3              # source rows in flight in the software pipeline of the loop over sources


# %% The kernels
#
# A row of width d is held as two tiles of heads × lanes: the first K1 lanes of every head (K1
# the largest power of two ≤ K) and the remaining K2 = K − K1. Every tile dimension must be a
# power of two, so one (H, K) tile would pad K = 160 (d = 1280, H = 8) to 256 lanes, 37.5 % of
# them idle; 160 = 128 + 32 has none. The states of a program's G sites add a leading dimension.
# (The loops' arithmetic is written out rather than in @triton.jit helpers: the interpreter
# re-patches the language at every helper call, which would double the tests' time.)

@triton.jit
def _row_tiles(K: tl.constexpr, K1: tl.constexpr, K2: tl.constexpr, K2_PAD: tl.constexpr,
               H: tl.constexpr, H_PAD: tl.constexpr):
    """Offsets and masks of the two tiles that cover a row: (H_PAD, K1) and (H_PAD, K2_PAD)."""
    heads = tl.arange(0, H_PAD)
    lanes1 = tl.arange(0, K1)
    lanes2 = tl.arange(0, K2_PAD)
    cols1 = heads[:, None] * K + lanes1[None, :]
    cols2 = heads[:, None] * K + K1 + lanes2[None, :]
    mask1 = (heads[:, None] < H) & (lanes1[None, :] < K1)
    mask2 = (heads[:, None] < H) & (lanes2[None, :] < K2)
    return cols1, cols2, mask1, mask2


@triton.jit
def _addresses(entries, mask, ELEMENT: tl.constexpr):
    """Table entries as pointers to ELEMENT, 16-byte aligned (the launchers make sure of it), so
    that the loads through them are vectorized and pipelined."""
    return tl.multiple_of(tl.load(entries, mask=mask, other=0).to(tl.pointer_type(ELEMENT)), 16)


# N, M and the row indices stay runtime integers: triton would turn a value of 1 into a
# constexpr, and specializing on their divisibility by 16 would compile more variants for no gain.
@triton.jit(do_not_specialize=["N", "M", "per_program"])
def _route_forward_kernel(
    table_ptr,          # int64 addresses: the N sources, then per site its output, the output's
                        # rounding remainder and lse (and, with INIT, those of the partial state
                        # it continues)
    qg_ptr,             # [G, D] fp32: q ⊙ g of each site (g folded into the query once)
    N,                  # number of sources to read
    M,                  # number of positions B·T
    per_program,        # positions routed by each program
    eps,                # RMSNorm epsilon
    SOURCE: tl.constexpr,   # element type of sources and outputs: tl.float32 or tl.bfloat16
    D: tl.constexpr,        # width d
    H: tl.constexpr,        # heads
    K: tl.constexpr,        # head width d / H
    K1: tl.constexpr,       # lanes of the first tile: the largest power of two <= K
    K2: tl.constexpr,       # lanes of the second tile: K - K1 (0: none)
    K2_PAD: tl.constexpr,   # next power of two >= K2 (1 when K2 = 0)
    H_PAD: tl.constexpr,    # next power of two >= H
    G: tl.constexpr,        # sites routed together
    G_PAD: tl.constexpr,    # next power of two >= G
    INIT: tl.constexpr,     # each site continues a partial state instead of starting empty
    SPLIT: tl.constexpr,    # bf16 outputs: also store the remainder out − bf16(out), in bf16
    NUM_STAGES: tl.constexpr,
):
    program = tl.program_id(0)
    first = program.to(tl.int64) * per_program      # int64: pos · d passes 2^31 at large B·T
    last = tl.minimum(first + per_program, M)
    cols1, cols2, mask1, mask2 = _row_tiles(K, K1, K2, K2_PAD, H, H_PAD)
    sites = tl.arange(0, G_PAD)
    heads = tl.arange(0, H_PAD)
    site_mask = sites < G
    state_mask = site_mask[:, None] & (heads[None, :] < H)                         # (G_PAD, H_PAD)
    tile1 = site_mask[:, None, None] & mask1[None, :, :]                           # (G_PAD, H_PAD, K1)
    tile2 = site_mask[:, None, None] & mask2[None, :, :]                           # (.., K2_PAD)
    qg1 = tl.load(qg_ptr + sites[:, None, None] * D + cols1[None, :, :], mask=tile1, other=0.0)
    qg2 = tl.load(qg_ptr + sites[:, None, None] * D + cols2[None, :, :], mask=tile2, other=0.0)
    site_table = table_ptr + N + sites * (6 if INIT else 3)                        # entries per site
    out_at = _addresses(site_table, site_mask, SOURCE)
    rest_at = _addresses(site_table + 1, site_mask, SOURCE)
    lse_at = _addresses(site_table + 2, site_mask, tl.float32)
    if INIT:
        init_out_at = _addresses(site_table + 3, site_mask, SOURCE)
        init_rest_at = _addresses(site_table + 4, site_mask, SOURCE)
        init_lse_at = _addresses(site_table + 5, site_mask, tl.float32)

    for pos in range(first, last):
        row1 = pos * D + cols1[None, :, :]
        row2 = pos * D + cols2[None, :, :]
        state = pos * H + heads[None, :]
        if INIT:    # a normalized partial state (out, lse) is the online softmax (max lse, sum 1, acc out)
            acc1 = tl.load(init_out_at[:, None, None] + row1, mask=tile1, other=0.0).to(tl.float32)
            acc2 = tl.load(init_out_at[:, None, None] + row2, mask=tile2, other=0.0).to(tl.float32)
            if SPLIT:
                acc1 += tl.load(init_rest_at[:, None, None] + row1, mask=tile1, other=0.0).to(tl.float32)
                acc2 += tl.load(init_rest_at[:, None, None] + row2, mask=tile2, other=0.0).to(tl.float32)
            row_max = tl.load(init_lse_at[:, None] + state, mask=state_mask, other=0.0)
            row_sum = tl.full([G_PAD, H_PAD], 1.0, tl.float32)
        else:
            acc1 = tl.zeros([G_PAD, H_PAD, K1], tl.float32)                     # Σ_n exp(ℓ_n − max)·V_n
            acc2 = tl.zeros([G_PAD, H_PAD, K2_PAD], tl.float32)
            row_max = tl.full([G_PAD, H_PAD], float("-inf"), tl.float32)        # online softmax per head
            row_sum = tl.zeros([G_PAD, H_PAD], tl.float32)
        for n in tl.range(0, N, num_stages=NUM_STAGES):
            source = tl.multiple_of(tl.load(table_ptr + n).to(tl.pointer_type(SOURCE)), 16) + pos * D
            v1 = tl.load(source + cols1, mask=mask1, other=0.0).to(tl.float32)   # (H_PAD, K1)
            v2 = tl.load(source + cols2, mask=mask2, other=0.0).to(tl.float32)   # (H_PAD, K2_PAD)
            r = tl.rsqrt((tl.sum(v1 * v1) + tl.sum(v2 * v2)) / D + eps)         # over the full width
            logit = r * (tl.sum(qg1 * v1[None, :, :], axis=2) + tl.sum(qg2 * v2[None, :, :], axis=2))
            new_max = tl.maximum(row_max, logit)
            rescale = tl.exp(row_max - new_max)
            weight = tl.exp(logit - new_max)
            row_sum = row_sum * rescale + weight
            acc1 = acc1 * rescale[:, :, None] + weight[:, :, None] * v1[None, :, :]
            acc2 = acc2 * rescale[:, :, None] + weight[:, :, None] * v2[None, :, :]
            row_max = new_max
        out1 = acc1 / row_sum[:, :, None]
        out2 = acc2 / row_sum[:, :, None]
        tl.store(out_at[:, None, None] + row1, out1.to(SOURCE), mask=tile1)
        tl.store(out_at[:, None, None] + row2, out2.to(SOURCE), mask=tile2)
        if SPLIT:   # out = bf16(out) + remainder, to ~16 bits: backward and phase 2 read both
            rest1 = out1 - out1.to(SOURCE).to(tl.float32)
            rest2 = out2 - out2.to(SOURCE).to(tl.float32)
            tl.store(rest_at[:, None, None] + row1, rest1.to(SOURCE), mask=tile1)
            tl.store(rest_at[:, None, None] + row2, rest2.to(SOURCE), mask=tile2)
        tl.store(lse_at[:, None] + state, row_max + tl.log(row_sum), mask=state_mask)


@triton.jit(do_not_specialize=["N", "M", "per_program", "row0", "own_lo", "fresh_lo"])
def _route_backward_kernel(
    table_ptr,          # int64 addresses: the N sources, then per site its output, the output's
                        # remainder, output gradient, lse, and the coupling given for a partial
                        # state (0 for a complete site); with INIT also the lse of the partial state
                        # it continues and where that state's output gradient and coupling go
    qg_ptr,             # [G, D] fp32: q ⊙ g of each site
    grads_ptr,          # [rows, M, D] fp32 source-gradient buffer: source n is row row0 + n
    owned_ptr,          # [N - own_lo, M, D] final gradients of sources own_lo.., in their dtype
    qg_grad_ptr,        # [programs, G, D] fp32: each program's Σ over positions and sources of dℓ·r·V
    N,                  # number of sources to read
    M,                  # number of positions B·T
    per_program,        # positions handled by each program
    row0,               # buffer row of source 0
    own_lo,             # sources own_lo.. are complete after this launch: written to owned_ptr
    fresh_lo,           # sources fresh_lo.. have no earlier gradient: rows written, not added to
    eps,                # RMSNorm epsilon
    SOURCE: tl.constexpr, D: tl.constexpr, H: tl.constexpr, K: tl.constexpr, K1: tl.constexpr,
    K2: tl.constexpr, K2_PAD: tl.constexpr, H_PAD: tl.constexpr, G: tl.constexpr,
    G_PAD: tl.constexpr, INIT: tl.constexpr, SPLIT: tl.constexpr,
    NUM_STAGES: tl.constexpr,                                               # as in the forward
):
    program = tl.program_id(0)
    first = program.to(tl.int64) * per_program
    last = tl.minimum(first + per_program, M)
    cols1, cols2, mask1, mask2 = _row_tiles(K, K1, K2, K2_PAD, H, H_PAD)
    sites = tl.arange(0, G_PAD)
    heads = tl.arange(0, H_PAD)
    site_mask = sites < G
    state_mask = site_mask[:, None] & (heads[None, :] < H)
    tile1 = site_mask[:, None, None] & mask1[None, :, :]
    tile2 = site_mask[:, None, None] & mask2[None, :, :]
    qg1 = tl.load(qg_ptr + sites[:, None, None] * D + cols1[None, :, :], mask=tile1, other=0.0)
    qg2 = tl.load(qg_ptr + sites[:, None, None] * D + cols2[None, :, :], mask=tile2, other=0.0)
    site_table = table_ptr + N + sites * (8 if INIT else 5)
    out_at = _addresses(site_table, site_mask, SOURCE)
    rest_at = _addresses(site_table + 1, site_mask, SOURCE)
    dout_at = _addresses(site_table + 2, site_mask, SOURCE)
    lse_at = _addresses(site_table + 3, site_mask, tl.float32)
    given_entry = tl.load(site_table + 4, mask=site_mask, other=0)   # 0: a complete site
    given = given_entry != 0                                          # (G_PAD,): a partial state
    given_at = tl.multiple_of(given_entry.to(tl.pointer_type(tl.float32)), 16)
    complete1 = tile1 & (given == 0)[:, None, None]
    complete2 = tile2 & (given == 0)[:, None, None]
    if INIT:
        init_lse_at = _addresses(site_table + 5, site_mask, tl.float32)
        init_dout_at = _addresses(site_table + 6, site_mask, SOURCE)
        init_coupling_at = _addresses(site_table + 7, site_mask, tl.float32)
    row_stride = M.to(tl.int64) * D                 # int64: rows · B·T·d passes 2^31 at large batches
    qg_grad1 = tl.zeros([G_PAD, H_PAD, K1], tl.float32)                        # Σ dℓ·r·V per site
    qg_grad2 = tl.zeros([G_PAD, H_PAD, K2_PAD], tl.float32)

    for pos in range(first, last):
        row1 = pos * D + cols1[None, :, :]
        row2 = pos * D + cols2[None, :, :]
        state = pos * H + heads[None, :]
        dout1 = tl.load(dout_at[:, None, None] + row1, mask=tile1, other=0.0).to(tl.float32)
        dout2 = tl.load(dout_at[:, None, None] + row2, mask=tile2, other=0.0).to(tl.float32)
        lse = tl.load(lse_at[:, None] + state, mask=state_mask, other=0.0)
        # The softmax couples the sources: dℓ_n = α_n·(<dout, V_n> − c) per head, with
        # c = Σ_n α_n·<dout, V_n> = <dout, out>: no pass over the sources (FlashAttention's
        # rowsum(dO ∘ O)). A bf16 output's rounding would cost c most of its digits where the
        # sources are alike: out is read with its remainder, to ~16 bits. A partial state's c
        # comes from the phase 2 that continued it, exact (below): its output is not read.
        out1 = tl.load(out_at[:, None, None] + row1, mask=complete1, other=0.0).to(tl.float32)
        out2 = tl.load(out_at[:, None, None] + row2, mask=complete2, other=0.0).to(tl.float32)
        if SPLIT:
            out1 += tl.load(rest_at[:, None, None] + row1, mask=complete1, other=0.0).to(tl.float32)
            out2 += tl.load(rest_at[:, None, None] + row2, mask=complete2, other=0.0).to(tl.float32)
        coupling = (tl.sum(dout1 * out1, axis=2) + tl.sum(dout2 * out2, axis=2)
                    + tl.load(given_at[:, None] + state, mask=state_mask & given[:, None], other=0.0))
        if INIT:    # out = β·init_out + Σ_n α_n·V_n, with β = exp(init_lse − lse)
            beta = tl.exp(tl.load(init_lse_at[:, None] + state, mask=state_mask, other=0.0) - lse)
            init_dout1 = beta[:, :, None] * dout1
            init_dout2 = beta[:, :, None] * dout2
            tl.store(init_dout_at[:, None, None] + row1, init_dout1.to(SOURCE), mask=tile1)
            tl.store(init_dout_at[:, None, None] + row2, init_dout2.to(SOURCE), mask=tile2)
            # the partial state's c = <β·dout, init_out> − (the gradient of its lse, β·(<dout,
            # init_out> − c)) = β·c: handed back in the place of that gradient
            tl.store(init_coupling_at[:, None] + state, beta * coupling, mask=state_mask)
        for n in tl.range(0, N, num_stages=NUM_STAGES):
            source = tl.multiple_of(tl.load(table_ptr + n).to(tl.pointer_type(SOURCE)), 16) + pos * D
            v1 = tl.load(source + cols1, mask=mask1, other=0.0).to(tl.float32)
            v2 = tl.load(source + cols2, mask=mask2, other=0.0).to(tl.float32)
            # The gradient row is loaded before any reduction, so both loads are in flight at once.
            # (Conditions on n as one-element tensors: the interpreter's loop indices are ints.)
            index = tl.full([1], n, tl.int32)
            grad_row = grads_ptr + (row0 + n) * row_stride + pos * D
            earlier1 = tl.load(grad_row + cols1, mask=mask1 & (index < fresh_lo), other=0.0)
            earlier2 = tl.load(grad_row + cols2, mask=mask2 & (index < fresh_lo), other=0.0)
            r = tl.rsqrt((tl.sum(v1 * v1) + tl.sum(v2 * v2)) / D + eps)
            logit = r * (tl.sum(qg1 * v1[None, :, :], axis=2) + tl.sum(qg2 * v2[None, :, :], axis=2))
            alpha = tl.where(state_mask, tl.exp(logit - lse), 0.0)                 # (G_PAD, H_PAD)
            dot = tl.sum(dout1 * v1[None, :, :], axis=2) + tl.sum(dout2 * v2[None, :, :], axis=2)
            dlogit = alpha * (dot - coupling)
            # dV_n = r·(g ⊙ dk) − (r³/d)·<g ⊙ dk, V_n>·V_n + Σ_sites α_n ⊙ dout,
            # with g ⊙ dk = Σ_sites dℓ_n·(q ⊙ g) per head
            g_dk1 = tl.sum(dlogit[:, :, None] * qg1, axis=0)                     # (H_PAD, K1)
            g_dk2 = tl.sum(dlogit[:, :, None] * qg2, axis=0)
            norm_coupling = r * r * r / D * (tl.sum(g_dk1 * v1) + tl.sum(g_dk2 * v2))
            value1 = tl.sum(alpha[:, :, None] * dout1, axis=0)
            value2 = tl.sum(alpha[:, :, None] * dout2, axis=0)
            grad1 = earlier1 + r * g_dk1 - norm_coupling * v1 + value1
            grad2 = earlier2 + r * g_dk2 - norm_coupling * v2 + value2
            qg_grad1 += (dlogit * r)[:, :, None] * v1[None, :, :]
            qg_grad2 += (dlogit * r)[:, :, None] * v2[None, :, :]
            # This program owns the position: the read-modify-write of its rows needs no atomics.
            tl.store(grad_row + cols1, grad1, mask=mask1 & (index < own_lo))
            tl.store(grad_row + cols2, grad2, mask=mask2 & (index < own_lo))
            owned_row = owned_ptr + tl.maximum(n - own_lo, 0) * row_stride + pos * D
            tl.store(owned_row + cols1, grad1.to(SOURCE), mask=mask1 & (index >= own_lo))
            tl.store(owned_row + cols2, grad2.to(SOURCE), mask=mask2 & (index >= own_lo))
    partial = qg_grad_ptr + program * G * D + sites[:, None, None] * D
    tl.store(partial + cols1[None, :, :], qg_grad1, mask=tile1)
    tl.store(partial + cols2[None, :, :], qg_grad2, mask=tile2)


# True when TRITON_INTERPRET=1 was set before import: triton.jit then made interpreted functions.
INTERPRETED = not isinstance(_route_forward_kernel, triton.runtime.JITFunction)


# %% Launchers

def memoized(fn):
    """fn with its results kept by arguments: launches and histories ask at every call. (A plain
    dict: torch.compile warns at every functools.lru_cache it traces.)"""
    results = {}

    @functools.wraps(fn)
    def cached(*args):
        if args not in results:
            results[args] = fn(*args)
        return results[args]
    return cached


@memoized
def layout(width, heads, sites):
    """The constexprs of a launch routing `sites` sites at this width and head count; raises on
    what the kernels cannot hold."""
    if width % heads != 0:
        raise ValueError(f"the width d={width} must be divisible by heads={heads}")
    K = width // heads
    K1 = 1 << (K.bit_length() - 1)                  # the largest power of two <= K
    K2 = K - K1
    config = dict(D=width, H=heads, K=K, K1=K1, K2=K2, K2_PAD=triton.next_power_of_2(K2) if K2 else 1,
                  H_PAD=triton.next_power_of_2(heads), G=sites, G_PAD=triton.next_power_of_2(sites))
    if _tile(config) > MAX_TILE:
        raise ValueError(f"fused routing holds {sites} site(s) of width d={width} as {_tile(config)} "
                         f"fp32 lanes per tile; past {MAX_TILE} they do not fit in one program: use a "
                         f"smaller fused_group, or fused=False for this width")
    return config


def _tile(config):
    """Lanes of a (G, H, K) tile of the sites' states (the second tile included, when there is one)."""
    lanes = config["K1"] + (config["K2_PAD"] if config["K2"] else 0)
    return config["G_PAD"] * config["H_PAD"] * lanes


def _num_warps(config, backward):
    # Tiles of up to 1024 lanes take 4 warps, so that each thread still loads several contiguous
    # elements of a row at a time. Larger ones: the backward keeps three tiles and fits them at 8
    # warps (see MAX_TILE); the forward, at 8 warps past 4096 lanes, gets 128 registers per thread
    # from ptxas and spills (350M, 7 sites); at 16 it does not.
    tile = _tile(config)
    return 4 if tile <= 1024 else 8 if backward or tile <= 4096 else 16


@memoized
def _constexprs(width, heads, sites, dtype, init, backward):
    """The keyword arguments of a launch besides its tensors and ints: a launch asks at every call."""
    config = layout(width, heads, sites)
    return dict(SOURCE=SOURCE_TYPES[dtype], INIT=init, SPLIT=dtype == torch.bfloat16, NUM_STAGES=NUM_STAGES,
                num_warps=_num_warps(config, backward), **config)


def _programs(M, target=None):
    """Positions per program, and programs, for `target` programs (None: what this process
    launches). A split fixed by M alone, for determinism."""
    per_program = -(-M // (target or (INTERPRETED_PROGRAMS if INTERPRETED else PROGRAMS)))
    return per_program, -(-M // per_program)          # ceiling divisions (triton.cdiv: 5 µs a call)


def _address_table(addresses, device):
    """The kernels read their tensors through a table of addresses: no copy into one buffer. On a
    GPU the table goes up from pinned memory, asynchronously: the host never waits for the GPU
    (a table from pageable memory would be a synchronizing copy at every launch)."""
    table = torch.frombuffer(array.array("q", addresses), dtype=torch.int64)  # 3x faster than torch.tensor
    if device.type == "cuda":
        table = table.pin_memory().to(device, non_blocking=True)
    return table


def _aligned(tensor):
    """The tensor, contiguous and 16-byte aligned (the kernels load every row as 16-byte vectors):
    a fresh allocation is, a view (a row of a stacked V) may not be."""
    tensor = tensor.contiguous()
    return tensor if tensor.data_ptr() % 16 == 0 else tensor.clone()


def check_sources(sources, heads, sites):
    """The layout of a launch over these sources (each (B, T, d)); raises on a dtype or shape the
    kernels cannot route together."""
    first = sources[0]
    if first.dtype not in SOURCE_TYPES:
        raise TypeError(f"fused routing stores sources in float32 or bfloat16, got {first.dtype}")
    for source in sources:
        if source.shape != first.shape or source.dtype != first.dtype:
            raise ValueError(f"fused routing needs sources of one shape and dtype, got {tuple(source.shape)} "
                             f"{source.dtype} next to {tuple(first.shape)} {first.dtype}")
    return layout(first.shape[-1], heads, sites)


def _checked(sources, heads, sites):
    """The sources checked and aligned, and their addresses (the custom operators' way in; eager
    launches are handed those FusedHistory took at append). Keep the sources while the kernel
    may read them: an aligned copy lives only as long as they do."""
    check_sources(sources, heads, sites)
    sources = [_aligned(t) for t in sources]
    return sources, [t.data_ptr() for t in sources]


def _route_forward(sources, qg, init, heads, eps, addresses=None, lses=None):
    """Route G sites over `sources` (each (B, T, d)); init = [] or, per site, the state (output,
    remainder, lse) of the partial state it continues. Returns the G outputs (sources' dtype),
    their G remainders (bf16: out − bf16(out); fp32 sources need none: empty) and G lse (fp32).
    addresses: the sources' addresses when the caller has checked and aligned them already; lses:
    where to write the lse (None: new tensors)."""
    source, G = sources[0], qg.shape[0]
    if addresses is None:
        sources, addresses = _checked(sources, heads, G)
    width = source.shape[-1]
    M = source.numel() // width
    # (empty_like and new_empty: a third of torch.empty's host time with dtype and device given)
    outs = [torch.empty_like(source) for _ in range(G)]
    split = source.dtype == torch.bfloat16
    rests = [torch.empty_like(source) if split else source.new_empty(0) for _ in range(G)]
    if lses is None:
        lse = source.new_empty((*source.shape[:-1], heads), dtype=torch.float32)
        lses = [lse, *[torch.empty_like(lse) for _ in range(G - 1)]]
    per_site = [[outs[i], rests[i], lses[i], *init[i::G]] for i in range(G)]
    table = _address_table(addresses + [t.data_ptr() for site in per_site for t in site], source.device)
    per_program, programs = _programs(M)
    _route_forward_kernel[(programs,)](table, qg, len(addresses), M, per_program, eps,
                                       **_constexprs(width, heads, G, source.dtype, bool(init), False))
    return outs, rests, lses


def _route_backward(grads, owned, qg_grads, init_grads, sources, qg, outs, rests, douts, lses,
                    couplings, init_lse, heads, eps, row0, own_lo, fresh_lo, addresses=None):
    """Add the gradients of `sources` into rows row0.. of the fp32 buffer `grads` (in place); write
    the final gradients of sources own_lo.. into `owned` (their dtype), each program's partial
    gradient of qg into `qg_grads` (programs, G, d), and the output gradient and coupling of the
    partial state whose lse is `init_lse` ([] or [lse]: phase 2) into init_grads. couplings: per
    site None, or for a partial state the coupling its phase 2 handed back (whose output and
    remainder the kernel does not read: they may be None). douts: contiguous, one per site."""
    source, G = douts[0], qg.shape[0]               # an output gradient has the sources' shape and dtype
    if addresses is None:
        sources, addresses = _checked(sources, heads, G)
    width = source.shape[-1]
    M = source.numel() // width
    per_site = [[outs[i], rests[i], douts[i], lses[i], couplings[i], *init_lse, *init_grads]
                for i in range(G)]
    table = _address_table(addresses + [0 if t is None else t.data_ptr() for site in per_site for t in site],
                           source.device)
    per_program, programs = _programs(M)
    _route_backward_kernel[(programs,)](
        table, qg, grads, owned, qg_grads, len(addresses), M, per_program, row0, own_lo, fresh_lo, eps,
        **_constexprs(width, heads, G, source.dtype, bool(init_lse), True))


# %% Autograd: one launch, two ways in
#
# A launch routes G sites over a list of sources, optionally continuing a partial state. It
# makes per site an output, its remainder (a bf16 output's rounding error, which backward and
# phase 2 add back) and its log-sum-exp, and it passes on the carrier: a tensor of the gradient
# buffer's shape and no memory (a stride-0 view of one element). Autograd hands the buffer from
# launch to launch backward as the carrier's gradient, which orders the launches' backward
# exactly in reverse, under torch.compile too.
#
# Eager code calls the launch through RouteSites, a torch.autograd.Function, and autograd sees
# only what it must: the carrier, the sources the launch completes and the outputs of the sites
# it completes. What else goes between launches goes beside autograd, in the order the carrier
# fixes (a later launch's backward runs first): a partial state from its phase 1 to its phase 2
# as a Partial, and its gradients back; each launch's per-program partials of q ⊙ g's gradient,
# which the forward's first launch, the last backward, sums at once. The sources' addresses are
# those FusedHistory checked once, when they were appended. (Each of these cut the host's time;
# `python kernel.py --host` measures it.) torch.compile traces the custom operators route_sites
# and route_sites_backward instead, every state and q ⊙ g an input or output (traced code cannot
# read addresses; an operator's dispatch of its tensor lists costs the host a few hundred µs per
# launch, the Function a few µs). Both run the same functions.

Spec = namedtuple("Spec", "heads eps rows row0 own_lo fresh_lo last continued")
Spec.__doc__ = """A launch's ints: H, the norm's eps, the rows of the gradient buffer, the row of
its first source, and which sources it completes (own_lo..) and touches first (fresh_lo..) in
backward; `last`: the last launch of a forward (it hands no buffer on); `continued`: a bit per
site whose state a phase 2 continues (see Launch). See route_sites."""


def _launch_forward(sources, qg, init, spec, addresses=None):
    """(outs, remainders, lses) of the G sites, and the carrier."""
    states = _route_forward(sources, qg, init, spec.heads, spec.eps, addresses)
    return *states, _carrier(sources[0], 0 if spec.last else spec.rows)


def _carrier(like, rows):
    return like.new_zeros((), dtype=torch.float32).expand(rows, *like.shape)


def _launch_backward(backward, spec, sources, qg, states, init_lse, douts, couplings, dcarrier,
                     addresses=None, qg_grads=None):
    """The gradients of one launch's inputs, from those of its outputs: (the gradient buffer the
    carrier hands back, the final gradients of the sources it completes, q ⊙ g's per program
    (programs, G, d), and the output gradient and coupling of the partial state it continues:
    [] without one). states: (outs, remainders, lses) as the forward made them; douts per site
    (None: no gradient); couplings per site (None: a complete site); `backward` runs the kernel
    (_route_backward or its operator). sources: all of them, or (with their addresses) any list
    led by the first. qg_grads: where the kernel writes q ⊙ g's partials (None: a new tensor)."""
    like = sources[0]                                    # of the sources' shape and dtype
    douts = [torch.zeros_like(like) if d is None else d.contiguous() for d in douts]
    if spec.last:   # the first launch in backward: no gradient yet, and every row it reads is fresh
        buffer = like.new_empty((spec.rows, *like.shape), dtype=torch.float32)
    else:
        buffer = dcarrier.contiguous()
    n_sources = len(sources) if addresses is None else len(addresses)
    n_owned = n_sources - spec.own_lo                  # one, mostly: then no stack to unbind
    owned = torch.empty_like(like) if n_owned == 1 else like.new_empty((n_owned, *like.shape))
    if qg_grads is None:
        qg_grads = qg.new_empty((_programs(like.numel() // like.shape[-1])[1], *qg.shape))  # fp32, as qg
    init_lse = [] if init_lse is None else [init_lse]
    init_grads = [torch.empty_like(like), torch.empty_like(init_lse[0])] if init_lse else []
    args = (buffer, owned, qg_grads, init_grads, sources, qg, *states[:2], douts, states[2], couplings,
            init_lse, spec.heads, spec.eps, spec.row0, spec.own_lo, spec.fresh_lo)
    backward(*args) if addresses is None else backward(*args, addresses=addresses)
    return buffer, [owned] if n_owned == 1 else list(owned.unbind(0)), qg_grads, init_grads


class Partial:
    """A site's phase-1 state on its way to its phase 2, outside autograd (eager code): forward
    hands over (out, rest, lse), of which phase 2 leaves only the lse (the two backwards read
    nothing else); backward hands back `grads`, the gradients of its output and coupling."""
    __slots__ = ("out", "rest", "lse", "grads")


class QGGradients:
    """Where the launches of one forward (eager code) leave their per-program partial gradients of
    q ⊙ g, (programs, G, d) each: views of three tensors made at the first backward, for phase 1's
    full groups, its last group when it is shorter, and phase 2's sites. The forward's first
    launch, whose backward runs last, sums them: a few sums in a fixed order (deterministic), not
    one per launch."""

    def __init__(self, n_sites, group, continued_sites):
        self.n_sites, self.group, self.continued_sites = n_sites, group, continued_sites
        self.buffers = self.slots = None

    def slot(self, launch, qg, positions):
        """The (programs, G, d) tensor launch `launch` writes into."""
        if self.slots is None:
            programs, d = _programs(positions)[1], qg.shape[-1]
            full, last = divmod(self.n_sites, self.group)
            self.buffers = (qg.new_empty((full, programs, self.group, d)), qg.new_empty((programs, last, d)),
                            qg.new_empty((len(self.continued_sites), programs, 1, d)))
            self.slots = ([*self.buffers[0].unbind(0), self.buffers[1]], self.buffers[2].unbind(0),
                          {site: i for i, site in enumerate(self.continued_sites)})
        by_group, by_site, rank = self.slots
        return by_group[launch.site // self.group] if launch.phase == 1 else by_site[rank[launch.site]]

    def total(self):
        """The gradient of q ⊙ g (S, d); the buffers go."""
        full, last, again = self.buffers
        self.buffers = self.slots = None
        grad = full.sum(1).flatten(0, 1)                    # (sites of the full groups, d)
        if last.shape[1]:
            grad = torch.cat([grad, last.sum(0)])
        if len(again):      # each row of a site with a phase 2 gets its sum once
            grad = grad.index_add(0, _index(self.continued_sites, grad.device), again.sum(1).flatten(0, 1))
        return grad


@memoized
def _index(values, device):
    """values as an int64 tensor on `device`, made once (from pinned memory on a GPU: no sync)."""
    return _address_table(values, device)


class RouteSites(torch.autograd.Function):
    """One launch in eager code: RouteSites.apply(carrier, qg_all, call, *sources[spec.own_lo:])
    -> (the output of each site it completes, carrier), call = (its Launch, Spec, sources,
    their addresses, init, partials, its q ⊙ g (G, d), the forward's QGGradients, where to
    write its lse). init: the Partial a phase 2
    continues (None in phase 1); partials: per site the Partial its state goes to, None for a
    site it completes. A list argument is not an input: the cost of a call does not grow with
    the sources it reads. Nor is q ⊙ g, but for the forward's first launch (qg_all, (S, d)):
    each backward leaves its per-program partials in QGGradients, and the first launch's, which
    runs last, sums them all at once."""

    @staticmethod
    def forward(ctx, carrier, qg_all, call, *completed):
        launch, spec, sources, addresses, init, partials, qg, qg_parts, lses = call
        outs, rests, lses = _route_forward(sources, qg, [init.out, init.rest, init.lse] if init else [],
                                           spec.heads, spec.eps, addresses, lses)
        if init:
            init.out = init.rest = None                  # free: only the lse is read again
        finals = []
        for out, rest, lse, partial in zip(outs, rests, lses, partials):
            if partial:
                partial.out, partial.rest, partial.lse = out, rest, lse
            else:
                finals.append(out)
        # Saved: the outputs (the next sublayers' inputs, alive anyway), their remainders and lse
        # (the only new activations), and the sources: held alive by the first launch that read
        # them, which completes them, and whose backward runs after this one's.
        ctx.save_for_backward(*finals)
        ctx.rests = [None if partial else rest for rest, partial in zip(rests, partials)]
        ctx.lses, ctx.call = lses, call
        ctx.set_materialize_grads(False)
        return (*finals, carrier)

    @staticmethod
    def backward(ctx, *grads):
        launch, spec, sources, addresses, init, partials, qg, qg_parts, _ = ctx.call
        finals, final_grads = iter(ctx.saved_tensors), iter(grads[:-1])
        outs, douts, couplings = [], [], []
        for partial, lse in zip(partials, ctx.lses):
            if partial:     # its gradients, from its phase 2's backward (which ran: the carrier)
                dout, coupling = partial.grads or (None, torch.zeros_like(lse))
                partial.grads = None
                outs.append(None), douts.append(dout), couplings.append(coupling)
            else:
                outs.append(next(finals)), douts.append(next(final_grads)), couplings.append(None)
        slot = qg_parts.slot(launch, qg, ctx.lses[0].numel() // spec.heads)
        buffer, source_grads, _, init_grads = _launch_backward(
            _route_backward, spec, sources, qg, (outs, ctx.rests, ctx.lses),
            init.lse if init else None, douts, couplings, grads[-1], addresses, slot)
        if init:
            init.grads = init_grads
        qg_grad = None
        if launch.site == 0 and launch.phase == 1:      # the forward's first launch: the last backward
            qg_grad = qg_parts.total()
            qg_grad = qg_grad if ctx.needs_input_grad[1] else None
        carrier_grad = buffer if ctx.needs_input_grad[0] else None
        return carrier_grad, qg_grad, None, *source_grads


@torch.library.custom_op("mhar::route_sites", mutates_args=())
def route_sites(carrier: Tensor, sources: list[Tensor], qg: Tensor, init: list[Tensor], heads: int,
                eps: float, rows: int, row0: int, own_lo: int, fresh_lo: int, last: bool,
                continued: int) -> list[Tensor]:
    """Route the G = len(qg) sites over `sources`: [out × G, remainder × G, lse × G, carrier].

    The sources are rows row0.. of the history's gradient buffer of `rows` rows (an extra source
    past them, a block's partial sum, has no row); own_lo and fresh_lo say which of them this
    launch completes and which it touches first in backward. init: [] or the (out, remainder,
    lse) of the partial state a phase 2 continues. The last launch of a forward passes on an
    empty carrier: nothing consumes it, and a gradient for it would be zero-filled.
    `continued`: a bit per site whose state a later launch continues (see Launch).
    """
    outs, rests, lses, carrier = _launch_forward(
        sources, qg.contiguous(), init, Spec(heads, eps, rows, row0, own_lo, fresh_lo, last, continued))
    return [*outs, *rests, *lses, carrier]


@route_sites.register_fake
def _(carrier, sources, qg, init, heads, eps, rows, row0, own_lo, fresh_lo, last, continued):
    source, G = sources[0], qg.shape[0]
    outs = [source.new_empty(source.shape) for _ in range(G)]
    split = source.dtype == torch.bfloat16
    rests = [source.new_empty(source.shape if split else 0) for _ in range(G)]
    lses = [source.new_empty((*source.shape[:-1], heads), dtype=torch.float32) for _ in range(G)]
    carrier = source.new_empty((), dtype=torch.float32).expand(0 if last else rows, *source.shape)
    return [*outs, *rests, *lses, carrier]


# A custom op that mutates arguments may not also return tensors (functionalization needs outputs
# without aliases): the backward writes into tensors its caller allocates.
@torch.library.custom_op("mhar::route_sites_backward",
                         mutates_args=("grads", "owned", "qg_grads", "init_grads"))
def route_sites_backward(grads: Tensor, owned: Tensor, qg_grads: Tensor, init_grads: list[Tensor],
                         sources: list[Tensor], qg: Tensor, outs: list[Tensor], rests: list[Tensor],
                         douts: list[Tensor], lses: list[Tensor], couplings: list[Optional[Tensor]],
                         init_lse: list[Tensor], heads: int, eps: float, row0: int, own_lo: int,
                         fresh_lo: int) -> None:
    """Backward of one route_sites launch: adds into the buffer `grads` in place, writes the final
    gradients of sources own_lo.. into `owned`, per-program partial gradients of qg into
    `qg_grads`, and the gradients of the partial state whose lse is `init_lse` into `init_grads`."""
    _route_backward(grads, owned, qg_grads, init_grads, sources, qg.contiguous(), outs, rests, douts,
                    lses, couplings, init_lse, heads, eps, row0, own_lo, fresh_lo)


def _setup_route_sites(ctx, inputs, output):
    carrier, sources, qg, init, *ints = inputs
    G = qg.shape[0]
    ctx.save_for_backward(qg, *sources, *init, *output[:3 * G])
    ctx.counts, ctx.spec = (len(sources), len(init)), Spec(*ints)


def _route_sites_backward(ctx, grads):
    (n_sources, n_init), spec = ctx.counts, ctx.spec
    qg, *saved = ctx.saved_tensors
    sources, init, states = saved[:n_sources], saved[n_sources:n_sources + n_init], saved[n_sources + n_init:]
    G = qg.shape[0]
    # the gradient of a continued site's lse is its coupling, handed back by its phase 2
    couplings = [d.contiguous() if spec.continued >> i & 1 else None
                 for i, d in enumerate(grads[2 * G:3 * G])]
    buffer, owned_grads, qg_grads, init_grads = _launch_backward(
        route_sites_backward, spec, sources, qg, (states[:G], states[G:2 * G], states[2 * G:]),
        init[2] if init else None, grads[:G], couplings, grads[3 * G])
    carrier_grad = buffer if ctx.needs_input_grad[0] else None
    init_grads = [init_grads[0], None, init_grads[1]] if init else []      # (out, remainder, lse)
    qg_grad = qg_grads.sum(0)                           # over programs, in a fixed order: deterministic
    return carrier_grad, [None] * spec.own_lo + owned_grads, qg_grad, init_grads, *[None] * len(Spec._fields)


route_sites.register_autograd(_route_sites_backward, setup_context=_setup_route_sites)


def check_available(device=None):
    """Raise unless the kernels can run: compiled on a CUDA GPU, or interpreted (on CPU tensors).
    With a device, the tensors that will be routed must be on it; without, any GPU will do."""
    on_gpu = torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda")
    if not (INTERPRETED or on_gpu):
        raise RuntimeError(UNAVAILABLE)


def fused_route(V, q, g, heads, eps=1e-6):
    """The multi-head depth route of one site in one launch: the contract of mhar.route
    (V (N, B, T, d) -> (B, T, d) in V.dtype, float32 inside; gradients in the dtypes of V, q, g)."""
    check_available(V.device)
    if q.shape != V.shape[-1:] or g.shape != V.shape[-1:]:
        raise ValueError(f"q and g must have shape ({V.shape[-1]},) to match the sources, "
                         f"got {tuple(q.shape)} and {tuple(g.shape)}")
    qg = (q.float() * g.float())[None]                                         # (1, d)
    return route_sites(_carrier(V[0], 0), list(V.unbind(0)), qg, [], heads, eps, 0, 0, 0, 0, True, 0)[0]


# %% The history of one forward pass
#
# The schedule of launches is static: it depends on the number of sites, the block size and the
# group size only. A source is "committed" once no later sum changes it (every source in full
# routing; the embedding and each completed block sum in block routing, after delta routing's
# null source); the committed sources are the rows of the gradient buffer. Block routing's partial
# sum of the current block is read by one site only, so it travels outside the buffer.

Launch = namedtuple("Launch", "phase site sites lo hi partial own_lo fresh_lo last continued")
Launch.__doc__ = """One route_sites call, made when site `site` is read. Phase 1: sites site..
(`sites` of them) over committed rows 0..hi-1; phase 2: site `site` continues its phase-1 state
over rows lo..hi-1. Either also reads the site's partial block sum when `partial`. The launch
completes the gradients of its sources own_lo.. and touches its sources fresh_lo.. first in
backward; the last launch of the forward has no successor to hand the gradient buffer to.
`continued`: a bit per site (1 << i for site `site` + i) whose state a phase 2 continues: its
backward takes that site's coupling from the phase 2."""


def committed_rows(site, block=1, delta=False):
    """How many sources are committed once site `site`'s source has been appended."""
    return (2 if delta else 1) + site // block


def reads_partial(site, block=1, delta=False):
    """Whether site `site` also reads its block's partial sum (block routing inside a block)."""
    return not delta and site % block != 0


@torch.compiler.assume_constant_result     # a pure function of ints: torch.compile calls it, not traces it
@memoized                                  # a history is built at every forward
def auto_group(n_sites, width, heads, block=1, delta=False):
    """The group size for Config.fused_group = 0: the one whose kernels move the fewest bytes by
    the traffic model (at a nominal B·T: the choice hardly depends on it), among the groups one
    program holds. Near √S for full routing, where groups that tile the sites evenly beat powers
    of two (25 sites move 13 % fewer bytes in 5 groups of 5 than in groups of 4); for block and
    delta routing usually the block or a multiple of it."""
    def kernel_bytes(group):
        return sum(sum(launch_bytes(launch, 4096, width, heads, 2, PROGRAMS))
                   for launch in schedule(n_sites, group, block, delta))
    groups = [G for G in range(1, n_sites + 1) if _fits(width, heads, G)]
    return min(groups, key=kernel_bytes)


def _fits(width, heads, sites):
    try:
        layout(width, heads, sites)
    except ValueError:
        return False
    return True


@memoized
def schedule(n_sites, group, block=1, delta=False):
    """The launches of one forward, in order (see Launch): `group` consecutive sites share phase 1."""
    launches = []
    for leader in range(0, n_sites, group):
        sites = min(group, n_sites - leader)
        shared = committed_rows(leader, block, delta)              # what every site of the group reads
        # A group of one reads its partial block sum in phase 1: one pass per site.
        launches.append(dict(phase=1, site=leader, sites=sites, lo=0, hi=shared,
                             partial=sites == 1 and reads_partial(leader, block, delta)))
        for site in range(leader, leader + sites if sites > 1 else leader):
            rows = committed_rows(site, block, delta)
            if rows > shared or reads_partial(site, block, delta):   # phase 2: merge what came later
                launches.append(dict(phase=2, site=site, sites=1, lo=shared, hi=rows,
                                     partial=reads_partial(site, block, delta)))
    # A row's gradient is complete after the backward of its first reader, which runs last.
    read = 0
    for launch in launches:
        launch["own_lo"] = max(read, launch["lo"]) - launch["lo"]
        read = max(read, launch["hi"])
    # A launch is the first to touch its rows in backward when no later launch reads them.
    last_reader = {row: i for i, launch in enumerate(launches) for row in range(launch["lo"], launch["hi"])}
    for i, launch in enumerate(launches):
        mine = [last_reader[row] == i for row in range(launch["lo"], launch["hi"])]
        assert all(mine) or not any(mine), "a launch touches some of its rows first and others not"
        launch["fresh_lo"] = 0 if all(mine) else launch["hi"] - launch["lo"]
        launch["last"] = i == len(launches) - 1
    continued = {launch["site"] for launch in launches if launch["phase"] == 2}
    for launch in launches:
        sites = range(launch["site"], launch["site"] + launch["sites"])
        launch["continued"] = sum(1 << i for i, site in enumerate(sites)
                                  if site in continued and launch["phase"] == 1)
    return tuple(Launch(**launch) for launch in launches)


@memoized
def _launches_by_site(n_sites, group, block, delta, heads, eps):
    """(site -> the (launch, Spec, continued, first) its read makes, the number of lse all the
    launches write, the sites with a phase 2); continued: per site of the launch, whether its
    state goes on to a phase 2; first: the index of its first site's lse among them all."""
    launches, rows, first = {}, committed_rows(n_sites - 1, block, delta), 0
    for launch in schedule(n_sites, group, block, delta):
        spec = Spec(heads, eps, rows, launch.lo, launch.own_lo, launch.fresh_lo, launch.last,
                    launch.continued)
        continued = tuple(bool(launch.continued >> i & 1) for i in range(launch.sites))
        launches.setdefault(launch.site, []).append((launch, spec, continued, first))
        first += launch.sites
    continued_sites = tuple(site for site, entries in launches.items()
                            for launch, *_ in entries if launch.phase == 2)
    return launches, first, continued_sites


class FusedHistory:
    """The depth history of ONE forward pass, routed by the fused kernels.

        history.append(source)    # (B, T, d): s_0 (the embedding) first, then each sublayer's output
        h = history.read(site)    # (B, T, d): the route of site `site` over what the history holds

    from per-site parameters queries[site], norms[site] ((d,) each; a list or an (S, d) tensor),
    for full routing (block=1), block routing (block > 1: the completed block sums and the current
    block's partial sum) and delta routing (null given: [null, completed block deltas]). Site j
    is read right after the (j+1)-th append. `group` sites share each phase 1 (0: auto_group).
    """

    def __init__(self, queries, norms, heads, eps=1e-6, block=1, group=0, null=None):
        n_sites, width = len(queries), queries[0].shape[-1]
        delta = null is not None
        group = group or auto_group(n_sites, width, heads, block, delta)
        layout(width, heads, group)                                  # fails here if a group cannot fit
        self.queries, self.norms, self.heads, self.eps = queries, norms, heads, eps
        self.block, self.null = block, null
        self.launches, self.lse_count, continued = _launches_by_site(n_sites, group, block, delta,
                                                                     heads, eps)
        self.group = group
        self.rows_total = committed_rows(n_sites - 1, block, delta)
        self.rows = []              # committed sources: (delta's null,) b_0 = s_0, completed blocks
        self.partial = None         # the current block's partial sum, not yet committed
        self.in_block = 0           # how many outputs it holds
        self.appended = 0
        self.traced = torch.compiler.is_compiling()   # traced code cannot read addresses
        self.addresses = []         # of the committed sources, checked and aligned as they came
        self.qg = None              # q ⊙ g (fp32) by group and by site: made at the first append
        self.carrier = None         # hands the source-gradient buffer backward from launch to launch
        # eager: where q ⊙ g's gradient gathers
        self.qg_parts = None if self.traced else QGGradients(n_sites, group, continued)
        self.lses = None            # eager: per site of each launch, where it writes its lse
        self.partials = {}          # site -> its phase-1 state, until its phase 2 (eager: a Partial)
        self.outputs = {}           # site -> its routed output, once complete

    def append(self, source):
        """Append a source (B, T, d): the embedding first, then each sublayer's raw output."""
        if self.appended == len(self.queries):
            raise RuntimeError(f"FusedHistory holds the sources of {len(self.queries)} sites: a history "
                               f"serves one forward pass (with activation checkpointing, checkpoint the "
                               f"sublayers, not the history's append and read)")
        if self.appended == 0:
            check_available(source.device)
            check_sources([source], self.heads, 1)
            # g folded into the query once per forward and split by group and by site. Traced, each
            # launch takes its split (its own slice of the whole (S, d) would give it a gradient of
            # the whole: S·d zeros each); eager, the splits are values, and the first launch takes
            # the whole, whose gradient it sums from every launch's partials.
            qg = torch.stack(list(self.queries)).float() * torch.stack(list(self.norms)).float()
            self.qg_all = qg                                         # (S, d)
            values = qg if self.traced else qg.detach()
            by_site = values.split(1)                                # (1, d) per site
            self.qg = values.split(self.group) if self.group > 1 else by_site, by_site   # (G, d) per group
            if self.null is not None:
                self._commit(self.null.to(source.dtype).expand_as(source))
            self._commit(source)                                     # b_0 = s_0
            if not self.traced:     # every launch's lse, in one tensor (they are kept until backward)
                self.lses = source.new_empty((self.lse_count, *source.shape[:-1], self.heads),
                                             dtype=torch.float32).unbind(0)
        else:
            first = self.rows[0]
            if source.shape != first.shape or source.dtype != first.dtype:
                raise ValueError(f"FusedHistory: every source has the first one's shape and dtype "
                                 f"{tuple(first.shape)} {first.dtype}, got {tuple(source.shape)} "
                                 f"{source.dtype} (append the embedding in the sublayers' dtype)")
            self.partial = source if self.partial is None else self.partial + source
            self.in_block += 1
            if self.in_block == self.block:
                self._commit(self.partial)
                self.partial, self.in_block = None, 0
        self.appended += 1

    def _commit(self, source):
        if not self.traced:
            source = _aligned(source)
            self.addresses.append(source.data_ptr())
        self.rows.append(source)

    def read(self, site):
        """The routed input of site `site` (B, T, d), once the history holds its sources."""
        if site != self.appended - 1:
            raise ValueError(f"FusedHistory.read({site}): site j is read right after the (j+1)-th "
                             f"append, and the history holds {self.appended} sources")
        for launch in self.launches.get(site, ()):
            self._launch(*launch)
        return self.outputs[site]

    def _launch(self, launch, spec, continued, first_lse):
        sources = self.rows[launch.lo:launch.hi]
        addresses = None if self.traced else self.addresses[launch.lo:launch.hi]
        if launch.partial:
            partial = self.partial if self.traced else _aligned(self.partial)
            sources = sources + [partial]
            addresses = None if self.traced else addresses + [partial.data_ptr()]
        if self.carrier is None:
            self.carrier = _carrier(sources[0], self.rows_total)
        by_group, by_site = self.qg
        qg = by_group[launch.site // self.group] if launch.phase == 1 else by_site[launch.site]  # (G, d)
        if self.traced:                          # every state an output of the operator
            init = list(self.partials.pop(launch.site)) if launch.phase == 2 else []
            *results, self.carrier = route_sites(self.carrier, sources, qg, init, *spec)
            states = list(zip(*[iter(results)] * launch.sites))          # (outs, remainders, lses)
            partials = [state if cont else None for cont, state in zip(continued, zip(*states))]
            finals = [out for cont, out in zip(continued, states[0]) if not cont]
        else:                                    # partial states beside autograd, as Partials
            init = self.partials.pop(launch.site) if launch.phase == 2 else None
            partials = [Partial() if cont else None for cont in continued]
            first = launch.site == 0 and launch.phase == 1
            lses = self.lses[first_lse:first_lse + launch.sites]
            call = launch, spec, sources, addresses, init, partials, qg, self.qg_parts, lses
            *finals, self.carrier = RouteSites.apply(self.carrier, self.qg_all if first else None, call,
                                                     *sources[spec.own_lo:])
        finals = iter(finals)
        for site, partial in zip(range(launch.site, launch.site + launch.sites), partials):
            if partial:
                self.partials[site] = partial
            else:
                self.outputs[site] = next(finals)


# %% Traffic: the bytes each algorithm moves
#
# Routing is memory-bound, so bytes are its cost model. `launch_bytes` mirrors the kernels' loads
# and stores term by term; `count_bytes` counts what the interpreter actually loads and stores,
# and a test checks that the two agree exactly. The torch ops around the kernels are modeled only.

def launch_bytes(launch, positions, width, heads, source_bytes, target=None):
    """Bytes one launch's forward and backward kernels load and store: (forward, backward), when
    launched as `target` programs (None: as in this process)."""
    M, d, H, b, G = positions, width, heads, source_bytes, launch.sites
    N = launch.hi - launch.lo + launch.partial                        # sources read
    init = launch.phase == 2                                           # continues a partial state
    programs = _programs(M, target)[1]
    row, state = d * b, 4 * H                                          # bytes of an output row, of its lse
    out = row * (2 if b == 2 else 1)                                   # bf16: with its remainder
    # forward: per program q ⊙ g and the sites' addresses; per position a table entry and a row per
    # source, the partial state read, the outputs (with remainders) and their lse written
    forward = (programs * G * (4 * d + 8 * (6 if init else 3))
               + M * (N * (8 + row) + G * (out + state) * (2 if init else 1)))
    # backward: per program q ⊙ g, addresses, and the partial gradient of q ⊙ g; per position the
    # output gradients and lse, the outputs of complete sites (with remainders), the coupling of
    # continued ones; with a partial state its lse read, its output gradient and coupling written;
    # per source the table entry, the row, the fp32 gradient row (read unless fresh), and the gradient
    # written, to the buffer, or in the source dtype for a source this launch completes
    per_source = [8 + row + 4 * d * (n < launch.fresh_lo) + (4 * d if n < launch.own_lo else row)
                  for n in range(N)]
    continued = bin(launch.continued).count("1")
    sites = G * (row + state) + (G - continued) * out + continued * state
    backward = (programs * G * (8 * d + 8 * (8 if init else 5))
                + M * (sites + init * (2 * state + row) + sum(per_source)))
    return forward, backward


def torch_bytes(launch, positions, width, heads, source_bytes, target=None):
    """A model of the bytes the torch ops around one launch move: (forward, backward), its address
    tables. (q ⊙ g is made once per forward, and its gradient summed once: see traffic.)"""
    N, G = launch.hi - launch.lo + launch.partial, launch.sites
    init = launch.phase == 2
    return 8 * (N + G * (6 if init else 3)), 8 * (N + G * (8 if init else 5))


def traffic(n_layer, width, heads, positions, group=0, block=1, delta=False, source_bytes=2,
            target=PROGRAMS):
    """Bytes a fused forward and backward through all 2L+1 sites move, for `group` (0: auto_group;
    1: one pass per site): {"forward"|"backward": {"kernels": bytes, "torch": bytes}, "saved":
    bytes}, where "saved" is what the routing keeps for backward besides the sources (bf16
    remainders, lse), in eager code (traced, the partial states are kept whole). The kernels
    launched as `target` programs: a GPU's by default, None: this process's."""
    n_sites = 2 * n_layer + 1
    group = group or auto_group(n_sites, width, heads, block, delta)
    layout(width, heads, group)                                      # raises if the group cannot be fused
    launches = schedule(n_sites, group, block, delta)
    kernels = [launch_bytes(launch, positions, width, heads, source_bytes, target) for launch in launches]
    around = [torch_bytes(launch, positions, width, heads, source_bytes, target) for launch in launches]
    E = positions * width * source_bytes                             # bytes of one (B, T, d) source
    # block and delta routing: each output that extends a partial block sum is added to it (read
    # two, write one); backward accumulates the previous sum's gradient when a site read that sum
    extends = [site for site in range(1, n_sites) if (site - 1) % block != 0]
    sums_forward = 3 * E * len(extends)
    sums_backward = 3 * E * sum(reads_partial(site - 1, block, delta) for site in extends)
    null = (E + 4 * width) if delta else 0                           # delta's null: expanded, summed back
    # q ⊙ g of all S sites: two stacks and a product forward; backward the product's gradient and
    # the stacks' (views), from the launches' per-program partials: each buffer summed over
    # programs, phase 2's rows added to a copy of phase 1's sum
    qg = 4 * n_sites * width
    programs = _programs(positions, target)[1]
    again = any(launch.phase == 2 for launch in launches)
    phase2 = 4 * width * sum(launch.phase == 2 for launch in launches)    # rows of q ⊙ g with a phase 2
    gathered = (programs * (qg + phase2) + qg + phase2 + again * (2 * qg + 3 * phase2)
                + 2 * qg * (n_sites % group != 0))                   # the last group's, joined
    qg_forward, qg_backward = 7 * qg, 6 * qg + gathered
    rest = E if source_bytes == 2 else 0                             # a bf16 output's remainder
    # kept for backward (eager): each site's remainder and lse, and the lse of each partial state
    # phase 2 continued (its output and remainder it frees)
    lse = positions * heads * 4
    saved = n_sites * (rest + lse) + sum(launch.phase == 2 for launch in launches) * lse
    return {"forward": {"kernels": sum(f for f, _ in kernels),
                        "torch": sum(f for f, _ in around) + sums_forward + null + qg_forward},
            "backward": {"kernels": sum(b for _, b in kernels),
                         "torch": sum(b for _, b in around) + sums_backward + null + qg_backward},
            "saved": saved}


def count_bytes():
    """A context manager counting the bytes the interpreted kernels load and store (every
    masked-in element of every tl.load and tl.store): `with count_bytes() as counted: ...`, then
    counted["load"], counted["store"]."""
    from contextlib import contextmanager

    import numpy as np
    from triton.runtime import interpreter

    if not INTERPRETED:
        raise RuntimeError("count_bytes counts in the Triton interpreter: set TRITON_INTERPRET=1 "
                           "before triton is imported")
    builder = interpreter.InterpreterBuilder

    def elements(ptrs, mask):
        return int(np.broadcast_to(mask.data, ptrs.data.shape).sum())

    def itemsize(ptrs):
        return np.dtype(interpreter._get_np_dtype(ptrs.get_element_ty())).itemsize

    @contextmanager
    def counting():
        counted = {"load": 0, "store": 0}
        load, store = builder.create_masked_load, builder.create_masked_store

        def counted_load(self, ptrs, mask, other, *args):
            counted["load"] += elements(ptrs, mask) * itemsize(ptrs)
            return load(self, ptrs, mask, other, *args)

        def counted_store(self, ptrs, value, mask, *args):
            counted["store"] += elements(ptrs, mask) * itemsize(ptrs)
            return store(self, ptrs, value, mask, *args)
        builder.create_masked_load, builder.create_masked_store = counted_load, counted_store
        try:
            yield counted
        finally:
            builder.create_masked_load, builder.create_masked_store = load, store
    return counting()


# %% Checks and benchmark
#
# The paper's kernel table: all 2L+1 sites forward + backward for one microbatch, bf16 sources,
# (preset, d, L, B, T). H = 8 at every scale, as in the paper's later version (the earlier one
# used n_kv_head: 4 at 100M, 8 at 350M and 1B).
KERNEL_TABLE = [("100m", 512, 12, 2, 2048), ("350m", 1024, 24, 1, 1024), ("1b", 1280, 36, 1, 1024)]
HEADS = 8
PAPER_MS = {"100m": (30.2, 5.7), "350m": (53.1, 11.4), "1b": (153.2, 42.4)}  # torch.compile, fused
# What the first version of these kernels (one pass per site, a two-pass backward) moved at those
# shapes with H = n_kv_head, counted as traffic() counts: every byte loaded or stored.
PREVIOUS_GB = {"100m": 11.4, "350m": 19.9, "1b": 53.1}
HBM = {"H100": 3.35e12, "H200": 4.8e12}         # bytes/s, vendor datasheets (H100 SXM, H200 SXM)


def stacked_network(route):
    """A network of sites over full routing, stacking each site's sources as the readable path
    does: network(s0, qs, gs, heads, sublayer), where `sublayer` turns site j's output into
    source j+1."""
    def network(s0, qs, gs, heads, sublayer):
        sources = [s0]
        h = route(torch.stack(sources), qs[0], gs[0], heads)
        for q, g in zip(qs[1:], gs[1:]):
            sources.append(sublayer(h))
            h = route(torch.stack(sources), q, g, heads)
        return h
    return network


def fused_network(group):
    """The same network through a FusedHistory that groups `group` sites (0: automatic)."""
    def network(s0, qs, gs, heads, sublayer):
        history = FusedHistory(qs, gs, heads, group=group)
        history.append(s0)
        h = history.read(0)
        for site in range(1, len(qs)):
            history.append(sublayer(h))
            h = history.read(site)
        return h
    return network


def _relative_error(a, b):
    # clamped: with one source the softmax is constant and dq = dg = 0 exactly on both sides
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def _check(device, routes, networks):
    """fused_route and FusedHistory (one pass per site and grouped) against mhar.route: the output
    and every gradient, fp32 and bf16 (compared with the float32 reference on the same rounded
    inputs). routes: (N, B, T, d, H) each; networks: (sites, B, T, d, H) each."""
    import mhar
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 2e-2}      # bf16: outputs rounded to 8 bits
    # Along a chain of sites the two paths' roundings compound, and dq, dg come from a cancellation
    # (<dout, V_n> − c) that magnifies them: a few 1e-6 in fp32, a few % in bf16.
    chain_tolerance = {torch.float32: 1e-4, torch.bfloat16: 5e-2}
    failed = False
    for dtype in SOURCE_TYPES:
        for N, B, T, d, heads in routes:
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
            print(f"fused_route   {str(dtype)[6:]:8} N={N:<3} B·T={B * T:<4} d={d:<4} H={heads:<2}      "
                  + "  ".join(f"{name} {e:.1e}" for name, e in zip(("out", "dV", "dq", "dg"), errors)))
        for sites, B, T, d, heads in networks:
            s0 = torch.randn(B, T, d, device=device).to(dtype)
            qs = [0.3 * torch.randn(d, device=device) for _ in range(sites)]
            gs = [1 + 0.1 * torch.randn(d, device=device) for _ in range(sites)]
            dout = torch.randn(B, T, d, device=device).to(dtype)
            # The sublayer: a fixed random projection and tanh. (An identity, or sin, would make the
            # later sources nearly equal to earlier ones: in bf16 the coupling c, taken from the
            # rounded output, then loses most of its digits to the cancellation; see docs/kernels.md.)
            projection = torch.randn(d, d, device=device) / d ** 0.5

            def sublayer(h):
                return torch.tanh(h.float() @ projection).to(h.dtype)
            for group in (1, 0):
                results = []
                for network in (fused_network(group), stacked_network(mhar.route)):
                    leaves = [x.clone().requires_grad_() for x in [s0, *qs, *gs]]
                    out = network(leaves[0], leaves[1:sites + 1], leaves[sites + 1:], heads, sublayer)
                    out.backward(dout.to(out.dtype))
                    # dq and dg of all sites as one vector each (site 0 reads one source: exactly zero)
                    results.append([out, leaves[0].grad, torch.cat([x.grad for x in leaves[1:sites + 1]]),
                                    torch.cat([x.grad for x in leaves[sites + 1:]])])
                errors = [_relative_error(a, b) for a, b in zip(*results)]
                failed |= max(errors) > chain_tolerance[dtype]
                G = group or auto_group(sites, d, heads)
                print(f"FusedHistory  {str(dtype)[6:]:8} {sites} sites B·T={B * T:<4} d={d:<4} H={heads:<2} "
                      f"G={G:<2} "
                      + "  ".join(f"{name} {e:.1e}" for name, e in zip(("out", "ds0", "dq", "dg"), errors)))
    print("check FAILED" if failed else "check passed")
    return not failed


def print_traffic():
    """Bytes and bandwidth-bound time of both algorithms at the kernel-table shapes (traffic())."""
    print("A fused forward + backward through all 2L+1 sites, bf16 sources, H = 8: the bytes the "
          "kernels load and store, and the torch ops around them (traffic()); time at HBM bandwidth, "
          "datasheet figures: H100 SXM 3.35 TB/s, H200 4.8 TB/s.")
    print(f"{'shape':6} {'B·T':>5} {'algorithm':18} {'G':>2} {'kernels GB':>10} {'torch GB':>8} "
          f"{'vs first':>8} {'H100 ms':>7} {'H200 ms':>7} {'saved MB':>8}")
    for preset, d, L, B, T in KERNEL_TABLE:
        for name, group in (("one pass per site", 1), ("grouped", 0)):
            moved = traffic(L, d, HEADS, B * T, group)
            kernels = moved["forward"]["kernels"] + moved["backward"]["kernels"]
            total = kernels + moved["forward"]["torch"] + moved["backward"]["torch"]
            G = group or auto_group(2 * L + 1, d, HEADS)
            print(f"{preset:6} {B * T:5} {name:18} {G:2} {kernels / 1e9:10.2f} "
                  f"{(total - kernels) / 1e9:8.3f} "
                  f"{total / 1e9 / PREVIOUS_GB[preset]:7.2f}x {total / HBM['H100'] * 1e3:7.2f} "
                  f"{total / HBM['H200'] * 1e3:7.2f} {moved['saved'] / 1e6:8.0f}")
    print("vs first: total bytes over those of the first version of these kernels (11.4 / 19.9 / "
          "53.1 GB). saved: the routing's activations kept for backward besides the sources (each "
          "output's bf16 remainder and lse; grouped: also the lse of each partial state).")


def _benchmark(device="cuda", shapes=KERNEL_TABLE, timer=None, compile_backend="inductor",
               dtype=torch.bfloat16):
    """Route every site of a network (identity sublayers: only the routing is timed), forward +
    backward: readable, torch.compile'd, fused one pass per site, fused grouped at every group
    size that fits (auto_group's marked *). Prints ms, achieved GB/s (the modeled bytes over the
    time) and % of the copy bandwidth; returns {(preset, "fused 1" | "fused G"): ms}, G auto_group's."""
    import mhar
    timer = timer or _do_bench
    bandwidth = _copy_bandwidth(timer) if device == "cuda" else None
    if bandwidth:
        print(f"\n{torch.cuda.get_device_name()}: copy bandwidth {bandwidth / 1e9:.0f} GB/s (read + write)")
    compiled = torch.compile(mhar.route, dynamic=True, backend=compile_backend)
    identity = torch.nn.Identity()
    routing = {}
    print(f"{'shape':6} {'method':8} {'G':>2} {'fwd+bwd ms':>10} {'host ms':>7} {'GB/s':>6} "
          f"{'% of copy':>9}   (paper, H100: torch.compile, fused)")
    for preset, d, L, B, T in shapes:
        sites = 2 * L + 1
        s0 = torch.randn(B, T, d, device=device, dtype=dtype, requires_grad=True)
        qs = [(0.02 * torch.randn(d, device=device)).requires_grad_() for _ in range(sites)]
        gs = [torch.ones(d, device=device, requires_grad=True) for _ in range(sites)]
        dout = torch.randn(B, T, d, device=device, dtype=dtype)
        chosen = auto_group(sites, d, HEADS)
        methods = {"eager": (stacked_network(mhar.route), None),
                   "compile": (stacked_network(compiled), None), "fused 1": (fused_network(1), 1),
                   **{f"fused {G}" + ("*" if G == chosen else ""): (fused_network(G), G)
                      for G in range(2, sites + 1) if _fits(d, HEADS, G) and G <= 12}}
        for method, (network, group) in methods.items():
            def run():
                network(s0, qs, gs, HEADS, identity).backward(dout)
            try:
                ms = timer(run, grad_to_none=[s0, *qs, *gs])
                host = _host_ms(run, device)
            except torch.cuda.OutOfMemoryError:
                print(f"{preset:6} {method:8} {'':2} {'OOM':>10}")
                continue
            finally:
                if device == "cuda":
                    torch.cuda.empty_cache()
            line = f"{preset:6} {method:8} {group or '':>2} {ms:10.2f} {host:7.2f}"
            if group:
                moved = traffic(L, d, HEADS, B * T, group, source_bytes=s0.element_size())
                moved = sum(sum(moved[way].values()) for way in ("forward", "backward"))
                per_second = moved / ms * 1e3                              # bytes/s
                line += f" {per_second / 1e9:6.0f} {100 * per_second / bandwidth if bandwidth else 0:9.0f}"
                routing.update({(preset, "fused 1"): ms} if group == 1 else {})
                routing.update({(preset, "fused G"): ms} if group == chosen else {})
            if preset in PAPER_MS and group == chosen:
                line += f"   ({PAPER_MS[preset][0]} ms, {PAPER_MS[preset][1]} ms)"
            print(line)
    return routing


def _step_benchmark(routing, device="cuda", steps=None, timer=None, vocab_size=50304):
    """A whole training step (forward + backward, bf16 autocast on a GPU, one microbatch of the
    kernel-table shape): the baseline, MHAR eager and fused (both algorithms), and the grouped
    routing's share of its step, and the peak memory of the baseline's and the fused step. Speed =
    baseline ms / fused ms, the tokens/s ratio (the paper: 0.88 / 0.71 / 0.55)."""
    import mhar
    timer = timer or _do_bench
    steps = steps or [(preset, B, T) for preset, _, _, B, T in KERNEL_TABLE]
    print(f"\n{'shape':6} {'baseline ms':>11} {'eager ms':>9} {'fused 1 ms':>10} {'fused G ms':>10} "
          f"{'speed G':>7} {'routing share G':>15} {'peak GB base/fused G':>20}")
    for preset, B, T in steps:
        idx = torch.randint(0, vocab_size, (B, T), device=device)
        step_ms, peak = {}, {}
        for name, overrides in (("baseline", dict(residual="baseline")), ("eager", dict(route_heads=HEADS)),
                                ("fused 1", dict(route_heads=HEADS, fused=True, fused_group=1)),
                                ("fused G", dict(route_heads=HEADS, fused=True))):
            model = mhar.GPT(mhar.preset(preset, vocab_size=vocab_size, **overrides)).to(device)

            def step():
                with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
                    loss = model(idx, idx)[1]
                loss.backward()
            try:
                if device == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                step_ms[name] = timer(step, grad_to_none=list(model.parameters()))
                peak[name] = torch.cuda.max_memory_allocated() / 1e9 if device == "cuda" else float("nan")
            except torch.cuda.OutOfMemoryError:
                step_ms[name] = float("nan")                        # the paper's eager 1B runs out too
            finally:
                model = None                                        # frees its memory before the next
                if device == "cuda":
                    torch.cuda.empty_cache()
        share = routing.get((preset, "fused G"), float("nan")) / step_ms["fused G"]
        print(f"{preset:6} {step_ms['baseline']:11.1f} {step_ms['eager']:9.1f} {step_ms['fused 1']:10.1f} "
              f"{step_ms['fused G']:10.1f} {step_ms['baseline'] / step_ms['fused G']:6.2f}x "
              f"{100 * share:14.0f}% {peak.get('baseline', float('nan')):9.1f}/"
              f"{peak.get('fused G', float('nan')):.1f}")


def host_cost(shapes=KERNEL_TABLE, positions=4, repeats=3, heads=HEADS):
    """Python's share of the fused path: every interpreted launch a no-op, a chain of 2L+1 sites
    (each source the previous site's output times 1.0) forward then backward, against the same
    chain with each site one plain op h * q_j; best of `repeats` × 3 runs of each, alternating,
    one thread, its CPU time. Prints µs per site and the ratio; returns {(preset, group): ratio}.
    Needs the interpreter (CPU)."""
    import time
    from triton.runtime import interpreter

    if not INTERPRETED:
        raise RuntimeError("host_cost stubs the Triton interpreter's launches: set TRITON_INTERPRET=1 "
                           "before triton is imported (python kernel.py --host does, without a GPU)")

    def best(*runs):
        """The best of `repeats` × 3 runs of each, alternating, in this thread's CPU time: other
        processes on the machine weigh on both alike, and hardly at all."""
        for run in runs:
            run()                                                   # warm: caches, schedules
        times = [[] for _ in runs]
        for _ in range(repeats):
            for run, kept in zip(runs, times):
                start = time.thread_time()
                for _ in range(3):
                    run()
                kept.append((time.thread_time() - start) / 3)
        return [min(kept) for kept in times]

    def fused_chain(s0, qs, gs, group):
        history = FusedHistory(qs, gs, heads, group=group)
        history.append(s0)
        out = history.read(0)
        for site in range(1, len(qs)):
            history.append(out * 1.0)
            out = history.read(site)
        out.float().sum().backward()

    def plain_chain(s0, qs):
        h = s0
        for site, q in enumerate(qs):
            h = (h * 1.0 if site else h) * q.to(h.dtype)
        h.float().sum().backward()

    threads, run = torch.get_num_threads(), interpreter.InterpretedFunction.run
    torch.set_num_threads(1)
    interpreter.InterpretedFunction.run = lambda *args, **kwargs: None    # launches cost nothing
    ratios = {}
    try:
        print(f"host time per routing site, forward + backward, launches stubbed, {positions} bf16 "
              f"positions, H = {heads}, one thread; plain: one op h * q_j per site")
        print(f"{'shape':6} {'d':>5} {'sites':>5} {'G':>3} {'fused µs':>9} {'plain µs':>9} {'ratio':>6}")
        for preset, d, L, *_ in shapes:
            sites = 2 * L + 1
            s0 = torch.randn(1, positions, d).bfloat16().requires_grad_()
            qs = [torch.zeros(d, requires_grad=True) for _ in range(sites)]
            gs = [torch.ones(d, requires_grad=True) for _ in range(sites)]
            for group in (1, auto_group(sites, d, heads)):
                plain, fused = (t / sites for t in best(lambda: plain_chain(s0, qs),
                                                        lambda: fused_chain(s0, qs, gs, group)))
                ratios[preset, group] = fused / plain
                print(f"{preset:6} {d:5} {sites:5} {group:3} {fused * 1e6:9.0f} {plain * 1e6:9.0f} "
                      f"{fused / plain:5.1f}x")
    finally:
        interpreter.InterpretedFunction.run = run
        torch.set_num_threads(threads)
    return ratios


def _host_ms(fn, device):
    """The host's time to issue fn: on a GPU the launches are queued and Python returns before
    the kernels end, unless something synchronizes; where host ms nears fwd+bwd ms, the host is
    the bound."""
    import time
    synchronize = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    synchronize()
    start = time.perf_counter()
    fn()
    host = time.perf_counter() - start
    synchronize()
    return host * 1e3


def _do_bench(fn, grad_to_none=None):
    from triton.testing import do_bench
    return do_bench(fn, grad_to_none=grad_to_none, return_mode="median")


def _copy_bandwidth(timer):
    x = torch.empty(2**28, device="cuda")
    y = torch.empty_like(x)
    return 2 * x.nbytes / timer(lambda: y.copy_(x)) * 1e3           # bytes/s, read + write


def main(argv=None):
    import argparse
    parser = argparse.ArgumentParser(description="Check the fused routing against mhar.route; with a "
                                                 "GPU, benchmark it; --traffic prints the modeled bytes.")
    parser.add_argument("--traffic", action="store_true", help="the traffic model at the kernel-table shapes")
    parser.add_argument("--host", action="store_true",
                        help="the host (Python) time per site with the launches stubbed (CPU, interpreter)")
    args = parser.parse_args(argv)
    if args.traffic:
        print_traffic()
        return 0
    if args.host:
        host_cost()
        return 0
    torch.manual_seed(0)
    if torch.cuda.is_available() and not INTERPRETED:
        # (N, B, T, d, H): one source; odd widths; the 1B width; the deepest site of 350M.
        # Networks: the 100M depth at the 1B width, the 350M depth.
        routes = [(1, 2, 33, 40, 8), (9, 3, 65, 520, 8), (25, 1, 257, 1280, 8), (49, 1, 129, 1024, 8)]
        ok = _check("cuda", routes, [(25, 1, 257, 1280, 8), (49, 1, 65, 1024, 8)])
        _step_benchmark(_benchmark())
    else:
        print("no CUDA GPU: checking the kernels in the Triton interpreter on small shapes; no benchmark")
        ok = _check("cpu", [(1, 1, 3, 24, 2), (9, 3, 5, 40, 4)], [(7, 1, 5, 40, 4)])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
