"""Step time of a zebra run with each issuer next to Megatron EP's, on forked CPU ranks.

    .venv/bin/python scripts/bench_issuer.py [--model tiny] [--attention 2 --expert 2] [--rounds 3]

Each round runs Megatron EP (the parity reference: the attention ranks' count, EP = gcd of it and
the expert count, the same global batch), then zebra with the threaded issuer, then with the
single issuer; rounds interleave the three so that load from elsewhere on the machine falls on
all of them. A run's first `--warmup` steps are dropped; each line gives the median and the
20th percentile over the rest of every round, and their ratios to Megatron EP's. Load from
elsewhere only adds time to a step, so on a shared machine the low percentile is the steadier
measure of what a step costs.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", help="model config (a configs/models name or a YAML path)")
    p.add_argument("--attention", type=int, default=2, help="attention ranks (M)")
    p.add_argument("--expert", type=int, default=2, help="expert ranks (N)")
    p.add_argument("--microbatches", type=int, default=2, help="microbatches per step (R)")
    p.add_argument("--steps", type=int, default=12, help="training steps per run")
    p.add_argument("--warmup", type=int, default=2, help="first steps of each run left out of the median")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the three runs")
    p.add_argument("--ep-ranks", type=int, default=None,
                   help="Megatron EP's ranks (default: the attention ranks, as the parity reference; "
                        "M + N: as many processes as the zebra run)")
    a = p.parse_args(argv)
    if a.steps <= a.warmup:
        p.error(f"--steps {a.steps} must exceed --warmup {a.warmup}")

    import megatron.core  # noqa: F401  - import once, then fork ranks

    from megatron_hetermoe.config import HeteroRunConfig, ModelConfig, ParallelConfig, TrainConfig
    from megatron_hetermoe.plan.hetero_plan import even_plan
    from megatron_hetermoe.training.args import run

    model = ModelConfig.load(a.model)
    plan = even_plan(model.num_layers, model.num_experts, a.attention, a.expert, num_microbatches=a.microbatches,
                     schedule="zebra")
    gbs = plan.num_microbatches * a.attention
    cfg = TrainConfig(model, ParallelConfig(), micro_batch_size=1, global_batch_size=gbs, train_iters=a.steps,
                      quiet=True)
    ep_ranks = a.ep_ranks or a.attention
    if gbs % ep_ranks:
        p.error(f"--ep-ranks {ep_ranks} must divide the global batch {gbs} (R x attention ranks)")
    ep = math.gcd(ep_ranks, model.num_experts)  # as tools/parity.reference_ep for the attention ranks
    runs = {
        f"megatron EP (ep={ep}, {ep_ranks} ranks)": lambda: run(
            dataclasses.replace(cfg, parallel=ParallelConfig(ep=ep)), ep_ranks),
        "zebra threads": lambda: run(cfg, plan.world_size, plan=plan, hetero=HeteroRunConfig(zebra_issuer="threads")),
        "zebra single": lambda: run(cfg, plan.world_size, plan=plan, hetero=HeteroRunConfig(zebra_issuer="single")),
    }
    times: dict[str, list[float]] = {k: [] for k in runs}
    for r in range(a.rounds):
        for name, fn in runs.items():
            got = fn().step_times[a.warmup:]
            times[name] += got
            print(f"round {r}: {name}: median {statistics.median(got) * 1e3:.2f} ms", file=sys.stderr, flush=True)
    def p20(ts: list[float]) -> float:
        return statistics.quantiles(ts, n=5)[0]

    ref = next(iter(times.values()))
    base, base20 = statistics.median(ref), p20(ref)
    print(f"{a.attention}+{a.expert} R={a.microbatches} model {a.model}, {a.rounds} rounds x "
          f"{a.steps - a.warmup} steps: median, 20th percentile")
    for name, ts in times.items():
        m, q = statistics.median(ts), p20(ts)
        print(f"  {name:32s} {m * 1e3:8.2f} ms {m / base:6.3f}x   {q * 1e3:8.2f} ms {q / base20:6.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
