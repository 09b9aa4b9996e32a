"""The zebra task list: Theorem 1's compute order, one collective order per stream, inputs
issued before they are needed."""
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_hetermoe.plan.hetero_plan import even_plan
from megatron_hetermoe.plan.tasks import (
    COMM_KINDS,
    Task,
    check_stream_order,
    distep_tasks_for_role,
    inputs,
    stream_order,
    zebra_tasks,
    zebra_tasks_for_role,
)


def compute(tasks):
    return [(t.kind, t.layer, t.microbatch) for t in tasks if not t.is_comm]


def test_theorem1_attention_order():
    L, R = 3, 2
    want = [("A_F", s, j) for s in range(L) for j in range(R)]
    for j in range(R):
        want += [("A_F", L, j), ("A_B", L, j)]
    want += [("A_B", s, j) for s in reversed(range(L)) for j in range(R)]
    assert compute(zebra_tasks_for_role(L, R, "attention")) == want


def test_theorem1_expert_order():
    L, R = 3, 2
    want = ([("E_F", l, j) for l in range(L) for j in range(R)]
            + [("E_B", l, j) for l in reversed(range(L)) for j in range(R)])
    assert compute(zebra_tasks_for_role(L, R, "expert")) == want


def test_offloaded_experts_follow_all_microbatches_of_their_stage():
    got = compute(zebra_tasks_for_role(2, 2, "attention", {0}))
    assert got[:6] == [("A_F", 0, 0), ("A_F", 0, 1), ("X_F", 0, 0), ("X_F", 0, 1), ("A_F", 1, 0), ("A_F", 1, 1)]
    # backward mirrored: X_B of layer 0 before A_B of stage 0
    assert got[-4:] == [("X_B", 0, 0), ("X_B", 0, 1), ("A_B", 0, 0), ("A_B", 0, 1)]


@settings(max_examples=60, deadline=None)
@given(L=st.integers(1, 5), R=st.integers(1, 4), data=st.data())
def test_lists_are_consistent(L, R, data):
    off_a = data.draw(st.sets(st.integers(0, L - 1)))
    off_b = data.draw(st.sets(st.integers(0, L - 1)))
    for f in (zebra_tasks_for_role, distep_tasks_for_role):
        lists = {0: f(L, R, "attention", off_a), 1: f(L, R, "attention", off_b), 2: f(L, R, "expert")}
        check_stream_order(lists)  # one collective order per stream in the group
        for role_list in lists.values():
            assert len(set(role_list)) == len(role_list)
            comm = {t for t in role_list if t.is_comm}
            assert comm == {Task(k, l, j) for k in COMM_KINDS for l in range(L) for j in range(R)}
            pos = {t: i for i, t in enumerate(role_list)}
            for t in role_list:
                dep = inputs(t, L)
                if not t.is_comm and dep is not None:
                    assert pos[dep] < pos[t], (t, dep)  # its input was issued earlier
        # a send is issued after the compute that produces it
        a = lists[0]
        pos = {t: i for i, t in enumerate(a)}
        for l in range(L):
            for j in range(R):
                assert pos[Task("A_F", l, j)] < pos[Task("D_F", l, j)]
                if l in off_a:
                    assert pos[Task("X_F", l, j)] < pos[Task("C_F", l, j)]
                    assert pos[Task("X_B", l, j)] < pos[Task("D_B", l, j)]


def test_mismatched_lists_are_caught():
    a = zebra_tasks_for_role(2, 2, "attention")
    x = distep_tasks_for_role(2, 2, "expert")
    try:
        check_stream_order({0: a, 1: x})
    except ValueError as e:
        assert "stream" in str(e) and "collective #" in str(e)
    else:
        raise AssertionError("zebra vs distep orders must be reported")


def test_plan_level_lists():
    plan = even_plan(2, 4, 2, 2, num_microbatches=3, schedule="zebra")
    plan.groups[0].placement[1] = {0: [3], 2: [0, 1], 3: [2]}  # rank 0 holds expert 3 of layer 1
    assert any(t.kind == "X_F" for t in zebra_tasks(plan, 0))
    assert not any(t.kind == "X_F" for t in zebra_tasks(plan, 1))
    check_stream_order({r: zebra_tasks(plan, r) for r in range(4)})
    assert stream_order(zebra_tasks(plan, 1), "dispatch")[0] == Task("D_F", 0, 0)
