"""Cost model: seconds and bytes of every piece of a HeterMoE step, for any model shape on any
profiled GPU type.

Compute time comes from FLOPs and bytes of the module, so it scales to any shape:
  * analytic profiles (datasheet peaks): roofline per module,
        t = max(FLOPs / (peak * efficiency), bytes / bandwidth) + kernels * launch overhead;
  * measured profiles: the achieved FLOP rate of the measured calls is interpolated (linearly
    in log tokens, then in log seq_len, clamped at the table's ends) and the target shape's
    FLOPs are divided by it. At the profiled shape and token counts this returns the measurement.
Backward counts 2x the forward GEMM FLOPs and 2.5x the attention-core FLOPs (flash-style backward
recomputes the scores); with activation checkpointing (the paper's setting) backward also
re-runs the forward.

FLOP counts (per token, forward; h hidden, f expert ffn, E experts, V vocab, s seq_len):
  attention projections + router: 8 h^2 + 2 h E
  causal attention core:          2 s h         (QK^T and PV, half of the square)
  one SwiGLU expert:              6 h f
  output head:                    2 h V
Model shapes whose numbers the paper does not give (ffn, heads) come from configs/models/.
"""
from __future__ import annotations

import bisect
import dataclasses
import math
from dataclasses import dataclass

from ..model_config import ModelConfig
from .profiles import GpuProfile, MeasuredTables

# Estimates (documented here once; the profile files carry the per-GPU numbers).
BYTES_PER_PARAM_STATE = 18.0  # estimate: fp16 weight 2 + fp32 main grad 4 + fp32 master 4 + Adam m, v 8
ELEMENTWISE_BYTES_PER_HIDDEN = 24.0  # estimate: norms, RoPE, residual, router softmax traffic per token per hidden unit
MEMBW_EFFICIENCY = 0.8  # estimate: fraction of datasheet bandwidth that streaming kernels reach
ATTN_KERNELS, EXPERT_KERNELS, HEAD_KERNELS = 14, 5, 4  # estimate: kernel launches per forward call
CORE_BWD_FACTOR = 2.5  # flash-style attention backward FLOPs / forward FLOPs
OPTIMIZER_BYTES_PER_PARAM = 40.0  # estimate: Adam reads/writes master, m, v, grad, weight


def attention_linear_flops(m: ModelConfig, tokens: float) -> float:
    h = m.hidden_size
    return tokens * (8.0 * h * h + 2.0 * h * m.num_experts)


def attention_core_flops(m: ModelConfig, tokens: float, seq_len: int) -> float:
    return tokens * 2.0 * seq_len * m.hidden_size


def expert_flops(m: ModelConfig, tokens: float) -> float:
    return tokens * 6.0 * m.hidden_size * m.moe_ffn_hidden_size


def head_flops(m: ModelConfig, tokens: float) -> float:
    return tokens * 2.0 * m.hidden_size * m.vocab_size


def mixtral_8x7b_attention_shape() -> ModelConfig:
    """The layer shape the paper's speed ratios were measured on (PAPER.md "Why"); MHA here,
    as our models are (Mixtral itself uses 8 KV heads: its K/V projections are 4x smaller)."""
    return ModelConfig(name="mixtral-8x7b-layer", num_layers=1, hidden_size=4096, num_attention_heads=32,
                       ffn_hidden_size=14336, moe_ffn_hidden_size=14336, num_experts=8)


# ---------------------------------------------------------------- analytic roofline pieces
def _roofline(p: GpuProfile, flops: float, nbytes: float, efficiency: float, kernels: int) -> float:
    if efficiency <= 0 or p.peak_fp16_tflops <= 0:
        raise ValueError(f"GPU profile {p.name!r}: efficiency {efficiency} or peak {p.peak_fp16_tflops} "
                         f"is 0; fix configs/gpus/ for this type")
    t_flop = flops / (p.peak_fp16_tflops * 1e12 * efficiency)
    t_mem = nbytes / (p.memory_bandwidth_gbs * 1e9 * MEMBW_EFFICIENCY)
    return max(t_flop, t_mem) + kernels * p.launch_overhead_us * 1e-6


def _analytic_attention(p: GpuProfile, m: ModelConfig, tokens: float, seq_len: int, backward: bool) -> float:
    h = m.hidden_size
    mult = 2.0 if backward else 1.0
    lin_bytes = (4 * h * h + h * m.num_experts) * 2.0 + tokens * h * 2.0 * 6
    lin = _roofline(p, mult * attention_linear_flops(m, tokens), mult * lin_bytes, p.gemm_efficiency,
                    int(ATTN_KERNELS * mult) // 2)
    core_mult = CORE_BWD_FACTOR if backward else 1.0
    core = _roofline(p, core_mult * attention_core_flops(m, tokens, seq_len), mult * tokens * h * 2.0 * 4,
                     p.attention_core_efficiency, int(ATTN_KERNELS * mult) // 2)
    elem = mult * tokens * h * ELEMENTWISE_BYTES_PER_HIDDEN / (p.memory_bandwidth_gbs * 1e9 * MEMBW_EFFICIENCY)
    return lin + core + elem


def _analytic_expert(p: GpuProfile, m: ModelConfig, tokens: float, backward: bool) -> float:
    h, f = m.hidden_size, m.moe_ffn_hidden_size
    mult = 2.0 if backward else 1.0
    nbytes = mult * (3.0 * h * f * 2.0 + tokens * (2.0 * h + 3.0 * f) * 2.0)
    return _roofline(p, mult * expert_flops(m, tokens), nbytes, p.gemm_efficiency, int(EXPERT_KERNELS * mult))


# ---------------------------------------------------------------- measured-table interpolation
def _interp_log(xs: list[float], ys: list[float], x: float) -> float:
    """Piecewise-linear in log x, clamped to the end values."""
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    i = bisect.bisect_right(xs, x)
    x0, x1 = math.log(xs[i - 1]), math.log(xs[i])
    w = (math.log(x) - x0) / (x1 - x0)
    return ys[i - 1] * (1 - w) + ys[i] * w


_RATES: dict[int, tuple] = {}


def _measured_rates(tables: MeasuredTables) -> tuple:
    """Achieved FLOP rates of the measured calls: attention per seq_len, and expert."""
    hit = _RATES.get(id(tables))
    if hit is not None and hit[0] is tables:
        return hit[1]
    m0 = ModelConfig(**tables.model)
    att: dict[int, list[tuple[int, float, float]]] = {}
    for a in tables.attention:
        f = attention_linear_flops(m0, a.tokens) + attention_core_flops(m0, a.tokens, a.seq_len)
        fb = 2 * attention_linear_flops(m0, a.tokens) + CORE_BWD_FACTOR * attention_core_flops(m0, a.tokens, a.seq_len)
        att.setdefault(a.seq_len, []).append((a.tokens, f / a.fwd_s, fb / a.bwd_s))
    att_rows = tuple((s, tuple(sorted(v))) for s, v in sorted(att.items()))
    exp = tuple(sorted((e.tokens, expert_flops(m0, e.tokens) / e.fwd_s, 2 * expert_flops(m0, e.tokens) / e.bwd_s)
                       for e in tables.expert))
    _RATES[id(tables)] = (tables, (att_rows, exp))  # keeps `tables` alive, so the id stays unique
    return att_rows, exp


def _measured_attention(t: MeasuredTables, m: ModelConfig, tokens: float, seq_len: int, backward: bool) -> float:
    att_rows, _ = _measured_rates(t)
    col = 2 if backward else 1
    seqs = [s for s, _ in att_rows]
    rates = [_interp_log([r[0] for r in rows], [r[col] for r in rows], tokens) for _, rows in att_rows]
    rate = _interp_log(seqs, rates, seq_len) if len(seqs) > 1 else rates[0]
    lin = attention_linear_flops(m, tokens)
    core = attention_core_flops(m, tokens, seq_len)
    f = (2 * lin + CORE_BWD_FACTOR * core) if backward else (lin + core)
    return f / rate


def _measured_expert(t: MeasuredTables, m: ModelConfig, tokens: float, backward: bool) -> float:
    _, exp = _measured_rates(t)
    col = 2 if backward else 1
    rate = _interp_log([e[0] for e in exp], [e[col] for e in exp], tokens)
    return (2.0 if backward else 1.0) * expert_flops(m, tokens) / rate


# ---------------------------------------------------------------- the model
@dataclass(frozen=True)
class TrainSettings:
    """What besides the model shape changes the cost of a step."""

    seq_len: int
    activation_checkpointing: bool = True  # the paper's setting: backward re-runs the forward
    dtype_bytes: int = 2  # fp16/bf16 activations on the wire and in checkpoints


class CostModel:
    """Times and memory for one model shape over a set of GPU profiles.

    All times are seconds of one call on one GPU; "tokens" are tokens that call processes.
    """

    def __init__(self, model: ModelConfig, profiles: dict[str, GpuProfile], settings: TrainSettings):
        self.model = model
        self.profiles = profiles
        self.settings = settings
        self._memo: dict[tuple, float] = {}  # the search asks the same few calls many times

    def profile(self, gpu: str) -> GpuProfile:
        try:
            return self.profiles[gpu]
        except KeyError:
            raise KeyError(f"no profile loaded for GPU type {gpu!r}; loaded: {sorted(self.profiles)}") from None

    # ---- compute -------------------------------------------------------------------------
    def attention_time(self, gpu: str, tokens: float, backward: bool = False, seq_len: int | None = None) -> float:
        """Attention + router of one layer (norm, QKV, core, output projection, gate)."""
        if tokens <= 0:
            return 0.0
        s = seq_len or self.settings.seq_len
        p = self.profile(gpu)
        if p.measured is not None:
            t = _measured_attention(p.measured, self.model, tokens, s, backward)
            h = self.model.hidden_size
            t += (2 if backward else 1) * tokens * h * ELEMENTWISE_BYTES_PER_HIDDEN / (p.memory_bandwidth_gbs * 1e9 * MEMBW_EFFICIENCY)
        else:
            t = _analytic_attention(p, self.model, tokens, s, backward)
        if backward and self.settings.activation_checkpointing:
            t += self.attention_time(gpu, tokens, False, s)
        return t

    def expert_time(self, gpu: str, tokens: float, backward: bool = False) -> float:
        """One expert FFN (SwiGLU) on `tokens` routed tokens."""
        if tokens <= 0:
            return 0.0
        key = ("expert", gpu, tokens, backward)
        if key not in self._memo:
            self._memo[key] = self._expert_time(gpu, tokens, backward)
        return self._memo[key]

    def _expert_time(self, gpu: str, tokens: float, backward: bool) -> float:
        p = self.profile(gpu)
        if p.measured is not None:
            t = _measured_expert(p.measured, self.model, tokens, backward)
        else:
            t = _analytic_expert(p, self.model, tokens, backward)
        if backward and self.settings.activation_checkpointing:
            t += self.expert_time(gpu, tokens, False)
        return t

    def head_time(self, gpu: str, tokens: float, backward: bool = False) -> float:
        """Final norm + output projection + cross-entropy loss."""
        if tokens <= 0:
            return 0.0
        p = self.profile(gpu)
        m = self.model
        mult = 2.0 if backward else 1.0
        loss_bytes = mult * tokens * m.vocab_size * 4.0 * 3  # fp32 logits: write, softmax read/write
        if p.measured is not None:
            # the head is a GEMM: use the measured expert GEMM rate at the same token count
            _, exp = _measured_rates(p.measured)
            rate = _interp_log([e[0] for e in exp], [e[2 if backward else 1] for e in exp], tokens)
            t = mult * head_flops(m, tokens) / rate
        else:
            t = _roofline(p, mult * head_flops(m, tokens), mult * m.vocab_size * m.hidden_size * 2.0,
                          p.gemm_efficiency, int(HEAD_KERNELS * mult))
        t += loss_bytes / (p.memory_bandwidth_gbs * 1e9 * MEMBW_EFFICIENCY)
        if backward and self.settings.activation_checkpointing:
            t += self.head_time(gpu, tokens, False)
        return t

    def elementwise_time(self, gpu: str, nbytes: float) -> float:
        p = self.profile(gpu)
        return nbytes / (p.memory_bandwidth_gbs * 1e9 * MEMBW_EFFICIENCY)

    def stage_time(self, gpu: str, stage: int, tokens: float, backward: bool = False) -> float:
        """Attention stage s of the zebra task list (0..L): s=0 embedding + attention_1 + router_1;
        0<s<L combine of layer s-1 + residual + attention + router; s=L last combine + head + loss."""
        L = self.model.num_layers
        key = ("stage", gpu, 0 if stage == 0 else (2 if stage == L else 1), tokens, backward) if 0 <= stage <= L else None
        if key is not None and key in self._memo:
            return self._memo[key]
        t = self._stage_time(gpu, stage, tokens, backward)
        if key is not None:
            self._memo[key] = t
        return t

    def _stage_time(self, gpu: str, stage: int, tokens: float, backward: bool) -> float:
        m = self.model
        L = m.num_layers
        if not 0 <= stage <= L:
            raise ValueError(f"stage {stage} outside 0..{L} for a {L}-layer model")
        mult = 2.0 if backward else 1.0
        h, k, b = m.hidden_size, m.moe_router_topk, self.settings.dtype_bytes
        combine = self.elementwise_time(gpu, mult * tokens * h * b * (k + 2)) if stage > 0 else 0.0
        if stage == 0:
            embed = self.elementwise_time(gpu, mult * tokens * h * b * 2)
            return embed + self.attention_time(gpu, tokens, backward)
        if stage == L:
            return combine + self.head_time(gpu, tokens, backward)
        return combine + self.attention_time(gpu, tokens, backward)

    def optimizer_time(self, gpu: str, params: float) -> float:
        return self.elementwise_time(gpu, params * OPTIMIZER_BYTES_PER_PARAM)

    # ---- communication payloads ----------------------------------------------------------
    def token_bytes(self) -> int:
        """Bytes of one token's hidden state on the wire."""
        return self.model.hidden_size * self.settings.dtype_bytes

    # ---- memory --------------------------------------------------------------------------
    def expert_state_bytes(self) -> float:
        return self.model.expert_params() * BYTES_PER_PARAM_STATE

    def non_expert_state_bytes(self) -> float:
        return self.model.non_expert_params() * BYTES_PER_PARAM_STATE

    def attention_rank_bytes(self, tokens_mb: float, microbatches_alive: int) -> float:
        """An attention rank without offloaded experts: non-expert weights and optimizer state,
        plus activations. With checkpointing: each stage's input for every live microbatch,
        one stage's working set and the fp32 logits; without: ~34 h bytes per token per layer
        (flash attention; Korthikanti et al. 2022; an estimate)."""
        m, b = self.model, self.settings.dtype_bytes
        h, L = m.hidden_size, m.num_layers
        logits = tokens_mb * m.vocab_size * 4.0  # estimate: fp16 logits + their fp16 gradient
        if self.settings.activation_checkpointing:
            kept = (L + 1) * tokens_mb * h * b * microbatches_alive
            working = tokens_mb * h * b * 20
        else:
            kept = L * tokens_mb * h * 34.0 * microbatches_alive
            working = 0.0
        return self.non_expert_state_bytes() + kept + working + logits

    def per_expert_bytes(self, tokens_per_expert_mb: float, microbatches_alive: int) -> float:
        """What each held expert adds on any rank: its weights and optimizer state and the routed
        tokens it keeps for backward (checkpointed input; without checkpointing also its SwiGLU
        intermediates)."""
        m, b = self.model, self.settings.dtype_bytes
        per_token = m.hidden_size * b
        if not self.settings.activation_checkpointing:
            per_token += 3 * m.moe_ffn_hidden_size * b
        return self.expert_state_bytes() + tokens_per_expert_mb * per_token * microbatches_alive

    def expert_working_bytes(self, tokens_per_expert_mb: float) -> float:
        """Transient working set of the expert being computed (SwiGLU intermediates, grads)."""
        return tokens_per_expert_mb * self.model.moe_ffn_hidden_size * self.settings.dtype_bytes * 4


# ---------------------------------------------------------------- ratio calibration
def calibrate_gemm_efficiency(prof: GpuProfile, ref: GpuProfile, time_ratio: float) -> float:
    """Efficiency of `prof` such that large expert GEMMs take `time_ratio` x the time on `ref`
    (compute-bound limit, where the paper's "V100 at 80% of A40" was measured)."""
    return ref.peak_fp16_tflops * ref.gemm_efficiency / (prof.peak_fp16_tflops * time_ratio)


def calibrate_attention_efficiency(prof: GpuProfile, ref: GpuProfile, time_ratio: float, seq_len: int) -> float:
    """Attention-core efficiency of `prof` such that one Mixtral-shaped attention layer on one
    sequence of `seq_len` (forward + backward) takes `time_ratio` x the time on `ref`."""
    m = mixtral_8x7b_attention_shape()

    def t(p: GpuProfile) -> float:
        return _analytic_attention(p, m, seq_len, seq_len, False) + _analytic_attention(p, m, seq_len, seq_len, True)

    target = time_ratio * t(ref)
    lo, hi = 1e-4, 1.0
    if t(dataclasses.replace(prof, attention_core_efficiency=hi)) > target:
        raise ValueError(f"{prof.name}: attention time ratio {time_ratio} vs {ref.name} at seq {seq_len} is "
                         f"unreachable even at 100% core efficiency; check gemm_efficiency and the ratio")
    for _ in range(80):  # bisection: time falls as efficiency rises
        mid = math.sqrt(lo * hi)
        if t(dataclasses.replace(prof, attention_core_efficiency=mid)) > target:
            lo = mid
        else:
            hi = mid
    return hi


def attention_time_ratio(slow: GpuProfile, fast: GpuProfile, seq_len: int) -> float:
    """time(slow)/time(fast) of one Mixtral-shaped attention layer fwd+bwd on one sequence."""
    m = mixtral_8x7b_attention_shape()
    f = lambda p: _analytic_attention(p, m, seq_len, seq_len, False) + _analytic_attention(p, m, seq_len, seq_len, True)
    return f(slow) / f(fast)
