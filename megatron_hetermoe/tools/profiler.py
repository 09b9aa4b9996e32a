"""`hetermoe profile --model CFG --out PROFILE.yaml`: measure this device (CUDA if present, else
CPU) into a GPU profile (profiles.py format) with measured tables.

What is measured, with real megatron-core modules built from the model config (one
TransformerLayer of the local spec):
  * attention + router: input norm, SelfAttention (RoPE, causal) and the MoE TopKRouter,
    forward and backward, for several (seq_len, sequences) shapes;
  * one expert (megatron-core MLP, SwiGLU) forward and backward at several token counts;
  * a large matmul (peak), a large copy (memory bandwidth), a tiny op (launch overhead);
  * all_to_all_single over the current process group at several message sizes (a world of one
    rank on a laptop: that is a local copy, and the profile says so);
  * memory: parameter bytes of the attention part and of one expert, and n_min / n_max of the
    paper for an example shape (from the cost model's memory formulas and the device memory).
Times are medians of `--repeats` runs after a warm-up. The tables are for one program
(cost_model.Program): the precision (default: the one this package's trainers run, fp32; --dtype
to measure another) and megatron-core's local spec (unfused attention), recorded in
measured.info.program, so the cost model knows which program they price.

`hetermoe profile --gpu-pair --out link.yaml` instead measures the all-to-all between two ranks:
two GPUs (of one type or two) over NCCL when this node has them, else two CPU processes over
gloo, and then says so in every number's source (CPU/gloo numbers describe this host, not a GPU
link). It fits latency and bandwidth to the times (the transfer model's link_latency_us and
intra_node_gbs, in the same {value, source} form as a GPU profile) and records the precision of
the messages (the runtime's).
"""
from __future__ import annotations

import datetime
import functools
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from megatron_hetermoe.config import ModelConfig
from megatron_hetermoe.planner.profiles import profile_to_yaml


def _sync(dev) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize()


def _median_time(fn, dev, repeats: int) -> float:
    fn()
    _sync(dev)
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(dev)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _fwd_bwd_times(module_fn, make_input, dev, repeats: int) -> tuple[float, float]:
    """Median forward time and median backward time of module_fn(x)."""
    fwd, bwd = [], []
    for i in range(repeats + 1):
        x = make_input()
        _sync(dev)
        t0 = time.perf_counter()
        y = module_fn(x)
        _sync(dev)
        t1 = time.perf_counter()
        y.backward(torch_ones_like(y))
        _sync(dev)
        t2 = time.perf_counter()
        if i:  # first run warms up
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
    return statistics.median(fwd), statistics.median(bwd)


def torch_ones_like(t):
    import torch

    return torch.ones_like(t)


def _init_dist(dev) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        # One rank: an in-process store (a file store would leave its directory behind).
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", store=dist.HashStore(),
                                rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)


def _build_layer(model: ModelConfig, dtype, dev):
    import torch
    from megatron.core.models.common.embeddings.rotary_pos_embedding import (
        RotaryEmbedding,
    )
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.spec_utils import build_module

    from megatron_hetermoe.config import ParallelConfig
    from megatron_hetermoe.models.builder import layer_spec, transformer_config

    model_parallel_cuda_manual_seed(1234)
    cfg = transformer_config(model.replace(num_layers=1), ParallelConfig(), params_dtype=dtype, pipeline_dtype=dtype,
                             bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16)
    layer = build_module(layer_spec(model), config=cfg, layer_number=1).to(dev)
    rope = RotaryEmbedding(model.head_dim, rotary_percent=1.0, use_cpu_initialization=True).to(dev)
    return layer, rope


def measure(model: ModelConfig, seq_lens: list[int], seqs: list[int], expert_tokens: list[int], repeats: int,
            a2a_sizes: list[int], dtype_name: str | None = None) -> tuple[dict, dict]:
    """Run every measurement; returns (profile fields, measured section)."""
    import torch
    import torch.distributed as dist

    from megatron_hetermoe.parallel import cpu_backend
    from megatron_hetermoe.planner.cost_model import runtime_program

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cpu_backend.apply()  # no-op with CUDA; bridges megatron-core's CUDA assumptions on CPU
    if dtype_name is None:
        dtype_name = runtime_program().precision  # what the trainers run (fp32 on CPU and GPU)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
    _init_dist(dev)
    layer, rope = _build_layer(model, dtype, dev)
    h = model.hidden_size

    attention = []
    for s in seq_lens:
        emb = rope(s)
        for b in seqs:
            def make():
                return torch.randn(s, b, h, device=dev, dtype=dtype, requires_grad=True)

            def attn_router(x):
                y = layer.input_layernorm(x)
                out, _ = layer.self_attention(y, attention_mask=None, rotary_pos_emb=emb)
                z = layer.pre_mlp_layernorm(out + x)
                probs, _ = layer.mlp.router(z)
                return out.float().sum() + probs.float().sum()

            f, bw = _fwd_bwd_times(attn_router, make, dev, repeats)
            attention.append({"seq_len": s, "tokens": s * b, "fwd_s": f, "bwd_s": bw})
            layer.zero_grad(set_to_none=True)

    expert_mod = layer.mlp.experts.local_experts[0]
    expert = []
    for t in expert_tokens:
        def make_e():
            return torch.randn(t, h, device=dev, dtype=dtype, requires_grad=True)

        def run_e(x):
            out, _ = expert_mod(x)
            return out.float().sum()

        f, bw = _fwd_bwd_times(run_e, make_e, dev, repeats)
        expert.append({"tokens": t, "fwd_s": f, "bwd_s": bw})
        expert_mod.zero_grad(set_to_none=True)

    # device peaks as reached by plain torch ops: the best of a square-GEMM size sweep (one
    # 2048^3 GEMM under-reports a Hopper GPU: it is too small to fill 132 SMs)
    sweep = []
    for n_ in ((2048, 4096, 8192) if dev.type == "cuda" else (256, 512)):
        a = torch.randn(n_, n_, device=dev, dtype=dtype)
        mm = _median_time(functools.partial(torch.mm, a, a), dev, repeats)  # bound now: a is dropped below
        sweep.append({"n": n_, "tflops": round(2 * n_ ** 3 / mm / 1e12, 3)})
        del a
    best = max(sweep, key=lambda r: r["tflops"])
    n, peak_tflops = best["n"], best["tflops"]
    big = torch.empty(64 * 2**20 // 4, device=dev, dtype=torch.float32)
    cp = _median_time(lambda: big.clone(), dev, repeats)
    membw = 2 * big.numel() * 4 / cp / 1e9
    tiny = torch.ones(8, device=dev)
    launch_us = _median_time(lambda: tiny.add_(1), dev, max(repeats, 20)) * 1e6

    world = dist.get_world_size()
    a2a = []
    for nbytes in a2a_sizes:
        numel = max(world, nbytes // 2 // world * world)
        src = torch.ones(numel, device=dev, dtype=torch.float16)
        dst = torch.empty_like(src)
        sec = _median_time(lambda: dist.all_to_all_single(dst, src), dev, repeats)
        a2a.append({"nbytes": numel * 2, "seconds": sec})

    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        mem_gib, name = props.total_memory / 2**30, props.name
        # Native bf16 only (Ampere, sm_80, and later): is_bf16_supported() also says True on
        # V100 and T4, where bf16 runs emulated.
        bf16 = props.major >= 8
        flash = props.major >= 8
    else:
        mem_gib = _cpu_memory_gib()
        name = "cpu"
        bf16, flash = True, False

    attn_params = sum(p.numel() for n_, p in layer.named_parameters() if ".experts." not in n_)
    exp_params = sum(p.numel() for p in expert_mod.parameters())
    info = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or platform.machine(),
        "date": datetime.date.today().isoformat(),
        "torch": str(torch.__version__),
        "megatron_core": _mcore_version(),
        "dtype": dtype_name,
        # The program these tables time (cost_model.Program): megatron-core's local spec has
        # unfused attention; recomputation is the cost model's to add.
        "program": {"precision": dtype_name, "attention": "unfused"},
        "threads": torch.get_num_threads(),
        "world_size_for_all_to_all": world,
        "attention_params_per_layer": int(attn_params),
        "expert_params": int(exp_params),
        "expert_params_match_model_config": int(exp_params) == model.expert_params(),
        "flops_note": "tables are converted to FLOP rates and scaled to other shapes by cost_model.py",
        "gemm_sweep": sweep,  # square matmuls n x n x n in the profile's precision: TFLOP/s
    }
    large = max(expert, key=lambda e: e["tokens"])
    gemm_rate = 6.0 * h * model.moe_ffn_hidden_size * large["tokens"] / large["fwd_s"] / 1e12
    src = f"measured: hetermoe profile on {info['device']} ({dtype_name}, torch {torch.__version__})"
    nbw = max(a2a, key=lambda c: c["nbytes"]) if a2a else None
    nlat = min(a2a, key=lambda c: c["nbytes"]) if a2a else None
    fields = {
        "name": name,
        "fp16": True,
        "bf16": bf16,
        "flash_attention": flash,
        "memory_gib": {"value": round(mem_gib, 2), "source": f"{src}: total device memory"},
        "peak_fp16_tflops": {"value": round(peak_tflops, 4),
                             "source": f"{src}: best square matmul of a size sweep ({n}^3) in {dtype_name} "
                                       f"(an achieved peak, not a datasheet one)"},
        "memory_bandwidth_gbs": {"value": round(membw, 2), "source": f"{src}: 256 MiB clone"},
        "gemm_efficiency": {"value": round(min(1.0, gemm_rate / peak_tflops), 4),
                            "source": f"{src}: expert forward FLOP rate at {large['tokens']} tokens / matmul peak"},
        "attention_core_efficiency": {"value": 0.3, "source": "estimate: unused while the measured tables are present"},
        "intra_node_gbs": {"value": round(nbw["nbytes"] / nbw["seconds"] / 1e9, 3) if nbw else 1.0,
                           "source": f"{src}: all_to_all_single over a world of {world}"
                           + (" (one rank: a local copy, not a link)" if world == 1 else "")},
        "launch_overhead_us": {"value": round(launch_us, 2), "source": f"{src}: median time of an 8-element add"},
        "link_latency_us": {"value": round(nlat["seconds"] * 1e6, 2) if nlat else 10.0,
                            "source": f"{src}: smallest all_to_all_single"},
        "usable_memory_fraction": {"value": 0.9, "source": "estimate: headroom for allocator and runtime"},
    }
    from dataclasses import asdict

    measured = {"model": {k: v for k, v in asdict(model).items()}, "info": info,
                "attention": attention, "expert": expert, "all_to_all": a2a}
    fields.update(_memory_findings(model, fields, measured, dtype))
    return fields, measured


def _memory_findings(model: ModelConfig, fields: dict, measured: dict, dtype) -> dict:
    """n_min / n_max of the paper for an example microbatch of this shape, from the cost model's
    memory formulas and this device's memory (recorded in info, not used by the planner, which
    recomputes them per plan)."""
    from megatron_hetermoe.planner.cost_model import CostModel, TrainSettings

    tokens = max(a["tokens"] for a in measured["attention"])
    usable = fields["memory_gib"]["value"] * 2**30 * fields["usable_memory_fraction"]["value"]
    cm = CostModel(model, {}, TrainSettings(model.seq_length))
    tpe = tokens * model.moe_router_topk / model.num_experts
    per = cm.per_expert_bytes(tpe, 1)
    n_max = int((usable - cm.attention_rank_bytes(tokens, 1)) // per)
    cap = int(usable // per)
    measured["info"]["memory_example"] = {
        "tokens_per_microbatch": tokens, "microbatches": 1, "bytes_per_expert": per,
        "n_max_experts_on_attention_rank": n_max, "experts_that_fit_on_expert_rank": cap,
        "n_min_for_one_expert_rank": max(0, model.num_moe_layers * model.num_experts - cap),  # dense layers hold none
    }
    return {}


# ---------------------------------------------------------------- --gpu-pair
def _pair_rank(rank: int, store: str, backend: str, sizes: list[int], repeats: int, dtype_name: str, q) -> None:
    """One of the two ranks of --gpu-pair (spawned): all_to_all_single at each size."""
    import torch
    import torch.distributed as dist

    try:
        dev = torch.device(f"cuda:{rank}") if backend == "nccl" else torch.device("cpu")
        if backend == "nccl":
            torch.cuda.set_device(dev)
        dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=2)
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
        esize = torch.tensor([], dtype=dtype).element_size()
        rows = []
        for nbytes in sizes:
            numel = max(2, nbytes // esize // 2 * 2)  # even: half stays, half goes to the peer
            src = torch.ones(numel, device=dev, dtype=dtype)
            dst = torch.empty_like(src)
            ts = []
            for i in range(repeats + 1):
                dist.barrier()
                _sync(dev)
                t0 = time.perf_counter()
                dist.all_to_all_single(dst, src)
                _sync(dev)
                if i:  # the first one warms up
                    ts.append(time.perf_counter() - t0)
            t = torch.tensor([statistics.median(ts)], dtype=torch.float64, device=dev)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slower rank's
            rows.append({"nbytes": numel * esize, "peer_bytes": numel * esize // 2, "seconds": float(t.item())})
        name = torch.cuda.get_device_name(dev) if backend == "nccl" else "cpu"
        q.put((rank, {"rows": rows, "device": name}))
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - reported by the parent
        q.put((rank, {"error": f"{type(e).__name__}: {e}"}))


def _fit_link(rows: list[dict]) -> tuple[float, float]:
    """Least squares t = latency + peer_bytes / bandwidth; returns (latency s, bandwidth B/s)."""
    xs = [r["peer_bytes"] for r in rows]
    ys = [r["seconds"] for r in rows]
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var > 0 else 0.0
    if slope <= 0:  # flat (all latency): the bandwidth of the largest message
        big = max(rows, key=lambda r: r["peer_bytes"])
        return min(ys), big["peer_bytes"] / max(big["seconds"], 1e-12)
    return max(0.0, my - slope * mx), 1.0 / slope


def measure_pair(sizes: list[int], repeats: int, dtype_name: str | None = None, timeout_s: float = 300.0) -> dict:
    """Measure the all-to-all between two ranks (two GPUs over NCCL, else two CPU processes over
    gloo); returns the link profile (profiles.load_link_profile reads it back)."""
    import dataclasses
    import multiprocessing as mp
    import queue

    import torch

    from megatron_hetermoe.planner.cost_model import runtime_program

    n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n_gpu == 1:
        raise SystemExit("hetermoe profile --gpu-pair: this node has one GPU; it needs two (of one type or two "
                         "types). Without GPUs it measures two CPU processes over gloo.")
    backend = "nccl" if n_gpu >= 2 else "gloo"
    program = runtime_program()
    dtype_name = dtype_name or program.precision
    store_dir = tempfile.TemporaryDirectory(prefix="hetermoe-pair-")  # removed in the finally below
    store = Path(store_dir.name) / "store"
    ctx = mp.get_context("spawn")  # no fork after CUDA (or torch threads) started
    q = ctx.Queue()
    procs = [ctx.Process(target=_pair_rank, args=(r, str(store), backend, sizes, repeats, dtype_name, q))
             for r in (0, 1)]
    got: dict[int, dict] = {}
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        while len(got) < 2:
            if time.monotonic() > deadline:
                raise SystemExit(f"hetermoe profile --gpu-pair: no result after {timeout_s:.0f} s")
            try:
                r, res = q.get(timeout=1.0)
            except queue.Empty:
                dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead:
                    raise SystemExit(f"hetermoe profile --gpu-pair: rank {dead[0]} died "
                                     f"(exit code {procs[dead[0]].exitcode})") from None
                continue
            if "error" in res:
                raise SystemExit(f"hetermoe profile --gpu-pair: rank {r}: {res['error']}")
            got[r] = res
    finally:
        for p in procs:
            if p.pid is None:
                continue
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
        store_dir.cleanup()
    rows = got[0]["rows"]
    lat, bw = _fit_link(rows)
    devices = [got[0]["device"], got[1]["device"]]
    if backend == "gloo":
        what = "CPU/gloo: two CPU processes over gloo on this host, not a GPU link; for CPU runs only"
    else:
        what = f"NCCL between {devices[0]} and {devices[1]} on this node"
    src = f"measured: hetermoe profile --gpu-pair, all_to_all between 2 ranks, {what} ({dtype_name} messages)"
    return {
        "kind": "gpu-pair",
        "devices": devices,
        "backend": backend,
        "note": what,
        "precision": dtype_name,  # of the messages: the runtime's unless --dtype
        "program": dict(dataclasses.asdict(program), precision=dtype_name),
        "date": datetime.date.today().isoformat(),
        "torch": str(torch.__version__),
        "host": platform.node() or platform.machine(),
        "link_latency_us": {"value": round(lat * 1e6, 3), "source": f"{src}: fitted latency"},
        "intra_node_gbs": {"value": round(bw / 1e9, 4),
                           "source": f"{src}: fitted bandwidth of the bytes each rank sends its peer"},
        "all_to_all": rows,
    }


def _cpu_memory_gib() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return 8.0


def _mcore_version() -> str:
    try:
        from importlib.metadata import version

        return version("megatron-core")
    except Exception:  # noqa: BLE001 - a version string is informational
        return "unknown"


def _main_pair(args) -> int:
    import yaml

    from megatron_hetermoe.planner.profiles import load_link_profile

    prof = measure_pair(args.a2a_bytes, args.repeats, args.dtype)
    header = (f"# Measured by `hetermoe profile --gpu-pair` on {prof['host']}, {prof['date']}: {prof['note']}.\n"
              f"# link_latency_us and intra_node_gbs have the form of a GPU profile's fields (configs/gpus/).\n")
    Path(args.out).write_text(header + yaml.safe_dump(prof, sort_keys=False, default_flow_style=None, width=110))
    load_link_profile(args.out)  # the file must load back
    print(f"wrote {args.out}: all_to_all between 2 ranks ({prof['backend']}, {prof['devices'][0]} / "
          f"{prof['devices'][1]}, {prof['precision']} messages): latency {prof['link_latency_us']['value']:.1f} us, "
          f"{prof['intra_node_gbs']['value']:.3g} GB/s" + (" -- CPU/gloo numbers, not a GPU link"
                                                          if prof["backend"] == "gloo" else ""))
    return 0


def main(argv: list[str] | None = None) -> int:
    from megatron_hetermoe.cli.profile import build_parser

    p = build_parser(__doc__)
    args = p.parse_args(argv)
    from megatron_hetermoe.outputs import writable_file

    writable_file("--out", args.out)  # before the minutes of measuring
    if args.gpu_pair:
        if args.repeats < 1:
            print(f"hetermoe profile: --repeats {args.repeats} must be >= 1", file=sys.stderr)
            return 2
        return _main_pair(args)
    if not args.model:
        p.error("--model is required (or --gpu-pair)")
    model = ModelConfig.load(args.model)
    S = model.seq_length
    seq_lens = args.seq_lens or sorted({max(8, S // 4), max(8, S // 2), S})
    expert_tokens = args.expert_tokens or sorted({max(8, S // 4), S, 4 * S, 16 * S})
    if args.repeats < 1:
        print(f"hetermoe profile: --repeats {args.repeats} must be >= 1", file=sys.stderr)
        return 2
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    fields, measured = measure(model, seq_lens, args.seqs, expert_tokens, args.repeats, args.a2a_bytes, args.dtype)
    if args.name:
        fields["name"] = args.name
    header = (f"# Measured by `hetermoe profile --model {args.model}` on {measured['info']['device']}, "
              f"{measured['info']['date']}.\n# Tables: seconds per call for the model shape under measured.model; "
              f"the cost model scales them by FLOPs.\n")
    Path(args.out).write_text(header + profile_to_yaml(fields, measured))
    from megatron_hetermoe.planner.profiles import load_profile

    load_profile(args.out)  # the file must load back
    print(f"wrote {args.out}: {len(measured['attention'])} attention and {len(measured['expert'])} expert "
          f"samples, {len(measured['all_to_all'])} all_to_all sizes")
    return 0


if __name__ == "__main__":
    from megatron_hetermoe.errors import run_command

    sys.exit(run_command("hetermoe profile", main))
