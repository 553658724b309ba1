"""interrupts.py: the handler a script installs first, which signals it takes and leaves, and the hand-over to
KeyboardInterrupt where the work begins. A script's real Ctrl-C at every phase: test_scripts.py."""
import signal
import subprocess
import sys

import pytest

from lib import interrupts
from helpers import ROOT

LINE = b"x.py: error: interrupted\n"


@pytest.fixture(autouse=True)
def handlers():
    """This process's SIGINT and SIGTERM handlers, put back after each test."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGINT, signal.default_int_handler)  # a suite run with `&` ignores SIGINT
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


@pytest.mark.parametrize("name", ["x", "", "__main__.x"], ids=["imported", "empty", "a-submodule"])
def test_only_the_scripts_own_process_is_guarded(name):
    """A script imported by another (a test, compare.py) changes no handler."""
    interrupts.guard(name, LINE, sigterm=LINE)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


@pytest.mark.parametrize("sigterm", [None, LINE], ids=["sigint-alone", "sigterm-too"])
def test_the_script_takes_the_signals_it_names(sigterm):
    interrupts.guard("__main__", LINE, sigterm=sigterm)
    assert interrupts.guarded(signal.SIGINT) and interrupts.guarded(signal.SIGTERM) == (sigterm is not None)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["sigint", "sigterm"])
@pytest.mark.parametrize("handler", [signal.SIG_IGN, print], ids=["ignored", "another-handler"])
def test_a_signal_ignored_or_handled_elsewhere_is_left_as_it_is(signum, handler):
    """nohup and `cmd &` in a shell script start a process with SIGINT ignored: it stays ignored."""
    signal.signal(signum, handler)
    interrupts.guard("__main__", LINE, sigterm=LINE)
    assert signal.getsignal(signum) is handler and not interrupts.guarded(signum)


@pytest.mark.parametrize("guarded", [True, False], ids=["guarded", "not-guarded"])
def test_the_work_hands_sigint_back_to_keyboard_interrupt(guarded):
    """begin: SIGINT raises KeyboardInterrupt again where guard had it; a test's handler stays; SIGTERM is the
    script's to hand over."""
    if guarded:
        interrupts.guard("__main__", LINE, sigterm=LINE)
    else:
        signal.signal(signal.SIGINT, print)
    interrupts.begin()
    assert signal.getsignal(signal.SIGINT) is (signal.default_int_handler if guarded else print)
    assert interrupts.guarded(signal.SIGTERM) == guarded
    interrupts.begin()  # twice: nothing more
    assert not interrupts.guarded(signal.SIGINT)


@pytest.mark.parametrize("signame, line", [("SIGINT", LINE), ("SIGTERM", LINE), ("SIGINT", b"")],
                         ids=["sigint", "sigterm", "sigint-without-a-word"])
def test_the_handler_writes_the_line_and_ends_the_process_at_once(signame, line):
    """128 + the signal's number and the line alone on stderr (none: bench_head.py's child), while the
    process sleeps (a Ctrl-C during an import meets it as one during any other instruction)."""
    code = (f"import os, signal, time; from lib import interrupts; interrupts.guard('__main__', {line!r}, sigterm={line!r}); "
            f"os.kill(os.getpid(), signal.{signame}); time.sleep(60)")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, timeout=60)
    assert p.returncode == 128 + getattr(signal, signame) and p.stderr == line, p.stderr
