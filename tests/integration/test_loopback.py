"""A ZP group of one rank (every expert on the one attention rank) moves its tokens through the
loopback transport (parallel/transport.py): no collective, zebra's compute in one process, and
parity with Megatron EP on one rank."""
import json

import pytest
from margins import within

from megatron_hetermoe.plan.hetero_plan import HeteroPlan, ZPGroup
from megatron_hetermoe.tools.parity import GRAD_NORM_TOL, GRAD_TOL, LOSS_TOL, run_parity

pytestmark = pytest.mark.slow


def _one_rank(tiny, schedule: str) -> HeteroPlan:
    every = list(range(tiny.num_experts))
    return HeteroPlan(tiny.num_layers, tiny.num_experts, ["cpu"],
                      [ZPGroup([0], [], [{0: every} for _ in range(tiny.num_layers)])], num_microbatches=2,
                      schedule=schedule)


@pytest.mark.parametrize("schedule, issuer", [("distep", "auto"), ("zebra", "threads"), ("zebra", "single")])
def test_one_rank_group_matches_megatron_ep_without_a_collective(tiny, tmp_path, monkeypatch, schedule, issuer):
    from megatron_hetermoe.reliability import collective_trace

    monkeypatch.setenv(collective_trace.ENV, str(tmp_path))
    r = run_parity(_one_rank(tiny, schedule), tiny, steps=2, micro_batch_size=1, free_run=False, issuer=issuer)
    within("loss", r.max_rel_loss_diff, LOSS_TOL)
    within("grad", r.max_rel_grad_diff, GRAD_TOL)
    within("grad norm", r.max_rel_grad_norm_diff, GRAD_NORM_TOL)
    records = [json.loads(ln) for f in tmp_path.glob("collectives.rank*.jsonl") for ln in f.read_text().splitlines()]
    ops = {r["op"] for r in records if "op" in r}  # entries (a collective's end is a record of its own)
    assert ops and "all_to_all_single" not in ops, ops  # the HeterMoE run moved no token through a collective
