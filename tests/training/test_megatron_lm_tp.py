"""Tensor parallelism on the attention members inside Megatron-LM's own pretrain() (core_v0.16.1
checkout, MEGATRON_LM_DIR): `--tensor-model-parallel-size 2 --sequence-parallel` with a plan whose
attention members are TP groups of 2 (attention_tp), against plain Megatron at the same TP (experts
whole: --expert-tensor-parallel-size 1). Plain Megatron initializes by its own rules, so the runs
are compared from one checkpoint (torch_dist, resharded by dist_checkpointing). Checkpoints both ways
at the same TP (zebra) run on core_v0.19.0's line (test_megatron_lm_v019.py)."""
from __future__ import annotations

import pytest
from megatron_lm_run import checkpoints_both_ways, hetero_run, resumes_bitwise, tb_losses

TP = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-tensor-parallel-size", "1"]


def _plan(path, schedule: str, groups: int = 1):
    from megatron_hetermoe.plan.hetero_plan import even_plan

    # 8 sequences of 2 per step: one TP-2 attention member per group holds R = 4 / groups microbatches.
    even_plan(2, 4, 2, 2, groups=groups, num_microbatches=4 // groups, schedule=schedule, attention_tp=2).save(path)
    return path


@pytest.mark.slow
def test_pretrain_tp2_from_tp1_checkpoint(mlm, data, tmp_path):
    """Across tensor-parallel sizes: plain Megatron TP 1 EP 2 saves; HeterMoE with TP-2 attention
    members loads it (dist_checkpointing cuts the shards) and continues as Megatron TP 1 does, and
    back. Megatron pads the vocabulary to a multiple of --make-vocab-size-divisible-by x TP (128 x 1 =
    64 x 2 here): with another padded size the embedding and output layer load with their extra
    rows at their initial values (Megatron's allow_shape_mismatch), and the softmax changes."""
    checkpoints_both_ways(mlm, _plan(tmp_path / "plan.json", "distep"), data, tmp_path,
                          extra=[*TP, "--make-vocab-size-divisible-by", "64"], plain_extra=[])


@pytest.mark.slow
def test_pretrain_tp2_trains_evaluates_resumes(mlm, data, tmp_path):
    """2 ZP groups x (a TP-2 member + 2 expert ranks), zebra, 8 ranks: Megatron's loop trains and
    evaluates; saved after iteration 2 and resumed (torch_dist, optimizer and RNG included), iteration
    3's loss is bitwise the uninterrupted run's."""
    plan = _plan(tmp_path / "plan.json", "zebra", groups=2)
    log, full = hetero_run(mlm, plan, data, tmp_path / "full", TP, nproc=8)
    assert "4 attention ranks (2 members of tensor parallel size 2: Megatron's data parallel size 2)" in log
    assert "validation loss at iteration 2 | lm loss value:" in log
    assert sorted(tb_losses(tmp_path / "full", "lm loss validation")) == [2, 3]
    resumes_bitwise(mlm, plan, data, tmp_path, TP, 8, full)
