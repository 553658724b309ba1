"""
Look at what the routing learned, and compare training runs.

    python -m scripts.probe --ckpt out/ckpt.pt                           # depth maps and head deviations -> out/probe/
    python -m scripts.probe --ckpt runs/attnres/ckpt.pt --slices 4       # AttnRes (H = 1): the width-disagreement probe
    python -m scripts.probe --logs runs/baseline runs/attnres runs/mhar --out runs/probe    # loss curves, one line per run
    python -m scripts.probe --ckpt out/ckpt.pt --data data/pystdlib --batches 8 --batch_size 8 --null_draws 64 --seed 0

The routing is read on --batches batches of --batch_size sequences of the model's seq_len tokens: train.py's
fixed validation batches of --data (default: the checkpoint's training data), or random tokens when the
data is synthetic or missing (with a note). A --data folder whose tokenizer (its meta.json) differs from
the one of the model's training data is refused: the same ids would be other tokens to the model. Bad
input (a missing or foreign checkpoint, such data, an absent --device) is one line on stderr, exit 2.
It measures, for attnres and mhar checkpoints:

1. Depth maps. At site j (in front of sublayer j, or the final norm) head h reads source n with weight
   α[n, h] (a softmax over the site's sources); averaged over the probed tokens this gives a
   sites x sources map per head. Rows are padded with NaN (null in JSON) past a site's sources.
2. Head deviations. Each head's map minus the mean map over the heads: the paper's evidence that heads
   route differently. The statistic is the mean |deviation| over the entries of sites with >= 2 sources,
   per head; it is compared with a null in which every site's trained query is replaced by a random
   query of the same norm (--null_draws draws per site, seeded by --seed, the same for every batch),
   read from the same sources with the same norm weight.
3. Width disagreement (single-head checkpoints, H = 1, e.g. attnres). Split the trained query q into
   --slices contiguous slices; slice s prefers p_s = softmax_n <q_[s], (RMSNorm(s_n) * g)_[s]> (the RMS
   over the full width, as in the route), while the site reads the shared α = softmax_n <q, RMSNorm(s_n) * g>.
   The probe is the mean over tokens and slices of KL(p_s || α), against the same matched-norm null; and
   the collinearity of the sources, the mean pairwise cosine of s_0..s_j over pairs and tokens (read for
   every routed checkpoint).
4. Loss curves of one or several runs (--logs DIR..., each with train.py's log.jsonl): the train loss
   (a centered moving average over ~10% of its points) and the validation loss, one colour per run,
   labelled by its folder and residual mode.
   With --ckpt alone the checkpoint's own run is drawn when its folder holds a log.jsonl.

baseline and hyper checkpoints have no routing: probe.json says so, and the loss curves still work.

Writes to --out (default <checkpoint folder>/probe, or ./probe with --logs alone):
    probe.json              the summary below
    depth_map.png           one heatmap per head and the head average
    head_deviation.png      H > 1: each pair of heads' distance against the null, and the deviation per site
    width_disagreement.png  H = 1: KL per site against the null, and the collinearity per site
    loss_curves.png         --logs (or the checkpoint's own log.jsonl)
The figures need matplotlib (pip install matplotlib); without it probe.json is still written.

probe.json (S = 2L + 1 sites, N = the most sources one site reads, H = routing heads, D = --null_draws):
    checkpoint, step            the checkpoint probed and its training step
    config                      its mhar.Config, as a dict
    residual, heads             its residual mode and routing heads H (0 without routing)
    notes                       list of strings: what to keep in mind (random tokens, no routing, ...)
    figures                     list of the PNG files written (empty without matplotlib)
    runs                        with --logs: per run {label, path, steps, final_train_loss, final_val_loss,
                                best_val_loss}
  routed checkpoints only:
    data                        the val.bin folder read, or "random tokens"
    tokens                      number of tokens probed (batches x batch_size x seq_len)
    batches, batch_size, seq_len, null_draws, seed, slices
    sites                       S site names ("attn 0", "mlp 0", ..., "final")
    sources                     S lists: the names of the sources each site reads ("emb" = s_0, "attn 0" = the
                                output of block 0's attention, "s1+s2" = a block sum, "null" = delta's null source)
    sources_per_site            S integers N_j
    query_norm                  S floats: |q_j| of the queries the sites route with (q / route_temperature)
    null_query_norm             S floats: the mean norm of the null's random queries (equal to query_norm)
    gates                       S floats, delta routing only: the per-site gates a
    depth_map                   S x N x H: token-averaged α; every site's row sums to 1 per head; null padding
    depth_map_mean              S x N: the head average
    collinearity                {per_site: S floats (null for one source), mean: over sites with >= 2 sources}
    head_deviation              H > 1 only:
        deviation               S x N x H: depth_map minus its head average
        per_site                S floats: mean |deviation| over the site's sources and heads
        null_per_site_mean      S floats: the same for the null, mean over draws
        null_per_site_std       S floats: its standard deviation over draws
        per_head                {mean_abs, null_mean, null_std, z, null_frac_above}: H floats each
        per_pair                {pairs, distance, null_mean, null_std, z, null_frac_above}: P = H(H-1)/2 pairs
                                (h, h') and P floats each: mean |α_h − α_h'| over sites with >= 2 sources
        overall                 the same as scalars, over all heads
    width_disagreement          H = 1 only:
        kl_per_site             S floats: mean KL(slice || shared α) at each site (null for one source)
        kl_per_slice            --slices floats: the mean over sites with >= 2 sources, per slice
        null_per_site_mean      S floats; null_per_site_std  S floats
        kl_mean, null_mean, null_std, z, null_frac_above   over the sites with >= 2 sources
  The null comparisons: z = (observed - null_mean) / null_std (null when the null has no spread, e.g. zero
  queries); null_frac_above = the fraction of null draws whose statistic is >= the observed one (small: the
  trained routing is unlike random routing of the same sharpness).
"""
import os

INTERRUPTED = b"probe.py: error: interrupted (Ctrl-C); nothing written\n"
try:  # the script's first instruction: a Ctrl-C until the files begin is this line at once (interrupts.py)
    from lib import interrupts
    interrupts.guard(__name__, INTERRUPTED)
except KeyboardInterrupt:  # one in the microseconds before
    os.write(2, INTERRUPTED)
    os._exit(130)

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

import mhar  # noqa: E402
from lib.common import (FlagParser, MachineError, UserError, exit_error, ignore_stop_signals,  # noqa: E402
                        load_model, output_folder, pick_device, read_tokens, sample_rows, staged,
                        training_data)
from lib import rivals  # noqa: E402
from lib.common import seed as SEED  # noqa: E402

FIGURE_DPI = 110  # README-sized PNGs (tens of KB)


# ----------------------------------------------------------------------------------------------
# The measurements: pure functions of tensors.

def depth_map(alphas):
    """Token-averaged routing weights (S, N, H) from the sites' α [(N_j, B, T, H)], NaN past a site's N_j."""
    N, H = max(a.shape[0] for a in alphas), alphas[0].shape[-1]
    out = torch.full((len(alphas), N, H), float("nan"))
    for j, alpha in enumerate(alphas):
        out[j, :alpha.shape[0]] = alpha.float().mean((1, 2)).cpu()
    return out


def head_deviation(maps):
    """Each head's depth map minus the mean over heads: (..., S, N, H) -> (..., S, N, H), NaN kept."""
    return maps - maps.mean(-1, keepdim=True)


def mean_abs_deviation(deviation):
    """Mean |deviation| per head over the entries of sites with >= 2 sources: (..., S, N, H) -> (..., H).

    A site with one source reads it with weight 1 in every head; its zero deviation says nothing.
    """
    valid = ~deviation.isnan()
    valid &= valid.sum(-2, keepdim=True) >= 2
    return torch.where(valid, deviation.abs(), 0.0).sum((-3, -2)) / valid.sum((-3, -2))


def head_pairs(heads):
    """The pairs of heads (h, h'), h < h': [(0, 1), (0, 2), ..., (H - 2, H - 1)]; none for one head."""
    return [(h, k) for h in range(heads) for k in range(h + 1, heads)]


def pair_distance(maps):
    """How far apart each pair of heads routes: mean |α_h − α_h'| over the entries of sites with >= 2
    sources, (..., S, N, H) -> (..., P), pairs in head_pairs order. Each head's deviation from the head
    mean cannot tell heads apart at H = 2 (the two deviations are opposite, equal in size); a pair's
    distance is what differs between heads at any H."""
    pairs = head_pairs(maps.shape[-1])
    first, second = [h for h, _ in pairs], [k for _, k in pairs]
    return mean_abs_deviation(maps[..., first] - maps[..., second])


def null_queries(q, draws, generator):
    """`draws` random queries (draws, d), uniform in direction, each with exactly the norm of q."""
    u = torch.randn(draws, q.numel(), generator=generator, dtype=torch.float64)
    return (u / u.norm(dim=1, keepdim=True) * q.double().norm()).to(q.dtype)


def slice_disagreement(q, g, sources, slices=4, eps=1e-6):
    """The width-disagreement probe at one single-head site: (mean KL, KL per slice (slices,)).

    Slice s of q prefers p_s = softmax_n <q_[s], k_n,[s]>, with k_n = RMSNorm(sources_n) * g over the full
    width; the site reads α = softmax_n <q, k_n>. Returns the mean over tokens of KL(p_s || α), averaged over
    slices and per slice. Those are route_weights with `slices` heads and with one head.
    """
    d = sources.shape[-1]
    if d % slices:
        raise ValueError(f"--slices {slices} does not divide the width d={d}: choose a divisor of {d}")
    p = mhar.route_weights(sources, q, g, slices, eps)                        # (N, B, T, slices)
    alpha = mhar.route_weights(sources, q, g, 1, eps)                         # (N, B, T, 1)
    tiny = torch.finfo(alpha.dtype).tiny  # a weight that underflowed to 0 would give log 0
    kl = (torch.xlogy(p, p) - p * alpha.clamp_min(tiny).log()).sum(0)         # (B, T, slices)
    per_slice = kl.mean((0, 1))
    return per_slice.mean(), per_slice


def collinearity(sources):
    """Mean pairwise cosine of the sources (N, B, T, d) over pairs n < m and tokens; NaN for one source."""
    N = sources.shape[0]
    if N < 2:
        return torch.full((), float("nan"), device=sources.device)
    unit = torch.nn.functional.normalize(sources.float(), dim=-1)
    cos = torch.einsum("nbtd,mbtd->bnm", unit, unit)                          # (B, N, N): summed over tokens
    pairs = torch.triu_indices(N, N, offset=1)
    return cos[:, pairs[0], pairs[1]].sum() / (pairs.shape[1] * sources.shape[1] * sources.shape[2])


def against_null(observed, null):
    """How a statistic (...) compares with its null draws (D, ...): their mean and std, z, the fraction >= it."""
    null_mean, null_std = null.mean(0), null.std(0) if null.shape[0] > 1 else torch.zeros_like(null[0])
    return dict(null_mean=null_mean, null_std=null_std, z=(observed - null_mean) / null_std,
                null_frac_above=(null >= observed).double().mean(0))


# ----------------------------------------------------------------------------------------------
# Reading a model's sites.

def site_labels(config):
    """Names of the 2L + 1 sites: the sublayer each one feeds, then the final norm."""
    return [f"{'attn' if j % 2 == 0 else 'mlp'} {j // 2}" for j in range(2 * config.n_layer)] + ["final"]


def source_labels(config):
    """The names of the sources each site reads, in the order of its α (DepthHistory's order)."""
    S = config.route_block

    def span(lo, hi):  # the sum of sublayer outputs s_lo..s_hi (s_i is sublayer i - 1's output)
        if lo == hi:
            return f"{'attn' if (lo - 1) % 2 == 0 else 'mlp'} {(lo - 1) // 2}"
        return f"s{lo}+s{hi}" if hi == lo + 1 else f"s{lo}..s{hi}"

    labels = []
    for j in range(2 * config.n_layer + 1):  # site j has seen s_0..s_j
        completed, partial = j // S, j % S
        names = ["emb"] + [span(b * S + 1, (b + 1) * S) for b in range(completed)]
        if config.delta:
            names = ["null"] + names
        elif partial:
            names.append(span(completed * S + 1, j))
        labels.append(names)
    return labels


@torch.no_grad()
def read_sites(model, idx, visit):
    """One forward pass of a routed model; visit(j, V, q, g) sees site j's sources V (N_j, B, T, d) as it routes."""
    site = itertools.count()
    model.hidden(idx, visit=lambda V, q, g: visit(next(site), V, q, g))


def probe_routing(model, batches, null_draws=32, slices=4, seed=0):
    """Every measurement of a routed model over a list of token batches (B, T) -> a dict of tensors."""
    config, H, eps = model.config, model.config.depth_heads, model.config.norm_eps
    generator = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    # the queries the sites route with (q / route_temperature), and the null's: drawn once per site from
    # them and reused for every batch, D fixed alternative routings
    routed = [site.query.detach().float().cpu() / config.route_temperature for site in model.sites]
    queries = [null_queries(q, null_draws, generator).to(device) for q in routed]
    n_sites = len(model.sites)
    maps, null_maps, cos, kl, kl_slices, null_kl = [], [], [], [], [], []
    for idx in batches:
        alphas, nulls = [None] * n_sites, [[None] * n_sites for _ in range(null_draws)]
        batch_cos, batch_kl, batch_kl_slices, batch_null_kl = [], [], [], []

        def visit(j, V, q, g):
            alphas[j] = mhar.route_weights(V, q, g, H, eps)                    # (N, B, T, H)
            batch_cos.append(collinearity(V))
            if H > 1:
                for draw, qn in enumerate(queries[j]):  # token-averaged at once: (N, 1, 1, H)
                    nulls[draw][j] = mhar.route_weights(V, qn, g, H, eps).mean((1, 2), keepdim=True)
            else:
                mean, per_slice = slice_disagreement(q, g, V, slices, eps)
                batch_kl.append(mean)
                batch_kl_slices.append(per_slice)
                batch_null_kl.append(torch.stack([slice_disagreement(qn, g, V, slices, eps)[0]
                                                  for qn in queries[j]]))

        read_sites(model, idx, visit)
        maps.append(depth_map(alphas))
        cos.append(torch.stack(batch_cos).cpu())
        if H > 1:
            null_maps.append(torch.stack([depth_map(draw) for draw in nulls]))
        else:
            kl.append(torch.stack(batch_kl).cpu())
            kl_slices.append(torch.stack(batch_kl_slices).cpu())
            null_kl.append(torch.stack(batch_null_kl).cpu())
    # every batch has B x T tokens, so the mean over batches is the mean over all tokens
    out = dict(depth_map=torch.stack(maps).mean(0), collinearity=torch.stack(cos).mean(0),
               query_norm=torch.stack([q.norm() for q in routed]),
               null_query_norm=torch.stack([qs.float().norm(dim=1).mean() for qs in queries]).cpu(),
               sources_per_site=[int(n) for n in (~maps[0][:, :, 0].isnan()).sum(1)])
    if H > 1:
        out["null_depth_map"] = torch.stack(null_maps).mean(0)                  # (D, S, N, H)
    else:
        out["kl_per_site"] = torch.stack(kl).mean(0)                            # (S,)
        out["kl_per_site_slice"] = torch.stack(kl_slices).mean(0)               # (S, slices)
        out["null_kl"] = torch.stack(null_kl).mean(0)                           # (S, D)
    if config.delta:
        out["gates"] = torch.stack([site.gate.detach().float() for site in model.sites]).cpu()
    return out


def summarize(measured, config):
    """probe_routing's tensors -> the JSON fields of the module docstring."""
    H, multi = config.depth_heads, torch.tensor(measured["sources_per_site"]) >= 2
    cos = measured["collinearity"]
    out = dict(sites=site_labels(config), sources=source_labels(config),
               sources_per_site=measured["sources_per_site"],
               query_norm=measured["query_norm"], null_query_norm=measured["null_query_norm"],
               depth_map=measured["depth_map"], depth_map_mean=measured["depth_map"].mean(-1),
               collinearity=dict(per_site=cos, mean=cos[multi].mean()))
    if "gates" in measured:
        out["gates"] = measured["gates"]
    if H > 1:
        deviation, null_deviation = head_deviation(measured["depth_map"]), head_deviation(measured["null_depth_map"])
        per_site, null_per_site = deviation.abs().nanmean((-2, -1)), null_deviation.abs().nanmean((-2, -1))
        per_head, null_per_head = mean_abs_deviation(deviation), mean_abs_deviation(null_deviation)   # (H,), (D, H)
        per_pair, null_per_pair = pair_distance(measured["depth_map"]), pair_distance(measured["null_depth_map"])
        out["head_deviation"] = dict(
            deviation=deviation, per_site=per_site,
            null_per_site_mean=null_per_site.mean(0), null_per_site_std=null_per_site.std(0),
            per_head=dict(mean_abs=per_head, **against_null(per_head, null_per_head)),
            per_pair=dict(pairs=head_pairs(H), distance=per_pair, **against_null(per_pair, null_per_pair)),
            overall=dict(mean_abs=per_head.mean(), **against_null(per_head.mean(), null_per_head.mean(-1))))
    else:
        kl, null_kl = measured["kl_per_site"], measured["null_kl"]                                      # (S,), (S, D)
        out["width_disagreement"] = dict(
            kl_per_site=torch.where(multi, kl, float("nan")),
            kl_per_slice=measured["kl_per_site_slice"][multi].mean(0),
            null_per_site_mean=torch.where(multi, null_kl.mean(1), float("nan")),
            null_per_site_std=torch.where(multi, null_kl.std(1), float("nan")),
            kl_mean=kl[multi].mean(), **against_null(kl[multi].mean(), null_kl[multi].mean(0)))
    return out


# ----------------------------------------------------------------------------------------------
# Data and logs.

def validation_batches(ckpt, data, batches, batch_size, seq_len, vocab_size):
    """(list of (B, T) token batches, what was read, notes): train.py's fixed validation batches i = 0, 1, ...

    data: a prepare.py folder, "synthetic", or None for the checkpoint's own training data. A folder tokenized
    otherwise than the model's training data is refused: its ids would mean other tokens to the model.
    """
    notes = []
    trained_on, trained_meta = training_data(ckpt)
    if data and data != "synthetic" and not (Path(data) / "val.bin").is_file():
        raise UserError(f"--data {data}: no val.bin there; give a prepare.py folder, 'synthetic', or "
                        f"leave --data out for the checkpoint's own data")
    data = data or trained_on
    tokens, source = None, "random tokens"
    if data == "synthetic":
        notes.append("the data is synthetic: the routing was read on uniform random tokens")
    elif not (Path(data) / "val.bin").is_file():
        notes.append(f"no val.bin in {data}: the routing was read on uniform random tokens (pass --data DIR)")
    else:
        files = read_tokens(data, splits=("val",))
        if trained_meta and tokenizer_of(files.meta) != tokenizer_of(trained_meta):
            raise UserError(f"{data} is tokenized with {describe(files.meta)} but the model was trained on "
                            f"{trained_on}, tokenized with {describe(trained_meta)}: pass --data {trained_on}, "
                            f"or a folder prepared with the same tokenizer")
        if files.meta.get("vocab_size", 0) > vocab_size:
            raise UserError(f"{data} has a vocabulary of {files.meta['vocab_size']} tokens, more than the "
                            f"model's {vocab_size}: pass the --data the model was trained on")
        if trained_on == "synthetic":
            notes.append(f"the model was trained on uniform random tokens (--data synthetic), read here on "
                         f"{data}")
        elif not trained_meta and Path(data).resolve() != Path(trained_on).resolve():
            notes.append(f"the model was trained on {trained_on}, whose meta.json is not here: probe.py could "
                         f"not check that {data} has the same tokenizer")
        tokens, source = files.val, str(data)
        if len(tokens) <= seq_len + 1:
            raise UserError(f"{data}/val.bin has {len(tokens)} tokens, fewer than one sequence of {seq_len}")
    rows = [sample_rows(tokens, ("val", i), batch_size, 0, batch_size, seq_len, vocab_size)[:, :seq_len]
            for i in range(batches)]
    return rows, source, notes


def tokenizer_of(meta):
    """What identifies the tokenizer of a prepare.py folder: its name, its vocabulary, the hash of its
    tokenizer.json (prepare.py --tokenizer), and the end-of-text id."""
    return tuple(meta.get(k) for k in ("tokenizer", "vocab_size", "tokenizer_sha256", "eot"))


def describe(meta):
    return f"{meta.get('tokenizer', 'an unnamed tokenizer')} ({meta.get('vocab_size', '?')} ids)"


def read_log(path):
    """The entries of a train.py log.jsonl (a folder holding one, or the file itself)."""
    path = Path(path)
    path = path / "log.jsonl" if path.is_dir() else path
    if not path.is_file():
        raise ValueError(f"no log.jsonl at {path}: pass run folders written by train.py --out_dir")
    entries, lines = [], path.read_bytes().decode(errors="replace").splitlines()
    for n, line in enumerate(lines, 1):
        if line.strip():
            try:
                entries.append(json.loads(line))
            except json.JSONDecodeError:
                if n == len(lines):  # half-written (a crash, a full disk): train.py --resume drops it too
                    break
                raise ValueError(f"{path} line {n} is not JSON: is it train.py's log.jsonl?") from None
    return entries


def run_label(path):
    """A run's legend: its folder name and residual mode (from train.py's config.json), e.g. 'run3 (mhar, H=2)';
    the mode is left out when the folder is named after it: 'mhar (H=2)', 'baseline'."""
    folder = Path(path) if Path(path).is_dir() else Path(path).parent
    name = folder.resolve().name
    try:
        config = rivals.config_of({**json.loads((folder / "config.json").read_text())["config"], "fused": False})
    except (OSError, KeyError, TypeError, ValueError):  # no config.json, or not train.py's
        return name
    parts = ([] if config.residual in name else [config.residual]) + ([f"H={config.depth_heads}"] if config.routed else [])
    return name + (f" ({', '.join(parts)})" if parts else "")


def smooth(values, window):
    """Centered moving average over `window` (odd) points: no lag on a falling curve. Only where the whole window
    fits: the first and last window // 2 points have no smoothed value (len(values) - window + 1 values)."""
    return [sum(values[i:i + window]) / window for i in range(len(values) - window + 1)]


def summarize_runs(runs):
    out = []
    for path, label, log in runs:
        train_log, val_log = [e for e in log if "loss" in e], [e for e in log if "val_loss" in e]
        out.append(dict(label=label, path=str(path), steps=max((e["step"] for e in log), default=0),
                        final_train_loss=train_log[-1]["loss"] if train_log else None,
                        final_val_loss=val_log[-1]["val_loss"] if val_log else None,
                        best_val_loss=min((e["val_loss"] for e in val_log), default=None)))
    return out


# ----------------------------------------------------------------------------------------------
# Figures (matplotlib is optional).

def pyplot():
    """matplotlib.pyplot on the file-only Agg backend, or None when matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def plot_depth_map(plt, summary, path, title):
    maps = summary["depth_map"]                                                # (S, N, H)
    H = maps.shape[-1]
    panels = [(maps[..., h], f"head {h}") for h in range(H)] + ([(maps.mean(-1), "head average")] if H > 1 else [])
    S, N = maps.shape[:2]
    fig, axes = plt.subplots(1, len(panels), figsize=(0.4 * N * len(panels) + 1.6, 0.32 * S + 1.6), squeeze=False,
                             constrained_layout=True)
    cmap = plt.get_cmap("viridis").with_extremes(bad="white")  # white: sources a site does not read
    longest = max(summary["sources"], key=len)  # one label per column when every site reads a prefix of it
    aligned = all(names == longest[:len(names)] for names in summary["sources"])
    xlabels = longest if aligned else [str(n) for n in range(N)]
    for ax, (values, name) in zip(axes[0], panels):
        image = ax.imshow(values.numpy(), cmap=cmap, vmin=0, vmax=float(np.nanmax(maps.numpy())), aspect="auto")
        ax.set_title(name)
        ax.set_xticks(range(N), xlabels, rotation=90, fontsize=7)
        ax.set_yticks(range(S), summary["sites"] if ax is axes[0, 0] else [""] * S, fontsize=7)
        ax.set_xlabel("source" if aligned else "source n (names in probe.json)")
    axes[0, 0].set_ylabel("site")
    fig.colorbar(image, ax=axes[0, -1], label="mean α")
    fig.suptitle(title, fontsize=9)
    fig.savefig(path, dpi=FIGURE_DPI)
    plt.close(fig)


def plot_head_deviation(plt, summary, path, title):
    """Left: how far apart each pair of heads routes (at H = 2 the one pair), against random queries of
    the same norm; right: the heads' deviation from their mean, site by site. One legend, below both."""
    dev = summary["head_deviation"]
    per_pair = dev["per_pair"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.8), layout="constrained")
    pairs = np.arange(len(per_pair["pairs"]))
    left.bar(pairs - 0.2, per_pair["distance"].numpy(), 0.4, label="trained queries")
    left.bar(pairs + 0.2, per_pair["null_mean"].numpy(), 0.4, yerr=2 * per_pair["null_std"].numpy(),
             color="grey", label="random queries of the same norm (±2 std)")
    left.set_xticks(pairs, [f"heads {h}, {k}\nz={z:.1f}" for (h, k), z in zip(per_pair["pairs"],
                                                                             per_pair["z"].tolist())],
                    fontsize=7 if len(pairs) > 6 else None, rotation=90 if len(pairs) > 6 else 0)
    left.set_xlim(-0.8, len(pairs) - 0.2)
    left.set_ylabel("mean |α_h − α_h'| (sites with ≥ 2 sources)")
    sites = np.arange(len(summary["sites"]))
    mean, std = dev["null_per_site_mean"].numpy(), dev["null_per_site_std"].numpy()
    right.plot(sites, dev["per_site"].numpy(), "o-")
    right.plot(sites, mean, "-", color="grey")
    right.fill_between(sites, np.maximum(mean - 2 * std, 0), mean + 2 * std, color="grey", alpha=0.3)
    right.set_xticks(sites, summary["sites"], rotation=90, fontsize=7)
    right.set_ylabel("mean |α_h − mean over heads| at the site")
    fig.legend(*left.get_legend_handles_labels(), loc="outside lower center", ncols=2, fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.savefig(path, dpi=FIGURE_DPI)
    plt.close(fig)


def plot_width_disagreement(plt, summary, path, title):
    wd = summary["width_disagreement"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4), constrained_layout=True)
    sites = np.arange(len(summary["sites"]))
    mean, std = wd["null_per_site_mean"].numpy(), wd["null_per_site_std"].numpy()
    left.plot(sites, wd["kl_per_site"].numpy(), "o-", label=f"trained query (z={wd['z']:.1f})")
    left.plot(sites, mean, "-", color="grey", label="random query, same norm (±2 std)")
    left.fill_between(sites, np.maximum(mean - 2 * std, 0), mean + 2 * std, color="grey", alpha=0.3)
    left.set_ylabel("mean KL(slice ‖ shared α)")
    right.plot(sites, summary["collinearity"]["per_site"].numpy(), "o-")
    right.set_ylabel("mean pairwise cosine of the sources")
    for ax in (left, right):
        ax.set_xticks(sites, summary["sites"], rotation=90, fontsize=7)
    left.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.savefig(path, dpi=FIGURE_DPI)
    plt.close(fig)


def plot_loss_curves(plt, runs, path):
    """Left: whole runs (train loss smoothed over ~10% of its points, the raw points faint; validation loss as
    dots). Right: the second half, smoothed, where methods separate. One legend entry a run, below both, the
    figure as much taller as its rows (a comparison of 30 runs had its legend cover the plot)."""
    columns = 5
    rows = -(-len(runs) // columns)
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8 + 0.2 * rows), layout="constrained")
    last = max((e["step"] for _, _, log in runs for e in log), default=1)
    late = []  # the values drawn in the second half, for its y-range
    for i, (_, label, log) in enumerate(runs):
        color = f"C{i}"
        train_log, val_log = [e for e in log if "loss" in e], [e for e in log if "val_loss" in e]
        steps, loss = [e["step"] for e in train_log], [e["loss"] for e in train_log]
        window = 2 * (len(loss) // 20) + 1
        smoothed, smoothed_steps = smooth(loss, window), steps[window // 2:len(steps) - window // 2]
        val_steps, val_loss = [e["step"] for e in val_log], [e["val_loss"] for e in val_log]
        axes[0].plot(steps, loss, color=color, alpha=0.15, linewidth=0.6)
        for ax in axes:
            ax.plot(smoothed_steps, smoothed, color=color, label=label if ax is axes[0] else None)
            ax.plot(val_steps, val_loss, "o--", color=color, markersize=4, linewidth=0.8)
        late += [v for step, v in zip(smoothed_steps + val_steps, smoothed + val_loss)
                 if step >= last / 2 and math.isfinite(v)]
    if late:
        margin = 0.1 * (max(late) - min(late)) + 0.01
        axes[1].set_xlim(last / 2, last * 1.02)
        axes[1].set_ylim(min(late) - margin, max(late) + margin)
    axes[0].set_title("loss (lines: train, smoothed; dots: validation)")
    axes[1].set_title("second half")
    for ax in axes:
        ax.set_xlabel("step")
    axes[0].set_ylabel("cross-entropy (nats/token)")
    if runs:
        fig.legend(loc="outside lower center", ncols=min(columns, len(runs)), fontsize=7)
    fig.savefig(path, dpi=FIGURE_DPI)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------
# The command line.

def jsonable(x):
    """Tensors to (nested) lists, NaN and infinities to null: strict JSON."""
    if isinstance(x, torch.Tensor):
        x = x.tolist()
    if isinstance(x, dict):
        return {k: jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def probe(args):
    """Run the probe for parsed arguments; returns the summary (as written to probe.json)."""
    if args.ckpt is None and not args.logs:
        raise ValueError("nothing to probe: pass --ckpt PATH and/or --logs DIR...")
    out_dir = output_folder(args.out or (Path(args.ckpt).parent / "probe" if args.ckpt else "probe"), "--out")
    summary, figures, plt, title = dict(notes=[], figures=[]), [], pyplot(), ""
    if args.ckpt is not None:
        model, ckpt = load_model(args.ckpt, pick_device(args.device))
        config = model.config
        summary.update(checkpoint=str(args.ckpt), step=ckpt.get("step"), config=dataclasses.asdict(config),
                       residual=config.residual, heads=config.depth_heads)
        title = f"{args.ckpt} | {config.residual} H={config.depth_heads} | step {ckpt.get('step')}"
        if not config.routed:
            summary["notes"].append(f"residual={config.residual} has no routing to probe (no sites, no α); "
                                    f"only the loss curves apply")
        else:
            batches, source, notes = validation_batches(ckpt, args.data, args.batches, args.batch_size,
                                                        config.seq_len, config.vocab_size)
            summary["notes"] += notes
            device = next(model.parameters()).device
            measured = probe_routing(model, [b.to(device) for b in batches], args.null_draws, args.slices, args.seed)
            summary.update(data=source, tokens=args.batches * args.batch_size * config.seq_len, batches=args.batches,
                           batch_size=args.batch_size, seq_len=config.seq_len, null_draws=args.null_draws,
                           seed=args.seed, slices=args.slices)
            summary.update(summarize(measured, config))
            title += f" | {summary['tokens']:,} tokens of {source}"
            figures = [("depth_map.png", plot_depth_map), ("head_deviation.png", plot_head_deviation)
                       if config.depth_heads > 1 else ("width_disagreement.png", plot_width_disagreement)]
    logs = args.logs
    if not logs and args.ckpt is not None and (Path(args.ckpt).parent / "log.jsonl").is_file():
        logs = [str(Path(args.ckpt).parent)]
    runs = [(path, run_label(path), read_log(path)) for path in logs or []]
    if runs:
        summary["runs"] = summarize_runs(runs)
    if plt is None and (figures or runs):
        summary["notes"].append("matplotlib is not installed: no figures; pip install matplotlib, then run again")
    interrupts.begin()  # the files begin: a Ctrl-C unwinds through staged(), which removes them
    with staged(out_dir) as tmp:  # every file whole, or none
        if plt is not None:
            for name, plot in figures:
                plot(plt, summary, tmp / name, title)
                summary["figures"].append(name)
            if runs:
                plot_loss_curves(plt, runs, tmp / "loss_curves.png")
                summary["figures"].append("loss_curves.png")
        summary = jsonable(summary)
        (tmp / "probe.json").write_text(json.dumps(summary, indent=1, allow_nan=False))
        # every file is written: probe.py's process is done, and its files move into place whatever signal
        # comes (ignored from here on, its teardown too)
        ignore_stop_signals("probe.py")
    return summary, out_dir


def report(summary, out_dir):
    """A few lines for the terminal."""
    def num(x, spec=".4f"):  # z is null when the null has no spread (e.g. untrained, zero queries)
        return "n/a" if x is None else format(x, spec)

    lines = list(summary["notes"])
    if "tokens" in summary:
        lines.append(f"probed {summary['tokens']:,} tokens of {summary['data']} | sources collinearity "
                     f"{num(summary['collinearity']['mean'], '.3f')}")
    if "head_deviation" in summary:
        o = summary["head_deviation"]["overall"]
        lines.append(f"head deviation {num(o['mean_abs'])} vs random queries of the same norm {num(o['null_mean'])} "
                     f"± {num(o['null_std'])} (z {num(o['z'], '.1f')}, {num(100 * o['null_frac_above'], '.0f')}% "
                     f"of draws above)")
        pair = summary["head_deviation"]["per_pair"]
        lines.extend(f"heads {h}, {k} apart {num(d)} vs random queries {num(m)} ± {num(s)} (z {num(z, '.1f')})"
                     for (h, k), d, m, s, z in zip(pair["pairs"], pair["distance"], pair["null_mean"],
                                                   pair["null_std"], pair["z"]))
    if "width_disagreement" in summary:
        w = summary["width_disagreement"]
        lines.append(f"width disagreement KL {num(w['kl_mean'])} vs random queries of the same norm "
                     f"{num(w['null_mean'])} ± {num(w['null_std'])} (z {num(w['z'], '.1f')}, "
                     f"{num(100 * w['null_frac_above'], '.0f')}% of draws above)")
    for run in summary.get("runs", []):
        val = "" if run["final_val_loss"] is None else (f", val loss {run['final_val_loss']:.4f} "
                                                        f"(best {run['best_val_loss']:.4f})")
        lines.append(f"run {run['label']}: {run['steps']} steps{val}")
    lines.append(f"wrote {out_dir / 'probe.json'}" + "".join(f", {name}" for name in summary["figures"]))
    return "\n".join(lines)


def parse_args(argv=None):
    p = FlagParser(prog="probe.py", description=__doc__.split("\n\n")[0].strip(),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--ckpt", help="a train.py checkpoint to probe (ckpt.pt)")
    a("--logs", nargs="+", metavar="DIR", help="run folders (or log.jsonl files) whose loss curves to draw")
    a("--out", help="output folder (default <checkpoint folder>/probe, or ./probe with --logs alone)")
    a("--data", help="folder with val.bin, or 'synthetic' (random tokens) (default: the checkpoint's training data)")
    a("--batches", type=int, default=4, help="validation batches to probe (default 4)")
    a("--batch_size", type=int, default=8, help="sequences per batch, of the model's seq_len tokens (default 8)")
    a("--null_draws", type=int, default=32, help="random queries per site for the null (default 32)")
    a("--slices", type=int, default=4, help="query slices of the width-disagreement probe, H = 1 only (default 4)")
    a("--seed", type=SEED, default=0, help="seeds the null's random queries, in [0, 2**63 - 1] (default 0)")
    a("--device", default="auto", help="auto (cuda > mps > cpu), cpu, cuda, ... (default auto)")
    args = p.parse_args(argv)
    for flag in ("batches", "batch_size", "null_draws", "slices"):
        if getattr(args, flag) < 1 + (flag == "null_draws"):
            p.error(f"--{flag} must be at least {1 + (flag == 'null_draws')}")
    return args


def main(argv=None):
    try:
        summary, out_dir = probe(parse_args(argv))
    except (UserError, ValueError) as e:
        exit_error("probe.py", str(e))
    except MachineError as e:  # writing the outputs: a full disk, a read-only folder
        exit_error("probe.py", str(e), status=1)
    except KeyboardInterrupt:  # its outputs are staged: none is left half-written
        exit_error("probe.py", "interrupted (Ctrl-C); nothing written", status=130)
    print(report(summary, out_dir))


if __name__ == "__main__":
    try:
        main()
    finally:  # however main ended (--help: argparse exits by itself), a signal is too late: ignored
        ignore_stop_signals("probe.py")
