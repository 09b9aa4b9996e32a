"""The core test: HeterMoE in DistEP mode trains exactly like plain Megatron EP."""
import pytest
from margins import within

from megatron_hetermoe.parallel.launcher import LaunchError, launch
from megatron_hetermoe.plan.hetero_plan import HeteroPlan, even_plan
from megatron_hetermoe.plan.layout import hetero_to_megatron, megatron_to_hetero
from megatron_hetermoe.tools.parity import (
    FREE_RUN_LOSS_TOL,
    FREE_RUN_PARAM_TOL,
    GRAD_NORM_TOL,
    GRAD_TOL,
    LOSS_TOL,
    run_parity,
)


@pytest.mark.slow
@pytest.mark.parametrize("R", [1, 2, 4, 8])
@pytest.mark.parametrize("M, N, G", [(1, 1, 1), (2, 2, 1), (1, 3, 1), (3, 1, 1), (2, 2, 2)],
                         ids=["1+1", "2+2", "1+3-uneven", "3+1", "2x(2+2)"])
def test_distep_matches_megatron_ep(tiny, M, N, G, R):
    # Each step's loss and gradients at the reference's parameters of that step. Measured worst
    # over these cases and ATEN_CPU_CAPABILITY default/avx2/avx512 (docs/parity.md): loss
    # 1.7e-7, grads 6e-7, free-run weights 2e-4 and losses 3e-7: >= 5x inside every bound.
    plan = even_plan(tiny.num_layers, tiny.num_experts, M, N, groups=G, num_microbatches=R)
    r = run_parity(plan, tiny, steps=5, free_run=R == 2)  # the free run once per plan
    assert len(r.ref_losses) == 5 and len(r.grad_diff_by_step) == 5
    within("loss", r.max_rel_loss_diff, LOSS_TOL)
    within("grad", r.max_rel_grad_diff, GRAD_TOL)
    within("grad norm", r.max_rel_grad_norm_diff, GRAD_NORM_TOL)
    if R == 2:
        within("free-run params", r.max_rel_param_diff_free_run, FREE_RUN_PARAM_TOL)
        within("free-run loss", r.max_rel_loss_diff_free_run, FREE_RUN_LOSS_TOL)
    assert set(r.grad_diff_by_category) == {"experts", "router", "attention", "embedding/output"}


def test_layout_roundtrip(tiny):
    import torch

    plan = even_plan(2, 8, 1, 3)  # 3/3/2 experts
    state = {"embedding.word_embeddings.weight": torch.randn(4, 2)}
    for layer in range(2):
        state[f"decoder.layers.{layer}.mlp.router.weight"] = torch.randn(8, 2)
        for e in range(8):
            state[f"decoder.layers.{layer}.mlp.experts.local_experts.{e}.linear_fc1.weight"] = torch.full(
                (2,), float(e))
    per_rank = [megatron_to_hetero(state, plan, r) for r in range(4)]
    assert "decoder.layers.1.mlp.router.weight" in per_rank[0]
    assert not any(".experts." in k for k in per_rank[0])
    # rank 3 holds experts 6 and 7 as its local experts 0 and 1
    assert per_rank[3]["decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight"][0] == 7.0
    assert len(per_rank[3]) == 2 * 2
    back = hetero_to_megatron(per_rank, plan)
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)


def _init(rank, world, plan):
    from megatron_hetermoe.parallel.state import initialize_hetero_parallel

    initialize_hetero_parallel(plan)


@pytest.mark.parametrize("mutate, message", [
    (lambda d: None, "plan is for 3 ranks .* world size 2"),
    (lambda d: d["gpu_types"].__setitem__(0, "Z100"), "rank 0 has unknown GPU type 'Z100'"),
])
def test_bad_plan_fails_before_any_collective(mutate, message):
    d = even_plan(2, 4, 1, 2).to_dict()
    mutate(d)
    plan = HeteroPlan.from_dict(d)
    world = 2 if "world size" in message else 3
    with pytest.raises(LaunchError, match=message):
        launch(_init, world, plan, timeout_s=30)


@pytest.mark.slow
def test_parity_cli(tmp_path):
    import json
    import subprocess
    import sys

    plan = tmp_path / "plan.json"
    even_plan(2, 4, 2, 2, num_microbatches=2).save(plan)
    r = subprocess.run([sys.executable, "-W", "ignore", "-m", "megatron_hetermoe.cli", "parity", "--plan", str(plan),
                        "--model", "tiny", "--steps", "5", "--json"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["ok"] and out["max_rel_loss_diff"] <= LOSS_TOL and out["max_rel_grad_diff"] <= GRAD_TOL, out
    assert len(out["grad_diff_by_step"]) == 5 and out["max_rel_param_diff_free_run"] <= FREE_RUN_PARAM_TOL, out
    text = subprocess.run([sys.executable, "-W", "ignore", "-m", "megatron_hetermoe.cli", "parity", "--plan", str(plan),
                           "--steps", "5"], capture_output=True, text=True, timeout=300)
    last = text.stdout.strip().splitlines()[-1]
    assert last.startswith("PASS max_rel_loss_diff=") and "max_rel_grad_diff=" in last
    # An impossible tolerance must fail the command.
    strict = subprocess.run([sys.executable, "-W", "ignore", "-m", "megatron_hetermoe.cli", "parity",
                             "--plan", str(plan), "--steps", "3", "--grad-tol", "0"],
                            capture_output=True, text=True, timeout=300)
    assert strict.returncode == 1 and "FAIL" in strict.stdout


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["distep", "zebra"])
def test_attention_ranks_need_not_come_first(tiny, schedule):
    # Ranks 0-1 hold experts, 2-3 run attention (as when the newer GPUs have the higher ranks):
    # all-to-all splits follow the group's rank order, not the plan's member order.
    from megatron_hetermoe.plan.hetero_plan import ZPGroup

    placement = [{0: [0, 1], 1: [2, 3]} for _ in range(tiny.num_layers)]
    plan = HeteroPlan(tiny.num_layers, tiny.num_experts, ["cpu"] * 4, [ZPGroup([2, 3], [0, 1], placement)],
                      num_microbatches=2, schedule=schedule)
    r = run_parity(plan, tiny, steps=3, free_run=False)
    within("loss", r.max_rel_loss_diff, LOSS_TOL)
    within("grad", r.max_rel_grad_diff, GRAD_TOL)
    within("grad norm", r.max_rel_grad_norm_diff, GRAD_NORM_TOL)
