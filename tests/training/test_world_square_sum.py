"""world_stats' exact sum of squares (the gradient norm clipping divides by): the same bits however
the elements are cut into tensors, shards and ranks, and within 2**-ACCURACY_BITS of the exactly
rounded sum (math.fsum of the squares, exact in float64 for fp32 values)."""
from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_hetermoe.training.world_stats import ACCURACY_BITS, _fold_steps, fold_sums


def _total(groups: list[list[torch.Tensor]], steps: list[float]) -> float:
    """As world_square_sum: each rank's fold sums, added over the ranks, the folds in order."""
    sums = sum(fold_sums([t.double().square() for t in g], steps) for g in groups)
    total = 0.0
    for x in sums.tolist():
        total += x
    return total


def _cut(values: torch.Tensor, cuts: list[int], ranks: int) -> list[list[torch.Tensor]]:
    """values cut at `cuts` into pieces, dealt round-robin to `ranks` ranks."""
    bounds = sorted({0, values.numel(), *(c % (values.numel() + 1) for c in cuts)})
    pieces = [values[a:b] for a, b in zip(bounds, bounds[1:])]
    return [pieces[r::ranks] for r in range(ranks)]


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31), n=st.integers(1, 3000), spread=st.integers(0, 60),
       cuts_a=st.lists(st.integers(0, 10**6), max_size=12), cuts_b=st.lists(st.integers(0, 10**6), max_size=12),
       ranks_a=st.integers(1, 5), ranks_b=st.integers(1, 5))
def test_any_cut_gives_the_same_bits_and_the_exact_sum(seed, n, spread, cuts_a, cuts_b, ranks_a, ranks_b):
    g = torch.Generator().manual_seed(seed)
    # fp32 gradients over 2**spread of magnitude, some zeros and negatives
    values = (torch.randn(n, generator=g) * torch.exp2(torch.randint(-spread, 1, (n,), generator=g).float()))
    values[torch.rand(n, generator=g) < 0.05] = 0.0
    values = values.float()
    n_bits = math.ceil(math.log2(n + 1)) + 1
    peak = values.double().square().max().item()
    if peak == 0.0:
        return
    steps = _fold_steps(peak, n_bits)
    a = _total(_cut(values, cuts_a, ranks_a), steps)
    b = _total(_cut(values, cuts_b, ranks_b), steps)
    assert a == b  # bitwise, whatever the cut
    exact = math.fsum(float(v) ** 2 for v in values.tolist())
    assert abs(a - exact) <= exact * 2.0 ** -ACCURACY_BITS, (a, exact)


def test_a_plain_sum_depends_on_the_cut():
    # Why the folds: the same squares added per piece and then over pieces give other bits.
    values = (torch.randn(10_000, generator=torch.Generator().manual_seed(0)) * 3).float().double().square()
    whole = values.sum().item()
    pieces = sum(p.sum().item() for p in values.split(777))
    assert whole != pieces
    steps = _fold_steps(values.max().item(), math.ceil(math.log2(values.numel() + 1)) + 1)
    folded = [x for x in (fold_sums([values], steps), fold_sums(list(values.split(777)), steps))]
    assert torch.equal(folded[0], folded[1])


def test_the_grid_covers_the_range_and_refuses_beyond_it():
    assert len(_fold_steps(1.0, 21)) == 2 and len(_fold_steps(1.0, 31)) == 4  # 2**20, 2**30 elements
    # any square of an fp32 value: from its smallest subnormal squared (2**-298) to its largest squared
    assert len(_fold_steps(2.0 ** -298, 31)) == len(_fold_steps(2.0 ** 256, 31)) == 4
    try:
        _fold_steps(1.0, 45)
    except ValueError as e:
        assert "2**44 elements" in str(e)
    else:
        raise AssertionError("2**44 elements accepted")
