"""`make demo`'s job (tools/demo.py run_demo), shrunk to a few steps: it trains, times both strategies,
and reports the expert loads the router made and what re-placing the experts for them is predicted to
gain (issue 46: the demo prints the skew and the closed loop's gain)."""
from __future__ import annotations

import json

import pytest


@pytest.mark.slow
def test_the_demo_reports_skew_and_the_placement_gain(tmp_path, capsys):
    from megatron_hetermoe.tools.demo import DEMO_WARMUP_ITERS, run_demo

    out = tmp_path / "demo"
    summary = run_demo(str(out), steps=DEMO_WARMUP_ITERS + 4, measure_steps=1, ep_measure_steps=1,
                       max_step_seconds=5.0)
    printed = capsys.readouterr().out
    assert json.loads((out / "summary.json").read_text())["expert_load"] == json.loads(
        json.dumps(summary["expert_load"], default=str))
    load = summary["expert_load"]
    # W1's 4 MoE layers: the loads of a real router, every layer at or above the balanced 1.0
    assert len(load["max_over_mean_per_layer"]) == 4 and min(load["max_over_mean_per_layer"]) >= 1.0
    assert load["gain"] >= 1.0 and load["placement"] in ("load-aware", "uniform")
    assert load["uniform_step_s"] > 0 and load["load_aware_step_s"] > 0
    assert "expert loads the router made" in printed and f"{load['gain']:.3f}x the static placement" in printed
    assert summary["loss_last10"] < summary["loss_first10"]  # it learns
    assert (out / "timeline.png").stat().st_size > 0
