"""--hetero-replan-interval / --hetero-replan-margin (training/replan.py): what they set, and the
combinations refused before any rank starts."""
from __future__ import annotations

import pytest

from megatron_hetermoe.config import HeteroRunConfig
from megatron_hetermoe.plan.hetero_plan import even_plan
from megatron_hetermoe.training import args as train_args

BASE = ["--model", "tiny", "--micro-batch-size", "1", "--global-batch-size", "4"]


def _plan(tmp_path, tiny) -> str:
    path = tmp_path / "plan.json"
    even_plan(tiny.num_layers, tiny.num_experts, 2, 2, num_microbatches=2).save(path)
    return str(path)


def test_the_flags_reach_the_run_config(tiny, tmp_path):
    p = train_args.build_parser()
    a = p.parse_args(BASE + ["--hetero-plan", _plan(tmp_path, tiny), "--hetero-replan-interval", "20",
                             "--hetero-replan-margin", "0.5"])
    _, plan, hetero, _ = train_args.validate_run(p, a)
    assert (hetero.replan_interval, hetero.replan_margin) == (20, 0.5) and plan is not None


def test_an_emulated_run_may_move_experts(tiny, tmp_path):
    """--emulate with --hetero-replan-interval: the emulated times follow each move's plan
    (tests/integration/test_emulated_live_moves.py)."""
    p = train_args.build_parser()
    plan = tmp_path / "plan.json"
    even_plan(tiny.num_layers, tiny.num_experts, 2, 2, num_microbatches=2,
              gpu_types=["A40", "A40", "V100-16GB", "V100-16GB"]).save(plan)
    a = p.parse_args(BASE + ["--hetero-plan", str(plan), "--hetero-replan-interval", "5", "--emulate",
                             "mini-2a40-2v100", "--emulated-model", "tiny"])
    cfg, _, hetero, _ = train_args.validate_run(p, a)
    assert hetero.replan_interval == 5 and cfg.emulate is not None


@pytest.mark.parametrize("extra, says", [
    (["--hetero-replan-interval", "5"], "needs --hetero-plan"),
    (["--hetero-replan-interval", "-1", "PLAN"], "give steps >= 0"),
    (["--hetero-replan-interval", "5", "--hetero-replan-margin", "-2", "PLAN"], "a factor >= 0"),
])
def test_refused_combinations_name_the_flag(tiny, tmp_path, capsys, extra, says):
    extra = [x for x in extra if x != "PLAN"] + (["--hetero-plan", _plan(tmp_path, tiny)] if "PLAN" in extra else [])
    with pytest.raises(SystemExit) as e:
        train_args.main(BASE + extra)
    assert e.value.code == 2
    assert says in capsys.readouterr().err


def test_run_config_checks_its_values():
    with pytest.raises(ValueError, match="--hetero-replan-interval 1.5"):
        HeteroRunConfig(replan_interval=1.5)
    with pytest.raises(ValueError, match="--hetero-replan-margin -1"):
        HeteroRunConfig(replan_margin=-1.0)
