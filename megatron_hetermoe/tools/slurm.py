"""SLURM launch of a HeterMoE plan: every rank on a node of the GPU type the plan gives it.

A plan names each rank's GPU type (`gpu_types[rank]`). SLURM allocates nodes per type as the
components of one heterogeneous job (`#SBATCH hetjob`), one task per GPU. Tasks of a multi-
component `srun` are numbered component by component (SLURM_PROCID), so the plan rank of task i
is `rank_map[i]`: the ranks of component 0's type in order, then component 1's, ... Component 0
is the type of plan rank 0, which hosts the rendezvous store (MASTER_ADDR is its first node).
scripts/slurm/launch.sh renders the batch script with this module and submits it (or, with
--dry-run, prints it and every task's command); scripts/slurm/rank.sh turns SLURM_PROCID into
RANK inside each task.

- Entry: `--entry plugin` (default) runs this plugin's trainer (`python -m
  megatron_hetermoe.training.pretrain_gpt`); `--entry megatron-lm --megatron-lm-dir DIR` runs
  Megatron-LM's own pretrain_gpt.py, patched (patches/), from that checkout; `--entry
  megatron-core` runs megatron-core >= 0.19's own pretrain() with no checkout (`python -m
  megatron_hetermoe.megatron_lm.pretrain`, `hetermoe pretrain`'s ranks).
- GPUs: each task sees every GPU of its node (`--gpu-bind=none`, no per-task GPU limit), so NCCL
  finds NVLink between them, and LOCAL_RANK (SLURM_LOCALID) is the task's GPU on the node, the
  device Megatron-LM's `set_device(args.local_rank)` takes. rank.sh sets LOCAL_RANK=0 where a
  site's configuration still gives a task a single GPU.
- The job's flags are checked before anything is written: the plugin's with its own parser and
  validation (pretrain_gpt.check_flags: `--num-layers 0` or `--frobnicate` is refused here, not on
  the nodes); Megatron-LM's by name (its core_v0.16.1 parser's flags plus the patch's --hetero-*).
- Paths: a relative --plan (like every relative path in the flags) means the caller's directory,
  which is where the job runs (--workdir); the plugin comes from --repo (PYTHONPATH).
- $PYTHON is the interpreter of every task (default: the one rendering the script).
- Elastic (`--elastic MIN_NODES`, every entry): instead of a task per GPU, one task per node runs
  torchrun's elastic agent (scripts/slurm/agent.sh: `--nnodes MIN_NODES:<allocated nodes>
  --nproc-per-node <its GPUs> --max-restarts N`, c10d rendezvous on the first node of component 0).
  When a node fails, the agents left restart their workers, each start plans for the world it got
  (`--hetero-plan auto`: every rank's GPU gathered) and continues from the latest checkpoint
  (`--save DIR --load DIR --save-interval N`, required, and `--hetero-ckpt-reshard` for the plugin's
  trainer; pretrain() reshards by itself, the distributed optimizer from
  --dist-ckpt-optim-fully-reshardable only). `#SBATCH --no-kill` and
  `srun --kill-on-bad-exit=0` keep the allocation and the other agents when a node goes; the node
  hosting the rendezvous must stay (torchrun's c10d store lives there). --plan sizes the allocation
  (its nodes per GPU type, each with the GPUs its first node gets); the flags are checked by planning
  for every allocated GPU, as the first start will.
- CUDA_DEVICE_MAX_CONNECTIONS is exported (--cuda-device-max-connections, default 8, CUDA's own):
  Megatron's Mixtral recipe exports 1, which serialises the CUDA streams zebra overlaps on, so 1 is
  refused for a zebra run.
"""
from __future__ import annotations

import math
import os
import shlex
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

from megatron_hetermoe.megatron_lm.auto_plan import flag_value
from megatron_hetermoe.plan.hetero_plan import HeteroPlan
from megatron_hetermoe.vocabulary import ScheduleName

ENTRIES = ("plugin", "megatron-lm", "megatron-core")
DEFAULT_MAX_CONNECTIONS = 8  # CUDA's default


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


@dataclass(frozen=True)
class Elastic:
    """--elastic: torchrun's elastic agent on every node instead of a task per GPU (module doc)."""

    min_nodes: int
    max_nodes: int  # the allocation's nodes
    max_restarts: int

    @property
    def nnodes(self) -> str:
        return f"{self.min_nodes}:{self.max_nodes}"


# What every elastic start needs among the job's flags: the checkpoint it continues from, resharded
# (inside Megatron-LM's pretrain() a checkpoint of another plan loads resharded by itself).
ELASTIC_FLAGS = ("--save", "--load", "--save-interval", "--hetero-ckpt-reshard")
ELASTIC_FLAGS_PRETRAIN = ("--save", "--load", "--save-interval")


def check_elastic(entry: str, train_args: list[str]) -> None:
    """--elastic's needs: a checkpoint every start continues from, loadable on another plan."""
    names = {t.split("=", 1)[0] for t in train_args if t.startswith("--")}
    needed = ELASTIC_FLAGS if entry == "plugin" else ELASTIC_FLAGS_PRETRAIN
    missing = [f for f in needed if f not in names]
    if missing:
        reshard = ", resharded onto the plan it makes for the GPUs left (--hetero-ckpt-reshard)" if (
            entry == "plugin") else ""
        raise ValueError(f"--elastic needs {' '.join(missing)} among the job's flags: every start continues from "
                         f"the latest checkpoint (--save DIR --load DIR --save-interval N){reshard}")
    save, load = flag_value(train_args, "--save"), flag_value(train_args, "--load")
    if save != load:
        raise ValueError(f"--elastic: --save {save} but --load {load}: a start after a failure continues from "
                         f"what the last one saved; give both the same directory")
    if entry != "plugin" and "--use-distributed-optimizer" in names and \
            "--dist-ckpt-optim-fully-reshardable" not in names:
        raise ValueError("--elastic with --use-distributed-optimizer: a start on another plan loads the distributed "
                         "optimizer's state from Megatron's fully reshardable format only; add "
                         "--dist-ckpt-optim-fully-reshardable")


def rank_map(comps: list[Component]) -> list[int]:
    return [r for c in comps for r in c.ranks]


def type_map(items: list[str], flag: str, plan_types: list[str]) -> dict[str, str]:
    """'a40=8' style pairs keyed by the plan's own spelling of each type (matched without regard
    to case, as the plan's types are); a bare value applies to every type. A key that is no type
    of the plan is refused: it would be dropped without a word."""
    out: dict[str, str] = {}
    by_lower = {t.lower(): t for t in plan_types}
    for it in items:
        k, sep, v = it.partition("=")
        if not sep:
            k, v = "*", it
        if not v:
            raise ValueError(f"{flag} {it!r}: expected TYPE=VALUE or VALUE")
        if k != "*":
            if k.lower() not in by_lower:
                raise ValueError(f"{flag} {it!r}: the plan has no GPU type {k!r}; its types are "
                                 f"{', '.join(sorted(set(plan_types)))}")
            k = by_lower[k.lower()]
        if k in out:
            raise ValueError(f"{flag} given twice for {'every type' if k == '*' else k}: {out[k]!r} and {v!r}")
        out[k] = v
    if "*" in out:
        return {t: out.get(t, out["*"]) for t in plan_types}
    return out


def schedule_of(plan: HeteroPlan, train_args: list[str]) -> str:
    """The schedule the job runs: --hetero-schedule among its flags, else the plan's."""
    given = flag_value(train_args, "--hetero-schedule")
    return plan.schedule if given is None else given


def entry_command(entry: str, megatron_lm_dir: str | None) -> list[str]:
    """What each task runs after $PYTHON (the training flags follow)."""
    if entry == "megatron-lm":
        return [str(Path(megatron_lm_dir) / "pretrain_gpt.py")]
    if entry == "megatron-core":
        return ["-m", "megatron_hetermoe.megatron_lm.pretrain"]
    return ["-m", "megatron_hetermoe.training.pretrain_gpt"]


def check_megatron_core(train_args: list[str]) -> None:
    """Flags that megatron-core's own parser (>= 0.19, with the --hetero-* flags) takes: names and
    value types, checked here with the parser the nodes will use."""
    from megatron_hetermoe.compat import mcore_version

    try:
        from megatron.training.arguments import add_megatron_arguments
    except ImportError:
        add_megatron_arguments = None
    if add_megatron_arguments is None or mcore_version()[:2] < (0, 19):
        found = ".".join(map(str, mcore_version()))
        raise ValueError(f"--entry megatron-core: this host's megatron-core {found} has no megatron.training to check "
                         f"the flags with (0.19 and later ship it); render the job where the training environment is "
                         f"installed, or use --entry megatron-lm --megatron-lm-dir DIR")
    from megatron_hetermoe.cli.slurm import megatron_core_parser

    class Refused(Exception):
        pass

    parser = megatron_core_parser(add_megatron_arguments)

    def refuse(message: str):
        raise Refused(message)

    parser.error = refuse
    try:
        _, unknown = parser.parse_known_args([*train_args, "--hetero-plan", "plan.json"])
    except Refused as e:
        raise ValueError(f"megatron-core's pretrain() flags: {e}") from None
    names = [t.split("=", 1)[0] for t in unknown if t.startswith("-")]
    if names or unknown:
        raise ValueError(f"megatron-core's pretrain() flag(s) {' '.join(names or unknown)}: not flags of "
                         f"megatron-core {'.'.join(map(str, mcore_version()))}'s parser (or the --hetero-* ones)")


def check_megatron_lm(checkout: str, train_args: list[str]) -> None:
    """A patched Megatron-LM checkout, and flags its parser has (by name: its values are checked
    by Megatron-LM itself on the nodes, whose training-side packages the login node may lack)."""
    from megatron_hetermoe.cli.hetero import HETERO_FLAGS
    from megatron_hetermoe.training.pretrain_gpt import MEGATRON_REF, megatron_flags

    script = Path(checkout) / "pretrain_gpt.py"
    if not script.is_file():
        raise ValueError(f"--megatron-lm-dir {checkout}: no pretrain_gpt.py there; give a Megatron-LM work tree")
    if "hetero" not in script.read_text():
        raise ValueError(f"--megatron-lm-dir {checkout}: pretrain_gpt.py is not patched for --hetero-plan; apply "
                         f"the patch patches/check_patch.sh {checkout} names (git apply)")
    known = megatron_flags() | set(HETERO_FLAGS)
    unknown = [t.split("=", 1)[0] for t in train_args if t.startswith("--") and t.split("=", 1)[0] not in known]
    if unknown:
        raise ValueError(f"pretrain_gpt.py flag(s) {' '.join(unknown)}: not flags of Megatron-LM {MEGATRON_REF}'s "
                         f"parser (or the patch's {', '.join(HETERO_FLAGS)})")


def check_train_args(train_args: list[str], plan_path: str, entry: str, megatron_lm_dir: str | None,
                     elastic_gpus: list[str] | None = None) -> None:
    """The job's flags, checked before the job script is written (see the module doc). Elastic
    (`elastic_gpus`: every allocated GPU's type): as every start runs them, planned for those GPUs."""
    if entry in ("megatron-lm", "megatron-core"):
        if entry == "megatron-lm":
            check_megatron_lm(megatron_lm_dir, train_args)
        else:
            check_megatron_core(train_args)
        if elastic_gpus:
            check_pretrain_pick(train_args, elastic_gpus)
        return
    from megatron_hetermoe.training.pretrain_gpt import check_flags

    env = {k: os.environ.pop(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK") if k in os.environ}
    try:  # as the job's own launch sees them: no torchrun job around, megatron's import warnings unshown
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan_flags = ["--hetero-plan", "auto", "--hetero-gpus", ",".join(elastic_gpus)] if elastic_gpus else [
                "--hetero-plan", plan_path]
            check_flags([*train_args, *plan_flags])
    except SystemExit as e:  # a few refusals of the trainer exit with their message
        raise ValueError(f"pretrain_gpt flags: {e.code}") from None
    except ValueError as e:
        raise ValueError(f"pretrain_gpt flags: {e}") from None
    finally:
        os.environ.update(env)


def check_pretrain_pick(train_args: list[str], gpus: list[str]) -> None:
    """An elastic pretrain() job's flags, planned for every allocated GPU as its first start will
    (megatron_lm/auto_plan.py); a tokenizer the planner does not read is left to that start, and
    said so."""
    from megatron_hetermoe.megatron_lm.auto_plan import pick_for
    from megatron_hetermoe.planner.inventory import Inventory
    from megatron_hetermoe.planner.megatron_flags import MegatronFlagsError

    try:
        pick_for(train_args, Inventory.from_types(gpus))
    except MegatronFlagsError as e:
        if "--padded-vocab-size" not in str(e):
            raise ValueError(f"pretrain_gpt.py flags: {e}") from None
        print(f"warning: the flags were not planned for the {len(gpus)} allocated GPUs here ({e}); every start "
              f"plans with Megatron's tokenizer", file=sys.stderr)


def render_sbatch(plan_path: str, comps: list[Component], train_args: list[str], *, partitions: dict[str, str],
                  constraints: dict[str, str], account: str | None, time_limit: str | None, job_name: str,
                  master_port: int, repo: str, workdir: str | None = None, python: str = "python3",
                  entry: str = "plugin", megatron_lm_dir: str | None = None,
                  max_connections: int = DEFAULT_MAX_CONNECTIONS, elastic: Elastic | None = None) -> str:
    """The batch script: one #SBATCH block per GPU type, then a single srun over all of them (a
    task per GPU; elastic: a torchrun agent per node)."""
    lines = ["#!/usr/bin/env bash", f"# HeterMoE job for plan {plan_path}: "
             + ", ".join(f"{len(c.ranks)} x {c.gpu_type}" for c in comps)]
    for i, c in enumerate(comps):
        if i:
            lines.append("#SBATCH hetjob")
        # One option per #SBATCH line: the portable form across SLURM versions.
        tasks, per_node = (c.nodes, 1) if elastic else (len(c.ranks), c.tasks_per_node)
        lines += [f"#SBATCH --nodes={c.nodes}", f"#SBATCH --ntasks={tasks}",
                  f"#SBATCH --ntasks-per-node={per_node}", f"#SBATCH --gpus-per-node={c.tasks_per_node}"]
        lines.append(f"#SBATCH --constraint={constraints.get(c.gpu_type) or c.gpu_type}")
        if partitions.get(c.gpu_type):
            lines.append(f"#SBATCH --partition={partitions[c.gpu_type]}")
        if i == 0:
            lines.append(f"#SBATCH --job-name={job_name}")
            if account:
                lines.append(f"#SBATCH --account={account}")
            if time_limit:
                lines.append(f"#SBATCH --time={time_limit}")
            if elastic:  # a failed node ends neither the allocation nor the other nodes' agents
                lines.append("#SBATCH --no-kill")
    first_nodes = "SLURM_JOB_NODELIST_HET_GROUP_0" if len(comps) > 1 else "SLURM_JOB_NODELIST"
    groups = f" --het-group=0-{len(comps) - 1}" if len(comps) > 1 else ""
    cmd = [*entry_command(entry, megatron_lm_dir), *train_args, "--hetero-plan", "auto" if elastic else plan_path]
    rank_sh = shlex.quote(str(Path(repo) / "scripts" / "slurm" / "rank.sh"))
    agent_sh = shlex.quote(str(Path(repo) / "scripts" / "slurm" / "agent.sh"))
    lines += [
        "set -euo pipefail",
        f"cd {shlex.quote(workdir or os.getcwd())}  # relative paths in the flags mean this directory",
        f'export PYTHONPATH={shlex.quote(str(repo))}"${{PYTHONPATH:+:${{PYTHONPATH}}}}"',
        f"PYTHON=${{PYTHON:-{shlex.quote(python)}}}",
        "# Streams zebra overlaps on need more than one hardware queue (Megatron's Mixtral recipe exports 1).",
        f"export CUDA_DEVICE_MAX_CONNECTIONS={max_connections}",
    ]
    if elastic:
        lines += [
            "# torchrun's c10d rendezvous on the first node of component 0 (it must stay up).",
            f'MASTER_ADDR=$(scontrol show hostnames "${first_nodes}" | head -n 1)',
            f"export MASTER_ADDR MASTER_PORT={master_port}",
            f"export HETERMOE_NNODES={elastic.nnodes} HETERMOE_MAX_RESTARTS={elastic.max_restarts}",
            "# One elastic agent per node with all its GPUs (agent.sh); a node that fails is left out of the",
            "# next start, whose ranks plan for the GPUs they got and continue from the latest checkpoint.",
            f'srun{groups} --gpu-bind=none --kill-on-bad-exit=0 {agent_sh} "${{PYTHON}}" ' + shlex.join(cmd),
        ]
        return "\n".join(lines) + "\n"
    lines += [
        "# Plan rank 0 is task 0 (on the first node of component 0): it hosts the rendezvous store.",
        f'MASTER_ADDR=$(scontrol show hostnames "${first_nodes}" | head -n 1)',
        f"export MASTER_ADDR MASTER_PORT={master_port} WORLD_SIZE={len(rank_map(comps))}",
        f'export HETERMOE_RANK_MAP="{" ".join(map(str, rank_map(comps)))}"',
        "# Every task sees all GPUs of its node (NVLink for NCCL); LOCAL_RANK picks its own (rank.sh).",
        f'srun{groups} --gpu-bind=none --kill-on-bad-exit=1 {rank_sh} "${{PYTHON}}" ' + shlex.join(cmd),
    ]
    return "\n".join(lines) + "\n"


def task_commands(comps: list[Component], train_args: list[str], plan_path: str, master_port: int,
                  python: str = "python3", entry: str = "plugin", megatron_lm_dir: str | None = None,
                  elastic: Elastic | None = None) -> list[str]:
    """What each task runs, as rank.sh (agent.sh) resolves it: for --dry-run."""
    if elastic:
        cmd = shlex.join(["-m", "torch.distributed.run", "--nnodes", elastic.nnodes, "--nproc-per-node", "GPUS_ON_NODE",
                          "--max-restarts", str(elastic.max_restarts), "--rdzv-backend", "c10d", "--rdzv-endpoint",
                          f"<first {comps[0].gpu_type} node>:{master_port}", "--rdzv-id", "<job id>",
                          *entry_command(entry, megatron_lm_dir), *train_args, "--hetero-plan", "auto"])
        out, procid = [], 0
        for ci, c in enumerate(comps):
            for node in range(c.nodes):  # every node of the type gets tasks_per_node GPUs (#SBATCH)
                out.append(f"[task {procid}: het group {ci}, {c.gpu_type} node {node}, {c.tasks_per_node} GPU(s)] "
                           f"{shlex.quote(python)} " + cmd.replace("GPUS_ON_NODE", str(c.tasks_per_node)))
                procid += 1
        return out
    world = len(rank_map(comps))
    cmd = shlex.join([python, *entry_command(entry, megatron_lm_dir), *train_args, "--hetero-plan", plan_path])
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
    from megatron_hetermoe.cli.slurm import build_parser

    p = build_parser(ENTRIES, DEFAULT_MAX_CONNECTIONS)
    a = p.parse_args(argv)
    train_args = a.train_args[1:] if a.train_args[:1] == ["--"] else a.train_args
    if "--hetero-plan" in train_args:
        p.error("give the plan as --plan only; it is passed to every task as --hetero-plan")
    if not 1 <= a.master_port <= 65535:
        p.error(f"--master-port {a.master_port}: a TCP port is 1..65535")
    if (a.entry == "megatron-lm") != (a.megatron_lm_dir is not None):
        p.error("--entry megatron-lm and --megatron-lm-dir DIR go together")
    if a.max_restarts < 0:
        p.error(f"--max-restarts {a.max_restarts}: give the number of restarts, >= 0")
    if not 1 <= a.cuda_device_max_connections <= 32:
        p.error(f"--cuda-device-max-connections {a.cuda_device_max_connections}: CUDA takes 1..32")
    workdir = Path(a.workdir or os.getcwd()).resolve()
    plan_path = str(workdir / a.plan)  # absolute: the nodes start elsewhere
    megatron_lm_dir = str(workdir / a.megatron_lm_dir) if a.megatron_lm_dir else None
    try:
        plan = HeteroPlan.load(plan_path)
        gpn_text = type_map(a.gpus_per_node, "--gpus-per-node", plan.gpu_types)
        try:
            gpn = {k: int(v) for k, v in gpn_text.items()}
        except ValueError:
            raise ValueError(f"--gpus-per-node {a.gpus_per_node}: give whole numbers, e.g. 8 or A40=4") from None
        comps = components(plan, gpn)
        elastic = None
        if a.elastic is not None:
            nodes = sum(c.nodes for c in comps)
            if not 1 <= a.elastic <= nodes:
                have = ", ".join(f"{c.nodes} x {c.gpu_type}" for c in comps)
                raise ValueError(f"--elastic {a.elastic}: the job's {nodes} node(s) ({have}) must keep going on at "
                                 f"least 1 and at most all of them; pass --elastic 1..{nodes}")
            check_elastic(a.entry, train_args)
            elastic = Elastic(a.elastic, nodes, a.max_restarts)
        partitions = type_map(a.partition, "--partition", plan.gpu_types)
        constraints = type_map(a.constraint, "--constraint", plan.gpu_types)
        if a.cuda_device_max_connections == 1 and schedule_of(plan, train_args) == ScheduleName.ZEBRA:
            raise ValueError("--cuda-device-max-connections 1 with the zebra schedule: one hardware queue serialises "
                             "the streams zebra overlaps attention and expert work on; leave it at 8 (CUDA's default)")
        if plan.member_size > 1 and a.entry in ("megatron-lm", "megatron-core") and a.cuda_device_max_connections != 1:
            raise ValueError(f"the plan's attention members are tensor- or context-parallel (attention_tp="
                             f"{plan.attention_tp}, attention_cp={plan.attention_cp}) and "
                             f"--entry {a.entry} runs Megatron-LM's validate_args, which asserts "
                             f"CUDA_DEVICE_MAX_CONNECTIONS=1 with tensor or context parallelism on GPUs before "
                             f"Blackwell; pass "
                             f"--cuda-device-max-connections 1 (with the distep schedule: one queue serialises zebra's "
                             f"streams), or use --entry plugin")
        # elastic: every start plans for the GPUs it finds; at first, all the allocation's
        allocated = [c.gpu_type for c in comps for _ in range(c.nodes * c.tasks_per_node)]
        check_train_args(train_args, plan_path, a.entry, megatron_lm_dir, allocated if elastic else None)
        if a.tasks:
            print("\n".join(task_commands(comps, train_args, plan_path, a.master_port, a.python, a.entry,
                                          megatron_lm_dir, elastic)))
        else:
            print(render_sbatch(plan_path, comps, train_args, partitions=partitions, constraints=constraints,
                                account=a.account, time_limit=a.time, job_name=a.job_name,
                                master_port=a.master_port, repo=a.repo, workdir=str(workdir), python=a.python,
                                entry=a.entry, megatron_lm_dir=megatron_lm_dir,
                                max_connections=a.cuda_device_max_connections, elastic=elastic), end="")
            if a.with_tasks:
                print("# ---- what each task runs " + ("(agent.sh: one torchrun agent per node)" if elastic else
                                                       "(rank.sh resolves RANK from SLURM_PROCID)"))
                print("\n".join(task_commands(comps, train_args, plan_path, a.master_port, a.python, a.entry,
                                              megatron_lm_dir, elastic)))
    except (ValueError, OSError) as e:  # named: one line, without the usage text
        print(f"{p.prog}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
