"""GPU profile data types: what the planner knows about one GPU type (GpuProfile, with the
`hetermoe profile` tables in MeasuredTables and their samples), what a measured link between two
ranks is (LinkProfile), and the error a bad profile raises (ProfileError).

Types only: this module imports nothing from the planner. profiles.py reads them from YAML
(configs/gpus/*.yaml) and resolves speed ratios; cost_model.py prices a program with them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from megatron_hetermoe.errors import UserError


class ProfileError(UserError, ValueError):
    """A profile that cannot be used; the message names the bad value and the fix."""


@dataclass(frozen=True)
class AttentionSample:
    """One measured attention(+router) call: `tokens` tokens in sequences of `seq_len`."""

    seq_len: int
    tokens: int
    fwd_s: float
    bwd_s: float


@dataclass(frozen=True)
class ExpertSample:
    """One measured expert FFN call on `tokens` tokens."""

    tokens: int
    fwd_s: float
    bwd_s: float


@dataclass(frozen=True)
class CommSample:
    """One measured all_to_all: `nbytes` sent per rank took `seconds`."""

    nbytes: int
    seconds: float


@dataclass(frozen=True)
class MeasuredTables:
    """What `hetermoe profile` measured, for the model shape in `model` (a ModelConfig dict)."""

    model: dict
    attention: tuple[AttentionSample, ...]
    expert: tuple[ExpertSample, ...]
    all_to_all: tuple[CommSample, ...] = ()
    info: dict = field(default_factory=dict)  # device name, software versions, date, memory findings

    @property
    def program(self) -> dict:
        """The program the tables time: info.program as `hetermoe profile` records it (older
        files: their dtype, and megatron-core's local spec, i.e. unfused attention)."""
        p = self.info.get("program")
        if isinstance(p, dict) and {"precision", "attention"} <= set(p):
            return {"precision": str(p["precision"]), "attention": str(p["attention"])}
        return {"precision": str(self.info.get("dtype", "fp32")), "attention": "unfused"}


@dataclass(frozen=True)
class GpuProfile:
    name: str
    memory_gib: float
    fp16: bool
    bf16: bool  # native bf16 (Ampere+); false on V100/T4, where the trainers refuse --bf16
    peak_fp16_tflops: float  # dense tensor-core FP16 (FP32 accumulate)
    memory_bandwidth_gbs: float
    gemm_efficiency: float  # fraction of peak that large expert / projection GEMMs reach
    attention_core_efficiency: float  # fraction of peak for softmax(QK^T)V (flash or not)
    flash_attention: bool
    launch_overhead_us: float  # per kernel launch, added per module call
    intra_node_gbs: float  # per-GPU bandwidth to a GPU in the same node (each direction)
    link_latency_us: float  # fixed cost of one collective
    usable_memory_fraction: float  # of memory_gib, after the CUDA context and fragmentation
    sources: dict[str, str] = field(default_factory=dict)  # field name -> source string
    measured: MeasuredTables | None = None
    peak_fp32_tflops: float = 0.0  # dense FP32 (no tensor cores); 0: not given (fp32 programs cannot be priced)
    # A regular expression torch.cuda.get_device_name() of this type matches (case-insensitive);
    # None: the name's first part ("V100" of "V100-16GB") as a word, and memory_gib within 20 %.
    device_name: str | None = None

    def source(self, name: str) -> str:
        return self.sources.get(name, "unknown")

    @property
    def usable_memory_bytes(self) -> float:
        return self.memory_gib * 2**30 * self.usable_memory_fraction


@dataclass(frozen=True)
class LinkProfile:
    """What `hetermoe profile --gpu-pair` measured between two ranks: the transfer model's
    link_latency_us and intra_node_gbs (same {value, source} form as a GPU profile), the devices
    and backend (gloo between CPU processes is said so in every source), the precision of the
    messages, and the all-to-all times they were fitted to."""

    devices: tuple[str, str]
    backend: str
    precision: str
    link_latency_us: float
    intra_node_gbs: float
    sources: dict[str, str]
    all_to_all: tuple[dict, ...]
    note: str = ""

    @property
    def is_cpu(self) -> bool:
        return self.backend == "gloo"
