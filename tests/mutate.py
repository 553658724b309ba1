"""
Mutation testing of one file, or of some of its functions, against the tests that reach them: mutmut 3
(https://github.com/boxed/mutmut) plants one small bug at a time (a < that becomes <=, a 1 that becomes 2, a
string or an argument dropped) and runs the tests that call the mutated function; a bug no test notices
"survives", and names a behaviour that no test pins.

    pip install mutmut==3.8.1
    python tests/mutate.py scripts/compare.py paired versus   # two functions, tests/test_compare.py
    python tests/mutate.py lib/common.py seed --tests tests/test_common.py tests/test_train.py
    python tests/mutate.py mhar.py GPT.hidden                  # a method: Class.method
    python tests/mutate.py scripts/compromise.py               # every function of the file

The working tree (what git tracks, and new files it does not ignore) is copied into .mutmut/<file's stem>/, with
a pyproject.toml that tells mutmut the file to mutate and the tests to run (default tests/test_<stem>.py), and
mutmut runs there: the checkout is never touched. mutmut first runs those tests once to learn which of them
call which function, then each mutant against the tests that call its function alone. Each command starts
from an empty folder: mutmut's saved map of tests to functions is updated for new tests only, so a function
moved, renamed or newly called by an old test would be judged against the wrong tests (reported as surviving
or untested). The end is a table: killed (a test failed: good), survived (no test
noticed: add one, or say why the mutant is equivalent), no tests (no selected test calls the function),
timeout (counted as killed: the bug made a test hang), and the score = killed / (killed + survived), with
the diff of every survivor. `mutmut show NAME` inside the folder shows any mutant.
With --skip_help the mutants that change only what `--help` prints (an argparse help=, description=, epilog= or
metavar=, changed or dropped) are left out and counted: wording no test should pin, each of which would otherwise survive
at the cost of every test that reaches its function (for a parse_args, the whole file).
mutmut leaves decorated functions alone (but @staticmethod and @classmethod): the Triton kernels (@triton.jit),
which its trampolines would break, and the few @torch.no_grad() functions are not mutated.
"""
import argparse
import ast
import copy
import fnmatch
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORDING = ("help", "description", "epilog", "metavar")  # what argparse prints for --help alone
COUNTED = ("killed", "timeout", "survived", "no tests", "suspicious", "skipped", "segfault")


def mutant_pattern(module, function=None):
    """mutmut's name of a function's mutants, as a glob: seed of lib.common -> "lib.common.x_seed__mutmut_*",
    GPT.hidden -> "mhar.xǁGPTǁhidden__mutmut_*"; none: every mutant of the module."""
    if function is None:
        return f"{module}.*"
    *cls, name = function.split(".")
    if len(cls) > 1 or not name.isidentifier() or not all(c.isidentifier() for c in cls):
        raise ValueError(f"{function!r} is not a function or Class.method name")
    return f"{module}." + (f"xǁ{cls[0]}ǁ{name}" if cls else f"x_{name}") + "__mutmut_*"


def tally(lines, patterns):
    """{status: [mutant names]} of `mutmut results --all true` lines ("    name: status"), for the mutants
    matching one of the patterns."""
    found = {}
    for line in lines:
        name, _, status = line.strip().rpartition(": ")
        if name and any(fnmatch.fnmatchcase(name, p) for p in patterns):
            found.setdefault(status, []).append(name)
    return found


def score(found):
    """killed / (killed + survived), timeouts counted as killed; None when nothing was checked."""
    killed = len(found.get("killed", [])) + len(found.get("timeout", []))
    checked = killed + len(found.get("survived", []))
    return killed / checked if checked else None


def wording_only(original, mutant):
    """Whether two versions of a function (ast.FunctionDef) differ only in argparse's texts for --help: the
    WORDING keywords of any call, changed or dropped."""
    def without_wording(function):
        function = copy.deepcopy(function)
        function.name = ""
        for node in ast.walk(function):
            if isinstance(node, ast.Call):
                node.keywords = [k for k in node.keywords if k.arg not in WORDING]
        return ast.dump(function)
    return without_wording(original) == without_wording(mutant)


def split_wording(mutated_source, module, patterns):
    """(kept, wording) mutant names of the patterns' functions in mutmut's mutated module: each mutant
    (x_f__mutmut_3) against its function's original (x_f__mutmut_orig); wording: those wording_only."""
    functions = {node.name: node for node in ast.walk(ast.parse(mutated_source))
                 if isinstance(node, ast.FunctionDef) and "__mutmut_" in node.name}
    kept, wording = [], []
    for name, function in functions.items():
        stem, _, number = name.rpartition("__mutmut_")
        mutant = f"{module}.{name}"
        if number.isdigit() and any(fnmatch.fnmatchcase(mutant, p) for p in patterns):
            (wording if wording_only(functions[f"{stem}__mutmut_orig"], function) else kept).append(mutant)
    return kept, wording


def generate_mutants(folder, jobs):
    """mutmut's mutated copy of the file, under `folder`/mutants/, as its `run` makes it first (main removes
    mutants/ again once read, so that `run` starts as it would have). mutmut must import in this Python."""
    code = ("from mutmut.__main__ import create_mutants\n"
            "from mutmut.mutation.trampoline import set_mutant_under_test\n"
            f"set_mutant_under_test('mutant_generation')\ncreate_mutants({jobs or 1})\n")
    subprocess.run([sys.executable, "-c", code], cwd=folder, check=True, capture_output=True)


def also_copy(listed, file):
    """What mutmut copies beside the mutated file for the tests to import: every top-level file and folder of
    the tree but the file and tests/, and for a file in a package (lib/common.py) the package's other entries
    (lib/__init__.py, lib/head.py, lib/remote), not the package whole, whose copy would hold the unmutated file."""
    tops = sorted({p.split("/")[0] for p in listed if p})
    package = file.split("/")[0] if "/" in file else None
    siblings = sorted({"/".join(p.split("/")[:2]) for p in listed if p.startswith(f"{package}/")} - {file})
    return [t for t in tops if t not in (file, "tests", package)] + (siblings if package else [])


def mutmut_missing():
    """Whether mutmut's command or its package for this Python (generate_mutants imports it) is missing."""
    return shutil.which("mutmut") is None or importlib.util.find_spec("mutmut") is None


class Usage(Exception):
    """A mistake of the user's (a bad argument, no mutmut, no git checkout): main prints it in one line."""


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not argparse's usage block first
        raise Usage(f"{message} (python tests/mutate.py --help lists the arguments)")


def workspace(file, tests):
    """.mutmut/<stem>/ holding a copy of the working tree and mutmut's configuration for `file`."""
    try:
        listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                                capture_output=True, text=True, check=True).stdout.split("\n")
    except (OSError, subprocess.CalledProcessError) as e:
        raise Usage(f"{ROOT} is not a git checkout (git ls-files: {(getattr(e, 'stderr', None) or str(e)).strip()}): "
                    f"mutate.py copies what git tracks; run it in a clone of the repository") from None
    tops = sorted({p.split("/")[0] for p in listed if p and (ROOT / p).exists()})
    folder = ROOT / ".mutmut" / Path(file).stem
    shutil.rmtree(folder, ignore_errors=True)  # nothing of an earlier run: its mutants, results, test map
    folder.mkdir(parents=True)
    for top in tops:
        source, copy = ROOT / top, folder / top
        if source.is_dir():
            shutil.copytree(source, copy, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(source, copy)
    (folder / "pyproject.toml").write_text(
        "[tool.mutmut]\n"
        f"source_paths = [{json.dumps(file)}]\n"
        f"also_copy = {json.dumps(also_copy(listed, file))}\n"  # what the tests import
        f"pytest_add_cli_args_test_selection = {json.dumps(tests)}\n"
        'process_isolation = "forkserver"\n')  # torch is not safe to fork once it has run
    return folder


def main(argv=None):
    try:
        mutate(argv)
    except Usage as e:
        print(f"mutate.py: error: {str(e).strip()}", file=sys.stderr)
        sys.exit(2)


def mutate(argv):
    p = Parser(prog="mutate.py", description=__doc__.split("\n\n")[0].strip())
    p.add_argument("file", help="a Python file of the project, e.g. mhar.py, lib/common.py, scripts/compare.py")
    p.add_argument("functions", nargs="*", help="its functions (Class.method for a method); none: all of them")
    p.add_argument("--tests", nargs="+", help="test files to run (default tests/test_<stem>.py)")
    p.add_argument("--jobs", type=int, help="mutants tested at a time (default: one per core)")
    p.add_argument("--skip_help", action="store_true",
                   help="leave out (and count) the mutants that change only what --help prints")
    args = p.parse_args(argv)
    if not re.fullmatch(r"((lib|scripts)/)?\w+\.py", args.file) or not (ROOT / args.file).is_file():
        p.error(f"{args.file} is not a Python file at the root, in lib/ or in scripts/")
    module = args.file.removesuffix(".py").replace("/", ".")  # lib/common.py: lib.common
    tests = args.tests or [f"tests/test_{Path(args.file).stem}.py"]
    missing = [t for t in tests if not (ROOT / t).is_file()]
    if missing:
        p.error(f"no test file {missing[0]}: name the tests with --tests")
    try:
        patterns = [mutant_pattern(module, f) for f in args.functions] or [mutant_pattern(module)]
    except ValueError as e:
        p.error(str(e))
    if mutmut_missing():
        p.error("mutmut is not installed: pip install mutmut==3.8.1")
    folder = workspace(args.file, tests)
    wording = []
    if args.skip_help:
        generate_mutants(folder, args.jobs)
        patterns, wording = split_wording((folder / "mutants" / args.file).read_text(), module, patterns)
        shutil.rmtree(folder / "mutants")
        if not patterns:
            sys.exit(f"mutate.py: error: every mutant of {' '.join(args.functions) or args.file} changes --help alone")
    jobs = ["--max-children", str(args.jobs)] if args.jobs else []
    run = subprocess.run(["mutmut", "run", *jobs, *patterns], cwd=folder,
                         env={**os.environ, "MUTATE_SLOW_LAST": "1"})  # conftest.py: slow tests last
    if run.returncode != 0:
        sys.exit(f"mutate.py: error: mutmut stopped with status {run.returncode} (its output is above)")
    results = subprocess.run(["mutmut", "results", "--all", "true"], cwd=folder, capture_output=True,
                             text=True, check=True).stdout.splitlines()
    found = tally(results, patterns)
    if not found:
        raise Usage(f"no mutant matches {' '.join(args.functions)} in {args.file}")
    print(f"\n{args.file} {' '.join(args.functions)} against {' '.join(tests)}:")
    print("  " + ", ".join(f"{len(found[s])} {s}" for s in COUNTED if s in found)
          + (f"; {len(wording)} left out (they change only what --help prints)" if wording else ""))
    s = score(found)
    print(f"  score {'—' if s is None else f'{s:.0%}'} (killed / (killed + survived), timeouts as killed)")
    for name in sorted(found.get("survived", [])):
        diff = subprocess.run(["mutmut", "show", name], cwd=folder, capture_output=True, text=True).stdout
        print("\n" + "\n".join(line for line in diff.splitlines() if line.startswith(("#", "-", "+", "@"))))


if __name__ == "__main__":
    main()
