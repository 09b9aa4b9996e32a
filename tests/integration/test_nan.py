"""--check-for-nan-in-loss-and-grad: detection, the rank and layer reported, stop and skip,
in the baseline Megatron trainer and the HeterMoE trainer (both schedules)."""
from __future__ import annotations

import argparse
import math

import pytest
import torch

from megatron_hetermoe.cli.train import add_megatron_args
from megatron_hetermoe.config import ParallelConfig, TrainConfig
from megatron_hetermoe.parallel.launcher import LaunchError
from megatron_hetermoe.plan.hetero_plan import even_plan
from megatron_hetermoe.training.args import config_from_args, run
from megatron_hetermoe.training.nan_check import NanGuard, NanInjection, layer_of
from megatron_hetermoe.training.run_hooks import RunHooks


def _hetero(tiny, schedule: str, steps: int, mode: str, inj: NanInjection | None):
    plan = even_plan(tiny.num_layers, tiny.num_experts, 2, 2, num_microbatches=1, schedule=schedule)
    cfg = TrainConfig(tiny, micro_batch_size=1, global_batch_size=2, train_iters=steps, quiet=True,
                      check_for_nan_in_loss_and_grad=mode)
    return run(cfg, plan.world_size, plan=plan, hooks=RunHooks(collect_grads=True, nan_injection=inj))


def _baseline(tiny, steps: int, mode: str, inj: NanInjection | None):
    cfg = TrainConfig(tiny, ParallelConfig(ep=2), micro_batch_size=1, global_batch_size=2, train_iters=steps,
                      quiet=True, check_for_nan_in_loss_and_grad=mode)
    return run(cfg, 2, hooks=RunHooks(collect_grads=True, nan_injection=inj))


def _same_params(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
@pytest.mark.parametrize("schedule, rank, param, expect", [
    ("distep", 1, "decoder.layers.0.self_attention.linear_qkv", r"rank 1 \(attention\) layer 0: gradient of "
                                                                  r"decoder\.layers\.0\.self_attention\.linear_qkv\.weight"),
    ("zebra", 3, "decoder.layers.1.mlp.experts", r"rank 3 \(expert\) layer 1: gradient of "
                                                  r"decoder\.layers\.1\.mlp\.experts\.local_experts\.2\."),
])
def test_stop_reports_rank_and_layer_on_every_rank(tiny, schedule, rank, param, expect):
    with pytest.raises(LaunchError, match=r"NonFiniteError: non-finite loss or gradient at iteration 2 .*" + expect):
        _hetero(tiny, schedule, 3, "stop", NanInjection(step=1, rank=rank, param=param))


@pytest.mark.slow
def test_stop_on_a_non_finite_loss_in_the_baseline(tiny):
    with pytest.raises(LaunchError, match=r"iteration 1 .*rank 1 \(megatron\): non-finite local loss"):
        _baseline(tiny, 2, "stop", NanInjection(step=0, rank=1, target="loss"))


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["distep", "zebra"])
def test_skip_makes_no_update_and_training_goes_on(tiny, schedule):
    # A NaN in one expert rank's gradient on the last of 2 steps: the weights must be exactly
    # those after 1 clean step, on every rank (the experts' and the attention ranks' alike).
    bad = _hetero(tiny, schedule, 2, "skip", NanInjection(step=1, rank=2, param="decoder.layers.0.mlp.experts"))
    clean = _hetero(tiny, schedule, 1, "skip", None)
    assert bad.skipped == [1] and clean.skipped == []
    assert bad.losses[0] == clean.losses[0]
    assert _same_params(bad.params, clean.params)


@pytest.mark.slow
def test_skip_in_the_baseline_continues_after_a_nan_loss(tiny):
    r = _baseline(tiny, 3, "skip", NanInjection(step=1, rank=0, target="loss"))
    assert r.skipped == [1]
    assert math.isnan(r.losses[1]) and all(math.isfinite(x) for x in (r.losses[0], r.losses[2]))
    assert all(torch.isfinite(v).all() for v in r.params.values())
    # Skipped before the update: identical to a 1-step run followed by nothing.
    two = _baseline(tiny, 2, "skip", NanInjection(step=1, rank=1, param="decoder.layers.1.mlp.router"))
    one = _baseline(tiny, 1, "skip", None)
    assert two.skipped == [1] and _same_params(two.params, one.params)


@pytest.mark.slow
def test_off_lets_the_fault_through(tiny):
    # Without the check the NaN reaches the weights: proof that the check is what stops it.
    r = _baseline(tiny, 2, "off", NanInjection(step=0, rank=0, param="decoder.layers.0.mlp.router"))
    assert r.skipped == []
    assert not all(torch.isfinite(v).all() for v in r.params.values())


def test_flag_keeps_megatrons_name_and_default():
    p = argparse.ArgumentParser()
    add_megatron_args(p)
    mode = lambda *argv: config_from_args(p.parse_args(list(argv))).check_for_nan_in_loss_and_grad  # noqa: E731
    assert mode() == "stop"
    assert mode("--check-for-nan-in-loss-and-grad") == "stop"
    assert mode("--check-for-nan-in-loss-and-grad", "skip") == "skip"
    assert mode("--no-check-for-nan-in-loss-and-grad") == "off"
    with pytest.raises(SystemExit):
        p.parse_args(["--check-for-nan-in-loss-and-grad", "ignore"])


def test_layer_names_and_bad_injection():
    assert layer_of("decoder.layers.12.mlp.router.weight") == "layer 12"
    assert layer_of("embedding.word_embeddings.weight") == "embedding"
    assert layer_of("output_layer.weight") == "output layer"
    p = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match="matches no parameter on rank 0"):
        NanGuard("stop", [], {p: "decoder.layers.0.mlp.router.weight"}, 0, "megatron",
                 injection=NanInjection(step=0, rank=0, param="experts"))
    with pytest.raises(ValueError, match="use one of"):
        NanGuard("warn", [], {}, 0, "megatron")
