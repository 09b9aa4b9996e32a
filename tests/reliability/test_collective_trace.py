"""collective_trace.check finds every order and thread violation in a job's traces, on synthetic
traces (the pretrain() test runs it on real ones)."""
from __future__ import annotations

import json

import pytest

from megatron_hetermoe.reliability.collective_trace import check


def _write(d, rank, recs):
    """The tracer's format: an entry line per collective, then an end line (none: never left)."""
    with open(d / f"collectives.rank{rank}.jsonl", "w") as f:
        for i, (group, ranks, op, thread, start, end) in enumerate(recs):
            f.write(json.dumps({"seq": i, "group": group, "ranks": ranks, "op": op, "thread": thread, "start": start,
                                "caller": ["x.py:1"]}) + "\n")
            if end is not None:
                f.write(json.dumps({"seq": i, "end": end}) + "\n")


def test_consistent_traces_pass(tmp_path):
    for r in (0, 1):
        _write(tmp_path, r, [("0", [0, 1], "barrier", "MainThread", 0, 1),
                             ("1", [0, 1], "all_to_all_single", "zebra-dispatch", 1, 2),
                             ("2", [0, 1], "all_to_all_single", "zebra-combine", 1.5, 2.5),  # another group: fine
                             ("1", [0, 1], "all_to_all_single", "MainThread", 3, 4),  # another thread, later: fine
                             ("3", [r], "all_reduce", "MainThread", 5, 6)])
    assert check(tmp_path) == []


def test_order_violation_names_group_position_and_ranks(tmp_path):
    _write(tmp_path, 0, [("0", [0, 1], "all_reduce", "MainThread", 0, 1), ("0", [0, 1], "barrier", "MainThread", 1, 2)])
    _write(tmp_path, 1, [("0", [0, 1], "all_reduce", "MainThread", 0, 1), ("0", [0, 1], "all_gather", "MainThread", 1, 2)])
    assert check(tmp_path) == ["order: group 0 (ranks [0, 1]): collective #1 is barrier on rank 0 but all_gather on "
                               "rank 1 (2 vs 2 in all)"]


def test_a_missing_collective_is_found(tmp_path):
    _write(tmp_path, 0, [("5", [0, 1], "all_reduce", "MainThread", 0, 1)])
    _write(tmp_path, 1, [])
    assert check(tmp_path) == ["order: group 5 (ranks [0, 1]): collective #0 is all_reduce on rank 0 but none on "
                               "rank 1 (1 vs 0 in all)"]


def test_two_threads_in_one_group_at_once(tmp_path):
    recs = [("1", [0, 1], "all_to_all_single", "zebra-dispatch", 0, 2),
            ("1", [0, 1], "all_to_all_single", "zebra-combine", 1, 3)]
    _write(tmp_path, 0, recs)
    _write(tmp_path, 1, recs)
    problems = check(tmp_path)
    assert len(problems) == 2 and all(p.startswith("threads: rank") for p in problems), problems


def test_point_to_point_ends_are_not_compared(tmp_path):
    _write(tmp_path, 0, [("0", [0, 1], "send", "MainThread", 0, 1)])
    _write(tmp_path, 1, [("0", [0, 1], "recv", "MainThread", 0, 1)])
    assert check(tmp_path) == []


def test_no_traces_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="HETERMOE_TRACE_COLLECTIVES"):
        check(tmp_path)


def test_a_collective_never_left_is_named_with_its_caller(tmp_path):
    _write(tmp_path, 0, [("3", [0, 1], "all_gather", "MainThread", 0, None)])
    _write(tmp_path, 1, [("3", [0, 1], "all_gather", "MainThread", 0, 1)])
    assert check(tmp_path) == ["stuck: rank 0 entered all_gather on group 3 (ranks [0, 1]) from x.py:1 and never "
                               "left it"]
