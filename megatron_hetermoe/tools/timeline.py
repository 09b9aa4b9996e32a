"""`hetermoe timeline RUN_DIR -o timeline.png`: draw the ranks' timelines (schedules/timeline.py
records them) as one row per (rank, lane, clock), and write timeline.json (Chrome trace format)
beside it for Perfetto. Each row names its clock: "host" (when the host ran or, on a CUDA rank,
enqueued the work) or "cuda" (when it ran on the GPU, from CUDA events); a CUDA rank running a
task list has rows of both. Where the run wrote its measured expert loads beside the timeline
(RUN_DIR/expert_load.json, training/expert_load_log.py), it prints them too: per MoE layer, each
expert's tokens over the layer's mean, and each rank's compute seconds per task kind.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from megatron_hetermoe.schedules.timeline import CLOCKS, Event, load_events
from megatron_hetermoe.vocabulary import TaskKind

LANES = ("compute", "dispatch", "combine")


def _row_key(lane: str, clock: str) -> tuple[int, int]:
    return (CLOCKS.index(clock) if clock in CLOCKS else len(CLOCKS),
            LANES.index(lane) if lane in LANES else len(LANES))


def row_label(lane: str, clock: str) -> str:
    return f"{lane} ({clock})"


def chrome_trace(events: list[Event]) -> dict:
    """Chrome trace events: a process per rank, a thread per (lane, clock) it recorded."""
    t0 = min(e.start for e in events)
    rows = sorted({(e.lane, e.clock) for e in events}, key=lambda x: _row_key(*x))
    tid = {row: i for i, row in enumerate(rows)}
    out = []
    for e in events:
        out.append({"name": f"{e.kind}(l{e.layer},mb{e.microbatch})", "cat": e.lane, "ph": "X",
                    "ts": (e.start - t0) * 1e6, "dur": max(e.end - e.start, 0.0) * 1e6,
                    "pid": e.rank, "tid": tid[(e.lane, e.clock)],
                    "args": {"step": e.step, "layer": e.layer, "microbatch": e.microbatch, "role": e.role,
                             "clock": e.clock}})
    for r in sorted({e.rank for e in events}):
        role = next(e.role for e in events if e.rank == r)
        out.append({"name": "process_name", "ph": "M", "pid": r, "args": {"name": f"rank {r} ({role})"}})
        for row in sorted({(e.lane, e.clock) for e in events if e.rank == r}, key=lambda x: _row_key(*x)):
            out.append({"name": "thread_name", "ph": "M", "pid": r, "tid": tid[row],
                        "args": {"name": row_label(*row)}})
    return {"traceEvents": out, "displayTimeUnit": "ms"}


_COLORS = {TaskKind.A_F: "#1f77b4", TaskKind.A_B: "#aec7e8", TaskKind.X_F: "#9467bd", TaskKind.X_B: "#c5b0d5",
           TaskKind.E_F: "#d62728", TaskKind.E_B: "#ff9896", TaskKind.D_F: "#2ca02c", TaskKind.C_B: "#98df8a",
           TaskKind.C_F: "#ff7f0e", TaskKind.D_B: "#ffbb78"}


def draw_png(events: list[Event], path: str | Path, step: int | None = None, title: str = "") -> None:
    from megatron_hetermoe import import_extra

    matplotlib = import_extra("matplotlib", "plot", "drawing a timeline PNG")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if step is not None:
        events = [e for e in events if e.step == step]
    t0 = min(e.start for e in events)
    rows = sorted({(e.rank, e.lane, e.clock) for e in events}, key=lambda x: (x[0], *_row_key(x[1], x[2])))
    fig, ax = plt.subplots(figsize=(14, 0.45 * len(rows) + 1.5))
    for i, (r, lane, clock) in enumerate(rows):
        for e in (e for e in events if e.rank == r and e.lane == lane and e.clock == clock):
            ax.broken_barh([((e.start - t0) * 1e3, max((e.end - e.start) * 1e3, 1e-3))], (i - 0.4, 0.8),
                           facecolors=_COLORS.get(e.kind, "gray"), edgecolor="black", linewidth=0.2)
    roles = {e.rank: e.role for e in events}
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"rank {r} {roles[r][:4]} {row_label(lane, clock)}" for r, lane, clock in rows], fontsize=8)
    ax.invert_yaxis()
    clocks = sorted({e.clock for e in events}, key=lambda c: _row_key("compute", c))
    ax.set_xlabel(f"time (ms; clock: {', '.join(clocks)})")
    ax.set_title(title or "HeterMoE timeline")
    ax.legend(handles=[Patch(color=c, label=k) for k, c in _COLORS.items()], ncol=10, fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def load_table(stats) -> str:
    """The per-expert load of a stats file (planner/expert_load.LoadStats) as text: per MoE layer,
    each expert's tokens over the layer's mean and the layer's max/mean; then each rank's compute
    seconds per task kind over the same steps."""
    load = stats.load
    first, last = stats.iterations
    lines = [f"expert load, iterations {first}-{last} ({stats.steps} steps): tokens per expert / the layer's mean"]
    for l in range(load.num_layers):
        m = load.multipliers(l)
        lines.append(f"  layer {l} (model layer {stats.model_layers[l]}): max/mean {max(m):.2f} | "
                     + " ".join(f"e{e} {x:.2f}" for e, x in enumerate(m)))
    for r, kinds in enumerate(stats.task_seconds):
        if kinds:
            lines.append(f"  rank {r} ({stats.roles[r]}, {stats.gpu_types[r]}): "
                         + " ".join(f"{k} {v:.3g} s" for k, v in sorted(kinds.items())))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from megatron_hetermoe.cli.timeline import build_parser

    p = build_parser()
    a = p.parse_args(argv)
    run_dir = Path(a.run_dir)
    if not run_dir.is_dir():
        p.error(f"{a.run_dir}: not a directory; give a --timeline-dir of hetermoe train / bench")
    if not list(run_dir.glob("timeline.rank*.json")):
        p.error(f"{a.run_dir}: holds no timeline.rank*.json; give the --timeline-dir of a finished "
                f"`hetermoe train --hetero-plan ... --timeline-dir DIR` (or bench) run")
    if a.output:
        from megatron_hetermoe.outputs import writable_file

        writable_file("-o/--output", a.output)
    try:
        events = load_events(a.run_dir)
    except (ValueError, TypeError) as e:  # not JSON, or not the recorder's events
        p.error(f"{a.run_dir}: a timeline.rank*.json is malformed ({type(e).__name__}: {e}); record it again")
    if not events:
        p.error(f"{a.run_dir}: its timeline files hold no events; train at least one step")
    if a.step is not None and a.step not in {e.step for e in events}:
        p.error(f"--step {a.step}: not in {a.run_dir} (steps {sorted({e.step for e in events})})")
    step = a.step if a.step is not None else max(e.step for e in events)
    png = Path(a.output or Path(a.run_dir) / "timeline.png")
    draw_png(events, png, step=step, title=f"{a.run_dir} step {step}")
    trace = png.with_suffix(".json")
    trace.write_text(json.dumps(chrome_trace(events)))
    print(f"wrote {png} and {trace} (Chrome trace: open in Perfetto)")
    loads = run_dir / "expert_load.json"  # training/expert_load_log.STATS_FILE
    if loads.exists():
        from megatron_hetermoe.planner.expert_load import LoadStats

        try:
            stats = LoadStats.load_file(loads)
        except (ValueError, KeyError, TypeError) as e:
            p.error(f"{loads}: not a readable expert-load stats file ({type(e).__name__}: {e})")
        if stats.steps:
            print(load_table(stats))
    return 0


if __name__ == "__main__":
    from megatron_hetermoe.errors import run_command

    sys.exit(run_command("hetermoe timeline", main))
