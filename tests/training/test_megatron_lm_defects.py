"""Defects of Megatron-LM's pretrain() with --hetero-plan found by review (issue 24), each
reproduced as a Megatron user runs it, from a core_v0.16.1 checkout (MEGATRON_LM_DIR)."""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch
from margins import within
from megatron_lm_run import (
    BATCH,
    CPU,
    DATA,
    MEGATRON_DEFAULTS,
    MODEL,
    RECIPE,
    load_dcp,
    plugin_losses,
    run_losses,
)
from shared_plans import sparse_asym_ea_plan

from megatron_hetermoe.plan.hetero_plan import even_plan

pytestmark = pytest.mark.slow
EVAL_OFF = ["--log-interval", "1", "--eval-interval", "100", "--eval-iters", "0"]


def _max_diff(a: dict[int, float], b: dict[int, float]) -> float:
    assert sorted(a) == sorted(b), (a, b)
    return max(abs(a[i] - b[i]) for i in a)


def _plan(tmp_path, schedule: str, m: int = 1, n: int = 1, groups: int = 1):
    path = tmp_path / f"plan-{schedule}-{m}+{n}x{groups}.json"
    even_plan(2, 4, m, n, groups=groups, num_microbatches=8 // (2 * m * groups), schedule=schedule).save(path)
    return str(path)


@pytest.mark.parametrize("positions", [[], ["--position-embedding-type", "none"]], ids=["learned_absolute", "none"])
def test_zebra_trains_megatrons_default_model_as_distep_does(mlm, data, tmp_path, positions):
    """Issue 24 item 2: Megatron's default model (GeLU, LayerNorm, learned absolute positions,
    tied embeddings), and one without position embeddings, under zebra: the losses of DistEP
    (Megatron's own schedule and MoELayer.forward). Zebra crashed on any model without RoPE."""
    flags = [*MODEL, *BATCH, *DATA, *CPU, *MEGATRON_DEFAULTS, *positions, *EVAL_OFF, "--data-path", data]
    losses = {s: run_losses(mlm, tmp_path, 2, [*flags, "--hetero-plan", _plan(tmp_path, s)], s)[0]
              for s in ("zebra", "distep")}
    assert sorted(losses["zebra"]) == sorted(losses["distep"]) == [1, 2, 3]
    within("zebra vs distep, Megatron's default model", _max_diff(losses["zebra"], losses["distep"]), 3e-6)


def test_zebra_uses_the_document_attention_mask(mlm, data, tmp_path):
    """Issue 24 item 10: --reset-attention-mask (document masking) under zebra trains with the
    data loader's mask, as DistEP does; that mask changes the losses (the test's data has
    documents shorter than some samples), so a zebra run that dropped it would fail here. The
    recipe's RoPE model: zebra ran it before, with a plain causal mask."""
    flags = [*MODEL, *BATCH, *DATA, *CPU, *RECIPE, *EVAL_OFF, "--data-path", data]
    reset = ["--reset-attention-mask", "--reset-position-ids"]
    zebra, _ = run_losses(mlm, tmp_path, 2, [*flags, *reset, "--hetero-plan", _plan(tmp_path, "zebra")], "zebra")
    distep, _ = run_losses(mlm, tmp_path, 2, [*flags, *reset, "--hetero-plan", _plan(tmp_path, "distep")], "distep")
    causal, _ = run_losses(mlm, tmp_path, 2, [*flags, "--reset-position-ids", "--hetero-plan",
                                               _plan(tmp_path, "distep")], "causal")
    within("zebra vs distep, --reset-attention-mask", _max_diff(zebra, distep), 3e-6)
    assert _max_diff(causal, distep) > 1e-4, (causal, distep)


def test_global_grad_norm_counts_experts_on_every_attention_rank(mlm, data, tmp_path):
    """Issue 24 item 9: on a 2+2 Asym-EA plan whose second attention rank holds an expert (and
    whose second expert rank holds none in layer 1), pretrain()'s gradient norm is Megatron EP's
    at identical parameters (a plain EP checkpoint loaded into HeterMoE), and with clipping
    active the losses are the plugin trainer's. Gradient-norm ownership was one flag per rank,
    which left out the experts of every attention rank but the first."""
    plan = tmp_path / "plan.json"
    sparse_asym_ea_plan().save(plan)
    flags = [*MODEL, *BATCH, *DATA, *CPU, *RECIPE, *EVAL_OFF, "--data-path", data, "--moe-aux-loss-coeff", "0.01"]
    ep = ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall"]
    ckpt = tmp_path / "ckpt"
    ep_norm, _ = run_losses(mlm, tmp_path, 2, [*flags, *ep, "--save", str(ckpt), "--save-interval", "2"], "ep",
                            tag="grad-norm")
    het_norm, _ = run_losses(mlm, tmp_path, 4, [*flags, "--hetero-plan", str(plan), "--load", str(ckpt),
                                                "--ckpt-step", "2", "--no-load-optim", "--no-load-rng"], "hetero",
                             tag="grad-norm")
    assert sorted(het_norm) == [3]
    within("grad norm at identical parameters, HeterMoE vs Megatron EP", abs(het_norm[3] - ep_norm[3]) / ep_norm[3],
           1e-5)
    # Clipping at 0.05 (below every norm here): a wrong norm changes every update.
    clip = ["--clip-grad", "0.05"]
    megatron, _ = run_losses(mlm, tmp_path, 4, [*flags, *clip, "--hetero-plan", str(plan)], "clipped")
    plugin = plugin_losses(tmp_path, plan, "zebra", data, ("--moe-aux-loss-coeff", "0.01", *clip))
    within("pretrain() vs plugin trainer, clipped", max(abs(megatron[i] - plugin[i - 1]) for i in (1, 2, 3)), 3e-6)


def test_second_save_with_assume_constant_structure(mlm, data, tmp_path):
    """Issue 24 item 4: --ckpt-assume-constant-structure (Megatron's MoE CI sets it) on a 1x(2+2)
    plan: the attention ranks' save group (their DP group) has 2 ranks and caches its save
    layout; the expert ranks' (their replica group) has 1, for which megatron-core caches
    nothing, so at the second save they re-entered a world-wide all_gather_object the attention
    ranks skip. Both saves complete and the second loads."""
    flags = [*MODEL, *BATCH, *DATA, *CPU, *RECIPE, *EVAL_OFF, "--data-path", data, "--distributed-timeout-minutes", "1",
             "--ckpt-assume-constant-structure", "--ckpt-format", "torch_dist"]
    ckpt = tmp_path / "ckpt"
    plan = _plan(tmp_path, "zebra", 2, 2)
    run_losses(mlm, tmp_path, 4, [*flags, "--hetero-plan", plan, "--save", str(ckpt), "--save-interval", "1"], "save")
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    assert all((ckpt / f"iter_000000{i}" / "metadata.json").exists() for i in (1, 2, 3))
    resumed, log = run_losses(mlm, tmp_path, 4, [*flags, "--hetero-plan", plan, "--load", str(ckpt), "--ckpt-step",
                                                 "2"], "resume")
    assert sorted(resumed) == [3] and "at iteration 2" in log


@pytest.mark.parametrize("schedule", ["distep", "zebra"])
def test_timing_log_level_2(mlm, data, tmp_path, schedule):
    """Issue 24 item 5: --timing-log-level 2 with Megatron's default --barrier-with-L1-time, on a
    plan where the roles run different gradient finalization and different numbers of
    sub-optimizers (attention rank 0 a dense one, attention rank 1 a dense and an expert one,
    expert ranks an expert one). The run trains, and Megatron's timing lines report the
    forward-backward time of every rank."""
    plan = tmp_path / "plan.json"
    sparse_asym_ea_plan(schedule).save(plan)
    flags = [*MODEL, *BATCH, *DATA, *CPU, *RECIPE, *EVAL_OFF, "--data-path", data, "--distributed-timeout-minutes", "1",
             "--timing-log-level", "2", "--timing-log-option", "all"]
    losses, log = run_losses(mlm, tmp_path, 4, [*flags, "--hetero-plan", str(plan)], "timed")
    assert sorted(losses) == [1, 2, 3]
    # --timing-log-option all: "  forward-backward:" then "     rank  N: <ms>" for each rank that timed it.
    blocks = re.findall(r"\n  forward-backward:((?:\n     rank +\d+: [0-9.]+)+)", log)
    assert len(blocks) == 3, log[-3000:]
    assert all(sorted(map(int, re.findall(r"rank +(\d+):", b))) == [0, 1, 2, 3] for b in blocks), blocks


def test_rampup_batch_size(mlm, data, tmp_path):
    """Issue 24 item 6: Megatron's --rampup-batch-size grows the global batch (4, 4, 6, then the
    full 8 sequences) and with it the microbatches per step (2, 2, 3, 4 on one attention rank; the
    plan's R=4 is the full batch's). Zebra's task lists follow the step's count on both roles;
    the losses are DistEP's (which runs Megatron's own schedule)."""
    flags = [*MODEL, *DATA, *CPU, *RECIPE, *EVAL_OFF, "--data-path", data, "--distributed-timeout-minutes", "1",
             "--micro-batch-size", "2", "--global-batch-size", "8", "--train-samples", "26", "--lr", "1e-3",
             "--rampup-batch-size", "4", "2", "12"]
    zebra, log = run_losses(mlm, tmp_path, 2, [*flags, "--hetero-plan", _plan(tmp_path, "zebra")], "zebra")
    distep, _ = run_losses(mlm, tmp_path, 2, [*flags, "--hetero-plan", _plan(tmp_path, "distep")], "distep")
    sizes = [int(b) for b in re.findall(r"global batch size: +(\d+) \|", log)]
    assert sizes == [4, 4, 6, 8], sizes  # Megatron: +2 every 12 / 2 = 6 ramp samples
    within("zebra vs distep under batch-size ramp-up", _max_diff(zebra, distep), 3e-6)


def test_logging_rank_reports_the_jobs_samples(mlm, data, tmp_path):
    """Issue 24 item 11: Megatron-LM logs from its last rank, an expert rank on a 1x(2+2) plan;
    its consumed samples (which batch-size ramp-up and sample-based schedules read too) counted
    the expert replica group's data-parallel size. Every iteration line reports the job's: 8
    sequences a step."""
    flags = [*MODEL, *BATCH, *DATA, *CPU, *RECIPE, *EVAL_OFF, "--data-path", data]
    _, log = run_losses(mlm, tmp_path, 4, [*flags, "--hetero-plan", _plan(tmp_path, "zebra", 2, 2)], "log")
    consumed = [int(c) for c in re.findall(r"consumed samples: +(\d+) \|", log)]
    assert consumed == [8, 16, 24], consumed


def test_init_flags_are_megatrons(mlm, data, tmp_path):
    """Issue 24 item 12: Megatron's init flags reach the layout-invariant init, which took
    --init-method-std alone and refused the rest. --init-method-std 0.05 with
    --embedding-init-method-std 0.5: the initial weights (one step at --lr 0, saved) of HeterMoE and
    of Megatron EP's own init have the same std per tensor (embeddings 0.5, output projections
    0.05/sqrt(2L), the rest 0.05). (--init-method-xavier-uniform crashes plain Megatron-LM at
    core_v0.16.1 and core_v0.19.0 alike: it sets a TransformerConfig field that does not exist,
    scaled_init_method; tests/models/test_init.py checks xavier on the config Megatron means.)"""
    flags = [*MODEL, *DATA, *CPU, *MEGATRON_DEFAULTS, *EVAL_OFF, "--data-path", data, "--micro-batch-size", "2",
             "--global-batch-size", "8", "--train-iters", "1", "--lr", "0", "--init-method-std", "0.05",
             "--embedding-init-method-std", "0.5", "--ckpt-format", "torch_dist", "--save-interval", "1"]
    ep = ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall"]
    run_losses(mlm, tmp_path, 2, [*flags, *ep, "--save", str(tmp_path / "ep")], "tb_ep")
    run_losses(mlm, tmp_path, 4, [*flags, "--hetero-plan", _plan(tmp_path, "zebra", 1, 1, 2), "--save",
                                  str(tmp_path / "het")], "tb_het")
    ep_w, het_w = (load_dcp(tmp_path / d / "iter_0000001") for d in ("ep", "het"))
    weights = [k for k in ep_w if not k.startswith("optimizer.") and k.endswith(".weight") and "norm" not in k]
    assert len(weights) == 7 and set(weights) <= set(het_w)  # embeddings, QKV, proj, router, expert fc1/fc2
    for k in weights:
        a, b = ep_w[k].float(), het_w[k].float()
        assert a.shape == b.shape and not torch.equal(a, b), k  # Megatron's own draw and HeterMoE's differ
        # Two estimates of one std from n draws differ by ~1/sqrt(n) relative: 5x that.
        assert abs(b.std().item() / a.std().item() - 1) < max(0.05, 5 / a.numel() ** 0.5), (k, a.std(), b.std())
        if "embedding" in k:
            assert abs(b.std().item() - 0.5) < 0.05, k


@pytest.fixture(scope="module")
def ep_checkpoint(mlm, data, tmp_path_factory) -> Path:
    """Megatron-LM's own EP run (2 ranks, EP 2, 2 iterations) saved with torch_dist."""
    tmp = tmp_path_factory.mktemp("ep")
    flags = [*MODEL, *BATCH, *DATA, *CPU, *RECIPE, *EVAL_OFF, "--data-path", data, "--moe-aux-loss-coeff", "0.01",
             "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall", "--train-iters", "2",
             "--save", str(tmp / "ckpt"), "--save-interval", "2"]
    run_losses(mlm, tmp, 2, flags, "tb")
    return tmp / "ckpt"


@pytest.mark.parametrize("schedule, issuer", [("zebra", "threads"), ("zebra", "single"), ("distep", "auto")])
def test_every_member_enters_every_collective_in_one_order(mlm, data, tmp_path, ep_checkpoint, schedule, issuer):
    """Issue 24 item 7 (a pretrain() run that hung once in three at its first step): the run that
    hung (2+2 Asym-EA, a plain Megatron EP checkpoint loaded, --tensorboard-dir on an expert
    logging rank, evaluation) traced: on every process group (world, dispatch, combine, counts,
    DDP's, the logging rank's gathers) every member entered the same collectives in the same
    order, each group from one thread at a time. A violation fails here in every run, not in the
    one whose timing hangs."""
    from megatron_hetermoe.reliability import collective_trace

    plan = tmp_path / "plan.json"
    sparse_asym_ea_plan(schedule).save(plan)
    trace = tmp_path / "trace"
    flags = [*MODEL, *BATCH, *DATA, *CPU, *RECIPE, "--data-path", data, "--moe-aux-loss-coeff", "0.01",
             "--log-interval", "1", "--eval-interval", "3", "--eval-iters", "1", "--train-iters", "4",
             "--hetero-plan", str(plan), "--hetero-zebra-issuer", issuer, "--load", str(ep_checkpoint),
             "--no-load-optim", "--no-load-rng", "--distributed-timeout-minutes", "1"]
    os.environ[collective_trace.ENV] = str(trace)
    try:
        losses, _ = run_losses(mlm, tmp_path, 4, flags, "tb")
    finally:
        del os.environ[collective_trace.ENV]
    assert sorted(losses) == [3, 4]
    assert len(list(trace.glob("collectives.rank*.jsonl"))) == 4
    assert collective_trace.check(trace) == []
