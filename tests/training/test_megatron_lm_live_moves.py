"""Live expert moves inside Megatron-LM's own pretrain() (core_v0.16.1, MEGATRON_LM_DIR; issue 46
item 4, the second hosting): --hetero-replan-interval moves experts between steps without a
restart, the losses stay bitwise those of the same run without moves, and a checkpoint saved after
a move records the plan it was saved on and resumes on the starting plan. The load rule decides
on its own in the first test (DistEP, each layer's experts all on one expert rank, priced by the
expert ranks' measured seconds); the others force the plugin trainer's test moves
(tests/integration/test_live_moves.py) through tests/forced_moves/sitecustomize.py: from the
sparse Asym-EA plan to the even plan at iteration 2 (attention rank 1 loses its experts and its
expert sub-optimizer) and on to a plan where each expert rank holds nothing in one layer at 4.
core_v0.19.0: test_megatron_lm_v019.py runs the same helpers (megatron_lm_run.py)."""
from __future__ import annotations

import pytest
from megatron_lm_run import (
    BATCH,
    CPU,
    DATA,
    MODEL,
    NO_EVAL,
    PRECISIONS,
    RECIPE,
    forced_moves_change_no_loss,
    hetero_run,
    lopsided_plan,
    moves_live_and_resumes,
    torchrun,
)


@pytest.mark.slow
def test_pretrain_moves_experts_live_bitwise_and_resumes_from_the_moved_checkpoint(mlm, data, tmp_path):
    moves_live_and_resumes(mlm, data, tmp_path)


@pytest.mark.slow
def test_pretrain_on_gpus_with_profiles_the_simulator_decides(mlm, data, tmp_path):
    """The lopsided DistEP plan labelled 2 A40 + 2 V100 (CPU ranks all the same): the decision is
    the simulator's for the model pretrain()'s flags give (live_moves.PretrainMoves._pricing), and
    the losses are the unmoved run's."""
    from megatron_hetermoe.plan.hetero_plan import HeteroPlan

    d = lopsided_plan("distep").to_dict()
    d["gpu_types"] = ["A40", "A40", "V100-16GB", "V100-16GB"]
    plan = tmp_path / "plan.json"
    HeteroPlan.from_dict(d).save(plan)
    four = ["--train-iters", "4"]
    _, still = hetero_run(mlm, plan, data, tmp_path / "still", four, evaluation=NO_EVAL)
    log, moved = hetero_run(mlm, plan, data, tmp_path / "moved",
                            [*four, "--hetero-replan-interval", "2", "--hetero-replan-margin", "0"], evaluation=NO_EVAL)
    assert " live move at iteration 2: 4 expert(s) of group 0 (simulated step " in log, log[-3000:]
    assert moved == still


CASES = {"zebra fp32": ("zebra", []),
         "distep bf16 distributed optimizer": ("distep", [*PRECISIONS["bf16"], "--use-distributed-optimizer"])}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_pretrain_forced_moves_change_no_loss(mlm, data, tmp_path, monkeypatch, case):
    schedule, flags = CASES[case]
    forced_moves_change_no_loss(mlm, data, tmp_path, monkeypatch, schedule, flags)


@pytest.mark.slow
def test_pretrain_refuses_live_moves_with_flags_that_keep_old_objects(mlm, data, tmp_path):
    plan = tmp_path / "plan.json"
    lopsided_plan("distep").save(plan)
    r = torchrun(mlm, 4, [*MODEL, *BATCH, *DATA, *RECIPE, *CPU, "--data-path", data, "--hetero-plan", str(plan),
                          "--hetero-replan-interval", "2", "--overlap-grad-reduce", "--use-distributed-optimizer"])
    log = r.stdout + r.stderr
    assert r.returncode != 0
    assert "--overlap-grad-reduce with --hetero-replan-interval" in log, log[-3000:]
