"""Measuring expert loads (issue 46 item 1): the counts exchange's host copy feeds the meter with no
host read added (tests/sync_count.py via tools/layer_bench.HostReads), each routed row is counted
once over the world, and the stats file's format round-trips and prints per-expert loads."""
import json

import pytest

from megatron_hetermoe.parallel.launcher import launch
from megatron_hetermoe.planner.expert_load import ExpertLoad, LoadStats, describe_skew, load_expert_load


def _measure(rank: int, world: int, tokens: int) -> dict:
    from megatron_hetermoe.parallel.expert_load import ExpertLoadMeter
    from megatron_hetermoe.tools import layer_bench as lb

    pair = lb.build_pair("tiny")
    hs = pair.hetero.hs
    hs.load_meter = meter = ExpertLoadMeter(hs.plan.num_layers, hs.plan.num_experts)
    x = lb.make_input(pair, tokens, seed=rank)
    reads = lb.host_reads(pair.hetero, x)
    meter.add_seconds(1, {"E_F": 0.5 * (rank + 1)})
    total, seconds = meter.reduce(hs.group("world"), hs.device)
    return {"reads": reads.count, "tokens": total, "seconds": seconds, "layer": pair.hetero.token_dispatcher.layer,
            "topk": pair.hetero.config.moe_router_topk, "mine": hs.local_experts(pair.hetero.token_dispatcher.layer)}


@pytest.mark.parametrize("world", [1, 2])
def test_the_meter_counts_every_routed_row_once_without_a_host_read(world):
    got = launch(_measure, world, 64, timeout_s=300)
    for g in got:
        assert g["reads"] == 1, g  # the counts exchange's one host copy, as without the meter
        assert g["tokens"] == got[0]["tokens"]  # the all-reduce: the same on every rank
        assert g["seconds"] == [{"E_F": 0.5 * (r + 1)} for r in range(world)]
    row = got[0]["tokens"][got[0]["layer"]]
    assert sum(row) == world * 64 * got[0]["topk"]  # every member's tokens, top-k rows each
    assert sum(sum(r) for r in got[0]["tokens"]) == sum(row)  # one layer ran


def test_expert_load_multipliers_and_skew():
    load = ExpertLoad.of([[30, 10, 0, 0], [10, 10, 10, 10], [0, 0, 0, 0]])
    assert load.multipliers(0) == (3.0, 1.0, 0.0, 0.0)
    assert load.max_over_mean() == [3.0, 1.0, 1.0]  # a layer that saw nothing counts as balanced
    assert "worst 3.00 (layer 0)" in describe_skew(load)
    with pytest.raises(ValueError, match="negative token count"):
        ExpertLoad.of([[1, -1]])
    with pytest.raises(ValueError, match="the same count"):
        ExpertLoad.of([[1, 1], [1, 1, 1]])


def test_stats_file_round_trips_and_sums_intervals(tmp_path):
    from megatron_hetermoe.tools.timeline import load_table

    st = LoadStats(2, 2, [0, 2], 2, ["attention", "expert"], ["A40", "V100-16GB"])
    st.add_interval(1, 2, 2, [[3.0, 1.0], [2.0, 2.0]], [{"A_F": 1.0}, {"E_F": 0.5}])
    st.add_interval(3, 4, 2, [[1.0, 3.0], [2.0, 2.0]], [{"A_F": 1.0}, {"E_F": 0.25}])
    path = st.save(tmp_path / "load.json")
    back = LoadStats.load_file(path)
    assert back.tokens == [[4.0, 4.0], [4.0, 4.0]] and back.iterations == [1, 4] and back.steps == 4
    assert back.task_seconds == [{"A_F": 2.0}, {"E_F": 0.75}]
    assert load_expert_load(path).max_over_mean() == [1.0, 1.0]
    assert load_expert_load(path, last_intervals=1).multipliers(0) == (0.5, 1.5)
    table = load_table(back)
    assert "layer 0 (model layer 0): max/mean 1.00" in table and "rank 1 (expert, V100-16GB): E_F 0.75 s" in table
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "something"}))
    with pytest.raises(ValueError, match="not a HeterMoE expert-load stats file"):
        load_expert_load(bad)
