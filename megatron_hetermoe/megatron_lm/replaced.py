"""Megatron-LM flags that name what a --hetero-plan run replaces: accepted, each with one line saying
what replaces it (Megatron's MoE recipes pass them every day), and set to the value the run uses,
so that Megatron's own checks of them (validate_args, TransformerConfig) see that value."""
from __future__ import annotations

from megatron_hetermoe.plan.hetero_plan import HeteroPlan


def _given(argv: list[str]) -> set[str]:
    return {t.split("=", 1)[0] for t in argv if t.startswith("--")}


def fused_permute_available() -> bool:
    """Whether megatron-core has its fused permute kernels here (transformer-engine >= 2.1, CUDA)."""
    import torch
    from megatron.core.transformer.moe import moe_utils

    names = ("fused_permute", "fused_unpermute", "fused_sort_chunks_by_index")
    return torch.cuda.is_available() and all(getattr(moe_utils, n, None) is not None for n in names)


def replace_flags(args, argv: list[str], plan: HeteroPlan) -> list[str]:
    """Apply the plan's replacements to Megatron-LM's `args` (before its validate_args); returns
    one line for each flag of the command line that something else replaces."""
    notes = []
    if "--moe-token-dispatcher-type" in _given(argv):
        notes.append(f"--moe-token-dispatcher-type {args.moe_token_dispatcher_type}: replaced by HeterMoE's "
                     f"attention->expert dispatcher (the plan's ZP groups)")
        args.moe_token_dispatcher_type = "alltoall"  # Megatron's default: none of flex's or allgather's checks apply
    if args.expert_model_parallel_size != 1:
        shapes = sorted({f"{len(g.attention_ranks)}+{len(g.expert_ranks)}" for g in plan.groups})
        notes.append(f"--expert-model-parallel-size {args.expert_model_parallel_size}: the plan's placement "
                     f"wins: {plan.num_experts} experts a layer over each of {len(plan.groups)} ZP group(s) of "
                     f"{' or '.join(shapes)} (attention + expert) ranks")
        args.expert_model_parallel_size = 1
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
            notes.append("--moe-permute-fusion: megatron-core has no fused permute on this host (it needs "
                         "transformer-engine >= 2.1 and CUDA): HeterMoE permutes unfused, with the same result")
            args.moe_permute_fusion = False
    return notes
