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
import probe
import sample
from common import load_model
from helpers import PNG_SIGNATURE, VOCAB
from mhar import GPT


def save_untrained(path, **overrides):
    """A checkpoint in train.py's format of an untrained tiny model (zero routing queries)."""
    torch.manual_seed(0)
    config = mhar.preset("tiny", vocab_size=VOCAB, seq_len=32, **overrides)
    torch.save(dict(model=GPT(config).state_dict(), config=dataclasses.asdict(config), args={}, step=0), path)
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


def test_head_deviation_is_zero_for_identical_heads_and_positive_otherwise():
    same = probe.depth_map([torch.rand(4, 2, 3, 1).softmax(0).expand(4, 2, 3, 4)])
    assert probe.mean_abs_deviation(probe.head_deviation(same)).eq(0).all()
    differ = probe.depth_map([torch.rand(4, 2, 3, 4).softmax(0)])
    assert (probe.mean_abs_deviation(probe.head_deviation(differ)) > 0).all()
    one_source = probe.depth_map([torch.ones(1, 2, 3, 4), torch.rand(2, 2, 3, 4).softmax(0)])
    expected = probe.head_deviation(one_source)[1].abs().mean(0)  # the one-source site does not count
    torch.testing.assert_close(probe.mean_abs_deviation(probe.head_deviation(one_source)), expected)


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
    assert torch.equal(nulls, probe.null_queries(q, 100, torch.Generator().manual_seed(0)))  # seeded
    assert probe.null_queries(torch.zeros(8), 3, torch.Generator()).eq(0).all()


def test_collinearity_of_constructed_sources():
    v = torch.randn(1, 2, 3, 8)
    assert probe.collinearity(torch.cat([v, 2 * v, v])).item() == pytest.approx(1.0)
    assert probe.collinearity(torch.cat([v, -v])).item() == pytest.approx(-1.0)
    e = torch.eye(4).view(4, 1, 1, 4).expand(4, 2, 3, 4)
    assert probe.collinearity(e).item() == 0.0
    assert math.isnan(probe.collinearity(v).item())


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
    S, H = 2 * model.config.n_layer + 1, model.config.heads
    assert summary["residual"] == "mhar" and summary["heads"] == H == 2
    assert summary["data"] == str(data) and summary["tokens"] == 2 * 4 * 32 and not summary["notes"]
    assert summary["sources_per_site"] == list(range(1, S + 1)) and len(summary["sites"]) == S
    depth = from_json(summary["depth_map"])
    assert depth.shape == (S, S, H)
    torch.testing.assert_close(depth.nansum(1), torch.ones(S, H, dtype=torch.float64))  # each α sums to 1
    # the same numbers as the model's own routing weights on the same batches
    batches, _, _ = probe.validation_batches({}, str(data), 2, 4, 32, VOCAB)
    expected = torch.stack([probe.depth_map(model.routing_weights(b)) for b in batches]).mean(0)
    torch.testing.assert_close(depth, expected.double(), equal_nan=True)
    torch.testing.assert_close(from_json(summary["depth_map_mean"]),
                               expected.double().mean(-1), equal_nan=True)
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
    for field in ("per_site", "null_per_site_mean", "null_per_site_std"):
        assert len(dev[field]) == S
    assert len(summary["collinearity"]["per_site"]) == S and -1 <= summary["collinearity"]["mean"] <= 1
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
        with pytest.raises(SystemExit) as exit_info:
            script.main(["--ckpt", str(path)])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and err.count("\n") == 1
        assert err.startswith(f"{script.__name__}.py: error: {reason}")


