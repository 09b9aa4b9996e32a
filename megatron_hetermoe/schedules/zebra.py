"""Zebra parallelism: the runtime that executes planner.schedule_tasks' lists.

Attention ranks cut each microbatch's forward into L+1 stages (embedding/attention/router,
then combine + residual + the next attention/router, ..., then combine + head + loss) at
detach points: every tensor crossing a stage boundary enters the next stage as a fresh leaf
(the combined expert output, the residual, the routing probabilities). A stage's backward runs
once all its outputs' gradients exist: the dispatched tokens' gradient from the expert ranks
(D_B) and the residual and gate gradients from the next stage's leaves, summed by one autograd
call, as the paper describes (backward stops at the attention output and resumes when the
expert-input gradients are back). Expert ranks run their experts per (layer, microbatch) on
received leaves.

Transfers run on two worker threads per rank, the "dispatch" and "combine" streams, each owning
one process group, executing its collectives in list order. A compute task waits only for the
transfer named by schedule_tasks.inputs(); everything else overlaps. The R microbatches'
activations are all alive at once; `recompute=True` recomputes attention stages in backward
(Megatron's --recompute-granularity full, per stage).
"""
from __future__ import annotations

import queue
import threading
import time
import weakref
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch.utils.checkpoint import checkpoint

from megatron_hetermoe.config import ZebraConfig
from megatron_hetermoe.emulation.emulator import sleep_until
from megatron_hetermoe.models.experts import run_local_experts
from megatron_hetermoe.parallel import cpu_backend
from megatron_hetermoe.parallel.comm import _a2a, exchange_counts
from megatron_hetermoe.parallel.state import HeteroParallelState
from megatron_hetermoe.reliability import faults
from megatron_hetermoe.schedules.tasks import Task, inputs
from megatron_hetermoe.tools.timeline import TimelineRecorder


class _Stream:
    """A worker thread running one stream's collectives in FIFO order (as a CUDA stream would)."""

    def __init__(self, name: str, recorder: TimelineRecorder | None, failure: Future,
                 on_done: Callable[[str, Task, float], None] | None = None):
        self.name, self.recorder = name, recorder
        self.failure = failure  # shared by a rank's streams: set by the first failed collective
        self.on_done = on_done  # (stream, task, end) before the task's future resolves
        self.ready: dict[Task, float] = {}  # when each collective could start: issued, and the stream free
        self.last_end = 0.0  # when this stream's previous collective ended
        self.q: queue.Queue = queue.Queue()
        self.executed: list[Task] = []
        self.failed: BaseException | None = None
        self.t = threading.Thread(target=self._loop, name=f"zebra-{name}", daemon=True)
        self.t.start()

    def _loop(self):
        while True:
            item = self.q.get()
            if item is None:
                return
            task, fn, fut, issued = item
            if self.failed is not None:
                # After a failed collective every later one would pair with the wrong collective
                # of the peers (gloo then aborts them on a size mismatch): issue nothing more.
                fut.set_exception(self.failed)
                continue
            self.ready[task] = max(issued, self.last_end)
            t0 = time.perf_counter()
            try:
                result = fn()
                t1 = self.last_end = time.perf_counter()
                if self.on_done is not None:
                    self.on_done(self.name, task, t1)
                fut.set_result(result)
            except BaseException as e:  # noqa: BLE001 - surfaced to the main thread by wait()
                self.failed = e
                fut.set_exception(e)
                if not self.failure.done():
                    self.failure.set_exception(e)
                continue
            self.executed.append(task)
            if self.recorder is not None:
                self.recorder.record(self.name, task.kind, task.layer, task.microbatch, t0, t1)

    def submit(self, task: Task, fn, issued: float = 0.0) -> Future:
        """Queue a collective; `issued`: when the rank reached it in its list (the end of the
        compute task before it)."""
        fut: Future = Future()
        self.q.put((task, fn, fut, issued))
        return fut

    def close(self):
        self.q.put(None)
        self.t.join()


@dataclass
class _MB:
    """What one rank keeps for one (layer, microbatch): stage outputs, routing state, transfers."""
    disp: dict = field(default_factory=dict)  # HeteroTokenDispatcher state of this layer/microbatch
    outputs: list = field(default_factory=list)  # stage outputs that get gradients
    permuted: torch.Tensor | None = None
    residual: torch.Tensor | None = None
    probs: torch.Tensor | None = None
    leaves: dict = field(default_factory=dict)  # next stage's input leaves (combined, residual, probs)
    send_splits: list | None = None
    recv_splits: list | None = None
    local_counts: torch.Tensor | None = None
    recv_tokens: torch.Tensor | None = None
    expert_in: torch.Tensor | None = None
    expert_out: torch.Tensor | None = None
    recv_combined: torch.Tensor | None = None
    grad_combined: torch.Tensor | None = None
    recv_grad: torch.Tensor | None = None
    grad_recv: torch.Tensor | None = None
    grad_permuted: torch.Tensor | None = None


class ZebraExecutor:
    """Executes one rank's task list for one step."""

    def __init__(self, hs: HeteroParallelState, hidden_size: int, dtype: torch.dtype, cfg: ZebraConfig,
                 recorder: TimelineRecorder | None, experts_of_layer: Callable[[int], torch.nn.Module | None]):
        self.hs, self.H, self.dtype, self.cfg, self.recorder = hs, hidden_size, dtype, cfg, recorder
        self.experts_of_layer = experts_of_layer
        self.n = len(hs.zp.members)
        self.is_attention = hs.role == "attention"
        self.st: dict[tuple[int, int], _MB] = {}
        self.executed: list[Task] = []
        self.meter = ActivationMeter()
        self._tinfo: dict[Task, tuple] = {}  # emulated transfer: (start, budget, real_end)
        self._ready: Callable[[Task], float] = lambda task: time.perf_counter()  # when a transfer could start

    def mb(self, layer: int, j: int) -> _MB:
        return self.st.setdefault((layer, j), _MB())

    def holds(self, layer: int) -> bool:
        return bool(self.hs.local_experts(layer))

    def _empty(self) -> torch.Tensor:
        return torch.empty(0, self.H, dtype=self.dtype)

    def _timed_a2a(self, task: Task, send: torch.Tensor, out_splits, in_splits, group,
                   started: float | None = None) -> torch.Tensor:
        """The exchange of one comm task. When emulating links, the collective is taken to start
        when its last member could start it (issued, and its stream free; `started`, or learned
        here from one extra row per peer carrying each member's time) and to end its emulated
        duration later, as the simulator has it, so the real gloo cost, and any host delay in
        reaching the call, hide inside the emulated time instead of adding to it."""
        outs, ins = list(map(int, out_splits)), list(map(int, in_splits))
        if self.cfg.transfer_time is None:
            return _a2a(send, outs, ins, group)
        if started is None:
            row = send.new_zeros(1, send.shape[1])
            row.view(-1)[:2] = torch.tensor([self._ready(task)], dtype=torch.float64).view(send.dtype)
            chunks = torch.split(send, ins)
            send = torch.cat([c for ch in chunks for c in (ch, row)])
            got = _a2a(send, [o + 1 for o in outs], [i + 1 for i in ins], group)
            parts = torch.split(got, [o + 1 for o in outs])
            started = max(float(p[-1].view(-1)[:2].contiguous().view(torch.float64)) for p in parts)
            out = torch.cat([p[:-1] for p in parts])
        else:
            out = _a2a(send, outs, ins, group)
        real_end = time.perf_counter()
        nbytes = max(send.numel(), out.numel()) * send.element_size()
        budget = self.cfg.transfer_time(task, nbytes)
        self._tinfo[task] = (started, budget, real_end)
        sleep_until(started + budget)
        return out

    # ---- transfers (run on the stream threads; read the state when they run) -------------
    def comm(self, task: Task) -> Callable[[], None]:
        hs, zeros = self.hs, [0] * self.n
        l, j = task.layer, task.microbatch
        st = self.mb(l, j)

        def d_f():
            if self.is_attention:
                send, send_splits, counts = st.permuted.detach(), st.send_splits, st.disp["per_expert"]
            else:
                send, send_splits = self._empty(), zeros
                counts = torch.zeros(len(hs.layer_order(l)), dtype=torch.int64)
            if self.cfg.transfer_time is not None:  # the counts carry when each member could start
                t_ns = int(self._ready(task) * 1e9)
                allc = exchange_counts(torch.cat([counts.to(torch.int64), torch.tensor([t_ns])]), hs.dispatch_group)
                started, allc = allc[:, -1].max().item() / 1e9, allc[:, :-1]
            else:
                started = None
                allc = exchange_counts(counts, hs.dispatch_group)
            st.local_counts = hs.received_counts(l, allc)
            st.recv_splits = st.local_counts.sum(1).tolist()  # zeros for a rank holding no expert
            st.recv_tokens = self._timed_a2a(task, send, st.recv_splits, send_splits, hs.dispatch_group, started)

        def c_f():
            send = st.expert_out.detach() if self.holds(l) else self._empty()
            st.recv_combined = self._timed_a2a(task, send, st.send_splits if self.is_attention else zeros,
                                               st.recv_splits if self.holds(l) else zeros, hs.combine_group)

        def c_b():
            send = st.grad_combined if self.is_attention else self._empty()
            st.recv_grad = self._timed_a2a(task, send, st.recv_splits if self.holds(l) else zeros,
                                           st.send_splits if self.is_attention else zeros, hs.dispatch_group)

        def d_b():
            send = st.grad_recv if self.holds(l) else self._empty()
            st.grad_permuted = self._timed_a2a(task, send, st.send_splits if self.is_attention else zeros,
                                               st.recv_splits if self.holds(l) else zeros, hs.combine_group)

        return {"D_F": d_f, "C_F": c_f, "C_B": c_b, "D_B": d_b}[task.kind]

    # ---- expert compute (expert ranks: E_*, attention ranks' offloaded experts: X_*) -----
    def expert_forward(self, l: int, j: int) -> None:
        st = self.mb(l, j)
        st.expert_in = st.recv_tokens.detach().requires_grad_()
        st.expert_out = run_local_experts(self.experts_of_layer(l), st.expert_in, st.local_counts)

    def expert_backward(self, l: int, j: int) -> None:
        st = self.mb(l, j)
        torch.autograd.backward(st.expert_out, st.recv_grad)
        st.grad_recv = st.expert_in.grad if st.expert_in.grad is not None else torch.zeros_like(st.expert_in)
        st.expert_in = st.expert_out = None

    # ---- the loop ------------------------------------------------------------------------
    def run(self, tasks: list[Task], compute: Callable[[Task], None]) -> None:
        failure: Future = Future()
        clock = self.cfg.clock
        tx_end: dict[Task, float] = {}  # when each transfer ended

        def done(stream: str, task: Task, end: float) -> None:
            tx_end[task] = end
            info = self._tinfo.pop(task, None)
            if clock is not None and info is not None:
                start, budget, real_end = info
                clock.window(stream, task, start, budget, real_end, end)

        streams = {name: _Stream(name, self.recorder, failure, done) for name in ("dispatch", "combine")}
        self._ready = lambda task: streams[task.stream].ready.pop(task, time.perf_counter())
        futures: dict[Task, Future] = {}

        def wait(fut: Future) -> None:
            # A failed collective on one stream can leave the other stream (and so `fut`) blocked
            # on peers that wait for the failed one: wake up on either.
            futures_wait([fut, failure], return_when=FIRST_COMPLETED)
            if failure.done():
                failure.result()
            fut.result()

        L = self.hs.plan.num_layers
        last_end = clock.t0 if clock is not None else time.perf_counter()  # the previous compute task's end
        try:
            self.meter.__enter__()
            for t in tasks:
                if t.is_comm:
                    futures[t] = streams[t.stream].submit(t, self.comm(t), last_end)
                    continue
                need = inputs(t, L)
                if need is not None:
                    wait(futures[need])
                # When emulating, a task's time starts when it could (the previous task ended and
                # its input arrived), as in the simulator: the host's delay in getting to it and
                # the real work both run inside its emulated time.
                ready = max(last_end, tx_end.get(need, last_end))
                t0 = time.perf_counter()
                faults.checkpoint("task", repr(t))
                compute(t)
                if self.cfg.stretch is not None:
                    real_end = time.perf_counter()
                    budget = self.cfg.stretch(t)
                    t0 = min(t0, ready)
                    sleep_until(t0 + budget)
                last_end = time.perf_counter()
                if clock is not None and self.cfg.stretch is not None:
                    clock.window("compute", t, t0, budget, real_end, last_end)
                self.executed.append(t)
                if self.recorder is not None:
                    self.recorder.record("compute", t.kind, t.layer, t.microbatch, t0, last_end)
            for f in futures.values():
                wait(f)
        except BaseException:
            # A stream may be blocked in a collective with a dead peer: do not join it (it is a
            # daemon thread and its collective times out); let the error end the rank now.
            for s in streams.values():
                s.q.put(None)
            raise
        else:
            for s in streams.values():
                s.close()
        finally:
            self.meter.__exit__(None, None, None)
        self.executed_streams = {k: s.executed for k, s in streams.items()}


class ActivationMeter:
    """Peak bytes of tensors saved for backward (activations; parameters excluded), tracked
    with autograd's saved-tensor hooks: a tensor counts from when it is saved until autograd
    drops it."""

    def __init__(self):
        self.live = 0
        self.peak = 0
        self._ids: set[int] = set()

    def _pack(self, t: torch.Tensor):
        if isinstance(t, torch.nn.Parameter) or id(t) in self._ids:
            return t
        n = t.numel() * t.element_size()
        self._ids.add(id(t))
        self.live += n
        self.peak = max(self.peak, self.live)
        weakref.finalize(t, self._free, id(t), n)
        return t

    def _free(self, key: int, n: int) -> None:
        self._ids.discard(key)
        self.live -= n

    def __enter__(self):
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)


def _in_device_scope(fn):
    """Recomputation runs inside backward, outside the CPU backend's process-wide mode."""

    def wrapped(*a):
        with cpu_backend.device_scope():
            return fn(*a)

    return wrapped


class AttentionZebra:
    """Stage functions of a GPTModel built with HeteroMoELayer (attention rank)."""

    def __init__(self, gpt, hs: HeteroParallelState, cfg: ZebraConfig, recorder: TimelineRecorder | None):
        self.gpt, self.hs, self.cfg = gpt, hs, cfg
        self.layers = gpt.decoder.layers
        c = gpt.config
        self.ex = ZebraExecutor(hs, c.hidden_size, c.params_dtype, cfg, recorder,
                                lambda l: self.layers[l].mlp.experts)

    def _stage(self, s: int, j: int, batch: dict, rope, leaves: tuple):
        """Forward of attention stage s (0..L-1): returns (permuted, residual, probs)."""
        if s == 0:
            hidden = self.gpt.embedding(input_ids=batch["tokens"], position_ids=batch["position_ids"])
        else:
            hidden = self._combine(s - 1, j, leaves)
        layer = self.layers[s]
        hidden, _ = layer._forward_attention(hidden, attention_mask=None, rotary_pos_emb=rope)
        pre = layer._forward_pre_mlp_layernorm(hidden)
        probs, routing_map = layer.mlp.route(pre)
        disp = layer.mlp.token_dispatcher
        disp.state = self.ex.mb(s, j).disp
        permuted, probs_o = layer.mlp.preprocess(pre, probs, routing_map)
        return permuted, hidden, probs_o

    def _combine(self, layer: int, j: int, leaves: tuple):
        """Combine of `layer` for microbatch j: unpermute with the routing probabilities, then
        the MLP's bias-dropout-add onto the residual."""
        combined, residual, probs = leaves
        prev = self.layers[layer]
        disp = prev.mlp.token_dispatcher
        disp.state = dict(self.ex.mb(layer, j).disp, probs=probs)
        out = disp.combine_postprocess(combined)
        return prev._forward_post_mlp((out, None), residual)

    def _head(self, j: int, batch: dict, rope, leaves: tuple):
        hidden = self._combine(len(self.layers) - 1, j, leaves)
        hidden = self.gpt.decoder.final_layernorm(hidden)
        return self.gpt._postprocess(hidden_states=hidden, input_ids=batch["tokens"], position_ids=batch["position_ids"],
                                     labels=batch["labels"], rotary_pos_emb=rope, rotary_pos_cos=None,
                                     rotary_pos_sin=None)

    def run(self, batches: list[dict], loss_funcs: list, tasks: list[Task]) -> list:
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

        R = len(batches)
        L = len(self.layers)
        ex = self.ex
        # Megatron scales the aux loss like the LM loss: 1/R per microbatch (fp32: loss scale 1).
        MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1) / R)
        ropes = [self.gpt.rotary_pos_emb(batches[j]["tokens"].shape[1]) for j in range(R)]
        losses: dict[int, torch.Tensor] = {}
        reported: dict[int, dict] = {}

        def leaves_for(s: int, j: int) -> tuple:
            prev = ex.mb(s - 1, j)
            lv = (prev.recv_combined.detach().requires_grad_(), prev.residual.detach().requires_grad_(),
                  prev.probs.detach().requires_grad_())
            prev.leaves = {"combined": lv[0], "residual": lv[1], "probs": lv[2]}
            return lv

        def compute(t: Task) -> None:
            s, j = t.layer, t.microbatch
            if t.kind == "A_F":
                lv = leaves_for(s, j) if s > 0 else ()
                if s < L:
                    fn = _in_device_scope(lambda *a: self._stage(s, j, batches[j], ropes[j], a))
                    out = checkpoint(fn, *lv, use_reentrant=False) if self.cfg.recompute else fn(*lv)
                    st = ex.mb(s, j)
                    st.permuted, st.residual, st.probs = out
                    st.send_splits = st.disp["send_splits"]
                else:
                    fn = _in_device_scope(lambda *a: self._head(j, batches[j], ropes[j], a))
                    out_tensor = checkpoint(fn, *lv, use_reentrant=False) if self.cfg.recompute else fn(*lv)
                    loss, num_tokens, rep = loss_funcs[j](out_tensor)
                    losses[j] = loss / torch.clamp(num_tokens, min=1) / R
                    reported[j] = rep
            elif t.kind == "A_B":
                if s == L:
                    torch.autograd.backward(losses.pop(j))
                else:
                    st, nxt = ex.mb(s, j), ex.mb(s, j).leaves
                    grads = [st.grad_permuted, nxt["residual"].grad, nxt["probs"].grad]
                    outs = [st.permuted, st.residual, st.probs]
                    keep = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
                    torch.autograd.backward([o for o, _ in keep], [g for _, g in keep])
                    st.permuted = st.residual = st.probs = None
                    st.leaves = {}
                if s > 0:
                    prev = ex.mb(s - 1, j)
                    g = prev.leaves["combined"].grad
                    prev.grad_combined = g if g is not None else torch.zeros_like(prev.leaves["combined"])
            elif t.kind == "X_F":
                ex.expert_forward(s, j)
            elif t.kind == "X_B":
                ex.expert_backward(s, j)
            else:
                raise ValueError(f"attention rank cannot run task {t}")

        ex.run(tasks, compute)
        return [reported[j] for j in range(R)]


class ExpertZebra:
    def __init__(self, runtime, hs: HeteroParallelState, cfg: ZebraConfig, recorder: TimelineRecorder | None):
        self.runtime = runtime
        self.ex = ZebraExecutor(hs, runtime.config.hidden_size, runtime.config.params_dtype, cfg, recorder,
                                lambda l: runtime.decoder.layers[l].mlp.experts)

    def run(self, tasks: list[Task]) -> None:
        ex = self.ex

        def compute(t: Task) -> None:
            if t.kind == "E_F":
                ex.expert_forward(t.layer, t.microbatch)
            elif t.kind == "E_B":
                ex.expert_backward(t.layer, t.microbatch)
            else:
                raise ValueError(f"expert rank cannot run task {t}")

        ex.run(tasks, compute)
