"""
The GPU check: one run of at most four minutes on one H200 (by its own plan) that answers what a
first GPU is for, on the machine's own packages (the repository copied, nothing installed).

    python -m scripts.gpu_check                # on a CUDA GPU: the whole check, about 3 min on an H200
    python -m scripts.gpu_check --quick        # does every mode run, is fused faster: under 2.5 min
    python -m scripts.gpu_check --plan         # each part's expected seconds on an H200 and hard timeout,
                                       # what the budget leaves out, the total (no GPU needed)
    python -m scripts.gpu_check --budget 200   # start no part expected to end past 200 s (default 240,
                                       # --quick 140), and kill any part at it
    python -m scripts.gpu_check --tiny         # the same code at tiny shapes on this machine: kernels in
                                       # Triton's interpreter, compiled configurations traced with
                                       # aot_eager, the GPU's timings faked (the suite runs it)

Each part runs in a process of its own (python -m scripts.gpu_check --part ROW... --json FILE), killed
at a hard timeout (twice its expected seconds, four times for a part that compiles, whose caches a
fresh machine has empty; never past the budget): a part that overruns is a row "timed out after
N s", one that crashes a row with its last line of error, and the others still run. The captured
steps (CUDA graphs, whose errors are sticky) each have a process alone. Ctrl-C, SIGTERM or SIGHUP
kills the part under way and ends the check with the table of what finished, in one line, exit
status 128 + the signal's number. It prints, flushing every line, as it goes:
  1. routing, at each shape of bench_kernel.KERNEL_TABLE (100m, 350m, 1b), in a part of its own
     that runs first: all 2L+1 sites forward and backward, fused, automatic G, bf16 sources: the
     GPU's time in the routing kernels and in every kernel, from torch.profiler, the host's time to
     issue it all, and the bandwidth: the traffic model's bytes over the kernel time, against the
     device's measured copy bandwidth;
  2. parity: the readable path, the fused kernels, and the fused kernels under torch.compile
     (what --compile --fused runs), in fp32 and bf16, each against the readable path in float64:
     relative errors of the output, ds0, dq, dg; fp32 within 1e-4, bf16 within 2x the readable
     bf16 path's (a wrong kernel errs by O(1); tests/test_kernel.py holds the fine bound);
  3. train.py's own step (train.train_step: synthetic tokens, the chunked head, AdamW, bf16
     autocast, the preset's micro-batch) for baseline, readable MHAR, fused, compiled + fused,
     captured (--compile --fused --compile_mode reduce-overhead), captured+accum (the same over
     4 micro-steps a step) and compiled (readable MHAR): the first step's seconds (compiling),
     tokens/s over 5 steps after 2 more, peak memory, dynamo's graphs, the recompiles after the
     first step and inductor's CUDA-graph skips;
  4. numbers under CUDA graphs, right after the routing: the fused chain (parity's sites) forward
     and backward captured in a torch.cuda.graph and replayed on new inputs, bit for bit against
     eager; and train.py's captured+accum step against the same step eager (fused) from the same
     weights at lr 0, over 3 steps of new batches and an evaluation: the losses, every gradient
     (within a tenth of how far two batches' gradients lie apart, the error of a stale input) and
     no CUDA graph skipped;
then one table of it all, headed by the device, the versions and the date, also written to
--out (default out/gpu_check/) as <mode>.md and <mode>.json (mode: full, quick or tiny), each
whole or not at all; an --out that is (or lies under) a file is refused, status 2, one that cannot
be written (read-only, a full disk) ends the check before its parts run, status 1.
"""
import time

STARTED = time.perf_counter()  # the budget counts from here, the imports included

import argparse  # noqa: E402
import contextlib  # noqa: E402
import datetime  # noqa: E402
import functools  # noqa: E402
import gc  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
from pathlib import Path  # noqa: E402

try:  # torch and triton take seconds to import: Ctrl-C meanwhile ends as it does later
    import torch

    if not torch.cuda.is_available():
        # the kernels run in Triton's interpreter, which triton.jit consults when it decorates them
        os.environ.setdefault("TRITON_INTERPRET", "1")

    try:
        import kernel
    except RuntimeError as error:  # no triton: one line, as every script's
        print(f"gpu_check.py: error: {error}", file=sys.stderr)
        raise SystemExit(2)
    import mhar
    from lib.common import (AMOUNT, ROOT, FlagParser, MachineError, UserError, exit_error,
                            output_folder, write_text)
    from scripts.bench_kernel import (HEADS, KERNEL_TABLE, auto_group, fused_network,
                                      rounded_to_nearest, stacked_network, traffic)
except KeyboardInterrupt:
    print("gpu_check.py: error: interrupted (Ctrl-C)", file=sys.stderr)
    raise SystemExit(130)

# (sites, B, T, d, H) of the parity chain: on a GPU the 100m depth and width, whose bf16 kernels
# (G = 5) it finds compiled by the routing (--quick's compiles them for the 100m steps); --tiny's
PARITY = {"gpu": (25, 2, 64, 512, 8), "tiny": (5, 1, 4, 40, 4)}
ROUTES = {r[0]: r for r in (*KERNEL_TABLE, ("tiny", 64, 2, 1, 4))}  # (preset, d, L, B, T)
TINY_FLAGS = ["--n_layer", "1", "--seq_len", "8", "--batch_size", "1", "--vocab_size", "256",
              "--device", "cpu"]
SHAPES = {"tiny": ["--preset", "tiny", *TINY_FLAGS],  # a step's shape: its train.py flags
          "100m-4L": ["--preset", "100m", "--n_layer", "4"]}  # --quick's compiles: 4 of 12 layers
CONFIGS = {  # name: train.py's flags beyond the shape's, --data synthetic and --grad_accum 1
    "baseline": ["--residual", "baseline"],
    "readable": [],
    "fused": ["--fused"],
    "compiled+fused": ["--compile", "--fused"],
    "captured": ["--compile", "--fused", "--compile_mode", "reduce-overhead"],
    "captured+accum": ["--compile", "--fused", "--compile_mode", "reduce-overhead",
                       "--grad_accum", "4"],
    "compiled": ["--compile"],
}
FP32_TOLERANCE = 1e-4      # relative, along a chain of sites (bench_kernel._check's)
BF16_SLACK = 2             # a bf16 path's errors at most this x the readable bf16 path's

# The parts of each mode, in the order they run: a part is the rows it measures, in a process of
# its own. The routing rows come first, alone, so that a part killed later (parity's cold compiles)
# costs none of the kernel timings; the captured steps each run alone; --tiny groups its rows in
# three processes (each one costs this CPU 4 s of imports), the routing first.
EAGER = ("baseline", "readable", "fused")
PLANS = {
    "full": [["routing 100m", "routing 350m", "routing 1b"], ["replay"], ["numbers 100m-4L"], ["parity"],
             [f"100m {c}" for c in EAGER],
             ["100m compiled+fused"], ["100m captured"], ["100m captured+accum"],
             [f"350m {c}" for c in EAGER], ["100m compiled"], ["350m compiled+fused"],
             ["350m captured"], ["350m captured+accum"], ["350m compiled"]],
    "quick": [["replay"], ["numbers 100m-4L"], ["parity"], [f"100m {c}" for c in EAGER],
              ["100m-4L compiled+fused"], ["100m-4L captured"]],  # numbers: captured+accum's step
    "tiny": [["routing tiny", "parity"], [f"tiny {c}" for c in (*EAGER, "compiled+fused", "compiled")],
             ["tiny captured", "tiny captured+accum", "replay", "numbers tiny"]],
}
# Expected seconds on one H200 (docs/kernels.md, "GPU check", says how each was estimated): the
# parent's start (Python, torch, CUDA), each part's process (START_S: its imports and CUDA context)
# and each row. A compile is 3x this CPU's aot_eager trace of the step, 2x in a later process that
# finds its kernels in the on-disk caches (captured, captured+accum). Routing 100m, first, compiles
# the bf16 kernels (4 variants, 1 s each) that parity then finds; --quick's parity, with no routing
# before it, compiles them itself.
START_S = 6
EXPECTED_S = {"start": 10, "parity": 22, "routing 100m": 7, "routing 350m": 6, "routing 1b": 8,
              "100m baseline": 2, "100m readable": 2, "100m fused": 3, "100m compiled+fused": 35,
              "100m captured": 24, "100m captured+accum": 27, "100m compiled": 53,
              "350m baseline": 3, "350m readable": 3, "350m fused": 4, "350m compiled+fused": 87,
              "350m captured": 59, "350m captured+accum": 62, "350m compiled": 108,
              "100m-4L compiled+fused": 17, "100m-4L captured": 12, "100m-4L captured+accum": 14,
              "replay": 8, "numbers 100m-4L": 24}
TIMEOUT_FACTOR = 2         # a part is killed at this x its expected seconds (or at the budget)
# ... and one that compiles (parity, the routing's kernels, a --compile step) at this x: on a fresh
# machine Triton's and inductor's on-disk caches are empty, and a cold compile's seconds are this
# CPU's trace scaled (docs/kernels.md), not measured; the budget still bounds the whole run
COLD_FACTOR = 4
TINY_TIMEOUT_S = 600       # --tiny's, per part: no budget on a CPU
BUDGET_S = {"full": 240.0, "quick": 140.0}


# %% Clocks: the GPU's (profiler, allocator), or a fake one where there is no GPU

class CudaClock:
    """Kernel time from torch.profiler's CUDA activity, the allocator's peak, the copy bandwidth."""
    fake, bandwidth = False, None

    def sync(self):
        torch.cuda.synchronize()

    def kernel_ms(self, fn, reps, prefix="_route"):
        """(ms in the kernels whose name starts with `prefix`, ms in every kernel) per call."""
        from torch.profiler import ProfilerActivity, profile
        self.sync()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                fn()
            self.sync()
        named = every = 0.0
        for event in prof.events():
            if event.device_type != torch.autograd.DeviceType.CUDA:
                continue
            us = event.device_time_total                            # µs, this kernel's (or copy's)
            every += us
            named += us if event.name.startswith(prefix) else 0.0
        return named / reps / 1e3, every / reps / 1e3

    def copy_bandwidth(self):
        """Bytes/s of a 1 GiB copy on the device (read + write), the best of 10; measured once."""
        if self.bandwidth:
            return self.bandwidth
        x = torch.empty(2**28, device="cuda")
        y = torch.empty_like(x)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        best = float("inf")
        for _ in range(10):
            start.record()
            y.copy_(x)
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end))
        self.bandwidth = 2 * x.nbytes / best * 1e3
        return self.bandwidth

    def reset_peak(self):
        torch.cuda.reset_peak_memory_stats()

    def peak_bytes(self):
        return torch.cuda.max_memory_allocated()


class FakeClock(CudaClock):
    """Where no GPU measures: every kernel measure 1 ms (the routing kernels' half of it), a copy
    bandwidth of 1 TB/s, the process's maximum resident set for the peak; so the arithmetic and
    the table run, and a test can check them."""
    fake = True
    KERNEL_MS, BANDWIDTH = 1.0, 1e12

    def sync(self):
        pass

    def kernel_ms(self, fn, reps, prefix="_route"):
        for _ in range(reps):
            fn()
        return self.KERNEL_MS / 2, self.KERNEL_MS

    def copy_bandwidth(self):
        return self.BANDWIDTH

    def reset_peak(self):
        pass

    def peak_bytes(self):
        from lib.common import peak_memory
        return peak_memory(torch.device("cpu"))


def host_ms(fn, clock):
    """The host's time to issue fn (the GPU still working when Python returns), in ms."""
    clock.sync()
    start = time.perf_counter()
    fn()
    host = time.perf_counter() - start
    clock.sync()
    return host * 1e3


@contextlib.contextmanager
def compile_backend(backend):
    """torch.compile with `backend` (train.py's too): on a CPU inductor's C++ compile of a model
    takes minutes, aot_eager traces the same graphs (a mode other than inductor's is left out)."""
    if backend == "inductor":
        yield
        return
    original = torch.compile

    def compile(model=None, **kwargs):
        kwargs.pop("mode", None)
        return original(model, **{**kwargs, "backend": backend})
    torch.compile = compile
    try:
        yield
    finally:
        torch.compile = original


# %% 2. Parity: readable, fused, compiled, against float64

def chain(network, dtype, shape, seed=0, device="cpu"):
    """[out, ds0, dq, dg] of `network` (bench_kernel's stacked_network or fused_network) over a
    chain of sites whose sublayers are tanh(h W), W fixed: distinct sources. The inputs are
    rounded to bf16 on every path, so that only the arithmetic differs."""
    sites, B, T, d, heads = shape
    gen = torch.Generator().manual_seed(seed)
    parameter = torch.float64 if dtype == torch.float64 else torch.float32
    s0 = torch.randn(B, T, d, generator=gen).bfloat16().to(device, dtype).requires_grad_()
    qs = [(0.5 * torch.randn(d, generator=gen)).to(device, parameter).requires_grad_()
          for _ in range(sites)]
    gs = [(1 + 0.1 * torch.randn(d, generator=gen)).to(device, parameter).requires_grad_()
          for _ in range(sites)]
    weight = (torch.randn(d, d, generator=gen) / d ** 0.5).bfloat16().to(device, dtype)
    dout = torch.randn(B, T, d, generator=gen).bfloat16().to(device)
    out = network(s0, qs, gs, heads, lambda h: torch.tanh(h @ weight.to(h.dtype)))
    out.backward(dout.to(out.dtype))
    return [out, s0.grad, torch.cat([q.grad for q in qs]), torch.cat([g.grad for g in gs])]


def relative_error(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def parity(shape, device, backend):
    """Rows (dtype, path, [errors of out, ds0, dq, dg against float64], passed)."""
    readable, fused = stacked_network(mhar.route), fused_network(0)
    compiled = torch.compile(fused, backend=backend)
    paths = {"readable": readable, "fused": fused, "compiled": compiled}
    exact = chain(readable, torch.float64, shape, device=device)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        with rounded_to_nearest():
            errors = {name: [relative_error(a, b)
                             for a, b in zip(chain(net, dtype, shape, device=device), exact)]
                      for name, net in paths.items()}
        for name, e in errors.items():
            ok = (max(e) <= FP32_TOLERANCE if dtype == torch.float32 else
                  all(x <= BF16_SLACK * r for x, r in zip(e, errors["readable"])))
            rows.append((str(dtype)[6:], name, e, ok))
    return rows


def print_parity(rows, shape):
    sites, B, T, d, heads = shape
    print(f"2. parity: {sites} sites, B·T = {B * T}, d = {d}, H = {heads}; relative error against "
          f"the readable path in float64 (fp32: at most {FP32_TOLERANCE:g}; bf16: at most "
          f"{BF16_SLACK}x the readable bf16 path's)")
    print(f"   {'dtype':8} {'path':15} {'out':>8} {'ds0':>8} {'dq':>8} {'dg':>8}  ok")
    for dtype, name, e, ok in rows:
        print(f"   {dtype:8} {name:15} " + " ".join(f"{x:8.1e}" for x in e)
              + f"  {'yes' if ok else 'NO'}")


# %% 1. Routing: the fused path's kernel time, host time and bandwidth per shape

def routing(shape, clock, device, reps, warm=2):
    """{"G", "route ms", "kernel ms", "host ms", "GB/s", "% copy"} of all 2L+1 sites forward and
    backward, fused at the automatic G, bf16, identity sublayers (only the routing runs)."""
    preset, d, L, B, T = shape
    sites = 2 * L + 1
    s0 = torch.randn(B, T, d, device=device, dtype=torch.bfloat16, requires_grad=True)
    qs = [(0.02 * torch.randn(d, device=device)).requires_grad_() for _ in range(sites)]
    gs = [torch.ones(d, device=device, requires_grad=True) for _ in range(sites)]
    dout = torch.randn(B, T, d, device=device, dtype=torch.bfloat16)
    network, identity = fused_network(0), torch.nn.Identity()

    def run():
        for leaf in (s0, *qs, *gs):
            leaf.grad = None
        network(s0, qs, gs, HEADS, identity).backward(dout)
    for _ in range(warm):                                           # compiled, caches filled
        run()
    route, every = clock.kernel_ms(run, reps)
    host = statistics.median(host_ms(run, clock) for _ in range(reps))
    moved = traffic(L, d, HEADS, B * T, 0, source_bytes=2)
    moved = sum(sum(moved[way].values()) for way in ("forward", "backward"))
    per_second = moved / every * 1e3
    return {"G": auto_group(sites, d, HEADS), "route ms": route, "kernel ms": every,
            "host ms": host, "GB/s": per_second / 1e9,
            "% copy": 100 * per_second / clock.copy_bandwidth()}


FAKED = ("route ms", "kernel ms", "GB/s", "% copy")  # what FakeClock makes up where no GPU measures
FOOTNOTE = ("   * fake: no GPU measured it (a placeholder clock, 1 ms per kernel and 1 TB/s, so that the "
            "arithmetic runs); ~ the kernels in Triton's CPU interpreter: its pace, not a GPU's")


def mark(column, config, fake):
    """The footnote mark of a printed figure: "*" made up by FakeClock, "~" the routing's host time or a
    fused configuration's speed, in the interpreter (both only where there is no GPU), "" measured."""
    if not fake:
        return ""
    if column in FAKED:
        return "*"
    fused = config == "routing" or "--fused" in CONFIGS.get(config, [])
    return "~" if fused and column in ("tok/s", "x base", "host ms") else ""


def print_routing_header(clock):
    print(f"1. routing: all 2L+1 sites forward + backward, fused, automatic G, bf16; copy "
          f"bandwidth {clock.copy_bandwidth() / 1e9:.0f} GB/s" + ("*" if clock.fake else ""))
    print(f"   {'shape':6} {'G':>2} {'route ms':>9} {'kernel ms':>10} {'host ms':>8} {'GB/s':>7} "
          f"{'% copy':>7}")


def print_routing(preset, r, fake):
    if isinstance(r, str):
        print(f"   {preset:6} {r}")
    else:
        m = {column: mark(column, "routing", fake) for column in (*FAKED, "host ms")}
        print(f"   {preset:6} {r['G']:2} {r['route ms']:8.2f}{m['route ms']:1} "
              f"{r['kernel ms']:9.2f}{m['kernel ms']:1} {r['host ms']:7.2f}{m['host ms']:1} "
              f"{r['GB/s']:6.0f}{m['GB/s']:1} {r['% copy']:6.0f}{m['% copy']:1}")


# %% 3. train.py's step

def step_config(shape, config):
    """train.py's flags of one step configuration at one shape (a preset, or one of SHAPES). Every
    configuration of a shape runs the readable path's micro-batch (its preset's batch_size; the
    baseline and --fused would take lean_batch_size): the rows compare at one size, and the plan's
    seconds were estimated at it."""
    import train
    flags = SHAPES.get(shape, ["--preset", shape])
    if "--batch_size" not in flags:
        preset = flags[flags.index("--preset") + 1]
        flags = [*flags, "--batch_size", str(train.RUNS[preset]["batch_size"])]
    accum = [] if "--grad_accum" in CONFIGS[config] else ["--grad_accum", "1"]
    return [*flags, "--data", "synthetic", *accum, *CONFIGS[config]]


def build_run(flags):
    """train.py's run from its flags, as train.py builds it: (args, session, model, optimizer, the
    loss of its steps)."""
    import train
    from lib import head, parallel
    try:
        with contextlib.redirect_stderr(io.StringIO()):     # the row says it, in a line
            args, given = train.parse_args(flags)
    except SystemExit:
        raise RuntimeError(f"this train.py does not take {' '.join(flags)}") from None
    session = parallel.start_session(args)
    args, _, _ = train.resolve_flags(args, given, session.world)
    parallel.set_precision(session, args)
    config = train.model_config(args, {})
    gpt, optimizer, _, _ = train.build_model(args, config, None, None, session)
    model = parallel.wrap_model(gpt, args, session)
    return args, session, model, optimizer, functools.partial(head.linear_cross_entropy, z_loss=args.z_loss)


def train_steps(flags, clock, steps, warm=2):
    """Build train.py's run from its flags and take steps with its own train_step: the first
    (compiling), `warm` more (reduce-overhead records its CUDA graphs in these), `steps` timed
    (tokens/s counts every micro-step's):
    {"first s", "tok/s", "peak GiB", "graphs", "recompiles", "cudagraph skips"}."""
    import train
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    args, session, model, optimizer, loss_fn = build_run(flags)
    xs, ys = train.to_device(train.train_batch(None, args, 0, 0), session.device)

    def step():
        train.train_step(model, optimizer, xs, ys, args, session, loss_fn)
    clock.sync()
    start = time.perf_counter()
    step()
    clock.sync()
    first, graphs = time.perf_counter() - start, counters["stats"]["unique_graphs"]
    for _ in range(warm):
        step()
    clock.reset_peak()
    clock.sync()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    clock.sync()
    seconds = time.perf_counter() - start
    tokens = steps * args.grad_accum * args.batch_size * args.seq_len
    return {"first s": first, "tok/s": tokens / seconds,
            "peak GiB": clock.peak_bytes() / 2**30, "graphs": graphs,
            "recompiles": counters["stats"]["unique_graphs"] - graphs,
            "cudagraph skips": counters["inductor"]["cudagraph_skips"]}


def measured(what, fn, *args):
    """fn(*args), or a one-line reason in its place: one failure must not cost the run the rest."""
    try:
        return fn(*args)
    except torch.OutOfMemoryError:
        return "out of memory"
    except SystemExit as e:                 # train.py's die(): its message
        return f"train.py refused: {e}"
    except Exception as e:                  # noqa: BLE001 -- reported in the table, not raised
        first = str(e).splitlines()[0][:120] if str(e) else ""
        return f"{what} failed: {type(e).__name__}: {first}"
    finally:
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def print_step(preset, config, r, fake=False):
    if isinstance(r, str):
        print(f"   {preset:7} {config:15} {r}")
    else:
        print(f"   {preset:7} {config:15} {r['first s']:8.1f} {r['tok/s']:9.0f}"
              f"{mark('tok/s', config, fake):1} {r['peak GiB']:8.2f} {r['graphs']:6} "
              f"{r['recompiles']:10} {r['cudagraph skips']:15}")


# %% 4. Numbers under CUDA graphs: a captured step against the eager one, the fused chain replayed

NUMBERS_STEPS = 3      # steps compared: reduce-overhead warms up and records in the first, replays after
NUMBERS_FRACTION = 0.1  # a captured step's gradients err by at most this x the difference between two
                        # batches' own (eager) gradients: a replay that reads a stale input errs by ~1x
LOSS_TOLERANCE = 1e-2   # relative, of a loss (bf16 logits: 8 bits; at lr 0 two batches' losses differ
                        # by less than this, so the gradients are the stale-input test)


def flat_grads(model):
    """Every gradient of `model`, one float64 vector (parameters in their order; one with none, zeros:
    a captured step holds zeroed buffers where an eager one holds none)."""
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).double().flatten()
                      for p in model.parameters()])


def recorded_step(run, xs, ys):
    """train.train_step on `run` (build_run's), with the gradients its optimizer steps with (after
    clipping; train_step drops them after): (loss, flat gradient vector)."""
    import train
    args, session, model, optimizer, loss_fn = run
    seen = []
    hook = optimizer.register_step_pre_hook(lambda *_: seen.append(flat_grads(model)))
    try:
        loss = train.train_step(model, optimizer, xs, ys, args, session, loss_fn)
    finally:
        hook.remove()
    return loss.item(), seen[0]


def captured_numbers(shape):
    """train.py's captured step with gradient accumulation (captured+accum: reduce-overhead, 4
    micro-steps) against the same step eager (fused), from the same weights, at lr 0 so that every
    step compares: NUMBERS_STEPS steps on new batches, then an evaluation of 3 batches (eval mode:
    graphs of their own, recorded and replayed). {"loss err", "grad err", "eval err", "batch diff",
    "cudagraph skips", "ok"}: the largest relative errors; batch diff, how far two batches' eager
    gradients lie apart, the scale a stale input would err by; ok, the gradients within
    NUMBERS_FRACTION of it, the losses within LOSS_TOLERANCE and no CUDA graph skipped."""
    import train
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    flags = [*step_config(shape, "captured+accum"), "--eval_batches", "3"]
    eager = build_run([f for f in flags if f not in ("--compile", "--compile_mode", "reduce-overhead")])
    captured = build_run(flags)
    unwrapped = [getattr(run[2], "_orig_mod", run[2]) for run in (eager, captured)]  # torch.compile's
    unwrapped[1].load_state_dict(unwrapped[0].state_dict())  # the same weights, whatever the seeding
    for run in (eager, captured):
        for group in run[3].param_groups:
            group["lr"] = 0.0                                # AdamW's decay is lr x wd: none either
    args, session = eager[0], eager[1]
    loss_err = grad_err = 0.0
    grads = []
    for step in range(NUMBERS_STEPS):
        xs, ys = train.to_device(train.train_batch(None, args, step, 0), session.device)
        (loss_e, grad_e), (loss_c, grad_c) = (recorded_step(run, xs, ys) for run in (eager, captured))
        loss_err = max(loss_err, abs(loss_c - loss_e) / abs(loss_e))
        grad_err = max(grad_err, relative_error(grad_c, grad_e))
        grads.append(grad_e)
    batch_diff = min(relative_error(a, b) for a, b in zip(grads[1:], grads))
    evaluated = [train.evaluate(run[2], None, run[0], 0, 1, session.device, session.autocast)[0]
                 for run in (eager, captured)]
    eval_err = abs(evaluated[1] - evaluated[0]) / abs(evaluated[0])
    r = {"loss err": loss_err, "grad err": grad_err, "eval err": eval_err, "batch diff": batch_diff,
         "cudagraph skips": counters["inductor"]["cudagraph_skips"]}
    return {**r, "ok": numbers_ok(r)}


def numbers_ok(r):
    """Whether captured_numbers' errors `r` pass: the gradients within NUMBERS_FRACTION of two
    batches' distance, the losses (the steps' and the evaluation's) within LOSS_TOLERANCE, no CUDA
    graph skipped (inductor ran a graph eagerly: the capture went unchecked)."""
    return (r["grad err"] <= NUMBERS_FRACTION * r["batch diff"]
            and max(r["loss err"], r["eval err"]) <= LOSS_TOLERANCE and r["cudagraph skips"] == 0)


class Replay:
    """`fn` captured once and replayed: a torch.cuda.graph on a GPU (after warm-up calls on a side
    stream, which compile and bind its kernels); elsewhere a stand-in that calls `fn` at each
    replay, so that everything up to the capture runs on a CPU."""

    def __init__(self, fn, device):
        if device != "cuda":
            self.replay = fn
            return
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            fn()
        self.replay = self.graph.replay


def replayed_chain(shape, device, inputs=2):
    """The fused chain (bench_kernel's fused_network over PARITY's sites; bf16 sources, sublayers
    tanh(h * w), elementwise: no library kernel that may pick another algorithm under capture),
    forward and backward, captured once and replayed on `inputs` new sets of inputs and output
    gradient, each against the same chain run eagerly on them: {"replays", "bitwise", "max diff",
    "ok"} (bitwise, ok: every output and gradient equal bit for bit; max diff: the largest absolute
    difference)."""
    sites, B, T, d, heads = shape
    gen = torch.Generator().manual_seed(1)

    def draw():  # (s0, qs, gs, w, dout) of one set of inputs, on the CPU's generator
        return (torch.randn(B, T, d, generator=gen).bfloat16(),
                0.5 * torch.randn(sites, d, generator=gen), 1 + 0.1 * torch.randn(sites, d, generator=gen),
                (1 + 0.5 * torch.randn(d, generator=gen)).bfloat16(),
                torch.randn(B, T, d, generator=gen).bfloat16())

    def leaves(s0, qs, gs, w, dout):
        return ([t.to(device).requires_grad_() for t in (s0, *qs, *gs)],
                w.to(device), dout.to(device))

    network = fused_network(0)

    def forward_backward(held, tensors, w, dout):
        for leaf in tensors:
            leaf.grad = None       # on a GPU the capture allocates them: each replay writes them anew
        s0, qs, gs = tensors[0], tensors[1:1 + sites], tensors[1 + sites:]
        held["out"] = network(s0, qs, gs, heads, lambda h: torch.tanh(h * w))
        held["out"].backward(dout)

    def results(held, tensors):
        return [held["out"], tensors[0].grad, torch.stack([t.grad for t in tensors[1:]])]

    static, w, dout = leaves(*draw())
    held = {}
    graph = Replay(lambda: forward_backward(held, static, w, dout), device)
    bitwise, most = True, 0.0
    for _ in range(inputs):
        fresh = draw()
        with torch.no_grad():
            for leaf, value in zip(static, (fresh[0], *fresh[1], *fresh[2])):
                leaf.copy_(value)
            w.copy_(fresh[3])
            dout.copy_(fresh[4])
        graph.replay()
        replayed = [t.detach().clone() for t in results(held, static)]
        tensors, w_e, dout_e = leaves(*fresh)
        eager = {}
        forward_backward(eager, tensors, w_e, dout_e)
        for a, b in zip(replayed, results(eager, tensors)):
            bitwise &= torch.equal(a, b)
            most = max(most, (a.double() - b.double()).abs().max().item())
    return {"replays": inputs, "bitwise": bitwise, "max diff": most, "ok": bitwise}


def numbers_line(row, r):
    """The printed line of a numbers row (its result `r`, or why there is none)."""
    name = ("4. CUDA graphs: the fused chain replayed" if row == "replay" else
            f"4. CUDA graphs: {row.split()[1]}'s captured+accum step against eager (lr 0)")
    if isinstance(r, str):
        return f"{name}: {r}"
    if row == "replay":
        return (f"{name} on {r['replays']} new inputs: "
                + ("bit for bit as eager" if r["bitwise"] else f"NOT bitwise: max |diff| {r['max diff']:.1e}"))
    return (f"{name}: relative errors: loss {r['loss err']:.1e}, gradients {r['grad err']:.1e} (two "
            f"batches' lie {r['batch diff']:.1e} apart), evaluation {r['eval err']:.1e}; "
            f"{r['cudagraph skips']} CUDA graph skips: {'ok' if r['ok'] else 'FAILED'}")


def numbers_verdict(results):
    """The numbers rows' verdict: "CUDA graphs: as eager (...)", "CUDA graphs FAILED: ...", or "CUDA
    graphs: not run (...)"; None where the plan has none."""
    rows = {row: r for row, r in results.items() if is_numbers(row)}
    if not rows:
        return None
    failed = [row for row, r in rows.items() if isinstance(r, dict) and not r["ok"]
              or isinstance(r, str) and not r.startswith(("skipped", "stopped"))]
    not_run = [row for row, r in rows.items() if isinstance(r, str) and row not in failed]
    if failed:
        return f"CUDA graphs FAILED: {', '.join(failed)}"
    return (f"CUDA graphs: not run ({', '.join(not_run)})" if not_run else
            f"CUDA graphs: as eager ({', '.join(rows)})")


# %% A part: its rows measured in a process of its own (python -m scripts.gpu_check --part ROW... --json F)

def step_header(steps, warm):
    print(f"3. train.py's step: the first, {warm} more, {steps} timed; recompiles after the first")
    print(f"   {'shape':7} {'config':15} {'first s':>8} {'tok/s':>10} {'peak GiB':>8} {'graphs':>6} "
          f"{'recompiles':>10} {'cudagraph skips':>15}")


# (parity shape, timed steps, warm-up steps, profiled calls) of each mode
SIZES = {"full": (PARITY["gpu"], 5, 2, 5), "quick": (PARITY["gpu"], 1, 2, 5),
         "tiny": (PARITY["tiny"], 1, 0, 1)}


def measure_part(rows, path, mode):
    """The child's work: each row measured in turn ("parity", "routing SHAPE", "SHAPE CONFIG"),
    printed, and the results so far written to `path` as JSON after each, so that a kill loses only
    the row under way."""
    on_gpu = mode != "tiny" and torch.cuda.is_available() and not kernel.INTERPRETED
    clock, device = (CudaClock(), "cuda") if on_gpu else (FakeClock(), "cpu")
    shape, steps, warm, reps = SIZES[mode]
    torch.manual_seed(0)
    results = {}
    with compile_backend("inductor" if on_gpu else "aot_eager"):
        for row in rows:
            what, _, config = row.partition(" ")
            if what == "parity":
                results[row] = measured("parity", parity, shape, device,
                                        "inductor" if on_gpu else "aot_eager")
            elif what == "replay":
                results[row] = measured("replay", replayed_chain, shape, device)
            elif what == "numbers":
                results[row] = measured("numbers", captured_numbers, config)
            elif what == "routing":
                if not any(r.startswith("routing") for r in results):
                    print_routing_header(clock)
                results[row] = measured("routing", routing, ROUTES[config], clock, device, reps,
                                        max(warm, 1))
            else:
                results[row] = measured(f"{config} step", train_steps, step_config(what, config),
                                        clock, steps, warm)
            with open(f"{path}.part", "w") as f:
                json.dump(results, f)
            os.replace(f"{path}.part", path)  # whole, even if a kill comes as the row is printed
            print_row(row, results[row], clock.fake)


def is_step(row):
    return " " in row and not row.startswith(("routing ", "numbers "))


def is_numbers(row):
    """A row of the numbers under CUDA graphs: the replayed chain, or a captured step's."""
    return row == "replay" or row.startswith("numbers ")


def timeout_factor(rows):
    """COLD_FACTOR for a part with a row that compiles (parity, the routing's Triton kernels, a step
    with --compile), else TIMEOUT_FACTOR."""
    compiles = any(not is_step(r) or "--compile" in CONFIGS[r.partition(" ")[2]] for r in rows)
    return COLD_FACTOR if compiles else TIMEOUT_FACTOR


def print_row(row, result, fake):
    what, _, config = row.partition(" ")
    if what == "parity":
        print_parity(result, PARITY["tiny" if fake else "gpu"]) if isinstance(result, list) else \
            print(f"2. parity: {result}")
    elif what == "routing":
        print_routing(config, result, fake)
    elif is_numbers(row):
        print(numbers_line(row, result))
    else:
        print_step(what, config, result, fake)


def part_command(rows, mode, path):
    """The command line of a part's process."""
    return [sys.executable, "-m", "scripts.gpu_check", "--part", *rows, "--json", str(path),
            *([f"--{mode}"] if mode != "full" else [])]


STOPS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}  # what stops the check (stop_signals)


def run_process(command, timeout):
    """Run `command` in a session of its own, relaying its output line by line; kill it and its own
    processes (inductor's compile workers) after `timeout` seconds, or at a stop signal. Returns (its
    exit status, None if killed at the timeout; the last line it wrote on stderr)."""
    # a stop signal handled while Popen starts the process would leave it running: held until the
    # try whose finally kills it (the part's process lets them through again: main)
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, STOPS)
    try:
        process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True, start_new_session=True)
    except BaseException:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        raise
    last = [""]

    def relay(stream, to_stderr):
        for line in stream:
            print(line, end="", file=sys.stderr if to_stderr else sys.stdout, flush=True)
            last[0] = line.strip() if to_stderr and line.strip() else last[0]
    relays = [threading.Thread(target=relay, args=(process.stdout, False), daemon=True),
              threading.Thread(target=relay, args=(process.stderr, True), daemon=True)]
    try:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)      # a signal held meanwhile comes here
        for thread in relays:
            thread.start()
        status = process.wait(timeout)
    except subprocess.TimeoutExpired:
        status = None
    finally:  # also on Ctrl-C, SIGTERM, SIGHUP: no process of the check outlives it
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        for thread in relays:
            if thread.ident is not None:  # started
                thread.join(5)
    return status, last[0]


def run_part(rows, mode, timeout, path):
    """{row: result} of one part, run in a process of its own: a row it did not write says why (timed
    out, or crashed with its last line of error), printed as the part's own rows are."""
    status, last = run_process(part_command(rows, mode, path), timeout)
    results = json.loads(path.read_text()) if path.exists() else {}
    if status is None:
        why = f"timed out after {timeout:.0f} s"
    else:
        how = f"killed by {signal.Signals(-status).name}" if status < 0 else f"exit status {status}"
        why = f"crashed: {how}" + (f": {last[:160]}" if last else "")
    for row in rows:
        if row not in results:
            results[row] = why
            print_row(row, why, mode == "tiny")
    return results


# %% The run and its table

class Stopped(KeyboardInterrupt):
    """SIGTERM (`timeout`, `kill`) or SIGHUP (the terminal closed), raised where Ctrl-C raises its
    KeyboardInterrupt, so that each stops the check as Ctrl-C does; `signum`: its number."""

    def __init__(self, signum):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def stop_name(stop):
    """What stopped the check, from its KeyboardInterrupt: "Ctrl-C", "SIGTERM", "SIGHUP"."""
    signum = getattr(stop, "signum", signal.SIGINT)
    return "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name


@contextlib.contextmanager
def stop_signals():
    """Ctrl-C, SIGTERM and SIGHUP inside the block stop the check alike: the first raises Stopped,
    where run_process kills the part under way (its process group: nothing of the check outlives
    it) and run_check writes what finished; later ones are ignored meanwhile. A signal ignored
    already (nohup's SIGHUP, SIGINT under `cmd &`) stays ignored."""
    def stop(signum, frame):
        for s in previous:
            signal.signal(s, signal.SIG_IGN)
        raise Stopped(signum)
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
                if signal.getsignal(s) != signal.SIG_IGN}
    for s in previous:
        signal.signal(s, stop)
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


class Budget:
    """Seconds since `start`; whether a part expected to take `seconds` still fits, and the hard
    timeout it gets: `factor` (TIMEOUT_FACTOR, or COLD_FACTOR for a part that compiles) x its
    seconds, never past the budget."""

    def __init__(self, seconds, enforce, start=None):
        self.seconds, self.enforce = seconds, enforce
        self.start = time.perf_counter() if start is None else start

    def elapsed(self):
        return time.perf_counter() - self.start

    def fits(self, seconds):
        return not self.enforce or self.elapsed() + seconds <= self.seconds

    def timeout(self, seconds, factor=TIMEOUT_FACTOR):
        if not self.enforce:
            return TINY_TIMEOUT_S
        return max(0.0, min(factor * seconds, self.seconds - self.elapsed()))


def versions():
    import triton
    device = (torch.cuda.get_device_name() if torch.cuda.is_available()
              else "no GPU (CPU, interpreter)")
    return {"device": device, "torch": torch.__version__, "triton": triton.__version__,
            "python": sys.version.split()[0], "date": str(datetime.date.today())}


def describe(v):
    return f"{v['device']}, torch {v['torch']}, triton {v['triton']}, Python {v['python']}, {v['date']}"


TABLE_COLUMNS = ("shape", "config", "first s", "tok/s", "x base", "peak GiB", "graphs",
                 "recompiles", "route ms", "kernel ms", "host ms", "% copy")
STEP_COLUMNS, ROUTING_COLUMNS = TABLE_COLUMNS[2:4] + TABLE_COLUMNS[5:8], TABLE_COLUMNS[8:]


def table(parity_rows, routed, stepped):
    """The check's rows, each a dict of TABLE_COLUMNS (absent values empty): per shape, a row per
    step configuration (in CONFIGS' order), the routing's measures on the fused row (on a row of
    their own at a shape with no steps); the parity's verdict last. parity_rows: a list, or why
    there is none."""
    rows = []
    shapes = list(dict.fromkeys([p for p, _ in stepped] + list(routed)))
    for preset in shapes:
        base = stepped.get((preset, "baseline"))
        configs = [c for c in CONFIGS if (preset, c) in stepped] or ["routing"]
        for config in configs:
            row = {"shape": preset, "config": config}
            r = stepped.get((preset, config))
            if isinstance(r, dict):
                row.update({k: r[k] for k in STEP_COLUMNS})
                if isinstance(base, dict):
                    row["x base"] = r["tok/s"] / base["tok/s"]
                if r["cudagraph skips"]:
                    row["note"] = f"inductor skipped CUDA graphs {r['cudagraph skips']} times"
            elif r is not None:
                row["note"] = r
            if config in ("fused", "routing") and preset in routed:
                if isinstance(routed[preset], dict):
                    row.update({k: routed[preset][k] for k in ROUTING_COLUMNS})
                else:
                    row["note"] = routed[preset]
            rows.append(row)
    if isinstance(parity_rows, str):
        not_run = parity_rows.startswith(("skipped", "stopped"))
        return rows, f"parity {'not run' if not_run else 'FAILED'}: {parity_rows}"
    failed = [f"{dtype} {name}" for dtype, name, _, ok in parity_rows if not ok]
    verdict = ("parity: every path within its tolerance" if parity_rows and not failed
               else f"parity FAILED: {', '.join(failed)}" if failed else "parity: not run")
    return rows, verdict


def cells(rows, fake):
    """Each row's printed cells, marked."""
    return [[cell(row[column], column) + mark(column, row["config"], fake) if column in row else ""
             for column in TABLE_COLUMNS] for row in rows]


def print_table(rows, verdict, fake, heading, elapsed):
    print(f"\nThe GPU check: {heading}" + (" -- no GPU: kernel times and bandwidth FAKE, the "
                                          "rest this CPU's" if fake else ""))
    printed = cells(rows, fake)
    widths = [max(len(c), *(len(r[i]) for r in printed)) for i, c in enumerate(TABLE_COLUMNS)]
    print(" ".join(f"{c:>{w}}" for c, w in zip(TABLE_COLUMNS, widths)))
    for row, line in zip(rows, printed):
        print((" ".join(f"{c:>{w}}" for c, w in zip(line, widths))
               + (f"  ({row['note']})" if "note" in row else "")).rstrip())
    if fake:
        print(FOOTNOTE.strip())
    print(f"{verdict}; {elapsed:.0f} s in all")


def cell(value, column):
    if isinstance(value, float):
        return f"{value:.0f}" if column == "tok/s" or value >= 100 else f"{value:.2f}"
    return str(value)


def write_table(out, mode, found, fake, heading, elapsed):
    """The table as <mode>.md and <mode>.json in the folder `out`: their paths."""
    rows, verdict = found["rows"], found["verdict"]
    columns = (*TABLE_COLUMNS, "note")
    lines = [f"# The GPU check ({mode}): {heading}", "",
             "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row, line in zip(rows, cells(rows, fake)):
        lines.append("| " + " | ".join([*line, row.get("note", "")]) + " |")
    if isinstance(found["parity"], list) and found["parity"]:
        lines += ["", "| parity dtype | path | out | ds0 | dq | dg | ok |", "|---|---|---|---|---|---|---|"]
        lines += [f"| {d} | {name} | " + " | ".join(f"{x:.1e}" for x in e) + f" | {'yes' if ok else 'NO'} |"
                  for d, name, e, ok in found["parity"]]
    lines += ["", *(numbers_line(row, r) for row, r in found["numbers"].items())] if found["numbers"] else []
    lines += ["", *([FOOTNOTE.strip(), ""] if fake else []), f"{verdict}; {elapsed:.0f} s in all", ""]
    md, js = out / f"{mode}.md", out / f"{mode}.json"
    write_text(md, "\n".join(lines), then="the table is printed above")  # each whole, or not there
    write_text(js, json.dumps({"mode": mode, "fake": fake, "elapsed s": round(elapsed, 1), **found},
                              indent=1) + "\n", then="the table is printed above")
    return md, js


def run_check(mode="full", budget=None, out=Path("out/gpu_check"), start=None):
    """The whole check, each part in a process of its own; prints it, writes its table to `out`,
    returns (table rows, the parity's verdict). tiny: --tiny's shapes, clock and backend, so that
    the suite runs it on a CPU (where no budget is enforced). start: when the budget's clock
    started (perf_counter; default now)."""
    budget = BUDGET_S.get(mode, 0.0) if budget is None else budget
    time_left = Budget(budget, enforce=mode != "tiny", start=start)
    v = versions()
    fake = mode == "tiny"
    print(f"GPU check ({mode}): {describe(v)}; "
          + ("no budget on a CPU" if fake else f"budget {budget:.0f} s"), flush=True)
    results, stopped, rows, path = {}, None, [], None
    with tempfile.TemporaryDirectory() as folder:
        try:
            for i, rows in enumerate(PLANS[mode]):
                if is_step(rows[0]) and not any(map(is_step, results)):
                    _, steps, warm, _ = SIZES[mode]
                    step_header(steps, warm)
                expected = START_S + sum(EXPECTED_S.get(r, 0) for r in rows)
                if not time_left.fits(expected):
                    for row in rows:
                        results[row] = "skipped: over the budget"
                        print_row(row, results[row], fake)
                    continue
                path = Path(folder) / f"part{i}.json"
                results.update(run_part(rows, mode, time_left.timeout(expected, timeout_factor(rows)),
                                        path))
                print(f"   ({time_left.elapsed():.0f} s so far)", flush=True)
        except KeyboardInterrupt as e:  # Ctrl-C, SIGTERM, SIGHUP: run_process killed the part under way
            stopped = e
            finished = json.loads(path.read_text()) if path is not None and path.exists() else {}
            for row in (r for r in rows if r not in results):
                results[row] = finished.get(row, f"stopped by {stop_name(e)}")
                if row not in finished:  # (the part printed those)
                    print_row(row, results[row], fake)
    if fake:
        print(FOOTNOTE)
    routed = {r.split()[1]: x for r, x in results.items() if r.startswith("routing ")}
    stepped = {tuple(r.split()): x for r, x in results.items() if is_step(r)}
    rows, verdict = table(results.get("parity", []), routed, stepped)
    numbers = {row: results.get(row, "stopped before it ran") for rows in PLANS[mode] for row in rows
               if is_numbers(row)}
    verdict = "; ".join(filter(None, [verdict, numbers_verdict(numbers)]))
    elapsed = time_left.elapsed()
    print_table(rows, verdict, fake, describe(v), elapsed)
    found = {**v, "budget s": budget, "verdict": verdict, "rows": rows,
             "parity": results.get("parity", []), "numbers": numbers}
    for path in write_table(out, mode, found, fake, describe(v), elapsed):
        print(f"written: {path}")
    if stopped is not None:
        raise stopped
    return rows, verdict


def plan(mode="full", budget=None):
    """[(rows, expected s, hard timeout s or None if skipped)] of each part, in the order the check
    runs them on a GPU, as Budget decides with every part taking its expected seconds (its
    process's start included), and the expected seconds in all (the check's own start included)."""
    budget = BUDGET_S[mode] if budget is None else budget
    parts, spent = [], EXPECTED_S["start"]
    for rows in PLANS[mode]:
        expected = START_S + sum(EXPECTED_S[r] for r in rows)
        runs = spent + expected <= budget
        parts.append((rows, expected,
                      min(timeout_factor(rows) * expected, budget - spent) if runs else None))
        spent += expected if runs else 0
    return parts, spent


def print_plan(mode, budget):
    parts, total = plan(mode, budget)
    budget = BUDGET_S[mode] if budget is None else budget
    print(f"gpu_check.py{' --quick' if mode == 'quick' else ''}: expected seconds on one H200 "
          f"(docs/kernels.md, GPU check), each part in a process of its own ({START_S} s to start "
          f"it); budget {budget:.0f} s")
    print(f"   {'part':52} {'expected':>8} {'timeout':>8}")
    print(f"   {'start (imports, CUDA)':52} {EXPECTED_S['start']:8}")
    for rows, seconds, timeout in parts:
        print(f"   {', '.join(rows):52} {seconds:8} "
              + (f"{timeout:8.0f}" if timeout is not None else "    skipped: over the budget"))
    print(f"   {'in all':52} {total:8}  ({total / 60:.1f} min)")


def budget_seconds(text):
    """--budget's type: AMOUNT (a finite number >= 0), refusing inf as a finite number of seconds
    (AMOUNT's own words, "must be >= 0, not inf", would be untrue)."""
    try:
        return AMOUNT(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds >= 0, not {text}") from None


def writable(out):
    """Make the folder `out` and write a file into it (removed): a read-only folder or a full disk
    ends the check in one line before its parts run, not after. MachineError if not."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise MachineError(f"cannot make --out {out} ({e.strerror}): give a folder you can write "
                           f"to") from None
    probe = out / ".gpu_check-probe"
    write_text(probe, "gpu_check.py: does this folder take files?\n",
               then="free some space or give another --out")
    probe.unlink()


def main(argv=None):
    p = FlagParser(prog="gpu_check.py", description=__doc__.split("\n\n")[0].strip())
    p.add_argument("--tiny", action="store_true",
                   help="tiny shapes, the interpreter, aot_eager, fake GPU timings (any machine)")
    p.add_argument("--quick", action="store_true",
                   help="the fewest parts: parity, 100m's eager steps, the compiled modes at 4 "
                        "layers, 1 timed step (under 2 min)")
    p.add_argument("--plan", action="store_true",
                   help="print each part's expected seconds on an H200, its timeout, the total")
    p.add_argument("--budget", type=budget_seconds, default=None,
                   help="seconds from the start: start no part expected to end past them, kill "
                        "any at them (default 240, --quick 140)")
    p.add_argument("--out", type=Path, default=Path("out/gpu_check"),
                   help="folder for the table, <mode>.md and <mode>.json (default out/gpu_check)")
    p.add_argument("--part", nargs="+", metavar="ROW", help=argparse.SUPPRESS)
    p.add_argument("--json", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    mode = "tiny" if args.tiny else "quick" if args.quick else "full"
    if args.tiny and (args.quick or args.plan):
        p.error("--tiny runs tiny shapes on any machine: it takes neither --quick nor --plan")
    if args.part:
        if not args.json:
            p.error("--part writes its rows to --json FILE")
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOPS)  # held by the parent while it started this
        measure_part(args.part, args.json, mode)
        return 0
    if args.plan:
        print_plan(mode, args.budget)
        return 0
    try:
        output_folder(args.out, "--out")
    except UserError as e:  # the folder, or one it would be made in, is a file
        exit_error("gpu_check.py", str(e))
    if not args.tiny and not torch.cuda.is_available():
        exit_error("gpu_check.py", "no CUDA GPU here: the check measures one; --tiny runs its "
                                   "code at tiny shapes, --plan prints its expected times")
    stopped = None
    try:
        writable(args.out)
        with stop_signals():
            try:
                _, verdict = run_check(mode, args.budget, args.out, STARTED)
            except KeyboardInterrupt as e:  # run_process killed the part under way
                stopped = e
    except MachineError as e:  # a read-only folder, a full disk: nothing half-written
        exit_error("gpu_check.py", str(e), status=1)
    if stopped is not None:  # outside stop_signals: exit_error ignores any further signal
        name = stop_name(stopped)
        how = "interrupted (Ctrl-C)" if name == "Ctrl-C" else f"stopped by {name}"
        exit_error("gpu_check.py", f"{how}: what finished is printed above and written to {args.out}",
                   status=128 + getattr(stopped, "signum", signal.SIGINT))
    return 1 if "FAILED" in verdict else 0


if __name__ == "__main__":
    sys.stdout.reconfigure(line_buffering=True)  # every line out as it is printed
    sys.exit(main())
