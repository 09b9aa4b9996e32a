"""The CPU demo (`make demo`): HeterMoE on an emulated 2 A40 + 2 V100 cluster.

1. Real text that ships with Python (its documentation topics) is tokenized with a BPE trained
   on it and written as a Megatron indexed dataset.
2. The planner picks the layout for the emulated cluster and model shape (Paper's W1 at 4K
   tokens): which GPUs run attention, R, and which experts move to the attention GPUs.
3. Four CPU ranks, each playing its GPU, train a tiny Mixtral-style model (W1's layers and
   experts at tiny widths) on that text with zebra + Asym-EA; the loss falls.
4. Plain Megatron EP runs on the same emulated cluster, timed by the same rules; the demo
   prints both throughputs (tokens/s of the emulated model), the measured speedup, the
   simulator's and their difference, and writes the timeline picture of the last HeterMoE step.

Timing is measured only where the emulation holds (emulation/emulator.py): the training steps run as
fast as the CPUs go (the loss does not depend on timing), then the last `measure_steps` steps of
each run are stretched to a scale picked by a calibration step, and each run reports whether its
real work and host delays stayed under 3 % of the step. A run that did not is reported as
invalid, with the fix, and no measured speedup is printed as a result.
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

DEMO_WARMUP_ITERS = 10  # LR warm-up of the HeterMoE training run, which must train more steps than this


def _hetero_rank(rank, world, cfg, plan, run_dir):
    from megatron_hetermoe.config import HeteroRunConfig
    from megatron_hetermoe.training.hetero import train_hetero

    return train_hetero(cfg, plan, HeteroRunConfig(schedule="zebra", timeline_dir=run_dir))


def plan_for_emulation(shape, cluster, seq_len: int, global_batch: int, path: Path):
    """The planner's pick for an emulated run (saved to `path`): the emulator times what the runtime
    does (no resent inputs: the default expert recompute level only) and attention members of one
    rank (no tensor parallelism), in one pipeline stage, with at most 4 microbatches (CPU ranks)."""
    from megatron_hetermoe.planner.cost_model import default_expert_recompute
    from megatron_hetermoe.planner.search import search

    plan = search(shape, cluster, seq_len, global_batch, max_microbatches=4,
                  expert_recompute=default_expert_recompute(True), attention_tp=(1,), pipeline_stages=(1,)).plan
    plan.save(path)
    return plan


def _measured_skew(stats_path: Path, plan, em, global_batch: int) -> dict:
    """The expert loads the HeterMoE run measured (its stats file) and what re-placing the experts for
    them is predicted to gain on the emulated cluster (the load-aware placement the closed loop uses)."""
    from megatron_hetermoe.planner.expert_load import LoadStats
    from megatron_hetermoe.planner.load_placement import place_for_load

    load = LoadStats.load_file(stats_path).load
    placed = place_for_load(plan, em.cost, em.cluster, global_batch, load)
    return {"stats": str(stats_path), "max_over_mean_per_layer": load.max_over_mean(), **placed.to_dict()}


def run_demo(out_dir: str = "demo-out", steps: int = 150, measure_steps: int = 3, ep_measure_steps: int = 3,
             cluster: str = "mini-2a40-2v100", emulated: str = "w1", seq_len: int = 4096,
             global_batch: int = 16, max_step_seconds: float = 30.0) -> dict:
    import megatron.core  # noqa: F401  - import once, then fork the ranks

    from megatron_hetermoe import import_extra
    from megatron_hetermoe.config import (
        DataConfig,
        EmulationSpec,
        ModelConfig,
        ParallelConfig,
        TrainConfig,
    )
    from megatron_hetermoe.data import corpus
    from megatron_hetermoe.emulation.emulator import Emulator, emulation_real_model
    from megatron_hetermoe.emulation.validity import validity_line
    from megatron_hetermoe.parallel.launcher import launch
    from megatron_hetermoe.planner.cluster import Cluster
    from megatron_hetermoe.schedules.timeline import load_events
    from megatron_hetermoe.tools.timeline import draw_png
    from megatron_hetermoe.training.args import run

    import_extra("matplotlib", "plot", "the demo's timeline.png")  # before minutes of training, not after
    if not 1 <= measure_steps <= steps - 2 or ep_measure_steps < 1:
        raise ValueError(f"measure_steps={measure_steps}, ep_measure_steps={ep_measure_steps}: need 1 <= "
                         f"measure_steps <= steps - 2 = {steps - 2} (a warm-up and a calibration step first)")
    t_start = time.perf_counter()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    print("[1/4] real text: Python's documentation topics -> BPE tokenizer -> Megatron .bin/.idx", flush=True)
    ds = corpus.build_text_dataset(out / "data", vocab_size=1024)
    data = DataConfig(data_path=(ds["data_path"],), tokenizer_type="HuggingFaceTokenizer",
                      tokenizer_model=ds["tokenizer_model"])

    print(f"[2/4] planning {emulated.upper()} at {seq_len} tokens on emulated cluster {cluster}", flush=True)
    cl = Cluster.load(cluster)
    shape = ModelConfig.load(emulated)
    plan = plan_for_emulation(shape, cl, seq_len, global_batch, out / "plan.json")
    g = plan.groups[0]
    print(f"      attention: ranks {g.attention_ranks} ({plan.gpu_types[g.attention_ranks[0]]}), experts: ranks "
          f"{g.expert_ranks} ({plan.gpu_types[g.expert_ranks[0]]}), R={plan.num_microbatches}, experts moved to "
          f"attention GPUs per layer: {plan.experts_on_attention_per_layer()} ({plan.meta['assignment']})")
    base = EmulationSpec(cluster, emulated, seq_len, global_batch)
    em = Emulator(base)
    pred = em.predict_hetero(plan, "zebra")
    programs = em.programs()
    print(f"      times are for: {'; '.join(f'{k}: {v}' for k, v in programs['predicted_program'].items())}; "
          f"the CPU ranks run {programs['runtime_program']}, timed as that")
    # The training steps run at 1 % of the emulated time, i.e. as fast as the CPUs go; the step
    # before the last measure_steps calibrates their scale (emulation/emulator.py).
    spec = replace(base, scale=0.01, auto_scale=True, calibrate_step=steps - measure_steps - 1,
                   max_step_seconds=max_step_seconds)
    real = emulation_real_model(shape, hidden=64, seq_length=64).replace(vocab_size=1024)
    n_attn = len(plan.attention_ranks)
    mbs = 2
    cfg = TrainConfig(real, ParallelConfig(), micro_batch_size=mbs,
                      global_batch_size=mbs * plan.num_microbatches * n_attn,
                      train_iters=steps, lr=3e-3, min_lr=3e-4, lr_warmup_iters=DEMO_WARMUP_ITERS, log_interval=10,
                      emulate=spec, data=data, progress_bar=True)

    print(f"[3/4] HeterMoE (zebra + Asym-EA) trains {steps} steps on {cl.world_size} CPU ranks; the last "
          f"{measure_steps} are timed as the emulated GPUs, at a scale the step before them picks", flush=True)
    tl = out / "timeline"
    het = launch(_hetero_rank, cl.world_size, cfg, plan, str(tl), timeout_s=3600)[0]
    h_rep = het.emulation
    skew = _measured_skew(tl / "expert_load.json", plan, em, global_batch)

    ep_pred = em.predict_ep()
    d, r_mb = ep_pred.detail["ep_size"], ep_pred.detail["microbatches"]
    print(f"[4/4] plain Megatron EP (EP={d}, {r_mb} microbatch(es)) on the same emulated cluster: a warm-up, a "
          f"calibration and {ep_measure_steps} timed steps", flush=True)
    ep_spec = replace(base, scale=1.0 / ep_pred.step_time_s, auto_scale=True, calibrate_step=1,
                      max_step_seconds=max_step_seconds)
    # Timing only: no LR warm-up (megatron-core's scheduler needs it shorter than the run).
    ep_cfg = replace(cfg, parallel=ParallelConfig(ep=d), micro_batch_size=1, global_batch_size=r_mb * cl.world_size,
                     train_iters=ep_measure_steps + 2, lr_warmup_iters=0, quiet=True, progress_bar=False,
                     emulate=ep_spec)
    ep = run(ep_cfg, cl.world_size, timeout_s=1800)
    e_rep = ep.emulation

    tokens = global_batch * seq_len
    h_step, e_step = h_rep["measured_step_s"], e_rep["measured_step_s"]
    h_tps, e_tps = tokens / h_step, tokens / e_step
    predicted = ep_pred.step_time_s / pred.step_time_s
    valid = bool(h_rep["valid"] and e_rep["valid"])
    measured = h_tps / e_tps
    last = max(e.step for e in load_events(tl))
    draw_png(load_events(tl), out / "timeline.png", step=last,
             title=f"HeterMoE zebra + Asym-EA, {emulated.upper()} on {cluster} (step {last + 1})")
    first10, last10 = statistics.mean(het.losses[:10]), statistics.mean(het.losses[-10:])
    summary = {
        "loss_first10": first10, "loss_last10": last10,
        "valid": valid,
        "invalid_reason": None if valid else "; ".join(
            f"{n}: {r['invalid_reason']}" for n, r in (("HeterMoE", h_rep), ("Megatron EP", e_rep)) if not r["valid"]),
        "speedup": measured if valid else None, "predicted_speedup": predicted,
        "difference": measured / predicted - 1 if valid else None,
        "measured_speedup_invalid": None if valid else measured,
        "hetermoe_tokens_per_s": h_tps, "megatron_ep_tokens_per_s": e_tps,
        "hetermoe_step_s": h_step, "megatron_ep_step_s": e_step,
        "predicted_hetermoe_step_s": pred.step_time_s, "predicted_megatron_ep_step_s": ep_pred.step_time_s,
        "hetermoe_emulation": {k: v for k, v in h_rep.items() if k != "steps"},
        "megatron_ep_emulation": {k: v for k, v in e_rep.items() if k != "steps"},
        "programs": programs,
        "expert_load": skew,
        "wall_s": time.perf_counter() - t_start,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    print(f"\nlm loss: {first10:.3f} (mean of the first 10 steps) -> {last10:.3f} (last 10)")
    print(f"emulated {emulated.upper()} step: HeterMoE {h_step:.3f} s (simulator {pred.step_time_s:.3f} s), "
          f"Megatron EP {e_step:.3f} s (simulator {ep_pred.step_time_s:.3f} s)")
    print(" " + validity_line("HeterMoE run", h_rep))
    print(" " + validity_line("Megatron EP run", e_rep))
    if valid:
        print(f"HeterMoE / Megatron EP: {measured:.2f}x tokens/s measured in emulation, {predicted:.2f}x simulated, "
              f"difference {measured / predicted - 1:+.1%} "
              f"(HeterMoE {h_tps:,.0f} vs Megatron EP {e_tps:,.0f} tokens/s)")
    else:
        print(f"HeterMoE / Megatron EP: no measured speedup (the emulation was not valid on this machine, see "
              f"above); {predicted:.2f}x simulated")
    print(f"expert loads the router made (HeterMoE run, every step): max/mean tokens per expert per layer "
          f"{' '.join(f'{x:.2f}' for x in skew['max_over_mean_per_layer'])}; re-placing the experts for them "
          f"(hetermoe plan --expert-load, the closed loop's planner): {skew['gain']:.3f}x the static placement's "
          f"step, simulated ({skew['placement']} placement chosen; measured closed-loop runs: "
          f"scripts/bench_closed_loop.py, docs/expert-load.md)")
    print(f"timeline: {out / 'timeline.png'}  (hetermoe timeline {tl} for the Chrome trace)")
    print(f"demo took {summary['wall_s']:.0f} s")
    return summary


def main(argv: list[str] | None = None) -> int:
    from megatron_hetermoe.cli.demo import build_parser

    p = build_parser(__doc__.split("\n\n")[0])
    a = p.parse_args(argv)
    if a.steps <= DEMO_WARMUP_ITERS:  # megatron-core's scheduler would assert on every rank, minutes in
        p.error(f"--steps {a.steps}: must be above the demo's LR warm-up of {DEMO_WARMUP_ITERS} steps; "
                f"pass --steps {DEMO_WARMUP_ITERS + 1} or more")
    if not 1 <= a.measure_steps <= a.steps - 2:
        p.error(f"--measure-steps {a.measure_steps}: must be in 1..steps - 2 = {a.steps - 2} (a warm-up and a "
                f"calibration step come first); pass e.g. --measure-steps 3")
    if not a.max_step_seconds > 0:
        p.error(f"--max-step-seconds {a.max_step_seconds}: must be > 0; pass e.g. --max-step-seconds 30")
    run_demo(a.out_dir, a.steps, a.measure_steps, a.measure_steps, max_step_seconds=a.max_step_seconds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
