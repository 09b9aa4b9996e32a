"""Every configuration dataclass of a run, in one module that imports no torch and no
megatron: the model shape (YAML-backed), Megatron's parallel sizes, data and tokenizer flags,
the training run, zebra's runtime options and the HeterMoE run (plan schedule, recompute,
timeline). Flags are parsed into these (training/args.py); everything downstream reads them.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Literal

from megatron_hetermoe.errors import UserError
from megatron_hetermoe.limits import MODEL_LIMITS
from megatron_hetermoe.paths import read_yaml_mapping, resolve_config
from megatron_hetermoe import layer_pattern as moe_layers  # layer 0: no torch, no megatron

# A rank's part in a run: HeterMoE's attention or expert rank (read from the plan), or a rank of
# plain Megatron EP (the reference). Logs, timelines, NaN reports and checkpoints name it.
Role = Literal["attention", "expert", "megatron"]
MEGATRON_ROLE: Role = "megatron"

TOKENIZER_TYPES = ("HuggingFaceTokenizer", "GPT2BPETokenizer", "NullTokenizer")



class ModelConfigError(UserError, ValueError):
    """A model config that cannot be built; the message names the field, the value and the fix."""


# ModelConfig fields that are not positive ints (each checked on its own), and those that are
# positive ints or None.
_NOT_COUNTS = ("name", "moe_aux_loss_coeff", "moe_layer_freq")
_OPTIONAL_COUNTS = ("moe_shared_expert_intermediate_size", "mtp_num_layers")


@dataclass(frozen=True)
class ModelConfig:
    """A Mixtral-style MoE GPT (SwiGLU MLPs, RMSNorm, RoPE, no bias), with Megatron's layer options:
    `moe_layer_freq` (Megatron's --moe-layer-freq) makes some layers dense (an MLP of
    ffn_hidden_size instead of experts; default 1: every layer MoE), and
    `moe_shared_expert_intermediate_size` gives every MoE layer a shared-expert MLP of that size
    that all tokens pass through (default None: none), and `mtp_num_layers` (Megatron's
    --mtp-num-layers) adds multi-token prediction layers after the decoder's (default None: none;
    even plans place them, the search does not price them). `num_layers` is the decoder's total
    (Megatron's --num-layers); `num_moe_layers` and `dense_layers` split it."""

    name: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int
    moe_ffn_hidden_size: int
    num_experts: int
    moe_router_topk: int = 2
    moe_aux_loss_coeff: float = 0.01
    vocab_size: int = 32000
    seq_length: int = 4096
    # An int N (layer i is MoE when i % N == 0) or one 0/1 per layer (1 = MoE); the string forms
    # Megatron takes ("2", "([0]+[1]*2)") are read into these. Kept as Megatron's int or list,
    # so it can be handed to a TransformerConfig as it is.
    moe_layer_freq: int | list[int] = 1
    moe_shared_expert_intermediate_size: int | None = None
    mtp_num_layers: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ModelConfigError(f"model name={self.name!r} must be a non-empty string")
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name in _NOT_COUNTS or (f.name in _OPTIONAL_COUNTS and v is None):
                continue
            # bool is an int subclass: `num_layers: true` in YAML must not mean 1.
            if type(v) is not int or v <= 0:
                what = " (or absent: none)" if f.name in _OPTIONAL_COUNTS else ""
                raise ModelConfigError(f"model {self.name!r}: {f.name}={v!r} must be a positive integer{what}")
            if f.name in MODEL_LIMITS and v > MODEL_LIMITS[f.name]:  # limits.py: no cluster holds more
                raise ModelConfigError(f"model {self.name!r}: {f.name}={v} is above {MODEL_LIMITS[f.name]}, the "
                                       f"largest this plugin takes (megatron_hetermoe/limits.py); check the value")
        c = self.moe_aux_loss_coeff
        if type(c) not in (int, float) or not math.isfinite(c) or c < 0:
            raise ModelConfigError(f"model {self.name!r}: moe_aux_loss_coeff={c!r} must be a finite number >= 0 "
                                   f"(Megatron's default is 0.01; 0 disables the load-balancing loss)")
        self._check_moe_layer_freq()
        if self.hidden_size % self.num_attention_heads:
            raise ModelConfigError(
                f"model {self.name!r}: hidden_size={self.hidden_size} is not divisible by "
                f"num_attention_heads={self.num_attention_heads}; pick a head count that divides it"
            )
        if self.head_dim % 2:
            # RoPE rotates pairs of channels; an odd head dim fails inside the first forward.
            raise ModelConfigError(
                f"model {self.name!r}: head dim hidden_size/num_attention_heads = {self.hidden_size}/"
                f"{self.num_attention_heads} = {self.head_dim} is odd; RoPE needs an even head dim"
            )
        if not 1 <= self.moe_router_topk <= self.num_experts:
            raise ModelConfigError(
                f"model {self.name!r}: moe_router_topk={self.moe_router_topk} must be in "
                f"[1, num_experts={self.num_experts}]"
            )

    def _check_moe_layer_freq(self) -> None:
        """Read moe_layer_freq as Megatron does (an int, or its list; a string form is read into
        one) and check it leaves at least one MoE layer in num_layers."""
        v = self.moe_layer_freq
        shown = repr(v) if len(repr(v)) <= 80 else repr(v)[:60] + "..."
        n = self.num_layers
        fix = (f"use an int N >= 1 (layer i is MoE when i % N == 0; 1: every layer) or a list of num_layers={n} "
               f"entries, 0 = dense and 1 = MoE" + (f", e.g. '([0]+[1]*{n - 1})' for a dense first layer" if n > 1 else ""))
        if type(v) not in (int, str, list) or (isinstance(v, list) and any(type(x) is not int for x in v)):
            raise ModelConfigError(f"model {self.name!r}: moe_layer_freq={shown} is not an int, a list of 0/1 nor a "
                                   f"list expression; {fix}")
        try:
            freq = moe_layers.parse_moe_layer_freq(v)
            moe_layers.dense_layers(freq, self.num_layers)
        except (moe_layers.LayerPatternError, ValueError) as e:  # ValueError: an int string too long to read
            raise ModelConfigError(f"model {self.name!r}: moe_layer_freq={shown} is not a valid layer pattern ({e}); "
                                   f"{fix}") from None
        object.__setattr__(self, "moe_layer_freq", freq)  # a fresh int or list: never the caller's list

    def __hash__(self) -> int:  # frozen, but moe_layer_freq may be a list (Megatron's type)
        return hash(tuple(tuple(v) if isinstance(v, list) else v for v in (getattr(self, f.name) for f in fields(self))))

    @classmethod
    def load(cls, path_or_name: str | Path) -> "ModelConfig":
        path = resolve_config(str(path_or_name), "models")
        raw = read_yaml_mapping(path, "model config", ModelConfigError)
        names = {f.name for f in fields(cls)}
        unknown = set(raw) - names
        if unknown:
            raise ModelConfigError(f"{path}: unknown model field(s) {sorted(map(str, unknown))}; known: {sorted(names)}")
        missing = {f.name for f in fields(cls) if f.default is dataclasses.MISSING} - set(raw)
        if missing:
            raise ModelConfigError(f"{path}: missing model field(s) {sorted(missing)}")
        try:
            return cls(**raw)
        except ModelConfigError as e:
            raise ModelConfigError(f"{path}: {e}") from None

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    # ---- layers: MoE and dense (Megatron's --moe-layer-freq) ------------------------------
    @property
    def moe_layer_pattern(self) -> list[int]:
        """One entry per model layer: 1 = MoE layer, 0 = dense layer."""
        return moe_layers.moe_layer_pattern(self.moe_layer_freq, self.num_layers)

    @property
    def dense_layers(self) -> list[int]:
        """Model indices of the layers without experts (a plan's dense_layers)."""
        return [i for i, v in enumerate(self.moe_layer_pattern) if not v]

    @property
    def moe_layer_ids(self) -> list[int]:
        """Model indices of the MoE layers; MoE layer k (a plan's layer k) is model layer moe_layer_ids[k]."""
        return [i for i, v in enumerate(self.moe_layer_pattern) if v]

    @property
    def num_moe_layers(self) -> int:
        """MoE layers: a plan's num_layers (one expert placement each), the task lists' L."""
        return sum(self.moe_layer_pattern)

    @property
    def beyond_every_layer_moe(self) -> list[str]:
        """What of this model the plugin's own trainer (every layer MoE, no shared experts) does not
        build: dense layers, shared experts (empty: it builds this model)."""
        out = []
        if self.dense_layers:
            out.append(f"dense layers {self.dense_layers} (moe_layer_freq {self.moe_layer_freq!r})")
        if self.moe_shared_expert_intermediate_size:
            out.append(f"shared experts (moe_shared_expert_intermediate_size {self.moe_shared_expert_intermediate_size})")
        if self.mtp_num_layers:
            out.append(f"multi-token prediction layers (mtp_num_layers {self.mtp_num_layers})")
        return out

    # ---- parameters ---------------------------------------------------------------------
    def expert_params(self) -> int:
        """Parameters of one SwiGLU expert (fc1 is 2 x ffn for the gate and up projections)."""
        return 3 * self.hidden_size * self.moe_ffn_hidden_size

    def dense_mlp_params(self) -> int:
        """The SwiGLU MLP of one dense layer (ffn_hidden_size)."""
        return 3 * self.hidden_size * self.ffn_hidden_size

    def shared_expert_params(self) -> int:
        """The shared-expert SwiGLU MLP of one MoE layer (0 without shared experts)."""
        return 3 * self.hidden_size * (self.moe_shared_expert_intermediate_size or 0)

    def layer_attention_params(self) -> int:
        """Attention of any layer: QKV + output projection and the two norms."""
        h = self.hidden_size
        return 4 * h * h + 2 * h

    def moe_layer_non_expert_params(self) -> int:
        """What an MoE layer holds besides its routed experts: attention, norms, router, shared expert."""
        return self.layer_attention_params() + self.hidden_size * self.num_experts + self.shared_expert_params()

    def dense_layer_params(self) -> int:
        return self.layer_attention_params() + self.dense_mlp_params()

    def non_expert_params(self) -> int:
        """Embedding, output layer, final norm, and every layer but its routed experts (attention,
        norms, routers, shared experts, dense layers' MLPs): what an attention rank holds."""
        h = self.hidden_size
        layers = self.num_moe_layers * self.moe_layer_non_expert_params() + \
            len(self.dense_layers) * self.dense_layer_params()
        return 2 * self.vocab_size * h + layers + h


@dataclass(frozen=True)
class ParallelConfig:
    """Megatron's parallel sizes and dispatcher. `sequence_parallel` is Megatron's
    --sequence-parallel: turned off at TP 1 (as Megatron-LM's validate_args does), required with
    TP > 1 (the model is always MoE: Megatron-LM refuses MoE with TP and no sequence parallelism).
    Experts are never tensor-parallel here (Megatron's --expert-tensor-parallel-size 1)."""
    tp: int = 1
    pp: int = 1
    ep: int = 1
    dispatcher: str = "alltoall"  # Megatron's --moe-token-dispatcher-type
    sequence_parallel: bool = False  # Megatron's --sequence-parallel

    def __post_init__(self) -> None:
        if self.dispatcher not in ("alltoall", "allgather"):
            raise ValueError(
                f"moe token dispatcher {self.dispatcher!r} is not available on CPU; use alltoall or "
                f"allgather (flex needs DeepEP on GPUs)"
            )
        if type(self.tp) is int and self.tp == 1 and self.sequence_parallel:
            object.__setattr__(self, "sequence_parallel", False)  # Megatron-LM: no SP without TP
        if type(self.tp) is int and self.tp > 1 and not self.sequence_parallel:
            raise ValueError(
                f"--tensor-model-parallel-size {self.tp} without --sequence-parallel: When using MoE and tensor "
                f"parallelism, sequence parallelism must be used (Megatron-LM's rule); add --sequence-parallel"
            )


@dataclass(frozen=True)
class DataConfig:
    """Megatron's data and tokenizer flags. No data_path means mock data (--mock-data)."""

    data_path: tuple[str, ...] | None = None  # Megatron --data-path: prefixes, or weight/prefix pairs
    split: str = "969,30,1"  # Megatron's default train,valid,test proportions
    tokenizer_type: str | None = None
    tokenizer_model: str | None = None
    vocab_file: str | None = None
    merge_file: str | None = None
    vocab_size: int | None = None  # NullTokenizer's size before EOD (Megatron's --vocab-size)
    data_cache_path: str | None = None
    eod_mask_loss: bool = False

    def __post_init__(self) -> None:
        if self.data_path is not None:
            object.__setattr__(self, "data_path", tuple(self.data_path))
            if not self.data_path:
                raise ValueError("--data-path is empty: give one or more dataset prefixes, or use --mock-data")
            if self.tokenizer_type is None:
                raise ValueError(f"--data-path {' '.join(self.data_path)} needs --tokenizer-type "
                                 f"(one of {', '.join(TOKENIZER_TYPES)}) to know the EOD token and vocab size")


@dataclass
class TrainConfig:
    model: ModelConfig
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    micro_batch_size: int = 2
    global_batch_size: int = 8
    train_iters: int = 5
    lr: float = 1e-3
    min_lr: float = 1e-4
    lr_warmup_iters: int = 0
    weight_decay: float = 0.01
    clip_grad: float = 1.0
    seed: int = 1234
    use_distributed_optimizer: bool = False
    deterministic: bool = False
    emulate: "EmulationSpec | None" = None  # --emulate: time every task as on an emulated cluster
    log_interval: int = 1
    quiet: bool = False
    progress_bar: bool = False  # prefix iteration lines with a bar (the demo)
    tensorboard_dir: str | None = None  # Megatron's --tensorboard-dir: scalars from the first rank
    data: DataConfig = field(default_factory=DataConfig)  # no data_path: mock data (data.py)
    # Megatron's --check-for-nan-in-loss-and-grad: "stop" (its default), "skip" or "off" (training/nan_check.py).
    check_for_nan_in_loss_and_grad: str = "stop"
    # Megatron's --save/--load/--save-interval/--ckpt-step (checkpoint/); ckpt_reshard loads a
    # checkpoint of another layout by parameter name (--hetero-ckpt-reshard).
    save: str | None = None
    load: str | None = None
    save_interval: int | None = None
    ckpt_step: int | None = None
    ckpt_reshard: bool = False
    # Megatron's --bf16/--fp16: 16-bit parameters and activations, fp32 main parameters and
    # gradients. Loss scaling as Megatron's: --loss-scale (None: dynamic for fp16, none for
    # bf16), --initial-loss-scale, --min-loss-scale, --loss-scale-window, --hysteresis.
    bf16: bool = False
    fp16: bool = False
    loss_scale: float | None = None
    initial_loss_scale: float = 2.0**32
    min_loss_scale: float = 1.0
    loss_scale_window: float = 1000
    hysteresis: int = 2
    # Megatron's --transformer-impl (local / transformer_engine) and --moe-grouped-gemm, with its
    # meaning when given; None (not given): the kernels are chosen for the device
    # (models.builder.choose_kernels: TE, else the legacy grouped GEMM, else the local spec).
    transformer_impl: str | None = None
    moe_grouped_gemm: bool | None = None

    @property
    def precision(self) -> str:
        """"bf16", "fp16" or "fp32": the world's parameter and activation precision."""
        return "bf16" if self.bf16 else "fp16" if self.fp16 else "fp32"

    def nan_check_mode(self, pools: "PoolPrecision | None" = None) -> str:
        """check_for_nan_in_loss_and_grad as the trainers apply it: "off" under fp16 with a
        dynamic loss scale (on any pool of `pools`), where a non-finite gradient is the scaler's
        signal (Megatron-LM's validate_args turns the check off there too)."""
        dynamic = pools.dynamic_scale(self.loss_scale) if pools is not None else (self.fp16 and self.loss_scale is None)
        if dynamic:
            return "off"
        return self.check_for_nan_in_loss_and_grad

    def num_microbatches(self, dp: int) -> int:
        per = self.micro_batch_size * dp
        if self.global_batch_size % per:
            raise ValueError(
                f"global batch size {self.global_batch_size} is not divisible by micro batch size "
                f"{self.micro_batch_size} x data-parallel size {dp}; pick a multiple of {per}"
            )
        return self.global_batch_size // per


ISSUERS = ("auto", "single", "threads")


@dataclass(frozen=True)
class EmulationSpec:
    cluster: str  # configs/clusters/NAME.yaml or a path
    model: str  # the emulated model shape (e.g. d1), not the small model that really runs
    seq_len: int
    global_batch: int  # emulated sequences per step
    scale: float = 1.0  # real seconds per emulated second (the initial one with auto_scale)
    activation_checkpointing: bool = True  # the paper's setting; the cost model charges re-forward
    ranks: tuple[int, ...] | None = None  # cluster ranks this job's ranks stand for (None: all, in order)
    # Validity and automatic scale (module docstring).
    auto_scale: bool = False  # pick the scale from a calibration step
    calibrate_step: int = 1  # index (from the run's first step) of the calibration step; earlier steps warm up
    max_overrun: float = 0.03  # a run whose delay bound exceeds this fraction of the step is invalid
    target_overrun: float = 0.01  # what auto_scale aims for (a margin under max_overrun)
    work_margin: float = 1.5  # auto_scale plans for real work this much longer than measured
    max_step_seconds: float = 30.0  # auto_scale never stretches the predicted step beyond this
    calibration_duty: float = 0.25  # auto_scale: the calibration step's real work per rank, at most this of it

    def __post_init__(self) -> None:
        if self.scale <= 0 or self.seq_len <= 0 or self.global_batch <= 0:
            raise ValueError(f"emulation needs scale, seq_len, global_batch > 0; got {self.scale}, "
                             f"{self.seq_len}, {self.global_batch}")
        if not 0 < self.target_overrun <= self.max_overrun or self.calibrate_step < 0 or self.max_step_seconds <= 0:
            raise ValueError(f"emulation needs 0 < target_overrun <= max_overrun, calibrate_step >= 0, "
                             f"max_step_seconds > 0; got {self.target_overrun}, {self.max_overrun}, "
                             f"{self.calibrate_step}, {self.max_step_seconds}")



@dataclass(frozen=True)
class HeteroRunConfig:
    """How a HeterMoE run executes its plan: --hetero-schedule (None: the plan's),
    --recompute-granularity full (zebra recomputes attention stages in backward),
    --timeline-dir (each rank writes its timeline there) and --hetero-zebra-issuer."""
    schedule: str | None = None
    recompute: bool = False
    timeline_dir: str | None = None
    # --hetero-expert-precision: the expert ranks' precision; None: the world's (--bf16/--fp16,
    # which the attention ranks run). See PoolPrecision.
    expert_precision: str | None = None
    # --hetero-zebra-issuer: who issues zebra's transfers (schedules/issuer.py resolve_issuer).
    zebra_issuer: str = "auto"

    def __post_init__(self) -> None:
        if self.zebra_issuer not in ISSUERS:
            raise ValueError(f"--hetero-zebra-issuer {self.zebra_issuer!r} is unknown; use one of {list(ISSUERS)}")
        if self.expert_precision not in (None, "bf16", "fp16", "fp32"):
            raise ValueError(f"--hetero-expert-precision {self.expert_precision!r} is unknown; use bf16, fp16 or fp32")

    def pools(self, cfg: "TrainConfig") -> "PoolPrecision":
        """Each pool's precision: the attention ranks run the world's, the expert ranks this."""
        return PoolPrecision(cfg.precision, self.expert_precision or cfg.precision)


@dataclass(frozen=True)
class PoolPrecision:
    """The precision of each pool of a HeterMoE world: the attention ranks run the world's
    (--bf16/--fp16), the expert ranks --hetero-expert-precision (e.g. bf16 on A100 attention
    ranks, fp16 on V100 expert ranks, which have no native bf16).

    - Tokens cross roles in one wire dtype, the expert pool's: the attention ranks (the newer
      GPUs) cast at the boundary, both ways, and an attention rank's own experts (Asym-EA)
      receive and send in it too (parallel/comm.py TokenRoute).
    - With fp16 on either pool the world takes Megatron's fp16 loss scaling (dynamic from
      --initial-loss-scale unless --loss-scale): gradients cross in fp16 scaled, so the bf16
      pool's optimizer holds the same scale (training/step.py build_optimizer) and every rank
      skips the same steps (share_loss_scale).
    - Pools that differ are both 16-bit (training/validation.py check_pools)."""
    attention: str
    expert: str

    @property
    def mixed(self) -> bool:
        return self.attention != self.expert

    @property
    def wire(self) -> str:
        return self.expert

    def of(self, role: str) -> str:
        return self.attention if role == "attention" else self.expert

    def dynamic_scale(self, loss_scale: float | None) -> bool:
        """Whether the world's loss scale is dynamic (fp16 somewhere, no --loss-scale)."""
        return "fp16" in (self.attention, self.expert) and loss_scale is None
