"""Fault injection for reliability tests: make one rank fail at a chosen point of a step.

$HETERMOE_INJECT_FAULT="rank=R,site=SITE,at=N,mode=MODE" makes rank R fail at the N-th (0-based)
occurrence of SITE on that rank:
- site "exchange": any all-to-all between attention and expert ranks (dispatch, combine and their
  gradients; forward and backward; DistEP and zebra; counts exchanges included);
- site "task": a compute task of the zebra/DistEP task list (A_F, A_B, X_*, E_F, E_B).
- site "iteration": the start of training iteration N (`at` is the iteration itself, not an
  occurrence count, so that a resumed run fails at the same point).
MODE "raise" raises FaultInjected (a Python error), "exit" ends the process at once (os._exit,
like a crash or an OOM kill), "kill" sends the process SIGKILL (kill -9: a lost GPU or node).
Several faults are separated by ";". `attempt=K` (default 0) aims a fault at the K-th start of
an elastic job (training/elastic.py numbers its starts in $HETERMOE_ELASTIC_ATTEMPT, torchrun in
$TORCHELASTIC_RESTART_COUNT), so a test can lose one rank, then another rank of the re-planned
job. Read once per process; costs a pid and a None check per site otherwise.
The launching process checks the variable against the job's world size first (`check_env`): a
malformed value, or a rank the job does not have, is refused before any rank starts.
"""
from __future__ import annotations

import os
import signal
from dataclasses import dataclass

from megatron_hetermoe.errors import UserError

ENV = "HETERMOE_INJECT_FAULT"
ATTEMPT_ENV = "HETERMOE_ELASTIC_ATTEMPT"
SITES = ("exchange", "task", "iteration")
MODES = ("raise", "exit", "kill")


class FaultInjected(RuntimeError):
    pass


class FaultSpecError(UserError, ValueError):
    """A malformed $HETERMOE_INJECT_FAULT, or one aimed at a rank the job does not have."""


@dataclass(frozen=True)
class Fault:
    rank: int
    site: str
    at: int
    mode: str = "raise"
    attempt: int = 0

    @classmethod
    def parse(cls, text: str) -> "Fault":
        try:
            kv = dict(item.split("=", 1) for item in text.split(",") if item)
            unknown = set(kv) - {"rank", "site", "at", "mode", "attempt"}
            if unknown:
                raise ValueError(f"unknown keys {sorted(unknown)}")
            f = cls(int(kv["rank"]), kv["site"], int(kv["at"]), kv.get("mode", "raise"), int(kv.get("attempt", 0)))
        except (KeyError, ValueError) as e:
            raise FaultSpecError(f"${ENV}={text!r} is malformed ({type(e).__name__}: {e}); use "
                                 f"rank=R,site=SITE,at=N[,mode=MODE][,attempt=K]") from None
        if f.site not in SITES or f.mode not in MODES or f.at < 0 or f.rank < 0 or f.attempt < 0:
            raise FaultSpecError(f"${ENV}={text!r}: site must be one of {SITES}, mode one of {MODES}, rank, at and "
                                 f"attempt >= 0")
        return f

    def env(self) -> str:
        return f"rank={self.rank},site={self.site},at={self.at},mode={self.mode},attempt={self.attempt}"


def parse_all(text: str) -> list[Fault]:
    """Every fault of a $HETERMOE_INJECT_FAULT value (faults separated by ';')."""
    return [Fault.parse(part) for part in text.split(";") if part.strip()]


def current_attempt() -> int:
    """Which start of an elastic job this process belongs to (0: the first, or no elastic job):
    training/elastic.py's count, or torchrun's ($TORCHELASTIC_RESTART_COUNT) for its workers."""
    return int(os.environ.get(ATTEMPT_ENV, os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))


def check_env(world_size: int) -> Fault | None:
    """The fault $HETERMOE_INJECT_FAULT asks for in a job of `world_size` ranks (None without
    one); FaultSpecError when it is malformed or names a rank outside the job."""
    text = os.environ.get(ENV)
    if not text:
        return None
    faults = parse_all(text)
    for f in faults:
        if f.rank >= world_size and f.attempt == current_attempt():
            raise FaultSpecError(f"${ENV}={text!r} aims at rank {f.rank}, but the job has ranks 0..{world_size - 1}; "
                                 f"pick one of those (or unset {ENV})")
    return faults[0] if faults else None


_fault: Fault | None = None
_counts = {s: 0 for s in SITES}
# The process that read $HETERMOE_INJECT_FAULT: a rank forked from a parent that already read it
# (the parent ran a task list in-process, say) reads it again, with its own counts.
_loaded_pid: int | None = None


def _load() -> None:
    global _fault, _loaded_pid, _counts
    _loaded_pid = os.getpid()
    _fault, _counts = None, {s: 0 for s in SITES}
    text = os.environ.get(ENV)
    if text:
        rank, attempt = int(os.environ.get("RANK", "-1")), current_attempt()
        mine = [f for f in parse_all(text) if f.rank == rank and f.attempt == attempt]
        _fault = mine[0] if mine else None


def _fail(site: str, what: str) -> None:
    if _fault.mode == "exit":
        os._exit(17)
    if _fault.mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise FaultInjected(f"injected fault on rank {_fault.rank} at {site} ({what})")


def checkpoint(site: str, what: str = "") -> None:
    """Called at every occurrence of `site`; fails here if this is the injected point."""
    if _loaded_pid != os.getpid():
        _load()
    if _fault is None or _fault.site != site:
        return
    n = _counts[site]
    _counts[site] = n + 1
    if n == _fault.at:
        _fail(site, f"#{n} {what}")


def iteration(it: int) -> None:
    """Called at the start of training iteration `it`; fails here if the fault names it."""
    if _loaded_pid != os.getpid():
        _load()
    if _fault is not None and _fault.site == "iteration" and _fault.at == it:
        _fail("iteration", f"iteration {it}")
