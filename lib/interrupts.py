"""
What every script does first (train.py, sample.py, probe.py, prepare.py, bench_head.py): a Ctrl-C
that comes before its work begins, while torch and the rest import (a second or more), ends the
process at once with the script's one line and exit status 130 (prepare.py: SIGTERM too, 143).
Nothing is written before the work, so there is nothing to clean up, and the handler calls
os._exit rather than raising KeyboardInterrupt: an exception raised inside an import may meet C
code that swallows it (a Ctrl-C lost) or turns it into another error (numpy's ImportError about a
bad install). Where its work begins, the script hands SIGINT back to KeyboardInterrupt (begin),
which unwinds through its clean-up; once the work is done it ignores the signals
(common.ignore_stop_signals), its teardown included.

A script imports this file first of all, in a try that catches the KeyboardInterrupt of the
microseconds before the handler is in place, and this file imports only what the interpreter has
imported already when it starts a script: os, and _signal, the C half of signal (signal itself
imports enum: milliseconds in which a Ctrl-C would be a traceback).
"""
import os

import _signal

_lines = {}  # signal number -> the script's line for it (bytes)


def _interrupted(signum, frame):
    try:
        os.write(2, _lines[signum])
    finally:
        os._exit(128 + signum)


def guard(name, sigint, sigterm=None):
    """In a script's own process (`name`, its __name__, is "__main__"): SIGINT writes the line
    `sigint` (bytes) and ends the process at once, and so does SIGTERM with `sigterm` when given.
    A signal the process ignores (nohup, `cmd &` in a shell script) stays ignored, and another
    process (a test importing the script) keeps its handlers."""
    if name != "__main__":
        return
    for signum, line, default in ((_signal.SIGINT, sigint, _signal.default_int_handler),
                                  (_signal.SIGTERM, sigterm, _signal.SIG_DFL)):
        if line is not None and _signal.getsignal(signum) == default:
            _lines[signum] = line
            _signal.signal(signum, _interrupted)


def guarded(signum):
    """Whether `signum` still ends the process at once (guard's handler)."""
    return _signal.getsignal(signum) is _interrupted


def begin():
    """The script's work begins: SIGINT raises KeyboardInterrupt again, which the script catches
    after its clean-up (a handler other than guard's, as a test's, is left as it is). SIGTERM is
    the script's to hand over (prepare.py)."""
    if guarded(_signal.SIGINT):
        _signal.signal(_signal.SIGINT, _signal.default_int_handler)
