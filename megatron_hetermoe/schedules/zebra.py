"""Zebra parallelism: the runtime of plan.tasks' lists on attention and expert ranks.

Attention ranks run each microbatch's forward as L+1 stages (models/stages.py) with detach
points between them: every tensor crossing a stage boundary enters the next stage as a fresh
leaf (the combined expert output, the residual, the routing probabilities). A stage's backward
runs once all its outputs' gradients exist: the dispatched tokens' gradient from the expert
ranks (D_B) and the residual and gate gradients from the next stage's leaves, summed by one
autograd call, as the paper describes (backward stops at the attention output and resumes when
the expert-input gradients are back). Expert ranks run their experts per (layer, microbatch) on
received leaves.

Each (layer, microbatch) gets one Route from the transport (parallel/extension.py) in its D_F
transfer; the other three transfers take the same handle. The task executor
(schedules/executor.py) runs transfers on the dispatch and combine streams. The R microbatches'
activations are all alive at once; `recompute=True` recomputes attention stages in backward
(Megatron's --recompute-granularity full, per stage).
"""
from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch.utils.checkpoint import checkpoint

from megatron_hetermoe.config import HeteroRunConfig
from megatron_hetermoe.models.dispatcher import DispatchMeta
from megatron_hetermoe.models.experts import recomputes_experts, run_local_experts
from megatron_hetermoe.models.stages import AttentionStages, StageContext
from megatron_hetermoe.parallel import cpu_backend
from megatron_hetermoe.parallel.extension import ReceivedTokens, Route, TaskTiming
from megatron_hetermoe.parallel.state import HeteroParallelState
from megatron_hetermoe.plan.issue_order import Counts, PipeCall, issue_sequence, stage_pipe_calls
from megatron_hetermoe.plan.tasks import ATTENTION_KINDS, Layers, PipeTask, Task, stage_transfers, task_layers
from megatron_hetermoe.schedules.executor import CUDA, StageIO
from megatron_hetermoe.schedules.issuer import IssueExecutor, make_executor
from megatron_hetermoe.schedules.timeline import TimelineRecorder
from megatron_hetermoe.schedules.timing import LoadedTiming
from megatron_hetermoe.vocabulary import Role, StreamName, TaskKind


_TO_EXPERTS = (TaskKind.D_F, TaskKind.C_B)  # the transfers in the dispatch direction


def _transfer_of(route: Route, task: Task) -> Callable:
    """The route's transfer that transfer task `task` makes: to the experts (D_F, C_B) or back."""
    return route.to_experts if task.kind in _TO_EXPERTS else route.to_attention


def _recomputed(fn, *args):
    """fn(*args) under torch's checkpoint (the stage is run again in its backward), with Megatron's
    RNG tracker states of the forward in place for the recomputation, as Megatron's own checkpoint
    does: torch restores its generators, but attention dropout draws under the tracker's fork,
    whose states have moved on since (the recomputed masks differed: loss off by 4e-3)."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    def contexts():
        tracker = get_cuda_rng_tracker()
        forward_states = tracker.get_states()  # the fork replaces its entries, never changes them in place

        @contextlib.contextmanager
        def recompute():
            after = tracker.get_states()
            tracker.set_states(forward_states)
            try:
                yield
            finally:
                tracker.set_states(after)

        return contextlib.nullcontext(), recompute()

    return checkpoint(fn, *args, use_reentrant=False, context_fn=contexts)


# The slot field a transfer's received tensor goes to, per transfer kind.
_RECEIVED = {TaskKind.D_F: "recv_tokens", TaskKind.C_F: "recv_combined", TaskKind.C_B: "recv_grad",
             TaskKind.D_B: "grad_permuted"}


def _release(t: torch.Tensor, stream) -> None:
    """Before a reference to a CUDA tensor that crossed streams is dropped: tell the caching
    allocator that `stream` uses it, so its block is not handed out again before the work that
    stream already has on it is done (nothing to do on CPU)."""
    if stream is not None and t.is_cuda:
        t.record_stream(stream)


class _IssueOps:
    """A ZebraRank's operations for the single issuer (issuer.IssueOps)."""

    def __init__(self, rank: "ZebraRank"):
        self.counts, self.routed, self.transfer = rank.counts, rank.routed, rank.transfer_async


@dataclass
class Slot:
    """What one rank keeps for one (layer, microbatch) between its tasks."""
    meta: DispatchMeta | None = None  # attention: the dispatch of this layer/microbatch
    route: Route | None = None  # made by D_F
    # Set once D_F made the route: C_F runs on the other stream and may reach it first (a
    # rank that receives nothing in D_F has no compute task between them).
    routed: threading.Event = field(default_factory=threading.Event)
    permuted: torch.Tensor | None = None  # attention: stage outputs that get gradients
    residual: torch.Tensor | None = None
    probs: torch.Tensor | None = None
    shared: torch.Tensor | None = None  # the shared experts' output (None: the model has none)
    carry: tuple = ()  # what the stage passes on to the head (models/stages.py: decoder and MTP outputs)
    leaves: dict = field(default_factory=dict)  # the next stage's input leaves (combined, residual, probs, shared)
    recv_tokens: torch.Tensor | None = None  # D_F's result on an expert holder
    expert_in: torch.Tensor | None = None
    expert_out: torch.Tensor | None = None
    recv_combined: torch.Tensor | None = None  # C_F's result on an attention rank
    grad_combined: torch.Tensor | None = None
    recv_grad: torch.Tensor | None = None  # C_B's result on an expert holder
    grad_recv: torch.Tensor | None = None
    grad_permuted: torch.Tensor | None = None  # D_B's result on an attention rank


class ZebraRank:
    """The state and transfers of one rank's step; AttentionZebra and ExpertZebra add compute."""

    def __init__(self, hs: HeteroParallelState, config, hidden_size: int, dtype: torch.dtype,
                 run: HeteroRunConfig, recorder: TimelineRecorder | None,
                 experts_of_layer: Callable[[int], torch.nn.Module | None], task_timing: TaskTiming | None = None,
                 schedule: str = "zebra"):
        """`config`: the rank's TransformerConfig (its recomputation flags: recomputes_experts);
        `run`: recompute and zebra_issuer are read; `task_timing`: emulated task times
        (schedules/timing.py), else tasks take as long as they run; `schedule`: whose task lists
        the steps run (the single issuer's sequences are made from them). One object serves every
        step of a run (schedules/select.py); its executor keeps the threaded executor's stream
        workers between steps until `close()`."""
        self.hs, self.H, self.dtype, self.recompute = hs, hidden_size, dtype, run.recompute
        self.config = config
        self.task_timing, self.schedule = task_timing, schedule
        self.experts_of_layer = experts_of_layer
        self.is_attention = hs.role == Role.ATTENTION
        # The task lists' layer k is this rank's pipeline stage's k-th MoE layer (every MoE layer
        # without pipeline stages): the plan's layer index for placement and routes.
        self.layer_ids = hs.plan.stage_moe_layers(hs.stage)
        self.slots: dict[tuple[int, int], Slot] = {}
        # Emulated expert tasks are priced for what their experts received (schedules/timing.py).
        executor_timing = None if task_timing is None else LoadedTiming(task_timing, self.received_tokens)
        self.ex = make_executor(task_layers(hs.plan, hs.stage), run.zebra_issuer, recorder, hs.device,
                                hs.transport.backend, executor_timing, keep_streams=True)
        self.sequences: dict[int, list] = {}  # R -> this rank's issue sequence (the single issuer's)

    def close(self) -> None:
        """End what the executor keeps between steps (the threaded executor's stream workers)."""
        self.ex.close()

    def slot(self, layer: int, j: int) -> Slot:
        return self.slots.setdefault((layer, j), Slot())

    def received_tokens(self, task: Task) -> ReceivedTokens | None:
        """What the experts of an expert task (X_*, E_*) received in its (layer, microbatch),
        from its route (on the host: made from the counts exchange); None for other tasks."""
        if task.kind[0] not in "XE":
            return None
        st = self.slots.get((task.layer, task.microbatch))
        if st is None or st.route is None:
            return None
        route = st.route
        return ReceivedTokens(tuple(int(c) for c in route.local_counts.sum(0).tolist()),
                              route.layer_tokens / len(self.hs.layer_order(self.layer_ids[task.layer])))

    def holds(self, layer: int) -> bool:
        return bool(self.hs.local_experts(self.layer_ids[layer]))

    def _move(self, task: Task, send: torch.Tensor | None, started: float | None = None) -> torch.Tensor:
        """Transfer `task`'s rows over its (layer, microbatch)'s route, synchronously. With
        emulated task times the transfer is taken to start when its last member could start it
        (issued, and its stream free): `started` (a D_F's, carried by its counts exchange), or
        else agreed on the transfer's own communicator just before the payload (Transport.latest:
        route metadata, never in the payload), and to end its emulated duration later, as the
        simulator has it; the real cost, and any host delay in reaching the call, hide inside the
        emulated time instead of adding to it."""
        route = self.slot(task.layer, task.microbatch).route
        go = _transfer_of(route, task)
        timing = self.task_timing
        if timing is None:
            return go(send)
        direction = StreamName.DISPATCH if task.kind in _TO_EXPERTS else StreamName.COMBINE
        begun = started if started is not None else self.hs.transport.latest(self.ex.ready(task), direction)
        out = go(send)
        timing.transfer(task, begun, time.perf_counter(), route.pair_rows)
        return out

    # ---- transfers (run on the streams; read the slot when they run) -----------------------
    def _dispatch_counts(self, st: Slot) -> torch.Tensor | None:
        """The per-expert counts a D_F exchanges; None on a rank that routes nothing (an expert rank)."""
        return st.meta.per_expert if self.is_attention else None

    def _send(self, task: Task, st: Slot) -> torch.Tensor | None:
        """What this rank sends in transfer `task` (None: nothing, an empty send)."""
        k, l = task.kind, task.layer
        if k == TaskKind.D_F:
            return st.permuted.detach() if self.is_attention else None
        if k == TaskKind.C_F:
            return st.expert_out.detach() if self.holds(l) else None
        if k == TaskKind.C_B:
            return st.grad_combined if self.is_attention else None
        return st.grad_recv if self.holds(l) else None  # D_B

    def transfer(self, task: Task) -> Callable[[], None]:
        l, j = task.layer, task.microbatch
        st = self.slot(l, j)

        def d_f():
            stamp = int(self.ex.ready(task) * 1e9) if self.task_timing is not None else None
            st.route, got = self.hs.transport.route(self.layer_ids[l], self._dispatch_counts(st), self.H, self.dtype,
                                                    stamp)
            st.routed.set()
            started = got / 1e9 if got is not None else None  # the counts carried when each member could start
            self._received(task, st, self._move(task, self._send(task, st), started))

        def c_f():
            st.routed.wait()
            self._received(task, st, self._move(task, self._send(task, st)))

        def gradient():  # C_B, D_B
            self._received(task, st, self._move(task, self._send(task, st)))
            self._sent(task, st)

        return {TaskKind.D_F: d_f, TaskKind.C_F: c_f, TaskKind.C_B: gradient, TaskKind.D_B: gradient}[task.kind]

    # ---- the single issuer's operations (schedules/issuer.py IssueOps) ----------------------
    def counts(self, c: Counts):
        """Issue the counts exchange of D_F(c) asynchronously: (received counts, Work)."""
        st = self.slot(c.layer, c.microbatch)
        return self.hs.transport.start_route(self.layer_ids[c.layer], self._dispatch_counts(st))

    def routed(self, c: Counts, counts: torch.Tensor) -> None:
        st = self.slot(c.layer, c.microbatch)
        st.route = self.hs.transport.finish_route(self.layer_ids[c.layer], counts, self.H, self.dtype)
        st.routed.set()

    def transfer_async(self, task: Task) -> list:
        """Issue transfer `task` asynchronously (its route exists); a sent buffer is released
        right away (`_sent`: kept for the side stream that reads it)."""
        st = self.slot(task.layer, task.microbatch)
        out, work = _transfer_of(st.route, task)(self._send(task, st), async_op=True)
        self._received(task, st, out)
        self._sent(task, st)
        return [work]

    # ---- buffers: each released after its last consumer ------------------------------------
    def _received(self, task: Task, st: Slot, out: torch.Tensor) -> None:
        """Keep what `task` received for its consumer: an expert task (D_F, C_B: every expert rank's
        E task, an attention rank's X task where it holds experts) or an attention piece (C_F,
        D_B); any other member received an empty tensor and has none."""
        expert_side = not self.is_attention or self.holds(task.layer)
        if expert_side if task.kind in (TaskKind.D_F, TaskKind.C_B) else self.is_attention:
            setattr(st, _RECEIVED[task.kind], out)

    def _sent(self, task: Task, st: Slot) -> None:
        """A gradient's send buffer has no consumer after its transfer was issued (C_B: the
        combined output's gradient on an attention rank; D_B: the expert input's on a holder):
        drop the slot's reference, the block kept for the side stream that reads it."""
        if task.kind == TaskKind.C_B and st.grad_combined is not None:
            _release(st.grad_combined, self._side(task))
            st.grad_combined = None
        elif task.kind == TaskKind.D_B and st.grad_recv is not None:
            _release(st.grad_recv, self._side(task))
            st.grad_recv = None

    def _consumed(self, st: Slot, name: str) -> None:
        """A received buffer's consumer was run (or enqueued on the compute stream): drop it, the
        block kept for the compute stream until then."""
        t = getattr(st, name)
        if t is not None:
            _release(t, self._compute_stream())
            setattr(st, name, None)

    def _side(self, task: Task):
        dev = self.hs.device
        return CUDA.side_stream(dev, task.stream) if dev.type == "cuda" else None

    def _compute_stream(self):
        dev = self.hs.device
        return torch.cuda.current_stream(dev) if dev.type == "cuda" else None

    def execute(self, tasks: list[Task], compute: Callable[[Task], None], stage_io: StageIO | None = None) -> None:
        self.slots.clear()  # a failed step's, should its caller go on
        if isinstance(self.ex, IssueExecutor):
            R = 1 + max(t.microbatch for t in tasks)
            if R not in self.sequences:
                self.sequences[R] = issue_sequence(self.hs.plan, self.hs.rank, R, self.schedule)
            self.ex.run(tasks, self.sequences[R], compute, _IssueOps(self), stage_io)
        else:
            self.ex.run(tasks, compute, self.transfer, stage_io)
        # The step is over: its slots (tensors referenced from the transfers' closures, a cycle
        # through this rank) go now, by reference counting, not at the next full collection.
        self.slots.clear()

    # ---- expert compute (expert ranks: E_*, attention ranks' offloaded experts: X_*) -----
    def expert_forward(self, l: int, j: int) -> None:
        st = self.slot(l, j)
        st.expert_in = st.route.arrived(st.recv_tokens).detach().requires_grad_()
        self._consumed(st, "recv_tokens")
        st.expert_out = run_local_experts(self.experts_of_layer(l), st.expert_in, st.route.local_counts,
                                          recompute=recomputes_experts(self.config, self.hs.plan))

    def expert_backward(self, l: int, j: int) -> None:
        st = self.slot(l, j)
        torch.autograd.backward(st.expert_out, st.route.arrived(st.recv_grad))
        self._consumed(st, "recv_grad")
        st.grad_recv = st.expert_in.grad if st.expert_in.grad is not None else torch.zeros_like(st.expert_in)
        st.expert_in = st.expert_out = None


def _in_device_scope(fn):
    """Recomputation runs inside backward, outside the CPU backend's process-wide mode."""

    def wrapped(*a):
        with cpu_backend.device_scope():
            return fn(*a)

    return wrapped


class AttentionZebra(ZebraRank):
    """An attention rank: its GPTModel's stages (models/stages.py) as A_F/A_B tasks, its
    offloaded experts (Asym-EA) as X_F/X_B tasks. With virtual pipeline stages it holds one
    GPTModel per model chunk (Megatron-LM's get_model builds them), chunk c's stages being the A
    tasks of chunk c and its MoE layers the rank's layers after the earlier chunks'."""

    def __init__(self, gpt, hs: HeteroParallelState, run: HeteroRunConfig, recorder: TimelineRecorder | None,
                 task_timing: TaskTiming | None = None, schedule: str = "zebra"):
        """`gpt`: the rank's GPTModel, or its model chunks' in order (virtual stages)."""
        gpts = list(gpt) if isinstance(gpt, (list, tuple)) else [gpt]
        self.chunks = [AttentionStages(g) for g in gpts]
        self.stages = self.chunks[0]
        want = task_layers(hs.plan, hs.stage)
        got = tuple(st.num_layers for st in self.chunks)
        if got != want:
            raise ValueError(f"attention rank {hs.rank}: its model chunks hold {list(got)} MoE layers, but the plan's "
                             f"pipeline stage {hs.stage} has {list(want)} per chunk; build the model the plan was made "
                             f"for (its layers, --moe-layer-freq, virtual stages)")
        self.offsets = [sum(got[:c]) for c in range(len(got))]  # chunk c's first MoE layer among the rank's
        layers = [tl for st in self.chunks for tl in st.layers]
        c = gpts[0].config
        super().__init__(hs, c, c.hidden_size, c.params_dtype, run, recorder,
                         lambda l: layers[l].mlp.experts, task_timing, schedule)
        P, V = hs.plan.pipeline_stages, len(self.chunks)
        self.first_chunk = 0 if hs.stage == 0 else None  # the chunk that embeds the tokens (virtual stage 0)
        self.loss_chunk = V - 1 if hs.stage == P - 1 else None  # the chunk that computes the loss
        self._pipeline_ready = False  # the pipeline group's communicator made by all its members

    def _stage(self, c: int, s: int, j: int, batch: dict, leaves: tuple):
        """Forward of attention stage s (0..L-1) of chunk c: returns (permuted, residual, probs,
        shared, *carry) and keeps the stage's DispatchMeta in its slot; stage 0 also keeps the
        microbatch's StageContext (attention mask, rotary embedding), which every later stage of
        the chunk reads. On a (virtual) pipeline stage after the first, stage 0 starts from the
        previous stage's output (`leaves`: its received leaf). `carry`: what the stage passes on to
        the head besides its MoE layer's pieces (models/stages.py: the decoder's and MTP layers'
        outputs)."""
        carry: tuple = ()
        if s == 0:
            hidden, self.contexts[(c, j)] = self.chunks[c].embed(batch, leaves[0] if leaves else None)
        else:
            hidden, carry = self._combine(c, s - 1, j, leaves)
        meta, permuted, residual, probs, shared, carry = self.chunks[c].attention_and_route(
            s, hidden, self.contexts[(c, j)], batch, carry)
        self.slot(self.offsets[c] + s, j).meta = meta
        return (permuted, residual, probs, shared, *carry)

    def _combine(self, c: int, layer: int, j: int, leaves: tuple):
        combined, residual, probs, shared, *carry = leaves
        meta = self.slot(self.offsets[c] + layer, j).meta
        return self.chunks[c].combine(layer, meta, combined, residual, probs, shared), tuple(carry)

    def _head(self, c: int, j: int, batch: dict, leaves: tuple):
        hidden, carry = self._combine(c, self.chunks[c].num_layers - 1, j, leaves)
        return self.chunks[c].head(hidden, batch, self.contexts[(c, j)], carry)

    def run(self, batches: list, loss_funcs: list, tasks: list[Task],
            seq_shape: tuple[int, int] | None = None) -> tuple[list, torch.Tensor | None]:
        """The step: (each microbatch's reported losses (none on a pipeline stage before the
        last), the step's tokens with --calculate-per-token-loss, else None). `batches` and
        `loss_funcs`: per microbatch, or with several model chunks per chunk and microbatch (a
        chunk that neither embeds nor computes the loss reads no batch: Megatron-LM's get_batch
        gives it Nones). `seq_shape`: (sequence length, micro-batch size), what a pipeline stage
        after the first receives. Nothing of it stays on the rank object (a long run's memory
        stays flat)."""
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

        if len(self.chunks) == 1:
            batches, loss_funcs = [batches], [loss_funcs]
        R = len(batches[0])
        # As Megatron's forward_step: the loss is scaled by config.grad_scale_func (the optimizer's
        # loss scale), and the aux loss by grad_scale_func(1) / R; with --calculate-per-token-loss
        # the losses are token sums (no division: finalize_model_grads divides the gradients by the
        # step's tokens, which run returns) and the aux loss is scaled by grad_scale_func(1).
        # Megatron-LM's training loop sets these on the first chunk's config.
        config = self.chunks[0].gpt.config
        per_token = config.calculate_per_token_loss
        scale_loss = config.grad_scale_func or (lambda t: t)
        one = scale_loss(torch.ones(1, device=self.hs.device))
        # Megatron's forward_step scales the aux loss by the CP size too (its gradient is averaged over dp x cp).
        MoEAuxLossAutoScaler.set_loss_scale(one if per_token else one * config.context_parallel_size / R)
        if config.mtp_num_layers:  # the MTP losses' backward scale, as Megatron's forward_step sets it
            from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

            MTPLossAutoScaler.set_loss_scale(one if per_token else one / R)
        num_tokens_step = torch.zeros((), dtype=torch.int, device=self.hs.device) if per_token else None
        self.contexts: dict[tuple[int, int], StageContext] = {}  # (chunk, microbatch) ->
        losses: dict[int, torch.Tensor] = {}
        reported: dict[int, dict] = {}
        pipe = _PipelineNeighbours(self.hs, config, seq_shape, task_layers(self.hs.plan, self.hs.stage), tasks,
                                   self.task_timing, sequenced=isinstance(self.ex, IssueExecutor),
                                   schedule=self.schedule)
        if pipe.active and not self._pipeline_ready:
            # batch_isend_irecv's first call on a group must include every member (torch's rule
            # for NCCL's lazily made communicators); a stage's first call has one neighbour only.
            pipe.warm_up()
            self._pipeline_ready = True

        def leaves_for(c: int, s: int, j: int) -> tuple:
            if s == 0:  # the previous (virtual) pipeline stage's output of microbatch j (none on the first)
                return () if c == self.first_chunk else (pipe.inputs[(c, j)],)
            prev = self.slot(self.offsets[c] + s - 1, j)
            lv = (prev.route.arrived(prev.recv_combined).detach().requires_grad_(),
                  prev.residual.detach().requires_grad_(),
                  prev.probs.detach().requires_grad_(),
                  None if prev.shared is None else prev.shared.detach().requires_grad_(),
                  *(x.detach().requires_grad_() for x in prev.carry))
            self._consumed(prev, "recv_combined")
            prev.leaves = {"combined": lv[0], "residual": lv[1], "probs": lv[2], "shared": lv[3], "carry": lv[4:]}
            return lv

        def compute(t: Task) -> None:
            s, j = t.layer, t.microbatch
            if t.kind in (TaskKind.A_F, TaskKind.A_B):
                c = t.chunk
                L, k = self.chunks[c].num_layers, self.offsets[c] + s  # k: the rank's MoE layer s of chunk c
            if t.kind == TaskKind.A_F:
                lv = leaves_for(c, s, j)
                if s < L:
                    fn = _in_device_scope(lambda *a: self._stage(c, s, j, batches[c][j], a))
                    out = _recomputed(fn, *lv) if self.recompute else fn(*lv)
                    st = self.slot(k, j)
                    st.permuted, st.residual, st.probs, st.shared, *carry = out
                    st.carry = tuple(carry)
                else:
                    fn = _in_device_scope(lambda *a: self._head(c, j, batches[c][j], a))
                    out_tensor = _recomputed(fn, *lv) if self.recompute else fn(*lv)
                    if c != self.loss_chunk:  # this chunk's output of microbatch j: pipe.send sends it
                        pipe.outputs[(c, j)] = out_tensor
                        return
                    loss, num_tokens, rep = loss_funcs[c][j](out_tensor)
                    if per_token:
                        losses[j] = loss
                        num_tokens_step.add_(num_tokens)
                    else:
                        losses[j] = loss / torch.clamp(num_tokens, min=1) / R
                    reported[j] = rep
            elif t.kind == TaskKind.A_B:
                if s == L and c != self.loss_chunk:  # the next stage's gradient of this chunk's output
                    torch.autograd.backward(pipe.outputs.pop((c, j)), pipe.grads.pop((c, j)))
                elif s == L:
                    torch.autograd.backward(scale_loss(losses.pop(j)))
                else:
                    st = self.slot(k, j)
                    nxt = st.leaves
                    grads = [st.route.arrived(st.grad_permuted), nxt["residual"].grad, nxt["probs"].grad,
                             None if nxt["shared"] is None else nxt["shared"].grad,
                             *(x.grad for x in nxt["carry"])]
                    outs = [st.permuted, st.residual, st.probs, st.shared, *st.carry]
                    keep = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
                    torch.autograd.backward([o for o, _ in keep], [g for _, g in keep])
                    self._consumed(st, "grad_permuted")
                    st.permuted = st.residual = st.probs = st.shared = None
                    st.carry = ()
                    st.leaves = {}
                if s > 0:
                    prev = self.slot(k - 1, j)
                    g = prev.leaves["combined"].grad
                    prev.grad_combined = g if g is not None else torch.zeros_like(prev.leaves["combined"])
                # on a (virtual) stage after the first, pipe.send sends the received input's gradient back
            elif t.kind == TaskKind.X_F:
                self.expert_forward(s, j)
            elif t.kind == TaskKind.X_B:
                self.expert_backward(s, j)
            else:
                raise ValueError(f"attention rank cannot run task {t}")

        try:
            self.execute(tasks, compute, pipe if pipe.active else None)
            pipe.finish()
        finally:
            pipe.close()
        self.contexts.clear()
        if per_token and self.hs.plan.pipeline_stages > 1:  # the last stage counts the step's tokens
            pipe.share_from_last(num_tokens_step)
        return [reported[j] for j in range(R)] if self.loss_chunk is not None else [], num_tokens_step


class _Posted:
    """One posted pipeline call: its Works and the tensors it sends (kept until they are sent).
    Waited once: gloo's Work.wait() on a receive that already completed waits for another one."""

    def __init__(self, works: list, keep: list):
        self.works, self.keep, self.waited = works, keep, False

    def wait(self) -> None:
        if not self.waited:
            for w in self.works:
                w.wait()
            self.waited = True


class _PipelineNeighbours:
    """An attention rank's point-to-point traffic with the previous and next pipeline stage (the
    same member and TP position; Megatron's P2P tensors: [sequence (its slice with sequence
    parallelism), micro-batch, hidden] in config.pipeline_dtype). It goes in the stage's calls
    (plan.issue_order.pipe_calls): the messages both neighbours post together, one
    batch_isend_irecv each, in one order on both sides, so a send never waits for a receive the
    peer queued behind its own send (NCCL runs a pair's sends and receives on one stream).
    `sequenced`: the single issuer issues the calls as items of its sequence (`issue`); else the
    executor's hooks do, a call right after the A task its key names (`send`) or, for the first,
    before the first A task (`receive`). A task's received input is waited for right before it
    (`receive`); what a task produces for a neighbour is kept for its call (`send`); sends are
    waited at the end of the step. Without pipeline stages there is none. With virtual stages
    stage P - 1's next is stage 0 (a chunk's output goes on to the next chunk there), and a
    message's tensors are the (model chunk, microbatch)'s.

    With emulated task times each transfer is a window, as the simulator's PipeTask: the sender
    sends, ahead of the tensor, when its producing task ended; the receiver starts the window at
    the latest of that, when it reached the consuming task and when its previous transfer of that
    direction ended, and the consuming task starts when the window closed."""

    def __init__(self, hs: HeteroParallelState, config, seq_shape: tuple[int, int] | None, num_layers: Layers,
                 tasks: list[Task], timing: TaskTiming | None = None, sequenced: bool = False,
                 schedule: str = "zebra"):
        import torch.distributed as dist

        self.dist, self.hs, self.L, self.timing, self.sequenced = dist, hs, num_layers, timing, sequenced
        ranks = hs.layout.ranks("pp")
        k = ranks.index(hs.rank)
        self.stage, self.stages = k, len(ranks)
        self.active = len(ranks) > 1
        # With virtual stages the last stage's chunks send on to the first stage's next chunk.
        self.ring = hs.plan.virtual_stages > 1
        self.prev = ranks[k - 1] if k > 0 else ranks[-1] if self.ring else None
        self.next = ranks[k + 1] if k + 1 < len(ranks) else ranks[0] if self.ring else None
        self.last = ranks[-1]
        self.group = hs.megatron_group("pp")
        self.dtype = config.pipeline_dtype or config.params_dtype
        if seq_shape is not None:
            seq, mbs = seq_shape
            tp = config.tensor_model_parallel_size if config.sequence_parallel else 1
            self.shape = (seq // (tp * config.context_parallel_size), mbs, config.hidden_size)  # Megatron's P2P shape
        self.a_index = {t: i for i, t in enumerate(t for t in tasks if t.kind in ATTENTION_KINDS)}
        self.calls_after: dict[int, list[PipeCall]] = {}  # A task index (-1: before the first) -> its calls
        if self.active:
            R = 1 + max(t.microbatch for t in tasks)
            for key, call in stage_pipe_calls(hs.plan, self.stage, R, schedule):
                self.calls_after.setdefault(int(key - 0.5), []).append(call)
        # keyed by (model chunk, microbatch):
        self.inputs: dict[tuple[int, int], torch.Tensor] = {}  # the previous stage's output (a leaf)
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}  # this stage's output, until its backward
        self.grads: dict[tuple[int, int], torch.Tensor] = {}  # the next stage's gradient of that output
        self.produced: dict[PipeTask, tuple[torch.Tensor, float]] = {}  # a message's tensor, when it was made
        self.posted: dict[PipeTask, tuple[torch.Tensor, torch.Tensor | None, _Posted]] = {}  # receive buffers
        self.sends: list[_Posted] = []  # every posted call, until the step's end
        self.lane_end: dict[str, float] = {}  # emulated: when the last transfer of each direction ended

    def warm_up(self) -> None:
        """One collective over the pipeline group, by all its members at the start of a run."""
        self.dist.barrier(group=self.group)

    def issue(self, call: PipeCall) -> None:
        """Post one call: its messages in the call's order (both sides list them alike), each
        preceded by its emulated send time where tasks are timed."""
        P2POp = self.dist.P2POp
        ops, keep, recvs = [], [], []
        for m in call.messages:
            peer = self.prev if m.peer < 0 else self.next
            tag = self._tag(m.task)
            if m.send:
                x, end = self.produced.pop(m.task)
                if self.timing is not None:
                    stamp = torch.tensor([end], dtype=torch.float64, device=self.hs.device)
                    ops.append(P2POp(self.dist.isend, stamp, peer, self.group, tag + 1))
                    keep.append(stamp)
                ops.append(P2POp(self.dist.isend, x, peer, self.group, tag))
                keep.append(x)
                continue
            out = self.outputs.get(self._key(m.task, sent=False))  # a P_B's: the output it is the gradient of
            if m.task.kind == TaskKind.P_F or out is None:  # (posted before it exists with virtual stages)
                buf = torch.empty(self.shape, dtype=self.dtype, device=self.hs.device)
            else:
                buf = torch.empty_like(out)
            stamp = None
            if self.timing is not None:
                stamp = torch.empty(1, dtype=torch.float64, device=self.hs.device)
                ops.append(P2POp(self.dist.irecv, stamp, peer, self.group, tag + 1))
            ops.append(P2POp(self.dist.irecv, buf, peer, self.group, tag))
            recvs.append((m.task, buf, stamp))
        posted = _Posted(self.dist.batch_isend_irecv(ops), keep)
        for task, buf, stamp in recvs:
            self.posted[task] = (buf, stamp, posted)
        self.sends.append(posted)

    def _key(self, m: PipeTask, sent: bool) -> tuple[int, int]:
        """(model chunk, microbatch) of message `m` on this rank: the chunk that sends it or, for
        a receive, the virtual stage after (P_F) or before (P_B) the sending one."""
        u = m.layer if sent else m.layer + (1 if m.kind == TaskKind.P_F else -1)
        return u // self.stages, m.microbatch

    def _tag(self, m: PipeTask) -> int:
        """Gloo matches a pair's messages by tag (NCCL by order, the same on both sides); with
        virtual stages a pair exchanges several messages of one microbatch, each its own tag.
        Odd tags: the emulated send times ahead of them."""
        if not self.ring:
            return 2 * m.microbatch
        return 2 * ((m.microbatch * self.stages * self.hs.plan.virtual_stages + m.layer) * 2 + (m.kind == TaskKind.P_B))

    def _issue_after(self, a: int) -> None:
        for call in self.calls_after.pop(a, []):
            self.issue(call)

    def receive(self, task: Task, ready: float) -> float | None:
        if not self.sequenced and self.a_index.get(task) == 0:
            self._issue_after(-1)
        recv, _ = stage_transfers(task, self.stage, self.stages, self.L)
        if recv is None:
            return None
        buf, stamp, posted = self.posted.pop(recv)
        posted.wait()  # CPU: the data is here; NCCL: the current stream waits for it
        end = None
        if self.timing is not None:
            start = max(float(stamp), ready, self.lane_end.get(recv.kind, self.timing.origin()))
            end = self.timing.transfer(recv, start, time.perf_counter())
            self.lane_end[recv.kind] = end
        key = (task.chunk, task.microbatch)
        if recv.kind == TaskKind.P_F:
            self.inputs[key] = buf.requires_grad_()
        else:
            self.grads[key] = buf
        return end

    def send(self, task: Task, end: float) -> None:
        _, send = stage_transfers(task, self.stage, self.stages, self.L)
        if send is not None:
            key = (task.chunk, task.microbatch)
            if send.kind == TaskKind.P_F:
                x = self.outputs[key].detach()
            else:
                inp = self.inputs.pop(key)
                x = inp.grad if inp.grad is not None else torch.zeros_like(inp)
            self.produced[send] = (x.contiguous(), end)
        if not self.sequenced and task in self.a_index:
            self._issue_after(self.a_index[task])

    def finish(self) -> None:
        for posted in self.sends:
            posted.wait()
        self.sends.clear()

    def close(self) -> None:
        self.inputs.clear()
        self.outputs.clear()
        self.grads.clear()
        self.produced.clear()
        self.posted.clear()
        self.sends.clear()

    def share_from_last(self, value: torch.Tensor) -> None:
        """`value` (the step's tokens) as the last stage has it, on every stage of the pipeline."""
        self.dist.broadcast(value, src=self.last, group=self.group)


class ExpertZebra(ZebraRank):
    """An expert rank: its ExpertRuntime's experts as E_F/E_B tasks."""

    def __init__(self, runtime, hs: HeteroParallelState, run: HeteroRunConfig, recorder: TimelineRecorder | None,
                 task_timing: TaskTiming | None = None, schedule: str = "zebra"):
        super().__init__(hs, runtime.config, runtime.config.hidden_size, runtime.config.params_dtype, run, recorder,
                         lambda l: runtime.experts_of(self.layer_ids[l]), task_timing, schedule)

    def run(self, tasks: list[Task]) -> None:
        def compute(t: Task) -> None:
            if t.kind == TaskKind.E_F:
                self.expert_forward(t.layer, t.microbatch)
            elif t.kind == TaskKind.E_B:
                self.expert_backward(t.layer, t.microbatch)
            else:
                raise ValueError(f"expert rank cannot run task {t}")

        self.execute(tasks, compute)
