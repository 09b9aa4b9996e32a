"""The task lists every rank executes in one training step: Theorem 1's zebra order, and the
non-overlapped DistEP order. The runtime executes exactly these lists; the simulator too.

Notation. L MoE layers, R microbatches. Attention stage s in 0..L:
  s=0      embedding + attention_1 + router_1
  0<s<L    combine of layer s-1 + residual + attention_{s+1} + router_{s+1}
  s=L      combine of the last layer + final norm + output head + loss
Expert layer l in 0..L-1 sits between attention stages l and l+1.

Task kinds, the rank that runs them, and the stream each one runs on:
  compute stream (one task at a time, in list order):
    A_F / A_B  attention rank: forward / backward of attention stage `layer` (0..L)
    X_F / X_B  attention rank: its offloaded experts of expert layer `layer` (Asym-EA); X_F
               runs after A_F of all R microbatches of stage `layer`; backward mirrored
               (X_B of all R microbatches before A_B of stage `layer`)
    E_F / E_B  expert rank: its experts of expert layer `layer`
  dispatch stream (attention -> expert direction; one collective at a time):
    D_F  forward dispatch of layer `layer`: routed tokens to the experts' holders
    C_B  backward of combine: gradients of the expert outputs, to the experts' holders
  combine stream (expert -> attention direction; one collective at a time):
    C_F  forward combine of layer `layer`: expert outputs back to the attention ranks
    D_B  backward of dispatch: gradients of the routed tokens, back to the attention ranks
Every comm task is an all_to_all over all members of the ZP group (ranks with nothing to send
pass zero split sizes), so the dispatch stream and the combine stream each carry one process
group. On each stream every member of a group issues the same collectives in the same order
(`check_stream_order`), which is what makes the lists deadlock-free.

Where a comm task sits in a list = the point it is issued: right after the compute task that
produces its send buffer; a rank that only receives in it posts it as soon as the data could
exist: an attention rank without experts in layer l posts C_F(l, j) right after D_F(l, j) and
D_B(l, j) right after C_B(l, j); an expert rank posts D_F(0, *) first, and the receive of
microbatch j's next input (D_F(l+1, j), or C_B(L-1, j) after the last layer, or C_B(l-1, j)
in backward) right after sending microbatch j's output of the current layer.
A compute task waits only for the comm task named by `inputs()`; issuing is asynchronous.

Theorem 1 order (0-based, R microbatches j):
  attention: A_F(s, 0..R-1) for s = 0..L-1; then A_F(L, j) A_B(L, j) for j = 0..R-1;
             then A_B(s, 0..R-1) for s = L-1..0
  expert:    E_F(l, 0..R-1) for l = 0..L-1; then E_B(l, 0..R-1) for l = L-1..0

Virtual pipeline stages (Megatron's interleaved model chunks, plan.virtual_stages V > 1): an
attention rank holds V model chunks, chunk c of pipeline stage s being virtual stage u = c*P + s.
Its MoE layers are numbered over all its chunks (chunk 0's first: plan.stage_moe_layers), which
every non-A task's `layer` is; an A task names its chunk (`Task.chunk`) and the attention stage
within it (0..L_c, L_c the chunk's MoE layers). `num_layers` arguments take the per-chunk counts
(a tuple; an int is one chunk). Each (chunk, wave of microbatches) is one item of Theorem 1's
forward or backward, in Megatron's interleaved order over the waves (zebra_interleaved_items).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from megatron_hetermoe.vocabulary import Role, StreamName, TaskKind

COMPUTE_KINDS = (TaskKind.A_F, TaskKind.A_B, TaskKind.X_F, TaskKind.X_B, TaskKind.E_F, TaskKind.E_B)
COMM_KINDS = (TaskKind.D_F, TaskKind.C_F, TaskKind.C_B, TaskKind.D_B)
ATTENTION_KINDS = (TaskKind.A_F, TaskKind.A_B)  # the attention pieces (may hold collectives among attention ranks)
STREAM = {
    **{k: StreamName.COMPUTE for k in COMPUTE_KINDS},
    TaskKind.D_F: StreamName.DISPATCH, TaskKind.C_B: StreamName.DISPATCH,
    TaskKind.C_F: StreamName.COMBINE, TaskKind.D_B: StreamName.COMBINE,
}


@dataclass(frozen=True)
class Task:
    kind: TaskKind
    layer: int  # attention stage (A_*, within its chunk) or expert layer (all other kinds, the rank's)
    microbatch: int
    chunk: int = 0  # A_*: the model chunk (virtual pipeline stage) it runs; 0 without virtual stages

    def __repr__(self) -> str:
        return f"{self.kind}({self.layer},{self.microbatch}" + (f",c{self.chunk})" if self.chunk else ")")

    @property
    def stream(self) -> StreamName:
        return STREAM[self.kind]

    @property
    def is_comm(self) -> bool:
        return self.kind in COMM_KINDS


@dataclass(frozen=True)
class PipeTask:
    """A transfer between pipeline stages, which no task list holds (the runtime does it at the
    attention task that produces or consumes it; the simulator inserts it there): P_F, stage
    `layer`'s output of microbatch j to the next stage (every attention rank to its
    counterpart); P_B, the gradient of stage `layer`'s input back to the previous stage. Sender
    and receiver both issue it (a send waits for its receive). With virtual stages `layer` is
    the sending virtual stage u = chunk * P + stage; the next of stage P - 1 is stage 0."""

    kind: TaskKind
    layer: int  # the sending (virtual) pipeline stage
    microbatch: int
    is_comm = True

    def __repr__(self) -> str:
        return f"{self.kind}({self.layer},{self.microbatch})"

    @property
    def stream(self) -> StreamName:
        return StreamName.PIPELINE


Layers = int | Sequence[int]  # a rank's MoE layers: per model chunk, or an int for one chunk


def chunk_counts(num_layers: Layers) -> tuple[int, ...]:
    """The MoE layers of each of a rank's model chunks (`num_layers` an int: one chunk)."""
    return (num_layers,) if isinstance(num_layers, int) else tuple(num_layers)


def stage_transfers(task: Task, stage: int, stages: int, num_layers: Layers) -> tuple[PipeTask | None, PipeTask | None]:
    """(the transfer an attention rank of pipeline stage `stage` receives before `task`, the one it
    sends after it); num_layers: the stage's MoE layers, per model chunk with virtual stages (a
    chunk's last attention piece is its count). A (virtual) stage after the first receives its
    input before its first piece's forward and sends that input's gradient after its backward; a
    (virtual) stage before the last sends its output after its last piece's forward and receives
    the output's gradient before its backward."""
    k, l, j = task.kind, task.layer, task.microbatch
    if k not in ATTENTION_KINDS:
        return None, None
    counts = chunk_counts(num_layers)
    u, last, end = task.chunk * stages + stage, stages * len(counts) - 1, counts[task.chunk]
    recv = send = None
    if k == TaskKind.A_F:
        if u > 0 and l == 0:
            recv = PipeTask(TaskKind.P_F, u - 1, j)
        if u < last and l == end:
            send = PipeTask(TaskKind.P_F, u, j)
    else:
        if u < last and l == end:
            recv = PipeTask(TaskKind.P_B, u + 1, j)
        if u > 0 and l == 0:
            send = PipeTask(TaskKind.P_B, u, j)
    return recv, send


def inputs(task: Task, num_layers: Layers) -> Task | None:
    """The comm task whose result a compute task waits for (None: only local inputs);
    `num_layers`: the rank's MoE layers (per model chunk with virtual stages)."""
    k, l, j = task.kind, task.layer, task.microbatch
    if k == TaskKind.A_F:
        if l == 0:
            return None
        return Task(TaskKind.C_F, l - 1 + (sum(chunk_counts(num_layers)[:task.chunk]) if task.chunk else 0), j)
    if k == TaskKind.A_B:
        counts = chunk_counts(num_layers)
        if l == counts[task.chunk]:
            return None
        return Task(TaskKind.D_B, l + (sum(counts[:task.chunk]) if task.chunk else 0), j)
    if k in (TaskKind.X_F, TaskKind.E_F):
        return Task(TaskKind.D_F, l, j)
    if k in (TaskKind.X_B, TaskKind.E_B):
        return Task(TaskKind.C_B, l, j)
    return None


def _check(num_layers: int, R: int, role: Role, offloaded_layers: Iterable[int]) -> set[int]:
    if num_layers < 1 or R < 1:
        raise ValueError(f"task list needs num_layers >= 1 and R >= 1, got {num_layers}, {R}")
    if role not in (Role.ATTENTION, Role.EXPERT):
        raise ValueError(f"role {role!r} is not 'attention' or 'expert'")
    off = set(offloaded_layers)
    bad = sorted(l for l in off if not 0 <= l < num_layers)
    if bad:
        raise ValueError(f"offloaded layers {bad} outside 0..{num_layers - 1}")
    if off and role == Role.EXPERT:
        raise ValueError("offloaded_layers is for attention ranks; expert ranks hold their experts already")
    return off


def _expert_next_recv(l: int, j: int, L: int) -> Task:
    """An expert rank posts the receive of microbatch j's next input as soon as it has sent the
    current output: that input cannot exist earlier, and posting then keeps the transfer off the
    expert's critical path."""
    return Task(TaskKind.D_F, l + 1, j) if l + 1 < L else Task(TaskKind.C_B, L - 1, j)


ZEBRA_WAVE_ORDERS = ("gpipe", "1f1b")  # plan.zebra_wave_order


def wave_warmup(order: str, waves: int, stages: int, stage: int) -> int:
    """Groups of microbatches whose forward pipeline stage `stage` of `stages` runs before its
    first backward: all W in GPipe's order; in 1F1B's, min(W, P - stage) (Megatron's P - i - 1
    warm-up forwards and the first steady-state one), so the stages that wait longest for their
    first gradient hold the most groups."""
    if order not in ZEBRA_WAVE_ORDERS:
        raise ValueError(f"zebra wave order {order!r} is not one of {ZEBRA_WAVE_ORDERS}")
    return waves if order == "gpipe" else min(waves, stages - stage)


def zebra_tasks_for_role(num_layers: int, R: int, role: Role, offloaded_layers: Iterable[int] = (),
                         last_pipeline_stage: bool = True, waves: int = 1, warmup: int | None = None) -> list[Task]:
    """Theorem 1's order for one rank. `offloaded_layers`: expert layers in which this attention
    rank holds experts (Asym-EA). With pipeline stages, an attention rank of a stage before the
    last (`last_pipeline_stage` False) runs every microbatch's last piece (which sends its output
    to the next stage) before the first backward of that piece (which waits for the next stage's
    gradient): the next stage's forward needs all R outputs before any of its backwards, so
    Theorem 1's interleaved head (A_F(L, j) A_B(L, j) per microbatch) would wait on itself.

    `waves` W (dividing R): Theorem 1 over W groups of R / W consecutive microbatches. A stage's
    first output then leaves after one group's forward, so the next pipeline stage starts while
    this one runs the next group; W = 1 is Theorem 1 over all R. `warmup` (wave_warmup): the
    groups whose forward runs before the first backward (default all W, GPipe's order); then
    each group's backward is followed by the forward of the next group not yet run (1F1B's
    order over the groups), so at most `warmup` groups are alive at once.

    An expert rank issues the collectives in its stage's attention ranks' order (what
    check_stream_order requires) and computes in the order its inputs arrive; it keeps R / W
    receives posted ahead (the next input of a microbatch is posted when its current output is
    sent: _expert_list)."""
    L = num_layers
    off = _check(L, R, role, offloaded_layers)
    if type(waves) is not int or waves < 1 or R % waves:
        raise ValueError(f"zebra waves={waves!r} must be a positive divisor of the R={R} microbatches")
    warmup = waves if warmup is None else warmup
    if type(warmup) is not int or not 1 <= warmup <= waves:
        raise ValueError(f"zebra warm-up groups={warmup!r} must be between 1 and the {waves} waves")
    if role == Role.EXPERT:
        attention = zebra_tasks_for_role(L, R, Role.ATTENTION, (), last_pipeline_stage, waves, warmup)
        return _expert_list([t for t in attention if t.stream == StreamName.DISPATCH], R // waves)
    # each group's backward, then the next group's forward
    items = [("F", 0, w) for w in range(warmup)]
    for w in range(waves):
        items.append(("B", 0, w))
        if w + warmup < waves:
            items.append(("F", 0, w + warmup))
    return _zebra_attention((L,), off, 0 if last_pipeline_stage else None, R // waves, items)


def _zebra_attention(counts: tuple[int, ...], off: set[int], holds_loss: int | None, per_wave: int,
                     items: list[tuple[str, int, int]]) -> list[Task]:
    """An attention rank's list from its items ("F" | "B", chunk c, wave w): Theorem 1's forward or
    backward of chunk c's MoE layers (the rank's layers sum(counts[:c]) on) over wave w's
    `per_wave` microbatches. `holds_loss`: the chunk whose last piece computes the loss (the
    model's last virtual stage), whose A_F(L_c, j) runs interleaved with A_B(L_c, j) in its
    backward (Theorem 1's head), or None; any other chunk's last piece sends its output on, so
    the wave's forward runs it (the next stage needs all the wave's outputs before any of its
    backwards, which would otherwise wait on this one)."""
    T = Task
    out: list[Task] = []
    for step, c, w in items:
        o, L, mbs = sum(counts[:c]), counts[c], range(w * per_wave, (w + 1) * per_wave)
        if step == "F":
            for s in range(L):
                k = o + s
                for j in mbs:
                    out.extend([T(TaskKind.A_F, s, j, c), T(TaskKind.D_F, k, j)])
                    if k not in off:
                        out.append(T(TaskKind.C_F, k, j))  # receive only: post at once
                if k in off:
                    for j in mbs:
                        out.extend([T(TaskKind.X_F, k, j), T(TaskKind.C_F, k, j)])
            if c != holds_loss:
                out.extend(T(TaskKind.A_F, L, j, c) for j in mbs)
            continue
        for j in mbs:
            if c == holds_loss:
                out.append(T(TaskKind.A_F, L, j, c))
            out += [T(TaskKind.A_B, L, j, c), T(TaskKind.C_B, o + L - 1, j)]
            if o + L - 1 not in off:
                out.append(T(TaskKind.D_B, o + L - 1, j))
        for s in reversed(range(L)):
            k = o + s
            if k in off:  # mirror of the forward: offloaded experts' backward before the stage's
                for j in mbs:
                    out += [T(TaskKind.X_B, k, j), T(TaskKind.D_B, k, j)]
            for j in mbs:
                out.append(T(TaskKind.A_B, s, j, c))
                if s > 0:
                    out.append(T(TaskKind.C_B, k - 1, j))
                    if k - 1 not in off:
                        out.append(T(TaskKind.D_B, k - 1, j))
    return out


def zebra_interleaved_items(order: str, waves: int, stages: int, stage: int, chunks: int) -> list[tuple[str, int, int]]:
    """The ("F" | "B", chunk, wave) items of pipeline stage `stage` of `stages` with `chunks` model
    chunks, W = `waves` waves each: Megatron's interleaved 1F1B (forward_backward_pipelining_with_
    interleaving) with the waves as its microbatches, in its schedule table (groups of P waves,
    chunk by chunk: megatron-core's microbatch_group_size_per_vp_stage default) and its warm-up
    count (P - stage - 1) * 2 + (V - 1) * P, then forward k + warm-up and backward k in turn, the
    backwards' chunks in reverse; "gpipe": every forward (in that table's order) before the first
    backward. Both are deadlock-free over the stages' point-to-point traffic as Megatron's own
    schedule is (plan.issue_order checks the calls they make)."""
    if order not in ZEBRA_WAVE_ORDERS:
        raise ValueError(f"zebra wave order {order!r} is not one of {ZEBRA_WAVE_ORDERS}")
    P, V, W = stages, chunks, waves
    table = [(w, c) for g in range(0, W, P) for c in range(V) for w in range(g, min(W, g + P))]
    total = W * V
    warmup = total if order == "gpipe" else min(total, (P - stage - 1) * 2 + (V - 1) * P)
    fwd = [("F", c, w) for w, c in table]
    bwd = [("B", V - 1 - c, w) for w, c in table]
    items = fwd[:warmup]
    for k in range(total - warmup):
        items += [fwd[k + warmup], bwd[k]]
    return items + bwd[total - warmup:]


def zebra_chunk_tasks(chunk_layers: Sequence[int], R: int, role: Role, offloaded_layers: Iterable[int] = (),
                      stage: int = 0, stages: int = 1, waves: int = 1, order: str = "gpipe") -> list[Task]:
    """The zebra list of a rank of pipeline stage `stage` of `stages` whose model chunks hold
    `chunk_layers` MoE layers each (virtual stage c * stages + stage for chunk c; one chunk:
    zebra_tasks_for_role with wave_warmup's groups). With several chunks: Theorem 1 per (chunk,
    wave of R / waves microbatches) item in zebra_interleaved_items' `order`; the model's last
    virtual stage (the last stage's last chunk) interleaves its head's forward and backward.
    `offloaded_layers`: the rank's MoE layers (over all its chunks) in which it holds experts.
    An expert rank issues its stage's attention ranks' collectives in their order, over the
    experts of all the stage's chunks."""
    counts = chunk_counts(chunk_layers)
    if len(counts) == 1:
        return zebra_tasks_for_role(counts[0], R, role, offloaded_layers, last_pipeline_stage=stage == stages - 1,
                                    waves=waves, warmup=wave_warmup(order, waves, stages, stage))
    if stages < 2 or not 0 <= stage < stages:
        raise ValueError(f"model chunks need pipeline stages: stage {stage} of {stages}")
    if any(type(n) is not int or n < 1 for n in counts):
        raise ValueError(f"every model chunk needs an MoE layer for zebra (its stages are cut at them); the chunks "
                         f"hold {list(counts)}")
    off = _check(sum(counts), R, role, offloaded_layers)
    if type(waves) is not int or waves < 1 or R % waves:
        raise ValueError(f"zebra waves={waves!r} must be a positive divisor of the R={R} microbatches")
    if role == Role.EXPERT:
        attention = zebra_chunk_tasks(counts, R, Role.ATTENTION, (), stage, stages, waves, order)
        return _expert_list([t for t in attention if t.stream == StreamName.DISPATCH], R // waves)
    holds_loss = len(counts) - 1 if stage == stages - 1 else None
    return _zebra_attention(counts, off, holds_loss, R // waves,
                            zebra_interleaved_items(order, waves, stages, stage, len(counts)))


def _expert_list(dispatch: list[Task], window: int) -> list[Task]:
    """An expert rank's list from its stage's dispatch-stream order (D_F and C_B as the attention
    ranks issue them): the first `window` receives posted at once; then for each, in that order,
    its expert compute, the send of its result on the combine stream (C_F, D_B) and the post of
    the next receive not posted yet: a microbatch's next input cannot exist before its current
    output is sent, and posting then keeps the transfer off the expert's critical path."""
    T = Task
    out = list(dispatch[:window])
    nxt = window
    for x in dispatch:
        if x.kind == TaskKind.D_F:
            out += [T(TaskKind.E_F, x.layer, x.microbatch), T(TaskKind.C_F, x.layer, x.microbatch)]
        else:
            out += [T(TaskKind.E_B, x.layer, x.microbatch), T(TaskKind.D_B, x.layer, x.microbatch)]
        if nxt < len(dispatch):
            out.append(dispatch[nxt])
            nxt += 1
    return out


def distep_tasks_for_role(num_layers: int, R: int, role: Role, offloaded_layers: Iterable[int] = ()) -> list[Task]:
    """The non-overlapped order: each microbatch's whole forward then its whole backward, the
    other side waiting (Megatron's gradient-accumulation loop with remote experts)."""
    L = num_layers
    off = _check(L, R, role, offloaded_layers)
    T = Task
    out: list[Task] = []
    for j in range(R):
        if role == Role.EXPERT:
            out.append(T(TaskKind.D_F, 0, j))
            for l in range(L):
                out += [T(TaskKind.E_F, l, j), T(TaskKind.C_F, l, j), _expert_next_recv(l, j, L)]
            for l in reversed(range(L)):
                out += [T(TaskKind.E_B, l, j), T(TaskKind.D_B, l, j)]
                if l > 0:
                    out.append(T(TaskKind.C_B, l - 1, j))
            continue
        for s in range(L):
            out += [T(TaskKind.A_F, s, j), T(TaskKind.D_F, s, j)]
            out += [T(TaskKind.X_F, s, j), T(TaskKind.C_F, s, j)] if s in off else [T(TaskKind.C_F, s, j)]
        out += [T(TaskKind.A_F, L, j), T(TaskKind.A_B, L, j)]
        for s in reversed(range(L)):
            out.append(T(TaskKind.C_B, s, j))
            out += [T(TaskKind.X_B, s, j), T(TaskKind.D_B, s, j)] if s in off else [T(TaskKind.D_B, s, j)]
            out.append(T(TaskKind.A_B, s, j))
    return out


def offloaded_layers_of(plan, rank: int) -> set[int]:
    """Expert layers in which attention rank `rank` holds experts, numbered within its pipeline
    stage (the task lists' layers: every MoE layer without pipeline stages)."""
    layers = plan.stage_moe_layers(plan.stage_of(rank))
    return {k for k, l in enumerate(layers) if plan.local_experts(rank, l)}


def task_layers(plan, stage: int) -> tuple[int, ...]:
    """The MoE layers of each model chunk of pipeline stage `stage` (one entry without virtual
    stages): what inputs(), stage_transfers() and the executors take as `num_layers`."""
    if plan.virtual_stages == 1:
        return (len(plan.stage_moe_layers(stage)),)
    return tuple(len(plan.chunk_moe_layers(stage, c)) for c in range(plan.virtual_stages))


def zebra_tasks(plan, rank: int, num_microbatches: int | None = None) -> list[Task]:
    """Zebra task list of `rank` in a HeteroPlan (megatron_hetermoe.plan.hetero_plan), over the
    plan's R microbatches or `num_microbatches` (a step of Megatron's batch-size ramp-up). With
    pipeline stages, over the rank's stage's MoE layers (layer k: the stage's k-th,
    plan.stage_moe_layers), in the plan's zebra_waves groups of microbatches, in its
    zebra_wave_order; with virtual stages, per model chunk (zebra_chunk_tasks)."""
    role = plan.role(rank)
    off = offloaded_layers_of(plan, rank) if role == Role.ATTENTION else set()
    stage = plan.stage_of(rank)
    R = num_microbatches or plan.num_microbatches
    if R % plan.zebra_waves:
        raise ValueError(f"{R} microbatches this step do not split into the plan's zebra_waves={plan.zebra_waves} "
                         f"groups; use a global batch (and ramp-up) whose microbatch count it divides")
    P, W = plan.pipeline_stages, plan.zebra_waves
    return zebra_chunk_tasks(task_layers(plan, stage), R, role, off, stage, P, W, plan.zebra_wave_order)


def distep_tasks(plan, rank: int, num_microbatches: int | None = None) -> list[Task]:
    """DistEP task list of `rank` in a HeteroPlan (R as zebra_tasks). With pipeline stages DistEP
    runs Megatron's 1F1B (schedules/distep.py), which has no task list here."""
    if plan.pipeline_stages > 1:
        raise NotImplementedError(f"the DistEP task list with {plan.pipeline_stages} pipeline stages is not built "
                                  f"(DistEP runs Megatron's 1F1B there, untimed); drop --emulate")
    role = plan.role(rank)
    off = offloaded_layers_of(plan, rank) if role == Role.ATTENTION else set()
    return distep_tasks_for_role(plan.num_layers, num_microbatches or plan.num_microbatches, role, off)


@dataclass(frozen=True)
class Schedule:
    """A HeterMoE schedule: its task list per rank (what executors run and the simulator prices),
    and whether attention ranks run it through Megatron's own schedule instead (DistEP: Megatron's
    forward_backward with HeteroMoELayer shipping tokens from inside MoELayer.forward, the expert
    ranks mirroring it). Megatron's schedule cannot be timed task by task, so an emulated run
    executes the task list on both roles, whatever the schedule."""
    name: str
    tasks: Callable[..., list[Task]]  # (plan, rank, num_microbatches=None) -> the rank's list
    megatron_on_attention: bool
    summary: str


# The one registry of schedules: flags, plans, the simulator and the executors read it.
SCHEDULES: dict[str, Schedule] = {
    "distep": Schedule("distep", distep_tasks, True,
                       "each microbatch's whole forward then backward, the other role waiting (no overlap)"),
    "zebra": Schedule("zebra", zebra_tasks, False, "Theorem 1's order: attention and experts overlap"),
}


def schedule(name: str) -> Schedule:
    if name not in SCHEDULES:
        raise ValueError(f"hetero schedule {name!r} is unknown; use one of {list(SCHEDULES)}")
    return SCHEDULES[name]


def tasks_for_rank(plan, rank: int) -> list[Task]:
    """The list for the plan's own schedule."""
    return schedule(plan.schedule).tasks(plan, rank)


def stream_order(tasks: list[Task], stream: StreamName) -> list[Task]:
    return [t for t in tasks if t.stream == stream]


def check_stream_order(lists: dict[int, list[Task]]) -> None:
    """Raise ValueError if the ranks of one ZP group do not issue the same collectives in the same
    order on the dispatch and on the combine stream (that would deadlock the runtime)."""
    ranks = sorted(lists)
    for stream in (StreamName.DISPATCH, StreamName.COMBINE):
        ref = stream_order(lists[ranks[0]], stream)
        for r in ranks[1:]:
            got = stream_order(lists[r], stream)
            if got != ref:
                i = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), min(len(ref), len(got)))
                a = ref[i] if i < len(ref) else None
                b = got[i] if i < len(got) else None
                raise ValueError(f"{stream} stream: rank {ranks[0]} issues {a} as collective #{i} but rank {r} "
                                 f"issues {b}; every member of a ZP group must issue the same order")
