"""hf.py and export.py: Qwen3 checkpoints in and out, checked against transformers (tiny random
models that transformers saves offline); routed checkpoints run by transformers and lm-eval from
their own directory (modeling_mhar.py), in a process that never imported this project."""
import dataclasses
import errno
import json
import os
import re
import stat
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from mhar import GPT, Config, KVCache, Positions, route
from lib import hf, midtrain
from lib.common import CheckpointError
from helpers import ROOT, error_line, files_in, foreign_model, one_error_line, rel_err, run_script, save_tiny_qwen3, tiny
from test_mhar import GENERATE_MODES, perturbed

transformers = pytest.importorskip("transformers")  # installed in CI (.ci/run); optional for users

# name: save_tiny_qwen3 arguments. Head width 16 = d / n_head; 32 and 24 are Qwen3's kind (0.6B:
# 16 heads of 128 at d 1024); GQA, or one key per query head (mha); rope theta 1e6 (Qwen3's) or 1e4.
QWEN3S = {
    "tied": dict(tied=True),
    "untied-hd32": dict(tied=False, head_dim=32),
    "mha-sharded": dict(tied=False, head_dim=24, n_kv_head=4, rope_theta=1e4, max_shard_size="20KB"),
}


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """{name: (directory, transformers model)} for every QWEN3S entry."""
    models = {}
    for name, kwargs in QWEN3S.items():
        directory = tmp_path_factory.mktemp(name)
        models[name] = directory, save_tiny_qwen3(directory, **kwargs)
    return models


def tokens(T=24, B=2, seed=0):
    return torch.randint(0, 100, (B, T), generator=torch.Generator().manual_seed(seed))


def logits_of(model, idx):
    with torch.no_grad():
        return model(idx)[0] if isinstance(model, GPT) else model(idx).logits.float()


def rotary(model, positions):
    """GPT.hidden's `at` for rotary positions (B, T) without padding or a cache: the tables' rows."""
    return Positions(model.rope_cos[positions][:, None], model.rope_sin[positions][:, None])


def edited(directory, copy, drop=(), **changes):
    """A copy of a checkpoint directory, its config.json with `changes` and without `drop`."""
    copy.mkdir(exist_ok=True)
    for file in directory.iterdir():
        (copy / file.name).write_bytes(file.read_bytes())
    config = {**json.loads((directory / "config.json").read_text()), **changes}
    (copy / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k not in drop}))
    return copy


def open_routing(model, seed=0):
    """Move every parameter routing adds off its init, so that an export that lost one shows."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith(hf.ADDED_BY_RESIDUAL):
                p.add_(0.3 * torch.randn(p.shape, generator=gen))
    return model


# ----------------------------------------------------------------------------------------------
# Reading

def test_the_tiny_checkpoints_are_what_they_say(qwen3):
    sharded = qwen3["mha-sharded"][0]
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 3
    untied = json.loads((qwen3["untied-hd32"][0] / "config.json").read_text())
    assert untied["head_dim"] * untied["num_attention_heads"] != untied["hidden_size"]
    assert untied["rope_parameters"]["rope_theta"] == 1e6 and not untied["tie_word_embeddings"]


@pytest.mark.parametrize("name", QWEN3S)
def test_load_gives_transformers_logits(qwen3, name):
    directory, reference = qwen3[name]
    model = hf.load(directory)
    idx = tokens()
    assert rel_err(logits_of(model, idx), logits_of(reference, idx)) < 1e-5
    assert model.config.tie_embeddings == QWEN3S[name].get("tied")
    assert (model.lm_head.weight is model.embed.weight) == model.config.tie_embeddings


def test_load_in_bf16_is_as_close_as_transformers_bf16(qwen3):
    directory, reference = qwen3["untied-hd32"]
    idx = tokens(T=48)
    truth = logits_of(reference, idx)                                          # float32
    ours = hf.load(directory, dtype=torch.bfloat16)
    theirs = transformers.Qwen3ForCausalLM.from_pretrained(directory, dtype=torch.bfloat16).eval()
    assert ours.embed.weight.dtype == torch.bfloat16
    error, their_error = rel_err(logits_of(ours, idx), truth), rel_err(logits_of(theirs, idx), truth)
    assert error < 2e-2 and error < 1.5 * their_error, (error, their_error)


def test_a_transformers_4_config_reads_the_same(qwen3, tmp_path):
    """transformers 4.x wrote rope_theta at the top level, rope_scaling null (Qwen3-0.6B's)."""
    directory, reference = qwen3["untied-hd32"]
    copy = edited(directory, tmp_path, drop=["rope_parameters"], rope_theta=1e6, rope_scaling=None)
    model = hf.load(copy)
    assert model.config.rope_theta == 1e6
    assert rel_err(logits_of(model, tokens()), logits_of(reference, tokens())) < 1e-5


def test_a_config_without_tie_word_embeddings_reads_as_transformers_reads_it(qwen3, tmp_path):
    """No tie_word_embeddings in config.json: transformers' Qwen3 default (untied), with the checkpoint's own
    lm_head, gives the logits transformers computes from the same directory."""
    directory, _ = qwen3["untied-hd32"]
    copy = edited(directory, tmp_path, drop=["tie_word_embeddings"])
    assert "tie_word_embeddings" not in json.loads((copy / "config.json").read_text())
    theirs = transformers.Qwen3ForCausalLM.from_pretrained(copy, dtype=torch.float32).eval()
    ours = hf.load(copy)
    assert ours.config.tie_embeddings == theirs.config.tie_word_embeddings
    assert rel_err(logits_of(ours, tokens()), logits_of(theirs, tokens())) < 1e-5


def test_a_tied_checkpoint_that_stores_its_lm_head_too_loads(qwen3, tmp_path):
    """Qwen3-0.6B is tied yet stores lm_head.weight too; transformers ties it, and so do we."""
    from safetensors.torch import load_file, save_file
    directory, reference = qwen3["tied"]
    copy = edited(directory, tmp_path)
    tensors = load_file(directory / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, copy / "model.safetensors")
    ours = hf.load(copy)
    assert rel_err(logits_of(ours, tokens()), logits_of(reference, tokens())) < 1e-5


@pytest.mark.parametrize("changes, field", [
    (dict(model_type="llama"), "model_type"),
    (dict(architectures=["Qwen3ForSequenceClassification"]), "architectures"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(use_sliding_window=True, sliding_window=16), "use_sliding_window"),
    (dict(layer_types=["full_attention", "sliding_attention"]), "layer_types"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}), "rope_type"),
    (dict(rope_parameters=None, rope_scaling={"type": "linear", "factor": 2.0}), "rope_type"),
    (dict(quantization_config={"quant_method": "fp8"}), "quantization_config"),
], ids=["llama", "classifier", "gelu", "bias", "sliding", "layer-types", "yarn", "linear-4.x", "fp8"])
def test_an_unmappable_config_is_one_clear_error(qwen3, tmp_path, changes, field):
    with pytest.raises(CheckpointError) as error:
        hf.load(edited(qwen3["tied"][0], tmp_path, **changes))
    message = str(error.value)
    assert "\n" not in message and f": {field} = " in message and "cannot be mapped" in message


def test_tensors_that_do_not_fit_the_config_are_one_clear_error(qwen3, tmp_path):
    from safetensors.torch import load_file, save_file
    directory = qwen3["untied-hd32"][0]
    with pytest.raises(CheckpointError, match="has shape"):  # another head width than the tensors'
        hf.load(edited(directory, tmp_path / "a", head_dim=16))
    tensors = load_file(directory / "model.safetensors")
    copy = edited(directory, tmp_path / "b")
    bias = {"model.layers.0.self_attn.q_proj.bias": torch.zeros(128)}
    save_file({**tensors, **bias}, copy / "model.safetensors")
    with pytest.raises(CheckpointError, match="no place for model.layers.0.self_attn.q_proj.bias"):
        hf.load(copy)
    del tensors["model.norm.weight"]
    save_file(tensors, copy / "model.safetensors")
    with pytest.raises(CheckpointError, match="missing model.norm.weight"):
        hf.load(copy)
    with pytest.raises(CheckpointError, match="is not a directory"):
        hf.load(tmp_path / "nowhere")


def test_overrides(qwen3, tmp_path):
    directory = qwen3["tied"][0]
    assert hf.load(directory).config.seq_len == 64                # max_position_embeddings
    assert hf.load(directory, seq_len=16).config.seq_len == 16
    with pytest.raises(ValueError, match="n_embd=32, but .* fixes it at 64"):
        hf.load(directory, n_embd=32)
    with pytest.raises(ValueError, match="delta=True"):
        hf.load(directory, residual="mhar", delta=False)
    with pytest.raises(ValueError, match="no field 'layers'"):
        hf.load(directory, layers=3)
    with pytest.raises(ValueError, match="dtype 'fp8' is not one of float32, bfloat16, float16"):
        hf.load(directory, dtype="fp8")
    hf.save(hf.load(directory, residual="mhar", route_heads=2), tmp_path)
    assert hf.load(tmp_path, residual="mhar", seq_len=8).config.depth_heads == 2
    with pytest.raises(ValueError, match="keeps its routing"):
        hf.load(tmp_path, route_heads=4)


def test_a_hub_id_is_fetched_only_when_no_such_directory_exists(qwen3, monkeypatch, tmp_path):
    calls = []

    def snapshot_download(repo_id, allow_patterns):
        calls.append(repo_id)
        if repo_id == "offline/model":
            raise OSError("no network")
        return str(qwen3["tied"][0])

    hub = types.SimpleNamespace(snapshot_download=snapshot_download)
    monkeypatch.setitem(sys.modules, "huggingface_hub", hub)
    monkeypatch.chdir(tmp_path)
    assert hf.load("Qwen/Qwen3-Tiny").config.n_embd == 64
    with pytest.raises(CheckpointError, match="hf download offline/model --local-dir"):
        hf.load("offline/model")
    (tmp_path / "Qwen" / "local").mkdir(parents=True)     # a local directory: never the hub
    with pytest.raises(CheckpointError, match="cannot read Qwen/local/config.json"):
        hf.load("Qwen/local")
    assert calls == ["Qwen/Qwen3-Tiny", "offline/model"]
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    with pytest.raises(CheckpointError, match="pip install huggingface_hub"):
        hf.load("Qwen/Qwen3-Tiny")


def test_the_scripts_import_without_the_optional_packages(qwen3):
    """transformers, tokenizers, safetensors and huggingface_hub are optional: blocked, the scripts
    still import, and reading a checkpoint says what to install."""
    code = f"""
import sys
for name in ("transformers", "tokenizers", "safetensors", "huggingface_hub"):
    sys.modules[name] = None  # `import name` raises ImportError
import mhar, train, sample
from lib import hf
from scripts import export
try:
    hf.load({str(qwen3['tied'][0])!r})
except hf.CheckpointError as e:
    print(e)
"""
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert "pip install safetensors" in result.stdout


# ----------------------------------------------------------------------------------------------
# Conversion

@pytest.mark.parametrize("name", ["tied", "untied-hd32"])
@pytest.mark.parametrize("route_heads, route_block", [(1, 1), (2, 2), (8, 3), (4, 8)],
                         ids=["H1-S1", "H2-S2", "H8-S3", "H4-S8"])
def test_conversion_gives_the_baseline_logits_exactly(qwen3, name, route_heads, route_block):
    directory = qwen3[name][0]
    baseline = hf.load(directory)
    routing = dict(residual="attnres") if route_heads == 1 else dict(residual="mhar",
                                                                     route_heads=route_heads)
    converted = hf.load(directory, route_block=route_block, **routing)
    assert converted.config.delta and converted.config.depth_heads == route_heads
    idx = tokens()
    assert (logits_of(converted, idx) - logits_of(baseline, idx)).abs().max().item() == 0.0


def test_conversion_in_bf16_is_exact_too(qwen3):
    directory = qwen3["untied-hd32"][0]
    baseline = hf.load(directory, dtype="bfloat16")
    converted = hf.load(directory, dtype="bfloat16", residual="mhar", route_heads=8,
                        route_block=8)
    assert converted.sites[0].gate.dtype == torch.bfloat16
    assert torch.equal(logits_of(converted, tokens()), logits_of(baseline, tokens()))


# ----------------------------------------------------------------------------------------------
# Writing

@pytest.mark.parametrize("name", QWEN3S)
def test_a_baseline_exports_to_transformers(qwen3, name, tmp_path):
    directory, reference = qwen3[name]
    model = hf.load(directory, seq_len=32)
    hf.save(model, tmp_path / "out")
    loaded = transformers.Qwen3ForCausalLM.from_pretrained(tmp_path / "out").eval()
    idx = tokens()
    assert torch.equal(logits_of(loaded, idx), logits_of(reference, idx))
    assert loaded.config.max_position_embeddings == 64  # not the shorter seq_len it was loaded with
    assert torch.equal(logits_of(hf.load(tmp_path / "out"), idx), logits_of(model, idx))


def test_a_model_trained_here_exports_to_transformers(tmp_path):
    torch.manual_seed(0)
    model = GPT(tiny("baseline"))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    hf.save(model, tmp_path, dtype="float32")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    idx = torch.randint(0, 128, (2, 32))
    assert rel_err(logits_of(loaded, idx), logits_of(model, idx)) < 1e-5


@pytest.mark.parametrize("kind", ["converted-mhar", "mhar-S2", "attnres", "attnres-T4", "hyper"])
def test_a_routed_model_round_trips_and_transformers_asks_to_trust_its_code(qwen3, kind, tmp_path):
    torch.manual_seed(0)
    if kind == "converted-mhar":
        model = hf.load(qwen3["untied-hd32"][0], residual="mhar", route_heads=8,
                        route_block=4)
    else:
        name, _, tau = kind.partition("-T")   # attnres-T4: at route_temperature 4
        residual, _, block = name.partition("-S")
        model = GPT(tiny(residual, route_block=int(block or 1), route_temperature=float(tau or 1)))
    open_routing(model)
    hf.save(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "mhar" and config["mhar"]["residual"] == model.config.residual
    assert config["auto_map"] == hf.AUTO_MAP and config["architectures"] == ["MHARForCausalLM"]
    for name in hf.REMOTE_CODE:  # the adapter and the model, as in the repository
        assert (tmp_path / name).read_bytes() == hf.REMOTE_SOURCES[name].read_bytes()
    loaded = hf.load(tmp_path)
    assert loaded.config == model.config
    pairs = zip(loaded.state_dict().values(), model.state_dict().values())
    assert all(torch.equal(a, b) for a, b in pairs)
    assert torch.equal(logits_of(loaded, tokens()), logits_of(model, tokens()))
    with pytest.raises(ValueError, match="trust_remote_code=True"):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=False)
    # Qwen3's class finds neither the embedding nor a layer: never a Qwen3 without the routing
    _, info = transformers.Qwen3ForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    decoder = {name for name in hf.tensor_names(model.config).values()
               if name.startswith(("model.layers.", "model.embed_tokens."))}
    assert decoder <= set(info["missing_keys"])


def write_earlier_export(model, directory):
    """A routed model as hf.save wrote it before it wrote remote code: config.json with
    the routing alone in its "mhar" section, Qwen3's names and "mhar.<name>" in
    mhar.safetensors."""
    from safetensors.torch import save_file
    hf.save(model, directory)
    config = json.loads((directory / "config.json").read_text())
    del config["auto_map"], config["use_cache"]
    config["mhar"] = {k: config["mhar"][k] for k in Config.ROUTING}
    (directory / "config.json").write_text(json.dumps(config))
    for file in [*directory.glob("model*.safetensors*"), *(directory / n for n in hf.REMOTE_CODE)]:
        file.unlink()
    state = model.state_dict()
    save_file({name: state[ours].contiguous()
               for name, ours in hf.file_names(model.config, state, "mhar").items()},
              directory / "mhar.safetensors")


def test_an_earlier_export_still_loads(qwen3, tmp_path):
    model = open_routing(hf.load(qwen3["untied-hd32"][0], residual="mhar",
                                 route_heads=8, route_block=4))
    write_earlier_export(model, tmp_path)
    assert hf.layout(json.loads((tmp_path / "config.json").read_text())) == "mhar"
    loaded = hf.load(tmp_path)
    assert loaded.config == model.config
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(),
                                                 model.state_dict().values()))


def test_shards_past_the_size_limit_as_transformers_writes_them(qwen3, tmp_path):
    from safetensors.torch import load_file
    model = open_routing(hf.load(qwen3["tied"][0], residual="attnres"))
    tmp_path, beside = tmp_path / "out", tmp_path  # a folder of the export's, another beside it
    hf.save(model, tmp_path, max_shard_size="20KB")
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    n = len(files)
    assert n > 3 and files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    stored = {name: file for file in files for name in load_file(tmp_path / file)}
    assert index["weight_map"] == stored
    sizes = [(tmp_path / file).stat().st_size for file in files]
    assert index["metadata"]["total_size"] < sum(sizes)  # the tensors, without the headers
    for file in files:  # each under the limit, or a tensor larger than it alone
        tensors = load_file(tmp_path / file).values()
        assert len(tensors) == 1 or sum(t.numel() * t.element_size() for t in tensors) <= 20_000
    assert torch.equal(logits_of(hf.load(tmp_path), tokens()),
                       logits_of(model, tokens()))
    baseline = hf.load(qwen3["tied"][0])  # a Qwen3 in shards, as transformers reads
    hf.save(baseline, beside / "qwen3", max_shard_size="20KB")
    assert (beside / "qwen3" / "model.safetensors.index.json").is_file()
    theirs = transformers.Qwen3ForCausalLM.from_pretrained(beside / "qwen3").eval()
    assert torch.equal(logits_of(theirs, tokens()), logits_of(qwen3["tied"][1], tokens()))
    hf.save(model, tmp_path)  # under the limit again: one file, no stale shard or index
    assert sorted(p.name for p in tmp_path.glob("model*.safetensors*")) == ["model.safetensors"]
    with pytest.raises(ValueError, match="max_shard_size '5 apples' is not a size"):
        hf.save(model, tmp_path, max_shard_size="5 apples")


def test_an_export_replaces_the_weights_and_code_of_an_earlier_one(qwen3, tmp_path):
    directory = qwen3["tied"][0]
    write_earlier_export(open_routing(hf.load(directory, residual="mhar")), tmp_path)
    hf.save(hf.load(directory), tmp_path)
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == ["model.safetensors"]
    hf.save(open_routing(hf.load(directory, residual="mhar")), tmp_path)
    assert sorted(p.name for p in tmp_path.glob("*.py")) == sorted(hf.REMOTE_CODE)
    hf.save(hf.load(directory), tmp_path)  # a plain Qwen3 again, no code
    assert not list(tmp_path.glob("*.py"))
    assert "auto_map" not in json.loads((tmp_path / "config.json").read_text())


def test_tokenizer_files_and_token_ids_travel_with_the_model(qwen3, tmp_path):
    source = edited(qwen3["tied"][0], tmp_path / "source", eos_token_id=7, bos_token_id=5)
    (source / "tokenizer.json").write_text('{"stand-in": true}')
    hf.save(hf.load(source, residual="mhar"), tmp_path / "out")
    assert (tmp_path / "out" / "tokenizer.json").read_text() == '{"stand-in": true}'
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (exported["eos_token_id"], exported["bos_token_id"]) == (7, 5)


# ----------------------------------------------------------------------------------------------
# The mid-training recipe

def test_a_converted_qwen3_trains_from_the_baselines_loss(qwen3):
    """Five AdamW steps with the recipe's groups on random tokens: the first loss is the
    unconverted model's, the gates open."""
    directory = qwen3["untied-hd32"][0]
    baseline = hf.load(directory)
    model = hf.load(directory, residual="mhar", route_block=8, route_heads=8)
    optimizer = torch.optim.AdamW(midtrain.param_groups(model, lr=1e-2), betas=(0.9, 0.95))
    batches = torch.randint(0, 100, (5, 4, 33), generator=torch.Generator().manual_seed(1))
    losses = []
    for rows in batches:
        _, loss = model(rows[:, :-1], rows[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    with torch.no_grad():
        assert losses[0] == baseline(batches[0, :, :-1], batches[0, :, 1:])[1].item()
    gates = torch.stack([site.gate for site in model.sites])
    assert (gates != 0).all() and losses[-1] != losses[0]


# ----------------------------------------------------------------------------------------------
# export.py

def write_checkpoint(path, model, **args):
    """A checkpoint with what export.py reads of train.py's."""
    torch.save(dict(model=model.state_dict(), config=dataclasses.asdict(model.config), args=args),
               path)
    return path


@pytest.mark.parametrize("residual", ["baseline", "mhar"])
def test_export_writes_a_checkpoint_as_a_hugging_face_directory(qwen3, tmp_path, capsys, residual):
    from scripts import export
    source = qwen3["untied-hd32"][0]
    model = hf.load(source, residual=residual)
    if residual == "mhar":
        open_routing(model)
    ckpt = write_checkpoint(tmp_path / "ckpt.pt", model, init_from=str(source))
    shards = ["--max_shard_size", "20KB"] if residual == "mhar" else []
    export.main([str(ckpt), str(tmp_path / "hf"), "--dtype", "bfloat16", *shards])
    printed = capsys.readouterr().out
    assert "tokenizer from" in printed
    if residual == "mhar":  # with its code, in shards
        assert "trust_remote_code=True" in printed
        assert "auto_map" in json.loads((tmp_path / "hf" / "config.json").read_text())
        assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    loaded = hf.load(tmp_path / "hf")
    assert loaded.config == model.config
    assert torch.equal(loaded.embed.weight, model.embed.weight.bfloat16().float())  # bf16 in the file
    if residual == "baseline":
        theirs = transformers.Qwen3ForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
        assert torch.equal(logits_of(theirs.eval(), tokens()), logits_of(loaded, tokens()))


def test_export_errors_are_one_line(tmp_path, capsys):
    from scripts import export
    ckpt = write_checkpoint(tmp_path / "ckpt.pt", GPT(tiny("baseline")))
    for argv in ([str(tmp_path / "missing.pt"), str(tmp_path / "hf")],
                 [str(ckpt), str(tmp_path / "hf"), "--tokenizer", str(tmp_path / "nowhere")],
                 [str(ckpt), str(tmp_path / "hf"), "--max_shard_size", "5 apples"]):
        error_line(capsys, export.main, argv)
    assert not (tmp_path / "hf").exists()  # nothing half-written


@pytest.mark.parametrize("fault,reason", [
    ("full", "No space left on device"), ("read-only", "Read-only file system"),
    ("read-only-existing", "Read-only file system"),
], ids=["full_disk", "read_only_folder", "read_only_export_folder"])
def test_export_onto_a_full_disk_or_into_a_read_only_folder(tmp_path, fault, reason):
    """One line, status 1 (safetensors' own error is read for its reason); the folders the export made are
    gone, and an earlier export that was there keeps what it held."""
    model = GPT(tiny("baseline"))
    ckpt = write_checkpoint(tmp_path / "ckpt.pt", model)
    disk, out = tmp_path / "disk", tmp_path / "disk" / "hf"
    disk.mkdir()
    if fault == "read-only-existing":
        hf.save(model, out)
    before = {name: (disk / name).read_bytes() for name in files_in(disk) if (disk / name).is_file()}
    p = run_script("scripts/export.py", ckpt, out / "new" if fault == "full" else out, fault=fault.removesuffix("-existing"),
                   under=disk)
    assert reason in one_error_line(p, "export.py", status=1)
    assert files_in(disk) == (["hf", "hf/config.json", "hf/model.safetensors"] if fault == "read-only-existing"
                              else [])
    assert {name: (disk / name).read_bytes() for name in files_in(disk) if (disk / name).is_file()} == before


def test_an_export_of_a_shorter_trained_window_runs_to_its_sources(qwen3, tmp_path):
    """Trained on 16 positions from a Qwen3 of 64: the export keeps the source's 64 (its rotary
    tables, its config), so 40 tokens run past the trained window as the source's positions do,
    and transformers is told the same window (max_position_embeddings, the mhar section's)."""
    model = hf.load(qwen3["tied"][0], residual="mhar", seq_len=16)
    hf.save(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["max_position_embeddings"] == config["mhar"]["seq_len"] == 64
    idx = tokens(T=40)
    long = hf.load(qwen3["tied"][0], residual="mhar")                # the same weights, 64 positions
    assert torch.equal(logits_of(hf.load(tmp_path), idx), logits_of(long, idx))


def test_save_is_whole_or_nothing(qwen3, tmp_path, monkeypatch):
    """hf.save onto a full disk (safetensors' own error, not an OSError, half a file written):
    MachineError naming the reason; the export that was there keeps every file as it was, and no
    staging folder is left; into a folder it made, that folder goes too."""
    import safetensors.torch
    model = hf.load(qwen3["tied"][0], residual="mhar")
    hf.save(model, tmp_path / "hf")
    before = {name: (tmp_path / "hf" / name).read_bytes() for name in files_in(tmp_path / "hf")}
    save_file = safetensors.torch.save_file

    def full_disk(tensors, path, metadata=None):
        Path(path).write_bytes(b"half a file")
        raise type("SafetensorError", (Exception,), {})(
            'Error while serializing: IoError(Os { code: 28, message: "No space left on device" })')
    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    for directory in (tmp_path / "hf", tmp_path / "new" / "hf"):
        with pytest.raises(hf.MachineError, match="No space left on device"):
            hf.save(model, directory, dtype="bfloat16")
    assert {name: (tmp_path / "hf" / name).read_bytes() for name in files_in(tmp_path / "hf")} == before
    assert files_in(tmp_path) == ["hf", *(f"hf/{name}" for name in sorted(before))]
    monkeypatch.setattr(safetensors.torch, "save_file", save_file)


def bytes_in(folder):
    """{name: bytes} of every file under `folder`: what a refused export must leave as it was."""
    return {name: (folder / name).read_bytes() for name in files_in(folder) if (folder / name).is_file()}


# what export.py finds in its out_dir, and the start of its refusal (None: it writes there)
OUT_DIRS = {"empty": None, "new": None, "earlier-export": None,
            "llama": "holds a model that is not an export of this project (config.json: model_type 'llama', "
                     "without the 'mhar' section every export writes)",
            "run-folder": "is a train.py run folder (its config.json is the run's record)",
            "stray-file": "holds notes.txt, which an export does not write (no config.json",
            "export-and-stray-file": "holds an earlier export and notes.txt, which an export does not write"}


@pytest.mark.parametrize("kind", OUT_DIRS)
def test_export_writes_over_nothing_but_an_earlier_export(tmp_path, capsys, kind):
    """export.py (and hf.save) writes into a new or empty folder, or over an earlier export of this project
    (a baseline's here, replaced by a routed model); onto another model, a train.py run folder (the mistake
    `export.py RUN/ckpt.pt RUN`) or a file it did not write, one line, status 2, and every file there keeps
    its bytes."""
    from scripts import export
    model = open_routing(GPT(tiny("mhar")))
    ckpt, out = tmp_path / "ckpt.pt", tmp_path / "out"
    if kind == "llama":  # a Llama's config.json and weights
        from safetensors.torch import save_file
        out.mkdir()
        (out / "config.json").write_text(json.dumps(dict(
            architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=100, hidden_size=64,
            intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)))
        save_file({"model.embed_tokens.weight": torch.randn(100, 64)}, out / "model.safetensors")
    elif kind == "run-folder":  # as train.py leaves it: the run's record, its log, its checkpoint
        out.mkdir()
        (out / "config.json").write_text(json.dumps(dict(config=dataclasses.asdict(model.config),
                                                         args={"out_dir": str(out)}, world_size=1)))
        (out / "log.jsonl").write_text('{"step": 0, "loss": 4.85}\n')
        ckpt = out / "ckpt.pt"
    elif kind != "new":
        out.mkdir()
    write_checkpoint(ckpt, model)
    if kind in ("earlier-export", "export-and-stray-file"):
        hf.save(GPT(tiny("baseline")), out, max_shard_size="20KB")  # in shards, with their index
    if kind in ("stray-file", "export-and-stray-file"):
        (out / "notes.txt").write_text("mine")
    before = bytes_in(out)
    if OUT_DIRS[kind] is None:
        export.main([str(ckpt), str(out)])
        assert set(files_in(out)) == {"config.json", "model.safetensors", *hf.REMOTE_CODE}
        assert torch.equal(logits_of(hf.load(out), tokens()), logits_of(model, tokens()))
        return
    line = error_line(capsys, export.main, [ckpt, out])
    assert line.startswith(f"export.py: error: {out} {OUT_DIRS[kind]}"), line
    with pytest.raises(CheckpointError, match=re.escape(OUT_DIRS[kind])):
        hf.save(model, out)
    assert bytes_in(out) == before


@pytest.mark.parametrize("how", ["through-a-new-folder", "through-a-link"])
def test_export_judges_the_folder_its_path_leads_to(tmp_path, capsys, how):
    """--out_dir new/../run, new not existing, or a link to a run folder: refused as the run folder itself is
    (before: new/../run was taken as new, new was created and the run's config.json overwritten)."""
    from scripts import export
    model = open_routing(GPT(tiny("mhar")))
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps(dict(config=dataclasses.asdict(model.config), args={})))
    write_checkpoint(run / "ckpt.pt", model)
    out = tmp_path / "new" / ".." / "run"
    if how == "through-a-link":
        out = tmp_path / "link"
        out.symlink_to(run)
    before = bytes_in(run)
    line = error_line(capsys, export.main, [run / "ckpt.pt", out])
    assert line.startswith(f"export.py: error: {run} is a train.py run folder"), line
    assert bytes_in(run) == before and sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["run"] + (["link"] if how == "through-a-link" else []))


@pytest.mark.parametrize("kind", ["a-file", "torn-config", "run-folder"])
def test_export_folders_refusals_whole(tmp_path, kind):
    """export_folder's refusals word for word: a file, a config.json that is no JSON object, a run folder (the
    folder it suggests instead)."""
    out = tmp_path / "out"
    if kind == "a-file":
        out.write_text("mine")
        said = f"{out} is a file, not a folder: export into a folder (it is created if it does not exist)"
    else:
        out.mkdir()
        (out / "config.json").write_text("{" if kind == "torn-config" else '{"config": {}, "args": {}}')
        said = (f"{out} holds a model that is not an export of this project (config.json: not a JSON object, "
                f"without the 'mhar' section every export writes), which an export would overwrite: export into "
                f"a new or empty folder, or remove what it holds first") if kind == "torn-config" else (
                f"{out} is a train.py run folder (its config.json is the run's record), which an export would "
                f"overwrite: export into another folder, e.g. {out / 'hf'}")
    with pytest.raises(CheckpointError) as refused:
        hf.export_folder(out)
    assert str(refused.value) == said


def test_export_onto_a_dangling_link_is_the_users_path(tmp_path, capsys):
    """A link to nothing: status 2 and what it is (before: status 1, "free some space")."""
    from scripts import export
    model = open_routing(GPT(tiny("mhar")))
    write_checkpoint(tmp_path / "ckpt.pt", model)
    (tmp_path / "out").symlink_to(tmp_path / "nowhere")
    line = error_line(capsys, export.main, [tmp_path / "ckpt.pt", tmp_path / "out"])
    assert line == (f"export.py: error: {tmp_path / 'out'} is a link to {tmp_path / 'nowhere'}, which does not "
                    f"exist: export into a folder (it is created if it does not exist)")
    assert not (tmp_path / "nowhere").exists()


def test_export_into_another_users_private_folder_says_it_cannot_be_read(tmp_path, capsys, monkeypatch):
    """A config.json that cannot be read (another user's folder; the tests may run as root, whom permissions
    do not stop: the read fails instead): "cannot be read", not "not a JSON object"."""
    from scripts import export
    model = open_routing(GPT(tiny("mhar")))
    write_checkpoint(tmp_path / "ckpt.pt", model)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "config.json").write_text("{}")
    read_text = Path.read_text

    def private(path, *args, **kwargs):
        if path.name == "config.json" and path.parent.name == "out":
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return read_text(path, *args, **kwargs)
    monkeypatch.setattr(Path, "read_text", private)
    line = error_line(capsys, export.main, [tmp_path / "ckpt.pt", tmp_path / "out"])
    assert line.startswith(f"export.py: error: {tmp_path / 'out' / 'config.json'} cannot be read (Permission "
                           f"denied): export into a folder of yours"), line


@pytest.mark.parametrize("name, written", [
    ("model.safetensors", True), ("mhar.safetensors", True), ("model.safetensors.index.json", True),
    ("model-00001-of-00002.safetensors", True), ("model-00099-of-99999.safetensors", True),
    ("mhar.safetensors.index.json", True), ("tokenizer.json", True), ("generation_config.json", True),
    ("modeling_mhar.py", True), ("model-1-of-2.safetensors", False), ("model.safetensors.bak", False),
    ("pytorch_model.bin", False), ("llama.safetensors", False), ("README.md", False), (".hidden", False),
    ("logs/", False), ("model.safetensors/", False)])
def test_an_earlier_export_holds_only_what_an_export_writes(tmp_path, name, written):
    """export_folder's list of what save writes, name by name: the weights in one file or in shards and
    their index (either layout's stem), the code, the tokenizer files; a folder of any name is not one."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3", "mhar": {"residual": "baseline"}}))
    if name.endswith("/"):
        (tmp_path / name).mkdir()
    else:
        (tmp_path / name).write_text("")
    if written:
        assert hf.export_folder(tmp_path) == tmp_path
    else:
        refusal = f"holds an earlier export and {name.rstrip('/')},"
        with pytest.raises(CheckpointError, match=re.escape(refusal)):
            hf.export_folder(tmp_path)


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o077, 0o002], ids=["022", "027", "077", "002"])
def test_every_exported_file_has_the_mode_a_new_file_gets(tmp_path, umask):
    """The weights (in shards, with their index) are as readable as config.json and the code beside them:
    0666 less the umask, not the 0600 of safetensors' private temporary file."""
    previous = os.umask(umask)
    try:
        hf.save(GPT(tiny("mhar")), tmp_path / "out", max_shard_size="20KB")
    finally:
        os.umask(previous)
    out = tmp_path / "out"
    modes = {name: oct(stat.S_IMODE((out / name).stat().st_mode)) for name in files_in(out)}
    assert len(modes) > 6 and "model.safetensors.index.json" in modes  # shards, index, code, config
    assert modes == {name: oct(0o666 & ~umask) for name in modes}


def test_export_out_dir_naming_a_file_is_one_line(tmp_path):
    ckpt = write_checkpoint(tmp_path / "ckpt.pt", GPT(tiny("baseline")))
    (tmp_path / "notes.txt").write_text("mine")
    p = run_script("scripts/export.py", ckpt, tmp_path / "notes.txt" / "hf")
    assert "notes.txt is a file, not a folder" in one_error_line(p, "export.py", status=2)
    assert (tmp_path / "notes.txt").read_text() == "mine" and files_in(tmp_path) == ["ckpt.pt", "notes.txt"]


@pytest.mark.parametrize("kind", ["llama", "broken"])
def test_hf_py_refuses_a_foreign_directory_in_one_line_and_leaves_it(tmp_path, kind):
    """python -m lib.hf DIR writes its random Qwen3 over DIR: a Llama directory or a broken config.json there is
    one line, status 2, and the directory is left as it was."""
    directory, _ = foreign_model(tmp_path, kind)
    before = {name: (directory / name).read_bytes() for name in files_in(directory)}
    p = run_script("lib/hf.py", directory)
    err = one_error_line(p, "hf.py", status=2)
    assert str(directory) in err and ("holds something else (model_type 'llama')" if kind == "llama" else
                                      "config.json (") in err, err
    assert {name: (directory / name).read_bytes() for name in files_in(directory)} == before
    assert not (tmp_path / f"{kind}-mhar").exists() and not (tmp_path / f"{kind}-baseline").exists()


def test_hf_py_takes_a_directory_and_nothing_else(tmp_path, capsys):
    """--help is help, not a folder named --help; a file, or a second argument, is one line."""
    p = run_script("lib/hf.py", "--help")
    assert p.returncode == 0 and p.stdout.startswith("usage: hf.py") and not (ROOT / "--help").exists()
    (tmp_path / "notes.txt").write_text("mine")
    assert "notes.txt is a file" in error_line(capsys, hf.main, [tmp_path / "notes.txt"])
    assert "unrecognized arguments" in error_line(capsys, hf.main, [tmp_path / "a", tmp_path / "b"])
    assert files_in(tmp_path) == ["notes.txt"]


SafetensorError = type("SafetensorError", (Exception,), {})  # safetensors' own, on a full disk


@pytest.mark.parametrize("error", [OSError(30, "Read-only file system"), KeyboardInterrupt(),
                                   SafetensorError("Error while serializing: No space left on "
                                                   "device (os error 28)")],
                         ids=["read-only", "ctrl-c", "full-disk-in-safetensors"])
def test_hf_py_that_cannot_finish_leaves_nothing_it_made(tmp_path, capsys, monkeypatch, error):
    """A demonstration stopped half-way (a read-only folder, a full disk, Ctrl-C): one line, status
    1 (the machine's) or 130, and the folders it made are gone; one that was there stays. A full
    disk under transformers' own save_pretrained raises safetensors' error, not an OSError."""
    (tmp_path / "demo-baseline").mkdir()

    def half_done(directory):
        for folder in (directory, directory.with_name("demo-mhar")):
            folder.mkdir()
            (folder / "config.json").write_text("")
        raise error
    monkeypatch.setattr(hf, "demo", half_done)
    machine = not isinstance(error, KeyboardInterrupt)
    line = error_line(capsys, hf.main, [tmp_path / "demo"], status=1 if machine else 130)
    assert ("Read-only file system" in line or "No space left" in line) if machine \
        else "interrupted" in line
    assert files_in(tmp_path) == ["demo-baseline"]


@pytest.mark.parametrize("kind", ["llama", "broken"])
def test_train_init_from_a_foreign_directory_is_one_line(tmp_path, kind):
    directory, message = foreign_model(tmp_path, kind)
    p = run_script("train.py", "--init_from", directory, "--data", "synthetic", "--max_steps", 1,
                   "--out_dir", tmp_path / "run")
    assert message in one_error_line(p, "train.py", status=2)
    assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------------------------
# A routed directory in transformers and lm-eval, in a process that never imported this project

# name: how the model is made. Full, block and delta routing; attnres and mhar; tied and untied;
# a converted Qwen3 (head width 32 over d 64, rope theta 1e6) in shards; hyper-connections.
ROUTED = {
    "mhar-full-tied": dict(residual="mhar", vocab_size=100),  # the tokenizer's ids, for lm-eval
    "attnres-block-untied": dict(residual="attnres", route_block=2, tie_embeddings=False),
    "mhar-delta-untied-sharded": dict(qwen3="untied-hd32", residual="mhar", route_heads=8,
                                      route_block=4),
    "attnres-delta-tied": dict(qwen3="tied", residual="attnres", route_block=2),
    "hyper": dict(residual="hyper"),
}
PROMPT, NEW = 5, 10  # greedy generation: prompt length, new tokens
ROWS = [5, 2, 9, 4]  # a padded batch: its prompts' lengths
PACKED = torch.arange(12) % 7  # position_ids of two documents in one row of 12 tokens
DROPPED = ("model.sites.1.query", "model.sites.2.norm_weight", "model.layers.0.q_proj.weight")
GEN_PROMPTS = ["Once upon a time,", "in a village between the mountains", "old", "the sea"]
SENTENCE = ("Once upon a time, in a village between the mountains and the sea, there lived an "
            "old clockmaker who repaired every clock in the valley.")

# Run as a script from a folder of its own, without the repository on sys.path: the checks a
# user of transformers and lm-eval makes, their answers saved for the test to compare.
FRESH_PROCESS = r"""
import json, sys
sys.modules["triton"] = None  # the directory's code runs without triton (and without kernel.py)
args = json.loads(sys.argv[1])
from pathlib import Path
import torch, transformers
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer, Qwen3ForCausalLM
torch.set_num_threads(1)  # as the tests run: the same sums in the same order, exact logits
out = {"hf": {}}
idx = torch.tensor(args["tokens"])
for name, directory in args["dirs"].items():
    model = AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True).eval()
    model.generation_config.eos_token_id = None  # NEW tokens, as GPT.generate writes them
    lengths = []  # the inputs' lengths: a cached step runs the newest token alone
    model.get_input_embeddings().register_forward_hook(
        lambda module, inputs, output: lengths.append(inputs[0].shape[1]))
    result = {"class": type(model).__name__}
    with torch.no_grad():
        result["logits"] = model(idx).logits
    for use_cache in (True, False):
        lengths.clear()
        generated = model.generate(
            idx[:, :args["prompt"]], max_new_tokens=args["new"], do_sample=False,
            use_cache=use_cache, output_logits=True, return_dict_in_generate=True)
        result[f"generate-{use_cache}"] = generated.sequences
        result[f"generate-logits-{use_cache}"] = torch.stack(generated.logits, 1)  # (B, new, V)
        result[f"lengths-{use_cache}"] = list(lengths)
    output = model(idx, labels=idx)
    output.loss.backward()
    result["loss"] = output.loss.detach()
    result["grads"] = {n: p.grad for n, p in model.named_parameters()}
    bf16 = AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True,
                                                dtype=torch.bfloat16).eval()
    with torch.no_grad():
        result["logits-bf16"] = bf16(idx).logits
    model.save_pretrained(f"{directory}-resaved")  # as after fine-tuning with transformers
    calls = []  # gradient checkpointing: the first sublayer runs again in backward
    model.model.layers[0].register_forward_pre_hook(lambda *_: calls.append(1))
    model.zero_grad(set_to_none=True)
    model.gradient_checkpointing_enable()
    model(idx, labels=idx).loss.backward()
    result["checkpointed"] = (len(calls), {n: p.grad for n, p in model.named_parameters()})
    model.gradient_checkpointing_disable()
    refused = []  # what the model cannot honour is an error, not ignored
    for call in (lambda: model(inputs_embeds=model.get_input_embeddings()(idx)),
                 lambda: model(torch.zeros(1, model.config.max_position_embeddings + 1,
                                           dtype=torch.long)),
                 lambda: model(idx, output_attentions=True),
                 lambda: model(idx, num_logits_to_keep=1),
                 lambda: model(idx, position_ids=torch.arange(100, 112).expand(2, -1)),
                 lambda: model.generate(idx, max_new_tokens=2, cache_implementation="static"),
                 lambda: AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True,
                                                              attn_implementation="eager"),
                 lambda: model(idx, attention_mask=torch.ones(2, 5, dtype=torch.long))):
        try:
            call()
        except ValueError as e:
            refused.append(str(e))
    result["refused"] = refused
    with torch.no_grad():  # padded batches: prompts of args["rows"] lengths, left- and right-padded
        rows = [idx[i % 2, :n] for i, n in enumerate(args["rows"])]
        width = max(args["rows"])
        left, right = torch.zeros(2, len(rows), width, dtype=torch.long)
        mask_left, mask_right = torch.zeros(2, len(rows), width, dtype=torch.long)
        for i, row in enumerate(rows):
            left[i, width - len(row):], right[i, :len(row)] = row, row
            mask_left[i, width - len(row):], mask_right[i, :len(row)] = 1, 1
        generated = model.generate(left, attention_mask=mask_left, max_new_tokens=args["new"],
                                   do_sample=False, pad_token_id=0)
        result["padded-generate"] = [generated[i, width - len(row):] for i, row in enumerate(rows)]
        logits = model(right, attention_mask=mask_right).logits
        result["right-padded"] = [logits[i, :len(row)] for i, row in enumerate(rows)]
        logits = model(left, attention_mask=mask_left).logits
        result["left-padded"] = [logits[i, width - len(row):] for i, row in enumerate(rows)]
        first = model(idx[:, :7])  # several tokens after a cache (chunked prefill)
        result["chunked"] = model(idx[:, 7:], cache=first[1]).logits
        result["packed"] = model(idx, position_ids=torch.tensor([args["packed"]] * 2)).logits
        result["hidden-states"] = model(idx, output_hidden_states=True).hidden_states
        result["tuple"] = model(idx, labels=idx, return_dict=False)[:2]
        result["keep-2"] = model(idx, logits_to_keep=2).logits
        result["keep-some"] = model(idx, logits_to_keep=torch.tensor([0, 5])).logits
        result["base"] = AutoModel.from_pretrained(directory, trust_remote_code=True)(idx)[0]
        result["sdpa"] = AutoModelForCausalLM.from_pretrained(
            directory, trust_remote_code=True, attn_implementation="sdpa")(idx).logits
        result["to-bf16"] = AutoModelForCausalLM.from_pretrained(
            directory, trust_remote_code=True).to(torch.bfloat16)(idx).logits
    resized = AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True)
    resized.resize_token_embeddings(resized.config.vocab_size + 8, mean_resizing=False)
    resized.save_pretrained(f"{directory}-resized")
    with torch.no_grad():
        result["resized"] = AutoModelForCausalLM.from_pretrained(
            f"{directory}-resized", trust_remote_code=True)(idx).logits
    qwen3, info = Qwen3ForCausalLM.from_pretrained(directory, output_loading_info=True)
    result["as-qwen3"] = (set(info["missing_keys"]), set(qwen3.state_dict()))
    with torch.no_grad():  # the cache a plain call returns (use_cache unsaid), and its length
        result["default-cache"] = model(idx).past_key_values.get_seq_length()
    result["bare-config-caches"] = type(model.config)().use_cache  # MHARConfig() as PEFT builds one
    out["hf"][name] = result
import shutil
from safetensors.torch import load_file, save_file
lacking = Path(args["lm_eval_dir"] + "-lacking")  # a directory without some of its tensors
shutil.copytree(args["lm_eval_dir"], lacking)
tensors = load_file(lacking / "model.safetensors")
for name in args["dropped"]:
    del tensors[name]
save_file(tensors, lacking / "model.safetensors", metadata={"format": "pt"})
out["lacking"] = AutoModelForCausalLM.from_pretrained(lacking, trust_remote_code=True).state_dict()
tokenizer = AutoTokenizer.from_pretrained(args["lm_eval_dir"], trust_remote_code=True)
out["token_ids"] = tokenizer(args["text"], add_special_tokens=False)["input_ids"]
from transformers import pipeline  # a pipeline's batches: the texts as one at a time
model = AutoModelForCausalLM.from_pretrained(args["lm_eval_dir"], trust_remote_code=True)
tokenizer.pad_token, tokenizer.padding_side = tokenizer.eos_token, "left"  # as transformers advises
generator = pipeline("text-generation", model=model, tokenizer=tokenizer)
out["pipeline"] = [generator(args["prompts"], batch_size=size, max_new_tokens=args["new"],
                             do_sample=False, return_full_text=False) for size in (1, 2)]
import importlib.util
out["samples"] = None  # lm-eval's hf model needs lm-eval and accelerate, optional for users
if not (importlib.util.find_spec("lm_eval") and importlib.util.find_spec("accelerate")):
    torch.save(out, args["out"])
    sys.exit(0)
from transformers import Trainer, TrainingArguments  # Trainer needs accelerate too
model = AutoModelForCausalLM.from_pretrained(args["lm_eval_dir"], trust_remote_code=True)
calls = []
model.model.layers[0].register_forward_pre_hook(lambda *_: calls.append(1))
rows = [{"input_ids": row, "labels": row} for row in args["tokens"]]
trainer = Trainer(model=model, train_dataset=rows, args=TrainingArguments(
    output_dir=str(Path(args["out"]).parent / "trainer"), max_steps=1, per_device_train_batch_size=2,
    gradient_checkpointing=True, report_to=[], save_strategy="no", use_cpu=True))
trainer.train()
out["trainer"] = (model.model.config.checkpointing, len(calls))
import lm_eval
from lm_eval.tasks import TaskManager
results = lm_eval.simple_evaluate(
    model="hf", model_args=f"pretrained={args['lm_eval_dir']},trust_remote_code=True,dtype=float32",
    tasks=args["tasks"], task_manager=TaskManager(include_path=args["tasks_dir"],
                                                  include_defaults=False),
    batch_size=4, device="cpu", log_samples=True)
out["samples"] = {task: [(s["doc_id"], s["arguments"], s["resps"]) for s in samples]
                  for task, samples in results["samples"].items()}
root = Path(args["root"]).resolve()
out["project_imported"] = ("mhar" in sys.modules or "hf" in sys.modules
                           or any(Path(p or ".").resolve() == root for p in sys.path))
torch.save(out, args["out"])
"""


def save_tiny_tokenizer(folder):
    """A BPE tokenizer of 100 ids trained on SENTENCE, as transformers saves one (tokenizer.json,
    tokenizer_config.json), end-of-text named in config.json as a Qwen3 directory does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    tok.train_from_iterator([SENTENCE], trainers.BpeTrainer(vocab_size=100,
                                                            special_tokens=["<|endoftext|>"]))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    fast.save_pretrained(folder)
    eot = tok.token_to_id("<|endoftext|>")
    (folder / "config.json").write_text(json.dumps({"eos_token_id": eot}))
    return folder


@pytest.fixture(scope="module")
def fresh(qwen3, tmp_path_factory):
    """Every ROUTED model exported, then loaded by transformers (and the first by lm-eval's hf
    model) in one fresh Python process: {models, dirs, answers of that process}."""
    from helpers import write_task
    root = tmp_path_factory.mktemp("fresh")
    source = save_tiny_tokenizer(root / "tokenizer")
    models, dirs = {}, {}
    for i, (name, recipe) in enumerate(ROUTED.items()):
        recipe = dict(recipe)
        torch.manual_seed(i)
        if "qwen3" in recipe:
            model = hf.load(qwen3[recipe.pop("qwen3")][0], **recipe)
        else:
            model = GPT(tiny(**recipe))
        models[name], dirs[name] = open_routing(model.eval(), seed=i), root / name
        shards = {"max_shard_size": "20KB"} if "sharded" in name else {}
        hf.save(model, dirs[name], source=source if i == 0 else None, **shards)
    docs = [dict(context=c, choices=[" there lived", " every clock", " the sea"], label=0)
            for c in ("Once upon a time,", "in a village between the mountains and", "old")]
    write_task(root, "tiny_choice", docs, output_type="multiple_choice", doc_to_text="{{context}}",
               doc_to_choice="{{choices}}", doc_to_target="{{label}}", target_delimiter="",
               metric_list=[{"metric": "acc"}])
    write_task(root, "tiny_text", [dict(text=" ".join([SENTENCE] * 3))],  # three windows of 32
               output_type="loglikelihood_rolling", doc_to_text="", doc_to_target="{{text}}",
               metric_list=[{"metric": "word_perplexity"}])
    write_task(root, "tiny_gen", [dict(prompt=p, answer="") for p in GEN_PROMPTS],
               output_type="generate_until", doc_to_text="{{prompt}}", doc_to_target="{{answer}}",
               generation_kwargs={"until": ["\n"], "max_gen_toks": NEW, "do_sample": False},
               metric_list=[{"metric": "exact_match"}])
    args = dict(dirs={k: str(v) for k, v in dirs.items()}, tokens=tokens(T=12).tolist(),
                prompt=PROMPT, new=NEW, lm_eval_dir=str(dirs["mhar-full-tied"]), text=SENTENCE,
                tasks=["tiny_choice", "tiny_text", "tiny_gen"], tasks_dir=str(root),
                root=str(ROOT), out=str(root / "answers.pt"), rows=ROWS, dropped=DROPPED, packed=PACKED.tolist(),
                prompts=GEN_PROMPTS)
    (root / "run").mkdir()
    (root / "run" / "check.py").write_text(FRESH_PROCESS)
    # the repository stays off; so does tests/mutate.py's mutant, whose trampolines in the exported copy of a
    # mutated modeling_mhar.py would look for mutmut's configuration in this folder (the process runs the
    # original functions, as it would under another module name anyway)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MUTANT_UNDER_TEST")}
    env.update(HF_HOME=str(root / "hf-home"), HF_MODULES_CACHE=str(root / "hf-modules"),
               HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, "check.py", json.dumps(args)], cwd=root / "run",
                            env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    answers = torch.load(root / "answers.pt")
    return types.SimpleNamespace(models=models, dirs=dirs, root=root, source=source, **answers)


def test_the_fresh_process_never_imported_this_project(fresh):
    assert not fresh.project_imported
    assert {answers["class"] for answers in fresh.hf.values()} == {"MHARForCausalLM"}


@pytest.mark.parametrize("name", ROUTED)
def test_transformers_gives_the_projects_logits_exactly(fresh, name):
    theirs, model = fresh.hf[name], fresh.models[name]
    assert theirs["logits"].dtype == torch.float32
    assert (theirs["logits"] - logits_of(model, tokens(T=12))).abs().max().item() == 0.0


@pytest.mark.parametrize("name", ROUTED)
def test_transformers_in_bf16_is_the_projects_bf16(fresh, name):
    truth = logits_of(fresh.models[name], tokens(T=12))
    ours = logits_of(hf.load(fresh.dirs[name], dtype=torch.bfloat16), tokens(T=12))
    assert rel_err(ours, truth) > 0                       # bf16 did round
    assert torch.equal(fresh.hf[name]["logits-bf16"], ours)  # the same computation, to the bit


@pytest.mark.parametrize("name", ROUTED)
def test_transformers_generate_is_gpt_generate(fresh, name):
    prompt = tokens(T=12)[:, :PROMPT]
    expected = fresh.models[name].generate(prompt, NEW, temperature=0)
    theirs = fresh.hf[name]
    assert torch.equal(theirs["generate-True"], expected)
    assert torch.equal(theirs["generate-False"], expected)
    assert theirs["lengths-True"] == [PROMPT] + [1] * (NEW - 1)             # the KV cache
    assert theirs["lengths-False"] == list(range(PROMPT, PROMPT + NEW))     # the whole window
    # and each step's logits are those of the whole sequence so far (up to the rounding of
    # other shapes): a cached step sits at its own position
    full = logits_of(fresh.models[name], expected[:, :-1])[:, PROMPT - 1:]  # (B, NEW, vocab)
    for use_cache in (True, False):
        assert rel_err(theirs[f"generate-logits-{use_cache}"], full) < 1e-6


@pytest.mark.parametrize("name", ROUTED)
def test_gradients_flow_through_the_transformers_class(fresh, name):
    """loss.backward() through MHARForCausalLM: transformers' causal loss and every parameter's
    gradient are GPT's, routing included."""
    import torch.nn.functional as F
    model, idx = fresh.models[name], tokens(T=12)
    model.zero_grad(set_to_none=True)
    logits, _ = model(idx)
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), idx[:, 1:].reshape(-1))
    loss.backward()
    theirs = fresh.hf[name]
    assert theirs["loss"].item() == pytest.approx(loss.item(), rel=1e-6)
    ours = {f"model.{n}": p.grad for n, p in model.named_parameters()}
    assert ours.keys() == theirs["grads"].keys()
    for n, grad in ours.items():
        assert rel_err(theirs["grads"][n], grad) < 1e-5, n
    if model.config.routed:  # the routing learns: the final site mixes all its sources
        assert theirs["grads"][f"model.sites.{len(model.sites) - 1}.query"].abs().sum() > 0


def test_a_plain_call_keeps_a_cache_as_transformers_models_do(fresh):
    """use_cache is on unless said otherwise, in an exported config and in one built bare: a call
    with input_ids alone returns the cache of its tokens, as Qwen3ForCausalLM does."""
    for answers in fresh.hf.values():
        assert answers["default-cache"] == 12 and answers["bare-config-caches"] is True  # tokens(T=12)


def test_the_model_refuses_what_it_cannot_honour(fresh):
    for answers in fresh.hf.values():
        embeddings, length, attentions, unknown, positions, static, eager, mask = answers["refused"]
        assert "not inputs_embeds" in embeddings and "longer than Config.seq_len" in length
        assert "no attention weights" in attentions and "num_logits_to_keep" in unknown
        assert "position_ids must be (B, 12) in [0, " in positions
        assert "not a static one" in static and "attn_implementation='eager' is not supported" in eager
        assert "attention_mask must be (B, 12)" in mask


@pytest.mark.parametrize("name", ROUTED)
def test_a_padded_batch_gives_each_prompt_what_it_gives_alone(fresh, name):
    """Prompts of four lengths in one batch: left-padded, transformers' greedy generate gives
    each the tokens GPT.generate gives it alone; left- and right-padded, its logits (up to the
    rounding of another attention shape). No token reads padding; routing is per position."""
    model, theirs, idx = fresh.models[name], fresh.hf[name], tokens(T=12)
    rows = [idx[i % 2, :n] for i, n in enumerate(ROWS)]
    for i, row in enumerate(rows):
        assert torch.equal(theirs["padded-generate"][i], model.generate(row[None], NEW, temperature=0)[0])
        alone = logits_of(model, row[None])[0]                                   # (n, vocab)
        assert rel_err(theirs["left-padded"][i], alone) < 1e-6
        assert rel_err(theirs["right-padded"][i], alone) < 1e-6


@pytest.mark.parametrize("name", ROUTED)
def test_tokens_after_a_cache_and_rotary_positions(fresh, name):
    """Five tokens after a cache of seven: the logits of all twelve at once; position_ids (two
    documents packed in a row, each from position 0): the rotary positions GPT.hidden takes."""
    model, theirs, idx = fresh.models[name], fresh.hf[name], tokens(T=12)
    assert rel_err(theirs["chunked"], logits_of(model, idx)[:, 7:]) < 1e-6
    with torch.no_grad():
        packed = model.lm_head(model.hidden(idx, at=rotary(model, PACKED.expand(2, -1)))).float()
    assert torch.equal(theirs["packed"], packed)
    assert rel_err(theirs["packed"], logits_of(model, idx)) > 1e-3  # the positions do count


@pytest.mark.parametrize("name", ROUTED)
def test_the_outputs_transformers_promises(fresh, name):
    """hidden_states (each block's attention input and the final normed state, L + 1), a tuple
    for return_dict=False, logits_to_keep as a count and as positions, the base AutoModel."""
    model, theirs, idx = fresh.models[name], fresh.hf[name], tokens(T=12)
    with torch.no_grad():
        final = model.hidden(idx)
    states = theirs["hidden-states"]
    assert len(states) == model.config.n_layer + 1 and torch.equal(states[-1], final)
    if name == "mhar-full-tied":  # block l's attention reads route(s_0 .. s_2l) at site 2l
        outputs = []
        hooks = [layer.register_forward_hook(lambda m, a, out: outputs.append(out))
                 for layer in model.layers]
        with torch.no_grad():
            model.hidden(idx)
            sources = [model.embed(idx)] + outputs
            for layer in range(model.config.n_layer):
                site = model.sites[2 * layer]
                expected = route(torch.stack(sources[:2 * layer + 1]), site.query,
                                 site.norm_weight, model.config.depth_heads, model.config.norm_eps)
                assert rel_err(states[layer], expected) < 1e-6
        for hook in hooks:
            hook.remove()
    loss, logits = theirs["tuple"]
    assert torch.equal(logits, theirs["logits"]) and torch.equal(loss, theirs["loss"])
    assert torch.equal(theirs["keep-2"], theirs["logits"][:, -2:])
    assert torch.equal(theirs["keep-some"], theirs["logits"][:, [0, 5]])
    assert torch.equal(theirs["base"], final)
    assert torch.equal(theirs["sdpa"], theirs["logits"])  # attn_implementation="sdpa": what it is


@pytest.mark.parametrize("name", ROUTED)
def test_fine_tuning_plumbing(fresh, name):
    """gradient_checkpointing_enable: Config.checkpointing (each sublayer runs again in
    backward), the same gradients; resize_token_embeddings, saved and loaded again; .to(bf16)
    after loading: the logits of loading in bf16 (the rotary tables stay fp32)."""
    theirs = fresh.hf[name]
    calls, grads = theirs["checkpointed"]
    assert calls == 2
    assert grads.keys() == theirs["grads"].keys()
    for n, grad in grads.items():
        assert rel_err(grad, theirs["grads"][n]) < 1e-6, n
    resized = theirs["resized"]
    vocab = fresh.models[name].config.vocab_size
    assert resized.size(-1) == vocab + 8 and torch.equal(resized[..., :vocab], theirs["logits"])
    assert torch.equal(theirs["to-bf16"], theirs["logits-bf16"])


def test_a_directory_without_some_tensors_starts_them_as_gpt_does(fresh):
    model, lacking = fresh.models["mhar-full-tied"], fresh.lacking
    ours = {f"model.{n}": t for n, t in model.state_dict().items()}
    assert lacking.keys() == ours.keys()
    assert all(torch.equal(lacking[n], t) for n, t in ours.items() if n not in DROPPED)
    query, norm, projection = (lacking[n] for n in DROPPED)
    assert torch.equal(query, torch.zeros_like(query)) and torch.equal(norm, torch.ones_like(norm))
    assert projection.std().item() == pytest.approx(0.02, rel=0.1)  # N(0, 0.02^2), not garbage


def test_qwen3_for_causal_lm_loads_nothing_of_a_routed_export(fresh):
    """As docs/conversion.md says: a Qwen3 of the directory's shape, every tensor new but the
    final norm's weight (the one name both share)."""
    for answers in fresh.hf.values():
        missing, every = answers["as-qwen3"]
        assert every - missing <= {"lm_head.weight", "model.norm.weight"}  # a tied head: the embedding


def test_trainers_gradient_checkpointing_is_configs(fresh):
    """Trainer(gradient_checkpointing=True) for one step: Config.checkpointing on, the first
    sublayer run again in backward (a forward, then its recompute)."""
    if fresh.samples is None:
        pytest.skip("transformers' Trainer needs accelerate: pip install accelerate")
    assert fresh.trainer == (True, 2)


def test_a_pipelines_batches_give_what_one_prompt_at_a_time_gives(fresh):
    one, two = fresh.pipeline
    assert one == two and len(one) == len(GEN_PROMPTS)


@pytest.mark.parametrize("name", ROUTED)
def test_what_transformers_saves_loads_here(fresh, name):
    """transformers' own save_pretrained of the model (after fine-tuning with it, say) writes a
    directory hf.load reads: the same tensors and logits."""
    resaved = hf.load(fresh.dirs[name].with_name(f"{name}-resaved"))
    model = fresh.models[name]
    assert resaved.config == model.config.__class__(**{**dataclasses.asdict(model.config),
                                                       "seq_len": resaved.config.seq_len})
    assert all(torch.equal(a, b) for a, b in zip(resaved.state_dict().values(),
                                                 model.state_dict().values()))
    assert torch.equal(logits_of(resaved, tokens(T=12)), logits_of(model, tokens(T=12)))


def test_autotokenizer_reads_the_directorys_tokenizer(fresh):
    import prepare
    assert fresh.token_ids == prepare.hf_tokenizer(fresh.source).encode_batch([SENTENCE])[0]


def test_lm_evals_hf_model_gives_eval_pys_loglikelihoods_and_generations(fresh):
    """lm-eval's own hf model (transformers, the directory's code) and eval.py (hf.load)
    on the same directory and offline tasks: request by request, the same log-likelihoods, and
    the same greedy generations (lm-eval at batch size 4, padded; eval.py by prompt length)."""
    if fresh.samples is None:
        pytest.skip("lm-eval's hf model needs lm-eval and accelerate: pip install lm-eval "
                    "accelerate")
    from scripts import eval
    tasks = ["tiny_choice", "tiny_text", "tiny_gen"]
    ours = eval.evaluate(fresh.dirs["mhar-full-tied"], tasks, include_path=fresh.root,
                         batch_size=4, device="cpu", log_samples=True,
                         output=fresh.root / "eval.json")["samples"]
    assert fresh.samples.keys() == ours.keys() == set(tasks)
    compared = 0
    for task, samples in fresh.samples.items():
        mine = {s["doc_id"]: s for s in ours[task]}
        for doc_id, arguments, resps in samples:
            assert [list(a) for a in mine[doc_id]["arguments"]] == [list(a) for a in arguments]
            for [theirs], [expected] in zip(resps, mine[doc_id]["resps"]):
                if task == "tiny_gen":  # generate_until: lm-eval pads its batch of 4 on the left
                    assert theirs == expected, doc_id
                    compared += 1
                    continue
                if task == "tiny_choice":  # (log p, is_greedy); rolling: log p alone
                    theirs, expected = theirs[0], expected[0]
                assert theirs == pytest.approx(expected, rel=1e-5, abs=1e-5), (task, doc_id)
                compared += 1
    assert compared == 3 * 3 + 1 + len(GEN_PROMPTS)


# ----------------------------------------------------------------------------------------------
# A routed export's code in this process: its window's edges, padding, a cache, hidden_states

WINDOW = 16


@pytest.fixture(scope="module")
def remote(tmp_path_factory):
    """A routed export of a window of WINDOW positions and the MHARForCausalLM that transformers builds
    from it, in this process: the directory's own three files, modeling_mhar.py imported as a package
    whose folder is the directory (its relative imports read the directory's configuration_mhar.py and
    mhar.py, as trust_remote_code's do, without writing into the user's module cache). It is named
    modeling_mhar, as the repository's file is: tests/mutate.py's mutants of modeling_mhar.py, which
    hf.save copies, reach it."""
    import importlib.util
    directory = tmp_path_factory.mktemp("remote")
    torch.manual_seed(0)
    model = open_routing(GPT(tiny("mhar", vocab_size=100, seq_len=WINDOW, route_block=2)).eval())
    hf.save(model, directory)
    spec = importlib.util.spec_from_file_location("modeling_mhar", directory / "modeling_mhar.py",
                                                  submodule_search_locations=[str(directory)])
    modeling = sys.modules["modeling_mhar"] = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(modeling)
        theirs = modeling.MHARForCausalLM.from_pretrained(directory).eval()
        base = modeling.MHARModel.from_pretrained(directory).eval()
        yield types.SimpleNamespace(model=model, theirs=theirs, base=base, directory=directory, modeling=modeling)
    finally:
        for name in [n for n in sys.modules if n.split(".")[0] == "modeling_mhar"]:
            del sys.modules[name]


def window_tokens(B=2, T=WINDOW, seed=1):
    return torch.randint(0, 100, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("new", [1, 2, 3, WINDOW - 7], ids=["one", "two", "three", "to-the-window"])
def test_tokens_after_a_cache_without_a_mask_are_those_of_the_whole_sequence(remote, new):
    """`new` tokens after a cache of 7, no attention_mask: each block's hidden state and the logits of the
    whole sequence's forward at those positions (up to the rounding of another attention shape). Two is the
    fewest that need a causal mask among themselves, which SDPA's is_causal would misplace after a cache."""
    idx = window_tokens()[:, :7 + new]
    with torch.no_grad():
        whole = remote.theirs(idx, output_hidden_states=True)
        first = remote.theirs(idx[:, :7])
        after = remote.theirs(idx[:, 7:], past_key_values=first.past_key_values, output_hidden_states=True)
    assert after.past_key_values.get_seq_length() == 7 + new
    assert len(after.hidden_states) == remote.model.config.n_layer + 1
    for state, full in zip(after.hidden_states, whole.hidden_states):
        assert rel_err(state, full[:, 7:]) < 1e-6
    assert rel_err(after.logits, logits_of(remote.model, idx)[:, 7:]) < 1e-6


def padded_hidden(remote, model, idx, mask, cache=None):
    """GPT.hidden of a padded batch idx (B, T), mask (B, start + T), at the Positions that the export's
    modeling_mhar.py builds (padded_positions), for any GPT of this process."""
    start = 0 if cache is None else cache[0].length
    return model.hidden(idx, cache=cache, at=remote.modeling.padded_positions(model, start, idx.size(1), mask))


@pytest.mark.parametrize("residual, overrides", GENERATE_MODES,
                         ids=["baseline", "hyper", "attnres", "mhar", "mhar-block2", "delta-block2"])
def test_padding_changes_no_tokens_output(remote, residual, overrides):
    """Rows of 7 and 4 tokens in one batch, left- and right-padded, and prefilled in two chunks through a cache,
    in every residual mode: each row's hidden states as it alone gives them, in float32 up to the rounding of
    another attention shape; padding (here huge embeddings) never reaches a token."""
    torch.manual_seed(0)
    model = perturbed(GPT(tiny(residual, **overrides)), scale=0.3).eval()
    with torch.no_grad():
        model.embed.weight[0] = 1e4                                  # the padding id's embedding
    a, b = torch.randint(1, 128, (1, 7)), torch.randint(1, 128, (1, 4))
    pad = torch.zeros(1, 3, dtype=torch.long)
    left, right = torch.cat([a, torch.cat([pad, b], 1)]), torch.cat([a, torch.cat([b, pad], 1)])
    mask_left, mask_right = (left != 0).long(), (right != 0).long()
    with torch.no_grad():
        alone = model.hidden(a)[0], model.hidden(b)[0]
        padded = padded_hidden(remote, model, left, mask_left), padded_hidden(remote, model, right, mask_right)
        kv = [KVCache() for _ in model.layers]
        chunked = torch.cat([padded_hidden(remote, model, left[:, :4], mask_left[:, :4], kv),
                             padded_hidden(remote, model, left[:, 4:], mask_left, kv)], 1)
    for h in (padded[0], chunked):
        assert rel_err(h[0], alone[0]) < 1e-5 and rel_err(h[1, 3:], alone[1]) < 1e-5
    assert rel_err(padded[1][0], alone[0]) < 1e-5 and rel_err(padded[1][1, :4], alone[1]) < 1e-5
    assert not any(h.isnan().any() for h in (*padded, chunked))      # padding rows included


@pytest.mark.parametrize("residual", ["baseline", "mhar"])
def test_a_left_padded_row_without_positions_reads_as_the_row_alone(remote, residual):
    """A mask and no position_ids number each row's tokens from its first real one, as transformers numbers a
    padded batch: a row padded on the left gives, at its real tokens, the hidden states of those tokens alone
    (an unpadded row beside it is unchanged)."""
    torch.manual_seed(0)
    model = perturbed(GPT(tiny(residual)), scale=0.1)
    idx = torch.randint(0, 128, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[0, :3] = 0                                                    # row 0: three padding tokens first
    with torch.no_grad():
        padded, alone, full = padded_hidden(remote, model, idx, mask), model.hidden(idx[:1, 3:]), model.hidden(idx[1:])
    assert rel_err(padded[0, 3:], alone[0]) < 1e-5 and rel_err(padded[1], full[0]) < 1e-5


def test_a_padded_batchs_masks_are_built_on_the_tokens_device(remote):
    """The padding mask and the causal one are built on the device of the tokens (on "meta", which holds no
    data, as a GPU would need: a table on the CPU meeting one on the GPU is an error). The baseline: the routed
    modes ask autocast about the device, which "meta" has no answer to; the masks are shared."""
    model = GPT(tiny("baseline")).to("meta")
    idx, mask = torch.zeros(2, 8, dtype=torch.long, device="meta"), torch.ones(2, 8, device="meta")
    h = padded_hidden(remote, model, idx, mask)
    assert h.device.type == "meta" and h.shape == (2, 8, model.config.n_embd)


@pytest.mark.parametrize("lengths, side", [
    ([WINDOW, 9, 1], "left"), ([WINDOW, 9, 1], "right"), ([WINDOW - 1, 5], "left"), ([WINDOW, 0, 3], "left"),
    ([WINDOW, 0], "right")], ids=["fills-window-left", "fills-window-right", "one-short-left",
                                  "fully-padded-row-left", "fully-padded-row-right"])
def test_a_padded_batch_whose_longest_row_fills_the_window(remote, lengths, side):
    """Rows of `lengths` tokens padded to the longest: every row's logits are those it gives alone (the
    default positions count each row's tokens from 0, so a row of WINDOW reaches WINDOW - 1), and nothing
    is NaN: a padding query, in a row of padding alone too, keeps its own key where SDPA would have none
    (a softmax over nothing: NaN, or zeros in this torch's CPU math), so before any token of its row (left
    padding) its logits are those of its token alone, at position 0. Right padding reads the row before
    it."""
    width, idx = max(lengths), window_tokens(B=len(lengths))
    ids, mask = (torch.zeros(len(lengths), width, dtype=torch.long) for _ in range(2))
    for i, n in enumerate(lengths):
        at = slice(width - n, width) if side == "left" else slice(0, n)
        ids[i, at], mask[i, at] = idx[i, :n], 1
    with torch.no_grad():
        logits = remote.theirs(ids, attention_mask=mask).logits
    assert torch.isfinite(logits).all()
    padding = logits_of(remote.model, torch.zeros(1, 1, dtype=torch.long))[0, 0]  # the padding id, 0, alone
    for i, n in enumerate(lengths):
        at = slice(width - n, width) if side == "left" else slice(0, n)
        if n:
            assert rel_err(logits[i, at], logits_of(remote.model, idx[i:i + 1, :n])[0]) < 1e-6
        for j in range(width - n if side == "left" else width * (n == 0)):  # padding before the row
            assert rel_err(logits[i, j], padding) < 1e-6, (i, j)


@pytest.mark.parametrize("T, first, accepted", [
    (1, WINDOW - 1, True), (1, WINDOW, False), (1, -1, False), (1, 0, True), (WINDOW, 0, True),
    (WINDOW, 1, False), (2, WINDOW - 1, False), (3, 5, True)],
    ids=["last-position", "window", "negative", "zero", "whole-window", "whole-window-shifted", "past-the-window",
         "middle"])
def test_position_ids_reach_the_window_and_no_further(remote, T, first, accepted):
    """position_ids first, first + 1, ... (T tokens): up to WINDOW - 1 they are the rotary positions
    GPT.hidden takes; at WINDOW or below 0, one ValueError that names the range (not an IndexError in the
    rotary table)."""
    idx, positions = window_tokens(T=T), (first + torch.arange(T)).expand(2, -1)
    if not accepted:
        with pytest.raises(ValueError, match=re.escape(f"position_ids must be (B, {T}) in [0, {WINDOW})")):
            remote.theirs(idx, position_ids=positions)
        return
    with torch.no_grad():
        expected = remote.model.lm_head(remote.model.hidden(idx, at=rotary(remote.model, positions))).float()
        assert torch.equal(remote.theirs(idx, position_ids=positions).logits, expected)


@pytest.mark.parametrize("new, use_cache", [(WINDOW - 9, True), (WINDOW - 8, True), (WINDOW - 9, False),
                                            (WINDOW - 8, False)],
                         ids=["fills-window-cached", "past-window-cached", "fills-window", "past-window"])
def test_generate_past_the_window_says_that_the_window_is_full(remote, new, use_cache):
    """transformers' generate from 10 tokens: the last token of a full window predicts one more (GPT.generate's
    tokens); one step further, the error of a plain forward past the window, not one about the position_ids
    that generate derived (the caller passed none)."""
    model = remote.theirs
    prompt = window_tokens(T=10)
    settings = dict(max_new_tokens=new, do_sample=False, use_cache=use_cache, eos_token_id=None, pad_token_id=0)
    if new == WINDOW - 9:  # the last step reads 10 + new - 1 = WINDOW tokens
        generated = model.generate(prompt, **settings)
        assert torch.equal(generated, remote.model.generate(prompt, new, temperature=0))
        return
    with pytest.raises(ValueError) as refused:
        model.generate(prompt, **settings)
    assert str(refused.value) == f"sequence of {WINDOW + 1} tokens is longer than Config.seq_len={WINDOW}"
    with pytest.raises(ValueError, match=re.escape(str(refused.value))):
        model(window_tokens(T=WINDOW + 1))


@pytest.mark.parametrize("configured", [False, True], ids=["config-off", "config-on"])
def test_output_hidden_states_unsaid_follows_the_config(remote, configured, monkeypatch):
    """As transformers' models: output_hidden_states=None takes config.output_hidden_states; said, it wins."""
    monkeypatch.setattr(remote.theirs.config, "output_hidden_states", configured)
    idx = window_tokens(T=8)
    with torch.no_grad():
        unsaid, said_no, said_yes = (remote.theirs(idx, output_hidden_states=said).hidden_states
                                     for said in (None, False, True))
        base = remote.theirs.model  # the GPT inside; its final state is the last of the L + 1
        final = base.hidden(idx)
    assert said_no is None and len(said_yes) == remote.model.config.n_layer + 1
    assert torch.equal(said_yes[-1], final)
    if configured:
        assert all(torch.equal(a, b) for a, b in zip(unsaid, said_yes)) and len(unsaid) == len(said_yes)
    else:
        assert unsaid is None


# the remote model in this process, each of its arguments and outputs against the GPT it was exported from

def reference(remote, idx, positions=None):
    """(GPT's final hidden states, its float32 logits) of idx: what MHARModel and MHARForCausalLM give."""
    with torch.no_grad():
        h = remote.model.hidden(idx, at=None if positions is None else rotary(remote.model, positions))
        return h, remote.model.lm_head(h).float()


def main_output(output, kind):
    return output.logits if kind == "causal-lm" else output.last_hidden_state


KINDS = ["causal-lm", "base"]


@pytest.mark.parametrize("argument", ["none", "position_ids", "attention_mask", "cache", "past_key_values",
                                      "cache-use_cache-off", "use_cache-off", "output_hidden_states",
                                      "return_dict-off"])
@pytest.mark.parametrize("kind", KINDS)
def test_both_classes_take_each_argument_to_its_effect(remote, kind, argument):
    """MHARForCausalLM (its logits) and MHARModel, the AutoModel (its final hidden states), each argument
    alone: the rotary positions, a left-padded row as it gives alone, tokens after a cache passed as `cache`
    or as `past_key_values` (before transformers 5.24), no cache returned when asked for none, the L + 1
    hidden states, a tuple. A cache passed with use_cache=False is read and extended all the same, as
    transformers' Qwen3 does, and not returned (it was ignored: the tokens computed as if alone, silently)."""
    model, which = (remote.theirs, 1) if kind == "causal-lm" else (remote.base, 0)
    idx = window_tokens(T=8)
    expected = reference(remote, idx)[which]
    with torch.no_grad():
        if argument == "none":
            output = model(idx)
            assert torch.equal(main_output(output, kind), expected) and output.hidden_states is None
            assert output.cache.get_seq_length() == 8           # use_cache, unsaid: the config's, on
        elif argument == "position_ids":
            positions = (torch.arange(8) % 5).expand(2, -1)   # two documents packed in a row
            got = main_output(model(idx, position_ids=positions), kind)
            assert torch.equal(got, reference(remote, idx, positions)[which])
            assert rel_err(got, expected) > 1e-3               # the positions do count
        elif argument == "attention_mask":
            ids, mask = idx.clone(), torch.ones_like(idx)
            ids[0, :3], mask[0, :3] = 0, 0                     # row 0: five tokens, left-padded
            got = main_output(model(ids, attention_mask=mask), kind)
            assert rel_err(got[0, 3:], reference(remote, idx[:1, 3:])[which][0]) < 1e-6
            assert rel_err(got[1], expected[1]) < 1e-6
            assert torch.equal(main_output(model(ids, attention_mask=mask, use_cache=False), kind), got)
        elif argument in ("cache", "past_key_values"):
            first = model(idx[:, :5])
            got = main_output(model(idx[:, 5:], **{argument: first.cache}), kind)
            assert rel_err(got, expected[:, 5:]) < 1e-6 and first.cache.get_seq_length() == 8
        elif argument == "cache-use_cache-off":
            cache = model(idx[:, :5]).cache
            output = model(idx[:, 5:], cache=cache, use_cache=False)
            assert rel_err(main_output(output, kind), expected[:, 5:]) < 1e-6
            assert output.cache is None and cache.get_seq_length() == 8
        elif argument == "use_cache-off":
            output = model(idx, use_cache=False)
            assert output.cache is None and torch.equal(main_output(output, kind), expected)
        elif argument == "output_hidden_states":
            states = model(idx, output_hidden_states=True).hidden_states
            inputs = []  # each attention sublayer's input in the GPT: its block's hidden state
            hooks = [layer.register_forward_pre_hook(lambda module, args: inputs.append(args[0]))
                     for layer in remote.model.layers if type(layer).__name__ == "Attention"]
            final = reference(remote, idx)[0]
            for hook in hooks:
                hook.remove()
            assert len(states) == len(inputs) + 1 == remote.model.config.n_layer + 1
            assert all(torch.equal(a, b) for a, b in zip(states, [*inputs, final]))
        else:
            output = model(idx, return_dict=False)
            assert isinstance(output, tuple) and torch.equal(output[0], expected)
            assert output[1].get_seq_length() == 8


@pytest.mark.parametrize("call, refusal", [
    (dict(inputs_embeds=torch.zeros(2, 8, 64)), "{cls} takes input_ids, not inputs_embeds"),
    (dict(output_attentions=True), "{cls} has no attention weights to output (its attention is torch's SDPA); "
                                   "the routing weights over depth: mhar.GPT.routing_weights"),
    (dict(foo=1), "{cls} does not take foo"),
    (dict(foo=1, bar=2, num_items_in_batch=3), "{cls} does not take bar, foo"),
    (dict(attention_mask=torch.ones(2, 7, dtype=torch.long)), "attention_mask must be (B, 8): 1 for each token "
                                                               "of the cache and the input, 0 for padding"),
    (dict(attention_mask=torch.ones(2, 9, dtype=torch.long)), "attention_mask must be (B, 8)"),
    (dict(attention_mask=torch.ones(1, 8, dtype=torch.long)), "attention_mask must be (B, 8)"),
    (dict(position_ids=torch.arange(7).expand(2, -1)), "position_ids must be (B, 8) in [0, 16)"),
    (dict(position_ids=torch.arange(9).expand(2, -1)), "position_ids must be (B, 8) in [0, 16)"),
    (dict(cache=types.SimpleNamespace(is_compileable=True)),
     "{cls} takes a dynamic cache (the default), not a static one: drop cache_implementation=\"static\""),
    (dict(past_key_values=types.SimpleNamespace(is_compileable=True)), "not a static one"),
], ids=["inputs_embeds", "output_attentions", "unknown", "two-unknown-sorted", "mask-one-short", "mask-one-long",
        "mask-one-row", "positions-one-short", "positions-one-long", "static-cache", "static-past_key_values"])
@pytest.mark.parametrize("kind", KINDS)
def test_what_either_class_cannot_honour_is_one_value_error(remote, kind, call, refusal):
    model = remote.theirs if kind == "causal-lm" else remote.base
    with pytest.raises(ValueError) as refused:
        model(window_tokens(T=8), **call)
    assert refusal.format(cls=type(model).__name__) in str(refused.value)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("width, accepted", [(2, False), (3, False), (7, False), (8, True), (9, False)],
                         ids=["new-only-one-less", "the-new-tokens-alone", "one-less", "cache-and-new", "one-more"])
def test_a_mask_after_a_cache_covers_the_cache_and_the_new_tokens(remote, kind, width, accepted):
    """Three tokens after a cache of five: a mask of 8 columns, no fewer (the new tokens' alone is the usual
    mistake) and no more; all ones it is the unmasked path's result exactly (no padding)."""
    model, which = (remote.theirs, 1) if kind == "causal-lm" else (remote.base, 0)
    idx = window_tokens(T=8)
    with torch.no_grad():
        unmasked = main_output(model(idx[:, 5:], cache=model(idx[:, :5]).cache), kind)
        cache, mask = model(idx[:, :5]).cache, torch.ones(2, width, dtype=torch.long)
        if not accepted:
            with pytest.raises(ValueError, match=re.escape("attention_mask must be (B, 8)")):
                model(idx[:, 5:], cache=cache, attention_mask=mask)
            return
        masked = main_output(model(idx[:, 5:], cache=cache, attention_mask=mask), kind)
    assert torch.equal(masked, unmasked) and rel_err(masked, reference(remote, idx)[which][:, 5:]) < 1e-6


@pytest.mark.parametrize("configured", [False, True], ids=["config-off", "config-on"])
@pytest.mark.parametrize("said", [None, False, True], ids=["unsaid", "said-off", "said-on"])
def test_use_cache_unsaid_follows_the_config(remote, configured, said, monkeypatch):
    monkeypatch.setattr(remote.theirs.config, "use_cache", configured)
    with torch.no_grad():
        cache = remote.theirs(window_tokens(T=8), use_cache=said).cache
    kept = configured if said is None else said
    assert (cache.get_seq_length() == 8) if kept else cache is None


@pytest.mark.parametrize("return_dict, configured, whole", [
    (None, True, True), (None, False, False), (True, False, True), (False, True, False)],
    ids=["unsaid-config-on", "unsaid-config-off", "said-on", "said-off"])
@pytest.mark.parametrize("kind", KINDS)
def test_return_dict_unsaid_follows_the_config(remote, kind, return_dict, configured, whole, monkeypatch):
    model = remote.theirs if kind == "causal-lm" else remote.base
    monkeypatch.setattr(model.config, "return_dict", configured)
    with torch.no_grad():
        output = model(window_tokens(T=8), return_dict=return_dict)
    assert isinstance(output, tuple) is not whole


@pytest.mark.parametrize("keep, expected", [(0, slice(None)), (1, slice(7, None)), (2, slice(6, None)),
                                            (7, slice(1, None)), (8, slice(None)), (9, slice(None)),
                                            (torch.tensor([0, 5]), [0, 5])],
                         ids=["zero-all", "one", "two", "all-but-one", "all", "one-more-than-all", "positions"])
def test_logits_to_keep_are_the_last_n_or_those_named(remote, keep, expected):
    with torch.no_grad():
        logits = remote.theirs(window_tokens(T=8), logits_to_keep=keep).logits
    assert rel_err(logits, reference(remote, window_tokens(T=8))[1][:, expected]) < 1e-6  # rounding of a shape


@pytest.mark.parametrize("items", [None, 5, 14], ids=["mean", "over-five-items", "over-every-label"])
def test_labels_give_transformers_causal_loss(remote, items):
    """labels shifted inside, -100 ignored (a label two positions in, of row 1); with num_items_in_batch (what
    Trainer passes on over gradient accumulation) the sum over that many."""
    import torch.nn.functional as F
    idx = window_tokens(T=8)
    labels = idx.clone()
    labels[1, 2] = -100
    kwargs = {} if items is None else dict(num_items_in_batch=items)
    with torch.no_grad():
        output = remote.theirs(idx, labels=labels, **kwargs)
    logits = reference(remote, idx)[1]
    each = F.cross_entropy(logits[:, :-1].reshape(-1, 100), labels[:, 1:].reshape(-1), reduction="none")
    expected = each.sum() / (13 if items is None else items)  # 14 predicted labels, one ignored
    assert output.loss.item() == pytest.approx(expected.item(), rel=1e-6)
    assert torch.equal(output.logits, logits)


def test_logits_are_float32_in_a_bf16_model(remote):
    """As GPT.forward's: the LM head runs in bf16, its logits are returned in float32."""
    import copy
    theirs, ours = (copy.deepcopy(m).to(torch.bfloat16) for m in (remote.theirs, remote.model))
    idx = window_tokens(T=8)
    with torch.no_grad():
        logits = theirs(idx).logits
    assert logits.dtype == torch.float32 and torch.equal(logits, ours(idx)[0])


@pytest.mark.parametrize("asked, multiple, size", [(99, None, 99), (100, None, 100), (101, None, 101),
                                                   (108, None, 108), (101, 8, 104)],
                         ids=["one-fewer", "same", "one-more", "eight-more", "one-more-padded-to-eight"])
def test_resize_token_embeddings_resizes_gpts_vocabulary(remote, asked, multiple, size):
    """transformers' resize (its options too: pad_to_multiple_of): the embedding and (tied) LM head of `size`
    rows, the old rows kept, and mhar.Config's vocab_size and the config's "mhar" section (what save_pretrained
    writes) follow it."""
    import copy
    model = copy.deepcopy(remote.theirs)
    embeddings = model.resize_token_embeddings(asked, pad_to_multiple_of=multiple, mean_resizing=False)
    assert embeddings is model.model.embed and embeddings.num_embeddings == size
    assert model.model.config.vocab_size == model.config.mhar["vocab_size"] == model.config.vocab_size == size
    idx = window_tokens(T=8) % min(size, 100)
    with torch.no_grad():
        logits = model(idx).logits
    kept = min(size, 100)
    assert logits.shape == (2, 8, size) and torch.equal(logits[..., :kept], reference(remote, idx)[1][..., :kept])
    assert remote.theirs.config.mhar["vocab_size"] == 100  # the copy's alone


def test_the_embeddings_transformers_reads_and_replaces_are_gpts(remote):
    import copy
    model = copy.deepcopy(remote.theirs)
    assert model.get_input_embeddings() is model.model.embed
    assert model.get_output_embeddings() is model.model.lm_head
    embed, head = torch.nn.Embedding(100, 64), torch.nn.Linear(64, 100, bias=False)
    torch.nn.init.zeros_(head.weight)
    model.set_input_embeddings(embed)
    model.set_output_embeddings(head)
    assert model.get_input_embeddings() is model.model.embed is embed
    assert model.get_output_embeddings() is model.model.lm_head is head
    with torch.no_grad():
        assert torch.equal(model(window_tokens(T=8)).logits, torch.zeros(2, 8, 100))


def test_activation_checkpointing_is_configs_and_keeps_no_cache_while_training(remote):
    """activation_checkpointing_enable (gradient_checkpointing_enable, Trainer's): Config.checkpointing, the
    first sublayer run again in backward, the same gradients; a forward that records gradients keeps no cache
    (recomputing would extend it twice), one under no_grad does; disabled, all as before."""
    import copy
    model = copy.deepcopy(remote.theirs)
    idx = window_tokens(T=8)

    def step():
        model.zero_grad(set_to_none=True)
        calls = []
        hook = model.model.layers[0].register_forward_pre_hook(lambda *_: calls.append(1))
        output = model(idx, labels=idx, use_cache=True)
        output.loss.backward()
        hook.remove()
        return len(calls), output.cache, {n: p.grad for n, p in model.named_parameters()}

    calls, cache, grads = step()
    assert (calls, cache.get_seq_length()) == (1, 8)
    # activation_checkpointing_enable where transformers has it; gradient_checkpointing_enable, now deprecated
    (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    assert model.model.config.checkpointing is True and model.gradient_checkpointing is True
    calls, cache, checkpointed = step()
    assert (calls, cache) == (2, None)
    assert all(rel_err(checkpointed[n], g) < 1e-6 for n, g in grads.items())
    with torch.no_grad():
        assert model(idx).cache.get_seq_length() == 8
    (getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable)()
    assert model.model.config.checkpointing is False and model.gradient_checkpointing is False
    calls, cache, _ = step()
    assert (calls, cache.get_seq_length()) == (1, 8)


@pytest.mark.parametrize("implementation, refused", [(None, False), ("sdpa", False), ("eager", True)],
                         ids=["unsaid", "sdpa", "eager"])
def test_attention_other_than_sdpa_is_refused_when_the_model_is_built(remote, implementation, refused):
    config = remote.modeling.MHARConfig.from_pretrained(remote.directory, attn_implementation=implementation)
    if refused:
        with pytest.raises(ValueError) as error:
            remote.modeling.MHARForCausalLM(config)
        assert str(error.value) == (f"MHARForCausalLM's attention is torch's SDPA: attn_implementation="
                                    f"{implementation!r} is not supported; use \"sdpa\" (the default)")
        return
    built = remote.modeling.MHARForCausalLM(config).model.config  # the directory's mhar.Config
    assert dataclasses.asdict(built) == dataclasses.asdict(remote.model.config)


def test_a_mhar_section_with_fields_this_mhar_py_lacks_builds_the_rest(remote):
    """An export's "mhar" section holds mhar.Config's fields and its note (and whatever a later version adds):
    the model is built from the fields mhar.Config has."""
    import copy
    config = copy.deepcopy(remote.theirs.config)
    config.mhar = {**config.mhar, "a_later_field": 3}
    built = remote.modeling.MHARModel(config).model.config
    assert dataclasses.asdict(built) == dataclasses.asdict(remote.model.config)


def test_tensors_a_directory_lacks_start_as_gpt_starts_them_and_the_rest_are_read(remote, tmp_path):
    """_init_weights on the modules transformers did not fill: a routing query GPT starts at zero, a norm
    weight at one, a projection at N(0, 0.02^2); every tensor the directory holds is its own, bit for bit."""
    from safetensors.torch import load_file, save_file
    dropped = ("model.sites.1.query", "model.sites.2.norm_weight", "model.layers.0.q_proj.weight")
    for file in remote.directory.iterdir():
        (tmp_path / file.name).write_bytes(file.read_bytes())
    tensors = load_file(tmp_path / "model.safetensors")
    save_file({n: t for n, t in tensors.items() if n not in dropped}, tmp_path / "model.safetensors",
              metadata={"format": "pt"})
    loaded = remote.modeling.MHARForCausalLM.from_pretrained(tmp_path).state_dict()
    ours = {f"model.{n}": t for n, t in remote.model.state_dict().items()}
    assert loaded.keys() == ours.keys()
    assert all(torch.equal(loaded[n], t) for n, t in ours.items() if n not in dropped)
    query, norm, projection = (loaded[n] for n in dropped)
    assert torch.equal(query, torch.zeros_like(query)) and torch.equal(norm, torch.ones_like(norm))
    assert projection.std().item() == pytest.approx(0.02, rel=0.1)
    assert not torch.equal(ours["model.sites.1.query"], query)  # open_routing moved it off its start


def test_set_gradient_checkpointing_has_transformers_defaults(remote):
    """The hook's signature is PreTrainedModel._set_gradient_checkpointing's: called bare, as transformers'
    own method may be, it turns checkpointing on (every_n_layers, unused, keeps transformers' default too)."""
    import inspect
    ours = inspect.signature(remote.modeling.MHARPreTrainedModel._set_gradient_checkpointing).parameters
    theirs = inspect.signature(transformers.PreTrainedModel._set_gradient_checkpointing).parameters
    for name in ("enable", "every_n_layers"):
        assert ours[name].default == theirs[name].default, name
    model = remote.modeling.MHARForCausalLM(remote.theirs.config)
    try:
        model._set_gradient_checkpointing()
        assert model.model.config.checkpointing is True and model.gradient_checkpointing is True
    finally:
        model._set_gradient_checkpointing(enable=False)


def test_a_hyper_connection_lacking_one_tensor_keeps_the_others_it_holds(tmp_path):
    """A directory without one of a hyper-connection's tensors: that one starts as GPT starts it (static mix
    the identity), and every other tensor of the same module is the directory's, bit for bit. GPT.init_weights
    writes a hyper-connection's tensors in place, unseen by transformers' guarded torch.nn.init, so _init_weights
    must put back those the directory held."""
    import importlib.util
    from safetensors.torch import load_file, save_file
    torch.manual_seed(0)
    model = open_routing(GPT(tiny(residual="hyper", vocab_size=100, seq_len=WINDOW)).eval())
    hf.save(model, tmp_path)
    dropped = "model.connections.1.static_mix"
    tensors = load_file(tmp_path / "model.safetensors")
    save_file({n: t for n, t in tensors.items() if n != dropped}, tmp_path / "model.safetensors",
              metadata={"format": "pt"})
    # imported as the package modeling_mhar, as the remote fixture does, its entries set aside meanwhile
    held = {n: sys.modules.pop(n) for n in [n for n in sys.modules if n.split(".")[0] == "modeling_mhar"]}
    try:
        spec = importlib.util.spec_from_file_location("modeling_mhar", tmp_path / "modeling_mhar.py",
                                                      submodule_search_locations=[str(tmp_path)])
        modeling = sys.modules["modeling_mhar"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(modeling)
        loaded = modeling.MHARForCausalLM.from_pretrained(tmp_path).state_dict()
    finally:
        for name in [n for n in sys.modules if n.split(".")[0] == "modeling_mhar"]:
            del sys.modules[name]
        sys.modules.update(held)
    ours = {f"model.{n}": t for n, t in model.state_dict().items()}
    assert loaded.keys() == ours.keys()
    kept = [n for n in ours if n != dropped]
    assert [n for n in kept if not torch.equal(loaded[n], ours[n])] == []
    assert torch.equal(loaded[dropped], torch.eye(4))
    assert not torch.equal(ours[dropped], torch.eye(4))  # open_routing moved it off its start


@pytest.mark.parametrize("shape", [(2, 5, 1), (2, 4), (2, 6), (1, 5)],
                         ids=["trailing-dim", "one-less", "one-more", "one-row-broadcast"])
def test_position_ids_of_another_shape_are_one_valueerror(remote, shape):
    """position_ids whose last dimension is not the input's T (5) are the one ValueError that names (B, T), as
    one with a trailing dimension of 1 is, whose second is T; a single row (1, T) is accepted and gives the
    logits of the default positions (it broadcasts over the batch)."""
    idx = window_tokens(T=5)
    positions = torch.arange(shape[1]).expand(shape[0], -1)
    positions = positions[..., None] if len(shape) == 3 else positions
    with torch.no_grad():
        if shape == (1, 5):
            assert torch.equal(remote.theirs(idx, position_ids=positions).logits, remote.theirs(idx).logits)
            return
        with pytest.raises(ValueError, match=re.escape(f"position_ids must be (B, 5) in [0, {WINDOW})")):
            remote.theirs(idx, position_ids=positions)


@pytest.mark.parametrize("padded", [False, True], ids=["all-ones", "one-padded"])
def test_a_mask_without_padding_takes_the_unmasked_path(remote, monkeypatch, padded):
    """An attention_mask of ones reaches GPT.hidden as no Positions at all (its own causal ones: SDPA's is_causal
    path, the call without a mask, which a GPU can run in a kernel that takes no mask); a mask with one 0, as
    Positions whose keys leave that token out of every query but its own."""
    calls, hidden = [], remote.theirs.model.hidden
    monkeypatch.setattr(remote.theirs.model, "hidden", lambda *a, **k: calls.append(k["at"]) or hidden(*a, **k))
    idx, mask = window_tokens(T=5), torch.ones(2, 5, dtype=torch.long)
    mask[1, 0] = 0 if padded else 1
    with torch.no_grad():
        remote.theirs(idx, attention_mask=mask)
    assert len(calls) == 1 and (calls[0] is None) != padded
    if padded:  # who reads key 0: every query of row 0; in row 1, where it is padding, query 0 alone
        assert torch.equal(calls[0].allowed[:, 0, :, 0], torch.tensor([[True] * 5, [True] + [False] * 4]))
