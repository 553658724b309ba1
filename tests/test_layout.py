"""The repository's shape, which the README promises a reader: the lesson at the root (the model, its
kernels, training, data, sampling; at most 7 files), the lab behind it in role-named folders (lib/: what the
scripts import; scripts/: every other entry point, run as python -m scripts.NAME), imports that point down the
tiers only and close no cycle (imports inside functions counted), mhar.py a leaf that teaches (it imports no
module of the project but kernel, behind Config.fused), files and functions of a size one reads."""
import ast

import pytest

from helpers import ROOT


def modules_under(root):
    """{dotted module name: path} of the project's Python files under `root`: the root's own, lib/'s (its
    remote-code files apart: they are copied into an export, not imported) and scripts/'."""
    found = {path.stem: path for path in sorted(root.glob("*.py"))}
    for package in ("lib", "scripts"):
        found |= {f"{package}.{path.stem}": path for path in sorted((root / package).glob("*.py"))
                  if path.stem != "__init__"}
    return found


MODULES = modules_under(ROOT)
MODEL = {"mhar", "kernel", "launcher"}  # the lowest tier: the model and its kernels
ENTRY_POINTS = {"train", "prepare", "sample"}  # the root's scripts, above lib/


def tier(module):
    """0 the model, 1 lib/, 2 the root's scripts, 3 scripts/: a module imports from its own tier or below."""
    if module in MODEL:
        return 0
    if module.startswith("lib."):
        return 1
    return 2 if module in ENTRY_POINTS else 3


def imports_of(path, modules=MODULES):
    """The modules (of `modules`) a file imports anywhere in it, at the top or inside a function:
    `import a`, `from a import x`, and `from lib import common` as lib.common."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        found |= set(names) & modules.keys()
    return found - {next((name for name, p in modules.items() if p == path), None)}


def cycle(graph):
    """One import cycle as a list of modules, or None."""
    state = {}                                                   # module -> "open" | "done"

    def visit(module, trail):
        state[module] = "open"
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                return trail[trail.index(target):] + [target]
            if target not in state and (found := visit(target, trail + [target])):
                return found
        state[module] = "done"
        return None

    for module in sorted(graph):
        if module not in state and (found := visit(module, [module])):
            return found
    return None


def test_no_module_of_the_project_imports_itself_back():
    graph = {name: imports_of(path) for name, path in MODULES.items()}
    assert {"mhar", "kernel", "train", "lib.common", "lib.hf", "scripts.compare"} <= graph.keys()
    assert cycle(graph) is None, f"an import cycle: {' -> '.join(cycle(graph))}"


def test_the_root_holds_the_lesson_and_the_lab_lives_in_folders():
    """At most 7 Python files at the root, each of the model or one of its three scripts; lib/ and scripts/
    are packages (python -m scripts.NAME runs from the root, without sys.path edits)."""
    root = sorted(path.name for path in ROOT.glob("*.py"))
    assert len(root) <= 7 and {path.removesuffix(".py") for path in root} <= MODEL | ENTRY_POINTS, root
    assert (ROOT / "lib" / "__init__.py").is_file() and (ROOT / "scripts" / "__init__.py").is_file()
    shims = [name for name, path in MODULES.items() if "sys.path" in path.read_text()]
    assert not shims, f"sys.path edited in {shims}"


def test_imports_point_down_the_tiers():
    upward = [f"{name} imports {target}" for name, path in MODULES.items()
              for target in sorted(imports_of(path)) if tier(target) > tier(name)]
    assert not upward, upward


def test_the_tier_check_sees_an_upward_import(tmp_path):
    """A file of lib/ that imports a script, as `from scripts import compare` inside a function: found."""
    for folder, text in (("lib", "def f():\n    from scripts import compare\n"), ("scripts", "")):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "lib" / "common.py").write_text("def f():\n    from scripts import compare\n")
    (tmp_path / "scripts" / "compare.py").write_text("from lib.common import f\n")
    modules = modules_under(tmp_path)
    graph = {name: imports_of(path, modules) for name, path in modules.items()}
    assert graph == {"lib.common": {"scripts.compare"}, "scripts.compare": {"lib.common"}}
    assert [t for t in graph["lib.common"] if tier(t) > tier("lib.common")] == ["scripts.compare"]


def test_the_cycle_finder_finds_a_cycle_through_a_function_level_import(tmp_path):
    """The check above can fail: a lazy import that closes a circle is one."""
    (tmp_path / "a.py").write_text("import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from a import x\n")
    modules = {"a": tmp_path / "a.py", "b": tmp_path / "b.py"}
    graph = {name: imports_of(path, modules) for name, path in modules.items()}
    assert graph == {"a": {"b"}, "b": {"a"}}
    assert cycle(graph) in (["a", "b", "a"], ["b", "a", "b"])


def test_the_model_file_is_a_leaf_that_teaches():
    """mhar.py imports kernel alone of the project (for Config.fused), so that it travels alone as
    an export's remote code, and reads in its docstring's "Reading order": the route and the plain
    depth history early, GPT's routed forward right after its __init__, GPT.hidden the residual
    dispatch that takes its positions ready (a padded batch's are built by the export's
    modeling_mhar.py), then block and delta routing's histories with the other modes, the config's
    checks and the presets last. 680 lines at most, with the route before line 150 and the routed
    forward before line 330."""
    source = MODULES["mhar"].read_text()
    assert imports_of(MODULES["mhar"]) <= {"kernel"}
    assert len(source.splitlines()) <= 680
    tree = ast.parse(source)
    top = {node.name: node for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
    top["PRESETS"] = next(node for node in tree.body if isinstance(node, ast.Assign)
                          and node.targets[0].id == "PRESETS")
    reading_order = ["Config", "route", "DepthHistory", "RMSNorm", "GPT", "BlockHistory", "DeltaHistory",
                     "depth_history", "site_reads", "forward_delta", "HyperConnection", "check_config", "PRESETS"]
    lines = [top[name].lineno for name in reading_order]
    assert lines == sorted(lines), dict(zip(reading_order, lines))
    assert top["route"].lineno < 150 and top["DepthHistory"].lineno < 150
    methods = [node for node in top["GPT"].body if isinstance(node, ast.FunctionDef)]
    assert [m.name for m in methods[:3]] == ["__init__", "forward_routed", "hidden"]
    assert methods[1].lineno < 330
    hidden = methods[2]
    assert hidden.end_lineno - hidden.lineno + 1 <= 20
    assert [arg.arg for arg in hidden.args.args] == ["self", "idx", "visit", "cache", "at"]


# Caps below today's sizes, with a margin: the next feature finds a home outside these files (kernel.py's
# bound launches went to launcher.py; train.py's reporting, timers and weight average to lib/)
@pytest.mark.parametrize("name, most", [("kernel", 1150), ("train", 950)])
def test_files_stay_readable_in_one_sitting(name, most):
    assert len(MODULES[name].read_text().splitlines()) <= most


def test_no_function_outside_a_triton_kernel_is_longer_than_70_lines():
    long = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if any("jit" in ast.unparse(decorator) for decorator in node.decorator_list):
                continue
            if node.end_lineno - node.lineno + 1 > 70:
                long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    assert not long, f"functions longer than 70 lines: {long}"
