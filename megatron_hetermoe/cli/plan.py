"""`hetermoe plan`'s parsers: its own flags (behaviour: planner/cli_plan.py) and the Megatron-LM
flags after `--` that it prices (planner/megatron_flags.py)."""
from __future__ import annotations

import argparse
from typing import Callable, NoReturn

from megatron_hetermoe.cli.formatter import HelpFormatter
from megatron_hetermoe.layer_pattern import LayerPatternError, parse_moe_layer_freq
from megatron_hetermoe.plan.hetero_plan import EXPERT_RECOMPUTE
from megatron_hetermoe.plan.tasks import SCHEDULES, ZEBRA_WAVE_ORDERS


def build_parser(description: str) -> argparse.ArgumentParser:
    """`p.even_only`: the dests of the "even plan" flags, which a search refuses (planner/cli_plan.py)."""
    p = argparse.ArgumentParser(prog="hetermoe plan", description=description, formatter_class=HelpFormatter)
    p.add_argument("--model", help="model config: a path or a name in configs/models/ (tiny, d1, ...); or, "
                   "instead, the run's pretrain_gpt.py flags after a literal --")
    p.add_argument("-o", "--output", help="write the plan JSON here (default: print it)")
    even = p.add_argument_group("even plan")
    even.add_argument("--even", action="store_true", help="experts split evenly; no search")
    # The group's other flags lay out an even plan; a search picks these itself (main refuses them there).
    even_only: list[str] = []

    def even_flag(*names: str, **kw) -> None:
        even_only.append(even.add_argument(*names, **kw).dest)

    even_flag("--attention-ranks", type=int, help="M: attention ranks per ZP group (required with --even)")
    even_flag("--expert-ranks", type=int, help="N: expert ranks per ZP group (required with --even, unless the "
              "run's flags after -- give --expert-model-parallel-size: then N is it)")
    even_flag("--groups", type=int, default=1, help="G: number of ZP groups")
    even_flag("--microbatches", type=int, default=None,
              help="R: microbatches per step (default 1; with the run's flags after --: its --global-batch-size / "
              "(--micro-batch-size x attention members))")
    even_flag("--schedule", choices=list(SCHEDULES), default="distep",
              help="the plan's schedule: DistEP (Megatron's schedule) or zebra (overlapped)")
    even_flag("--zebra-waves", type=int, default=1,
              help="W: with --schedule zebra and --pipeline-stages P > 1, Theorem 1 over W groups of R / W "
              "microbatches, so a stage passes one group's outputs on while it runs the next (default 1)")
    even_flag("--zebra-wave-order", choices=list(ZEBRA_WAVE_ORDERS), default="gpipe",
              help="with --zebra-waves W > 1: gpipe, every group's forward before the first backward (every "
              "stage keeps all R microbatches alive), or 1f1b, Megatron's 1F1B over the groups (stage i of P "
              "keeps R / W x min(W, P - i)) (default gpipe)")
    even_flag("--virtual-stages", type=int, default=None,
              help="V: with --pipeline-stages P > 1, each stage holds V model chunks (Megatron's "
              "--num-virtual-stages-per-pipeline-rank V; DistEP runs Megatron's interleaved 1F1B, zebra its "
              "order over the waves, docs/virtual-stages.md; Megatron-LM's pretrain() only) (default 1)")
    even_flag("--attention-gpu", default="cpu", help="GPU type of attention ranks (a configs/gpus/ name)")
    even_flag("--expert-gpu", default="cpu", help="GPU type of expert ranks (a configs/gpus/ name)")
    p.add_argument("--attention-tp", type=int, default=None,
                   help="tensor-parallel size of each attention member (Megatron's --tensor-model-parallel-size with "
                   "--sequence-parallel; M must be a multiple of it; no experts on attention ranks with TP > 1). With "
                   "--even: the plan's attention_tp (default 1); with --cluster: search only this size (default: "
                   "1, 2, 4 and 8 where they divide the heads and fit in a node)")
    p.add_argument("--attention-cp", type=int, default=None,
                   help="context-parallel size of each attention member (Megatron's --context-parallel-size: a member "
                   "is attention-tp x attention-cp ranks of one node, each CP rank two of every sequence's 2 x CP "
                   "chunks; the search places no experts on attention ranks with CP > 1). With --even: the "
                   "plan's attention_cp (default 1); with --cluster: search only this size (default: 1, 2, 4 "
                   "and 8 where 2 x CP divides the sequence and the member fits in a node)")
    p.add_argument("--pipeline-stages", type=int, default=None,
                   help="P: pipeline stages of each ZP group (Megatron's --pipeline-model-parallel-size; the decoder "
                   "layers split evenly; each stage its own attention and expert ranks; with --cluster DistEP or zebra "
                   "inside the stages, as the search picks). "
                   "With --even: the plan's P (default 1; --attention-ranks and --expert-ranks are then per stage); "
                   "with --cluster: search only this P (default: 1, 2, 4 and 8 where they divide the layers and "
                   "the ZP group)")
    srch = p.add_argument_group("search")
    srch.add_argument("--cluster", help="cluster config: a path or a name in the config directory's clusters/ "
                      "(o1, c1-200g, ...; required for a search)")
    srch.add_argument("--seq-len", type=int, help="tokens per sequence (required for a search)")
    srch.add_argument("--global-batch", type=int, help="sequences per step (required for a search)")
    srch.add_argument("--asym", choices=["optimal", "greedy", "none"], default="optimal",
                      help="expert assignment solver for the plan (default: optimal)")
    srch.add_argument("--engine", choices=["auto", "python", "cpp"], default="auto",
                      help="simulator core (auto: the C++ core when built)")
    srch.add_argument("--max-microbatches", type=int, default=32, help="largest R the search tries")
    srch.add_argument("--expert-recompute", choices=["auto", *EXPERT_RECOMPUTE], default="auto",
                      help="what expert ranks keep for the expert backward: off (inputs and intermediates), "
                      "keep-inputs (backward re-runs the expert forward), resend-inputs (nothing kept: the "
                      "attention ranks send the tokens again with the gradient); auto: keep-inputs, and "
                      "resend-inputs for shapes whose expert ranks cannot hold their experts otherwise. "
                      "The plan carries the level; training runs off and keep-inputs and refuses "
                      "resend-inputs, which is priced only (default: auto)")
    srch.add_argument("--distributed-optimizer", action="store_true",
                      help="price Megatron's --use-distributed-optimizer: fp32 master weights and Adam moments "
                      "sharded over each parameter's replicas (attention members; an expert's ZP groups); "
                      "train the plan with --use-distributed-optimizer")
    srch.add_argument("--json", action="store_true", help="print the predictions as JSON instead of a table")
    loads = p.add_argument_group("measured expert loads (docs/expert-load.md)")
    loads.add_argument("--expert-load", metavar="STATS",
                       help="place experts for the loads a run measured (its --hetero-expert-load-stats file): "
                       "Asym-EA and the expert-to-rank assignment balance load x time per token of each rank's GPU "
                       "within its memory; prints the predicted step of the uniform and the load-aware placement "
                       "under these loads and writes the load-aware one where it is faster. With --even: "
                       "placement only (needs --seq-len and --global-batch, or the run's flags after --)")
    loads.add_argument("--expert-load-intervals", type=int, default=None, metavar="K",
                       help="with --expert-load: the loads of the stats file's last K log intervals (recent "
                       "routing; default: the whole run)")
    loads.add_argument("--expert-load-plan", metavar="RUN_PLAN",
                       help="with --expert-load: the plan the measured run trained on; each GPU type's expert speed "
                       "is then its ranks' measured expert task seconds over the cost model's for the same tokens "
                       "(relative between the measured types; default: the GPU profiles)")
    p.even_only = tuple(even_only)  # the dests of the "even plan" flags, for main's refusal in a search
    return p


def _window(text: str) -> tuple[int, ...]:
    """Megatron's tuple_type: "128,0" or "(128,0)" -> (128, 0)."""
    try:
        return tuple(int(i) for i in text.strip("()").split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not comma-separated integers, e.g. 128,0") from None


def _pattern(text: str) -> int | list[int]:
    """Megatron's moe_freq_type (--window-attn-skip-freq): an int, or a list expression."""
    try:
        return parse_moe_layer_freq(text)
    except LayerPatternError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def megatron_flags_parser(recompute_modules: tuple[str, ...],
                          error: Callable[[str], NoReturn]) -> argparse.ArgumentParser:
    """The pretrain_gpt.py flags after `hetermoe plan ... --` that give the model and the run
    (behaviour: planner/megatron_flags.py); `error` ends a bad value (the planner's one-line error
    instead of this parser's usage); `recompute_modules`: --recompute-modules' choices."""
    # allow_abbrev=False: Megatron's names only (--num-layers must not match --num-layers-per-...)
    p = argparse.ArgumentParser(prog="hetermoe plan ... --", add_help=False, allow_abbrev=False)
    p.error = error  # type: ignore[method-assign]
    for flag in ("--num-layers", "--hidden-size", "--num-attention-heads", "--ffn-hidden-size", "--moe-ffn-hidden-size",
                 "--num-experts", "--moe-router-topk", "--seq-length", "--encoder-seq-length", "--vocab-size",
                 "--padded-vocab-size", "--global-batch-size", "--moe-shared-expert-intermediate-size",
                 "--kv-channels", "--num-query-groups", "--mtp-num-layers", "--q-lora-rank",
                 "--moe-router-num-groups", "--moe-router-group-topk", "--max-position-embeddings",
                 "--num-layers-per-virtual-pipeline-stage", "--num-virtual-stages-per-pipeline-rank",
                 "--recompute-num-layers", "--decoder-first-pipeline-num-layers",
                 "--decoder-last-pipeline-num-layers"):
        p.add_argument(flag, type=int, default=None)
    for flag, default in (("--kv-lora-rank", 32), ("--qk-head-dim", 128), ("--qk-pos-emb-head-dim", 64),
                          ("--v-head-dim", 128), ("--make-vocab-size-divisible-by", 128),
                          ("--tensor-model-parallel-size", 1), ("--pipeline-model-parallel-size", 1),
                          ("--context-parallel-size", 1),
                          ("--expert-model-parallel-size", 1), ("--micro-batch-size", 1)):
        p.add_argument(flag, type=int, default=default)
    p.add_argument("--moe-aux-loss-coeff", type=float, nargs="+", default=None)
    p.add_argument("--moe-layer-freq", default=None)  # int or list expression: ModelConfig reads it
    p.add_argument("--window-size", type=_window, default=None)
    p.add_argument("--window-attn-skip-freq", type=_pattern, default=None)
    p.add_argument("--softmax-type", choices=["vanilla", "off-by-one", "learnable"], default="vanilla")
    p.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default="LayerNorm")
    p.add_argument("--position-embedding-type", choices=["learned_absolute", "rope", "mrope", "relative", "none"],
                   default="learned_absolute")
    p.add_argument("--recompute-granularity", choices=["full", "selective"], default=None)
    p.add_argument("--recompute-method", choices=["uniform", "block"], default=None)
    p.add_argument("--recompute-modules", nargs="*", choices=recompute_modules, default=None)
    for flag in ("--swiglu", "--quick-geglu", "--squared-relu", "--group-query-attention",
                 "--untie-embeddings-and-output-weights", "--qk-layernorm", "--attention-output-gate",
                 "--multi-latent-attention", "--add-qkv-bias", "--moe-shared-expert-gate", "--sequence-parallel",
                 "--use-distributed-optimizer", "--recompute-activations", "--moe-layer-recompute"):
        p.add_argument(flag, action="store_true")
    p.add_argument("--disable-bias-linear", action="store_false", dest="add_bias_linear")
    p.add_argument("--tokenizer-type", default=None)
    return p
