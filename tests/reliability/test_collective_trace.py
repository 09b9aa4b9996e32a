"""collective_trace.check finds every order and thread violation in a job's traces, on synthetic
traces (the pretrain() test runs it on real ones)."""
from __future__ import annotations

import json

import pytest

from megatron_hetermoe.reliability.collective_trace import check, single_queue_hangs


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
    _write(tmp_path, 1, [("0", [0, 1], "all_reduce", "MainThread", 0, 1),
                         ("0", [0, 1], "all_gather", "MainThread", 1, 2)])
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


def _calls(d, rank, calls):
    """Calls for single_queue_hangs: (group, ranks, op) or (group, ranks, op, [[send|recv, peer, tag]])."""
    with open(d / f"collectives.rank{rank}.jsonl", "w") as f:
        for i, c in enumerate(calls):
            rec = {"seq": i, "group": c[0], "ranks": c[1], "op": c[2], "thread": "MainThread", "start": i,
                   "caller": ["x.py:1"]}
            if len(c) > 3:
                rec["p2p"] = c[3]
            f.write(json.dumps(rec) + "\n" + json.dumps({"seq": i, "end": i + 0.5}) + "\n")


def test_single_queue_finds_two_communicators_in_opposite_orders(tmp_path):
    # each group's order agrees (check() is content), but rank 0 runs dispatch first and rank 1
    # combine first: with one hardware queue each waits for the other
    _calls(tmp_path, 0, [("d", [0, 1], "all_to_all_single"), ("c", [0, 1], "all_to_all_single")])
    _calls(tmp_path, 1, [("c", [0, 1], "all_to_all_single"), ("d", [0, 1], "all_to_all_single")])
    assert check(tmp_path) == []
    assert single_queue_hangs(tmp_path) == ["rank 0 waits at its call #0: all_to_all_single on group d",
                                            "rank 1 waits at its call #0: all_to_all_single on group c"]
    _calls(tmp_path, 1, [("d", [0, 1], "all_to_all_single"), ("c", [0, 1], "all_to_all_single")])
    assert single_queue_hangs(tmp_path) == []


def test_single_queue_pairs_point_to_point_by_peer_tag_and_turn(tmp_path):
    send, recv = "batch_isend_irecv", "batch_isend_irecv"
    # crossing sends, each alone: both wait
    _calls(tmp_path, 0, [("p", [0, 1], send, [["send", 1, 2]]), ("p", [0, 1], recv, [["recv", 1, 0]])])
    _calls(tmp_path, 1, [("p", [0, 1], send, [["send", 0, 0]]), ("p", [0, 1], recv, [["recv", 0, 2]])])
    assert len(single_queue_hangs(tmp_path)) == 2
    # the same messages posted together on both sides: through
    _calls(tmp_path, 0, [("p", [0, 1], send, [["recv", 1, 0], ["send", 1, 2]])])
    _calls(tmp_path, 1, [("p", [0, 1], send, [["send", 0, 0], ["recv", 0, 2]])])
    assert single_queue_hangs(tmp_path) == []
    # a receive posted before the send on one side resolves the crossing too
    _calls(tmp_path, 0, [("p", [0, 1], recv, [["recv", 1, 0]]), ("p", [0, 1], send, [["send", 1, 2]])])
    _calls(tmp_path, 1, [("p", [0, 1], send, [["send", 0, 0]]), ("p", [0, 1], recv, [["recv", 0, 2]])])
    assert single_queue_hangs(tmp_path) == []
