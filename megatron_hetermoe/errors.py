"""User errors, and how a command reports an error: one line for a user's mistake, the
traceback for a bug.

A `UserError` is an error whose message already names the bad input (flag, file, field) and
the fix: a refused plan, flag, model config, checkpoint or data file. Every package error class
of that kind derives from it (PlanError, ConfigError, CheckpointError, ...). `run_command` runs a
command's main: a user error, or a rank's (the launcher's LaunchError carries it), becomes one
line `PROG: error: MESSAGE` on stderr and exit code 1; anything else is a bug and keeps its full
traceback. $HETERMOE_TRACEBACK=1 shows the traceback of user errors too. SIGTERM/SIGHUP (raised
as Terminated by the launcher) and Ctrl-C end with 128 + the signal's number. A leaf module: it
imports nothing of the package.
"""
from __future__ import annotations

import os
import signal
import sys
from typing import Callable

TRACEBACK_ENV = "HETERMOE_TRACEBACK"


class UserError(Exception):
    """Base of the errors caused by an input, whose message names that input and the fix."""


class Terminated(BaseException):
    """The process got SIGTERM (or SIGHUP): a scheduler's preemption, `kill`, a closed terminal.
    A BaseException, so that no `except Exception` swallows it on the way out."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"terminated by {signal.Signals(signum).name}")


def want_traceback() -> bool:
    return os.environ.get(TRACEBACK_ENV, "") not in ("", "0")


def user_message(e: BaseException) -> str | None:
    """The one line to show for `e` when it is a user's error (or a rank's user error that the
    launcher passed on), else None (a bug: show the traceback)."""
    if isinstance(e, UserError):
        return str(e)
    line = getattr(e, "user_message", None)  # parallel.launcher.LaunchError of a rank's user error
    if isinstance(line, str):
        return line
    if isinstance(e, OSError) and e.filename is not None and e.strerror:
        # A file the user named: missing, not writable, a directory, a full disk.
        where = f"{e.filename}" + (f" -> {e.filename2}" if e.filename2 else "")
        return f"{where}: {e.strerror}"
    return None


def run_command(prog: str, main: Callable[[list[str] | None], int | None], argv: list[str] | None = None) -> int:
    """Run a command's main(argv) and turn its errors into an exit code (see the module doc)."""
    try:
        return int(main(argv) or 0)
    except Terminated as e:
        sys.stdout.flush()
        print(f"{prog}: {e}; stopped", file=sys.stderr, flush=True)
        return 128 + e.signum
    except KeyboardInterrupt:  # Ctrl-C: the launcher has stopped its ranks on the way out
        sys.stdout.flush()
        print(f"{prog}: interrupted; stopped", file=sys.stderr, flush=True)
        return 128 + signal.SIGINT
    except Exception as e:  # sorted into a user's error or a bug below
        line = user_message(e)
        if line is None or want_traceback():
            raise
        sys.stdout.flush()
        print(f"{prog}: error: {line}", file=sys.stderr, flush=True)
        return 1
