"""Build the Mixtral-style MoE GPTModel with the kernels the rank can run, and give it weights
that do not depend on the parallel layout or the kernels (so any two layouts start identical).

Kernels (`choose_kernels`, decided once per run for a pool of ranks from their GPUs, what imports
there and Megatron-LM's --transformer-impl / --moe-grouped-gemm):

    name            layer spec (megatron-core)                          experts         attention
    "te"            get_gpt_layer_with_transformer_engine_spec, grouped  TEGroupedMLP    TE (fused)
    "te_sequential" get_gpt_layer_with_transformer_engine_spec           SequentialMLP   TE (fused)
    "grouped"       get_gpt_layer_local_spec, moe_grouped_gemm (legacy)  GroupedMLP      local (unfused)
    "local"         get_gpt_layer_local_spec                             SequentialMLP   local (unfused)

The same weights have other names (and for GroupedMLP another layout) under each: canonical
names (plan/expert_names.py) are one namespace for all of them.

Fusions (`choose_fusions`, per rank): Megatron-LM's defaults, each turned off only where this
rank cannot run it, for the reason its row of FUSION_RULES gives; CPU ranks run none (their
numerics are the parity suite's).
"""
from __future__ import annotations

import dataclasses
import enum
import importlib
import os
import re
import zlib
from typing import Callable, Mapping, NamedTuple, Sequence

import torch
import torch.nn.functional as F

from megatron_hetermoe.config import ModelConfig, ParallelConfig
from megatron_hetermoe.errors import UserError
from megatron_hetermoe.plan import expert_names
from megatron_hetermoe.vocabulary import Role

PRECISIONS = ("fp32", "bf16", "fp16")

# --- kernels ---------------------------------------------------------------------------------
KERNELS = ("local", "te", "te_sequential", "grouped")
TE_KERNELS = ("te", "te_sequential")
TRANSFORMER_IMPLS = ("local", "transformer_engine")  # Megatron-LM's --transformer-impl values run here
# transformer-engine's support matrix starts at Ampere (compute capability 8.0): a V100 (7.0) or
# a T4 (7.5) cannot run its kernels even where the package imports.
TE_MIN_CAPABILITY = (8, 0)


class KernelError(UserError, ValueError):
    """Kernels asked for (--transformer-impl, --moe-grouped-gemm) that cannot run here."""


class KernelChoice(NamedTuple):
    """The kernels a run uses and why (`name, reason = choose_kernels(...)`)."""

    name: str
    reason: str

    @property
    def transformer_impl(self) -> str:
        return "transformer_engine" if self.name in TE_KERNELS else "local"

    @property
    def moe_grouped_gemm(self) -> bool:
        return self.name in ("te", "grouped")

    @property
    def experts(self) -> str:
        return {"te": expert_names.TE_GROUPED, "grouped": expert_names.GROUPED}.get(self.name, expert_names.SEQUENTIAL)

    def line(self) -> str:
        return f"kernels: {self.name} ({self.reason})"


def transformer_engine_status() -> tuple[bool, bool, str]:
    """(transformer-engine imports, it has grouped linear layers for TEGroupedMLP, what was found)."""
    try:
        te = importlib.import_module("transformer_engine")
        importlib.import_module("transformer_engine.pytorch")
        from megatron.core.extensions import transformer_engine as mte
    except Exception as e:  # ImportError, or OSError/RuntimeError of a broken install
        return False, False, f"transformer_engine does not import: {type(e).__name__}: {str(e)[:120]}"
    grouped = getattr(mte, "TEColumnParallelGroupedLinear", None) is not None
    return True, grouped, f"transformer-engine {getattr(te, '__version__', '?')}"


def grouped_gemm_status() -> tuple[bool, str]:
    """(megatron-core's legacy GroupedMLP can run: the grouped_gemm package imports and this
    megatron-core still has GroupedMLP, what was found)."""
    from megatron.core.transformer.moe import experts as mexperts

    if not hasattr(mexperts, "GroupedMLP"):
        return False, "this megatron-core has no legacy GroupedMLP"
    try:
        from megatron.core.transformer.moe import grouped_gemm_util as gg
    except Exception as e:
        return False, f"megatron's grouped_gemm_util does not import: {type(e).__name__}: {e}"
    if not gg.grouped_gemm_is_available():
        return False, "the grouped_gemm package does not import"
    return True, "grouped_gemm imports"


@dataclasses.dataclass(frozen=True)
class RankEnv:
    """What one rank can run: its device, its GPU, and which optional kernels import there.
    `probe_rank` fills it in on the rank; `gather_rank_envs` gives every rank everyone's, so the
    ranks that must agree on kernels decide from the same facts. A CPU rank imports none of the
    optional kernels (an installed-but-broken transformer-engine raises on import).
    capability None on a CUDA rank: unknown (no CUDA runtime answered: a check of a GPU job's
    flags where there is no GPU), not held against it."""

    device: str = "cpu"  # "cpu" or "cuda"
    rank: int | None = None  # in the job; None: this process before it joined one
    gpu: str | None = None  # torch.cuda.get_device_name
    capability: tuple[int, int] | None = None  # torch.cuda.get_device_capability
    te: bool = False  # transformer-engine imports
    te_grouped: bool = False  # ... with grouped linear layers (TEGroupedMLP)
    te_why: str = "CPU rank: transformer-engine is not imported on CPU ranks"
    grouped_gemm: bool = False  # megatron-core's legacy GroupedMLP runs (grouped_gemm imports)
    grouped_gemm_why: str = "CPU rank"
    apex_norm: bool = False  # apex imports: megatron-core's FusedLayerNorm (LayerNorm only)
    apex_wgrad: bool = False  # apex's fused_weight_gradient_mlp_cuda (megatron-core's flag for it)
    softmax_kernels: bool = False  # Megatron's compiled fused-softmax extensions import
    jit_fuser_builds: bool = False  # megatron-core's jit_fuser can build for this device
    te_rope: bool = False  # megatron-core's fused RoPE (transformer-engine's) is bound
    te_permute: bool = False  # megatron-core's fused permute (transformer-engine >= 2.1) is bound

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    def who(self) -> str:
        """'rank 5 (Tesla V100-SXM2-16GB, compute capability 7.0)', for messages."""
        name = "this rank" if self.rank is None else f"rank {self.rank}"
        if not self.cuda:
            return f"{name} (CPU)"
        cc = "" if self.capability is None else f", compute capability {self.capability[0]}.{self.capability[1]}"
        return f"{name} ({self.gpu or 'GPU'}{cc})"

    def te_blocker(self) -> str | None:
        """Why transformer-engine cannot run on this rank (None: it can)."""
        if not self.cuda:
            return f"{self.who()}: transformer-engine runs on CUDA ranks only"
        if not self.te:
            return f"{self.who()}: {self.te_why}"
        if self.capability is not None and tuple(self.capability) < TE_MIN_CAPABILITY:
            lo = ".".join(map(str, TE_MIN_CAPABILITY))
            return f"{self.who()}: transformer-engine supports compute capability {lo} (Ampere) and newer"
        return None


def _imports(name: str) -> bool:
    try:
        importlib.import_module(name)
    except Exception:  # ImportError, or OSError of an extension built for another CUDA
        return False
    return True


def device_capability(device) -> tuple[int, int] | None:
    """The compute capability of a CUDA `device`, None where no CUDA runtime answers."""
    if not torch.cuda.is_available():
        return None
    return tuple(torch.cuda.get_device_capability(device))


def probe_rank(device, rank: int | None = None) -> RankEnv:
    """This process's RankEnv on `device` (CPU: nothing optional is imported)."""
    if torch.device(device).type != "cuda":
        return RankEnv("cpu", rank)
    from megatron.core import jit
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.tensor_parallel import layers
    from megatron.core.transformer.moe import moe_utils

    te, te_grouped, te_why = transformer_engine_status()
    gg, gg_why = grouped_gemm_status()
    capability = device_capability(device)
    gpu = torch.cuda.get_device_name(device) if capability is not None else None
    # megatron-core's jit_fuser is torch.compile (torch >= 2.2), whose CUDA kernels are triton's.
    if jit.jit_fuser is torch.compile:
        try:
            from torch.utils._triton import has_triton
        except ImportError:  # a torch without the helper: triton importing is what inductor needs
            builds = _imports("triton")
        else:
            builds = bool(has_triton())
    else:
        builds = True  # torch.jit.script or megatron's no-op decorator
    permute = ("fused_permute", "fused_permute_with_probs", "fused_sort_chunks_by_index",
               "fused_sort_chunks_by_index_with_probs", "fused_unpermute")  # what TransformerConfig checks
    return RankEnv(
        "cuda", rank, gpu, capability, te, te_grouped, te_why, gg, gg_why,
        apex_norm=_imports("apex") and _imports("megatron.core.fusions.fused_layer_norm"),
        apex_wgrad=bool(getattr(layers, "_grad_accum_fusion_available", False)),
        softmax_kernels=all(_imports(m) for m in ("scaled_upper_triang_masked_softmax_cuda",
                                                  "scaled_masked_softmax_cuda", "scaled_softmax_cuda")),
        jit_fuser_builds=builds,
        te_rope=te and getattr(rope_utils, "fused_apply_rotary_pos_emb", None) is not None,
        te_permute=te and all(getattr(moe_utils, n, None) is not None for n in permute))


def gather_rank_envs(device, group=None) -> list[RankEnv]:
    """Every rank's RankEnv, indexed by its rank in `group` (default: the world), on every rank.
    A world's ranks are all CUDA (NCCL) or all CPU (gloo; parallel/device.py rank_device), so
    CPU ranks know everyone's without a collective."""
    import torch.distributed as dist

    n, me = dist.get_world_size(group), dist.get_rank(group)
    if torch.device(device).type != "cuda":
        return [RankEnv("cpu", r) for r in range(n)]
    out = [None] * n
    dist.all_gather_object(out, probe_rank(device, me), group=group)
    return out


def _te_blocker(pool: Sequence[RankEnv]) -> str | None:
    """Why transformer-engine cannot run on some rank of `pool` (the first such; None: it runs on all)."""
    return next((b for b in (r.te_blocker() for r in pool) if b is not None), None)


def _oldest(pool: Sequence[RankEnv]) -> str:
    caps = [r.capability for r in pool if r.capability is not None]
    return f" (oldest GPU: compute capability {'.'.join(map(str, min(caps)))})" if caps else ""


def choose_kernels(device, precision: str = "fp32", transformer_impl: str | None = None,
                   moe_grouped_gemm: bool | None = None, pool: Sequence[RankEnv] | None = None) -> KernelChoice:
    """The kernels of a pool of ranks: `pool` (their RankEnvs; default: this rank alone on `device`).

    The rule: ranks whose gradients meet in one data-parallel reduction (DDP buckets, the
    distributed optimizer's shards) must have identical parameter layouts, so they run one
    choice. HeterMoE decides per pool (role): the attention ranks (the dense weights' DP group,
    and the replica groups of Asym-EA experts, all of them attention ranks) and the expert ranks
    (every expert replica group is expert ranks: ZP groups have one shape); every rank of the job
    computes both pools' choices from the same gathered RankEnvs, so all agree, and a choice that
    cannot run fails on every rank alike. TE is chosen only where every rank of the pool runs it
    (it imports, compute capability >= TE_MIN_CAPABILITY), so its oldest GPU decides.

    transformer_impl / moe_grouped_gemm: Megatron-LM's --transformer-impl and --moe-grouped-gemm
    with Megatron's meaning when given (a request some rank of the pool cannot run raises
    KernelError naming that rank and its GPU); None: choose automatically, the fastest that runs on
    every rank of the pool: TE (with TEGroupedMLP) on CUDA ranks, else the legacy GroupedMLP when
    grouped_gemm imports on CUDA ranks and the run is bf16 (megatron-core's GroupedMLP asserts
    bf16), else megatron-core's local spec (SequentialMLP)."""
    ranks = list(pool) if pool is not None else [probe_rank(device)]
    cuda = all(r.cuda for r in ranks)
    if transformer_impl not in (None, *TRANSFORMER_IMPLS):
        raise KernelError(f"--transformer-impl {transformer_impl}: this trainer runs {' or '.join(TRANSFORMER_IMPLS)}")
    gg_bad = next((r for r in ranks if not r.grouped_gemm), None)
    gg, gg_why = gg_bad is None, (ranks[0].grouped_gemm_why if gg_bad is None else gg_bad.grouped_gemm_why)
    if gg_bad is not None and len(ranks) > 1:
        gg_why = f"{gg_bad.who()}: {gg_why}"
    te_blocker = _te_blocker(ranks)
    te_why = te_blocker if te_blocker is not None else ranks[0].te_why + _oldest(ranks)
    te_grouped = all(r.te_grouped for r in ranks)

    def grouped_or_raise(what: str) -> KernelChoice:
        if not cuda:
            raise KernelError(f"{what}: GroupedMLP runs on CUDA ranks only, these are CPU ranks; "
                              f"drop --moe-grouped-gemm")
        if not gg:
            raise KernelError(f"{what}: {gg_why} (pip install grouped_gemm, or use transformer-engine); drop "
                              f"--moe-grouped-gemm")
        if precision != "bf16":
            raise KernelError(f"{what}: megatron-core's GroupedMLP runs bf16 only (it asserts config.bf16), "
                              f"this run is {precision}; add --bf16 or drop --moe-grouped-gemm")
        return KernelChoice("grouped", f"{what}: local spec, GroupedMLP experts; {gg_why}")

    if transformer_impl == "transformer_engine":
        if not cuda:
            raise KernelError("--transformer-impl transformer_engine: transformer-engine runs on CUDA ranks only, "
                              "these are CPU ranks; use --transformer-impl local")
        if te_blocker is not None:
            raise KernelError(f"--transformer-impl transformer_engine: {te_blocker}; install transformer-engine there, "
                              f"or run that pool on Ampere or newer GPUs, or use --transformer-impl local, or leave "
                              f"the flag out (each pool then runs transformer-engine where all of its GPUs can)")
        if moe_grouped_gemm:
            if not te_grouped:
                raise KernelError(f"--transformer-impl transformer_engine --moe-grouped-gemm: {te_why} has no grouped "
                                  f"linear layers (TEGroupedMLP needs transformer-engine >= 1.7)")
            return KernelChoice("te", f"--transformer-impl transformer_engine --moe-grouped-gemm: TEGroupedMLP "
                                      f"experts; {te_why}")
        return KernelChoice("te_sequential", f"--transformer-impl transformer_engine: TE spec, SequentialMLP experts "
                                             f"(no --moe-grouped-gemm); {te_why}")
    if transformer_impl == "local":
        if moe_grouped_gemm:
            return grouped_or_raise("--transformer-impl local --moe-grouped-gemm")
        return KernelChoice("local", "--transformer-impl local: megatron-core's local spec, SequentialMLP experts")
    # automatic
    if not cuda:
        if moe_grouped_gemm:
            grouped_or_raise("--moe-grouped-gemm")  # raises: CPU
        return KernelChoice("local", "automatic: CPU ranks run megatron-core's local spec, SequentialMLP experts")
    if te_blocker is None:
        if te_grouped:
            return KernelChoice("te", f"automatic: {te_why} runs on CUDA: TE spec, TEGroupedMLP experts")
        if not moe_grouped_gemm:
            return KernelChoice("te_sequential", f"automatic: {te_why} runs on CUDA but has no grouped linear "
                                                 f"layers: TE spec, SequentialMLP experts")
    if moe_grouped_gemm:
        return grouped_or_raise(f"--moe-grouped-gemm ({te_why})")
    if gg and precision == "bf16":
        return KernelChoice("grouped", f"automatic: no transformer-engine ({te_why}); {gg_why}, bf16 on CUDA: "
                                       f"local spec, GroupedMLP experts")
    why = gg_why if not gg else f"{gg_why} but GroupedMLP runs bf16 only, this run is {precision}"
    return KernelChoice("local", f"automatic: no transformer-engine ({te_why}); {why}: megatron-core's local "
                                 f"spec, SequentialMLP experts")


def megatron_lm_kernels(transformer_impl: str, given: bool, moe_grouped_gemm: bool, precision: str,
                        pool: Sequence[RankEnv]) -> KernelChoice:
    """Megatron-LM's --transformer-impl and --moe-grouped-gemm on one pool of a --hetero-plan run
    of its pretrain() (the pool rule of choose_kernels). transformer_engine given on the command
    line: every rank of the pool must run it (KernelError naming the rank otherwise); Megatron-LM's
    default transformer_engine: the pool runs it where every rank can, else megatron-core's local
    spec, with --moe-grouped-gemm the legacy GroupedMLP where it runs there (grouped_gemm, bf16),
    else SequentialMLP (the reason says which rank decided). Any other value: Megatron's own."""
    if transformer_impl != "transformer_engine":
        return KernelChoice("grouped" if moe_grouped_gemm else "local", f"--transformer-impl {transformer_impl}")
    if given:
        return choose_kernels("cuda", precision, "transformer_engine", moe_grouped_gemm, pool)
    blocker = _te_blocker(pool)
    if blocker is None:
        return choose_kernels("cuda", precision, "transformer_engine", moe_grouped_gemm, pool)
    why = f"Megatron-LM's default --transformer-impl transformer_engine cannot run on {blocker}"
    if moe_grouped_gemm:
        try:
            return choose_kernels("cuda", precision, "local", True, pool)._replace(
                reason=f"{why}: megatron-core's local spec, GroupedMLP experts")
        except KernelError as e:
            return KernelChoice("local", f"{why}: megatron-core's local spec, SequentialMLP experts (the legacy "
                                         f"GroupedMLP for --moe-grouped-gemm cannot run either: {e})")
    return KernelChoice("local", f"{why}: megatron-core's local spec, SequentialMLP experts")


# --- fusions ---------------------------------------------------------------------------------
class Fusion(str, enum.Enum):
    """Megatron's kernel fusions, each by the TransformerConfig field that sets it."""

    BIAS_ACTIVATION = "bias_activation_fusion"
    MASKED_SOFTMAX = "masked_softmax_fusion"
    PERSIST_LAYER_NORM = "persist_layer_norm"
    GRADIENT_ACCUMULATION = "gradient_accumulation_fusion"
    APPLY_ROPE = "apply_rope_fusion"
    BIAS_DROPOUT = "bias_dropout_fusion"
    MOE_PERMUTE = "moe_permute_fusion"
    CROSS_ENTROPY_LOSS = "cross_entropy_loss_fusion"


# Why a fusion cannot run on a rank (None: it can): (the rank, its kernels, its role, the model's
# normalization) -> reason. Read from megatron-core 0.16.1's source (the sites named).
Blocker = Callable[[RankEnv, str, "Role | None", str], "str | None"]
_CPU = ("CPU rank: megatron-core's fused paths are CUDA kernels or torch.compile'd by its jit_fuser; CPU ranks run "
        "the unfused ops (the parity suite's numerics)")


def _jit(env: RankEnv, kernels: str, role, norm: str) -> str | None:
    if not env.jit_fuser_builds:  # fusions/fused_bias_swiglu.py, fused_bias_dropout.py, fused_cross_entropy.py
        return "megatron-core's jit_fuser is torch.compile, whose CUDA kernels need triton, which does not import here"
    return None


def _softmax(env: RankEnv, kernels: str, role, norm: str) -> str | None:
    if kernels in TE_KERNELS:  # TE's attention does not read it
        return None
    if not env.softmax_kernels:  # fusions/fused_softmax.py imports them when it fuses
        return ("the local spec's FusedScaleMaskSoftmax imports Megatron's compiled softmax extensions "
                "(scaled_masked_softmax_cuda ...), which do not import here")
    return None


def _persist(env: RankEnv, kernels: str, role, norm: str) -> str | None:
    if kernels in TE_KERNELS:  # TE's norms do not read it
        return None
    if norm != "LayerNorm":  # the local spec's RMSNorm is torch's (transformer/torch_norm.py asserts it off)
        return f"the local spec's {norm} is torch's (WrappedTorchNorm), which refuses it; apex's kernel is LayerNorm's"
    if not env.apex_norm:
        return "the local spec's LayerNorm is torch's (WrappedTorchNorm, apex does not import), which refuses it"
    return None


def _wgrad(env: RankEnv, kernels: str, role, norm: str) -> str | None:
    if env.apex_wgrad:
        return None
    if role == Role.EXPERT and kernels in TE_KERNELS:  # only TE's linears, which fuse it themselves
        return None
    # tensor_parallel/layers.py: ColumnParallelLinear raises at build without it (GPTModel's output
    # layer is one in every spec; the local spec's linears are all megatron-core's).
    return "megatron-core's own linear layers need apex's fused_weight_gradient_mlp_cuda, which does not import here"


def _rope(env: RankEnv, kernels: str, role, norm: str) -> str | None:
    blocker = env.te_blocker()  # models/common/embeddings/rope_utils.py binds transformer-engine's
    if blocker is not None:
        return f"megatron-core's fused RoPE is transformer-engine's: {blocker}"
    if not env.te_rope:
        return "this transformer-engine has no fused RoPE (megatron-core asks for transformer-engine >= 1.4)"
    return None


def _permute(env: RankEnv, kernels: str, role, norm: str) -> str | None:
    blocker = env.te_blocker()  # transformer/moe/moe_utils.py binds transformer-engine's
    if blocker is not None:
        return f"megatron-core's fused permute is transformer-engine's: {blocker}"
    if not env.te_permute:
        return "this transformer-engine has no fused permute (megatron-core asks for transformer-engine >= 2.1)"
    return None


@dataclasses.dataclass(frozen=True)
class FusionRule:
    megatron_lm: bool  # Megatron-LM's default (its flags; TransformerConfig's own default is off for all)
    flag: str  # Megatron-LM's flag that changes it
    blocker: Blocker


FUSION_RULES: dict[Fusion, FusionRule] = {
    Fusion.BIAS_ACTIVATION: FusionRule(True, "--no-bias-swiglu-fusion", _jit),
    Fusion.MASKED_SOFTMAX: FusionRule(True, "--no-masked-softmax-fusion", _softmax),
    Fusion.PERSIST_LAYER_NORM: FusionRule(True, "--no-persist-layer-norm", _persist),
    Fusion.GRADIENT_ACCUMULATION: FusionRule(True, "--no-gradient-accumulation-fusion", _wgrad),
    Fusion.APPLY_ROPE: FusionRule(True, "--no-rope-fusion", _rope),
    Fusion.BIAS_DROPOUT: FusionRule(True, "--no-bias-dropout-fusion", _jit),
    Fusion.MOE_PERMUTE: FusionRule(False, "--moe-permute-fusion", _permute),
    Fusion.CROSS_ENTROPY_LOSS: FusionRule(False, "--cross-entropy-loss-fusion", _jit),
}


@dataclasses.dataclass(frozen=True)
class FusionChoice:
    """Which fusions a rank runs (`on`), and why each asked-for one it does not run is off (`off`)."""

    on: Mapping[Fusion, bool]
    off: Mapping[Fusion, str] = dataclasses.field(default_factory=dict)

    def config_kwargs(self) -> dict[str, bool]:
        """TransformerConfig's fields."""
        return {f.value: bool(self.on[f]) for f in Fusion}

    def lines(self) -> list[str]:
        """One line per fusion asked for and turned off here: its field and the reason."""
        return [f"{f.value} off: {why}" for f, why in self.off.items()]


NO_FUSIONS = FusionChoice({f: False for f in Fusion})


def choose_fusions(env: RankEnv, kernels: str, role: Role | None = None, normalization: str = "RMSNorm",
                   requested: Mapping[Fusion, bool] | None = None) -> FusionChoice:
    """The fusions of a rank (`env`) running `kernels` in `role`: each asked for (`requested`,
    default Megatron-LM's defaults, FusionRule.megatron_lm) stays on unless its rule says this rank
    cannot run it; CPU ranks run none. Per rank: a fusion changes no parameter layout."""
    asked = {f: r.megatron_lm for f, r in FUSION_RULES.items()}
    asked.update(requested or {})
    on, off = {}, {}
    for f, rule in FUSION_RULES.items():
        why = (_CPU if not env.cuda else rule.blocker(env, kernels, role, normalization)) if asked[f] else None
        on[f] = bool(asked[f]) and why is None
        if why is not None:
            off[f] = why
    return FusionChoice(on, off)


def config_kernels(config) -> str:
    """The kernels a TransformerConfig made by transformer_config() was made for."""
    te = getattr(config, "transformer_impl", "local") == "transformer_engine"
    grouped = bool(getattr(config, "moe_grouped_gemm", False))
    return ("te" if grouped else "te_sequential") if te else ("grouped" if grouped else "local")


def precision_dtype(precision: str) -> torch.dtype:
    """The parameter and activation dtype of a precision name (TrainConfig.precision)."""
    try:
        return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    except KeyError:
        raise ValueError(f"precision {precision!r} is unknown; use one of {list(PRECISIONS)}") from None


# The ModelConfig fields TransformerConfig takes as they are: the same name and meaning (Megatron-LM's flag).
_CONFIG_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "moe_ffn_hidden_size",
                  "moe_router_topk", "moe_aux_loss_coeff", "moe_router_load_balancing_type",
                  "moe_router_score_function", "moe_router_enable_expert_bias", "moe_router_bias_update_rate")


def transformer_config(model: ModelConfig, par: ParallelConfig, precision: str = "fp32", kernels: str = "local",
                       fusions: FusionChoice | None = None, **overrides):
    """megatron-core's TransformerConfig of `model`; `precision` sets bf16/fp16 and
    params_dtype as Megatron-LM's --bf16/--fp16 do; `kernels` (KERNELS, choose_kernels) sets
    transformer_impl and moe_grouped_gemm as Megatron-LM's flags do; `fusions` (choose_fusions'
    for the rank) sets Megatron's fusion fields; default: every fusion off, a CPU rank's choice
    (and all that megatron-core's own config checks, run before launch, need)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    if kernels not in KERNELS:
        raise ValueError(f"kernels {kernels!r} is unknown; use one of {list(KERNELS)}")
    dtype = precision_dtype(precision)
    kw = dict(
        **{name: getattr(model, name) for name in _CONFIG_FIELDS},
        num_moe_experts=model.num_experts,
        # Megatron refuses top-1 with softmax after top-k (the gate would get no gradient).
        moe_router_pre_softmax=model.moe_router_topk == 1,
        moe_token_dispatcher_type=par.dispatcher,
        normalization="RMSNorm",
        gated_linear_unit=True,  # SwiGLU
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        bf16=precision == "bf16",
        fp16=precision == "fp16",
        params_dtype=dtype,
        pipeline_dtype=dtype,
        tensor_model_parallel_size=par.tp,
        sequence_parallel=par.sequence_parallel,
        expert_tensor_parallel_size=1,  # experts are never tensor-parallel here (tp_shards.py)
        pipeline_model_parallel_size=par.pp,
        expert_model_parallel_size=par.ep,
        # A list when per layer (megatron-core checks its length against num_layers at CP > 1).
        cp_comm_type=par.cp_comm_type if isinstance(par.cp_comm_type, str) else list(par.cp_comm_type),
        **(fusions or NO_FUSIONS).config_kwargs(),
        transformer_impl="transformer_engine" if kernels in TE_KERNELS else "local",
        moe_grouped_gemm=kernels in ("te", "grouped"),
    )
    if kernels in TE_KERNELS and overrides.get("deterministic_mode"):
        # megatron-core refuses TE's attention in deterministic mode unless this is 0 (Megatron-LM's advice).
        os.environ.setdefault("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
    # megatron-core's default CUDA-graph scope "full" (cuda_graph_scope in 0.16-0.18,
    # cuda_graph_modules from 0.19) warns "full scope is deprecated" on every config; [] is
    # the same whole-layer scope without the warning. (Unused on CPU: no CUDA graphs.)
    defaults = {f.name: f.default for f in dataclasses.fields(TransformerConfig)}
    for name in ("cuda_graph_modules", "cuda_graph_scope"):
        if defaults.get(name) == "full":
            kw[name] = []
            break
    kw.update(overrides)
    return TransformerConfig(**kw)


def layer_spec(model: ModelConfig, kernels: str = "local"):
    """megatron-core's GPT layer spec for `kernels` (the table in this module's docstring)."""
    from megatron.core.models.gpt import gpt_layer_specs

    from megatron_hetermoe.compat import (
        moe_experts_spec,
        normalize_layer_spec,
    )
    from megatron_hetermoe.shims.moe_utils import bind_missing_te_general_gemm

    if kernels not in KERNELS:
        raise ValueError(f"kernels {kernels!r} is unknown; use one of {list(KERNELS)}")
    bind_missing_te_general_gemm()  # the router needs it without transformer-engine (shims/moe_utils.py)
    if kernels == "local":
        spec = gpt_layer_specs.get_gpt_layer_local_spec(num_experts=model.num_experts, normalization="RMSNorm")
    elif kernels == "grouped":
        spec = gpt_layer_specs.get_gpt_layer_local_spec(num_experts=model.num_experts, normalization="RMSNorm",
                                                        moe_grouped_gemm=True)
    else:  # TE's norms read config.normalization (RMSNorm)
        spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(num_experts=model.num_experts,
                                                                          moe_grouped_gemm=kernels == "te")
    # 0.18+ give the MoE mlp as builders; normalized to 0.16.1's ModuleSpec form (compat.py).
    spec = normalize_layer_spec(spec)
    want = {"te": expert_names.TE_GROUPED, "grouped": expert_names.GROUPED}.get(kernels, expert_names.SEQUENTIAL)
    experts = moe_experts_spec(spec)
    got = getattr(getattr(experts, "module", experts), "__name__", repr(experts))
    if got != want:  # e.g. a megatron-core whose local spec dropped the legacy GroupedMLP
        raise RuntimeError(f"kernels {kernels!r}: megatron-core's spec gives {got} experts, not {want}")
    return spec


def block_spec(model: ModelConfig, kernels: str, config, pp_rank: int = 0, device=None):
    """The decoder block spec of pipeline stage `pp_rank`: `layer_spec(model, kernels)` for each
    layer the stage builds (megatron-core's get_num_layers_to_build, as TransformerBlock counts
    them) and a final norm of the same kernels: TENorm with TE, else the local spec's own norm.
    Given a layer spec alone, TransformerBlock takes its final norm from what imports (TENorm
    whenever transformer-engine imports, even on a V100 or with the local spec; else apex's
    FusedLayerNorm, which refuses RMSNorm). `device`: the rank's, which needs the norm patch on the
    local spec (parallel/cpu_backend.py apply_for_spec)."""
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    from megatron_hetermoe.parallel import cpu_backend

    spec = layer_spec(model, kernels)
    if device is not None:
        cpu_backend.apply_for_spec(device, "transformer_engine" if kernels in TE_KERNELS else "local")
    if kernels in TE_KERNELS:
        from megatron.core.extensions.transformer_engine import TENorm

        norm = TENorm
    else:
        norm = spec.submodules.input_layernorm
    return TransformerBlockSubmodules(layer_specs=[spec] * get_num_layers_to_build(config, pp_rank=pp_rank),
                                      layer_norm=norm)


def gpt_kwargs(model: ModelConfig) -> dict:
    """GPTModel's arguments beyond config, spec and groups for `model` (a Mixtral-style model:
    untied embeddings, RoPE)."""
    return {"vocab_size": model.vocab_size, "max_sequence_length": model.seq_length,
            "share_embeddings_and_output_weights": False, "position_embedding_type": "rope"}


def build_gpt(model: ModelConfig, config, spec=None, pre_process: bool = True, post_process: bool = True,
              pg_collection=None, pp_rank: int | None = None, device=None):
    """One pipeline stage of the GPT model (all of it when PP=1); without `spec`, the block spec
    of the kernels `config` was made for (transformer_config's `kernels`) for its stage: `pp_rank`,
    default the rank in the pipeline group GPTModel's TransformerBlock reads (pg_collection's, or
    megatron-core's global one); `device`: block_spec's."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.utils import get_pg_rank

    kw = {} if pg_collection is None else {"pg_collection": pg_collection}
    if spec is None:
        if pp_rank is None:
            pgc = pg_collection if pg_collection is not None else ProcessGroupCollection.use_mpu_process_groups()
            pp_rank = get_pg_rank(getattr(pgc, "pp", None))
        spec = block_spec(model, config_kernels(config), config, pp_rank, device)
    return GPTModel(config=config, transformer_layer_spec=spec, pre_process=pre_process, post_process=post_process,
                    **gpt_kwargs(model), **kw)


def wrap_precision(config, module: torch.nn.Module) -> torch.nn.Module:
    """Megatron-LM's get_model: a bf16/fp16 model chunk is wrapped in Float16Module (which
    casts it) before DDP; fp32 chunks are returned as they are."""
    if not (config.bf16 or config.fp16):
        return module
    from megatron.core.transformer.module import Float16Module

    return Float16Module(config, module)


def unwrap(model) -> torch.nn.Module:
    """The module inside DDP and Float16Module (a model chunk list: its first chunk)."""
    m = model[0] if isinstance(model, (list, tuple)) else model
    while hasattr(m, "module"):
        m = m.module
    return m


def wrapped_names(model: torch.nn.Module, names: dict[str, str]) -> dict[str, str]:
    """`names` (the unwrapped module's local name -> canonical name) keyed by the names the
    wrapped model (DDP, Float16Module) gives the same parameters."""
    by_param = {p: names[n] for n, p in unwrap(model).named_parameters()}
    return {n: by_param[p] for n, p in model.named_parameters()}


# --- canonical names: the same parameter has the same name in every layout -----------------
_LAYER = re.compile(r"^(?:module\.)*decoder\.layers\.(\d+)\.")
_MTP_LAYER = re.compile(r"^(?:module\.)*mtp\.layers\.(\d+)\.transformer_layer\.")


def canonical_names(model: torch.nn.Module) -> dict[str, str]:
    """local parameter name -> canonical name: the name in a plain Megatron model with PP=1, EP=1
    and the local spec (global layer and expert indices, no DDP wrapper, SequentialMLP's names).

    Layer numbers come from TransformerLayer.layer_number (global, 1-based) and expert ids
    from MoELayer.local_expert_indices, so PP and EP shards map onto one namespace; expert and
    fused-norm names of other kernels map through plan/expert_names.py (a GroupedMLP weight,
    which holds several experts, gets its label `...mlp.experts.weight1[E0,E1]`).
    """
    from megatron.core.transformer.transformer_layer import TransformerLayer

    layer_of: dict[int, int] = {}
    experts_of: dict[int, list[int]] = {}
    mtp_experts: dict[int, list[int]] = {}  # MTP layer k's transformer layer (names keep k: PP=1)
    mods = dict(model.named_modules())
    for name, mod in mods.items():
        m = re.match(r"^(?:module\.)*decoder\.layers\.(\d+)$", name)
        if m and isinstance(mod, TransformerLayer):
            layer_of[int(m.group(1))] = mod.layer_number - 1
            mlp = mod.mlp
            if hasattr(mlp, "local_expert_indices"):
                experts_of[int(m.group(1))] = list(mlp.local_expert_indices)
        m = _MTP_LAYER.match(name + ".")  # the TransformerLayer inside MTP layer k
        if m and isinstance(mod, TransformerLayer) and hasattr(mod.mlp, "local_expert_indices"):
            mtp_experts[int(m.group(1))] = list(mod.mlp.local_expert_indices)
    out = {}
    for name, _ in model.named_parameters():
        canon = re.sub(r"^(?:module\.)*", "", name)
        m = _LAYER.match(name)
        if m:
            local = int(m.group(1))
            canon = _LAYER.sub(f"decoder.layers.{layer_of[local]}.", name)
            canon = expert_names.canonical_name(canon, lambda pre, local=local: experts_of[local])
        m = _MTP_LAYER.match(name)
        if m and int(m.group(1)) in mtp_experts:
            canon = expert_names.canonical_name(canon, lambda pre, k=int(m.group(1)): mtp_experts[k])
        out[name] = canon
    return out


def router_expert_bias(module: torch.nn.Module, names: dict[str, str]) -> dict[str, list[float]]:
    """This rank's routers' aux-loss-free expert bias (Megatron's `expert_bias` buffer), keyed by
    canonical name (the router weight's, `weight` -> `expert_bias`); empty without expert bias or
    without routers (HeterMoE's expert ranks)."""
    params = dict(module.named_parameters())
    out = {}
    for n, b in module.named_buffers():
        if n.endswith("router.expert_bias") and b is not None:
            w = n[: -len("expert_bias")] + "weight"
            if w in params:
                out[names[w][: -len("weight")] + "expert_bias"] = b.detach().float().cpu().tolist()
    return out


def _init_kind(name: str) -> str:
    """Which of Megatron's init rules a canonical parameter follows: "norm" (weights of norms),
    "bias", "embedding" (word and position embeddings: embedding_init_method), "output" (attention
    and MLP/expert output projections: output_layer_init_method) or "weight" (init_method:
    QKV, fc1, routers and their bias, the output layer)."""
    if re.search(r"(norm|layernorm)\.weight$", name):
        return "norm"
    if name.endswith("router.bias"):  # Megatron's TopKRouter draws its bias by init_method, unlike linear layers
        return "weight"
    if name.endswith("bias"):
        return "bias"
    if name.startswith("embedding."):
        return "embedding"
    if name.endswith("linear_proj.weight") or name.endswith("linear_fc2.weight"):
        return "output"
    return "weight"


def canonical_init(name: str, shape: torch.Size, seed: int, config) -> torch.Tensor:
    """Deterministic initial value of canonical parameter `name`, by Megatron's init method for
    its kind in `config` (a TransformerConfig, built from Megatron's flags: --init-method-std,
    --init-method-xavier-uniform, --embedding-init-method-std, --apply-layernorm-1p): norms at 1
    (0 with zero-centered gamma, whose forward adds 1), biases at 0, embeddings by
    embedding_init_method, output projections by output_layer_init_method (N(0, std/sqrt(2 L)) by
    default), others by init_method. The random draw is seeded by (seed, name) alone, so every
    layout and kernel gets the same values."""
    kind = _init_kind(name)
    if kind == "norm":
        return torch.zeros(shape) if config.layernorm_zero_centered_gamma else torch.ones(shape)
    if kind == "bias":
        return torch.zeros(shape)
    method = {"embedding": config.embedding_init_method, "output": config.output_layer_init_method,
              "weight": config.init_method}[kind]
    key = seed * 1_000_003 + zlib.crc32(name.encode())
    normal = _normal_params(method)
    if normal is not None:  # Megatron's normal init: drawn as before for bitwise-stable starts
        mean, std = normal
        return torch.randn(shape, generator=torch.Generator().manual_seed(key)) * std + mean
    out = torch.empty(shape)
    with torch.random.fork_rng(devices=[]):  # any other init method Megatron's config holds
        torch.manual_seed(key)
        method(out)
    return out


def _normal_params(method) -> tuple[float, float] | None:
    """(mean, std) of an init method that is torch.nn.init.normal_ with fixed arguments
    (megatron.core.utils.init_method_normal / scaled_init_method_normal), else None."""
    import functools

    if isinstance(method, functools.partial) and method.func is torch.nn.init.normal_ and not method.args:
        return float(method.keywords.get("mean", 0.0)), float(method.keywords.get("std", 1.0))
    return None


@torch.no_grad()
def init_layout_invariant(model: torch.nn.Module, seed: int, config, names: dict[str, str] | None = None,
                          tp_group=None) -> None:
    """Every parameter at canonical_init of its canonical name under `config`'s init methods: the
    same values under any layout and any kernels (a GroupedMLP weight is packed from its experts'
    canonical values). With `tp_group` of size > 1, a TP-split parameter gets this rank's shard
    of the canonical FULL tensor (models/tp_shards.py), so TP=1 and TP=2 start identical."""
    from megatron_hetermoe.models import tp_shards

    names = names or canonical_names(model)
    specs = tp_shards.module_specs(model, tp_group, glu=bool(getattr(config, "gated_linear_unit", False)))
    for name, p in model.named_parameters():
        c = names[name]
        if expert_names.is_label(c):
            p.copy_(expert_names.pack(c, {k: canonical_init(k, torch.Size(s), seed, config)
                                          for k, s in expert_names.canonical_shapes(c, p.shape).items()}))
        else:
            spec = specs[name]
            p.copy_(tp_shards.shard(canonical_init(c, tp_shards.full_shape(p.shape, spec), seed, config), spec))
