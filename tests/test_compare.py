"""compare.py: every method trained in its own process, the table and the figure."""
import json

import pytest

import mhar
from helpers import PNG_SIGNATURE, VOCAB


def test_compare_trains_each_method_then_writes_the_table_and_the_figure(data, tmp_path, capsys):
    import compare
    argv = ["--methods", "baseline,mhar", "--baseline_seeds", "1", "--out_dir", str(tmp_path),
            "--preset", "tiny", "--data", str(data), "--seq_len", "32", "--batch_size", "4", "--max_steps", "4",
            "--warmup_steps", "1", "--eval_interval", "2", "--eval_batches", "2", "--log_interval", "1"]
    compare.main(argv)
    results = json.loads((tmp_path / "results.json").read_text())
    rows = {row["name"]: row for row in results["rows"]}
    assert list(rows) == ["baseline-s0", "mhar-s0", "baseline-s1"]
    c = mhar.preset("tiny", vocab_size=VOCAB, seq_len=32)
    assert rows["mhar-s0"]["params"] - rows["baseline-s0"]["params"] == (2 * c.n_layer + 1) * 2 * c.n_embd
    for name, row in rows.items():  # each row is the run's own summary.json
        summary = json.loads((tmp_path / name / "summary.json").read_text())
        assert row["tail_val_loss"] == summary["tail_val_loss"] and summary["finished"]
    assert results["baseline_loss"] == pytest.approx((rows["baseline-s0"]["tail_val_loss"]
                                                      + rows["baseline-s1"]["tail_val_loss"]) / 2)
    table = (tmp_path / "results.md").read_text()
    assert "| mhar-s0 |" in table and "Baseline over 2 seeds" in table
    assert (tmp_path / "loss_curves.png").read_bytes()[:8] == PNG_SIGNATURE
    first_log = (tmp_path / "baseline-s0" / "log.jsonl").read_text()
    compare.main(argv)  # finished runs are reused, not trained again
    assert (tmp_path / "baseline-s0" / "log.jsonl").read_text() == first_log


def test_compare_sweeps_heads_and_refuses_per_run_flags():
    import compare
    args, train_flags = compare.parse_args(["--route_heads", "1,2,4", "--baseline_seeds", "0,3", "--max_steps", "5"])
    assert [name for name, _ in compare.runs_of(args)] == [
        "mhar-H1-s0", "mhar-H2-s0", "mhar-H4-s0", "baseline-s0", "baseline-s3"]
    assert train_flags == ["--max_steps", "5"]
    assert all(flags[:2] == ["--residual", "mhar"] for _, flags in compare.runs_of(args)[:3])
    args, _ = compare.parse_args(["--methods", "baseline,mhar", "--baseline_seeds", "0,1"])
    assert [name for name, _ in compare.runs_of(args)] == ["baseline-s0", "mhar-s0", "baseline-s1"]
    with pytest.raises(SystemExit):
        compare.parse_args(["--residual", "mhar"])
    with pytest.raises(SystemExit):
        compare.parse_args(["--methods", "baseline,transformer"])
