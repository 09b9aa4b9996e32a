"""Closed-loop expert placement, measured (issue 46 item 5): static plan vs closed loop vs Megatron
EP, side by side in one run, on an emulated cluster, on real text, every strategy timed by the
same emulation rules (emulation/emulator.py) with the experts priced for the tokens they really
received.

Built as `make demo` builds its comparison (megatron_hetermoe/tools/demo.py): the demo's text
(Python's documentation topics, its BPE of 1024 tokens), the planner's pick for the emulated shape,
a tiny model with the emulated shape's layers, experts and top-k trained on CPU ranks. Each
strategy trains the same number of steps as fast as the CPUs go (scale 0.01), then the step before
the last `--measure-steps` calibrates the emulation's scale and those steps are timed:

- static: HeterMoE (zebra) on the planner's pick for the whole run;
- closed loop: the same, with `--hetero-replan-interval K` (training/replan.py): every K steps
  the first rank proposes a placement for the measured loads (emulated: planner/rebalance.py
  propose_simulated, the load-aware placement judged by the simulator on the emulated cluster)
  and the experts move when it pays; the emulation follows each move's plan;
- Megatron EP: the plugin's Megatron EP trainer (EP over every GPU), its experts priced for the
  tokens its own router sent them.

Printed: the measured skew (max/mean tokens per expert per MoE layer over the timed steps and
over the run), each strategy's tokens/s of the emulated model and whether its emulation was valid,
the gains, the moves (experts, bytes, measured seconds on the CPU ranks) and the simulator's
prediction for each HeterMoE plan under the timed steps' loads (Megatron EP's: balanced; the
simulator takes no load for it). A summary goes to OUT/closed_loop.json.

The router is Megatron's with the load-balancing loss (`--aux-loss`), or with `--expert-bias`
aux-loss-free balancing (load balancing none, sigmoid scores, the expert bias at Megatron's update
rate, 1e-3: DeepSeek-V3's recipe), in every strategy alike.

    .venv/bin/python scripts/bench_closed_loop.py --out-dir /tmp/cl --steps 60 --replan-interval 20
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from megatron_hetermoe.parallel.launcher import show_warnings_once

show_warnings_once()

import megatron.core  # noqa: E402,F401  - import once, then fork the ranks


def _hetero_rank(rank, world, cfg, plan, run):
    from megatron_hetermoe.training.hetero import train_hetero

    return train_hetero(cfg, plan, run)


def _timed_loads(path: Path, first_timed: int):
    """The expert loads of the steps from `first_timed` (1-based iterations) on, and of the run."""
    from megatron_hetermoe.planner.expert_load import ExpertLoad, LoadStats

    st = LoadStats.load_file(path)
    got = [iv for iv in st.intervals if iv["iterations"][0] >= first_timed]
    timed = ExpertLoad.of([[sum(iv["tokens"][l][e] for iv in got) for e in range(st.num_experts)]
                           for l in range(st.num_layers)])
    return timed, st.load


def _fmt(xs) -> str:
    return " ".join(f"{x:.2f}" for x in xs)


def run_bench(out_dir: str, steps: int, measure_steps: int, replan_interval: int, replan_margin: float,
              cluster: str, emulated: str, num_experts: int, topk: int, moe_ffn: int | None, aux_loss: float,
              seq_len: int, global_batch: int, max_step_seconds: float, expert_bias: bool = False,
              target_overrun: float | None = None, work_margin: float | None = None) -> dict:
    from megatron_hetermoe.config import (
        DataConfig,
        EmulationSpec,
        HeteroRunConfig,
        ModelConfig,
        ParallelConfig,
        TrainConfig,
    )
    from megatron_hetermoe.data import corpus
    from megatron_hetermoe.emulation.emulator import Emulator, emulation_real_model
    from megatron_hetermoe.emulation.validity import validity_line
    from megatron_hetermoe.parallel.launcher import launch
    from megatron_hetermoe.plan.hetero_plan import HeteroPlan
    from megatron_hetermoe.planner.cluster import Cluster
    from megatron_hetermoe.planner.rebalance import moves as plan_moves
    from megatron_hetermoe.planner.simulator import simulate_plan
    from megatron_hetermoe.tools.demo import plan_for_emulation
    from megatron_hetermoe.training.args import run

    t_start = time.perf_counter()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ds = corpus.build_text_dataset(out / "data", vocab_size=1024)
    data = DataConfig(data_path=(ds["data_path"],), tokenizer_type="HuggingFaceTokenizer",
                      tokenizer_model=ds["tokenizer_model"])
    base_shape = ModelConfig.load(emulated)
    # Fine-grained experts (DeepSeek's, Qwen's): by default the shape's expert parameters split over
    # num_experts (W1: 12 x 7168 -> 32 x 2688), so Megatron EP's replicas fit the V100s too.
    moe_ffn = moe_ffn or base_shape.moe_ffn_hidden_size * base_shape.num_experts // num_experts
    # Aux-loss-free: Megatron's load balancing "none" takes no loss whatever the coefficient; 0 says so.
    aux_loss = 0.0 if expert_bias else aux_loss
    router = (("moe_router_load_balancing_type", "none"), ("moe_router_score_function", "sigmoid"),
              ("moe_router_enable_expert_bias", "true")) if expert_bias else ()
    shape = base_shape.replace(name=f"{base_shape.name}-{num_experts}e-top{topk}-ffn{moe_ffn}",
                               num_experts=num_experts, moe_router_topk=topk, moe_aux_loss_coeff=aux_loss,
                               moe_ffn_hidden_size=moe_ffn)
    model_path = out / "emulated_model.yaml"
    model_path.write_text("".join(f"{k}: {v}\n" for k, v in (
        ("name", shape.name), ("num_layers", shape.num_layers), ("hidden_size", shape.hidden_size),
        ("num_attention_heads", shape.num_attention_heads), ("ffn_hidden_size", shape.ffn_hidden_size),
        ("moe_ffn_hidden_size", shape.moe_ffn_hidden_size), ("num_experts", num_experts),
        ("moe_router_topk", topk), ("moe_aux_loss_coeff", aux_loss), ("vocab_size", shape.vocab_size),
        ("seq_length", seq_len), *router)))
    shape = ModelConfig.load(model_path)
    balancing = (f"aux-loss-free expert bias, update rate {shape.moe_router_bias_update_rate:g}" if expert_bias
                 else f"aux loss {aux_loss:g}")
    cl = Cluster.load(cluster)
    plan = plan_for_emulation(shape, cl, seq_len, global_batch, out / "plan.json")
    g = plan.groups[0]
    print(f"plan for {shape.name} ({num_experts} experts, top-{topk}, {balancing}) at {seq_len} tokens, "
          f"global batch {global_batch}, on {cl.name}: attention ranks {g.attention_ranks}, expert ranks "
          f"{g.expert_ranks}, R={plan.num_microbatches}, {plan.schedule}, experts on attention ranks per layer "
          f"{plan.experts_on_attention_per_layer()}", flush=True)
    base = EmulationSpec(cluster, str(model_path), seq_len, global_batch)
    em = Emulator(base)
    # Slack for a loaded machine: a lower target or a larger margin makes the calibration pick a longer
    # real step, so the same host delays are a smaller part of it (the validity limit stays).
    slack = {k: v for k, v in (("target_overrun", target_overrun), ("work_margin", work_margin)) if v is not None}
    spec = replace(base, scale=0.01, auto_scale=True, calibrate_step=steps - measure_steps - 1,
                   max_step_seconds=max_step_seconds, **slack)
    real = emulation_real_model(shape, hidden=64, seq_length=64).replace(vocab_size=1024)
    n_attn = len(plan.attention_ranks)
    mbs = 2
    cfg = TrainConfig(real, ParallelConfig(), micro_batch_size=mbs,
                      global_batch_size=mbs * plan.num_microbatches * n_attn, train_iters=steps, lr=3e-3,
                      min_lr=3e-4, lr_warmup_iters=min(10, steps // 4), log_interval=1, emulate=spec, data=data,
                      quiet=True)
    first_timed = steps - measure_steps + 1  # 1-based iteration of the first timed step
    ep_pred = em.predict_ep()
    ep_fits = "ep_size" in ep_pred.detail
    if not ep_fits:  # before the HeterMoE runs: say so now, then compare static and closed loop alone
        print(f"Megatron EP cannot run {shape.name} on {cl.name} ({ep_pred.reason}); not run (a smaller --moe-ffn "
              f"would fit it)", flush=True)
    runs = {}
    for name, k in (("static", 0), ("closed loop", replan_interval)):
        t0 = time.perf_counter()
        print(f"HeterMoE, {name}: {steps} steps on {cl.world_size} CPU ranks"
              + (f", replanning every {k} steps" if k else ""), flush=True)
        stats = out / f"expert_load_{name.replace(' ', '_')}.json"
        hr = HeteroRunConfig(schedule=plan.schedule, expert_load_stats=str(stats), replan_interval=k,
                             replan_margin=replan_margin)
        r = launch(_hetero_rank, cl.world_size, cfg, plan, hr, timeout_s=3600)[0]
        timed, whole = _timed_loads(stats, first_timed)
        final = HeteroPlan.from_dict(r.plan) if r.plan is not None else plan
        pred = simulate_plan(final, em.cost, em.cluster, global_batch, expert_load=timed).step_time_s
        runs[name] = {"result": r, "emulation": r.emulation, "timed_load": timed, "whole_load": whole,
                      "final_plan": final, "predicted_step_s": pred,
                      "predicted_balanced_step_s": em.predict_hetero(final, final.schedule).step_time_s,
                      "wall_s": time.perf_counter() - t0}
        print(f"  {validity_line(name, r.emulation)}; {len(r.moves)} move(s); {time.perf_counter() - t0:.0f} s",
              flush=True)

    if ep_fits:
        d, r_mb = ep_pred.detail["ep_size"], ep_pred.detail["microbatches"]
        print(f"Megatron EP (EP={d}, {r_mb} microbatch(es)): {steps} steps", flush=True)
        t0 = time.perf_counter()
        ep_cfg = replace(cfg, parallel=ParallelConfig(ep=d), micro_batch_size=1,
                         global_batch_size=r_mb * cl.world_size)
        ep = run(ep_cfg, cl.world_size, timeout_s=3600)
        runs["Megatron EP"] = {"emulation": ep.emulation, "predicted_step_s": ep_pred.step_time_s,
                               "wall_s": time.perf_counter() - t0}
        print(f"  {validity_line('Megatron EP', ep.emulation)}; {time.perf_counter() - t0:.0f} s", flush=True)

    tokens = global_batch * seq_len
    rows = []
    for name, r in runs.items():
        rep = r["emulation"]
        step = rep["measured_step_s"]
        rows.append({"strategy": name, "valid": bool(rep["valid"]), "overrun": rep["overrun"],
                     "invalid_reason": rep["invalid_reason"], "measured_step_s": step,
                     "tokens_per_s": tokens / step if step else None,
                     "predicted_step_s": r["predicted_step_s"],
                     "predicted_tokens_per_s": tokens / r["predicted_step_s"],
                     "difference": step / r["predicted_step_s"] - 1 if step else None})
    by = {r["strategy"]: r for r in rows}

    def gain(a: str, b: str, key: str = "tokens_per_s"):
        if a not in by or b not in by:
            return None
        x, y = by[a][key], by[b][key]
        return x / y if x and y else None

    cl_run = runs["closed loop"]
    moves = [{k: m.get(k) for k in ("iteration", "experts", "bytes", "gather_s", "exchange_s", "rebuild_s",
                                     "seconds", "reason", "predicted_s_now", "predicted_s_new", "estimated_cost_s",
                                     "step_s")} for m in cl_run["result"].moves]
    moved_total = plan_moves(plan, cl_run["final_plan"])
    for m in moves:  # what it would cost on the emulated cluster (Emulator.move_seconds: an estimate)
        m["emulated_estimate_s"] = em.move_seconds(m["experts"] * len(plan.groups))
    summary = {
        "cluster": cluster, "emulated_model": shape.name, "num_experts": num_experts, "topk": topk,
        "aux_loss": None if expert_bias else aux_loss, "expert_bias": expert_bias,
        "router": {"load_balancing": shape.moe_router_load_balancing_type,
                   "score_function": shape.moe_router_score_function,
                   "expert_bias_update_rate": shape.moe_router_bias_update_rate if expert_bias else None},
        "seq_len": seq_len, "global_batch": global_batch, "steps": steps,
        "timed_steps": measure_steps, "emulation_slack": slack, "max_step_seconds": max_step_seconds,
        "replan_interval": replan_interval, "replan_margin": replan_margin,
        "plan": {"attention_ranks": plan.attention_ranks, "expert_ranks": plan.expert_ranks,
                 "R": plan.num_microbatches, "schedule": plan.schedule},
        "skew_timed": {n: runs[n]["timed_load"].max_over_mean() for n in ("static", "closed loop")},
        "skew_whole_run": {n: runs[n]["whole_load"].max_over_mean() for n in ("static", "closed loop")},
        "rows": rows,
        "gain_closed_loop_over_static": gain("closed loop", "static"),
        "predicted_gain_closed_loop_over_static": gain("closed loop", "static", "predicted_tokens_per_s"),
        "gain_static_over_megatron_ep": gain("static", "Megatron EP"),
        "gain_closed_loop_over_megatron_ep": gain("closed loop", "Megatron EP"),
        "moves": moves, "stays": list(cl_run["result"].stays), "experts_moved_vs_start": len(moved_total),
        "predicted_balanced_step_s": {n: runs[n]["predicted_balanced_step_s"] for n in ("static", "closed loop")},
        "emulation": {n: {k: v for k, v in runs[n]["emulation"].items() if k != "steps"} for n in runs},
        "wall_s": time.perf_counter() - t_start,
    }
    (out / "closed_loop.json").write_text(json.dumps(summary, indent=1, default=str))

    print(f"\nmeasured skew, max/mean tokens per expert per MoE layer (timed steps): static "
          f"{_fmt(summary['skew_timed']['static'])}, closed loop {_fmt(summary['skew_timed']['closed loop'])}; "
          f"whole run: {_fmt(summary['skew_whole_run']['static'])}")
    print(f"{'strategy':<12} {'valid':<6} {'step s':>8} {'tokens/s':>9} {'simulated s':>11} {'diff':>7}")
    for r in rows:
        step = f"{r['measured_step_s']:.3f}" if r["measured_step_s"] else "-"
        tps = f"{r['tokens_per_s']:,.0f}" if r["tokens_per_s"] else "-"
        diff = f"{r['difference']:+.1%}" if r["difference"] is not None else "-"
        print(f"{r['strategy']:<12} {'yes' if r['valid'] else 'NO':<6} {step:>8} {tps:>9} "
              f"{r['predicted_step_s']:>11.3f} {diff:>7}")
    for r in rows:
        if not r["valid"]:
            print(f" {r['strategy']}: emulation INVALID: {r['invalid_reason']}")
    g1, p1 = summary["gain_closed_loop_over_static"], summary["predicted_gain_closed_loop_over_static"]
    print(f"closed loop / static: {g1:.3f}x measured, {p1:.3f}x simulated" if g1 else "closed loop / static: -")
    for n in ("static", "closed loop"):
        gx = summary[f"gain_{n.replace(' ', '_')}_over_megatron_ep"]
        print(f"{n} / Megatron EP: {gx:.3f}x measured" if gx else f"{n} / Megatron EP: -")
    for m in moves:
        print(f"move at iteration {m['iteration']}: {m['experts']} expert(s) of group 0, {m['bytes'] / 2**20:.2f} MiB "
              f"in {m['seconds']:.3f} s on the CPU ranks (tiny widths; on the emulated cluster about "
              f"{m['emulated_estimate_s']:.2f} s); predicted s/step {m['predicted_s_now']:.4g} -> "
              f"{m['predicted_s_new']:.4g} ({m['reason']})")
    for st in summary["stays"]:  # the decisions that did not move, with the rule's reason
        print(f"stayed at iteration {st['iteration']}: {st['reason']}")
    if not moves:
        print("no move made")
    print(f"bench took {summary['wall_s']:.0f} s; {out / 'closed_loop.json'}")
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out-dir", default="closed-loop-out")
    p.add_argument("--steps", type=int, default=60, help="training steps of each strategy")
    p.add_argument("--measure-steps", type=int, default=3, help="timed steps at the end of each run")
    p.add_argument("--replan-interval", type=int, default=20, help="the closed loop's --hetero-replan-interval")
    p.add_argument("--replan-margin", type=float, default=2.0, help="its --hetero-replan-margin")
    p.add_argument("--cluster", default="mini-2a40-2v100")
    p.add_argument("--model", default="w1", help="the emulated shape, its experts and top-k replaced")
    p.add_argument("--num-experts", type=int, default=32)
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--moe-ffn", type=int, default=None,
                   help="the emulated experts' FFN width (default: the shape's expert parameters split over them)")
    p.add_argument("--aux-loss", type=float, default=1e-3, help="the load-balancing loss's coefficient")
    p.add_argument("--expert-bias", action="store_true",
                   help="aux-loss-free balancing instead of the loss: load balancing none, sigmoid scores, the "
                        "expert bias at Megatron's update rate (1e-3)")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--max-step-seconds", type=float, default=30.0,
                   help="the longest real step the calibration may stretch the emulated step to")
    p.add_argument("--target-overrun", type=float, default=None,
                   help="what the calibration aims the delays at, a fraction of the step (default: the "
                        "emulation's 1 %%; lower gives a loaded machine slack; the validity limit stays 3 %%)")
    p.add_argument("--work-margin", type=float, default=None,
                   help="the calibration plans for real work this much longer than measured (default: 1.5)")
    a = p.parse_args(argv)
    if not 1 <= a.measure_steps <= a.steps - 2 or a.replan_interval < 1:
        p.error(f"--measure-steps {a.measure_steps} must be in 1..steps - 2 and --replan-interval >= 1")
    run_bench(a.out_dir, a.steps, a.measure_steps, a.replan_interval, a.replan_margin, a.cluster, a.model,
              a.num_experts, a.topk, a.moe_ffn, a.aux_loss, a.seq_len, a.global_batch, a.max_step_seconds,
              a.expert_bias, a.target_overrun, a.work_margin)
    return 0


if __name__ == "__main__":
    sys.exit(main())
