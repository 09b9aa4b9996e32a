"""Emulated expert tasks priced for the tokens they received (issue 46 item 2): with a router forced
to send every token to experts 0 and 1 (tests/routing.py), the expert rank holding them gets the
cost model's time for twice the balanced share per expert, the other expert rank for nothing; the
tokens are counted once per ZP group in the stats file. The unit tests check the pricing itself:
a balanced load gives exactly the old (balanced) task times, in the emulator, the Megatron EP
hooks' rule and the simulator."""
from __future__ import annotations

import pytest
from emulated_small import CLUSTER, GB, MODEL, SEQ

from megatron_hetermoe.config import EmulationSpec, ModelConfig
from megatron_hetermoe.emulation.emulator import Emulator
from megatron_hetermoe.parallel.extension import ReceivedTokens
from megatron_hetermoe.plan.hetero_plan import HeteroPlan, ZPGroup
from megatron_hetermoe.planner.expert_load import ExpertLoad
from megatron_hetermoe.planner.simulator import balanced_tokens_per_expert, experts_time, simulate_plan


def _plan() -> HeteroPlan:
    """1 A40 attention rank, 2 V100 expert ranks: rank 1 holds experts 0 and 1, rank 2 holds 2 and 3."""
    g = ZPGroup([0], [1, 2], [{1: [0, 1], 2: [2, 3]}, {1: [0, 1], 2: [2, 3]}])
    return HeteroPlan(2, 4, ["A40", "V100-16GB", "V100-16GB"], [g], num_microbatches=2, schedule="zebra")


@pytest.fixture
def spec(tmp_path) -> EmulationSpec:
    (tmp_path / "cluster.yaml").write_text(CLUSTER)
    (tmp_path / "model.yaml").write_text(MODEL)
    return EmulationSpec(str(tmp_path / "cluster.yaml"), str(tmp_path / "model.yaml"), SEQ, GB, scale=1e-6)


def test_a_balanced_load_prices_every_expert_task_as_before(spec):
    em, plan = Emulator(spec), _plan()
    timing = em.task_timing(plan, 1, "zebra")
    for task, t in em.task_times(plan, 1, "zebra").items():
        if task.kind in ("E_F", "E_B"):
            # every local expert got exactly the layer's mean: the balanced time, bitwise
            assert timing.expert_duration(task, ReceivedTokens((96, 96), 96.0)) == t * spec.scale
            assert timing.expert_duration(task, ReceivedTokens((192, 0), 96.0)) != t * spec.scale


def test_skewed_loads_price_each_expert_by_its_tokens(spec):
    em, plan = Emulator(spec), _plan()
    share = balanced_tokens_per_expert(plan, em.cost, GB)
    assert share == pytest.approx(SEQ * GB / 2 * 2 / 4)  # per microbatch: 2 sequences x top-2 / 4 experts
    price = em.expert_task_time(plan, 1)
    from megatron_hetermoe.plan.tasks import Task

    hot = price(Task("E_F", 0, 0), ReceivedTokens((300, 100), 100.0))
    assert hot == pytest.approx(em.cost.expert_time("V100-16GB", 3 * share) + em.cost.expert_time("V100-16GB", share))
    assert price(Task("E_B", 0, 0), ReceivedTokens((0, 0), 100.0)) == pytest.approx(
        2 * em.cost.expert_time("V100-16GB", 0.0, True))


def test_simulator_takes_an_expert_load_histogram(spec):
    em, plan = Emulator(spec), _plan()
    base = simulate_plan(plan, em.cost, em.cluster, GB, dedup=False)
    assert simulate_plan(plan, em.cost, em.cluster, GB, dedup=False,
                         expert_load=ExpertLoad.uniform(2, 4)).step_time_s == base.step_time_s
    hot = ExpertLoad.of([[3, 1, 0, 0], [3, 1, 0, 0]])  # rank 1's experts get every token
    skewed = simulate_plan(plan, em.cost, em.cluster, GB, dedup=False, keep_trace=True, expert_load=hot)
    assert skewed.step_time_s > base.step_time_s
    share = balanced_tokens_per_expert(plan, em.cost, GB)
    e_f = {t: e - s for t, s, e in skewed.trace_of(1) if t.kind == "E_F"}
    assert e_f[next(iter(e_f))] == pytest.approx(experts_time(em.cost, "V100-16GB", [3 * share, share], False))
    with pytest.raises(ValueError, match="3 MoE layers x 4 experts but the plan 2 x 4"):
        simulate_plan(plan, em.cost, em.cluster, GB, expert_load=ExpertLoad.uniform(3, 4))


def _rank(rank, world, cfg, plan, spec, init_state):
    """Train with the emulator's task times at a tiny scale, recording every expert task's budget."""
    from megatron_hetermoe.config import HeteroRunConfig
    from megatron_hetermoe.training.hetero import train_hetero
    from megatron_hetermoe.training.run_hooks import RunHooks

    inner = Emulator(spec).task_timing(plan, rank, "zebra")
    seen, moved = [], []

    class Recording:
        def origin(self):
            return inner.origin()

        def compute(self, task, start, real_end, tokens=None):
            if task.kind in ("E_F", "E_B"):
                seen.append((task, tokens, inner.expert_duration(task, tokens) / spec.scale))
            return inner.compute(task, start, real_end, tokens)

        def transfer(self, task, start, real_end, rows=None):
            moved.append((task, rows, inner.transfer_duration(task, rows) / spec.scale if rows else None))
            return inner.transfer(task, start, real_end, rows)

    res = train_hetero(cfg, plan, HeteroRunConfig(schedule="zebra", expert_load_stats=str(spec.cluster) + ".load"),
                       RunHooks(init_state=init_state, task_timing=Recording()))
    return res.losses, seen, moved


def _skewed_run(spec: EmulationSpec, plan: HeteroPlan, global_batch: int):
    """One emulated step of `plan` (one sequence a microbatch per attention rank) with every token
    routed to experts 0 and 1: (each rank's (losses, expert budgets, transfers), the real model)."""
    from routing import force_routing, initial_state

    from megatron_hetermoe.config import ParallelConfig, TrainConfig
    from megatron_hetermoe.emulation.emulator import emulation_real_model
    from megatron_hetermoe.parallel.launcher import launch

    real = emulation_real_model(ModelConfig.load(spec.model))
    state = force_routing(initial_state(real), [0, 1], real.num_layers)
    cfg = TrainConfig(real, ParallelConfig(), micro_batch_size=1, global_batch_size=global_batch, train_iters=1,
                      quiet=True, log_interval=1)
    return launch(_rank, plan.world_size, cfg, plan, spec, state), real


@pytest.mark.slow
def test_emulated_expert_times_follow_a_planted_skew(spec):
    import json

    plan = _plan()
    out, real = _skewed_run(spec, plan, 2)
    em = Emulator(spec)
    share = balanced_tokens_per_expert(plan, em.cost, GB)
    tokens = real.seq_length  # per microbatch: one sequence, every token to experts 0 and 1
    hot, cold = out[1][1], out[2][1]
    assert len(hot) == len(cold) == 2 * 2 * 2  # E_F, E_B x 2 layers x 2 microbatches
    for task, got, budget in hot:
        assert got == ReceivedTokens((tokens, tokens), tokens * 2 / 4)
        assert budget == pytest.approx(2 * em.cost.expert_time("V100-16GB", 2 * share, task.kind == "E_B"))
    for task, got, budget in cold:
        assert got.received == (0, 0)
        assert budget == pytest.approx(2 * em.cost.expert_time("V100-16GB", 0.0, task.kind == "E_B"))
    balanced = em.task_times(plan, 1, "zebra")
    assert all(budget > balanced[task] * 1.5 for task, _, budget in hot)
    stats = json.loads(open(str(spec.cluster) + ".load").read())
    assert stats["tokens"] == [[2 * tokens, 2 * tokens, 0, 0]] * 2  # one step of 2 microbatches


# Two attention ranks: with one, every transfer's time is its one sender's (or receiver's) whatever
# the routing; with two, an expert rank that receives both's rows waits for more than either sends.
CLUSTER4 = """name: 2a40-2v100
node_groups:
  - {gpu: A40, nodes: 2, gpus_per_node: 1, nic_gbps_per_gpu: 100}
  - {gpu: V100-16GB, nodes: 2, gpus_per_node: 1, nic_gbps_per_gpu: 100}
network_latency_us: 10
"""


def _plan4() -> HeteroPlan:
    """2 A40 attention ranks, 2 V100 expert ranks: rank 2 holds experts 0 and 1, rank 3 holds 2 and 3."""
    g = ZPGroup([0, 1], [2, 3], [{2: [0, 1], 3: [2, 3]}, {2: [0, 1], 3: [2, 3]}])
    return HeteroPlan(2, 4, ["A40", "A40", "V100-16GB", "V100-16GB"], [g], num_microbatches=2, schedule="zebra")


@pytest.fixture
def spec4(tmp_path) -> EmulationSpec:
    (tmp_path / "cluster4.yaml").write_text(CLUSTER4)
    (tmp_path / "model.yaml").write_text(MODEL)
    return EmulationSpec(str(tmp_path / "cluster4.yaml"), str(tmp_path / "model.yaml"), SEQ, GB, scale=1e-6)


def _transfers(em, plan, rank):
    return {t: d for t, d in em.task_times(plan, rank, "zebra").items() if t.kind in ("D_F", "C_F", "C_B", "D_B")}


def test_balanced_rows_price_every_transfer_as_before_and_skewed_rows_longer(spec4):
    """Each attention rank routes R rows, split over the expert ranks by their experts' share: the
    simulator's balanced time for every D_F, C_F, C_B and D_B, on every member. All rows to rank 2
    (experts 0 and 1) take longer (it receives twice what either attention rank sends), the same
    on every member: the collective ends with its slowest member."""
    em, plan = Emulator(spec4), _plan4()
    even = ((0, 0, 50, 50), (0, 0, 50, 50), (0,) * 4, (0,) * 4)
    hot = ((0, 0, 100, 0), (0, 0, 100, 0), (0,) * 4, (0,) * 4)
    for r in range(4):
        price = em.transfer_task_time(plan, r)
        for task, t in _transfers(em, plan, r).items():
            assert price(task, even) == pytest.approx(t, rel=1e-12)
            assert price(task, hot) > 1.5 * t
            assert price(task, hot) == em.transfer_task_time(plan, 0)(task, hot)
    timing = em.task_timing(plan, 2, "zebra")
    d_f = next(t for t in _transfers(em, plan, 2) if t.kind == "D_F")
    assert timing.transfer_duration(d_f, hot) == em.transfer_task_time(plan, 2)(d_f, hot) * spec4.scale


@pytest.mark.slow
def test_emulated_transfers_follow_a_planted_skew(spec4):
    """Every token to experts 0 and 1 (rank 2's) on 2 attention + 2 expert ranks: every transfer is
    told the rows each member sent each (all to rank 2), every member prices it alike, and longer
    than the balanced transfer."""
    plan = _plan4()
    out, real = _skewed_run(spec4, plan, 4)
    em = Emulator(spec4)
    rows = real.seq_length * real.moe_router_topk  # one sequence a microbatch per attention rank, top-2
    moves = [{task: (got, budget) for task, got, budget in out[r][2]} for r in range(4)]
    assert all(len(m) == 4 * 2 * 2 for m in moves)  # D_F, C_F, C_B, D_B x 2 layers x 2 microbatches
    for task, (got, budget) in moves[0].items():
        assert got == ((0, 0, rows, 0), (0, 0, rows, 0), (0,) * 4, (0,) * 4), got
        assert all(m[task] == (got, budget) for m in moves[1:]), [m[task] for m in moves]
        assert budget > 1.5 * _transfers(em, plan, 0)[task]


PAIR = """name: a40-v100
node_groups:
  - {gpu: A40, nodes: 1, gpus_per_node: 1, nic_gbps_per_gpu: 100}
  - {gpu: V100-16GB, nodes: 1, gpus_per_node: 1, nic_gbps_per_gpu: 100}
network_latency_us: 10
"""


def test_megatron_ep_all_to_all_is_priced_for_the_rows_each_rank_sent(spec4):
    """emulation/megatron_ep.routed_a2a_time: even rows give the simulator's balanced EP all-to-all
    (planner/baselines.ep_a2a_time) on every EP size of the 2 A40 + 2 V100 cluster; all rows to one
    rank take longer; reversed rows (the backward) price the same; rows a rank keeps cost nothing."""
    from megatron_hetermoe.emulation.megatron_ep import routed_a2a_time
    from megatron_hetermoe.planner.baselines import ep_a2a_time
    from megatron_hetermoe.planner.cluster import Links

    em = Emulator(spec4)
    t, k, tb = 512.0, em.model.moe_router_topk, em.cost.token_bytes()
    for ranks in ([0, 1], [2, 3], [0, 2], [0, 1, 2, 3]):
        n = len(ranks)
        links = Links.for_ranks(em.cluster, ranks, em.cost.profiles)
        even = [[7.0] * n for _ in range(n)]
        balanced = ep_a2a_time(em.cost, em.cluster, ranks, t)
        assert routed_a2a_time(links, n * t * k * tb, even) == pytest.approx(balanced, rel=1e-12)
        hot = [[7.0 * n] + [0.0] * (n - 1) for _ in range(n)]  # every rank's rows to the first
        assert routed_a2a_time(links, n * t * k * tb, hot) > balanced
        transposed = [list(col) for col in zip(*hot)]
        assert routed_a2a_time(links, n * t * k * tb, transposed) == routed_a2a_time(links, n * t * k * tb, hot)
        kept = [[7.0 if i == j else 0.0 for j in range(n)] for i in range(n)]
        assert routed_a2a_time(links, n * t * k * tb, kept) == 0.0


TRANSFERS = ("D_F", "C_F", "C_B", "D_B")


def _ep_rank(rank, world, cfg, init_state):
    """Plain Megatron EP, emulated, recording its experts' and all-to-alls' windows (emulated seconds)."""
    from megatron_hetermoe.emulation import clock
    from megatron_hetermoe.training.megatron_ep import train
    from megatron_hetermoe.training.run_hooks import RunHooks

    seen, window = [], clock.EmulationClock.window

    def recording(self, lane, key, start, budget, real_end, end):
        if key[0] in ("E_F", "E_B", *TRANSFERS):
            seen.append((key, budget / self.cur["scale"]))
        return window(self, lane, key, start, budget, real_end, end)

    clock.EmulationClock.window = recording
    train(cfg, RunHooks(init_state=init_state))
    return seen


@pytest.mark.slow
def test_megatron_ep_emulated_experts_follow_a_planted_skew(tmp_path):
    """EP 2 on an A40 + a V100: every token to experts 0 and 1 (rank 0's), so rank 0's experts
    take the time of twice their balanced share each, rank 1's of nothing."""
    from routing import force_routing, initial_state

    from megatron_hetermoe.config import ParallelConfig, TrainConfig
    from megatron_hetermoe.emulation.emulator import emulation_real_model
    from megatron_hetermoe.parallel.launcher import launch

    (tmp_path / "pair.yaml").write_text(PAIR)
    (tmp_path / "model.yaml").write_text(MODEL)
    spec = EmulationSpec(str(tmp_path / "pair.yaml"), str(tmp_path / "model.yaml"), SEQ, 2, scale=1e-3)
    real = emulation_real_model(ModelConfig.load(spec.model))
    state = force_routing(initial_state(real), [0, 1], real.num_layers)
    cfg = TrainConfig(real, ParallelConfig(ep=2), micro_batch_size=1, global_batch_size=2, train_iters=1,
                      quiet=True, emulate=spec)
    hot, cold = launch(_ep_rank, 2, cfg, state, timeout_s=300)
    em = Emulator(spec)
    cost = em.cost
    share = 2 * SEQ * 2 / 4  # the EP group's tokens of a microbatch x top-2 / 4 experts
    experts = [[(key, b) for key, b in seen if key[0] in ("E_F", "E_B")] for seen in (hot, cold)]
    assert len(experts[0]) == len(experts[1]) == 4  # E_F and E_B of 2 layers, one microbatch
    for (kind, _, _), budget in experts[0]:
        assert budget == pytest.approx(2 * cost.expert_time("A40", 2 * share, kind == "E_B"))
    for (kind, _, _), budget in experts[1]:
        assert budget == pytest.approx(2 * cost.expert_time("V100-16GB", 0.0, kind == "E_B"))
    # The all-to-alls: rank 1 sends its every row to rank 0 and back (rank 0 keeps its own), so each
    # moves SEQ x top-2 tokens one way where balanced routing moves half that each way; both ranks
    # price it alike, forward and backward.
    from megatron_hetermoe.planner.baselines import ep_a2a_time
    from megatron_hetermoe.planner.cluster import Links, collective_time

    moved = SEQ * 2 * cost.token_bytes()
    want = collective_time(Links.for_ranks(em.cluster, [0, 1], cost.profiles), [[0.0, 0.0], [moved, 0.0]])
    for seen in (hot, cold):
        a2a = [(key, b) for key, b in seen if key[0] in TRANSFERS]
        assert sorted(key[0] for key, _ in a2a) == sorted(TRANSFERS * 2)  # 2 layers
        assert all(b == pytest.approx(want, rel=1e-9) for _, b in a2a), a2a
    assert want > ep_a2a_time(cost, em.cluster, [0, 1], SEQ)
