"""The GPU check's timing probes, each the entry point of a subprocess (`main.py --worker NAME`):
one MoE layer's forward+backward (megatron-core's MoELayer vs HeteroMoELayer), and, GPU only,
GEMM against a copy / all_to_all on two CUDA streams and the zebra executor's streams and
single issuer."""
from __future__ import annotations

import functools
import json
import time

from runner import emit
from workers import init_single


def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def worker_moe_layer(a) -> int:
    """fwd+bwd time of one MoE layer: megatron-core MoELayer or HeteroMoELayer (1-rank world)."""
    import torch

    from megatron_hetermoe.config import ModelConfig, ParallelConfig
    from megatron_hetermoe.models.builder import (
        build_gpt,
        layer_spec,
        transformer_config,
    )

    dev = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    model = ModelConfig.load(a.model).replace(num_layers=1)
    S = min(model.seq_length, a.tokens)
    B = max(1, a.tokens // S)
    init_single(dev)
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1, device=dev))

    def cfg_for(dt, **kw):
        return transformer_config(model, ParallelConfig(), params_dtype=dt, pipeline_dtype=dt,
                                  bf16=dt == torch.bfloat16, use_cpu_initialization=dev.type == "cpu", **kw)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def time_mlp(mlp, dt) -> dict:
        mlp.to(dev).train()
        x = torch.randn(S, B, model.hidden_size, device=dev, dtype=dt, requires_grad=True)
        tot, fwd = [], []
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        for i in range(a.repeats + 2):
            sync()
            t0 = time.perf_counter()
            out, _ = mlp(x)
            sync()
            t1 = time.perf_counter()
            out.float().sum().backward()
            sync()
            t2 = time.perf_counter()
            mlp.zero_grad(set_to_none=True)
            x.grad = None
            if i >= 2:  # two warm-ups
                tot.append(t2 - t0)
                fwd.append(t1 - t0)
        row = {"ms": _median(tot) * 1e3, "min_ms": min(tot) * 1e3, "fwd_ms": _median(fwd) * 1e3}
        if dev.type == "cuda":
            row["peak_gib"] = torch.cuda.max_memory_allocated(dev) / 2**30
        return row

    times = {}
    if a.impl == "megatron":
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        parallel_state.initialize_model_parallel(1, 1)
        model_parallel_cuda_manual_seed(1234)
        for name in a.dtypes.split(","):
            dt = dtypes[name]
            gpt = build_gpt(model, cfg_for(dt))
            mlp = gpt.decoder.layers[0].mlp
            kind = type(mlp).__name__
            times[name] = time_mlp(mlp, dt)
            del gpt, mlp
    else:
        from megatron_hetermoe.models.moe_layer import hetero_layer_spec
        from megatron_hetermoe.parallel.megatron_globals import megatron_globals
        from megatron_hetermoe.parallel.state import initialize_hetero_parallel
        from megatron_hetermoe.plan.hetero_plan import HeteroPlan, ZPGroup

        plan = HeteroPlan(1, model.num_experts, ["cpu"], [ZPGroup([0], [], [{0: list(range(model.num_experts))}])],
                          1, "distep")
        hs = initialize_hetero_parallel(plan, device=dev)
        with megatron_globals(hs, 1234):
            pgc = hs.pg_collection()
            for name in a.dtypes.split(","):
                dt = dtypes[name]
                # expert_model_parallel_size=2 as the trainer: only marks expert weights allreduce=False
                spec = hetero_layer_spec(layer_spec(model), hs, pgc)
                gpt = build_gpt(model, cfg_for(dt, expert_model_parallel_size=2), spec=spec, pg_collection=pgc)
                mlp = gpt.decoder.layers[0].mlp
                kind = type(mlp).__name__
                times[name] = time_mlp(mlp, dt)
                del gpt, mlp
    for k, v in times.items():
        print(f"{a.impl} {kind} {k}: {v}")
    emit({"impl": a.impl, "class": kind, "device": str(dev), "shape": f"{model.name} [{S}x{B}x{model.hidden_size}] "
           f"{model.num_experts} experts top-{model.moe_router_topk}", "times": times})
    return 0


def worker_overlap(a) -> int:
    """GPU only: GEMM vs copy / all_to_all on two streams, and the zebra executor's streams."""
    import torch
    import torch.distributed as dist

    dev = torch.device("cuda", 0)
    init_single(dev)
    res: dict = {}
    n = 8192
    A = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    Bm = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    C = torch.empty(n, n, device=dev, dtype=torch.bfloat16)

    def timed(fn, reps: int = 3) -> float:
        fn()
        torch.cuda.synchronize()
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            ts.append(time.perf_counter() - t0)
        return min(ts)

    def calibrate(unit, target: float) -> int:
        t = timed(lambda: [unit() for _ in range(4)], 2) / 4
        return max(1, int(round(target / max(t, 1e-7))))

    gemm = lambda: torch.mm(A, Bm, out=C)  # noqa: E731
    kg = calibrate(gemm, 0.08)
    gemm_loop = lambda: [gemm() for _ in range(kg)]  # noqa: E731
    src = torch.empty(2**30, device=dev, dtype=torch.uint8)
    dst = torch.empty_like(src)
    copy = functools.partial(dst.copy_, src)  # bound now: src and dst are dropped later
    s1, s2 = torch.cuda.Stream(dev), torch.cuda.Stream(dev)

    def pair(comm_unit, k: int) -> dict:
        comm_loop = lambda: [comm_unit() for _ in range(k)]  # noqa: E731

        def on(s, f):
            def g():
                with torch.cuda.stream(s):
                    f()
            return g

        t_g = timed(on(s1, gemm_loop))
        t_c = timed(on(s2, comm_loop))

        def both():
            with torch.cuda.stream(s1):
                gemm_loop()
            with torch.cuda.stream(s2):
                comm_loop()

        t_b = timed(both)
        return {"t_gemm": t_g, "t_comm": t_c, "t_both": t_b, "ratio": (t_g + t_c) / t_b, "k_gemm": kg, "k_comm": k}

    res["copy"] = pair(copy, calibrate(copy, 0.08))
    try:
        g = dist.new_group([0])
        x = torch.ones(128 * 2**20, device=dev, dtype=torch.bfloat16)  # 256 MiB
        y = torch.empty_like(x)
        a2a = lambda: dist.all_to_all_single(y, x, group=g)  # noqa: E731
        res["a2a"] = pair(a2a, calibrate(a2a, 0.08))
    except Exception as e:  # noqa: BLE001
        res["a2a_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    del src, dst
    torch.cuda.empty_cache()
    try:
        res["executor"] = _executor_probe(dev, gemm, timed, calibrate)
    except Exception as e:  # noqa: BLE001
        import traceback

        traceback.print_exc()
        res["executor_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    print(json.dumps(res, indent=1))
    emit(res)
    return 0


def _executor_probe(dev, gemm, timed, calibrate, numel: int = 64 * 2**20) -> dict:
    """The zebra executor on an expert rank's list (L=1, R=4) with GEMM compute and all_to_all
    transfers (world of 1: a copy through NCCL, one group per stream), CudaStream vs ThreadStream,
    and the single issuer (schedules/issuer.py: async collectives, a counts exchange per D_F on a
    third group). Each compute task writes its outputs after a long GEMM and each transfer sends a compute
    output (and vice versa), so a missing event wait shows as a wrong value."""
    import torch
    import torch.distributed as dist

    from megatron_hetermoe.plan.tasks import zebra_tasks_for_role
    from megatron_hetermoe.schedules.executor import (
        CudaStream,
        TaskExecutor,
        ThreadStream,
    )
    from megatron_hetermoe.schedules.issuer import AsyncTransfer, IssueExecutor

    groups = {"dispatch": dist.new_group([0]), "combine": dist.new_group([0]), "counts": dist.new_group([0])}
    R = 4
    tasks = zebra_tasks_for_role(1, R, "expert")
    # numel: 64 Mi elements = 128 MiB bf16 per message
    probe_x = torch.ones(numel, device=dev, dtype=torch.bfloat16)
    probe_y = torch.empty_like(probe_x)
    unit = functools.partial(dist.all_to_all_single, probe_y, probe_x, group=groups["dispatch"])  # bound now
    k_tx = calibrate(unit, 0.006)
    k_c = calibrate(gemm, 0.006)
    del probe_x, probe_y

    def run_once(make_stream) -> tuple[float, bool]:
        send_df = {j: torch.full((numel,), float(j + 1), device=dev, dtype=torch.bfloat16) for j in range(R)}
        out_f = {j: torch.full((numel,), -1.0, device=dev, dtype=torch.bfloat16) for j in range(R)}
        out_b = {j: torch.full((numel,), -1.0, device=dev, dtype=torch.bfloat16) for j in range(R)}
        res_b = {j: torch.full((numel,), -1.0, device=dev, dtype=torch.bfloat16) for j in range(R)}
        recv: dict = {}
        torch.cuda.synchronize()

        def compute(t):
            for _ in range(k_c):
                gemm()
            if t.kind == "E_F":
                x = recv[("D_F", t.microbatch)]
                out_f[t.microbatch].copy_(x * 2)
                out_b[t.microbatch].copy_(x * 3)
            else:  # E_B
                res_b[t.microbatch].copy_(recv[("C_B", t.microbatch)] + 1)

        def transfer(t):
            def fn():
                j = t.microbatch
                send = {"D_F": send_df, "C_F": out_f, "C_B": out_b, "D_B": res_b}[t.kind][j]
                out = torch.empty_like(send)
                for _ in range(k_tx):
                    dist.all_to_all_single(out, send, group=groups[t.stream])
                recv[(t.kind, j)] = out
            return fn

        def start(t, counts):
            def launch():
                j = t.microbatch
                send = {"D_F": send_df, "C_F": out_f, "C_B": out_b, "D_B": res_b}[t.kind][j]
                out = torch.empty_like(send)
                recv[(t.kind, j)] = out
                return [dist.all_to_all_single(out, send, group=groups[t.stream], async_op=True) for _ in range(k_tx)]

            if t.kind != "D_F":
                return AsyncTransfer(ready=lambda: True, launch=launch)

            def exchange():
                c = torch.full((1,), t.microbatch, dtype=torch.int64, device=dev)
                got = torch.empty_like(c)
                return got, dist.all_to_all_single(got, c, group=groups["counts"], async_op=True)

            ticket = counts(exchange)
            return AsyncTransfer(ready=ticket.arrived, launch=launch)

        t0 = time.perf_counter()
        if make_stream == "single":
            IssueExecutor(1, None, device=dev).run(tasks, compute, start)
        else:
            TaskExecutor(1, None, make_stream=make_stream).run(tasks, compute, transfer)
        torch.cuda.synchronize()
        sec = time.perf_counter() - t0
        ok = True
        for j in range(R):
            v = float(j + 1)
            ok &= bool((recv[("C_F", j)] == 2 * v).all()) and bool((recv[("C_B", j)] == 3 * v).all())
            ok &= bool((recv[("D_B", j)] == 3 * v + 1).all())
        return sec, ok

    from functools import partial

    cuda_stream = partial(CudaStream, device=dev)
    run_once(ThreadStream)  # warm-up (NCCL communicators, kernels)
    run_once(cuda_stream)
    t_thread, ok_thread = min((run_once(ThreadStream) for _ in range(3)), key=lambda x: x[0])
    t_cuda, ok_cuda = min((run_once(cuda_stream) for _ in range(3)), key=lambda x: x[0])
    run_once("single")
    t_single, ok_single = min((run_once("single") for _ in range(3)), key=lambda x: x[0])
    n_compute = sum(not t.is_comm for t in tasks)
    n_tx = sum(t.is_comm for t in tasks)
    t_compute = timed(lambda: [gemm() for _ in range(k_c * n_compute)], 2)
    x = torch.ones(numel, device=dev, dtype=torch.bfloat16)
    y = torch.empty_like(x)
    t_transfer = timed(lambda: [dist.all_to_all_single(y, x, group=groups["dispatch"]) for _ in range(k_tx * n_tx)], 2)
    return {"tasks": f"expert rank, L=1, R={R}: {n_compute} compute, {n_tx} transfers", "t_thread": t_thread,
            "t_cuda": t_cuda, "speedup": t_thread / t_cuda, "ok_thread": ok_thread, "ok_cuda": ok_cuda,
            "t_single": t_single, "speedup_single": t_thread / t_single, "ok_single": ok_single,
            "t_compute": t_compute, "t_transfer": t_transfer, "k_gemm": k_c, "k_a2a": k_tx}


SYNC_TEXT = "synchronizing CUDA operation"  # c10's warning under torch.cuda.set_sync_debug_mode("warn")


class SyncCounter:
    """Host syncs inside a `with` block, under torch.cuda.set_sync_debug_mode("warn"): the warnings
    raised on this thread (each with the Python line that made it) and, since a warning raised in
    the autograd engine's device thread may reach only c10's logger, the lines it writes to fd 2
    (no line number). counted is None where there is no CUDA (nothing to count)."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.py_sites: list[str] = []
        self.c10 = 0

    @property
    def counted(self) -> int | None:
        return len(self.py_sites) + self.c10 if self.cuda else None

    def __enter__(self):
        import os
        import sys
        import tempfile
        import warnings

        if not self.cuda:
            return self
        import torch

        torch.cuda.synchronize()
        self._cw = warnings.catch_warnings(record=True)
        self._rec = self._cw.__enter__()
        warnings.simplefilter("always")
        sys.stderr.flush()
        self._saved = os.dup(2)
        self._tmp = tempfile.TemporaryFile()
        os.dup2(self._tmp.fileno(), 2)
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc):
        import os
        import sys

        if not self.cuda:
            return False
        import torch

        torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()  # the block's queued work is done (not counted: the mode is off)
        sys.stderr.flush()
        os.dup2(self._saved, 2)
        os.close(self._saved)
        self._tmp.seek(0)
        text = self._tmp.read().decode(errors="replace")
        self._tmp.close()
        self._cw.__exit__(*exc)
        self.c10 = text.count(SYNC_TEXT)
        self.py_sites = [f"{_short(w.filename)}:{w.lineno}" for w in self._rec if SYNC_TEXT in str(w.message)]
        if text.strip():  # whatever else the block printed to stderr stays visible
            print(text.replace(SYNC_TEXT, "[sync]")[-2000:], file=sys.stderr)
        return False


def _short(path: str) -> str:
    for mark in ("megatron_hetermoe/", "megatron/core/", "torch/"):
        i = path.rfind(mark)
        if i >= 0:
            return path[i:]
    return path


# Sites of the route's one host read of the counts per (layer, microbatch) (parallel/transport.py,
# SplitRoute): the split sizes of the transfers must be on the host; not a compute task's sync.
ROUTE_SITES = ("megatron_hetermoe/parallel/transport.py",)


def worker_host_syncs(a) -> int:
    """Host syncs per MoE layer forward+backward (issue 43 item 6), in one process: the attention
    side, HeteroMoELayer as the trainer builds it (kernels for this device, RoleAssembly) in a
    world of one rank holding every expert (its route reads the counts once; its experts run
    through run_local_experts); and the expert runtime's computation of a layer,
    models/experts.run_local_experts, on tokens from two source members (the chunk sort an
    expert rank does). Two warm-ups, then `--iters` counted iterations of each."""
    import torch

    from megatron_hetermoe.config import HeteroRunConfig, ModelConfig, ParallelConfig, TrainConfig
    from megatron_hetermoe.models.builder import choose_kernels, gpt_kwargs, layer_spec, transformer_config
    from megatron_hetermoe.models.experts import run_local_experts
    from megatron_hetermoe.parallel.megatron_globals import megatron_globals
    from megatron_hetermoe.parallel.state import initialize_hetero_parallel
    from megatron_hetermoe.plan.hetero_plan import HeteroPlan, ZPGroup
    from megatron_hetermoe.training.assembly import RoleAssembly, model_config

    cuda = torch.cuda.is_available()
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    model = ModelConfig.load(a.model).replace(num_layers=1)
    init_single(dev)
    plan = HeteroPlan(1, model.num_experts, ["cpu"], [ZPGroup([0], [], [{0: list(range(model.num_experts))}])],
                      1, "zebra")
    hs = initialize_hetero_parallel(plan, device=dev)
    cfg = TrainConfig(model=model, micro_batch_size=2, global_batch_size=2, train_iters=1)
    res: dict = {"device": str(dev), "iters": a.iters}
    with megatron_globals(hs, 1234):
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

        MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1, device=dev))
        kernels = choose_kernels(dev, "fp32")
        config = model_config(transformer_config(model, ParallelConfig(), "fp32", kernels=kernels.name), hs)
        module, _ = RoleAssembly(hs, HeteroRunConfig().pools(cfg)).module(config, layer_spec(model, kernels.name), 1234,
                                                                        gpt_kwargs(model))
        module.to(dev).train()
        mlp = module.decoder.layers[0].mlp
        res["kernels"] = kernels.name
        res["layer"] = type(mlp).__name__
        S, B, H = model.seq_length, 2, model.hidden_size
        x = torch.randn(S, B, H, device=dev, requires_grad=True)

        def attention_side():
            out, _ = mlp(x)
            out.float().sum().backward()

        n = model.num_experts
        counts = torch.tensor([[(3 * s + e) % 5 + 1 for e in range(n)] for s in range(2)], dtype=torch.int64)
        recv = torch.randn(int(counts.sum()), H, device=dev, requires_grad=True)

        def expert_side():
            y = run_local_experts(mlp.experts, recv, counts)
            y.float().sum().backward()

        for name, fn in (("attention", attention_side), ("expert", expert_side)):
            for _ in range(2):  # warm-ups: lazy allocations, caches
                fn()
            with SyncCounter(cuda) as sc:
                for _ in range(a.iters):
                    fn()
            sites: dict[str, int] = {}
            for s in sc.py_sites:
                sites[s] = sites.get(s, 0) + 1
            route = sum(v for s, v in sites.items() if s.startswith(ROUTE_SITES))
            res[name] = {"total": sc.counted, "route": route, "py": len(sc.py_sites), "c10": sc.c10,
                         "sites": dict(sorted(sites.items(), key=lambda kv: -kv[1])[:8])}
            print(f"{name}: {res[name]}")
    emit(res)
    return 0
