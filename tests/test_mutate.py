"""tests/mutate.py's own arithmetic: the mutant names it selects, its tally of mutmut's results and its score
(running mutmut itself takes minutes: the README's "Testing" section says how)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import mutate
from mutate import mutant_pattern, score, tally

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("function, pattern", [
    (None, "mhar.*"), ("route", "mhar.x_route__mutmut_*"), ("GPT.hidden", "mhar.xǁGPTǁhidden__mutmut_*")],
    ids=["file", "function", "method"])
def test_mutant_pattern_names_mutmuts_mangled_functions(function, pattern):
    assert mutant_pattern("mhar", function) == pattern


@pytest.mark.parametrize("function", ["", "a.b.c", "GPT.", "1x", "route*"],
                         ids=["empty", "nested", "no-method", "not-identifier", "glob"])
def test_mutant_pattern_refuses_what_is_not_a_name(function):
    with pytest.raises(ValueError, match="not a function or Class.method"):
        mutant_pattern("mhar", function)


def test_tally_keeps_the_selected_mutants_and_score_counts_timeouts_as_killed():
    lines = ["    mhar.x_route__mutmut_1: killed", "    mhar.x_route__mutmut_2: survived",
             "    mhar.x_route__mutmut_3: timeout", "    mhar.x_route_weights__mutmut_1: survived",
             "    mhar.xǁGPTǁhidden__mutmut_1: no tests", "    mhar.x_route__mutmut_4: killed", ""]
    found = tally(lines, [mutant_pattern("mhar", "route")])  # route_weights is another function
    assert found == {"killed": ["mhar.x_route__mutmut_1", "mhar.x_route__mutmut_4"],
                     "survived": ["mhar.x_route__mutmut_2"], "timeout": ["mhar.x_route__mutmut_3"]}
    assert score(found) == 3 / 4


@pytest.mark.parametrize("found, expected", [({}, None), ({"no tests": ["a"]}, None), ({"killed": ["a"]}, 1.0),
                                             ({"survived": ["a"]}, 0.0)],
                         ids=["empty", "untested-only", "all-killed", "all-survived"])
def test_score_at_its_edges(found, expected):
    assert score(found) == expected


def test_each_run_starts_from_a_fresh_copy_of_the_tree(tmp_path, monkeypatch):
    """The workspace holds the tree as git lists it now and nothing of an earlier run: not mutmut's map of
    tests to functions (updated for new tests only: a moved function was judged against the wrong tests),
    not its results, not a file since deleted."""
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / ".gitignore").write_text(".mutmut/\n")  # as the repository's
    (tmp_path / "tests").mkdir()
    (tmp_path / "a.py").write_text("def f():\n    return 1\n")
    (tmp_path / "tests" / "test_a.py").write_text("from a import f\n")
    monkeypatch.setattr(mutate, "ROOT", tmp_path)
    earlier = tmp_path / ".mutmut" / "a"
    (earlier / "mutants").mkdir(parents=True)
    (earlier / "mutants" / "mutmut-stats.json").write_text("{}")
    (earlier / "gone.py").write_text("")
    (earlier / "tests").mkdir()
    (earlier / "tests" / "test_gone.py").write_text("")
    folder = mutate.workspace("a.py", ["tests/test_a.py"])
    assert folder == earlier
    files = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
    assert files == [".gitignore", "a.py", "pyproject.toml", "tests/test_a.py"]
    assert (folder / "a.py").read_text() == "def f():\n    return 1\n"
    config = (folder / "pyproject.toml").read_text()
    assert 'source_paths = ["a.py"]' in config and json.dumps(["tests/test_a.py"]) in config


@pytest.mark.parametrize("slow_last", [False, True], ids=["the-suite", "under-mutate"])
def test_under_mutate_the_slow_tests_run_last(slow_last, tmp_path):
    """conftest.py, with MUTATE_SLOW_LAST set (tests/mutate.py sets it for mutmut): the tests marked slow after
    the others, each group in its written order; without it, the order as written."""
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "conftest.py").write_text((ROOT / "tests" / "conftest.py").read_text())
    (tests / "helpers.py").write_text((ROOT / "tests" / "helpers.py").read_text())
    (tests / "test_order.py").write_text(
        "import pytest\n\n@pytest.mark.slow\ndef test_a():\n    pass\n\ndef test_b():\n    pass\n\n"
        "@pytest.mark.slow\n@pytest.mark.parametrize('x', [1, 2])\ndef test_c(x):\n    pass\n\n"
        "def test_d():\n    pass\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("MUTATE_SLOW_LAST", None)
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "-c", str(ROOT / "pytest.ini"), "--rootdir", str(tmp_path), str(tests / "test_order.py")],
                          cwd=tmp_path, capture_output=True, text=True,
                          env={**env, "MUTATE_SLOW_LAST": "1"} if slow_last else env)
    order = [line.split("::")[1] for line in done.stdout.splitlines() if "::" in line]
    assert order == (["test_b", "test_d", "test_a", "test_c[1]", "test_c[2]"] if slow_last else
                     ["test_a", "test_b", "test_c[1]", "test_c[2]", "test_d"]), done.stdout + done.stderr
