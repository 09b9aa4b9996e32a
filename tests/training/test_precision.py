"""--bf16 / --fp16 (Megatron's mixed precision) on both trainers: parity of HeterMoE with
Megatron EP in bf16, fp16 with a dynamic loss scale that is one scale for the whole world,
per-pool precision (bf16 attention ranks, fp16 expert ranks, tokens cast at the boundary), and
the refusals made before launch (no native bf16 per pool, both flags, fp32 next to 16-bit)."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from margins import within
from routing import force_routing, initial_state
from shared_plans import asym_ea_plan

from megatron_hetermoe.config import HeteroRunConfig, ParallelConfig, TrainConfig
from megatron_hetermoe.parallel.launcher import launch
from megatron_hetermoe.parallel.transport import SplitRoute
from megatron_hetermoe.plan.hetero_plan import even_plan
from megatron_hetermoe.tools.parity import diff_by_category, run_parity
from megatron_hetermoe.training import args as train_args
from megatron_hetermoe.training.nan_check import NanInjection
from megatron_hetermoe.training.run_hooks import RunHooks
from megatron_hetermoe.training.validation import ConfigError, validate_job

# bf16, HeterMoE against Megatron EP, measured on the tiny model (micro batch 1, 3-4 steps;
# plans 2+2 R=2 distep and zebra, 1+1 R=2 zebra, 1+3 R=1 distep, 3+1 R=2 zebra;
# ATEN_CPU_CAPABILITY default, avx2, avx512):
# - loss at identical parameters: worst 6.1e-5 (bf16 round-off in a different but equivalent
#   order: HeterMoE applies the routing probabilities after combine, Megatron inside the expert);
# - free-running losses: worst 3.8e-5;
# - gradients at identical parameters with forced routing: worst 2.7e-2 (default kernels, 1+3;
#   1.7e-2 on the 2+2 R=2 tested here; about 3 bf16 ulps of the category's largest gradient).
#   With free routing a near-tie in the router flips under bf16 round-off (seen: 0.19 in one
#   step of 2+2 R=2, 0.007 in the others), so gradients are compared where routing cannot flip
#   (test_routing_extremes.force_routing).
BF16_LOSS_TOL = 5e-4
BF16_FREE_RUN_LOSS_TOL = 2e-4
BF16_GRAD_TOL = 0.15
# fp16 (initial loss scale 4096, no overflow) against fp32, HeterMoE 2+2 R=2 (distep and zebra
# alike), 4 free-running steps, ATEN_CPU_CAPABILITY default and avx512: losses measured worst
# 3.3e-5; the first step's gradients (same initial weights, fp16-rounded in one) 6.9e-4. The
# gradients also show the loss scale is taken out (Adam's update barely depends on a constant
# factor, so losses cannot).
FP16_VS_FP32_LOSS_TOL = 2e-4
FP16_VS_FP32_GRAD_TOL = 5e-3


def _ranks(cfg: TrainConfig, plan=None, schedule: str | None = None, hooks: RunHooks | None = None) -> list:
    """Every rank's TrainResult (HeterMoE with a plan, else Megatron EP on 4 ranks)."""
    world = plan.world_size if plan is not None else 4
    hetero = HeteroRunConfig(schedule=schedule) if plan is not None else None
    return launch(train_args._rank_main, world, cfg, plan, hetero, hooks, timeout_s=600)


def _max_rel(got: list[float], want: list[float]) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(got, want))


# ---- (a) bf16 parity ----------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["distep", "zebra"])
def test_bf16_matches_megatron_ep(tiny, schedule):
    plan = even_plan(tiny.num_layers, tiny.num_experts, 2, 2, num_microbatches=2, schedule=schedule)
    r = run_parity(plan, tiny, steps=3, micro_batch_size=1, schedule=schedule, precision="bf16")
    within("bf16 loss", r.max_rel_loss_diff, BF16_LOSS_TOL)
    within("bf16 free-running loss", r.max_rel_loss_diff_free_run, BF16_FREE_RUN_LOSS_TOL)
    state = force_routing(initial_state(tiny), [3, 1], tiny.num_layers)
    r = run_parity(plan, tiny, steps=3, micro_batch_size=1, schedule=schedule, precision="bf16",
                   init_state=state, free_run=False)
    within("bf16 loss, forced routing", r.max_rel_loss_diff, BF16_LOSS_TOL)
    within("bf16 grad, forced routing", r.max_rel_grad_diff, BF16_GRAD_TOL)
    # bf16 really ran: the same step in fp32 gives other losses.
    fp32 = run_parity(plan, tiny, steps=1, micro_batch_size=1, schedule=schedule, init_state=state, free_run=False)
    assert fp32.ref_losses[0] != r.ref_losses[0]


# ---- (b) fp16 and one world-wide loss scale -----------------------------------------------
@pytest.mark.slow
def test_fp16_close_to_fp32_with_fp16_params_on_both_roles(tiny):
    plan = even_plan(tiny.num_layers, tiny.num_experts, 2, 2, num_microbatches=2, schedule="zebra")
    base = TrainConfig(tiny, micro_batch_size=1, global_batch_size=4, train_iters=4, quiet=True)
    grads = RunHooks(collect_grads=True)
    fp32 = _ranks(base, plan, "zebra", grads)[0]
    got = _ranks(dataclasses.replace(base, fp16=True, initial_loss_scale=4096.0), plan, "zebra", grads)
    for rank, r in enumerate(got):
        assert r.param_dtypes == ["torch.float16"], (rank, r.param_dtypes)  # attention and expert ranks
        assert r.loss_scales == [4096.0] * 4 and r.overflow_skipped == []
    assert all(math.isfinite(x) for x in got[0].losses)
    within("fp16 vs fp32 loss", _max_rel(got[0].losses, fp32.losses), FP16_VS_FP32_LOSS_TOL)
    grads = diff_by_category(got[0].grads[0], fp32.grads[0], scale="category")
    within("fp16 vs fp32 first-step grad", max(grads.values()), FP16_VS_FP32_GRAD_TOL)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["distep", "zebra"])
def test_an_inf_on_one_expert_rank_skips_the_step_and_halves_the_scale_everywhere(tiny, schedule):
    plan = even_plan(tiny.num_layers, tiny.num_experts, 2, 2, num_microbatches=2, schedule=schedule)
    expert = plan.expert_ranks[0]
    # A NaN in one expert weight's gradient on one expert rank, at step 1 (before the expert
    # reduction); hysteresis 1: one overflowing step halves the scale.
    cfg = TrainConfig(tiny, micro_batch_size=1, global_batch_size=4, train_iters=3, quiet=True, fp16=True,
                      initial_loss_scale=4096.0, hysteresis=1)
    nan = RunHooks(nan_injection=NanInjection(step=1, rank=expert, target="grad", param="mlp.experts"))
    got = _ranks(cfg, plan, schedule, nan)
    for rank, r in enumerate(got):
        assert r.overflow_skipped == [1], (rank, r.overflow_skipped)
        assert r.loss_scales == [4096.0, 2048.0, 2048.0], (rank, r.loss_scales)
    assert all(math.isfinite(x) for x in got[0].losses)


@pytest.mark.slow
def test_megatron_ep_fp16_shares_the_scale_too(tiny):
    # Megatron EP=2: an inf in rank 1's expert gradient only (its experts are not on rank 0).
    cfg = TrainConfig(tiny, ParallelConfig(ep=2), micro_batch_size=1, global_batch_size=4, train_iters=3, quiet=True,
                      fp16=True, initial_loss_scale=4096.0, hysteresis=1)
    nan = RunHooks(nan_injection=NanInjection(step=1, rank=1, target="grad", param="mlp.experts"))
    got = _ranks(cfg, hooks=nan)
    for rank, r in enumerate(got):
        assert r.param_dtypes == ["torch.float16"]
        assert r.overflow_skipped == [1] and r.loss_scales == [4096.0, 2048.0, 2048.0], (rank, r)


@pytest.mark.slow
def test_fp16_resume_is_bitwise_and_keeps_the_loss_scale(tiny, tmp_path):
    plan = even_plan(tiny.num_layers, tiny.num_experts, 2, 2, num_microbatches=2, schedule="zebra")
    # The scale halves at step 0 (an injected NaN, hysteresis 1), so the checkpoint holds 2048.
    cfg = TrainConfig(tiny, micro_batch_size=1, global_batch_size=4, train_iters=4, quiet=True, deterministic=True,
                      fp16=True, initial_loss_scale=4096.0, hysteresis=1, save=str(tmp_path), save_interval=2)
    nan = RunHooks(nan_injection=NanInjection(step=0, rank=plan.expert_ranks[0], target="grad", param="mlp.experts"))
    full = _ranks(cfg, plan, "zebra", nan)[0]
    resumed = _ranks(dataclasses.replace(cfg, save=None, load=str(tmp_path), ckpt_step=2), plan, "zebra", nan)[0]
    assert full.loss_scales == [2048.0] * 4 and resumed.loss_scales == [2048.0] * 2
    assert resumed.losses == full.losses[2:]
    with pytest.raises(Exception, match=r"saved by a fp16 run, this run is bf16; load it with the precision it "
                                         r"was saved with \(--fp16\)"):
        _ranks(dataclasses.replace(cfg, save=None, load=str(tmp_path), ckpt_step=2, fp16=False, bf16=True),
               plan, "zebra")


# ---- (c) refusals before launch -------------------------------------------------------------
def _cfg(tiny, **kw) -> TrainConfig:
    return TrainConfig(tiny, micro_batch_size=1, global_batch_size=4, train_iters=2, **kw)


def test_bf16_on_gpus_without_native_bf16_is_refused(tiny):
    plan = even_plan(tiny.num_layers, tiny.num_experts, 2, 2, num_microbatches=2)
    plan.gpu_types = ["A100-80GB", "A100-80GB", "V100-32GB", "T4"]
    with pytest.raises(ConfigError, match=r"--bf16: .*V100-32GB \(ranks \[2\]\); T4 \(ranks \[3\]\); use --fp16"):
        validate_job(_cfg(tiny, bf16=True), 4, plan)
    validate_job(_cfg(tiny, fp16=True), 4, plan)  # the fix
    plan.gpu_types = ["H100", "H100", "A100-80GB", "A100-80GB"]
    validate_job(_cfg(tiny, bf16=True), 4, plan)


def test_bf16_refused_on_a_pre_ampere_cuda_device(monkeypatch):
    from megatron_hetermoe.parallel.device import check_native_bf16

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (7, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "Tesla V100-SXM2-32GB")
    with pytest.raises(ValueError, match=r"Tesla V100-SXM2-32GB \(compute capability 7.0\).*use --fp16"):
        check_native_bf16(torch.device("cuda", 0))
    check_native_bf16(torch.device("cpu"))


def test_bf16_and_fp16_together_are_refused(tiny, capsys):
    with pytest.raises(ConfigError, match="--bf16 and --fp16 together"):
        validate_job(_cfg(tiny, bf16=True, fp16=True), 4)
    with pytest.raises(SystemExit):
        train_args.build_parser().parse_args(["--bf16", "--fp16"])
    assert "not allowed with argument --bf16" in capsys.readouterr().err


def test_per_pool_precision_rules(tiny, tmp_path, capsys):
    plan = even_plan(tiny.num_layers, tiny.num_experts, 2, 2, num_microbatches=2)
    # The paper's kind of cluster: bf16 on A100 attention ranks, fp16 on V100 expert ranks.
    plan.gpu_types = ["A100-80GB", "A100-80GB", "V100-32GB", "V100-32GB"]
    validate_job(_cfg(tiny, bf16=True), 4, plan, run=HeteroRunConfig(expert_precision="fp16"))
    with pytest.raises(ConfigError, match=r"--bf16: the plan has .*V100-32GB \(ranks \[2, 3\]\); use --fp16"):
        validate_job(_cfg(tiny, bf16=True), 4, plan)  # bf16 on the V100s too
    with pytest.raises(ConfigError, match=r"--hetero-expert-precision bf16: the plan's expert pool has .*"
                                          r"V100-32GB \(ranks \[2, 3\]\); use --hetero-expert-precision fp16"):
        validate_job(_cfg(tiny, fp16=True), 4, plan, run=HeteroRunConfig(expert_precision="bf16"))
    plan.gpu_types = ["V100-32GB", "V100-32GB", "A100-80GB", "A100-80GB"]
    with pytest.raises(ConfigError, match=r"--bf16: the plan's attention pool has .*V100-32GB \(ranks \[0, 1\]\)"):
        validate_job(_cfg(tiny, bf16=True), 4, plan, run=HeteroRunConfig(expert_precision="fp16"))
    validate_job(_cfg(tiny, fp16=True), 4, plan, run=HeteroRunConfig(expert_precision="bf16"))
    # fp32 next to a 16-bit pool: Megatron's fp32 optimizer would not take the loss scale out.
    for world, expert in ((dict(bf16=True), "fp32"), (dict(fp16=True), "fp32"), ({}, "fp16"), ({}, "bf16")):
        with pytest.raises(ConfigError, match=r"pools of different precision must both be 16-bit"):
            validate_job(_cfg(tiny, **world), 4, plan, run=HeteroRunConfig(expert_precision=expert))
    plan.save(tmp_path / "plan.json")
    with pytest.raises(SystemExit) as e:
        train_args.main(["--model", "tiny", "--micro-batch-size", "1", "--global-batch-size", "4", "--fp16",
                         "--hetero-plan", str(tmp_path / "plan.json"), "--hetero-expert-precision", "fp32"])
    assert e.value.code == 2
    assert "--hetero-expert-precision fp32 with --fp16" in capsys.readouterr().err
    # The world's loss scale: dynamic when either pool is fp16 (and then no NaN check).
    pools = HeteroRunConfig(expert_precision="fp16").pools(_cfg(tiny, bf16=True))
    assert (pools.attention, pools.expert, pools.wire, pools.mixed) == ("bf16", "fp16", "fp16", True)
    assert pools.dynamic_scale(None) and not pools.dynamic_scale(128.0)
    assert _cfg(tiny, bf16=True).nan_check_mode(pools) == "off" and _cfg(tiny, bf16=True).nan_check_mode() == "stop"


def test_loss_scale_flags(tiny):
    a = train_args.build_parser().parse_args(["--fp16"])
    cfg = train_args.config_from_args(a)
    # Megatron-LM's defaults: dynamic scale from 2**32, floor 1, window 1000, hysteresis 2.
    assert (cfg.fp16, cfg.bf16, cfg.loss_scale, cfg.initial_loss_scale, cfg.min_loss_scale, cfg.loss_scale_window,
            cfg.hysteresis) == (True, False, None, 2.0**32, 1.0, 1000, 2)
    assert cfg.precision == "fp16" and cfg.nan_check_mode() == "off"  # overflow is the scaler's signal
    a = train_args.build_parser().parse_args(["--bf16", "--loss-scale", "128"])
    cfg = train_args.config_from_args(a)
    assert (cfg.precision, cfg.loss_scale, cfg.nan_check_mode()) == ("bf16", 128.0, "stop")
    with pytest.raises(ConfigError, match="--loss-scale 128.0: scales the loss of --fp16/--bf16 runs only"):
        validate_job(_cfg(tiny, loss_scale=128.0), 4)
    with pytest.raises(ConfigError, match="--min-loss-scale 8.0: is above --initial-loss-scale 4.0"):
        validate_job(_cfg(tiny, fp16=True, initial_loss_scale=4.0, min_loss_scale=8.0), 4)
    with pytest.raises(ConfigError, match="--hysteresis 0: must be an integer >= 1"):
        validate_job(_cfg(tiny, fp16=True, hysteresis=0), 4)
    with pytest.raises(ConfigError, match="--hetero-ckpt-reshard with --bf16"):
        validate_job(_cfg(tiny, bf16=True, ckpt_reshard=True), 4)


class _Recorder:
    """A split-size transport that records what it was given to send and sends it back."""

    def __init__(self):
        self.sent = []

    def move(self, x, out_splits, in_splits, direction, async_op=False):
        self.sent.append(x)
        return x.clone()


def test_split_route_casts_to_the_wire_dtype_and_back():
    wire = _Recorder()
    route = SplitRoute((0,), (0,), torch.zeros(1, 1, dtype=torch.int64), wire, 8, torch.float16,
                       torch.device("cpu"), torch.bfloat16)
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    got = route.to_experts(x)
    assert wire.sent[-1].dtype == torch.float16 and got.dtype == torch.float16  # the wire's
    assert route.arrived(got).dtype == torch.bfloat16
    assert torch.equal(route.arrived(got), x)  # bf16 -> fp16 -> bf16 is exact in fp16's range
    route.to_attention(torch.zeros(0, 8, dtype=torch.float16))  # the wire dtype passes as it is
    assert wire.sent[-1].dtype == torch.float16
    with pytest.raises(TypeError, match=r"SplitRoute.to_attention: sending a torch.float32 tensor on a torch.float16 "
                                        r"route whose rank computes in torch.bfloat16"):
        route.to_attention(torch.zeros(0, 8))
    one = SplitRoute((0,), (0,), torch.zeros(1, 1, dtype=torch.int64), wire, 8, torch.bfloat16,
                     torch.device("cpu"))  # one precision: compute is the wire dtype
    with pytest.raises(TypeError, match=r"sending a torch.float32 tensor on a torch.bfloat16 route"):
        one.to_experts(torch.zeros(0, 8))


# ---- (d) per-pool precision: bf16 attention ranks, fp16 expert ranks ----------------------
# Against fp32 (initial loss scale 4096, no overflow), 4 free-running steps, tiny, measured
# worst over 2+2 R=2 and Asym-EA 2x(1+1) R=2 (distep and zebra with both issuers give the same
# losses bitwise), ATEN_CPU_CAPABILITY default/avx2/avx512: losses 1.02e-4 (pure bf16 on 2+2:
# 1.2e-4); first-step gradients 3.97e-2 of the category's largest (bf16 round-off, free routing).
MIXED_VS_FP32_LOSS_TOL = 1e-3
MIXED_VS_FP32_GRAD_TOL = 0.25


@pytest.mark.slow
@pytest.mark.parametrize("name", ["2+2", "asym-ea 2x(1+1)"])
def test_bf16_attention_fp16_experts_train_close_to_fp32(tiny, name):
    plan = (even_plan(tiny.num_layers, tiny.num_experts, 2, 2, num_microbatches=2, schedule="zebra")
            if name == "2+2" else asym_ea_plan())
    base = TrainConfig(tiny, micro_batch_size=1, global_batch_size=4, train_iters=4, quiet=True)
    grads = RunHooks(collect_grads=True)
    fp32 = launch(train_args._rank_main, 4, base, plan, HeteroRunConfig(), grads, timeout_s=600)[0]
    mixed = dataclasses.replace(base, bf16=True, initial_loss_scale=4096.0)
    runs = {(schedule, issuer): launch(train_args._rank_main, 4, mixed, plan,
                                       HeteroRunConfig(schedule=schedule, expert_precision="fp16",
                                                       zebra_issuer=issuer), grads, timeout_s=600)
            for schedule, issuer in (("distep", "auto"), ("zebra", "threads"), ("zebra", "single"))}
    for key, got in runs.items():
        for rank, r in enumerate(got):
            want = "torch.bfloat16" if rank in plan.attention_ranks else "torch.float16"
            assert r.param_dtypes == [want], (key, rank, r.param_dtypes)
            assert r.loss_scales == [4096.0] * 4 and r.overflow_skipped == [], (key, rank)
        # The three transports cast at the same places: the same losses, bitwise.
        assert got[0].losses == runs["distep", "auto"][0].losses, key
    got = runs["zebra", "threads"][0]
    within("bf16/fp16 pools vs fp32 loss", _max_rel(got.losses, fp32.losses), MIXED_VS_FP32_LOSS_TOL)
    grads = diff_by_category(got.grads[0], fp32.grads[0], scale="category")
    within("bf16/fp16 pools vs fp32 first-step grad", max(grads.values()), MIXED_VS_FP32_GRAD_TOL)


@pytest.mark.slow
def test_an_fp16_overflow_on_the_wire_skips_the_bf16_ranks_step_too(tiny):
    # 2**24 times the attention ranks' bf16 gradients does not fit in fp16: the expert ranks see
    # inf once the gradients cross, and the whole world skips and halves until it fits.
    plan = even_plan(tiny.num_layers, tiny.num_experts, 2, 2, num_microbatches=2, schedule="zebra")
    cfg = TrainConfig(tiny, micro_batch_size=1, global_batch_size=4, train_iters=6, quiet=True, bf16=True,
                      initial_loss_scale=2.0**24, hysteresis=1)
    got = launch(train_args._rank_main, 4, cfg, plan, HeteroRunConfig(expert_precision="fp16"), timeout_s=600)
    skipped, scales = got[0].overflow_skipped, got[0].loss_scales
    for rank, r in enumerate(got):
        assert (r.overflow_skipped, r.loss_scales) == (skipped, scales), rank
    assert skipped and skipped == list(range(len(skipped))) and len(skipped) < cfg.train_iters, skipped
    assert scales == [2.0**(23 - min(i, len(skipped) - 1)) for i in range(cfg.train_iters)], scales
    assert all(math.isfinite(x) for x in got[0].losses)


@pytest.mark.slow
def test_per_pool_resume_is_bitwise_and_the_expert_precision_is_checked(tiny, tmp_path):
    plan = even_plan(tiny.num_layers, tiny.num_experts, 2, 2, num_microbatches=2, schedule="zebra")
    cfg = TrainConfig(tiny, micro_batch_size=1, global_batch_size=4, train_iters=4, quiet=True, deterministic=True,
                      bf16=True, initial_loss_scale=4096.0, save=str(tmp_path), save_interval=2)
    run = HeteroRunConfig(expert_precision="fp16")
    full = launch(train_args._rank_main, 4, cfg, plan, run, timeout_s=600)[0]
    again = dataclasses.replace(cfg, save=None, load=str(tmp_path), ckpt_step=2)
    resumed = launch(train_args._rank_main, 4, again, plan, run, timeout_s=600)[0]
    assert resumed.losses == full.losses[2:] and resumed.loss_scales == [4096.0] * 2
    with pytest.raises(Exception, match=r"its expert ranks ran fp16, this run's run bf16; load it with "
                                         r"--hetero-expert-precision fp16"):
        launch(train_args._rank_main, 4, again, plan, HeteroRunConfig(), timeout_s=600)
