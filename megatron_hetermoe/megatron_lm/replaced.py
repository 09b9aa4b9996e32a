"""Megatron-LM flags that name what a --hetero-plan run replaces: accepted, each with one line saying
what replaces it (Megatron's MoE recipes pass them every day), and set to the value the run uses,
so that Megatron's own checks of them (validate_args, TransformerConfig) see that value."""
from __future__ import annotations

from megatron_hetermoe.plan.hetero_plan import HeteroPlan
from megatron_hetermoe.vocabulary import ScheduleName


def given_flags(argv: list[str]) -> set[str]:
    """The flags of a command line (`--name` or `--name=value`), as given."""
    return {t.split("=", 1)[0] for t in argv if t.startswith("--")}



def fused_permute_available() -> bool:
    """Whether megatron-core's fused permute kernels run on this rank: transformer-engine (>= 2.1)
    binds them, and this rank's GPU (LOCAL_RANK's, the device Megatron-LM makes current) is one
    transformer-engine supports (models.builder.TE_MIN_CAPABILITY: a V100 is not)."""
    import os

    import torch
    from megatron.core.transformer.moe import moe_utils

    from megatron_hetermoe.models.builder import TE_MIN_CAPABILITY

    names = ("fused_permute", "fused_permute_with_probs", "fused_sort_chunks_by_index",
             "fused_sort_chunks_by_index_with_probs", "fused_unpermute")  # what TransformerConfig checks
    if not torch.cuda.is_available() or not all(getattr(moe_utils, n, None) is not None for n in names):
        return False
    local = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
    return tuple(torch.cuda.get_device_capability(local)) >= TE_MIN_CAPABILITY


def replace_flags(args, argv: list[str], plan: HeteroPlan) -> list[str]:
    """Apply the plan's replacements to Megatron-LM's `args` (before its validate_args); returns
    one line for each flag of the command line that something else replaces."""
    notes = []
    if "--moe-token-dispatcher-type" in given_flags(argv):
        notes.append(f"--moe-token-dispatcher-type {args.moe_token_dispatcher_type}: replaced by HeterMoE's "
                     f"attention->expert dispatcher (the plan's ZP groups)")
        args.moe_token_dispatcher_type = "alltoall"  # Megatron's default: none of flex's or allgather's checks apply
    if args.expert_model_parallel_size != 1:
        shapes = sorted({f"{len(g.attention_ranks)}+{len(g.expert_ranks)}" for g in plan.groups})
        notes.append(f"--expert-model-parallel-size {args.expert_model_parallel_size}: the plan's placement "
                     f"wins: {plan.num_experts} experts a layer over each of {len(plan.groups)} ZP group(s) of "
                     f"{' or '.join(shapes)} (attention + expert) ranks")
        args.expert_model_parallel_size = 1
    etp = args.expert_tensor_parallel_size
    if (etp if etp is not None else args.tensor_model_parallel_size) != 1:
        given = etp if etp is not None else f"{args.tensor_model_parallel_size} (Megatron's default: the TP size)"
        notes.append(f"--expert-tensor-parallel-size {given}: the plan's expert ranks hold whole experts (expert "
                     f"tensor parallelism 1); the plan's placement decides where they fit")
        args.expert_tensor_parallel_size = 1
    if getattr(args, "moe_shared_expert_overlap", False):
        notes.append("--moe-shared-expert-overlap: the shared experts run on the attention ranks in the attention "
                     "stage (under zebra, while other microbatches' tokens are with the experts), not inside "
                     "Megatron's dispatcher")
        args.moe_shared_expert_overlap = False
    if args.moe_permute_fusion:
        if fused_permute_available():
            notes.append("--moe-permute-fusion: HeterMoE's dispatcher and experts permute with megatron-core's "
                         "fused kernels (transformer-engine)")
        else:
            notes.append("--moe-permute-fusion: megatron-core has no fused permute on this host that runs on this "
                         "rank's GPU (it needs transformer-engine >= 2.1 and a CUDA GPU of compute capability 8.0+): "
                         "HeterMoE permutes unfused here, with the same result")
            args.moe_permute_fusion = False
    return notes


# Selective recomputation Megatron offers, and whether each replays nothing across roles.
_SELECTIVE_LOCAL = {"core_attn", "layernorm", "mla_up_proj", "mlp", "moe_act", "shared_experts"}


def recompute_choice(args, schedule: str) -> tuple[bool, list[str], list[str]]:
    """Megatron's recomputation flags on a --hetero-plan run: (whether zebra recomputes its attention
    stages, notes, refusals).

    - selective: each module Megatron recomputes inside one rank (attention, norms, the experts'
      activation, shared experts) runs as Megatron runs it, under both schedules; `moe` (the
      whole MoE layer, its dispatch included; --moe-layer-recompute) is run without replaying the
      dispatch: the experts keep their inputs and recompute their forward in backward
      (models/experts.recomputes_experts), with a note.
    - full: Megatron's TransformerBlock would recompute layers through their dispatch (distep:
      refused). Zebra recomputes each attention stage (one layer's attention and routing, the
      previous layer's combine) in its backward: Megatron's full/uniform recomputation, each
      layer's input kept (--recompute-num-layers 1's memory; larger numbers keep fewer); block with
      fewer layers than the model recomputes only some layers (refused)."""
    granularity = args.recompute_granularity
    moe_layer = bool(getattr(args, "moe_layer_recompute", False))
    if moe_layer and granularity is None:  # TransformerConfig makes it selective "moe" (megatron-core 0.16+)
        granularity = "selective"
    notes: list[str] = []
    if granularity == "selective":
        modules = (set(args.recompute_modules or ([] if moe_layer else ["core_attn"]))
                   | ({"moe"} if moe_layer else set()))
        if "moe" in modules:
            flag = "--moe-layer-recompute" if moe_layer else "--recompute-modules moe"
            notes.append(f"{flag}: the experts keep their inputs and recompute their forward in backward (on the "
                         f"expert ranks and on attention ranks holding experts); the dispatch is not replayed, so "
                         f"the router's outputs and the tokens that came back from other ranks are kept")
        bad = sorted(modules - _SELECTIVE_LOCAL - {"moe"})
        if bad:
            return False, [], [f"--recompute-modules {' '.join(bad)}: not a module Megatron recomputes inside one "
                                f"rank; keep {sorted(_SELECTIVE_LOCAL | {'moe'})}"]
        if schedule == ScheduleName.ZEBRA and "layernorm" in modules:
            # Megatron registers the pre-MLP norm's recomputation on the MLP's output (_forward_mlp),
            # which zebra's stages do not call; megatron-core 0.16.1's norm recomputation also needs
            # transformer-engine, so it cannot be tried on CPU ranks.
            return False, [], ["--recompute-modules layernorm with the zebra schedule: not supported (zebra splits "
                               "the layer where Megatron registers the norm's recomputation); use distep or drop it"]
        return False, notes, []
    if granularity != "full":
        return False, [], []
    if schedule != ScheduleName.ZEBRA:
        return False, [], [f"--recompute-granularity full with the {schedule} schedule: Megatron's recomputation "
                           f"would replay the dispatch collectives, which expert ranks do not mirror; use "
                           f"--hetero-schedule zebra (it recomputes each attention stage) or --recompute-granularity "
                           f"selective"]
    if args.recompute_method == "block" and (args.recompute_num_layers or 0) < args.num_layers:
        return False, [], [f"--recompute-method block --recompute-num-layers {args.recompute_num_layers}: zebra "
                           f"recomputes every layer's attention stage; use --recompute-method uniform"]
    note = (f"--recompute-granularity full --recompute-method {args.recompute_method}: zebra recomputes each "
            f"attention stage in its backward (each layer's input kept")
    if args.recompute_method == "uniform" and (args.recompute_num_layers or 1) > 1:
        note += f"; --recompute-num-layers {args.recompute_num_layers} would keep fewer"
    return True, [note + ")"], []
