"""Measured expert loads: how many tokens each expert of each MoE layer received, and the stats
file a run writes them to (docs/expert-load.md) for a planner, the simulator and the emulator to
read. No torch: the measuring side is parallel/expert_load.py.

`ExpertLoad` is a per-layer histogram: tokens[layer][expert] (MoE layers in the plan's order,
expert ids the model's), any non-negative scale (counts, or fractions). What the pricing reads of
it is each expert's *multiplier*: its tokens over the layer's mean, 1.0 for every expert under
balanced routing, so a histogram measured on a small model prices the same skew on a large one.

The stats file (JSON, `FORMAT`, version 1):
    {"format": "hetermoe-expert-load", "version": 1,
     "num_layers": L, "num_experts": E, "model_layers": [model layer index of each MoE layer],
     "world_size": W, "roles": [role of each rank], "gpu_types": [the plan's type of each rank],
     "steps": S,                                  # steps summed in "tokens" below
     "iterations": [first, last],                 # the iterations they cover (1-based, inclusive)
     "tokens": [[tokens of expert e in layer l, summed over the steps and every ZP group] * E] * L,
     "task_seconds": [{task kind: seconds, summed over the steps} for each rank],
     "intervals": [{"iterations": [first, last], "steps": n, "tokens": [[...]],
                    "task_seconds": [{...} per rank]}, ...]}   # one per log interval, oldest first
Task kinds are plan/tasks.py's compute kinds (A_F, A_B, X_F, X_B, E_F, E_B); task seconds are
each rank's measured compute (CUDA events where the rank records them, host timers on CPU ranks,
the emulated budget under emulation), empty where the rank runs Megatron's own schedule.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

FORMAT = "hetermoe-expert-load"
VERSION = 1
MAX_INTERVALS = 1000  # a long run's file keeps its last intervals; "tokens" keeps the whole run


@dataclass(frozen=True)
class ExpertLoad:
    """tokens[layer][expert] of the MoE layers in the plan's order."""
    tokens: tuple[tuple[float, ...], ...]

    def __post_init__(self) -> None:
        widths = {len(row) for row in self.tokens}
        if len(widths) > 1:
            raise ValueError(f"expert load rows have {sorted(widths)} experts; every MoE layer has the same count")
        for l, row in enumerate(self.tokens):
            if any(t < 0 for t in row):
                raise ValueError(f"expert load of layer {l} has a negative token count {min(row)}")

    @classmethod
    def of(cls, tokens) -> "ExpertLoad":
        return cls(tuple(tuple(float(t) for t in row) for row in tokens))

    @classmethod
    def uniform(cls, num_layers: int, num_experts: int) -> "ExpertLoad":
        return cls(tuple((1.0,) * num_experts for _ in range(num_layers)))

    @property
    def num_layers(self) -> int:
        return len(self.tokens)

    @property
    def num_experts(self) -> int:
        return len(self.tokens[0]) if self.tokens else 0

    def multipliers(self, layer: int) -> tuple[float, ...]:
        """Each expert's tokens over the layer's mean (1.0 each where the layer saw nothing)."""
        row = self.tokens[layer]
        total = sum(row)
        if total <= 0:
            return (1.0,) * len(row)
        mean = total / len(row)
        return tuple(t / mean for t in row)

    def max_over_mean(self) -> list[float]:
        """Per layer: the most loaded expert's tokens over the mean (1.0: balanced)."""
        return [max(self.multipliers(l), default=1.0) for l in range(self.num_layers)]

    def check(self, num_layers: int, num_experts: int, what: str) -> None:
        if (self.num_layers, self.num_experts) != (num_layers, num_experts):
            raise ValueError(f"{what} has {self.num_layers} MoE layers x {self.num_experts} experts but the plan "
                             f"{num_layers} x {num_experts}; measure the loads on a run of this model")


@dataclass
class LoadStats:
    """The stats file's content (module docstring)."""
    num_layers: int
    num_experts: int
    model_layers: list[int]
    world_size: int
    roles: list[str]
    gpu_types: list[str]
    steps: int = 0
    iterations: list[int] = field(default_factory=lambda: [0, 0])
    tokens: list[list[float]] = field(default_factory=list)
    task_seconds: list[dict[str, float]] = field(default_factory=list)
    intervals: list[dict] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.tokens:
            self.tokens = [[0.0] * self.num_experts for _ in range(self.num_layers)]
        if not self.task_seconds:
            self.task_seconds = [{} for _ in range(self.world_size)]

    @property
    def load(self) -> ExpertLoad:
        return ExpertLoad.of(self.tokens)

    def add_interval(self, first: int, last: int, steps: int, tokens: list[list[float]],
                     task_seconds: list[dict[str, float]]) -> None:
        """One log interval's sums (iterations first..last, `steps` of them)."""
        if self.steps == 0:
            self.iterations = [first, last]
        self.iterations[1] = last
        self.steps += steps
        for row, add in zip(self.tokens, tokens):
            for e, t in enumerate(add):
                row[e] += t
        for mine, add in zip(self.task_seconds, task_seconds):
            for k, s in add.items():
                mine[k] = mine.get(k, 0.0) + s
        self.intervals.append({"iterations": [first, last], "steps": steps, "tokens": tokens,
                               "task_seconds": task_seconds})
        del self.intervals[:-MAX_INTERVALS]

    def to_json(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "num_layers": self.num_layers, "num_experts": self.num_experts,
                "model_layers": self.model_layers, "world_size": self.world_size, "roles": self.roles,
                "gpu_types": self.gpu_types, "steps": self.steps, "iterations": self.iterations,
                "tokens": self.tokens, "task_seconds": self.task_seconds, "intervals": self.intervals}

    def save(self, path: str | Path) -> Path:
        """Write atomically (a planner may read it while the run goes on)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.to_json()))
        tmp.replace(path)
        return path

    @classmethod
    def from_json(cls, d: dict, where: str = "expert load stats") -> "LoadStats":
        if d.get("format") != FORMAT:
            raise ValueError(f"{where} is not a HeterMoE expert-load stats file (format {d.get('format')!r}, want "
                             f"{FORMAT!r}); write one with --hetero-expert-load-stats PATH")
        if d.get("version") != VERSION:
            raise ValueError(f"{where} has version {d.get('version')!r}; this release reads version {VERSION}")
        keys = ("num_layers", "num_experts", "model_layers", "world_size", "roles", "gpu_types", "steps",
                "iterations", "tokens", "task_seconds", "intervals")
        return cls(**{k: d[k] for k in keys})

    @classmethod
    def load_file(cls, path: str | Path) -> "LoadStats":
        return cls.from_json(json.loads(Path(path).read_text()), str(path))


def load_expert_load(path: str | Path, last_intervals: int | None = None) -> ExpertLoad:
    """The histogram of a stats file: the whole run's, or the sum of its last `last_intervals`
    log intervals (recent loads, where routing drifts)."""
    st = LoadStats.load_file(path)
    if not last_intervals:
        if st.steps == 0:
            raise ValueError(f"{path} has no measured step yet; let the run log at least once (--log-interval)")
        return st.load
    got = st.intervals[-last_intervals:]
    if not got:
        raise ValueError(f"{path} has no log interval yet; let the run log at least once (--log-interval)")
    tokens = [[sum(iv["tokens"][l][e] for iv in got) for e in range(st.num_experts)] for l in range(st.num_layers)]
    return ExpertLoad.of(tokens)


def describe_skew(load: ExpertLoad) -> str:
    """One line: max/mean per layer (its worst and its median layer)."""
    mm = load.max_over_mean()
    if not mm:
        return "no MoE layer"
    worst = max(range(len(mm)), key=mm.__getitem__)
    med = sorted(mm)[len(mm) // 2]
    return f"max/mean tokens per expert: worst {mm[worst]:.2f} (layer {worst}), median layer {med:.2f}"
