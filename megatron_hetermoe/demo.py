"""The CPU demo (`make demo`): HeterMoE on an emulated 2 A40 + 2 V100 cluster.

1. Real text that ships with Python (its documentation topics) is tokenized with a BPE trained
   on it and written as a Megatron indexed dataset.
2. The planner picks the layout for the emulated cluster and model shape (Paper's W1 at 4K
   tokens): which GPUs run attention, R, and which experts move to the attention GPUs.
3. Four CPU ranks, each playing its GPU, train a tiny Mixtral-style model (W1's layers and
   experts at tiny widths) on that text with zebra + Asym-EA; the loss falls.
4. Plain Megatron EP runs on the same emulated cluster, timed by the same rules; the demo
   prints both throughputs (tokens/s of the emulated model) and their ratio, next to the
   simulator's prediction, and writes the timeline picture of the last HeterMoE step.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path


def _hetero_rank(rank, world, cfg, plan, run_dir):
    from .hetero_trainer import train_hetero

    return train_hetero(cfg, plan, schedule="zebra", run_dir=run_dir)


def run_demo(out_dir: str = "demo-out", steps: int = 150, ep_steps: int = 15, step_seconds: float = 0.8,
             cluster: str = "mini-2a40-2v100", emulated: str = "w1", seq_len: int = 4096,
             global_batch: int = 16) -> dict:
    import megatron.core  # noqa: F401  - import once, then fork the ranks

    from . import corpus
    from .data import DataConfig
    from .emulation import EmulationSpec, Emulator, emulation_real_model
    from .launcher import launch
    from .model_builder import ParallelConfig
    from .model_config import ModelConfig
    from .planner.cluster import Cluster
    from .planner.search import search
    from .timeline import draw_png, load_events
    from .trainer import TrainConfig, run

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
    res = search(shape, cl, seq_len, global_batch, max_microbatches=4)
    plan = res.plan
    plan.save(out / "plan.json")
    g = plan.groups[0]
    print(f"      attention: ranks {g.attention_ranks} ({plan.gpu_types[g.attention_ranks[0]]}), experts: ranks "
          f"{g.expert_ranks} ({plan.gpu_types[g.expert_ranks[0]]}), R={plan.num_microbatches}, experts moved to "
          f"attention GPUs per layer: {plan.experts_on_attention_per_layer()} ({plan.meta['assignment']})")
    base = EmulationSpec(cluster, emulated, seq_len, global_batch)
    pred = Emulator(base).predict_hetero(plan, "zebra")
    spec = replace(base, scale=step_seconds / pred.step_time_s)
    em = Emulator(spec)
    real = emulation_real_model(shape, hidden=64, seq_length=64).replace(vocab_size=1024)
    n_attn = len(plan.attention_ranks)
    mbs = 2
    cfg = TrainConfig(real, ParallelConfig(), micro_batch_size=mbs, global_batch_size=mbs * plan.num_microbatches * n_attn,
                      train_iters=steps, lr=3e-3, min_lr=3e-4, lr_warmup_iters=10, log_interval=10,
                      emulate=spec, data=data, progress_bar=True)

    print(f"[3/4] HeterMoE (zebra + Asym-EA) trains {steps} steps on {cl.world_size} CPU ranks "
          f"(1 emulated second = {spec.scale:.2f} s here)", flush=True)
    tl = out / "timeline"
    het = launch(_hetero_rank, cl.world_size, cfg, plan, str(tl), timeout_s=1800)[0]
    h_step = statistics.median(het["step_times"][1:])

    ep_pred = em.predict_ep()
    d, r_mb = ep_pred.detail["ep_size"], ep_pred.detail["microbatches"]
    print(f"[4/4] plain Megatron EP (EP={d}, {r_mb} microbatch(es)) on the same emulated cluster, {ep_steps} steps",
          flush=True)
    ep_cfg = replace(cfg, parallel=ParallelConfig(ep=d), micro_batch_size=1, global_batch_size=r_mb * cl.world_size,
                     train_iters=ep_steps, quiet=True, progress_bar=False)
    ep = run(ep_cfg, cl.world_size, timeout_s=900)
    e_step = statistics.median(ep["step_times"][1:])

    tokens = global_batch * seq_len
    h_tps, e_tps = tokens / (h_step / spec.scale), tokens / (e_step / spec.scale)
    last = max(e.step for e in load_events(tl))
    draw_png(load_events(tl), out / "timeline.png", step=last,
             title=f"HeterMoE zebra + Asym-EA, {emulated.upper()} on {cluster} (step {last + 1})")
    first10, last10 = statistics.mean(het["losses"][:10]), statistics.mean(het["losses"][-10:])
    summary = {
        "loss_first10": first10, "loss_last10": last10,
        "hetermoe_tokens_per_s": h_tps, "megatron_ep_tokens_per_s": e_tps, "speedup": h_tps / e_tps,
        "predicted_speedup": ep_pred.step_time_s / pred.step_time_s,
        "hetermoe_step_s": h_step / spec.scale, "megatron_ep_step_s": e_step / spec.scale,
        "wall_s": time.perf_counter() - t_start,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"\nlm loss: {first10:.3f} (mean of the first 10 steps) -> {last10:.3f} (last 10)")
    print(f"emulated {emulated.upper()} step: HeterMoE {summary['hetermoe_step_s']:.3f} s, Megatron EP "
          f"{summary['megatron_ep_step_s']:.3f} s")
    print(f"tokens/s: HeterMoE {h_tps:,.0f} vs Megatron EP {e_tps:,.0f} -> {summary['speedup']:.2f}x "
          f"(simulator predicts {summary['predicted_speedup']:.2f}x)")
    print(f"timeline: {out / 'timeline.png'}  (hetermoe timeline {tl} for the Chrome trace)")
    print(f"demo took {summary['wall_s']:.0f} s")
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--out-dir", default="demo-out")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--ep-steps", type=int, default=15)
    p.add_argument("--step-seconds", type=float, default=0.8, help="real seconds per HeterMoE step")
    a = p.parse_args(argv)
    run_demo(a.out_dir, a.steps, a.ep_steps, a.step_seconds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
