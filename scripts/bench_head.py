"""
The LM head's cost, the full logits against the chunked loss (head.py, GPT.forward(loss_fn=...)),
side by side: the peak memory and the time of one training step (forward, backward, AdamW). The
two heads alternate step by step in one process, so that a busy machine slows both alike; the
process's CPU time per step is printed beside the wall time, as a busy machine inflates it less.

    python -m scripts.bench_head                        # the three cases, 5 timed steps of each head
    python -m scripts.bench_head --cases small --steps 10

Cases:
    qwen3-4k     one 4096-token sequence at Qwen3's vocabulary, 151,936, through the tiny preset
                 at d 128 (train.py --preset tiny --data synthetic --vocab_size 151936 --seq_len
                 4096 --n_embd 128 --n_head 4 --n_kv_head 2 --ffn_hidden 384 --batch_size 1)
    qwen3-4k-z   the same with the z-loss (--z_loss 1e-4)
    small        the step of the CPU demo (python train.py): the small preset, 8 x 256 tokens

Peak memory: on a CPU each case and head runs two steps in a child process of its own, started
before any timed step, which reports its resident set before the first step (torch, the model, its
data) and its maximum resident set (the kernel's count: a process's peak never comes down, hence
the children); on CUDA, the allocator's peak of each step.

Ctrl-C: one line and exit status 130, whenever it comes.
"""
import os
import sys

INTERRUPTED = b"bench_head.py: error: interrupted (Ctrl-C)\n"
try:  # the script's first instruction: a Ctrl-C until the work begins is this line (interrupts.py)
    from lib import interrupts
    # a measuring child (--child) ends without a word: its parent, whom the Ctrl-C reaches too, says it
    interrupts.guard(__name__, b"" if "--child" in sys.argv else INTERRUPTED)
except KeyboardInterrupt:  # one in the microseconds before
    os.write(2, INTERRUPTED)
    os._exit(130)

import argparse  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402

# Before torch starts OpenMP, as in train.py: spinning threads starve the other processes of a
# shared CPU
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch  # noqa: E402

import mhar  # noqa: E402
from lib.common import (ROOT, FlagParser, UserError, adamw, exit_error, ignore_stop_signals,  # noqa: E402
                        max_resident_bytes, peak_memory, pick_device)
from lib.head import linear_cross_entropy, squared_log_z  # noqa: E402

QWEN3_4K = dict(vocab_size=151936, seq_len=4096, n_embd=128, n_head=4, n_kv_head=2, ffn_hidden=384)
CASES = {  # name: (preset, overrides, batch size, z_loss)
    "qwen3-4k": ("tiny", QWEN3_4K, 1, 0.0),
    "qwen3-4k-z": ("tiny", QWEN3_4K, 1, 1e-4),
    "small": ("small", {}, 8, 0.0),
}
HEADS = ("full", "chunked")


def setup(case, device):
    """(model, optimizer, inputs, targets) of a case, from a fixed seed."""
    name, overrides, batch, _ = CASES[case]
    torch.manual_seed(0)
    model = mhar.GPT(mhar.preset(name, **overrides)).to(device)
    optimizer = adamw(model, device_type=device.type)
    c = model.config
    tokens = torch.randint(0, c.vocab_size, (batch, c.seq_len + 1), device=device)
    return model, optimizer, tokens[:, :-1], tokens[:, 1:]


def step(model, optimizer, x, y, head, z_loss):
    """One training step with the full logits or the chunked loss, the z-loss in the gradient of
    either; its loss (the cross-entropy)."""
    if head == "full":
        logits, loss = model(x, y)
        objective = loss + z_loss * squared_log_z(logits) if z_loss else loss
    else:
        _, loss = model(x, y, loss_fn=functools.partial(linear_cross_entropy, z_loss=z_loss))
        objective = loss
    objective.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def rss():
    """The resident set now, in bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child(case, head):
    """Two steps of one head, in this process alone: prints the resident set before them."""
    model, optimizer, x, y = setup(case, torch.device("cpu"))
    before = rss()
    for _ in range(2):
        step(model, optimizer, x, y, head, CASES[case][3])
    print(json.dumps({"before": before}))


def peak_cpu(case, head):
    """(resident set before the steps, maximum resident set) of a child running two steps."""
    proc = subprocess.Popen([sys.executable, "-m", "scripts.bench_head", "--child", case, head],
                            cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        out = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)
    except BaseException:  # Ctrl-C: a child that it did not reach (kill -INT) stops too
        proc.kill()
        proc.wait()
        raise
    if status != 0:
        sys.exit(f"bench_head.py: error: the {case} {head} child failed ({status})")
    return json.loads(out)["before"], max_resident_bytes(usage)


def timed(model, optimizer, x, y, head, z_loss, device):
    """((wall seconds, CPU seconds of the process), loss, CUDA peak bytes or None) of one step."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        peak_memory(device)  # resets the counter: the next reading is this step's
    t0, cpu0 = time.perf_counter(), time.process_time()
    loss = step(model, optimizer, x, y, head, z_loss)  # .item() waits for the step
    seconds = time.perf_counter() - t0, time.process_time() - cpu0
    return seconds, loss, peak_memory(device) if cuda else None


def bench(case, steps, device, peaks):
    """Time the two heads alternately, each on its own copy of the model (the same weights and
    batch), after one untimed step each; print one line per head (with peaks[head], a CPU
    child's, or the CUDA allocator's) and their ratio."""
    z_loss = CASES[case][3]
    runs = {head: setup(case, device) for head in HEADS}
    seconds, losses, allocated = ({h: [] for h in HEADS} for _ in range(3))
    for i in range(steps + 1):
        for head in HEADS:
            s, loss, peak = timed(*runs[head], head, z_loss, device)
            if i > 0:
                seconds[head].append(s)
                losses[head].append(loss)
                allocated[head].append(peak)
    c = runs["full"][0].config
    print(f"{case}: vocab {c.vocab_size:,}, {runs['full'][2].numel():,} positions, d {c.n_embd}, "
          f"{c.n_layer} layers" + (f", z-loss {z_loss:g}" if z_loss else ""))
    wall, cpu = ({h: [s[i] for s in seconds[h]] for h in HEADS} for i in range(2))
    for head in HEADS:
        if device.type == "cuda":
            memory = f"peak allocated {max(allocated[head]) / 2**30:.2f} GiB"
        else:
            before, peak = peaks[head]
            memory = f"peak RSS {peak / 2**30:.2f} GiB (before the step {before / 2**30:.2f})"
        print(f"  {head:8s} {1e3 * statistics.median(wall[head]):8.1f} ms/step, CPU "
              f"{1e3 * statistics.median(cpu[head]):.0f} ms (medians of {steps}) | {memory} | "
              f"last loss {losses[head][-1]:.6f}")
    pairs = [f / c for f, c in zip(wall["full"], wall["chunked"])]
    ratio, cpu_ratio = (statistics.median(t["full"]) / statistics.median(t["chunked"])
                        for t in (wall, cpu))
    print(f"  full / chunked: {ratio:.2f}x per step (medians; step by step {min(pairs):.2f}x to "
          f"{max(pairs):.2f}x), {cpu_ratio:.2f}x in the process's CPU time")


def main(argv=None):
    p = FlagParser(prog="bench_head.py", description=__doc__.split("\n\n")[0].strip(),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {list(CASES)}")
    p.add_argument("--steps", type=int, default=5, help="timed steps of each head (default 5)")
    p.add_argument("--device", default="cpu", help="cpu (default), cuda, ...")
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)  # CASE HEAD: one peak measurement
    args = p.parse_args(argv)
    if args.child:  # peak_cpu's own child process: its arguments are checked all the same
        case, head = args.child
        if case not in CASES or head not in HEADS:
            p.error(f"--child CASE HEAD takes a case of {list(CASES)} and a head of {list(HEADS)}, "
                    f"not {case!r} {head!r}")
        return child(case, head)
    cases = args.cases.split(",")
    unknown = [c for c in cases if c not in CASES]
    if unknown or args.steps < 1:
        p.error(f"unknown case {unknown[0]!r}; use {list(CASES)}" if unknown else
                "--steps must be >= 1")
    try:
        device = pick_device(args.device)
    except UserError as e:
        p.error(str(e))
    try:
        interrupts.begin()  # the work begins: a Ctrl-C unwinds (and stops a child)
        print(f"{torch.get_num_threads()} threads, {device}, float32")
        # the children first: a child's maximum resident set starts from this process's resident
        # set when it forks, which the timed steps would raise
        peaks = {(case, head): peak_cpu(case, head) for case in cases for head in HEADS
                 if device.type == "cpu"}
        for case in cases:
            bench(case, args.steps, device, {head: peaks.get((case, head)) for head in HEADS})
    except KeyboardInterrupt:
        exit_error("bench_head.py", "interrupted (Ctrl-C)", status=130)
    ignore_stop_signals("bench_head.py")  # every line is out: a Ctrl-C is too late (the teardown)


if __name__ == "__main__":
    try:
        main()
    finally:  # however main ended (--help: argparse exits by itself), a signal is too late: ignored
        ignore_stop_signals("bench_head.py")
