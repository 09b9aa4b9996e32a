"""Live expert moves inside Megatron-LM's own pretrain() (core_v0.16.1, MEGATRON_LM_DIR; issue 46
item 4, the second hosting): --hetero-replan-interval moves experts between steps without a
restart, the losses stay bitwise those of the same run without moves, and a checkpoint saved after
a move records the plan it was saved on and resumes on the starting plan. The load rule decides
on its own in the first test (DistEP, each layer's experts all on one expert rank, priced by the
expert ranks' measured seconds); the others force the plugin trainer's test moves
(tests/integration/test_live_moves.py) through tests/forced_moves/sitecustomize.py: from the
sparse Asym-EA plan to the even plan at iteration 2 (attention rank 1 loses its experts and its
expert sub-optimizer) and on to a plan where each expert rank holds nothing in one layer at 4."""
from __future__ import annotations

import json
import re

import pytest
from megatron_lm_run import NO_EVAL, PRECISIONS, ROOT, hetero_run


def _lopsided(schedule: str):
    """2 attention + 2 expert ranks, one ZP group; each MoE layer's 4 experts all on one expert rank
    (rank 2 holds layer 0's, rank 3 layer 1's): under DistEP each layer waits for one rank doing
    all of its experts, and a placement of 2 + 2 per layer halves the predicted expert time for
    any routing. Each expert rank holds nothing in one layer."""
    from megatron_hetermoe.plan.hetero_plan import HeteroPlan, even_plan

    d = even_plan(2, 4, 2, 2, groups=1, num_microbatches=2, schedule=schedule).to_dict()
    d["groups"][0]["placement"] = [{"2": [0, 1, 2, 3]}, {"3": [0, 1, 2, 3]}]
    return HeteroPlan.from_dict(d)


@pytest.mark.slow
def test_pretrain_moves_experts_live_bitwise_and_resumes_from_the_moved_checkpoint(mlm, data, tmp_path):
    from megatron.core.dist_checkpointing import load_common_state_dict

    from megatron_hetermoe.plan.hetero_plan import HeteroPlan

    plan = tmp_path / "plan.json"
    start = _lopsided("distep")
    start.save(plan)
    four = ["--train-iters", "4"]
    _, still = hetero_run(mlm, plan, data, tmp_path / "still", four, evaluation=NO_EVAL)
    ckpt = tmp_path / "ckpt"
    log, moved = hetero_run(mlm, plan, data, tmp_path / "moved",
                            [*four, "--hetero-replan-interval", "2", "--hetero-replan-margin", "0",
                             "--save", str(ckpt), "--save-interval", "2"], evaluation=NO_EVAL)
    lines = re.findall(r" live move at iteration (\d+): (\d+) expert\(s\)", log)
    assert lines and lines[0][0] == "2" and int(lines[0][1]) >= 2, log[-3000:]
    assert sorted(moved) == [1, 2, 3, 4]
    assert moved == still  # bitwise: a move changes no arithmetic
    # The checkpoint of iteration 2 was saved after the move: it records the moved plan.
    common = load_common_state_dict(str(ckpt / "iter_0000002"))
    saved = HeteroPlan.from_dict(json.loads(common["args"].hetero_plan_json))
    assert saved.groups[0].placement != start.groups[0].placement
    assert any(2 in pl and 3 in pl for pl in [{int(r) for r, es in p.items() if es}
                                              for p in saved.groups[0].placement])
    # Resumed on the starting plan from iteration 2's (loaded resharded by parameter name, no RNG).
    (ckpt / "latest_checkpointed_iteration.txt").write_text("2")
    log, resumed = hetero_run(mlm, plan, data, tmp_path / "resumed", [*four, "--load", str(ckpt)],
                              evaluation=NO_EVAL)
    assert sorted(resumed) == [3, 4], log[-3000:]
    assert [resumed[3], resumed[4]] == [still[3], still[4]]


@pytest.mark.slow
def test_pretrain_refuses_live_moves_with_flags_that_keep_old_objects(mlm, data, tmp_path):
    from megatron_lm_run import BATCH, CPU, DATA, MODEL, RECIPE, torchrun

    plan = tmp_path / "plan.json"
    _lopsided("distep").save(plan)
    r = torchrun(mlm, 4, [*MODEL, *BATCH, *DATA, *RECIPE, *CPU, "--data-path", data, "--hetero-plan", str(plan),
                          "--hetero-replan-interval", "2", "--overlap-grad-reduce", "--use-distributed-optimizer"])
    log = r.stdout + r.stderr
    assert r.returncode != 0
    assert "--overlap-grad-reduce with --hetero-replan-interval" in log, log[-3000:]


FORCED = {2: [{2: [0, 1], 3: [2, 3]}, {2: [0, 1], 3: [2, 3]}],
          4: [{1: [1], 3: [0, 2, 3]}, {1: [2], 2: [0, 1, 3]}]}
CASES = {"zebra fp32": ("zebra", []),
         "distep bf16 distributed optimizer": ("distep", [*PRECISIONS["bf16"], "--use-distributed-optimizer"])}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_pretrain_forced_moves_change_no_loss(mlm, data, tmp_path, monkeypatch, case):
    from shared_plans import sparse_asym_ea_plan

    schedule, flags = CASES[case]
    plan = tmp_path / "plan.json"
    sparse_asym_ea_plan(schedule).save(plan)
    six = ["--train-iters", "6", *flags]
    _, still = hetero_run(mlm, plan, data, tmp_path / "still", six, evaluation=NO_EVAL)
    monkeypatch.setenv("PYTHONPATH", str(ROOT / "tests" / "forced_moves"))
    monkeypatch.setenv("HETERMOE_TEST_FORCED_MOVES", json.dumps(FORCED))
    log, moved = hetero_run(mlm, plan, data, tmp_path / "moved", [*six, "--hetero-replan-interval", "1"],
                            evaluation=NO_EVAL)
    assert re.findall(r" live move at iteration (\d+): (\d+) expert", log) == [("2", "4"), ("4", "4")], log[-3000:]
    assert sorted(moved) == [1, 2, 3, 4, 5, 6]
    assert moved == still  # bitwise
