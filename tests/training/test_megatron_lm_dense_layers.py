"""Dense layers (issue 27 item 2): Megatron's --moe-layer-freq, DeepSeek's first-k dense layers and
an interleaved pattern, on Megatron-LM's own pretrain() with --hetero-plan added (core_v0.16.1 checkout,
MEGATRON_LM_DIR). The plan counts MoE layers and names the dense ones (dense_layers): they run on
the attention ranks inside zebra's stages, as TransformerBlock runs them."""
from __future__ import annotations

import pytest
import torch
from margins import within
from megatron_lm_run import BATCH, CPU, DATA, MODEL, RECIPE, load_dcp, run_losses
from shared_plans import asym_ea_plan

pytestmark = pytest.mark.slow
EVAL_OFF = ["--log-interval", "1", "--eval-interval", "100", "--eval-iters", "0"]
EP = ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall"]
# (--num-layers, --moe-layer-freq, the plan's dense_layers): DeepSeek-V2/V3's first-k dense layers as
# their recipes write them, and every other layer dense (the last one too: it runs before the head).
PATTERNS = {"first-k-dense": ("3", "([0]+[1]*2)", [0]), "freq-2": ("4", "2", [1, 3])}
_EP_RUNS: dict[str, tuple] = {}


def _with(flags: list[str], **kv: str) -> list[str]:
    out = list(flags)
    for k, v in kv.items():
        out[out.index(f"--{k.replace('_', '-')}") + 1] = v
    return out


def _resume_losses(mlm, tmp_path, nproc: int, flags: list[str], ckpt, name: str) -> dict[int, float]:
    losses, _ = run_losses(mlm, tmp_path, nproc, [*flags, "--load", str(ckpt), "--ckpt-step", "1",
                                                    "--no-load-optim", "--no-load-rng"], name)
    assert sorted(losses) == [2, 3, 4], losses
    return losses


# DeepSeek-V2-Lite's recipe (test_megatron_lm_recipes.py) runs first-k-dense under zebra and distep.
@pytest.mark.parametrize("pattern, schedule", [("freq-2", "zebra")])
def test_dense_layers_equal_megatron_ep(mlm, data, tmp_path, tmp_path_factory, pattern, schedule):
    """A plain Megatron EP checkpoint of a model with dense layers, after one iteration, loads into
    Megatron EP and into an Asym-EA HeterMoE run (experts on attention and expert ranks; the
    expert ranks' checkpoint keys are Megatron's for non-homogeneous layers): the next 3
    iterations' losses are equal, and the checkpoints both save after them hold the same
    tensors under the same keys."""
    layers, freq, dense = PATTERNS[pattern]
    flags = [*_with(MODEL, num_layers=layers), *DATA, *CPU, *RECIPE,
             *_with(BATCH, train_iters="4"), *EVAL_OFF, "--data-path", data, "--moe-aux-loss-coeff", "0.01",
             "--moe-layer-freq", freq]
    if pattern not in _EP_RUNS:
        tmp = tmp_path_factory.mktemp(f"ep-{pattern}")
        ckpt = tmp / "ckpt"
        run_losses(mlm, tmp, 2, [*flags, *EP, "--save", str(ckpt), "--save-interval", "1", "--train-iters", "1"],
                   "tb")
        saved = tmp / "after"
        _EP_RUNS[pattern] = ckpt, _resume_losses(mlm, tmp, 2, [*flags, *EP, "--save", str(saved), "--save-interval",
                                                               "4"], ckpt, "resumed"), saved
    ckpt, ep, ep_saved = _EP_RUNS[pattern]
    path = tmp_path / "plan.json"
    plan = asym_ea_plan()
    plan.dense_layers = dense
    plan.save(path)
    saved = tmp_path / "after"
    het = _resume_losses(mlm, tmp_path, 4, [*flags, "--hetero-plan", str(path), "--hetero-schedule", schedule,
                                            "--save", str(saved), "--save-interval", "4"], ckpt, "het")
    within(f"dense layers {pattern}, {schedule} vs Megatron EP", max(abs(het[i] - ep[i]) for i in ep), 3e-6)
    a, b = (load_dcp(d / "iter_0000004") for d in (ep_saved, saved))
    model = ("decoder.", "embedding.", "output_layer.")
    assert sorted(k for k in a if k.startswith(model)) == sorted(k for k in b if k.startswith(model))
    weights = sorted(k for k in a if k.startswith(model) and isinstance(a[k], torch.Tensor))
    dense_mlp = [k for k in weights if f"layers.{dense[-1]}.mlp.linear_fc1" in k]
    experts = [k for k in weights if ".mlp.experts." in k]
    assert dense_mlp and experts, weights  # a dense layer's MLP and the experts: both saved under Megatron's keys
    worst = max((a[k].float() - b[k].float()).abs().max().item() for k in weights)
    within(f"dense layers {pattern}, {schedule}: saved weights vs Megatron EP's", worst, 2e-5)
