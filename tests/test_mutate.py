"""tests/mutate.py's own arithmetic: the mutant names it selects, its tally of mutmut's results and its score
(running mutmut itself takes minutes: the README's "Testing" section says how)."""
import ast
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import mutate
from mutate import mutant_pattern, score, tally

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("module, function, pattern", [
    ("mhar", None, "mhar.*"), ("mhar", "route", "mhar.x_route__mutmut_*"),
    ("mhar", "GPT.hidden", "mhar.xǁGPTǁhidden__mutmut_*"), ("lib.common", "seed", "lib.common.x_seed__mutmut_*")],
    ids=["file", "function", "method", "in-a-package"])
def test_mutant_pattern_names_mutmuts_mangled_functions(module, function, pattern):
    assert mutant_pattern(module, function) == pattern


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


LISTED = ["README.md", "mhar.py", "train.py", "lib/__init__.py", "lib/common.py", "lib/head.py",
          "lib/remote/modeling_mhar.py", "scripts/__init__.py", "scripts/compare.py", "tests/test_mhar.py", ""]


@pytest.mark.parametrize("file, copied", [
    ("mhar.py", ["README.md", "lib", "scripts", "train.py"]),
    ("lib/common.py", ["README.md", "mhar.py", "scripts", "train.py", "lib/__init__.py", "lib/head.py", "lib/remote"]),
    ("scripts/compare.py", ["README.md", "lib", "mhar.py", "train.py", "scripts/__init__.py"]),
], ids=["root", "lib", "scripts"])
def test_also_copy_is_the_tree_but_the_mutated_file_and_the_tests(file, copied):
    """What the tests import beside the mutant: a package's other files one by one (its folder whole would carry
    the unmutated file), never the file itself nor tests/."""
    assert mutate.also_copy(LISTED, file) == copied


def test_also_copy_of_an_empty_tree_is_empty():
    assert mutate.also_copy([], "lib/common.py") == [] and mutate.also_copy([""], "mhar.py") == []


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


ORIGINAL = '''
def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="x", description="Compare runs.", epilog="See the README.")
    p.add_argument("--seeds", default="0", metavar="LIST", help="comma-separated seeds")
    args = p.parse_args(argv)
    if not args.seeds:
        p.error("--seeds needs a seed")
    return args
'''


def function_of(source):
    return ast.parse(source).body[0]


@pytest.mark.parametrize("old, new, wording", [
    ('help="comma-separated seeds"', 'help="XXcomma-separated seedsXX"', True),
    ('help="comma-separated seeds"', 'help="COMMA-SEPARATED SEEDS"', True),
    (', help="comma-separated seeds"', '', True),
    ('description="Compare runs."', 'description=None', True),
    (', epilog="See the README."', '', True),
    ('default="0"', 'default="XX0XX"', False),
    ('default="0", ', '', False),
    ('"--seeds needs a seed"', '"XX--seeds needs a seedXX"', False),
    ('help="comma-separated seeds")', 'help="comma-separated seeds", type=int)', False),
    ('prog="x"', 'prog="XXxXX"', False),
    ('metavar="LIST"', 'metavar="list"', True),
    ('metavar="LIST", ', '', True),
    ('if not args.seeds', 'if args.seeds', False),
    ('help="comma-separated seeds"', 'help="XX"', True),
], ids=["help-changed", "help-case", "help-dropped", "description", "epilog-dropped", "default", "default-dropped",
        "error-message", "keyword-added", "prog", "metavar", "metavar-dropped", "logic", "help-emptied"])
def test_wording_only_is_what_help_prints_and_nothing_else(old, new, wording):
    assert old in ORIGINAL
    mutant = function_of(ORIGINAL.replace(old, new).replace("def parse_args", "def parse_args__mutmut_1"))
    assert mutate.wording_only(function_of(ORIGINAL), mutant) is wording


def test_wording_only_catches_a_second_change_beside_the_help():
    both = ORIGINAL.replace('help="comma-separated seeds"', 'help="X"').replace('default="0"', 'default="1"')
    assert mutate.wording_only(function_of(ORIGINAL), function_of(both)) is False


MUTATED = '''
def x_f__mutmut_orig(p):
    p.add_argument("--a", help="the a")
def x_f__mutmut_1(p):
    p.add_argument("--a", help="XXthe aXX")
def x_f__mutmut_2(p):
    p.add_argument("--b", help="the a")
def x_g__mutmut_orig(p):
    p.add_argument("--c", help="the c")
def x_g__mutmut_1(p):
    p.add_argument("--c")
class C:
    def xǁCǁm__mutmut_orig(self, p):
        p.add_argument("--d", help="the d")
    def xǁCǁm__mutmut_1(self, p):
        p.add_argument("--d", help="THE D")
    def xǁCǁm__mutmut_2(self, p):
        p.add_argument("--D", help="the d")
'''


@pytest.mark.parametrize("functions, kept, wording", [
    (["f"], ["m.x_f__mutmut_2"], ["m.x_f__mutmut_1"]),
    (["g"], [], ["m.x_g__mutmut_1"]),
    (["C.m"], ["m.xǁCǁm__mutmut_2"], ["m.xǁCǁm__mutmut_1"]),
    (["f", "C.m"], ["m.x_f__mutmut_2", "m.xǁCǁm__mutmut_2"], ["m.x_f__mutmut_1", "m.xǁCǁm__mutmut_1"]),
    ([None], ["m.x_f__mutmut_2", "m.xǁCǁm__mutmut_2"],
     ["m.x_f__mutmut_1", "m.x_g__mutmut_1", "m.xǁCǁm__mutmut_1"]),
    (["h"], [], []),
], ids=["function", "all-wording", "method", "two", "whole-file", "no-such-function"])
def test_split_wording_sorts_the_selected_mutants(functions, kept, wording):
    """Each mutant is judged against its own function's original; the originals themselves are not mutants."""
    patterns = [mutant_pattern("m", f) for f in functions]
    assert mutate.split_wording(MUTATED, "m", patterns) == (kept, wording)


def test_skip_help_runs_only_the_mutants_that_change_more_than_wording(tmp_path, monkeypatch, capsys):
    """main --skip_help: mutmut's mutated file is read, the wording mutants are left out of `mutmut run` and
    counted in the last lines; when every mutant is wording, one line and nothing runs."""
    monkeypatch.setattr(mutate, "ROOT", tmp_path)
    (tmp_path / "m.py").write_text("")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_m.py").write_text("")
    monkeypatch.setattr(mutate, "mutmut_missing", lambda: False)  # its runs are stand-ins below
    folder = tmp_path / ".mutmut" / "m"

    def workspace(file, tests):
        (folder / "mutants").mkdir(parents=True, exist_ok=True)
        return folder
    monkeypatch.setattr(mutate, "workspace", workspace)
    monkeypatch.setattr(mutate, "generate_mutants",
                        lambda folder, jobs: (folder / "mutants" / "m.py").write_text(MUTATED))
    calls = []

    def run(command, **kwargs):
        calls.append(command)
        out = "".join(f"    {name}: survived\n" if name.endswith("2") else f"    {name}: killed\n"
                      for name in calls[0][2:]) if command[1] == "results" else ""
        return subprocess.CompletedProcess(command, 0, stdout=out)
    monkeypatch.setattr(mutate.subprocess, "run", run)
    mutate.main(["m.py", "f", "C.m", "--skip_help"])
    assert calls[0] == ["mutmut", "run", "m.x_f__mutmut_2", "m.xǁCǁm__mutmut_2"]
    assert not (folder / "mutants").exists()  # mutmut's run starts from no mutants, as it would have
    assert "2 survived; 2 left out (they change only what --help prints)" in capsys.readouterr().out
    calls.clear()
    with pytest.raises(SystemExit, match="every mutant of g changes --help alone"):
        mutate.main(["m.py", "g", "--skip_help"])
    assert calls == []


@pytest.mark.skipif(importlib.util.find_spec("mutmut") is None, reason="mutmut is not installed (pip install "
                    "mutmut==3.8.1): its mutant generation is what this test checks")
def test_generate_mutants_writes_mutmuts_mutated_file(tmp_path, monkeypatch):
    """The mutated file as mutmut's run makes it: each function's original and its numbered mutants."""
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "tests").mkdir()
    (tmp_path / "a.py").write_text('def f(p):\n    p.add_argument("--a", default=1, help="the a")\n')
    (tmp_path / "tests" / "test_a.py").write_text("")
    monkeypatch.setattr(mutate, "ROOT", tmp_path)
    folder = mutate.workspace("a.py", ["tests/test_a.py"])
    mutate.generate_mutants(folder, 1)
    kept, wording = mutate.split_wording((folder / "mutants" / "a.py").read_text(), "a", [mutant_pattern("a", "f")])
    assert kept and wording and len(kept) + len(wording) == len(set(kept + wording))


def mutate_line(capsys, argv):
    """mutate.main(argv) on a mistake: status 2 and one line "mutate.py: error: ...", no usage block."""
    with pytest.raises(SystemExit) as stop:
        mutate.main(argv)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1 and err.startswith("mutate.py: error: "), err
    return err


@pytest.mark.parametrize("argv, fragment", [
    ([], "the following arguments are required: file"),
    (["nope.py"], "nope.py is not a Python file at the root, in lib/ or in scripts/"),
    (["mhar.py", "a.b.c"], "'a.b.c' is not a function or Class.method name"),
    (["mhar.py", "--jobs", "x"], "argument --jobs: invalid int value: 'x'"),
], ids=["nothing", "no-such-file", "bad-function", "bad-flag"])
def test_a_mistake_is_one_line_and_status_2(argv, fragment, capsys):
    assert fragment in mutate_line(capsys, argv)


@pytest.mark.parametrize("command, package", [(None, object()), ("/bin/mutmut", None)],
                         ids=["no-command", "not-in-this-python"])
def test_without_mutmut_it_says_what_to_install(command, package, capsys, monkeypatch):
    """The check comes after the arguments' (a mistake there is said first, with or without mutmut)."""
    monkeypatch.setattr(mutate.shutil, "which", lambda name: command)
    monkeypatch.setattr(mutate.importlib.util, "find_spec", lambda name: package)
    assert "mutmut is not installed: pip install mutmut==3.8.1" in mutate_line(capsys, ["mhar.py", "route"])


def test_outside_a_git_checkout_it_says_so(tmp_path, capsys, monkeypatch):
    """A copy of the files without .git: git ls-files fails; one line (before: a CalledProcessError traceback)."""
    (tmp_path / "tests").mkdir()
    (tmp_path / "a.py").write_text("def f():\n    return 1\n")
    (tmp_path / "tests" / "test_a.py").write_text("")
    monkeypatch.setattr(mutate, "ROOT", tmp_path)
    monkeypatch.setattr(mutate, "mutmut_missing", lambda: False)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))  # git looks no higher
    err = mutate_line(capsys, ["a.py"])
    assert f"{tmp_path} is not a git checkout" in err and "run it in a clone of the repository" in err, err
