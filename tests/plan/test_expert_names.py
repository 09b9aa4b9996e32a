"""One canonical namespace for every expert implementation (plan/expert_names.py), and the kernel
choice (models/builder.py choose_kernels), on CPU without transformer-engine or grouped_gemm.

States are synthesized in each implementation's naming and layout as megatron-core 0.16.1 makes them
(transformer/moe/experts.py): SequentialMLP `local_experts.i.linear_fc1.weight` [2F, H]; TEGroupedMLP
`linear_fc1.weight{i}` (TE GroupedLinear, [out, in]); GroupedMLP `weight1` [H, n*2F] read as
view(n, H, 2F)[i] = fc1_i^T and `weight2` [n*F, H] read as view(n, F, H)[i] = fc2_i^T. GroupedMLP is
also built for real on CPU (its grouped_gemm check satisfied by a stand-in) and run with a reference
grouped GEMM, so its layout is checked against megatron's own forward, not only against this test's
reading of it.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_hetermoe.plan import expert_names as en
from megatron_hetermoe.plan.hetero_plan import HeteroPlan, ZPGroup
from megatron_hetermoe.plan.layout import (
    hetero_to_megatron,
    load_params,
    megatron_to_hetero,
)

PRE = "decoder.layers.0.mlp.experts."


def _canonical_experts(n: int, h: int, f: int, pre: str = PRE, ids=None, base: float = 0.0) -> dict:
    """Distinct values everywhere, so any misplaced element shows."""
    ids = list(range(n)) if ids is None else ids
    out = {}
    for k, e in enumerate(ids):
        out[f"{pre}local_experts.{e}.linear_fc1.weight"] = (
            base + 1000 * e + torch.arange(2 * f * h, dtype=torch.float64).view(2 * f, h))
        out[f"{pre}local_experts.{e}.linear_fc2.weight"] = (
            base + 1000 * e + 500 + torch.arange(h * f, dtype=torch.float64).view(h, f))
    return out


def _names(impl: str, n: int, pre: str = PRE) -> list[str]:
    if impl == en.SEQUENTIAL:
        return [f"{pre}local_experts.{i}.linear_fc{w}.weight" for i in range(n) for w in (1, 2)]
    if impl == en.TE_GROUPED:
        return [f"{pre}linear_fc{w}.weight{i}" for i in range(n) for w in (1, 2)]
    return [f"{pre}weight1", f"{pre}weight2"]


def _megatron_grouped(seq: dict, n: int, h: int, f: int, pre: str = PRE) -> dict:
    """GroupedMLP's tensors built the way its forward reads them (view then index), independently of
    expert_names: w1[i] = fc1_i^T in view(n, H, 2F), w2[i] = fc2_i^T in view(n, F, H)."""
    w1 = torch.empty(h, n * 2 * f, dtype=torch.float64)
    w2 = torch.empty(n * f, h, dtype=torch.float64)
    for i in range(n):
        w1.view(n, h, 2 * f)[i] = seq[f"{pre}local_experts.{i}.linear_fc1.weight"].t()
        w2.view(n, f, h)[i] = seq[f"{pre}local_experts.{i}.linear_fc2.weight"].t()
    return {f"{pre}weight1": w1, f"{pre}weight2": w2}


def _same(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


# ---- one module: each implementation <-> SequentialMLP names -----------------------------------
@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 5), h=st.integers(1, 6), f=st.integers(1, 5),
       impl=st.sampled_from(en.EXPERT_IMPLS), extra=st.booleans())
def test_round_trip_through_every_implementation(n, h, f, impl, extra):
    seq = _canonical_experts(n, h, f)
    if extra:  # non-expert parameters pass through untouched
        seq["decoder.layers.0.mlp.router.weight"] = torch.randn(n, h)
        seq["embedding.word_embeddings.weight"] = torch.randn(3, h)
    target = _names(impl, n) + [k for k in seq if ".experts." not in k]
    mod = en.from_sequential(seq, target)
    assert set(mod) == set(target)
    back = en.to_sequential(mod, {PRE: n})
    assert _same(back, seq)
    # and straight between any two implementations
    for other in en.EXPERT_IMPLS:
        t2 = _names(other, n) + [k for k in seq if ".experts." not in k]
        assert _same(en.convert(en.convert(mod, t2), target), mod)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 5), h=st.integers(1, 6), f=st.integers(1, 5))
def test_grouped_layout_is_megatrons(n, h, f):
    seq = _canonical_experts(n, h, f)
    ours = en.from_sequential(seq, _names(en.GROUPED, n))
    assert _same(ours, _megatron_grouped(seq, n, h, f))
    assert ours[f"{PRE}weight1"].shape == (h, n * 2 * f) and ours[f"{PRE}weight2"].shape == (n * f, h)


def test_te_grouped_is_a_rename_and_grouped_is_not_column_blocks():
    n, h, f = 3, 4, 2
    seq = _canonical_experts(n, h, f)
    te = en.from_sequential(seq, _names(en.TE_GROUPED, n))
    for i in range(n):
        assert te[f"{PRE}linear_fc1.weight{i}"] is seq[f"{PRE}local_experts.{i}.linear_fc1.weight"]
        assert te[f"{PRE}linear_fc2.weight{i}"] is seq[f"{PRE}local_experts.{i}.linear_fc2.weight"]
    w1 = en.from_sequential(seq, _names(en.GROUPED, n))[f"{PRE}weight1"]
    # expert 1 is the second H*2F stretch of the flattened weight, not columns 2F..4F
    assert torch.equal(w1.reshape(-1)[h * 2 * f: 2 * h * 2 * f].view(h, 2 * f).t(),
                       seq[f"{PRE}local_experts.1.linear_fc1.weight"])
    assert not torch.equal(w1[:, 2 * f: 4 * f].t(), seq[f"{PRE}local_experts.1.linear_fc1.weight"])


def test_te_fused_input_norm_is_canonical_input_layernorm():
    state = {"decoder.layers.1.input_layernorm.weight": torch.ones(4),
             "decoder.layers.1.self_attention.linear_qkv.weight": torch.zeros(12, 4)}
    target = ["decoder.layers.1.self_attention.linear_qkv.layer_norm_weight",
              "decoder.layers.1.self_attention.linear_qkv.weight"]
    te = en.convert(state, target)
    assert set(te) == set(target)
    assert _same(en.to_sequential(te), state)
    assert en.canonical_norm("module.decoder.layers.1.self_attention.linear_qkv.layer_norm_weight") == \
        "module.decoder.layers.1.input_layernorm.weight"


def test_bad_names_and_shapes_are_named():
    with pytest.raises(en.ExpertNameError, match="not a parameter name"):
        en.to_sequential({f"{PRE}linear_fc1.kernel0": torch.zeros(1)})
    with pytest.raises(en.ExpertNameError, match="needs the number of local experts"):
        en.to_sequential({f"{PRE}weight1": torch.zeros(2, 6)})
    with pytest.raises(en.ExpertNameError, match="are not 4 experts"):
        en.split_grouped(torch.zeros(2, 6), 1, 4)
    seq = _canonical_experts(3, 2, 2)
    del seq[f"{PRE}local_experts.1.linear_fc1.weight"]
    with pytest.raises(en.ExpertNameError, match="needs 0..n-1"):
        en.from_sequential(seq, _names(en.GROUPED, 3))


# ---- canonical names: global ids, labels ----------------------------------------------------
def test_canonical_names_by_global_id_for_every_implementation():
    ids = [5, 1, 7]  # local order of the module's experts (a plan's list for the rank)
    te = en.canonical_name(f"{PRE}linear_fc2.weight2", lambda pre: ids)
    assert te == f"{PRE}local_experts.7.linear_fc2.weight"
    seq = en.canonical_name(f"{PRE}local_experts.0.linear_fc1.weight", lambda pre: ids)
    assert seq == f"{PRE}local_experts.5.linear_fc1.weight"
    label = en.canonical_name(f"{PRE}weight1", lambda pre: ids)
    assert label == f"{PRE}weight1[5,1,7]" and en.is_label(label)
    assert en.label_members(label) == [f"{PRE}local_experts.{e}.linear_fc1.weight" for e in ids]
    with pytest.raises(en.ExpertNameError, match="holds 3 experts"):
        en.canonical_name(f"{PRE}linear_fc1.weight3", lambda pre: ids)


@settings(max_examples=40, deadline=None)
@given(ids=st.lists(st.integers(0, 63), min_size=1, max_size=5, unique=True), h=st.integers(1, 5),
       f=st.integers(1, 4), which=st.sampled_from([1, 2]))
def test_labels_pack_and_unpack(ids, h, f, which):
    canon = _canonical_experts(len(ids), h, f, ids=ids)
    label = en.grouped_label(PRE, which, ids)
    packed = en.pack(label, canon)
    assert _same(en.unpack(label, packed), {c: canon[c] for c in en.label_members(label)})
    shapes = en.canonical_shapes(label, packed.shape)
    assert shapes == {c: tuple(canon[c].shape) for c in en.label_members(label)}
    # an Adam state splits like its parameter; 'step' goes to every expert
    stt = {"exp_avg": packed * 2, "exp_avg_sq": packed * 3, "step": torch.tensor(4.0)}
    per = en.unpack_optimizer_state(label, stt, packed.shape)
    for c in en.label_members(label):
        assert torch.equal(per[c]["exp_avg"], canon[c] * 2) and per[c]["step"] == 4.0
    again = en.pack_optimizer_state(label, per)
    assert torch.equal(again["exp_avg_sq"], stt["exp_avg_sq"]) and again["step"] == 4.0
    assert en.pack_optimizer_state(label, {}) is None


def test_module_state_and_expand_are_inverse():
    canon = _canonical_experts(3, 2, 2, ids=[4, 0, 2])
    canon["decoder.layers.0.input_layernorm.weight"] = torch.ones(2)
    names = {"weight1": f"{PRE}weight1[4,0,2]", "weight2": f"{PRE}weight2[4,0,2]",
             "norm": "decoder.layers.0.input_layernorm.weight"}
    local = en.module_state(names, canon)
    assert _same(en.expand({names[k]: v for k, v in local.items()}), canon)


# ---- a plan with uneven placement: experts land at the right global id ---------------------
def _uneven_plan() -> HeteroPlan:
    # rank 0 attention (holds expert 5 of layer 0: Asym-EA), ranks 1, 2 experts, uneven counts
    placement = [{0: [5], 1: [0, 2, 3], 2: [1, 4]}, {1: [4], 2: [0, 1, 2, 3, 5]}]
    plan = HeteroPlan(num_layers=2, num_experts=6, gpu_types=["cpu"] * 3,
                      groups=[ZPGroup([0], [1, 2], placement)])
    plan.validate()
    return plan


def _full_state(h=3, f=2) -> dict:
    state = {}
    for layer in range(2):
        pre = f"decoder.layers.{layer}.mlp.experts."
        state.update(_canonical_experts(6, h, f, pre=pre, base=10_000 * layer))
        state[f"decoder.layers.{layer}.input_layernorm.weight"] = torch.full((h,), float(layer))
        state[f"decoder.layers.{layer}.mlp.router.weight"] = torch.full((6, h), float(layer))
    state["embedding.word_embeddings.weight"] = torch.zeros(5, h)
    return state


@pytest.mark.parametrize("impl", en.EXPERT_IMPLS)
@pytest.mark.parametrize("fused_norm", [False, True])
def test_plan_layout_round_trip_in_every_naming(impl, fused_norm):
    plan, state = _uneven_plan(), _full_state()
    per_rank = []
    for rank in range(plan.world_size):
        seq = megatron_to_hetero(state, plan, rank)  # SequentialMLP names, local indices
        target = [k for k in seq if ".experts." not in k]
        if fused_norm:
            target = [en.FUSED_NORM.join(k.rsplit(en.NORM, 1)) if k.endswith(en.NORM) else k for k in target]
        for layer in range(plan.num_layers):
            n = len(plan.local_experts(rank, layer))
            if n:
                target += _names(impl, n, f"decoder.layers.{layer}.mlp.experts.")
        mod = en.convert(seq, target)
        assert set(mod) == set(target)
        per_rank.append(mod)
    # rank 1 holds experts [0, 2, 3] of layer 0: global expert 3 is its local 2
    want = state[f"{PRE}local_experts.3.linear_fc1.weight"]
    r1 = per_rank[1]
    got = {en.SEQUENTIAL: lambda: r1[f"{PRE}local_experts.2.linear_fc1.weight"],
           en.TE_GROUPED: lambda: r1[f"{PRE}linear_fc1.weight2"],
           en.GROUPED: lambda: r1[f"{PRE}weight1"].view(3, 3, 4)[2].t()}[impl]()
    assert torch.equal(got, want)
    # rank 0 (attention) holds global expert 5 of layer 0 as its only local expert
    want = state[f"{PRE}local_experts.5.linear_fc2.weight"]
    r0 = per_rank[0]
    got = {en.SEQUENTIAL: lambda: r0[f"{PRE}local_experts.0.linear_fc2.weight"],
           en.TE_GROUPED: lambda: r0[f"{PRE}linear_fc2.weight0"],
           en.GROUPED: lambda: r0[f"{PRE}weight2"].t()}[impl]()  # one expert: weight2 = fc2^T
    assert torch.equal(got, want)
    assert _same(hetero_to_megatron(per_rank, plan), state)


@pytest.mark.parametrize("impl", en.EXPERT_IMPLS)
def test_load_params_converts_to_the_modules_names(impl):
    plan, state = _uneven_plan(), _full_state()
    rank = 2
    seq = megatron_to_hetero(state, plan, rank)
    target = {}
    for layer in range(2):
        pre = f"decoder.layers.{layer}.mlp.experts."
        n = len(plan.local_experts(rank, layer))
        shaped = en.from_sequential({k: v for k, v in seq.items() if k.startswith(pre)}, _names(impl, n, pre))
        target.update({k: v.shape for k, v in shaped.items()})
    mod = _module_with(target)  # a stand-in rank module with the target's parameter names
    load_params(mod, seq)
    got = {n: p.detach() for n, p in mod.named_parameters()}
    assert _same(en.to_sequential(got, {f"decoder.layers.{l}.mlp.experts.": len(plan.local_experts(rank, l))
                                        for l in range(2)}), seq)
    with pytest.raises(ValueError, match="state does not fit"):
        load_params(mod, {k: v for k, v in seq.items() if "layers.1" not in k})


# ---- megatron-core's GroupedMLP, built on CPU, against SequentialMLP ---------------------------
def test_megatron_grouped_mlp_matches_sequential_mlp(tiny, one_rank_groups, grouped_mlp_on_cpu):
    from megatron_hetermoe.compat import build_experts, moe_experts_spec
    from megatron_hetermoe.config import ParallelConfig
    from megatron_hetermoe.models.builder import (
        canonical_init,
        init_layout_invariant,
        layer_spec,
        transformer_config,
    )
    from megatron_hetermoe.models.experts import run_local_experts
    n, ids = 3, [6, 1, 3]
    # GroupedMLP asserts config.bf16; fp32 parameters keep the comparison exact up to summation order.
    cfg = transformer_config(tiny, ParallelConfig(), "fp32", kernels="grouped", bf16=True)
    grouped = build_experts(moe_experts_spec(layer_spec(tiny, "grouped")), n, cfg, one_rank_groups)
    seqmlp = build_experts(moe_experts_spec(layer_spec(tiny, "local")), n, cfg, one_rank_groups)
    assert en.impl_of(grouped) == en.GROUPED and en.impl_of(seqmlp) == en.SEQUENTIAL
    # names -> canonical (labels for GroupedMLP), and layout-invariant initial values: the same weights
    gnames = {k: en.canonical_name(PRE + k, lambda pre: ids) for k, _ in grouped.named_parameters()}
    snames = {k: en.canonical_name(PRE + k, lambda pre: ids) for k, _ in seqmlp.named_parameters()}
    assert set(gnames.values()) == {f"{PRE}weight1[6,1,3]", f"{PRE}weight2[6,1,3]"}
    assert en.expand_names(gnames.values()) == set(snames.values())
    init_layout_invariant(grouped, 7, cfg, gnames)
    init_layout_invariant(seqmlp, 7, cfg, snames)
    gstate = {gnames[k]: p.detach() for k, p in grouped.named_parameters()}
    sstate = {snames[k]: p.detach() for k, p in seqmlp.named_parameters()}
    assert _same(en.expand(gstate), sstate)
    c = f"{PRE}local_experts.1.linear_fc2.weight"
    assert torch.equal(sstate[c], canonical_init(c, sstate[c].shape, 7, cfg))
    # megatron's own forward on both, through HeterMoE's expert entry point
    counts = torch.tensor([[2, 0, 3], [1, 4, 0]])  # [source member, local expert]
    x = torch.randn(int(counts.sum()), tiny.hidden_size, generator=torch.Generator().manual_seed(0))
    y_g = run_local_experts(grouped, x, counts)
    y_s = run_local_experts(seqmlp, x, counts)
    torch.testing.assert_close(y_g, y_s, rtol=1e-5, atol=1e-6)
    # and a state moved between the two modules by name conversion runs identically
    def at_layer0(experts):  # named as in a model (or an ExpertRuntime): decoder.layers.0.mlp.experts.*
        root, layer = torch.nn.Module(), torch.nn.Module()
        root.decoder = torch.nn.Module()
        root.decoder.layers = torch.nn.ModuleList([layer])
        layer.mlp = torch.nn.Module()
        layer.mlp.experts = experts
        return root

    load_params(at_layer0(grouped), {k: p.detach() * 1.5 for k, p in at_layer0(seqmlp).named_parameters()})
    with torch.no_grad():
        for p in seqmlp.parameters():
            p.mul_(1.5)
    torch.testing.assert_close(run_local_experts(grouped, x, counts), run_local_experts(seqmlp, x, counts),
                               rtol=1e-5, atol=1e-6)


# ---- the kernel choice ------------------------------------------------------------------------
def test_choose_kernels_on_this_machine():
    from megatron_hetermoe.models.builder import KernelError, choose_kernels

    name, reason = choose_kernels("cpu")
    assert name == "local" and "automatic" in reason
    assert choose_kernels("cpu", "fp32", "local").name == "local"
    with pytest.raises(KernelError, match="--transformer-impl transformer_engine"):
        choose_kernels("cpu", "fp32", "transformer_engine")
    with pytest.raises(KernelError, match="CUDA ranks only"):
        choose_kernels("cpu", "bf16", "local", True)
    with pytest.raises(KernelError, match="CUDA ranks only"):
        choose_kernels("cpu", "bf16", None, True)


def test_choose_kernels_rules(monkeypatch):
    from megatron_hetermoe.models import builder

    def world(te: bool, te_grouped: bool, gg: bool):
        monkeypatch.setattr(builder, "transformer_engine_status", lambda: (te, te_grouped, "te-status"))
        monkeypatch.setattr(builder, "grouped_gemm_status", lambda: (gg, "gg-status"))

    world(True, True, True)
    assert builder.choose_kernels("cuda", "fp32").name == "te"
    assert builder.choose_kernels("cpu", "fp32").name == "local"  # CPU ranks: never TE
    assert builder.choose_kernels("cuda", "fp32", "transformer_engine").name == "te_sequential"  # Megatron's meaning
    assert builder.choose_kernels("cuda", "fp32", "transformer_engine", True).name == "te"
    assert builder.choose_kernels("cuda", "bf16", "local").name == "local"
    assert builder.choose_kernels("cuda", "bf16", "local", True).name == "grouped"
    with pytest.raises(builder.KernelError, match="bf16 only"):
        builder.choose_kernels("cuda", "fp32", "local", True)
    world(True, False, False)
    assert builder.choose_kernels("cuda", "fp32").name == "te_sequential"
    with pytest.raises(builder.KernelError, match="no grouped linear"):
        builder.choose_kernels("cuda", "fp32", "transformer_engine", True)
    world(False, False, True)
    assert builder.choose_kernels("cuda", "bf16").name == "grouped"
    assert builder.choose_kernels("cuda", "fp32").name == "local"  # GroupedMLP is bf16-only
    assert "bf16 only" in builder.choose_kernels("cuda", "fp16").reason
    with pytest.raises(builder.KernelError, match="te-status"):
        builder.choose_kernels("cuda", "bf16", "transformer_engine")
    world(False, False, False)
    assert builder.choose_kernels("cuda", "bf16").name == "local"
    with pytest.raises(builder.KernelError, match="gg-status"):
        builder.choose_kernels("cuda", "bf16", None, True)
    k = builder.KernelChoice("grouped", "why")
    assert (k.transformer_impl, k.moe_grouped_gemm, k.experts) == ("local", True, en.GROUPED)
    assert k.line() == "kernels: grouped (why)"


def test_config_and_spec_follow_the_kernels(tiny):
    from megatron_hetermoe.config import ParallelConfig
    from megatron_hetermoe.models.builder import (
        config_kernels,
        layer_spec,
        transformer_config,
    )

    for kernels in ("local", "grouped", "te", "te_sequential"):
        cfg = transformer_config(tiny, ParallelConfig(), "bf16", kernels=kernels)
        assert config_kernels(cfg) == kernels
    cfg = transformer_config(tiny, ParallelConfig())
    assert (cfg.transformer_impl, cfg.moe_grouped_gemm) == ("local", False)
    from megatron.core.transformer.moe import experts as mexperts

    from megatron_hetermoe.compat import moe_experts_spec

    assert moe_experts_spec(layer_spec(tiny)).module.__name__ == en.SEQUENTIAL
    if hasattr(mexperts, "GroupedMLP"):  # megatron-core 0.16/0.17; 0.19 has no legacy GroupedMLP
        assert moe_experts_spec(layer_spec(tiny, "grouped")).module.__name__ == en.GROUPED
    else:
        with pytest.raises(RuntimeError, match="not GroupedMLP"):
            layer_spec(tiny, "grouped")
    with pytest.raises(ValueError, match="unknown"):
        layer_spec(tiny, "fast")


# ---- checkpoints: by canonical name across kernels --------------------------------------------
class _Opt:
    """What the checkpoint code reads of a Megatron optimizer: .optimizer (torch's)."""

    def __init__(self, module):
        self.optimizer = torch.optim.Adam(module.parameters(), lr=1e-3)


def _module_with(names_shapes: dict) -> torch.nn.Module:
    mod = torch.nn.Module()
    for name, shape in names_shapes.items():
        parent = mod
        *path, leaf = name.split(".")
        for part in path:
            if not hasattr(parent, part):
                parent.add_module(part, torch.nn.Module())
            parent = getattr(parent, part)
        parent.register_parameter(leaf, torch.nn.Parameter(torch.zeros(shape, dtype=torch.float64)))
    return mod


@pytest.mark.parametrize("saved_impl,loaded_impl", [(en.GROUPED, en.TE_GROUPED), (en.TE_GROUPED, en.GROUPED),
                                                    (en.GROUPED, en.SEQUENTIAL)])
def test_checkpoint_moves_between_kernels_by_canonical_name(tmp_path, saved_impl, loaded_impl):
    from megatron_hetermoe.checkpoint.format import RankState, locate
    from megatron_hetermoe.checkpoint.load import kernels_difference
    from megatron_hetermoe.checkpoint.reshard import (
        gather_canonical,
        inject_optimizer_state,
        load_canonical_params,
    )
    from megatron_hetermoe.checkpoint.save import write_offline

    ids, h, f = [4, 0, 2], 3, 2
    canon = _canonical_experts(3, h, f, ids=ids)

    def rank_module(impl):
        local = en.from_sequential(_canonical_experts(3, h, f), _names(impl, 3))
        mod = _module_with({k: v.shape for k, v in local.items()})
        names = {k: en.canonical_name(k, lambda pre: ids) for k, _ in mod.named_parameters()}
        return mod, names

    smod, snames = rank_module(saved_impl)
    load_canonical_params(RankState("hetero", 0, 1, "expert", smod, snames, None, None, {}, {}), canon)
    sopt = _Opt(smod)
    for p in smod.parameters():  # Adam moments that differ per element: 2x and 3x the parameter
        sopt.optimizer.state[p] = {"step": torch.tensor(5.0), "exp_avg": p.detach() * 2, "exp_avg_sq": p.detach() * 3}
    sstate = RankState("hetero", 0, 1, "expert", smod, snames, sopt, None, {}, {})
    from megatron_hetermoe.checkpoint.format import optimizer_param_names

    payload = {"iteration": 3, "rank": 0, "role": "expert", "names": snames,
               "model": {n: p.detach().clone() for n, p in smod.named_parameters()},
               "optimizer": sopt.optimizer.state_dict(), "optimizer_param_names": optimizer_param_names(sstate)}
    write_offline(tmp_path, 3, {"trainer": "hetero", "world_size": 1, "model": {}, "layout": {}, "train": {}},
                  [payload])
    iter_dir, manifest = locate(tmp_path)

    lmod, lnames = rank_module(loaded_impl)
    lstate = RankState("hetero", 0, 1, "expert", lmod, lnames, _Opt(lmod), None, {}, {})
    assert "saved with other kernels" in kernels_difference(payload, lstate)
    assert kernels_difference({**payload, "optimizer": None}, lstate) is None  # imported: Adam state by name
    params, opt, _ = gather_canonical(iter_dir, manifest, set(lnames.values()))
    assert _same(params, canon)
    load_canonical_params(lstate, params)
    assert inject_optimizer_state(lstate, opt) == len(lnames)
    got = en.expand({lnames[n]: p.detach() for n, p in lmod.named_parameters()})
    assert _same(got, canon)
    for n, p in lmod.named_parameters():
        st = lstate.optimizer.optimizer.state[p]
        assert torch.equal(st["exp_avg"], p.detach() * 2) and torch.equal(st["exp_avg_sq"], p.detach() * 3)
        assert float(st["step"]) == 5.0
