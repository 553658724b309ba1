"""train.py: schedule, batches, training of every mode, conversion, resume, logs, errors, DDP (tiny preset,
the 64-token corpus of the `data` fixture, a few steps each)."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import train
from common import sample_rows
from helpers import ROOT, VOCAB


def flags(data, out, *extra):
    return ["--preset", "tiny", "--data", str(data), "--out_dir", str(out), "--seq_len", "32", "--batch_size", "4",
            "--max_steps", "8", "--warmup_steps", "2", "--eval_interval", "4", "--eval_batches", "2",
            "--log_interval", "1", "--lr", "1e-2", *extra]


def run(data, out, *extra):
    return train.main(flags(data, out, *extra))


def read_log(out):
    return [json.loads(line) for line in (Path(out) / "log.jsonl").read_text().splitlines()]


def losses(out):
    """What must not depend on timing: step, loss, lr, val_loss of every log.jsonl line."""
    return [{k: e[k] for k in ("step", "loss", "lr", "val_loss") if k in e} for e in read_log(out)]


def load(out):
    return torch.load(Path(out) / "ckpt.pt", map_location="cpu", weights_only=True)


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    f = [train.lr_factor(s, 10, 100, 0.1) for s in range(100)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(f[9:], f[10:]))
    assert f[-1] == pytest.approx(0.1, abs=1e-3) and train.lr_factor(500, 10, 100, 0.1) == pytest.approx(0.1)


def test_batches_are_a_pure_function_of_the_step_and_split_freely():
    tokens = np.arange(1000, dtype=np.uint16)
    whole = sample_rows(tokens, ("train", 0, 7), 8, 0, 8, 16, VOCAB)
    assert torch.equal(whole, sample_rows(tokens, ("train", 0, 7), 8, 0, 8, 16, VOCAB))
    assert torch.equal(whole[4:6], sample_rows(tokens, ("train", 0, 7), 8, 4, 6, 16, VOCAB))
    assert (whole[:, 1:] - whole[:, :-1] == 1).all()  # contiguous windows of the corpus
    assert not torch.equal(whole, sample_rows(tokens, ("train", 0, 8), 8, 0, 8, 16, VOCAB))
    assert not torch.equal(whole, sample_rows(tokens, ("train", 1, 7), 8, 0, 8, 16, VOCAB))


def test_loss_decreases_and_beats_the_unigram_entropy(data, tmp_path):
    summary = run(data, tmp_path, "--max_steps", "40", "--eval_interval", "20", "--log_interval", "5")
    log = [e for e in read_log(tmp_path) if "loss" in e]
    assert log[-1]["loss"] < log[0]["loss"] - 0.5
    assert summary["final_val_loss"] < summary["unigram_entropy"] < math.log(VOCAB)


@pytest.mark.parametrize("residual, extra", [
    ("baseline", []), ("hyper", ["--hc_streams", "2"]), ("attnres", []), ("mhar", []),
    ("mhar", ["--route_block", "2"]), ("mhar", ["--delta", "--route_block", "2"]),
], ids=["baseline", "hyper-2streams", "attnres", "mhar", "mhar-block2", "mhar-delta"])
def test_every_residual_mode_trains(data, tmp_path, residual, extra):
    summary = run(data, tmp_path, "--residual", residual, *extra, "--max_steps", "6", "--eval_interval", "6")
    log = [e for e in read_log(tmp_path) if "loss" in e]
    assert summary["residual"] == residual and math.isfinite(summary["final_val_loss"])
    assert log[-1]["loss"] < log[0]["loss"]
    config = json.loads((tmp_path / "config.json").read_text())["config"]
    assert (config["hc_streams"], config["route_block"], config["delta"]) == (
        2 if "--hc_streams" in extra else 4, 2 if "--route_block" in extra else 1, "--delta" in extra)


def test_conversion_continues_the_baseline_run_exactly(data, tmp_path):
    """--init_from: the converted model starts with the baseline's logits (difference 0) and validation loss,
    its first step has the loss of the baseline's own next step, and its routing group has its own lr."""
    run(data, tmp_path / "baseline", "--residual", "baseline", "--stop_step", "4")
    source = tmp_path / "baseline-step4.pt"
    source.write_bytes((tmp_path / "baseline" / "ckpt.pt").read_bytes())
    run(data, tmp_path / "baseline", "--residual", "baseline", "--resume")
    run(data, tmp_path / "converted", "--init_from", str(source), "--residual", "mhar", "--route_block", "2",
        "--routing_lr", "5e-3")
    baseline, converted = read_log(tmp_path / "baseline"), read_log(tmp_path / "converted")
    assert converted[0] == {"step": 4, "conversion_max_logit_diff": 0.0}
    val_at_4 = [e["val_loss"] for e in baseline if e.get("val_loss") is not None and e["step"] == 4]
    assert converted[1]["step"] == 4 and converted[1]["val_loss"] == val_at_4[0]
    baseline_loss = {e["step"]: e["loss"] for e in baseline if "loss" in e}
    first = [e for e in converted if "loss" in e][0]
    assert first["step"] == 5 and first["loss"] == baseline_loss[5]
    ckpt = load(tmp_path / "converted")
    assert ckpt["config"]["delta"] and ckpt["config"]["residual"] == "mhar"
    groups = {g["name"]: g for g in ckpt["optimizer"]["param_groups"]}
    assert groups["routing"]["initial_lr"] == 5e-3 and groups["matrices"]["initial_lr"] == 1e-2
    gates = [v for k, v in ckpt["model"].items() if k.endswith(".gate")]
    assert len(gates) == 5 and all(g.item() != 0 for g in gates)  # opened by non-zero gradients


def test_conversion_refuses_a_routed_checkpoint(data, tmp_path, capsys):
    run(data, tmp_path / "mhar", "--residual", "mhar", "--max_steps", "2", "--eval_interval", "2")
    with pytest.raises(SystemExit):
        run(data, tmp_path / "converted", "--init_from", str(tmp_path / "mhar" / "ckpt.pt"))
    assert "converts a baseline checkpoint" in capsys.readouterr().err


def test_resume_reproduces_the_uninterrupted_run_bitwise(data, tmp_path):
    run(data, tmp_path / "straight")
    run(data, tmp_path / "resumed", "--stop_step", "3")  # interrupted after step 3 (no eval there)
    assert load(tmp_path / "resumed")["step"] == 3 and not (tmp_path / "resumed" / "summary.json").exists()
    train.main(["--resume", "--out_dir", str(tmp_path / "resumed")])  # the rest from the checkpoint
    assert losses(tmp_path / "resumed") == losses(tmp_path / "straight")
    a, b = load(tmp_path / "straight"), load(tmp_path / "resumed")
    assert a["step"] == b["step"] == 8 and a.keys() == b.keys()
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    for sa, sb in zip(a["optimizer"]["state"].values(), b["optimizer"]["state"].values()):
        assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_log_checkpoint_and_summary_carry_the_documented_fields(data, tmp_path):
    summary = run(data, tmp_path)
    log = read_log(tmp_path)
    steps = [e for e in log if "loss" in e]
    evals = [e for e in log if "val_loss" in e]
    assert [e["step"] for e in steps] == list(range(1, 9)) and [e["step"] for e in evals] == [4, 8]
    assert {"step", "loss", "lr", "ms", "tokens_per_s", "tokens", "peak_mem"} <= steps[0].keys()
    assert steps[-1]["tokens"] == 8 * 8 * 32 and steps[0]["peak_mem"] > 0
    assert {"step", "val_loss", "tokens", "peak_mem"} <= evals[0].keys()
    ckpt = load(tmp_path)
    assert {"model", "optimizer", "step", "config", "args", "data_position", "rng", "evals", "val_loss",
            "best_val_loss", "tokens", "global_batch"} <= ckpt.keys()
    assert ckpt["config"]["residual"] == "mhar" and ckpt["config"]["vocab_size"] == VOCAB
    assert {"torch", "numpy", "python", "cuda"} <= ckpt["rng"].keys()
    assert [e["val_loss"] for e in ckpt["evals"]] == [e["val_loss"] for e in evals]
    assert summary["tail_val_loss"] == pytest.approx(sum(e["val_loss"] for e in evals) / 2)
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert {"final_val_loss", "tail_val_loss", "tail_evals", "tokens", "tokens_per_s", "peak_mem",
            "unigram_entropy"} <= saved.keys()
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["args"]["grad_accum"] == 2 and config["config"]["n_layer"] == 2
    assert not list(tmp_path.glob("*.tmp"))  # written atomically


def test_synthetic_data_needs_no_files(tmp_path):
    summary = train.main(["--preset", "tiny", "--data", "synthetic", "--vocab_size", "128",
                                            "--out_dir", str(tmp_path), "--max_steps", "2", "--batch_size", "2",
                                            "--seq_len", "16", "--eval_batches", "1"])
    assert math.isfinite(summary["final_val_loss"]) and summary["unigram_entropy"] is None


def error_of(capsys, argv):
    with pytest.raises(SystemExit) as exit:
        train.main(argv)
    err = capsys.readouterr().err.strip()
    assert exit.value.code == 2 and err.startswith("train.py: error: ") and "\n" not in err
    return err


def test_corrupt_or_foreign_checkpoints_give_one_clear_error(data, tmp_path, capsys):
    run(data, tmp_path, "--max_steps", "2")
    ckpt = tmp_path / "ckpt.pt"
    whole = ckpt.read_bytes()
    ckpt.write_bytes(whole[: len(whole) // 2])
    assert "truncated" in error_of(capsys, ["--resume", str(ckpt)])
    ckpt.write_bytes(b"not a checkpoint at all")
    assert "cannot read checkpoint" in error_of(capsys, ["--resume", str(ckpt)])
    torch.save({"model": {}}, ckpt)
    assert "missing optimizer" in error_of(capsys, ["--resume", str(ckpt)])
    assert "no checkpoint at" in error_of(capsys, ["--resume", str(tmp_path / "nowhere.pt")])


def test_resume_refuses_flags_that_contradict_the_checkpoint(data, tmp_path, capsys):
    run(data, tmp_path, "--max_steps", "2")
    assert "--residual mhar, not baseline" in error_of(capsys, ["--resume", "--out_dir", str(tmp_path),
                                                                "--residual", "baseline"])
    assert "global batch" in error_of(capsys, ["--resume", "--out_dir", str(tmp_path), "--grad_accum", "3"])


def test_bad_flags_give_one_line(data, tmp_path, capsys):
    assert "route_heads" in error_of(capsys, flags(data, tmp_path, "--route_heads", "3"))
    assert "no train.bin in" in error_of(capsys, flags(tmp_path / "missing", tmp_path))
    if not os.environ.get("TRITON_INTERPRET") and not torch.cuda.is_available():
        assert "CUDA" in error_of(capsys, flags(data, tmp_path, "--fused"))
    try:
        import wandb  # noqa: F401
    except ImportError:
        assert "pip install wandb" in error_of(capsys, flags(data, tmp_path, "--wandb"))


def test_command_line_error_exits_2_without_traceback(data, tmp_path):
    (tmp_path / "ckpt.pt").write_bytes(b"garbage")
    p = subprocess.run([sys.executable, "train.py", "--resume", str(tmp_path / "ckpt.pt")], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stderr.startswith("train.py: error: cannot read checkpoint")
    assert "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1


def test_torchrun_two_ranks_match_one_process_with_the_same_global_batch(data, tmp_path):
    """2 ranks x grad_accum 1 and 1 process x grad_accum 2 see the same 8 sequences per step."""
    steps = ["--max_steps", "4", "--eval_interval", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        "train.py", *flags(data, tmp_path / "ddp", *steps, "--grad_accum", "1")],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    run(data, tmp_path / "one", *steps, "--grad_accum", "2")
    ddp, one = losses(tmp_path / "ddp"), losses(tmp_path / "one")
    assert [e.keys() for e in ddp] == [e.keys() for e in one]  # rank 0 alone writes the log
    for a, b in zip(ddp, one):
        for k in a:
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-6), (k, a, b)
    a, b = load(tmp_path / "ddp"), load(tmp_path / "one")
    assert a["args"]["global_batch"] == b["args"]["global_batch"] == 8
    for k in a["model"]:
        torch.testing.assert_close(a["model"][k], b["model"][k], rtol=1e-4, atol=1e-5)


