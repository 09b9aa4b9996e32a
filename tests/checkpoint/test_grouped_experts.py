"""Megatron-format (torch_dist) checkpoints of grouped-GEMM experts placed by the plan
(models/expert_axis.py), on CPU.

megatron-core's legacy GroupedMLP is built for real (its grouped_gemm check satisfied by a stand-in,
conftest `grouped_mlp_on_cpu`); its kernels never run here, only its own sharded_state_dict, which
HeterMoE renumbers to the plan's expert ids. The reference is megatron-core's SequentialMLP holding
all E experts (what Megatron EP writes for one layer, EP=1), through its own sharded_state_dict.
Holders take experts in no order and uneven counts (Asym-EA), so a shard of GroupedMLP's, which
megatron-core writes as one block of contiguous experts, must be cut per expert. TEGroupedMLP
(transformer-engine, CUDA) takes the same renumbering of its own sharded_state_dict; its cases run
where transformer-engine and a GPU are (the GPU check's step 7) and skip here, saying so.

Each case runs in a launched 1-rank child (its own gloo group): dist_checkpointing's threads and a
gloo group never live in the pytest process, whose later tests fork their ranks from it.
"""
from __future__ import annotations

import pytest
import torch

from megatron_hetermoe.parallel.launcher import launch
from megatron_hetermoe.plan import expert_names as en

E = 8
LAYER = ((0, 0, 1),)  # TransformerBlock's layer axis for layer 0 of a 1-layer block
PRE = "decoder.layers.mlp.experts."  # the sharded prefix TransformerBlock gives a homogeneous block


def _grouped_kernels(request, kernels: str) -> str:
    """Make `kernels`' grouped experts buildable here, or skip saying why."""
    if kernels == "grouped":
        request.getfixturevalue("grouped_mlp_on_cpu")
    else:
        try:
            import transformer_engine  # noqa: F401
        except ImportError:
            pytest.skip("TEGroupedMLP needs transformer-engine (not installed here; the GPU check runs it)")
        if not torch.cuda.is_available():
            pytest.skip("TEGroupedMLP needs a GPU (the GPU check runs it)")
    return kernels


def _groups():
    """This child's one-rank ProcessGroupCollection for megatron-core's modules."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection

    one = dist.new_group([0])
    ps._set_global_memory_buffer()
    return ProcessGroupCollection(tp=one, ep=one, expt_tp=one, tp_ep=one, expt_dp=one)


def _in_child(case, *args) -> None:
    """Run case(groups, *args) on a launched 1-rank child (its failures come back as LaunchError)."""
    launch(_run_case, 1, case, args, timeout_s=300)


def _run_case(rank: int, world: int, case, args) -> None:
    case(_groups(), *args)


def _build(tiny, groups, kernels: str, n: int, seed: int):
    from megatron_hetermoe.compat import build_experts, moe_experts_spec
    from megatron_hetermoe.config import ParallelConfig
    from megatron_hetermoe.models.builder import layer_spec, transformer_config

    # GroupedMLP asserts config.bf16; fp32 parameters keep every comparison exact.
    cfg = transformer_config(tiny, ParallelConfig(), "fp32", kernels=kernels, bf16=(kernels == "grouped"))
    mod = build_experts(moe_experts_spec(layer_spec(tiny, kernels)), n, cfg, groups)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in mod.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return mod


def _canonical(mod, ids) -> dict[str, torch.Tensor]:
    """{canonical name (global expert id): tensor} of a module holding experts `ids` (local order)."""
    state = {en.canonical_name(PRE + k, lambda pre: ids): p.detach().cpu().clone() for k, p in mod.named_parameters()}
    return en.expand(state)


def _meta(groups, singleton: bool = False) -> dict:
    # the data-parallel group megatron-core's modules read from the metadata outside a Megatron job
    return {"dp_cp_group": groups.tp, "singleton_local_shards": singleton}


def _hetero_sd(mod, ids, tag: str, meta: dict):
    from megatron_hetermoe.models.experts import experts_sharded_state_dict

    sd = experts_sharded_state_dict(mod, list(ids), E, 0, PRE, LAYER, meta)
    return {f"{tag}/{k}": v for k, v in sd.items()}  # holders of one process need distinct local keys


def _load_into(mod, loaded: dict, tag: str | None):
    mine = {k.split("/", 1)[1] if tag else k: v for k, v in loaded.items() if tag is None or k.startswith(tag + "/")}
    state = {k[len(PRE):]: v for k, v in mine.items() if k.startswith(PRE)}
    missing, unexpected = mod.load_state_dict(state, strict=False)
    assert not [m for m in missing if not m.endswith("_extra_state")], missing


def _save(sd, path):
    from megatron.core import dist_checkpointing

    path.mkdir()
    dist_checkpointing.save(sd, str(path))


def _load(sd, path):
    from megatron.core import dist_checkpointing

    return dist_checkpointing.load(sd, str(path))


def _load_holders(mods, holders, path, meta):
    """Load every holder at once, as the ranks of a run do (each expert read exactly once)."""
    sd = {}
    for h, (m, ids) in enumerate(zip(mods, holders)):
        sd.update(_hetero_sd(m, ids, f"h{h}", meta))
    loaded = _load(sd, path)
    for h, m in enumerate(mods):
        _load_into(m, loaded, f"h{h}")


PLACEMENTS = {  # holders' expert ids, local order: uneven, unordered, one holder with one expert
    "asym": ([6, 1, 3], [0, 2, 4, 5, 7]),
    "one+rest": ([7], [3, 0, 1, 2, 4, 5, 6]),
}


@pytest.mark.parametrize("singleton", [False, True], ids=["expert-axis", "singleton-shards"])
@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
@pytest.mark.parametrize("kernels", ["grouped", "te"], ids=["GroupedMLP", "TEGroupedMLP"])
def test_megatron_ep_checkpoint_loads_into_plan_placed_grouped_experts_and_back(
        tiny, request, tmp_path, kernels, placement, singleton):
    _in_child(_ep_and_back, tiny, tmp_path, _grouped_kernels(request, kernels), placement, singleton)


def _ep_and_back(one_rank_groups, tiny, tmp_path, kernels, placement, singleton):
    meta = _meta(one_rank_groups, singleton)
    holders = PLACEMENTS[placement]
    assert sorted(sum(holders, [])) == list(range(E))
    # Megatron EP's experts (SequentialMLP, all E, its own sharded_state_dict) -> grouped holders
    ref = _build(tiny, one_rank_groups, "local", E, seed=1)
    _save(ref.sharded_state_dict(PRE, LAYER, meta), tmp_path / "ep")
    want = _canonical(ref, list(range(E)))
    gs = [_build(tiny, one_rank_groups, kernels, len(ids), seed=100 + h) for h, ids in enumerate(holders)]
    assert all(en.impl_of(g) == {"grouped": en.GROUPED, "te": en.TE_GROUPED}[kernels] for g in gs)
    _load_holders(gs, holders, tmp_path / "ep", meta)
    for g, ids in zip(gs, holders):
        got = _canonical(g, ids)
        assert set(got) <= set(want) and len(got) == 2 * len(ids)
        for k, t in got.items():
            assert torch.equal(t, want[k]), k
    # grouped holders (one save, every expert once) -> Megatron EP's experts
    gs = [_build(tiny, one_rank_groups, kernels, len(ids), seed=200 + h) for h, ids in enumerate(holders)]
    sd = {}
    for h, (g, ids) in enumerate(zip(gs, holders)):
        sd.update(_hetero_sd(g, ids, f"h{h}", meta))
    _save(sd, tmp_path / "hetero")
    want = {}
    for g, ids in zip(gs, holders):
        want.update(_canonical(g, ids))
    back = _build(tiny, one_rank_groups, "local", E, seed=3)
    _load_into(back, _load(back.sharded_state_dict(PRE, LAYER, meta),
                           tmp_path / "hetero"), None)
    got = _canonical(back, list(range(E)))
    assert set(got) == set(want)
    for k, t in got.items():
        assert torch.equal(t, want[k]), k


def test_grouped_checkpoint_reshards_to_another_placement_and_kernel(tiny, grouped_mlp_on_cpu, tmp_path):
    """Saved by one plan's GroupedMLP holders, loaded by another plan's (other ids, other counts)
    GroupedMLP and SequentialMLP holders: every expert lands where its id says."""
    _in_child(_reshard, tiny, tmp_path)


def _reshard(one_rank_groups, tiny, tmp_path):
    first, second = PLACEMENTS["asym"], ([2, 7], [5, 4, 3, 1, 0, 6])
    gs = [_build(tiny, one_rank_groups, "grouped", len(ids), seed=10 + h) for h, ids in enumerate(first)]
    sd, want = {}, {}
    for h, (g, ids) in enumerate(zip(gs, first)):
        sd.update(_hetero_sd(g, ids, f"h{h}", _meta(one_rank_groups)))
        want.update(_canonical(g, ids))
    _save(sd, tmp_path / "first")
    for kernels in ("grouped", "local"):
        ms = [_build(tiny, one_rank_groups, kernels, len(ids), seed=50 + h) for h, ids in enumerate(second)]
        _load_holders(ms, second, tmp_path / "first", _meta(one_rank_groups))
        for m, ids in zip(ms, second):
            for k, t in _canonical(m, ids).items():
                assert torch.equal(t, want[k]), (kernels, k)


def test_a_shard_outside_the_modules_experts_is_named(tiny, grouped_mlp_on_cpu):
    _in_child(_named, tiny)


def _named(one_rank_groups, tiny):
    from megatron_hetermoe.models.expert_axis import ExpertAxisError

    g = _build(tiny, one_rank_groups, "grouped", 3, seed=0)
    with pytest.raises(ExpertAxisError, match=r"holds 3 experts but the plan gives it \[1, 2\]"):
        _hetero_sd(g, [1, 2], "h", _meta(one_rank_groups))


def _optimizer_sd(mods, holders, meta):
    """Megatron's optimizer checkpoint of an Adam over the holders (what MegatronOptimizer's
    sharded_state_dict does): each moment takes its parameter's shards (GroupedMLP: its factory)."""
    from megatron.core.dist_checkpointing.optimizer import (
        get_param_id_to_sharded_param_map,
        optim_state_to_sharding_state,
    )

    model_sd = {}
    for h, (m, ids) in enumerate(zip(mods, holders)):
        model_sd.update(_hetero_sd(m, ids, f"h{h}", meta))
    params = [p for m in mods for p in m.parameters()]
    opt = torch.optim.Adam(params, lr=0.1)
    for p in params:  # one step on distinct gradients: every moment differs per element
        p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) + p.detach()
    opt.step()
    sd = opt.state_dict()
    optim_state_to_sharding_state(sd, get_param_id_to_sharded_param_map(model_sd, iter(params)),
                                  exclude_keys=("step",))
    return opt, sd


def _moments(opt, mods, holders) -> dict[str, torch.Tensor]:
    out = {}
    params = {id(p): (m, ids, k) for m, ids in zip(mods, holders) for k, p in m.named_parameters()}
    for p, st in opt.state.items():
        m, ids, k = params[id(p)]
        label = en.canonical_name(PRE + k, lambda pre: ids)
        out.update({f"{n}:exp_avg": t for n, t in en.expand({label: st["exp_avg"].detach().cpu()}).items()})
    return out


def test_adam_moments_of_grouped_experts_follow_their_expert_ids(tiny, grouped_mlp_on_cpu, tmp_path):
    """The optimizer's moments reach the same experts as the weights: Megatron's optimizer sharding
    (its parameters' factories) through the renumbering, saved by one plan and loaded by another."""
    _in_child(_adam, tiny, tmp_path)


def _adam(one_rank_groups, tiny, tmp_path):
    from megatron.core import dist_checkpointing

    first, second = PLACEMENTS["asym"], ([2, 7], [5, 4, 3, 1, 0, 6])
    meta = _meta(one_rank_groups)
    gs = [_build(tiny, one_rank_groups, "grouped", len(ids), seed=20 + h) for h, ids in enumerate(first)]
    opt, sd = _optimizer_sd(gs, first, meta)
    want = _moments(opt, gs, first)
    (tmp_path / "opt").mkdir()
    dist_checkpointing.save({"optimizer": sd}, str(tmp_path / "opt"))
    ms = [_build(tiny, one_rank_groups, "grouped", len(ids), seed=60 + h) for h, ids in enumerate(second)]
    opt2, sd2 = _optimizer_sd(ms, second, meta)  # its own state first, as Megatron's load does
    assert not all(torch.equal(t, want[k]) for k, t in _moments(opt2, ms, second).items())
    loaded = dist_checkpointing.load({"optimizer": sd2}, str(tmp_path / "opt"))["optimizer"]
    for st in loaded["state"].values():  # Megatron keeps 'step' out of the sharded state
        st["step"] = torch.tensor(1.0)
    opt2.load_state_dict(loaded)
    got = _moments(opt2, ms, second)
    assert set(got) == set(want) and len(got) == 2 * E
    for k, t in got.items():
        assert torch.equal(t, want[k]), k
