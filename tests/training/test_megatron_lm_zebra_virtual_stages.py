"""Zebra with Megatron's virtual pipeline stages in Megatron-LM's own pretrain() (core_v0.16.1 checkout,
MEGATRON_LM_DIR): PP 2 x --num-virtual-stages-per-pipeline-rank 2, 8 layers (layer 0 dense: stage 0's
first chunk holds a dense and an MoE layer), Megatron's distributed optimizer. Stage 0 holds chunks
[0, 1] and [4, 5], stage 1 [2, 3] and [6, 7]; each stage is 1 attention + 1 expert rank; zebra runs
Megatron's interleaved 1F1B over waves of one microbatch (plan.tasks.zebra_chunk_tasks), the expert
ranks mirroring it over the experts of both chunks. The plan is made as a user makes it
(`hetermoe plan --even ... -- <the run's flags>`).

One chain of runs from one plain Megatron EP checkpoint at the same PP x V (saved after iteration 1):
- Megatron EP -> HeterMoE: plain Megatron (PP 2 x V 2 x EP 2, 4 ranks) and HeterMoE zebra each load it
  (--no-load-optim --no-load-rng, as for any change of layout) and train iterations 2-4 with the same lm
  and load-balancing losses (bound 3e-6 absolute; measured on default, AVX2 and AVX-512 kernels: lm loss
  bitwise at 2 and 3, 4.8e-7 at 4; load-balancing bitwise, 1.2e-7 on AVX-512);
- save -> resume: the HeterMoE run saves after iterations 3 and 4 (torch_dist: both chunks of each
  attention rank, the expert ranks' module, the distributed optimizer, RNG); resumed from iteration 3,
  its iteration 4 is bitwise the uninterrupted run's."""
from __future__ import annotations

import pytest
from margins import within
from megatron_lm_run import CPU, DATA, MODEL, RECIPE, run_losses, tb_losses

from megatron_hetermoe.plan.hetero_plan import HeteroPlan
from megatron_hetermoe.planner.cli_plan import main as plan_main

pytestmark = pytest.mark.slow
LAST, SAVED = 4, 3
TOL = 3e-6  # issue 42's bound for fp32 parity (6.3x the measured 4.8e-7)
LAYOUT = ["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2"]
CROSS = ["--no-load-optim", "--no-load-rng"]
TAGS = ("lm loss", "load_balancing_loss")


def _flags(data: str) -> list[str]:
    return ["--num-layers", "8", "--moe-layer-freq", "([0]+[1]*7)", *MODEL[2:], "--micro-batch-size", "2",
            "--global-batch-size", "8", "--lr", "1e-3", "--train-iters", str(LAST), *DATA, *RECIPE, *CPU,
            "--data-path", data, "--log-interval", "1", "--eval-interval", "100", "--eval-iters", "0",
            "--moe-aux-loss-coeff", "0.01", "--use-distributed-optimizer", *LAYOUT]


def _values(tb) -> dict[str, dict[int, float]]:
    return {t: tb_losses(tb, t) for t in TAGS}


def test_zebra_virtual_stages_continue_megatron_ep_and_resume_bitwise(mlm, data, tmp_path):
    flags = _flags(data)
    ep = [*flags, "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall"]
    ckpt = tmp_path / "ep"
    run_losses(mlm, tmp_path, 4, [*ep, "--train-iters", "1", "--lr-warmup-iters", "0", "--save", str(ckpt),
                                  "--save-interval", "1"], "tb0")
    _, log = run_losses(mlm, tmp_path, 4, [*ep, "--load", str(ckpt), *CROSS], "plain")
    assert "Number of virtual stages per pipeline stage: 2" in log
    plain = _values(tmp_path / "plain")

    plan = tmp_path / "plan.json"
    assert plan_main(["--even", "--attention-ranks", "1", "--expert-ranks", "1", "--schedule", "zebra",
                      "--zebra-waves", "4", "--zebra-wave-order", "1f1b", "-o", str(plan), "--", *flags]) == 0
    p = HeteroPlan.load(plan)
    assert (p.pipeline_stages, p.virtual_stages, p.num_microbatches, p.dense_layers) == (2, 2, 4, [0])
    assert [[p.chunk_model_layers(s, v) for v in range(2)] for s in range(2)] == [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]
    het = [*flags, "--hetero-plan", str(plan)]
    saved = tmp_path / "hetero"
    _, log = run_losses(mlm, tmp_path, 4, [*het, "--load", str(ckpt), *CROSS, "--save", str(saved), "--save-interval",
                                           str(SAVED)], "into")
    assert "schedule zebra" in log
    into = _values(tmp_path / "into")
    for tag in TAGS:
        assert sorted(into[tag]) == sorted(plain[tag]) == list(range(2, LAST + 1)), (tag, into, plain)
        within(f"zebra PP 2 x V 2 vs Megatron EP: {tag}", max(abs(into[tag][i] - plain[tag][i]) for i in plain[tag]),
               TOL)

    # save -> resume: model chunks, distributed optimizer, RNG, scheduler and data position restored
    run_losses(mlm, tmp_path, 4, [*het, "--load", str(saved), "--ckpt-step", str(SAVED)], "resumed")
    resumed = _values(tmp_path / "resumed")
    assert resumed == {t: {i: v[i] for i in range(SAVED + 1, LAST + 1)} for t, v in into.items()}
