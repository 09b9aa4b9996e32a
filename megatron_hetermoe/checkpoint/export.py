"""HeterMoE checkpoint <-> plain Megatron MoE checkpoint, and `hetermoe checkpoint`.

The plain side is megatron-core's own dist_checkpointing format (torch_dist backend), as
Megatron-LM writes with --ckpt-format torch_dist: OUT/latest_checkpointed_iteration.txt and
OUT/iter_N/ holding {'model': GPTModel.sharded_state_dict(), 'optimizer':
optimizer.sharded_state_dict(model), 'opt_param_scheduler', 'iteration', 'checkpoint_version'}
for a PP=1, EP=1 GPTModel (so Megatron can reshard it onto any TP/PP/EP it supports). No RNG
state is written: a HeterMoE rank's RNG has no Megatron rank to go to (Megatron-LM: load with
--no-load-rng).

Export reads the HeterMoE rank files by canonical parameter name (reshard.gather_canonical);
import splits the Megatron state over a plan (layout.megatron_to_hetero) and writes rank files
whose Adam moments are keyed by name, which load.load puts into each rank's optimizer.
Both run in one forked gloo rank (megatron-core's sharded state needs a process group).
"""
from __future__ import annotations

import os
import shutil
import time
from dataclasses import asdict
from pathlib import Path

import torch

from megatron_hetermoe.checkpoint.format import (
    TRACKER,
    CheckpointError,
    RankState,
    _write_atomic,
    iter_dir_name,
    locate,
    optimizer_param_names,
    read_tracker,
)
from megatron_hetermoe.checkpoint.load import model_difference, plan_difference
from megatron_hetermoe.checkpoint.reshard import (
    canonical_optimizer_state,
    gather_canonical,
    inject_optimizer_state,
    load_canonical_params,
)
from megatron_hetermoe.checkpoint.save import write_offline
from megatron_hetermoe.config import MEGATRON_ROLE, ModelConfig

META_KEY = "hetermoe"  # our common (non-sharded) entry: model shape, training settings, source


def _single_rank_model(model: ModelConfig, train: dict):
    """A PP=1, EP=1 GPTModel with DDP and the Megatron optimizer the trainers use."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_hetermoe.config import ParallelConfig
    from megatron_hetermoe.models.builder import (
        build_gpt,
        canonical_names,
        transformer_config,
    )

    ps.initialize_model_parallel()
    model_parallel_cuda_manual_seed(int(train.get("seed", 1234)))
    config = transformer_config(model, ParallelConfig())
    module = build_gpt(model, config)
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), module)
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=train.get("lr", 1e-3), min_lr=train.get("min_lr", 0.0),
        weight_decay=train.get("weight_decay", 0.01), adam_beta1=0.9, adam_beta2=0.95,
        clip_grad=train.get("clip_grad", 1.0), params_dtype=torch.float32), [ddp], use_gloo_process_groups=False)
    return module, optimizer, canonical_names(module)


def _sharded(module, optimizer, is_loading: bool) -> dict:
    model_sd = module.sharded_state_dict()
    return {"model": model_sd, "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=is_loading)}


def _write_tracker(root: Path, iteration: int) -> None:
    _write_atomic(root / TRACKER, lambda f: f.write(f"{iteration}\n"), binary=False)


# ---- export: HeterMoE (or baseline) checkpoint -> Megatron dist checkpoint ------------------
def _export_rank(rank: int, world: int, load_dir: str, step: int | None, out: str) -> dict:
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    iter_dir, manifest = locate(load_dir, step)
    params, opt, first = gather_canonical(iter_dir, manifest)
    model = ModelConfig(**manifest["model"])
    try:
        module, optimizer, names = _single_rank_model(model, manifest.get("train", {}))
        state = RankState("megatron", 0, 1, MEGATRON_ROLE, module, names, optimizer, None, manifest["model"], {})
        load_canonical_params(state, params)
        missing = sorted(set(names.values()) - set(opt))
        if missing:
            raise CheckpointError(f"{iter_dir}: no optimizer state for {missing[:3]}; was it saved before any step?")
        inject_optimizer_state(state, opt)
        iteration = manifest["iteration"]
        root = Path(out)
        final = root / iter_dir_name(iteration)
        tmp = root / (iter_dir_name(iteration) + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        sd = _sharded(module, optimizer, is_loading=False)
        sd.update({"iteration": iteration, "checkpoint_version": 3.0,
                   "opt_param_scheduler": first["opt_param_scheduler"],
                   META_KEY: {"model": manifest["model"], "train": manifest.get("train", {}),
                              "source": {"dir": str(iter_dir), "trainer": manifest["trainer"],
                                         "layout": manifest["layout"]}}})
        dist_checkpointing.save(sd, str(tmp))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        _write_tracker(root, iteration)
        return {"iteration": iteration, "dir": str(final), "params": len(params)}
    finally:
        ps.destroy_model_parallel()


def export_checkpoint(load_dir: str, out: str, step: int | None = None, plan=None) -> dict:
    """Write the checkpoint in load_dir (tracked iteration, or `step`) as a plain Megatron
    dist checkpoint under out/. With `plan`, first check that it was saved under that plan."""
    from megatron_hetermoe.parallel.launcher import launch

    iter_dir, manifest = locate(load_dir, step)
    precision = manifest.get("train", {}).get("precision", "fp32")
    if precision != "fp32":
        raise CheckpointError(f"{iter_dir} was saved by a {precision} run: its fp32 master weights sit in Megatron's "
                              f"mixed-precision optimizer state, which export does not read by name yet; export "
                              f"an fp32 run's checkpoint")
    if plan is not None:
        if manifest["trainer"] != "hetero":
            raise CheckpointError(f"{iter_dir} was saved by the {manifest['trainer']} trainer, not under a plan; "
                                  f"drop --plan")
        diff = plan_difference(manifest["layout"]["plan"], plan.to_dict())
        if diff:
            raise CheckpointError(f"{iter_dir} was saved under another plan: {'; '.join(diff[:6])}; "
                                  f"pass the plan it was trained with")
    return launch(_export_rank, 1, load_dir, step, out, timeout_s=600)[0]


# ---- import: Megatron dist checkpoint -> HeterMoE checkpoint ---------------------------------
def _read_megatron_rank(rank: int, world: int, load_dir: str, model: ModelConfig | None) -> dict:
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    root = Path(load_dir)
    iteration = read_tracker(root)
    if iteration is None:
        raise CheckpointError(f"{root}: no {TRACKER}; not a Megatron checkpoint directory")
    d = root / iter_dir_name(iteration)
    if not (d / "metadata.json").exists():
        raise CheckpointError(f"{d}: no metadata.json; not a dist_checkpointing (torch_dist) checkpoint")
    common = dist_checkpointing.load_common_state_dict(str(d))
    meta = common.get(META_KEY, {})
    if model is None:
        if "model" not in meta:
            raise CheckpointError(f"{d} does not say its model shape; pass --model NAME")
        model = ModelConfig(**meta["model"])
    elif "model" in meta and model_difference(meta["model"], asdict(model)):
        raise CheckpointError(f"{d}: model shape differs: {'; '.join(model_difference(meta['model'], asdict(model)))}")
    try:
        module, optimizer, names = _single_rank_model(model, meta.get("train", {}))
        loaded = dist_checkpointing.load(_sharded(module, optimizer, is_loading=True), str(d))
        module.load_state_dict(loaded["model"], strict=False)
        optimizer.load_state_dict(loaded["optimizer"])
        state = RankState("megatron", 0, 1, MEGATRON_ROLE, module, names, optimizer, None, {}, {})
        raw = optimizer.state_dict()
        opt = canonical_optimizer_state({"optimizer": raw, "optimizer_param_names": optimizer_param_names(state),
                                         "rank": 0})
        params = {names[n]: p.detach().clone() for n, p in module.named_parameters()}
        return {"iteration": int(common.get("iteration", iteration)), "params": params, "opt": opt,
                "opt_param_scheduler": common.get("opt_param_scheduler"), "model": asdict(model).copy(),
                "train": meta.get("train", {})}
    finally:
        ps.destroy_model_parallel()


def import_checkpoint(load_dir: str, plan, out: str, model: ModelConfig | None = None) -> Path:
    """Split a plain Megatron dist checkpoint over `plan` into a HeterMoE checkpoint in out/."""
    from megatron_hetermoe.parallel.launcher import launch
    from megatron_hetermoe.plan.layout import megatron_to_hetero

    plan.validate()
    src = launch(_read_megatron_rank, 1, load_dir, model, timeout_s=600)[0]
    if src["opt_param_scheduler"] is None:
        raise CheckpointError(f"{load_dir}: no opt_param_scheduler in the checkpoint; cannot resume from it")
    mdict = src["model"]
    if plan.num_layers != mdict["num_layers"] or plan.num_experts != mdict["num_experts"]:
        raise CheckpointError(f"plan is for {plan.num_layers} layers x {plan.num_experts} experts, the checkpoint "
                              f"has {mdict['num_layers']} x {mdict['num_experts']}; make the plan for this model")
    iteration = src["iteration"]
    payloads = []
    for r in range(plan.world_size):
        local_names = megatron_to_hetero({c: c for c in src["params"]}, plan, r)  # local -> canonical
        payloads.append({
            "iteration": iteration, "rank": r, "role": str(plan.role(r)),
            "model": {n: src["params"][c] for n, c in local_names.items()},
            "names": local_names,
            "optimizer": None, "optimizer_param_names": [],
            "optimizer_canonical": {c: src["opt"][c] for c in local_names.values() if c in src["opt"]},
            "opt_param_scheduler": src["opt_param_scheduler"], "rng_state": None,
        })
    manifest = {"trainer": "hetero", "world_size": plan.world_size, "model": mdict,
                "layout": {"plan": plan.to_dict()}, "train": src["train"],
                "imported_from": str(Path(load_dir).resolve())}
    return write_offline(out, iteration, manifest, payloads)


# ---- CLI -----------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    from megatron_hetermoe.cli.checkpoint import build_parser

    a = build_parser().parse_args(argv)

    import megatron.core  # noqa: F401  - import once here; the rank is forked from this process

    from megatron_hetermoe.parallel.launcher import LaunchError
    from megatron_hetermoe.plan.hetero_plan import HeteroPlan, PlanError

    t0 = time.perf_counter()
    try:
        plan = HeteroPlan.load(a.plan) if a.plan else None
        if a.cmd == "export":
            r = export_checkpoint(a.load, a.out, a.ckpt_step, plan)
            print(f"exported iteration {r['iteration']} ({r['params']} tensors) to {r['dir']} "
                  f"in {time.perf_counter() - t0:.1f} s")
        else:
            d = import_checkpoint(a.load, plan, a.out, ModelConfig.load(a.model) if a.model else None)
            print(f"imported {a.load} for a plan of {plan.world_size} ranks into {d} "
                  f"in {time.perf_counter() - t0:.1f} s")
    except (CheckpointError, PlanError, LaunchError) as err:
        print(f"hetermoe checkpoint {a.cmd}: {err}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
