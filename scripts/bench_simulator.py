"""Speed of the simulator's C++ core against the Python reference on the same problems.

    python scripts/bench_simulator.py [--repeats 5]

Builds step problems (task lists + durations) for a few plan shapes, runs both engines on each,
checks they agree, and prints the time of each and the ratio.
"""
from __future__ import annotations

import argparse
import time

from megatron_hetermoe.config import ModelConfig
from megatron_hetermoe.planner import asym_ea
from megatron_hetermoe.planner.cluster import Cluster
from megatron_hetermoe.planner.cost_model import CostModel, TrainSettings
from megatron_hetermoe.planner.profiles import load_profiles
from megatron_hetermoe.planner.search import asym_problem, build_plan
from megatron_hetermoe.planner.simulator import (
    build_problem,
    flat_arrays,
    have_cpp,
    run_cpp,
    run_python,
)


def cases():
    """(label, problem) for: O1/D1 one 6:6 group, and a 1024-GPU 64-layer 256-expert group."""
    out = []
    for model, cluster, S, B, G, R, dedup in (("d1", "o1", 4096, 48, 1, 8, False),
                                              ("moe-64l-256e", "mixed-1024", 4096, 1024, 32, 4, False),
                                              ("moe-64l-256e", "mixed-1024", 4096, 1024, 8, 4, True)):
        m, cl = ModelConfig.load(model), Cluster.load(cluster)
        cost = CostModel(m, load_profiles(set(cl.gpu_types())), TrainSettings(S))
        types = cl.gpu_types()
        a = [r for r, t in enumerate(types) if t == types[0]]
        x = [r for r, t in enumerate(types) if t != types[0]]
        M, N = len(a) // G, len(x) // G
        k = asym_ea.optimal(asym_problem(cost, types, a[:M], x[:N], G, R, B, forward_only=False))
        plan = build_plan(m, types, a, x, G, R, k, skeleton=True)
        p = build_problem(plan, cost, cl, B, dedup=dedup)
        tasks = sum(len(t) for t in p.tasks)
        out.append((f"{model} on {cluster}: {G} group(s) of {M}:{N}, R={R}, {len(p.tasks)} ranks simulated, "
                    f"{tasks} tasks", p))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    if not have_cpp():
        print("C++ core not built: run `python setup.py build_ext --inplace` (or pip install -e .)")
        return 1
    from megatron_hetermoe import _csim

    for label, p in cases():
        tp = min(_time(run_python, p) for _ in range(args.repeats))
        tc = min(_time(_fresh_cpp, p) for _ in range(args.repeats))  # incl. flattening and back to lists
        flat = flat_arrays(p)
        core = min(_time(lambda q: _csim.run(*flat), p) for _ in range(args.repeats))
        a, b = run_python(p), run_cpp(p)
        same = a.start == b.start and a.end == b.end and a.coll_end == b.coll_end
        print(f"{label}\n  python {tp * 1e3:8.3f} ms | C++ end to end {tc * 1e3:8.3f} ms ({tp / tc:5.1f}x) | "
              f"C++ core {core * 1e3:8.3f} ms ({tp / core:6.1f}x) | identical: {same}")
    return 0


def _fresh_cpp(p):
    p._flat = None  # as in the search: every problem is flattened once, then simulated once
    return run_cpp(p)


def _time(fn, p) -> float:
    t0 = time.perf_counter()
    fn(p)
    return time.perf_counter() - t0


if __name__ == "__main__":
    raise SystemExit(main())
