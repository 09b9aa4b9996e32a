"""A token backend of its own plugs in through parallel/extension.py's Transport and Route alone:
a point-to-point backend written here (counts by all-reduce, rows by isend/irecv per peer, its own
route handle) carries every transfer of DistEP, zebra and the single issuer, with no all-to-all,
and the run's losses and gradient norms are bitwise the all-to-all backend's."""
from __future__ import annotations

import json
import threading

import pytest
import torch
import torch.distributed as dist
from shared_plans import sparse_asym_ea_plan

from megatron_hetermoe.config import HeteroRunConfig, ParallelConfig, TrainConfig
from megatron_hetermoe.parallel.launcher import launch
from megatron_hetermoe.training.hetero import train_hetero
from megatron_hetermoe.training.run_hooks import RunHooks



class _Requests:
    """The Work of one transfer: its point-to-point requests. gloo's send/recv Work completes only
    in wait() and has no future, so a thread waits and completes one (the single issuer polls it)."""

    def __init__(self, reqs: list):
        self.future = torch.futures.Future()

        def wait_all():
            for r in reqs:
                r.wait()
            self.future.set_result(None)

        threading.Thread(target=wait_all, daemon=True).start()

    def get_future(self):
        return self.future

    def wait(self) -> bool:
        self.future.wait()
        return True

    def is_completed(self) -> bool:
        return self.future.done()


class _Transfer(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, route, to_experts: bool):
        ctx.route, ctx.to_experts = route, to_experts
        return route.arrived(route.to_experts(x) if to_experts else route.to_attention(x))

    @staticmethod
    def backward(ctx, grad):
        r = ctx.route
        return r.to_attention(grad) if ctx.to_experts else r.to_experts(grad), None, None


class P2PRoute:
    def __init__(self, backend: "P2PTransport", send: list[int], recv: list[int], local_counts: torch.Tensor,
                 width: int, dtype: torch.dtype, layer_tokens: int, pair_rows: tuple):
        self.backend, self.send, self.recv, self.width, self.dtype = backend, send, recv, width, dtype
        self.local_counts, self.layer_tokens, self.pair_rows = local_counts, layer_tokens, pair_rows

    def empty(self) -> torch.Tensor:
        return torch.empty(0, self.width, dtype=self.dtype)

    def arrived(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.dtype)

    def _move(self, x, send, recv, group, async_op):
        x = self.empty() if x is None else x.contiguous()
        out = x.new_empty((sum(recv), self.width))
        ops, hs = [], self.backend.hs
        for k, (rows_out, rows_in) in enumerate(zip(x.split(send), out.split(recv))):
            peer = hs.comm_order[k]
            if peer == hs.rank:
                rows_in.copy_(rows_out)
                continue
            if send[k]:
                ops.append(dist.P2POp(dist.isend, rows_out.contiguous(), peer, group))
            if recv[k]:
                ops.append(dist.P2POp(dist.irecv, rows_in, peer, group))
        self.backend.transfers += 1
        work = _Requests(dist.batch_isend_irecv(ops) if ops else [])
        if async_op:
            return out, work
        work.wait()
        return out

    def to_experts(self, x, async_op=False):
        return self._move(x, self.send, self.recv, self.backend.hs.group("dispatch"), async_op)

    def to_attention(self, x, async_op=False):
        return self._move(x, self.recv, self.send, self.backend.hs.group("combine"), async_op)

    def dispatch(self, x):
        return _Transfer.apply(x, self, True)

    def combine(self, y):
        return _Transfer.apply(y, self, False)


class P2PTransport:
    """Counts: each member writes its row of a [members, experts] matrix, one all-reduce sums them."""

    def __init__(self, hs):
        self.hs, self.members, self.backend, self.transfers = hs, len(hs.comm_order), "gloo", 0

    def _counts(self, layer, per_expert, group, async_op):
        hs = self.hs
        allc = torch.zeros(self.members, len(hs.layer_order(layer)), dtype=torch.int64)
        if per_expert is not None:
            allc[hs.comm_order.index(hs.rank)] = per_expert.to(torch.int64)
        work = dist.all_reduce(allc, group=group, async_op=True)
        if async_op:
            return allc, work
        work.wait()
        return allc

    def start_route(self, layer, per_expert):
        return self._counts(layer, per_expert, self.hs.group("counts"), True)

    def finish_route(self, layer, all_counts, width, dtype):
        hs = self.hs
        sizes = hs.member_sizes(layer)
        starts = [sum(sizes[:k]) for k in range(len(sizes))]
        pairs = tuple(tuple(int(row[s:s + n].sum()) for s, n in zip(starts, sizes)) for row in all_counts)
        local = hs.received_counts(layer, all_counts)
        me = hs.comm_order.index(hs.rank)
        return P2PRoute(self, list(pairs[me]), [p[me] for p in pairs], local, width, dtype, int(all_counts.sum()),
                        pairs)

    def route(self, layer, per_expert, width, dtype, stamp=None):
        assert stamp is None  # no emulation here
        return self.finish_route(layer, self._counts(layer, per_expert, self.hs.group("dispatch"), False), width,
                                 dtype), None

    def latest(self, value, direction):
        raise AssertionError("no emulation here")


def _run(tiny, plan, issuer, p2p):
    cfg = TrainConfig(tiny, ParallelConfig(), micro_batch_size=1, global_batch_size=4, train_iters=3, quiet=True)
    return launch(_run_rank, 4, cfg, plan, issuer, p2p)


def _run_rank(rank, world, cfg, plan, issuer, p2p):
    made = []

    def backend(hs):
        made.append(P2PTransport(hs))
        return made[-1]

    r = train_hetero(cfg, plan, HeteroRunConfig(zebra_issuer=issuer), RunHooks(transport=backend if p2p else None))
    return r.losses, r.grad_norms, made[0].transfers if made else None


@pytest.mark.parametrize("schedule, issuer", [("distep", "auto"), ("zebra", "threads"), ("zebra", "single")])
def test_a_point_to_point_backend_plugs_in_and_changes_no_bit(tiny, tmp_path, monkeypatch, schedule, issuer):
    from megatron_hetermoe.reliability import collective_trace

    plan = sparse_asym_ea_plan(schedule)  # an attention rank holding experts, an expert rank holding none in a layer
    ref = _run(tiny, plan, issuer, False)
    monkeypatch.setenv(collective_trace.ENV, str(tmp_path))
    got = _run(tiny, plan, issuer, True)
    assert [(losses, norms) for losses, norms, _ in got] == [(losses, norms) for losses, norms, _ in ref]
    # Every rank's transfers went through the test's backend: 2 layers x 2 microbatches x 3 steps,
    # 4 transfers each (dispatch, combine and their gradients).
    assert [n for _, _, n in got] == [2 * 2 * 3 * 4] * 4
    records = [json.loads(ln) for f in tmp_path.glob("collectives.rank*.jsonl") for ln in f.read_text().splitlines()]
    ops = {r["op"] for r in records if "op" in r}
    assert ops and "all_to_all_single" not in ops, ops
