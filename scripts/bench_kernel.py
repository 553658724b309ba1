"""
Checks and benchmarks of the fused routing kernels of kernel.py: the kernels against mhar.route,
the bytes they move (the traffic model, and the Triton interpreter's count of every load and
store), their time on a GPU and the host's (Python's) time per routing site.

    python -m scripts.bench_kernel              # with CUDA: parity check, then the routing and whole-step benchmarks
    python -m scripts.bench_kernel              # without: the parity check in the Triton interpreter (CPU, slow)
    python -m scripts.bench_kernel --traffic    # the bytes both algorithms move at the paper's kernel-table shapes
    python -m scripts.bench_kernel --host       # the host's time per routing site, through Triton's launcher (CPU)

docs/kernels.md reports what they print.
"""
import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from contextlib import contextmanager
from pathlib import Path

try:  # torch and triton take seconds to import: Ctrl-C meanwhile ends as it does later
    import torch

    if __name__ == "__main__" and "--host" not in sys.argv and not torch.cuda.is_available():
        # without a GPU the kernels run in Triton's interpreter, which triton.jit consults when it
        # decorates them: switch it on before kernel.py imports triton. (--host compiles them for
        # sm_90 and launches them through a stand-in driver instead: torch.cuda left untouched.)
        os.environ.setdefault("TRITON_INTERPRET", "1")

    try:
        import kernel
    except RuntimeError as error:  # no triton: one line, as every script's, in the name of the one run
        script = Path(getattr(sys.modules["__main__"], "__file__", None) or "bench_kernel.py").name
        print(f"{script}: error: {error}", file=sys.stderr)  # (bench_step.py imports this file)
        raise SystemExit(2)
    import mhar
    from kernel import FusedHistory, fused_route
except KeyboardInterrupt:
    if __name__ != "__main__":  # imported (gpu_check.py, the tests): the importer says it
        raise
    print("bench_kernel.py: error: interrupted (Ctrl-C)", file=sys.stderr)
    raise SystemExit(130)

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


def auto_group(n_sites, width, heads, block=1, delta=False):
    """kernel.auto_group's G for a network of n_sites sites."""
    return kernel.auto_group(mhar.site_reads(n_sites, block, delta), width, heads)


# %% Traffic: the bytes a forward and backward move
#
# kernel.launch_bytes mirrors the kernels' loads and stores term by term (auto_group picks G by
# it); count_bytes counts what the interpreter actually loads and stores, and a test checks that
# the two agree exactly. The torch ops around the kernels are modeled only.

def traffic(n_layer, width, heads, positions, group=0, block=1, delta=False, source_bytes=2,
            target=kernel.PROGRAMS):
    """Bytes a fused forward and backward through all 2L+1 sites move, for `group` (0: auto_group;
    1: one pass per site): {"forward"|"backward": {"kernels": bytes, "torch": bytes}, "saved":
    bytes}, where "saved" is what the routing keeps for backward besides the sources (bf16
    remainders, lse), in eager code (traced, the partial states are kept whole). The kernels
    launched as `target` programs: a GPU's by default, None: this process's."""
    n_sites = 2 * n_layer + 1
    reads = mhar.site_reads(n_sites, block, delta)
    group = group or kernel.auto_group(reads, width, heads)
    kernel.layout(width, heads, group)                                      # raises if the group cannot be fused
    launches = kernel.schedule(reads, group)
    kernels = [kernel.launch_bytes(launch, positions, width, heads, source_bytes, target) for launch in launches]
    E = positions * width * source_bytes                             # bytes of one (B, T, d) source
    # block and delta routing: each output that extends a partial block sum is added to it (read
    # two, write one); backward accumulates the previous sum's gradient when a site read that sum
    extends = [site for site in range(1, n_sites) if (site - 1) % block != 0]
    sums_forward = 3 * E * len(extends)
    sums_backward = 3 * E * sum(reads[site - 1][1] for site in extends)
    null = (E + 4 * width) if delta else 0                           # delta's null: expanded, summed back
    # q ⊙ g of all S sites: two stacks and a product forward; backward the product's gradient and
    # the stacks' (views), from the launches' per-program partials: each buffer summed over
    # programs (counted at 8 warps: a 4-warp backward has twice as many), phase 2's rows added to a
    # copy of phase 1's sum.
    qg = 4 * n_sites * width
    programs = kernel._programs(positions, target)[1]
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
                        "torch": sums_forward + null + qg_forward},
            "backward": {"kernels": sum(b for _, b in kernels),
                         "torch": sums_backward + null + qg_backward},
            "saved": saved}


@contextmanager
def rounded_to_nearest():
    """Triton's interpreter rounds fp32 to bf16 toward zero (its casts pass no rounding mode);
    compiled kernels and torch round to nearest even (the default of tl.tensor.to). Interpreted,
    they round as compiled within this block, so that bf16 accuracy measured on a CPU is the GPU's
    (gpu_check.py --tiny, and the whole test suite)."""
    if not kernel.INTERPRETED:
        yield
        return
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter
    convert = interpreter._convert_float

    def to_nearest(values, source, target, rounding_mode):
        if (source, target) != (tl.float32, tl.bfloat16):
            return convert(values, source, target, rounding_mode)
        rounded = torch.from_numpy(np.ascontiguousarray(values).view(np.float32)).bfloat16()
        return rounded.view(torch.int16).numpy().view(np.uint16)
    interpreter._convert_float = to_nearest
    try:
        yield
    finally:
        interpreter._convert_float = convert


def count_bytes():
    """A context manager counting the bytes the interpreted kernels load and store (every
    masked-in element of every tl.load and tl.store): `with count_bytes() as counted: ...`, then
    counted["load"], counted["store"]."""
    import numpy as np
    from triton.runtime import interpreter

    if not kernel.INTERPRETED:
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


# %% Checks and benchmarks

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
        history = FusedHistory(mhar.depth_history(qs, gs, heads, 1e-6), mhar.site_reads(len(qs)),
                               group=group)
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
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 2e-2}      # bf16: outputs rounded to 8 bits
    # Along a chain of sites the two paths' roundings compound, and dq, dg come from a cancellation
    # (<dout, V_n> − c) that magnifies them: a few 1e-6 in fp32, a few % in bf16.
    chain_tolerance = {torch.float32: 1e-4, torch.bfloat16: 5e-2}
    failed = False
    for dtype in kernel.SOURCE_TYPES:
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
    time) and % of the copy bandwidth; returns {(preset, "eager" | "fused 1" | "fused G"): ms}, G
    auto_group's."""
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
                      for G in range(2, sites + 1) if kernel._fits(d, HEADS, G) and G <= 12}}
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
            routing.update({(preset, "eager"): ms} if method == "eager" else {})
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
    """The readable and the fused routing side by side in a whole training step (forward + backward,
    bf16 autocast on a GPU, one microbatch of the kernel-table shape): tokens per second of the step,
    the routing's own time (from `routing`, _benchmark's), fused over readable for both, and the
    baseline's step for scale with the peak memory of the baseline's and the fused step. fused/base is
    the fused step's tokens/s over the baseline's (the paper: 0.88 / 0.71 / 0.55)."""
    timer = timer or _do_bench
    steps = steps or [(preset, B, T) for preset, _, _, B, T in KERNEL_TABLE]
    print(f"\n{'shape':6} {'tok/s readable':>14} {'fused':>8} {'speedup':>7} {'routing ms readable':>19} "
          f"{'fused':>6} {'speedup':>7} {'tok/s baseline':>14} {'fused/base':>10} {'peak GB base/fused':>18}")
    for preset, B, T in steps:
        idx = torch.randint(0, vocab_size, (B, T), device=device)
        step_ms, peak = {}, {}
        for name, overrides in (("baseline", dict(residual="baseline")), ("readable", dict(route_heads=HEADS)),
                                ("fused", dict(route_heads=HEADS, fused=True))):
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
        tokens_per_s = {name: B * T / ms * 1e3 for name, ms in step_ms.items()}
        readable_ms, fused_ms = (routing.get((preset, m), float("nan")) for m in ("eager", "fused G"))
        print(f"{preset:6} {tokens_per_s['readable']:14,.0f} {tokens_per_s['fused']:8,.0f} "
              f"{tokens_per_s['fused'] / tokens_per_s['readable']:6.2f}x {readable_ms:19.2f} {fused_ms:6.2f} "
              f"{readable_ms / fused_ms:6.2f}x {tokens_per_s['baseline']:14,.0f} "
              f"{tokens_per_s['fused'] / tokens_per_s['baseline']:9.2f}x "
              f"{peak.get('baseline', float('nan')):9.1f}/{peak.get('fused', float('nan')):.1f}")


# A stand-in for the CUDA driver, libcuda.so.1: every call succeeds and answers as an H100 or H200 would
# (sm_90, 132 SMs, 227 KB of shared memory a block), a module and a function are placeholders, and a
# launch only counts itself. Triton's launcher runs against it to its last call: the host's whole
# share of a launch, with nothing run and no pointer dereferenced. (Its calls are the ones triton's
# backends/nvidia/driver.c makes; one it does not know fails to link, loudly.)
STAND_IN_DRIVER = r"""
#include <string.h>
#include "cuda.h"
static int context, module, function;
unsigned long long launches = 0;
CUresult cuInit(unsigned int flags) { return CUDA_SUCCESS; }
CUresult cuDriverGetVersion(int *version) { *version = 12080; return CUDA_SUCCESS; }
CUresult cuDeviceGetCount(int *count) { *count = 1; return CUDA_SUCCESS; }
CUresult cuDeviceGet(CUdevice *device, int ordinal) { *device = ordinal; return CUDA_SUCCESS; }
CUresult cuDeviceGetAttribute(int *value, CUdevice_attribute attribute, CUdevice device) {
  switch (attribute) {
  case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: *value = 9; break;
  case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: *value = 0; break;
  case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: *value = 132; break;
  case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN: *value = 232448; break;
  case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR: *value = 233472; break;
  case CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_BLOCK: *value = 65536; break;
  case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK: *value = 1024; break;
  case CU_DEVICE_ATTRIBUTE_WARP_SIZE: *value = 32; break;
  default: *value = 0;
  }
  return CUDA_SUCCESS;
}
CUresult cuDevicePrimaryCtxRetain(CUcontext *c, CUdevice d) { *c = (CUcontext)&context; return CUDA_SUCCESS; }
CUresult cuCtxGetCurrent(CUcontext *c) { *c = (CUcontext)&context; return CUDA_SUCCESS; }  /* as after torch's init */
CUresult cuCtxSetCurrent(CUcontext c) { return CUDA_SUCCESS; }
CUresult cuCtxGetDevice(CUdevice *device) { *device = 0; return CUDA_SUCCESS; }
CUresult cuCtxGetLimit(size_t *value, CUlimit limit) { *value = 1 << 20; return CUDA_SUCCESS; }
CUresult cuCtxSetLimit(CUlimit limit, size_t value) { return CUDA_SUCCESS; }
CUresult cuGetErrorString(CUresult error, const char **text) { *text = "stand-in driver"; return CUDA_SUCCESS; }
CUresult cuModuleLoadData(CUmodule *m, const void *image) { *m = (CUmodule)&module; return CUDA_SUCCESS; }
CUresult cuModuleUnload(CUmodule m) { return CUDA_SUCCESS; }
CUresult cuModuleGetFunction(CUfunction *f, CUmodule m, const char *name) { *f = (CUfunction)&function; return CUDA_SUCCESS; }
CUresult cuFuncGetAttribute(int *value, CUfunction_attribute attribute, CUfunction f) {
  *value = attribute == CU_FUNC_ATTRIBUTE_NUM_REGS ? 64 : attribute == CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK ? 1024 : 0;
  return CUDA_SUCCESS;
}
CUresult cuFuncSetAttribute(CUfunction f, CUfunction_attribute attribute, int value) { return CUDA_SUCCESS; }
CUresult cuFuncSetCacheConfig(CUfunction f, CUfunc_cache config) { return CUDA_SUCCESS; }
CUresult cuPointerGetAttribute(void *data, CUpointer_attribute attribute, CUdeviceptr pointer) {
  if (attribute == CU_POINTER_ATTRIBUTE_DEVICE_POINTER) *(CUdeviceptr *)data = pointer;  /* valid as it is */
  return CUDA_SUCCESS;
}
CUresult cuPointerGetAttributes(unsigned int n, CUpointer_attribute *a, void **data, CUdeviceptr p) { return CUDA_SUCCESS; }
CUresult cuStreamIsCapturing(CUstream s, CUstreamCaptureStatus *status) { *status = CU_STREAM_CAPTURE_STATUS_NONE; return CUDA_SUCCESS; }
CUresult cuOccupancyMaxActiveClusters(int *n, CUfunction f, const CUlaunchConfig *c) { *n = 132; return CUDA_SUCCESS; }
CUresult cuTensorMapEncodeTiled(CUtensorMap *m, CUtensorMapDataType t, cuuint32_t r, void *g, const cuuint64_t *d,
    const cuuint64_t *s, const cuuint32_t *b, const cuuint32_t *e, CUtensorMapInterleave i, CUtensorMapSwizzle w,
    CUtensorMapL2promotion l, CUtensorMapFloatOOBfill f) { memset(m, 0, sizeof *m); return CUDA_SUCCESS; }
CUresult cuTensorMapEncodeIm2col(CUtensorMap *m, CUtensorMapDataType t, cuuint32_t r, void *g, const cuuint64_t *d,
    const cuuint64_t *s, const int *lo, const int *hi, cuuint32_t c, cuuint32_t p, const cuuint32_t *e,
    CUtensorMapInterleave i, CUtensorMapSwizzle w, CUtensorMapL2promotion l, CUtensorMapFloatOOBfill f) {
  memset(m, 0, sizeof *m); return CUDA_SUCCESS; }
CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **parameters, void **extra) {
  launches++; return CUDA_SUCCESS; }
CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
    unsigned shared, CUstream s, void **parameters, void **extra) { launches++; return CUDA_SUCCESS; }
CUresult cuGetProcAddress(const char *symbol, void **function, int version, cuuint64_t flags,
    CUdriverProcAddressQueryResult *status) {
  *function = 0; if (status) *status = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND; return CUDA_ERROR_NOT_FOUND; }
"""
STAND_IN_SMS = 132  # the stand-in driver's, an H100's and an H200's


@contextmanager
def stand_in_gpu():
    """Triton's CUDA launch path on a machine without a GPU, down to its last driver call: the kernels
    compile for sm_90, JITFunction.run binds and looks up every launch as on a GPU, and Triton's C
    launcher hands it to STAND_IN_DRIVER (compiled with gcc on first use, loaded before the launcher
    links libcuda.so.1). The tensors stay on the CPU and are never read. Yields a function that
    returns how many launches reached the driver. Needs the kernels compiled, not interpreted."""
    import triton
    from triton.backends.nvidia.driver import CudaDriver

    if kernel.INTERPRETED:
        raise RuntimeError("the host's time goes through Triton's launcher, which the interpreter "
                           "replaces: unset TRITON_INTERPRET")
    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        raise RuntimeError("the stand-in driver needs a C compiler (gcc), as Triton's launcher does")
    digest = hashlib.sha256(STAND_IN_DRIVER.encode()).hexdigest()[:12]
    user = getattr(os, "getuid", lambda: "")()       # a folder a user's own: another's may be private
    folder = Path(tempfile.gettempdir()) / f"mhar-stand-in-driver-{user}-{digest}"
    library = folder / "libcuda.so.1"
    try:
        built = library.exists()
        if not built:
            folder.mkdir(exist_ok=True)
            (folder / "driver.c").write_text(STAND_IN_DRIVER)
    except PermissionError:
        raise RuntimeError(f"the stand-in driver's folder {folder} is not yours to write: set TMPDIR "
                           "to another temporary folder") from None
    if not built:
        source, partial = folder / "driver.c", folder / f"libcuda.so.1.{os.getpid()}"
        include = Path(triton.__file__).parent / "backends" / "nvidia" / "include"  # triton's cuda.h
        subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", f"-I{include}",
                        str(source), "-o", str(partial)], check=True, capture_output=True)
        partial.replace(library)  # whole or absent, whoever else builds it meanwhile
    driver_library = ctypes.CDLL(str(library), mode=ctypes.RTLD_GLOBAL)  # libcuda.so.1 from now on
    saved = (os.environ.get("TRITON_LIBCUDA_PATH"), kernel.check_available, kernel._device_programs,
             triton.runtime.driver._active)  # None until a launch asks for one (reset_active would ask)
    os.environ["TRITON_LIBCUDA_PATH"] = str(folder)  # where Triton's launcher links libcuda.so.1
    driver = CudaDriver()
    # its own device, stream and capability queries, not torch.cuda's: through the driver where
    # triton has them (3.9, in C), else device 0, its default stream, sm_90 (3.6 has none)
    driver.get_current_device = getattr(driver, "_get_current_device", lambda: 0)
    driver.get_current_stream = getattr(driver, "_get_current_stream", lambda device: 0)
    driver.get_device_capability = getattr(driver, "_get_device_capability", lambda device: (9, 0))
    triton.runtime.driver.set_active(driver)
    kernel.check_available = lambda device=None: None
    kernel._device_programs = lambda: kernel.RESIDENT_WARPS // 8 * STAND_IN_SMS
    try:
        with warnings.catch_warnings():
            # triton 3.9 warns at the first compile that its FMA default will change: not the host's
            warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION")
            yield lambda: ctypes.c_ulonglong.in_dll(driver_library, "launches").value
    finally:
        if saved[0] is None:
            del os.environ["TRITON_LIBCUDA_PATH"]
        else:
            os.environ["TRITON_LIBCUDA_PATH"] = saved[0]
        kernel.check_available, kernel._device_programs = saved[1:3]
        triton.runtime.driver.set_active(saved[3])


def host_cost(shapes=KERNEL_TABLE, positions=4, repeats=3, heads=HEADS):
    """The host's share of the fused path: a chain of 2L+1 sites (each source the previous site's output
    times 1.0) forward then backward, every launch through Triton's launcher to the stand-in driver
    (stand_in_gpu), against the same chain with each site one plain op h * q_j; best of `repeats` × 3
    runs of each, alternating, one thread, its CPU time. Prints µs per site, launches per site and the
    ratio; returns {(preset, group): ratio}."""

    def best(*runs):
        """The best of `repeats` × 3 runs of each, alternating, in this thread's CPU time: other
        processes on the machine weigh on both alike, and hardly at all."""
        for run in runs:
            run()                                                   # warm: compiles, caches
        times = [[] for _ in runs]
        for _ in range(repeats):
            for run, kept in zip(runs, times):
                start = time.thread_time()
                for _ in range(3):
                    run()
                kept.append((time.thread_time() - start) / 3)
        return [min(kept) for kept in times]

    def fused_chain(s0, qs, gs, group):
        history = FusedHistory(mhar.depth_history(qs, gs, heads, 1e-6), mhar.site_reads(len(qs)),
                               group=group)
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

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    ratios = {}
    try:
        with stand_in_gpu() as launched:
            print(f"host time per routing site, forward + backward, through Triton's launcher to a "
                  f"stand-in driver (sm_90), {positions} bf16 positions, H = {heads}, one thread; "
                  f"plain: one op h * q_j per site")
            print(f"{'shape':6} {'d':>5} {'sites':>5} {'G':>3} {'launches':>8} {'fused µs':>9} "
                  f"{'plain µs':>9} {'ratio':>6}")
            for preset, d, L, *_ in shapes:
                sites = 2 * L + 1
                s0 = torch.randn(1, positions, d).bfloat16().requires_grad_()
                qs = [torch.zeros(d, requires_grad=True) for _ in range(sites)]
                gs = [torch.ones(d, requires_grad=True) for _ in range(sites)]
                for group in (1, auto_group(sites, d, heads)):
                    plain, fused = (t / sites for t in best(lambda: plain_chain(s0, qs),
                                                            lambda: fused_chain(s0, qs, gs, group)))
                    before = launched()
                    fused_chain(s0, qs, gs, group)
                    launches = (launched() - before) / sites
                    ratios[preset, group] = fused / plain
                    print(f"{preset:6} {d:5} {sites:5} {group:3} {launches:8.1f} {fused * 1e6:9.0f} "
                          f"{plain * 1e6:9.0f} {fused / plain:5.1f}x", flush=True)
    finally:
        torch.set_num_threads(threads)
    return ratios


def _host_ms(fn, device):
    """The host's time to issue fn: on a GPU the launches are queued and Python returns before
    the kernels end, unless something synchronizes; where host ms nears fwd+bwd ms, the host is
    the bound."""
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
    from lib.common import FlagParser, exit_error  # one line for a wrong flag, as every script
    parser = FlagParser(prog="bench_kernel.py", description="Check the fused routing against "
                        "mhar.route; with a GPU, benchmark it; --traffic prints the modeled bytes.")
    parser.add_argument("--traffic", action="store_true", help="the traffic model at the kernel-table shapes")
    parser.add_argument("--host", action="store_true",
                        help="the host's time per routing site, through Triton's launcher to a stand-in "
                             "driver (no GPU needed)")
    args = parser.parse_args(argv)
    try:
        return run(args)
    except KeyboardInterrupt:
        exit_error("bench_kernel.py", "interrupted (Ctrl-C): what finished is printed above",
                   status=130)


def run(args):
    """What main's flags ask for; the exit status: 1 when the check failed."""
    if args.traffic:
        print_traffic()
        return 0
    if args.host:
        from lib.common import exit_error, one_line
        if kernel.INTERPRETED:
            exit_error("bench_kernel.py", "--host measures Triton's launcher, which the interpreter replaces: "
                                          "unset TRITON_INTERPRET")
        try:
            host_cost()
        except (RuntimeError, OSError, ImportError, subprocess.CalledProcessError) as error:  # the machine's
            exit_error("bench_kernel.py", f"--host: {one_line(error)}", status=1)
        return 0
    torch.manual_seed(0)
    if torch.cuda.is_available() and not kernel.INTERPRETED:
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
