"""Does the eager training step keep a GPU busy? Its host time against its device time, per preset.

    python -m scripts.bench_step                       # every preset, micro-batches 1 to 32 sequences
    python -m scripts.bench_step --preset 100m --micro_batches 4,16

Each row is one micro-step (forward and backward, the loss through the chunked head) of a preset:
- host ms: the aten ops it dispatches × the host's time per op, both measured here: the preset's
  depth at a tiny width (d 64, 16 positions, CPU tensors, one thread, bf16 autocast), where the
  step is all dispatch, autograd and Python; its best thread time over its op count. The fused
  path's launches go through Triton's launcher to the stand-in driver (bench_kernel.stand_in_gpu),
  counted as ops. A GPU's host also pays each op's CUDA launch, which this CPU cannot measure:
  hence MARGIN.
- device ms: the same step at the preset's width and micro-batch on fake tensors (shapes, no data),
  each aten op's roofline time on an H200 summed: the longer of its FLOPs (the formulas of
  torch.utils.flop_counter; attention's by its own, causal masking not discounted) at the bf16
  peak and the bytes of its tensors in and out at HBM bandwidth (views move none). The fused
  routing, which fake tensors cannot launch, is the baseline's step plus the bytes of the kernels
  and their torch ops from the traffic model (bench_kernel.traffic).
- memory GiB: 16 bytes a parameter (fp32 weights, gradients, AdamW's two moments) and the tensors
  autograd saves (their storages, each once); for the fused path the baseline's, plus the 2L+1
  bf16 sources the kernels keep and their remainders and lse (bench_kernel.traffic's "saved").
A micro-step is device-bound when device ms ≥ MARGIN × host ms: then the host queues kernels
faster than the GPU runs them. Nothing here needs a GPU; the figures are a model, to be checked on
one (gpu_check.py).
"""
import contextlib
import subprocess
import sys
import time

import torch

import mhar
from lib import head
from lib.common import PEAK_FLOPS, FlagParser, exit_error, one_line
from scripts import bench_kernel

H200_FLOPS = PEAK_FLOPS["NVIDIA H200"]     # bf16 dense, vendor datasheet
H200_BYTES = bench_kernel.HBM["H200"]      # bytes/s, vendor datasheet
MARGIN = 2.0        # device time over host time that counts as device-bound (the CUDA launches)
MODES = {"baseline": dict(residual="baseline"), "mhar": dict(residual="mhar"),
         "mhar fused": dict(residual="mhar", fused=True)}
TINY = dict(n_embd=64, n_head=2, n_kv_head=1, ffn_hidden=128, vocab_size=256, seq_len=16,
            route_heads=4)     # the host's measure: the preset's depth, nothing else of its size


class Meter(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the aten ops dispatched under it and sums their roofline time on an H200."""

    def __init__(self):
        super().__init__()
        self.ops, self.flops, self.bytes, self.seconds = 0, 0, 0, 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        flops = op_flops(func, args, kwargs, out)
        tensors = [t for t in torch.utils._pytree.tree_leaves((args, kwargs, out))
                   if isinstance(t, torch.Tensor)]
        moved = 0 if func.is_view else sum(t.numel() * t.element_size() for t in tensors)
        self.ops += 1
        self.flops += flops
        self.bytes += moved
        self.seconds += max(flops / H200_FLOPS, moved / H200_BYTES)
        return out


def op_flops(func, args, kwargs, out):
    """An aten op's FLOPs: torch.utils.flop_counter's formula, and for the CPU's fused attention
    (which it has none for) 4·B·H·T·S·hd forward (two matmuls), 2.5 times that backward."""
    from torch.utils.flop_counter import flop_registry
    name = func.overloadpacket.__name__
    if name.startswith("_scaled_dot_product_flash_attention_for_cpu"):
        backward = name.endswith("_backward")       # (grad_out, query, key, ...): (query, key, ...)
        q, k = args[backward:backward + 2]
        B, H, T, hd = q.shape
        forward = 4 * B * H * T * k.shape[2] * hd
        return int(2.5 * forward) if backward else forward
    formula = flop_registry.get(func.overloadpacket)
    return formula(*args, **kwargs, out_val=out) if formula else 0


def micro_step(gpt, batch, seq_len):
    """Forward and backward of one micro-batch of `batch` sequences, the loss through the chunked
    head as in training, under bf16 autocast (the CPU's: fake tensors are CPU tensors)."""
    idx = torch.randint(0, gpt.config.vocab_size, (batch, seq_len))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, loss = gpt(idx, idx, loss_fn=head.linear_cross_entropy)
    loss.backward()


def host_time(preset, mode, repeats=5):
    """(aten ops and launches of a micro-step, the host's seconds for one): measured at TINY."""
    config = mhar.preset(preset, **MODES[mode], **TINY)
    fused = config.fused
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        driver = bench_kernel.stand_in_gpu() if fused else contextlib.nullcontext(lambda: 0)
        with driver as launched:                     # how many launches reached the driver
            gpt = mhar.GPT(config)
            for _ in range(2):
                micro_step(gpt, 1, config.seq_len)                   # warm: compiles, caches
            before = launched()                                      # (unfused: none)
            with Meter() as meter:
                micro_step(gpt, 1, config.seq_len)
            ops = meter.ops + launched() - before
            best = float("inf")
            for _ in range(repeats):
                start = time.thread_time()
                micro_step(gpt, 1, config.seq_len)
                best = min(best, time.thread_time() - start)
    finally:
        torch.set_num_threads(threads)
    return ops, best


def device_time(preset, mode, batch):
    """(the device's roofline seconds for a micro-step of `batch` sequences, the bytes of memory
    it needs): on fake tensors, as the module's docstring says."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    fused = MODES[mode].get("fused", False)
    config = mhar.preset(preset, **MODES["baseline" if fused else mode])
    saved = {}

    def keep(tensor):
        storage = tensor.untyped_storage()
        saved[storage._cdata] = storage.nbytes()
        return tensor

    chunk = head.HEAD_CHUNK_BYTES["cpu"]
    head.HEAD_CHUNK_BYTES["cpu"] = head.HEAD_CHUNK_BYTES["cuda"]    # the GPU's chunks of the head
    try:
        with FakeTensorMode():
            gpt = mhar.GPT(config)
            with Meter() as meter, torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
                micro_step(gpt, batch, config.seq_len)
    finally:
        head.HEAD_CHUNK_BYTES["cpu"] = chunk
    seconds = meter.seconds
    memory = 16 * sum(p.numel() for p in gpt.parameters()) + sum(saved.values())
    if fused:   # the baseline's, plus the kernels' bytes and what they keep: the sources, the rest
        routed = mhar.preset(preset, **MODES[mode])
        tokens = batch * routed.seq_len
        moved = bench_kernel.traffic(routed.n_layer, routed.n_embd, routed.depth_heads, tokens)
        seconds += sum(sum(moved[way].values()) for way in ("forward", "backward")) / H200_BYTES
        memory += (2 * routed.n_layer + 1) * tokens * routed.n_embd * 2 + moved["saved"]
    return seconds, memory


def table(presets, micro_batches, modes=tuple(MODES)):
    """Prints a row per preset, mode and micro-batch; returns {(preset, mode, batch): (host s,
    device s, memory bytes)}."""
    print(f"one micro-step, host (measured here, per op) against device (roofline, H200: "
          f"{H200_FLOPS / 1e12:.0f} TFLOPS bf16, {H200_BYTES / 1e12:.1f} TB/s); device-bound: "
          f"device >= {MARGIN:g} x host")
    print(f"{'preset':6} {'mode':10} {'micro':>5} {'ops':>6} {'us/op':>5} {'host ms':>8} "
          f"{'device ms':>9} {'dev/host':>8} {'memory GiB':>10}")
    rows = {}
    for preset in presets:
        for mode in modes:
            ops, host = host_time(preset, mode)
            for batch in micro_batches:
                device, memory = device_time(preset, mode, batch)
                rows[preset, mode, batch] = host, device, memory
                print(f"{preset:6} {mode:10} {batch:5} {ops:6} {host / ops * 1e6:5.1f} "
                      f"{host * 1e3:8.1f} {device * 1e3:9.1f} {device / host:7.2f}"
                      f"{'*' if device >= MARGIN * host else ' '} {memory / 2**30:10.1f}",
                      flush=True)
    return rows


def parse_args(argv):
    p = FlagParser(prog="bench_step.py", description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--preset", choices=("100m", "350m", "1b"), action="append",
                   help="a preset to model (repeat for several; default: all three)")
    p.add_argument("--micro_batches", default="1,2,4,8,16,32",
                   help="micro-batch sizes in sequences, comma-separated (default: 1,2,4,8,16,32)")
    args = p.parse_args(argv)
    text = args.micro_batches
    try:
        args.micro_batches = [int(b) for b in text.split(",")]
    except ValueError:
        args.micro_batches = []
    if not args.micro_batches or min(args.micro_batches) < 1:
        p.error(f"--micro_batches: comma-separated positive integers, got {text!r}")
    return args


def main(argv=None):
    args = parse_args(argv)
    if bench_kernel.kernel.INTERPRETED:
        exit_error("bench_step.py", "the fused path's host time goes through Triton's launcher, "
                   "which the interpreter replaces: unset TRITON_INTERPRET")
    try:
        table(args.preset or ["100m", "350m", "1b"], args.micro_batches)
    except KeyboardInterrupt:
        exit_error("bench_step.py", "interrupted (Ctrl-C): what finished is printed above",
                   status=130)
    except (RuntimeError, OSError, subprocess.CalledProcessError) as error:  # the machine's: the
        exit_error("bench_step.py", one_line(error), status=1)   # stand-in driver, no compiler


if __name__ == "__main__":
    main(sys.argv[1:])
