"""Parameter names of every expert implementation megatron-core builds, and the one canonical form.

Which kernels a model runs (models/builder.py `choose_kernels`) changes how megatron-core names,
and for the legacy GroupedMLP how it lays out, the same weights. Everything that keys weights by
name (initial values, checkpoints, the plan's layout conversion, parity) goes through this module,
so all of it sees one namespace whatever the kernels. A leaf: it imports no package module.

Canonical form: a plain Megatron GPTModel with the local spec, PP=1, EP=1 (global layer and
expert ids, no wrapper), i.e. SequentialMLP's names:

    decoder.layers.L.input_layernorm.weight                          [H]
    decoder.layers.L.mlp.experts.local_experts.E.linear_fc1.weight   [2F, H]  rows [:F] gate, [F:] up
    decoder.layers.L.mlp.experts.local_experts.E.linear_fc2.weight   [H, F]

E is the global expert id. SwiGLU (gated_linear_unit): every implementation chunks fc1's output
in two halves along the last dim and applies the activation to the first (MLP.forward,
TEGroupedMLP.forward, GroupedMLP's glu: `torch.chunk(x, 2, dim=-1)`), so gate and up are the two
row halves of the canonical fc1 weight, never interleaved (TP=1).

A module's own names, after the layer's `mlp.experts.` (n local experts, i the local index;
megatron-core 0.16.1 transformer/moe/experts.py):

    SequentialMLP  (local spec; TE spec without grouped GEMM)
        local_experts.i.linear_fc1.weight [2F, H], local_experts.i.linear_fc2.weight [H, F]
    TEGroupedMLP   (TE spec with moe_grouped_gemm: TE GroupedLinear, one [out, in] parameter per GEMM)
        linear_fc1.weight{i} [2F, H], linear_fc2.weight{i} [H, F]
    GroupedMLP     (local spec with moe_grouped_gemm: the legacy grouped_gemm package)
        weight1 [H, n*2F]: weight1.view(n, H, 2F)[i] is fc1_i transposed ([H, 2F]: gmm computes x @ w1[i])
        weight2 [n*F, H]:  weight2.view(n, F, H)[i] is fc2_i transposed ([F, H])
      The view reinterprets memory: expert i of weight1 is the i-th stretch of H*2F elements of the
      flattened tensor, not a block of columns (GroupedMLP.forward and its sharded_state_dict,
      which transposes view(n, H, 2F) to SequentialMLP's [n, 2F, H]).

The TE spec also fuses the attention's input norm into linear_qkv (TELayerNormColumnParallelLinear):
`self_attention.linear_qkv.layer_norm_weight` is canonical `input_layernorm.weight`.

A GroupedMLP parameter holds several experts, so it has no canonical name of its own: its
*label* is `decoder.layers.L.mlp.experts.weight1[E0,E1,...]` (global ids in local order), what
`canonical_name` gives it; `unpack` splits a labelled tensor (the parameter, or any tensor of its
shape: a gradient, an Adam moment) into canonical tensors and `pack` joins them back.

Two levels: `to_sequential` / `from_sequential` / `convert` re-express a module's state between
implementations at *local* expert indices (what a rank holds); `canonical_name`, labels and
`module_state` / `expand` map between a module and the canonical (global) names.
"""
from __future__ import annotations

import re
from typing import Callable, Iterable, Mapping, Sequence

import torch

SEQUENTIAL, TE_GROUPED, GROUPED = "SequentialMLP", "TEGroupedMLP", "GroupedMLP"
EXPERT_IMPLS = (SEQUENTIAL, TE_GROUPED, GROUPED)

FUSED_NORM = "self_attention.linear_qkv.layer_norm_weight"  # TE spec
NORM = "input_layernorm.weight"  # local spec, canonical

_EXPERTS = re.compile(r"^(?P<pre>(?:.+\.)?mlp\.experts\.)(?P<rel>[^\[\]]+)$")
_SEQ = re.compile(r"^local_experts\.(?P<i>\d+)\.(?P<rest>.+)$")
_TE = re.compile(r"^(?P<fc>linear_fc[12])\.(?P<kind>weight|bias)(?P<i>\d+)$")
_GG = re.compile(r"^weight(?P<w>[12])$")
_LABEL = re.compile(r"^(?P<pre>(?:.+\.)?mlp\.experts\.)weight(?P<w>[12])\[(?P<ids>\d+(?:,\d+)*)\]$")
_LAYER_OF_PREFIX = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp\.experts\.$")
_MTP_LAYER_OF_PREFIX = re.compile(r"(?:^|\.)mtp\.layers\.(\d+)\.transformer_layer\.mlp\.experts\.$")


class ExpertNameError(ValueError):
    """A name or tensor that does not fit the implementation it claims (the message says which)."""


# ---- one name ------------------------------------------------------------------------------
def split_expert(name: str) -> tuple[str, str] | None:
    """(prefix up to and including `mlp.experts.`, the rest) of an expert parameter name, else None."""
    m = _EXPERTS.match(name)
    return (m["pre"], m["rel"]) if m else None


def layer_of_prefix(pre: str) -> int:
    """The layer number in an experts prefix (`...layers.L.mlp.experts.`)."""
    m = _LAYER_OF_PREFIX.search(pre)
    if m is None:
        raise ExpertNameError(f"{pre!r}: no layer number before mlp.experts.")
    return int(m.group(1))


def model_layer_of_prefix(pre: str, decoder_layers: int) -> int:
    """The model layer of an experts prefix: decoder layer L (`...decoder.layers.L.mlp.experts.`)
    or MTP layer k (`...mtp.layers.k.transformer_layer.mlp.experts.`), model layer decoder_layers + k."""
    m = _MTP_LAYER_OF_PREFIX.search(pre)
    return decoder_layers + int(m.group(1)) if m else layer_of_prefix(pre)


def expert_impl(rel: str) -> str:
    """Which implementation names an expert parameter `rel` (the name after `mlp.experts.`)."""
    if _SEQ.match(rel):
        return SEQUENTIAL
    if _TE.match(rel):
        return TE_GROUPED
    if _GG.match(rel):
        return GROUPED
    raise ExpertNameError(f"mlp.experts.{rel}: not a parameter name of {', '.join(EXPERT_IMPLS)}")


def impl_of(experts: torch.nn.Module) -> str:
    """The implementation of a megatron-core experts module (by class, subclasses included)."""
    for cls in type(experts).__mro__:
        if cls.__name__ in EXPERT_IMPLS:
            return cls.__name__
    raise TypeError(f"{type(experts).__name__} is none of megatron-core's expert modules {EXPERT_IMPLS}")


def _local_index(rel: str) -> int | None:
    m = _SEQ.match(rel) or _TE.match(rel)
    return int(m["i"]) if m else None


# ---- GroupedMLP's layout -------------------------------------------------------------------
def split_grouped(t: torch.Tensor, which: int, n: int) -> list[torch.Tensor]:
    """GroupedMLP's weight1 (which=1, [H, n*2F]) or weight2 (which=2, [n*F, H]), or any tensor of
    that shape, as n canonical tensors: fc1 [2F, H], fc2 [H, F] (contiguous copies)."""
    if t.dim() != 2 or n < 1:
        raise ExpertNameError(f"GroupedMLP weight{which}: expected a 2-D tensor and n >= 1, "
                              f"got {tuple(t.shape)}, n={n}")
    if which == 1:
        h, cols = t.shape
        if cols % n:
            raise ExpertNameError(f"GroupedMLP weight1 {tuple(t.shape)}: {cols} columns are not {n} experts' 2F")
        blocks = t.reshape(n, h, cols // n)  # = weight1.view(n, H, 2F) (reshape: same on a non-contiguous view)
    elif which == 2:
        rows, h = t.shape
        if rows % n:
            raise ExpertNameError(f"GroupedMLP weight2 {tuple(t.shape)}: {rows} rows are not {n} experts' F")
        blocks = t.reshape(n, rows // n, h)  # = weight2.view(n, F, H)
    else:
        raise ExpertNameError(f"GroupedMLP has weight1 and weight2, not weight{which}")
    return [blocks[i].t().contiguous() for i in range(n)]


def join_grouped(ts: Sequence[torch.Tensor], which: int) -> torch.Tensor:
    """The inverse of split_grouped: canonical per-expert tensors (local order) -> weight1/weight2."""
    if not ts:
        raise ExpertNameError(f"GroupedMLP weight{which}: no experts to join")
    shapes = {tuple(t.shape) for t in ts}
    if len(shapes) != 1 or ts[0].dim() != 2:
        raise ExpertNameError(f"GroupedMLP weight{which}: experts of different or non-2-D shapes {sorted(shapes)}")
    stacked = torch.stack([t.t() for t in ts])  # [n, H, 2F] (which=1) or [n, F, H] (which=2)
    n, a, b = stacked.shape
    if which == 1:
        return stacked.reshape(a, n * b)  # [H, n*2F]
    if which == 2:
        return stacked.reshape(n * a, b)  # [n*F, H]
    raise ExpertNameError(f"GroupedMLP has weight1 and weight2, not weight{which}")


# ---- labels: GroupedMLP parameters by global expert ids --------------------------------------
def grouped_label(pre: str, which: int, ids: Sequence[int]) -> str:
    return f"{pre}weight{which}[{','.join(str(int(e)) for e in ids)}]"


def is_label(name: str) -> bool:
    return _LABEL.match(name) is not None


def parse_label(label: str) -> tuple[str, int, list[int]]:
    m = _LABEL.match(label)
    if m is None:
        raise ExpertNameError(f"{label!r} is not a GroupedMLP label (...mlp.experts.weight1[E0,E1,...])")
    return m["pre"], int(m["w"]), [int(e) for e in m["ids"].split(",")]


def _canonical_expert(pre: str, e: int, which: int) -> str:
    return f"{pre}local_experts.{e}.linear_fc{which}.weight"


def label_members(label: str) -> list[str]:
    """The canonical names a label stands for, in local order."""
    pre, which, ids = parse_label(label)
    return [_canonical_expert(pre, e, which) for e in ids]


def unpack(label: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
    """A labelled tensor (parameter, gradient or Adam moment) as canonical tensors."""
    pre, which, ids = parse_label(label)
    return dict(zip(label_members(label), split_grouped(t, which, len(ids))))


def pack(label: str, canonical: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The labelled tensor made of canonical tensors (KeyError names a missing expert)."""
    _, which, _ = parse_label(label)
    return join_grouped([canonical[c] for c in label_members(label)], which)


def canonical_shapes(name: str, shape: Sequence[int]) -> dict[str, tuple[int, ...]]:
    """{canonical name: shape} of a canonical name or label and its (packed) shape."""
    if not is_label(name):
        return {name: tuple(shape)}
    _, which, ids = parse_label(name)
    n = len(ids)
    if which == 1:
        h, cols = shape
        one = (cols // n, h)
    else:
        rows, h = shape
        one = (h, rows // n)
    return {c: one for c in label_members(name)}


def expand_names(names: Iterable[str]) -> set[str]:
    """Canonical names, labels replaced by the names they stand for."""
    out: set[str] = set()
    for n in names:
        out.update(label_members(n) if is_label(n) else (n,))
    return out


def expand(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state keyed by canonical names and labels -> keyed by canonical names only."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        out.update(unpack(name, t) if is_label(name) else {name: t})
    return out


def module_state(names: Mapping[str, str], canonical: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A module's local state (keys of `names`: local name -> canonical name or label) taken from a
    canonical state dict (packing GroupedMLP's experts)."""
    return {local: pack(c, canonical) if is_label(c) else canonical[c] for local, c in names.items()}


def unpack_optimizer_state(label: str, st: Mapping, shape: Sequence[int]) -> dict[str, dict]:
    """An Adam state of a labelled parameter (of `shape`) as per-canonical-parameter states: moments
    of the parameter's shape are split, anything else ('step') is copied to every expert."""
    members = label_members(label)
    out: dict[str, dict] = {c: {} for c in members}
    for k, v in st.items():
        if torch.is_tensor(v) and tuple(v.shape) == tuple(shape):
            for c, piece in unpack(label, v).items():
                out[c][k] = piece
        else:
            for c in members:
                out[c][k] = v.clone() if torch.is_tensor(v) else v
    return out


def pack_optimizer_state(label: str, by_name: Mapping[str, Mapping]) -> dict | None:
    """The inverse of unpack_optimizer_state; None when an expert has no state."""
    members = label_members(label)
    states = [by_name.get(c) for c in members]
    if any(s is None for s in states):
        return None
    out = {}
    for k, v in states[0].items():
        if torch.is_tensor(v) and v.dim() == 2:
            out[k] = pack(label, {c: s[k] for c, s in zip(members, states)})
        else:
            out[k] = v
    return out


# ---- a module's name <-> canonical ---------------------------------------------------------
def canonical_norm(name: str) -> str:
    """TE's fused input norm under its canonical name; any other name unchanged."""
    if name == FUSED_NORM or name.endswith("." + FUSED_NORM):
        return name[: len(name) - len(FUSED_NORM)] + NORM
    return name


def canonical_expert_name(pre: str, rel: str, ids: Sequence[int]) -> str:
    """The canonical name (or, for GroupedMLP, the label) of expert parameter `pre + rel` of a module
    whose local experts have global ids `ids` (local order)."""
    impl = expert_impl(rel)
    if impl == GROUPED:
        return grouped_label(pre, int(_GG.match(rel)["w"]), ids)
    i = _local_index(rel)
    if i >= len(ids):
        raise ExpertNameError(f"{pre}{rel}: local expert {i}, but the module holds {len(ids)} experts {list(ids)}")
    if impl == SEQUENTIAL:
        return f"{pre}local_experts.{ids[i]}.{_SEQ.match(rel)['rest']}"
    m = _TE.match(rel)
    return f"{pre}local_experts.{ids[i]}.{m['fc']}.{m['kind']}"


def canonical_name(name: str, ids_of: Callable[[str], Sequence[int]]) -> str:
    """`name` with the fused norm and experts renamed canonically; ids_of(prefix) gives the global
    expert ids of the experts module at `prefix` (`...mlp.experts.`), in local order. Layer numbers
    and wrapper prefixes are left to the caller."""
    s = split_expert(name)
    if s is None:
        return canonical_norm(name)
    pre, rel = s
    return canonical_expert_name(pre, rel, ids_of(pre))


# ---- a module's state between implementations (local expert indices) -----------------------
def _counts(names: Iterable[str]) -> dict[str, int]:
    """Local experts per experts prefix, from SequentialMLP / TEGroupedMLP names."""
    seen: dict[str, set[int]] = {}
    for n in names:
        s = split_expert(n)
        if s is not None:
            i = _local_index(s[1])
            if i is not None:
                seen.setdefault(s[0], set()).add(i)
    return {pre: max(ix) + 1 for pre, ix in seen.items()}


def to_sequential(state: Mapping[str, torch.Tensor],
                  num_local: Mapping[str, int] | Callable[[str], int] | None = None) -> dict[str, torch.Tensor]:
    """A module state in any implementation's names -> SequentialMLP's names at the same local
    indices, with TE's fused input norm unfused. num_local (experts prefix -> n) is needed only to
    split GroupedMLP weights."""
    out: dict[str, torch.Tensor] = {}

    def put(name, t):
        if name in out:
            raise ExpertNameError(f"{name} is given twice (in two implementations' names)")
        out[name] = t

    for name, t in state.items():
        s = split_expert(name)
        if s is None:
            put(canonical_norm(name), t)
            continue
        pre, rel = s
        impl = expert_impl(rel)
        if impl == SEQUENTIAL:
            put(name, t)
        elif impl == TE_GROUPED:
            m = _TE.match(rel)
            put(f"{pre}local_experts.{m['i']}.{m['fc']}.{m['kind']}", t)
        else:
            if num_local is None:
                raise ExpertNameError(f"{name}: splitting GroupedMLP weights needs the number of local experts")
            n = num_local(pre) if callable(num_local) else num_local.get(pre)
            if not n:
                raise ExpertNameError(f"{name}: the number of local experts of {pre} is unknown")
            which = int(_GG.match(rel)["w"])
            for i, piece in enumerate(split_grouped(t, which, n)):
                put(f"{pre}local_experts.{i}.linear_fc{which}.weight", piece)
    return out


def target_impls(target_names: Iterable[str]) -> tuple[dict[str, str], set[str]]:
    """({experts prefix: implementation}, {layer prefixes whose input norm is TE-fused}) of a
    module's parameter names."""
    impls: dict[str, str] = {}
    fused: set[str] = set()
    for n in target_names:
        if n == FUSED_NORM or n.endswith("." + FUSED_NORM):
            fused.add(n[: len(n) - len(FUSED_NORM)])
            continue
        s = split_expert(n)
        if s is None:
            continue
        impl = expert_impl(s[1])
        if impls.setdefault(s[0], impl) != impl:
            raise ExpertNameError(f"{s[0]}: parameters of both {impls[s[0]]} and {impl}")
    return impls, fused


def from_sequential(state: Mapping[str, torch.Tensor], target_names: Iterable[str]) -> dict[str, torch.Tensor]:
    """A state in SequentialMLP's names (local indices, unfused norm) -> the names of a module whose
    parameter names are `target_names` (whichever implementation they belong to)."""
    impls, fused = target_impls(target_names)
    out: dict[str, torch.Tensor] = {}
    pending: dict[tuple[str, int], dict[int, torch.Tensor]] = {}
    for name, t in state.items():
        if name == NORM or name.endswith("." + NORM):
            layer = name[: len(name) - len(NORM)]
            if layer in fused:
                out[layer + FUSED_NORM] = t
                continue
        s = split_expert(name)
        if s is None:
            out[name] = t
            continue
        pre, rel = s
        m = _SEQ.match(rel)
        if m is None:
            raise ExpertNameError(f"{name}: not in SequentialMLP's names (convert with to_sequential first)")
        impl = impls.get(pre, SEQUENTIAL)
        i = int(m["i"])
        if impl == SEQUENTIAL:
            out[name] = t
        elif impl == TE_GROUPED:
            fc, _, kind = m["rest"].rpartition(".")
            out[f"{pre}{fc}.{kind}{i}"] = t
        else:
            g = re.fullmatch(r"linear_fc([12])\.weight", m["rest"])
            if g is None:
                raise ExpertNameError(f"{name}: GroupedMLP has no parameter for {m['rest']} (no expert bias)")
            pending.setdefault((pre, int(g.group(1))), {})[i] = t
    for (pre, which), by_i in sorted(pending.items()):
        if sorted(by_i) != list(range(len(by_i))):
            raise ExpertNameError(f"{pre}: local experts {sorted(by_i)} for GroupedMLP weight{which}; it needs 0..n-1")
        out[f"{pre}weight{which}"] = join_grouped([by_i[i] for i in range(len(by_i))], which)
    return out


def convert(state: Mapping[str, torch.Tensor], target_names: Iterable[str]) -> dict[str, torch.Tensor]:
    """A module state (local indices, any implementation's names) in the names of the module whose
    parameter names are `target_names`; the same dict's items when the names already match."""
    target = list(target_names)
    if set(state) == set(target):
        return dict(state)
    n = {**_counts(target), **_counts(state)}
    return from_sequential(to_sequential(state, n), target)
