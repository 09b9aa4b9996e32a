"""`torchrun pretrain_gpt.py ... --hetero-plan plan.json` from a Megatron-LM core_v0.16.1 checkout
(MEGATRON_LM_DIR): Megatron-LM's own pretrain() on every rank, attention and expert alike, on CPU
ranks over gloo. Skipped, with the reason, without a checkout or without Megatron-LM's
training-side packages (the megatron-lm extra; `make test` installs it when MEGATRON_LM_DIR is set)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from margins import within
from megatron_lm_run import (
    checkpoints_both_ways,
    PRECISIONS,
    hetero_run,
    same_state,
    BATCH,
    CPU,
    DATA,
    ITERATION,
    MODEL,
    RECIPE,
    TOL_16,
    env,
    load_dcp,
    plugin_losses,
    tb_losses,
    torchrun,
)
from shared_plans import asym_ea_plan


@pytest.mark.slow
@pytest.mark.parametrize("schedule,extra", [("zebra", []), ("distep", []), ("zebra", ["--use-distributed-optimizer"]),
                                             ("zebra", ["--hetero-zebra-issuer", "single"])],
                         ids=["zebra", "distep", "zebra-distributed-optimizer", "zebra-single-issuer"])
def test_megatron_lm_pretrain_runs_hetermoe(mlm, data, tmp_path, schedule, extra):
    """4 CPU ranks (2 ZP groups of 1 attention + 1 expert rank): Megatron-LM's loop, its
    iteration lines and its validation/test evaluation, with the plugin trainer's losses (whose
    optimizer is not distributed: sharding the optimizer changes no number)."""
    from megatron_hetermoe.plan.hetero_plan import even_plan

    plan = tmp_path / "plan.json"
    even_plan(2, 4, 1, 1, groups=2, num_microbatches=2, schedule=schedule).save(plan)
    tb = tmp_path / "tb"
    log, megatron = hetero_run(mlm, plan, data, tb, extra)
    dist_opt = "--use-distributed-optimizer" in extra
    assert f"use_distributed_optimizer={dist_opt}" in log  # Megatron's DDP config, as built
    assert f"2 attention ranks (Megatron's data parallel size) + 2 expert ranks, schedule {schedule}" in log
    issuer = ", zebra issuer " + ("single" if "single" in extra else "threads") if schedule == "zebra" else ""
    assert "HeterMoE rank 1 (expert, ZP group 0" in log and f"HeterMoE rank 2 (attention, ZP group 1{issuer})" in log
    assert "validation loss at iteration 2 | lm loss value:" in log
    assert "validation loss at iteration 3 on test set | lm loss value:" in log
    assert sorted(int(i) for i, _ in ITERATION.findall(log)) == [1, 2, 3], log[-4000:]
    assert sorted(megatron) == [1, 2, 3] and sorted(tb_losses(tb, "lm loss validation")) == [2, 3]
    plugin = plugin_losses(tmp_path, plan, schedule, data)
    # Measured: |diff| <= 4.8e-7 (iteration 1; the others bitwise), the token-weighted sums added in
    # another order.
    assert [megatron[i] for i in (1, 2, 3)] == pytest.approx(plugin, abs=3e-6), (megatron, plugin)
    assert plugin[2] < plugin[0]  # it learns


@pytest.mark.slow
@pytest.mark.parametrize("precision", list(PRECISIONS.values()), ids=list(PRECISIONS))
def test_megatron_lm_pretrain_in_16_bit(mlm, data, tmp_path, precision):
    """--bf16 / --fp16 inside Megatron-LM's pretrain(): Float16Module and Megatron's mixed-precision
    optimizer on both roles, one loss scale for the world; the losses are the plugin trainer's
    (whose 16-bit runs are checked against Megatron EP in tests/training/test_precision.py). An
    Asym-EA plan: attention ranks step a dense and an expert sub-optimizer, expert ranks one.
    Per-pool precision: the expert ranks (and the attention ranks' bf16 experts) get fp16 tokens,
    and the bf16 attention ranks hold the world's fp16 loss scale."""
    plan = _asym_plan(tmp_path / "plan.json")
    log, megatron = hetero_run(mlm, plan, data, tmp_path / "tb", precision)
    assert sorted(int(i) for i, _ in ITERATION.findall(log)) == [1, 2, 3], log[-4000:]
    if "--initial-loss-scale" in precision:
        # Megatron's dynamic scale from --initial-loss-scale, the same on every rank: no step skipped.
        lines = [ln for ln in log.splitlines() if ITERATION.search(ln)]
        assert len(lines) == 3 and all("loss scale: 4096.0 |" in ln and "skipped iterations:   0 |" in ln
                                       for ln in lines), lines
    plugin = plugin_losses(tmp_path, plan, "zebra", data, tuple(precision))
    # Iteration 1 starts from the same weights: equal up to the rounding of the fp32 loss reduction
    # (bitwise with ATEN_CPU_CAPABILITY=default; 4.8e-7, one fp32 ulp at 6, under AVX2/AVX-512 kernels
    # on a CPU with AVX512-FP16, fp16).
    within(f"pretrain() vs plugin, {' '.join(precision)}: iteration 1", abs(megatron[1] - plugin[0]), 5e-6)
    within(f"pretrain() vs plugin, {' '.join(precision)}", max(abs(megatron[i] - plugin[i - 1]) for i in (1, 2, 3)),
           TOL_16)


@pytest.mark.slow
def test_megatron_lm_flags_it_cannot_honour_are_refused_by_name(mlm, tmp_path):
    from megatron_hetermoe.plan.hetero_plan import even_plan

    plan = tmp_path / "plan.json"
    even_plan(2, 4, 1, 1, num_microbatches=4).save(plan)
    r = torchrun(mlm, 1, [*MODEL, *BATCH, *CPU, "--mock-data", "--vocab-size", "256", "--tokenizer-type",
                           "NullTokenizer", "--data-parallel-random-init", "--moe-apply-probs-on-input",
                           "--moe-router-topk", "1", "--hetero-plan", str(plan)], timeout=300)
    log = r.stdout + r.stderr
    assert r.returncode != 0
    assert "--data-parallel-random-init True: HeterMoE initializes every parameter" in log, log[-3000:]
    assert "--moe-apply-probs-on-input True: HeterMoE's dispatcher replaces Megatron's" in log


@pytest.mark.slow
def test_megatron_lm_pretrain_runs_a_keep_inputs_plan_with_the_same_losses(mlm, data, tmp_path):
    """A plan with expert_recompute 'keep-inputs' (the planner's choice under activation memory
    pressure) trains inside pretrain() (Asym-EA zebra: attention ranks hold experts too), and with
    the losses of the same plan without recomputation. That the runtime does recompute (and saves
    the activations) is test_expert_recompute_runtime.py's; pretrain() reads the plan from the
    same HeteroParallelState."""
    import dataclasses

    losses = {}
    for mode in ("off", "keep-inputs"):
        plan = tmp_path / f"{mode}.json"
        dataclasses.replace(asym_ea_plan(), expert_recompute=mode).save(plan)
        _, losses[mode] = hetero_run(mlm, plan, data, tmp_path / f"tb-{mode}", evaluation=EVAL_OFF)
    assert sorted(losses["off"]) == [1, 2, 3]
    assert losses["keep-inputs"] == losses["off"]  # measured: bitwise


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["zebra", "distep"])
def test_megatron_lm_moe_layer_recompute_recomputes_the_experts_with_the_same_losses(mlm, data, tmp_path, schedule):
    """Megatron's --moe-layer-recompute (the DeepSeek-R1, Kimi-K2 and Qwen3-235B confs pass it) on the
    Asym-EA plan: accepted with its note, the experts (expert ranks' and the attention ranks') keep
    their inputs and recompute their forward in backward (models/experts.recomputes_experts), the
    dispatch is not replayed; the losses are bitwise the run's without it."""
    plan = _asym_plan(tmp_path / "plan.json")
    sched = ["--hetero-schedule", schedule]
    _, plain = hetero_run(mlm, plan, data, tmp_path / "tb-plain", extra=sched, evaluation=EVAL_OFF)
    log, rec = hetero_run(mlm, plan, data, tmp_path / "tb-rec", extra=[*sched, "--moe-layer-recompute"],
                          evaluation=EVAL_OFF)
    assert "--moe-layer-recompute: the experts keep their inputs and recompute their forward" in log
    assert sorted(plain) == [1, 2, 3] and rec == plain


EVAL_OFF = ["--eval-interval", "100", "--eval-iters", "0"]


def _asym_plan(path: Path) -> Path:
    """shared_plans.asym_ea_plan, saved at `path`."""
    asym_ea_plan().save(path)
    return path



@pytest.mark.slow
@pytest.mark.parametrize("precision", [[], ["--bf16"], ["--fp16", "--initial-loss-scale", "4096"]],
                         ids=["fp32", "bf16", "fp16"])
def test_resume_from_a_torch_dist_checkpoint_is_bitwise(mlm, data, tmp_path, precision):
    """HeterMoE zebra, 2+2: three iterations in one go, or two, a save, and a resume: the
    checkpoints after iteration 3 (model, Adam moments, RNG states; in 16-bit the fp32 main
    weights too) are bitwise equal."""
    from megatron_hetermoe.plan.hetero_plan import even_plan

    plan = tmp_path / "plan.json"
    even_plan(2, 4, 1, 1, groups=2, num_microbatches=2, schedule="zebra").save(plan)
    flags = [*MODEL, *BATCH, *DATA, *RECIPE, *CPU, "--data-path", data, "--log-interval", "1", "--eval-interval",
             "100", "--eval-iters", "0", "--hetero-plan", str(plan), "--ckpt-format", "torch_dist", *precision]
    a, b = tmp_path / "a", tmp_path / "b"
    r = torchrun(mlm, 4, [*flags, "--save", str(a), "--save-interval", "2",
                          "--tensorboard-dir", str(tmp_path / "tb_a")])
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    r2 = torchrun(mlm, 4, [*flags, "--load", str(a), "--ckpt-step", "2", "--save", str(b), "--save-interval", "3",
                            "--tensorboard-dir", str(tmp_path / "tb_b")])
    log2 = r2.stdout + r2.stderr
    assert r2.returncode == 0, log2[-4000:]
    assert f"successfully loaded checkpoint from {a}" in log2 and "at iteration 2" in log2
    assert tb_losses(tmp_path / "tb_b") == {3: tb_losses(tmp_path / "tb_a")[3]}
    whole, resumed = load_dcp(a / "iter_0000003"), load_dcp(b / "iter_0000003")
    assert any("exp_avg" in k for k in whole) and any("experts.experts.linear_fc1" in k for k in whole)
    assert any("fp32_param" in k for k in whole) == bool(precision)  # 16-bit: the fp32 main weights
    for ck in (whole, resumed):
        for k in [k for k in ck if k.startswith("rng_state")]:
            # Megatron's own: its data loader draws from torch's RNG when the iterator is made, which
            # a resumed run does after restoring the RNG (plain Megatron EP shows the same). The
            # dropout RNG tracker, Python's and numpy's states are compared.
            (state,) = ck[k][0]
            del state["torch_rng_state"], state["cuda_rng_state"]
    differ = [k for k in whole if not same_state(whole[k], resumed.get(k))]
    assert whole.keys() == resumed.keys() and not differ, differ


@pytest.mark.slow
def test_megatron_ep_and_hetermoe_checkpoints_load_into_each_other(mlm, data, tmp_path):
    """Megatron EP's checkpoint into HeterMoE Asym-EA zebra and back (megatron_lm_run.checkpoints_both_ways)."""
    checkpoints_both_ways(mlm, _asym_plan(tmp_path / "plan.json"), data, tmp_path)


@pytest.mark.slow
def test_megatron_lm_pretrain_with_mock_data(mlm, tmp_path):
    """--mock-data (Megatron's MockGPTDataset), 2+2 in one ZP group, zebra: Megatron's iteration and
    validation lines on every iteration and evaluation."""
    from megatron_hetermoe.plan.hetero_plan import even_plan

    plan = tmp_path / "plan.json"
    even_plan(2, 4, 2, 2, num_microbatches=2, schedule="zebra").save(plan)
    r = torchrun(mlm, 4, [*MODEL, "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "2",
                           "--lr", "1e-3", "--mock-data", "--vocab-size", "256", "--tokenizer-type", "NullTokenizer",
                           *RECIPE, *CPU, "--log-interval", "1", "--eval-interval", "1", "--eval-iters", "1",
                           "--hetero-plan", str(plan)])
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-4000:]
    assert "2 attention ranks (Megatron's data parallel size) + 2 expert ranks, schedule zebra" in log
    assert sorted(int(i) for i, _ in ITERATION.findall(log)) == [1, 2]
    assert "validation loss at iteration 1 |" in log and "validation loss at iteration 2 |" in log


@pytest.mark.slow
def test_help_lists_the_hetero_flags(mlm):
    r = subprocess.run([sys.executable, "-W", "ignore", "pretrain_gpt.py", "--help"], cwd=mlm, env=env(),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert "HeterMoE (megatron-hetermoe):" in r.stdout and "--hetero-plan HETERO_PLAN" in r.stdout
    assert "--hetero-zebra-issuer {auto,single,threads}" in r.stdout
    assert "--num-layers NUM_LAYERS" in r.stdout  # Megatron's own, in the same help
