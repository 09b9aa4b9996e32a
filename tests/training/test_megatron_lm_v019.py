"""`torchrun pretrain_gpt.py ... --hetero-plan plan.json` from a Megatron-LM core_v0.19.0 checkout
(MEGATRON_LM_DIR, run with the environment of that release: `make compat`'s .venv-compat with the
megatron-lm extra): Megatron-LM's own pretrain() on every rank, through the same hooks as
core_v0.16.1's (test_megatron_lm_pretrain.py), and a plain Megatron EP run through the patch's CPU
layer. Skipped, with the reason, without such a checkout or environment.

What differs from core_v0.16.1 for these runs (docs/compatibility.md):
- NullTokenizer --vocab-size N has N tokens, EOD N-1 (core_v0.16.1: N+1 tokens, EOD N): the plugin's
  data (EOD 256, vocab 257) takes --vocab-size 257 here, 256 on core_v0.16.1 and the plugin's trainer
  (the padded vocabulary is 384 on all three).
- Megatron-LM's own run without --eval-interval fails (train_iters // None): given here.
"""
from __future__ import annotations

import importlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from megatron_lm_run import (
    checkpoints_both_ways,
    forced_moves_change_no_loss,
    moves_live_and_resumes,
    PRECISIONS,
    hetero_run,
    same_state,
    BATCH,
    CPU,
    ITERATION,
    MODEL,
    RECIPE,
    ROOT,
    load_dcp,
    plugin_losses,
    replans_and_resumes,
    tb_losses,
    torchrun,
)

from megatron_hetermoe import compat, megatron_lm

# The release line these tests run: core_v0.19.0, or with HETERMOE_CANARY_MAIN=1 (make canary-main) a
# snapshot of Megatron-LM main (megatron-core 0.20.0 in development) on its own megatron-core.
LINE = (0, 20) if os.environ.get("HETERMOE_CANARY_MAIN") else (0, 19)
# megatron_lm_run.DATA with core_v0.19.0's NullTokenizer size for the same token ids.
DATA = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "257", "--split", "90,5,5"]


@pytest.fixture(scope="session")
def mlm19(tmp_path_factory) -> Path:
    """The core_v0.19.0 checkout, linked entry by entry, with the patched pretrain_gpt.py and a copy
    of megatron/ (Megatron-LM compiles its dataset helpers into megatron/core/datasets/, which
    must not be the checkout's)."""
    # CI's core_v0.19.0 line (make test-v019) sets HETERMOE_REQUIRE_V019: there a missing piece fails.
    skip = pytest.fail if os.environ.get("HETERMOE_REQUIRE_V019") else pytest.skip
    src = os.environ.get("MEGATRON_LM_DIR")
    if not src:
        skip("set MEGATRON_LM_DIR to a Megatron-LM core_v0.19.0 work tree to run its pretrain() with HeterMoE")
    checkout = Path(src)
    if megatron_lm.checkout_version(checkout)[:2] != LINE:
        skip(f"{checkout} is not core_v{LINE[0]}.{LINE[1]}.x (core_v0.16.1: test_megatron_lm_pretrain.py; "
             f"Megatron-LM main: HETERMOE_CANARY_MAIN=1, make canary-main)")
    if compat.mcore_version()[:2] != LINE:
        skip(f"the core_v{LINE[0]}.{LINE[1]} checkout needs megatron-core {LINE[0]}.{LINE[1]}'s environment "
             f"(make compat: .venv-compat; make canary-main: .venv-canary)")
    for name in ("six", "regex", "pydantic", "tensorboard"):
        try:
            importlib.import_module(name)
        except ImportError:
            skip(f"Megatron-LM's training side needs {name!r}: pip install -e '.[megatron-lm]'")
    work = tmp_path_factory.mktemp("mlm19")
    for entry in checkout.iterdir():
        if entry.name not in (".git", "pretrain_gpt.py", "megatron"):
            (work / entry.name).symlink_to(entry)
    shutil.copytree(checkout / "megatron", work / "megatron", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    (work / "pretrain_gpt.py").write_text((checkout / "pretrain_gpt.py").read_text())
    subprocess.run(["git", "apply", str(ROOT / "patches" / megatron_lm.patch_for(checkout))], cwd=work, check=True)
    return work


@pytest.mark.slow
@pytest.mark.parametrize("schedule,asym,extra", [("zebra", False, []), ("distep", False, []), ("zebra", True, []),
                                                  ("zebra", True, ["--use-distributed-optimizer"])],
                         ids=["zebra", "distep", "zebra-asym-ea", "zebra-asym-ea-distributed-optimizer"])
def test_core_v019_pretrain_runs_hetermoe_with_the_plugin_losses(mlm19, data, tmp_path, schedule, asym, extra):
    """4 CPU ranks (2 ZP groups of 1 attention + 1 expert rank) in core_v0.19.0's pretrain(): its
    loop, iteration lines and evaluation, with the plugin trainer's losses. Asym-EA: attention
    ranks step a dense and an expert sub-optimizer, expert ranks one (RoleAssembly's
    _grad_norm_groups_once keeps core_v0.19.0's per-sub-optimizer reductions from pairing up wrongly).
    With the distributed optimizer (the plugin trainer's is not distributed: sharding the optimizer
    changes no number)."""
    from megatron_hetermoe.plan.hetero_plan import even_plan
    from shared_plans import asym_ea_plan

    plan = tmp_path / "plan.json"
    (asym_ea_plan() if asym else even_plan(2, 4, 1, 1, groups=2, num_microbatches=2, schedule=schedule)).save(plan)
    log, megatron = hetero_run(mlm19, plan, data, tmp_path / "tb", extra, data=DATA)
    assert f"use_distributed_optimizer={'--use-distributed-optimizer' in extra}" in log  # Megatron's DDP config
    assert f"2 attention ranks (Megatron's data parallel size) + 2 expert ranks, schedule {schedule}" in log
    assert "HeterMoE rank 1 (expert, ZP group 0" in log and "HeterMoE rank 2 (attention, ZP group 1" in log
    assert "validation loss at iteration 2 | lm loss value:" in log
    assert "validation loss at iteration 3 on test set | lm loss value:" in log
    assert sorted(int(i) for i, _ in ITERATION.findall(log)) == [1, 2, 3], log[-4000:]
    assert sorted(megatron) == [1, 2, 3]
    # The plugin trainer on the same plan (its Asym-EA run hung on megatron-core 0.19 until both
    # hostings took the separate grad-norm groups' answer in RoleAssembly.configure_optimizer).
    plugin = plugin_losses(tmp_path, plan, schedule, data)
    # Measured: bitwise equal (zebra, distep, Asym-EA zebra).
    assert [megatron[i] for i in (1, 2, 3)] == pytest.approx(plugin, abs=3e-6), (megatron, plugin)
    assert plugin[2] < plugin[0]  # it learns


@pytest.mark.slow
@pytest.mark.parametrize("precision", [PRECISIONS["bf16-attention-fp16-experts"]], ids=["bf16-attention-fp16-experts"])
def test_core_v019_pretrain_in_16_bit(mlm19, data, tmp_path, precision):
    """--bf16 with --hetero-expert-precision fp16 inside core_v0.19.0's pretrain(), Asym-EA zebra:
    Float16Module and Megatron's mixed-precision optimizer in bf16 on the attention ranks and fp16
    on the expert ranks, one dynamic loss scale for the world, the plugin trainer's losses within
    megatron_lm_run.TOL_16 (core_v0.16.1's test_megatron_lm_pretrain_in_16_bit runs bf16 and fp16
    alone too; on this line the mixed run covers both pools' code)."""
    from margins import within
    from megatron_lm_run import TOL_16
    from shared_plans import asym_ea_plan

    plan = tmp_path / "plan.json"
    asym_ea_plan().save(plan)
    log, megatron = hetero_run(mlm19, plan, data, tmp_path / "tb", precision, data=DATA)
    lines = [ln for ln in log.splitlines() if ITERATION.search(ln)]
    assert len(lines) == 3, log[-4000:]
    if "--initial-loss-scale" in precision:
        # Megatron's dynamic scale from --initial-loss-scale, the same on every rank: no step skipped.
        assert all("loss scale: 4096.0 |" in ln and "skipped iterations:   0 |" in ln for ln in lines), lines
    plugin = plugin_losses(tmp_path, plan, "zebra", data, tuple(precision))
    within(f"core_v0.19.0 pretrain() vs plugin, {' '.join(precision)}: iteration 1", abs(megatron[1] - plugin[0]),
           5e-6)
    within(f"core_v0.19.0 pretrain() vs plugin, {' '.join(precision)}",
           max(abs(megatron[i] - plugin[i - 1]) for i in (1, 2, 3)), TOL_16)


@pytest.mark.slow
def test_core_v019_resume_from_a_torch_dist_checkpoint_is_bitwise(mlm19, data, tmp_path):
    """HeterMoE zebra, 2+2, fp32: three iterations in one go, or two, a save, and a resume: the
    checkpoints after iteration 3 are bitwise equal (as test_megatron_lm_pretrain.py's, core_v0.16.1)."""
    from megatron_hetermoe.plan.hetero_plan import even_plan

    plan = tmp_path / "plan.json"
    even_plan(2, 4, 1, 1, groups=2, num_microbatches=2, schedule="zebra").save(plan)
    flags = [*MODEL, *BATCH, *DATA, *RECIPE, *CPU, "--data-path", data, "--log-interval", "1", "--eval-interval",
             "100", "--eval-iters", "0", "--hetero-plan", str(plan), "--ckpt-format", "torch_dist"]
    a, b = tmp_path / "a", tmp_path / "b"
    r = torchrun(mlm19, 4, [*flags, "--save", str(a), "--save-interval", "2",
                             "--tensorboard-dir", str(tmp_path / "ta")])
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    r2 = torchrun(mlm19, 4, [*flags, "--load", str(a), "--ckpt-step", "2", "--save", str(b), "--save-interval", "3",
                              "--tensorboard-dir", str(tmp_path / "tb")])
    log2 = r2.stdout + r2.stderr
    assert r2.returncode == 0, log2[-4000:]
    assert f"successfully loaded checkpoint from {a}" in log2 and "at iteration 2" in log2
    assert tb_losses(tmp_path / "tb") == {3: tb_losses(tmp_path / "ta")[3]}
    whole, resumed = load_dcp(a / "iter_0000003"), load_dcp(b / "iter_0000003")
    assert any("exp_avg" in k for k in whole) and any("experts.experts.linear_fc1" in k for k in whole)
    for ck in (whole, resumed):
        for k in [k for k in ck if k.startswith("rng_state")]:
            (state,) = ck[k][0]  # Megatron's data loader draws from torch's RNG (see the 0.16.1 test)
            del state["torch_rng_state"], state["cuda_rng_state"]
        for k in [k for k in ck if k.startswith("common_state")]:
            # core_v0.19.0 saves its common state (iteration, scheduler, ...) in the checkpoint, with
            # the command line's args, which differ between the two runs (--load, --save, ...).
            (common,) = ck[k]
            del common["args"]
    differ = [k for k in whole if not same_state(whole[k], resumed.get(k))]
    assert whole.keys() == resumed.keys() and not differ, differ



@pytest.mark.slow
def test_core_v019_plans_itself_and_resumes_on_the_gpus_left(mlm19, data, tmp_path, monkeypatch):
    """--hetero-plan auto in core_v0.19.0's pretrain(), and a checkpoint of 4 GPUs resumed on the 3 left
    (test_megatron_lm_auto_plan.py's case on core_v0.16.1)."""
    replans_and_resumes(mlm19, data, tmp_path, monkeypatch, data=DATA)


@pytest.mark.slow
def test_core_v019_moves_experts_live(mlm19, data, tmp_path, monkeypatch):
    """--hetero-replan-interval in core_v0.19.0's pretrain() (test_megatron_lm_live_moves.py's cases
    on core_v0.16.1): the load rule's move with bitwise losses and a resume from the moved
    checkpoint, and the forced moves under zebra."""
    moves_live_and_resumes(mlm19, data, tmp_path / "rule", data=DATA)
    forced_moves_change_no_loss(mlm19, data, tmp_path / "forced", monkeypatch, "zebra", [], data=DATA)


@pytest.mark.slow
def test_core_v019_megatron_ep_and_hetermoe_checkpoints_load_into_each_other(mlm19, data, tmp_path):
    """Plain Megatron-LM (EP 2, no --hetero-plan) through the patch's CPU layer saves; Megatron EP
    and a HeterMoE Asym-EA zebra run load it and continue with the same losses and load-balancing
    loss (core_v0.19.0 reports it through MoEMetricsTracker); then the HeterMoE checkpoint loads
    into both alike (megatron_lm_run.checkpoints_both_ways, as core_v0.16.1's test)."""
    from shared_plans import asym_ea_plan

    plan = tmp_path / "plan.json"
    asym_ea_plan().save(plan)
    checkpoints_both_ways(mlm19, plan, data, tmp_path, data=DATA)


@pytest.mark.slow
def test_core_v019_refuses_by_name(mlm19, tmp_path):
    """The flags a --hetero-plan run cannot honour are refused by name in core_v0.19.0's
    parse_and_validate_args (before pretrain()). (core_v0.19.0's own `pretrain_gpt.py --help` fails,
    patched or not: its --moe-paged-stash-buffer-size-factor-cuda help has an unescaped "%".)"""
    from megatron_hetermoe.plan.hetero_plan import even_plan

    plan = tmp_path / "plan.json"
    even_plan(2, 4, 1, 1, num_microbatches=4).save(plan)
    r = torchrun(mlm19, 1, [*MODEL, *BATCH, *CPU, "--mock-data", "--vocab-size", "257", "--tokenizer-type",
                             "NullTokenizer", "--data-parallel-random-init", "--moe-apply-probs-on-input",
                             "--moe-router-topk", "1", "--hetero-plan", str(plan)], timeout=300)
    log = r.stdout + r.stderr
    assert r.returncode != 0
    assert "--data-parallel-random-init True: HeterMoE initializes every parameter" in log, log[-3000:]
    assert "--moe-apply-probs-on-input True: HeterMoE's dispatcher replaces Megatron's" in log


def _hetermoe_pretrain(nproc: int, flags: list[str], tb: Path, cwd: Path) -> dict[int, float]:
    """`hetermoe pretrain` with no checkout anywhere: megatron-core 0.19's (canary: 0.20's) own megatron.training."""
    import sys

    from megatron_lm_run import env

    environ = {k: v for k, v in env().items() if k != "MEGATRON_LM_DIR"}
    r = subprocess.run([sys.executable, "-W", "ignore", "-m", "megatron_hetermoe.cli", "pretrain", "--nproc",
                        str(nproc), *flags, "--tensorboard-dir", str(tb)],
                       cwd=cwd, env=environ, capture_output=True, text=True, timeout=600)
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-4000:]
    import megatron.training

    where = Path(megatron.training.__file__).parent
    # The installed megatron-core's own megatron.training (the canary installs main's tree editable: it is there).
    installed = "site-packages" in str(where) or bool(os.environ.get("HETERMOE_CANARY_MAIN"))
    assert installed and f"megatron-core {LINE[0]}.{LINE[1]}" in log and f"pretrain() ({where})" in log, log[:2000]
    return tb_losses(tb)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", [None, "zebra"], ids=["plain-megatron-ep", "hetermoe-zebra"])
def test_hetermoe_pretrain_without_a_checkout_equals_the_checkout(mlm19, data, tmp_path, schedule):
    """Issue 29 item 2: Megatron-LM's Qwen3-30B-A3B conf (core_v0.19.0's tree), shrunk to CPU size,
    through `hetermoe pretrain` on megatron-core 0.19's megatron.training with the plugin's providers
    (no checkout on the path), and through the checkout's patched pretrain_gpt.py: the same losses.
    Plain: Megatron EP 2 (the model built by Megatron from the flags); HeterMoE: 2 x (1+1) zebra."""
    from test_megatron_lm_recipes import CONF, EVAL_OFF, recipe_flags, shrunk

    from megatron_hetermoe.planner.cli_plan import main as plan_main

    flags = [*shrunk(recipe_flags(mlm19, f"{CONF}/Qwen/Qwen3-30B-A3B.sh")), *DATA, *CPU, *EVAL_OFF, "--data-path", data,
             "--train-iters", "3"]
    if schedule is None:
        nproc, extra = 2, ["--expert-model-parallel-size", "2"]
    else:
        plan = tmp_path / "plan.json"
        assert plan_main(["--even", "--attention-ranks", "1", "--expert-ranks", "1", "--groups", "2",
                          "--microbatches", "2", "--schedule", schedule, "-o", str(plan), "--", *flags]) == 0
        nproc, extra = 4, ["--hetero-plan", str(plan)]
    work = tmp_path / "elsewhere"
    work.mkdir()
    ours = _hetermoe_pretrain(nproc, [*flags, *extra], tmp_path / "ours", work)
    r = torchrun(mlm19, nproc, [*flags, *extra, "--tensorboard-dir", str(tmp_path / "checkout")])
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    theirs = tb_losses(tmp_path / "checkout")
    assert sorted(ours) == sorted(theirs) == [1, 2, 3]
    assert ours == theirs  # measured: bitwise equal


def test_hetermoe_pretrain_help_lists_megatrons_flags_and_the_hetero_ones(mlm19):
    """`hetermoe pretrain --help` with no checkout: its own flags, then megatron-core 0.19's parser's
    (whose own --help fails on a bare "%" in one help text) with the --hetero-* flags."""
    import sys

    from megatron_lm_run import env

    environ = {k: v for k, v in env().items() if k != "MEGATRON_LM_DIR"}
    r = subprocess.run([sys.executable, "-W", "ignore", "-m", "megatron_hetermoe.cli", "pretrain", "--help"],
                       env=environ, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert "--nproc N" in r.stdout and "with the plugin's GPT providers" in r.stdout
    for flag in ("--hetero-plan HETERO_PLAN", "--num-experts", "--moe-router-topk", "--mock-data"):
        assert flag in r.stdout, flag


@pytest.mark.slow
def test_core_v019_tensor_parallel_members_checkpoints_both_ways(mlm19, data, tmp_path):
    """Tensor parallelism on attention members inside core_v0.19.0's pretrain(): plain Megatron TP 2
    (+SP) EP 2 saves; HeterMoE 1 x (a TP-2 attention member + 2 expert ranks), zebra, loads it and
    continues with Megatron's losses, and back (test_megatron_lm_tp.py on core_v0.16.1)."""
    from test_megatron_lm_tp import TP, _plan

    checkpoints_both_ways(mlm19, _plan(tmp_path / "plan.json", "zebra"), data, tmp_path, data=DATA, extra=TP)


@pytest.mark.slow
def test_core_v019_context_parallel_members_checkpoints_both_ways(mlm19, data, tmp_path):
    """Context parallelism on attention members inside core_v0.19.0's pretrain(): plain Megatron CP 1
    EP 2 saves; HeterMoE 1 x (a CP-2 attention member + 2 expert ranks), zebra, loads it and continues
    with Megatron's losses, and back (test_megatron_lm_cp.py on core_v0.16.1)."""
    from test_megatron_lm_cp import CP, _plan

    checkpoints_both_ways(mlm19, _plan(tmp_path / "plan.json", "zebra"), data, tmp_path, data=DATA, extra=CP,
                          plain_extra=[])


@pytest.mark.slow
def test_core_v019_pipeline_stages_checkpoints_both_ways(mlm19, data, tmp_path):
    """Pipeline stages inside core_v0.19.0's pretrain(): plain Megatron PP 1 EP 2 saves; HeterMoE with
    2 stages of 1 attention + 1 expert rank (--pipeline-model-parallel-size 2, zebra) loads it and
    continues with Megatron's losses, and back (test_megatron_lm_pp.py on core_v0.16.1, distep)."""
    from test_megatron_lm_pp import PP, _plan

    checkpoints_both_ways(mlm19, _plan(tmp_path / "plan.json", schedule="zebra"), data, tmp_path, data=DATA,
                          extra=PP, plain_extra=[])


@pytest.mark.slow
def test_core_v019_virtual_pipeline_stages(mlm19, data, tmp_path):
    """Virtual pipeline stages inside core_v0.19.0's pretrain(): PP 2 x 2 virtual stages, DistEP, from
    one plain Megatron checkpoint with plain Megatron's training and validation losses (save and
    resume: test_megatron_lm_pp.py on core_v0.16.1; measured here too, bitwise)."""
    from megatron_lm_run import virtual_stages_run

    virtual_stages_run(mlm19, data, tmp_path, data=DATA, resume=False)
