"""train.py --init_from DIR: a Hugging Face Qwen3 directory converted and mid-trained with the
paper's recipe (midtrain.py), checked against transformers and a hand-written loop."""
import functools
import json
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import train
from lib import head, hf, midtrain
from helpers import save_tiny_qwen3
from test_train import assert_same_state, error_of, load, read_log

transformers = pytest.importorskip("transformers")  # the oracle; optional for users

VOCAB = 100  # save_tiny_qwen3's


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """(directory, transformers model): Qwen3's kind of shape — heads of 32 over d 64 (wider than
    d / n_head), untied embeddings, rope theta 1e6, 2 key heads for 4 query heads."""
    directory = tmp_path_factory.mktemp("qwen3")
    return directory, save_tiny_qwen3(directory, tied=False, head_dim=32, n_kv_head=2,
                                      rope_theta=1e6)


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    """Token files of the model's vocabulary, as another tool writes them (no tokenizer)."""
    folder = tmp_path_factory.mktemp("tokens")
    rng = np.random.default_rng(0)
    for split, n in (("train", 4000), ("val", 1000)):
        rng.integers(0, VOCAB, n).astype(np.uint16).tofile(folder / f"{split}.bin")
    (folder / "meta.json").write_text(json.dumps({"tokenizer": "none", "vocab_size": VOCAB}))
    return folder


def test_the_recipe_matches_the_paper_and_its_groups_decay_the_matrices_alone(qwen3):
    values = {k: v for k, (v, _) in midtrain.RECIPE.items()}
    assert values["lr"] * values["min_lr_ratio"] == pytest.approx(4e-6)           # 4e-4 -> 4e-6
    assert values["route_block"] == 2 * 4                                        # 4 layers
    assert values["global_batch"] * values["seq_len"] == 1_048_576               # ~1.05M tokens
    model = hf.load(qwen3[0], residual="mhar", route_block=8, route_heads=8)
    groups = midtrain.param_groups(model, lr=4e-4)
    params = [id(p) for g in groups for p in g["params"]]
    assert sorted(params) == sorted(id(p) for p in model.parameters())           # each exactly once
    decayed = {id(p) for g in groups if g["weight_decay"] > 0 for p in g["params"]}
    named = dict(model.named_parameters())
    assert {n for n, p in named.items() if id(p) in decayed} == {
        n for n, p in named.items() if p.dim() == 2 and n != "embed.weight"}
    assert all(g["weight_decay"] == 0.05 for g in groups if g["weight_decay"] > 0)


def flags(directory, tokens, out, *extra):
    """5 steps of 2 x 32 tokens; every recipe flag left to --init_from's defaults."""
    return ["--init_from", str(directory), "--data", str(tokens), "--out_dir", str(out),
            "--seq_len", "32", "--batch_size", "2", "--grad_accum", "1", "--max_steps", "5",
            "--warmup_steps", "2", "--eval_interval", "5", "--eval_batches", "1",
            "--log_interval", "1", *extra]


@pytest.fixture(scope="module")
def midtrained(qwen3, tokens, tmp_path_factory):
    out = tmp_path_factory.mktemp("midtrained")
    train.main(flags(qwen3[0], tokens, out))
    return out


def test_the_run_converts_and_its_first_loss_is_the_unconverted_models(qwen3, tokens, midtrained):
    log, ckpt = read_log(midtrained), load(midtrained)
    assert log[0] == {"step": 0, "conversion_max_logit_diff": 0.0}
    assert log[1]["step"] == 0 and log[1]["ema_val_loss"] == log[1]["val_loss"]  # before step 1
    # step 1's batch through transformers' Qwen3ForCausalLM, the directory as it was saved
    args = train.parse_args(flags(qwen3[0], tokens, midtrained))[0]
    args.global_batch, args.vocab_size = 2, VOCAB
    rows = train.train_batch(np.memmap(tokens / "train.bin", dtype=np.uint16), args, 0, 0)[0]
    with torch.no_grad():
        logits = qwen3[1](rows[:, :-1]).logits
    theirs = F.cross_entropy(logits.reshape(-1, VOCAB), rows[:, 1:].reshape(-1)).item()
    first = [e for e in log if "loss" in e][0]
    # equal up to fp32 rounding: the chunked head sums its matmuls in another order than one matmul
    assert first["step"] == 1 and first["loss"] == pytest.approx(theirs, rel=1e-6)
    # the recipe's conversion: delta MHAR, H 8, a delta per 8 sublayers; the gates opened
    config = ckpt["config"]
    assert (config["residual"], config["delta"], config["route_heads"], config["route_block"]) == (
        "mhar", True, 8, 8)
    assert config["head_dim"] == 32 and config["rope_theta"] == 1e6 and not config["tie_embeddings"]
    gates = [v for k, v in ckpt["model"].items() if k.endswith(".gate")]
    assert len(gates) == 5 and all(g.item() != 0 for g in gates)
    # the recipe's optimizer: decay 0.05 on the matrices (the untied LM head is one), no other
    groups = {g["name"]: g for g in ckpt["optimizer"]["param_groups"]}
    assert {name: g["weight_decay"] for name, g in groups.items()} == {
        "embedding": 0.0, "matrices": 0.05, "norms": 0.0, "routing": 0.0}
    assert all(g["initial_lr"] == 4e-4 for g in groups.values())
    assert ckpt["args"]["min_lr_ratio"] == 0.01 and ckpt["args"]["z_loss"] == 1e-4
    assert ckpt["args"]["ema"] == 0.999 and ckpt["args"]["global_batch"] == 2


def reference_midtraining(directory, tokens, steps, lr, z, decay, warmup=2, max_steps=5):
    """The recipe by hand: the converted model, AdamW over midtrain.param_groups, cross-entropy
    plus z x the z-loss (the chunked head's; tests/test_head.py checks it against head.squared_log_z), clip
    1.0, and the weight average of every parameter, step by step."""
    model = hf.load(directory, residual="mhar", route_block=8, route_heads=8,
                                seq_len=32)
    optimizer = torch.optim.AdamW(midtrain.param_groups(model, lr, 0.05), betas=(0.9, 0.95),
                                  eps=1e-8)
    average = {name: p.detach().clone() for name, p in model.named_parameters()}
    args = train.parse_args(["--seq_len", "32", "--batch_size", "2"])[0]
    args.global_batch, args.grad_accum, args.vocab_size, args.seed = 2, 1, VOCAB, 0
    train_tokens = np.memmap(tokens / "train.bin", dtype=np.uint16)
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = lr * train.lr_factor(step, warmup, max_steps, 0.01)
        rows = train.train_batch(train_tokens, args, step, 0)[0]
        _, loss = model(rows[:, :-1], rows[:, 1:],
                        loss_fn=functools.partial(head.linear_cross_entropy, z_loss=z))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for name, p in model.named_parameters():
                average[name] += (1 - decay) * (p - average[name])
    return model.state_dict(), average


def test_z_loss_and_the_weight_average_are_the_recipes(qwen3, tokens, tmp_path):
    """Trained with a z-loss and an average large enough to show, the run's weights are the hand
    loop's, and so are its averaged weights (not the raw ones); without the z-loss they differ."""
    train.main(flags(qwen3[0], tokens, tmp_path, "--z_loss", "0.01", "--ema", "0.75"))
    ckpt = load(tmp_path)
    weights, average = reference_midtraining(qwen3[0], tokens, 5, 4e-4, z=0.01, decay=0.75)
    for name, tensor in weights.items():
        torch.testing.assert_close(ckpt["model"][name], tensor, rtol=0, atol=1e-7)
    for name, tensor in average.items():
        torch.testing.assert_close(ckpt["ema"][name], tensor, rtol=0, atol=1e-7)
        assert not torch.equal(ckpt["ema"][name], ckpt["model"][name])
    without_z, _ = reference_midtraining(qwen3[0], tokens, 5, 4e-4, z=0.0, decay=0.75)
    embed = ckpt["model"]["embed.weight"]
    assert (embed - without_z["embed.weight"]).abs().max() > 1e-6
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["final_ema_val_loss"] == read_log(tmp_path)[-1]["ema_val_loss"]


def test_resume_continues_the_midtraining_run_bitwise_without_the_directory(
        qwen3, tokens, midtrained, tmp_path):
    directory = tmp_path / "qwen3"
    shutil.copytree(qwen3[0], directory)
    train.main(flags(directory, tokens, tmp_path / "run", "--stop_step", "2"))
    shutil.rmtree(directory)  # the checkpoint holds all a resumed run needs
    train.main(["--resume", "--out_dir", str(tmp_path / "run")])
    a, b = load(midtrained), load(tmp_path / "run")
    assert_same_state(a, b)
    assert a["ema"].keys() == b["ema"].keys() == a["model"].keys()
    assert all(torch.equal(a["ema"][k], b["ema"][k]) for k in a["ema"])
    assert [e.get("loss") for e in read_log(midtrained)] == [
        e.get("loss") for e in read_log(tmp_path / "run")]


def test_the_control_run_is_the_same_recipe_without_routing(qwen3, tokens, tmp_path):
    train.main(flags(qwen3[0], tokens, tmp_path, "--residual", "baseline", "--max_steps", "1"))
    ckpt = load(tmp_path)
    assert ckpt["config"]["residual"] == "baseline" and not ckpt["config"]["delta"]
    assert ckpt["args"]["weight_decay"] == 0.05 and ckpt["args"]["decay_on"] == "matrices"


def other_data(tokens, folder, **meta):
    folder.mkdir()
    for split in ("train", "val"):
        shutil.copyfile(tokens / f"{split}.bin", folder / f"{split}.bin")
    (folder / "meta.json").write_text(json.dumps(meta))
    return folder


@pytest.mark.parametrize("case, message", [
    ("gpt2-ids", "vocabulary of 50257 and"),
    ("another-tokenizer", "not with the tokenizer.json of"),
    ("another-models-vocabulary", "(its tokenizer's model: 151936)"),
    ("contradicting-shape", "config.json fixes --n_layer at 2, not 3"),
    ("truncated-weights", "model.safetensors: it is truncated or not a safetensors file"),
    ("truncated-shard", ".safetensors: it is truncated or not a safetensors file"),
], ids=["gpt2-ids", "another-tokenizer", "another-models-vocabulary", "contradicting-shape",
        "truncated-weights", "truncated-shard"])
def test_data_of_another_tokenizer_or_a_contradicting_shape_is_one_line(
        qwen3, tokens, tmp_path, capsys, case, message):
    directory, data, extra = qwen3[0], tokens, []
    if case == "gpt2-ids":
        data = other_data(tokens, tmp_path / "data", tokenizer="gpt2", vocab_size=50257)
    elif case == "another-tokenizer":  # prepare.py --tokenizer records the file's SHA-256
        directory = tmp_path / "qwen3"
        shutil.copytree(qwen3[0], directory)
        (directory / "tokenizer.json").write_text('{"model": "this directory\'s"}')
        data = other_data(tokens, tmp_path / "data", tokenizer="hf:Qwen3-0.6B", vocab_size=100,
                          tokenizer_sha256="0" * 64)
    elif case == "another-models-vocabulary":
        data = other_data(tokens, tmp_path / "data", tokenizer="hf:Qwen3-0.6B", vocab_size=100,
                          model_vocab_size=151936)
    elif case.startswith("truncated"):  # a download cut short
        directory = tmp_path / "qwen3"
        if case == "truncated-weights":
            shutil.copytree(qwen3[0], directory)
        else:
            save_tiny_qwen3(directory, tied=False, head_dim=32, max_shard_size="100KB")
            assert (directory / "model.safetensors.index.json").is_file()  # shards
            capsys.readouterr()  # transformers' progress bar
        weights = sorted(directory.glob("*.safetensors"))[-1]
        weights.write_bytes(weights.read_bytes()[:weights.stat().st_size // 2])
    else:
        extra = ["--n_layer", "3"]
    err = error_of(capsys, flags(directory, data, tmp_path / "out", *extra))
    assert message in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("raw", [False, True], ids=["average", "raw"])
def test_export_writes_the_weight_average_unless_raw(midtrained, tmp_path, raw):
    from scripts import export
    export.main([str(midtrained / "ckpt.pt"), str(tmp_path / "hf")] + (["--raw"] if raw else []))
    ckpt, back = load(midtrained), hf.load(tmp_path / "hf").state_dict()
    written = ckpt["model"] if raw else ckpt["ema"]
    assert all(torch.equal(back[k], written[k]) for k in written)
    assert not torch.equal(ckpt["ema"]["embed.weight"], ckpt["model"]["embed.weight"])


def test_a_sharded_midtraining_run_is_the_unsharded_one_and_resumes(qwen3, tokens, tmp_path):
    """--init_from DIR --fsdp (one rank, no torchrun): rank 0 reads the directory and its shards
    are handed out; the weight average is sharded with the weights, evaluated between steps,
    saved in the shards, read back by --resume and by export.py. Stopped after step 2 and
    resumed, it ends where the unsharded run does."""
    from lib.common import load_model
    every_2 = ("--eval_interval", "2")  # the average swapped in and out while training goes on
    train.main(flags(qwen3[0], tokens, tmp_path / "plain", *every_2))
    out = tmp_path / "sharded"
    train.main(flags(qwen3[0], tokens, out, *every_2, "--fsdp", "--stop_step", "3"))
    train.main(["--resume", "--out_dir", str(out)])
    ours, theirs = read_log(out), read_log(tmp_path / "plain")
    assert ours[0] == {"step": 0, "conversion_max_logit_diff": 0.0}
    for key in ("loss", "val_loss", "ema_val_loss"):
        a, b = [e[key] for e in ours if key in e], [e[key] for e in theirs if key in e]
        assert len(a) == len(b) > 0 and all(abs(x - y) <= 1e-6 * abs(y) for x, y in zip(a, b)), key
    reference = load(tmp_path / "plain")
    for average in (False, True):
        model = load_model(out / "ckpt.pt", average=average)[0].state_dict()
        expected = reference["ema" if average else "model"]
        for name, tensor in expected.items():
            torch.testing.assert_close(model[name], tensor, rtol=1e-5, atol=1e-6)
