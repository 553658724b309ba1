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

The schedule's words. reads[j] = (committed, partial): site j reads the first `committed`
committed sources (no later block sum changes them: the rows of the fp32 gradient buffer) and, if
`partial`, its block's partial sum (read by site j alone, outside the buffer). A group: G
consecutive sites. Its phase 1: one launch over the committed rows its first site reads (in a
group of one, with the partial sum); a site that reads more has a phase 2, a launch of it alone
over the rest. A launch's sources n < N are buffer rows row0 + n (a partial sum last, none). In its
backward, own_lo: sources own_lo.. are complete (no earlier launch reads them, so this backward,
the last to touch them, writes their final gradients, in their dtype); fresh_lo: sources
fresh_lo.. have no gradient yet (no later launch reads them: rows written, not added to);
given_sites (`continued` in Spec and Launch): a bit per site, 1 << i for its i-th, whose state a
phase 2 continues, which hands back that site's coupling <dout, out>.

Autograd without Python-side state. Each launch is a torch custom operator with a functional
signature (a list of source tensors, which the kernel reads through a table of addresses: no
copies), so `torch.compile(fullgraph=True)` traces a fused model; eager code runs the same
launch through a torch.autograd.Function, whose dispatch costs the host far less. The fp32
source-gradient buffer travels backward as the gradient of a "carrier" tensor (no memory) that
each launch hands to the next, adding its share in place (see own_lo, fresh_lo). No atomics:
every position belongs to one program, and dq, dg come from one per-program partial of Σ dℓ·r·V
that torch sums in a fixed order, so the backward is bitwise deterministic.

The file reads (# %%): the kernels; their launches' keys and launchers (launcher.py writes the
custom operators' address tables and binds the launches); autograd (the shared launch, the custom
operators, the eager path); the schedule, the traffic model (`launch_bytes`, which a test checks
against the interpreter's count) and the roofline that pick G; the public API, `fused_route` and
`FusedHistory`. bench_kernel.py checks the kernels against `mhar.route`, prints the bytes both
algorithms move, benchmarks them and measures the host's time per site.
Without a CUDA GPU the kernels run in the Triton interpreter, on CPU tensors, when
TRITON_INTERPRET=1 is set before this file is imported (slow; for tests).
"""
import functools
import math
import sys
from collections import namedtuple
from typing import Optional

import torch
from torch import Tensor

UNAVAILABLE = ("fused routing needs a CUDA GPU, or TRITON_INTERPRET=1 set before triton is "
               "imported to run the kernels on the CPU (slow; for tests)")
try:
    import triton
    import triton.language as tl
    from triton import knobs

    import launcher
except ImportError as error:
    if __name__ == "__main__":  # python kernel.py: one line, as every script's
        print("kernel.py: error: triton is not installed (pip install triton)", file=sys.stderr)
        raise SystemExit(2)
    raise RuntimeError(f"{UNAVAILABLE}; triton is not installed (pip install triton)") from error

SOURCE_TYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16}
# The forward keeps (G, H, K) fp32 tiles of its G sites, the backward three rows per site (q ⊙ g,
# the output gradient, the gradient of q ⊙ g). With (G, H, K) tiles in both, on sm_90 at 8 warps
# 8192 lanes (8 sites at d = 1024) fit without spilling, 10240 spilled. Larger are refused.
MAX_TILE = 8192
# Each program routes a contiguous block of positions, so that dq and dg leave as one partial per
# program. The grid follows the SMs: 16 / num_warps programs per SM, all resident when registers
# allow, so that 16 warps per SM hide the loads' latency. PROGRAMS: the grid of an 8-warp kernel
# on an H100/H200 (132 SMs), the traffic model's device.
RESIDENT_WARPS = 16
PROGRAMS = RESIDENT_WARPS // 8 * 132
INTERPRETED_PROGRAMS = 3    # the interpreter runs programs one by one: few, of many positions
NUM_STAGES = 3              # source rows in flight in the loop over sources (software pipeline)
# The kernels read the sources through a table of int64 addresses: source n < committed at
# table[first_source + n] (a history's one table, each address written by the forward launch that
# reads its source first; a custom operator's, one a launch), and a partial sum after them from
# the entry of `entries` after the sites'. Each site's own tensors come as kernel arguments,
# `entries`, FORWARD_ENTRIES per site: its output, the output's remainder, its lse;
# BACKWARD_ENTRIES in backward: its output, remainder, output gradient, lse, and the coupling
# given for a partial state (any address for a complete site). In phase 2 each site's go on with
# the partial state's, forward: its output, remainder and lse; backward: its lse, and where its
# output gradient and coupling go. (tl.constexpr, for Triton)
FORWARD_ENTRIES = tl.constexpr(3)
BACKWARD_ENTRIES = tl.constexpr(5)
INIT_ENTRIES = tl.constexpr(3)


# %% The kernels
# A row of width d is held as two tiles of heads × lanes: the first K1 lanes of every head (K1 the
# largest power of two ≤ K) and the remaining K2 = K − K1. Tile dimensions are powers of two, so
# one (H, K) tile would pad K = 160 (d = 1280, H = 8) to 256 lanes, 37.5 % idle; 128 + 32 has none.
# A program's G sites add a leading dimension. (The loops' arithmetic is written out, not in
# @triton.jit helpers: the interpreter re-patches the language at each call, doubling test time.)

@triton.jit
def _row_tiles(K: tl.constexpr, K1: tl.constexpr, K2: tl.constexpr, K2_PAD: tl.constexpr,
               H: tl.constexpr, H_PAD: tl.constexpr):
    """Offsets and masks of the two tiles that cover a row: (H_PAD, K1) and (H_PAD, K2_PAD)."""
    heads = tl.arange(0, H_PAD)
    lanes1, lanes2 = tl.arange(0, K1), tl.arange(0, K2_PAD)
    cols1 = heads[:, None] * K + lanes1[None, :]
    cols2 = heads[:, None] * K + K1 + lanes2[None, :]
    mask1 = (heads[:, None] < H) & (lanes1[None, :] < K1)
    mask2 = (heads[:, None] < H) & (lanes2[None, :] < K2)
    return cols1, cols2, mask1, mask2


@triton.jit
def _site_addresses(entries, k: tl.constexpr, STRIDE: tl.constexpr, G: tl.constexpr,
                    G_PAD: tl.constexpr, ELEMENT: tl.constexpr):
    """Entry k of each of the G sites in `entries` (STRIDE a site) as a (G_PAD,) vector of pointers
    to ELEMENT, 16-byte aligned (the callers' tensors are: loads vectorize and pipeline)."""
    sites = tl.arange(0, G_PAD)
    at = tl.zeros([G_PAD], tl.int64)
    for i in tl.static_range(G):
        at = tl.where(sites == i, entries[i * STRIDE + k], at)
    return tl.multiple_of(at.to(tl.pointer_type(ELEMENT)), 16)


# N, M and the row indices stay runtime integers: triton would turn a value of 1 into a
# constexpr, and specializing on their divisibility by 16 would compile more variants for no gain.
@triton.jit(do_not_specialize=["first_source", "committed", "N", "M", "per_program"])
def _route_forward_kernel(
    table_ptr,          # int64 addresses of the sources, as laid out above FORWARD_ENTRIES
    entries,            # int64 addresses: FORWARD_ENTRIES per site (and INIT_ENTRIES more with
                        # INIT), as laid out above FORWARD_ENTRIES, then the partial sum's (source
                        # N - 1 when committed < N; any address otherwise), then those of the last
                        # committed sources that are not in the table yet
    qg_ptr,             # [G, D] fp32: q ⊙ g of each site (g folded into the query once)
    first_source,       # the table entry of source 0
    committed,          # sources read from the table (the rest: the partial sum)
    N, M,               # number of sources to read, of positions B·T
    per_program,        # positions routed by each program
    eps,                # RMSNorm epsilon
    SOURCE: tl.constexpr,   # element type of sources and outputs: tl.float32 or tl.bfloat16
    D: tl.constexpr, H: tl.constexpr, K: tl.constexpr,    # width d, heads, head width d / H
    K1: tl.constexpr, K2: tl.constexpr,   # the two tiles' lanes: largest power of 2 <= K; K - K1
    K2_PAD: tl.constexpr, H_PAD: tl.constexpr,  # next powers of 2 >= K2 (1 when K2 = 0) and >= H
    G: tl.constexpr, G_PAD: tl.constexpr,       # sites routed together, next power of 2 >= G
    INIT: tl.constexpr,     # each site continues a partial state instead of starting empty
    SPLIT: tl.constexpr,    # bf16 outputs: also store the remainder out − bf16(out), in bf16
    NUM_STAGES: tl.constexpr,
):
    first = tl.program_id(0).to(tl.int64) * per_program     # int64: pos · d can pass 2^31
    last = tl.minimum(first + per_program, M)
    cols1, cols2, mask1, mask2 = _row_tiles(K, K1, K2, K2_PAD, H, H_PAD)
    sites, heads = tl.arange(0, G_PAD), tl.arange(0, H_PAD)
    site_mask = sites < G
    state_mask = site_mask[:, None] & (heads[None, :] < H)            # (G_PAD, H_PAD)
    tile1 = site_mask[:, None, None] & mask1[None, :, :]              # (G_PAD, H_PAD, K1)
    tile2 = site_mask[:, None, None] & mask2[None, :, :]              # (G_PAD, H_PAD, K2_PAD)
    qg1 = tl.load(qg_ptr + sites[:, None, None] * D + cols1[None, :, :], mask=tile1, other=0.0)
    qg2 = tl.load(qg_ptr + sites[:, None, None] * D + cols2[None, :, :], mask=tile2, other=0.0)
    STRIDE: tl.constexpr = FORWARD_ENTRIES + INIT * INIT_ENTRIES
    out_at = _site_addresses(entries, 0, STRIDE, G, G_PAD, SOURCE)
    rest_at = _site_addresses(entries, 1, STRIDE, G, G_PAD, SOURCE)
    lse_at = _site_addresses(entries, 2, STRIDE, G, G_PAD, tl.float32)
    if INIT:
        init_out_at = _site_addresses(entries, FORWARD_ENTRIES, STRIDE, G, G_PAD, SOURCE)
        init_rest_at = _site_addresses(entries, FORWARD_ENTRIES + 1, STRIDE, G, G_PAD, SOURCE)
        init_lse_at = _site_addresses(entries, FORWARD_ENTRIES + 2, STRIDE, G, G_PAD, tl.float32)
    partial_at = entries[G * STRIDE]
    # The committed sources no earlier launch read (a history's newest): read from `entries`, and
    # written into the table by program 0 for the launches after this one (the stream orders them)
    NEW: tl.constexpr = len(entries) - G * STRIDE - 1
    in_table = committed - NEW
    for i in tl.static_range(NEW):
        tl.store(table_ptr + first_source + in_table + i, entries[G * STRIDE + 1 + i],
                 mask=tl.program_id(0) == 0)

    for pos in range(first, last):
        row1, row2 = pos * D + cols1[None, :, :], pos * D + cols2[None, :, :]
        state = pos * H + heads[None, :]
        if INIT:    # a normalized (out, lse) is the online softmax state (max lse, sum 1, acc out)
            acc1 = tl.load(init_out_at[:, None, None] + row1, mask=tile1, other=0.0).to(tl.float32)
            acc2 = tl.load(init_out_at[:, None, None] + row2, mask=tile2, other=0.0).to(tl.float32)
            if SPLIT:
                init_rest1 = tl.load(init_rest_at[:, None, None] + row1, mask=tile1, other=0.0)
                init_rest2 = tl.load(init_rest_at[:, None, None] + row2, mask=tile2, other=0.0)
                acc1 += init_rest1.to(tl.float32)
                acc2 += init_rest2.to(tl.float32)
            row_max = tl.load(init_lse_at[:, None] + state, mask=state_mask, other=0.0)
            row_sum = tl.full([G_PAD, H_PAD], 1.0, tl.float32)
        else:
            acc1 = tl.zeros([G_PAD, H_PAD, K1], tl.float32)                # Σ_n exp(ℓ_n − max)·V_n
            acc2 = tl.zeros([G_PAD, H_PAD, K2_PAD], tl.float32)
            row_max = tl.full([G_PAD, H_PAD], float("-inf"), tl.float32)   # online softmax per head
            row_sum = tl.zeros([G_PAD, H_PAD], tl.float32)
        for n in tl.range(0, N, num_stages=NUM_STAGES):
            source = tl.load(table_ptr + first_source + n, mask=n < in_table, other=partial_at)
            for i in tl.static_range(NEW):
                source = tl.where(n == in_table + i, entries[G * STRIDE + 1 + i], source)
            source = tl.multiple_of(source.to(tl.pointer_type(SOURCE)), 16) + pos * D
            v1 = tl.load(source + cols1, mask=mask1, other=0.0).to(tl.float32)   # (H_PAD, K1)
            v2 = tl.load(source + cols2, mask=mask2, other=0.0).to(tl.float32)   # (H_PAD, K2_PAD)
            r = tl.rsqrt((tl.sum(v1 * v1) + tl.sum(v2 * v2)) / D + eps)    # over the full width
            logit = r * (tl.sum(qg1 * v1[None, :, :], axis=2)
                         + tl.sum(qg2 * v2[None, :, :], axis=2))           # (G_PAD, H_PAD)
            new_max = tl.maximum(row_max, logit)
            rescale = tl.exp(row_max - new_max)
            weight = tl.exp(logit - new_max)
            row_sum = row_sum * rescale + weight
            acc1 = acc1 * rescale[:, :, None] + weight[:, :, None] * v1[None, :, :]
            acc2 = acc2 * rescale[:, :, None] + weight[:, :, None] * v2[None, :, :]
            row_max = new_max
        out1, out2 = acc1 / row_sum[:, :, None], acc2 / row_sum[:, :, None]
        tl.store(out_at[:, None, None] + row1, out1.to(SOURCE), mask=tile1)
        tl.store(out_at[:, None, None] + row2, out2.to(SOURCE), mask=tile2)
        if SPLIT:   # out = bf16(out) + remainder, to ~16 bits: backward and phase 2 read both
            rest1 = out1 - out1.to(SOURCE).to(tl.float32)
            rest2 = out2 - out2.to(SOURCE).to(tl.float32)
            tl.store(rest_at[:, None, None] + row1, rest1.to(SOURCE), mask=tile1)
            tl.store(rest_at[:, None, None] + row2, rest2.to(SOURCE), mask=tile2)
        tl.store(lse_at[:, None] + state, row_max + tl.log(row_sum), mask=state_mask)


@triton.jit(do_not_specialize=["first_source", "committed", "N", "M", "per_program", "row0",
                               "own_lo", "fresh_lo", "given_sites"])
def _route_backward_kernel(
    table_ptr,          # int64 addresses of the sources, as in the forward
    entries,            # int64 addresses: BACKWARD_ENTRIES per site (and INIT_ENTRIES more with
                        # INIT), as laid out above FORWARD_ENTRIES, then the partial sum's
    qg_ptr,             # [G, D] fp32: q ⊙ g of each site
    grads_ptr,          # [rows, M, D] fp32 source-gradient buffer: source n is row row0 + n
    owned_ptr,          # [N - own_lo, M, D] final gradients of sources own_lo.., in their dtype
    qg_grad_ptr,        # [programs, G, D] fp32: per program, Σ of dℓ·r·V over positions, sources
    first_source, committed, N, M, per_program,  # as in the forward
    row0,               # buffer row of source 0
    own_lo,             # sources own_lo.. are complete after this launch: written to owned_ptr
    fresh_lo,           # sources fresh_lo.. have no earlier gradient: rows written, not added to
    given_sites,        # a bit per site whose coupling is given (a partial state: Spec.continued)
    eps,                # RMSNorm epsilon
    SOURCE: tl.constexpr, D: tl.constexpr, H: tl.constexpr, K: tl.constexpr, K1: tl.constexpr,
    K2: tl.constexpr, K2_PAD: tl.constexpr, H_PAD: tl.constexpr, G: tl.constexpr,
    G_PAD: tl.constexpr, INIT: tl.constexpr, SPLIT: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    # The sites' states are tuples of G (H_PAD, K) tiles, one per site, rather than (G_PAD, H_PAD,
    # K) tiles: the three a program keeps through its loops (q ⊙ g, the output gradients, the
    # gradient of q ⊙ g) hold no padded sites, and a row's (H_PAD, K) tensors are not copied to
    # every warp that holds other sites, so that 16 warps stay resident on an SM (docs/kernels.md).
    first = tl.program_id(0).to(tl.int64) * per_program
    last = tl.minimum(first + per_program, M)
    cols1, cols2, mask1, mask2 = _row_tiles(K, K1, K2, K2_PAD, H, H_PAD)
    heads = tl.arange(0, H_PAD)
    head_mask = heads < H
    qg1, qg2, qg_grad1, qg_grad2 = (), (), (), ()
    for i in tl.static_range(G):
        qg1 += (tl.load(qg_ptr + i * D + cols1, mask=mask1, other=0.0),)
        qg2 += (tl.load(qg_ptr + i * D + cols2, mask=mask2, other=0.0),)
        qg_grad1 += (tl.zeros([H_PAD, K1], tl.float32),)                    # Σ dℓ·r·V per site
        qg_grad2 += (tl.zeros([H_PAD, K2_PAD], tl.float32),)
    row_stride = M.to(tl.int64) * D                 # int64: rows · B·T·d passes 2^31 at large B·T
    STRIDE: tl.constexpr = BACKWARD_ENTRIES + INIT * INIT_ENTRIES
    partial_at = entries[G * STRIDE]

    for pos in range(first, last):
        row1, row2 = pos * D + cols1, pos * D + cols2
        state = pos * H + heads
        dout1, dout2, lse, coupling = (), (), (), ()
        for i in tl.static_range(G):
            # the site's addresses, kernel arguments (scalars in registers, not tiles)
            out_at = tl.multiple_of(entries[i * STRIDE].to(tl.pointer_type(SOURCE)), 16)
            rest_at = tl.multiple_of(entries[i * STRIDE + 1].to(tl.pointer_type(SOURCE)), 16)
            dout_at = tl.multiple_of(entries[i * STRIDE + 2].to(tl.pointer_type(SOURCE)), 16)
            lse_at = tl.multiple_of(entries[i * STRIDE + 3].to(tl.pointer_type(tl.float32)), 16)
            given = ((tl.full([1], given_sites, tl.int32) >> i) & 1) != 0   # a partial state
            complete = given == 0                                           # its output is read
            given_at = tl.multiple_of(entries[i * STRIDE + 4].to(tl.pointer_type(tl.float32)), 16)
            d1 = tl.load(dout_at + row1, mask=mask1, other=0.0).to(tl.float32)
            d2 = tl.load(dout_at + row2, mask=mask2, other=0.0).to(tl.float32)
            lse += (tl.load(lse_at + state, mask=head_mask, other=0.0),)
            # The softmax couples the sources: dℓ_n = α_n·(<dout, V_n> − c) per head, with
            # c = Σ_n α_n·<dout, V_n> = <dout, out>: no pass over the sources (FlashAttention's
            # rowsum(dO ∘ O)). A bf16 output's rounding would cost c most of its digits where the
            # sources are alike: out is read with its remainder, to ~16 bits. A partial state's c
            # comes from the phase 2 that continued it, exact (below): its output is not read.
            out1 = tl.load(out_at + row1, mask=mask1 & complete, other=0.0).to(tl.float32)
            out2 = tl.load(out_at + row2, mask=mask2 & complete, other=0.0).to(tl.float32)
            if SPLIT:
                out1 += tl.load(rest_at + row1, mask=mask1 & complete, other=0.0).to(tl.float32)
                out2 += tl.load(rest_at + row2, mask=mask2 & complete, other=0.0).to(tl.float32)
            c = (tl.sum(d1 * out1, axis=1) + tl.sum(d2 * out2, axis=1)
                 + tl.load(given_at + state, mask=head_mask & given, other=0.0))
            if INIT:    # out = β·init_out + Σ_n α_n·V_n, with β = exp(init_lse − lse)
                init_lse_at = tl.multiple_of(
                    entries[i * STRIDE + BACKWARD_ENTRIES].to(tl.pointer_type(tl.float32)), 16)
                init_dout_at = tl.multiple_of(
                    entries[i * STRIDE + BACKWARD_ENTRIES + 1].to(tl.pointer_type(SOURCE)), 16)
                init_coupling_at = tl.multiple_of(
                    entries[i * STRIDE + BACKWARD_ENTRIES + 2].to(tl.pointer_type(tl.float32)), 16)
                beta = tl.exp(tl.load(init_lse_at + state, mask=head_mask, other=0.0) - lse[i])
                tl.store(init_dout_at + row1, (beta[:, None] * d1).to(SOURCE), mask=mask1)
                tl.store(init_dout_at + row2, (beta[:, None] * d2).to(SOURCE), mask=mask2)
                # the partial state's c = <β·dout, init_out> − (the gradient of its lse, β·(<dout,
                # init_out> − c)) = β·c: handed back in the place of that gradient
                tl.store(init_coupling_at + state, beta * c, mask=head_mask)
            dout1, dout2, coupling = dout1 + (d1,), dout2 + (d2,), coupling + (c,)
        for n in tl.range(0, N, num_stages=NUM_STAGES):
            source = tl.load(table_ptr + first_source + n, mask=n < committed, other=partial_at)
            source = tl.multiple_of(source.to(tl.pointer_type(SOURCE)), 16) + pos * D
            v1 = tl.load(source + cols1, mask=mask1, other=0.0).to(tl.float32)   # (H_PAD, K1)
            v2 = tl.load(source + cols2, mask=mask2, other=0.0).to(tl.float32)   # (H_PAD, K2_PAD)
            # The gradient row is loaded before any reduction, so both loads are in flight at once.
            # (Conditions on n as one-element tensors: the interpreter's loop indices are ints.)
            index = tl.full([1], n, tl.int32)
            grad_row = grads_ptr + (row0 + n) * row_stride + pos * D
            earlier1 = tl.load(grad_row + cols1, mask=mask1 & (index < fresh_lo), other=0.0)
            earlier2 = tl.load(grad_row + cols2, mask=mask2 & (index < fresh_lo), other=0.0)
            r = tl.rsqrt((tl.sum(v1 * v1) + tl.sum(v2 * v2)) / D + eps)
            # dV_n = r·(g ⊙ dk) − (r³/d)·<g ⊙ dk, V_n>·V_n + Σ_sites α_n ⊙ dout, with per head
            # g ⊙ dk = Σ_sites dℓ_n·(q ⊙ g), and <g ⊙ dk, V_n> = Σ_sites,heads dℓ_n·<q ⊙ g, V_n>
            g_dk1 = tl.zeros([H_PAD, K1], tl.float32)
            g_dk2 = tl.zeros([H_PAD, K2_PAD], tl.float32)
            value1 = tl.zeros([H_PAD, K1], tl.float32)
            value2 = tl.zeros([H_PAD, K2_PAD], tl.float32)
            dk_v = tl.zeros([H_PAD], tl.float32)
            sums1, sums2 = (), ()
            for i in tl.static_range(G):
                raw = tl.sum(qg1[i] * v1, axis=1) + tl.sum(qg2[i] * v2, axis=1)     # (H_PAD,)
                alpha = tl.where(head_mask, tl.exp(r * raw - lse[i]), 0.0)
                dlogit = alpha * (tl.sum(dout1[i] * v1, axis=1) + tl.sum(dout2[i] * v2, axis=1)
                                  - coupling[i])
                g_dk1 += dlogit[:, None] * qg1[i]
                g_dk2 += dlogit[:, None] * qg2[i]
                value1 += alpha[:, None] * dout1[i]
                value2 += alpha[:, None] * dout2[i]
                dk_v += dlogit * raw
                sums1 += (qg_grad1[i] + (dlogit * r)[:, None] * v1,)
                sums2 += (qg_grad2[i] + (dlogit * r)[:, None] * v2,)
            qg_grad1, qg_grad2 = sums1, sums2
            norm_coupling = r * r * r / D * tl.sum(dk_v)
            grad1 = earlier1 + r * g_dk1 - norm_coupling * v1 + value1
            grad2 = earlier2 + r * g_dk2 - norm_coupling * v2 + value2
            # This program owns the position: the read-modify-write of its rows needs no atomics.
            tl.store(grad_row + cols1, grad1, mask=mask1 & (index < own_lo))
            tl.store(grad_row + cols2, grad2, mask=mask2 & (index < own_lo))
            owned_row = owned_ptr + tl.maximum(n - own_lo, 0) * row_stride + pos * D
            tl.store(owned_row + cols1, grad1.to(SOURCE), mask=mask1 & (index >= own_lo))
            tl.store(owned_row + cols2, grad2.to(SOURCE), mask=mask2 & (index >= own_lo))
    partial = qg_grad_ptr + tl.program_id(0) * G * D      # read again: kept, it was spilled
    for i in tl.static_range(G):
        tl.store(partial + i * D + cols1, qg_grad1[i], mask=mask1)
        tl.store(partial + i * D + cols2, qg_grad2[i], mask=mask2)


# True when TRITON_INTERPRET=1 was set before import: triton.jit then made interpreted functions.
INTERPRETED = not isinstance(_route_forward_kernel, triton.runtime.JITFunction)


# %% Bound launches (launcher.py): each route kernel's key
# A key is a guard on a launch's runtime arguments that fixes how Triton specializes every one of
# them, and what the guard leaves free (launcher.py's docstring gives the rules): every int these
# kernels take is do_not_specialize, and `entries` their addresses passed as arguments.

def _forward_key(programs, constexprs, args):
    """_route_forward_kernel's key (None: launch unbound)."""
    table, entries, qg, first, committed, N, M, per_program, eps = args
    if (launcher.BOUND_LAUNCHES and type(eps) is float
            and type(first) is type(committed) is type(N) is type(M) is type(per_program) is int
            and 0 <= first | committed | N | M | per_program < launcher.I32
            and launcher.all_bind(entries) and not (table.data_ptr() | qg.data_ptr()) & 15
            and launcher.unhooked(_route_forward_kernel)):
        return programs, id(constexprs), len(entries), table.dtype, qg.dtype, knobs.runtime.debug
    return None


def _backward_key(programs, constexprs, args):
    """_route_backward_kernel's key (None: launch unbound)."""
    (table, entries, qg, grads, owned, qg_grads, first, committed, N, M, per_program, row0, own_lo,
     fresh_lo, given, eps) = args
    if (launcher.BOUND_LAUNCHES and type(eps) is float
            and type(first) is type(committed) is type(N) is type(M) is type(per_program)
            is type(row0) is type(own_lo) is type(fresh_lo) is type(given) is int
            and 0 <= (first | committed | N | M | per_program | row0 | own_lo | fresh_lo
                      | given) < launcher.I32 and launcher.all_bind(entries)
            and not (table.data_ptr() | qg.data_ptr() | grads.data_ptr() | owned.data_ptr()
                     | qg_grads.data_ptr()) & 15 and launcher.unhooked(_route_backward_kernel)):
        return (programs, id(constexprs), len(entries), table.dtype, qg.dtype, grads.dtype,
                owned.dtype, qg_grads.dtype, knobs.runtime.debug)
    return None


# %% Launchers

def memoized(fn):
    """fn with its results kept by arguments: launches and histories ask at every call. fn is a
    pure function of constants, which torch.compile calls rather than traces: traced, the cache's
    "key not in dict" became a guard that the first fill broke, a recompile."""
    results = {}
    @functools.wraps(fn)
    def cached(*args):
        result = results.get(args, results)         # (the dict itself: what fn never returns)
        if result is results:
            result = results[args] = fn(*args)
        return result
    cached.cache_clear = results.clear
    return torch.compiler.assume_constant_result(cached)


@memoized
def layout(width, heads, sites):
    """The constexprs of a launch of `sites` sites at this width and heads; raises if they can't."""
    if width % heads != 0:
        raise ValueError(f"the width d={width} must be divisible by heads={heads}")
    K = width // heads
    K1 = 1 << (K.bit_length() - 1)                  # the largest power of two <= K
    K2 = K - K1
    pad = triton.next_power_of_2
    config = dict(D=width, H=heads, K=K, K1=K1, K2=K2, K2_PAD=pad(K2) if K2 else 1,
                  H_PAD=pad(heads), G=sites, G_PAD=pad(sites))
    if _tile(config) > MAX_TILE:
        raise ValueError(f"fused routing holds {sites} site(s) of width d={width} as "
                         f"{_tile(config)} fp32 lanes per tile; past {MAX_TILE} they do not fit in "
                         f"one program: use a smaller fused_group, or fused=False for this width")
    return config


def _tile(config):
    """Lanes of a (G, H, K) tile of the sites' states (with the second tile, when there is one)."""
    lanes = config["K1"] + (config["K2_PAD"] if config["K2"] else 0)
    return config["G_PAD"] * config["H_PAD"] * lanes


def _fits(width, heads, sites):
    try:
        return bool(layout(width, heads, sites))
    except ValueError:
        return False


def _num_warps(config, backward):
    # Under 128 lanes (tests' odd widths) 1 warp (triton 3.6 spilled 8 bytes at 2+); to 1024, 4, so
    # a thread loads several contiguous elements. Larger: the forward spills at 8 warps past 4096
    # lanes, not at 16. The backward's 3·G rows: G·d <= 4096 fit 2 CTAs of 8 warps (100M); more take
    # 16 (350M; 1B at _num_stages' 2), 16 resident (docs/kernels.md); one site of 1024 lanes: 8.
    tile = _tile(config)
    if tile < 128:
        return 1
    if backward:
        return 4 if tile < 1024 else 8 if config["G"] * config["D"] <= 4096 else 16
    return 4 if tile <= 1024 else 8 if tile <= 4096 else 16


def _num_stages(config, backward):
    """Source rows in flight: NUM_STAGES, but two for a grouped backward of 16 warps whose rows are
    two tiles (1B): with three it spills 16-24 bytes of its 128 registers a thread."""
    return 2 if backward and _num_warps(config, True) == 16 and config["K2"] else NUM_STAGES


@memoized
def _launch_constants(width, heads, sites, dtype, init, backward, M):
    """(positions per program, programs, keyword arguments) of a launch over M positions."""
    config = layout(width, heads, sites)
    warps = _num_warps(config, backward)
    constexprs = dict(SOURCE=SOURCE_TYPES[dtype], INIT=init, SPLIT=dtype == torch.bfloat16,
                      NUM_STAGES=_num_stages(config, backward), num_warps=warps, **config)
    return (*_programs(M, warps=warps), constexprs)


def _programs(M, target=None, warps=8):
    """Positions per program, and programs, of a kernel of `warps` warps: `target` programs at 8
    warps and 8 / warps times as many at other counts (None: this process's grid; the interpreter
    runs a few). A split fixed by M, the kernel and the device, for determinism."""
    if target or not INTERPRETED:       # (one program per SM at least)
        grid = (target or _device_programs()) * 8 // min(warps, RESIDENT_WARPS)
    else:
        grid = INTERPRETED_PROGRAMS
    per_program = -(-M // grid)
    return per_program, -(-M // per_program)        # ceiling divisions (triton.cdiv: 5 µs a call)


@memoized
def _device_programs():
    """The grid of an 8-warp kernel on this process's GPU: RESIDENT_WARPS / 8 programs per SM."""
    SMs = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    return RESIDENT_WARPS // 8 * SMs


def _backward_programs(M, width, heads, sites):
    """The programs of a backward launch, and so the partials of q ⊙ g's gradient it writes."""
    return _programs(M, warps=_num_warps(layout(width, heads, sites), True))[1]


def _aligned(tensor):
    """The tensor, contiguous and 16-byte aligned (the kernels load every row as 16-byte vectors):
    a fresh allocation is, a view (a row of a stacked V) may not be."""
    tensor = tensor.contiguous()
    return tensor if tensor.data_ptr() % 16 == 0 else tensor.clone()


def check_available(device=None):
    """Raise unless the kernels can run: compiled on a CUDA GPU, or interpreted (on CPU tensors).
    With a device, the tensors that will be routed must be on it; without, any GPU will do."""
    on_gpu = torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda")
    if not (INTERPRETED or on_gpu):
        raise RuntimeError(UNAVAILABLE)


def check_sources(sources, heads, sites):
    """The layout of a launch over these sources (B, T, d); raises on dtypes or shapes it cannot."""
    first = sources[0]
    if first.dtype not in SOURCE_TYPES:
        raise TypeError(f"fused routing stores sources in float32 or bfloat16, got {first.dtype}")
    for source in sources:
        if source.shape != first.shape or source.dtype != first.dtype:
            raise ValueError(f"fused routing needs sources of one shape and dtype, got "
                             f"{tuple(source.shape)} {source.dtype} next to {tuple(first.shape)} "
                             f"{first.dtype}")
    return layout(first.shape[-1], heads, sites)


def _checked(sources, heads, sites):
    """The sources checked and aligned, and a table of their addresses for one launch (the custom
    operators' way in; a history's forward launches write theirs, each source's by its first
    reader). Keep the sources while the kernel may read them: an aligned copy lives only as long
    as they do."""
    check_sources(sources, heads, sites)
    sources = [_aligned(t) for t in sources]
    return sources, launcher.address_table([t.data_ptr() for t in sources], sources[0])


def _route_forward(*, sources, qg, init, heads, eps, table=None, first_source=0, partial=None,
                   lses=None, new_rows=(), in_place=False):
    """Route G sites over `sources` (each (B, T, d)); init = [] or, per site, the state (output,
    remainder, lse) of the partial state it continues. Returns the G outputs (sources' dtype),
    their G remainders (bf16: out − bf16(out); fp32 sources need none: empty) and G lse (fp32).
    table: where the caller keeps the sources' addresses (FusedHistory: its table, the launch's
    first row in it at first_source, and the address of a partial sum read last, or None); without
    one, the sources are checked and given a table. lses: where to write the lse (None: new).
    new_rows: addresses of the last committed sources, not in the table yet (the kernel adds them).
    in_place: write each output and remainder over the init's (eager: nothing reads those again;
    a position's are read before they are written, by the program that writes them)."""
    source, G = sources[0], qg.shape[0]
    if table is None:
        sources, table = _checked(sources, heads, G)
    width = source.shape[-1]
    M = source.numel() // width
    if in_place and init:
        outs, rests = init[:G], init[G:2 * G]
    else:   # (empty_like and new_empty: a third of torch.empty's host time, dtype and device given)
        split = source.dtype == torch.bfloat16
        outs = [torch.empty_like(source) for _ in range(G)]
        rests = [torch.empty_like(source) if split else source.new_empty(0) for _ in range(G)]
    if lses is None:
        lse = source.new_empty((*source.shape[:-1], heads), dtype=torch.float32)
        lses = [lse, *[torch.empty_like(lse) for _ in range(G - 1)]]
    # per site as laid out above FORWARD_ENTRIES (an fp32 output's remainder is empty: no address)
    any_address = outs[0].data_ptr()
    entries = (*[t.data_ptr() or any_address for i in range(G)
                 for t in (outs[i], rests[i], lses[i], *init[i::G])],
               partial or any_address, *new_rows)
    per_program, programs, constexprs = _launch_constants(width, heads, G, source.dtype, bool(init),
                                                          False, M)
    N = len(sources)
    args = (table, entries, qg, first_source, N - (partial is not None), N, M, per_program, eps)
    launcher.launch(_route_forward_kernel, (programs,), _forward_key(programs, constexprs, args),
                    args, constexprs)
    return outs, rests, lses


def _route_backward(grads, owned, qg_grads, init_grads, *, sources, qg, outs, rests, douts, lses,
                    couplings, init_lse, heads, eps, row0, own_lo, fresh_lo, continued,
                    table=None, first_source=0, partial=None):
    """Add the gradients of `sources` into rows row0.. of the fp32 buffer `grads` (in place); write
    the final gradients of sources own_lo.. into `owned` (their dtype), each program's partial
    gradient of qg into `qg_grads` (programs, G, d), and the output gradient and coupling of the
    partial state whose lse is `init_lse` ([] or [lse]: phase 2) into init_grads. couplings: per
    site None, or for a partial state the coupling its phase 2 handed back (whose output and
    remainder the kernel does not read: they may be None); `continued` has a bit for each of those
    (Spec.continued). douts: one per site. table, first_source, partial: as _route_forward's."""
    douts = [_aligned(dout) for dout in douts]   # (the kernel loads them as 16-byte vectors)
    source, G = douts[0], qg.shape[0]       # an output gradient has the sources' shape and dtype
    if table is None:
        sources, table = _checked(sources, heads, G)
    width = source.shape[-1]
    M = source.numel() // width
    any_address = douts[0].data_ptr()                           # as laid out above FORWARD_ENTRIES
    entries = (*[t is not None and t.data_ptr() or any_address for i in range(G)
                 for t in (outs[i], rests[i], douts[i], lses[i], couplings[i], *init_lse,
                           *init_grads)], partial or any_address)
    per_program, programs, constexprs = _launch_constants(width, heads, G, source.dtype,
                                                          bool(init_lse), True, M)
    N = len(sources)
    args = (table, entries, qg, grads, owned, qg_grads, first_source, N - (partial is not None), N,
            M, per_program, row0, own_lo, fresh_lo, continued, eps)
    launcher.launch(_route_backward_kernel, (programs,), _backward_key(programs, constexprs, args),
                    args, constexprs)


# %% Autograd: one launch, two ways in
# A launch makes per site an output, its remainder (a bf16 output's rounding error, which backward
# and phase 2 add back) and its lse, and passes on the carrier (a stride-0 view of one element),
# whose gradient autograd hands from launch to launch backward in exactly reverse order, compiled
# too. Traced, every state and q ⊙ g is an input or output of the custom operators (traced code
# cannot read addresses); eager code's RouteSites costs the host a few µs a launch, where the
# operators' dispatch of tensor lists costs a few hundred. Both run the functions below.

Spec = namedtuple("Spec", "heads eps rows row0 own_lo fresh_lo last continued")
Spec.__doc__ = """A launch's ints, in route_sites's order: H, the norm's eps, the gradient buffer's
rows, its first source's row, own_lo, fresh_lo, `last` (hands no buffer on), `continued`."""


def _carrier(like, rows):
    return like.new_zeros((), dtype=torch.float32).expand(rows, *like.shape)


def _launch_backward(backward, spec, *, sources, qg, outs, rests, lses, init_lse, douts, couplings,
                     dcarrier, table=None, first_source=0, partial=None, qg_grads=None):
    """The gradients of one launch's inputs, from those of its outputs: (the gradient buffer the
    carrier hands back, the final gradients of the sources it completes, q ⊙ g's per program
    (programs, G, d), the output gradient and coupling of the partial state it continues: []
    without one). outs, rests, lses: as the forward made them; douts, couplings per site (None: no
    gradient, a complete site); `backward` runs the kernel (_route_backward, or the operator
    through _traced_backward); table, first_source, partial: as _route_forward's. qg_grads: for q ⊙
    g's partials (None: new)."""
    like = sources[0]                                    # of the sources' shape and dtype
    douts = [torch.zeros_like(like) if d is None else d for d in douts]   # (aligned where launched)
    # the forward's last launch is the first in backward: no gradient yet, every row it reads fresh
    buffer = (like.new_empty((spec.rows, *like.shape), dtype=torch.float32) if spec.last
              else dcarrier.contiguous())
    n_owned = len(sources) - spec.own_lo                                         # 1 mostly
    owned = torch.empty_like(like) if n_owned == 1 else like.new_empty((n_owned, *like.shape))
    if qg_grads is None:
        M, (G, d) = like.numel() // like.shape[-1], qg.shape
        qg_grads = qg.new_empty((_backward_programs(M, d, spec.heads, G), G, d))    # fp32, as qg
    init_lse = [] if init_lse is None else [init_lse]
    init_grads = [torch.empty_like(like), torch.empty_like(init_lse[0])] if init_lse else []
    # the tensors it writes first, then what it reads
    backward(buffer, owned, qg_grads, init_grads, sources=sources, qg=qg, outs=outs, rests=rests,
             douts=douts, lses=lses, couplings=couplings, init_lse=init_lse, heads=spec.heads,
             eps=spec.eps, row0=spec.row0, own_lo=spec.own_lo, fresh_lo=spec.fresh_lo,
             continued=spec.continued, table=table, first_source=first_source, partial=partial)
    return buffer, [owned] if n_owned == 1 else list(owned.unbind(0)), qg_grads, init_grads


# %% Autograd for torch.compile: the custom operators

@torch.library.custom_op("mhar::route_sites", mutates_args=())
def route_sites(carrier: Tensor, sources: list[Tensor], qg: Tensor, init: list[Tensor], heads: int,
                eps: float, rows: int, row0: int, own_lo: int, fresh_lo: int, last: bool,
                continued: int) -> list[Tensor]:
    """Route the G = len(qg) sites over `sources` (rows row0.. of the gradient buffer; a partial
    sum after them has none): [out × G, remainder × G, lse × G, carrier]. init: [] or the (out,
    remainder, lse) of the partial state a phase 2 continues; the ints: Spec's. The forward's last
    launch passes on an empty carrier: nothing consumes it; a gradient would be zero-filled."""
    outs, rests, lses = _route_forward(sources=sources, qg=qg.contiguous(), init=init, heads=heads,
                                       eps=eps)
    return [*outs, *rests, *lses, _carrier(sources[0], 0 if last else rows)]


@route_sites.register_fake
def _(carrier, sources, qg, init, heads, eps, rows, row0, own_lo, fresh_lo, last, continued):
    source, G = sources[0], qg.shape[0]
    outs = [source.new_empty(source.shape) for _ in range(G)]
    rests = [source.new_empty(source.shape if source.dtype == torch.bfloat16 else 0)
             for _ in range(G)]
    lses = [source.new_empty((*source.shape[:-1], heads), dtype=torch.float32) for _ in range(G)]
    return [*outs, *rests, *lses, _carrier(source, 0 if last else rows)]


# A custom op that mutates arguments may not also return tensors (functionalization needs outputs
# without aliases): the backward writes into tensors its caller allocates.
@torch.library.custom_op("mhar::route_sites_backward",
                         mutates_args=("grads", "owned", "qg_grads", "init_grads"))
def route_sites_backward(grads: Tensor, owned: Tensor, qg_grads: Tensor, init_grads: list[Tensor],
                         sources: list[Tensor], qg: Tensor, outs: list[Tensor], rests: list[Tensor],
                         douts: list[Tensor], lses: list[Tensor], couplings: list[Optional[Tensor]],
                         init_lse: list[Tensor], heads: int, eps: float, row0: int, own_lo: int,
                         fresh_lo: int, continued: int) -> None:
    """Backward of one route_sites launch: _route_backward, writing into the first four."""
    _route_backward(grads, owned, qg_grads, init_grads, sources=sources, qg=qg.contiguous(),
                    outs=outs, rests=rests, douts=douts, lses=lses, couplings=couplings,
                    init_lse=init_lse, heads=heads, eps=eps, row0=row0, own_lo=own_lo,
                    fresh_lo=fresh_lo, continued=continued)


def _traced_backward(grads, owned, qg_grads, init_grads, *, table, first_source, partial, **reads):
    """route_sites_backward as _launch_backward calls it: traced code has no addresses."""
    route_sites_backward(grads, owned, qg_grads, init_grads, **reads)


def _setup_route_sites(ctx, inputs, output):
    carrier, sources, qg, init, *ints = inputs      # route_sites's ints: Spec's fields, in order
    G = qg.shape[0]
    ctx.save_for_backward(qg, *sources, *init, *output[:3 * G])
    ctx.counts, ctx.spec = (len(sources), len(init)), Spec(*ints)


def _route_sites_backward(ctx, grads):
    (n_sources, n_init), spec = ctx.counts, ctx.spec
    qg, *saved = ctx.saved_tensors
    sources, saved = saved[:n_sources], saved[n_sources:]
    init, states = saved[:n_init], saved[n_init:]
    G = qg.shape[0]
    # the gradient of a continued site's lse is its coupling, handed back by its phase 2
    couplings = [d.contiguous() if spec.continued >> i & 1 else None
                 for i, d in enumerate(grads[2 * G:3 * G])]
    buffer, owned_grads, qg_grads, init_grads = _launch_backward(
        _traced_backward, spec, sources=sources, qg=qg, outs=states[:G], rests=states[G:2 * G],
        lses=states[2 * G:], init_lse=init[2] if init else None, douts=grads[:G],
        couplings=couplings, dcarrier=grads[3 * G])
    carrier_grad = buffer if ctx.needs_input_grad[0] else None
    init_grads = [init_grads[0], None, init_grads[1]] if init else []      # (out, remainder, lse)
    qg_grad = qg_grads.sum(0)                       # over programs, in a fixed order: deterministic
    return (carrier_grad, [None] * spec.own_lo + owned_grads, qg_grad, init_grads,
            *[None] * len(Spec._fields))


route_sites.register_autograd(_route_sites_backward, setup_context=_setup_route_sites)


# %% Autograd for eager code: RouteSites, and what goes beside autograd
# Autograd sees only the carrier, the sources a launch completes and its sites' final outputs.
# The rest goes beside autograd, in the order the carrier fixes (a later launch's backward runs
# first): a partial state to its phase 2 and its gradients back (Partial); the per-program partials
# of q ⊙ g's gradient (QGGradients). The sources' addresses are in FusedHistory's table, each
# written once by its first reader; each site's own go to the kernels as arguments. (Each cut the
# host's time: `python -m scripts.bench_kernel --host` measures it.)

class Partial:
    """A site's phase-1 state on its way to its phase 2, outside autograd (eager code): forward
    hands over (out, rest, lse); phase 2 writes its own output over out and rest and leaves only
    the lse (the two backwards read nothing else); backward hands back `grads`, the gradients of
    its output and coupling."""
    __slots__ = ("out", "rest", "lse", "grads")


class QGGradients:
    """Where the launches of one forward (eager code) leave their per-program partial gradients of
    q ⊙ g, (programs, G, d) each: views of three tensors made at the first backward, for phase 1's
    full groups, its last group when shorter, and phase 2's sites. The forward's first launch, whose
    backward runs last, sums them: a few sums in a fixed order (deterministic), not one a launch."""

    def __init__(self, n_sites, group, continued_sites):
        self.n_sites, self.group, self.continued_sites = n_sites, group, continued_sites
        self.buffers = self.slots = None

    def slot(self, launch, qg, positions, heads):
        """The (programs, G, d) tensor launch `launch` writes into."""
        if self.slots is None:
            d = qg.shape[-1]
            full, last = divmod(self.n_sites, self.group)
            programs = functools.partial(_backward_programs, positions, d, heads)    # of G sites
            self.buffers = (qg.new_empty((full, programs(self.group), self.group, d)),
                            qg.new_empty((programs(last) if last else 1, last, d)),
                            qg.new_empty((len(self.continued_sites), programs(1), 1, d)))
            self.slots = ([*self.buffers[0].unbind(0), self.buffers[1]], self.buffers[2].unbind(0),
                          {site: i for i, site in enumerate(self.continued_sites)})
        by_group, by_site, rank = self.slots
        return (by_group[launch.site // self.group] if launch.phase == 1
                else by_site[rank[launch.site]])

    def total(self):
        """The gradient of q ⊙ g (S, d); the buffers go."""
        full, last, again = self.buffers
        self.buffers = self.slots = None
        grad = full.sum(1).flatten(0, 1)                    # (sites of the full groups, d)
        if last.shape[1]:
            grad = torch.cat([grad, last.sum(0)])
        if len(again):      # each row of a site with a phase 2 gets its sum once
            grad = grad.index_add(0, _index(self.continued_sites, grad.device),
                                  again.sum(1).flatten(0, 1))
        return grad


@memoized
def _index(values, device):
    """values as an int64 tensor on `device`, made once (from pinned memory on a GPU: no sync)."""
    index = torch.tensor(values, dtype=torch.int64)
    return index.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else index


Call = namedtuple("Call",
                  "launch spec sources table new_rows partial init partials qg qg_parts lses")
Call.__doc__ = """What one eager launch needs besides its autograd inputs: its Launch and Spec, the
sources it reads, the history's address table (their rows from launch.lo), the addresses of those
it reads first (its forward writes them there), the partial sum's it reads last (None: none),
`init` (the Partial a phase 2 continues; None in phase 1), `partials` (per site the Partial its
state goes to; None for a site it completes), its q ⊙ g (G, d), the forward's QGGradients and the
tensors to write its lse into."""


class RouteSites(torch.autograd.Function):
    """One launch in eager code: RouteSites.apply(carrier, qg_all, call, *sources[spec.own_lo:])
    -> (the output of each site it completes, carrier), `call` a Call. A list argument is not an
    input: the cost of a call does not grow with the sources it reads. Nor is q ⊙ g, but for the
    forward's first launch (qg_all, (S, d)), whose backward runs last and sums QGGradients."""

    @staticmethod
    def forward(ctx, carrier, qg_all, call, *completed):
        init = call.init
        outs, rests, lses = _route_forward(
            sources=call.sources, qg=call.qg, init=[init.out, init.rest, init.lse] if init else [],
            heads=call.spec.heads, eps=call.spec.eps, table=call.table,
            first_source=call.launch.lo, partial=call.partial, lses=call.lses,
            new_rows=call.new_rows, in_place=True)
        if init:
            init.out = init.rest = None     # now this launch's output: only the lse is read again
        finals, final_rests = [], []
        for out, rest, lse, partial in zip(outs, rests, lses, call.partials):
            if partial:
                partial.out, partial.rest, partial.lse = out, rest, lse
            else:
                finals.append(out)
            final_rests.append(None if partial else rest)
        # Saved: the outputs (the next sublayers' inputs, alive anyway), their remainders and lse
        # (the only new activations), and the sources: held alive by the first launch that read
        # them, which completes them, and whose backward runs after this one's.
        ctx.save_for_backward(*finals)
        ctx.rests, ctx.lses, ctx.call = final_rests, lses, call
        ctx.set_materialize_grads(False)
        return (*finals, carrier)

    @staticmethod
    def backward(ctx, *grads):
        call = ctx.call
        finals, final_grads = iter(ctx.saved_tensors), iter(grads[:-1])
        outs, douts, couplings = [], [], []
        for partial, lse in zip(call.partials, ctx.lses):
            if partial:     # its gradients, from its phase 2's backward (which ran: the carrier)
                dout, coupling = partial.grads or (None, torch.zeros_like(lse))
                partial.grads = None
                outs.append(None), douts.append(dout), couplings.append(coupling)
            else:
                outs.append(next(finals)), douts.append(next(final_grads)), couplings.append(None)
        heads = call.spec.heads
        slot = call.qg_parts.slot(call.launch, call.qg, ctx.lses[0].numel() // heads, heads)
        buffer, source_grads, _, init_grads = _launch_backward(
            _route_backward, call.spec, sources=call.sources, qg=call.qg, outs=outs,
            rests=ctx.rests, lses=ctx.lses, init_lse=call.init.lse if call.init else None,
            douts=douts, couplings=couplings, dcarrier=grads[-1], table=call.table,
            first_source=call.launch.lo, partial=call.partial, qg_grads=slot)
        if call.init:
            call.init.grads = init_grads
        qg_grad = None
        if call.launch.site == 0 and call.launch.phase == 1:   # the forward's first, last backward
            qg_grad = call.qg_parts.total()
            qg_grad = qg_grad if ctx.needs_input_grad[1] else None
        carrier_grad = buffer if ctx.needs_input_grad[0] else None
        return carrier_grad, qg_grad, None, *source_grads


def _apply(*args):
    """RouteSites.apply(*args) without Function.apply's Python layer (torch/autograd/function.py),
    which outside functorch transforms only unwraps their dead wrappers (a history holds none)
    before the C apply: 1.3 µs a launch. Under a transform, RouteSites.apply: it refuses them."""
    if torch._C._are_functorch_transforms_active():
        return RouteSites.apply(*args)
    return _C_APPLY(*args)


_C_APPLY = super(torch.autograd.Function, RouteSites).apply


# %% The schedule of one forward pass, and the traffic model and roofline that pick G
# The schedule of launches is static: it depends on what each site reads (reads[j], as the
# module's docstring says) and on the group size only. Routing is mostly memory-bound, but a
# group's states are tiles of G_PAD sites (a power of two), whose padded lanes compute as the
# others do: a phase 1 of 5 to 8 sites does about as many fp32 operations per byte as an H100 can
# (its ridge point, ~20). G is picked by a roofline's time, each kernel the longer of its bytes at
# the HBM bandwidth and its operations (padded lanes counted) at the fp32 rate.
BANDWIDTH, FLOPS = 3.35e12, 67e12    # H100 SXM datasheet: HBM bytes/s, fp32 operations/s (FMA: 2)
# fp32 operations per tile lane, source and position, counted in the loops over sources: forward
# the logit (2) and the accumulator's update (3); backward the logit, <dout, V> (2 each), the
# source gradient's sum over sites (4) and q ⊙ g's gradient (2).
FORWARD_OPS, BACKWARD_OPS = 5, 10

Launch = namedtuple("Launch", "phase site sites lo hi partial own_lo fresh_lo last continued")
Launch.__doc__ = """One route_sites call, made when site `site` is read. Phase 1: sites site..
(`sites` of them) over committed rows 0..hi-1; phase 2: site `site` continues its phase-1 state
over rows lo..hi-1. Either also reads the site's partial block sum when `partial`. own_lo,
fresh_lo, `continued` (given_sites): the module's words; `last`: it hands the buffer on to none."""


@memoized
def schedule(reads, group):
    """The launches of one forward, in order (see Launch), for sites that read reads[site] =
    (committed, partial): `group` consecutive sites share phase 1."""
    launches, n_sites = [], len(reads)
    for leader in range(0, n_sites, group):
        sites = min(group, n_sites - leader)
        shared = reads[leader][0]                       # what every site of the group reads
        launches.append(dict(phase=1, site=leader, sites=sites, lo=0, hi=shared,
                             partial=sites == 1 and bool(reads[leader][1])))   # one pass per site
        for site in range(leader, leader + sites if sites > 1 else leader):
            rows, partial = reads[site]
            if rows > shared or partial:                # phase 2: merge what came later
                launches.append(dict(phase=2, site=site, sites=1, lo=shared, hi=rows,
                                     partial=bool(partial)))
    read = 0        # a row's gradient is complete after the backward of its first reader (own_lo)
    for launch in launches:
        launch["own_lo"] = max(read, launch["lo"]) - launch["lo"]
        read = max(read, launch["hi"])
    last_reader = {row: i for i, launch in enumerate(launches)        # fresh_lo: no later reader
                   for row in range(launch["lo"], launch["hi"])}
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


def launch_bytes(launch, positions, width, heads, source_bytes, target=None):
    """Bytes one launch's forward and backward kernels load and store, term by term: (forward,
    backward), launched as `target` programs (None: as in this process)."""
    M, d, H, b, G = positions, width, heads, source_bytes, launch.sites
    N = launch.hi - launch.lo + launch.partial                  # sources read
    init = launch.phase == 2                                     # continues a partial state
    config = layout(d, H, G)
    programs, backward_programs = (_programs(M, target, _num_warps(config, way))[1]
                                   for way in (False, True))
    row, state = d * b, 4 * H                                   # bytes of an output row, of its lse
    out = row * (2 if b == 2 else 1)                             # bf16: with its remainder
    committed = N - launch.partial                               # read from the address table
    new = max(committed - launch.own_lo, 0)          # rows first read here: arguments, not table
    # forward: per program q ⊙ g; per position a row per source, the table entries of those read
    # before, the partial state, the outputs (with remainders) and lse; the new rows' entries once
    forward = 8 * new + programs * G * 4 * d + M * (8 * (committed - new) + N * row
                                                    + G * (out + state) * (2 if init else 1))
    # backward: per program q ⊙ g and its partial gradient; per position the output gradients and
    # lse, the outputs of complete sites (with remainders), the coupling of continued ones; with a
    # partial state its lse read, its output gradient and coupling written; per source the row, the
    # fp32 gradient row (read unless fresh), the gradient written, to the buffer, or in the source
    # dtype for a source this launch completes, and the committed ones' table entries
    per_source = [row + 4 * d * (n < launch.fresh_lo) + (4 * d if n < launch.own_lo else row)
                  for n in range(N)]
    continued = bin(launch.continued).count("1")
    sites = G * (row + state) + (G - continued) * out + continued * state
    backward = (backward_programs * G * 8 * d
                + M * (sites + init * (2 * state + row) + 8 * committed + sum(per_source)))
    return forward, backward


def launch_time(launch, positions, width, heads, source_bytes, target=None):
    """The roofline's seconds of one launch's forward and backward kernels on the traffic model's
    device: each the longer of its bytes (launch_bytes) and its operations, every lane of its
    (G_PAD, H_PAD, K1 + K2_PAD) tiles counted, idle or not."""
    lanes = _tile(layout(width, heads, launch.sites))
    work = positions * (launch.hi - launch.lo + launch.partial) * lanes / FLOPS
    moved = launch_bytes(launch, positions, width, heads, source_bytes, target)
    return (max(moved[0] / BANDWIDTH, FORWARD_OPS * work),
            max(moved[1] / BANDWIDTH, BACKWARD_OPS * work))


@memoized                                  # a history is built at every forward
def auto_group(reads, width, heads):
    """The group size for Config.fused_group = 0: the one whose kernels take the least time by the
    roofline of launch_time (at a nominal B·T: the choice hardly depends on it), among the groups
    one program holds. Near √S for full routing, where groups that tile the sites evenly can beat
    powers of two in bytes (25 sites move 13 % fewer bytes in 5 groups of 5 than in groups of 4)
    but pay for their padded lanes; for block and delta routing usually the block or a multiple."""
    def predicted(group):
        return sum(sum(launch_time(launch, 4096, width, heads, 2, PROGRAMS))
                   for launch in schedule(reads, group))
    groups = [G for G in range(1, len(reads) + 1) if _fits(width, heads, G)]
    return min(groups, key=predicted)


Plan = namedtuple("Plan", "launch spec continued first_lse")
Plan.__doc__ = """A launch as FusedHistory makes it: its Launch and Spec, per site whether its state
goes on to a phase 2, and its first site's index among the forward's lse."""


@memoized
def _plans(reads, group, heads, eps):
    """(per site the Plans its read launches, the lse they write, the sites with a phase 2):
    tuples, which torch.compile reads as constants."""
    plans, rows, first = {}, reads[-1][0], 0
    for launch in schedule(reads, group):
        spec = Spec(heads=heads, eps=eps, rows=rows, row0=launch.lo, own_lo=launch.own_lo,
                    fresh_lo=launch.fresh_lo, last=launch.last, continued=launch.continued)
        continued = tuple(bool(launch.continued >> i & 1) for i in range(launch.sites))
        plans.setdefault(launch.site, []).append(Plan(launch, spec, continued, first))
        first += launch.sites
    continued_sites = tuple(site for site, entries in plans.items()
                            for plan in entries if plan.launch.phase == 2)
    by_site = tuple(tuple(plans.get(site, ())) for site in range(len(reads)))
    return by_site, first, continued_sites


# %% The public API: fused_route, one site in one launch; FusedHistory, a forward's sites

def fused_route(V, q, g, heads, eps=1e-6):
    """The multi-head depth route of one site in one launch: the contract of mhar.route
    (V (N, B, T, d) -> (B, T, d) in V.dtype, float32 inside; gradients in the dtypes of V, q, g)."""
    check_available(V.device)
    if q.shape != V.shape[-1:] or g.shape != V.shape[-1:]:
        raise ValueError(f"q and g must have shape ({V.shape[-1]},) to match the sources, "
                         f"got {tuple(q.shape)} and {tuple(g.shape)}")
    qg = (q.float() * g.float())[None]                                         # (1, d)
    return route_sites(_carrier(V[0], 0), list(V.unbind(0)), qg, [], heads=heads, eps=eps, rows=0,
                       row0=0, own_lo=0, fresh_lo=0, last=True, continued=0)[0]


class FusedHistory:
    """The depth history of ONE forward pass, routed by the fused kernels:

        history = FusedHistory(mhar.depth_history(queries, norms, heads, eps, block, null),
                               mhar.site_reads(len(queries), block, null is not None), group)
        history.append(source)    # (B, T, d): s_0 (the embedding), then each sublayer's output
        h = history.read(site)    # (B, T, d): site `site`'s route, after the (site+1)-th append

    It wraps an empty readable history (full, block or delta routing), which keeps the books: its
    append makes the block sums and delta's null source, its `sources` are the committed sources,
    its `partial` the current block's partial sum. `reads` (the module's docstring) says what each
    site reads, whence the schedule. `group` sites share each phase 1 (0: auto_group)."""

    def __init__(self, history, reads, group=0):
        self.history = history
        self.queries, self.norms = history.queries, history.norms           # (d,) per site
        self.heads, self.eps = history.heads, history.eps
        n_sites, width = len(self.queries), self.queries[0].shape[-1]
        if len(reads) != n_sites:
            raise ValueError(f"FusedHistory: {len(reads)} sites' reads for {n_sites} sites")
        self.group = group = group or auto_group(reads, width, self.heads)
        layout(width, self.heads, group)            # fails here if a group cannot fit
        self.plans, self.lse_count, continued = _plans(reads, group, self.heads, self.eps)
        self.rows_total = reads[-1][0]
        self.rows = []              # the history's committed sources (eager: aligned)
        self.addresses = []         # eager: theirs
        self.appended = 0
        self.traced = torch.compiler.is_compiling()   # traced code cannot read addresses
        self.table = None           # eager: the sources' addresses, written by their first readers
        self.qg = None              # q ⊙ g (fp32) by group and by site: made at the first append
        self.carrier = None         # hands the source-gradient buffer backward, launch to launch
        self.qg_parts = None if self.traced else QGGradients(n_sites, group, continued)   # eager
        self.lses = None            # eager: per site of each launch, where it writes its lse
        self.partials = {}          # site -> its phase-1 state until its phase 2 (eager: a Partial)
        self.outputs = {}           # site -> its routed output, once complete

    def append(self, source):
        """Append a source (B, T, d): the embedding first, then each sublayer's raw output."""
        if self.appended == len(self.queries):
            raise RuntimeError(f"FusedHistory holds the sources of {len(self.queries)} sites: a "
                               f"history serves one forward pass (with activation checkpointing, "
                               f"checkpoint the sublayers, not the history's append and read)")
        if self.appended == 0:
            self._start(source)
        elif source.shape != self.rows[0].shape or source.dtype != self.rows[0].dtype:
            first = self.rows[0]
            raise ValueError(f"FusedHistory: every source has the first one's shape and dtype "
                             f"{tuple(first.shape)} {first.dtype}, got {tuple(source.shape)} "
                             f"{source.dtype} (append the embedding in the sublayers' dtype)")
        self.history.append(source)
        known = len(self.rows)
        if self.traced:
            self.rows += self.history.sources[known:]
        else:   # aligned: the kernels load rows as 16-byte vectors
            self.rows += [_aligned(committed) for committed in self.history.sources[known:]]
            self.addresses += [row.data_ptr() for row in self.rows[known:]]
        self.appended += 1

    def _start(self, source):
        """At the first append: check the source, fold g into the queries, make the lse's tensor
        and the address table."""
        check_available(source.device)
        check_sources([source], self.heads, 1)
        # g folded into the query once per forward and split by group and by site. Traced, each
        # launch takes its split (its own slice of the whole (S, d) would give it a gradient of
        # the whole: S·d zeros each); eager, the splits are values, and the first launch takes
        # the whole, whose gradient it sums from every launch's partials.
        qg = torch.stack(list(self.queries)).float() * torch.stack(list(self.norms)).float()
        self.qg_all = qg                                             # (S, d)
        values = qg if self.traced else qg.detach()
        by_site = values.split(1)                                    # (1, d) per site
        self.qg = values.split(self.group) if self.group > 1 else by_site, by_site  # (G, d) a group
        if not self.traced:  # every launch's lse: rows of one tensor, each 16-byte aligned
            shape = (*source.shape[:-1], self.heads)
            size = math.prod(shape)
            rows = source.new_empty((self.lse_count, -(-size // 4) * 4), dtype=torch.float32)
            self.lses = rows[:, :size].unflatten(1, shape).unbind(0)
            self.table = source.new_empty(self.rows_total, dtype=torch.int64)

    def read(self, site):
        """The routed input of site `site` (B, T, d), once the history holds its sources."""
        if site != self.appended - 1:
            raise ValueError(f"FusedHistory.read({site}): site j is read right after the (j+1)-th "
                             f"append, and the history holds {self.appended} sources")
        for plan in self.plans[site]:
            self._launch(plan)
        return self.outputs[site]

    def _launch(self, plan):
        launch, spec = plan.launch, plan.spec
        sources, partial = self.rows[launch.lo:launch.hi], None
        if launch.partial:      # read last, its address a kernel argument (eager)
            partial = self.history.partial if self.traced else _aligned(self.history.partial)
            sources = sources + [partial]
        if self.carrier is None:
            self.carrier = _carrier(sources[0], self.rows_total)
        by_group, by_site = self.qg
        qg = by_group[launch.site // self.group] if launch.phase == 1 else by_site[launch.site]
        if self.traced:                          # every state an output of the operator
            init = list(self.partials.pop(launch.site)) if launch.phase == 2 else []
            *results, self.carrier = route_sites(self.carrier, sources, qg, init, *spec)  # its ints
            states = list(zip(*[iter(results)] * launch.sites))          # (outs, remainders, lses)
            partials = [state if cont else None
                        for cont, state in zip(plan.continued, zip(*states))]
            finals = [out for cont, out in zip(plan.continued, states[0]) if not cont]
        else:                                    # partial states beside autograd, as Partials
            partials = [Partial() if cont else None for cont in plan.continued]
            first = launch.site == 0 and launch.phase == 1
            # the rows no earlier launch read (own_lo: the first that this one completes)
            new_rows = self.addresses[launch.lo + launch.own_lo:launch.hi]
            call = Call(launch=launch, spec=spec, sources=sources, table=self.table,
                        new_rows=new_rows, partial=partial.data_ptr() if launch.partial else None,
                        init=self.partials.pop(launch.site) if launch.phase == 2 else None,
                        partials=partials, qg=qg, qg_parts=self.qg_parts,
                        lses=self.lses[plan.first_lse:plan.first_lse + launch.sites])
            *finals, self.carrier = _apply(self.carrier, self.qg_all if first else None, call,
                                           *sources[spec.own_lo:])
        finals = iter(finals)
        for site, partial in zip(range(launch.site, launch.site + launch.sites), partials):
            if partial:
                self.partials[site] = partial
            else:
                self.outputs[site] = next(finals)


if __name__ == "__main__":  # a library: its checks and benchmarks are bench_kernel.py's
    print("kernel.py: error: the kernels' library runs nothing; python -m scripts.bench_kernel "
          "[--traffic | --host] checks and benchmarks them", file=sys.stderr)
    raise SystemExit(2)
