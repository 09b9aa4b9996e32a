"""Pipeline stages inside the pools in Megatron-LM's own pretrain() (core_v0.16.1 checkout,
MEGATRON_LM_DIR): `--pipeline-model-parallel-size 2` with a plan of 2 pipeline stages (each with its
own attention and expert ranks; under distep Megatron's 1F1B on the attention ranks, the expert
ranks mirroring it; under zebra each stage's task lists), alone and with
`--tensor-model-parallel-size 2 --sequence-parallel`. Plain Megatron initializes
by its own rules, so runs at other layouts are compared from one checkpoint (torch_dist, resharded by
dist_checkpointing)."""
from __future__ import annotations

import pytest
from megatron_lm_run import checkpoints_both_ways, hetero_run, resumes_bitwise, tb_losses

PP = ["--pipeline-model-parallel-size", "2"]
TP = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-tensor-parallel-size", "1"]


def _plan(path, attention_tp: int = 1, groups: int = 1, schedule: str = "distep", waves: int = 1):
    from megatron_hetermoe.plan.hetero_plan import even_plan

    # 8 sequences of 2 per step; per stage one attention member (TP attention_tp) + 1 expert rank.
    even_plan(2, 4, attention_tp, 1, groups=groups, num_microbatches=4 // groups, pipeline_stages=2,
              attention_tp=attention_tp, schedule=schedule, zebra_waves=waves).save(path)
    return path


@pytest.mark.slow
def test_pretrain_pp2_from_pp1_checkpoint(mlm, data, tmp_path):
    """Across pipeline layouts: plain Megatron PP 1 EP 2 saves; HeterMoE with 2 pipeline stages loads
    it (dist_checkpointing gives each stage its layers) and continues as Megatron does, and back."""
    checkpoints_both_ways(mlm, _plan(tmp_path / "plan.json"), data, tmp_path, extra=PP, plain_extra=[])


@pytest.mark.slow
def test_pretrain_tp2_pp2_trains_evaluates_resumes(mlm, data, tmp_path):
    """TP 2 x PP 2 under zebra: per stage a TP-2 attention member + 1 expert rank (6 ranks): Megatron's
    loop trains and evaluates (forward-only passes: Megatron's pipelined schedule, mirrored);
    saved after iteration 2 and resumed (torch_dist, optimizer and RNG included), iteration 3's loss
    is bitwise the uninterrupted run's."""
    plan = _plan(tmp_path / "plan.json", attention_tp=2, schedule="zebra")
    flags = [*TP, *PP]
    log, full = hetero_run(mlm, plan, data, tmp_path / "full", flags, nproc=6)
    assert ("4 attention ranks (1 member of tensor parallel size 2 in each of 2 pipeline stages: Megatron's data "
            "parallel size 1)") in log
    # Megatron's get_model on each stage's attention ranks: every (TP rank, PP stage) holds its part.
    for tp in (0, 1):
        for pp in (0, 1):
            assert f"number of parameters on (tensor, pipeline) model parallel rank ({tp}, {pp})" in log
    assert "validation loss at iteration 2 | lm loss value:" in log
    assert sorted(tb_losses(tmp_path / "full", "lm loss validation")) == [2, 3]
    resumes_bitwise(mlm, plan, data, tmp_path, flags, 6, full)


@pytest.mark.slow
def test_pretrain_pp2_with_megatrons_own_defaults(mlm, data, tmp_path):
    """Megatron's own model defaults at 2 stages (learned absolute positions on the first stage, GeLU,
    LayerNorm, biased linear layers, embeddings tied between the first and the last stage: their
    gradients summed over the embedding group): from one plain Megatron EP checkpoint HeterMoE (zebra
    in 2 waves of 2 microbatches, 2 stages of 1 + 1) continues with plain Megatron's losses."""
    from megatron_lm_run import CPU, DATA, MEGATRON_DEFAULTS, MODEL, run_losses

    flags = [*MODEL, "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-3", *DATA, *MEGATRON_DEFAULTS,
             *CPU, "--data-path", data, "--log-interval", "1", "--eval-interval", "100", "--eval-iters", "0",
             "--moe-aux-loss-coeff", "0.01"]
    ep = ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall"]
    ckpt = tmp_path / "ckpt"
    run_losses(mlm, tmp_path, 2, [*flags, *ep, "--train-iters", "1", "--save", str(ckpt), "--save-interval", "1"],
               "tb0")
    cross = ["--train-iters", "3", "--load", str(ckpt), "--no-load-optim", "--no-load-rng"]
    plain, _ = run_losses(mlm, tmp_path, 2, [*flags, *ep, *cross], "tb1")
    het, _ = run_losses(mlm, tmp_path, 4, [*flags, *PP, *cross, "--hetero-plan",
                                           str(_plan(tmp_path / "plan.json", schedule="zebra", waves=2))], "tb2")
    assert sorted(plain) == sorted(het) == [2, 3]
    assert [het[i] for i in (2, 3)] == pytest.approx([plain[i] for i in (2, 3)], abs=3e-6), (het, plain)


@pytest.mark.slow
def test_pretrain_virtual_pipeline_stages_continue_with_megatrons_losses_and_resume(mlm, data, tmp_path):
    """Virtual pipeline stages (--num-virtual-stages-per-pipeline-rank 2 at PP 2, 4 layers: stage 0
    holds layers 0 and 2, stage 1 layers 1 and 3): Megatron's interleaved 1F1B on the attention ranks
    (4 microbatches: 4 warm-up forwards on stage 0, 2 on stage 1), each stage's expert rank mirroring
    it chunk by chunk, in training and in the forward-only evaluation (megatron_lm_run.virtual_stages_run;
    measured: iteration 2 and both validations bitwise plain Megatron's, iteration 3 within 4.8e-7;
    resumed bitwise)."""
    from megatron_lm_run import virtual_stages_run

    virtual_stages_run(mlm, data, tmp_path)


@pytest.mark.slow
def test_pretrain_virtual_stages_two_attention_members_asym_ea_an_empty_expert_rank_megatron_defaults(
        mlm, data, tmp_path):
    """Virtual stages at the shapes users hit: PP 2 x 2 virtual stages (stage 0 holds layers 0 and 2,
    stage 1 layers 1 and 3), per stage 2 attention ranks (Megatron's data parallel 2) + 2 expert
    ranks, DistEP; layer 0 has all its experts on one expert rank (the other holds none in that
    layer), layers 1 and 2 each put one expert on an attention rank (Asym-EA, in either chunk of
    either stage); Megatron's own model defaults (learned absolute positions, GeLU, LayerNorm, biased
    linear layers, embeddings tied between the first and the last stage). From one plain Megatron
    EP 2 checkpoint, HeterMoE's training and validation losses are plain Megatron's (measured on
    default, avx2 and avx512 kernels: iteration 2 bitwise, the rest bitwise or 4.8e-7 apart)."""
    from megatron_lm_run import CPU, DATA, EVAL, MEGATRON_DEFAULTS, MODEL, continues_as_plain, run_losses

    from megatron_hetermoe.plan.hetero_plan import HeteroPlan, ZPGroup

    flags = ["--num-layers", "4", *MODEL[2:], "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-3",
             *DATA, *MEGATRON_DEFAULTS, *CPU, "--data-path", data, "--log-interval", "1",
             "--moe-aux-loss-coeff", "0.01"]
    ep = ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall"]
    ckpt = tmp_path / "ckpt"
    run_losses(mlm, tmp_path, 2, [*flags, *ep, "--train-iters", "1", "--save", str(ckpt), "--save-interval", "1",
                                  "--eval-interval", "100", "--eval-iters", "0"], "tb0")
    cross = ["--train-iters", "3", "--load", str(ckpt), "--no-load-optim", "--no-load-rng", *EVAL]
    # Stage 0: attention 0, 1, experts 2, 3; stage 1: attention 4, 5, experts 6, 7.
    placement = [{2: [0, 1, 2, 3]}, {5: [0], 6: [1, 2], 7: [3]}, {1: [3], 2: [0], 3: [1, 2]}, {6: [0, 1], 7: [2, 3]}]
    plan = tmp_path / "plan.json"
    HeteroPlan(4, 4, ["cpu"] * 8, [ZPGroup([0, 1, 4, 5], [2, 3, 6, 7], placement)], num_microbatches=2,
               pipeline_stages=2, virtual_stages=2, schedule="distep").save(plan)
    continues_as_plain(mlm, tmp_path, 2, [*flags, *ep, *cross], 8,
                       [*flags, *PP, "--num-virtual-stages-per-pipeline-rank", "2", *cross, "--hetero-plan", str(plan)])


@pytest.fixture(scope="module")
def four_layer_reference(mlm, data, tmp_path_factory):
    """Plain Megatron EP 2 with 4 layers saves after iteration 1 and continues through iteration 4."""
    from megatron_lm_run import CPU, DATA, MODEL, RECIPE, run_losses

    work = tmp_path_factory.mktemp("four_layers")
    flags = ["--num-layers", "4", *MODEL[2:], "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-3",
             *DATA, *RECIPE, *CPU, "--data-path", data, "--log-interval", "1", "--moe-aux-loss-coeff", "0.01",
             "--eval-interval", "100", "--eval-iters", "0"]
    ep = ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall"]
    ckpt = work / "ckpt"
    run_losses(mlm, work, 2, [*flags, *ep, "--train-iters", "1", "--save", str(ckpt), "--save-interval", "1"], "tb0")
    cross = ["--train-iters", "4", "--load", str(ckpt), "--no-load-optim", "--no-load-rng"]
    plain, _ = run_losses(mlm, work, 2, [*flags, *ep, *cross], "plain")
    return flags, cross, plain


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["zebra", "distep"])
def test_pretrain_uneven_stages_continue_with_megatrons_losses(mlm, four_layer_reference, tmp_path, schedule):
    """--decoder-first-pipeline-num-layers 1 at PP 2 (stage 0 one layer, stage 1 three; what DeepSeek-V3's
    61 layers need), the plan made as a user makes it (hetermoe plan --even ... -- <the run's flags>):
    from plain Megatron EP's checkpoint both schedules continue with its losses."""
    from megatron_lm_run import run_losses

    from megatron_hetermoe.planner.cli_plan import main as plan_main

    flags, cross, plain = four_layer_reference
    run = [*flags, "--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "1"]
    plan = tmp_path / "plan.json"
    assert plan_main(["--even", "--attention-ranks", "1", "--expert-ranks", "1", "--schedule", schedule,
                      "-o", str(plan), "--", *run]) == 0
    het, log = run_losses(mlm, tmp_path, 4, [*run, *cross, "--hetero-plan", str(plan)], "het")
    assert sorted(het) == sorted(plain) == [2, 3, 4]
    assert [het[i] for i in (2, 3, 4)] == pytest.approx([plain[i] for i in (2, 3, 4)], abs=3e-6), (het, plain)
