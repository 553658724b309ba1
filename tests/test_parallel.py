"""train.py --fsdp (parallel.py): 2 gloo ranks on the CPU against one process with the same global
batch, an interrupted sharded run resumed bitwise, a two-node launch on localhost, activation
checkpointing, one-rank runs in this process (a conversion, the closing sample), sample.py on
the shards, and a contradicting --resume."""
import json
import os
import socket
import subprocess
import sys

import pytest
import torch

import sample
import train
from lib.common import read_shards
from helpers import ROOT, error_line, rel_err

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
STEPS = ["--max_steps", "5", "--eval_interval", "2", "--eval_batches", "3"]


def flags(data, out, *extra):
    return ["--preset", "tiny", "--data", str(data), "--out_dir", str(out), "--seq_len", "32",
            "--batch_size", "4", "--warmup_steps", "2", "--log_interval", "1", "--lr", "1e-2",
            *STEPS, *extra]


def read_log(out):
    return [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]


def losses(out):
    """The training and validation losses of log.jsonl, by step."""
    return [{k: e[k] for k in ("step", "loss", "val_loss") if k in e} for e in read_log(out)]


def assert_close_losses(a, b, rel):
    assert [e.keys() for e in a] == [e.keys() for e in b]
    for x, y in zip(a, b):
        for k in x:
            assert x[k] == pytest.approx(y[k], rel=rel), (k, x, y)


def shards(out, prefix="model."):
    """The tensors of a sharded run's last checkpoint, read in this one process."""
    ckpt = torch.load(out / "ckpt.pt", weights_only=True)
    return read_shards(out / ckpt["sharded"], prefix=prefix)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(*commands):
    """Run torchrun command lines side by side; each must succeed. Their outputs."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen(c, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for c in commands]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    for p, output in zip(procs, outputs):
        assert p.returncode == 0, output[-3000:]
    return outputs


@pytest.fixture(scope="module")
def one(data, tmp_path_factory):
    """The reference: one process, unsharded, batch 4 x 2 micro-steps (8 sequences per step)."""
    out = tmp_path_factory.mktemp("one")
    train.main(flags(data, out, "--grad_accum", "2"))
    return out


# The LM head apart from the embedding (its own FSDP unit, whose chunked loss must gather it) and
# the z-loss in the chunked head's gradient
UNTIED = ["--no-tie_embeddings", "--z_loss", "1e-2"]


@pytest.fixture(scope="module")
def one_untied(data, tmp_path_factory):
    """The reference of the untied runs: one process, batch 4 x 2 micro-steps."""
    out = tmp_path_factory.mktemp("one-untied")
    train.main(flags(data, out, "--grad_accum", "2", *UNTIED))
    return out


@pytest.fixture(scope="module")
def runs(data, tmp_path_factory):
    """The torchrun runs the tests share (a launch costs seconds of imports per process):
    "nodes": 2 ranks x batch 4, the same 8 sequences per step as `one`, launched as two torchrun
    nodes of one process each (c10d rendezvous on 127.0.0.1); "stopped": the same on one node,
    stopped after step 3, then resumed; "untied": 2 ranks on one node, the head untied (UNTIED)."""
    tmp = tmp_path_factory.mktemp("fsdp")
    train_py, port = str(ROOT / "train.py"), free_port()
    nodes = [[*TORCHRUN, "--nnodes", "2", "--node_rank", str(rank), "--nproc_per_node", "1",
              "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id",
              "fsdp-test", train_py, *flags(data, tmp / "nodes", "--fsdp")] for rank in (0, 1)]
    one_node = [*TORCHRUN, "--standalone", "--nproc_per_node", "2", train_py]
    launch(*nodes, [*one_node, *flags(data, tmp / "stopped", "--fsdp", "--stop_step", "3")],
           [*one_node, *flags(data, tmp / "untied", "--fsdp", *UNTIED)])
    stopped_at_3 = torch.load(tmp / "stopped" / "ckpt.pt", weights_only=True)["step"]
    launch([*one_node, "--out_dir", str(tmp / "stopped"), "--resume"])
    return tmp, stopped_at_3


def test_two_sharded_ranks_match_one_process_with_the_same_global_batch(runs, one):
    tmp, _ = runs
    assert_close_losses(losses(tmp / "nodes"), losses(one), rel=1e-5)
    assert len(losses(tmp / "nodes")) == 5 + 3  # 5 steps, evaluations at 2, 4, 5
    reference = torch.load(one / "ckpt.pt", weights_only=True)["model"]
    sharded = shards(tmp / "nodes")
    assert sharded.keys() == reference.keys()
    for k, v in reference.items():  # Adam's m / sqrt(v) amplifies float order on tiny gradients
        assert rel_err(sharded[k], v) < 1e-5, k


def test_a_sharded_untied_head_matches_one_process(runs, one_untied):
    """The untied head is sharded on its own: its chunked loss gathers it as its forward would."""
    tmp, _ = runs
    assert_close_losses(losses(tmp / "untied"), losses(one_untied), rel=1e-5)
    reference = torch.load(one_untied / "ckpt.pt", weights_only=True)["model"]
    sharded = shards(tmp / "untied")
    assert sharded.keys() == reference.keys() and "lm_head.weight" in reference
    for k, v in reference.items():
        assert rel_err(sharded[k], v) < 1e-5, k


def test_an_interrupted_sharded_run_resumes_bitwise(runs):
    tmp, stopped_at_3 = runs
    assert stopped_at_3 == 3
    assert losses(tmp / "stopped") == losses(tmp / "nodes")
    a, b = shards(tmp / "nodes", prefix=""), shards(tmp / "stopped", prefix="")
    assert a.keys() == b.keys() and any(k.startswith("optimizer.state.") for k in a)
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]
    assert [f.name for f in (tmp / "stopped").glob("shards-*")] == ["shards-5"]  # old ones gone


def test_sample_reads_the_shards(runs, capsys):
    tmp, _ = runs
    sample.main(["--ckpt", str(tmp / "nodes" / "ckpt.pt"), "--prompt", "3 1 4",
                 "--max_new_tokens", "5", "--num_samples", "1"])
    ids = capsys.readouterr().out.split()
    assert ids[:3] == ["3", "1", "4"] and len(ids) == 8


def test_one_rank_sharded_with_checkpointing_matches_one_process(data, tmp_path, one):
    """--fsdp without torchrun is a run of one rank; activation checkpointing recomputes each
    sublayer in the backward, its parameters gathered again: the same losses and weights."""
    train.main(flags(data, tmp_path, "--grad_accum", "2", "--fsdp", "--checkpointing"))
    assert_close_losses(losses(tmp_path), losses(one), rel=1e-6)
    reference = torch.load(one / "ckpt.pt", weights_only=True)["model"]
    for k, v in shards(tmp_path).items():
        assert rel_err(v, reference[k]) < 1e-6, k


def test_a_sharded_conversion_continues_as_the_unsharded_one(data, tmp_path):
    """--init_from into --fsdp: rank 0's converted model and its carried Adam moments become the
    shards; the run continues as the unsharded conversion does."""
    train.main(flags(data, tmp_path / "baseline", "--residual", "baseline", "--stop_step", "3"))
    source = str(tmp_path / "baseline" / "ckpt.pt")
    for out, extra in (("plain", []), ("sharded", ["--fsdp"])):
        train.main(flags(data, tmp_path / out, "--init_from", source, *extra))
    assert_close_losses(losses(tmp_path / "sharded"), losses(tmp_path / "plain"), rel=1e-6)


def test_a_sharded_run_samples_at_the_end(data, tmp_path, capsys):
    """The closing sample of a sharded model: generate() needs the root's parameters gathered."""
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    for name in ("train.bin", "val.bin"):
        (gpt2 / name).write_bytes((data / name).read_bytes())
    (gpt2 / "meta.json").write_text(json.dumps({"tokenizer": "gpt2", "vocab_size": 50257}))
    train.main(flags(gpt2, tmp_path / "out", "--fsdp", "--max_steps", "1"))
    out = capsys.readouterr().out
    assert "sample: the first " in out and "no sample" not in out


def test_resuming_an_unsharded_checkpoint_with_fsdp_is_refused(data, tmp_path, capsys):
    train.main(flags(data, tmp_path, "--max_steps", "1"))
    err = error_line(capsys, train.main, ["--resume", "--out_dir", tmp_path, "--fsdp"])
    assert err.startswith("train.py: error: the checkpoint was trained with --fsdp False")


def test_the_rival_residuals_shard_as_one_process_trains_them(data, tmp_path):
    """lib/rivals.py's modes under --fsdp: MUDDFormer's dense connections and Depth-Attention's
    cross-layer values, 2 ranks x batch 4 against one process at batch 4 x 2 micro-steps: the same
    losses, the same weights. MUDD's to 1e-2 only: at its start the query and key ways' weights on
    X_i have a gradient of exactly zero (their inputs are RMS-normed: scale-invariant), ~1e-9 in
    float, and Adam turns that noise into steps of +-lr whose signs the order of the sums decides
    (measured: 2e-3 after 5 steps with one rank alone; a connection left unreduced errs by O(1))."""
    residuals = {"muddformer": 1e-2, "depth-attention": 1e-5}
    one_node = [*TORCHRUN, "--standalone", "--nproc_per_node", "2", str(ROOT / "train.py")]
    launch(*[[*one_node, *flags(data, tmp_path / f"fsdp-{r}", "--fsdp", "--residual", r)] for r in residuals])
    for residual, tolerance in residuals.items():
        train.main(flags(data, tmp_path / f"one-{residual}", "--grad_accum", "2", "--residual", residual))
        assert_close_losses(losses(tmp_path / f"fsdp-{residual}"), losses(tmp_path / f"one-{residual}"), rel=1e-5)
        reference = torch.load(tmp_path / f"one-{residual}" / "ckpt.pt", weights_only=True)["model"]
        sharded = shards(tmp_path / f"fsdp-{residual}")
        assert sharded.keys() == reference.keys() and any(k.startswith("connections.") for k in reference) == (
            residual == "muddformer")
        for k, v in reference.items():
            assert rel_err(sharded[k], v) < tolerance, k
