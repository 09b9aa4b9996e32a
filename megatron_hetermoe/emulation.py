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
        """Stretch one Megatron EP rank's modules to its emulated GPU type; returns an undo."""
        from megatron.core.transformer.moe import token_dispatcher as td

        from .planner.baselines import ep_a2a_time

        m, s, gpu, cost = self.model, self.spec.scale, self.gpu(rank), self.cost
        t = tokens_per_microbatch
        d = len(ep_group_ranks)
        per_expert = d * t * m.moe_router_topk / m.num_experts
        L = m.num_layers
        handles = []
        for i, layer in enumerate(gpt.decoder.layers):
            # Stage i of the simulator (combine of layer i-1 + attention i + router i) is charged to
            # attention i: in Megatron's layer order they run back to back on this rank.
            fwd, bwd = cost.stage_time(gpu, i, t), cost.stage_time(gpu, i, t, True)
            handles += stretch_module(layer.self_attention, fwd * s, bwd * s, ("A", i), recorder)
            n_local = layer.mlp.num_local_experts
            handles += stretch_module(layer.mlp.experts, n_local * cost.expert_time(gpu, per_expert) * s,
                                      n_local * cost.expert_time(gpu, per_expert, True) * s, ("E", i), recorder)
        handles += stretch_module(gpt.output_layer, cost.stage_time(gpu, L, t) * s, cost.stage_time(gpu, L, t, True) * s,
                                  ("A", L), recorder)
        a2a = ep_a2a_time(cost, self.cluster, ep_group_ranks, t) * s if d > 1 else 0.0
        hidden = gpt.config.hidden_size
        orig = td.all_to_all

        def timed_all_to_all(group, input_, output_split_sizes=None, input_split_sizes=None):
            if input_.dim() != 2 or input_.shape[-1] != hidden:  # probabilities ride along for free
                return orig(group, input_, output_split_sizes, input_split_sizes)
            x = _Mark.apply(input_, lambda: time.sleep(a2a)) if input_.requires_grad else input_
            t0 = time.perf_counter()
            out = orig(group, x, output_split_sizes, input_split_sizes)
            time.sleep(a2a)
            if recorder is not None:
                recorder.record("dispatch", "A2A", -1, -1, t0, time.perf_counter())
            return out

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


def stretch_module(module: torch.nn.Module, fwd_s: float, bwd_s: float, tag: tuple, recorder=None) -> list:
    """Make every forward of `module` last at least fwd_s and its backward at least bwd_s."""
    calls: list[dict] = []

    def on_bwd_start(call):
        call["b0"] = time.perf_counter()

    def on_bwd_end(call):
        sleep_until(call["b0"] + bwd_s)
        if recorder is not None:
            recorder.record("compute", f"{tag[0]}_B", tag[1], -1, call["b0"], time.perf_counter())

    def pre(mod, args):
        call = {"t0": time.perf_counter()}
        calls.append(call)
        if args and torch.is_tensor(args[0]) and args[0].requires_grad:
            args = (_Mark.apply(args[0], lambda: on_bwd_end(call)),) + tuple(args[1:])
        return args

    def post(mod, args, out):
        call = calls.pop()
        sleep_until(call["t0"] + fwd_s)
        if recorder is not None:
            recorder.record("compute", f"{tag[0]}_F", tag[1], -1, call["t0"], time.perf_counter())
        first = out[0] if isinstance(out, tuple) else out
        if torch.is_tensor(first) and first.requires_grad:
            first = _Mark.apply(first, lambda: on_bwd_start(call))
            out = (first,) + tuple(out[1:]) if isinstance(out, tuple) else first
        return out

    return [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]


def emulation_real_model(emulated: str | ModelConfig, hidden: int = 64, seq_length: int = 32) -> ModelConfig:
    """The small model that really runs while `emulated` is emulated: same layers, experts and
    top-k (the task lists and placements depend on them), tiny widths."""
    m = emulated if isinstance(emulated, ModelConfig) else ModelConfig.load(emulated)
    return m.replace(name=f"{m.name}-emulated-by-tiny", hidden_size=hidden, num_attention_heads=4,
                     ffn_hidden_size=2 * hidden, moe_ffn_hidden_size=2 * hidden, vocab_size=256,
                     seq_length=seq_length)
