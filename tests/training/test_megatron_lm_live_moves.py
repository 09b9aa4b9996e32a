"""Live expert moves inside Megatron-LM's own pretrain() (core_v0.16.1, MEGATRON_LM_DIR; issue 46
item 4, the second hosting): --hetero-replan-interval moves experts between steps without a
restart, the losses stay bitwise those of the same run without moves, and a checkpoint saved after
a move records the plan it was saved on and resumes on the starting plan. The load rule decides
on its own in the first test (DistEP, each layer's experts all on one expert rank, priced by the
expert ranks' measured seconds); the others force the plugin trainer's test moves
(tests/integration/test_live_moves.py) through tests/forced_moves/sitecustomize.py: from the
sparse Asym-EA plan to the even plan at iteration 2 (attention rank 1 loses its experts and its
expert sub-optimizer) and on to a plan where each expert rank holds nothing in one layer at 4,
also under Megatron's model defaults with fp16's dynamic loss scale; others force moves with
pipeline stages and with attention tensor parallelism; and on a real recipe (Megatron's MoE CI
config, TP 2), planned from its flags and saved after a move.
core_v0.19.0: test_megatron_lm_v019.py runs the same helpers (megatron_lm_run.py)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
from megatron_lm_run import (
    BATCH,
    CPU,
    DATA,
    MEGATRON_DEFAULTS,
    MODEL,
    PRECISIONS,
    RECIPE,
    NO_EVAL,
    forced_moves_change_no_loss,
    hetero_run,
    lopsided_plan,
    moved_experts,
    moves_live_and_resumes,
    tb_losses,
    torchrun,
)

PP = ["--pipeline-model-parallel-size", "2"]
TP = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-tensor-parallel-size", "1"]


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
def test_pretrain_forced_moves_keep_fp16s_dynamic_scale_with_megatrons_defaults(mlm, data, tmp_path, monkeypatch):
    """The sparse Asym-EA moves under Megatron's own model defaults (learned-absolute positions,
    GeLU, LayerNorm, tied embeddings, biased linears) and fp16's dynamic loss scale, which doubles
    after every 3 iterations without overflow: the moves come after iterations 2 and 4, mid-window,
    so a scaler restarted by the move would double at another iteration. Losses and the logged
    loss scale are bitwise the unmoved run's."""
    fp16 = ["--fp16", "--initial-loss-scale", "4096", "--loss-scale-window", "3"]
    forced_moves_change_no_loss(mlm, data, tmp_path, monkeypatch, "zebra", fp16, recipe=MEGATRON_DEFAULTS,
                                same=("loss-scale",))


@pytest.mark.slow
def test_pretrain_forced_moves_with_pipeline_stages(mlm, data, tmp_path, monkeypatch):
    """DistEP on 2 pipeline stages of 1 attention + 2 expert ranks (stage 0: ranks 0 | 1, 2; stage 1:
    3 | 4, 5): each stage's experts move between its own expert ranks, at 4 so that rank 1 holds
    nothing in layer 0 and rank 5 nothing in layer 1; losses and gradient norms bitwise the
    unmoved run's, clipped by the norm (under ATEN_CPU_CAPABILITY=default Megatron's per-rank
    partial sums moved the norm at iteration 4 and, clipped by it, the loss of iteration 6 by 5e-7;
    world_stats.world_grad_norm sums the squares exactly)."""
    from megatron_hetermoe.plan.hetero_plan import even_plan

    plan = even_plan(2, 4, 1, 2, groups=1, num_microbatches=4, pipeline_stages=2, schedule="distep")
    assert plan.groups[0].placement == [{1: [0, 1], 2: [2, 3]}, {4: [0, 1], 5: [2, 3]}]
    forced = {2: [{1: [0, 1, 2], 2: [3]}, {4: [0], 5: [1, 2, 3]}], 4: [{2: [0, 1, 2, 3]}, {4: [0, 1, 2, 3]}]}
    forced_moves_change_no_loss(mlm, data, tmp_path, monkeypatch, "distep", PP, plan=plan, forced=forced, nproc=6)


@pytest.mark.slow
def test_pretrain_forced_moves_with_attention_tensor_parallelism(mlm, data, tmp_path, monkeypatch):
    """Zebra with the attention pool one TP 2 pair (ranks 0, 1; sequence parallel) and expert ranks
    2, 3: moves at 2 and 4, each expert rank holding nothing in one layer after 4; losses and
    gradient norms bitwise the unmoved run's: a rebuild without Megatron's tensor-parallel
    attributes left TP rank 1's shards out of the norm, 10 % lower (training/expert_move.rebuild_config)."""
    from shared_plans import attention_tp_pair_moves

    plan, forced = attention_tp_pair_moves()
    forced_moves_change_no_loss(mlm, data, tmp_path, monkeypatch, "zebra", TP, plan=plan, forced=forced)


@pytest.mark.slow
def test_pretrain_refuses_live_moves_with_flags_that_keep_old_objects(mlm, data, tmp_path):
    plan = tmp_path / "plan.json"
    lopsided_plan("distep").save(plan)
    r = torchrun(mlm, 4, [*MODEL, *BATCH, *DATA, *RECIPE, *CPU, "--data-path", data, "--hetero-plan", str(plan),
                          "--hetero-replan-interval", "2", "--overlap-grad-reduce", "--use-distributed-optimizer"])
    log = r.stdout + r.stderr
    assert r.returncode != 0
    assert "--overlap-grad-reduce with --hetero-replan-interval" in log, log[-3000:]


@pytest.mark.slow
def test_pretrain_forced_moves_on_a_recipe_planned_from_its_flags_and_saved(mlm, data, tmp_path, monkeypatch):
    """Megatron's MoE CI config (test_megatron_lm_recipes.py's CI_CONFIG: TP 2 with sequence
    parallelism, 8 experts top-2, Megatron's model defaults, --deterministic-mode), shrunk, planned
    with `hetermoe plan --even -- <its flags>` (one TP pair + 2 expert ranks at the recipe's TP), with
    moves forced at 2 (3 experts) and 4 (each layer's experts all on one expert rank) and --save at 4:
    6 iterations' losses and gradient norms bitwise the unmoved run's; the checkpoint of iteration 4,
    saved after the second move, records the moved plan and resumes on the starting plan with
    iterations 5 and 6 as before. Left out of the recipe: --async-save, refused by name with
    --hetero-replan-interval (its writer holds the old objects)."""
    import json

    from megatron.core.dist_checkpointing import load_common_state_dict
    from test_megatron_lm_recipes import CI_CONFIG, EVAL_OFF, RECIPE_ENV, recipe_flags, shrunk

    from megatron_hetermoe.plan.hetero_plan import HeteroPlan
    from megatron_hetermoe.planner.cli_plan import main as plan_main

    for k, v in RECIPE_ENV["moe-ci-tp2-ep2-top2"].items():
        monkeypatch.setenv(k, v)
    recipe = [f for f in shrunk(recipe_flags(mlm, "CI_CONFIG")) if f != "--async-save"]
    assert "--async-save" in CI_CONFIG and recipe[recipe.index("--tensor-model-parallel-size") + 1] == "2"
    path = tmp_path / "plan.json"
    assert plan_main(["--even", "--attention-ranks", "2", "--expert-ranks", "2", "--microbatches", "4", "-o",
                      str(path), "--", *recipe, *EVAL_OFF]) == 0
    plan = HeteroPlan.load(path)
    assert plan.attention_tp == 2 and plan.groups[0].placement == [{2: [0, 1, 2, 3], 3: [4, 5, 6, 7]}] * 2
    forced = {2: [{2: [0, 1, 2, 3, 4], 3: [5, 6, 7]}, {2: [0, 1, 2], 3: [3, 4, 5, 6, 7]}],
              4: [{3: list(range(8))}, {2: list(range(8))}]}
    six = ["--train-iters", "6"]
    _, still = hetero_run(mlm, path, data, tmp_path / "still", six, evaluation=NO_EVAL, recipe=recipe)
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parents[1] / "forced_moves"))
    monkeypatch.setenv("HETERMOE_TEST_FORCED_MOVES", json.dumps(forced))
    ckpt = tmp_path / "ckpt"
    log, moved = hetero_run(mlm, path, data, tmp_path / "moved",
                            [*six, "--hetero-replan-interval", "1", "--save", str(ckpt), "--save-interval", "4"],
                            evaluation=NO_EVAL, recipe=recipe)
    assert re.findall(r" live move at iteration (\d+): (\d+) expert", log) == moved_experts(plan, forced), log[-3000:]
    assert sorted(moved) == [1, 2, 3, 4, 5, 6] and len(set(moved.values())) == 6
    assert moved == still  # bitwise
    norms = tb_losses(tmp_path / "still", "grad-norm")
    assert sorted(norms) == [1, 2, 3, 4, 5, 6] and tb_losses(tmp_path / "moved", "grad-norm") == norms
    saved = HeteroPlan.from_dict(json.loads(load_common_state_dict(str(ckpt / "iter_0000004"))["args"]
                                            .hetero_plan_json))
    assert [{int(r): es for r, es in pl.items() if es} for pl in saved.groups[0].placement] == forced[4]
    monkeypatch.delenv("HETERMOE_TEST_FORCED_MOVES")
    (ckpt / "latest_checkpointed_iteration.txt").write_text("4")  # not the final save's 6
    log, resumed = hetero_run(mlm, path, data, tmp_path / "resumed", [*six, "--load", str(ckpt)],
                              evaluation=NO_EVAL, recipe=recipe)
    assert sorted(resumed) == [5, 6], log[-3000:]
    assert resumed == {i: still[i] for i in (5, 6)}
