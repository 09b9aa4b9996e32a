"""`hetermoe bench --layer`: HeteroMoELayer against megatron-core's MoELayer in one process.

Both layers are built on one rank from the same model config (a ZP group of one for HeterMoE, EP 1
with Megatron's all-to-all dispatcher), with the same weights and the same input; each timed pass
is a forward and backward of one layer on one microbatch, the two layers alternating so drift in
the machine hits both alike. It prints the median time of each and the ratio HeterMoE / Megatron
with its spread (the quartiles of the per-pair ratios), and the host reads each layer's forward
makes (`HostReads`: what would be a device-to-host copy on a GPU).

`HostReads` counts, on any device, the host synchronizations a forward makes on a GPU: reads of a
tensor's values into Python (`.item()`, `.tolist()`, `int()`/`float()`/`bool()`, `.cpu()`,
`.numpy()`, `.to("cpu")`) of tensors that live on the device in a GPU run (the layer's input, its
parameters and whatever is computed from them; a tensor made from Python values, or read back once,
is a host tensor and reading it costs nothing). A read waits for the device work queued before it,
so reads with no device work between them are one synchronization (Megatron's batched copies before
its one synchronize): the count is the reads that follow device work.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

_MARK, _HOST, _WEIGHTS = "_hetermoe_on_device", "_hetermoe_on_host", "_hetermoe_weights"
_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__int__, torch.Tensor.__float__,
          torch.Tensor.__bool__, torch.Tensor.__index__, torch.Tensor.cpu, torch.Tensor.numpy}


def _on_device(t) -> bool:
    return (isinstance(t, torch.Tensor) and not getattr(t, _HOST, False)
            and (getattr(t, _MARK, False) or t.requires_grad))


def _to_host(args, kwargs) -> bool:
    """Whether a Tensor.to call moves its tensor to the host."""
    for a in list(args[1:]) + [kwargs.get("device")]:
        if isinstance(a, torch.device) and a.type == "cpu" or isinstance(a, str) and a.split(":")[0] == "cpu":
            return True
    return False


def _set(t, attr: str) -> None:
    try:
        setattr(t, attr, True)
    except (AttributeError, RuntimeError):
        pass


@dataclass
class HostReads(TorchFunctionMode):
    """A torch function mode counting the host synchronizations of device tensors (module
    docstring). `mark` the inputs that live on the device (parameters and tensors that need a
    gradient count already)."""
    count: int = 0
    reads: int = 0  # every read of a device tensor, synchronizing or not
    sites: list = field(default_factory=list)  # where each counted synchronization is
    queued: bool = True  # device work issued since the last synchronization

    def __post_init__(self):
        super().__init__()

    @staticmethod
    def mark(*tensors: torch.Tensor) -> None:
        for t in tensors:
            _set(t, _MARK)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        src = args[0] if args else None
        if getattr(func, "__self__", None) is torch.Tensor.data:  # the `.data` getter
            # Megatron's router moves its weights to the current device if they are on the CPU (a
            # CPU rank's "device"): moving weights' storage is not reading values.
            out = func(*args, **kwargs)
            _set(out, _WEIGHTS)
            return out
        if func is torch.Tensor.to and getattr(src, _WEIGHTS, False):
            return func(*args, **kwargs)
        if func in _READS or func is torch.Tensor.to and _to_host(args, kwargs):
            out = func(*args, **kwargs)
            if _on_device(src):
                self.reads += 1
                if self.queued:
                    self.count, self.queued = self.count + 1, False
                    self.sites.append(f"{getattr(func, '__name__', func)} at {_caller()}")
                if isinstance(out, torch.Tensor):
                    if out is src:  # a host tensor's .cpu() is itself: a new view marks the copy
                        out = out.view_as(out)
                    _set(out, _HOST)
            return out
        out = func(*args, **kwargs)
        if any(_on_device(a) for a in tree_flatten((args, kwargs))[0]):
            self.queued = True
            for o in tree_flatten(out)[0]:
                if isinstance(o, torch.Tensor):
                    _set(o, _MARK)
        return out


def _caller() -> str:
    import traceback

    for f in reversed(traceback.extract_stack()):
        if not f.filename.endswith(("layer_bench.py", "overrides.py")) and "/torch/" not in f.filename:
            return f"{f.filename}:{f.lineno}"
    return "?"


@dataclass(frozen=True)
class LayerPair:
    """One MoE layer twice on this rank, with the same weights: Megatron's and HeterMoE's."""
    megatron: torch.nn.Module
    hetero: torch.nn.Module
    hidden_size: int
    dtype: torch.dtype
    device: torch.device


def build_pair(model_name: str, dtype: torch.dtype = torch.float32, device: torch.device | None = None) -> LayerPair:
    """Megatron's MoELayer (all-to-all dispatcher, EP = the world) and HeteroMoELayer (one ZP group
    of the world's ranks, all attention ranks, each holding the experts Megatron's EP rank holds) of
    `model_name`'s MoE layer, same weights. Starts a 1-rank world (gloo on the CPU, NCCL on a GPU)
    if none is up."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.spec_utils import build_module

    from megatron_hetermoe.config import ModelConfig, ParallelConfig
    from megatron_hetermoe.models.builder import layer_spec, transformer_config
    from megatron_hetermoe.models.moe_layer import hetero_layer_spec
    from megatron_hetermoe.parallel import cpu_backend
    from megatron_hetermoe.parallel.state import initialize_hetero_parallel
    from megatron_hetermoe.plan.hetero_plan import HeteroPlan, ZPGroup

    device = device or (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
                        else torch.device("cpu"))
    if device.type == "cpu":
        cpu_backend.apply()
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                                world_size=1)
    world = dist.get_world_size()
    model = ModelConfig.load(model_name).replace(num_layers=1)
    if model.num_experts % world:
        raise ValueError(f"{model_name} has {model.num_experts} experts, which {world} ranks cannot share evenly")
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=world)
    cfg = transformer_config(model, ParallelConfig(ep=world), params_dtype=dtype,
                             pipeline_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16)
    model_parallel_cuda_manual_seed(1234)
    spec = layer_spec(model)
    megatron = build_module(spec.submodules.mlp, config=cfg)
    megatron.set_layer_number(1)
    n = model.num_experts // world
    # GPU type "cpu": a plan that checks no GPU type (parallel/device.py check_rank_gpu).
    plan = HeteroPlan(1, model.num_experts, ["cpu"] * world,
                      [ZPGroup(list(range(world)), [], [{r: list(range(r * n, r * n + n)) for r in range(world)}])],
                      num_microbatches=1)
    hs = initialize_hetero_parallel(plan, device=device)
    hetero = build_module(hetero_layer_spec(spec, hs, hs.pg_collection()).submodules.mlp, config=cfg)
    hetero.set_layer_number(1)
    megatron.to(device)
    hetero.to(device)
    hetero.load_state_dict(megatron.state_dict(), strict=True)  # the same experts, named alike
    return LayerPair(megatron, hetero, model.hidden_size, dtype, device)


def make_input(pair: LayerPair, tokens: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(tokens, 1, pair.hidden_size, generator=g).to(pair.device, pair.dtype)
    return x.requires_grad_()


def host_reads(layer: torch.nn.Module, x: torch.Tensor) -> HostReads:
    """The host reads of one forward of `layer` on x."""
    with torch.no_grad(), HostReads() as reads:
        HostReads.mark(x)
        layer(x)
    return reads


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _pass(layer: torch.nn.Module, x: torch.Tensor) -> float:
    device = x.device
    _sync(device)
    t0 = time.perf_counter()
    out, _ = layer(x)
    out.float().sum().backward()
    _sync(device)
    return time.perf_counter() - t0


@dataclass(frozen=True)
class LayerTiming:
    megatron_s: float  # median seconds of a forward + backward
    hetero_s: float
    ratio: float  # median of the per-pair ratios hetero / megatron
    ratio_q1: float
    ratio_q3: float
    pairs: int


def time_pair(pair: LayerPair, tokens: int, repeats: int = 20, warmup: int = 3) -> LayerTiming:
    """Alternating forward+backward passes of both layers on the same input; the ratio's
    quartiles over the `repeats` pairs (which layer goes first alternates too)."""
    x = make_input(pair, tokens)
    for _ in range(warmup):
        _pass(pair.megatron, x)
        _pass(pair.hetero, x)
    m, h = [], []
    for i in range(repeats):
        if i % 2:
            h.append(_pass(pair.hetero, x))
            m.append(_pass(pair.megatron, x))
        else:
            m.append(_pass(pair.megatron, x))
            h.append(_pass(pair.hetero, x))
        pair.megatron.zero_grad(set_to_none=True)
        pair.hetero.zero_grad(set_to_none=True)
        x.grad = None
    ratios = sorted(b / a for a, b in zip(m, h))
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    return LayerTiming(statistics.median(m), statistics.median(h), statistics.median(ratios), q[0], q[2], repeats)


def main(argv: list[str] | None = None) -> int:
    from megatron_hetermoe.cli.bench import build_layer_parser

    p = build_layer_parser(__doc__)
    a = p.parse_args(argv)
    if a.tokens < 1 or a.repeats < 2:
        p.error(f"--tokens {a.tokens} must be >= 1 and --repeats {a.repeats} >= 2")
    from megatron_hetermoe.models.builder import precision_dtype

    pair = build_pair(a.model, precision_dtype(a.precision))
    x = make_input(pair, a.tokens)
    mr, hr = host_reads(pair.megatron, x), host_reads(pair.hetero, x)
    t = time_pair(pair, a.tokens, a.repeats)
    print(f"MoE layer of {a.model}, {a.tokens} tokens, {a.precision} on {pair.device}: forward + backward, "
          f"median of {t.pairs} alternating pairs")
    print(f"  megatron MoELayer   {t.megatron_s * 1e3:9.2f} ms   host reads per forward {mr.count}")
    print(f"  HeteroMoELayer      {t.hetero_s * 1e3:9.2f} ms   host reads per forward {hr.count}")
    print(f"  ratio HeterMoE / Megatron {t.ratio:.3f} (quartiles {t.ratio_q1:.3f} .. {t.ratio_q3:.3f})")
    return 0
