"""The kernel check before launch takes each pool's precision (issue 24 item 13)."""
from __future__ import annotations

import pytest

from megatron_hetermoe.config import HeteroRunConfig, ModelConfig, TrainConfig
from megatron_hetermoe.models import builder
from megatron_hetermoe.training.args import build_parser, check_kernels


@pytest.fixture
def grouped_gemm_installed(monkeypatch):
    """A CUDA host whose grouped_gemm imports (none here: the check reads only its status)."""
    monkeypatch.setattr(builder, "grouped_gemm_status", lambda: (True, "grouped_gemm 1.1"))
    monkeypatch.setattr(builder, "transformer_engine_status", lambda: (False, False, "no transformer-engine"))


def _cfg(**kw) -> TrainConfig:
    return TrainConfig(ModelConfig.load("tiny"), moe_grouped_gemm=True, transformer_impl="local", **kw)


def test_grouped_gemm_with_fp16_expert_pool_is_refused_before_launch(grouped_gemm_installed, capsys):
    """--moe-grouped-gemm --bf16 --hetero-expert-precision fp16: megatron-core's GroupedMLP runs bf16
    only; the world's bf16 passed the check and the fp16 expert ranks failed after every group
    existed."""
    cfg = _cfg(bf16=True)
    pools = HeteroRunConfig(expert_precision="fp16").pools(cfg)
    with pytest.raises(SystemExit):
        check_kernels(build_parser(), cfg, "cuda", pools)
    err = capsys.readouterr().err
    assert "expert ranks (fp16): --transformer-impl local --moe-grouped-gemm: megatron-core's GroupedMLP runs bf16 " \
           "only" in err, err


def test_each_pool_prints_its_kernels(grouped_gemm_installed, capsys):
    cfg = TrainConfig(ModelConfig.load("tiny"), bf16=True)
    check_kernels(build_parser(), cfg, "cuda", HeteroRunConfig(expert_precision="fp16").pools(cfg))
    out = capsys.readouterr().out
    assert " attention ranks (bf16): kernels: grouped" in out and " expert ranks (fp16): kernels: local" in out, out


def test_one_precision_checks_the_world(grouped_gemm_installed, capsys):
    check_kernels(build_parser(), _cfg(bf16=True), "cuda", HeteroRunConfig().pools(_cfg(bf16=True)))
    assert capsys.readouterr().out.startswith(" kernels: grouped")
