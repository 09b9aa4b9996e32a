"""Checkpoints: bitwise resume (Megatron EP, DistEP, zebra), atomic saves under injected
crashes, refusal of truncated/mismatched checkpoints, resharding, Megatron export/import."""
from __future__ import annotations

import dataclasses
import os
import shutil
from functools import partial

import pytest
import torch
from margins import within

from megatron_hetermoe.checkpoint import save as ck_save
from megatron_hetermoe.checkpoint.format import (
    MANIFEST,
    TRACKER,
    CheckpointError,
    iter_dir_name,
    locate,
    rank_file_name,
    read_tracker,
    sha256_file,
    verify_file,
)
from megatron_hetermoe.checkpoint.load import (
    layout_difference,
    model_difference,
    plan_difference,
)
from megatron_hetermoe.checkpoint.reshard import gather_canonical
from megatron_hetermoe.config import ParallelConfig, TrainConfig
from megatron_hetermoe.parallel.launcher import LaunchError, launch
from megatron_hetermoe.plan.hetero_plan import even_plan
from megatron_hetermoe.tools.parity import FREE_RUN_LOSS_TOL, max_rel_loss_diff

# Train 5 steps, saving every 2: the resumed runs start from step 2 and take 3 steps, so the
# last loss depends on an update made with the restored scheduler's learning rate.
STEPS, AT, CRASH_AT = 5, 2, 4


def _crash(target_stage: str, target_rank: int, target_iter: int, stage: str, rank: int, iteration: int) -> None:
    if (stage, rank, iteration) == (target_stage, target_rank, target_iter):
        os._exit(17)  # a hard crash: no exception handler, no cleanup


def _rank(rank: int, world: int, cfg: TrainConfig, plan, schedule: str | None, crash: tuple | None) -> dict:
    from megatron_hetermoe.config import HeteroRunConfig
    from megatron_hetermoe.training.hetero import train_hetero
    from megatron_hetermoe.training.megatron_ep import train

    if crash is not None:
        ck_save.FAULT_HOOK = partial(_crash, *crash)  # this forked rank only
    return train(cfg) if plan is None else train_hetero(cfg, plan, HeteroRunConfig(schedule=schedule))


def _run(cfg, plan=None, schedule=None, crash=None, world=4) -> dict:
    return launch(_rank, plan.world_size if plan else world, cfg, plan, schedule, crash, timeout_s=180)[0]


def _cfg(model, **kw) -> TrainConfig:
    return TrainConfig(model=model, micro_batch_size=2, global_batch_size=8, train_iters=STEPS,
                       deterministic=True, quiet=True, **kw)


# ---- Megatron EP baseline --------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("par, distopt", [(ParallelConfig(ep=2), False), (ParallelConfig(pp=2, ep=2), True)],
                         ids=["ep2", "pp2-ep2-distributed-optimizer"])
def test_megatron_resume_is_bitwise(tiny, tmp_path, par, distopt):
    cfg = _cfg(tiny, parallel=par, use_distributed_optimizer=distopt, save=str(tmp_path), save_interval=AT)
    full = _run(cfg).losses
    assert (tmp_path / TRACKER).read_text().strip() == str(STEPS)  # saved at 2, 4 and at the end
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000002", "iter_0000004", "iter_0000005", TRACKER]
    _, manifest = locate(tmp_path, AT)
    assert manifest["world_size"] == 4 and len(manifest["files"]) == 4
    assert all(len(m["sha256"]) == 64 and m["size"] > 0 for m in manifest["files"].values())
    resumed = _run(dataclasses.replace(cfg, save=None, load=str(tmp_path), ckpt_step=AT))
    assert resumed.start_iteration == AT
    assert resumed.losses == full[AT:], (resumed.losses, full)
    if not distopt:
        # A Megatron EP checkpoint continues under a HeterMoE plan, by parameter name.
        plan = even_plan(tiny.num_layers, tiny.num_experts, 1, 2, num_microbatches=4)
        hetero = _run(dataclasses.replace(cfg, parallel=ParallelConfig(), save=None, load=str(tmp_path), ckpt_step=AT,
                                          ckpt_reshard=True), plan, "distep")
        # Free-running after the load (another layout sums in another order): measured <= 8.9e-8 (112x inside).
        d = max_rel_loss_diff(hetero.losses, full[AT:])
        within("free-run loss after reshard", d, FREE_RUN_LOSS_TOL)


# ---- HeterMoE: one DistEP run that crashes while saving, reused by the tests below ------------
@pytest.fixture(scope="module")
def distep(tiny, tmp_path_factory):
    plan = even_plan(tiny.num_layers, tiny.num_experts, 2, 2, num_microbatches=2)  # 2 attention + 2 expert ranks
    root = tmp_path_factory.mktemp("distep")
    full = _run(_cfg(tiny), plan, "distep").losses
    cfg = _cfg(tiny, save=str(root / "ckpt"), save_interval=AT)
    # Expert rank 3 dies right after writing its file of the step-4 checkpoint.
    # (Which rank the launcher blames is racy: a peer may report its broken connection first.)
    with pytest.raises(LaunchError, match="rank [0-3] of 4 failed"):
        _run(cfg, plan, "distep", crash=("rank_file", 3, CRASH_AT))
    return {"plan": plan, "full": full, "dir": root / "ckpt", "cfg": cfg, "root": root}


@pytest.mark.slow
def test_crash_mid_save_keeps_previous_and_resume_is_bitwise_distep(distep):
    d = distep["dir"]
    assert read_tracker(d) == AT  # the tracker never moved to the crashed save
    assert (d / f"{iter_dir_name(CRASH_AT)}.tmp").is_dir() and not (d / iter_dir_name(CRASH_AT)).exists()
    # --load without --ckpt-step follows the tracker, past the debris of the crashed save.
    r = _run(dataclasses.replace(distep["cfg"], save=None, load=str(d)), distep["plan"], "distep")
    assert r.start_iteration == AT
    assert r.losses == distep["full"][AT:], (r.losses, distep["full"])


@pytest.mark.slow
def test_zebra_resume_is_bitwise_after_crash_before_tracker(tiny, tmp_path):
    plan = even_plan(tiny.num_layers, tiny.num_experts, 2, 2, num_microbatches=2, schedule="zebra")
    full = _run(_cfg(tiny), plan, "zebra").losses
    cfg = _cfg(tiny, save=str(tmp_path), save_interval=AT)
    # Rank 0 dies after renaming iter_0000004 into place but before updating the tracker.
    with pytest.raises(LaunchError, match="rank [0-3] of 4 failed"):
        _run(cfg, plan, "zebra", crash=("tracker", 0, CRASH_AT))
    assert read_tracker(tmp_path) == AT and (tmp_path / iter_dir_name(CRASH_AT) / MANIFEST).exists()
    r = _run(dataclasses.replace(cfg, save=None, load=str(tmp_path)), plan, "zebra")
    assert r.start_iteration == AT and r.losses == full[AT:], (r.losses, full)


# ---- refusal ---------------------------------------------------------------------------------
@pytest.mark.slow
def test_truncated_rank_file_is_refused_on_every_rank(distep, tmp_path):
    d = tmp_path / "ckpt"
    shutil.copytree(distep["dir"], d)
    f = d / iter_dir_name(AT) / rank_file_name(2)
    f.write_bytes(f.read_bytes()[:-100])
    cfg = dataclasses.replace(distep["cfg"], save=None, load=str(d))
    with pytest.raises(LaunchError, match=r"rank_00002/model_optim_rng.pt is \d+ bytes but the manifest says \d+: "
                                          r"the file is truncated"):
        _run(cfg, distep["plan"], "distep")


@pytest.mark.slow
def test_other_plan_is_refused_naming_the_difference_then_resharded(distep, tiny):
    other = even_plan(tiny.num_layers, tiny.num_experts, 1, 3, num_microbatches=4)  # 1 attention + 3 expert ranks
    cfg = dataclasses.replace(distep["cfg"], save=None, load=str(distep["dir"]))
    with pytest.raises(LaunchError, match=r"different layout: ZP group 0 attention_ranks \[0, 1\] in the checkpoint's "
                                          r"plan, \[0\] now.*--hetero-ckpt-reshard"):
        _run(cfg, other, "distep")
    # Opting in moves parameters and Adam moments by name: training continues as if uninterrupted
    # (to fp32 round-off: the new layout sums the batch in another order).
    r = _run(dataclasses.replace(cfg, ckpt_reshard=True), other, "distep")
    assert r.start_iteration == AT
    ref = distep["full"][AT:]
    d = max_rel_loss_diff(r.losses, ref)  # free-running: measured <= 8.9e-8 (112x inside)
    within("free-run loss after reshard", d, FREE_RUN_LOSS_TOL)


def test_validation_messages_name_the_problem(tmp_path, tiny):
    a = even_plan(2, 4, 2, 2).to_dict()
    assert plan_difference(a, even_plan(2, 4, 1, 2).to_dict())[0] == \
        "world size 4 in the checkpoint's plan, 3 now"
    b = even_plan(2, 4, 2, 2).to_dict()
    b["groups"][0]["placement"][1] = {"2": [0, 1, 2], "3": [3]}
    assert plan_difference(a, b) == [
        "layer 1 of ZP group 0: rank 2 holds experts [0, 1] in the checkpoint's plan, [0, 1, 2] now",
        "layer 1 of ZP group 0: rank 3 holds experts [2, 3] in the checkpoint's plan, [3] now"]
    wide = dataclasses.asdict(tiny.replace(hidden_size=128))
    assert model_difference(dataclasses.asdict(tiny), wide) == ["hidden_size 64 in the checkpoint, 128 now"]
    megatron = {"trainer": "megatron", "world_size": 4, "layout": {"expert-model-parallel-size": 2}}
    assert layout_difference(megatron, "megatron", {"expert-model-parallel-size": 4}, 4) == \
        ["expert-model-parallel-size 2 in the checkpoint, 4 now"]
    assert "saved by the megatron trainer" in layout_difference(megatron, "hetero", {}, 4)[0]
    # Tracker, manifest and file checks.
    with pytest.raises(CheckpointError, match="no latest_checkpointed_iteration.txt"):
        locate(tmp_path)
    (tmp_path / TRACKER).write_text("banana")
    with pytest.raises(CheckpointError, match="expected an iteration number, found 'banana'"):
        read_tracker(tmp_path)
    (tmp_path / TRACKER).write_text("3\n")
    (tmp_path / iter_dir_name(3)).mkdir()
    with pytest.raises(CheckpointError, match="manifest.json is missing: iter_0000003 is incomplete"):
        locate(tmp_path)
    d = tmp_path / iter_dir_name(3)
    f = d / rank_file_name(0)
    f.parent.mkdir()
    f.write_bytes(b"x" * 10)
    manifest = {"files": {rank_file_name(0): {"size": 10, "sha256": sha256_file(f)}}}
    assert verify_file(d, manifest, rank_file_name(0)) == f
    f.write_bytes(b"y" * 10)
    with pytest.raises(CheckpointError, match="rank_00000/model_optim_rng.pt: sha256 .* the file is corrupted"):
        verify_file(d, manifest, rank_file_name(0))
    f.unlink()
    with pytest.raises(CheckpointError, match="rank_00000/model_optim_rng.pt is missing"):
        verify_file(d, manifest, rank_file_name(0))


@pytest.mark.slow
def test_wrong_model_shape_is_refused(distep, tiny):
    wide = tiny.replace(moe_ffn_hidden_size=64)
    cfg = dataclasses.replace(distep["cfg"], model=wide, save=None, load=str(distep["dir"]))
    with pytest.raises(LaunchError, match=r"model shape differs: moe_ffn_hidden_size 128 in the checkpoint, 64 now"):
        _run(cfg, distep["plan"], "distep")


# ---- export to a plain Megatron dist checkpoint and back ----------------------------------------
@pytest.mark.slow
def test_export_import_identity_and_resume(distep):
    from megatron_hetermoe.commands import main as cli

    root = distep["root"]
    plan_file = root / "plan.json"
    distep["plan"].save(plan_file)
    mega, back = root / "megatron", root / "imported"
    assert cli(["checkpoint", "export", "--load", str(distep["dir"]), "--plan", str(plan_file), "-o", str(mega)]) == 0
    assert (mega / TRACKER).read_text().strip() == str(AT)
    assert (mega / iter_dir_name(AT) / "metadata.json").exists()  # dist_checkpointing's own metadata
    assert cli(["checkpoint", "import", "--load", str(mega), "--plan", str(plan_file), "-o", str(back)]) == 0
    # Identity: every parameter and Adam moment, by canonical name.
    p0, o0, _ = gather_canonical(*locate(distep["dir"]))
    p1, o1, _ = gather_canonical(*locate(back))
    assert p0.keys() == p1.keys() and all(torch.equal(p0[k], p1[k]) for k in p0)
    assert o0.keys() == o1.keys() == p0.keys()
    for k in o0:
        assert o0[k].keys() == o1[k].keys() and all(torch.equal(o0[k][s], o1[k][s]) for s in o0[k]), k
    # And training from the round-tripped checkpoint is the uninterrupted run, bit for bit.
    r = _run(dataclasses.replace(distep["cfg"], save=None, load=str(back)), distep["plan"], "distep")
    assert r.start_iteration == AT and r.losses == distep["full"][AT:], (r.losses, distep["full"])
    # The export is a real Megatron checkpoint: megatron-core itself reshards it onto EP=2.
    got = launch(_load_exported_ep2, 2, str(mega / iter_dir_name(AT)), timeout_s=120)
    merged = {**got[0], **got[1]}
    assert merged.keys() == p0.keys() and all(torch.equal(merged[k], p0[k]) for k in p0)
    # A plan the checkpoint was not trained with is refused by export.
    other = root / "other.json"
    even_plan(2, 4, 1, 3).save(other)
    assert cli(["checkpoint", "export", "--load", str(distep["dir"]), "--plan", str(other), "-o", str(root / "x")]) == 1


def _load_exported_ep2(rank: int, world: int, path: str) -> dict:
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_hetermoe.config import ModelConfig
    from megatron_hetermoe.models.builder import (
        build_gpt,
        canonical_names,
        transformer_config,
    )

    model = ModelConfig.load("tiny")
    ps.initialize_model_parallel(expert_model_parallel_size=2)
    try:
        model_parallel_cuda_manual_seed(1)
        gpt = build_gpt(model, transformer_config(model, ParallelConfig(ep=2)))
        gpt.load_state_dict(dist_checkpointing.load(gpt.sharded_state_dict(), path), strict=False)
        names = canonical_names(gpt)
        return {names[n]: p.detach().clone() for n, p in gpt.named_parameters()}
    finally:
        ps.destroy_model_parallel()
