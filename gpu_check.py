"""
The GPU check: one run, at most five minutes on one H200, that answers what a first GPU is for,
on the machine's own packages (the repository copied, nothing installed).

    python gpu_check.py                # on a CUDA GPU: the whole check, about 4 min on an H200
    python gpu_check.py --budget 200   # start no part expected to end past 200 s (default 270)
    python gpu_check.py --plan         # the parts' expected seconds on an H200, and what the
                                       # budget leaves out (no GPU needed)
    python gpu_check.py --tiny         # the same code at tiny shapes on this machine: kernels in
                                       # Triton's interpreter, compiled configurations traced with
                                       # aot_eager, the GPU's timings faked (the suite runs it)

It prints, as it goes:
  1. parity: the readable path, the fused kernels, and the fused kernels under torch.compile
     (what --compile --fused runs), in fp32 and bf16, each against the readable path in float64:
     relative errors of the output, ds0, dq, dg; fp32 within 1e-4, bf16 within 2x the readable
     bf16 path's (a wrong kernel errs by O(1); tests/test_kernel.py holds the fine bound);
  2. routing, at each shape of bench_kernel.KERNEL_TABLE (100m, 350m, 1b): all 2L+1 sites forward
     and backward, fused, automatic G, bf16 sources: the GPU's time in the routing kernels and in
     every kernel, from torch.profiler, the host's time to issue it all, and the bandwidth: the
     traffic model's bytes over the kernel time, against the device's measured copy bandwidth;
  3. train.py's own step (train.train_step: synthetic tokens, the chunked head, AdamW, bf16
     autocast, the preset's micro-batch, one micro-step per step) at 100m and 350m, for baseline,
     readable MHAR, fused, compiled + fused, captured (--compile --fused --compile_mode
     reduce-overhead) and compiled (readable MHAR): the first step's seconds (compiling), tokens/s
     over 5 steps after 2 more, peak memory, dynamo's graphs, the recompiles after the first step
     and inductor's CUDA-graph skips;
then one table of it all, headed by the device, the versions and the date. Each part's expected
time (EXPECTED_S) is what --budget weighs: a part that would end past it is skipped, and its row
says so; the table comes regardless.
"""
import contextlib
import datetime
import functools
import gc
import io
import os
import statistics
import sys
import time

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
    from bench_kernel import (HEADS, KERNEL_TABLE, auto_group, fused_network,
                              rounded_to_nearest, stacked_network, traffic)
    from common import AMOUNT, FlagParser, exit_error
except KeyboardInterrupt:
    print("gpu_check.py: error: interrupted (Ctrl-C)", file=sys.stderr)
    raise SystemExit(130)

# (sites, B, T, d, H) of the parity chain: on a GPU the 100m depth and width, whose bf16 kernels
# (G = 5) the routing and the 100m steps then find compiled; --tiny's
PARITY = {"gpu": (25, 2, 64, 512, 8), "tiny": (5, 1, 4, 40, 4)}
TINY_ROUTING = [("tiny", 64, 2, 1, 4)]                     # (preset, d, L, B, T), as KERNEL_TABLE
STEP_PRESETS = {"gpu": ("100m", "350m"), "tiny": ("tiny",)}
TINY_FLAGS = ["--n_layer", "1", "--seq_len", "8", "--batch_size", "1", "--vocab_size", "256",
              "--device", "cpu"]
CONFIGS = {  # name: train.py's flags beyond --preset P --data synthetic --grad_accum 1, in the
    "baseline": ["--residual", "baseline"],          # order they run: the budget drops the last
    "readable": [],                                  # first (the compiled readable model: the
    "fused": ["--fused"],                            # kernels' speed question is the others')
    "compiled+fused": ["--compile", "--fused"],
    "captured": ["--compile", "--fused", "--compile_mode", "reduce-overhead"],
    "compiled": ["--compile"],
}
FP32_TOLERANCE = 1e-4      # relative, along a chain of sites (bench_kernel._check's)
BF16_SLACK = 2             # a bf16 path's errors at most this x the readable bf16 path's
# Expected seconds of each part on one H200 (docs/kernels.md, "GPU check", says how each was
# estimated); --budget skips a part whose expected end is past it. The budget counts from after
# the imports ("start").
EXPECTED_S = {"start": 10, "parity": 22,
              ("routing", "100m"): 3, ("routing", "350m"): 6, ("routing", "1b"): 8,
              **{("100m", c): s for c, s in zip(CONFIGS, (2, 2, 3, 22, 17, 35))},
              **{("350m", c): s for c, s in zip(CONFIGS, (3, 3, 4, 57, 44, 71))}}


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
        from common import peak_memory
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


# %% 1. Parity: readable, fused, compiled, against float64

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
    print(f"1. parity: {sites} sites, B·T = {B * T}, d = {d}, H = {heads}; relative error against "
          f"the readable path in float64 (fp32: at most {FP32_TOLERANCE:g}; bf16: at most "
          f"{BF16_SLACK}x the readable bf16 path's)")
    print(f"   {'dtype':8} {'path':15} {'out':>8} {'ds0':>8} {'dq':>8} {'dg':>8}  ok")
    for dtype, name, e, ok in rows:
        print(f"   {dtype:8} {name:15} " + " ".join(f"{x:8.1e}" for x in e)
              + f"  {'yes' if ok else 'NO'}")


# %% 2. Routing: the fused path's kernel time, host time and bandwidth per shape

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


def print_routing(results, clock):
    print(f"2. routing: all 2L+1 sites forward + backward, fused, automatic G, bf16; copy "
          f"bandwidth {clock.copy_bandwidth() / 1e9:.0f} GB/s" + ("*" if clock.fake else ""))
    print(f"   {'shape':6} {'G':>2} {'route ms':>9} {'kernel ms':>10} {'host ms':>8} {'GB/s':>7} "
          f"{'% copy':>7}")
    for preset, r in results.items():
        if isinstance(r, str):
            print(f"   {preset:6} {r}")
        else:
            m = {column: mark(column, "routing", clock.fake) for column in (*FAKED, "host ms")}
            print(f"   {preset:6} {r['G']:2} {r['route ms']:8.2f}{m['route ms']:1} "
                  f"{r['kernel ms']:9.2f}{m['kernel ms']:1} {r['host ms']:7.2f}{m['host ms']:1} "
                  f"{r['GB/s']:6.0f}{m['GB/s']:1} {r['% copy']:6.0f}{m['% copy']:1}")
    if clock.fake:
        print(FOOTNOTE)


# %% 3. train.py's step

def step_config(preset, config, tiny):
    """train.py's flags of one step configuration."""
    flags = ["--preset", preset, "--data", "synthetic", "--grad_accum", "1", *CONFIGS[config]]
    return flags + (TINY_FLAGS if tiny else [])


def train_steps(flags, clock, steps, warm=2):
    """Build train.py's run from its flags and take steps with its own train_step: the first
    (compiling), `warm` more (reduce-overhead records its CUDA graph in these), `steps` timed:
    {"first s", "tok/s", "peak GiB", "graphs", "recompiles", "cudagraph skips"}."""
    import head
    import parallel
    import train
    from torch._dynamo.utils import counters
    try:
        with contextlib.redirect_stderr(io.StringIO()):     # the row says it, in a line
            args, given = train.parse_args(flags)
    except SystemExit:
        raise RuntimeError(f"this train.py does not take {' '.join(flags)}") from None
    session = parallel.start_session(args)
    args, _, _ = train.resolve_flags(args, given, session.world)
    parallel.set_precision(session, args)
    config = train.model_config(args, {})
    torch._dynamo.reset()
    counters.clear()
    gpt, optimizer, _, _ = train.build_model(args, config, None, None, session)
    model = parallel.wrap_model(gpt, args, session)
    loss_fn = functools.partial(head.linear_cross_entropy, z_loss=args.z_loss)
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
    return {"first s": first, "tok/s": steps * args.batch_size * args.seq_len / seconds,
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
        print(f"   {preset:5} {config:15} {r}")
    else:
        print(f"   {preset:5} {config:15} {r['first s']:8.1f} {r['tok/s']:9.0f}"
              f"{mark('tok/s', config, fake):1} {r['peak GiB']:8.2f} {r['graphs']:6} "
              f"{r['recompiles']:10} {r['cudagraph skips']:15}")


# %% The run and its table

class Budget:
    """Seconds since the start; whether a part expected to take `EXPECTED_S[key]` still fits."""

    def __init__(self, seconds, enforce):
        self.seconds, self.enforce, self.start = seconds, enforce, time.perf_counter()

    def elapsed(self):
        return time.perf_counter() - self.start

    def fits(self, key):
        return not self.enforce or self.elapsed() + EXPECTED_S.get(key, 0) <= self.seconds


def versions():
    import triton
    device = (torch.cuda.get_device_name() if torch.cuda.is_available()
              else "no GPU (CPU, interpreter)")
    return (f"{device}, torch {torch.__version__}, triton {triton.__version__}, Python "
            f"{sys.version.split()[0]}, {datetime.date.today()}")


TABLE_COLUMNS = ("shape", "config", "first s", "tok/s", "x base", "peak GiB", "graphs",
                 "recompiles", "route ms", "kernel ms", "host ms", "% copy")
STEP_COLUMNS, ROUTING_COLUMNS = TABLE_COLUMNS[2:4] + TABLE_COLUMNS[5:8], TABLE_COLUMNS[8:]


def table(parity_rows, routed, stepped):
    """The check's rows, each a dict of TABLE_COLUMNS (absent values empty): per shape, a row per
    step configuration, the routing's measures on the fused row (on a row of their own at a
    shape with no steps); the parity's verdict last."""
    rows = []
    shapes = list(dict.fromkeys([p for p, _ in stepped] + list(routed)))
    for preset in shapes:
        base = stepped.get((preset, "baseline"))
        configs = [c for p, c in stepped if p == preset] or ["routing"]
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
    failed = [f"{dtype} {name}" for dtype, name, _, ok in parity_rows if not ok]
    verdict = ("parity: every path within its tolerance" if parity_rows and not failed
               else f"parity FAILED: {', '.join(failed)}" if failed else "parity: not run")
    return rows, verdict


def print_table(rows, verdict, clock, elapsed):
    print(f"\nThe GPU check: {versions()}" + (" -- no GPU: kernel times and bandwidth FAKE, the "
                                                "rest this CPU's" if clock.fake else ""))
    cells = [[cell(row[column], column) + mark(column, row["config"], clock.fake) if column in row else ""
              for column in TABLE_COLUMNS] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(TABLE_COLUMNS)]
    print(" ".join(f"{c:>{w}}" for c, w in zip(TABLE_COLUMNS, widths)))
    for row, line in zip(rows, cells):
        print((" ".join(f"{c:>{w}}" for c, w in zip(line, widths))
               + (f"  ({row['note']})" if "note" in row else "")).rstrip())
    if clock.fake:
        print(FOOTNOTE.strip())
    print(f"{verdict}; {elapsed:.0f} s in all")


def cell(value, column):
    if isinstance(value, float):
        return f"{value:.0f}" if column == "tok/s" or value >= 100 else f"{value:.2f}"
    return str(value)


# (parity shape, routing shapes, step presets, timed steps, warm-up calls, profiled calls)
SIZES = {"gpu": (PARITY["gpu"], KERNEL_TABLE, STEP_PRESETS["gpu"], 5, 2, 5),
         "tiny": (PARITY["tiny"], TINY_ROUTING, STEP_PRESETS["tiny"], 1, 0, 1)}


def run_check(tiny=False, budget=270.0):
    """The whole check; returns (table rows, the parity's verdict). tiny: --tiny's shapes, clock
    and backend, so that the suite runs it on a CPU (where no budget is enforced)."""
    on_gpu = torch.cuda.is_available() and not kernel.INTERPRETED and not tiny
    clock, device = (CudaClock(), "cuda") if on_gpu else (FakeClock(), "cpu")
    backend = "inductor" if on_gpu else "aot_eager"
    shape, routes, presets, steps, warm, reps = SIZES["gpu" if on_gpu else "tiny"]
    time_left = Budget(budget, enforce=on_gpu)
    print(f"GPU check: {versions()}; budget {budget:.0f} s" + ("" if on_gpu else " (not enforced)"))
    torch.manual_seed(0)
    parity_rows = []
    if time_left.fits("parity"):
        parity_rows = measured("parity", parity, shape, device, backend)
    if isinstance(parity_rows, str):
        print(f"1. {parity_rows}")
        parity_rows = []
    print_parity(parity_rows, shape)
    print(f"   ({time_left.elapsed():.0f} s so far)")
    routed = {route[0]: (measured("routing", routing, route, clock, device, reps, max(warm, 1))
                         if time_left.fits(("routing", route[0])) else "skipped: over the budget")
              for route in routes}
    print_routing(routed, clock)
    print(f"   ({time_left.elapsed():.0f} s so far)")
    print(f"3. train.py's step: the first, {warm} more, {steps} timed; recompiles after the first")
    print(f"   {'shape':5} {'config':15} {'first s':>8} {'tok/s':>10} {'peak GiB':>8} {'graphs':>6} "
          f"{'recompiles':>10} {'cudagraph skips':>15}")
    stepped = {}
    with compile_backend(backend):
        for preset in presets:
            for config in CONFIGS:
                stepped[preset, config] = (
                    measured(f"{config} step", train_steps,
                             step_config(preset, config, not on_gpu), clock, steps, warm)
                    if time_left.fits((preset, config)) else "skipped: over the budget")
                print_step(preset, config, stepped[preset, config], clock.fake)
    if clock.fake:
        print("   " + FOOTNOTE.split("; ")[1])
    rows, verdict = table(parity_rows, routed, stepped)
    print_table(rows, verdict, clock, time_left.elapsed())
    return rows, verdict


def plan(budget=270.0):
    """[(part, expected s, runs)] in the order the check runs them on a GPU, as Budget decides
    with every part taking its EXPECTED_S, and the expected seconds in all (imports included)."""
    parts = ["parity", *(("routing", r[0]) for r in KERNEL_TABLE),
             *((p, c) for p in STEP_PRESETS["gpu"] for c in CONFIGS)]
    rows, spent = [], 0
    for part in parts:
        runs = spent + EXPECTED_S[part] <= budget
        spent += EXPECTED_S[part] if runs else 0
        rows.append((part, EXPECTED_S[part], runs))
    return rows, EXPECTED_S["start"] + spent


def print_plan(budget):
    rows, total = plan(budget)
    print(f"expected seconds on one H200 (docs/kernels.md, GPU check), budget {budget:.0f} s:")
    print(f"   {'start (imports, CUDA)':28} {EXPECTED_S['start']:4}")
    for part, seconds, runs in rows:
        name = part if isinstance(part, str) else " ".join(part)
        print(f"   {name:28} {seconds:4}" + ("" if runs else "  skipped: over the budget"))
    print(f"   {'in all':28} {total:4}  ({total / 60:.1f} min)")


def main(argv=None):
    p = FlagParser(prog="gpu_check.py", description=__doc__.split("\n\n")[0].strip())
    p.add_argument("--tiny", action="store_true",
                   help="tiny shapes, the interpreter, aot_eager, fake GPU timings (any machine)")
    p.add_argument("--plan", action="store_true",
                   help="print each part's expected seconds on an H200 and what the budget skips")
    p.add_argument("--budget", type=AMOUNT, default=270.0,
                   help="seconds after the imports: start no part expected to end past them "
                        "(default 270)")
    args = p.parse_args(argv)
    if args.plan:
        print_plan(args.budget)
        return 0
    if not args.tiny and not torch.cuda.is_available():
        exit_error("gpu_check.py", "no CUDA GPU here: the check measures one; --tiny runs its "
                                   "code at tiny shapes, --plan prints its expected times")
    try:
        _, verdict = run_check(args.tiny, args.budget)
    except KeyboardInterrupt:  # measured() lets it through: one part's failure, not a stop
        exit_error("gpu_check.py", "interrupted (Ctrl-C): no table; what finished is printed above",
                   status=130)
    return 1 if "FAILED" in verdict else 0


if __name__ == "__main__":
    sys.exit(main())
