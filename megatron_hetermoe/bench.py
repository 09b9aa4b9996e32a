"""`hetermoe bench`: HeterMoE against Megatron EP, side by side, on one emulated cluster.

In one invocation, on CPU ranks that each play a GPU of the cluster file (emulation.py), it runs
Megatron EP over all ranks, EP (Ideal) (each GPU type alone, throughputs added), DistEP, Zebra
and Zebra + Asym-EA, all on the same small model standing in for the emulated shape, all timed
by the same rules. For each it prints the measured step time, tokens/s (of the emulated model)
and per-GPU-type utilization (busy compute / step, from each rank's recorded timeline), next to
the simulator's prediction, then HeterMoE's ratio to each baseline and the prediction error.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict, dataclass, field, replace

from .emulation import EmulationSpec, Emulator, emulation_real_model
from .model_builder import ParallelConfig
from .model_config import ModelConfig
from .planner.cluster import Cluster
from .planner.search import DISTEP, ZEBRA, ZEBRA_NO_EA, build_plan, search
from .trainer import TrainConfig

HETERMOE = "Zebra + Asym-EA"
STRATEGIES = ("Megatron EP", "EP (Ideal)", "DistEP", "Zebra", HETERMOE)


@dataclass
class Row:
    name: str
    measured_step_s: float  # real seconds (emulated seconds x scale)
    predicted_step_s: float
    tokens_per_s: float  # emulated-model tokens per emulated second
    utilization: dict[str, float] = field(default_factory=dict)
    detail: dict = field(default_factory=dict)

    @property
    def error(self) -> float:
        return (self.measured_step_s - self.predicted_step_s) / self.predicted_step_s


def _steady(step_times: list[float]) -> float:
    """Median step time after the first (warm-up) step."""
    return statistics.median(step_times[1:] if len(step_times) > 1 else step_times)


def _utilization(busy: list[float], gpus: list[str], step: float) -> dict[str, float]:
    by: dict[str, list[float]] = {}
    for b, g in zip(busy, gpus):
        by.setdefault(g, []).append(b / step)
    return {g: sum(v) / len(v) for g, v in by.items()}


def _hetero_rank(rank, world, cfg, plan, schedule, run_dir):
    from .hetero_trainer import train_hetero

    return train_hetero(cfg, plan, schedule=schedule, run_dir=run_dir)


def run_bench(cluster: str, model: str, seq_len: int, global_batch: int, steps: int = 4,
              step_seconds: float = 2.0, timeline_dir: str | None = None, only: tuple[str, ...] = STRATEGIES,
              timeout_s: float = 1800.0) -> dict:
    from .launcher import launch
    from .trainer import run

    cl = Cluster.load(cluster)
    emulated = ModelConfig.load(model)
    types = cl.gpu_types()
    W = cl.world_size
    res = search(emulated, cl, seq_len, global_batch, activation_checkpointing=True)
    preds = res.by_name()
    plans = {}
    for name, key, schedule in ((HETERMOE, ZEBRA, "zebra"), ("Zebra", ZEBRA_NO_EA, "zebra"), ("DistEP", DISTEP, "distep")):
        p = preds.get(key)
        if p is None or not p.fits:
            raise SystemExit(f"the planner found no feasible {key} plan for {model} on {cluster} at seq {seq_len}, "
                             f"global batch {global_batch}: {p.detail if p else 'none'}")
        d = p.detail
        plans[name] = build_plan(emulated, types, d["attention_ranks"], d["expert_ranks"], d["groups"],
                                 d["microbatches"], d["experts_on_attention_per_layer"], schedule)
    base = EmulationSpec(cluster, model, seq_len, global_batch)
    em0 = Emulator(base)
    scale = step_seconds / em0.predict_hetero(plans[HETERMOE], "zebra").step_time_s
    spec = replace(base, scale=scale)
    em = Emulator(spec)
    real = emulation_real_model(emulated)
    tokens = global_batch * seq_len
    rows: list[Row] = []
    unfit: dict[str, str] = {}  # strategies that do not fit in the emulated GPUs' memory

    def tps(measured: float) -> float:
        return tokens / (measured / scale)

    for name in only:
        if name in plans:
            plan = plans[name]
            schedule = plan.schedule
            n_attn = len(plan.attention_ranks)
            cfg = TrainConfig(real, ParallelConfig(), micro_batch_size=1, global_batch_size=plan.num_microbatches * n_attn,
                              train_iters=steps, quiet=True, emulate=spec)
            run_dir = f"{timeline_dir}/{name.replace(' ', '_').replace('+', 'plus')}" if timeline_dir else None
            out = launch(_hetero_rank, W, cfg, plan, schedule, run_dir, timeout_s=timeout_s)[0]
            m = _steady(out["step_times"])
            p = em.predict_hetero(plan, schedule).step_time_s * scale
            g = plan.groups[0]
            rows.append(Row(name, m, p, tps(m), _utilization(out["busy_s"], types, m), {
                "M": len(g.attention_ranks), "N": len(g.expert_ranks), "groups": len(plan.groups),
                "R": plan.num_microbatches, "experts_on_attention_per_layer": plan.experts_on_attention_per_layer(),
                "schedule": schedule}))
        elif name == "Megatron EP":
            pred = em.predict_ep()
            if not pred.fits:
                unfit[name] = pred.reason
                continue
            d, r_mb = pred.detail["ep_size"], pred.detail["microbatches"]
            cfg = TrainConfig(real, ParallelConfig(ep=d), micro_batch_size=1, global_batch_size=r_mb * W,
                              train_iters=steps, quiet=True, emulate=spec)
            out = run(cfg, W, timeout_s=timeout_s)
            m = _steady(out["step_times"])
            rows.append(Row(name, m, pred.step_time_s * scale, tps(m), _utilization(out["busy_s"], types, m),
                            {"ep_size": d, "microbatches": r_mb}))
        elif name == "EP (Ideal)":
            total, util, det, pred_total = 0.0, {}, {}, 0.0
            for gpu in sorted(set(types)):
                ranks = cl.ranks_of(gpu)
                pred = em.predict_ep(ranks, f"EP on {gpu}")
                if not pred.fits:
                    det[gpu] = pred.reason
                    continue
                d, r_mb = pred.detail["ep_size"], pred.detail["microbatches"]
                sub = replace(spec, ranks=tuple(ranks))
                cfg = TrainConfig(real, ParallelConfig(ep=d), micro_batch_size=1, global_batch_size=r_mb * len(ranks),
                                  train_iters=steps, quiet=True, emulate=sub)
                out = run(cfg, len(ranks), timeout_s=timeout_s)
                m = _steady(out["step_times"])
                share = global_batch * len(ranks) // W * seq_len
                total += share / (m / scale)
                pred_total += pred.tokens_per_s
                util[gpu] = sum(out["busy_s"]) / len(ranks) / m
                det[gpu] = {"ranks": len(ranks), "ep_size": d, "microbatches": r_mb, "measured_step_s": m,
                            "predicted_step_s": pred.step_time_s * scale}
            if total == 0:
                unfit[name] = f"no GPU type fits the model alone: {det}"
                continue
            rows.append(Row(name, tokens / total * scale, tokens / pred_total * scale, total, util, det))
    by = {r.name: r for r in rows}
    ratios = {}
    if HETERMOE in by:
        for r in rows:
            if r.name != HETERMOE:
                ratios[r.name] = by[HETERMOE].tokens_per_s / r.tokens_per_s
    return {"cluster": cl.name, "model": emulated.name, "seq_len": seq_len, "global_batch": global_batch,
            "scale": scale, "steps": steps, "world_size": W, "real_model": asdict(real),
            "strategies": {r.name: {"measured_step_s": r.measured_step_s, "predicted_step_s": r.predicted_step_s,
                                    "tokens_per_s": r.tokens_per_s, "prediction_error": r.error,
                                    "utilization": r.utilization, "detail": r.detail} for r in rows},
            "hetermoe_speedup": ratios, "does_not_fit": unfit}


def format_report(rep: dict) -> str:
    lines = [f"emulated cluster {rep['cluster']} ({rep['world_size']} ranks), model {rep['model']} at seq "
             f"{rep['seq_len']}, global batch {rep['global_batch']}; real model: tiny widths, "
             f"{rep['real_model']['num_layers']} layers x {rep['real_model']['num_experts']} experts; "
             f"scale {rep['scale']:.3g} real s per emulated s; median of steps 2..{rep['steps']}",
             f"{'strategy':<18} {'measured s':>10} {'predicted s':>11} {'error':>7} {'tokens/s':>10}  utilization"]
    for name, r in rep["strategies"].items():
        util = " ".join(f"{g}={u:.0%}" for g, u in sorted(r["utilization"].items()))
        lines.append(f"{name:<18} {r['measured_step_s']:>10.3f} {r['predicted_step_s']:>11.3f} "
                     f"{r['prediction_error']:>+7.1%} {r['tokens_per_s']:>10.0f}  {util}")
    for name, why in rep.get("does_not_fit", {}).items():
        lines.append(f"{name:<18} does not fit: {why}")
    for name, x in rep["hetermoe_speedup"].items():
        lines.append(f"{HETERMOE} / {name}: {x:.2f}x tokens/s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hetermoe bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--cluster", required=True)
    p.add_argument("--model", required=True, help="the emulated model shape (e.g. d1)")
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--global-batch", type=int, default=None, help="sequences per step (default: 4 per GPU)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--step-seconds", type=float, default=2.0,
                   help="real seconds the Zebra+Asym-EA step is scaled to (longer: less CPU noise)")
    p.add_argument("--only", default=",".join(STRATEGIES), help="comma-separated subset of " + ", ".join(STRATEGIES))
    p.add_argument("--timeline-dir", default=None, help="write each HeterMoE run's timeline here")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    only = tuple(s.strip() for s in a.only.split(","))
    bad = [s for s in only if s not in STRATEGIES]
    if bad:
        raise SystemExit(f"unknown strategies {bad}; choose from {list(STRATEGIES)}")
    import megatron.core  # noqa: F401  - import once, then fork ranks

    gb = a.global_batch or 4 * Cluster.load(a.cluster).world_size
    rep = run_bench(a.cluster, a.model, a.seq_len, gb, a.steps, a.step_seconds, a.timeline_dir, only)
    print(json.dumps(rep) if a.json else format_report(rep))
    return 0


if __name__ == "__main__":
    sys.exit(main())
