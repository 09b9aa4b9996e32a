"""Context parallelism for megatron-core's local attention core (models/context_attention.py): on each
CP rank of a launched gloo world, ContextParallelAttention's output rows and its query, key and value
gradients (from a random upstream gradient) are those of megatron-core's DotProductAttention (CP 1,
causal) run on the full sequence, sliced to the rank's tokens by Megatron's own
get_batch_on_this_cp_rank; with GQA, with tensor parallelism beside CP, with a mask from the data, and
in bf16 and fp16. With a CP group of one rank it is DotProductAttention bit for bit; what it does not
support it refuses before any collective.

The ranks are launched (parallel/launcher.py): no process group lives in the pytest process but the
one-rank world of the `one_rank_groups` fixture, made and destroyed around each test that uses it."""
from __future__ import annotations

import logging

import pytest
import torch
from margins import within

from megatron_hetermoe.parallel.launcher import launch

S, B, HEADS, GROUPS, HEAD_DIM = 16, 2, 4, 2, 8
# Max |diff| measured (ATEN_CPU_CAPABILITY default, avx2 and avx512 alike). all_gather: output 0 (the
# same sums in the same order), q/k/v gradients 7.2e-7 (k and v: the ranks' partial sums added by the
# reduce-scatter in another order). p2p (the ring: partial softmaxes merged): output 3.6e-7, gradients
# 9.5e-7 (1.2e-6 on default kernels). Bound 8.6x.
TOL_F32 = 1e-5
# Half precision: the k/v gradients are rounded per rank before the reduce-scatter adds them, the
# reference rounds once (all_gather; output and q gradient 0); the ring accumulates in fp32 and rounds
# its results once. Measured, both: bf16 3.1e-2, fp16 3.9e-3 (one ulp of each at the gradients' 4..6);
# bounds 6x.
TOL_HALF = {torch.bfloat16: 2e-1, torch.float16: 2.5e-2}


def _config(cp: int, dtype: torch.dtype = torch.float32, **kw):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(**{"num_layers": 1, "hidden_size": HEADS * HEAD_DIM, "num_attention_heads": HEADS,
                                "num_query_groups": GROUPS, "kv_channels": HEAD_DIM, "context_parallel_size": cp,
                                "attention_dropout": 0.0, "masked_softmax_fusion": False,
                                "bf16": dtype == torch.bfloat16, "fp16": dtype == torch.float16, "params_dtype": dtype,
                                **kw})


def _full(seed: int, dtype: torch.dtype, v_dim: int = HEAD_DIM) -> dict[str, torch.Tensor]:
    """The full sequence's q, k, v ([S, b, heads or groups, head dim]; v's head dim `v_dim`), an
    upstream gradient of the output ([S, b, heads x v_dim]) and a data mask [b, 1, S, S] (True =
    masked): causal, reset at a document end (batch 0 at 5, batch 1 at 11)."""
    g = torch.Generator().manual_seed(seed)
    out = {"q": torch.randn(S, B, HEADS, HEAD_DIM, generator=g), "k": torch.randn(S, B, GROUPS, HEAD_DIM, generator=g),
           "v": torch.randn(S, B, GROUPS, v_dim, generator=g),
           "dout": torch.randn(S, B, HEADS * v_dim, generator=g)}
    out = {k: v.to(dtype) for k, v in out.items()}
    doc = torch.zeros(B, S, dtype=torch.long)
    doc[0, 5:], doc[1, 11:] = 1, 1
    future = torch.ones(S, S, dtype=torch.bool).triu(1)
    out["mask"] = (future | (doc[:, :, None] != doc[:, None, :]))[:, None]
    return out


def _attend(core, t: dict[str, torch.Tensor], mask) -> dict[str, torch.Tensor]:
    """core's output for leaf copies of t's q, k, v, and their gradients from t's upstream gradient."""
    q, k, v = (t[n].detach().clone().requires_grad_() for n in "qkv")
    out = core(q, k, v, mask)
    out.backward(t["dout"])
    return {"out": out.detach(), "q": q.grad, "k": k.grad, "v": v.grad}


def _heads(t: dict[str, torch.Tensor], tp: int, rank: int) -> dict[str, torch.Tensor]:
    """TP rank `rank`'s heads (and query groups, and the output columns of its heads)."""
    h, g, v_dim = HEADS // tp, GROUPS // tp, t["v"].size(3)
    cols = slice(rank * h * v_dim, (rank + 1) * h * v_dim)
    out = {"q": t["q"][:, :, rank * h:(rank + 1) * h], "k": t["k"][:, :, rank * g:(rank + 1) * g],
           "v": t["v"][:, :, rank * g:(rank + 1) * g], "dout": t["dout"][..., cols], "mask": t["mask"]}
    if "out" in t:
        out["out"] = t["out"][..., cols]
    return out


def _cp_slice(t: dict[str, torch.Tensor], cp_group) -> dict[str, torch.Tensor]:
    """This CP rank's tokens of each tensor, by megatron-core's get_batch_on_this_cp_rank (it takes
    [b, s, ...] and splits an attention_mask along its query dimension)."""
    from megatron_hetermoe.compat import batch_on_this_cp_rank

    batch = {k: (v if k == "mask" else v.transpose(0, 1)) for k, v in t.items()}
    batch["attention_mask"] = batch.pop("mask")
    got = batch_on_this_cp_rank(batch, cp_group)
    out = {k: v.transpose(0, 1) for k, v in got.items() if k != "attention_mask"}
    out["mask"] = got["attention_mask"]
    return out


def _compare(rank: int, world: int, tp: int, dtype: torch.dtype, comm: str = "all_gather",
             v_dim: int = HEAD_DIM) -> dict[str, float]:
    """On a world of tp x cp ranks (TP groups of consecutive ranks): the max |diff| of each of output,
    q, k, v gradients against DotProductAttention on the full sequence and all heads, without and
    with the data mask, under cp_comm_type `comm`. A `v_dim` other than HEAD_DIM builds both cores as
    multi-latent attention does (k_channels, v_channels and a softmax_scale; shims' kv_channels)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_hetermoe.models.context_attention import ContextParallelAttention

    cp = world // tp
    # Every rank joins every new_group call, in the same order (gloo).
    ones = [dist.new_group([r]) for r in range(world)]
    tps = [dist.new_group(list(range(i * tp, (i + 1) * tp))) for i in range(cp)]
    cps = [dist.new_group(list(range(j, world, tp))) for j in range(tp)]
    tp_group, cp_group = tps[rank // tp], cps[rank % tp]
    ps._set_global_memory_buffer()  # DotProductAttention's score buffer (no explicit-group path)
    _seed(1)  # the core's dropout forks the model-parallel RNG (dropout 0 here, the fork is still taken)

    full = _full(seed=3, dtype=dtype, v_dim=v_dim)
    mla = {}
    if v_dim != HEAD_DIM:
        from megatron_hetermoe.shims.dot_product_attention import kv_channels

        kv_channels()  # in this forked rank only
        mla = {"k_channels": HEAD_DIM, "v_channels": v_dim, "softmax_scale": HEAD_DIM ** -0.5}
    reference = DotProductAttention(_config(1, dtype), 1, AttnMaskType.causal, "self",
                                    pg_collection=ProcessGroupCollection(tp=ones[rank]), **mla)
    core = ContextParallelAttention(_config(cp, dtype), 1, AttnMaskType.causal, "self", cp_comm_type=comm,
                                    pg_collection=ProcessGroupCollection(tp=tp_group, cp=cp_group), **mla)
    assert core.cp_comm == comm
    diffs = {}
    for case, use_mask in (("causal", False), ("data mask", True)):
        want = _attend(reference, full, full["mask"] if use_mask else None)
        want = _cp_slice(_heads({**full, **want}, tp, tp_group.rank()), cp_group)
        mine = _cp_slice(_heads(full, tp, tp_group.rank()), cp_group)
        got = _attend(core, mine, mine["mask"] if use_mask else None)
        for n in ("out", "q", "k", "v"):
            assert got[n].dtype == dtype and got[n].shape == want[n].shape, (n, got[n].shape, want[n].shape)
            diffs[f"{case} {n}"] = (got[n].double() - want[n].double()).abs().max().item()
    ps.destroy_global_memory_buffer()
    return diffs


def _check(diffs: list[dict[str, float]], what: str, tol: float) -> None:
    for rank, d in enumerate(diffs):
        for name, value in d.items():
            within(f"{what}, rank {rank}, {name}", value, tol)


COMMS = ["p2p", "all_gather", "a2a"]


def _bound(comm: str, tol: float) -> float:
    """a2a attends with DotProductAttention over the whole sequence of its heads: the same sums in the
    same order as the reference, outputs and gradients bit for bit (measured on ATEN native, default and
    avx2, fp32, bf16 and fp16)."""
    return 0.0 if comm == "a2a" else tol


@pytest.mark.parametrize("comm", COMMS)
@pytest.mark.parametrize("cp", [2, 4])
def test_each_cp_rank_computes_its_rows_and_gradients_of_full_attention(cp, comm):
    _check(launch(_compare, cp, 1, torch.float32, comm, timeout_s=120), f"cp={cp} {comm}", _bound(comm, TOL_F32))


@pytest.mark.parametrize("comm", COMMS)
def test_values_of_another_head_dim_as_multi_latent_attention_has(comm):
    """MLA's core: values 4 wide per head, queries and keys 8 (k_channels, v_channels), cp=2."""
    _check(launch(_compare, 2, 1, torch.float32, comm, 4, timeout_s=120), f"cp=2 v_dim=4 {comm}",
           _bound(comm, TOL_F32))


@pytest.mark.slow
@pytest.mark.parametrize("comm", COMMS)
def test_tensor_parallel_beside_context_parallel(comm):
    """tp=2 x cp=2: each rank half of the heads (one query group) of its tokens."""
    _check(launch(_compare, 4, 2, torch.float32, comm, timeout_s=120), f"tp=2 cp=2 {comm}", _bound(comm, TOL_F32))


@pytest.mark.slow
@pytest.mark.parametrize("comm", COMMS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_as_the_parent_does_it(dtype, comm):
    _check(launch(_compare, 2, 1, dtype, comm, timeout_s=120), f"cp=2 {dtype} {comm}", _bound(comm, TOL_HALF[dtype]))


def test_the_load_balanced_positions_are_megatrons_split():
    from megatron_hetermoe.models.context_attention import local_positions

    assert local_positions(8, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert local_positions(8, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert local_positions(4, 4, 3).tolist() == [6, 7, 8, 9]


def _seed(seed: int) -> None:
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(seed, tp_rank=0, ep_rank=0, etp_rank=0)


def test_cp_1_is_the_parent_bit_for_bit(one_rank_groups):
    """With and without a one-rank cp group, with dropout (the same RNG draws) and a given mask."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_hetermoe.models.context_attention import ContextParallelAttention

    full = _full(seed=5, dtype=torch.float32)
    for pgs in (one_rank_groups, ProcessGroupCollection(tp=one_rank_groups.tp, cp=one_rank_groups.tp)):
        for dropout, mask in ((0.0, None), (0.3, None), (0.0, full["mask"])):
            results = []
            for cls in (DotProductAttention, ContextParallelAttention):
                core = cls(_config(1, attention_dropout=dropout), 1, AttnMaskType.causal, "self", pg_collection=pgs)
                _seed(11)
                results.append(_attend(core, full, mask))
            for n in ("out", "q", "k", "v"):
                assert torch.equal(results[0][n], results[1][n]), (n, dropout, mask is not None)
    core = ContextParallelAttention(_config(1), 1, AttnMaskType.causal, "self", pg_collection=one_rank_groups)
    assert core.cp_size == 1 and core.attn_mask_type == core.scale_mask_softmax.attn_mask_type == AttnMaskType.causal


class _Group:
    """A stand-in CP group of `size` ranks: the refusals come before any collective."""

    def __init__(self, size: int):
        self._size = size

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return 0


def test_what_it_does_not_support_it_refuses(one_rank_groups):
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_hetermoe.models.context_attention import ContextParallelAttention

    tp = one_rank_groups.tp
    two = ProcessGroupCollection(tp=tp, cp=_Group(2))

    def build(config=None, mask_type=AttnMaskType.causal, pgs=two):
        return ContextParallelAttention(config or _config(2), 1, mask_type, "self", pg_collection=pgs)

    with pytest.raises(ValueError, match=r"attn_mask_type=AttnMaskType.padding .*use AttnMaskType.causal"):
        build(mask_type=AttnMaskType.padding)
    with pytest.raises(ValueError, match=r"window_size=\(4, 0\).*drop window_size"):
        build(_config(2, window_size=(4, 0)))
    with pytest.raises(ValueError, match=r"context_parallel_size=2 in the config but the CP group .* 1 rank"):
        build(pgs=one_rank_groups)
    with pytest.raises(ValueError, match=r"context_parallel_size=1 in the config but the CP group .* 2 rank"):
        build(_config(1))

    core = build()
    local = {n: t[: S // 2] for n, t in _full(seed=0, dtype=torch.float32).items() if n != "mask"}
    q, k, v = local["q"], local["k"], local["v"]
    packed = PackedSeqParams(qkv_format="thd")
    with pytest.raises(ValueError, match=r"packed_seq_params .*qkv_format='thd'.*use unpacked"):
        core(q, k, v, None, packed_seq_params=packed)
    with pytest.raises(ValueError, match=r"attention_bias of shape \(1, 4, 8, 16\).*pass attention_bias=None"):
        core(q, k, v, None, attention_bias=torch.zeros(1, 4, 8, 16))
    with pytest.raises(ValueError, match=r"attn_mask_type=AttnMaskType.no_mask.*pass attn_mask_type=None"):
        core(q, k, v, None, attn_mask_type=AttnMaskType.no_mask)
    with pytest.raises(ValueError, match=r"7/7/7 tokens.*multiple of 2 x context_parallel_size = 4"):
        core(q[:7], k[:7], v[:7], None)
    with pytest.raises(ValueError, match=r"attention_mask of shape \(2, 1, 16, 16\).*expected \[b or 1, 1, s_local=8"):
        core(q, k, v, torch.zeros(B, 1, S, S, dtype=torch.bool))


def test_each_cp_comm_type_is_megatrons_or_named(one_rank_groups):
    """p2p (Megatron-LM's default) and None are the ring, all_gather the all-gather, a2a the all-to-all;
    transformer-engine's a2a+p2p all-gathers and says so once per process; a value Megatron does not have
    is refused by name, as are a softmax the ring cannot merge and heads that do not split over CP."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_hetermoe.models import context_attention as ca

    two = ProcessGroupCollection(tp=one_rank_groups.tp, cp=_Group(2))
    ca._TOLD.discard("a2a+p2p")
    said: list[str] = []
    catch = logging.Handler(logging.WARNING)  # on the module's logger: no root filter between
    catch.emit = lambda record: said.append(record.getMessage())
    logger = logging.getLogger(ca.__name__)
    logger.addHandler(catch)
    try:
        comms = [ca.ContextParallelAttention(_config(2), 1, AttnMaskType.causal, "self", cp_comm_type=comm,
                                             pg_collection=two).cp_comm
                 for comm in ("all_gather", None, "p2p", "a2a", "a2a+p2p", "a2a+p2p")]
    finally:
        logger.removeHandler(catch)
    assert comms == ["all_gather", "p2p", "p2p", "a2a", "all_gather", "all_gather"], comms
    assert len(said) == 1 and "cp_comm_type='a2a+p2p'" in said[0], said
    assert "all-gathers keys and values" in said[0], said
    with pytest.raises(ValueError, match=r"cp_comm_type='ring' .*Megatron's values are p2p, all_gather, a2a"):
        ca.ContextParallelAttention(_config(2), 1, AttnMaskType.causal, "self", cp_comm_type="ring",
                                    pg_collection=two)
    for comm in ("p2p", "a2a"):
        with pytest.raises(ValueError, match=rf"softmax_type='off-by-one' with cp_comm_type='{comm}'.*all_gather"):
            ca.ContextParallelAttention(_config(2, softmax_type="off-by-one"), 1, AttnMaskType.causal, "self",
                                        cp_comm_type=comm, pg_collection=two)
    with pytest.raises(ValueError, match=r"cp_comm_type='a2a' with 4 attention heads .*context_parallel_size=3"):
        ca.ContextParallelAttention(_config(3), 1, AttnMaskType.causal, "self", cp_comm_type="a2a",
                                    pg_collection=ProcessGroupCollection(tp=one_rank_groups.tp, cp=_Group(3)))
