"""Helpers every test file shares: one relative error, one builder of route inputs, the tiny models, an
lm-eval task over local files, a script run in a subprocess on a full disk or in a read-only folder, a
child that Ctrl-C reaches as it would under a terminal."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mhar import preset

ROOT = Path(__file__).resolve().parent.parent  # the repository
VOCAB = 64  # the vocabulary of the training tests' corpus (the `data` fixture)
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def sigint_as_in_a_terminal():
    """preexec_fn of a child that a test interrupts with SIGINT, as a terminal's Ctrl-C would: SIGINT at its
    default. A suite started in the background without job control (`pytest &` in a script) ignores SIGINT,
    its children inherit that, and Python then installs no KeyboardInterrupt handler: the signal would do
    nothing."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
def script_path(name):
    """A script's path from the repository root, by its name: "train.py", "scripts/compare.py", "lib/hf.py"."""
    return next(f"{folder}{name}.py" for folder in ("", "scripts/", "lib/") if (ROOT / f"{folder}{name}.py").exists())


def script_module(name):
    """A script's module by its name, imported: train, scripts.compare, lib.hf."""
    import importlib
    return importlib.import_module(script_path(name).removesuffix(".py").replace("/", "."))


def script_command(script):
    """How a user runs `script` from the repository root: `python train.py`, or for one in a package
    (scripts/compare.py, lib/hf.py) `python -m scripts.compare`."""
    if "/" in script:
        return [sys.executable, "-m", script.removesuffix(".py").replace("/", ".")]
    return [sys.executable, script]


def command_line(argv):
    """[python, argv...], a script's path first in argv run as script_command runs it."""
    argv = [str(a) for a in argv]
    return [*script_command(argv[0]), *argv[1:]] if argv[0].endswith(".py") else [sys.executable, *argv]


def interrupted_while_importing(argv, module, tmp_path):
    """`python argv` from the repository root, SIGINT'd (as a terminal's Ctrl-C) while it imports
    `module`, which a sitecustomize.py holds (after a marker file) until the signal comes:
    (returncode, stdout, stderr). It holds in short sleeps, as an import runs Python between its C
    calls: Python runs a signal's handler between two instructions, and a signal that did not cut
    one long C sleep short (as when the system hands it another thread) may wait for its end (in
    one CI run the child, held in one two-minute sleep, outlived the test's minute)."""
    marker = tmp_path / "importing"
    (tmp_path / "sitecustomize.py").write_text(
        "import sys, time\n"
        "class SlowImport:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        f"        if name == {module!r}:\n"
        f"            open({str(marker)!r}, 'w').close()\n"
        "            for _ in range(1200):\n"
        "                time.sleep(0.1)\n"
        "sys.meta_path.insert(0, SlowImport())\n")
    p = subprocess.Popen(command_line(argv), cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(tmp_path)}, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, preexec_fn=sigint_as_in_a_terminal)
    deadline = time.time() + 60
    while not marker.exists():
        assert p.poll() is None and time.time() < deadline, p.communicate()
        time.sleep(0.02)
    p.send_signal(signal.SIGINT)
    stdout, stderr = p.communicate(timeout=60)
    return p.returncode, stdout, stderr


def _held_run(argv, tmp_path, hook, then):
    """`python argv` from the repository root, SIGINT reaching it as a terminal's Ctrl-C, and a sitecustomize.py
    that runs `hook` (source that defines and installs it, with its marker file at MARKER): once the marker is
    there, then(process) -> (returncode, stdout, stderr)."""
    marker = tmp_path / "marker"
    (tmp_path / "sitecustomize.py").write_text(hook.replace("MARKER", repr(str(marker))))
    p = subprocess.Popen(command_line(argv), cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(tmp_path), "OMP_NUM_THREADS": "1"},
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=sigint_as_in_a_terminal)
    try:
        deadline = time.time() + 60
        while not marker.exists():
            assert p.poll() is None and time.time() < deadline, p.communicate()
            time.sleep(0.005)
        then(p, marker)
        stdout, stderr = p.communicate(timeout=60)
    finally:
        p.kill()  # (a process that has ended already: nothing)
    return p.returncode, stdout, stderr


def interrupted_after(argv, delay, tmp_path):
    """`python argv` from the repository root, SIGINT'd (as a terminal's Ctrl-C) `delay` seconds after the
    script's first import began, unless it has ended by then: (returncode, stdout, stderr). The count starts there,
    microseconds into the script, not at the process's start: before the script runs the interpreter runs alone
    (its start, the site module, compiling the script: 10-30 ms, more on a loaded machine), where a Ctrl-C meets
    Python's own handling, which no script can change (killed by the signal, or a KeyboardInterrupt traceback from
    line 0). A sitecustomize.py writes a marker from inside that import (the audit event "import" that follows the
    script's "exec"): a Ctrl-C that comes before the marker is written meets the import as one after it would."""
    script = str((ROOT / str(argv[0])).resolve())
    hook = ("import os, sys\n"
            "seen = []\n"
            "def started(event, args):\n"
            f"    if event == 'exec' and getattr(args[0], 'co_filename', None) == {script!r}:\n"
            "        seen.append(event)\n"
            "    elif event == 'import' and seen == ['exec']:\n"
            "        seen.append(event)\n"
            "        os.close(os.open(MARKER, os.O_CREAT | os.O_WRONLY))\n"
            "sys.addaudithook(started)\n")

    def interrupt(p, marker):
        time.sleep(delay)
        p.send_signal(signal.SIGINT)  # (Popen does nothing once it has seen the process end)
    return _held_run(argv, tmp_path, hook, interrupt)


def interrupted_while_exiting(argv, tmp_path):
    """`python argv` from the repository root, SIGINT'd (as a terminal's Ctrl-C) once its work is done and it
    exits: a sitecustomize.py registers an exit handler (atexit, which runs when the script has ended) that writes
    a marker, then waits in short sleeps until the test has sent the signal (a second marker), at most a minute.
    (returncode, stdout, stderr)."""
    hook = ("import atexit, os, time\n"
            "def held():\n"
            "    open(MARKER, 'w').close()\n"
            "    for _ in range(600):\n"
            "        if os.path.exists(MARKER + '.sent'):\n"
            "            time.sleep(0.2)\n"  # time for the signal to be handled, if it is
            "            return\n"
            "        time.sleep(0.1)\n"
            "atexit.register(held)\n")

    def interrupt(p, marker):
        p.send_signal(signal.SIGINT)
        (tmp_path / "marker.sent").touch()
    return _held_run(argv, tmp_path, hook, interrupt)


# fused kernels on CPU tensors: in the Triton interpreter, which conftest.py switches on without a GPU
interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason=(
    "runs the fused kernels on CPU tensors, in the Triton interpreter: on a GPU machine the compiled "
    "kernels are tested in test_gpu.py"))


def needs(module):
    """The module, or the test is skipped with the reason: an optional package that the README's test command
    installs (requirements-test.txt), absent here."""
    return pytest.importorskip(module, reason=f"needs {module}: pip install -r requirements-test.txt")


def rel_err(a, b):
    """Norm-wise ||a - b|| / ||b|| in float64; exact zeros on both sides count as a match."""
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def error_line(capsys, main, argv, status=2, prog=None):
    """Run a script's main(argv) on bad input: it exits with `status` and writes one line,
    "<script>.py: error: ..." (prog: another script's name, which it runs), and no traceback.
    Returns that line."""
    with pytest.raises(SystemExit) as exit:
        main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert exit.value.code == status, err
    script = prog or main.__module__.rpartition(".")[2]
    assert err.startswith(f"{script}.py: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err, err
    return err.strip()


# The child of run_script: every file it opens for writing under a folder meets a full disk (the file is created,
# its bytes go to /dev/full, whose writes fail with ENOSPC) or a read-only file system (EROFS on creating
# anything). Tests may run as root, whom chmod 555 does not stop, and mounting a small or read-only file system
# needs privileges: the fault is made at Python's file functions instead, and at safetensors' writer, which
# opens its files in Rust and reports the OSError inside its own error.
FAULTS = r"""
import builtins, errno, io, os, runpy, sys
fault, under, script = sys.argv[1], os.path.realpath(sys.argv[2]), sys.argv[3]
sys.argv = sys.argv[3:]
code = errno.ENOSPC if fault == "full" else errno.EROFS
open_, os_open, mkdir = io.open, os.open, os.mkdir

def inside(path):
    if isinstance(path, int):
        return False
    path = os.path.realpath(os.fsdecode(path))
    return path == under or path.startswith(under + os.sep)

def refused(path):
    return OSError(code, os.strerror(code), os.fsdecode(path))

def guarded_open(file, mode="r", *args, **kwargs):
    if inside(file) and set(mode) & set("wax+"):
        if fault == "read-only":
            raise refused(file)
        open_(file, mode, *args, **kwargs).close()
        return open_("/dev/full", "wb" if "b" in mode else "w", *args, **kwargs)
    return open_(file, mode, *args, **kwargs)

def guarded_os_open(path, flags, *args, **kwargs):
    if fault == "read-only" and inside(path) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
        raise refused(path)
    return os_open(path, flags, *args, **kwargs)

def guarded_mkdir(path, *args, **kwargs):
    if fault == "read-only" and inside(path) and not os.path.lexists(path):
        raise refused(path)
    return mkdir(path, *args, **kwargs)

builtins.open = io.open = guarded_open
os.open, os.mkdir = guarded_os_open, guarded_mkdir
try:
    import safetensors, safetensors.torch
    serialize_file = safetensors.torch.serialize_file

    def guarded_serialize_file(tensors, filename, metadata=None):
        if inside(filename):
            raise safetensors.SafetensorError(f"Error while serializing: I/O error: {os.strerror(code)} "
                                              f"(os error {code})")
        return serialize_file(tensors, filename, metadata=metadata)
    safetensors.torch.serialize_file = guarded_serialize_file
except ImportError:
    pass
if os.sep in script:  # a script in a package (scripts/, lib/), run as python -m does
    runpy.run_module(script.removesuffix(".py").replace(os.sep, "."), run_name="__main__", alter_sys=True)
else:
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")
"""


def run_script(script, *argv, fault=None, under=None, timeout=300):
    """`python <script> argv` (or `python -m <package.script> argv`: script_command) from the repository root in
    a subprocess -> CompletedProcess (text). fault "full" or "read-only" makes the files it writes under the
    folder `under` fail as on a full disk or in a read-only folder (FAULTS)."""
    argv = [str(a) for a in argv]
    command = [sys.executable, "-c", FAULTS, fault, str(under), script, *argv] if fault else \
        [*script_command(script), *argv]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def one_error_line(p, script, status):
    """The one line "<script>: error: ..." a finished run_script wrote on stderr, having exited with `status`."""
    assert p.returncode == status, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{script}: error: "), p.stderr
    return lines[0]


def files_in(folder):
    """Every file and folder under `folder`, hidden ones included, relative to it (none: the folder is absent)."""
    folder = Path(folder)
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*")) if folder.exists() else []


def tiny(residual="mhar", **overrides):
    """The tiny preset with a small vocabulary, so a test model has few parameters."""
    return preset("tiny", residual=residual, **{"vocab_size": 128, "seq_len": 32, **overrides})


def route_inputs(N, B, T, d, dtype=torch.float64, seed=0, device="cpu"):
    """Sources V (N, B, T, d) of unequal scales, a nonzero query q and norm weight g (d,) in float32 or
    float64, and an output gradient dout (B, T, d). A zero query would route uniformly and hide the logits."""
    gen = torch.Generator().manual_seed(seed)
    V = torch.randn(N, B, T, d, generator=gen, dtype=torch.float64) * (1 + torch.rand(N, 1, 1, 1, generator=gen,
                                                                                      dtype=torch.float64))
    q = 0.5 * torch.randn(d, generator=gen, dtype=torch.float64)
    g = 1 + 0.3 * torch.randn(d, generator=gen, dtype=torch.float64)
    dout = torch.randn(B, T, d, generator=gen, dtype=torch.float64)
    param_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    return (V.to(device, dtype), q.to(device, param_dtype), g.to(device, param_dtype), dout.to(device, dtype))


def route_and_grads(route, V, q, g, dout, heads):
    """Output and (dV, dq, dg) of one route call (mhar.route, kernel.fused_route)."""
    V, q, g = (x.clone().requires_grad_() for x in (V, q, g))
    out = route(V, q, g, heads)
    out.backward(dout.to(out.dtype))
    return out, V.grad, q.grad, g.grad


def gpt_pair(device="cpu", **overrides):
    """A fused tiny model and its readable twin with the same weights: (fused, readable). Queries
    are nonzero and delta's gates open, so that the logit path and the route are both in play."""
    import mhar
    torch.manual_seed(0)
    readable = mhar.GPT(tiny(**overrides)).to(device)
    with torch.no_grad():
        for site in readable.sites:
            site.query.normal_(0, 0.3)                        # zero queries would hide the logit path
            if site.gate is not None:
                site.gate.fill_(0.5)                          # a closed gate would hide the route
    fused = mhar.GPT(tiny(fused=True, **overrides)).to(device)
    fused.load_state_dict(readable.state_dict())
    return fused, readable


def save_tiny_qwen3(directory, tied=True, head_dim=16, n_kv_head=2, rope_theta=1e6,
                    max_shard_size=None, seed=0):
    """A tiny random Qwen3ForCausalLM that transformers saves into `directory` (offline): d 64, 2
    layers, 4 heads of width head_dim (16 = d / n_head), vocabulary 100. Every tensor is perturbed,
    norms included, so that a tensor read into the wrong place changes the logits. Returns the
    transformers model (eval mode)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=n_kv_head, head_dim=head_dim,
                         max_position_embeddings=64, tie_word_embeddings=tied,
                         rope_parameters={"rope_theta": rope_theta, "rope_type": "default"})
    model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(torch.randn_like(p) * (0.3 if "norm" in name else 0.02))
    shards = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, **shards)
    return model


def foreign_model(folder, kind):
    """A directory hf.load refuses, folder/kind: "llama", a Llama model that transformers saves;
    "broken", a Qwen3 config.json cut short. Returns (directory, a fragment of the refusal)."""
    needs("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config
    directory = folder / kind
    if kind == "llama":
        LlamaForCausalLM(LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2)).save_pretrained(directory)
        return directory, 'model_type = "llama" cannot be mapped'
    directory.mkdir()
    text = Qwen3Config(vocab_size=100, hidden_size=64, num_hidden_layers=2).to_json_string()
    (directory / "config.json").write_text(text[:len(text) // 2])
    return directory, "config.json ("


def write_task(folder, name, rows, **config):
    """An lm-eval task that needs no network: a YAML file over a JSON-lines file of rows."""
    yaml = needs("yaml")  # a dependency of datasets, which lm-eval needs
    data = folder / f"{name}.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = dict(task=name, dataset_path="json", test_split="test",
                  dataset_kwargs={"data_files": {"test": str(data)}}, **config)
    (folder / f"{name}.yaml").write_text(yaml.safe_dump(config, sort_keys=False))


def fused_history(queries, norms, heads, block=1, null=None, group=0, eps=1e-6):
    """kernel.FusedHistory over mhar's readable history for this routing, as GPT.new_history makes it."""
    import kernel
    import mhar
    return kernel.FusedHistory(mhar.depth_history(queries, norms, heads, eps, block, null),
                               mhar.site_reads(len(queries), block, null is not None), group)
