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
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

COMPUTE_KINDS = ("A_F", "A_B", "X_F", "X_B", "E_F", "E_B")
COMM_KINDS = ("D_F", "C_F", "C_B", "D_B")
ATTENTION_KINDS = ("A_F", "A_B")  # the attention pieces (may hold collectives among attention ranks)
STREAM = {
    "A_F": "compute", "A_B": "compute", "X_F": "compute", "X_B": "compute", "E_F": "compute", "E_B": "compute",
    "D_F": "dispatch", "C_B": "dispatch", "C_F": "combine", "D_B": "combine",
}


@dataclass(frozen=True)
class Task:
    kind: str
    layer: int  # attention stage (A_*) or expert layer (all other kinds)
    microbatch: int

    def __repr__(self) -> str:
        return f"{self.kind}({self.layer},{self.microbatch})"

    @property
    def stream(self) -> str:
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
    and receiver both issue it (a send waits for its receive)."""

    kind: str
    layer: int  # the sending pipeline stage
    microbatch: int
    is_comm = True

    def __repr__(self) -> str:
        return f"{self.kind}({self.layer},{self.microbatch})"

    @property
    def stream(self) -> str:
        return "pipeline"


def stage_transfers(task: Task, stage: int, stages: int, num_layers: int) -> tuple[PipeTask | None, PipeTask | None]:
    """(the transfer an attention rank of pipeline stage `stage` receives before `task`, the one it
    sends after it); num_layers: the stage's MoE layers (its last attention piece is
    num_layers). A stage after the first receives its input before its first piece's forward and
    sends that input's gradient after its backward; a stage before the last sends its output
    after its last piece's forward and receives the output's gradient before its backward."""
    k, l, j = task.kind, task.layer, task.microbatch
    recv = send = None
    if k == "A_F":
        if stage > 0 and l == 0:
            recv = PipeTask("P_F", stage - 1, j)
        if stage < stages - 1 and l == num_layers:
            send = PipeTask("P_F", stage, j)
    elif k == "A_B":
        if stage < stages - 1 and l == num_layers:
            recv = PipeTask("P_B", stage + 1, j)
        if stage > 0 and l == 0:
            send = PipeTask("P_B", stage, j)
    return recv, send


def inputs(task: Task, num_layers: int) -> Task | None:
    """The comm task whose result a compute task waits for (None: only local inputs)."""
    k, l, j = task.kind, task.layer, task.microbatch
    if k == "A_F":
        return Task("C_F", l - 1, j) if l > 0 else None
    if k == "A_B":
        return Task("D_B", l, j) if l < num_layers else None
    if k in ("X_F", "E_F"):
        return Task("D_F", l, j)
    if k in ("X_B", "E_B"):
        return Task("C_B", l, j)
    return None


def _check(num_layers: int, R: int, role: str, offloaded_layers: Iterable[int]) -> set[int]:
    if num_layers < 1 or R < 1:
        raise ValueError(f"task list needs num_layers >= 1 and R >= 1, got {num_layers}, {R}")
    if role not in ("attention", "expert"):
        raise ValueError(f"role {role!r} is not 'attention' or 'expert'")
    off = set(offloaded_layers)
    bad = sorted(l for l in off if not 0 <= l < num_layers)
    if bad:
        raise ValueError(f"offloaded layers {bad} outside 0..{num_layers - 1}")
    if off and role == "expert":
        raise ValueError("offloaded_layers is for attention ranks; expert ranks hold their experts already")
    return off


def _expert_next_recv(l: int, j: int, L: int) -> Task:
    """An expert rank posts the receive of microbatch j's next input as soon as it has sent the
    current output: that input cannot exist earlier, and posting then keeps the transfer off the
    expert's critical path."""
    return Task("D_F", l + 1, j) if l + 1 < L else Task("C_B", L - 1, j)


ZEBRA_WAVE_ORDERS = ("gpipe", "1f1b")  # plan.zebra_wave_order


def wave_warmup(order: str, waves: int, stages: int, stage: int) -> int:
    """Groups of microbatches whose forward pipeline stage `stage` of `stages` runs before its
    first backward: all W in GPipe's order; in 1F1B's, min(W, P - stage) (Megatron's P - i - 1
    warm-up forwards and the first steady-state one), so the stages that wait longest for their
    first gradient hold the most groups."""
    if order not in ZEBRA_WAVE_ORDERS:
        raise ValueError(f"zebra wave order {order!r} is not one of {ZEBRA_WAVE_ORDERS}")
    return waves if order == "gpipe" else min(waves, stages - stage)


def zebra_tasks_for_role(num_layers: int, R: int, role: str, offloaded_layers: Iterable[int] = (),
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
    T = Task
    if role == "expert":
        attention = zebra_tasks_for_role(L, R, "attention", (), last_pipeline_stage, waves, warmup)
        return _expert_list([t for t in attention if t.stream == "dispatch"], R // waves)
    m = R // waves
    groups = [range(w * m, (w + 1) * m) for w in range(waves)]
    out: list[Task] = []

    def forward(mbs: range) -> None:
        for s in range(L):
            for j in mbs:
                out.extend([T("A_F", s, j), T("D_F", s, j)])
                if s not in off:
                    out.append(T("C_F", s, j))  # receive only: post at once
            if s in off:
                for j in mbs:
                    out.extend([T("X_F", s, j), T("C_F", s, j)])
        if not last_pipeline_stage:
            out.extend(T("A_F", L, j) for j in mbs)

    for mbs in groups[:warmup]:
        forward(mbs)
    for w, mbs in enumerate(groups):  # each group's backward, then the next group's forward
        for j in mbs:
            if last_pipeline_stage:
                out.append(T("A_F", L, j))
            out += [T("A_B", L, j), T("C_B", L - 1, j)]
            if L - 1 not in off:
                out.append(T("D_B", L - 1, j))
        for s in reversed(range(L)):
            if s in off:  # mirror of the forward: offloaded experts' backward before the stage's
                for j in mbs:
                    out += [T("X_B", s, j), T("D_B", s, j)]
            for j in mbs:
                out.append(T("A_B", s, j))
                if s > 0:
                    out.append(T("C_B", s - 1, j))
                    if s - 1 not in off:
                        out.append(T("D_B", s - 1, j))
        if w + warmup < waves:
            forward(groups[w + warmup])
    return out


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
        if x.kind == "D_F":
            out += [T("E_F", x.layer, x.microbatch), T("C_F", x.layer, x.microbatch)]
        else:
            out += [T("E_B", x.layer, x.microbatch), T("D_B", x.layer, x.microbatch)]
        if nxt < len(dispatch):
            out.append(dispatch[nxt])
            nxt += 1
    return out


def distep_tasks_for_role(num_layers: int, R: int, role: str, offloaded_layers: Iterable[int] = ()) -> list[Task]:
    """The non-overlapped order: each microbatch's whole forward then its whole backward, the
    other side waiting (Megatron's gradient-accumulation loop with remote experts)."""
    L = num_layers
    off = _check(L, R, role, offloaded_layers)
    T = Task
    out: list[Task] = []
    for j in range(R):
        if role == "expert":
            out.append(T("D_F", 0, j))
            for l in range(L):
                out += [T("E_F", l, j), T("C_F", l, j), _expert_next_recv(l, j, L)]
            for l in reversed(range(L)):
                out += [T("E_B", l, j), T("D_B", l, j)]
                if l > 0:
                    out.append(T("C_B", l - 1, j))
            continue
        for s in range(L):
            out += [T("A_F", s, j), T("D_F", s, j)]
            out += [T("X_F", s, j), T("C_F", s, j)] if s in off else [T("C_F", s, j)]
        out += [T("A_F", L, j), T("A_B", L, j)]
        for s in reversed(range(L)):
            out.append(T("C_B", s, j))
            out += [T("X_B", s, j), T("D_B", s, j)] if s in off else [T("D_B", s, j)]
            out.append(T("A_B", s, j))
    return out


def offloaded_layers_of(plan, rank: int) -> set[int]:
    """Expert layers in which attention rank `rank` holds experts, numbered within its pipeline
    stage (the task lists' layers: every MoE layer without pipeline stages)."""
    layers = plan.stage_moe_layers(plan.stage_of(rank))
    return {k for k, l in enumerate(layers) if plan.local_experts(rank, l)}


def zebra_tasks(plan, rank: int, num_microbatches: int | None = None) -> list[Task]:
    """Zebra task list of `rank` in a HeteroPlan (megatron_hetermoe.plan.hetero_plan), over the
    plan's R microbatches or `num_microbatches` (a step of Megatron's batch-size ramp-up). With
    pipeline stages, over the rank's stage's MoE layers (layer k: the stage's k-th,
    plan.stage_moe_layers), in the plan's zebra_waves groups of microbatches, in its
    zebra_wave_order."""
    role = plan.role(rank)
    off = offloaded_layers_of(plan, rank) if role == "attention" else set()
    stage = plan.stage_of(rank)
    R = num_microbatches or plan.num_microbatches
    if R % plan.zebra_waves:
        raise ValueError(f"{R} microbatches this step do not split into the plan's zebra_waves={plan.zebra_waves} "
                         f"groups; use a global batch (and ramp-up) whose microbatch count it divides")
    P, W = plan.pipeline_stages, plan.zebra_waves
    return zebra_tasks_for_role(len(plan.stage_moe_layers(stage)), R, role, off, last_pipeline_stage=stage == P - 1,
                                waves=W, warmup=wave_warmup(plan.zebra_wave_order, W, P, stage))


def distep_tasks(plan, rank: int, num_microbatches: int | None = None) -> list[Task]:
    """DistEP task list of `rank` in a HeteroPlan (R as zebra_tasks). With pipeline stages DistEP
    runs Megatron's 1F1B (schedules/distep.py), which has no task list here."""
    if plan.pipeline_stages > 1:
        raise NotImplementedError(f"the DistEP task list with {plan.pipeline_stages} pipeline stages is not built "
                                  f"(DistEP runs Megatron's 1F1B there, untimed); drop --emulate")
    role = plan.role(rank)
    off = offloaded_layers_of(plan, rank) if role == "attention" else set()
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


def stream_order(tasks: list[Task], stream: str) -> list[Task]:
    return [t for t in tasks if t.stream == stream]


def check_stream_order(lists: dict[int, list[Task]]) -> None:
    """Raise ValueError if the ranks of one ZP group do not issue the same collectives in the same
    order on the dispatch and on the combine stream (that would deadlock the runtime)."""
    ranks = sorted(lists)
    for stream in ("dispatch", "combine"):
        ref = stream_order(lists[ranks[0]], stream)
        for r in ranks[1:]:
            got = stream_order(lists[r], stream)
            if got != ref:
                i = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), min(len(ref), len(got)))
                a = ref[i] if i < len(ref) else None
                b = got[i] if i < len(got) else None
                raise ValueError(f"{stream} stream: rank {ranks[0]} issues {a} as collective #{i} but rank {r} "
                                 f"issues {b}; every member of a ZP group must issue the same order")
