"""Checkpoints at every layout (issue 42 item 4) in Megatron-LM's own pretrain() (core_v0.16.1 checkout,
MEGATRON_LM_DIR), with Megatron's distributed optimizer: Mixtral's flags (examples/mixtral/, shrunk as
test_megatron_lm_recipes.py shrinks them) at pipeline size 2 under zebra and distep, at 2 x 2 virtual
stages (zebra, distep), with an MTP layer at 2 stages under both schedules, and an Asym-EA plan whose attention
ranks hold different numbers of optimizers; and at PP 2 with --dist-ckpt-optim-fully-reshardable. Plans are
made as a user makes them (`hetermoe plan --even ... -- <the run's flags>`), except the Asym-EA one (a
search's placement).

Per layout, one chain of runs from one plain Megatron EP checkpoint (saved after iteration 1):
- Megatron EP -> HeterMoE: plain Megatron and HeterMoE each load it (--no-load-optim --no-load-rng, as
  for any change of layout) and train iterations 2-5 with the same lm and load-balancing losses;
- save -> resume: the HeterMoE run saves after iterations 3 and 5 (torch_dist: model, distributed
  optimizer, RNG); resumed from iteration 3, its iterations 4 and 5 are bitwise the uninterrupted
  run's (5 depends on the Adam step taken after the load);
- HeterMoE -> Megatron EP (once per layout): plain Megatron and HeterMoE each load its iteration-5
  checkpoint and train iteration 6 with the same losses.
Before the fix, the saves raised `Duplicate ShardedObject keys:
['optimizer.distributed.dp_group_idx_0.optimizer/shard_0_1']` (pipeline stages) and `Invalid access
pattern: 1 ShardedObject are missing` (Asym-EA), and a resume failed in megatron-core's
DistributedOptimizer on torch's Adam (no apex/TE; shims/distrib_optimizer.py _torch_adam_replacements):
an assertion (both formats), then a wrong Adam step from the second iteration on."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest
from margins import within
from megatron_lm_run import BATCH, CPU, DATA, MODEL, RECIPE, run_losses, tb_losses
from test_megatron_lm_recipes import MIXTRAL, recipe_flags, shrunk

from megatron_hetermoe.plan.hetero_plan import HeteroPlan
from megatron_hetermoe.planner.cli_plan import main as plan_main

pytestmark = pytest.mark.slow
EVAL_OFF = ["--log-interval", "1", "--eval-interval", "100", "--eval-iters", "0"]
CROSS = ["--no-load-optim", "--no-load-rng"]
LAST, SAVED = 5, 3  # iterations: the runs' last, and the one resumed from
BALANCE = "load_balancing_loss"
# |a - b| / |b| of the logged values of two runs from one checkpoint. Measured on default and AVX-512
# kernels: bitwise or 1 to 2 fp32 ulps apart (the microbatches' values summed in another order), at
# most 2.4e-7 (AVX-512: mtp-pp2 zebra's load-balancing loss; its lm loss 1.6e-7, 9.5e-7 at 5.9).
REL_TOL = 1.5e-6


@dataclass(frozen=True)
class Layout:
    """`flags`: the HeterMoE runs' (model, batch, data, CPU, layout; --hetero-plan added), on `nproc`
    ranks; `plain`: plain Megatron EP's, on `plain_nproc` ranks; `even`: `hetermoe plan --even`'s
    own flags (the rest comes from the run's flags), or None for `plan`'s hand-made plan; `tags`:
    the logged values compared besides lm loss."""
    flags: list[str]
    plain: list[str]
    plain_nproc: int
    nproc: int
    even: list[str] | None = None
    plan: Callable[[str], HeteroPlan] | None = None  # by schedule
    tags: tuple[str, ...] = (BALANCE,)
    both_ways: str | None = "zebra"  # the schedule whose checkpoint goes back into Megatron EP


def _set(flags: list[str], **kv: str) -> list[str]:
    out = list(flags)
    for k, v in kv.items():
        flag = f"--{k.replace('_', '-')}"
        if flag in out:
            out[out.index(flag) + 1] = v
        else:
            out += [flag, v]
    return out


def _mixtral(mlm: Path, data: str, **kv: str) -> list[str]:
    """Mixtral's flags (its --use-distributed-optimizer, --overlap-grad-reduce, --overlap-param-gather
    included), shrunk, at pipeline size 2."""
    flags = [*shrunk(recipe_flags(mlm, MIXTRAL)), *DATA, *CPU, *EVAL_OFF, "--data-path", data]
    assert "--use-distributed-optimizer" in flags
    return _set(flags, pipeline_model_parallel_size="2", train_iters=str(LAST), **kv)


def _layouts(mlm: Path, data: str) -> dict[str, Layout]:
    from shared_plans import sparse_asym_ea_plan

    one = ["--attention-ranks", "1", "--expert-ranks", "1"]  # per stage; the rest from the run's flags
    mixtral = _mixtral(mlm, data)  # its own EP 2: plain Megatron at PP 2 x EP 2 on 4 ranks
    vpp = _mixtral(mlm, data, num_layers="4")
    mtp = _set(mixtral, mtp_num_layers="1", mtp_loss_scaling_factor="0.3")
    tiny = _set([*MODEL, *BATCH, *DATA, *RECIPE, *CPU, *EVAL_OFF, "--data-path", data, "--moe-aux-loss-coeff", "0.01",
                 "--use-distributed-optimizer"], train_iters=str(LAST))
    return {
        "pp2": Layout(mixtral, mixtral, 4, 4, even=one),
        # Megatron's other optimizer format (each parameter's state whole, gathered on DP rank 0).
        "pp2-fully-reshardable": Layout([*mixtral, "--dist-ckpt-optim-fully-reshardable"], mixtral, 4, 4, even=one,
                                        both_ways=None),
        # 4 layers, stage 0 holding 0 and 2, stage 1 1 and 3; plain Megatron at PP 1 x EP 2.
        "vpp2": Layout([*vpp, "--num-virtual-stages-per-pipeline-rank", "2"],
                       _set(vpp, pipeline_model_parallel_size="1"), 2, 4, even=one, both_ways="distep"),
        "mtp-pp2": Layout(mtp, _set(mtp, pipeline_model_parallel_size="1"), 2, 4, even=one,
                          tags=(BALANCE, "mtp_1 loss")),
        # PP 1: attention rank 0 steps a dense optimizer, rank 1 a dense and an expert one.
        "asym-ea": Layout(tiny, [*tiny, "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall"],
                          2, 4, plan=sparse_asym_ea_plan),
    }


def _values(tb: Path, tags: tuple[str, ...]) -> dict[str, dict[int, float]]:
    return {"lm loss": tb_losses(tb), **{t: tb_losses(tb, t) for t in tags}}


def _run(mlm: Path, tmp: Path, nproc: int, flags: list[str], name: str, tags: tuple[str, ...],
         steps: list[int]) -> dict[str, dict[int, float]]:
    _, log = run_losses(mlm, tmp, nproc, flags, name)
    out = _values(tmp / name, tags)
    for tag, values in out.items():
        assert sorted(values) == steps and all(v > 0 for v in values.values()), (tag, values, log[-2000:])
    return out


def _close(what: str, a: dict[str, dict[int, float]], b: dict[str, dict[int, float]]) -> None:
    for tag in a:
        within(f"{what}: {tag} (relative)", max(abs(a[tag][i] - b[tag][i]) / abs(b[tag][i]) for i in a[tag]), REL_TOL)


@dataclass
class Reference:
    """Plain Megatron EP's checkpoint after iteration 1 and its iterations 2-LAST from it."""
    ckpt: Path
    values: dict[str, dict[int, float]] = field(default_factory=dict)


_REFERENCES: dict[tuple, Reference] = {}  # by plain Megatron's command line


def _reference(mlm: Path, tmp_path_factory, name: str, layout: Layout) -> Reference:
    key = (layout.plain_nproc, *layout.plain, *layout.tags)
    if key not in _REFERENCES:
        tmp = tmp_path_factory.mktemp(f"ep-{name}")
        plain = layout.plain
        ckpt = tmp / "ckpt"
        # Megatron: the warm-up must end before the (1-iteration) decay does.
        run_losses(mlm, tmp, layout.plain_nproc, [*_set(plain, train_iters="1", lr_warmup_iters="0"), "--save",
                                                  str(ckpt), "--save-interval", "1"], "tb0")
        ref = Reference(ckpt)
        ref.values = _run(mlm, tmp, layout.plain_nproc, [*plain, "--load", str(ckpt), *CROSS], "tb1", layout.tags,
                          list(range(2, LAST + 1)))
        _REFERENCES[key] = ref
    return _REFERENCES[key]


def _plan(layout: Layout, schedule: str, path: Path) -> Path:
    if layout.plan is not None:
        layout.plan(schedule).save(path)
    else:
        assert plan_main(["--even", *layout.even, "--schedule", schedule, "-o", str(path), "--", *layout.flags]) == 0
    return path


CASES = [("pp2", "zebra"), ("pp2", "distep"), ("pp2-fully-reshardable", "zebra"), ("vpp2", "distep"), ("vpp2", "zebra"),
         ("mtp-pp2", "zebra"), ("mtp-pp2", "distep"), ("asym-ea", "zebra")]


@pytest.mark.parametrize("name,schedule", CASES, ids=[f"{n}-{s}" for n, s in CASES])
def test_checkpoints_at_every_layout(mlm, data, tmp_path, tmp_path_factory, name, schedule):
    layout = _layouts(mlm, data)[name]
    ref = _reference(mlm, tmp_path_factory, name, layout)
    het = [*layout.flags, "--hetero-plan", str(_plan(layout, schedule, tmp_path / "plan.json"))]
    saved = tmp_path / "hetero"
    # Megatron EP -> HeterMoE, saving after iteration SAVED and the last.
    into = _run(mlm, tmp_path, layout.nproc, [*het, "--load", str(ref.ckpt), *CROSS, "--save", str(saved),
                                              "--save-interval", str(SAVED)], "into", layout.tags,
                list(range(2, LAST + 1)))
    _close(f"{name} {schedule}: HeterMoE from Megatron EP's checkpoint vs Megatron EP", into, ref.values)
    assert sorted(p.name for p in saved.iterdir() if p.is_dir()) == [f"iter_{i:07d}" for i in (SAVED, LAST)]
    # save -> resume: everything restored (model, distributed optimizer, RNG, scheduler, data position).
    after = list(range(SAVED + 1, LAST + 1))
    resumed = _run(mlm, tmp_path, layout.nproc, [*het, "--load", str(saved), "--ckpt-step", str(SAVED)], "resumed",
                   layout.tags, after)
    assert resumed == {t: {i: v[i] for i in after} for t, v in into.items()}
    if schedule != layout.both_ways:
        return
    # HeterMoE -> Megatron EP: its last checkpoint loads into both.
    more = ["--load", str(saved), *CROSS, "--train-iters", str(LAST + 1)]
    back_ep = _run(mlm, tmp_path, layout.plain_nproc, [*layout.plain, *more], "back_ep", layout.tags, [LAST + 1])
    back_h = _run(mlm, tmp_path, layout.nproc, [*het, *more], "back_h", layout.tags, [LAST + 1])
    _close(f"{name}: Megatron EP from HeterMoE's checkpoint vs HeterMoE", back_ep, back_h)
