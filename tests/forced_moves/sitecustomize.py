"""Live moves forced in Megatron-LM's pretrain() ranks (tests/training/test_megatron_lm_live_moves.py),
as the plugin trainer's tests force them with RunHooks.replan: a process started with this folder on
PYTHONPATH and HETERMOE_TEST_FORCED_MOVES='{"2": placement, ...}' (group 0's placement per MoE
layer, ranks as strings) moves to that placement at that iteration's decision and stays otherwise."""
import json
import os

_FORCED = os.environ.get("HETERMOE_TEST_FORCED_MOVES")

if _FORCED:
    from megatron_hetermoe.planner.rebalance import with_placement
    from megatron_hetermoe.training import replan

    _placements = {int(it): [{int(r): es for r, es in pl.items()} for pl in p] for it, p in json.loads(_FORCED).items()}
    _init = replan.Replanner.__init__

    def _forced(iteration, plan):
        p = _placements.get(iteration)
        return None if p is None else with_placement(plan, p)

    def _init_forced(self, hs, run, hook, *a, **k):
        _init(self, hs, run, hook or _forced, *a, **k)

    replan.Replanner.__init__ = _init_forced
