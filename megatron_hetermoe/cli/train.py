"""`hetermoe train`'s parser (its config form): the subset of Megatron-LM's pretrain_gpt.py flags the
plugin's trainer takes, its own launch flags and the --hetero-* flags (behaviour: training/args.py). The
pretrain_gpt.py form adds the model's shape as flags (cli/train_gpt.py; which form: cli/train_forms.py)."""
from __future__ import annotations

import argparse

from megatron_hetermoe.cli.data import add_data_args
from megatron_hetermoe.cli.flags import FlagRows, add_flags
from megatron_hetermoe.cli.formatter import HelpFormatter
from megatron_hetermoe.cli.hetero import add_hetero_args
from megatron_hetermoe.vocabulary import CpComm

# Forked CPU ranks share one host: more than this is a typo, not a job (each rank holds ~400 MB).
MAX_FORKED_RANKS = 1024


# The model, parallelism, batch and optimizer flags, first in --help.
_RUN_FLAGS: FlagRows = (
    ("--model", dict(default="tiny"),
     "model config: a name in the config directory's models/ "
"(hetermoe --config-dir) or a path to a YAML file"),
    ("--tensor-model-parallel-size", dict(type=int, default=1),
     "TP size; above 1 needs --sequence-parallel (MoE, as Megatron-LM requires) and divides the "
     "attention heads, the vocab and --seq-length; experts are not tensor-parallel (expert TP 1); "
     "with --hetero-plan: the plan's attention_tp (its attention members' TP size)"),
    ("--sequence-parallel", dict(action="store_true"),
     "Megatron's sequence parallelism over the TP group (required with TP > 1; turned off at TP 1, "
     "as Megatron-LM does)"),
    ("--context-parallel-size", dict(type=int, default=1),
     "Megatron's context parallelism: with --hetero-plan, the plan's attention_cp (each attention "
     "member's ranks at one TP position split every sequence into 2 x CP chunks, two each, and "
     "attend over the others' by --cp-comm-type); without a plan (Megatron EP) only 1 runs here"),
    ("--cp-comm-type", dict(nargs="+", default=[CpComm.P2P.value]),
     "Megatron's CP communication, one value for every layer or one per layer: p2p (a ring that "
     "passes keys and values around the CP group), all_gather (each rank gathers them) or a2a "
     "(an all-to-all gives each CP rank the whole sequence of heads / CP); transformer-engine's "
     "hierarchical a2a+p2p is not built"),
    ("--expert-tensor-parallel-size", dict(type=int, default=None),
     "expert TP size; only 1 runs here (experts are whole). Megatron's default is the TP size, so "
     "with --tensor-model-parallel-size > 1 give 1 explicitly"),
    ("--pipeline-model-parallel-size", dict(type=int, default=1),
     "PP size (1F1B); must divide the model's layers; with --hetero-plan: the plan's "
     "pipeline_stages (each stage its own attention and expert ranks; distep)"),
    ("--expert-model-parallel-size", dict(type=int, default=1),
     "EP size; must divide the model's experts and the world size / PP"),
    ("--moe-token-dispatcher-type", dict(default="alltoall", choices=["alltoall", "allgather"]),
     "Megatron's MoE token dispatcher (flex needs DeepEP on GPUs)"),
    ("--micro-batch-size", dict(type=int, default=2), "sequences per microbatch per rank"),
    ("--global-batch-size", dict(type=int, default=8),
     "sequences per step; a multiple of --micro-batch-size x data-parallel size"),
    ("--seq-length", dict(type=int, default=None), "tokens per sequence (default: the model config's)"),
    ("--train-iters", dict(type=int, default=5), "optimizer steps to train (the LR schedule's length)"),
    ("--lr", dict(type=float, default=1e-3), "peak learning rate (Adam; cosine decay to --min-lr)"),
    ("--min-lr", dict(type=float, default=1e-4), "learning rate at the end of the cosine decay"),
    ("--lr-warmup-iters", dict(type=int, default=0), "linear warm-up steps from 0 to --lr; fewer than --train-iters"),
    ("--weight-decay", dict(type=float, default=0.01), "Adam weight decay"),
    ("--clip-grad", dict(type=float, default=1.0), "clip the global gradient norm to this (0: no clipping)"),
    ("--seed", dict(type=int, default=1234), "seed of weights and data order, in [0, 2^32)"),
    ("--use-distributed-optimizer", dict(action="store_true"),
     "shard optimizer state over data-parallel ranks (Megatron's: with --hetero-plan over the "
     "attention DP group and each expert replica group)"),
)


def add_megatron_args(p: argparse.ArgumentParser) -> None:
    """The subset of Megatron-LM pretrain_gpt.py flags the baseline trainer takes."""
    add_flags(p, _RUN_FLAGS)
    g = p.add_argument_group("mixed precision (Megatron-LM flags)")
    prec = g.add_mutually_exclusive_group()
    prec.add_argument("--bf16", action="store_true",
                      help="bf16 parameters and activations, fp32 main parameters and gradients (Megatron's "
                           "mixed-precision optimizer); needs native bf16 on every GPU (not V100/T4: use --fp16)")
    prec.add_argument("--fp16", action="store_true",
                      help="fp16 parameters and activations, fp32 main parameters and gradients, loss scaling "
                           "(dynamic unless --loss-scale)")
    g.add_argument("--loss-scale", type=float, default=None,
                   help="constant loss scale for --fp16/--bf16 (a positive power of 2 helps fp16; default: dynamic "
                        "for --fp16, none for --bf16)")
    g.add_argument("--initial-loss-scale", type=float, default=2**32, help="initial dynamic loss scale")
    g.add_argument("--min-loss-scale", type=float, default=1.0, help="minimum dynamic loss scale")
    g.add_argument("--loss-scale-window", type=float, default=1000,
                   help="steps without overflow before the dynamic loss scale doubles")
    g.add_argument("--hysteresis", type=int, default=2,
                   help="overflowing steps in a row before the dynamic loss scale halves")
    g = p.add_argument_group("kernels (Megatron-LM flags; default: chosen for the ranks' device)")
    g.add_argument("--transformer-impl", choices=["local", "transformer_engine"], default=None,
                   help="Megatron-LM's layer spec: transformer_engine (TE layers; needs transformer-engine and CUDA "
                        "ranks of compute capability 8.0+ (Ampere or newer), on every rank) or local (megatron-core's "
                        "own). Default: chosen automatically (unlike Megatron-LM, whose default is "
                        "transformer_engine) per pool (attention ranks, expert ranks): TE where it runs on every GPU "
                        "of the pool, else local; the choice is printed (kernels: ...)")
    g.add_argument("--moe-grouped-gemm", action="store_true", default=None,
                   help="Megatron-LM's grouped GEMM for experts: TEGroupedMLP with transformer_engine, the legacy "
                        "GroupedMLP (grouped_gemm package, CUDA, --bf16) with local (default: with TE when chosen "
                        "automatically, else off)")
    p.add_argument("--deterministic-mode", action="store_true",
                   help="bitwise reproducible runs (deterministic kernels; regress compares exactly)")
    p.add_argument("--log-interval", type=int, default=1, help="print an iteration line every this many steps")
    p.add_argument("--tensorboard-dir", default=None, help="write TensorBoard scalars here (first rank; default: none)")
    p.add_argument("--moe-aux-loss-coeff", type=float, default=None,
                   help="load-balancing loss weight (default: the model config's)")
    add_data_args(p)
    p.add_argument("--save", default=None, help="directory to save checkpoints to (default: no checkpoints)")
    p.add_argument("--load", default=None,
                   help="directory to load a checkpoint from (latest_checkpointed_iteration.txt; "
                   "default: start from scratch)")
    p.add_argument("--save-interval", type=int, default=None,
                   help="iterations between checkpoint saves (default: only at the end)")
    p.add_argument("--ckpt-step", type=int, default=None, help="load this iteration (default: the latest)")
    g = p.add_argument_group("non-persistent local checkpoints (Megatron-LM flags; checkpoint/local.py)")
    g.add_argument("--non-persistent-save-interval", type=int, default=None,
                   help="iterations between local checkpoints (default: none)")
    g.add_argument("--non-persistent-ckpt-type", choices=["global", "local", "in_memory"], default=None,
                   help="'local': each rank's state in host memory of its node (--non-persistent-local-ckpt-dir); "
                        "'global' and 'in_memory' are refused (not built)")
    g.add_argument("--non-persistent-local-ckpt-dir", default=None,
                   help="the nodes' local directory for them, e.g. /dev/shm/ckpt (a tmpfs: host memory)")
    g.add_argument("--replication", action="store_true",
                   help="copy each rank's local checkpoint to --replication-factor - 1 other ranks")
    g.add_argument("--replication-jump", type=int, default=None,
                   help="J: rank n's copies go to ranks n+J, n+2J, ... (modulo the world; the GPUs per node "
                        "puts them on other nodes)")
    g.add_argument("--replication-factor", type=int, default=2,
                   help="ranks holding each rank's local checkpoint, its own included (default: 2)")
    p.add_argument("--check-for-nan-in-loss-and-grad", nargs="?", const="stop", default="stop",
                   choices=["stop", "skip"],
                   help="on a non-finite loss or gradient: stop the run (Megatron's meaning, the default) "
                        "or skip the step on every rank")
    p.add_argument("--no-check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad",
                   action="store_const", const="off",
                   help="do not check (default: check, see --check-for-nan-in-loss-and-grad)")
    g = p.add_argument_group("emulation of a mixed cluster on CPU ranks (HeterMoE's own flags)")
    g.add_argument("--emulate", default=None, metavar="CLUSTER",
                   help="time every rank as the GPU of its position in this cluster (a clusters/ name or a "
                        "path; default: no emulation)")
    g.add_argument("--emulated-model", default=None, help="model shape whose cost is emulated (default: --model)")
    g.add_argument("--emulated-seq-length", type=int, default=None, help="its sequence length (default: 4096)")
    g.add_argument("--emulated-global-batch-size", type=int, default=None,
                   help="its sequences per step (default: 4 per emulated GPU)")
    g.add_argument("--emulation-scale", default="1.0",
                   help="real seconds per emulated second, or 'auto': picked from a calibration step (the "
                        "second) so that the real work fits inside the emulated times")


def build_parser(progress_timeout_s: float, prog: str = "hetermoe train") -> argparse.ArgumentParser:
    """`hetermoe train`'s flags (`progress_timeout_s`: --progress-timeout's default, the launcher's);
    the pretrain_gpt.py form adds Megatron's model-shape flags to these (cli/train_gpt.py)."""
    p = argparse.ArgumentParser(prog=prog, description="Train the Megatron MoE baseline (plain Megatron-Core "
                                "TP/PP/EP/DP), or HeterMoE with --hetero-plan.", formatter_class=HelpFormatter)
    add_megatron_args(p)
    p.add_argument("--nproc", type=int, default=None,
                   help=f"CPU ranks to start, 1..{MAX_FORKED_RANKS} (default: join a torchrun job if RANK is set, "
                        f"else 4)")
    p.add_argument("--elastic-restarts", type=int, default=0, metavar="N",
                   help="HeterMoE on forked ranks: when ranks are lost (a process killed, its GPU gone), re-plan "
                        "for the GPUs left (--hetero-gpus, or the plan's) and continue from the latest checkpoint "
                        "(--save, --save-interval), up to N times (default: 0, a lost rank ends the job)")
    p.add_argument("--progress-timeout", type=float, default=progress_timeout_s, metavar="SECONDS",
                   help="forked CPU ranks: end the job, naming the rank furthest behind, when no rank finishes a "
                        "step (or a checkpoint save) for this long; 0: never. A run has no other time limit "
                        "(under torchrun the collective timeouts apply)")
    p.add_argument("--golden-values-out", default=None,
                   help="write per-step lm loss as Megatron golden values JSON (default: none)")
    p.add_argument("--recompute-granularity", choices=["full"], default=None,
                   help="zebra only (refused otherwise): recompute attention stages in backward (Megatron's "
                        "'full' meaning, per stage; default: keep activations)")
    p.add_argument("--timeline-dir", default=None, help="HeterMoE: write each rank's timeline here (default: none)")
    add_hetero_args(p)
    return p
