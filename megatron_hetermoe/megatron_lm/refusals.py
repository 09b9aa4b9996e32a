"""The Megatron-LM flags a --hetero-plan run of Megatron-LM's pretrain() cannot honour, each refused
by name with the reason (the flags naming what HeterMoE replaces are accepted with a note: replaced.py;
every other flag is Megatron-LM's, applied by Megatron-LM itself)."""
from __future__ import annotations

import torch

# Megatron-LM flags this path refuses: reason -> {flag: the values it may keep} (Megatron's
# defaults). A flag's argparse dest is its name without dashes.
_OFF, _UNSET, _ONE = (False,), (None,), (1,)
_REFUSED: dict[str, dict[str, tuple]] = {
    "HeterMoE's context parallelism is one flat group per attention member and TP position (the plan's "
    "attention_cp); hierarchical groups are not built": {"--hierarchical-context-parallel-sizes": _UNSET},
    "the plan's pipeline stages split the decoder layers evenly or by the first and last stages' counts "
    "(--decoder-first/last-pipeline-num-layers, checked against the plan); other layouts are not built yet": {
        "--pipeline-model-parallel-layout": _UNSET, "--account-for-embedding-in-pipeline-split": _OFF,
        "--account-for-loss-in-pipeline-split": _OFF},
    "HeterMoE builds megatron-core's GPTModel from the command line's flags and Megatron's spec": {
        "--use-legacy-models": _OFF, "--spec": _UNSET, "--yaml-cfg": _UNSET},
    "not supported with HeterMoE": {
        "--heterogeneous-layers-config-path": _UNSET,
        "--experimental-attention-variant": _UNSET, "--delay-wgrad-compute": _OFF, "--moe-use-upcycling": _OFF,
        "--use-torch-fsdp2": _OFF, "--use-megatron-fsdp": _OFF},
    "HeterMoE's dispatcher replaces Megatron's (it applies the probabilities after combine)": {
        "--moe-enable-deepep": _OFF,
        "--moe-apply-probs-on-input": _OFF},
    "zebra is HeterMoE's overlap of expert communication": {"--overlap-moe-expert-parallel-comm": _OFF},
    "not computed across HeterMoE's roles (the logging rank may hold experts only)": {
        "--log-max-attention-logit": _OFF, "--qk-clip": _OFF},
    "HeterMoE initializes every parameter by Megatron's init method for it, seeded by its name, so every "
    "replica and every layout starts from the same values": {
        "--data-parallel-random-init": _OFF, "--init-model-with-meta-device": _OFF},
    "HeterMoE checkpoints inside pretrain() are Megatron's torch_dist (dist_checkpointing) format": {
        "--ckpt-format": ("torch_dist",)},
    "inside pretrain() a checkpoint of another plan loads resharded by itself (megatron_lm/checkpoints.py)": {
        "--hetero-ckpt-reshard": _OFF},
    "Megatron's local checkpoints need the NVIDIA resiliency extension and have not run with HeterMoE's "
    "per-rank optimizer state; the plugin's trainer (hetermoe train) takes the same flags, with copies on "
    "peers' nodes": {"--non-persistent-ckpt-type": (None, "global")},
}


def _dest(flag: str) -> str:
    return flag[2:].replace("-", "_")


def refusals(args) -> list[str]:
    """Each Megatron-LM flag of this command line that a --hetero-plan run cannot honour, with
    the reason (empty: the run may go on)."""
    out = [f"{flag} {getattr(args, _dest(flag))!r}: {why}" for why, flags in _REFUSED.items()
           for flag, keep in flags.items() if getattr(args, _dest(flag), keep[0]) not in keep]
    if getattr(args, "hetero_gpus", None) and getattr(args, "hetero_plan", None) != "auto":
        out.append(f"--hetero-gpus {args.hetero_gpus}: the GPUs to plan for, with --hetero-plan auto only (a plan "
                   f"file names its GPUs)")
    if not getattr(args, "num_experts", None):
        out.append("--num-experts: HeterMoE trains MoE models; give --num-experts")
    if args.transformer_impl == "transformer_engine":
        try:
            import transformer_engine  # noqa: F401
        except ImportError:
            out.append("--transformer-impl transformer_engine (Megatron-LM's default): transformer-engine is not "
                       "installed; install it or pass --transformer-impl local")
    if not torch.cuda.is_available() and args.distributed_backend != "gloo":
        out.append(f"--distributed-backend {args.distributed_backend!r}: this host has no CUDA; pass "
                   f"--distributed-backend gloo to run the ranks on the CPU")
    return out


def schedule_refusals(args, schedule: str) -> list[str]:
    """The flags a run on `schedule` cannot honour (beyond recompute_choice's), with the reason."""
    return []  # none today: zebra cuts the MTP block into stages too (models/stages.py)
