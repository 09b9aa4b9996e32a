"""Host reads of one MoE layer's forward (tools/layer_bench.py HostReads: the synchronizations a GPU
run would make) are no more than Megatron's MoELayer makes for the same shape, and the two layers,
built with the same weights, compute the same output.

Each case runs in launched ranks (their own gloo world): no process group lives in the pytest
process, whose later tests fork their ranks."""
import pytest
import torch

from megatron_hetermoe.parallel.launcher import launch


def _count(rank: int, world: int, model: str, tokens: int) -> dict:
    from megatron_hetermoe.tools import layer_bench as lb

    pair = lb.build_pair(model)
    x = lb.make_input(pair, tokens, seed=rank)
    got = {}
    for name, layer in (("megatron", pair.megatron), ("hetero", pair.hetero)):
        reads = lb.host_reads(layer, x)
        got[name] = (reads.count, reads.sites)
        out, _ = layer(x)
        out.sum().backward()
        got[name + "_out"] = out.detach()
        got[name + "_grad"] = x.grad.clone()
        x.grad = None
    return got


@pytest.mark.parametrize("world", [1, 2])
def test_a_layer_reads_the_host_no_more_than_megatrons(world):
    for rank, got in enumerate(launch(_count, world, "tiny", 64, timeout_s=300)):
        megatron, hetero = got["megatron"], got["hetero"]
        assert megatron[0] >= 1, megatron  # the counter sees Megatron's one synchronization
        assert hetero[0] <= megatron[0], f"rank {rank}: HeterMoE {hetero} vs Megatron {megatron}"
        assert hetero[0] == 1, hetero  # one host copy of the counts per (layer, microbatch)
        # Same weights, same input: the same output and input gradient (the probabilities weigh
        # the expert outputs at another place in a group of two ranks: within float rounding).
        torch.testing.assert_close(got["hetero_out"], got["megatron_out"], rtol=0, atol=1e-6)
        torch.testing.assert_close(got["hetero_grad"], got["megatron_grad"], rtol=0, atol=1e-6)


def test_the_counter_counts_a_read_after_device_work_once():
    from megatron_hetermoe.tools.layer_bench import HostReads

    x = torch.arange(6.0)
    with HostReads() as reads:
        HostReads.mark(x)
        host = torch.tensor([1, 2])  # made from Python values: a host tensor
        host.tolist()
        y = x * 2
        y.sum().item()  # waits for the device: one
        y.tolist()  # nothing queued since: the same synchronization
        z = y.cpu()
        (z + 1).tolist()  # a host copy: free
        int((y + 1).sum())  # device work first: two
    assert (reads.count, reads.reads) == (2, 4), reads.sites
