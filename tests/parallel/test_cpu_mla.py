"""Multi-latent attention (DeepSeek-V2/V3, Kimi-K2) on megatron-core's local spec: the attention core
that takes separate key and value head widths (cpu_backend's core_attention_kv_channels) computes
what megatron-core's DotProductAttention computes (scale, causal mask, dropout under the model-parallel
RNG) with q/k heads of qk_head_dim + qk_pos_emb_head_dim and v heads of v_head_dim; an MLA layer gets
Megatron's MLA softmax scale; CUDA ranks on the local spec get the MLA patches too.

Run as a script (`python tests/parallel/test_cpu_mla.py`), it is the canary step of the MLA patches
(test_cpu_backend.py leaves each out through $HETERMOE_CPU_PATCHES_SKIP): a tiny DeepSeek-shaped
GPTModel from Megatron's own MLA spec, one forward and backward, then CANARY-OK."""
from __future__ import annotations

import math
import os
import subprocess
import sys
import tempfile
import textwrap

import pytest
import torch

DEEPSEEK = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=96, kv_channels=16,
                multi_latent_attention=True, q_lora_rank=48, kv_lora_rank=32, qk_head_dim=16, qk_pos_emb_head_dim=8,
                v_head_dim=16, qk_layernorm=True, rotary_scaling_factor=40.0, mscale=0.707, mscale_all_dim=0.707)
UNFUSED = dict(use_cpu_initialization=True, bias_activation_fusion=False, masked_softmax_fusion=False,
               persist_layer_norm=False, gradient_accumulation_fusion=False, apply_rope_fusion=False,
               bias_dropout_fusion=False, add_bias_linear=False, normalization="RMSNorm")


def mla_config(**kw):
    """Megatron-LM's MLATransformerConfig for DeepSeek's flags, shrunk (yarn RoPE: MLA's default)."""
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    return MLATransformerConfig(**{**DEEPSEEK, **UNFUSED, "activation_func": F.silu, "gated_linear_unit": True,
                                   "hidden_dropout": 0.0, "attention_dropout": 0.0, **kw})


def mla_step() -> float:
    """A GPTModel of DeepSeek's shape (MLA with q/kv LoRA, qk-layernorm, yarn RoPE) from Megatron's
    own layer spec on a one-rank gloo world: forward, backward; returns the loss."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_hetermoe.shims.moe_utils import bind_missing_te_general_gemm

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.FileStore(tempfile.mktemp(), 1), rank=0, world_size=1)
    ps.initialize_model_parallel()
    try:
        model_parallel_cuda_manual_seed(1)
        bind_missing_te_general_gemm()
        spec = get_gpt_layer_local_spec(multi_latent_attention=True, qk_layernorm=True, normalization="RMSNorm")
        model = GPTModel(mla_config(attention_dropout=0.1), spec, 128, 32, position_embedding_type="rope")
        tokens = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0))
        loss = model(tokens, torch.arange(32).expand(2, 32), None, labels=tokens).sum()
        loss.backward()
        return loss.item()
    finally:
        ps.destroy_model_parallel()
        if created:
            dist.destroy_process_group()


def _seed(seed: int) -> None:
    """The model-parallel RNG tracker of a one-rank world, seeded (the core's dropout forks it)."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(seed, tp_rank=0, ep_rank=0, etp_rank=0)


@pytest.fixture
def groups(one_rank_groups):
    _seed(7)
    return one_rank_groups


def _core(groups, k: int | None, v: int | None, scale: float | None, dropout: float = 0.0):
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, kv_channels=16,
                               attention_dropout=dropout, **UNFUSED)
    kw = {} if k is None else {"k_channels": k, "v_channels": v}
    return DotProductAttention(config, 1, AttnMaskType.causal, "self", softmax_scale=scale, pg_collection=groups, **kw)


def _qkv(k: int, v: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(8, 2, 4, d, generator=g) for d in (k, k, v))  # [s, b, heads, width]


def _reference(q, k, v, scale: float, dropped=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal softmax attention in float64: (probabilities [b, n, s, s], output [s, b, n x v width]);
    `dropped`: the probabilities after dropout, used for the output where given."""
    q, k, v = (t.double() for t in (q, k, v))
    scores = torch.einsum("sbnd,tbnd->bnst", q, k) * scale
    s = scores.shape[-1]
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    probs = scores.softmax(-1)
    out = torch.einsum("bnst,tbnd->sbnd", probs if dropped is None else dropped.double(), v)
    return probs, out.reshape(out.shape[0], out.shape[1], -1)


def test_core_takes_separate_key_and_value_widths(groups):
    """q/k heads 24 wide (16 + 8 rope), v heads 16: the output is heads x 16 wide, each head
    softmax(q k^T x scale, causal) v, as float64 computes it (scale given, as MLA gives it)."""
    from margins import within  # tests/: on the path under pytest, not in the canary step

    scale = 0.37
    core = _core(groups, 24, 16, scale)
    q, k, v = _qkv(24, 16)
    out = core(q, k, v, None)
    assert out.shape == (8, 2, 4 * 16) and core.hidden_size_per_partition == 64
    _, ref = _reference(q, k, v, scale)
    # Measured 4.2e-7 / 3.3e-7 / 3.3e-7 (default / avx2 / avx512 kernels).
    within("MLA core vs float64 attention", (out.double() - ref).abs().max().item(), 3e-6)


def test_core_default_scale_is_the_key_width(groups):
    """Without a softmax_scale the scores are scaled by 1/sqrt(k_channels), the q/k head width, as
    transformer-engine's core does; megatron-core's own rule (1/sqrt(kv_channels)) without the keywords."""
    assert _core(groups, 24, 16, None).softmax_scale == pytest.approx(1 / math.sqrt(24), rel=1e-15)
    plain = _core(groups, None, None, None)
    assert plain.softmax_scale == pytest.approx(1 / math.sqrt(16), rel=1e-15) and plain.hidden_size_per_partition == 64


def test_core_dropout_as_megatron_core_draws_it(groups):
    """Attention dropout on the probabilities, drawn inside the model-parallel RNG tracker's fork (the
    default generator's state is left as it was), the output the dropped probabilities times v; and with
    equal widths the keywords change nothing: bitwise megatron-core's core on the same RNG state."""
    from margins import within

    scale, p = 0.29, 0.5
    core = _core(groups, 24, 16, scale, dropout=p).train()
    seen = {}
    core.attention_dropout.register_forward_hook(lambda m, i, o: seen.update(before=i[0].detach(), after=o.detach()))
    q, k, v = _qkv(24, 16, seed=1)
    state = torch.get_rng_state()
    out = core(q, k, v, None)
    assert torch.equal(torch.get_rng_state(), state)  # the fork drew it
    probs, ref = _reference(q, k, v, scale, dropped=seen["after"])
    # Measured: probabilities 1.4e-7 / 1.7e-7 / 1.6e-7, output 3.1e-7 / 2.9e-7 / 3.4e-7 (default / avx2 / avx512)
    within("MLA core's probabilities vs float64", (seen["before"].double() - probs).abs().max().item(), 1e-6)
    kept = seen["after"] != 0
    assert 0.3 < kept[probs > 0].float().mean().item() < 0.7  # p = 0.5 of the attended positions
    assert torch.equal(seen["after"][kept], (seen["before"] / (1 - p))[kept])
    within("MLA core with dropout vs float64", (out.double() - ref).abs().max().item(), 3e-6)

    q, k, v = _qkv(16, 16, seed=2)
    outs = []
    for kw in ((16, 16), (None, None)):
        _seed(7)
        outs.append(_core(groups, *kw, scale, dropout=p).train()(q, k, v, None))
    assert torch.equal(outs[0], outs[1])


def test_mla_layer_gets_megatrons_mla_scale(groups):
    """An MLA layer of Megatron's local spec builds: its core scales by yarn's mscale(40, 0.707)^2 /
    sqrt(qk_head_dim + qk_pos_emb_head_dim) (DeepSeek-V2-Lite's factors) and writes heads x v_head_dim."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.spec_utils import build_module

    spec = get_gpt_layer_local_spec(multi_latent_attention=True, qk_layernorm=True, normalization="RMSNorm")
    one = ProcessGroupCollection(tp=groups.tp, cp=groups.tp)
    attn = build_module(spec.submodules.self_attention, config=mla_config(), layer_number=1, pg_collection=one)
    mscale = 0.1 * 0.707 * math.log(40.0) + 1.0
    assert attn.core_attention.softmax_scale == pytest.approx(mscale ** 2 / math.sqrt(16 + 8), rel=1e-12)
    assert attn.core_attention.hidden_size_per_partition == 4 * 16


def _mla_step_rank(rank: int, world: int) -> float:
    return mla_step()


def test_mla_model_trains_a_step():
    from megatron_hetermoe.parallel.launcher import launch

    # In a launched rank: megatron-core's global groups made and destroyed in the pytest process leave
    # later tests' forked ranks hanging.
    assert math.isfinite(launch(_mla_step_rank, 1, timeout_s=300)[0])


# A fresh interpreter that looks like a GPU host to the CPU backend (apply() installs nothing there):
# megatron-core's local spec on a CUDA rank without transformer-engine needs the MLA patches as a CPU
# rank does; apply_for_spec puts them in for that spec, not for transformer-engine's.
_GPU_HOST = textwrap.dedent("""
    import torch
    torch.cuda.is_available = lambda: True
    from megatron.core.extensions import transformer_engine
    from megatron.core.transformer import multi_latent_attention
    from megatron_hetermoe.parallel import cpu_backend

    assert cpu_backend.apply() == []
    assert not transformer_engine.HAVE_TE
    print("BEFORE", multi_latent_attention.HAVE_TE)
    cpu_backend.apply_for_spec("cuda", "transformer_engine")
    print("TE SPEC", sorted(cpu_backend.applied()))
    cpu_backend.apply_for_spec("cuda", "local")
    print("LOCAL SPEC", sorted(cpu_backend.applied()), multi_latent_attention.HAVE_TE)
""")


def test_cuda_ranks_on_the_local_spec_get_the_mla_patches():
    r = subprocess.run([sys.executable, "-W", "ignore", "-c", _GPU_HOST], capture_output=True, text=True, timeout=120)
    out = r.stdout + r.stderr[-3000:]
    assert "BEFORE True" in r.stdout and "TE SPEC []" in r.stdout, out
    local = "LOCAL SPEC ['core_attention_kv_channels', 'mla_have_te', 'torch_norm_sequence_parallel'] False"
    assert local in r.stdout, out


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import megatron.core  # noqa: F401

    from megatron_hetermoe.parallel import cpu_backend

    cpu_backend.apply()
    print("CANARY-OK", mla_step())
