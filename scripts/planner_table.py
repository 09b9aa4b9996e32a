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

    python scripts/planner_table.py --flagships [--megatron-lm DIR] [--only NAME,...] [--markdown]

The real-size table of docs/flagship-plans.md (issue 42 item 5): for each flagship model,
`hetermoe plan --cluster CLUSTER --json -- <the recipe's own flags>` (the flags read from the
Megatron-LM tree's recipe as tests/training/test_megatron_lm_recipes.py reads them, DIR or
$MEGATRON_LM_DIR, with FLAGSHIPS' additions: the vocabulary the recipe's tokenizer gives, the
global batch the modelopt confs leave to their launch scripts, and the few changes each entry
names), and a row: the pick, its memory per GPU type, its step against Megatron EP at its best
TP/PP/EP, the compute-only limit, the network floor and their roofline, and what bounds it.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

from megatron_hetermoe.config import ModelConfig
from megatron_hetermoe.planner.cli_plan import main as plan_main
from megatron_hetermoe.planner.cluster import Cluster
from megatron_hetermoe.planner.search import (
    DISTEP,
    LIMIT_ROWS,
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


# ---------------------------------------------------------------- the flagship table (issue 42 item 5)
CONF = "examples/post_training/modelopt/conf"
MIXTRAL = "examples/mixtral/train_mixtral_8x7b_distributed.sh"
# Mixtral 8x22B's shape (its released config.json), as examples/mixtral/README.md says to set on the
# 8x7B script: hidden 6144, 56 layers, 48 heads in 8 query groups, ffn 16384, vocabulary 32768.
MIXTRAL_8X22B = {"--num-layers": "56", "--hidden-size": "6144", "--num-attention-heads": "48",
                 "--ffn-hidden-size": "16384"}


FULL_RECOMPUTE = ("--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1")
SELECTIVE = {"--recompute-activations": 0, "--moe-layer-recompute": 0}


@dataclass(frozen=True)
class Flagship:
    """One row: the recipe's flags (`recipe`, a path in the Megatron-LM tree) with `drop` removed
    (flag -> how many values follow it), `replace` applied and `add` appended, planned on `cluster`
    at `global_batch` sequences per step; `why` says why each change is there."""
    name: str
    recipe: str
    cluster: str
    global_batch: int
    add: tuple[str, ...] = ()
    drop: dict[str, int] = field(default_factory=dict)
    replace: dict[str, str] = field(default_factory=dict)
    why: str = ""


FLAGSHIPS = (
    Flagship("DeepSeek-V3", f"{CONF}/deepseek-ai/DeepSeek-R1.sh", "mixed-h100-a100-960", 960,
             ("--padded-vocab-size", "129280", "--mtp-num-layers", "1"),
             why="DeepSeek-R1's conf is DeepSeek-V3's architecture; V3's recipe adds one MTP layer; its tokenizer "
                 "has 129280 ids (a multiple of the conf's 1280)"),
    Flagship("DeepSeek-V3 (no MTP; full recompute)", f"{CONF}/deepseek-ai/DeepSeek-R1.sh", "mixed-h100-a100-960", 960,
             ("--padded-vocab-size", "129280", *FULL_RECOMPUTE), drop=SELECTIVE,
             why="DeepSeek-R1's conf as it is (no MTP layer: zebra may run it), its selective recomputation "
                 "replaced by full"),
    Flagship("Kimi-K2", f"{CONF}/moonshotai/Kimi-K2-Instruct.sh", "mixed-h100-a100-960", 960,
             drop={"--trust-remote-code": 0}, why="--trust-remote-code is the modelopt script's (tokenizer loading)"),
    Flagship("Kimi-K2 (full recompute)", f"{CONF}/moonshotai/Kimi-K2-Instruct.sh", "mixed-h100-a100-960", 960,
             FULL_RECOMPUTE, drop={"--trust-remote-code": 0, **SELECTIVE},
             why="the conf's selective recomputation replaced by full (zebra recomputes each attention stage; "
                 "Megatron refuses --moe-layer-recompute with it)"),
    Flagship("Qwen3-235B-A22B", f"{CONF}/Qwen/Qwen3-235B-A22B.sh", "mixed-1024", 1024,
             ("--padded-vocab-size", "151936"), why="Qwen3's tokenizer pads to 151936"),
    Flagship("Qwen3-235B-A22B (full recompute)", f"{CONF}/Qwen/Qwen3-235B-A22B.sh", "mixed-1024", 1024,
             ("--padded-vocab-size", "151936", *FULL_RECOMPUTE), drop=SELECTIVE,
             why="the conf's selective recomputation replaced by full"),
    Flagship("Qwen3-30B-A3B", f"{CONF}/Qwen/Qwen3-30B-A3B.sh", "mixed-h100-a100", 384,
             ("--padded-vocab-size", "151936"), why="Qwen3's tokenizer pads to 151936"),
    Flagship("DeepSeek-V2-Lite", f"{CONF}/deepseek-ai/DeepSeek-V2-Lite.sh", "h100x16-v100x16", 256,
             ("--padded-vocab-size", "102400"), why="DeepSeek-V2-Lite's tokenizer has 102400 ids"),
    Flagship("Mixtral-8x7B", MIXTRAL, "h100x16-v100x16", 256, ("--padded-vocab-size", "32000"),
             why="Mixtral's tokenizer has 32000 ids; the script's own TP 1, PP 4, EP 8, micro batch 1 and global "
                 "batch 256"),
    Flagship("Mixtral-8x7B (full recompute; layout searched)", MIXTRAL, "h100x16-v100x16", 256,
             ("--padded-vocab-size", "32000", *FULL_RECOMPUTE),
             drop={"--tensor-model-parallel-size": 1, "--pipeline-model-parallel-size": 1, "--micro-batch-size": 1},
             why="the script's TP, PP and micro batch left to the search, full recomputation added"),
    Flagship("Mixtral-8x22B", MIXTRAL, "mixed-h100-a100", 384, ("--padded-vocab-size", "32768"),
             replace=MIXTRAL_8X22B,
             why="the 8x7B script with 8x22B's shape (examples/mixtral/README.md); its tokenizer has 32768 ids; "
                 "global batch 384 (a multiple of the 192 GPUs Megatron EP splits it over)"),
    Flagship("GPT-OSS-120b", f"{CONF}/openai/gpt-oss-120b.sh", "mixed-h100-a100", 384,
             ("--position-embedding-type", "rope"), drop={"--enable-gpt-oss": 0, "--export-force-local-attention": 0},
             why="--enable-gpt-oss and --export-force-local-attention are the modelopt script's, "
                 "not pretrain_gpt.py's; --enable-gpt-oss sets YaRN RoPE, which pretrain_gpt.py's "
                 "--position-embedding-type does not offer: rope (the same parameters and FLOPs)"),
)


def recipe_flags(tree: Path, path: str) -> list[str]:
    """The flags a recipe passes to pretrain_gpt.py: the bash arrays of Mixtral's script (model, MoE,
    training, model-parallel) or the MODEL_ARGS string of a modelopt conf (as
    tests/training/test_megatron_lm_recipes.py reads them)."""
    text = (tree / path).read_text()
    arrays = [m.group(1) for name in ("MODEL_ARGS", "MOE_ARGS", "TRAINING_ARGS", "MODEL_PARALLEL_ARGS")
              for m in [re.search(rf"^{name}=\((.*?)^\)", text, re.DOTALL | re.MULTILINE)] if m]
    strings = [m.group(1) for m in [re.search(r'^MODEL_ARGS="(.*?)"', text, re.DOTALL | re.MULTILINE)] if m]
    flags = [t for part in arrays + strings for t in shlex.split(part.replace("\\\n", " "))]
    if not flags or not flags[0].startswith("--"):
        raise SystemExit(f"planner_table: {tree / path} gives no flags (MODEL_ARGS ...)")
    return flags


def flagship_flags(f: Flagship, tree: Path) -> list[str]:
    out, flags, i = [], recipe_flags(tree, f.recipe), 0
    while i < len(flags):
        t = flags[i]
        if t in f.drop:
            i += 1 + f.drop[t]
            continue
        if t in f.replace:
            out += [t, f.replace[t]]
            i += 2
            continue
        out.append(t)
        i += 1
    return out + list(f.add) + ["--global-batch-size", str(f.global_batch)]


def plan_json(cluster: str, flags: list[str]) -> tuple[dict | None, str]:
    """`hetermoe plan --cluster CLUSTER --json -- FLAGS`: its JSON (None if it refused) and its stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = plan_main(["--cluster", cluster, "--json", "--", *flags])
    return (json.loads(out.getvalue()) if code in (0, 1) and out.getvalue().strip() else None), err.getvalue()


def _gib(mem: dict | None) -> str:
    if not mem:
        return "-"
    return f"{mem['GiB']:.0f}/{mem['usable_GiB']:.0f} GiB {mem['gpu']}"


def flagship_row(f: Flagship, tree: Path) -> dict:
    """One table row (strings) and the notes behind it."""
    d, err = plan_json(f.cluster, flagship_flags(f, tree))
    row = {"model": f.name, "cluster": f.cluster, "batch": str(f.global_batch), "notes": [f.why] if f.why else []}
    if d is None:
        row["pick"] = "refused: " + err.strip().splitlines()[-1]
        return row
    s = d["strategies"]
    pick, meg = s["HeterMoE (planner's pick)"], s["Megatron EP (best TP/PP)"]
    limit, net, roof = (s[n] for n in LIMIT_ROWS)
    if pick["fits"]:
        p = pick["detail"]
        ea = sum(p["experts_on_attention_per_layer"])
        row["pick"] = (f"{p['schedule']}, attention on {p['attention_gpu']}: {p['groups']} x ({p['M']} + {p['N']}) "
                       f"per stage, TP {p['attention_tp']}, P {p['pipeline_stages']}, R {p['microbatches']}"
                       + (f", {p['zebra_waves']} waves" if p["zebra_waves"] > 1 else "")
                       + (f", Asym-EA {ea} experts" if ea else "") + f", experts keep {p['expert_recompute']}")
        row["memory"] = f"attn {_gib(p['memory'].get('attention'))}; exp {_gib(p['memory'].get('expert'))}"
        row["step"] = f"{pick['step_time_s']:.2f}"
        row["vs roofline"] = f"{pick['ratio_to_limit']:.2f}"
    else:
        row["pick"] = "no plan fits: " + str(pick["detail"].get("reason"))
        row["notes"] += [f"{k}: {v}" for k, v in sorted(pick["detail"].get("excluded_layouts", {}).items())]
    if meg["fits"]:
        m = meg["detail"]
        row["megatron"] = f"{meg['step_time_s']:.2f} (TP {m['tp']}, PP {m['pp']}, EP {m['ep_size']})"
        if pick["fits"]:
            row["speedup"] = f"{meg['step_time_s'] / pick['step_time_s']:.2f}x"
    else:
        row["megatron"] = "does not fit"
        row["notes"].append(f"Megatron EP (TP in 1, 2, 4, 8 and PP in 1, 2, 4, 8 dividing the MoE layers): "
                            f"{str(meg['detail'].get('reason'))[:400]}")
    row["limits"] = f"{limit['step_time_s']:.2f} / {net['step_time_s']:.2f} / {roof['step_time_s']:.2f}"
    row["bound"] = roof["detail"].get("bound_by", "")
    row["search_s"] = f"{d['search']['elapsed_s']:.1f}"
    row["notes"] += [line.removeprefix("hetermoe plan: note: ") for line in err.splitlines() if "note:" in line]
    return row


FLAGSHIP_HEAD = ("model", "cluster", "batch", "pick", "memory", "step", "megatron", "speedup", "limits", "vs roofline",
                 "bound", "search_s")
FLAGSHIP_TITLES = ("model", "cluster", "global batch (x seq)", "HeterMoE pick", "memory per rank (peak/usable)",
                   "step s", "Megatron EP best (TP, PP, EP)", "vs Megatron",
                   "compute-only / layouts' floor / roofline s", "vs roofline", "bound by", "search s")


def megatron_lm_tree(arg: str | None) -> Path:
    tree = Path(arg or os.environ.get("MEGATRON_LM_DIR", ""))
    if not arg and not os.environ.get("MEGATRON_LM_DIR") or not (tree / CONF).is_dir():
        raise SystemExit(f"planner_table: --flagships reads the recipes of a Megatron-LM core_v0.16.1 tree: pass "
                         f"--megatron-lm DIR or set MEGATRON_LM_DIR ({tree or 'unset'} has no {CONF})")
    return tree


def flagships_main(args: argparse.Namespace) -> int:
    tree = megatron_lm_tree(args.megatron_lm)
    names = args.only.split(",") if args.only else [f.name for f in FLAGSHIPS]
    unknown = sorted(set(names) - {f.name for f in FLAGSHIPS})
    if unknown:
        print(f"planner_table: --only {','.join(unknown)}: use names of {[f.name for f in FLAGSHIPS]}", file=sys.stderr)
        return 2
    rows = [flagship_row(f, tree) for f in FLAGSHIPS if f.name in names]
    if args.markdown:
        print("| " + " | ".join(FLAGSHIP_TITLES) + " |")
        print("|" + "---|" * len(FLAGSHIP_TITLES))
        for r in rows:
            print("| " + " | ".join(r.get(k, "-") for k in FLAGSHIP_HEAD) + " |")
    else:
        for r in rows:
            print("  ".join(f"{t}: {r.get(k, '-')}" for t, k in zip(FLAGSHIP_TITLES, FLAGSHIP_HEAD)))
    for r in rows:
        for n in r["notes"]:
            print(f"  {r['model']}: {n}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cluster", default="o1")
    p.add_argument("--model", default="d1")
    p.add_argument("--seqs", default="4096,8192,16384,20480,32768")
    p.add_argument("--max-batch", type=int, default=768, help="stop the batch scan here")
    p.add_argument("--markdown", action="store_true", help="print a markdown table")
    p.add_argument("--flagships", action="store_true", help="the real-size table of the flagship recipes instead")
    p.add_argument("--megatron-lm", help="with --flagships: the Megatron-LM tree (default $MEGATRON_LM_DIR)")
    p.add_argument("--only", help="with --flagships: comma-separated names of FLAGSHIPS")
    args = p.parse_args(argv)
    if args.flagships:
        return flagships_main(args)
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
