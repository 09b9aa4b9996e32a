"""Expert loads measured inside Megatron-LM's pretrain() (core_v0.16.1, MEGATRON_LM_DIR) and on the
plugin's trainer, from the same data: the same tokens per expert in the stats file (issue 46 item 1),
"expert load max/mean" in Megatron's iteration line and its TensorBoard scalars."""
from __future__ import annotations

import json

import pytest
from megatron_lm_run import hetero_run, plugin_losses, tb_losses


@pytest.mark.slow
def test_pretrain_and_plugin_trainer_log_the_same_expert_loads(mlm, data, tmp_path):
    from megatron_hetermoe.plan.hetero_plan import even_plan

    plan = tmp_path / "plan.json"
    even_plan(2, 4, 1, 1, groups=2, num_microbatches=2, schedule="zebra").save(plan)
    mine, theirs = tmp_path / "pretrain-load.json", tmp_path / "plugin-load.json"
    log, _ = hetero_run(mlm, plan, data, tmp_path / "tb",
                        ["--hetero-expert-load-stats", str(mine), "--moe-per-layer-logging"])
    plugin_losses(tmp_path, plan, "zebra", data, ("--hetero-expert-load-stats", str(theirs)))
    a, b = json.loads(mine.read_text()), json.loads(theirs.read_text())
    assert a["steps"] == b["steps"] == 3 and a["iterations"] == b["iterations"] == [1, 3]
    # Every routed row counted once: 3 iterations x 8 sequences x 32 tokens x top-2, per layer (the
    # validation and test passes, forward only, are not training load).
    assert [sum(row) for row in a["tokens"]] == [3 * 8 * 32 * 2] * 2
    # The first iteration's weights are the same in both hostings: the same routing.
    assert a["intervals"][0]["tokens"] == b["intervals"][0]["tokens"]
    assert "expert load max/mean:" in log
    worst = tb_losses(tmp_path / "tb", "expert_load_max_over_mean")
    assert sorted(worst) == [1, 2, 3] and all(v >= 1.0 for v in worst.values())
    first = a["intervals"][0]["tokens"]
    want = max(max(row) / (sum(row) / len(row)) for row in first)
    assert worst[1] == pytest.approx(want, rel=1e-6)
    assert tb_losses(tmp_path / "tb", "moe/expert_tokens_layer_1_expert_3")[1] == first[1][3]
