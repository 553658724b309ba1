"""README.md and docs/*.md as written, one test id per page: every ```python block runs; every script that
a ```bash block runs (python X.py, python -m scripts.X, torchrun ... X.py) is a file of the repository and
takes the flags written, through its own parser and nothing more (train.py's model flags through mhar.Config, compare.py's grid cell by cell); the Python and
YAML that a block hands to a program parse; every relative link and #anchor resolves."""
import argparse
import contextlib
import importlib
import io
import re
import shlex
import tempfile
from pathlib import Path

import pytest

from lib.common import one_line
from helpers import ROOT

README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]
IDS = [page.relative_to(ROOT).as_posix() for page in PAGES]


def fenced(page, language):
    """The bodies of a page's code blocks in one language, in order."""
    return re.findall(rf"^```{language}\n(.*?)^```$", page.read_text(), flags=re.S | re.M)


def test_there_are_documents():
    assert len(DOCS) >= 5, "docs/ holds the manual"


@pytest.mark.parametrize("page", PAGES, ids=IDS)
def test_python_blocks_run(page):
    """A page's ```python blocks run as written, in order, in one namespace (one per page)."""
    namespace = {"__name__": page.stem}
    for i, block in enumerate(fenced(page, "python")):
        exec(compile(block, f"{page.relative_to(ROOT)} (python block {i + 1})", "exec"), namespace)


# -----------------------------------------------------------------------------
# ```bash blocks: the repository's scripts and their flags


class Parsed(Exception):
    """Raised by a patched ArgumentParser method once a script's flags parsed: the script stops there."""


def strict(method, monkeypatch, stop=True):
    """ArgumentParser.<method> refuses abbreviated flags (the documents spell every flag in full) and,
    with stop, raises Parsed(its result) once it parsed: what comes after never runs."""
    original = getattr(argparse.ArgumentParser, method)

    def parse(self, *args, **kwargs):
        self.allow_abbrev = False
        result = original(self, *args, **kwargs)
        if stop:
            raise Parsed(result)
        return result
    monkeypatch.setattr(argparse.ArgumentParser, method, parse)


def parse_script(module):
    """A script's flags through its own parser, run up to the parse and no further: its parse_args(argv),
    or, for a script that builds its parser inside main(argv), main."""
    def parse(argv, monkeypatch):
        script = importlib.import_module(module)
        strict("parse_args", monkeypatch)
        with pytest.raises(Parsed):
            getattr(script, "parse_args", script.main)(argv)
        monkeypatch.undo()
    return parse


def parse_train(argv, monkeypatch):
    """train.py's flags (its parse_args runs nothing) and, for a run that neither resumes nor converts
    (those take the model from a checkpoint or a directory), the mhar.Config they describe."""
    import train
    strict("parse_known_args", monkeypatch, stop=False)
    args, _ = train.parse_args(argv)
    monkeypatch.undo()
    if args.resume is None and not args.init_from:
        train.model_config(args, {})


def parse_compare(argv, monkeypatch):
    """compare.py's flags and every run of its grid (compare.check_shapes builds each run's mhar.Config),
    then the flags it passes on to train.py; in a temporary folder holding the --eval_include it names."""
    from scripts import compare
    with tempfile.TemporaryDirectory() as folder:
        monkeypatch.chdir(folder)
        if "--eval_include" in argv:
            Path(argv[argv.index("--eval_include") + 1]).mkdir(parents=True)
        strict("parse_known_args", monkeypatch, stop=False)
        args, train_flags = compare.parse_args(argv)
        compare.check_shapes(compare.runs_of(args), train_flags)
        monkeypatch.undo()
    parse_train(train_flags, monkeypatch)


def parse_mutate(argv, monkeypatch):
    """tests/mutate.py's flags, and the file it names is one of the project's (its path from the root)."""
    parse_script("mutate")(argv, monkeypatch)
    first = argparse.ArgumentParser(add_help=False)
    first.add_argument("file")
    file = first.parse_known_args(argv)[0].file
    assert (ROOT / file).is_file(), f"tests/mutate.py {file}: no such file in the repository"


PARSERS = {"train.py": parse_train, "scripts/compare.py": parse_compare,
           **{f"{m}.py": parse_script(m) for m in ("sample", "prepare")},
           **{f"scripts/{m}.py": parse_script(f"scripts.{m}") for m in (
               "eval", "export", "probe", "bench_head", "bench_kernel", "bench_step", "compromise", "gpu_check",
               "trend")},
           "lib/hf.py": parse_script("lib.hf"), "tests/mutate.py": parse_mutate}
PACKAGES = ("scripts", "lib")  # run as python -m PACKAGE.NAME from the root
SEPARATORS = {";", "&&", "||", "|", "&", "(", ")", "\n"}


def balanced(line):
    """Whether a line closes its quotes."""
    try:
        shlex.split(line, comments=True)
        return True
    except ValueError:
        return False


def lines_of(block):
    """(command line, here-document body or None): continuation lines joined, here-documents set aside."""
    lines, i = block.split("\n"), 0
    while i < len(lines):
        line, i = lines[i], i + 1
        while i < len(lines) and (line.endswith("\\") or not balanced(line)):
            line, i = (line[:-1] + " " + lines[i].lstrip(), i + 1) if line.endswith("\\") else \
                (line + "\n" + lines[i], i + 1)  # a quoted string over several lines
        body = None
        heredoc = re.search(r"<<-?\s*'?(\w+)'?", line)
        if heredoc:
            end = lines.index(heredoc.group(1), i)
            body, i, line = "\n".join(lines[i:end]), end + 1, line[:heredoc.start()]
        yield line, body


def simple_commands(line, variables):
    """The words of each simple command of a line, with the block's own variables expanded (a loop's
    values go to variables["for"]: the caller checks the loop's body once per value)."""
    line = re.sub(r"\$\([^()]*\)", "SUBSTITUTED", line)  # $(command): one word, not checked
    line = re.sub(r"\$(\w+)|\$\{(\w+)\}", lambda m: variables.get(m.group(1) or m.group(2), m.group(0)), line)
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    words, commands = list(lexer), [[]]
    for word in words:
        if word in SEPARATORS:
            commands.append([])
        else:
            commands[-1].append(word)
    for command in commands:
        while command and command[0] in ("do", "then", "else", "done", "fi"):
            command = command[1:]
        while command and re.fullmatch(r"\w+=.*", command[0]):  # NAME=value: the block's variables
            name, value = command[0].split("=", 1)
            variables[name] = value
            command = command[1:]
        if command[:1] == ["for"] and len(command) > 3 and command[2] == "in":  # for NAME in VALUES
            variables.setdefault("for", {})[command[1]] = command[3:]
            continue
        if command:
            yield command


def check_command(words, body, monkeypatch):
    """The problems of one simple command: a script that does not exist, flags its parser refuses, Python
    or YAML that does not parse. Commands of other programs are not checked."""
    if words[0] == "bash" and "-c" in words:  # srun ... bash -c '...': the command inside
        return [p for line, _ in lines_of(words[words.index("-c") + 1])
                for command in simple_commands(line, {}) for p in check_command(command, None, monkeypatch)]
    if words[0] == "srun" and "bash" in words:
        return check_command(words[words.index("bash"):], body, monkeypatch)
    if words[0] == "cat" and len(words) == 3 and words[1] == ">" and words[2].endswith(".yaml"):
        yaml = pytest.importorskip("yaml")
        try:
            yaml.safe_load(body)
        except yaml.YAMLError as e:
            return [f"{words[2]}: {one_line(e)}"]
        return []
    if words[0] not in ("python", "python3", "torchrun"):
        return []
    if words[0] != "torchrun" and words[1:2] in (["-c"], ["-"]):
        code = words[2] if words[1] == "-c" else body
        try:
            compile(code, f"python {words[1]}", "exec")
        except SyntaxError as e:
            return [f"python {words[1]}: {e.msg} at line {e.lineno}: {e.text!r}"]
        return []
    if words[0] != "torchrun" and words[1:2] == ["-m"]:
        if words[2].split(".")[0] not in PACKAGES:  # python -m pytest, torch.distributed.run: not ours
            return []
        script, argv = words[2].replace(".", "/") + ".py", words[3:]
    else:
        scripts = [i for i, w in enumerate(words) if w.endswith(".py")]
        if not scripts:
            return [f"{' '.join(words)}: no script"]
        script, argv = words[scripts[0]], words[scripts[0] + 1:]
        if script.split("/")[0] in PACKAGES:
            return [f"{script}: a module of a package, run as python -m {script.removesuffix('.py').replace('/', '.')}"]
    if not (ROOT / script).is_file():
        return [f"{script}: no such file in the repository"]
    if script not in PARSERS:
        return [f"{script}: the docs test knows no parser of it (add it to PARSERS)"]
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            PARSERS[script](argv, monkeypatch)
    except SystemExit as e:
        return [f"{script} {' '.join(argv)}: refused (exit {e.code}): {stderr.getvalue().strip()}"]
    except AssertionError as e:
        return [str(e)]
    finally:
        monkeypatch.undo()
    return []


@pytest.mark.parametrize("page", PAGES, ids=IDS)
def test_bash_blocks_name_scripts_and_flags_that_exist(page, monkeypatch):
    """Every `python X.py ...`, `python -m scripts.X ...` and `torchrun ... X.py ...` of a page's ```bash blocks
    names a script of the repository, and its flags parse with that script's parser; `python -c` and
    here-document code compiles."""
    problems, checked = [], 0
    for block in fenced(page, "bash"):
        variables = {}
        for line, body in lines_of(block):
            loops = [(name, values) for name, values in variables.get("for", {}).items() if f"${name}" in line]
            for name, value in [(name, v) for name, values in loops for v in values] or [(None, None)]:
                for words in simple_commands(line, {**variables, name: value} if name else variables):
                    found = check_command(words, body, monkeypatch)
                    checked += words[0] in ("python", "python3", "torchrun")
                    problems += [f"{page.relative_to(ROOT)}: {p}" for p in found]
    assert not problems, "\n".join(problems)
    if fenced(page, "bash"):
        assert checked, f"{page.name}: bash blocks, but no command checked"


# -----------------------------------------------------------------------------
# Links


def prose(text):
    """A page without its code: fenced blocks and inline code spans hold no links."""
    text = re.sub(r"^```.*?^```$", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def anchors(page):
    """GitHub's heading anchors: lowercase, punctuation but hyphens dropped, spaces to hyphens, -1, -2
    for repeats."""
    seen, result = {}, set()
    for heading in re.findall(r"^#{1,6} (.+?)\s*#*$", prose(page.read_text()), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        result.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return result


def links(page):
    """(target file, anchor or None) of every relative link and image of a page."""
    for target in re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", prose(page.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        yield (page.parent / path).resolve() if path else page, anchor or None


@pytest.mark.parametrize("page", PAGES, ids=IDS)
def test_links_resolve(page):
    """Every relative link of a page names a file of the repository, and every #anchor a heading of that
    file (GitHub's anchors)."""
    problems = []
    for target, anchor in links(page):
        if ROOT not in target.parents:
            problems.append(f"{target}: outside the repository")
        elif not target.exists():
            problems.append(f"{target.relative_to(ROOT)}: no such file")
        elif anchor and (target.suffix != ".md" or anchor not in anchors(target)):
            problems.append(f"{target.relative_to(ROOT)}#{anchor}: no such heading")
    assert not problems, f"{page.relative_to(ROOT)}:\n" + "\n".join(problems)


def test_every_document_is_linked_from_the_readme_and_links_back():
    linked = {target for target, _ in links(README)}
    assert [d.name for d in DOCS if d not in linked] == [], "documents the README does not link to"
    unlinked = [d.name for d in DOCS if README not in {target for target, _ in links(d)}]
    assert unlinked == [], "documents without a link back to the README"


@pytest.mark.parametrize("command, problem", [
    ("python -m scripts.compare --methods baseline,mhar --seeds 0,1", None),
    ("python -m scripts.compare --no_such_flag 1", "unrecognized arguments: --no_such_flag"),
    ("python -m scripts.trend runs/d64 runs/d128 --no_such_flag", "unrecognized arguments: --no_such_flag"),
    ("python -m lib.hf --no_such_flag", "unrecognized arguments: --no_such_flag"),
    ("python -m scripts.no_such_script", "scripts/no_such_script.py: no such file"),
    ("python scripts/compare.py --seeds 0", "run as python -m scripts.compare"),
    ("python train.py --no_such_flag 1", "unrecognized arguments: --no_such_flag"),
    ("python -m pytest -q", None),
    ("python tests/mutate.py lib/common.py seed", None),
    ("python tests/mutate.py common.py seed", "tests/mutate.py common.py: no such file"),
], ids=["module-flags", "module-bad-flag", "trend-bad-flag", "lib-bad-flag", "module-missing", "module-as-a-file",
        "file-bad-flag", "another-program", "mutate", "mutate-moved-file"])
def test_a_documented_command_with_a_bad_flag_or_script_is_a_problem(command, problem, monkeypatch):
    """The check itself, on planted commands: a `python -m scripts.X` command with a flag its parser refuses is
    found, as a `python X.py` one is."""
    found = [p for words in simple_commands(command, {}) for p in check_command(words, None, monkeypatch)]
    assert (found == []) if problem is None else (len(found) == 1 and problem in found[0]), found
