"""probe.py: the measurements on constructed inputs, then on checkpoints of short train.py runs."""
import dataclasses
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import mhar
import sample
from mhar import GPT
from lib.common import load_model, sample_rows
from helpers import PNG_SIGNATURE, VOCAB, error_line, files_in, one_error_line, run_script
from scripts import probe


def save_untrained(path, data="synthetic", **overrides):
    """A checkpoint in train.py's format of an untrained tiny model (zero routing queries), trained on `data`."""
    torch.manual_seed(0)
    config = mhar.preset("tiny", **{"vocab_size": VOCAB, "seq_len": 32, **overrides})
    torch.save(dict(model=GPT(config).state_dict(), config=dataclasses.asdict(config), args=dict(data=str(data)),
                    step=0), path)
    return path


def run_probe(*argv):
    args = probe.parse_args([*argv, "--batches", "2", "--batch_size", "4", "--null_draws", "8"])
    summary, out_dir = probe.probe(args)
    assert json.loads((out_dir / "probe.json").read_text()) == summary  # strict JSON (no NaN), as returned
    return summary, out_dir


def from_json(values):
    """A JSON array (null = a missing entry) as a float64 tensor with NaN."""
    return torch.from_numpy(np.array(values, dtype=float))


def assert_png(path):
    data = Path(path).read_bytes()
    assert data[:8] == PNG_SIGNATURE and len(data) > 5_000, path


# ----------------------------------------------------------------------------------------------
# The measurements, on constructed inputs.

def test_depth_map_averages_tokens_and_pads_short_sites():
    alphas = [torch.ones(1, 2, 3, 2), torch.rand(3, 2, 3, 2).softmax(0)]
    maps = probe.depth_map(alphas)
    assert maps.shape == (2, 3, 2)
    assert torch.isnan(maps[0, 1:]).all() and maps[0, 0].eq(1).all()
    torch.testing.assert_close(maps[1], alphas[1].mean((1, 2)))
    torch.testing.assert_close(maps.nansum(1), torch.ones(2, 2))


def test_head_deviation_on_hand_made_maps():
    """Three heads, three sites: one source (left out: it says nothing), two sources, three sources."""
    nan = float("nan")
    maps = torch.tensor([[[1.0, 1.0, 1.0], [nan, nan, nan], [nan, nan, nan]],
                         [[1.0, 0.5, 0.0], [0.0, 0.5, 1.0], [nan, nan, nan]],    # heads disagree
                         [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]])   # (S, N, H): each head its own source
    deviation = probe.head_deviation(maps)
    torch.testing.assert_close(deviation[1, :2], torch.tensor([[0.5, 0.0, -0.5], [-0.5, 0.0, 0.5]]))
    assert deviation[1, 2].isnan().all() and deviation[0, 0].eq(0).all()
    torch.testing.assert_close(deviation[2], torch.eye(3) - 1 / 3)
    # per head: |deviation| summed over the 2 + 3 entries of the sites with two and three sources, / 5
    torch.testing.assert_close(probe.mean_abs_deviation(deviation), torch.tensor([1 + 4 / 3, 4 / 3, 1 + 4 / 3]) / 5)
    same = probe.depth_map([torch.rand(4, 2, 3, 1).softmax(0).expand(4, 2, 3, 4)])
    assert probe.mean_abs_deviation(probe.head_deviation(same)).eq(0).all()
    # each pair of heads: |α_h − α_h'| over the same 5 entries: site 1 gives .5 .5 | 1 1 | .5 .5, site 2 1 1 0 each
    assert probe.head_pairs(3) == [(0, 1), (0, 2), (1, 2)]
    torch.testing.assert_close(probe.pair_distance(maps), torch.tensor([3, 4, 3]) / 5)
    assert probe.pair_distance(same).eq(0).all() and probe.pair_distance(same).shape == (6,)


@pytest.mark.parametrize("heads, pairs", [(0, []), (1, []), (2, [(0, 1)]), (4, [(0, 1), (0, 2), (0, 3), (1, 2),
                                                                                  (1, 3), (2, 3)])],
                         ids=["none", "one", "two", "four"])
def test_head_pairs_are_every_pair_once_in_order(heads, pairs):
    assert probe.head_pairs(heads) == pairs


@pytest.mark.parametrize("case", ["zero_query", "identical_sources", "one_source"])
def test_slice_disagreement_is_exactly_zero_when_every_slice_agrees(case):
    torch.manual_seed(0)
    V, q, g = torch.randn(5, 2, 3, 16), torch.randn(16), torch.rand(16) + 0.5
    if case == "zero_query":
        q = torch.zeros(16)
    elif case == "identical_sources":
        V = V[:1].expand(4, -1, -1, -1)
    else:
        V = V[:1]
    kl, per_slice = probe.slice_disagreement(q, g, V, slices=4)
    assert kl.item() == 0.0 and per_slice.eq(0).all()


def test_slice_disagreement_is_positive_when_one_slice_holds_the_query():
    """q lives in slice 0 only: α = p_0 (KL 0) and slices 1-3 prefer uniform, KL(uniform || α) > 0 exactly."""
    torch.manual_seed(0)
    V, g = torch.randn(5, 2, 3, 16), torch.ones(16)
    q = torch.zeros(16)
    q[:4] = 3 * torch.randn(4)
    kl, per_slice = probe.slice_disagreement(q, g, V, slices=4)
    alpha = mhar.route_weights(V, q, g, 1)[..., 0]                                   # (N, B, T)
    uniform_kl = (-math.log(5) - alpha.log().mean(0)).mean()                        # KL(uniform || α)
    assert per_slice[0].abs() < 1e-6 and uniform_kl > 0.01
    torch.testing.assert_close(per_slice[1:], uniform_kl.expand(3))
    torch.testing.assert_close(kl, 3 * uniform_kl / 4)
    with pytest.raises(ValueError, match="slices"):
        probe.slice_disagreement(q, g, V, slices=5)


def test_null_queries_have_the_trained_query_norm():
    q = torch.randn(64) * 3
    nulls = probe.null_queries(q, 100, torch.Generator().manual_seed(0))
    assert nulls.shape == (100, 64)
    torch.testing.assert_close(nulls.norm(dim=1), q.norm().expand(100))
    assert (nulls @ q / q.norm() ** 2).abs().max() < 0.9  # random directions, not q itself
    u = torch.randn(100, 64, generator=torch.Generator().manual_seed(0), dtype=torch.float64)  # the seeded draws
    torch.testing.assert_close(nulls, (u / u.norm(dim=1, keepdim=True) * q.double().norm()).float())
    assert probe.null_queries(torch.zeros(8), 3, torch.Generator()).eq(0).all()


@pytest.mark.parametrize("residual,null", [("mhar", "null_depth_map"), ("attnres", "null_kl")])
def test_the_null_is_one_fixed_set_of_random_queries(residual, null):
    """The null's D random queries per site are drawn once and used on every batch: its statistics over two
    batches are then the mean of those over each batch alone (with queries drawn again per batch, the second
    batch would meet other queries)."""
    torch.manual_seed(0)
    model = GPT(mhar.preset("tiny", residual=residual, vocab_size=VOCAB, seq_len=16)).eval()
    with torch.no_grad():
        for site in model.sites:
            site.query.normal_(0, 1.0)  # the null's queries have the trained queries' norm: zero would hide them
    first, second = torch.randint(0, VOCAB, (2, 2, 16))
    both = probe.probe_routing(model, [first, second], null_draws=4, seed=3)[null]
    alone = [probe.probe_routing(model, [batch], null_draws=4, seed=3)[null] for batch in (first, second)]
    torch.testing.assert_close(both, (alone[0] + alone[1]) / 2, equal_nan=True, rtol=1e-5, atol=1e-7)
    assert not torch.allclose(alone[0], alone[1], equal_nan=True)  # the batches differ, so the test can see it


@pytest.mark.parametrize("residual", ["mhar", "attnres"])
def test_a_models_temperature_is_measured_as_the_queries_it_routes_with(residual):
    """At route_temperature tau every measurement, the null's included, is that of the model at 1 whose queries
    are divided by tau: the null's random queries take the norm of the queries the sites route with."""
    torch.manual_seed(0)
    tempered = GPT(mhar.preset("tiny", residual=residual, vocab_size=VOCAB, seq_len=16, route_temperature=4.0))
    plain = GPT(mhar.preset("tiny", residual=residual, vocab_size=VOCAB, seq_len=16))
    with torch.no_grad():
        for site in tempered.sites:
            site.query.normal_(0, 1.0)
    plain.load_state_dict(tempered.state_dict())
    with torch.no_grad():
        for site in plain.sites:
            site.query.div_(4)
    batch = [torch.randint(0, VOCAB, (2, 16))]
    measured = [probe.probe_routing(m.eval(), batch, null_draws=4, seed=3) for m in (tempered, plain)]
    assert measured[0].keys() == measured[1].keys()
    for key in measured[0]:
        if torch.is_tensor(measured[0][key]):
            torch.testing.assert_close(measured[0][key], measured[1][key], equal_nan=True, msg=key)


def test_collinearity_of_constructed_sources():
    v = torch.randn(1, 2, 3, 8)
    assert probe.collinearity(torch.cat([v, 2 * v, v])).item() == pytest.approx(1.0)
    assert probe.collinearity(torch.cat([v, -v])).item() == pytest.approx(-1.0)
    e = torch.eye(4).view(4, 1, 1, 4).expand(4, 2, 3, 4)
    assert probe.collinearity(e).item() == 0.0
    assert math.isnan(probe.collinearity(v).item())


def test_against_null_on_hand_made_numbers():
    """z and the fraction of null draws at or above the observed value; a tie counts as above."""
    observed = torch.tensor([0.25, 0.0], dtype=torch.float64)
    null = torch.tensor([[0.0, 0.0], [0.125, 0.0], [0.25, 0.0], [0.375, 0.0]], dtype=torch.float64)  # (D, 2)
    out = probe.against_null(observed, null)
    std = math.sqrt((2 * 0.1875 ** 2 + 2 * 0.0625 ** 2) / 3)  # sample std of 0, 1/8, 2/8, 3/8 around 3/16
    torch.testing.assert_close(out["null_mean"], torch.tensor([0.1875, 0.0], dtype=torch.float64))
    torch.testing.assert_close(out["null_std"], torch.tensor([std, 0.0], dtype=torch.float64))
    assert out["z"][0].item() == pytest.approx(0.0625 / std) and math.isnan(out["z"][1].item())  # no spread: no z
    assert out["null_frac_above"].tolist() == [0.5, 1.0]  # 0.25 and 0.375 of the first; every 0 of the second


def test_head_deviation_summary_on_hand_made_numbers():
    """summarize() of an H = 2 model with three sites, from hand-made depth maps and four null draws."""
    config = mhar.preset("tiny", vocab_size=VOCAB, n_layer=1, residual="mhar", route_heads=2)
    nan = float("nan")

    def maps(d):  # site 1's heads read its two sources as 1/2 +- d and 1/2 -+ d; sites 0 and 2 agree
        return torch.tensor([[[1, 1], [nan, nan], [nan, nan]],
                             [[0.5 + d, 0.5 - d], [0.5 - d, 0.5 + d], [nan, nan]],
                             [[0.5, 0.5], [0.25, 0.25], [0.25, 0.25]]], dtype=torch.float64)

    measured = dict(depth_map=maps(0.25), null_depth_map=torch.stack([maps(d) for d in (0, 0.125, 0.25, 0.375)]),
                    sources_per_site=[1, 2, 3], collinearity=torch.tensor([nan, 0.5, 0.25]),
                    query_norm=torch.ones(3), null_query_norm=torch.ones(3))
    dev = probe.summarize(measured, config)["head_deviation"]
    # per head: |d| + |d| over the 2 + 3 entries of sites 1 and 2 -> 2|d| / 5: observed 0.1, null 0, .05, .1, .15
    std = math.sqrt((2 * 0.075 ** 2 + 2 * 0.025 ** 2) / 3)
    for stats in (dev["overall"], *({k: v[h] for k, v in dev["per_head"].items()} for h in range(2))):
        assert float(stats["mean_abs"]) == pytest.approx(0.1)
        assert float(stats["null_mean"]) == pytest.approx(0.075)
        assert float(stats["null_std"]) == pytest.approx(std)
        assert float(stats["z"]) == pytest.approx(0.025 / std)
        assert float(stats["null_frac_above"]) == 0.5  # the draws 0.1 (a tie) and 0.15
    # the one pair: |2d| over the same 5 entries -> 4|d| / 5: observed 0.2; null 0, .1, .2, .3; unlike the
    # per-head deviation, the statistic a figure at H = 2 can show
    pair, std_pair = dev["per_pair"], math.sqrt((2 * 0.15 ** 2 + 2 * 0.05 ** 2) / 3)
    assert pair["pairs"] == [(0, 1)] and float(pair["distance"][0]) == pytest.approx(0.2)
    assert (float(pair["null_mean"][0]), float(pair["null_std"][0])) == pytest.approx((0.15, std_pair))
    assert float(pair["z"][0]) == pytest.approx(0.05 / std_pair) and float(pair["null_frac_above"][0]) == 0.5
    torch.testing.assert_close(dev["per_site"], torch.tensor([0.0, 0.25, 0.0], dtype=torch.float64))
    std = math.sqrt((2 * 0.1875 ** 2 + 2 * 0.0625 ** 2) / 3)
    torch.testing.assert_close(dev["null_per_site_mean"], torch.tensor([0, 0.1875, 0], dtype=torch.float64))
    torch.testing.assert_close(dev["null_per_site_std"], torch.tensor([0, std, 0], dtype=torch.float64))


def test_width_disagreement_summary_on_hand_made_numbers():
    """summarize() of an H = 1 model with three sites; site 0 (one source) is left out of every mean."""
    config = mhar.preset("tiny", vocab_size=VOCAB, n_layer=1, residual="attnres", route_heads=1)
    nan = float("nan")
    null_kl = torch.tensor([[0, 0, 0, 0], [0.25, 0.5, 0.75, 1.0], [0, 0.25, 0.5, 0.25]], dtype=torch.float64)
    measured = dict(depth_map=torch.full((3, 3, 1), 1 / 3, dtype=torch.float64), sources_per_site=[1, 2, 3],
                    kl_per_site=torch.tensor([0, 0.5, 0.25], dtype=torch.float64), null_kl=null_kl,
                    kl_per_site_slice=torch.tensor([[0, 0], [0.25, 0.75], [0.5, 0]], dtype=torch.float64),
                    collinearity=torch.tensor([nan, 0.5, 0.25]), query_norm=torch.ones(3), null_query_norm=torch.ones(3))
    wd = probe.summarize(measured, config)["width_disagreement"]
    # observed: (0.5 + 0.25) / 2 = 0.375; per null draw: 0.125, 0.375, 0.625, 0.625 (mean 0.4375)
    std = math.sqrt((0.3125 ** 2 + 0.0625 ** 2 + 2 * 0.1875 ** 2) / 3)
    assert float(wd["kl_mean"]) == 0.375 and float(wd["null_mean"]) == 0.4375
    assert float(wd["null_std"]) == pytest.approx(std) and float(wd["z"]) == pytest.approx(-0.0625 / std)
    assert float(wd["null_frac_above"]) == 0.75  # 0.375 (a tie), 0.625, 0.625
    torch.testing.assert_close(wd["kl_per_site"], torch.tensor([nan, 0.5, 0.25], dtype=torch.float64), equal_nan=True)
    torch.testing.assert_close(wd["kl_per_slice"], torch.tensor([0.375, 0.375], dtype=torch.float64))
    torch.testing.assert_close(wd["null_per_site_mean"], torch.tensor([nan, 0.625, 0.25], dtype=torch.float64),
                               equal_nan=True)
    std_1, std_2 = math.sqrt(2 * (0.375 ** 2 + 0.125 ** 2) / 3), math.sqrt(2 * 0.25 ** 2 / 3)
    torch.testing.assert_close(wd["null_per_site_std"], torch.tensor([nan, std_1, std_2], dtype=torch.float64),
                               equal_nan=True)


@pytest.mark.parametrize("overrides", [{}, {"route_block": 2}, {"route_block": 3}, {"delta": True, "route_block": 2}],
                         ids=["full", "S2", "S3", "delta"])
def test_source_labels_follow_the_depth_history(overrides):
    config = mhar.preset("tiny", vocab_size=VOCAB, n_layer=3, **overrides)
    alphas = GPT(config).routing_weights(torch.zeros(1, 4, dtype=torch.long))
    labels = probe.source_labels(config)
    assert [len(names) for names in labels] == [a.shape[0] for a in alphas]
    assert len(probe.site_labels(config)) == len(alphas) == 7
    if not overrides:
        assert labels[-1] == ["emb", "attn 0", "mlp 0", "attn 1", "mlp 1", "attn 2", "mlp 2"]


# ----------------------------------------------------------------------------------------------
# probe.py on checkpoints.

def test_probe_mhar_checkpoint(probe_runs, data):
    ckpt_path = probe_runs["mhar"] / "ckpt.pt"
    summary, out_dir = run_probe("--ckpt", str(ckpt_path))
    assert out_dir == probe_runs["mhar"] / "probe"
    model, _ = load_model(ckpt_path)
    S, H = 2 * model.config.n_layer + 1, model.config.depth_heads
    assert summary["residual"] == "mhar" and summary["heads"] == H == 2
    assert summary["data"] == str(data) and summary["tokens"] == 2 * 4 * 32 and not summary["notes"]
    assert summary["sources_per_site"] == list(range(1, S + 1)) and len(summary["sites"]) == S
    depth = from_json(summary["depth_map"])
    assert depth.shape == (S, S, H)
    torch.testing.assert_close(depth.nansum(1), torch.ones(S, H, dtype=torch.float64))  # each α sums to 1
    # the same numbers as the model's own routing weights on train.py's validation batches 0 and 1
    val = np.memmap(data / "val.bin", dtype=np.uint16, mode="r")
    batches = [sample_rows(val, ("val", i), 4, 0, 4, 32, VOCAB)[:, :32] for i in range(2)]
    expected = torch.full((2, S, S, H), float("nan"), dtype=torch.float64)
    sources = []  # per batch, per site: the sources (N_j, B, T, d) it reads
    for b, idx in enumerate(batches):
        for j, alpha in enumerate(model.routing_weights(idx)):                  # (j + 1, B, T, H)
            expected[b, j, :j + 1] = alpha.double().mean((1, 2))
        sources.append([])
        with torch.no_grad():
            model.hidden(idx, visit=lambda V, q, g: sources[-1].append(V.double().numpy()))
    torch.testing.assert_close(depth, expected.mean(0), equal_nan=True)
    torch.testing.assert_close(from_json(summary["depth_map_mean"]), expected.mean(0).mean(-1), equal_nan=True)
    # the collinearity: the mean cosine over pairs of sources and tokens, in float64 by hand, per site
    cosine = np.full((2, S), np.nan)
    for b, per_site in enumerate(sources):
        for j, V in enumerate(per_site):
            unit = V / np.linalg.norm(V, axis=-1, keepdims=True)
            pairs = [(unit[n] * unit[m]).sum(-1).mean() for n in range(len(V)) for m in range(n + 1, len(V))]
            cosine[b, j] = np.mean(pairs) if pairs else np.nan
    per_site = from_json(summary["collinearity"]["per_site"])
    torch.testing.assert_close(per_site, torch.from_numpy(cosine.mean(0)), equal_nan=True, rtol=1e-5, atol=1e-6)
    assert summary["collinearity"]["mean"] == pytest.approx(np.nanmean(cosine.mean(0)), rel=1e-5)
    assert abs(summary["collinearity"]["mean"]) > 0.01  # the check above means something
    # the null uses each trained query's norm
    norms = torch.stack([site.query.norm() for site in model.sites]).detach()
    assert norms[1:].min() > 0  # trained (site 0 reads one source: its query gets no gradient)
    torch.testing.assert_close(torch.tensor(summary["query_norm"]), norms)
    torch.testing.assert_close(torch.tensor(summary["null_query_norm"]), norms)
    dev = summary["head_deviation"]
    assert from_json(dev["deviation"]).shape == (S, S, H)
    for field in ("mean_abs", "null_mean", "null_std", "z", "null_frac_above"):
        assert len(dev["per_head"][field]) == H and isinstance(dev["overall"][field], float)
    assert 0 <= dev["overall"]["null_frac_above"] <= 1
    assert dev["per_pair"]["pairs"] == [[0, 1]] and all(len(dev["per_pair"][field]) == 1 for field in (
        "distance", "null_mean", "null_std", "z", "null_frac_above"))
    for field in ("per_site", "null_per_site_mean", "null_per_site_std"):
        assert len(dev[field]) == S
    assert "width_disagreement" not in summary
    assert summary["runs"][0]["label"] == f"{probe_runs['mhar'].name} (H=2)" and summary["runs"][0]["steps"] == 30
    assert summary["figures"] == ["depth_map.png", "head_deviation.png", "loss_curves.png"]
    for name in summary["figures"]:
        assert_png(out_dir / name)


def test_probe_attnres_checkpoint_measures_width_disagreement(probe_runs, tmp_path):
    summary, out_dir = run_probe("--ckpt", str(probe_runs["attnres"] / "ckpt.pt"), "--out", str(tmp_path),
                                 "--slices", "8")
    S = 5
    wd = summary["width_disagreement"]
    assert summary["heads"] == 1 and "head_deviation" not in summary and summary["slices"] == 8
    assert wd["kl_per_site"][0] is None and all(k > 0 for k in wd["kl_per_site"][1:])  # site 0: one source
    assert len(wd["kl_per_slice"]) == 8 and len(wd["null_per_site_mean"]) == len(wd["null_per_site_std"]) == S
    assert wd["kl_mean"] > 0 and wd["null_mean"] > 0 and 0 <= wd["null_frac_above"] <= 1
    assert wd["kl_mean"] == pytest.approx(np.mean(wd["kl_per_site"][1:]))
    torch.testing.assert_close(torch.tensor(summary["null_query_norm"]), torch.tensor(summary["query_norm"]))
    depth = from_json(summary["depth_map"])
    assert depth.shape == (S, S, 1)
    torch.testing.assert_close(depth.nansum(1), torch.ones(S, 1, dtype=torch.float64))
    assert summary["figures"] == ["depth_map.png", "width_disagreement.png", "loss_curves.png"]
    for name in summary["figures"]:
        assert_png(out_dir / name)


def test_probe_untrained_attnres_disagreement_is_exactly_zero(tmp_path):
    """Zero queries: every slice and the site read uniformly, and the null's queries have norm 0 too."""
    ckpt = save_untrained(tmp_path / "ckpt.pt", residual="attnres")
    summary, _ = run_probe("--ckpt", str(ckpt), "--data", "synthetic")
    wd = summary["width_disagreement"]
    assert wd["kl_mean"] == 0.0 and wd["null_mean"] == 0.0 and set(wd["kl_per_site"][1:]) == {0.0}
    assert set(summary["query_norm"]) == set(summary["null_query_norm"]) == {0.0}
    assert summary["data"] == "random tokens" and "synthetic" in summary["notes"][0]
    assert "runs" not in summary and "loss_curves.png" not in summary["figures"]


def test_probe_baseline_notes_no_routing_and_draws_several_runs(probe_runs, tmp_path, capsys):
    ckpt = save_untrained(tmp_path / "ckpt.pt", residual="baseline")
    probe.main(["--ckpt", str(ckpt), "--logs", str(probe_runs["mhar"]), str(probe_runs["attnres"] / "log.jsonl"),
                "--out", str(tmp_path / "out")])
    summary = json.loads((tmp_path / "out" / "probe.json").read_text())
    assert "no routing" in summary["notes"][0] and "depth_map" not in summary and summary["heads"] == 0
    assert [run["label"] for run in summary["runs"]] == [f"{probe_runs['mhar'].name} (H=2)",
                                                         f"{probe_runs['attnres'].name} (H=1)"]
    assert all(run["final_val_loss"] < math.log(VOCAB) for run in summary["runs"])
    assert summary["figures"] == ["loss_curves.png"]
    assert_png(tmp_path / "out" / "loss_curves.png")
    assert "no routing" in capsys.readouterr().out


def test_probe_without_matplotlib_still_writes_the_json(probe_runs, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    probe.main(["--ckpt", str(probe_runs["mhar"] / "ckpt.pt"), "--out", str(tmp_path), "--batches", "1",
                "--null_draws", "2"])
    summary = json.loads((tmp_path / "probe.json").read_text())
    assert summary["figures"] == [] and "depth_map" in summary and not list(tmp_path.glob("*.png"))
    assert "pip install matplotlib" in capsys.readouterr().out


@pytest.mark.parametrize("script", [probe, sample])
def test_missing_or_corrupt_checkpoint_is_one_clear_line(script, tmp_path, capsys):
    corrupt = tmp_path / "ckpt.pt"
    corrupt.write_bytes(b"not a checkpoint")
    for path, reason in ((tmp_path / "missing.pt", "no checkpoint at"), (corrupt, "cannot read checkpoint")):
        err = error_line(capsys, script.main, ["--ckpt", path])
        assert err.startswith(f"{script.__name__.rpartition('.')[2]}.py: error: {reason}")




def token_folder(folder, meta):
    """A prepare.py-style folder: val.bin of 1,000 random ids below 64, and the given meta.json."""
    folder.mkdir()
    np.random.default_rng(0).integers(0, VOCAB, 1000).astype(np.uint16).tofile(folder / "val.bin")
    (folder / "meta.json").write_text(json.dumps(meta))
    return folder


def test_probe_refuses_data_with_another_tokenizer(tmp_path, capsys):
    trained_on = token_folder(tmp_path / "trained", {"tokenizer": "gpt2", "vocab_size": 50257, "eot": 50256})
    other = token_folder(tmp_path / "other", {"tokenizer": "hf:Qwen3-0.6B", "vocab_size": 151669, "eot": 151643,
                                              "tokenizer_sha256": "aec2"})
    ckpt = save_untrained(tmp_path / "ckpt.pt", data=trained_on, residual="mhar", vocab_size=50304)
    err = error_line(capsys, probe.main, ["--ckpt", ckpt, "--data", other])
    assert err.startswith(f"probe.py: error: {other} is tokenized with hf:Qwen3-0.6B (151669 ids) but the model was "
                          f"trained on {trained_on}, tokenized with gpt2 (50257 ids): pass --data {trained_on}")
    # the same vocabulary size, another tokenizer.json: refused too
    same_size = token_folder(tmp_path / "same_size", {"tokenizer": "hf:mine", "vocab_size": 50257, "eot": 50256,
                                                      "tokenizer_sha256": "77ab"})
    err = error_line(capsys, probe.main, ["--ckpt", ckpt, "--data", same_size])
    assert "tokenized with hf:mine (50257 ids) but" in err


def test_probe_notes_a_tokenizer_it_cannot_check(tmp_path):
    data = token_folder(tmp_path / "data", {"tokenizer": "none", "vocab_size": VOCAB})
    ckpt = save_untrained(tmp_path / "ckpt.pt", data=tmp_path / "moved_away", residual="mhar")
    summary, _ = run_probe("--ckpt", str(ckpt), "--data", str(data), "--out", str(tmp_path / "out"))
    assert summary["data"] == str(data)
    assert summary["notes"] == [f"the model was trained on {tmp_path / 'moved_away'}, whose meta.json is not here: "
                                f"probe.py could not check that {data} has the same tokenizer"]


@pytest.mark.parametrize("device,message", [
    ("gpu", "unknown device 'gpu': use auto, cpu, cuda, cuda:N or mps"),
    ("cuda", "--device cuda: this machine has no CUDA GPU that torch can use"),
], ids=["gpu", "cuda_without_gpu"])
def test_probe_absent_device_is_one_line(device, message, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the same answer on a GPU machine
    err = error_line(capsys, probe.main, ["--ckpt", save_untrained(tmp_path / "ckpt.pt"),
                                          "--device", device])
    assert err.startswith(f"probe.py: error: {message}"), err


@pytest.mark.parametrize("fault,reason", [("full", "No space left on device"), ("read-only", "Read-only file system")],
                         ids=["full_disk", "read_only_folder"])
def test_probe_onto_a_full_disk_or_into_a_read_only_folder(probe_runs, tmp_path, fault, reason):
    """One line, status 1; no half-written figure or probe.json, no folder left behind."""
    (tmp_path / "disk").mkdir()
    p = run_script("scripts/probe.py", "--ckpt", probe_runs["mhar"] / "ckpt.pt", "--out", tmp_path / "disk" / "probe",
                   "--batches", 1, "--batch_size", 2, "--null_draws", 2, fault=fault, under=tmp_path / "disk")
    err = one_error_line(p, "probe.py", status=1)
    assert f"cannot write into {tmp_path / 'disk' / 'probe'} ({reason}): nothing written" in err, err
    assert files_in(tmp_path / "disk") == []


def test_probe_out_naming_a_file_is_one_line(probe_runs, tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    p = run_script("scripts/probe.py", "--ckpt", probe_runs["mhar"] / "ckpt.pt", "--out", tmp_path / "notes.txt")
    assert "notes.txt is a file, not a folder" in one_error_line(p, "probe.py", status=2)
    assert (tmp_path / "notes.txt").read_text() == "mine" and files_in(tmp_path) == ["notes.txt"]


def test_probe_data_that_is_not_there_is_one_line(tmp_path, capsys):
    """--data naming no prepare.py folder is the user's mistake: refused, not read silently as
    random tokens (the checkpoint's own data, gone since, is a note, as before)."""
    ckpt = save_untrained(tmp_path / "ckpt.pt", residual="mhar")
    err = error_line(capsys, probe.main, ["--ckpt", ckpt, "--data", tmp_path / "nothere", "--out",
                                          tmp_path / "out"])
    assert "--data" in err and "nothere: no val.bin there" in err and not (tmp_path / "out").exists()


def test_a_log_whose_last_line_is_torn_is_read_as_train_py_resume_reads_it(probe_runs, tmp_path):
    """A crash or a full disk in the middle of a line: the torn last line is dropped (train.py
    --resume drops it too); a torn line before the last is an error."""
    lines = (probe_runs["mhar"] / "log.jsonl").read_text().splitlines()
    (tmp_path / "log.jsonl").write_text("\n".join(lines) + '\n{"step": 9, "lo')
    assert probe.read_log(tmp_path) == [json.loads(line) for line in lines]
    (tmp_path / "log.jsonl").write_text('{"step": 9, "lo\n' + "\n".join(lines))
    with pytest.raises(ValueError, match="line 1 is not JSON"):
        probe.read_log(tmp_path)


def test_the_terminal_report_says_each_number_where_it_belongs(tmp_path):
    """probe.report's lines, every number distinct, so that a swap (a pair's distance for its null's mean, a
    std for a mean) shows."""
    summary = dict(notes=["note one"], tokens=12345, data="data/x", collinearity=dict(mean=0.123),
                   head_deviation=dict(overall=dict(mean_abs=0.0111, null_mean=0.0222, null_std=0.0033, z=-3.36,
                                                    null_frac_above=0.75),
                                       per_pair=dict(pairs=[(0, 1), (1, 3)], distance=[0.0444, 0.0555],
                                                     null_mean=[0.0666, 0.0777], null_std=[0.0088, 0.0099],
                                                     z=[-2.5, None])),
                   width_disagreement=dict(kl_mean=0.1234, null_mean=0.0567, null_std=0.0089, z=7.49,
                                           null_frac_above=0.0),
                   runs=[dict(label="mhar", steps=30, final_val_loss=2.5, best_val_loss=2.25),
                         dict(label="baseline", steps=10, final_val_loss=None, best_val_loss=None)],
                   figures=["depth_map.png"])
    assert probe.report(summary, tmp_path).splitlines() == [
        "note one",
        "probed 12,345 tokens of data/x | sources collinearity 0.123",
        "head deviation 0.0111 vs random queries of the same norm 0.0222 ± 0.0033 (z -3.4, 75% of draws above)",
        "heads 0, 1 apart 0.0444 vs random queries 0.0666 ± 0.0088 (z -2.5)",
        "heads 1, 3 apart 0.0555 vs random queries 0.0777 ± 0.0099 (z n/a)",
        "width disagreement KL 0.1234 vs random queries of the same norm 0.0567 ± 0.0089 (z 7.5, 0% of draws above)",
        "run mhar: 30 steps, val loss 2.5000 (best 2.2500)",
        "run baseline: 10 steps",
        f"wrote {tmp_path / 'probe.json'}, depth_map.png"]


@pytest.mark.parametrize("count", [0, 1, 5, 6, 30], ids=lambda n: f"{n}-runs")
def test_the_loss_curves_have_one_legend_entry_a_run_below_the_plots(count, tmp_path, recwarn, monkeypatch):
    """One entry a run (not two: train and val), in a figure legend below both axes, the figure taller by its rows;
    30 runs once had 60 entries covering the plot, and constrained layout gave up with a warning."""
    plt = pytest.importorskip("matplotlib.pyplot")
    log = [{"step": s, "loss": 3 - s / 500} for s in range(25, 751, 25)]
    log += [{"step": s, "val_loss": 3.1 - s / 500} for s in range(50, 751, 50)]
    runs = [(tmp_path, f"run{i}", log) for i in range(count)]
    figures, close = [], plt.close
    monkeypatch.setattr(plt, "close", figures.append)       # keep the figure to read its legend
    probe.plot_loss_curves(plt, runs, tmp_path / "loss_curves.png")
    (fig,) = figures
    assert (tmp_path / "loss_curves.png").read_bytes()[:8] == PNG_SIGNATURE
    legends = fig.legends
    assert [t.get_text() for legend in legends for t in legend.get_texts()] == [f"run{i}" for i in range(count)]
    assert all(not ax.get_legend() for ax in fig.axes)
    rows = -(-count // 5)
    assert fig.get_figheight() == pytest.approx(3.8 + 0.2 * rows)
    assert not [w for w in recwarn if issubclass(w.category, UserWarning)], [str(w.message) for w in recwarn]
    close(fig)
