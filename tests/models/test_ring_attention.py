"""Ring attention (models/ring_attention.py, `--cp-comm-type p2p`): the blocks it skips hold only masked
pairs, and on launched gloo CP groups its backward is the derivative of its forward, across ranks
(a key's gradient collects every rank's queries), with GQA, a data mask and dropout, in fp64. Its
outputs and gradients against megatron-core's DotProductAttention on the full sequence are in
test_context_attention.py (both cp_comm_types)."""
from __future__ import annotations

import itertools

import pytest
import torch
from margins import within

from megatron_hetermoe.parallel.launcher import launch

HEADS, HEAD_DIM = 4, 4


def test_the_blocks_it_skips_hold_only_masked_pairs():
    """For every CP size up to 4, rank and source block: outside live_block every query is before every
    key (masked), and inside it each live row sees a key and each live column is seen."""
    from megatron_hetermoe.models.ring_attention import live_block, local_positions

    s = 6
    for cp in range(1, 5):
        for r, src in itertools.product(range(cp), repeat=2):
            rows, cols = live_block(r, src, s)
            seen = local_positions(s, cp, src)[None, :] <= local_positions(s, cp, r)[:, None]  # [q, k]
            live = torch.zeros_like(seen)
            live[rows, cols] = True
            assert not (seen & ~live).any(), (cp, r, src)
            assert seen[rows, cols].any(1).all() and seen[rows, cols].any(0).all(), (cp, r, src)
            if src != r:
                assert live.sum() == s * s // 2, (cp, r, src)  # half of an off-diagonal block is computed


def _directional(rank: int, world: int, groups: int, dropout: float, with_mask: bool) -> list[float]:
    """The world is one CP group. L = sum over ranks of <W_r, out_r>; for three random directions d
    (each rank's part of q, k, v), the all-reduced sum of <grad_r, d_r> from backward against the
    central difference (L(x + eps d) - L(x - eps d)) / 2 eps, fp64. Dropout draws the same keep masks in
    every forward (the RNG is reseeded per call), so L is a smooth function of x."""
    import contextlib

    import torch.distributed as dist

    from megatron_hetermoe.models.ring_attention import RingConfig, local_positions, ring_attention

    s_local = 4
    seq = s_local * world
    g = torch.Generator().manual_seed(100 + rank)
    q = torch.randn(s_local, 2, HEADS, HEAD_DIM, generator=g, dtype=torch.float64)
    k = torch.randn(s_local, 2, groups, HEAD_DIM, generator=g, dtype=torch.float64)
    v = torch.randn(s_local, 2, groups, HEAD_DIM, generator=g, dtype=torch.float64)
    w = torch.randn(s_local, 2, HEADS * HEAD_DIM, generator=g, dtype=torch.float64)
    mask = None
    if with_mask:
        # Documents end at 3 and 9 of the full sequence (batch 0) and at 5 (batch 1); rows in this
        # rank's order, columns in sequence order.
        doc = torch.zeros(2, seq, dtype=torch.long)
        doc[0, 3:], doc[0, 9:], doc[1, 5:] = 1, 2, 1
        pos = local_positions(s_local, world, rank)
        mask = (doc[:, pos][:, :, None] != doc[:, None, :])[:, None]

    @contextlib.contextmanager
    def same_draws():
        with torch.random.fork_rng():
            torch.manual_seed(7 + rank)
            yield

    cfg = RingConfig(dist.group.WORLD, scale=HEAD_DIM ** -0.5, dropout=dropout, rng=same_draws)

    def loss(q, k, v) -> torch.Tensor:
        local = (ring_attention(q, k, v, mask, cfg) * w).sum()
        dist.all_reduce(local)  # not differentiated: only its value is used below
        return local

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    (ring_attention(*leaves, mask, cfg) * w).sum().backward()
    grads = [t.grad for t in leaves]
    diffs = []
    eps = 1e-6
    for i in range(3):
        d = [torch.randn(t.shape, generator=g, dtype=torch.float64) for t in (q, k, v)]
        with torch.no_grad():
            plus = loss(*(t + eps * u for t, u in zip((q, k, v), d)))
            minus = loss(*(t - eps * u for t, u in zip((q, k, v), d)))
        numeric = (plus - minus) / (2 * eps)
        analytic = sum((gr * u).sum() for gr, u in zip(grads, d)).reshape(1)
        dist.all_reduce(analytic)
        diffs.append(abs(analytic.item() - numeric.item()) / max(1.0, abs(numeric.item())))
    return diffs


@pytest.mark.parametrize("cp,groups,dropout,with_mask", [(2, 2, 0.0, False), (2, 2, 0.3, True),
                                                         (4, 1, 0.3, True), (4, 4, 0.0, True)])
def test_backward_is_the_derivative_of_forward_across_the_ring(cp, groups, dropout, with_mask):
    # Measured (relative, fp64 central differences at eps 1e-6): <= 2.1e-9 in every case; bound 9.5x.
    for rank, diffs in enumerate(launch(_directional, cp, groups, dropout, with_mask, timeout_s=120)):
        for i, d in enumerate(diffs):
            within(f"cp={cp} groups={groups} dropout={dropout} mask={with_mask}, rank {rank}, direction {i}", d,
                   2e-8)


def test_the_runs_cp_comm_type_reaches_megatrons_config(tiny):
    """--cp-comm-type as `hetermoe train` parses it (one value, or one per layer) becomes
    TransformerConfig.cp_comm_type (a string, or megatron-core's per-layer list); a value not run here
    is refused by name."""
    from megatron_hetermoe.config import ParallelConfig
    from megatron_hetermoe.models.builder import transformer_config

    model = tiny.replace(num_layers=2)
    assert ParallelConfig().cp_comm_type == "p2p"  # Megatron-LM's default
    assert transformer_config(model, ParallelConfig(cp_comm_type=("all_gather",))).cp_comm_type == "all_gather"
    both = transformer_config(model, ParallelConfig(cp_comm_type=("p2p", "all_gather")))
    assert both.cp_comm_type == ["p2p", "all_gather"]
    with pytest.raises(ValueError, match=r"--cp-comm-type p2p a2a\+p2p: runs here are p2p, all_gather, a2a"):
        ParallelConfig(cp_comm_type=("p2p", "a2a+p2p"))
