"""
Hugging Face Qwen3 checkpoints in and out.

This project's decoder is Qwen3's (Qwen3 Technical Report, arXiv:2505.09388): given the same
weights, transformers' Qwen3ForCausalLM computes the same logits. So a Qwen3 directory
(config.json, and model.safetensors or the shards a model.safetensors.index.json lists) loads as
this project's baseline, or as a delta-routed model that starts as that baseline exactly, and a
trained model goes back to a directory:

    model = hf.load("models/Qwen3-0.6B")                                # the baseline, a mhar.GPT
    model = hf.load("models/Qwen3-0.6B", residual="mhar", route_block=8, route_heads=8)
    hf.save(model, "out/qwen3-0.6b-mhar")

The mapping, config.json -> Config:

    hidden_size -> n_embd, num_hidden_layers -> n_layer, num_attention_heads -> n_head,
    num_key_value_heads -> n_kv_head, intermediate_size -> ffn_hidden, head_dim -> head_dim,
    rope_parameters.rope_theta (transformers 4.x: rope_theta) -> rope_theta,
    rms_norm_eps -> norm_eps, tie_word_embeddings -> tie_embeddings, vocab_size -> vocab_size,
    max_position_embeddings -> seq_len (the longest sequence; train.py sets its own)

and the tensors, block i of Qwen3 being sublayers 2i (attention) and 2i + 1 (MLP) here:

    model.embed_tokens                          embed
    model.layers.i.input_layernorm              layers.2i.norm
    model.layers.i.self_attn.{q,k,v,o}_proj     layers.2i.{q,k,v,o}_proj
    model.layers.i.self_attn.{q,k}_norm         layers.2i.{q,k}_norm
    model.layers.i.post_attention_layernorm     layers.2i+1.norm
    model.layers.i.mlp.{gate,up,down}_proj      layers.2i+1.{gate,up,down}_proj
    model.norm                                  norm
    lm_head (untied embeddings only)            lm_head

A field that asks for something this decoder does not compute (another model_type, attention
biases, sliding windows, scaled rotary embeddings, another activation, ...) is one error naming
the field.

A routed model (attnres, mhar, hyper; delta or not) has no class in transformers. It is written
as a directory transformers runs with trust_remote_code: config.json with model_type "mhar",
an "auto_map" to configuration_mhar.py and modeling_mhar.py, both written into the directory
beside a copy of mhar.py (the modeling file adapts mhar.GPT to PreTrainedModel, it does not
restate it), and an "mhar" section with mhar.Config's fields; the tensors under GPT's own names
("model." + name) in model.safetensors, or in shards past max_shard_size; the tokenizer files.

    model = AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)  # GPT's logits

hf.load reads it too, and the layout written before it: mhar.safetensors with the
Qwen3 names above plus "mhar.<name>" for what routing adds, no code (transformers refuses it).

A baseline's config.json carries an "mhar" section too (residual "baseline"), which transformers
ignores: it marks every export as this project's. save writes into a new or empty folder, or over
an earlier export; a folder that holds another model, a train.py run or a file of the user's is
refused, untouched (export_folder).

Only safetensors is needed here (and huggingface_hub to fetch a model by its hub id);
transformers, the tests' oracle, is imported by the CPU demonstration alone (python -m lib.hf), at the
end of the file; the paper's 8B mid-training recipe, for train.py --init_from DIR, is midtrain.py.
"""
import dataclasses
import errno
import json
import os
import re
import shutil
from pathlib import Path

import torch

from mhar import ADDED_BY_RESIDUAL, GPT, Config
from lib import rivals
from lib.common import ROOT, CheckpointError, FlagParser, MachineError, exit_error, one_line, staged

# Absent fields take the defaults of transformers' Qwen3Config (transformers 5), as it would.
QWEN3_DEFAULTS = dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016,
                      num_hidden_layers=32, num_attention_heads=32, head_dim=128,
                      max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=False,
                      rope_theta=10000.0)

# What this decoder computes, for every field that could ask for something else:
# field -> (the value it needs, why). An absent field counts as its transformers default, this.
REQUIRED = {
    "model_type": ("qwen3", "its decoder is Qwen3's: QK-norm, SwiGLU, no biases"),
    "architectures": (["Qwen3ForCausalLM"], "a language model with its LM head"),
    "hidden_act": ("silu", "the MLP is SwiGLU, SiLU(gate) * up"),
    "attention_bias": (False, "the projections have no biases"),
    "attention_dropout": (0.0, "the model has no dropout"),
    "use_sliding_window": (False, "every layer attends to the whole causal context"),
    "layer_types": (["full_attention"], "every layer attends to the whole causal context"),
    "rope_type": ("default", "plain rotary embeddings, no YaRN, linear or dynamic scaling"),
    "partial_rotary_factor": (1.0, "rotary embeddings turn the whole head width"),
    "quantization_config": (None, "weights are plain floating-point tensors"),
}

MODEL_TYPE = "mhar"                          # a routed model's: its class is in the directory
# The layouts of a directory (layout()) and the stem of their weights, <stem>.safetensors
WEIGHTS = {"qwen3": "model", "remote": "model", "mhar": "mhar"}
# what transformers runs a routed model with (trust_remote_code): the adapter and the model itself
REMOTE_CODE = ("configuration_mhar.py", "modeling_mhar.py", "mhar.py")
# where each comes from: lib/remote/ and the repository's own mhar.py
REMOTE_SOURCES = {name: ROOT / ("lib/remote" if name != "mhar.py" else "") / name for name in REMOTE_CODE}
AUTO_MAP = {"AutoConfig": "configuration_mhar.MHARConfig", "AutoModel": "modeling_mhar.MHARModel",
            "AutoModelForCausalLM": "modeling_mhar.MHARForCausalLM"}
MAX_SHARD_SIZE = "5GB"  # the hub's habit (Qwen3-8B: five files of <= 4 GB): each downloads alone
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "added_tokens.json", "generation_config.json")
CARRIED = ("bos_token_id", "eos_token_id", "pad_token_id")  # the model ignores them, its users not
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")           # "Qwen/Qwen3-0.6B"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def safetensors_api():
    try:
        import safetensors.torch
    except ImportError:
        raise CheckpointError("reading and writing Hugging Face checkpoints needs safetensors: "
                              "pip install safetensors") from None
    return safetensors


def torch_dtype(dtype, default, caller):
    """torch.float32 / bfloat16 / float16 from a dtype or its name; None is `default`."""
    dtype = DTYPES.get(dtype, dtype) or default
    if dtype not in DTYPES.values():
        raise ValueError(f"{caller}: dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    return dtype


# ----------------------------------------------------------------------------------------------
# config.json <-> Config

def rope_settings(hf_config):
    """Rotary settings: transformers 5 keeps theta and type in rope_parameters, earlier versions
    kept rope_theta at the top level and the type in rope_scaling (null for plain rotary)."""
    rope = dict(hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {})
    if set(rope) == {"full_attention"}:                    # per layer type, all of one type
        rope = dict(rope["full_attention"])
    if any(isinstance(v, dict) for v in rope.values()):
        rope = {"rope_type": f"one per layer type ({', '.join(rope)})"}
    rope.setdefault("rope_type", rope.pop("type", "default"))
    rope.setdefault("rope_theta", hf_config.get("rope_theta", QWEN3_DEFAULTS["rope_theta"]))
    return rope


def check_mappable(hf_config, where):
    """Raise CheckpointError naming the first field of config.json this decoder cannot compute."""
    get, rope = hf_config.get, rope_settings(hf_config)
    found = dict(model_type=get("model_type"),
                 architectures=get("architectures") or ["Qwen3ForCausalLM"],
                 hidden_act=get("hidden_act", "silu"),
                 attention_bias=get("attention_bias", False),
                 attention_dropout=get("attention_dropout", 0.0),
                 use_sliding_window=get("use_sliding_window", False),
                 layer_types=sorted(set(get("layer_types") or ["full_attention"])),
                 rope_type=rope["rope_type"],
                 partial_rotary_factor=rope.get("partial_rotary_factor",
                                                get("partial_rotary_factor", 1.0)),
                 quantization_config=get("quantization_config"))
    for field, value in found.items():
        needed, why = REQUIRED[field]
        if value != needed:
            raise CheckpointError(f"{where}: {field} = {json.dumps(value)} cannot be mapped onto "
                                  f"this project's decoder, which needs {json.dumps(needed)} "
                                  f"({why})")


def config_from_hf(hf_config, where="config.json"):
    """The Config fields of a Qwen3 config.json: a baseline, or the routing of an export's "mhar"
    section."""
    if hf_config.get("model_type") == MODEL_TYPE:
        routing = hf_config.get(MODEL_TYPE)
        if not isinstance(routing, dict):
            raise CheckpointError(f"{where}: model_type {MODEL_TYPE!r} without an {MODEL_TYPE!r} "
                                  f"section: export the model again (hf.save, export.py)")
        hf_config = {**hf_config, "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}
    else:
        routing = {"residual": "baseline"}
    check_mappable(hf_config, where)
    get = lambda field: hf_config.get(field, QWEN3_DEFAULTS[field])  # noqa: E731
    d, n_head, head_dim = get("hidden_size"), get("num_attention_heads"), get("head_dim")
    return dict(vocab_size=get("vocab_size"), n_embd=d, n_layer=get("num_hidden_layers"),
                n_head=n_head,
                n_kv_head=hf_config.get("num_key_value_heads") or n_head,  # null: no grouping
                ffn_hidden=get("intermediate_size"),
                head_dim=0 if head_dim * n_head == d else head_dim,        # 0: Config's d / n_head
                rope_theta=float(rope_settings(hf_config)["rope_theta"]),
                norm_eps=get("rms_norm_eps"), tie_embeddings=get("tie_word_embeddings"),
                seq_len=get("max_position_embeddings"),
                **{k: routing[k] for k in Config.ROUTING if k in routing})


def config_to_hf(config, dtype):
    """config.json of a model: Qwen3's fields, and for a routed model model_type "mhar" and its
    routing."""
    hf_config = dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=config.vocab_size,
        hidden_size=config.n_embd, intermediate_size=config.ffn_hidden,
        num_hidden_layers=config.n_layer, num_attention_heads=config.n_head,
        num_key_value_heads=config.n_kv_head, head_dim=config.head_width, hidden_act="silu",
        max_position_embeddings=config.seq_len, rms_norm_eps=config.norm_eps,
        rope_parameters=dict(rope_theta=config.rope_theta, rope_type="default"),
        rope_theta=config.rope_theta,  # where transformers 4.x reads it
        tie_word_embeddings=config.tie_embeddings, attention_bias=False, attention_dropout=0.0,
        use_sliding_window=False, sliding_window=None, dtype=str(dtype).removeprefix("torch."))
    if config.residual == "baseline":  # the section marks the export as this project's (save)
        hf_config[MODEL_TYPE] = {
            "residual": "baseline",
            "note": "this project's baseline, a plain Qwen3 checkpoint: transformers' "
                    "Qwen3ForCausalLM and hf.load read the fields above, not this section"}
        return hf_config
    hf_config.update(architectures=["MHARForCausalLM"], model_type=MODEL_TYPE,
                     auto_map=AUTO_MAP, use_cache=True)
    fields = {k: v for k, v in dataclasses.asdict(config).items() if k not in Config.RUNTIME}
    hf_config[MODEL_TYPE] = {
        **fields,
        "note": "Multi-Head Attention Residuals (Luo, Cai, Hu, 2026) on a Qwen3 decoder, "
                "mhar.Config's fields: AutoModelForCausalLM.from_pretrained(DIR, "
                "trust_remote_code=True) runs it (modeling_mhar.py), as does "
                "hf.load"}
    return hf_config


# ----------------------------------------------------------------------------------------------
# Tensor names

def tensor_names(config):
    """{this project's name: the Qwen3 name} for every tensor of the baseline decoder."""
    names = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
    if not config.tie_embeddings:
        names["lm_head.weight"] = "lm_head.weight"
    for i in range(config.n_layer):
        attention, mlp, block = f"layers.{2 * i}.", f"layers.{2 * i + 1}.", f"model.layers.{i}."
        names[attention + "norm.weight"] = block + "input_layernorm.weight"
        for p in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"):
            names[f"{attention}{p}.weight"] = f"{block}self_attn.{p}.weight"
        names[mlp + "norm.weight"] = block + "post_attention_layernorm.weight"
        for p in ("gate_proj", "up_proj", "down_proj"):
            names[f"{mlp}{p}.weight"] = f"{block}mlp.{p}.weight"
    return names


def layout(hf_config):
    """How a directory stores its model: "qwen3" (a baseline), "remote" (a routed model that
    transformers runs with the code beside it) or "mhar" (a routed model as written before it)."""
    if hf_config.get("model_type") != MODEL_TYPE:
        return "qwen3"
    return "remote" if "auto_map" in hf_config else "mhar"


def file_names(config, state, layout):
    """{name in the file: name in the model}. "remote": GPT's own names under "model." (those of
    modeling_mhar's MHARForCausalLM), a tied LM head left out; otherwise the Qwen3 names, and in
    the "mhar" layout "mhar.<name>" for the parameters routing adds (a converted model starts
    them at their init)."""
    shared = {"lm_head.weight"} if config.tie_embeddings else set()  # the embedding's second name
    if layout == "remote":
        return {f"model.{name}": name for name in state if name not in shared}
    names = {hf_name: name for name, hf_name in tensor_names(config).items()}
    added = [name for name in state if name.startswith(ADDED_BY_RESIDUAL)]
    if layout == MODEL_TYPE:
        names.update({f"{MODEL_TYPE}.{name}": name for name in added})
    assert set(state) == set(names.values()) | set(added) | shared, "a tensor without a file name"
    return names


# ----------------------------------------------------------------------------------------------
# Reading

def read_json(path):
    try:
        value = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read {path} ({one_line(e)}): download or export the model "
                              f"again") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path} holds a JSON {type(value).__name__}, not an object")
    return value


def local_dir(path):
    """The directory of a model: `path` itself, or, for a hub id such as Qwen/Qwen3-0.6B that is
    not a local path, its snapshot from the Hugging Face hub (needs huggingface_hub, network)."""
    directory = Path(path)
    if directory.is_dir():
        return directory
    download = f"hf download {path} --local-dir DIR" if HUB_ID.fullmatch(str(path)) else None
    if directory.exists() or download is None:
        raise CheckpointError(f"{path} is not a directory: give the directory that holds "
                              f"config.json and model.safetensors (hf download ORG/NAME "
                              f"--local-dir DIR)")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise CheckpointError(f"no directory {path}, and fetching it from the hub needs "
                              f"huggingface_hub: pip install huggingface_hub, or {download}"
                              ) from None
    try:
        patterns = ["*.json", "*.safetensors", "merges.txt"]
        return Path(snapshot_download(str(path), allow_patterns=patterns))
    except Exception as e:  # offline, unknown repository, gated model, ...
        raise CheckpointError(f"no directory {path}, and fetching it from the hub failed "
                              f"({one_line(e)[:120]}); on a machine with network: {download}"
                              ) from None


def tensor_files(directory, stem):
    """{tensor name: file} of <stem>.safetensors, or of the shards <stem>.safetensors.index.json
    lists."""
    index, single = directory / f"{stem}.safetensors.index.json", directory / f"{stem}.safetensors"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index} has no weight_map: download the model again")
        return {name: directory / file for name, file in weight_map.items()}
    if single.is_file():
        with open_tensors(single) as f:
            return {name: single for name in f.keys()}
    raise CheckpointError(f"no {single.name} or {index.name} in {directory}: download the model's "
                          f"safetensors files (pytorch_model.bin: resave it with transformers)")


def open_tensors(file):
    """safetensors' safe_open of a file; CheckpointError when it is truncated or not one (its
    header must cover the whole file: checked at opening)."""
    safe_open = safetensors_api().safe_open
    try:
        return safe_open(file, framework="pt")
    except Exception as e:  # SafetensorError
        raise CheckpointError(f"cannot read {file}: it is truncated or not a safetensors file "
                              f"({one_line(e)[:120]}); download it again") from None


def load(path, dtype=None, **overrides):
    """A GPT from a Hugging Face directory (or hub id): a Qwen3 checkpoint, or this project's
    export.

    overrides: Config fields. On a Qwen3 checkpoint, residual="attnres"/"mhar" (with route_heads,
    route_block) converts it to delta routing: the parameters routing adds keep their init, gates
    at zero, so the model computes the checkpoint's logits exactly (as GPT.from_baseline, but one
    tensor at a time). seq_len and fused are free; config.json fixes the shape. dtype: float32
    (default), bfloat16 or float16, the parameters' dtype; the files' tensors are cast to it.
    """
    safetensors_api()  # its install hint before any work
    dtype = torch_dtype(dtype, torch.float32, "hf.load")
    directory = local_dir(path)
    hf_config = read_json(directory / "config.json")
    fields = config_from_hf(hf_config, directory / "config.json")
    exported = fields["residual"] != "baseline"
    free = ("seq_len", "fused") + (() if exported else Config.ROUTING)
    for k, v in overrides.items():
        if k not in Config.__dataclass_fields__:
            raise ValueError(f"hf.load: Config has no field {k!r}")
        if k not in free and fields.get(k, v) != v:
            kept = " (a routed export keeps its routing)" if exported else ""
            raise ValueError(f"hf.load: {k}={v!r}, but {directory}/config.json fixes it at "
                             f"{fields[k]!r}{kept}")
    converting = not exported and overrides.get("residual", "baseline") != "baseline"
    config = Config(**{**fields, **({"delta": True} if converting else {}), **overrides})
    if converting and not config.delta:
        raise ValueError(f"hf.load: residual={config.residual!r} with delta={config.delta} "
                         f"does not start as the checkpoint; convert with residual='attnres' or "
                         f"'mhar' and delta=True (the default)")
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # parameters made in their dtype: an 8B model is not built twice
    try:
        model = GPT(config)
    finally:
        torch.set_default_dtype(default)
    state = model.state_dict()  # shares the parameters' storage: copying into it loads the model
    names = file_names(config, state, layout(hf_config))
    files = tensor_files(directory, WEIGHTS[layout(hf_config)])
    ignored = {"lm_head.weight"} if config.tie_embeddings else set()  # tied, yet stored (0.6B)
    missing = [k for k in names if k not in files]
    unexpected = [k for k in files if k not in names and k not in ignored]
    if missing or unexpected:
        raise CheckpointError(f"{directory}: the tensors do not fit its config.json ("
                              + (f"missing {', '.join(missing[:3])}" if missing else
                                 f"no place for {', '.join(unexpected[:3])}") + ")")
    by_file = {}
    for name, file in files.items():
        if name in names:
            by_file.setdefault(file, []).append(name)
    with torch.no_grad():
        for file, in_file in by_file.items():
            with open_tensors(file) as f:
                for name in in_file:
                    tensor, target = f.get_tensor(name), state[names[name]]
                    if tensor.shape != target.shape:
                        raise CheckpointError(f"{file}: {name} has shape {tuple(tensor.shape)}, "
                                              f"config.json makes it {tuple(target.shape)}")
                    target.copy_(tensor)
    model.pretrained_from = directory  # save copies its tokenizer files from here
    return model


# ----------------------------------------------------------------------------------------------
# Writing

def byte_count(size):
    """max_shard_size in bytes: an int, or a string as transformers takes it ("5GB", "20KB",
    "2GiB": powers of 1000, or of 1024 with the i)."""
    units = {"": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B)?\s*", str(size), flags=re.I)
    count = int(float(match[1]) * units[(match[2] or "").upper()]) if match else 0
    if count < 1:
        raise ValueError(f"max_shard_size {size!r} is not a size: give bytes or e.g. 5GB, 500MB")
    return count


def shards(tensors, stem, max_shard_size):
    """{file name: {tensor name: tensor}}: <stem>.safetensors, or, past max_shard_size,
    <stem>-00001-of-0000N.safetensors filled in order as transformers fills them (a new file when
    the next tensor would not fit; a larger tensor alone in its file)."""
    limit, groups, size = byte_count(max_shard_size), [{}], 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if groups[-1] and size + nbytes > limit:
            groups.append({})
            size = 0
        groups[-1][name] = tensor
        size += nbytes
    if len(groups) == 1:
        return {f"{stem}.safetensors": groups[0]}
    n = len(groups)
    return {f"{stem}-{i + 1:05d}-of-{n:05d}.safetensors": group for i, group in enumerate(groups)}


# The weights files save writes (or wrote, in the "mhar" layout): one file, or shards and an index
WEIGHTS_FILE = re.compile(r"(model|mhar)(\.safetensors(\.index\.json)?"
                          r"|-\d{5}-of-\d{5}\.safetensors)")


def export_folder(directory):
    """`directory` as a Path if save may write into it: a new or empty folder, or an earlier export
    of this project (config.json with the "mhar" section every export carries) holding nothing
    but what save writes. CheckpointError naming what else it holds: another model, a train.py
    run folder, a file of the user's. Nothing is read but config.json and the names. Judged where
    the path leads: new/../run is run (the folder new need not exist), and so is what a save writes."""
    if Path(directory).is_symlink() and not Path(directory).exists():
        raise CheckpointError(f"{directory} is a link to {os.readlink(directory)}, which does not exist: "
                              f"export into a folder (it is created if it does not exist)")
    directory = Path(os.path.realpath(directory))
    if not directory.exists():
        return directory
    if not directory.is_dir():
        raise CheckpointError(f"{directory} is a file, not a folder: export into a folder (it is "
                              f"created if it does not exist)")
    held = sorted(p.name for p in directory.iterdir())
    if not held:
        return directory
    instead = "export into a new or empty folder, or remove what it holds first"
    config = directory / "config.json"
    if not config.is_file():
        raise CheckpointError(f"{directory} holds {held[0]}, which an export does not write (no "
                              f"config.json of an earlier export): {instead}")
    try:
        hf_config = json.loads(config.read_text())
    except OSError as e:  # another user's private folder
        raise CheckpointError(f"{config} cannot be read ({e.strerror}): export into a folder of "
                              f"yours") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        hf_config = None
    if isinstance(hf_config, dict) and {"config", "args"} <= hf_config.keys():
        raise CheckpointError(f"{directory} is a train.py run folder (its config.json is the run's "
                              f"record), which an export would overwrite: export into another "
                              f"folder, e.g. {directory / 'hf'}")
    if not isinstance(hf_config, dict) or not isinstance(hf_config.get(MODEL_TYPE), dict):
        what = (f"model_type {hf_config.get('model_type')!r}" if isinstance(hf_config, dict)
                else "not a JSON object")
        raise CheckpointError(f"{directory} holds a model that is not an export of this project "
                              f"(config.json: {what}, without the {MODEL_TYPE!r} section every "
                              f"export writes), which an export would overwrite: {instead}")
    ours = {"config.json", *REMOTE_CODE, *TOKENIZER_FILES}
    foreign = [name for name in held if not (directory / name).is_file()
               or name not in ours and not WEIGHTS_FILE.fullmatch(name)]
    if foreign:
        raise CheckpointError(f"{directory} holds an earlier export and {foreign[0]}, which an "
                              f"export does not write: {instead}")
    return directory


def save(model, directory, source=None, dtype=None, max_shard_size=MAX_SHARD_SIZE):
    """Write `model` as a Hugging Face directory: a baseline as a Qwen3 checkpoint, a routed model
    as a checkpoint transformers runs with the code written beside it (trust_remote_code; see the
    top of the file). The tokenizer files and special token ids of `source` (default: the
    directory load read) come along. dtype: the tensors' dtype in the files (default:
    the model's); past max_shard_size they are split into shards and an index, as transformers
    writes them. `directory` is new, empty or an earlier export (export_folder): another model or
    a file of the user's there is one CheckpointError, and nothing is written."""
    if model.config.residual in rivals.RESIDUALS:  # no remote code is written for them
        raise ValueError(f"hf.save: {model.config.residual} (lib/rivals.py) has no export: its modeling "
                         f"code is not written beside the weights; export mhar, attnres, hyper or a baseline")
    safetensors = safetensors_api()
    config, directory, state = model.config, export_folder(directory), model.state_dict()
    dtype = torch_dtype(dtype, state["embed.weight"].dtype, "hf.save")
    source = source or getattr(model, "pretrained_from", None)
    source = Path(source) if source else None
    has_config = source is not None and (source / "config.json").is_file()
    source_config = read_json(source / "config.json") if has_config else {}
    hf_config = {**{k: source_config[k] for k in CARRIED if k in source_config},
                 **config_to_hf(config, dtype)}
    # a model trained on shorter sequences keeps the positions its source was made for
    hf_config["max_position_embeddings"] = max(config.seq_len,
                                               source_config.get("max_position_embeddings", 0))
    kind = layout(hf_config)
    if kind == "remote":  # the window of the model transformers builds, as load's
        hf_config[MODEL_TYPE]["seq_len"] = hf_config["max_position_embeddings"]
    names = file_names(config, state, kind)
    tensors = {file_name: state[name].detach().to("cpu", dtype).contiguous()
               for file_name, name in names.items()}
    files = shards(tensors, WEIGHTS[kind], max_shard_size)
    index = f"{WEIGHTS[kind]}.safetensors.index.json"
    # every file written into a staging folder inside the directory, then moved in: a full disk or a
    # read-only folder leaves no half-written export (MachineError, with the reason)
    with staged(directory) as tmp:
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
        # safetensors writes a private temporary file (mode 0600) and renames it: each weights file
        # takes the mode of config.json, made as every file is (0666 less the umask)
        mode = (tmp / "config.json").stat().st_mode & 0o777
        for file, group in files.items():
            try:  # metadata format "pt": transformers 4 checks it
                safetensors.torch.save_file(group, tmp / file, metadata={"format": "pt"})
            except Exception as e:  # SafetensorError wraps the OSError: staged() reads it as one
                if type(e).__name__ != "SafetensorError":
                    raise
                raise OSError(errno.EIO, one_line(e)) from None
            os.chmod(tmp / file, mode)
        if len(files) > 1:
            total = sum(t.numel() * t.element_size() for t in tensors.values())
            weight_map = {name: file for file, group in files.items() for name in group}
            (tmp / index).write_text(json.dumps({"metadata": {"total_size": total},
                                                 "weight_map": weight_map}, indent=2) + "\n")
        for name in REMOTE_CODE if kind == "remote" else ():
            shutil.copyfile(REMOTE_SOURCES[name], tmp / name)
        for name in TOKENIZER_FILES:
            if source and (source / name).is_file() and source.resolve() != directory.resolve():
                shutil.copyfile(source / name, tmp / name)
    # an earlier export's weights, index or code would be read in place of these
    written = set(files) | ({index} if len(files) > 1 else set())
    stale = [*(() if kind == "remote" else REMOTE_CODE), *(f"{stem}.safetensors.index.json"
                                                           for stem in set(WEIGHTS.values()))]
    for file in [*(directory / name for name in stale),
                 *(f for stem in set(WEIGHTS.values()) for f in directory.glob(f"{stem}*.safetensors"))]:
        if file.name not in written:
            file.unlink(missing_ok=True)
    return directory


# ----------------------------------------------------------------------------------------------
# The CPU demonstration: python -m lib.hf [DIR]. transformers saves a tiny random Qwen3 into DIR (no
# download); it is read, converted, trained five steps with the recipe's groups, written back and
# run by transformers.

DEMO_SHAPE = dict(vocab_size=1024, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64,  # 4 x 64 > d, as Qwen3
                  tie_word_embeddings=False, max_position_embeddings=512,
                  rope_parameters={"rope_theta": 1e6, "rope_type": "default"})


def check_demo_folders(directory):
    """The demonstration writes its models over `directory`, DIR-mhar and DIR-baseline: never over
    another model. transformers writes the first (an earlier demonstration's has its shape), save
    the other two (new, empty or an earlier export): all checked before anything runs."""
    folder = Path(directory)
    if folder.exists() and not folder.is_dir():
        raise CheckpointError(f"{folder} is a file: give the demonstration a directory, "
                              f"python -m lib.hf DIR")
    if folder.is_dir() and any(folder.iterdir()):
        config = read_json(folder / "config.json") if (folder / "config.json").is_file() else {}
        shape = [k for k in DEMO_SHAPE if k.endswith(("_size", "_heads", "_layers", "_dim"))]
        if any(config.get(k) != DEMO_SHAPE[k] for k in shape):
            raise CheckpointError(f"{folder} holds something else (model_type "
                                  f"{config.get('model_type')!r}), which the demonstration would "
                                  f"overwrite: give it a new directory, python -m lib.hf DIR")
    for folder in (Path(f"{directory}-mhar"), Path(f"{directory}-baseline")):
        export_folder(folder)


def demo(directory, steps=5):
    check_demo_folders(directory)
    import time
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

    def max_diff(a, b):
        return (a.float() - b.float()).abs().max().item()

    torch.manual_seed(0)
    Qwen3ForCausalLM(Qwen3Config(**DEMO_SHAPE)).save_pretrained(directory)
    theirs = {dtype: Qwen3ForCausalLM.from_pretrained(directory, dtype=dtype).eval()
              for dtype in (torch.float32, torch.bfloat16)}
    rows = torch.randint(0, 1024, (steps, 4, 257), generator=torch.Generator().manual_seed(0))
    x, y = rows[0, :, :-1], rows[0, :, 1:]                                     # random tokens
    t0 = time.perf_counter()
    baseline = load(directory)
    print(f"{directory}: a random Qwen3 saved by transformers; load "
          f"{time.perf_counter() - t0:.2f} s, {baseline.num_params():,} parameters")
    with torch.no_grad():
        truth = theirs[torch.float32](x).logits
        print(f"float32 logits, max |ours - transformers| {max_diff(baseline(x)[0], truth):.3g}")
        ours16 = load(directory, dtype=torch.bfloat16)(x)[0]
        relative = lambda a: ((a.float() - truth).norm() / truth.norm()).item()  # noqa: E731
        print(f"bfloat16 logits, relative error to float32: ours {relative(ours16):.2e}, "
              f"transformers {relative(theirs[torch.bfloat16](x).logits):.2e}")
    model = load(directory, residual="mhar", route_block=8, route_heads=8)
    with torch.no_grad():
        print(f"converted (mhar, delta, H 8, one delta per 4 layers): max |logit difference| to "
              f"the baseline {max_diff(model(x)[0], baseline(x)[0]):g}")
        first_baseline_loss = baseline(x, y)[1].item()
    from lib import midtrain  # the recipe's optimizer groups
    groups = midtrain.param_groups(model, lr=midtrain.RECIPE["lr"][0])
    optimizer = torch.optim.AdamW(groups, betas=(0.9, 0.95), eps=1e-8)
    for step in range(steps):
        _, loss = model(rows[step, :, :-1], rows[step, :, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        gates = torch.stack([site.gate.detach() for site in model.sites]).abs()
        baseline_loss = f" (the baseline's on this batch: {first_baseline_loss:.6f})"
        print(f"step {step + 1}: loss {loss.item():.6f}{baseline_loss if step == 0 else ''} | "
              f"max |gate| {gates.max().item():.2e}")
    save(model, f"{directory}-mhar")
    with torch.no_grad():
        back = load(f"{directory}-mhar")
        print(f"{directory}-mhar: the trained model written and read back, max |logit difference| "
              f"{max_diff(back(x)[0], model(x)[0]):g}")
    theirs_mhar = AutoModelForCausalLM.from_pretrained(f"{directory}-mhar",
                                                       trust_remote_code=True).eval()
    with torch.no_grad():
        print(f"  transformers runs it with the code beside it ({type(theirs_mhar).__name__}, "
              f"trust_remote_code): max |logit difference| "
              f"{max_diff(theirs_mhar(x).logits, model(x)[0]):g}")
    save(baseline, f"{directory}-baseline")
    with torch.no_grad():
        exported = AutoModelForCausalLM.from_pretrained(f"{directory}-baseline",
                                                        dtype=torch.float32)
        print(f"{directory}-baseline: the baseline written back, transformers reads it: max |logit "
              f"difference| {max_diff(exported.eval()(x).logits, truth):g}")


def main(argv=None):
    p = FlagParser(prog="hf.py", description="The CPU demonstration: a random Qwen3 saved by "
                   "transformers, loaded here, converted to delta MHAR, trained a few steps, "
                   "written back and run by transformers.")
    p.add_argument("directory", nargs="?", default="models/tiny-qwen3",
                   help="the random Qwen3's folder; DIR-mhar and DIR-baseline go beside it "
                        "(default models/tiny-qwen3)")
    directory = Path(p.parse_args(argv).directory)
    made = [folder for folder in (directory, Path(f"{directory}-mhar"), Path(f"{directory}-baseline"))
            if not folder.exists()]
    try:
        demo(directory)
    except BaseException as e:  # what this run wrote is of no use half-done: it goes
        for folder in made:
            shutil.rmtree(folder, ignore_errors=True)
        if isinstance(e, CheckpointError):
            exit_error("hf.py", str(e))
        if isinstance(e, MachineError):  # hf.save's: the reason named
            exit_error("hf.py", str(e), status=1)
        if isinstance(e, OSError) or type(e).__name__ == "SafetensorError":  # a full disk's, too
            reason = getattr(e, "strerror", None) or one_line(e)
            exit_error("hf.py", f"cannot write {directory} ({reason}): free some space or give "
                                f"another directory", status=1)
        if isinstance(e, KeyboardInterrupt):
            exit_error("hf.py", "interrupted; nothing kept", status=130)
        raise


if __name__ == "__main__":
    main()
