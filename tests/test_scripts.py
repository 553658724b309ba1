"""What every script does with a mistake in its command line: one line, "<script>.py: error: ...",
and exit status 2, never argparse's usage block (one style for every script, as the README's
"Files" section says)."""
import importlib
import subprocess
import sys

import pytest

from helpers import ROOT, error_line, interrupted_while_importing

SCRIPTS = ["bench_head", "bench_kernel", "compare", "compromise", "eval", "export", "gpu_check", "hf", "prepare",
           "probe", "sample", "train"]


REQUIRED = {"eval": ["--tasks", "x"], "export": ["ckpt.pt", "out"]}  # so the flag is the only mistake


@pytest.mark.parametrize("script", SCRIPTS)
def test_an_unknown_flag_is_one_line(script, capsys, tmp_path, monkeypatch):
    """compare.py hands the flags it does not know to train.py: train.py's parser refuses them,
    before the first run starts."""
    monkeypatch.chdir(tmp_path)                                  # where a run would have written
    main = importlib.import_module(script).main
    line = error_line(capsys, main, REQUIRED.get(script, []) + ["--no_such_flag"],
                      prog="train" if script == "compare" else script)
    assert "--no_such_flag" in line and "--help lists the flags" in line
    assert not list(tmp_path.iterdir())                          # nothing started


@pytest.mark.parametrize("script, argv", [("eval", []), ("export", ["only_one"]),
                                          ("prepare", ["--seed", "x"]), ("sample", ["--top_k"])],
                         ids=["eval-missing", "export-missing", "prepare-type", "sample-no-value"])
def test_a_missing_or_malformed_value_is_one_line(script, argv, capsys):
    error_line(capsys, importlib.import_module(script).main, argv)


@pytest.mark.parametrize("script, module", [("sample", "torch"), ("probe", "torch"),
                                            ("prepare", "numpy")])
def test_ctrl_c_while_a_script_imports_is_one_line(script, module, tmp_path):
    """A Ctrl-C during the seconds torch (or numpy) takes to import: one line and status 130, as
    once the work has begun, not a KeyboardInterrupt traceback. The import is held until the
    signal comes."""
    status, _, stderr = interrupted_while_importing([f"{script}.py"], module, tmp_path)
    assert status == 130 and stderr == f"{script}.py: error: interrupted (Ctrl-C)\n", stderr


def test_ctrl_c_while_probing_is_one_line(monkeypatch, capsys):
    import probe

    def interrupted(args):
        raise KeyboardInterrupt
    monkeypatch.setattr(probe, "probe", interrupted)
    try:
        line = error_line(capsys, probe.main, ["--ckpt", "x.pt"], status=130)
    except KeyboardInterrupt:  # escaping, it would stop pytest itself
        pytest.fail("probe.main let the KeyboardInterrupt through")
    assert "interrupted (Ctrl-C)" in line


@pytest.mark.parametrize("script", ["kernel", "bench_kernel", "gpu_check"])
def test_a_kernel_script_without_triton_is_one_line(script):
    """Without an importable triton, the kernels' scripts say so in one line, status 2, as
    train.py --fused does (a RuntimeError traceback from kernel.py's import before)."""
    code = (f"import runpy, sys; sys.modules['triton'] = None; sys.argv = ['{script}.py']; "
            f"runpy.run_path('{script}.py', run_name='__main__')")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
    assert p.stderr.startswith(f"{script}.py: error: ") and "triton is not installed" in p.stderr
