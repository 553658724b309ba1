"""
The forced compromise of single-head depth routing, on a task built to show it.

    python -m scripts.compromise                                   # 6 methods x 3 seeds, 2 processes
    python -m scripts.compromise --d 32 --seeds 0,1,2,3,4          # a narrower model, more seeds
    python -m scripts.compromise --steps 3 --seeds 0 --d 32 --out_dir /tmp/compromise   # a smoke run

Attention Residuals (H = 1) give every sublayer one softmax over depth, shared by the whole width:
when one slice of the width needs the embedding and another must avoid it, a single head has to
settle on one mix for both. MHAR's heads (H = 2) each read their own slice and need not compromise.
This script builds a task where exactly that happens, trains the methods on it and prints the gap.

The task. A token is a pair (a, b), a and b in 0..15 (token id a * 16 + b); sequences are uniform
random. The target at position t is (a_t, b_{t-2}): keep the a of the current token, fetch the b of
two tokens back (positions t < 2 are not scored). The embedding is frozen and tied to the LM head:
e(a, b) = [U_a ; W_b], orthonormal codes of a in the first d/2 coordinates and of b in the second.
So the a-part of the answer sits in the embedding s_0 already, in the half that MHAR's first head
reads; the b-part needs an attention layer, and in its half s_0 carries b_t, a distractor. The
final site would like much of s_0 over the first half and little over the second: one head cannot.
The control, "rotated", multiplies the codes by a random orthogonal d x d matrix, so that neither
part lines up with a head's slice: the gain should vanish there.

The models are mhar.GPT with 2 blocks (4 sublayers, 5 routing sites), width d 64, 4 attention
heads over 2 key-value heads, a SwiGLU MLP of 4d: the baseline, AttnRes, AttnRes at the temperature
of H heads (attnres-tau: its logits divided by H = --heads, as flat as an MHAR head's), MHAR with
H = --heads, then AttnRes and MHAR on the rotated codes. AdamW (lr 3e-3, weight decay 0.1, betas
0.9, 0.95), 30 warmup steps, cosine to 0.1x, gradients clipped at 1, 250 steps of 32 sequences. For
a seed every method starts from the same weights and sees the same batches; seeds are paired.

Measured (2026-12-01, 2-core CPU loaded by another experiment's two training runs, load average
3 to 4; `python -m scripts.compromise`, 2 min 56 s): the validation cross-entropy over 512 fixed
sequences at the end and at step 50, the mean of seeds 0, 1, 2, and the paired difference to the
reference, ± its standard error:

    method           val loss  at step 50  accuracy   paired difference                    ratio
    baseline           0.0284      1.6681    100.0%   +0.0028 ± 0.0006 vs attnres           1.11
    attnres            0.0256      0.4824    100.0%   (the reference)
    attnres-tau        0.0277      0.8655    100.0%   +0.0021 ± 0.0001 vs attnres           1.08
    mhar               0.0205      0.2121    100.0%   -0.0051 ± 0.0008 vs attnres           0.80
                                                      -0.0072 ± 0.0009 vs attnres-tau       0.74
    attnres-rotated    0.0308      0.4953    100.0%   +0.0051 ± 0.0002 vs attnres           1.20
    mhar-rotated       0.0316      0.7444    100.0%   +0.0008 ± 0.0002 vs attnres-rotated   1.03

MHAR is below AttnRes by 6 standard errors, and on the rotated codes the gain is gone (MHAR is
slightly worse there). The flatter softmax does not explain it: AttnRes at MHAR's temperature is
worse than AttnRes, and MHAR beats it by 8 standard errors. At the final site MHAR's head over the
a-half puts α = 0.28 on the embedding, its head over the b-half 0.13; AttnRes's single head 0.14
(attnres-tau 0.15; rotated: 0.17 and 0.18, and 0.16); depth_maps.png draws the final site's five
sources for every head. The rotation costs AttnRes too (+0.0051; a guess at why: Adam's steps and
the norms' weights act coordinate by coordinate), which is why the control is judged against
AttnRes on the same codes. At d 32 (`--d 32`, 1 min 28 s, without attnres-tau) MHAR's difference
is -0.058 ± 0.015 (ratio 0.79), the rotated control's -0.0002 ± 0.0053.

Read it for what it shows: the mechanism, not a capability that only MHAR has. Every method
answers every validation position at d 64 correctly (at d 32, 99.9% and more): the gap is in
confidence, and in speed early on. Whether a learned embedding would find the aligned layout by
itself, this does not say. Two variants measured the same day (model() without the freezing, d 64,
seeds 0, 1, 2; not flags of this script): an embedding trained from the codes keeps the gap
(AttnRes 0.0049, MHAR 0.0032, paired -0.0016 ± 0.0001), but it starts in the aligned layout; one
trained from mhar.GPT's own N(0, 0.02^2) init learns only the a-part in 250 steps (2.786 for both
methods, about ln 16; accuracy 6%), and there the methods differ by -0.00001 ± 0.00002.

Writes to --out_dir (default runs/compromise):
    results.json     {"args": the flags, "runs": [...]}, every run with method, seed, d, heads (H;
                     0 for the baseline), steps, val_loss, val_accuracy, curve (the validation
                     loss every 50 steps and at the end, [step, loss] pairs), seconds, and alphas:
                     per routing site a list of N_j lists of H floats, α averaged over the
                     validation sequences and their scored positions (null for the baseline)
    depth_maps.png   the final site's α over its five sources, per head, averaged over the seeds
The figure needs matplotlib (pip install matplotlib); without it results.json is still written.
Bad input is one line on stderr and exit status 2; an --out_dir that cannot be written into (a
read-only folder, a full disk) is one line and status 1, found before the training. Ctrl-C, or
SIGTERM (how a job scheduler stops a job), sent to the main process alone or to all of them, stops
every worker and ends with one line and exit status 130 (143 for SIGTERM), leaving nothing behind:
results.json and the figure are written together at the end, both whole or neither.
"""
import argparse
import json
import math
import os
import signal
import sys
import time
from contextlib import contextmanager, suppress
import multiprocessing
from multiprocessing import get_context, resource_tracker
from statistics import fmean as mean

try:  # torch takes seconds to import: Ctrl-C meanwhile ends as it does later
    import torch
    import torch.nn.functional as F

    import mhar
    from lib.common import (FlagParser, MachineError, UserError, adamw, duration, exit_error, one_line,
                            output_folder, progress, remove_staging, seed_of, staged, write_atomically)
    from lib.schedule import lr_factor
    from scripts.probe import FIGURE_DPI, pyplot
except KeyboardInterrupt:
    print("compromise.py: error: interrupted (SIGINT): nothing written; the same command runs it "
          "again from the start", file=sys.stderr)
    sys.exit(130)

# %%
# The task: pairs (a, b) in, (a_t, b_{t-2}) out.
#
# A token is a pair of two symbols from an alphabet of 16, a vocabulary of 256. The first symbol of
# the answer is the current token's, the second is copied from LAG tokens back; the first LAG
# positions have nothing to copy and their targets are IGNORE, which the loss skips.

SIDE = 16                # symbols per half of a token: a and b each in 0..15
VOCAB = SIDE * SIDE      # token id a * 16 + b
SEQ_LEN = 32
LAG = 2                  # the b of the answer is the b of LAG tokens back
IGNORE = -1              # the target of a position that is not scored


def batch(generator, n):
    """n uniform random sequences and their targets: (idx, targets), (n, SEQ_LEN) int64 each."""
    idx = torch.randint(VOCAB, (n, SEQ_LEN), generator=generator)
    a, b = idx // SIDE, idx % SIDE
    targets = torch.full_like(idx, IGNORE)
    targets[:, LAG:] = a[:, LAG:] * SIDE + b[:, :-LAG]               # (a_t, b_{t-2})
    return idx, targets


# %%
# The frozen embedding: the a-code in one half of the width, the b-code in the other.
#
# U and W hold 16 orthonormal rows each, of width d/2 (so d/2 >= 16). Token (a, b) is [U_a ; W_b].
# The LM head is tied to it, so the logit of (a, b) is <h_[:d/2], U_a> + <h_[d/2:], W_b>: the two
# halves of the final hidden state answer the two symbols separately. rotation() is the control's
# orthogonal matrix R; the rotated codes e R keep every inner product but spread each symbol over
# the whole width.

def orthonormal_rows(n, width, generator):
    """n orthonormal rows of the given width (n <= width): Q of a Gaussian's QR, transposed."""
    q, _ = torch.linalg.qr(torch.randn(width, n, generator=generator))   # (width, n), Q^T Q = I
    return q.T.contiguous()                                              # (n, width)


def half_codes(d, seed):
    """(U, W): the codes of a and of b, (16, d/2) each with orthonormal rows."""
    g = torch.Generator().manual_seed(seed_of("codes", d, seed))
    return orthonormal_rows(SIDE, d // 2, g), orthonormal_rows(SIDE, d // 2, g)


def rotation(d, seed):
    """The control's random orthogonal matrix R (d, d)."""
    return orthonormal_rows(d, d, torch.Generator().manual_seed(seed_of("rotation", d, seed)))


def codes(d, seed, rotated=False):
    """The embedding (256, d): row a * 16 + b is [U_a ; W_b], times R when rotated."""
    U, W = half_codes(d, seed)
    e = torch.cat([U.repeat_interleave(SIDE, 0), W.repeat(SIDE, 1)], dim=1)  # (256, d)
    return e @ rotation(d, seed) if rotated else e


# %%
# The models: mhar.GPT with two blocks, on the frozen codes.
#
# Six methods: the pre-norm baseline, AttnRes (one softmax over depth per site), AttnRes with its
# logits divided by H (attnres-tau: the temperature control, whose logits are as flat as an MHAR
# head's; the README's "What it shows"), MHAR (--heads softmaxes, each over its slice of the
# width), and AttnRes and MHAR on the rotated codes. For one
# seed every method starts from the same weights: the attention and MLP projections are drawn in
# the same order whatever the residual mode (the routing queries start at zero, drawing nothing),
# and the same codes replace the embedding.

METHODS = {                     # name: (Config.residual, rotated codes, logits divided by H)
    "baseline":        ("baseline", False, False),
    "attnres":         ("attnres", False, False),
    "attnres-tau":     ("attnres", False, True),
    "mhar":            ("mhar", False, False),
    "attnres-rotated": ("attnres", True, False),
    "mhar-rotated":    ("mhar", True, False),
}
REFERENCE = {"baseline": ("attnres",), "attnres-tau": ("attnres",),  # each is compared, seed by
             "mhar": ("attnres", "attnres-tau"),                    # seed, with these
             "attnres-rotated": ("attnres",), "mhar-rotated": ("attnres-rotated",)}
N_LAYER = 2


def model(method, d, heads, seed):
    """A fresh model of the method: weights drawn from `seed`, the frozen codes as embedding."""
    residual, rotated, tempered = METHODS[method]
    config = mhar.Config(vocab_size=VOCAB, seq_len=SEQ_LEN, n_layer=N_LAYER, n_embd=d, n_head=4,
                         n_kv_head=2, ffn_hidden=4 * d, residual=residual, route_heads=heads,
                         route_temperature=float(heads) if tempered else 1.0)
    torch.manual_seed(seed)
    net = mhar.GPT(config)
    with torch.no_grad():
        net.embed.weight.copy_(codes(d, seed, rotated))
    net.embed.weight.requires_grad_(False)  # frozen; the LM head is the same tensor (tied)
    return net


# %%
# The training loop: AdamW, warmup, cosine, clipped gradients; the same batches for every method.
#
# mhar.GPT's own loss scores every position; this task leaves the first LAG out, so the loss is
# the cross-entropy of the tied head's logits with IGNORE skipped. The frozen embedding has no
# gradient, and AdamW leaves a parameter without one alone (no step, no weight decay). The
# validation sequences are the same for every run.

LR, WEIGHT_DECAY, BETAS = 3e-3, 0.1, (0.9, 0.95)
WARMUP, MIN_LR_RATIO = 30, 0.1       # linear warmup, then cosine down to 0.1x (lib/schedule.py)
BATCH_SIZE, CLIP = 32, 1.0
VAL_SEQUENCES, EVAL_EVERY = 512, 50


def loss_of(net, idx, targets):
    """The mean cross-entropy over the scored positions, and the logits (B, T, vocab)."""
    logits = net.lm_head(net.hidden(idx))                            # (B, T, vocab)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE), logits


def validation():
    """The fixed validation set, (idx, targets), the same for every seed and method."""
    return batch(torch.Generator().manual_seed(seed_of("validation")), VAL_SEQUENCES)


@torch.no_grad()
def evaluate(net, val):
    """(loss, accuracy) on the scored positions; a token counts as right when both symbols are."""
    idx, targets = val
    loss, logits = loss_of(net, idx, targets)
    scored = targets != IGNORE
    return loss.item(), (logits.argmax(-1) == targets)[scored].float().mean().item()


def fit(net, seed, steps, val=None):
    """Train net for `steps` updates on the batches of `seed`. Returns the validation loss every
    EVAL_EVERY steps before the last, [step, loss] pairs (none without val)."""
    opt = adamw(net, weight_decay=WEIGHT_DECAY, lr=LR, betas=BETAS)
    data = torch.Generator().manual_seed(seed_of("train", seed))
    curve = []
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = LR * lr_factor(step, WARMUP, steps, MIN_LR_RATIO)
        loss, _ = loss_of(net, *batch(data, BATCH_SIZE))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), CLIP)
        opt.step()
        if val is not None and (step + 1) % EVAL_EVERY == 0 and step + 1 < steps:
            curve.append([step + 1, evaluate(net, val)[0]])
    return curve


@torch.no_grad()
def mean_alphas(net, idx):
    """α at every site averaged over the sequences and the scored positions: per site N_j lists of
    H floats; None for the baseline."""
    if not net.config.routed:
        return None
    return [a[:, :, LAG:].mean((1, 2)).tolist() for a in net.routing_weights(idx)]  # (N_j, H)


def train(method, seed, d=64, heads=2, steps=250):
    """One run: a fresh model trained on the seed's batches, measured on the validation set."""
    start, val = time.perf_counter(), validation()
    net = model(method, d, heads, seed)
    curve = fit(net, seed, steps, val)
    loss, accuracy = evaluate(net, val)
    return dict(method=method, seed=seed, d=d, heads=net.config.depth_heads, steps=steps,
                val_loss=loss, val_accuracy=accuracy, curve=curve + [[steps, loss]],
                alphas=mean_alphas(net, val[0]), seconds=round(time.perf_counter() - start, 1))


# %%
# Running them all: two processes at a time, one thread each.
#
# Tiny models gain nothing from a second thread, so two single-threaded runs in parallel use a
# 2-core machine fully. They are spawned, not forked: a fork copies a process's locks but not its
# threads (torch's OpenMP pool among them), which can deadlock the child.
#
# Stopping. Only the main process acts on Ctrl-C or SIGTERM, which it turns into KeyboardInterrupt
# (main); it then stops the workers and waits for them. A terminal's Ctrl-C reaches the workers too:
# they start with SIGINT blocked and keep it so. SIGTERM they take at its default, which is how the
# main process stops them (Pool.terminate), and how a scheduler that signals every process of a job
# stops them directly. The resource tracker multiprocessing starts ends by itself once every other
# process has closed its pipe. A signal while the workers start, or while they are being stopped,
# is held until that is done (signals_held): never a pool half started or half stopped.

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def one_thread():
    torch.set_num_threads(1)


def indexed_run(item):
    i, run = item
    return i, train(**run)


def interrupt(signum, frame):
    """The main process's SIGTERM handler: the run unwinds as on Ctrl-C, the signal named."""
    raise KeyboardInterrupt(signal.Signals(signum).name)


@contextmanager
def sigterm_as_interrupt():
    """SIGTERM raises KeyboardInterrupt("SIGTERM") inside the block (interrupt); restored after."""
    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextmanager
def signals_held(act=True):
    """SIGINT and SIGTERM are noted, not acted on, while the block runs; the first one noted goes
    to its handler once the block has ended, unless the block raised or act is False (the run is
    already ending, for its first reason). A signal that is ignored (a job started in the
    background ignores Ctrl-C) or at its default (no handler of ours: an in-process caller's own
    choice) is left as it is."""
    held, handlers = [], {}
    for signum in STOP_SIGNALS:
        handler = signal.getsignal(signum)
        if callable(handler):
            handlers[signum] = handler
            signal.signal(signum, lambda noted, frame: held.append(noted))
    try:
        yield
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    if held and act:
        handlers[held[0]](held[0], None)


@contextmanager
def starting_workers():
    """The processes started inside never hear Ctrl-C (they inherit the blocked SIGINT); a stop
    signal meanwhile is acted on at the end, never in the middle of starting one."""
    with signals_held():
        resource_tracker.ensure_running()  # it unblocks SIGINT once started: start it first
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            yield
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # a held press: noted


def run_all(runs, jobs, done, waiting=None, every_s=60):
    """Train every run (a dict of train()'s arguments), `jobs` at a time; done(result) is called
    as each one finishes, and waiting(), when given, after each `every_s` seconds without one.
    Returns the results in the order of runs. However it ends, no worker outlives it: stopped at
    once on a signal, idle after the last result."""
    if jobs == 1:  # in this process
        results = []
        for run in runs:
            results.append(train(**run))
            done(results[-1])
        return results
    results, pool, finished = {}, None, False
    try:
        with starting_workers():
            pool = get_context("spawn").Pool(jobs, one_thread)
        ordered = pool.imap_unordered(indexed_run, list(enumerate(runs)))
        while len(results) < len(runs):
            try:
                i, result = ordered.next(timeout=every_s)
            except multiprocessing.TimeoutError:
                if waiting is not None:
                    waiting()
                continue
            results[i] = result
            done(result)
        finished = True
    finally:
        # a signal must not cut the stopping short; after a stop, a second one is dropped (the
        # first names the stop)
        if pool is not None:
            with signals_held(act=finished):
                pool.terminate()
                pool.join()
    return [results[i] for i in range(len(runs))]


# %%
# The table: each method against its reference, seed by seed.
#
# The paired difference is the mean over seeds of (method - reference) in validation loss, with
# its standard error (the sample standard deviation over seeds / sqrt(n)); the ratio is the ratio
# of the mean losses. The rotated ones are compared with AttnRes on the rotated codes.

def by_method(results):
    """{method: {seed: result}}."""
    table = {}
    for r in results:
        table.setdefault(r["method"], {})[r["seed"]] = r
    return table


def paired(runs, reference):
    """(mean difference, standard error, ratio of means) of val_loss over the shared seeds; the
    standard error is nan for a single seed."""
    seeds = sorted(set(runs) & set(reference))
    diffs = torch.tensor([runs[s]["val_loss"] - reference[s]["val_loss"] for s in seeds],
                         dtype=torch.float64)
    se = diffs.std().item() / math.sqrt(len(seeds)) if len(seeds) > 1 else math.nan
    ratio = (sum(runs[s]["val_loss"] for s in seeds) /
             sum(reference[s]["val_loss"] for s in seeds))
    return diffs.mean().item(), se, ratio


def report(results):
    """The table: one line per method (the mean final val loss, the mean val loss at the first
    evaluation, the accuracy, the paired difference of the final loss and the ratio), then α on
    the embedding at the final site, per head."""
    table = by_method(results)
    early = results[0]["curve"][0][0]  # the step of the first evaluation
    lines = [f"{'method':<16} {'val loss':>8}  {f'at step {early}':>10}  {'accuracy':>8}   "
             f"{'paired difference':<36} {'ratio':>5}"]
    for method, runs in table.items():
        loss = mean(r["val_loss"] for r in runs.values())
        at_early = mean(r["curve"][0][1] for r in runs.values())
        accuracy = mean(r["val_accuracy"] for r in runs.values())
        line = f"{method:<16} {loss:>8.4f}  {at_early:>10.4f}  {accuracy:>8.1%}   "
        references = [name for name in REFERENCE.get(method, ()) if name in table]
        for reference in references:
            diff, se, ratio = paired(runs, table[reference])
            error = f" ± {se:.4f}" if math.isfinite(se) else " (one seed)"
            vs = f"{diff:+.4f}{error} vs {reference}"
            lines.append(f"{line}{vs:<36} {ratio:>5.2f}")
            line = " " * len(line)  # a second reference: a line of its own, under the first
        if not references:
            lines.append(line + "(the reference)")
    embed = []
    for method, runs in table.items():
        first = runs[min(runs)]
        if first["alphas"] is not None:
            heads = [mean(r["alphas"][-1][0][h] for r in runs.values())
                     for h in range(first["heads"])]
            embed.append(f"{method} " + "/".join(f"{a:.2f}" for a in heads))
    lines.append("α on s0 (the embedding) at the final site, per head: " + ", ".join(embed))
    return "\n".join(lines)


# %%
# The figure: the final site's depth map, per head.
#
# The final site reads all five sources: the embedding s0, then the outputs of attention 0, MLP 0,
# attention 1, MLP 1. With aligned codes MHAR's head 0 reads the a-half and head 1 the b-half;
# AttnRes's single head has to serve both.

def source_labels():
    names = [f"{'attn' if j % 2 == 0 else 'mlp'} {j // 2}" for j in range(2 * N_LAYER)]
    return ["s0 embed"] + [f"s{j + 1} {name}" for j, name in enumerate(names)]


def plot_depth_maps(plt, results, path):
    """Grouped bars of the final site's α over its sources: two panels (aligned and rotated codes),
    one bar per head of each routed method: the mean over the seeds, their std as the error bar."""
    table = by_method(results)
    labels = source_labels()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True, constrained_layout=True)
    for ax, (title, suffix) in zip(axes, (("aligned codes", ""), ("rotated codes", "-rotated"))):
        bars = []  # (label, α of one head over the sources, per seed (n_seeds, N))
        for name in ("attnres", "mhar"):
            final = torch.tensor([r["alphas"][-1] for r in table[name + suffix].values()])
            H = final.size(-1)                                        # final: (n_seeds, N, H)
            for h in range(H):
                label = f"{name} (one head)" if H == 1 else f"{name} head {h}"
                if H > 1 and not suffix:  # aligned: the first H/2 heads read the a-half
                    label += f" ({'a' if h < H // 2 else 'b'}-half)"
                bars.append((label, final[..., h]))
        width = 0.8 / max(1, len(bars))
        for k, (label, values) in enumerate(bars):
            spread = values.std(0) if values.size(0) > 1 else None
            ax.bar([n + (k - (len(bars) - 1) / 2) * width for n in range(len(labels))],
                   values.mean(0).tolist(), width, yerr=None if spread is None else spread.tolist(),
                   capsize=2, label=label)
        ax.set_xticks(range(len(labels)), labels, fontsize=8)
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("mean α at the final site")
    steps, d, seeds = results[0]["steps"], results[0]["d"], len(table["attnres"])
    fig.suptitle(f"(a_t, b_(t-2)) with frozen codes: d {d}, {steps} steps, mean of {seeds} seeds",
                 fontsize=9)
    write_atomically(path, lambda f: fig.savefig(f, format="png", dpi=FIGURE_DPI))
    plt.close(fig)


# %%
# The command line.

def positive(text):
    """An argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, not {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def seed_list(text):
    """An argparse type: distinct integers separated by commas."""
    try:
        seeds = [int(s) for s in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be integers separated by commas, e.g. 0,1,2; "
                                         f"not {text!r}") from None
    if len(set(seeds)) < len(seeds):
        raise argparse.ArgumentTypeError(f"lists a seed twice: {text!r}")
    return seeds


def parse_args(argv=None):
    title, examples = __doc__.split("\n\n")[:2]
    p = FlagParser(prog="compromise.py", description=title.strip(), epilog=examples,
              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d", type=positive, default=64,
                   help="model width: a multiple of 8, at least 32 (default 64)")
    p.add_argument("--heads", type=positive, default=2,
                   help="MHAR's routing heads: even, dividing --d (default 2)")
    p.add_argument("--seeds", type=seed_list, default=[0, 1, 2],
                   help="paired seeds, separated by commas (default 0,1,2)")
    p.add_argument("--steps", type=positive, default=250, help="training steps (default 250)")
    p.add_argument("--jobs", type=positive, default=2,
                   help="runs trained at a time, one thread each (default 2)")
    p.add_argument("--out_dir", default="runs/compromise",
                   help="where results.json and depth_maps.png go (default runs/compromise)")
    args = p.parse_args(argv)
    if args.d < 2 * SIDE or args.d % 8:
        p.error(f"--d {args.d}: use a multiple of 8 of at least {2 * SIDE} (each half holds "
                f"{SIDE} orthonormal codes; 4 attention heads need an even width)")
    if args.heads % 2 or args.d % args.heads:
        p.error(f"--heads {args.heads}: use an even number that divides --d {args.d}, so that "
                f"each head's slice lies within one half of the width")
    return args


PROBE_BYTES = 64 * 1024  # about what a run writes (results.json ~20 KB, depth_maps.png ~40 KB)


def check_writable(folder):
    """MachineError now, not after the training, when files cannot be written into `folder` (a
    read-only file system, a full disk): a file of PROBE_BYTES is written there, flushed to disk and
    removed, and so are the folders made for it (a run stopped later leaves nothing behind). A disk
    that fills up during the training is found at the end, where nothing is written half."""
    created = [d for d in (folder, *folder.parents) if not d.exists()]  # deepest first
    probe = folder / f".probe-{os.getpid()}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(bytes(PROBE_BYTES))
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise MachineError(f"cannot write into {folder} ({e.strerror or one_line(e)}), found "
                           f"before training: free some space or write elsewhere") from None
    finally:
        with suppress(OSError):
            probe.unlink()
        remove_staging(None, created)


def write_results(out_dir, args, results):
    """results.json and depth_maps.png moved into out_dir together (common.staged): both whole,
    or neither. Returns the paths written."""
    plt = pyplot()
    if plt is None:
        print("depth_maps.png not drawn: pip install matplotlib")
    text, names = json.dumps(dict(args=vars(args), runs=results), indent=1), ["results.json"]
    with staged(out_dir) as tmp:
        write_atomically(tmp / "results.json", lambda f: f.write(text.encode()))
        if plt is not None:
            plot_depth_maps(plt, results, tmp / "depth_maps.png")
            names.append("depth_maps.png")
    return [out_dir / name for name in names]


def run(args, written):
    """The whole experiment: the folder checked, every run trained, the table printed, the files
    written (their paths appended to `written`). Returns the results."""
    out_dir = output_folder(args.out_dir, "--out_dir")
    check_writable(out_dir)
    torch.set_num_threads(1)
    runs = [dict(method=m, seed=s, d=args.d, heads=args.heads, steps=args.steps)
            for s in args.seeds for m in METHODS]
    print(f"compromise.py: {len(METHODS)} methods x {len(args.seeds)} seeds, d {args.d}, "
          f"H {args.heads}, {args.steps} steps, {min(args.jobs, len(runs))} at a time", flush=True)
    finished, began = 0, time.monotonic()

    def done(r):
        nonlocal finished
        finished += 1
        print(f"[{finished:>2}/{len(runs)}] {r['method']:<16} seed {r['seed']}: val loss "
              f"{r['val_loss']:.4f}, accuracy {r['val_accuracy']:.1%} ({duration(r['seconds'])}; "
              f"{progress(finished, len(runs), time.monotonic() - began)})", flush=True)

    def waiting():  # on a busy machine a run can take minutes: say that they go on
        going = min(args.jobs, len(runs) - finished)
        print(f"     {going} run{'s' if going > 1 else ''} under way "
              f"({progress(finished, len(runs), time.monotonic() - began)}; "
              f"{duration(time.monotonic() - began)} so far)", flush=True)
    results = run_all(runs, min(args.jobs, len(runs)), done, waiting)
    print(report(results))
    with signals_held():  # a second or two: a stop meanwhile waits until both files are whole
        written.extend(write_results(out_dir, args, results))
    return results


def main(argv=None):
    args = parse_args(argv)
    written = []
    try:
        with sigterm_as_interrupt():
            results = run(args, written)
    except UserError as e:  # --out_dir is a file
        exit_error("compromise.py", str(e))
    except MachineError as e:  # a read-only folder, a full disk
        exit_error("compromise.py", str(e), status=1)
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM (interrupt): every worker stopped
        name = str(e) or "SIGINT"
        kept = (f" after {' and '.join(map(str, written))} had been written whole" if written
                else ": nothing written; the same command runs it again from the start")
        exit_error("compromise.py", f"interrupted ({name}){kept}",
                   status=128 + signal.Signals[name])
    print("wrote " + ", ".join(map(str, written)))
    return results


if __name__ == "__main__":
    main()
