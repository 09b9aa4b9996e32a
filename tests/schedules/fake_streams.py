"""What the stream tests share: the task lists they run (CASES) and, for their fake CUDA APIs, a
per-thread current stream, set the way torch.cuda.stream(s) sets it."""
from __future__ import annotations

import contextlib
import threading

from megatron_hetermoe.plan.issue_order import stage_sequences
from megatron_hetermoe.plan.tasks import (
    distep_tasks_for_role,
    zebra_tasks_for_role,
)


class ThreadStreams:
    def __init__(self):
        self.tls = threading.local()

    def thread_stream(self):
        """The stream a `use_stream` block made current on this thread, or None."""
        return getattr(self.tls, "stream", None)

    @contextlib.contextmanager
    def use_stream(self, s):
        prev = self.thread_stream()
        self.tls.stream = s
        try:
            yield
        finally:
            self.tls.stream = prev


# Task lists of both roles, with offloaded experts, and DistEP's.
CASES = [
    ("attention", zebra_tasks_for_role(2, 3, "attention")),
    ("expert", zebra_tasks_for_role(2, 3, "expert")),
    ("attention+offload", zebra_tasks_for_role(3, 2, "attention", offloaded_layers=[0, 2])),
    ("distep-expert", distep_tasks_for_role(2, 2, "expert")),
]


def num_layers(tasks) -> int:
    return max(t.layer for t in tasks if t.kind not in ("A_F", "A_B")) + 1


def sequence_of(name: str, tasks) -> list:
    """`tasks`' issue sequence in a ZP group of it and one rank of the other role (CASES)."""
    L, R = num_layers(tasks), 1 + max(t.microbatch for t in tasks)
    make = distep_tasks_for_role if name.startswith("distep") else zebra_tasks_for_role
    attention = name.startswith("attention")
    other = make(L, R, "expert" if attention else "attention")
    lists = {0: tasks, 1: other} if attention else {0: other, 1: tasks}
    me = 0 if attention else 1
    return stage_sequences(lists, {0}, [], L)[me]
