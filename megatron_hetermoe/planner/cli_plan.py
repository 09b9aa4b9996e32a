"""`hetermoe plan`: write a plan file.

  hetermoe plan --even --attention-ranks M --expert-ranks N --groups G --model CFG
                [--microbatches R] [--schedule distep|zebra] [--zebra-waves W [--zebra-wave-order gpipe|1f1b]]
                [--attention-gpu T --expert-gpu T] [--attention-tp T] [--attention-cp C]
                [--pipeline-stages P [--virtual-stages V]] -o plan.json
      G groups of M attention + N expert ranks, experts split evenly (plan.even_plan); with
      --attention-tp T the M attention ranks are M/T tensor-parallel members, with --attention-cp C
      too M/(T C) members of T x C ranks (TP position fastest; Megatron's --context-parallel-size C); with
      --pipeline-stages P each group is P stages of M attention + N expert ranks (Megatron's
      --pipeline-model-parallel-size P, the layers split evenly, a stage's experts on its ranks).
  hetermoe plan --cluster CLUSTER --model CFG --seq-len S --global-batch B [-o plan.json] [--json]
                [--asym optimal|greedy|none] [--engine auto|python|cpp] [--max-microbatches K]
                [--expert-recompute auto|off|keep-inputs|resend-inputs] [--attention-tp T] [--attention-cp C]
                [--pipeline-stages P] [--distributed-optimizer]
      searches ZP group shape, attention TP and CP sizes, pipeline stages (P > 1: DistEP inside the
      stages with Megatron's 1F1B across them, or zebra inside them), R, expert placement and what expert ranks keep
      for backward;
      prints every strategy's predicted step.
  hetermoe plan [--even ... | --cluster CLUSTER ...] -- <pretrain_gpt.py flags>
      the model from the run's own Megatron-LM flags instead of --model (every flag that changes
      what megatron-core builds, with Megatron's meaning and default; planner/megatron_flags.py
      says which are read and which refused); --seq-len and --global-batch default to their
      --seq-length and --global-batch-size. An even plan follows the run's layout and batch as the
      run checks them (even_layout): --tensor-model-parallel-size, --context-parallel-size,
      --pipeline-model-parallel-size, the virtual pipeline size and R = --global-batch-size /
      (--micro-batch-size x attention members); --expert-ranks defaults to
      --expert-model-parallel-size. A search prices the run's recomputation and distributed
      optimizer, and searches only the TP, CP, PP and micro batch the run's flags give
      (search_settings); it prints the flags its plan trains with.
  hetermoe plan [--even ... | --cluster CLUSTER ...] --expert-load STATS [--expert-load-intervals K]
                [--expert-load-plan RUN_PLAN]
      places experts for the loads a run measured (--hetero-expert-load-stats; docs/expert-load.md):
      Asym-EA and the expert-to-rank assignment balance each expert's load x its time on each
      rank's GPU within each rank's memory (planner/load_placement.py); prints the predicted step
      of the uniform placement and of the load-aware one under the measured loads, side by side,
      and writes the load-aware one where it is predicted faster. With --even the layout is kept
      (placement only; --seq-len and --global-batch, or the run's flags after --, price it); a
      search re-places its fastest candidates. --expert-load-plan: the plan the measured run
      trained on, so its per-rank expert task seconds give each GPU type's measured speed.
A model with dense layers (--moe-layer-freq) gets a plan of its MoE layers (num_layers) that
names the dense ones (dense_layers); those and shared experts run on the attention ranks. MTP
layers (--mtp-num-layers) are MoE layers after the decoder's, of its last layer's kind.
The table's "vs limit" sets HeterMoE's rows against the roofline of compute and network (the
compute-only physical limit and the network floor of the layouts it fits, both printed) and the
baselines against the compute-only limit.
"""
from __future__ import annotations

import argparse
import json
import math
import sys

from megatron_hetermoe.config import ModelConfig
from megatron_hetermoe.limits import (
    MAX_GLOBAL_BATCH,
    MAX_MICROBATCHES,
    MAX_RANKS,
    MODEL_LIMITS,
)
from megatron_hetermoe.plan.hetero_plan import RUNTIME_EXPERT_RECOMPUTE, HeteroPlan, PlanError, even_plan
from megatron_hetermoe.planner.baselines import NETWORK_FLOOR, ROOFLINE
from megatron_hetermoe.planner.cluster import Cluster
from megatron_hetermoe.planner.cost_model import SELECTIVE_PRICED, CostModel, TrainSettings
from megatron_hetermoe.planner.expert_load import ExpertLoad, LoadStats, describe_skew, load_expert_load
from megatron_hetermoe.planner.load_placement import ExpertSpeeds, LoadPlacement, measured_speeds, place_for_load
from megatron_hetermoe.planner.megatron_flags import RunFlags, model_from_flags
from megatron_hetermoe.planner.pipeline import PIPELINE_STAGES
from megatron_hetermoe.planner.profiles import known_gpu_types, load_profiles
from megatron_hetermoe.planner.search import ATTENTION_CP, ATTENTION_TP, SearchResult, search
from megatron_hetermoe.vocabulary import ScheduleName


def _parser() -> argparse.ArgumentParser:
    """`hetermoe plan`'s parser (cli/plan.py), described by this module's docstring."""
    from megatron_hetermoe.cli.plan import build_parser

    return build_parser(__doc__)


def _finite(x):
    return x if isinstance(x, (int, float)) and math.isfinite(x) else None


def format_table(res: SearchResult, title: str) -> str:
    types = sorted({g for p in res.predictions for g in p.utilization})
    w = max([36] + [len(p.name) + 2 for p in res.predictions])
    head = (f"{'strategy':<{w}}{'step (s)':>10}{'tokens/s':>12}{'vs limit':>9}"
            + "".join(f"{'util ' + g:>16}" for g in types))
    lines = [title, head, "-" * len(head)]
    for p in res.predictions:
        if not p.fits:
            lines.append(f"{p.name:<{w}}{'does not fit: ' + str(p.detail.get('reason', '')):>40}")
            continue
        row = f"{p.name:<{w}}{p.step_time_s:>10.3f}{p.tokens_per_s:>12.0f}{p.ratio_to_limit:>9.2f}"
        row += "".join(f"{p.utilization.get(g, 0.0):>16.2f}" for g in types)
        lines.append(row)
    roof = next((p for p in res.predictions if p.name == ROOFLINE), None)
    if roof is not None:
        lines.append(f"note: vs limit: HeterMoE's rows over the {ROOFLINE} ({roof.step_time_s:.3f} s, bound by "
                     f"{roof.detail.get('bound_by')}: the larger of the compute-only physical limit and the "
                     f"{NETWORK_FLOOR}, the best of the layouts the strategies fit by the bytes it moves across NICs "
                     f"with per-node dedup and each role's compute), the baselines over the compute-only one")
    for p in res.predictions:  # the parallel configuration of the Megatron rows
        if p.fits and "tp" in p.detail and "pp" in p.detail:
            lines.append(f"note: {p.name}: TP {p.detail['tp']}, PP {p.detail['pp']}, EP {p.detail['ep_size']}, "
                         f"{p.detail['microbatches']} microbatch(es), pipeline bubble {p.detail['bubble_s']:.3f} s")
    for p in res.predictions:  # layouts a strategy could not use: the reason behind a jump in its step
        for layout, why in (p.detail.get("excluded_layouts") or {}).items():
            lines.append(f"note: {p.name} cannot use {layout}: {why}")
    if res.plan is not None:
        g0 = res.plan.groups[0]
        tp, cp, P = res.plan.attention_tp, res.plan.attention_cp, res.plan.pipeline_stages
        M, N = len(g0.attention_ranks) // P, len(g0.expert_ranks) // P
        sizes = " x ".join([f"attention_tp {tp}"] * (tp > 1) + [f"attention_cp {cp}"] * (cp > 1))
        members = f" ({M // (tp * cp)} member(s) of {sizes})" if sizes else ""
        shape = f"{M} attention{members} + {N} expert ranks"
        if P > 1:
            shape = f"{P} pipeline stages of {shape} each"
        lines.append(f"plan: {len(res.plan.groups)} ZP group(s) of {shape}, pipeline stages P={P}, "
                     f"R={res.plan.num_microbatches}, schedule {res.plan.schedule}, "
                     f"{res.plan.meta.get('assignment')}; experts on attention ranks per layer: "
                     f"{res.plan.meta.get('experts_on_attention_per_layer')}; expert recompute: "
                     f"{res.plan.expert_recompute}")
        pick = next((p for p in res.predictions if p.fits and p.detail.get("pipeline_stages", 1) > 1
                     and "stage_times_s" in p.detail), None)
        if P > 1 and pick is not None:
            times = ", ".join(f"{t:.3f}" for t in pick.detail["stage_times_s"])
            lines.append(f"note: {pick.name}: {P} pipeline stages under 1F1B, one microbatch per stage {times} s "
                         f"(forward + backward + P2P), pipeline bubble {pick.detail['bubble_s']:.3f} s")
        if res.plan.expert_recompute not in RUNTIME_EXPERT_RECOMPUTE:
            lines.append(f"note: expert recompute {res.plan.expert_recompute!r} is priced, not run: training refuses "
                         f"this plan; plan with --expert-recompute "
                         f"{' or '.join(RUNTIME_EXPERT_RECOMPUTE)} for one that runs")
    if res.expert_load is not None:
        lines.extend(load_lines(res.expert_load))
    lines.append(f"searched {res.candidates} shapes in {res.elapsed_s:.2f} s")
    return "\n".join(lines)


def load_lines(report: dict) -> list[str]:
    """The measured-loads comparison in words (a search's or an even plan's report)."""
    if "not_priced" in report:
        return [f"note: measured expert loads: the pick is not priced under loads ({report['not_priced']}); its "
                f"placement is kept"]
    u, a, b = report["uniform_step_s"], report["load_aware_step_s"], report["balanced_routing_step_s"]
    out = [f"under the measured loads: uniform placement {u:.3f} s, load-aware {a:.3f} s ({u / a:.2f}x); the "
           f"same plan under balanced routing {b:.3f} s",
           f"placement written: {report['placement']}; experts on attention ranks per layer: "
           f"{report['experts_on_attention_per_layer']}"]
    if not report.get("load_aware_fits", True):
        out.append("note: no placement found fits in memory under these loads; the written one is over by the "
                   "least (more ranks, more microbatches or GPUs with more memory)")
    if not report.get("uniform_fits", True):
        out.append("note: the uniform placement does not fit in memory under these loads (a hot expert's routed "
                   "tokens and working set)")
    if report.get("same_shape_as_pick") is False:
        out.append("note: the load-aware plan starts from another of the search's candidates than the balanced "
                   "pick (another shape, R or Asym-EA): " + ", ".join(
            f"{k} {v}" for k, v in report["load_aware_shape"].items()))
    return out


def _split_flags(argv: list[str]) -> tuple[list[str], list[str] | None]:
    """hetermoe plan's own arguments, and the Megatron-LM flags after the first literal -- (None: no --)."""
    if "--" not in argv:
        return argv, None
    i = argv.index("--")
    return argv[:i], argv[i + 1:]


def _model(args: argparse.Namespace, flags: list[str] | None) -> tuple[ModelConfig, RunFlags | None]:
    """The model: --model's config, or the one the Megatron-LM flags after -- build (which also
    give --seq-len and --global-batch their defaults; a value given twice must agree), and the
    run those flags describe (None without flags)."""
    if flags is None:
        if not args.model:
            raise ValueError("no model: give --model CONFIG, or the run's pretrain_gpt.py flags after --")
        return ModelConfig.load(args.model), None
    if args.model:
        raise ValueError(f"--model {args.model} and Megatron-LM flags after -- both give the model; keep one")
    fm = model_from_flags(flags)
    for note in fm.notes:
        print(f"hetermoe plan: note: {note}", file=sys.stderr)
    for ours, theirs, v in (("seq_len", "--seq-length", fm.seq_length), ("global_batch", "--global-batch-size",
                                                                          fm.global_batch_size)):
        mine = getattr(args, ours)
        if v is not None and mine is not None and mine != v:
            raise ValueError(f"--{ours.replace('_', '-')} {mine} and {theirs} {v} after -- disagree; the plan "
                             f"must price the run: drop --{ours.replace('_', '-')}")
        if mine is None:
            setattr(args, ours, v)
    return fm.model, fm.run


def _agree(ours: str, mine, theirs: str, run_value) -> None:
    """A layout value given to hetermoe plan and read from the run's flags must agree (the run
    refuses a plan that differs): ValueError naming both."""
    if mine is not None and mine != run_value:
        raise ValueError(f"{ours} {mine} and the run's {theirs} {run_value} (after --; Megatron's default where the "
                         f"flag is absent) disagree; the run refuses a plan that differs: drop {ours}, or change "
                         f"{theirs} after --")


def even_layout(args: argparse.Namespace, model: ModelConfig, run: RunFlags | None) -> dict:
    """The even plan's layout: hetermoe plan's flags, or the run's (RunFlags) as the run reads
    them and checks them against the plan (training/validation.py): attention_tp is
    --tensor-model-parallel-size, attention_cp --context-parallel-size, pipeline_stages
    --pipeline-model-parallel-size, virtual_stages Megatron's virtual pipeline size,
    first/last_stage_layers --decoder-first/last-pipeline-num-layers, R = --global-batch-size /
    (--micro-batch-size x attention members), members = groups x attention ranks / (attention_tp x
    attention_cp) (Megatron's data-parallel size); N defaults to --expert-model-parallel-size (the
    run replaces it by the plan's placement)."""
    out = {"tp": args.attention_tp, "cp": args.attention_cp, "pp": args.pipeline_stages, "V": args.virtual_stages,
           "R": args.microbatches, "N": args.expert_ranks, "first": None, "last": None, "notes": []}
    if run is not None:
        _agree("--attention-tp", args.attention_tp, "--tensor-model-parallel-size", run.tensor_model_parallel_size)
        _agree("--attention-cp", args.attention_cp, "--context-parallel-size", run.context_parallel_size)
        _agree("--pipeline-stages", args.pipeline_stages, "--pipeline-model-parallel-size",
               run.pipeline_model_parallel_size)
        _agree("--virtual-stages", args.virtual_stages, "virtual pipeline size (--num-virtual-stages-per-pipeline-rank"
               " / --num-layers-per-virtual-pipeline-stage)", run.virtual_stages)
        out.update(tp=run.tensor_model_parallel_size, cp=run.context_parallel_size, pp=run.pipeline_model_parallel_size,
                   V=run.virtual_stages, first=run.first_stage_layers, last=run.last_stage_layers)
        ep = run.expert_model_parallel_size
        if args.expert_ranks is None and "--expert-model-parallel-size" in run.given:
            out["N"] = ep
        elif args.expert_ranks is not None and ep != 1 and ep != args.expert_ranks:
            out["notes"].append(f"--expert-model-parallel-size {ep}: the plan's placement wins (as in the run): "
                                f"{model.num_experts} experts a layer over --expert-ranks {args.expert_ranks}")
        member = out["tp"] * out["cp"]  # ranks of one attention member
        if args.attention_ranks is not None and member >= 1 and args.attention_ranks % member == 0:
            members = args.groups * args.attention_ranks // member
            mbs = run.micro_batch_size
            gbs = run.global_batch_size if run.global_batch_size is not None else mbs * members
            cp_note = f" x CP {out['cp']}" if out["cp"] > 1 else ""
            if gbs % (mbs * members):
                raise ValueError(f"the run's --global-batch-size {gbs} is not a multiple of --micro-batch-size {mbs} x "
                                 f"{members} attention members (--groups {args.groups} x --attention-ranks "
                                 f"{args.attention_ranks} / (TP {out['tp']}{cp_note}): Megatron's data-parallel "
                                 f"size); pass "
                                 f"--global-batch-size {max(1, gbs // (mbs * members)) * mbs * members} after --, or "
                                 f"change --attention-ranks / --groups")
            _agree("--microbatches", args.microbatches, "--global-batch-size / (--micro-batch-size x attention "
                   "members)", gbs // (mbs * members))
            out["R"] = gbs // (mbs * members)
        if out["tp"] > 1 and not run.sequence_parallel:
            out["notes"].append(f"--tensor-model-parallel-size {out['tp']} without --sequence-parallel: the run "
                                f"refuses it (Megatron's rule for MoE with TP); add --sequence-parallel")
    for key, default in (("tp", 1), ("cp", 1), ("pp", 1), ("V", 1), ("R", 1)):
        if out[key] is None:
            out[key] = default
    return out


def _print_placed(placed: LoadPlacement, load: ExpertLoad, speeds: ExpertSpeeds, out) -> None:
    print(f"measured expert loads: {describe_skew(load)}; {speeds.describe()}", file=out)
    print(f"{'placement under the measured loads':<40}{'step (s)':>10}{'tokens/s':>12}", file=out)
    for name, t in (("uniform (this layout's even placement)", placed.uniform_step_s),
                    ("load-aware", placed.load_aware_step_s)):
        print(f"{name:<40}{t:>10.3f}{placed.tokens_per_step / t:>12.0f}", file=out)
    for line in load_lines({**placed.to_dict(), "same_shape_as_pick": True}):
        print(line, file=out)


def run_flags_note(plan, global_batch: int, model: ModelConfig) -> str:
    """The Megatron-LM flags a run of `plan` takes for its layout and batch (what the run checks
    against the plan: training/validation.py)."""
    members = plan.num_attention_members
    mbs = global_batch // (members * plan.num_microbatches)
    flags = [f"--tensor-model-parallel-size {plan.attention_tp}"]
    if plan.attention_tp > 1:
        flags.append("--sequence-parallel")
    if plan.attention_cp > 1:  # Megatron's default is 1: named only where the plan differs
        flags.append(f"--context-parallel-size {plan.attention_cp}")
    flags += [f"--pipeline-model-parallel-size {plan.pipeline_stages}", f"--micro-batch-size {mbs}",
              f"--global-batch-size {global_batch}"]
    return "train it with: " + " ".join(flags) + f" --hetero-plan PLAN (schedule {plan.schedule})"


def search_settings(args: argparse.Namespace, run: RunFlags | None) -> dict:
    """search()'s keyword arguments (and "notes") from hetermoe plan's flags and the run's: without
    the run's flags the paper's program (activation recompute); with them, the run's recomputation
    (full: zebra's per-stage recompute, the pick zebra, which is what the runtime runs with it;
    selective modules; --moe-layer-recompute: the experts keep their inputs, 'keep-inputs'), its
    --use-distributed-optimizer, and the layout values the run's flags give (TP, PP, micro batch)
    fix what the search tries (--context-parallel-size: attention_cp, as --tensor-model-parallel-size
    fixes attention_tp); values the flags leave to Megatron's defaults stay the search's."""
    tp = None if args.attention_tp is None else (args.attention_tp,)
    cp = None if args.attention_cp is None else (args.attention_cp,)
    pp = None if args.pipeline_stages is None else (args.pipeline_stages,)
    kw = {"expert_recompute": args.expert_recompute, "distributed_optimizer": args.distributed_optimizer,
          "notes": []}
    if run is None:
        return {**kw, "attention_tp": tp, "attention_cp": cp, "pipeline_stages": pp}
    if run.virtual_stages > 1:
        raise ValueError(f"the run's virtual pipeline size {run.virtual_stages} (after --): the search does not price "
                         f"virtual stages; make an even plan (--even), or drop the virtual-stage flag")
    if run.first_stage_layers is not None or run.last_stage_layers is not None:
        raise ValueError("the run's --decoder-first/last-pipeline-num-layers (after --): the search prices Megatron's "
                         "even pipeline split only; make an even plan (--even), which takes the split")
    given = run.given
    if "--tensor-model-parallel-size" in given:
        _agree("--attention-tp", args.attention_tp, "--tensor-model-parallel-size", run.tensor_model_parallel_size)
        tp = (run.tensor_model_parallel_size,)
    if "--context-parallel-size" in given:
        _agree("--attention-cp", args.attention_cp, "--context-parallel-size", run.context_parallel_size)
        cp = (run.context_parallel_size,)
    if "--pipeline-model-parallel-size" in given:
        _agree("--pipeline-stages", args.pipeline_stages, "--pipeline-model-parallel-size",
               run.pipeline_model_parallel_size)
        pp = (run.pipeline_model_parallel_size,)
    for flag, v, ok in (("--tensor-model-parallel-size", tp, ATTENTION_TP),
                        ("--context-parallel-size", cp if "--context-parallel-size" in given else None, ATTENTION_CP),
                        ("--pipeline-model-parallel-size", pp, PIPELINE_STAGES)):
        if v is not None and v[0] not in ok:  # --attention-cp alone is checked by main, under its own name
            raise ValueError(f"{flag} {v[0]}: the search tries {list(ok)}")
    rec = run.recompute
    if rec.moe_layer:
        if args.expert_recompute not in ("auto", "keep-inputs"):
            raise ValueError(f"--expert-recompute {args.expert_recompute} and the run's MoE-layer recomputation (the "
                             f"runtime's experts keep their inputs and recompute: 'keep-inputs') disagree; drop one")
        kw["expert_recompute"] = "keep-inputs"
        kw["notes"].append("MoE-layer recomputation: priced as expert recompute 'keep-inputs', what the runtime runs "
                           "(the experts keep their inputs and recompute their forward; the dispatch is not replayed)")
    kw.update(attention_tp=tp, attention_cp=cp, pipeline_stages=pp, activation_checkpointing=rec.full,
              recompute_modules=frozenset(rec.selective) & frozenset(SELECTIVE_PRICED),
              distributed_optimizer=args.distributed_optimizer or run.distributed_optimizer,
              micro_batch_size=run.micro_batch_size if "--micro-batch-size" in given else None)
    if rec.full:
        kw["pick_schedules"] = ("zebra",)  # DistEP refuses full recomputation (megatron_lm/replaced.py)
        kw["notes"].append(f"{rec.describe()}: priced as zebra's per-stage recompute; the pick is zebra (DistEP "
                           f"refuses --recompute-granularity full)")
    else:
        kw["notes"].append(f"the run's flags ask for {rec.describe()}: priced so (zebra keeps every microbatch's "
                           f"activations without recompute; --recompute-granularity full prices its per-stage "
                           f"recompute)")
    return kw


def read_loads(args: argparse.Namespace, model: ModelConfig, cost: CostModel) -> tuple[ExpertLoad, ExpertSpeeds]:
    """--expert-load's histogram (checked against the model) and the expert speeds: measured with
    --expert-load-plan, else the GPU profiles'."""
    if args.expert_load_intervals is not None and args.expert_load_intervals < 1:
        raise ValueError(f"--expert-load-intervals {args.expert_load_intervals} must be >= 1")
    load = load_expert_load(args.expert_load, args.expert_load_intervals)
    load.check(model.planned_num_moe_layers, model.num_experts, f"--expert-load {args.expert_load}")
    if args.expert_load_plan is None:
        stats = LoadStats.load_file(args.expert_load)
        if any(any(k[0] in "XE" for k in s) for s in stats.task_seconds):
            print("hetermoe plan: note: the stats file has the measured run's expert task seconds; give "
                  "--expert-load-plan (the plan that run trained on) to price experts at their measured speeds",
                  file=sys.stderr)
        return load, ExpertSpeeds()
    speeds = measured_speeds(LoadStats.load_file(args.expert_load), HeteroPlan.load(args.expert_load_plan), cost,
                             args.expert_load_intervals)
    return load, speeds


def _load_cost(model: ModelConfig, gpu_types: list[str], seq_len: int, run: RunFlags | None,
               distributed_optimizer: bool, expert_recompute: str | None = None) -> CostModel:
    """The cost model a plan is priced with under loads: the paper's program (activation recompute)
    or the run's recomputation and optimizer (as search_settings prices them)."""
    rec = run.recompute if run is not None else None
    settings = TrainSettings(seq_len, activation_checkpointing=rec.full if rec else True,
                             expert_recompute=expert_recompute,
                             distributed_optimizer=distributed_optimizer or bool(run and run.distributed_optimizer),
                             recompute_modules=frozenset(rec.selective) & frozenset(SELECTIVE_PRICED) if rec
                             else frozenset())
    return CostModel(model.replace(seq_length=seq_len), load_profiles(set(gpu_types)), settings)


def main(argv: list[str] | None = None) -> int:
    own, flags = _split_flags(list(sys.argv[1:] if argv is None else argv))
    parser = _parser()
    args = parser.parse_args(own)
    given = [d for d in parser.even_only if getattr(args, d) != parser.get_default(d)]
    if given and not args.even:
        names = ", ".join("--" + d.replace("_", "-") for d in given)
        print(f"hetermoe plan: {names}: only with --even (a search, --cluster, chooses the layout itself); add "
              f"--even, or drop {names}", file=sys.stderr)
        return 2
    loose = [f for f, v in (("--expert-load-intervals", args.expert_load_intervals),
                            ("--expert-load-plan", args.expert_load_plan)) if v is not None]
    if loose and not args.expert_load:
        print(f"hetermoe plan: {', '.join(loose)}: only with --expert-load STATS (the measured loads they read)",
              file=sys.stderr)
        return 2
    try:
        model, run = _model(args, flags)
    except (FileNotFoundError, ValueError) as e:
        print(f"hetermoe plan: {e}", file=sys.stderr)
        return 2
    try:
        if args.even:
            lay = even_layout(args, model, run)
            args.expert_ranks = lay["N"]
            if args.attention_ranks is None or args.expert_ranks is None:
                print("hetermoe plan: --even needs --attention-ranks and --expert-ranks (or, after --, the run's "
                      "--expert-model-parallel-size)", file=sys.stderr)
                return 2
            for note in lay["notes"]:
                print(f"hetermoe plan: note: {note}", file=sys.stderr)
            world = args.groups * (args.attention_ranks + args.expert_ranks)
            if world > MAX_RANKS:  # named by its flags here; even_plan would only say "world size"
                print(f"hetermoe plan: --groups {args.groups} x (--attention-ranks {args.attention_ranks} + "
                      f"--expert-ranks {args.expert_ranks}) = {world} ranks is above {MAX_RANKS}, more than any "
                      f"cluster could hold (megatron_hetermoe/limits.py)", file=sys.stderr)
                return 2
            known = known_gpu_types()
            for flag, t in (("--attention-gpu", args.attention_gpu), ("--expert-gpu", args.expert_gpu)):
                if t not in known:
                    print(f"hetermoe plan: {flag} {t!r} is not a known GPU type; use one of {known}", file=sys.stderr)
                    return 2
            if run is not None and run.recompute.full and args.schedule != ScheduleName.ZEBRA:
                print("hetermoe plan: note: the run's --recompute-granularity full runs under zebra only (DistEP "
                      "would replay the dispatch); train with --hetero-schedule zebra, or plan --schedule zebra",
                      file=sys.stderr)
            # MTP layers come after the decoder's, of its last layer's kind (layer_pattern.model_dense_layers)
            mtp, dense = model.mtp_num_layers or 0, model.planned_dense_layers
            tp, cp, pp = lay["tp"], lay["cp"], lay["pp"]
            if tp < 1 or model.num_attention_heads % tp or model.query_groups % tp:
                print(f"hetermoe plan: attention TP {tp} (--attention-tp, or the run's --tensor-model-parallel-size) "
                      f"must be a positive divisor of the model's {model.num_attention_heads} attention heads and "
                      f"{model.query_groups} query groups", file=sys.stderr)
                return 2
            if cp < 1 or (cp > 1 and args.seq_len is not None and args.seq_len % (2 * cp)):
                print(f"hetermoe plan: attention CP {cp} (--attention-cp, or the run's --context-parallel-size) must "
                      f"be a positive integer with 2 x CP dividing the sequence length {args.seq_len} (Megatron's "
                      f"load-balanced split: each CP rank holds 2 of 2 x CP chunks)", file=sys.stderr)
                return 2
            plan = even_plan(model.planned_num_moe_layers, model.num_experts, args.attention_ranks,
                             args.expert_ranks, args.groups, attention_gpu=args.attention_gpu,
                             expert_gpu=args.expert_gpu, num_microbatches=lay["R"], schedule=args.schedule,
                             dense_layers=dense, mtp_layers=mtp, attention_tp=tp, attention_cp=cp,
                             pipeline_stages=pp, zebra_waves=args.zebra_waves,
                             zebra_wave_order=args.zebra_wave_order, virtual_stages=lay["V"],
                             first_stage_layers=lay["first"], last_stage_layers=lay["last"])
            plan.meta = {"model": model.name, "made_by": "hetermoe plan --even"}
            if flags is not None:  # where the model came from, for whoever reads the plan
                plan.meta["model_flags"] = flags
            placed = None
            if args.expert_load:
                if args.seq_len is None or args.global_batch is None:
                    print("hetermoe plan: --expert-load with --even prices the loads, which needs --seq-len and "
                          "--global-batch (or the run's --seq-length and --global-batch-size after --)",
                          file=sys.stderr)
                    return 2
                cost = _load_cost(model, plan.gpu_types, args.seq_len, run, args.distributed_optimizer,
                                  plan.expert_recompute)
                load, speeds = read_loads(args, model, cost)
                cluster = Cluster.from_gpu_types("even plan", plan.gpu_types)
                placed = place_for_load(plan, cost, cluster, args.global_batch, load, speeds, args.engine)
                plan = placed.plan
                plan.meta["expert_load"] = {**placed.to_dict(), "stats": args.expert_load}
            if placed is not None:  # the plan JSON may go to stdout: the comparison goes to stderr then
                _print_placed(placed, load, speeds, sys.stdout if args.output else sys.stderr)
            if args.output:
                plan.save(args.output)
                tp_note = (f", attention_tp {tp}" if tp > 1 else "") + (f", attention_cp {cp}" if cp > 1 else "")
                stages = f"{pp} stages of " if pp > 1 else ""
                print(f"wrote {args.output}: {args.groups} x {stages}({args.attention_ranks} attention + "
                      f"{args.expert_ranks} expert ranks), world size {plan.world_size}{tp_note}")
            else:
                print(plan.to_json())
            return 0
        settings = search_settings(args, run)
        missing = [f for f, v in (("--cluster", args.cluster), ("--seq-len", args.seq_len),
                                  ("--global-batch", args.global_batch)) if v is None]
        if missing:
            print(f"hetermoe plan: search mode needs {', '.join(missing)} (or use --even)", file=sys.stderr)
            return 2
        if args.max_microbatches < 1:
            print(f"hetermoe plan: --max-microbatches {args.max_microbatches} must be >= 1", file=sys.stderr)
            return 2
        if args.seq_len < 1 or args.global_batch < 1:
            print(f"hetermoe plan: --seq-len {args.seq_len} and --global-batch {args.global_batch} must be >= 1",
                  file=sys.stderr)
            return 2
        for flag, v, most in (("--seq-len", args.seq_len, MODEL_LIMITS["seq_length"]),
                              ("--global-batch", args.global_batch, MAX_GLOBAL_BATCH),
                              ("--max-microbatches", args.max_microbatches, MAX_MICROBATCHES)):
            if v > most:
                print(f"hetermoe plan: {flag} {v} is above {most}, more than any cluster could hold "
                      f"(megatron_hetermoe/limits.py)", file=sys.stderr)
                return 2
        if args.attention_tp is not None and args.attention_tp not in ATTENTION_TP:
            print(f"hetermoe plan: --attention-tp {args.attention_tp}: the search tries {list(ATTENTION_TP)}",
                  file=sys.stderr)
            return 2
        if args.attention_cp is not None and args.attention_cp not in ATTENTION_CP:
            print(f"hetermoe plan: --attention-cp {args.attention_cp}: the search tries {list(ATTENTION_CP)}",
                  file=sys.stderr)
            return 2
        if args.pipeline_stages is not None and args.pipeline_stages not in PIPELINE_STAGES:
            print(f"hetermoe plan: --pipeline-stages {args.pipeline_stages}: the search tries {list(PIPELINE_STAGES)}",
                  file=sys.stderr)
            return 2
        cluster = Cluster.load(args.cluster)
        for note in settings.pop("notes"):
            print(f"hetermoe plan: note: {note}", file=sys.stderr)
        load = speeds = None
        if args.expert_load:
            cost = _load_cost(model, cluster.gpu_types(), args.seq_len, run, args.distributed_optimizer)
            load, speeds = read_loads(args, model, cost)
            print(f"measured expert loads ({args.expert_load}): {describe_skew(load)}; {speeds.describe()}",
                  file=sys.stderr if args.json else sys.stdout)
        res = search(model, cluster, args.seq_len, args.global_batch, asym=args.asym, engine=args.engine,
                     max_microbatches=args.max_microbatches, expert_load=load, expert_speeds=speeds, **settings)
    except (PlanError, FileNotFoundError, ValueError, KeyError) as e:
        print(f"hetermoe plan: {e}", file=sys.stderr)
        return 2
    if args.json:
        out = {"model": model.name, "cluster": cluster.name, "seq_len": args.seq_len, "global_batch": args.global_batch,
               "strategies": {p.name: {"step_time_s": _finite(p.step_time_s), "tokens_per_s": p.tokens_per_s,
                                       "utilization": p.utilization, "ratio_to_limit": p.ratio_to_limit,
                                       "fits": p.fits, "detail": p.detail} for p in res.predictions},
               "search": {"candidates": res.candidates, "elapsed_s": res.elapsed_s},
               "plan_file": args.output}
        if res.expert_load is not None:
            out["expert_load"] = res.expert_load
        print(json.dumps(out, indent=1, default=str))
    else:
        print(format_table(res, f"{model.name} on {cluster.name}, seq {args.seq_len}, "
                                f"global batch {args.global_batch}"))
    if res.plan is None:
        print("hetermoe plan: no HeterMoE plan fits this cluster and batch; see the table", file=sys.stderr)
        return 1
    if flags is not None:  # where the model came from, for whoever reads the plan
        res.plan.meta["model_flags"] = flags
    if not args.json:
        print(run_flags_note(res.plan, args.global_batch, model))
    if args.output:
        res.plan.save(args.output)
        if not args.json:
            print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
