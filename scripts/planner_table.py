"""Predicted step of every strategy at the largest global batch all of them fit, per sequence length.

    python scripts/planner_table.py [--cluster o1] [--model d1] [--seqs 4096,8192,16384,20480,32768]
                                    [--max-batch 768] [--markdown]

For each sequence length the global batch runs over multiples of the batch every strategy can
split (lcm of the world size and the GPU counts per type) and stops at the first one where some
strategy no longer fits (the planner's report says which, and why). Two tables: the last batch
before that stop, and the last batch at which no strategy has yet lost a layout it could use
at the smallest batch (detail["excluded_layouts"] grew: it fits only in a fallback layout).
Ratios are HeterMoE's throughput over each baseline's; the Asym-EA gain is
zebra without Asym-EA's step over HeterMoE's. Layouts a strategy could not use at that batch
(detail["excluded_layouts"]) are listed under the table: a large Asym-EA gain there means the
V100s cannot hold all experts next to zebra's live activations, not a scheduling win.
"""
from __future__ import annotations

import argparse
import math
import sys

from megatron_hetermoe.config import ModelConfig
from megatron_hetermoe.planner.cluster import Cluster
from megatron_hetermoe.planner.search import (
    DISTEP,
    PICK,
    ZEBRA,
    ZEBRA_NO_EA,
    Prediction,
    search,
)

STRATEGIES = (PICK, ZEBRA, ZEBRA_NO_EA, DISTEP, "EP", "EP (Ideal)", "Hetero PP")
SHORT = {PICK: "HeterMoE", ZEBRA: "Zebra+EA", ZEBRA_NO_EA: "Zebra", DISTEP: "DistEP", "EP": "EP",
         "EP (Ideal)": "EP(Ideal)", "Hetero PP": "HeteroPP"}


def _exclusions(res: dict[str, Prediction]) -> set[tuple[str, str]]:
    return {(n, k) for n in STRATEGIES for k in (res[n].detail.get("excluded_layouts") or {})}


def largest_common_batches(model: ModelConfig, cluster: Cluster, seq_len: int, max_batch: int) -> dict:
    """Scan multiples of the batch unit up to the first batch where some strategy in STRATEGIES
    does not fit. Returns {"all_fit": (batch, predictions), "first_choice": (batch, predictions),
    "stop": why the scan stopped}: all_fit is the last batch before that stop; first_choice is
    the last batch before the first one where some strategy loses a layout it could use at the
    smallest batch (it still fits, in a fallback layout, e.g. zebra without Asym-EA on V100
    attention once V100s cannot hold their experts)."""
    unit = math.lcm(cluster.world_size, *cluster.counts().values())
    out = {"all_fit": (0, {}), "first_choice": (0, {}), "stop": f"reached --max-batch {max_batch}"}
    base: set | None = None
    first_choice_open = True
    for batch in range(unit, max_batch + 1, unit):
        res = search(model, cluster, seq_len, batch).by_name()
        bad = [n for n in STRATEGIES if not res[n].fits]
        if bad:
            why = "; ".join(f"{n} ({res[n].detail.get('reason', '')})" for n in bad)
            out["stop"] = f"at {batch}: {why}"
            break
        exc = _exclusions(res)
        base = exc if base is None else base
        first_choice_open = first_choice_open and exc <= base
        out["all_fit"] = (batch, res)
        if first_choice_open:
            out["first_choice"] = (batch, res)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cluster", default="o1")
    p.add_argument("--model", default="d1")
    p.add_argument("--seqs", default="4096,8192,16384,20480,32768")
    p.add_argument("--max-batch", type=int, default=768, help="stop the batch scan here")
    p.add_argument("--markdown", action="store_true", help="print a markdown table")
    args = p.parse_args(argv)
    try:
        seqs = [int(s) for s in args.seqs.split(",")]
    except ValueError:
        print(f"planner_table: --seqs {args.seqs!r} must be comma-separated integers, e.g. 4096,8192", file=sys.stderr)
        return 2
    model, cluster = ModelConfig.load(args.model), Cluster.load(args.cluster)
    head = (["seq", "batch"] + [SHORT[n] + " s" for n in STRATEGIES]
            + ["/EP", "/EP(Ideal)", "/DistEP", "/HeteroPP", "Asym-EA gain"])
    tables: dict[str, list[list[str]]] = {"all_fit": [], "first_choice": []}
    notes = []
    for S in seqs:
        scan = largest_common_batches(model, cluster, S, args.max_batch)
        notes.append(f"{S}: batch scan stopped {scan['stop']}")
        for kind in tables:
            batch, res = scan[kind]
            if not batch:
                notes.append(f"{S} ({kind}): no batch fits every strategy")
                continue
            t = {n: res[n].step_time_s for n in STRATEGIES}
            h = t[PICK]
            tables[kind].append([str(S), str(batch)] + [f"{t[n]:.2f}" for n in STRATEGIES]
                                + [f"{t[n] / h:.2f}x" for n in ("EP", "EP (Ideal)", DISTEP, "Hetero PP")]
                                + [f"{t[ZEBRA_NO_EA] / h:.2f}x"])
            for n in STRATEGIES:
                for layout, why in (res[n].detail.get("excluded_layouts") or {}).items():
                    notes.append(f"{S}, batch {batch} ({kind}), {n}: cannot use '{layout}': {why}")
    titles = {"all_fit": "largest batch at which every strategy fits (some may run a fallback layout)",
              "first_choice": "largest batch at which every strategy still fits its first-choice layout"}
    for kind, rows in tables.items():
        print(f"\n{titles[kind]}:")
        if args.markdown:
            print("| " + " | ".join(head) + " |")
            print("|" + "---|" * len(head))
            for r in rows:
                print("| " + " | ".join(r) + " |")
        else:
            w = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]
            print("  ".join(h.rjust(x) for h, x in zip(head, w)))
            for r in rows:
                print("  ".join(c.rjust(x) for c, x in zip(r, w)))
    print(f"\n{model.name} on {cluster.name}; step times in seconds (predicted); ratios = HeterMoE's "
          f"throughput over the baseline's.")
    for n in notes:
        print("  " + n)
    return 0


if __name__ == "__main__":
    sys.exit(main())
