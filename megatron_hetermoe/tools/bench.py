"""`hetermoe bench`: HeterMoE against Megatron EP, side by side, on one emulated cluster.

In one invocation, on CPU ranks that each play a GPU of the cluster file (emulation/emulator.py), it runs
Megatron EP over all ranks, EP (Ideal) (each GPU type alone, throughputs added), DistEP, Zebra
and Zebra + Asym-EA, all on the same small model standing in for the emulated shape, all timed
by the same rules. For each it prints the measured step time, tokens/s (of the emulated model)
and per-GPU-type utilization (emulated compute / step), next to the simulator's prediction,
whether the emulation held, then HeterMoE's ratio to each baseline, measured and predicted.

Validity: every run records how far its real work and host delays pushed its steps past an
exact emulation (emulation/emulator.py). A run past `max_overrun` (3 %) of the step is invalid: its
tokens/s are shown flagged, and no ratio that needs them is reported. By default each run picks
its own scale from a calibration step (`--step-seconds auto`); `--step-seconds N` fixes it
instead (the Zebra + Asym-EA step takes N real seconds, the others the same scale).
"""
from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, field, replace

from megatron_hetermoe.config import (
    EmulationSpec,
    ModelConfig,
    ParallelConfig,
    TrainConfig,
)
from megatron_hetermoe.emulation.emulator import (
    Emulator,
    emulation_real_model,
)
from megatron_hetermoe.planner.cluster import Cluster
from megatron_hetermoe.planner.cost_model import default_expert_recompute
from megatron_hetermoe.planner.search import (
    DISTEP,
    ZEBRA,
    ZEBRA_NO_EA,
    build_plan,
    search,
)

HETERMOE = "Zebra + Asym-EA"
STRATEGIES = ("Megatron EP", "EP (Ideal)", "DistEP", "Zebra", HETERMOE)
CALIBRATION_SECONDS = 1.0  # the warm-up and calibration steps of an auto-scaled run take about this long


@dataclass
class Row:
    name: str
    measured_step_s: float  # emulated seconds (real seconds / scale)
    predicted_step_s: float  # emulated seconds
    tokens_per_s: float  # emulated-model tokens per emulated second
    utilization: dict[str, float] = field(default_factory=dict)
    detail: dict = field(default_factory=dict)
    valid: bool = False
    invalid_reason: str | None = None
    overrun: float | None = None  # delay bound / predicted step (median-high over the measured steps)
    scale: float | None = None  # real seconds per emulated second of the measured steps

    @property
    def error(self) -> float:
        return (self.measured_step_s - self.predicted_step_s) / self.predicted_step_s


def _utilization(per_rank: list[float], gpus: list[str]) -> dict[str, float]:
    """Mean per GPU type of each rank's emulated compute / step (never above 1)."""
    by: dict[str, list[float]] = {}
    for u, g in zip(per_rank, gpus):
        by.setdefault(g, []).append(min(1.0, u))
    return {g: sum(v) / len(v) for g, v in by.items()}


def _hetero_rank(rank, world, cfg, plan, schedule, run_dir):
    from megatron_hetermoe.config import HeteroRunConfig
    from megatron_hetermoe.training.hetero import train_hetero

    return train_hetero(cfg, plan, HeteroRunConfig(schedule=schedule, timeline_dir=run_dir))


def _spec_for(base: EmulationSpec, pred_step_s: float, fixed_scale: float | None, max_step_seconds: float,
              max_overrun: float) -> EmulationSpec:
    if fixed_scale is not None:
        return replace(base, scale=fixed_scale, max_overrun=max_overrun,
                       target_overrun=min(base.target_overrun, max_overrun))
    return replace(base, scale=CALIBRATION_SECONDS / pred_step_s, auto_scale=True, calibrate_step=1,
                   max_step_seconds=max_step_seconds, max_overrun=max_overrun,
                   target_overrun=min(base.target_overrun, max_overrun / 3))


def run_bench(cluster: str, model: str, seq_len: int, global_batch: int, steps: int = 3,
              step_seconds: float | None = None, timeline_dir: str | None = None, only: tuple[str, ...] = STRATEGIES,
              timeout_s: float = 1800.0, max_step_seconds: float = 30.0, max_overrun: float = 0.03) -> dict:
    """Run the strategies; `steps` measured steps each (after one warm-up step, and with
    step_seconds=None, the calibration step that picks the scale)."""
    from megatron_hetermoe.parallel.launcher import launch
    from megatron_hetermoe.training.args import run

    if steps < 1:
        raise ValueError(f"steps={steps}: measure at least one step")
    cl = Cluster.load(cluster)
    emulated = ModelConfig.load(model)
    types = cl.gpu_types()
    W = cl.world_size
    # The emulated runs time what the runtime does: expert holders never resend their inputs, so
    # the search prices only the level the emulator prices (its TrainSettings' default).
    # The emulator times attention members of one rank (no tensor parallelism).
    res = search(emulated, cl, seq_len, global_batch, activation_checkpointing=True,
                 expert_recompute=default_expert_recompute(True), attention_tp=(1,), pipeline_stages=(1,))
    preds = res.by_name()
    plans = {}
    for name, key, schedule in ((HETERMOE, ZEBRA, "zebra"), ("Zebra", ZEBRA_NO_EA, "zebra"),
                                ("DistEP", DISTEP, "distep")):
        p = preds.get(key)
        if p is None or not p.fits:
            raise SystemExit(f"the planner found no feasible {key} plan for {model} on {cluster} at seq {seq_len}, "
                             f"global batch {global_batch}: {p.detail if p else 'none'}")
        d = p.detail
        plans[name] = build_plan(emulated, types, d["attention_ranks"], d["expert_ranks"], d["groups"],
                                 d["microbatches"], d["experts_on_attention_per_layer"], schedule)
    base = EmulationSpec(cluster, model, seq_len, global_batch)
    em = Emulator(base)
    fixed = step_seconds / em.predict_hetero(plans[HETERMOE], "zebra").step_time_s if step_seconds else None
    iters = steps + (1 if fixed is not None else 2)
    real = emulation_real_model(emulated)
    tokens = global_batch * seq_len
    rows: list[Row] = []
    unfit: dict[str, str] = {}  # strategies that do not fit in the emulated GPUs' memory

    def from_report(name: str, rep: dict, pred_s: float, gpus: list[str], detail: dict) -> Row:
        m = rep["measured_step_s"]
        return Row(name, m if m else float("nan"), pred_s, tokens / m if m else 0.0,
                   _utilization(rep.get("utilization", []), gpus), detail, bool(rep["valid"]),
                   rep.get("invalid_reason"), rep.get("overrun"), rep.get("scale"))

    for name in only:
        if name in plans:
            plan = plans[name]
            schedule = plan.schedule
            pred = em.predict_hetero(plan, schedule).step_time_s
            spec = _spec_for(base, pred, fixed, max_step_seconds, max_overrun)
            n_attn = len(plan.attention_ranks)
            cfg = TrainConfig(real, ParallelConfig(), micro_batch_size=1,
                              global_batch_size=plan.num_microbatches * n_attn,
                              train_iters=iters, quiet=True, emulate=spec)
            run_dir = f"{timeline_dir}/{name.replace(' ', '_').replace('+', 'plus')}" if timeline_dir else None
            out = launch(_hetero_rank, W, cfg, plan, schedule, run_dir, timeout_s=timeout_s)[0]
            g = plan.groups[0]
            rows.append(from_report(name, out.emulation, pred, types, {
                "M": len(g.attention_ranks), "N": len(g.expert_ranks), "groups": len(plan.groups),
                "R": plan.num_microbatches, "experts_on_attention_per_layer": plan.experts_on_attention_per_layer(),
                "schedule": schedule, "emulation": out.emulation}))
        elif name == "Megatron EP":
            pred = em.predict_ep()
            if not pred.fits:
                unfit[name] = pred.reason
                continue
            d, r_mb = pred.detail["ep_size"], pred.detail["microbatches"]
            spec = _spec_for(base, pred.step_time_s, fixed, max_step_seconds, max_overrun)
            cfg = TrainConfig(real, ParallelConfig(ep=d), micro_batch_size=1, global_batch_size=r_mb * W,
                              train_iters=iters, quiet=True, emulate=spec)
            out = run(cfg, W, timeout_s=timeout_s)
            rows.append(from_report(name, out.emulation, pred.step_time_s, types,
                                    {"ep_size": d, "microbatches": r_mb, "emulation": out.emulation}))
        elif name == "EP (Ideal)":
            total, pred_total, util, det, bad = 0.0, 0.0, {}, {}, []
            overrun, scales = 0.0, []
            for gpu in sorted(set(types)):
                ranks = cl.ranks_of(gpu)
                pred = em.predict_ep(ranks, f"EP on {gpu}")
                if not pred.fits:
                    det[gpu] = pred.reason
                    continue
                d, r_mb = pred.detail["ep_size"], pred.detail["microbatches"]
                sub = replace(_spec_for(base, pred.step_time_s, fixed, max_step_seconds, max_overrun),
                              ranks=tuple(ranks))
                cfg = TrainConfig(real, ParallelConfig(ep=d), micro_batch_size=1, global_batch_size=r_mb * len(ranks),
                                  train_iters=iters, quiet=True, emulate=sub)
                rep = run(cfg, len(ranks), timeout_s=timeout_s).emulation
                m = rep["measured_step_s"]
                share = global_batch * len(ranks) // W * seq_len
                total += share / m if m else 0.0
                pred_total += pred.tokens_per_s
                util[gpu] = sum(min(1.0, u) for u in rep["utilization"]) / max(1, len(rep["utilization"]))
                overrun = max(overrun, rep["overrun"] or 0.0)
                scales.append(rep["scale"])
                if not rep["valid"]:
                    bad.append(f"EP on {gpu}: {rep['invalid_reason']}")
                det[gpu] = {"ranks": len(ranks), "ep_size": d, "microbatches": r_mb, "measured_step_s": m,
                            "predicted_step_s": pred.step_time_s, "emulation": rep}
            if pred_total == 0:
                unfit[name] = f"no GPU type fits the model alone: {det}"
                continue
            rows.append(Row(name, tokens / total if total else float("nan"), tokens / pred_total, total, util, det,
                            not bad, "; ".join(bad) or None, overrun, max(scales) if scales else None))
    by = {r.name: r for r in rows}
    ratios, predicted, not_reported = {}, {}, {}
    if HETERMOE in by:
        h = by[HETERMOE]
        for r in rows:
            if r.name == HETERMOE:
                continue
            predicted[r.name] = r.predicted_step_s / h.predicted_step_s
            if h.valid and r.valid:
                ratios[r.name] = h.tokens_per_s / r.tokens_per_s
            else:
                not_reported[r.name] = "; ".join(f"{x.name}: {x.invalid_reason}" for x in (h, r) if not x.valid)
    invalid = [f"{r.name}: {r.invalid_reason}" for r in rows if not r.valid]
    return {"cluster": cl.name, "model": emulated.name, "seq_len": seq_len, "global_batch": global_batch,
            "scale": "auto" if fixed is None else fixed, "steps": steps, "world_size": W, "real_model": asdict(real),
            "max_overrun": max_overrun, "programs": em.programs(),
            "strategies": {r.name: {"measured_step_s": r.measured_step_s, "predicted_step_s": r.predicted_step_s,
                                    "tokens_per_s": r.tokens_per_s,
                                    "predicted_tokens_per_s": tokens / r.predicted_step_s,
                                    "prediction_error": r.error, "utilization": r.utilization, "valid": r.valid,
                                    "invalid_reason": r.invalid_reason, "overrun": r.overrun, "scale": r.scale,
                                    "detail": r.detail} for r in rows},
            "hetermoe_speedup": ratios, "predicted_speedup": predicted, "speedup_not_reported": not_reported,
            "valid": not invalid and bool(rows), "invalid_reason": "; ".join(invalid) or None,
            "does_not_fit": unfit}


def format_report(rep: dict) -> str:
    pr = rep.get("programs", {})
    lines = [f"emulated cluster {rep['cluster']} ({rep['world_size']} ranks), model {rep['model']} at seq "
             f"{rep['seq_len']}, global batch {rep['global_batch']}; real model: tiny widths, "
             f"{rep['real_model']['num_layers']} layers x {rep['real_model']['num_experts']} experts; "
             f"median of {rep['steps']} measured steps per strategy, each at its own scale (real s per emulated s)"]
    if pr:
        lines.append("predicted program (cost model): "
                     + "; ".join(f"{g}: {d}" for g, d in pr["predicted_program"].items()))
        lines.append(f"the CPU ranks run: {pr['runtime_program']}, and are timed as the predicted program")
    lines.append(f"{'strategy':<18} {'measured s':>10} {'predicted s':>11} {'error':>7} {'tokens/s':>10} "
                 f"{'overrun':>8} {'scale':>6}  emulation  utilization")
    for name, r in rep["strategies"].items():
        util = " ".join(f"{g}={min(u, 1.0):.0%}" for g, u in sorted(r["utilization"].items()))
        over = f"{r['overrun']:.1%}" if r.get("overrun") is not None else "-"
        scale = f"{r['scale']:.3g}" if r.get("scale") else "-"
        lines.append(f"{name:<18} {r['measured_step_s']:>10.3f} {r['predicted_step_s']:>11.3f} "
                     f"{r['prediction_error']:>+7.1%} {r['tokens_per_s']:>10.0f} {over:>8} {scale:>6}  "
                     f"{'valid    ' if r['valid'] else 'INVALID  '}  {util}")
    for name, why in rep.get("does_not_fit", {}).items():
        lines.append(f"{name:<18} does not fit: {why}")
    for name, x in rep["hetermoe_speedup"].items():
        lines.append(f"{HETERMOE} / {name}: {x:.2f}x tokens/s measured (simulator: "
                     f"{rep['predicted_speedup'][name]:.2f}x, "
                     f"difference {x / rep['predicted_speedup'][name] - 1:+.1%})")
    for name, why in rep.get("speedup_not_reported", {}).items():
        lines.append(f"{HETERMOE} / {name}: not reported, the emulation was invalid (simulator: "
                     f"{rep['predicted_speedup'][name]:.2f}x)")
    for name, r in rep["strategies"].items():
        if not r["valid"]:
            lines.append(f"INVALID {name}: {r['invalid_reason']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from megatron_hetermoe.cli.bench import build_parser

    argv = sys.argv[1:] if argv is None else list(argv)
    if "--layer" in argv:  # one MoE layer, HeterMoE's against Megatron's (tools/layer_bench.py)
        from megatron_hetermoe.tools import layer_bench

        return layer_bench.main([a for a in argv if a != "--layer"])
    p = build_parser(__doc__, STRATEGIES)
    a = p.parse_args(argv)
    if a.steps < 1:
        p.error(f"--steps {a.steps}: measure at least 1 step")
    if not a.max_step_seconds > 0 or not 0 < a.max_overrun < 1:
        p.error(f"--max-step-seconds {a.max_step_seconds} must be > 0 and --max-overrun {a.max_overrun} in (0, 1)")
    only = tuple(s.strip() for s in a.only.split(","))
    bad = [s for s in only if s not in STRATEGIES]
    if bad:
        raise SystemExit(f"unknown strategies {bad}; choose from {list(STRATEGIES)}")
    from megatron_hetermoe.limits import MAX_GLOBAL_BATCH, MODEL_LIMITS

    for flag, v, most in (("--seq-len", a.seq_len, MODEL_LIMITS["seq_length"]),
                          ("--global-batch", a.global_batch, MAX_GLOBAL_BATCH)):
        if v is not None and not 1 <= v <= most:
            p.error(f"{flag} {v}: must be an integer in 1..{most}")
    # The inputs, before megatron's import and any rank: a bad name or file is one line, not a traceback.
    cluster = Cluster.load(a.cluster)
    beyond = ModelConfig.load(a.model).beyond_every_layer_moe
    if beyond:
        p.error(f"--model {a.model}: has {' and '.join(beyond)}; the emulated bench trains on the plugin's own "
                f"trainer, which builds every layer as an MoE layer without shared experts (`hetermoe plan` prices "
                f"such a model)")
    if a.timeline_dir:
        from megatron_hetermoe.outputs import writable_dir

        writable_dir("--timeline-dir", a.timeline_dir)
    import megatron.core  # noqa: F401  - import once, then fork ranks

    gb = a.global_batch or 4 * cluster.world_size
    rep = run_bench(a.cluster, a.model, a.seq_len, gb, a.steps, a.step_seconds, a.timeline_dir, only,
                    max_step_seconds=a.max_step_seconds, max_overrun=a.max_overrun)
    print(json.dumps(rep, default=str) if a.json else format_report(rep))
    return 0


if __name__ == "__main__":
    from megatron_hetermoe.errors import run_command

    sys.exit(run_command("hetermoe bench", main))
