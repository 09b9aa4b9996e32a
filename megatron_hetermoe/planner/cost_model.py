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
  attention projections + router: 8 h^2 + 2 h E (a dense layer has no router: 8 h^2)
  causal attention core:          2 s h         (QK^T and PV, half of the square)
  one SwiGLU expert:              6 h f
  output head:                    2 h V
Model shapes whose numbers the paper does not give (ffn, heads) come from configs/models/.

Dense layers and shared experts (Megatron's --moe-layer-freq, --moe-shared-expert-intermediate-size)
run on the attention ranks, inside attention stages (models/stages.py), so `stage_time` prices them:
  * a dense layer (attention without router + a SwiGLU MLP of ffn_hidden_size F, 6 h F per token)
    runs in the stage that reaches it: before MoE layer k's attention in stage k, after the last
    MoE layer in stage L (before the head);
  * MoE layer l's shared expert (a SwiGLU MLP of the shared size S, 6 h S per token, every token)
    runs in stage l, next to the router, before the dispatch.
Both are priced as the experts are (the same roofline, the same measured GEMM rate), forward and
backward (2x, plus the re-forward under activation checkpointing). Routed experts follow their
own level, TrainSettings.expert_recompute (EXPERT_RECOMPUTE: what an expert holder keeps for
backward, and whether its backward re-runs the forward).

Tensor parallelism on attention members (plan.attention_tp t, Megatron's --tensor-model-parallel-size
with --sequence-parallel): a TP rank's tokens are its sequence slice (member tokens / t); its stage
time is the stage on the slice plus the stage's TP collectives (tp_comm_time: all-gather/reduce-
scatter of the slice on the GPU profile's intra_node_gbs, forward and backward, again in the re-run
forward under checkpointing); its non-expert weights and state are split t ways but for norms and
routers (non_expert_params_per_rank). TrainSettings.distributed_optimizer prices Megatron's
--use-distributed-optimizer (state_bytes_per_param: 6 + 12/d bytes per parameter).

Context parallelism on attention members (plan.attention_cp c, Megatron's --context-parallel-size;
a member is t x c ranks): each CP rank holds 2 of the sequence's 2c chunks (Megatron's load-balanced
split), so a rank's tokens are member tokens / (t c) and the linear parts, the elementwise work and
the rank's queries' share of the causal attention core (each query still meets seq_len / 2 keys on
average: 1/c of the core) are the stage on those tokens, as under TP. Each attention layer adds
its K/V exchange over the CP group (cp_comm_time, not overlapped): forward one all-gather of the
other c - 1 ranks' keys and values (kv_width channels of each of their tokens), backward one
reduce-scatter of their gradients, and under activation checkpointing one all-gather more in the
re-run forward, on the GPU profile's intra_node_gbs (a member sits in one node, as a TP member
does). Dense weights are replicated over the CP group (Megatron's rule: CP splits activations
only), their gradients all-reduced and, with the distributed optimizer, sharded over data x
context parallel ranks; the gathered K/V are held by the layer being computed (with
checkpointing: the recomputed stage's attention layers; without: every layer of every live
microbatch, saved for the core's backward): cp_gathered_bytes.

Which program is priced (`Program`): precision, attention kernel and recomputation change a
step's cost, so a time is always for one program. `TrainSettings.program=None` prices each
GPU type as its profile describes it (`program_of`): analytic profiles the paper's program (fp16
mixed precision on tensor cores, fused attention: FlashAttention-2 where the GPU has it,
memory-efficient attention elsewhere), measured profiles the program `hetermoe profile` ran. A
given program is priced on every GPU type or refused (ProgramError): fp32 uses the profile's
`peak_fp32_tflops` with the same efficiencies (an estimate), 'unfused' attention computes the
full score matrix with GEMM efficiency and moves it through memory (an estimate); a measured
profile prices only the program it measured. `runtime_program()` is what this package's
trainers run (fp32, unfused attention: megatron-core's local spec), so a report can say which
program a prediction is for and which one ran.
"""
from __future__ import annotations

import bisect
import dataclasses
import math
from dataclasses import dataclass

from megatron_hetermoe.config import ModelConfig
from megatron_hetermoe.errors import UserError
from megatron_hetermoe.plan.hetero_plan import EXPERT_RECOMPUTE  # noqa: F401 - the levels, one list
from megatron_hetermoe.planner.gpu_profile import GpuProfile, MeasuredTables

# Estimates (documented here once; the profile files carry the per-GPU numbers).
BYTES_PER_PARAM_STATE = 18.0  # estimate: fp16 weight 2 + fp32 main grad 4 + fp32 master 4 + Adam m, v 8
BYTES_PER_PARAM_STATE_FP32 = 16.0  # fp32 weight 4 + fp32 main grad 4 + Adam m, v 8 (no master copy)
# estimate: unfused attention writes the scores, softmax reads and writes them, PV reads them
UNFUSED_SCORE_PASSES = 4.0
ELEMENTWISE_BYTES_PER_HIDDEN = 24.0  # estimate: norms, RoPE, residual, router softmax traffic per token per hidden unit
MEMBW_EFFICIENCY = 0.8  # estimate: fraction of datasheet bandwidth that streaming kernels reach
ATTN_KERNELS, EXPERT_KERNELS, HEAD_KERNELS = 14, 5, 4  # estimate: kernel launches per forward call
CORE_BWD_FACTOR = 2.5  # flash-style attention backward FLOPs / forward FLOPs
OPTIMIZER_BYTES_PER_PARAM = 40.0  # estimate: Adam reads/writes master, m, v, grad, weight


def attention_linear_flops(m: ModelConfig, tokens: float, router: bool = True) -> float:
    """The attention's projections as megatron-core builds them (ModelConfig.attention_linear_shapes:
    QKV with its GQA groups and output gate, or MLA's down/up projections; the output projection),
    and the router GEMM of an MoE layer (`router=False`: a dense layer); 2 FLOPs per MAC."""
    return tokens * 2.0 * (m.attention_linear_weights() + (m.hidden_size * m.num_experts if router else 0.0))


def attention_core_flops(m: ModelConfig, tokens: float, seq_len: int, full: bool = False) -> float:
    """QK^T and PV of causal attention: a query meets seq_len / 2 keys on average, each costing
    qk_channels + v_channels MACs per head; sliding windows scale it by ModelConfig.window_fraction
    (`full`: the whole causal square, as an unfused kernel computes it whatever the mask)."""
    frac = 1.0 if full else m.window_fraction(seq_len)
    return tokens * seq_len * m.num_attention_heads * (m.qk_channels + m.v_channels) * frac


def mlp_flops(hidden: int, ffn: int, tokens: float, gated: bool = True) -> float:
    """One MLP: fc1 (h -> 2 ffn gate and up when gated: SwiGLU, GeGLU; else h -> ffn) and fc2
    (ffn -> h), 2 FLOPs per MAC."""
    return tokens * 2.0 * hidden * ffn * (3.0 if gated else 2.0)


def expert_flops(m: ModelConfig, tokens: float) -> float:
    return mlp_flops(m.hidden_size, m.moe_ffn_hidden_size, tokens, m.activation.gated)


def head_flops(m: ModelConfig, tokens: float) -> float:
    return tokens * 2.0 * m.hidden_size * m.vocab_size


def mixtral_8x7b_attention_shape() -> ModelConfig:
    """The layer shape the paper's speed ratios were measured on (PAPER.md "Why"); MHA here,
    as our models are (Mixtral itself uses 8 KV heads: its K/V projections are 4x smaller)."""
    return ModelConfig(name="mixtral-8x7b-layer", num_layers=1, hidden_size=4096, num_attention_heads=32,
                       ffn_hidden_size=14336, moe_ffn_hidden_size=14336, num_experts=8)


# ---------------------------------------------------------------- the program being priced
PRECISIONS = ("fp16", "bf16", "fp32")
ATTENTION_KERNELS = ("fused", "unfused")
RECOMPUTE = ("full", "none")


class ProgramError(UserError, ValueError):
    """A program a profile cannot price; the message names the profile, the difference and the fix."""


@dataclass(frozen=True)
class Program:
    """What a training step runs besides the model shape, as far as it changes the step's cost.
    The cost model prices one, a runtime runs one; reports name both.
      precision  'fp16' / 'bf16': mixed precision (16-bit GEMMs on tensor cores, fp32 master
                 weights); 'fp32': fp32 throughout
      attention  'fused': FlashAttention-2 where the GPU has it, memory-efficient attention
                 (xformers) elsewhere, as the paper ran; 'unfused': the score matrix is
                 materialized (megatron-core's local spec, DotProductAttention)
      recompute  'full': activation checkpointing (backward re-runs the forward); 'none'
    """

    precision: str = "fp16"
    attention: str = "fused"
    recompute: str = "full"

    def __post_init__(self) -> None:
        for name, v, ok in (("precision", self.precision, PRECISIONS), ("attention", self.attention, ATTENTION_KERNELS),
                            ("recompute", self.recompute, RECOMPUTE)):
            if v not in ok:
                raise ProgramError(f"program {name}={v!r}; use one of {ok}")

    @property
    def dtype_bytes(self) -> int:
        return 4 if self.precision == "fp32" else 2

    @property
    def activation_checkpointing(self) -> bool:
        return self.recompute == "full"

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def describe(self) -> str:
        prec = {"fp16": "fp16 mixed precision (tensor cores)", "bf16": "bf16 mixed precision (tensor cores)",
                "fp32": "fp32"}[self.precision]
        att = {"fused": "fused attention (FlashAttention-2, or memory-efficient where the GPU has no flash)",
               "unfused": "unfused attention (scores materialized)"}[self.attention]
        rec = {"full": "activation recompute", "none": "no recompute"}[self.recompute]
        return f"{prec}, {att}, {rec}"


PAPER_PROGRAM = Program("fp16", "fused", "full")  # what the paper ran and the GPU profiles describe


def runtime_program(recompute: bool = False) -> Program:
    """The program this package's trainers run by default (without --bf16/--fp16; emulated runs
    are fp32 only), on CPU and GPU alike: models/builder.py's
    TransformerConfig has fp32 parameters and activations and megatron-core's local layer spec
    (unfused DotProductAttention); trainer.build_optimizer is fp32 Adam; activations are
    recomputed only by zebra's --recompute-granularity full (per attention stage)."""
    return Program("fp32", "unfused", "full" if recompute else "none")


def priced_profile(p: GpuProfile, program: Program) -> GpuProfile:
    """The profile as the cost model uses it for `program`, or ProgramError if it cannot price it."""
    if p.measured is not None:
        mp = p.measured.program
        if (mp["precision"], mp["attention"]) != (program.precision, program.attention):
            raise ProgramError(
                f"GPU profile {p.name!r} has measured tables for {mp['precision']} with {mp['attention']} attention, "
                f"but the program is {program.precision} with {program.attention} attention; re-profile that "
                f"program (hetermoe profile --dtype {program.precision}) or price the profile's own program")
        return p
    if program.precision == "bf16" and not p.bf16:
        raise ProgramError(f"GPU profile {p.name!r} has no bf16 (bf16: false); use fp16 or fp32 on it")
    if program.precision == "fp32":
        if p.peak_fp32_tflops <= 0:
            raise ProgramError(f"GPU profile {p.name!r} gives no peak_fp32_tflops; add it "
                               f"({{value, source: 'datasheet: ...'}}) to price an fp32 program")
        p = dataclasses.replace(p, peak_fp16_tflops=p.peak_fp32_tflops)
    return p


# ---------------------------------------------------------------- analytic roofline pieces
def _roofline(p: GpuProfile, flops: float, nbytes: float, efficiency: float, kernels: int) -> float:
    if efficiency <= 0 or p.peak_fp16_tflops <= 0:
        raise ValueError(f"GPU profile {p.name!r}: efficiency {efficiency} or peak {p.peak_fp16_tflops} "
                         f"is 0; fix configs/gpus/ for this type")
    t_flop = flops / (p.peak_fp16_tflops * 1e12 * efficiency)
    t_mem = nbytes / (p.memory_bandwidth_gbs * 1e9 * MEMBW_EFFICIENCY)
    return max(t_flop, t_mem) + kernels * p.launch_overhead_us * 1e-6


def _analytic_attention(p: GpuProfile, m: ModelConfig, tokens: float, seq_len: int, backward: bool,
                        program: Program | None = None, router: bool = True) -> float:
    h = m.hidden_size
    b = program.dtype_bytes if program is not None else 2
    mult = 2.0 if backward else 1.0
    lin_bytes = (m.attention_linear_weights() + (h * m.num_experts if router else 0)) * b + tokens * h * b * 6
    lin = _roofline(p, mult * attention_linear_flops(m, tokens, router), mult * lin_bytes, p.gemm_efficiency,
                    int(ATTN_KERNELS * mult) // 2)
    if program is not None and program.attention == "unfused":
        # the full score matrix (the mask, a window's too, is applied after), as batched GEMMs, through memory
        scores = tokens * seq_len * m.num_attention_heads * b
        core = _roofline(p, mult * 2.0 * attention_core_flops(m, tokens, seq_len, full=True),
                         mult * (UNFUSED_SCORE_PASSES * scores + tokens * h * b * 4), p.gemm_efficiency,
                         int(ATTN_KERNELS * mult) // 2)
    else:
        core_mult = CORE_BWD_FACTOR if backward else 1.0
        core = _roofline(p, core_mult * attention_core_flops(m, tokens, seq_len), mult * tokens * h * b * 4,
                         p.attention_core_efficiency, int(ATTN_KERNELS * mult) // 2)
    elem = mult * tokens * h * ELEMENTWISE_BYTES_PER_HIDDEN * b / 2 / (p.memory_bandwidth_gbs * 1e9 * MEMBW_EFFICIENCY)
    return lin + core + elem


def _analytic_mlp(p: GpuProfile, h: int, f: int, tokens: float, backward: bool, dtype_bytes: int = 2,
                  gated: bool = True) -> float:
    """One MLP (an expert, a dense layer's MLP or a shared expert): weights, input, output and the
    f-wide intermediates (three gated: gate, up and their product; else two) through memory."""
    mult = 2.0 if backward else 1.0
    w = 3.0 if gated else 2.0
    nbytes = mult * (w * h * f + tokens * (2.0 * h + w * f)) * dtype_bytes
    return _roofline(p, mult * mlp_flops(h, f, tokens, gated), nbytes, p.gemm_efficiency, int(EXPERT_KERNELS * mult))


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


def _measured_attention(t: MeasuredTables, m: ModelConfig, tokens: float, seq_len: int, backward: bool,
                        router: bool = True) -> float:
    att_rows, _ = _measured_rates(t)
    col = 2 if backward else 1
    seqs = [s for s, _ in att_rows]
    rates = [_interp_log([r[0] for r in rows], [r[col] for r in rows], tokens) for _, rows in att_rows]
    rate = _interp_log(seqs, rates, seq_len) if len(seqs) > 1 else rates[0]
    lin = attention_linear_flops(m, tokens, router)
    core = attention_core_flops(m, tokens, seq_len)
    f = (2 * lin + CORE_BWD_FACTOR * core) if backward else (lin + core)
    return f / rate


def _measured_mlp(t: MeasuredTables, h: int, f: int, tokens: float, backward: bool, gated: bool = True) -> float:
    """An MLP of any width at the measured expert GEMMs' achieved FLOP rate (at `tokens`)."""
    _, exp = _measured_rates(t)
    col = 2 if backward else 1
    rate = _interp_log([e[0] for e in exp], [e[col] for e in exp], tokens)
    return (2.0 if backward else 1.0) * mlp_flops(h, f, tokens, gated) / rate


# ---------------------------------------------------------------- expert recomputation
# What an expert holder keeps for an expert's backward, per routed token of each live microbatch
# (zebra keeps all R alive), cheapest in time first:
#   'off'           input and the SwiGLU intermediates (fc1's 2f outputs, the f-wide product):
#                   (h + 3f) x dtype bytes; backward = 2x the forward GEMMs.
#   'keep-inputs'   the input only (h x dtype bytes); backward re-runs the expert forward.
#   'resend-inputs' nothing: the attention ranks keep the dispatched tokens (k x h x dtype bytes
#                   per token per MoE layer) and send them again with the output gradient (C_B
#                   carries twice the bytes); backward re-runs the expert forward. An expert
#                   rank's memory then no longer grows with the batch, as under Megatron's full
#                   recompute, where a layer's recomputation re-dispatches its tokens.


def default_expert_recompute(activation_checkpointing: bool) -> str:
    """The level a plain TrainSettings prices: with activation checkpointing experts re-run their
    forward and keep their inputs (the planner's rule before the levels existed), else 'off'."""
    return "keep-inputs" if activation_checkpointing else "off"


def heavier_expert_recompute(level: str) -> tuple[str, ...]:
    """`level` and every level that keeps less on expert holders, in the order the search tries them."""
    if level not in EXPERT_RECOMPUTE:
        raise ValueError(f"expert recompute level {level!r}; use one of {EXPERT_RECOMPUTE}")
    return EXPERT_RECOMPUTE[EXPERT_RECOMPUTE.index(level):]


# ---------------------------------------------------------------- the model
# Megatron's --recompute-modules the cost model prices (each re-runs its forward in backward); the
# others it takes (layernorm, moe_act: elementwise) add no GEMM and are left out.
SELECTIVE_PRICED = ("core_attn", "mlp", "shared_experts", "mla_up_proj")
SELECTIVE_FREE = ("layernorm", "moe_act")


@dataclass(frozen=True)
class TrainSettings:
    """What besides the model shape changes the cost of a step. With `program` given, its
    recompute and precision set activation_checkpointing and dtype_bytes, and every profile
    must price it; without, each GPU type is priced as its profile describes it (program_of)."""

    seq_len: int
    activation_checkpointing: bool = True  # the paper's setting: backward re-runs the forward
    dtype_bytes: int = 2  # fp16/bf16 activations on the wire and in checkpoints
    program: Program | None = None
    # What expert holders keep between an expert's forward and its backward (EXPERT_RECOMPUTE);
    # None: 'keep-inputs' with activation checkpointing, else 'off'.
    expert_recompute: str | None = None
    # Megatron's --use-distributed-optimizer: fp32 master weights and Adam moments sharded over
    # each parameter's data-parallel group (state_bytes_per_param).
    distributed_optimizer: bool = False
    # Megatron's selective recomputation (--recompute-granularity selective --recompute-modules;
    # --recompute-activations is core_attn), without activation checkpointing: each module in
    # SELECTIVE_PRICED re-runs its forward in backward; core_attn also keeps no unfused scores.
    recompute_modules: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        object.__setattr__(self, "recompute_modules", frozenset(self.recompute_modules))
        bad = sorted(self.recompute_modules - set(SELECTIVE_PRICED))
        if bad:
            raise ValueError(f"recompute_modules {bad}: the cost model prices {list(SELECTIVE_PRICED)}")
        if self.program is not None:
            object.__setattr__(self, "activation_checkpointing", self.program.activation_checkpointing)
            object.__setattr__(self, "dtype_bytes", self.program.dtype_bytes)
        if self.expert_recompute is None:
            object.__setattr__(self, "expert_recompute", default_expert_recompute(self.activation_checkpointing))
        elif self.expert_recompute not in EXPERT_RECOMPUTE:
            raise ValueError(f"expert_recompute={self.expert_recompute!r}; use one of {EXPERT_RECOMPUTE}")

    @property
    def expert_reforward(self) -> bool:
        """Whether an expert's backward re-runs its forward (any level but 'off')."""
        return self.expert_recompute != "off"


class CostModel:
    """Times and memory for one model shape over a set of GPU profiles.

    All times are seconds of one call on one GPU; "tokens" are tokens that call processes.
    """

    def __init__(self, model: ModelConfig, profiles: dict[str, GpuProfile], settings: TrainSettings):
        self.model = model
        self.settings = settings
        self.program = settings.program  # None: each profile's own (program_of)
        if self.program is not None:
            profiles = {n: priced_profile(p, self.program) for n, p in profiles.items()}
        self.profiles = profiles
        self._memo: dict[tuple, float] = {}  # the search asks the same few calls many times
        # Stages 0..L (L: MoE layers, the MTP layers' included, as a plan counts them): how many
        # dense layers each runs. Dense layer d runs in the stage of the first MoE layer after it
        # (stage L after the last one): the MoE layers before d. MTP layer j's entry (its norms
        # and 2h -> h projection) runs in the stage that runs its attention, alike.
        moe = model.planned_moe_layer_ids
        self.num_layers = len(moe)
        self.dense_in_stage = [0] * (self.num_layers + 1)
        for d in model.planned_dense_layers:
            self.dense_in_stage[sum(1 for i in moe if i < d)] += 1
        self.mtp_in_stage = [0] * (self.num_layers + 1)
        for j in range(model.mtp_num_layers or 0):
            self.mtp_in_stage[sum(1 for i in moe if i < model.num_layers + j)] += 1
        self.heads = 1 + (model.mtp_num_layers or 0)  # the output layer and loss run once per MTP layer more

    def program_of(self, gpu: str) -> Program:
        """The program this model's times on `gpu` are for."""
        if self.program is not None:
            return self.program
        rec = "full" if self.settings.activation_checkpointing else "none"
        p = self.profile(gpu)
        if p.measured is not None:
            mp = p.measured.program
            prec = mp["precision"] if mp["precision"] in PRECISIONS else "fp32"
            att = mp["attention"] if mp["attention"] in ATTENTION_KERNELS else "unfused"
            return Program(prec, att, rec)
        return dataclasses.replace(PAPER_PROGRAM, recompute=rec)

    def programs(self) -> dict[str, str]:
        """GPU type -> the program its times are for, in words."""
        return {g: self.program_of(g).describe() for g in sorted(self.profiles)}

    def profile(self, gpu: str) -> GpuProfile:
        try:
            return self.profiles[gpu]
        except KeyError:
            raise KeyError(f"no profile loaded for GPU type {gpu!r}; loaded: {sorted(self.profiles)}") from None

    # ---- compute -------------------------------------------------------------------------
    def attention_time(self, gpu: str, tokens: float, backward: bool = False, seq_len: int | None = None,
                       router: bool = True) -> float:
        """Attention + router of one layer (norm, QKV, core, output projection, gate);
        `router=False`: a dense layer's attention (no gate)."""
        if tokens <= 0:
            return 0.0
        s = seq_len or self.settings.seq_len
        p = self.profile(gpu)
        if p.measured is not None:
            t = _measured_attention(p.measured, self.model, tokens, s, backward, router)
            h = self.model.hidden_size
            t += ((2 if backward else 1) * tokens * h * ELEMENTWISE_BYTES_PER_HIDDEN
                  / (p.memory_bandwidth_gbs * 1e9 * MEMBW_EFFICIENCY))
        else:
            t = _analytic_attention(p, self.model, tokens, s, backward, self.program, router)
        if backward and self.settings.activation_checkpointing:
            t += self.attention_time(gpu, tokens, False, s, router)
        elif backward and self.settings.recompute_modules & {"core_attn", "mla_up_proj"}:
            t += self.selective_reforward_time(gpu, tokens, s)
        return t

    def selective_reforward_time(self, gpu: str, tokens: float, seq_len: int) -> float:
        """What Megatron's selective recomputation re-runs of one layer's attention in backward:
        the core's forward (core_attn) and MLA's up projections (mla_up_proj), at the attention's
        forward rate (the share of the attention forward their FLOPs are)."""
        m = self.model
        fwd = self.attention_time(gpu, tokens, False, seq_len, router=False)
        lin, core = attention_linear_flops(m, tokens, False), attention_core_flops(m, tokens, seq_len)
        if self.program is not None and self.program.attention == "unfused":
            core = 2.0 * attention_core_flops(m, tokens, seq_len, full=True)
        part = core if "core_attn" in self.settings.recompute_modules else 0.0
        if "mla_up_proj" in self.settings.recompute_modules and m.multi_latent_attention:
            part += 2.0 * tokens * sum(i * o for i, o in m.attention_linear_shapes()
                                       if i in (m.q_lora_rank, m.kv_lora_rank))
        return fwd * part / (lin + core)

    def mlp_time(self, gpu: str, ffn: int, tokens: float, backward: bool = False,
                 reforward: bool | None = None) -> float:
        """One SwiGLU MLP of intermediate size `ffn` on `tokens` tokens: an expert, a dense
        layer's MLP or a shared expert (the same GEMMs; the same measured rate). `reforward`:
        whether backward re-runs the forward (None: activation checkpointing's setting, which
        dense layers and shared experts follow: they run inside attention stages)."""
        if tokens <= 0 or ffn <= 0:
            return 0.0
        key = ("mlp", gpu, ffn, tokens, backward)
        if key not in self._memo:
            self._memo[key] = self._mlp_time(gpu, ffn, tokens, backward)
        t = self._memo[key]
        if backward and (self.settings.activation_checkpointing if reforward is None else reforward):
            t += self.mlp_time(gpu, ffn, tokens, False)
        return t

    def linear_time(self, gpu: str, n_in: int, n_out: int, tokens: float, backward: bool = False) -> float:
        """One GEMM of an n_in x n_out weight on `tokens` tokens (MTP's projection), at the MLPs'
        GEMM rate (measured: the expert table's), re-run in backward under activation checkpointing."""
        if tokens <= 0:
            return 0.0
        p = self.profile(gpu)
        mult = 2.0 if backward else 1.0
        flops = mult * 2.0 * n_in * n_out * tokens
        if p.measured is not None:
            _, exp = _measured_rates(p.measured)
            t = flops / _interp_log([e[0] for e in exp], [e[2 if backward else 1] for e in exp], tokens)
        else:
            b = self.settings.dtype_bytes
            t = _roofline(p, flops, mult * (n_in * n_out + tokens * (n_in + n_out)) * b, p.gemm_efficiency,
                          int(2 * mult))
        if backward and self.settings.activation_checkpointing:
            t += self.linear_time(gpu, n_in, n_out, tokens, False)
        return t

    def mtp_entry_time(self, gpu: str, tokens: float, backward: bool = False) -> float:
        """One MTP layer's work before its transformer layer: the embedding lookup, the two norms
        (elementwise) and the 2h -> h projection (multi_token_prediction.py)."""
        h, b = self.model.hidden_size, self.settings.dtype_bytes
        mult = 2.0 if backward else 1.0
        return self.linear_time(gpu, 2 * h, h, tokens, backward) + self.elementwise_time(gpu, mult * tokens * h * b * 6)

    def _mlp_time(self, gpu: str, ffn: int, tokens: float, backward: bool) -> float:
        """The MLP's own forward or backward GEMMs, without any re-forward."""
        p = self.profile(gpu)
        h = self.model.hidden_size
        gated = self.model.activation.gated
        if p.measured is not None:
            return _measured_mlp(p.measured, h, ffn, tokens, backward, gated)
        return _analytic_mlp(p, h, ffn, tokens, backward, self.settings.dtype_bytes, gated)

    def expert_time(self, gpu: str, tokens: float, backward: bool = False) -> float:
        """One expert FFN (SwiGLU) on `tokens` routed tokens; its backward re-runs the forward
        unless settings.expert_recompute is 'off'."""
        return self.mlp_time(gpu, self.model.moe_ffn_hidden_size, tokens, backward, self.settings.expert_reforward)

    def _selective(self, module: str) -> bool | None:
        """Whether a module's backward re-runs its forward: activation checkpointing's setting
        (None), or True where selective recomputation names the module."""
        return True if module in self.settings.recompute_modules else None

    def shared_expert_time(self, gpu: str, tokens: float, backward: bool = False) -> float:
        """One MoE layer's shared expert on all `tokens` of the microbatch (0 without one)."""
        return self.mlp_time(gpu, self.model.moe_shared_expert_intermediate_size or 0, tokens, backward,
                             self._selective("shared_experts"))

    def dense_layer_time(self, gpu: str, tokens: float, backward: bool = False) -> float:
        """One dense layer, whole: attention (no router) and its MLP of ffn_hidden_size."""
        return (self.attention_time(gpu, tokens, backward, router=False)
                + self.mlp_time(gpu, self.model.ffn_hidden_size, tokens, backward, self._selective("mlp")))

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
            t = _roofline(p, mult * head_flops(m, tokens),
                          mult * m.vocab_size * m.hidden_size * self.settings.dtype_bytes,
                          p.gemm_efficiency, int(HEAD_KERNELS * mult))
        t += loss_bytes / (p.memory_bandwidth_gbs * 1e9 * MEMBW_EFFICIENCY)
        if backward and self.settings.activation_checkpointing:
            t += self.head_time(gpu, tokens, False)
        return t

    def elementwise_time(self, gpu: str, nbytes: float) -> float:
        p = self.profile(gpu)
        return nbytes / (p.memory_bandwidth_gbs * 1e9 * MEMBW_EFFICIENCY)

    def stage_kind(self, stage: int) -> tuple[int, int, int]:
        """Stages of one kind cost alike: (0 first / 1 middle / 2 head stage, dense layers run,
        MTP entries run)."""
        L = self.num_layers
        if not 0 <= stage <= L:
            raise ValueError(f"stage {stage} outside 0..{L} for a model of {L} MoE layers")
        return (0 if stage == 0 else (2 if stage == L else 1), self.dense_in_stage[stage], self.mtp_in_stage[stage])

    def stage_time(self, gpu: str, stage: int, tokens: float, backward: bool = False, tp: int = 1,
                   dense: int | None = None, cp: int = 1) -> float:
        """Attention stage s of the zebra task list (0..L, L = MoE layers): s=0 embedding +
        attention_1 + router_1; 0<s<L combine of layer s-1 + residual + attention + router;
        s=L last combine + head + loss. A stage s<L also runs MoE layer s's shared expert, and
        any stage the dense layers that come before its MoE layer (or, s=L, before the head).
        `tokens`: the rank's tokens; under tensor parallelism `tp` (with sequence parallelism) its
        sequence slice, member tokens / tp: the rank computes 1/tp of every GEMM, of the heads and
        of the elementwise work, priced as the stage on `tokens` tokens, plus the stage's TP
        collectives (tp_comm_time), not overlapped. Under context parallelism `cp` `tokens` is the
        rank's share of the member's, member tokens / (tp cp), priced alike (its queries' share of
        the load-balanced causal core), plus the stage's K/V exchanges (cp_comm_time), not
        overlapped. `dense`: how many dense layers the stage runs (default dense_in_stage[stage]; a
        pipeline stage boundary may move a dense layer to the neighbouring stage: planner/pipeline.py)."""
        kind = self.stage_kind(stage)
        if dense is not None:
            kind = (kind[0], dense, kind[2])
        key = ("stage", gpu, kind, tokens, backward, tp, cp)
        if key not in self._memo:
            t = self._stage_time(gpu, stage, tokens, backward, dense)
            if tp > 1:
                t += self.tp_comm_time(gpu, stage, tokens, tp, backward, dense)
            if cp > 1:
                t += self.cp_comm_time(gpu, stage, tokens, cp, backward, dense)
            self._memo[key] = t
        return self._memo[key]

    # ---- tensor parallelism (Megatron's --tensor-model-parallel-size t --sequence-parallel) ----
    def tp_collectives(self, stage: int, dense: int | None = None) -> int:
        """All-gathers + reduce-scatters of one forward of attention stage `stage` under sequence
        parallelism (Megatron's SP: an all-gather of the sequence before each TP block, a
        reduce-scatter after it): 2 for MoE layer s's attention block, 2 for its shared expert,
        4 per dense layer (attention block and MLP block), 1 on stage 0 (the vocab-parallel
        embedding's output reduce-scattered), 1 on stage L (the final norm's output all-gathered
        for the vocab-parallel output layer). The MoE input stays the rank's slice (each TP rank
        routes and dispatches its own tokens), so the experts add none. The vocab-parallel
        cross-entropy's all-reduces (3 floats per token) are left out. `dense`: as stage_time."""
        L = self.num_layers
        self.stage_kind(stage)  # range check
        n = 4 * (self.dense_in_stage[stage] if dense is None else dense)
        n += self.mtp_in_stage[stage]  # the gathered input of MTP's projection
        if stage < L:
            n += 2 + (2 if self.model.moe_shared_expert_intermediate_size else 0)
        if stage == 0:
            n += 1
        if stage == L:
            n += 1
        return n

    def tp_collective_time(self, gpu: str, tokens: float, tp: int) -> float:
        """One sequence-parallel all-gather or reduce-scatter (ring, inside one node): each rank
        holds `tokens` tokens of hidden size h and sends/receives the other tp-1 slices,
        (tp-1) x tokens x h x dtype bytes, at the GPU profile's intra_node_gbs, + its link_latency_us."""
        if tp <= 1 or tokens <= 0:
            return 0.0
        return self.intra_node_time(gpu, (tp - 1) * tokens * self.token_bytes())

    def intra_node_time(self, gpu: str, nbytes: float) -> float:
        """One collective moving `nbytes` per rank inside a node: the GPU profile's link_latency_us
        + nbytes at its intra_node_gbs."""
        p = self.profile(gpu)
        return p.link_latency_us * 1e-6 + nbytes / (p.intra_node_gbs * 1e9)

    def passes(self, collectives: int, backward: bool) -> int:
        """A stage's collectives per pass: forward as many as it has; backward the same volumes (the
        all-gather's backward is a reduce-scatter and vice versa), twice under activation
        checkpointing (the re-run forward gathers again)."""
        return collectives * (2 if backward and self.settings.activation_checkpointing else 1)

    def tp_comm_time(self, gpu: str, stage: int, tokens: float, tp: int, backward: bool = False,
                     dense: int | None = None) -> float:
        """TP collectives of attention stage `stage` on a rank holding `tokens` tokens (its slice):
        forward tp_collectives(stage) of tp_collective_time; backward the same volumes (the
        all-gather's backward is a reduce-scatter and vice versa), twice under activation
        checkpointing (the re-run forward gathers again)."""
        if tp <= 1:
            return 0.0
        return self.passes(self.tp_collectives(stage, dense), backward) * self.tp_collective_time(gpu, tokens, tp)

    # ---- context parallelism (Megatron's --context-parallel-size c) ----------------------------
    def kv_width(self) -> int:
        """Key and value channels of one token over all heads, what CP ranks exchange per token:
        2 x query groups x head_dim; MLA's keys and values after their up projection (heads x
        (qk_channels + v_channels): megatron-core gathers those, not the latent)."""
        m = self.model
        if m.multi_latent_attention:
            return m.num_attention_heads * (m.qk_channels + m.v_channels)
        return 2 * m.query_groups * m.head_dim

    def cp_attention_layers(self, stage: int, dense: int | None = None) -> int:
        """Attention layers of attention stage `stage`, each one K/V exchange per pass under CP:
        MoE layer s's (s < L) and its dense layers' (`dense`: as stage_time)."""
        self.stage_kind(stage)  # range check
        n = self.dense_in_stage[stage] if dense is None else dense
        return n + (1 if stage < self.num_layers else 0)

    def cp_collective_time(self, gpu: str, tokens: float, cp: int) -> float:
        """One K/V all-gather of one attention layer over a CP group of `cp` ranks (ring, inside one
        node), or its gradient's reduce-scatter (the same volume): a rank holding `tokens` tokens
        (member tokens / (tp cp)) receives the other cp-1 ranks' keys and values, (cp-1) x tokens x
        kv_width x dtype bytes (under TP each rank exchanges its heads' share of the tp x tokens
        its CP rank holds: the same bytes), at the GPU profile's intra_node_gbs + its link_latency_us
        (tp_collective_time's link model)."""
        if cp <= 1 or tokens <= 0:
            return 0.0
        return self.intra_node_time(gpu, (cp - 1) * tokens * self.kv_width() * self.settings.dtype_bytes)

    def cp_comm_time(self, gpu: str, stage: int, tokens: float, cp: int, backward: bool = False,
                     dense: int | None = None) -> float:
        """K/V exchanges of attention stage `stage` on a rank holding `tokens` tokens: forward one
        all-gather per attention layer (cp_attention_layers), backward one reduce-scatter of their
        gradients per layer, plus one all-gather more under activation checkpointing (the re-run
        forward gathers again), each cp_collective_time."""
        if cp <= 1:
            return 0.0
        return self.passes(self.cp_attention_layers(stage, dense), backward) * self.cp_collective_time(gpu, tokens, cp)

    def cp_gathered_bytes(self, tokens_mb: float, cp: int) -> float:
        """The other CP ranks' keys and values one attention layer holds on a rank of `tokens_mb`
        tokens: (cp-1) x tokens_mb x kv_width x dtype bytes (0 without CP)."""
        if cp <= 1:
            return 0.0
        return (cp - 1) * tokens_mb * self.kv_width() * self.settings.dtype_bytes

    def _stage_time(self, gpu: str, stage: int, tokens: float, backward: bool, n_dense: int | None = None) -> float:
        m = self.model
        L = self.num_layers
        mult = 2.0 if backward else 1.0
        h, k, b = m.hidden_size, m.moe_router_topk, self.settings.dtype_bytes
        combine = self.elementwise_time(gpu, mult * tokens * h * b * (k + 2)) if stage > 0 else 0.0
        n_dense = self.dense_in_stage[stage] if n_dense is None else n_dense
        dense = n_dense * self.dense_layer_time(gpu, tokens, backward)
        dense += self.mtp_in_stage[stage] * self.mtp_entry_time(gpu, tokens, backward)
        if stage == L:  # the main output layer and loss, and one more per MTP layer
            return combine + dense + self.heads * self.head_time(gpu, tokens, backward)
        # MoE layer `stage`: its attention and router, and its shared expert on every token
        moe = self.attention_time(gpu, tokens, backward) + self.shared_expert_time(gpu, tokens, backward)
        if stage == 0:
            embed = self.elementwise_time(gpu, mult * tokens * h * b * 2)
            return embed + dense + moe
        return combine + dense + moe

    def stage_params(self, stage: int) -> int:
        """Non-expert parameters attention stage `stage` computes with, besides the embedding and
        the output layer: MoE layer `stage`'s attention, norms, router and shared expert (s < L)
        and the dense layers the stage runs. Over all stages, + embedding and head, this is
        ModelConfig.non_expert_params()."""
        m = self.model
        self.stage_kind(stage)  # range check
        moe = m.moe_layer_non_expert_params() if stage < self.num_layers else 0
        return (moe + self.dense_in_stage[stage] * m.dense_layer_params()
                + self.mtp_in_stage[stage] * m.mtp_extra_params())

    def optimizer_time(self, gpu: str, params: float) -> float:
        return self.elementwise_time(gpu, params * OPTIMIZER_BYTES_PER_PARAM)

    # ---- communication payloads ----------------------------------------------------------
    def token_bytes(self) -> int:
        """Bytes of one token's hidden state on the wire."""
        return self.model.hidden_size * self.settings.dtype_bytes

    # ---- memory --------------------------------------------------------------------------
    @property
    def bytes_per_param_state(self) -> float:
        fp32 = self.program is not None and self.program.precision == "fp32"
        return BYTES_PER_PARAM_STATE_FP32 if fp32 else BYTES_PER_PARAM_STATE

    def state_bytes_per_param(self, dp: int = 1) -> float:
        """Weights, gradient and optimizer state per parameter. Without the distributed optimizer
        bytes_per_param_state (18 mixed precision, 16 fp32); with it (Megatron's
        --use-distributed-optimizer) the fp32 master weights and Adam moments are sharded over
        the parameter's `dp` data-parallel replicas: mixed precision 2 (16-bit weight) + 4 (fp32
        main grad) + 12 / dp (master, m, v), fp32 4 + 4 + 8 / dp (Megatron's docs give 6 + 12/d)."""
        if not self.settings.distributed_optimizer or dp <= 1:
            return self.bytes_per_param_state
        fp32 = self.program is not None and self.program.precision == "fp32"
        return 8.0 + 8.0 / dp if fp32 else 6.0 + 12.0 / dp

    def expert_state_bytes(self, dp: int = 1) -> float:
        """One expert's weights and state; `dp`: its replicas (ZP groups), for the distributed optimizer."""
        return self.model.expert_params() * self.state_bytes_per_param(dp)

    def layer_tp_replicated_params(self) -> int:
        """Parameters of one layer's attention and norms that every TP rank holds whole: the two
        norms, the q/k (MLA: latent) norms, MLA's down projections (transformer-engine's spec
        duplicates them over TP; the local spec splits them: an over-estimate there)."""
        m = self.model
        n = 2 * m.norm_params(m.hidden_size)
        if m.multi_latent_attention:
            n += sum(i * o for i, o in m.attention_linear_shapes()[:-1] if i == m.hidden_size)
            if m.qk_layernorm:
                n += m.norm_params(m.kv_lora_rank) + (m.norm_params(m.q_lora_rank) if m.q_lora_rank else 0)
        elif m.qk_layernorm:
            n += 2 * m.norm_params(m.head_dim)
        return n

    def stage_tp_replicated_params(self, stage: int, dense: int | None = None) -> int:
        """tp_replicated_params of one attention stage (its `dense` layers, default its own)."""
        m = self.model
        d = self.dense_in_stage[stage] if dense is None else dense
        n = d * self.layer_tp_replicated_params() + self.mtp_in_stage[stage] * 3 * m.norm_params(m.hidden_size)
        if stage < self.num_layers:
            return n + self.layer_tp_replicated_params() + m.router_params()  # an MoE layer's and its router
        return n + m.norm_params(m.hidden_size)  # the final norm

    def tp_replicated_params(self, stages: list[int] | None = None) -> int:
        """Non-expert parameters every TP rank holds whole (norms, routers, MLA's down projections;
        Megatron replicates them over the TP group): of the attention `stages` (None: all, with
        the final norm)."""
        stages = list(range(self.num_layers + 1)) if stages is None else stages
        return sum(self.stage_tp_replicated_params(s) for s in stages)

    def non_expert_params_per_rank(self, tp: int = 1) -> float:
        """Non-expert parameters one rank of a TP member holds: QKV/projection, dense MLPs, shared
        experts, embedding and output layer split tp ways; norms and routers whole."""
        total = self.model.non_expert_params()
        if tp <= 1:
            return total
        rep = self.tp_replicated_params()
        return (total - rep) / tp + rep

    def non_expert_state_bytes(self, tp: int = 1, dp: int = 1) -> float:
        """An attention rank's non-expert weights and state: `tp` its member's TP size, `dp` the
        number of members (the dense weights' data-parallel size, for the distributed optimizer)."""
        return self.non_expert_params_per_rank(tp) * self.state_bytes_per_param(dp)

    def layer_activation_bytes_per_token(self) -> float:
        """Activations one whole layer keeps per token for backward without recomputation (an
        estimate after Korthikanti et al. 2022, 34 h bytes at 16 bits with fused attention: 11 h
        of attention, 23 h of MLP and norms): the attention's 11 h generalized to its real widths,
        3 h (its input, the dropout mask) + 2 x (query, key and value widths) + 2 x the output
        projection's input (+ MLA's latents); unfused attention adds the scores (5 heads x seq
        per token) unless selective recomputation re-runs the core."""
        m, b = self.model, self.settings.dtype_bytes
        h, a = m.hidden_size, m.num_attention_heads
        if m.multi_latent_attention:
            qkv = a * (2 * m.qk_channels + m.v_head_dim)
            qkv += (m.q_lora_rank or 0) + m.kv_lora_rank + m.qk_pos_emb_head_dim
        else:
            qkv = (a + 2 * m.query_groups) * m.head_dim
        units = 3 * h + 2 * qkv + 2 * a * m.v_channels + 23 * h
        if (self.program is not None and self.program.attention == "unfused"
                and "core_attn" not in self.settings.recompute_modules):
            units += 5.0 * a * self.settings.seq_len
        return units * b / 2

    def attention_rank_bytes(self, tokens_mb: float, microbatches_alive: int, layer_checkpoints: bool = False,
                             tp: int = 1, dp: int = 1, cp: int = 1) -> float:
        """An attention rank without offloaded experts: non-expert weights and optimizer state
        (dense layers and shared experts included), plus activations. With checkpointing: each
        stage's input for every live microbatch, one stage's working set (a stage recomputed
        whole holds its dense layers' activations too) and the fp32 logits; without: ~34 h
        bytes per token per layer, dense or MoE (flash attention; Korthikanti et al. 2022; an
        estimate). `layer_checkpoints`: Megatron's full recompute instead of zebra's per stage
        (every layer's input kept, one layer recomputed at a time; the EP baselines). Shared
        experts keep their SwiGLU intermediates (without checkpointing) or need them as working
        set, as an expert does (per_expert_bytes). With expert_recompute 'resend-inputs' also the
        dispatched tokens it sends again in backward (resent_bytes). Tensor parallelism `tp`
        (sequence parallel): `tokens_mb` is the rank's slice, so activations are the member's / tp;
        weights and state are non_expert_state_bytes(tp, dp); the working set adds the all-gathered
        sequence, (tp-1) x tokens_mb x h x dtype bytes. Context parallelism `cp`: `tokens_mb` is
        member tokens / (tp cp); weights stay whole over CP (`dp` counts data x context parallel
        ranks, the distributed optimizer's shards); the other ranks' keys and values
        (cp_gathered_bytes) are kept per layer and live microbatch without checkpointing, else held
        by the recomputed stage's attention layers (by one layer under `layer_checkpoints`)."""
        m, b = self.model, self.settings.dtype_bytes
        h, L = m.hidden_size, self.num_layers
        n_dense = len(m.planned_dense_layers)
        shared = m.moe_shared_expert_intermediate_size or 0
        logits = self.heads * tokens_mb * m.vocab_size * 4.0  # estimate: fp16 logits + their fp16 gradient, per head
        per_token = self.layer_activation_bytes_per_token()  # one whole layer's activations
        shared_working = tokens_mb * shared * b * 4  # as expert_working_bytes
        gathered = self.cp_gathered_bytes(tokens_mb, cp)  # one attention layer's other CP ranks' K/V
        if self.settings.activation_checkpointing:
            stage_working = tokens_mb * h * b * 20
            if layer_checkpoints:  # one layer at a time: an MoE layer's working set, or a whole dense layer's
                kept = (L + n_dense + 1) * tokens_mb * h * b * microbatches_alive
                working = max(stage_working, tokens_mb * per_token if n_dense else 0.0) + gathered
            else:  # zebra recomputes a stage whole: its MoE layer's attention and its dense layers
                kept = (L + 1) * tokens_mb * h * b * microbatches_alive
                working = stage_working + max(self.dense_in_stage) * (tokens_mb * per_token + gathered) + gathered
            working += shared_working
        else:
            kept = (L + n_dense) * (tokens_mb * per_token + gathered) * microbatches_alive
            kept += L * tokens_mb * 3 * shared * b * microbatches_alive  # shared experts' SwiGLU intermediates
            working = 0.0
        working += (tp - 1) * tokens_mb * h * b if tp > 1 else 0.0
        return (self.non_expert_state_bytes(tp, dp) + kept + working + logits
                + self.resent_bytes(tokens_mb, microbatches_alive))

    # ---- pipeline stages (plan.pipeline_stages; planner/pipeline.py) -------------------------
    # A pipeline stage's attention work is a list of pieces (zebra stage s, dense layers it runs):
    # its MoE layers' stages (and, on the last pipeline stage, the head stage L), each with the
    # dense layers of the pipeline stage that come before that MoE layer (or the head), or after
    # the stage's last MoE layer. With one stage the pieces are (s, dense_in_stage[s]) for s = 0..L.

    def pipeline_stage_params(self, pieces: list[tuple[int, int]], first: bool, last: bool) -> int:
        """Non-expert parameters of a pipeline stage (one copy): its pieces' (stage_params with the
        piece's dense layers), the embedding on the first stage, output layer and final norm on
        the last. Over all stages this is ModelConfig.non_expert_params()."""
        m = self.model
        h, L = m.hidden_size, self.num_layers
        n = sum((m.moe_layer_non_expert_params() if s < L else 0) + d * m.dense_layer_params()
                + self.mtp_in_stage[s] * m.mtp_extra_params() for s, d in pieces)
        # the last stage holds an output layer, tied or not (a tied one is the embedding's copy
        # there), unless it is also the first stage and tied
        output = m.vocab_size * h if (m.untie_embeddings_and_output_weights or not first) else 0
        return n + (m.embedding_params() if first else 0) + (output + m.norm_params(h) if last else 0)

    def pipeline_stage_params_per_rank(self, pieces: list[tuple[int, int]], first: bool, last: bool,
                                       tp: int = 1) -> float:
        """pipeline_stage_params on one rank of a TP member: split tp ways but norms and routers
        (tp_replicated_params' rule for the stage's pieces)."""
        key = ("stage_params", tuple(pieces), first, last, tp)
        if key not in self._memo:
            total = self.pipeline_stage_params(pieces, first, last)
            rep = sum(self.stage_tp_replicated_params(s, d) for s, d in pieces) if tp > 1 else 0
            self._memo[key] = total if tp <= 1 else (total - rep) / tp + rep
        return self._memo[key]

    def pipeline_attention_rank_bytes(self, tokens_mb: float, microbatches_alive: int,
                                      pieces: list[tuple[int, int]], first: bool, last: bool,
                                      tp: int = 1, dp: int = 1, cp: int = 1) -> float:
        """attention_rank_bytes for an attention rank of one pipeline stage: the same terms over
        the stage's pieces only (weights and state of its pieces, the embedding on the first
        stage and output layer on the last; one checkpointed input per piece per live
        microbatch; a piece's working set; fp32 logits only on the last stage; resent tokens of
        its MoE layers; under CP the gathered K/V as there). With every piece, first and last, this
        is attention_rank_bytes."""
        m, b = self.model, self.settings.dtype_bytes
        h, L = m.hidden_size, self.num_layers
        n_moe = sum(1 for s, _ in pieces if s < L)
        n_dense = sum(d for _, d in pieces)
        shared = m.moe_shared_expert_intermediate_size or 0
        logits = self.heads * tokens_mb * m.vocab_size * 4.0 if last else 0.0
        per_token = self.layer_activation_bytes_per_token()
        shared_working = tokens_mb * shared * b * 4
        gathered = self.cp_gathered_bytes(tokens_mb, cp)
        if self.settings.activation_checkpointing:
            kept = len(pieces) * tokens_mb * h * b * microbatches_alive
            working = (tokens_mb * h * b * 20 + max(d for _, d in pieces) * (tokens_mb * per_token + gathered)
                       + gathered + shared_working)
        else:
            kept = (n_moe + n_dense) * (tokens_mb * per_token + gathered) * microbatches_alive
            kept += n_moe * tokens_mb * 3 * shared * b * microbatches_alive
            working = 0.0
        working += (tp - 1) * tokens_mb * h * b if tp > 1 else 0.0
        state = self.pipeline_stage_params_per_rank(pieces, first, last, tp) * self.state_bytes_per_param(dp)
        resent = (n_moe * tokens_mb * m.moe_router_topk * self.token_bytes() * microbatches_alive
                  if self.settings.expert_recompute == "resend-inputs" else 0.0)
        return state + kept + working + logits + resent

    def resent_bytes(self, tokens_mb: float, microbatches_alive: int) -> float:
        """Dispatched tokens an attention rank keeps to send again in backward (expert_recompute
        'resend-inputs'; 0 otherwise): top-k copies of each token, every MoE layer, every live
        microbatch."""
        if self.settings.expert_recompute != "resend-inputs":
            return 0.0
        m = self.model
        return self.num_layers * tokens_mb * m.moe_router_topk * self.token_bytes() * microbatches_alive

    def expert_kept_bytes_per_token(self) -> float:
        """Bytes an expert holder keeps per routed token of a live microbatch for the expert's
        backward, by settings.expert_recompute (EXPERT_RECOMPUTE says what each level keeps)."""
        m, b = self.model, self.settings.dtype_bytes
        inter = 3 if m.activation.gated else 2  # fc1's outputs and the activation's
        return {"off": (m.hidden_size + inter * m.moe_ffn_hidden_size) * b, "keep-inputs": m.hidden_size * b,
                "resend-inputs": 0.0}[self.settings.expert_recompute]

    def per_expert_bytes(self, tokens_per_expert_mb: float, microbatches_alive: int, dp: int = 1) -> float:
        """What each held expert adds on any rank: its weights and optimizer state and what it
        keeps for backward of the routed tokens of every live microbatch
        (expert_kept_bytes_per_token). `dp`: the expert's replicas (distributed optimizer)."""
        kept = tokens_per_expert_mb * self.expert_kept_bytes_per_token() * microbatches_alive
        return self.expert_state_bytes(dp) + kept

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

    def f(p: GpuProfile) -> float:
        return _analytic_attention(p, m, seq_len, seq_len, False) + _analytic_attention(p, m, seq_len, seq_len, True)

    return f(slow) / f(fast)
