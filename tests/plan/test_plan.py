import pytest

from megatron_hetermoe.plan.hetero_plan import HeteroPlan, PlanError, even_plan


def test_even_plan_uneven_split_and_roundtrip():
    p = even_plan(num_layers=2, num_experts=8, attention_ranks=1, expert_ranks=3)
    assert p.groups[0].placement[0] == {1: [0, 1, 2], 2: [3, 4, 5], 3: [6, 7]}
    assert [p.role(r) for r in range(4)] == ["attention", "expert", "expert", "expert"]
    assert HeteroPlan.from_dict(p.to_dict()) == p


def test_two_groups_are_laid_out_group_by_group():
    p = even_plan(2, 4, 2, 2, groups=2)
    assert p.groups[1].attention_ranks == [4, 5] and p.groups[1].expert_ranks == [6, 7]
    assert p.attention_ranks == [0, 1, 4, 5]


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d["groups"][0]["placement"][0]["1"].append(2), r"expert\(s\) \[2\] placed more than once"),
    (lambda d: d["groups"][0]["placement"][1]["2"].remove(3), r"expert\(s\) \[3\] placed on no rank"),
    (lambda d: d["groups"][0]["expert_ranks"].append(0), "rank 0 is both attention rank of ZP group 0 and expert rank"),
    (lambda d: d["gpu_types"].__setitem__(1, "Z100"), "rank 1 has unknown GPU type .Z100."),
    (lambda d: d.__setitem__("schedule", "gpipe"), "schedule 'gpipe' is unknown"),
    (lambda d: d["groups"][0]["placement"].pop(), "places experts for 1 layers but the plan has num_layers=2"),
])
def test_bad_plans_name_the_problem(mutate, message):
    d = even_plan(2, 4, 1, 2, gpu_types=["A40", "V100", "V100"]).to_dict()
    mutate(d)
    with pytest.raises(PlanError, match=message):
        HeteroPlan.from_dict(d).validate(known_gpu_types={"a40", "V100"})


def test_world_size_mismatch():
    with pytest.raises(PlanError, match="plan is for 4 ranks .* world size 6"):
        even_plan(2, 4, 2, 2).validate(world_size=6)


def test_groups_must_place_alike():
    d = even_plan(1, 4, 1, 2, groups=2).to_dict()
    d["groups"][1]["placement"][0] = {"4": [0, 1, 2], "5": [3]}
    with pytest.raises(PlanError, match="every group must place experts alike"):
        HeteroPlan.from_dict(d).validate()
