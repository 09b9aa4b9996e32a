"""Kernels are chosen per pool from its ranks' GPUs (issue 43 item 5): transformer-engine only where
every rank of a pool runs it (compute capability 8.0+), so the ranks that share a gradient
reduction keep one parameter layout. No GPU is needed: each rank's capability and what imports
there are injected."""
from __future__ import annotations

import types

import pytest
import torch

from megatron_hetermoe.config import HeteroRunConfig, ModelConfig, TrainConfig
from megatron_hetermoe.models import builder
from megatron_hetermoe.models.builder import KernelError, RankEnv
from megatron_hetermoe.training.hetero import pool_kernels
from shared_plans import asym_ea_plan

H100 = dict(gpu="NVIDIA H100 80GB HBM3", capability=(9, 0))
A100 = dict(gpu="NVIDIA A100-SXM4-80GB", capability=(8, 0))
V100 = dict(gpu="Tesla V100-SXM2-16GB", capability=(7, 0))
TE = dict(te=True, te_grouped=True, te_why="transformer-engine 2.4", te_rope=True, te_permute=True)


def gpu(rank: int, card: dict, te: bool = True, **kw) -> RankEnv:
    return RankEnv("cuda", rank, **card, **(TE if te else {"te_why": "transformer_engine does not import"}), **kw)


def _cfg(**kw) -> TrainConfig:
    return TrainConfig(ModelConfig.load("tiny"), **kw)


# asym_ea_plan: attention ranks 0 and 2 (each also holds Asym-EA experts), expert ranks 1 and 3.
def _pools(envs: list[RankEnv], **kw) -> dict:
    cfg = _cfg(**kw)
    return pool_kernels(cfg, asym_ea_plan(), HeteroRunConfig().pools(cfg), envs)


def test_v100_expert_pool_runs_local_and_h100_attention_pool_runs_te():
    envs = [gpu(0, H100), gpu(1, V100), gpu(2, H100), gpu(3, V100)]
    got = _pools(envs)
    assert (got["attention"].name, got["expert"].name) == ("te", "local"), got
    assert "rank 1 (Tesla V100-SXM2-16GB, compute capability 7.0)" in got["expert"].reason, got["expert"].reason
    assert "compute capability 9.0" in got["attention"].reason, got["attention"].reason


def test_the_oldest_gpu_of_a_pool_decides_for_all_of_it():
    """One V100 among the expert ranks keeps TE off every expert rank (their replica groups reduce
    expert gradients together), and an A100 (8.0) is new enough."""
    envs = [gpu(0, A100), gpu(1, H100), gpu(2, H100), gpu(3, V100)]
    got = _pools(envs)
    assert (got["attention"].name, got["expert"].name) == ("te", "local"), got
    assert "rank 3 (Tesla V100" in got["expert"].reason
    assert "compute capability 8.0" in got["attention"].reason


def test_all_v100_runs_local():
    got = _pools([gpu(r, V100) for r in range(4)])
    assert (got["attention"].name, got["expert"].name) == ("local", "local"), got


def test_te_missing_on_one_rank_keeps_its_pool_local():
    got = _pools([gpu(0, H100), gpu(1, H100), gpu(2, H100), gpu(3, H100, te=False)])
    assert (got["attention"].name, got["expert"].name) == ("te", "local"), got
    assert "rank 3" in got["expert"].reason and "does not import" in got["expert"].reason


def test_explicit_te_with_a_v100_in_a_pool_names_the_rank_its_gpu_and_the_fix():
    with pytest.raises(KernelError) as e:
        _pools([gpu(0, H100), gpu(1, V100), gpu(2, H100), gpu(3, H100)], transformer_impl="transformer_engine")
    msg = str(e.value)
    assert "--transformer-impl transformer_engine: rank 1 (Tesla V100-SXM2-16GB, compute capability 7.0)" in msg, msg
    assert "8.0 (Ampere) and newer" in msg and "--transformer-impl local" in msg and "leave the flag out" in msg, msg


def test_explicit_te_on_a_new_enough_pool_is_megatron_s_meaning():
    got = _pools([gpu(r, H100) for r in range(4)], transformer_impl="transformer_engine")
    assert {c.name for c in got.values()} == {"te_sequential"}  # no --moe-grouped-gemm: SequentialMLP


def test_every_rank_computes_both_pools_so_a_bad_request_fails_everywhere():
    """pool_kernels takes no rank: an expert rank raises the attention pool's error too."""
    envs = [gpu(0, V100), gpu(1, H100), gpu(2, H100), gpu(3, H100)]
    with pytest.raises(KernelError, match="rank 0 "):
        _pools(envs, transformer_impl="transformer_engine")


def test_the_rank_s_gpu_is_probed(monkeypatch):
    """probe_rank reads the capability and GPU name from torch.cuda (injected here)."""
    monkeypatch.setattr(builder, "device_capability", lambda device: (7, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100-SXM2-32GB")
    monkeypatch.setattr(builder, "transformer_engine_status", lambda: (True, True, "transformer-engine 2.4"))
    env = builder.probe_rank("cuda", 6)
    assert (env.device, env.rank, env.capability, env.te) == ("cuda", 6, (7, 0), True)
    assert env.te_blocker() == ("rank 6 (Tesla V100-SXM2-32GB, compute capability 7.0): transformer-engine supports "
                                "compute capability 8.0 (Ampere) and newer")
    assert builder.choose_kernels("cuda", "fp16").name == "local"  # this rank alone: its own GPU


def test_cpu_ranks_probe_nothing():
    env = builder.probe_rank("cpu", 3)
    assert env == RankEnv("cpu", 3) and not env.te and env.te_blocker() == "rank 3 (CPU): transformer-engine runs " \
                                                                          "on CUDA ranks only"


def test_check_before_launch_names_this_rank_s_gpu(monkeypatch, capsys):
    """A torchrun rank's check (training/args.py check_kernels) refuses an explicit TE on its V100."""
    from megatron_hetermoe.training.args import build_parser, check_kernels

    monkeypatch.setenv("RANK", "5")
    monkeypatch.setattr(builder, "probe_rank", lambda device, rank=None: gpu(rank, V100))
    with pytest.raises(SystemExit):
        check_kernels(build_parser(), _cfg(transformer_impl="transformer_engine"), "cuda")
    err = capsys.readouterr().err
    assert "rank 5 (Tesla V100-SXM2-16GB, compute capability 7.0)" in err, err


# ---- Megatron-LM's pretrain() (megatron_lm/hooks.py) ------------------------------------------------
def test_megatron_lm_default_te_falls_back_on_a_v100_pool_and_explicit_te_is_refused():
    v100s, h100s = [gpu(1, V100), gpu(3, V100)], [gpu(0, H100), gpu(2, H100)]
    assert builder.megatron_lm_kernels("transformer_engine", False, True, "bf16", h100s).name == "te"
    assert builder.megatron_lm_kernels("transformer_engine", False, False, "bf16", h100s).name == "te_sequential"
    fell = builder.megatron_lm_kernels("transformer_engine", False, False, "fp16", v100s)
    assert fell.name == "local" and "rank 1 (Tesla V100" in fell.reason and "default" in fell.reason, fell
    # --moe-grouped-gemm where the legacy GroupedMLP cannot run either (fp16, no grouped_gemm): SequentialMLP, said so
    fell = builder.megatron_lm_kernels("transformer_engine", False, True, "fp16", v100s)
    assert fell.name == "local" and "GroupedMLP" in fell.reason, fell
    with pytest.raises(KernelError, match=r"rank 1 \(Tesla V100-SXM2-16GB, compute capability 7.0\)"):
        builder.megatron_lm_kernels("transformer_engine", True, False, "fp16", v100s)
    assert builder.megatron_lm_kernels("local", True, False, "fp16", h100s).name == "local"


def test_megatron_lm_rank_config_follows_its_pool_and_its_gpu():
    """HeteroPretrain._rank_config: an expert rank on a V100 pool that fell back from Megatron-LM's
    default TE gets the local spec and loses the fusions its GPU cannot run (TE's RoPE and
    permute), the reason printed by the pool's first rank."""
    from megatron_hetermoe.megatron_lm.hooks import HeteroPretrain

    envs = [gpu(0, H100, apex_wgrad=True), gpu(1, V100, apex_wgrad=True), gpu(2, H100), gpu(3, V100)]
    run = HeteroPretrain([], plan=asym_ea_plan())
    run.envs = envs
    run.kernels = {"attention": builder.megatron_lm_kernels("transformer_engine", False, False, "fp16", envs[0::2]),
                   "expert": builder.megatron_lm_kernels("transformer_engine", False, False, "fp16", envs[1::2])}
    args = types.SimpleNamespace(transformer_impl="transformer_engine", normalization="RMSNorm")
    megatron_lm = types.SimpleNamespace(**{f.value: r.megatron_lm for f, r in builder.FUSION_RULES.items()})
    run.hs = types.SimpleNamespace(role="expert", rank=1)
    over = run._rank_config(args, megatron_lm)
    assert (over["transformer_impl"], over["moe_grouped_gemm"]) == ("local", False)
    assert (not over["apply_rope_fusion"] and over["gradient_accumulation_fusion"]
            and over["bias_dropout_fusion"] is False)
    run.hs, run._fusions_told = types.SimpleNamespace(role="attention", rank=0), False
    over = run._rank_config(args, megatron_lm)
    assert "transformer_impl" not in over and over["apply_rope_fusion"] and over["gradient_accumulation_fusion"]


def test_fused_permute_is_this_rank_s_gpu_s(monkeypatch):
    """--moe-permute-fusion in Megatron-LM's pretrain() (megatron_lm/replaced.py): TE's fused permute
    only on a GPU transformer-engine supports, the one LOCAL_RANK names."""
    from megatron.core.transformer.moe import moe_utils

    from megatron_hetermoe.megatron_lm.replaced import fused_permute_available

    for name in ("fused_permute", "fused_permute_with_probs", "fused_sort_chunks_by_index",
                 "fused_sort_chunks_by_index_with_probs", "fused_unpermute"):
        monkeypatch.setattr(moe_utils, name, lambda *a: None, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    caps = {0: (9, 0), 1: (7, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: caps[d])
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert fused_permute_available()
    monkeypatch.setenv("LOCAL_RANK", "3")  # cuda:1, a V100
    assert not fused_permute_available()
