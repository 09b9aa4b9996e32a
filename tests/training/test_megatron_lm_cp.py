"""Context parallelism on the attention members inside Megatron-LM's own pretrain() (core_v0.16.1
checkout, MEGATRON_LM_DIR): `--context-parallel-size 2` with a plan whose attention members are CP
groups of 2 (attention_cp). Megatron-LM's get_batch cuts each sequence to the rank's two chunks, its
loss and schedule average over data x context parallelism, and the attention core is ours
(models/context_attention.py: megatron-core's local attention has no CP). CP changes no parameter,
so the runs continue from one checkpoint as plain Megatron at CP 1 does, and its checkpoint loads
back into plain Megatron (torch_dist, resharded by dist_checkpointing)."""
from __future__ import annotations

import pytest
from megatron_lm_run import checkpoints_both_ways, hetero_run, resumes_bitwise

CP = ["--context-parallel-size", "2"]
TP = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-tensor-parallel-size", "1"]


def _plan(path, schedule: str, tp: int = 1, groups: int = 1):
    from megatron_hetermoe.plan.hetero_plan import even_plan

    # 8 sequences of 2 per step: one CP-2 (x TP) attention member per group holds R = 4 / groups microbatches.
    even_plan(2, 4, 2 * tp, 2, groups=groups, num_microbatches=4 // groups, schedule=schedule, attention_tp=tp,
              attention_cp=2).save(path)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["distep", "zebra"])
def test_pretrain_cp2_from_and_to_a_cp1_checkpoint(mlm, data, tmp_path, schedule):
    """Plain Megatron (EP 2, CP 1) saves; HeterMoE with a CP-2 member + 2 expert ranks loads it and
    continues as plain Megatron does (3e-6), and back."""
    checkpoints_both_ways(mlm, _plan(tmp_path / "plan.json", schedule), data, tmp_path, extra=CP, plain_extra=[])


@pytest.mark.slow
def test_pretrain_cp2_tp2_from_a_tp2_checkpoint(mlm, data, tmp_path):
    """A TP-2 x CP-2 member (4 ranks) + 2 expert ranks against plain Megatron at TP 2, CP 1."""
    checkpoints_both_ways(mlm, _plan(tmp_path / "plan.json", "zebra", tp=2), data, tmp_path,
                          extra=[*TP, *CP, "--make-vocab-size-divisible-by", "64"],
                          plain_extra=[*TP, "--make-vocab-size-divisible-by", "64"], nproc=6)


@pytest.mark.slow
def test_pretrain_cp2_two_groups_resumes_bitwise(mlm, data, tmp_path):
    """2 ZP groups x (a CP-2 member + 2 expert ranks), DistEP, 8 ranks: saved after iteration 2 and
    resumed (optimizer and RNG included), iteration 3's loss is bitwise the uninterrupted run's."""
    plan = _plan(tmp_path / "plan.json", "distep", groups=2)
    log, full = hetero_run(mlm, plan, data, tmp_path / "full", CP, nproc=8)
    assert "4 attention ranks (2 members of context parallel size 2: Megatron's data parallel size 2)" in log
    resumes_bitwise(mlm, plan, data, tmp_path, CP, 8, full)
