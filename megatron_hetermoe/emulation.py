"""Emulate a mixed GPU cluster on CPU ranks.

Each rank gets the GPU type of its position in a cluster file. Every compute task runs its real
computation on the small model, then waits until the time the cost model gives for the
*emulated* model shape on that GPU type has passed; every transfer likewise waits for its bytes
over the emulated links. All times are multiplied by `scale` (real seconds per emulated
second) so that a step takes about a second. The same rules time plain Megatron EP, through
hooks on megatron-core's modules (attention, experts, output layer) and its token all-to-all,
so HeterMoE and the baselines are measured alike, and each can be compared with the
simulator's prediction for the same plan.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from .model_config import ModelConfig
from .planner.cluster import Cluster
from .planner.cost_model import CostModel, TrainSettings
from .planner.profiles import load_profiles


@dataclass(frozen=True)
class EmulationSpec:
    cluster: str  # configs/clusters/NAME.yaml or a path
    model: str  # the emulated model shape (e.g. d1), not the small model that really runs
    seq_len: int
    global_batch: int  # emulated sequences per step
    scale: float = 1.0  # real seconds per emulated second
    activation_checkpointing: bool = True  # the paper's setting; the cost model charges re-forward
    ranks: tuple[int, ...] | None = None  # cluster ranks this job's ranks stand for (None: all, in order)

    def __post_init__(self) -> None:
        if self.scale <= 0 or self.seq_len <= 0 or self.global_batch <= 0:
            raise ValueError(f"emulation needs scale, seq_len, global_batch > 0; got {self.scale}, "
                             f"{self.seq_len}, {self.global_batch}")


def sleep_until(deadline: float) -> None:
    left = deadline - time.perf_counter()
    if left > 0:
        time.sleep(left)


class Emulator:
    def __init__(self, spec: EmulationSpec):
        self.spec = spec
        self.cluster = Cluster.load(spec.cluster)
        self.model = ModelConfig.load(spec.model).replace(seq_length=spec.seq_len)
        self.profiles = load_profiles(set(self.cluster.gpu_types()))
        self.cost = CostModel(self.model, self.profiles, TrainSettings(spec.seq_len, spec.activation_checkpointing))

    def gpu(self, rank: int) -> str:
        return self.cluster.gpu_types()[rank]

    def check_real_model(self, real: ModelConfig) -> None:
        m = self.model
        if (real.num_layers, real.num_experts, real.moe_router_topk) != (m.num_layers, m.num_experts, m.moe_router_topk):
            raise ValueError(
                f"the real model {real.name!r} has {real.num_layers} layers x {real.num_experts} experts, top-"
                f"{real.moe_router_topk}, but the emulated {m.name!r} has {m.num_layers} x {m.num_experts}, top-"
                f"{m.moe_router_topk}; emulation keeps layers and experts and shrinks only the widths: use "
                f"emulation_real_model({m.name!r})")

    def check_plan(self, plan) -> None:
        types = self.cluster.gpu_types()
        if plan.world_size != len(types):
            raise ValueError(f"plan has {plan.world_size} ranks but emulated cluster {self.cluster.name!r} has "
                             f"{len(types)}; plan for this cluster (hetermoe plan --cluster {self.cluster.name})")
        for r, (a, b) in enumerate(zip(plan.gpu_types, types)):
            if a.lower() != b.lower():
                raise ValueError(f"rank {r} is {a!r} in the plan but {b!r} in cluster {self.cluster.name!r}")

    # ---- HeterMoE --------------------------------------------------------------------------
    def task_times(self, plan, rank: int, schedule: str) -> dict:
        from .planner.simulator import rank_task_times

        return {t: d * self.spec.scale for t, d in
                rank_task_times(plan, self.cost, self.cluster, self.spec.global_batch, rank, schedule)}

    def zebra_config(self, plan, rank: int, schedule: str, recompute: bool = False):
        from .zebra import ZebraConfig

        times = self.task_times(plan, rank, schedule)
        return ZebraConfig(recompute=recompute, stretch=lambda t: times[t], transfer_time=lambda t, nbytes: times[t])

    def hetero_post_step(self, plan, schedule: str) -> float:
        """Gradient all-reduce + optimizer step after the task lists (the slowest rank's)."""
        from .planner.simulator import build_problem

        return max(build_problem(plan, self.cost, self.cluster, self.spec.global_batch, schedule).post_step) * self.spec.scale

    def predict_hetero(self, plan, schedule: str):
        from .planner.simulator import simulate_plan

        return simulate_plan(plan, self.cost, self.cluster, self.spec.global_batch, schedule=schedule)

    # ---- plain Megatron EP ------------------------------------------------------------------
    def predict_ep(self, ranks: list[int] | None = None, name: str = "EP"):
        from .planner.baselines import simulate_ep

        b = self.spec.global_batch if ranks is None else self.spec.global_batch * len(ranks) // self.cluster.world_size
        return simulate_ep(self.cost, self.cluster, b, ranks, name)

    def install_ep_hooks(self, gpt, rank: int, ep_group_ranks: list[int], tokens_per_microbatch: float,
                         recorder=None) -> Callable[[], None]:
        """Time one plain Megatron EP rank as its emulated GPU; returns an undo.

        The token all-to-alls are the sync points of an EP step, so time is set per segment
        between them, as the simulator models it: (previous all-to-all or microbatch start ->
        dispatch) = attention stage l, (dispatch -> combine) = this rank's experts of layer l, each
        all-to-all = its transfer time, (last combine -> loss) = the head; backward mirrors it.
        All real work of a segment (norms, router, permutes, the probabilities' all-to-all)
        runs inside its emulated time instead of adding to it."""
        from megatron.core.transformer.moe import token_dispatcher as td

        from .planner.baselines import ep_a2a_time

        m, s, gpu, cost = self.model, self.spec.scale, self.gpu(rank), self.cost
        t = tokens_per_microbatch
        L = m.num_layers
        per_expert = len(ep_group_ranks) * t * m.moe_router_topk / m.num_experts
        n_local = gpt.decoder.layers[0].mlp.num_local_experts
        stage = [[cost.stage_time(gpu, i, t, b) * s for i in range(L + 1)] for b in (False, True)]
        expert = [n_local * cost.expert_time(gpu, per_expert, b) * s for b in (False, True)]
        a2a = ep_a2a_time(cost, self.cluster, ep_group_ranks, t) * s if len(ep_group_ranks) > 1 else 0.0
        hidden = gpt.config.hidden_size
        clock = {"seg": 0.0, "calls": 0, "deadline": None, "bseg": 0.0, "bcall": 0.0}

        def segment(kind: str, layer: int, start: float, dur: float) -> None:
            sleep_until(start + dur)
            if recorder is not None:
                recorder.record("compute", kind, layer, -1, start, time.perf_counter())

        def mb_start(mod, args):
            clock.update(seg=time.perf_counter(), calls=0, deadline=None)

        def bwd_call(layer: int, dispatch: bool):  # gradient of an all-to-all's output is ready
            if dispatch:
                segment("E_B", layer, clock["bseg"], expert[True])
            else:
                segment("A_B", layer + 1, clock["bseg"], stage[True][layer + 1])
            clock["bcall"] = time.perf_counter()

        def bwd_return():  # the reverse all-to-all produced the input's gradient
            sleep_until(clock["bcall"] + a2a)
            clock["bseg"] = time.perf_counter()

        orig = td.all_to_all

        def timed_all_to_all(group, input_, output_split_sizes=None, input_split_sizes=None):
            if input_.dim() != 2 or input_.shape[-1] != hidden:
                # The probabilities ride in the dispatch's window.
                out = orig(group, input_, output_split_sizes, input_split_sizes)
                if clock["deadline"] is not None:
                    sleep_until(clock["deadline"])
                    clock.update(deadline=None, seg=time.perf_counter())
                return out
            k = clock["calls"]
            clock["calls"] = k + 1
            layer, dispatch = k // 2, k % 2 == 0
            if dispatch:
                segment("A_F", layer, clock["seg"], stage[False][layer])
            else:
                segment("E_F", layer, clock["seg"], expert[False])
            t_call = time.perf_counter()
            x = _Mark.apply(input_, bwd_return) if input_.requires_grad else input_
            out = orig(group, x, output_split_sizes, input_split_sizes)
            if dispatch:
                clock["deadline"] = t_call + a2a
            else:
                sleep_until(t_call + a2a)
                clock["seg"] = time.perf_counter()
            if recorder is not None:
                recorder.record("dispatch" if dispatch else "combine", "D_F" if dispatch else "C_F", layer, -1,
                                t_call, time.perf_counter())
            return _Mark.apply(out, lambda: bwd_call(layer, dispatch)) if out.requires_grad else out

        def head_done(mod, args, out):
            segment("A_F", L, clock["seg"], stage[False][L])
            first = out[0] if isinstance(out, tuple) else out
            first = _Mark.apply(first, lambda: clock.update(bseg=time.perf_counter()))
            return (first,) + tuple(out[1:]) if isinstance(out, tuple) else first

        def embedding_done(mod, args, out):
            return _Mark.apply(out, lambda: segment("A_B", 0, clock["bseg"], stage[True][0]))

        handles = [gpt.embedding.register_forward_pre_hook(mb_start),
                   gpt.embedding.register_forward_hook(embedding_done),
                   gpt.output_layer.register_forward_hook(head_done)]
        td.all_to_all = timed_all_to_all

        def undo():
            td.all_to_all = orig
            for h in handles:
                h.remove()

        return undo

    def ep_post_step(self, prediction) -> float:
        return prediction.detail["post_step_s"] * self.spec.scale


class _Mark(torch.autograd.Function):
    """Identity whose backward calls `cb` (a stretch point inside the backward pass)."""

    @staticmethod
    def forward(ctx, x, cb):
        ctx.cb = cb
        return x.clone()  # a view would break in-place ops downstream (bias-dropout-add)

    @staticmethod
    def backward(ctx, g):
        ctx.cb()
        return g, None


def emulation_real_model(emulated: str | ModelConfig, hidden: int = 64, seq_length: int = 32) -> ModelConfig:
    """The small model that really runs while `emulated` is emulated: same layers, experts and
    top-k (the task lists and placements depend on them), tiny widths."""
    m = emulated if isinstance(emulated, ModelConfig) else ModelConfig.load(emulated)
    return m.replace(name=f"{m.name}-emulated-by-tiny", hidden_size=hidden, num_attention_heads=4,
                     ffn_hidden_size=2 * hidden, moe_ffn_hidden_size=2 * hidden, vocab_size=256,
                     seq_length=seq_length)
