"""--overlap-grad-reduce and --overlap-param-gather (issue 27 item 6) on Megatron-LM's own pretrain()
with --hetero-plan added (core_v0.16.1 checkout, MEGATRON_LM_DIR): Megatron's DDP starts each bucket's
reduction from its backward hooks, on attention ranks (dense parameters, attention DP group) and
expert ranks (expert replicas) alike, and the distributed optimizer gathers parameters from the
next forward's pre-hooks."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from margins import within
from megatron_lm_run import BATCH, CPU, DATA, MODEL, RECIPE, run_losses
from shared_plans import asym_ea_plan

pytestmark = pytest.mark.slow
EVAL_OFF = ["--log-interval", "1", "--eval-interval", "100", "--eval-iters", "0"]
EP = ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall"]
# Small buckets (parameters per bucket), so a step has several and their reductions start one by one
# during backward instead of once at its end.
OVERLAP = {"grad": ["--overlap-grad-reduce", "--ddp-bucket-size", "4000"],
           "grad+param": ["--overlap-grad-reduce", "--use-distributed-optimizer", "--overlap-param-gather",
                          "--ddp-bucket-size", "4000"]}
_EP_RUNS: dict[str, dict] = {}


def overlapped_steps(trace: Path) -> dict[int, int]:
    """rank -> how many steps had a gradient-bucket reduction (issued by Megatron's DDP,
    param_and_grad_buffer.py) entered before one of that step's token transfers (all_to_all):
    the reduction started while backward still ran. A step ends at the gradient norm's all-reduce
    (HeterMoE's, training/world_stats.py world_grad_norm; Megatron's in clip_grads.py)."""
    out = {}
    for f in sorted(trace.glob("collectives.rank*.jsonl")):
        steps, reducing = 0, False
        for rec in (json.loads(ln) for ln in f.read_text().splitlines()):
            caller = " ".join(rec.get("caller", []))
            if "op" not in rec:
                continue
            if "param_and_grad_buffer.py" in caller and rec["op"] in ("all_reduce", "reduce_scatter_tensor",
                                                                        "_reduce_scatter_base"):
                reducing = reducing or "pending"
            elif rec["op"].startswith("all_to_all") and reducing == "pending":
                reducing = "overlapped"
            elif "world_stats.py" in caller or "clip_grads.py" in caller:
                steps += reducing == "overlapped"
                reducing = False
        out[int(f.name[len("collectives.rank"):-len(".jsonl")])] = steps
    return out


def _flags(data: str) -> list[str]:
    return [*MODEL, *BATCH, *DATA, *CPU, *RECIPE, *EVAL_OFF, "--data-path", data, "--moe-aux-loss-coeff", "0.01",
            "--train-iters", "4"]


# Mixtral's recipe (test_megatron_lm_recipes.py) runs --overlap-grad-reduce --overlap-param-gather with the
# distributed optimizer under zebra and distep too.
@pytest.mark.parametrize("overlap, schedule", [("grad", "zebra"), ("grad+param", "zebra")])
def test_overlapped_reductions_keep_megatron_eps_losses(mlm, data, tmp_path, tmp_path_factory, monkeypatch, overlap,
                                                        schedule):
    """From Megatron EP's checkpoint after one iteration, HeterMoE (Asym-EA: experts on attention
    and expert ranks) with overlapped reductions continues with Megatron EP's losses for 3
    iterations, the same flags on both; and on every rank, after the first of them (where
    Megatron's DDP learns how many gradients each bucket waits for, and reduces at the end),
    bucket reductions start before the step's last token transfers."""
    flags = [*_flags(data), *OVERLAP[overlap]]
    if overlap not in _EP_RUNS:
        tmp = tmp_path_factory.mktemp(f"ep-{overlap}")
        ckpt = tmp / "ckpt"
        run_losses(mlm, tmp, 2, [*flags, *EP, "--save", str(ckpt), "--save-interval", "1", "--train-iters", "1"], "tb")
        resumed, _ = run_losses(mlm, tmp, 2, [*flags, *EP, "--load", str(ckpt), "--no-load-optim", "--no-load-rng"],
                                "resumed")
        _EP_RUNS[overlap] = ckpt, resumed
    ckpt, ep = _EP_RUNS[overlap]
    assert sorted(ep) == [2, 3, 4], ep
    path = tmp_path / "plan.json"
    asym_ea_plan().save(path)
    monkeypatch.setenv("HETERMOE_TRACE_COLLECTIVES", str(tmp_path / "trace"))
    het, _ = run_losses(mlm, tmp_path, 4, [*flags, *EP, "--hetero-plan", str(path), "--hetero-schedule", schedule,
                                           "--load", str(ckpt), "--no-load-optim", "--no-load-rng"], "het")
    assert sorted(het) == [2, 3, 4], het
    within(f"--overlap {overlap}, {schedule} vs Megatron EP", max(abs(het[i] - ep[i]) for i in ep), 3e-6)
    assert overlapped_steps(tmp_path / "trace") == {r: 2 for r in range(4)}
