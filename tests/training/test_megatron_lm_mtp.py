"""Multi-token prediction (issue 27 item 4): Megatron's --mtp-num-layers on Megatron-LM's own
pretrain() with --hetero-plan added (core_v0.16.1 checkout, MEGATRON_LM_DIR). The MTP block runs on
the attention ranks; its MoE layer is the plan's model layer after the decoder's (mtp_layers), its
experts placed and dispatched like any other layer's, its loss logged as Megatron logs it."""
from __future__ import annotations

import pytest
import torch
from margins import within
from megatron_lm_run import BATCH, CPU, DATA, MODEL, RECIPE, load_dcp, run_losses, tb_losses

from megatron_hetermoe.plan.hetero_plan import HeteroPlan, ZPGroup

pytestmark = pytest.mark.slow
EVAL_OFF = ["--log-interval", "1", "--eval-interval", "100", "--eval-iters", "0"]
EP = ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall"]
MTP = ["--mtp-num-layers", "1", "--mtp-loss-scaling-factor", "0.3"]


def _with(flags: list[str], **kv: str) -> list[str]:
    out = list(flags)
    for k, v in kv.items():
        out[out.index(f"--{k.replace('_', '-')}") + 1] = v
    return out


def mtp_plan(schedule: str = "distep") -> HeteroPlan:
    """The tiny model's 2 decoder MoE layers and its MTP layer (model layer 2): one ZP group of 2
    attention ranks (0, 1) + 2 expert ranks (2, 3), R=2. Attention rank 0 holds an expert of the
    MTP layer only, rank 1 one of each decoder layer (Asym-EA); expert rank 3 holds nothing in
    decoder layer 1 nor in the MTP layer."""
    g = ZPGroup([0, 1], [2, 3], [{1: [0], 2: [1, 2], 3: [3]}, {1: [3], 2: [0, 1, 2]}, {0: [1], 2: [0, 2, 3]}])
    return HeteroPlan(3, 4, ["cpu"] * 4, [g], num_microbatches=2, schedule=schedule, mtp_layers=1)


def _resume(mlm, tmp_path, nproc: int, flags: list[str], ckpt, name: str) -> dict[str, dict[int, float]]:
    """Megatron's logged values of the 3 iterations after the checkpoint: lm loss, the MTP layer's
    loss and the load-balancing loss (averaged over the MoE layers, the MTP layer's included)."""
    losses, _ = run_losses(mlm, tmp_path, nproc, [*flags, "--load", str(ckpt), "--ckpt-step", "1",
                                                  "--no-load-optim", "--no-load-rng"], name)
    out = {"lm loss": losses, **{t: tb_losses(tmp_path / name, t) for t in ("mtp_1 loss", "load_balancing_loss")}}
    for tag, values in out.items():
        assert sorted(values) == [2, 3, 4] and all(v > 0 for v in values.values()), (tag, values)
    return out


@pytest.fixture(scope="module")
def mtp_reference(mlm, data, tmp_path_factory):
    """A plain Megatron EP checkpoint of a model with one MTP layer after one iteration, and plain
    Megatron EP's next 3 iterations from it, with the checkpoint it saves after them."""
    flags = [*MODEL, *DATA, *CPU, *RECIPE, *_with(BATCH, train_iters="4"), *EVAL_OFF, "--data-path", data,
             "--moe-aux-loss-coeff", "0.01", *MTP]
    ep_dir = tmp_path_factory.mktemp("mtp_ep")
    ckpt, ep_saved = ep_dir / "ckpt", ep_dir / "after"
    run_losses(mlm, ep_dir, 2, [*flags, *EP, "--save", str(ckpt), "--save-interval", "1", "--train-iters", "1"], "tb")
    ep = _resume(mlm, ep_dir, 2, [*flags, *EP, "--save", str(ep_saved), "--save-interval", "4"], ckpt, "resumed")
    return flags, ckpt, ep, ep_saved


@pytest.mark.parametrize("schedule", ["distep", "zebra"])
def test_mtp_equals_megatron_ep(mlm, mtp_reference, tmp_path, schedule):
    """Plain Megatron EP's checkpoint of a model with one MTP layer loads into a HeterMoE run (MTP
    experts on an attention rank and an expert rank, none on the other), under DistEP and under
    zebra (the MTP layer's MoE layer is zebra's third stage cut; models/stages.py): the next 3
    iterations' lm and MTP losses are Megatron EP's, and the checkpoints both save after them hold
    the same tensors under the same keys, the MTP layer's experts included."""
    flags, ckpt, ep, ep_saved = mtp_reference
    path = tmp_path / "plan.json"
    mtp_plan(schedule).save(path)
    saved = tmp_path / "after"
    # logged by the last rank, an expert rank here
    het = _resume(mlm, tmp_path, 4, [*flags, "--hetero-plan", str(path), "--hetero-schedule", schedule,
                                     "--save", str(saved), "--save-interval", "4"], ckpt, "het")
    # Measured (default, avx2, avx512 kernels): losses bitwise or <= 4.8e-7, saved weights <= 3.8e-6
    # (distep) and <= 4.6e-6 (zebra, whose microbatch order sums in another order): >= 6x inside.
    for tag in ep:
        within(f"MTP model, {schedule} vs Megatron EP: {tag}", max(abs(het[tag][i] - ep[tag][i]) for i in ep[tag]),
               3e-6)
    a, b = (load_dcp(d / "iter_0000004") for d in (ep_saved, saved))
    model = ("decoder.", "embedding.", "output_layer.", "mtp.")
    assert sorted(k for k in a if k.startswith(model)) == sorted(k for k in b if k.startswith(model))
    weights = sorted(k for k in a if k.startswith(model) and isinstance(a[k], torch.Tensor))
    mtp_experts = [k for k in weights if k.startswith("mtp.") and ".mlp.experts." in k]
    assert mtp_experts and [k for k in weights if k.startswith("mtp.") and "eh_proj" in k], weights
    worst = max((a[k].float() - b[k].float()).abs().max().item() for k in weights)
    within(f"MTP model, {schedule}: saved weights vs Megatron EP's", worst, 3e-5)


@pytest.mark.parametrize("schedule", ["distep", "zebra"])
def test_mtp_across_pipeline_stages_equals_megatron_ep(mlm, mtp_reference, tmp_path, schedule):
    """Two pipeline stages, the MTP layer with the last (as megatron-core builds its MTP block there):
    each stage one attention + one expert rank, the MTP layer's experts on the last stage's expert
    rank. From plain Megatron EP's checkpoint (PP 1, resharded by dist_checkpointing) the next 3
    iterations' lm and MTP losses are Megatron EP's, under DistEP (Megatron's 1F1B, the expert ranks
    mirroring it) and under zebra (each stage's task lists, the MTP block cut at its MoE layer)."""
    from megatron_hetermoe.plan.hetero_plan import even_plan

    flags, ckpt, ep, _ = mtp_reference
    path = tmp_path / "plan.json"
    even_plan(3, 4, 1, 1, num_microbatches=4, schedule=schedule, pipeline_stages=2, mtp_layers=1).save(path)
    het = _resume(mlm, tmp_path, 4, [*flags, "--pipeline-model-parallel-size", "2", "--hetero-plan", str(path),
                                     "--hetero-schedule", schedule], ckpt, "het")
    for tag in ep:
        within(f"MTP model at PP 2, {schedule} vs Megatron EP: {tag}",
               max(abs(het[tag][i] - ep[tag][i]) for i in ep[tag]), 3e-6)
