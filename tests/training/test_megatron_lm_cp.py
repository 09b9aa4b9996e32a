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
@pytest.mark.parametrize("schedule,comm", [("distep", None), ("zebra", None), ("distep", "all_gather"),
                                           ("zebra", "a2a")])
def test_pretrain_cp2_from_and_to_a_cp1_checkpoint(mlm, data, tmp_path, schedule, comm):
    """Plain Megatron (EP 2, CP 1) saves; HeterMoE with a CP-2 member + 2 expert ranks loads it and
    continues as plain Megatron does (3e-6), and back; under Megatron's default --cp-comm-type (p2p:
    the ring) and the two other kinds the local core does."""
    extra = [*CP, "--cp-comm-type", comm] if comm else CP
    checkpoints_both_ways(mlm, _plan(tmp_path / "plan.json", schedule), data, tmp_path, extra=extra, plain_extra=[])


@pytest.mark.slow
def test_pretrain_cp2_asym_ea_from_and_to_a_cp1_checkpoint(mlm, data, tmp_path):
    """Asym-EA under CP in pretrain(): CP rank 0 of the member holds expert 0 of each layer, zebra;
    plain Megatron's checkpoint loads into it and it continues with plain Megatron's losses, and back."""
    from megatron_hetermoe.plan.hetero_plan import HeteroPlan, ZPGroup

    plan = tmp_path / "plan.json"
    HeteroPlan(2, 4, ["cpu"] * 4, [ZPGroup([0, 1], [2, 3], [{0: [0], 2: [1], 3: [2, 3]} for _ in range(2)])],
               num_microbatches=4, schedule="zebra", attention_cp=2).save(plan)
    checkpoints_both_ways(mlm, plan, data, tmp_path, extra=CP, plain_extra=[])


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


@pytest.mark.slow
def test_pretrain_cp2_on_megatrons_moe_ci_recipe(mlm, data, tmp_path, monkeypatch):
    """Megatron's MoE CI config (test_megatron_lm_recipes.py's CI_CONFIG: Megatron's model defaults,
    learned-absolute positions, GeLU, LayerNorm; TP 2 + SP, 8 experts top-2, --deterministic-mode),
    shrunk, with --context-parallel-size 2 added and planned as a user does (`hetermoe plan --even
    --attention-cp 2 -- <its flags>`: a TP-2 x CP-2 member + 1 expert rank), continues plain Megatron
    EP's checkpoint (its TP 2, CP 1) with its losses (measured bitwise on native, default and avx2 kernels)."""
    from margins import within
    from test_megatron_lm_recipes import EVAL_OFF, RECIPE_ENV, _resume, recipe_flags, shrunk

    from megatron_hetermoe.plan.hetero_plan import HeteroPlan
    from megatron_hetermoe.planner.cli_plan import main as plan_main
    from megatron_lm_run import CPU, DATA, run_losses

    for k, v in RECIPE_ENV["moe-ci-tp2-ep2-top2"].items():
        monkeypatch.setenv(k, v)
    flags = [*shrunk(recipe_flags(mlm, "CI_CONFIG")), *DATA, *CPU, *EVAL_OFF, "--data-path", data]
    assert "--position-embedding-type" not in flags and "--swiglu" not in flags  # Megatron's defaults
    ckpt = tmp_path / "ckpt"
    run_losses(mlm, tmp_path, 4, [*flags, "--save", str(ckpt), "--save-interval", "1", "--train-iters", "1",
                                  "--lr-warmup-iters", "0"], "tb")
    ep = _resume(mlm, tmp_path, 4, flags, ckpt, "ep")
    plan = tmp_path / "plan.json"
    assert plan_main(["--even", "--attention-ranks", "4", "--expert-ranks", "1", "--attention-cp", "2", "-o",
                      str(plan), "--", *flags, *CP]) == 0
    p = HeteroPlan.load(plan)
    assert (p.attention_tp, p.attention_cp, p.world_size) == (2, 2, 5)
    het, log = run_losses(mlm, tmp_path, 5, [*flags, *CP, "--hetero-plan", str(plan), "--load", str(ckpt),
                                             "--ckpt-step", "1", "--no-load-optim", "--no-load-rng"], "het")
    assert "4 attention ranks (1 member of tensor parallel size 2 and context parallel size 2" in log, log[-3000:]
    assert sorted(het) == sorted(ep) == [2, 3, 4], (het, ep)
    within(f"MoE CI recipe, CP 2 vs Megatron EP ({het} vs {ep})", max(abs(het[i] - ep[i]) for i in ep), 3e-6)
