"""What every script does with a mistake in its command line: one line, "<script>.py: error: ...",
and exit status 2, never argparse's usage block (one style for every script, as the README's
"Files" section says)."""
import os
import signal
import subprocess
import sys
import time

import pytest

from helpers import (ROOT, error_line, files_in, interrupted_after, interrupted_while_exiting,
                     interrupted_while_importing, script_module, script_path, tiny)

SCRIPTS = ["bench_head", "bench_kernel", "compare", "compromise", "eval", "export", "gpu_check", "hf", "prepare",
           "probe", "sample", "train"]


REQUIRED = {"eval": ["--tasks", "x"], "export": ["ckpt.pt", "out"]}  # so the flag is the only mistake


@pytest.mark.parametrize("script", SCRIPTS)
def test_an_unknown_flag_is_one_line(script, capsys, tmp_path, monkeypatch):
    """compare.py hands the flags it does not know to train.py: train.py's parser refuses them,
    before the first run starts."""
    monkeypatch.chdir(tmp_path)                                  # where a run would have written
    main = script_module(script).main
    line = error_line(capsys, main, REQUIRED.get(script, []) + ["--no_such_flag"],
                      prog="train" if script == "compare" else script)
    assert "--no_such_flag" in line and "--help lists the flags" in line
    assert not list(tmp_path.iterdir())                          # nothing started


@pytest.mark.parametrize("script, argv", [("eval", []), ("export", ["only_one"]),
                                          ("prepare", ["--seed", "x"]), ("sample", ["--top_k"])],
                         ids=["eval-missing", "export-missing", "prepare-type", "sample-no-value"])
def test_a_missing_or_malformed_value_is_one_line(script, argv, capsys):
    error_line(capsys, script_module(script).main, argv)


@pytest.mark.parametrize("argv", [["nope", "full"], ["small", "nope"], ["", ""], ["Small", "full"], ["small"]],
                         ids=["unknown-case", "unknown-head", "empty", "case-miscased", "one-value"])
def test_bench_heads_child_with_bad_arguments_is_one_line(argv, capsys):
    """bench_head.py --child CASE HEAD, the process peak_cpu starts for one measurement: a case or head it does not
    have is one line, status 2 (before: a KeyError traceback for a case, and an unknown head measured the chunked
    one), checked before any model is built."""
    from scripts import bench_head
    line = error_line(capsys, bench_head.main, ["--child", *argv])
    assert "--child" in line, line


SEEDS = {"0": 0, str(2**63 - 1): 2**63 - 1, **dict.fromkeys([str(2**63), "99999999999999999999999", "-1", ""],
                                                               "whole number in [0, 9223372036854775807]")}


@pytest.mark.parametrize("text", SEEDS, ids=["zero", "largest", "one-past", "huge", "negative", "empty"])
@pytest.mark.parametrize("script", ["train", "sample", "probe", "prepare"])
def test_a_seed_is_an_int64_at_or_above_zero_in_every_script(script, text, capsys):
    """--seed takes common.seed: [0, 2**63 - 1] gets through argument parsing, anything else is one line that
    names the flag and the range, status 2 (before: torch.manual_seed's overflow traceback once the run had
    started, or numpy's for -1 in prepare.py)."""
    module = script_module(script)
    parse = (lambda argv: module.parse_args(argv)[0]) if script == "train" else module.parse_args
    if isinstance(SEEDS[text], int):
        assert parse(["--seed", text]).seed == SEEDS[text]
        return
    line = error_line(capsys, parse, ["--seed", text], prog=script)
    assert "argument --seed: " in line and SEEDS[text] in line, line


# A script's one line for a Ctrl-C, the same whenever it comes (prepare.py names the signal: it takes SIGTERM too)
INTERRUPTED = {"sample": "sample.py: error: interrupted (Ctrl-C)\n",
               "probe": "probe.py: error: interrupted (Ctrl-C); nothing written\n",
               "prepare": "prepare.py: error: interrupted (SIGINT); nothing written\n",
               "train": "train.py: error: interrupted before training started\n",
               "bench_head": "bench_head.py: error: interrupted (Ctrl-C)\n"}


@pytest.mark.parametrize("script, module", [("sample", "torch"), ("probe", "torch"), ("prepare", "numpy"),
                                            ("sample", "argparse"), ("probe", "argparse"), ("prepare", "argparse"),
                                            ("prepare", "datetime"), ("train", "argparse"),
                                            ("bench_head", "argparse"), ("bench_head", "torch")])
def test_ctrl_c_while_a_script_imports_is_one_line(script, module, tmp_path):
    """A Ctrl-C during the seconds torch (or numpy) takes to import: one line and status 130, as
    once the work has begun, not a KeyboardInterrupt traceback. The import is held until the
    signal comes. argparse: the first import, before torch's; datetime: numpy's C code imports it
    (PyCapsule_Import) and turns a KeyboardInterrupt there into an ImportError (status 1, a
    paragraph about a bad install)."""
    status, _, stderr = interrupted_while_importing([script_path(script)], module, tmp_path)
    assert status == 130 and stderr == INTERRUPTED[script], stderr


def test_ctrl_c_ends_bench_heads_child_without_a_word(tmp_path):
    """A terminal's Ctrl-C reaches bench_head.py and its measuring child alike: the child ends with
    status 130 without a word (its parent says the one line), even while it imports torch."""
    status, stdout, stderr = interrupted_while_importing(["-m", "scripts.bench_head", "--child", "small", "full"], "torch",
                                                         tmp_path)
    assert status == 130 and stdout == stderr == "", stderr


def test_ctrl_c_while_benchmarking_is_one_line_and_stops_the_child(monkeypatch, capsys):
    """A Ctrl-C while bench_head.py waits for a measuring child: one line, status 130, and the child
    is stopped (a Ctrl-C sent to the parent alone, kill -INT, would have left it running)."""
    import threading

    from scripts import bench_head
    children, popen = [], subprocess.Popen

    def child(argv, **kwargs):  # a child that would measure for a minute
        children.append(popen([sys.executable, "-c", "import time; time.sleep(60)"], **kwargs))
        return children[-1]
    monkeypatch.setattr(bench_head.subprocess, "Popen", child)

    def interrupt():  # once the parent waits for its child
        for _ in range(6000):
            if children:
                break
            time.sleep(0.01)
        time.sleep(0.1)
        os.kill(os.getpid(), signal.SIGINT)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # a suite run with `&` ignores it
    try:
        threading.Thread(target=interrupt, daemon=True).start()
        line = error_line(capsys, bench_head.main, ["--cases", "small"], status=130)
    except KeyboardInterrupt:  # escaping, it would stop pytest itself
        pytest.fail("bench_head.main let the KeyboardInterrupt through")
    finally:
        signal.signal(signal.SIGINT, previous)
    assert line == INTERRUPTED["bench_head"].strip()
    assert len(children) == 1 and children[0].poll() is not None


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{script: argv} of a short run of each, and what it writes: sample.py on an untrained tiny checkpoint (token
    ids: no tokenizer to load), prepare.py on two small documents as bytes (no tokenizer to load either)."""
    import dataclasses

    import torch

    import mhar
    folder = tmp_path_factory.mktemp("runs")
    torch.manual_seed(0)
    config = tiny()
    torch.save(dict(model=mhar.GPT(config).state_dict(), config=dataclasses.asdict(config),
                    args=dict(data="synthetic")), folder / "ckpt.pt")
    (folder / "corpus").mkdir()
    for name in ("a", "b"):
        (folder / "corpus" / f"{name}.txt").write_text(f"document {name}\n")
    return {"sample": ["sample.py", "--ckpt", folder / "ckpt.pt", "--max_new_tokens", 4, "--num_samples", 2,
                       "--device", "cpu"],
            "prepare": ["prepare.py", "--input", folder / "corpus", "--tokenizer", "bytes"]}


def check_interrupted_or_finished(script, status, stdout, stderr, out):
    """The one line and status 130, nothing written (prepare.py's --out `out`); or, when the run had finished
    first, status 0 and all of its output. sample.py says what it draws (one line on stderr) before the first
    token: a Ctrl-C after it comes after that line."""
    if script == "sample" and stderr.startswith("sample.py: 2 samples of 4 tokens from "):
        stderr = stderr.split("\n", 1)[1]
    elif script == "sample":
        assert status == 130, (status, stderr)  # finished, it has said what it drew
    if status == 130:
        assert stderr == INTERRUPTED[script] and not files_in(out), (stderr, files_in(out))
        return
    assert status == 0 and stderr == "", (status, stderr)
    if script == "sample":  # two samples: the prompt (token 0) and 4 tokens each
        assert [len(s.split()) for s in stdout.split("-" * 40)] == [5, 5], stdout
    else:
        assert files_in(out) == ["corpus", "corpus/meta.json", "corpus/train.bin", "corpus/val.bin"]
        assert stdout.splitlines()[-1].startswith("done in "), stdout


DELAYS = [0, 0.05, 0.2, 0.5, 1]  # later, mostly the finished run: test_ctrl_c_once_the_run_has_finished_is_too_late


@pytest.mark.parametrize("delay", DELAYS, ids=[f"at-{d:g}s" for d in DELAYS])
@pytest.mark.parametrize("script", ["sample", "prepare"])
def test_ctrl_c_at_any_moment_is_one_line_or_a_finished_run(script, delay, runs, tmp_path):
    """A real Ctrl-C at some moment of a run (in its imports, between them, in its work, as it exits): one line and
    status 130 with nothing written, or, once the run has finished (a Ctrl-C after the last sample, or once
    prepare.py moves its files into place, is too late), the finished run: status 0, all of its output. Which
    phase a delay meets depends on the machine's load: the test asserts what holds in every one. The count starts
    inside the script's first import, microseconds into it (helpers.interrupted_after): at-0s meets that import
    (interrupts.py's, which installs the first handler) or the imports it guards."""
    out = tmp_path / "data"
    argv = runs[script] + (["--out", out] if script == "prepare" else [])
    check_interrupted_or_finished(script, *interrupted_after(argv, delay, tmp_path), out)


@pytest.mark.parametrize("script, help", [("sample", False), ("prepare", False), ("prepare", True)],
                         ids=["sample", "prepare", "prepare-help"])
def test_ctrl_c_once_the_run_has_finished_is_too_late(script, help, runs, tmp_path):
    """A Ctrl-C as the process exits, its work done (held there): ignored, the finished run's output and status 0;
    before, a KeyboardInterrupt traceback from the exit handlers, or (in the interpreter's teardown, once it has
    put SIGINT back to its default) a death by the signal without a word. --help too, which argparse ends by
    itself (before: the script's line, status 130, and the help lost when stdout is a pipe)."""
    out = tmp_path / "data"
    argv = [script_path(script), "--help"] if help else runs[script] + (["--out", out] if script == "prepare" else [])
    status, stdout, stderr = interrupted_while_exiting(argv, tmp_path)
    assert status == 0, stderr
    if help:
        assert stderr == "" and stdout.startswith(f"usage: {script}.py ") and not files_in(out), stderr
    else:
        check_interrupted_or_finished(script, status, stdout, stderr, out)


def test_ctrl_c_while_probing_is_one_line(monkeypatch, capsys):
    from scripts import probe

    def interrupted(args):
        raise KeyboardInterrupt
    monkeypatch.setattr(probe, "probe", interrupted)
    try:
        line = error_line(capsys, probe.main, ["--ckpt", "x.pt"], status=130)
    except KeyboardInterrupt:  # escaping, it would stop pytest itself
        pytest.fail("probe.main let the KeyboardInterrupt through")
    assert "interrupted (Ctrl-C)" in line


@pytest.mark.parametrize("script", ["kernel", "launcher", "bench_kernel", "bench_step", "gpu_check"])
def test_a_kernel_script_without_triton_is_one_line(script):
    """Without an importable triton, the kernels' scripts say so in one line, status 2, as
    train.py --fused does (a RuntimeError traceback from kernel.py's import before)."""
    module = script_path(script).removesuffix(".py").replace("/", ".")
    code = (f"import runpy, sys; sys.modules['triton'] = None; sys.argv = ['{script}.py']; "
            f"runpy.run_module('{module}', run_name='__main__', alter_sys=True)")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
    assert p.stderr.startswith(f"{script}.py: error: ") and "triton is not installed" in p.stderr


@pytest.mark.parametrize("library", ["kernel", "launcher"])
def test_a_kernel_library_run_as_a_script_says_what_runs_it(library):
    p = subprocess.run([sys.executable, f"{library}.py"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
    assert p.stderr.startswith(f"{library}.py: error: ") and "python -m scripts.bench_kernel" in p.stderr


@pytest.mark.parametrize("prog, run", [
    ("train.py", "python train.py"), ("prepare.py", "python prepare.py"), ("compare.py", "python -m scripts.compare"),
    ("gpu_check.py", "python -m scripts.gpu_check"), ("hf.py", "python -m lib.hf"),
    ("no_such_script.py", "python no_such_script.py"), ("", "python "), ("remote", "python remote"),
], ids=["root", "root-data", "scripts", "scripts-last", "lib", "unknown", "empty", "a-folder"])
def test_a_scripts_command_is_how_the_root_runs_it(prog, run):
    """common.command: `python X.py` for the root's scripts, `python -m PACKAGE.X` for those in scripts/ and
    lib/ (a file there, not a folder), what a flag's error line tells the user to run with --help."""
    from lib import common
    assert common.command(prog) == run


def test_a_bad_flag_names_the_module_command_of_a_packaged_script(capsys):
    from scripts import trend
    line = error_line(capsys, trend.main, ["runs/a", "--no_such_flag"])
    assert line.endswith("(python -m scripts.trend --help lists the flags)"), line
