"""Fault injection for reliability tests: make one rank fail at a chosen point of a step.

$HETERMOE_INJECT_FAULT="rank=R,site=SITE,at=N,mode=MODE" makes rank R fail at the N-th (0-based)
occurrence of SITE on that rank:
- site "exchange": any all-to-all between attention and expert ranks (dispatch, combine and their
  gradients; forward and backward; DistEP and zebra; counts exchanges included);
- site "task": a compute task of the zebra/DistEP task list (A_F, A_B, X_*, E_F, E_B).
MODE "raise" raises FaultInjected (a Python error), "exit" ends the process at once (os._exit,
like a crash or an OOM kill). Read once per process; costs a pid and a None check per site otherwise.
The launching process checks the variable against the job's world size first (`check_env`): a
malformed value, or a rank the job does not have, is refused before any rank starts.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from megatron_hetermoe.errors import UserError

ENV = "HETERMOE_INJECT_FAULT"
SITES = ("exchange", "task")
MODES = ("raise", "exit")


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

    @classmethod
    def parse(cls, text: str) -> "Fault":
        try:
            kv = dict(item.split("=", 1) for item in text.split(",") if item)
            f = cls(int(kv["rank"]), kv["site"], int(kv["at"]), kv.get("mode", "raise"))
        except (KeyError, ValueError) as e:
            raise FaultSpecError(f"${ENV}={text!r} is malformed ({type(e).__name__}: {e}); use "
                                 f"rank=R,site=SITE,at=N[,mode=MODE]") from None
        if f.site not in SITES or f.mode not in MODES or f.at < 0 or f.rank < 0:
            raise FaultSpecError(f"${ENV}={text!r}: site must be one of {SITES}, mode one of {MODES}, rank and at "
                                 f">= 0")
        return f

    def env(self) -> str:
        return f"rank={self.rank},site={self.site},at={self.at},mode={self.mode}"


def check_env(world_size: int) -> Fault | None:
    """The fault $HETERMOE_INJECT_FAULT asks for in a job of `world_size` ranks (None without
    one); FaultSpecError when it is malformed or names a rank outside the job."""
    text = os.environ.get(ENV)
    if not text:
        return None
    f = Fault.parse(text)
    if f.rank >= world_size:
        raise FaultSpecError(f"${ENV}={text!r} aims at rank {f.rank}, but the job has ranks 0..{world_size - 1}; "
                             f"pick one of those (or unset {ENV})")
    return f


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
        f = Fault.parse(text)
        if f.rank == int(os.environ.get("RANK", "-1")):
            _fault = f


def checkpoint(site: str, what: str = "") -> None:
    """Called at every occurrence of `site`; fails here if this is the injected point."""
    if _loaded_pid != os.getpid():
        _load()
    if _fault is None or _fault.site != site:
        return
    n = _counts[site]
    _counts[site] = n + 1
    if n == _fault.at:
        if _fault.mode == "exit":
            os._exit(17)
        raise FaultInjected(f"injected fault on rank {_fault.rank} at {site} #{n} ({what})")
