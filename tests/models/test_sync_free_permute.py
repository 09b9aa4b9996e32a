"""The dispatcher's permutation without host reads (issue 43 item 6).

permute_dropless / unpermute_dropless give megatron-core's unfused permute and unpermute bitwise
(rows, order, probabilities, gradients) on random dropless routing maps; in a real HeteroMoELayer
(launched gloo ranks) the attention side's dispatch preprocess, the experts' regrouping and the
unpermute after combine read nothing back to the host (tests/sync_count.py counts what a GPU run
would synchronize on), and the layer's one remaining synchronization is the counts exchange's.
"""
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_hetermoe.models.dispatcher import permute_dropless, unpermute_dropless
from megatron_hetermoe.parallel.launcher import launch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sync_count import HostSyncs  # noqa: E402


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as integers: equal bits, not only equal values (-0.0 != 0.0, NaN == NaN)."""
    return t.contiguous().view(torch.uint8)


def _assert_bitwise(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, want.dtype, got.shape, want.shape)
    assert torch.equal(_bits(got), _bits(want)), f"{what}: values differ"


@st.composite
def routings(draw):
    """A dropless top-k routing map [tokens, experts] (each token picks exactly topk distinct
    experts, from a subset so that some experts receive nothing), random probabilities, tokens."""
    topk = draw(st.sampled_from([1, 2, 6]))
    experts = draw(st.integers(topk + 1, 12))
    used = draw(st.integers(topk, experts))  # experts outside the first `used` (shuffled) get nothing
    tokens = draw(st.integers(0, 24))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    allowed = torch.randperm(experts, generator=g)[:used]
    picks = torch.stack([allowed[torch.randperm(used, generator=g)[:topk]] for _ in range(tokens)]) \
        if tokens else torch.empty(0, topk, dtype=torch.long)
    rmap = torch.zeros(tokens, experts, dtype=torch.bool).scatter_(1, picks, True)
    return rmap, topk, seed


def _both(fn_megatron, fn_ours, x, probs):
    """Run both functions on copies of the same leaves; return ((outputs, grads) of each)."""
    results = []
    for fn in (fn_megatron, fn_ours):
        xl, pl = x.detach().clone().requires_grad_(), probs.detach().clone().requires_grad_()
        outs = fn(xl, pl)
        g = torch.Generator().manual_seed(7)
        loss = sum((o.float() * torch.randn(o.shape, generator=g)).sum() for o in outs if o.is_floating_point())
        loss.backward()
        results.append((outs, (xl.grad, pl.grad)))
    return results


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(routings(), st.sampled_from([torch.float32, torch.bfloat16]), st.booleans())
def test_permute_and_unpermute_are_megatrons_bitwise(routing, dtype, deterministic):
    from megatron.core.transformer.moe.moe_utils import permute, unpermute

    rmap, topk, seed = routing
    n, e = rmap.shape
    g = torch.Generator().manual_seed(seed + 1)
    hidden = 5
    x = torch.randn(n, hidden, generator=g).to(dtype)
    probs = torch.rand(n, e, generator=g)  # the router's dtype (fp32) with bf16 tokens: promotion
    rows = n * topk
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic)  # megatron's unpermute scatters differently then
    try:
        # permute, with and without probabilities
        (m_out, m_grad), (o_out, o_grad) = _both(
            lambda xl, pl: permute(xl, rmap, probs=pl, num_out_tokens=rows)[:3],
            lambda xl, pl: permute_dropless(xl, rmap, rows, pl)[:3], x, probs)
        for what, a, b in zip(("tokens", "probs", "sorted_indices"), o_out, m_out):
            _assert_bitwise(a, b, f"permute {what}")
        for what, a, b in zip(("token grad", "probs grad"), o_grad, m_grad):
            _assert_bitwise(a, b, f"permute {what}")
        plain_m = permute(x, rmap, num_out_tokens=rows)
        plain_o = permute_dropless(x, rmap, rows)
        assert plain_o[1] is None and plain_m[1] is None
        _assert_bitwise(plain_o[0], plain_m[0], "permute without probs")
        # unpermute of expert outputs (the permuted rows), weighted by the probabilities and not
        _, _, idx, flat = permute_dropless(x, rmap, rows)
        y = torch.randn(rows, hidden, generator=g).to(dtype)
        for weighted in (True, False):
            (m_out, m_grad), (o_out, o_grad) = _both(
                lambda yl, pl: (unpermute(yl, idx, torch.Size([n, hidden]), probs=pl if weighted else None,
                                          routing_map=rmap),),
                lambda yl, pl: (unpermute_dropless(yl, idx, flat, torch.Size([n, hidden]), pl if weighted else None),),
                y, probs)
            _assert_bitwise(o_out[0], m_out[0], f"unpermute (weighted={weighted})")
            _assert_bitwise(o_grad[0], m_grad[0], f"unpermute grad (weighted={weighted})")
            if weighted:
                _assert_bitwise(o_grad[1], m_grad[1], "unpermute probs grad")
            else:
                assert o_grad[1] is None and m_grad[1] is None
    finally:
        torch.use_deterministic_algorithms(was)


def test_permute_reads_nothing_back_where_megatrons_reads_three_times():
    from megatron.core.transformer.moe.moe_utils import permute, unpermute

    g = torch.Generator().manual_seed(3)
    n, e, k, h = 16, 8, 2, 4
    rmap = torch.zeros(n, e, dtype=torch.bool).scatter_(1, torch.rand(n, e, generator=g).topk(k, 1).indices, True)
    x = torch.randn(n, h, generator=g, requires_grad=True)
    probs = torch.rand(n, e, generator=g, requires_grad=True)
    with HostSyncs() as syncs:
        with syncs.phase("megatron"):
            out, _, idx = permute(x, rmap, probs=probs, num_out_tokens=n * k)[:3]
            unpermute(out, idx, torch.Size([n, h]), probs=probs, routing_map=rmap).sum().backward()
        with syncs.phase("ours"):
            out, _, idx, flat = permute_dropless(x, rmap, n * k, probs)
            unpermute_dropless(out, idx, flat, torch.Size([n, h]), probs).sum().backward()
    # the counter sees Megatron's masked_selects (two in permute with probs, one in unpermute)
    assert syncs.count("megatron") == 3, syncs.sites("megatron")
    assert syncs.count("ours") == 0, syncs.sites("ours")


# ---- a real layer, per (layer, microbatch) --------------------------------------------------------
def _layer_syncs(rank: int, world: int, microbatches: int) -> dict:
    """One HeteroMoELayer (tools/layer_bench.py: a ZP group of the world's attention ranks, each
    holding experts) and Megatron's MoELayer with the same weights: host synchronizations per
    phase of each microbatch's forward and backward."""
    from megatron_hetermoe.models import moe_layer
    from megatron_hetermoe.tools import layer_bench as lb

    pair = lb.build_pair("tiny")
    layer = pair.hetero
    d = layer.token_dispatcher
    syncs = HostSyncs()

    def phased(name, fn):
        def run(*args, **kwargs):
            with syncs.phase(name):
                return fn(*args, **kwargs)
        return run

    d.preprocess = phased("dispatch preprocess", d.preprocess)
    d.exchange_route = phased("counts exchange", d.exchange_route)
    d.postprocess = phased("unpermute", d.postprocess)
    moe_layer.run_local_experts = phased("experts", moe_layer.run_local_experts)
    out = {}
    for mb in range(microbatches + 1):  # microbatch 0 warms the order tensors (built once per device)
        x = lb.make_input(pair, 32, seed=rank * 10 + mb)
        with syncs:
            y, _ = layer(x)
            with syncs.phase("backward"):
                y.sum().backward()
        events = [(e.phase, e.site) for e in syncs.events]
        syncs.events.clear()
        if mb:
            out[mb] = events
    x = lb.make_input(pair, 32, seed=rank)
    with syncs:
        y, _ = pair.megatron(x)
        y.sum().backward()
    out["megatron"] = [(e.phase, e.site) for e in syncs.events]
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_a_layer_synchronizes_once_per_microbatch_for_the_counts(world):
    # world 1: a ZP group of one (the experts weigh the outputs: probabilities permuted along);
    # world 2: tokens cross ranks and the probabilities weigh the combined outputs in the unpermute.
    for rank, got in enumerate(launch(_layer_syncs, world, 2, timeout_s=300)):
        for mb in (1, 2):
            phases = [p for p, _ in got[mb]]
            for phase in ("dispatch preprocess", "experts", "unpermute", "backward"):
                assert phase not in phases, f"rank {rank} microbatch {mb}: {phase} synchronizes: {got[mb]}"
            # the split sizes of the exchange must reach the host: the one synchronization left
            assert phases == ["counts exchange"], f"rank {rank} microbatch {mb}: {got[mb]}"
        # Megatron's MoELayer (unfused permute) for scale: its counts copy and its masked_selects
        assert len(got["megatron"]) >= 2, got["megatron"]
