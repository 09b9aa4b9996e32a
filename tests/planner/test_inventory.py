"""--hetero-plan auto's inventory and pick (planner/inventory.py), and the faults an elastic job's
tests aim at its starts (reliability/faults.py)."""
import pytest

from megatron_hetermoe.planner.inventory import AutoPlanRun, Inventory, InventoryError, auto_plan
from megatron_hetermoe.reliability import faults


def test_spec_lists_counts_and_cluster_configs():
    inv = Inventory.from_spec("2xA40,V100-16GB,1xV100-16GB")
    assert inv.gpu_types == ("A40", "A40", "V100-16GB", "V100-16GB") and inv.nodes == (0, 0, 1, 1)
    assert inv.describe() == "2 A40 + 2 V100-16GB"
    mini = Inventory.from_spec("mini-2a40-2v100")  # configs/clusters/
    assert mini.gpu_types == inv.gpu_types and mini.nodes == inv.nodes
    assert [(g.gpu, g.count) for g in inv.cluster().node_groups] == [("A40", 2), ("V100-16GB", 2)]
    with pytest.raises(InventoryError, match="no profile"):
        Inventory.from_spec("2xB300")
    with pytest.raises(InventoryError, match="not a cluster config"):
        Inventory.from_spec("no-such-cluster")


def test_losing_ranks_keeps_the_survivors_order_and_nodes():
    inv = Inventory.from_spec("3xA40,3xV100-16GB")
    left = inv.without([1, 4])
    assert left.gpu_types == ("A40", "A40", "V100-16GB", "V100-16GB") and left.nodes == (0, 0, 1, 1)
    # ranks of one type on two nodes stay two node groups: their NICs are not shared
    assert [(g.gpu, g.count) for g in Inventory(("A40",) * 3, (0, 0, 1)).cluster().node_groups] == \
        [("A40", 2), ("A40", 1)]


def test_auto_plan_uses_every_gpu_where_the_batch_splits(tiny):
    run = AutoPlanRun(tiny, 32, 8, 2)
    plan, kept = auto_plan(run, Inventory.from_spec("2xA40,2xV100-16GB"))
    assert kept == [0, 1, 2, 3] and plan.world_size == 4 and list(plan.gpu_types) == ["A40"] * 2 + ["V100-16GB"] * 2
    # R from the run's batch: 8 sequences / (micro batch 2 x attention members)
    assert plan.num_microbatches * 2 * plan.num_attention_members == 8
    plan.validate()


def test_auto_plan_leaves_the_fewest_gpus_idle(tiny):
    """3 A40 + 3 V100 with 8 sequences of micro batch 2: whole sequences per attention member need
    1, 2 or 4 attention members, and every role split by type uses 3 or 6 GPUs of a type for attention
    when all run: the pick leaves exactly one GPU idle, and plan rank i is inventory rank kept[i]."""
    inv = Inventory.from_spec("3xA40,3xV100-16GB")
    plan, kept = auto_plan(AutoPlanRun(tiny, 32, 8, 2), inv)
    assert len(kept) == 5 and plan.world_size == 5 and plan.meta["idle_gpus"] == 1
    assert list(plan.gpu_types) == [inv.gpu_types[i] for i in kept]
    assert 8 % (2 * plan.num_attention_members) == 0


def test_auto_plan_names_what_is_missing(tiny):
    with pytest.raises(InventoryError, match=r"on 1 GPUs \(1 V100-16GB\).*add GPUs"):
        auto_plan(AutoPlanRun(tiny, 32, 8, 2), Inventory.from_spec("V100-16GB"))


def test_faults_aim_at_an_elastic_start(monkeypatch):
    both = faults.parse_all("rank=2,site=iteration,at=3,mode=kill;rank=0,site=task,at=1,attempt=1")
    assert both == [faults.Fault(2, "iteration", 3, "kill"), faults.Fault(0, "task", 1, "raise", 1)]
    assert faults.Fault.parse(both[1].env()) == both[1]
    with pytest.raises(faults.FaultSpecError, match="unknown keys"):
        faults.Fault.parse("rank=0,site=task,at=1,when=2")
    monkeypatch.setenv(faults.ENV, "rank=0,site=task,at=0;rank=9,site=task,at=0,attempt=1")
    assert faults.check_env(4) == faults.Fault(0, "task", 0)  # rank 9 is aimed at the next start's job
    monkeypatch.setenv(faults.ATTEMPT_ENV, "1")
    with pytest.raises(faults.FaultSpecError, match="rank 9"):
        faults.check_env(4)
