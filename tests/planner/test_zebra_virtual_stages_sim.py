"""The event simulator prices zebra with virtual pipeline stages: each model chunk's A tasks are its
virtual stage's attention pieces (pipeline.layout_of_plan's chunk_pieces), the last stage's chunks
send on to the first stage's next chunk over that pair's link.

Hand check: with one microbatch nothing overlaps, so the step is the one-stage chain plus the
P x V - 1 activation transfers and as many gradient transfers (every rank on its own node: every
link alike)."""
import pytest
from pp_small import GPUS, SMALL, S, cost

from megatron_hetermoe.plan.hetero_plan import even_plan
from megatron_hetermoe.plan.tasks import PipeTask
from megatron_hetermoe.planner.cluster import Cluster
from megatron_hetermoe.planner.profiles import load_profiles
from megatron_hetermoe.planner.simulator import have_cpp, simulate_plan


def _plan(P: int, R: int, V: int = 1, W: int = 1, order: str = "gpipe"):
    plan = even_plan(SMALL.num_layers, SMALL.num_experts, 1, 1, attention_gpu=GPUS[0], expert_gpu=GPUS[1],
                     num_microbatches=R, pipeline_stages=P, schedule="zebra", virtual_stages=V, zebra_waves=W,
                     zebra_wave_order=order)
    return plan, Cluster.from_gpu_types(f"own-nodes-{P}", plan.gpu_types, gpus_per_node=1)


@pytest.mark.parametrize("P,V", [(2, 2), (2, 4), (4, 2)])
def test_one_microbatch_is_the_chain_plus_every_virtual_stage_transfer(P, V):
    c = cost()
    one, cl1 = _plan(1, 1)
    chain = simulate_plan(one, c, cl1, 1, engine="python").makespan_s
    plan, cl = _plan(P, 1, V)
    got = simulate_plan(plan, c, cl, 1, engine="python", keep_trace=True)
    prof = load_profiles(set(GPUS))
    lat = cl.network_latency_us * 1e-6 + max(prof[g].link_latency_us for g in GPUS) * 1e-6
    assert got.makespan_s == pytest.approx(chain + 2 * (P * V - 1) * (lat + S * 1024 * 2 / 12.5e9), rel=1e-12)
    sent = {t for ts in got.problem.tasks for t in ts if isinstance(t, PipeTask)}
    assert sent == {PipeTask(k, u + (k == "P_B"), 0) for k in ("P_F", "P_B") for u in range(P * V - 1)}


@pytest.mark.skipif(not have_cpp(), reason="the C++ simulator is not built")
@pytest.mark.parametrize("R,W,order", [(4, 1, "gpipe"), (4, 4, "1f1b"), (8, 4, "1f1b")])
def test_cpp_core_prices_virtual_stages_as_the_reference(R, W, order):
    plan, cl = _plan(2, R, 2, W, order)
    a = simulate_plan(plan, cost(), cl, R, engine="python")
    b = simulate_plan(plan, cost(), cl, R, engine="cpp")
    assert a.step_time_s == pytest.approx(b.step_time_s, rel=1e-12) and a.step_time_s > 0
