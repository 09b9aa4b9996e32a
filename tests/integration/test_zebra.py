"""Zebra schedule: parity with Megatron EP, the executed order, overlap, recomputation."""
import pytest
from margins import within

from megatron_hetermoe.config import (
    HeteroRunConfig,
    ParallelConfig,
    TrainConfig,
)
from megatron_hetermoe.emulation.timing import EmulatedTiming
from megatron_hetermoe.parallel.launcher import launch
from megatron_hetermoe.plan.hetero_plan import even_plan
from megatron_hetermoe.plan.tasks import tasks_for_rank
from megatron_hetermoe.schedules.timeline import load_events
from megatron_hetermoe.tools.parity import GRAD_NORM_TOL, GRAD_TOL, LOSS_TOL, run_parity
from megatron_hetermoe.training.hetero import train_hetero
from megatron_hetermoe.training.run_hooks import RunHooks

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("R", [1, 2, 4, 8])
@pytest.mark.parametrize("M, N, G", [(1, 1, 1), (2, 2, 1), (1, 3, 1), (3, 1, 1), (2, 2, 2)],
                         ids=["1+1", "2+2", "1+3-uneven", "3+1", "2x(2+2)"])
def test_zebra_matches_megatron_ep(tiny, M, N, G, R):
    # At the reference's parameters of each step; measured worst over this matrix and
    # ATEN_CPU_CAPABILITY default/avx2/avx512 (docs/parity.md): loss 9.0e-8, grads 4.6e-7: >= 11x inside.
    plan = even_plan(tiny.num_layers, tiny.num_experts, M, N, groups=G, num_microbatches=R, schedule="zebra")
    r = run_parity(plan, tiny, steps=5, micro_batch_size=1, free_run=False)
    within("loss", r.max_rel_loss_diff, LOSS_TOL)
    within("grad", r.max_rel_grad_diff, GRAD_TOL)
    within("grad norm", r.max_rel_grad_norm_diff, GRAD_NORM_TOL)


def _train(rank, world, cfg, plan, run_dir=None, recompute=False, timing=None):
    return train_hetero(cfg, plan, HeteroRunConfig(recompute=recompute, timeline_dir=run_dir),
                        RunHooks(task_timing=timing))


def _cfg(tiny, plan, steps=2):
    gbs = plan.num_microbatches * len(plan.attention_ranks)
    return TrainConfig(tiny, ParallelConfig(), micro_batch_size=1, global_batch_size=gbs, train_iters=steps, quiet=True)


def test_every_rank_executes_exactly_the_generated_order(tiny):
    plan = even_plan(tiny.num_layers, tiny.num_experts, 2, 2, num_microbatches=4, schedule="zebra")
    results = launch(_train, 4, _cfg(tiny, plan), plan)
    for rank, res in enumerate(results):
        want = tasks_for_rank(plan, rank)
        for compute, streams in res.executed:
            assert compute == [t for t in want if not t.is_comm]
            for lane in ("dispatch", "combine"):
                assert streams[lane] == [t for t in want if t.stream == lane], (rank, lane)


def test_dispatch_of_next_microbatch_overlaps_expert_compute(tiny, tmp_path):
    # Stretch compute to emulate an expert GPU a little slower than the attention GPU (E = 1.25 A):
    # then expert compute of microbatch j spans the dispatch of j+1 by 10-20 ms, unambiguous on a
    # loaded 2-core machine. (Much slower experts fall behind, which Asym-EA addresses.)
    dur = {"A_F": 0.04, "A_B": 0.04, "E_F": 0.05, "E_B": 0.05}
    timing = EmulatedTiming(lambda t: dur.get(t.kind, 0.0))
    R = 4
    plan = even_plan(tiny.num_layers, tiny.num_experts, 1, 1, num_microbatches=R, schedule="zebra")
    launch(_train, 2, _cfg(tiny, plan, steps=1), plan, str(tmp_path), False, timing)
    ev = load_events(tmp_path)
    disp = {(e.layer, e.microbatch): e for e in ev if e.rank == 0 and e.kind == "D_F"}
    expert = {(e.layer, e.microbatch): e for e in ev if e.rank == 1 and e.kind == "E_F"}
    for j in range(R - 1):
        d, x = disp[(0, j + 1)], expert[(0, j)]
        assert d.start < x.end and x.start < d.end, f"D_F(0,{j + 1}) {d} does not overlap E_F(0,{j}) {x}"


def test_recomputation_gives_identical_losses_and_less_activation_memory(tiny):
    plan = even_plan(tiny.num_layers, tiny.num_experts, 1, 1, num_microbatches=4, schedule="zebra")
    off = launch(_train, 2, _cfg(tiny, plan, steps=3), plan, None, False)[0]
    on = launch(_train, 2, _cfg(tiny, plan, steps=3), plan, None, True)[0]
    assert on.losses == off.losses
    assert on.peak_activation_mib < 0.7 * off.peak_activation_mib, (on.peak_activation_mib, off.peak_activation_mib)


def test_timeline_cli_writes_png_and_chrome_trace(tiny, tmp_path):
    import json
    import subprocess
    import sys

    plan = even_plan(tiny.num_layers, tiny.num_experts, 1, 1, num_microbatches=2, schedule="zebra")
    launch(_train, 2, _cfg(tiny, plan, steps=1), plan, str(tmp_path))
    r = subprocess.run([sys.executable, "-m", "megatron_hetermoe.cli", "timeline", str(tmp_path), "-o",
                        str(tmp_path / "t.png")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"
    trace = json.loads((tmp_path / "t.json").read_text())
    names = {e["name"].split("(")[0] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert {"A_F", "A_B", "E_F", "E_B", "D_F", "C_F", "C_B", "D_B"} <= names
    # CPU ranks time on the host clock only, and the rows say so.
    assert {e["args"]["clock"] for e in trace["traceEvents"] if e["ph"] == "X"} == {"host"}
    assert {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"} == \
        {"compute (host)", "dispatch (host)", "combine (host)"}


def test_emulated_timing_changes_no_numbers(tiny):
    # Stretching tasks and timing transfers (their start agreed on the transfer's group before
    # the payload) must leave every loss bit-identical.
    plan = even_plan(tiny.num_layers, tiny.num_experts, 2, 2, num_microbatches=2, schedule="zebra")
    plain = launch(_train, 4, _cfg(tiny, plan, steps=2), plan)[0]
    timed = EmulatedTiming(lambda t: 0.001 if t.is_comm else 0.002)
    emulated = launch(_train, 4, _cfg(tiny, plan, steps=2), plan, None, False, timed)[0]
    assert emulated.losses == plain.losses
