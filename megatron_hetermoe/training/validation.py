"""Every input of a training job checked in one place, before any process group exists.

`validate_job(cfg, world_size, plan)` runs in the launching process (hetermoe train calls it
before forking ranks or joining torchrun's group), so a bad flag, model, plan or layout is
refused with one message naming the flag/field, the bad value and the fix, instead of a
traceback from inside megatron-core on every rank. Plan, model config, cluster and GPU profile
files have their own errors (PlanError, ModelConfigError, ClusterError, ProfileError), raised
when they are loaded; docs/reliability.md lists them all.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from megatron_hetermoe.errors import UserError
from megatron_hetermoe.limits import MAX_GLOBAL_BATCH
from megatron_hetermoe.plan.hetero_plan import HeteroPlan, PlanError
from megatron_hetermoe.plan.tasks import SCHEDULES
from megatron_hetermoe.vocabulary import Role, ScheduleName

if TYPE_CHECKING:
    from megatron_hetermoe.config import HeteroRunConfig, TrainConfig


class ConfigError(UserError, ValueError):
    """A training flag or layout that cannot run; names the flag, the value and the fix."""


# TrainConfig field -> the Megatron flag a user sets it with.
FLAGS = {
    "micro_batch_size": "--micro-batch-size", "global_batch_size": "--global-batch-size",
    "train_iters": "--train-iters", "lr": "--lr", "min_lr": "--min-lr", "lr_warmup_iters": "--lr-warmup-iters",
    "weight_decay": "--weight-decay", "clip_grad": "--clip-grad", "seed": "--seed", "log_interval": "--log-interval",
    "check_for_nan_in_loss_and_grad": "--check-for-nan-in-loss-and-grad",
    "save_interval": "--save-interval", "ckpt_step": "--ckpt-step",
    "bf16": "--bf16", "fp16": "--fp16", "loss_scale": "--loss-scale", "initial_loss_scale": "--initial-loss-scale",
    "min_loss_scale": "--min-loss-scale", "loss_scale_window": "--loss-scale-window", "hysteresis": "--hysteresis",
    "tp": "--tensor-model-parallel-size", "pp": "--pipeline-model-parallel-size", "ep": "--expert-model-parallel-size",
    "sequence_parallel": "--sequence-parallel", "cp": "--context-parallel-size",
}
SEED_LIMIT = 2**32  # data and init generators take seed * 1_000_003 + index: keep it in int64


def _bad(field: str, value, rule: str, fix: str) -> ConfigError:
    return ConfigError(f"{FLAGS.get(field, field)} {value!r}: {rule}; {fix}")


def _int(cfg, field: str, low: int) -> int:
    v = getattr(cfg, field)
    if type(v) is not int or v < low:
        raise _bad(field, v, f"must be an integer >= {low}", f"pass {FLAGS[field]} {max(low, 1)} or more")
    return v


def _real(cfg, field: str) -> float:
    v = getattr(cfg, field)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise _bad(field, v, "must be a finite number >= 0", f"pass e.g. {FLAGS[field]} 0.01")
    return float(v)


def check_plugin_model(m) -> None:
    """The plugin's own trainers build every layer as an MoE layer without shared experts
    (models/builder.py's Mixtral-style model); a model config with dense layers or shared experts
    trains through Megatron-LM's pretrain_gpt.py, which builds them (and can be planned for)."""
    what = m.beyond_every_layer_moe
    if what:
        raise ConfigError(f"model {m.name!r} has {' and '.join(what)}: the plugin's own trainer builds every layer "
                          f"as an MoE layer without shared experts; train it with Megatron-LM's pretrain_gpt.py and "
                          f"--hetero-plan (docs/megatron-lm.md), or use a model without them")


def check_train_config(cfg: "TrainConfig") -> None:
    """The flags every trainer reads (no layout)."""
    from megatron_hetermoe.training.nan_check import NAN_MODES

    check_plugin_model(cfg.model)
    for name, low in (("micro_batch_size", 1), ("global_batch_size", 1), ("train_iters", 0),
                      ("lr_warmup_iters", 0), ("log_interval", 1)):
        _int(cfg, name, low)
    for name in ("micro_batch_size", "global_batch_size"):  # a typo (1e15) must fail here, not loop per microbatch
        if getattr(cfg, name) > MAX_GLOBAL_BATCH:
            raise _bad(name, getattr(cfg, name), f"is above {MAX_GLOBAL_BATCH} sequences per step, more than any "
                       f"cluster could hold (megatron_hetermoe/limits.py)", "check the value")
    # megatron-core's OptimizerParamScheduler asserts lr_warmup_steps < lr_decay_steps (the
    # trainers pass max(--train-iters, 1)) on every rank, after the ranks started.
    decay = max(cfg.train_iters, 1)
    if cfg.lr_warmup_iters and cfg.lr_warmup_iters >= decay:
        raise _bad("lr_warmup_iters", cfg.lr_warmup_iters, f"must be below --train-iters {cfg.train_iters} "
                   f"(warm-up, then cosine decay)", f"pass --lr-warmup-iters at most {decay - 1}")
    lr, min_lr = _real(cfg, "lr"), _real(cfg, "min_lr")
    if min_lr > lr:
        raise _bad("min_lr", cfg.min_lr, f"is above --lr {cfg.lr}", f"pass --min-lr at most {cfg.lr}")
    _real(cfg, "weight_decay")
    _real(cfg, "clip_grad")
    if type(cfg.seed) is not int or not 0 <= cfg.seed < SEED_LIMIT:
        raise _bad("seed", cfg.seed, f"must be an integer in [0, {SEED_LIMIT})", "pass e.g. --seed 1234")
    if cfg.check_for_nan_in_loss_and_grad not in NAN_MODES:
        raise _bad("check_for_nan_in_loss_and_grad", cfg.check_for_nan_in_loss_and_grad,
                   f"must be one of {list(NAN_MODES)}", "pass stop or skip, or --no-check-for-nan-in-loss-and-grad")
    for name, low in (("save_interval", 1), ("ckpt_step", 0)):
        if getattr(cfg, name, None) is not None:
            _int(cfg, name, low)
    check_precision(cfg)


def _positive(cfg, field: str, example: str) -> None:
    v = getattr(cfg, field)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise _bad(field, v, "must be a finite number > 0", f"pass e.g. {FLAGS[field]} {example}")


def check_precision(cfg: "TrainConfig") -> None:
    """--bf16/--fp16 and Megatron's loss-scale flags."""
    for name in ("bf16", "fp16"):
        if type(getattr(cfg, name)) is not bool:
            raise _bad(name, getattr(cfg, name), "must be true or false", f"pass {FLAGS[name]} or leave it out")
    if cfg.bf16 and cfg.fp16:
        raise ConfigError("--bf16 and --fp16 together: pick one precision (Megatron-LM refuses both too)")
    if cfg.loss_scale is not None:
        _positive(cfg, "loss_scale", "4096")
        if cfg.precision == "fp32":
            raise _bad("loss_scale", cfg.loss_scale, "scales the loss of --fp16/--bf16 runs only (fp32 has none)",
                       "drop --loss-scale, or add --fp16 or --bf16")
    if cfg.fp16 and cfg.loss_scale is None:  # Megatron's DynamicGradScaler asserts these on every rank
        _positive(cfg, "initial_loss_scale", "65536")
        _positive(cfg, "min_loss_scale", "1")
        if cfg.min_loss_scale > cfg.initial_loss_scale:
            raise _bad("min_loss_scale", cfg.min_loss_scale, f"is above --initial-loss-scale {cfg.initial_loss_scale}",
                       f"pass --min-loss-scale at most {cfg.initial_loss_scale}")
        _positive(cfg, "loss_scale_window", "1000")
        if type(cfg.hysteresis) is not int or cfg.hysteresis < 1:
            raise _bad("hysteresis", cfg.hysteresis, "must be an integer >= 1", "pass e.g. --hysteresis 2")
    if cfg.precision != "fp32" and cfg.ckpt_reshard:
        raise ConfigError(f"--hetero-ckpt-reshard with --{cfg.precision}: resharding by name moves fp32 parameters "
                          f"and Adam moments, but a {cfg.precision} run's fp32 master weights sit in Megatron's "
                          f"mixed-precision optimizer state, not read by name yet; resume on the layout (plan) it "
                          f"was saved with, without --hetero-ckpt-reshard")
    if cfg.precision != "fp32" and cfg.emulate is not None:
        raise ConfigError(f"--{cfg.precision} with --emulate: emulated runs time fp32 work on CPU ranks (the "
                          f"emulated cluster is priced by the cost model); drop --{cfg.precision}")


def check_pools(pools, plan, what: str = "the plan") -> None:
    """Pools that differ are both 16-bit, and bf16 runs only on GPU types with native bf16, per
    pool (what: how errors name the plan)."""
    if not pools.mixed:
        check_bf16_gpus(pools.attention == "bf16", plan.gpu_types, what)
        return
    if "fp32" in (pools.attention, pools.expert):
        flag = {"bf16": "--bf16", "fp16": "--fp16", "fp32": "no precision flag"}[pools.attention]
        raise ConfigError(
            f"--hetero-expert-precision {pools.expert} with {flag} (attention ranks {pools.attention}): pools of "
            f"different precision must both be 16-bit (an fp16 pool's gradients carry a loss scale that "
            f"Megatron's fp32 optimizer does not take out); use bf16 or fp16 on both pools, or one precision "
            f"everywhere")
    for role, ranks in (("attention", plan.attention_ranks), ("expert", plan.expert_ranks)):
        if pools.of(role) == "bf16":
            check_bf16_gpus(True, [plan.gpu_types[r] for r in ranks], f"{what}'s {role} pool", list(ranks),
                            "--bf16" if role == Role.ATTENTION else "--hetero-expert-precision bf16")


def check_bf16_gpus(bf16: bool, gpu_types: list[str], what: str, ranks: list[int] | None = None,
                    flag: str = "--bf16") -> None:
    """bf16 (`flag`) on GPU types whose profile says bf16: false (no native bf16: V100, T4).
    `ranks`: the ranks of gpu_types (default 0, 1, ...)."""
    if not bf16:
        return
    from megatron_hetermoe.planner.profiles import load_profile

    bad: dict[str, list[int]] = {}
    for r, t in zip(ranks if ranks is not None else range(len(gpu_types)), gpu_types):
        if t.lower() != "cpu" and not load_profile(t).bf16:
            bad.setdefault(t, []).append(r)
    if bad:
        where = "; ".join(f"{t} (ranks {rs})" for t, rs in bad.items())
        fix = "use --fp16" if flag == "--bf16" else "use --hetero-expert-precision fp16"
        raise ConfigError(f"{flag}: {what} has GPU type(s) without native bf16 (profile bf16: false): {where}; "
                          f"{fix}")


def check_megatron_layout(cfg: "TrainConfig", world: int) -> None:
    """What parallel_state.initialize_model_parallel and MoELayer would assert on every rank."""
    par, m = cfg.parallel, cfg.model
    for name in ("tp", "pp", "ep"):
        v = getattr(par, name)
        if type(v) is not int or v < 1:
            raise _bad(name, v, "must be an integer >= 1", f"pass {FLAGS[name]} 1 or more")
    if par.cp != 1:
        raise _bad("cp", par.cp, "the Megatron EP trainer runs without context parallelism (megatron-core's "
                   "local attention refuses it; transformer-engine's needs GPUs)",
                   "pass --context-parallel-size 1, or train with --hetero-plan and a plan of that attention_cp")
    if world % (par.tp * par.pp):
        raise ConfigError(f"world size {world} is not divisible by TP {par.tp} x PP {par.pp}; launch a multiple "
                          f"of {par.tp * par.pp} ranks (--nproc) or change --pipeline-model-parallel-size")
    if world % (par.ep * par.pp):
        raise ConfigError(f"world size {world} is not divisible by EP {par.ep} x PP {par.pp} (Megatron's expert "
                          f"layout); launch a multiple of {par.ep * par.pp} ranks or change "
                          f"--expert-model-parallel-size")
    if m.num_experts % par.ep:
        raise _bad("ep", par.ep, f"does not divide num_experts={m.num_experts} of model {m.name!r}",
                   "pick an expert-parallel size that divides the expert count")
    if m.num_layers % par.pp:
        raise _bad("pp", par.pp, f"does not divide num_layers={m.num_layers} of model {m.name!r}",
                   "pick a pipeline size that divides the layer count")
    check_megatron_tp(cfg)
    dp = world // (par.tp * par.pp)
    per = cfg.micro_batch_size * dp
    if cfg.global_batch_size % per:
        raise _bad("global_batch_size", cfg.global_batch_size,
                   f"is not divisible by --micro-batch-size {cfg.micro_batch_size} x data-parallel size {dp}",
                   f"pass a multiple of {per}")
    from megatron_hetermoe.models.builder import transformer_config

    try:  # megatron-core's own config checks, run here with no process group
        transformer_config(m, par, cfg.precision)
    except (ValueError, AssertionError) as e:
        raise ConfigError(f"megatron-core refuses model {m.name!r} with TP={par.tp} PP={par.pp} EP={par.ep}: "
                          f"{e}") from None


def check_megatron_tp(cfg: "TrainConfig") -> None:
    """TP > 1 in the plugin's trainers (with --sequence-parallel: ParallelConfig requires it):
    what megatron-core asserts on every rank (heads, vocab and sequence split over the TP group),
    and what they do not do under TP yet (their checkpoints by canonical name, emulation; inside
    Megatron-LM's pretrain() TP runs save and resume torch_dist)."""
    par, m = cfg.parallel, cfg.model
    if par.tp == 1:
        return
    for what, n in (("num_attention_heads", m.num_attention_heads), ("vocab_size", m.vocab_size),
                    ("seq_length", m.seq_length)):
        if n % par.tp:
            raise _bad("tp", par.tp, f"does not divide {what}={n} of model {m.name!r} (Megatron splits it over the "
                       f"TP group{' with --sequence-parallel' if what == 'seq_length' else ''})",
                       "pick a tensor-parallel size that divides it")
    for flag, given in (("--save", cfg.save), ("--load", cfg.load), ("--emulate", cfg.emulate)):
        if given is not None:
            raise _bad("tp", par.tp, f"with {flag}: not supported under tensor parallelism yet",
                       f"drop {flag}, or use --tensor-model-parallel-size 1")


def check_issuer(issuer: str, emulated: bool) -> None:
    """--hetero-zebra-issuer against the run: an emulated cluster needs the threaded issuer."""
    if issuer == "single" and emulated:
        raise ConfigError("--hetero-zebra-issuer single cannot emulate a cluster (emulated transfers sleep in their "
                          "stream's thread); drop --hetero-zebra-issuer or pass threads")


def check_plan_model(plan: HeteroPlan, num_layers: int, num_experts: int, moe_layer_freq: int | str | list[int],
                     model: str, remake: str, mtp_num_layers: int | None = None) -> None:
    """PlanError unless the plan is for this model: its layers (`num_layers` decoder layers, then
    `mtp_num_layers` MTP layers), which of them are dense (Megatron's --moe-layer-freq) and its
    experts (`model` names it; `remake`: the fix)."""
    from megatron_hetermoe.layer_pattern import model_dense_layers

    dense = model_dense_layers(moe_layer_freq, num_layers, mtp_num_layers)
    mtp = mtp_num_layers or 0
    have = (plan.decoder_layers, plan.mtp_layers, sorted(plan.dense_layers), plan.num_experts)
    if have != (num_layers, mtp, dense, num_experts):
        def shape(layers: int, m: int, d: list[int], experts: int) -> str:
            return (f"{layers} layers{f' + {m} MTP layers' if m else ''}{f' (dense: {d})' if d else ''} "
                    f"x {experts} experts")
        raise PlanError(f"plan is for {shape(*have)} but {model} has {shape(num_layers, mtp, dense, num_experts)}; "
                        f"{remake}")


def check_plan_for_job(plan: HeteroPlan, world: int, num_layers: int, num_experts: int, micro_batch_size: int,
                       global_batch_size: int, pools, model: str, remake: str, what: str = "the plan",
                       moe_layer_freq: int | str | list[int] = 1, mtp_num_layers: int | None = None) -> None:
    """The plan against a job, the same check for both hostings (the plugin's trainer and
    Megatron-LM's pretrain()): its ranks and GPU types, the model's layers, which of them are
    dense (`moe_layer_freq`, Megatron's --moe-layer-freq) and its experts (`model` names it;
    `remake`: how to make a plan for it), the batch (R microbatches of
    `micro_batch_size` per attention rank; the full batch under Megatron's ramp-up), and each
    pool's precision on its GPU types (`pools`, a config.PoolPrecision; `what` names the plan)."""
    from megatron_hetermoe.planner.profiles import known_gpu_types

    plan.validate(world_size=world, known_gpu_types=known_gpu_types())
    check_pools(pools, plan, what)
    check_plan_model(plan, num_layers, num_experts, moe_layer_freq, model, remake, mtp_num_layers)
    n_attn = plan.num_attention_members
    want = micro_batch_size * plan.num_microbatches * n_attn
    what_dp = (f"{n_attn} attention ranks" if plan.member_size == plan.pipeline_stages == 1 else
               f"{n_attn} attention members (attention ranks / (attention_tp {plan.attention_tp} x attention_cp "
               f"{plan.attention_cp} x pipeline_stages {plan.pipeline_stages}))")
    if global_batch_size != want:
        raise ConfigError(f"--global-batch-size {global_batch_size}: must be --micro-batch-size {micro_batch_size} x "
                          f"the plan's R={plan.num_microbatches} microbatches x {what_dp}; pass "
                          f"--global-batch-size {want}, or remake the plan with another --microbatches")


def check_hetero_tp(plan: HeteroPlan, tp: int, sequence_parallel: bool, expert_tp: int | None = 1,
                    cp: int = 1) -> None:
    """Tensor and context parallelism of a HeterMoE job, the same rule for both hostings: the
    attention members' TP size is the plan's attention_tp, with sequence parallelism (Megatron's
    rule for MoE with TP: every TP rank routes its own sequence slice), and their CP size (`cp`,
    Megatron's --context-parallel-size) the plan's attention_cp; experts are not tensor-parallel."""
    if cp != plan.attention_cp:
        raise ConfigError(f"--context-parallel-size {cp}: the plan's attention members are context-parallel over "
                          f"attention_cp={plan.attention_cp} ranks; pass --context-parallel-size "
                          f"{plan.attention_cp}, or remake the plan with attention_cp {cp}")
    if tp != plan.attention_tp:
        raise ConfigError(f"--tensor-model-parallel-size {tp}: the plan's attention members are tensor-parallel over "
                          f"attention_tp={plan.attention_tp} ranks; pass --tensor-model-parallel-size "
                          f"{plan.attention_tp}, or remake the plan with attention_tp {tp}")
    if tp > 1 and not sequence_parallel:
        raise ConfigError(f"--tensor-model-parallel-size {tp} without --sequence-parallel: with MoE and tensor "
                          f"parallelism Megatron needs sequence parallelism (each TP rank routes its own sequence "
                          f"slice); add --sequence-parallel")
    if expert_tp not in (None, 1):
        raise ConfigError(f"--expert-tensor-parallel-size {expert_tp}: HeterMoE's expert ranks hold whole experts "
                          f"(expert tensor parallelism is not built yet); pass --expert-tensor-parallel-size 1")


def check_hetero_pp(plan: HeteroPlan, pp: int, schedule: str | None, emulated: bool = False) -> None:
    """Pipeline parallelism of a HeterMoE job, the same rule for both hostings: Megatron's
    --pipeline-model-parallel-size is the plan's pipeline_stages; inside the stages DistEP (the
    expert ranks mirror Megatron's 1F1B, interleaved with the plan's virtual stages) or zebra
    (each stage's task lists); emulation times zebra's stages only (DistEP's 1F1B is Megatron's
    own schedule, which has no task lists to time)."""
    P = plan.pipeline_stages
    if pp != P:
        raise ConfigError(f"--pipeline-model-parallel-size {pp}: the plan has pipeline_stages={P}; pass "
                          f"--pipeline-model-parallel-size {P}, or remake the plan with {pp} stages")
    if plan.zebra_waves > 1 and (schedule or plan.schedule) != ScheduleName.ZEBRA:
        raise ConfigError(f"--hetero-schedule {schedule}: the plan runs zebra in zebra_waves={plan.zebra_waves} groups "
                          f"of microbatches, which DistEP has no use for; run zebra, or remake the plan with "
                          f"zebra_waves 1")
    if P == 1:
        return
    if emulated and (schedule or plan.schedule) != ScheduleName.ZEBRA:
        raise ConfigError(f"--emulate with {P} pipeline stages under {schedule or plan.schedule}: the emulator times "
                          f"task lists, and DistEP runs Megatron's 1F1B across the stages; emulate zebra "
                          f"(--hetero-schedule zebra) or one stage")


def check_hetero_split(plan: HeteroPlan, first: int | None, last: int | None) -> None:
    """Megatron-LM's --decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers are the
    plan's first_stage_layers / last_stage_layers (both None: Megatron's even split)."""
    if (first, last) != (plan.first_stage_layers, plan.last_stage_layers):
        def flags(f: int | None, la: int | None) -> str:
            out = ([f"--decoder-first-pipeline-num-layers {f}"] if f is not None else []) + \
                ([f"--decoder-last-pipeline-num-layers {la}"] if la is not None else [])
            return " ".join(out) or "no uneven split flags"

        want = flags(plan.first_stage_layers, plan.last_stage_layers)
        raise ConfigError(f"{flags(first, last)}: the plan splits its stages as {want} (stage layers "
                          f"{plan.stage_layer_counts()}); pass those, or remake the plan from the run's flags "
                          f"(hetermoe plan --even ... -- <flags>)")


def check_hetero_virtual_stages(plan: HeteroPlan, virtual_stages: int | None, schedule: str | None) -> None:
    """Megatron-LM's virtual pipeline size (args.virtual_pipeline_model_parallel_size, which its
    validate_args derives from either virtual-stage flag; None without) is the plan's
    virtual_stages; under DistEP they run Megatron's interleaved 1F1B, under zebra its order over
    waves of microbatches (plan.tasks.zebra_chunk_tasks), where every model chunk needs an MoE
    layer."""
    V = virtual_stages or 1
    if V != plan.virtual_stages:
        raise ConfigError(f"--num-virtual-stages-per-pipeline-rank {V} (Megatron's virtual pipeline size; "
                          f"--num-layers-per-virtual-pipeline-stage sets it too): the plan has "
                          f"virtual_stages={plan.virtual_stages}; pass --num-virtual-stages-per-pipeline-rank "
                          f"{plan.virtual_stages}" + (" (or neither flag)" if plan.virtual_stages == 1 else "")
                          + f", or remake the plan with virtual_stages {V}")
    P = plan.pipeline_stages
    dense = [(s, v) for s in range(P) for v in range(V) if V > 1 and not plan.chunk_moe_layers(s, v)]
    if dense and (schedule or plan.schedule) == ScheduleName.ZEBRA:
        raise ConfigError(f"--hetero-schedule zebra: model chunk(s) (pipeline stage, chunk) {dense} of the plan's "
                          f"{P} x {V} virtual stages hold no MoE layer, and zebra cuts a chunk's stages at its MoE "
                          f"layers; run distep, or use fewer virtual stages")


def check_hetero(cfg: "TrainConfig", plan: HeteroPlan, world: int, schedule: str | None = None,
                 run: "HeteroRunConfig | None" = None) -> None:
    """A HeterMoE job: the plan against the job, the model and the batch; its precision against
    the plan's GPU types."""
    from megatron_hetermoe.config import ParallelConfig, PoolPrecision

    par = cfg.parallel
    if par.ep != 1:
        raise ConfigError(f"--expert-model-parallel-size {par.ep} with --hetero-plan: the plan places the experts; "
                          f"leave --expert-model-parallel-size at 1")
    check_hetero_tp(plan, par.tp, par.sequence_parallel, cp=par.cp)
    split = 2 * plan.attention_cp * plan.attention_tp
    if plan.attention_cp > 1 and cfg.model.seq_length % split:
        raise ConfigError(f"--seq-length {cfg.model.seq_length}: context parallelism cuts every sequence into 2 x "
                          f"attention_cp = {2 * plan.attention_cp} chunks, each split over attention_tp="
                          f"{plan.attention_tp} ranks; use a multiple of {split}")
    if plan.attention_cp > 1 and cfg.emulate is not None:
        raise ConfigError(f"--emulate with the plan's attention_cp={plan.attention_cp}: the emulated clock does not "
                          f"time the CP ranks' key/value gathers yet; emulate attention_cp 1 (the planner prices CP)")
    if plan.virtual_stages > 1:
        raise ConfigError(f"plan virtual_stages={plan.virtual_stages}: the plugin's trainer builds one model chunk "
                          f"per rank (Megatron's non-interleaved schedules); train virtual pipeline stages in "
                          f"Megatron-LM's pretrain() (--num-virtual-stages-per-pipeline-rank "
                          f"{plan.virtual_stages} --hetero-plan ...), or remake the plan with virtual_stages 1")
    if plan.first_stage_layers is not None or plan.last_stage_layers is not None:
        raise ConfigError(f"plan stage layers {plan.stage_layer_counts()} (first_stage_layers, last_stage_layers): "
                          f"the plugin's trainer splits pipeline stages evenly; train uneven stages in Megatron-LM's "
                          f"pretrain() (--decoder-first/last-pipeline-num-layers --hetero-plan ...), or remake the "
                          f"plan with the even split")
    check_hetero_pp(plan, par.pp, schedule, cfg.emulate is not None)
    check_megatron_tp(cfg)  # the plugin's checkpoints and emulation are TP=1 in both trainers
    if schedule is not None and schedule not in SCHEDULES:
        raise ConfigError(f"--hetero-schedule {schedule!r}: use one of {list(SCHEDULES)}")
    m = cfg.model
    check_plugin_model(m)  # library callers of train_hetero skip validate_job
    pools = run.pools(cfg) if run is not None else PoolPrecision(cfg.precision, cfg.precision)
    check_plan_for_job(plan, world, m.num_layers, m.num_experts, cfg.micro_batch_size, cfg.global_batch_size,
                       pools, f"model {m.name!r}", f"make the plan with --model {m.name}")
    if pools.mixed and cfg.emulate is not None:
        raise ConfigError("--hetero-expert-precision with --emulate: emulated runs time fp32 work on CPU ranks; "
                          "drop --hetero-expert-precision")
    if run is not None:
        check_issuer(run.zebra_issuer, cfg.emulate is not None)
    from megatron_hetermoe.models.builder import transformer_config

    try:
        transformer_config(m, ParallelConfig(), cfg.precision, expert_model_parallel_size=2)
    except (ValueError, AssertionError) as e:
        raise ConfigError(f"megatron-core refuses model {m.name!r}: {e}") from None


def validate_job(cfg: "TrainConfig", world: int, plan: HeteroPlan | None = None, schedule: str | None = None,
                 run: "HeteroRunConfig | None" = None) -> None:
    """Everything a job's ranks would otherwise find out after their process groups exist."""
    if type(world) is not int or world < 1:
        raise ConfigError(f"world size {world!r} must be an integer >= 1; pass --nproc 1 or more")
    check_train_config(cfg)
    if plan is None:
        check_megatron_layout(cfg, world)
    else:
        check_hetero(cfg, plan, world, schedule, run)
