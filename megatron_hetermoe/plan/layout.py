"""Plain Megatron MoE state dict <-> HeterMoE layout, per rank, from the plan alone.

The Megatron side is a PP=1, EP=1 GPTModel's parameter names (every expert as
`decoder.layers.L.mlp.experts.local_experts.E.*` with its global id E), which is also what
models.builder.canonical_names produces for any Megatron layout. A HeterMoE rank holds:
- attention rank: everything except experts, plus the experts the plan offloads to it;
- expert rank: only its experts, under the same module path.
Either way an expert appears under its *local* index on the rank (position in the plan's
sorted expert list for that rank and layer), as in Megatron's own EP sharding.

The per-rank states megatron_to_hetero makes use SequentialMLP's names (the local spec's);
load_params puts them into a module of any kernels (TEGroupedMLP, GroupedMLP, TE's fused input
norm) and hetero_to_megatron takes every rank's state in its module's own names
(plan/expert_names.py converts).
"""
from __future__ import annotations

import re

import torch

from megatron_hetermoe.plan import expert_names
from megatron_hetermoe.plan.hetero_plan import HeteroPlan
from megatron_hetermoe.vocabulary import Role

# an expert of decoder layer L or of MTP layer k (expert_names.model_layer_of_prefix numbers both)
_EXPERT = re.compile(r"^(?P<pre>(?:decoder\.layers\.\d+|mtp\.layers\.\d+\.transformer_layer)\.mlp\.experts\.)"
                     r"local_experts\.(?P<e>\d+)\.(?P<rest>.+)$")


def _expert(name: str, plan: HeteroPlan) -> tuple[str, int, int, str] | None:
    """(experts prefix, model layer, expert index, the rest) of an expert parameter name."""
    m = _EXPERT.match(name)
    if m is None:
        return None
    return m["pre"], expert_names.model_layer_of_prefix(m["pre"], plan.decoder_layers), int(m["e"]), m["rest"]


_DECODER_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def _to_stage(name: str, plan: HeteroPlan, stage: int) -> str | None:
    """A canonical name on an attention rank of pipeline stage `stage`: its local name there
    (GPTModel numbers a stage's layers from 0; the embedding lives on the first stage, the final
    norm and output layer on the last), or None when another stage holds it."""
    P = plan.pipeline_stages
    if P == 1:
        return name
    if name.startswith("embedding."):
        return name if stage == 0 else None
    if name.startswith(("decoder.final_layernorm.", "output_layer.", "mtp.")):
        return name if stage == P - 1 else None  # the MTP block is the last stage's too
    m = _DECODER_LAYER.match(name)
    if m is None:
        return name
    layers = plan.stage_model_layers(stage)
    layer = int(m.group(1))
    if layer not in layers:
        return None
    return f"decoder.layers.{layer - layers[0]}.{name[m.end():]}"


def _from_stage(name: str, plan: HeteroPlan, stage: int) -> str:
    """The canonical name of a local name on an attention rank of pipeline stage `stage`."""
    m = _DECODER_LAYER.match(name)
    if plan.pipeline_stages == 1 or m is None:
        return name
    return f"decoder.layers.{int(m.group(1)) + plan.stage_model_layers(stage)[0]}.{name[m.end():]}"


def megatron_to_hetero(state: dict[str, torch.Tensor], plan: HeteroPlan, rank: int) -> dict[str, torch.Tensor]:
    """The slice of a plain Megatron state dict that `rank` holds, under its local names (an
    attention rank of a pipeline stage: its stage's layers, numbered from 0 as GPTModel numbers
    them; an expert rank names its experts by model layer)."""
    role = plan.role(rank)
    stage = plan.stage_of(rank) if role == Role.ATTENTION else 0
    out = {}
    for name, t in state.items():
        x = _expert(name, plan)
        if x is None:
            if role == Role.ATTENTION and (local := _to_stage(name, plan, stage)) is not None:
                out[local] = t
            continue
        pre, layer, e, rest = x
        mine = plan.local_experts_at(rank, layer)  # names carry model layer indices
        if e in mine:
            local = f"{pre}local_experts.{mine.index(e)}.{rest}"
            out[local if role == Role.EXPERT else _to_stage(local, plan, stage)] = t
    return out


def hetero_to_megatron(per_rank: list[dict[str, torch.Tensor]], plan: HeteroPlan) -> dict[str, torch.Tensor]:
    """Merge every rank's local state (index = rank; in its module's names, whatever its kernels)
    into one plain Megatron state dict. Replicas (other ZP groups, other attention DP ranks) must
    agree; the first copy is kept."""
    if len(per_rank) != plan.world_size:
        raise ValueError(f"got states of {len(per_rank)} ranks for a plan of {plan.world_size}")
    out: dict[str, torch.Tensor] = {}
    for rank, state in enumerate(per_rank):
        if plan.pipeline_stages > 1 and plan.role(rank) == Role.ATTENTION:  # a stage's local layer numbers
            state = {_from_stage(n, plan, plan.stage_of(rank)): t for n, t in state.items()}
        state = expert_names.to_sequential(state, lambda pre, rank=rank: len(plan.local_experts_at(
            rank, expert_names.model_layer_of_prefix(pre, plan.decoder_layers))))
        for name, t in state.items():
            x = _expert(name, plan)
            if x is not None:
                pre, layer, i, rest = x
                name = f"{pre}local_experts.{plan.local_experts_at(rank, layer)[i]}.{rest}"
            out.setdefault(name, t)
    return out


@torch.no_grad()
def load_params(module: torch.nn.Module, local_state: dict[str, torch.Tensor]) -> None:
    """Copy a rank's local state into its module's parameters; every parameter must be given.
    The state may name experts (and the input norm) as any kernels do: it is converted to the
    module's names (plan/expert_names.py) when they differ."""
    params = dict(module.named_parameters())
    if set(local_state) != set(params):
        try:
            local_state = expert_names.convert(local_state, params)
        except expert_names.ExpertNameError as e:
            raise ValueError(f"state does not fit this rank's module: {e}") from None
    missing = sorted(set(params) - set(local_state))
    unexpected = sorted(set(local_state) - set(params))
    if missing or unexpected:
        raise ValueError(f"state does not fit this rank's module: missing {missing[:5]}, unexpected {unexpected[:5]}")
    for name, p in params.items():
        if p.shape != local_state[name].shape:
            raise ValueError(f"{name}: shape {tuple(local_state[name].shape)} in the state, "
                             f"{tuple(p.shape)} in the model")
        p.copy_(local_state[name])
