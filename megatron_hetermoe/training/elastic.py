"""Keep training when a GPU is lost (`hetermoe train --elastic-restarts N`, the plugin's launcher).

A start runs the plan on forked ranks. When a rank is lost (its process ended without a report of
its own: a signal, os._exit, an OOM kill; parallel/launcher.LaunchError.lost), the launcher has
already ended the others; the survivors' inventory (planner/inventory.py) gets a new plan from the
planner's search, and the next start loads the latest checkpoint resharded onto it by parameter
name (checkpoint/reshard.py) and continues: the global batch and the sample order are the run's,
so the iterations after the restart are those of a run started from that checkpoint on the new
plan. A rank that failed with a Python error (not lost) restarts on the same GPUs and plan; a
user's error (a bad input) ends the job. Steps completed after the last save are run again: what
a start loses is the iterations since its last checkpoint (--save-interval).

With Megatron's non-persistent local checkpoints (--non-persistent-ckpt-type local, checkpoint/
local.py) a restart continues from the newest complete local checkpoint where it is newer than the
persistent one: each rank's state in host memory of its node and, with --replication, of its
peers'. The forked ranks stand for the inventory's nodes ($HETERMOE_RANK_NODES); a node whose every
rank was lost is taken as a lost machine, its store removed before the restart, so the copies on
other nodes are what the restart reads.

Not built: growing back when a GPU returns (the inventory only shrinks within a job).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

from megatron_hetermoe.checkpoint.format import read_tracker
from megatron_hetermoe.checkpoint.local import JOB_ENV, NODES_ENV, job_store, newest_complete, scan
from megatron_hetermoe.config import TrainConfig
from megatron_hetermoe.plan.hetero_plan import HeteroPlan
from megatron_hetermoe.planner.inventory import (
    GPU_TYPE_ENV,
    AutoPlanRun,
    Inventory,
    InventoryError,
    auto_plan,
)
from megatron_hetermoe.reliability.faults import ATTEMPT_ENV
from megatron_hetermoe.training.result import TrainResult

def describe_plan(plan: HeteroPlan) -> str:
    """One line: the ZP groups (attention + expert ranks and their GPU types), R and the schedule."""
    def side(ranks) -> str:
        types = [plan.gpu_types[r] for r in ranks]
        return "+".join(f"{types.count(t)} {t}" for t in dict.fromkeys(types)) or "0"

    groups = ", ".join(f"({side(g.attention_ranks)} attention | {side(g.expert_ranks)} expert)" for g in plan.groups)
    return f"{plan.world_size} ranks: {groups}, R={plan.num_microbatches}, {plan.schedule}"


@dataclass(frozen=True)
class Recovery:
    """One restart: what was lost, and how the job went on."""
    attempt: int  # the start that followed (1, 2, ...)
    lost_ranks: tuple[int, ...]  # ranks of the failed start's plan whose processes were lost
    lost_gpus: tuple[str, ...]
    failure: str  # the launcher's first line about it
    last_completed: int  # the last iteration completed before the failure
    resumed_from: int  # the checkpoint iteration the next start loaded (0: from scratch)
    plan_before: str
    plan_after: str
    plan: dict = field(compare=False)  # the next start's plan (HeteroPlan.to_dict())
    failed_at: float = 0.0  # time.time() when the launcher had ended the failed start
    recovery_s: float | None = None  # failed_at -> the first step completed after it
    local: bool = False  # resumed from a local (in-memory) checkpoint, not the persistent one
    lost_nodes: tuple[int, ...] = ()  # nodes whose every rank was lost: their local stores removed

    @property
    def steps_lost(self) -> int:
        """Iterations completed before the failure that the next start runs again."""
        return self.last_completed - self.resumed_from


@dataclass
class ElasticResult:
    result: TrainResult  # the last start's
    losses: dict[int, float]  # iteration (1-based) -> lm loss; a re-run iteration has its last start's
    recoveries: list[Recovery]


def _read_losses(path: Path) -> list[tuple[int, float, float]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        d = json.loads(line)
        out.append((d["iteration"], d["lm loss"], d["time"]))
    return out


def run_elastic(cfg: TrainConfig, plan: HeteroPlan, inventory: Inventory, plan_run: AutoPlanRun,
                max_restarts: int, start: Callable[[TrainConfig, HeteroPlan], TrainResult],
                check: Callable[[TrainConfig, HeteroPlan], None] = lambda cfg, plan: None,
                log: Callable[[str], None] = print) -> ElasticResult:
    """Run `start(cfg, plan)` (forked ranks; raises LaunchError on a failure) and restart it up to
    `max_restarts` times after failures: re-planned for the GPUs left of `inventory` (plan rank i
    runs on inventory rank i) when ranks were lost, from the latest checkpoint in cfg.save.
    `check`: the job's validation of each new plan (training/validation.validate_job)."""
    from megatron_hetermoe.parallel.launcher import LaunchError

    if not cfg.save:
        raise ValueError("--elastic-restarts needs --save DIR (and --save-interval): a restart continues from the "
                         "latest checkpoint there")
    if plan.world_size != inventory.size:
        raise ValueError(f"the plan has {plan.world_size} ranks but the inventory {inventory.size} GPUs")
    tmp = Path(tempfile.mkdtemp(prefix="hetermoe-elastic-"))
    loss_log = tmp / "losses.jsonl"
    recoveries: list[Recovery] = []
    saved_env = {k: os.environ.get(k) for k in (ATTEMPT_ENV, NODES_ENV, JOB_ENV)}
    alive = inventory  # plan rank i runs on alive rank on_gpu[i]
    on_gpu = list(range(inventory.size))
    run_cfg = replace(cfg, loss_log=str(loss_log))
    store = None
    if cfg.local_ckpt is not None:  # this job's local checkpoints, apart from any other job's
        os.environ[JOB_ENV] = f"elastic-{uuid.uuid4().hex[:12]}"
        store = job_store(cfg.local_ckpt)
    try:
        for attempt in range(max_restarts + 1):
            os.environ[ATTEMPT_ENV] = str(attempt)  # forked ranks inherit it (faults.py aims at a start)
            nodes = [alive.nodes[on_gpu[r]] for r in range(plan.world_size)]
            os.environ[NODES_ENV] = ",".join(map(str, nodes))
            try:
                result = start(run_cfg, plan)
            except LaunchError as e:
                failed_at = time.time()
                if attempt == max_restarts or e.user_message is not None:
                    raise
                lost = sorted(set(e.lost))
                done = [it for it, _, t in _read_losses(loss_log) if t <= failed_at]
                before = describe_plan(plan)
                lost_gpus = tuple(plan.gpu_types[r] for r in lost)
                kept_nodes = {m for r, m in enumerate(nodes) if r not in lost}
                lost_nodes = tuple(sorted(set(nodes) - kept_nodes))  # none of their ranks survived
                if lost:
                    gone = {on_gpu[r] for r in lost}
                    alive = alive.without(sorted(gone))
                    plan, on_gpu = auto_plan(plan_run, alive)
                resumed, local = read_tracker(cfg.save) or 0, False
                if store is not None:
                    for n in lost_nodes:  # a lost machine's memory is gone with it
                        shutil.rmtree(store / f"node{n}", ignore_errors=True)
                    best = newest_complete({d.name: scan(d) for d in store.glob("node*")})
                    if best is not None and best[1] > resumed:
                        resumed, local = best[1], True
                run_cfg = replace(run_cfg, load=cfg.save if resumed or store is not None else cfg.load,
                                  ckpt_reshard=True, ckpt_step=None)
                check(run_cfg, plan)
                rec = Recovery(attempt + 1, tuple(lost), lost_gpus, str(e).split("\n", 1)[0][:300],
                               max(done, default=0), resumed, before, describe_plan(plan), plan.to_dict(),
                               failed_at, local=local, lost_nodes=lost_nodes if store is not None else ())
                recoveries.append(rec)
                what = (f"lost rank(s) {list(lost)} ({', '.join(lost_gpus)})" if lost
                        else f"rank {e.rank} failed (no GPU lost)")
                kind = "local checkpoint" if local else "checkpoint"
                log(f"elastic: {what} after iteration {rec.last_completed}; restart {attempt + 1} of "
                    f"{max_restarts} on {describe_plan(plan)}"
                    + (f"; idle GPUs: {plan.meta.get('idle_gpus')}" if plan.meta.get("idle_gpus") else "")
                    + (f"; node(s) {list(rec.lost_nodes)} lost with their memory" if rec.lost_nodes else "")
                    + (f", from the {kind} of iteration {resumed}" if resumed else ", from the start"))
                continue
            break
        logged = _read_losses(loss_log)
        losses: dict[int, float] = {}
        for it, loss, _ in logged:
            losses[it] = loss
        for i, rec in enumerate(recoveries):  # the first step completed after each failure
            after = [t for _, _, t in logged if t > rec.failed_at]
            if after:
                recoveries[i] = replace(rec, recovery_s=min(after) - rec.failed_at)
        return ElasticResult(result, losses, recoveries)
    finally:
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(tmp, ignore_errors=True)
        if store is not None:  # the job's memory: nothing else reads it
            shutil.rmtree(store, ignore_errors=True)


def gather_inventory(device) -> Inventory:
    """Every rank's GPU type and host, gathered over the default group (call after
    init_distributed): the CUDA device's profile, or on a CPU rank $HETERMOE_GPU_TYPE (the type
    its node emulates, or a type per local rank, comma-separated). Returns a
    planner.inventory.Inventory in rank order."""
    import socket

    import torch
    import torch.distributed as dist

    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        mine = profile_of_device(props.name, props.total_memory / 2**30)
    else:  # a CPU rank: the type its node emulates, or one per local rank ("A40,A40,V100-16GB,...")
        types = [t.strip() for t in os.environ.get(GPU_TYPE_ENV, "").split(",") if t.strip()]
        local = int(os.environ.get("LOCAL_RANK", "0"))
        mine = types[0] if len(types) == 1 else types[local] if local < len(types) else None
    got: list = [None] * dist.get_world_size()
    dist.all_gather_object(got, (mine, socket.gethostname()))
    missing = [r for r, (t, _) in enumerate(got) if not t]
    if missing:
        raise InventoryError(f"--hetero-plan auto: CPU rank(s) {missing} have no GPU to find; set ${GPU_TYPE_ENV} "
                             f"(the GPU type the node emulates, e.g. A40, or one per local rank: A40,V100-16GB) in "
                             f"their environment, or pass --hetero-gpus with every rank's type")
    return Inventory.from_ranks([(t, h) for t, h in got])


def profile_of_device(name: str, memory_gib: float) -> str:
    """The GPU profile (configs/gpus/) a CUDA device is, by parallel/device.gpu_type_matches (the
    rule that checks a rank's GPU against its plan type); InventoryError naming the device when
    none matches."""
    from megatron_hetermoe.parallel.device import gpu_type_matches
    from megatron_hetermoe.planner.profiles import known_gpu_types, load_profile

    known = [t for t in known_gpu_types() if t != "cpu"]
    for t in known:
        if gpu_type_matches(load_profile(t), name, memory_gib):
            return t
    raise InventoryError(f"GPU {name!r} ({memory_gib:.0f} GiB) is none of the GPU profiles {known}; pass "
                         f"--hetero-gpus with its type, or add its profile under configs/gpus/")
