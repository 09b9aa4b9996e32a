"""An emulated run with live moves (--emulate with --hetero-replan-interval, issue 46 item 5): after a
move the emulated task times follow the new plan's lists, and each step is judged for validity by
the plan it ran. 1 A40 attention rank and 2 V100 expert ranks, a router forced to send every token
to experts 0 and 1. Before the move the attention rank holds expert 3 (Asym-EA: its X tasks, idle)
and both hot experts sit on expert rank 1 (twice the balanced share of two experts), rank 2 holds
expert 2 (idle); a move forced after step 1 takes expert 3 off the attention rank (no X task from
then on) and gives each expert rank one hot and one idle expert; every other window takes the new
plan's time: attention its balanced one, the dispatch and combine transfers the rows really routed
(all to rank 1 before, half to each expert rank after)."""
from __future__ import annotations

import pytest
from emulated_small import CLUSTER, GB, MODEL, SEQ

from megatron_hetermoe.config import EmulationSpec, ModelConfig
from megatron_hetermoe.emulation.emulator import Emulator
from megatron_hetermoe.plan.hetero_plan import HeteroPlan, ZPGroup
from megatron_hetermoe.planner.rebalance import with_placement
from megatron_hetermoe.planner.simulator import balanced_tokens_per_expert

START = [{0: [3], 1: [0, 1], 2: [2]}, {0: [3], 1: [0, 1], 2: [2]}]
MOVED = [{1: [0, 2], 2: [1, 3]}, {1: [0, 2], 2: [1, 3]}]


def _plan() -> HeteroPlan:
    return HeteroPlan(2, 4, ["A40", "V100-16GB", "V100-16GB"], [ZPGroup([0], [1, 2], START)], num_microbatches=2,
                      schedule="zebra")


def _forced(iteration: int, plan: HeteroPlan) -> HeteroPlan | None:
    return with_placement(plan, MOVED) if iteration == 1 else None


def _rank(rank, world, cfg, plan, init_state):
    """Train emulated with a forced move, recording each task window's budget (emulated s) by step."""
    from megatron_hetermoe.config import HeteroRunConfig
    from megatron_hetermoe.emulation import clock
    from megatron_hetermoe.training.hetero import train_hetero
    from megatron_hetermoe.training.run_hooks import RunHooks

    seen, window = [], clock.EmulationClock.window

    def recording(self, lane, key, start, budget, real_end, end):
        if hasattr(key, "kind"):  # a task of the lists
            seen.append((self.cur["it"], key, budget / self.cur["scale"]))
        return window(self, lane, key, start, budget, real_end, end)

    clock.EmulationClock.window = recording
    res = train_hetero(cfg, plan, HeteroRunConfig(schedule="zebra", replan_interval=1),
                       RunHooks(init_state=init_state, replan=_forced))
    return res.losses, res.moves, res.emulation, seen


def _emulated_job(tmp_path):
    """(EmulationSpec, plan, initial state with every token routed to experts 0 and 1, TrainConfig):
    3 emulated steps of 2 sequences on 1 A40 + 2 V100 (tests/emulated_small.py)."""
    from routing import force_routing, initial_state

    from megatron_hetermoe.config import ParallelConfig, TrainConfig
    from megatron_hetermoe.emulation.emulator import emulation_real_model

    (tmp_path / "cluster.yaml").write_text(CLUSTER)
    (tmp_path / "model.yaml").write_text(MODEL)
    spec = EmulationSpec(str(tmp_path / "cluster.yaml"), str(tmp_path / "model.yaml"), SEQ, GB, scale=1e-3)
    real = emulation_real_model(ModelConfig.load(spec.model))
    plan = _plan()
    state = force_routing(initial_state(real), [0, 1], real.num_layers)
    cfg = TrainConfig(real, ParallelConfig(), micro_batch_size=1, global_batch_size=2, train_iters=3, quiet=True,
                      log_interval=1, emulate=spec)
    return spec, plan, state, cfg


@pytest.mark.slow
def test_emulated_task_times_follow_a_live_move(tmp_path):
    from megatron_hetermoe.parallel.launcher import launch

    spec, plan, state, cfg = _emulated_job(tmp_path)
    out = launch(_rank, plan.world_size, cfg, plan, state, timeout_s=600)
    losses, moves, rep, _ = out[0]
    assert len(losses) == 3 and [m["iteration"] for m in moves] == [1] and all(o[1] == moves for o in out)
    em = Emulator(spec)
    share = balanced_tokens_per_expert(plan, em.cost, GB)
    moved = with_placement(plan, MOVED)

    def t(tokens: float, backward: bool, gpu: str = "V100-16GB") -> float:
        return em.cost.expert_time(gpu, tokens, backward)

    # The attention rank's rows of a microbatch (one sequence, each token to experts 0 and 1): all to
    # rank 1 before the move, half to each expert rank after it.
    seq = cfg.model.seq_length
    rows = {True: ((0, 2 * seq, 0), (0, 0, 0), (0, 0, 0)), False: ((0, seq, seq), (0, 0, 0), (0, 0, 0))}
    changed = 0
    for rank in (0, 1, 2):
        seen = out[rank][3]
        assert sorted({it for it, _, _ in seen}) == [0, 1, 2]
        before, after = em.task_times(plan, rank, "zebra"), em.task_times(moved, rank, "zebra")
        changed += sum(k not in after or before[k] != pytest.approx(after[k]) for k in before if k.kind[0] not in "XE")
        kinds = [{task.kind for it, task, _ in seen if (it == 0) == first} for first in (True, False)]
        assert ("X_F" in kinds[0], "X_F" in kinds[1]) == ((True, False) if rank == 0 else (False, False))
        for it, task, budget in seen:
            b = task.kind.endswith("_B")
            if task.kind[0] in "DC":  # a transfer: the rows really routed, as the plan of that step places them
                price = em.transfer_task_time(plan if it == 0 else moved, rank)
                assert budget == pytest.approx(price(task, rows[it == 0])), (rank, it, task)
            elif task.kind[0] not in "XE":
                assert budget == pytest.approx((before if it == 0 else after)[task]), (rank, it, task)
            elif rank == 0:  # expert 3 on the attention rank, idle
                assert budget == pytest.approx(t(0.0, b, "A40")), (rank, it, task)
            elif it == 0:  # the starting plan: rank 1 holds both hot experts, rank 2 an idle one
                assert budget == pytest.approx(2 * t(2 * share, b) if rank == 1 else t(0.0, b)), (rank, it, task)
            else:  # the new plan: one hot and one idle expert on each
                assert budget == pytest.approx(t(2 * share, b) + t(0.0, b)), (rank, task)
    assert changed > 0  # the move changes windows other than the experts' (the check can fail)
    # Each step is judged by the plan it ran: the clock's phases are the two plans' predictions.
    preds = [em.predict_hetero(plan, "zebra").step_time_s, em.predict_hetero(moved, "zebra").step_time_s]
    assert [p["from_iteration"] for p in rep["phases"]] == [0, 1]
    assert [p["predicted_step_s"] for p in rep["phases"]] == pytest.approx(preds)
    assert [s["predicted_step_s"] for s in rep["steps"]] == pytest.approx([preds[0], preds[1], preds[1]])


def _rank_decided(rank, world, cfg, plan, init_state):
    from megatron_hetermoe.config import HeteroRunConfig
    from megatron_hetermoe.training.hetero import train_hetero
    from megatron_hetermoe.training.run_hooks import RunHooks

    res = train_hetero(cfg, plan, HeteroRunConfig(schedule="zebra", replan_interval=2, replan_margin=0.0),
                       RunHooks(init_state=init_state))
    return res.moves, res.plan, res.emulation, res.stays


@pytest.mark.slow
def test_an_emulated_run_decides_its_moves_through_the_simulator(tmp_path):
    """No hook: the decision is propose_simulated's on the emulated cluster; the planted hot pair
    (experts 0 and 1 on rank 1) is split, and the simulator predicted the new step faster."""
    from megatron_hetermoe.parallel.launcher import launch
    from megatron_hetermoe.planner.expert_load import ExpertLoad
    from megatron_hetermoe.planner.simulator import simulate_plan

    import dataclasses

    spec, plan, state, cfg = _emulated_job(tmp_path)
    cfg = dataclasses.replace(cfg, train_iters=4)  # a second decision, on the moved placement
    moves, final, rep, stays = launch(_rank_decided, plan.world_size, cfg, plan, state, timeout_s=600)[0]
    assert [m["iteration"] for m in moves] == [2] and moves[0]["reason"].startswith("simulated step"), moves
    # the hot pair already split: the decision at 4 stays, and says why
    assert [s["iteration"] for s in stays] == [4] and stays[0]["reason"], stays
    final = HeteroPlan.from_dict(final)
    for l in range(2):
        holders = [r for r, es in final.groups[0].placement[l].items() if {0, 1} & set(es)]
        assert len(holders) == 2, final.groups[0].placement  # the hot pair split
    em = Emulator(spec)
    load = ExpertLoad.of([[1.0, 1.0, 0.0, 0.0]] * 2)
    before = simulate_plan(plan, em.cost, em.cluster, GB, expert_load=load).step_time_s
    after = simulate_plan(final, em.cost, em.cluster, GB, expert_load=load).step_time_s
    assert moves[0]["predicted_s_now"] == pytest.approx(before) and after < before
    assert [p["from_iteration"] for p in rep["phases"]] == [0, 2]  # one move: two phases
