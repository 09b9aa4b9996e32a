"""SLURM launch of a HeterMoE plan: every rank on a node of the GPU type the plan gives it.

A plan names each rank's GPU type (`gpu_types[rank]`). SLURM allocates nodes per type as the
components of one heterogeneous job (`#SBATCH hetjob`), one task per GPU. Tasks of a multi-
component `srun` are numbered component by component (SLURM_PROCID), so the plan rank of task i
is `rank_map[i]`: the ranks of component 0's type in order, then component 1's, ... Component 0
is the type of plan rank 0, which hosts the rendezvous store (MASTER_ADDR is its first node).
scripts/slurm/launch.sh renders the batch script with this module and submits it (or, with
--dry-run, prints it and every task's command); scripts/slurm/rank.sh turns SLURM_PROCID into
RANK inside each task.
"""
from __future__ import annotations

import argparse
import math
import shlex
import sys
from dataclasses import dataclass

from megatron_hetermoe.plan.hetero_plan import HeteroPlan


@dataclass(frozen=True)
class Component:
    """One heterogeneous-job component: the nodes of one GPU type and the plan ranks on them."""

    gpu_type: str
    ranks: tuple[int, ...]  # plan ranks in task order
    gpus_per_node: int

    @property
    def nodes(self) -> int:
        return math.ceil(len(self.ranks) / self.gpus_per_node)

    @property
    def tasks_per_node(self) -> int:
        return min(self.gpus_per_node, len(self.ranks))


def components(plan: HeteroPlan, gpus_per_node: dict[str, int]) -> list[Component]:
    """Group the plan's ranks by GPU type, the type of rank 0 first, others in first-seen order."""
    order: list[str] = []
    for t in plan.gpu_types:
        if t not in order:
            order.append(t)
    out = []
    for t in order:
        if t not in gpus_per_node:
            raise ValueError(f"plan has {t} ranks but no GPUs-per-node for {t}; pass --gpus-per-node {t}=N")
        if gpus_per_node[t] < 1:
            raise ValueError(f"--gpus-per-node {t}={gpus_per_node[t]} must be >= 1")
        out.append(Component(t, tuple(r for r, g in enumerate(plan.gpu_types) if g == t), gpus_per_node[t]))
    return out


def rank_map(comps: list[Component]) -> list[int]:
    return [r for c in comps for r in c.ranks]


def _type_map(items: list[str], flag: str) -> dict[str, str]:
    """'a40=8' style pairs; a bare value applies to every type (key '*')."""
    out = {}
    for it in items:
        k, sep, v = it.partition("=")
        if not sep:
            k, v = "*", it
        if not v:
            raise ValueError(f"{flag} {it!r}: expected TYPE=VALUE or VALUE")
        out[k] = v
    return out


def _for_type(m: dict[str, str], t: str) -> str | None:
    return m.get(t, m.get("*"))


def render_sbatch(plan_path: str, comps: list[Component], train_args: list[str], *, partitions: dict[str, str],
                  constraints: dict[str, str], account: str | None, time_limit: str | None, job_name: str,
                  master_port: int, repo: str) -> str:
    """The batch script: one #SBATCH block per GPU type, then a single srun over all of them."""
    lines = ["#!/usr/bin/env bash", f"# HeterMoE job for plan {plan_path}: "
             + ", ".join(f"{len(c.ranks)} x {c.gpu_type}" for c in comps)]
    for i, c in enumerate(comps):
        if i:
            lines.append("#SBATCH hetjob")
        # One option per #SBATCH line: the portable form across SLURM versions.
        lines += [f"#SBATCH --nodes={c.nodes}", f"#SBATCH --ntasks={len(c.ranks)}",
                  f"#SBATCH --ntasks-per-node={c.tasks_per_node}", f"#SBATCH --gpus-per-node={c.tasks_per_node}"]
        lines.append(f"#SBATCH --constraint={_for_type(constraints, c.gpu_type) or c.gpu_type}")
        if _for_type(partitions, c.gpu_type):
            lines.append(f"#SBATCH --partition={_for_type(partitions, c.gpu_type)}")
        if i == 0:
            lines.append(f"#SBATCH --job-name={job_name}")
            if account:
                lines.append(f"#SBATCH --account={account}")
            if time_limit:
                lines.append(f"#SBATCH --time={time_limit}")
    first_nodes = "SLURM_JOB_NODELIST_HET_GROUP_0" if len(comps) > 1 else "SLURM_JOB_NODELIST"
    groups = f" --het-group=0-{len(comps) - 1}" if len(comps) > 1 else ""
    cmd = ["python", "-m", "megatron_hetermoe.training.pretrain_gpt", *train_args, "--hetero-plan", plan_path]
    lines += [
        "set -euo pipefail",
        f"cd {shlex.quote(repo)}",
        "# Plan rank 0 is task 0 (on the first node of component 0): it hosts the rendezvous store.",
        f'MASTER_ADDR=$(scontrol show hostnames "${first_nodes}" | head -n 1)',
        f"export MASTER_ADDR MASTER_PORT={master_port} WORLD_SIZE={len(rank_map(comps))}",
        f'export HETERMOE_RANK_MAP="{" ".join(map(str, rank_map(comps)))}"',
        f"srun{groups} --gpus-per-task=1 --kill-on-bad-exit=1 scripts/slurm/rank.sh " + shlex.join(cmd),
    ]
    return "\n".join(lines) + "\n"


def task_commands(comps: list[Component], train_args: list[str], plan_path: str, master_port: int) -> list[str]:
    """What each task runs, as rank.sh resolves it: for --dry-run."""
    world = len(rank_map(comps))
    cmd = shlex.join(["python", "-m", "megatron_hetermoe.training.pretrain_gpt", *train_args, "--hetero-plan", plan_path])
    out, procid = [], 0
    master = f"<first {comps[0].gpu_type} node>"
    for ci, c in enumerate(comps):
        for i, r in enumerate(c.ranks):
            node, local = divmod(i, c.gpus_per_node)
            out.append(f"[task {procid}: het group {ci}, {c.gpu_type} node {node}, GPU {local}] "
                       f"RANK={r} LOCAL_RANK={local} WORLD_SIZE={world} MASTER_ADDR={master} "
                       f"MASTER_PORT={master_port} {cmd}")
            procid += 1
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megatron_hetermoe.tools.slurm",
                                description="render the sbatch script (and per-task commands) for a plan")
    p.add_argument("--plan", required=True)
    p.add_argument("--gpus-per-node", action="append", default=[], metavar="[TYPE=]N",
                   help="GPUs per node, per GPU type (a40=4) or for all types (8); repeatable")
    p.add_argument("--partition", action="append", default=[], metavar="[TYPE=]NAME")
    p.add_argument("--constraint", action="append", default=[], metavar="[TYPE=]FEATURE",
                   help="node feature of each GPU type (default: the type name)")
    p.add_argument("--account", default=None)
    p.add_argument("--time", default=None)
    p.add_argument("--job-name", default="hetermoe")
    p.add_argument("--master-port", type=int, default=29500)
    p.add_argument("--repo", default=".", help="directory the tasks start in (this repository on the nodes)")
    p.add_argument("--tasks", action="store_true", help="print each task's command instead of the script")
    p.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then pretrain_gpt flags")
    a = p.parse_args(argv)
    train_args = a.train_args[1:] if a.train_args[:1] == ["--"] else a.train_args
    if "--hetero-plan" in train_args:
        p.error("give the plan as --plan only; it is passed to every task as --hetero-plan")
    try:
        plan = HeteroPlan.load(a.plan)
        gpn = {k: int(v) for k, v in _type_map(a.gpus_per_node, "--gpus-per-node").items()}
        if "*" in gpn:
            gpn = {t: gpn.get(t, gpn["*"]) for t in set(plan.gpu_types)}
        comps = components(plan, gpn)
        if a.tasks:
            print("\n".join(task_commands(comps, train_args, a.plan, a.master_port)))
        else:
            print(render_sbatch(a.plan, comps, train_args, partitions=_type_map(a.partition, "--partition"),
                                constraints=_type_map(a.constraint, "--constraint"), account=a.account,
                                time_limit=a.time, job_name=a.job_name, master_port=a.master_port,
                                repo=a.repo), end="")
    except (ValueError, OSError) as e:
        p.error(str(e))
    return 0


if __name__ == "__main__":
    sys.exit(main())
