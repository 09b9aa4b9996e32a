"""The GPU check's workers that are not timing probes, each the entry point of a subprocess
(`main.py --worker NAME`, under torchrun when it takes ranks): the environment probe, the
4-rank preflight, and the fallbacks' gloo all_to_all on CUDA tensors and train_hetero over gloo;
init_single makes a world of one process for the probes too."""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from runner import emit


# What the check imports, by distribution: the plugin's requirements (setup.py) and what
# Megatron-LM's training side imports (megatron/training: pretrain_gpt.py's imports, checked on the
# core_v0.16.1 tree; pydantic through megatron.rl). (module, distribution, who needs it)
NEEDED = (("megatron.core", "megatron-core", "plugin"), ("einops", "einops", "plugin"), ("yaml", "pyyaml", "plugin"),
          ("numpy", "numpy", "plugin"), ("psutil", "psutil", "plugin"), ("tokenizers", "tokenizers", "plugin"),
          ("six", "six", "Megatron-LM"), ("regex", "regex", "Megatron-LM"), ("pydantic", "pydantic", "Megatron-LM"),
          ("triton", "triton", "Megatron-LM"))
# Megatron-LM compiles its dataset helpers at start (megatron/core/datasets/Makefile).
BUILD_TOOLS = ("make", "c++", "python3-config")


def _version(dist_name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist_name)
    except PackageNotFoundError:
        return None


def worker_env(a) -> int:
    """What is here and what is missing: Python, torch, the GPU, NCCL, each package the check
    imports (imported one by one, so one missing does not hide the others), the build tools of
    Megatron-LM's dataset helpers, transformer-engine and apex. Never fails on a missing package:
    the orchestrator says what is missing."""
    import importlib
    import platform
    import shutil as sh
    import sysconfig

    import torch

    info = {"python": platform.python_version(), "torch": torch.__version__, "cuda_build": torch.version.cuda,
            "cuda_available": torch.cuda.is_available(), "cpus": os.cpu_count(), "gpus": [], "packages": {},
            "missing": []}
    if info["cuda_available"]:
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            info["gpus"].append({"name": p.name, "memory_gib": p.total_memory / 2**30,
                                 "capability": f"{p.major}{p.minor}", "sms": p.multi_processor_count})
        try:
            v = torch.cuda.nccl.version()
            info["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception as e:  # noqa: BLE001
            info["nccl"] = f"n/a ({e})"
        info["bf16"] = torch.cuda.is_bf16_supported()
        try:  # Megatron-LM's start-up runs CUDA_HOME/bin/nvcc -V (megatron/legacy/fused_kernels)
            from torch.utils.cpp_extension import CUDA_HOME

            info["cuda_home"] = CUDA_HOME
        except Exception as e:  # noqa: BLE001
            info["cuda_home"] = f"n/a ({type(e).__name__}: {e})"
    for mod, dist_name, who in NEEDED:
        try:
            importlib.import_module(mod)
            info["packages"][dist_name] = _version(dist_name) or "imports"
        except BaseException as e:  # noqa: BLE001 - a broken install raises more than ImportError
            info["packages"][dist_name] = None
            info["missing"].append({"dist": dist_name, "module": mod, "for": who, "error": f"{type(e).__name__}: {e}"})
    info["megatron_core"] = info["packages"].get("megatron-core") or "not installed"
    for mod, key in (("transformer_engine.pytorch", "transformer_engine"), ("apex", "apex")):
        try:
            m = importlib.import_module(mod)
            info[key] = f"imports ({getattr(sys.modules[mod.split('.')[0]], '__version__', '?')})"
            del m
        except BaseException as e:  # noqa: BLE001 - an import can fail in many ways
            info[key] = f"no ({type(e).__name__}: {str(e)[:120]})"
    # The PATH Megatron-LM's helpers build sees (steps.megatron_lm_env): this interpreter's
    # directory, then its base installation's.
    path = os.pathsep.join([os.path.dirname(sys.executable), sysconfig.get_config_var("BINDIR") or "",
                            os.environ.get("PATH", "")])
    info["build_tools"] = {t: sh.which(t, path=path) for t in BUILD_TOOLS}
    include = sysconfig.get_paths().get("include") or ""
    info["python_h"] = os.path.exists(os.path.join(include, "Python.h"))
    try:
        import megatron_hetermoe  # noqa: F401
        import megatron_hetermoe.training.hetero  # noqa: F401  - the trainer's imports (megatron-core's)

        info["hetermoe_imports"] = True
    except BaseException as e:  # noqa: BLE001
        info["hetermoe_imports"] = f"{type(e).__name__}: {e}"
    for k, v in info.items():
        print(f"{k}: {v}")
    emit(info)
    return 0


# ---- preflight: four ranks of the world, every group kind, every collective the product uses ----
A2A_ROW = 4096  # floats per row of the uneven all_to_all (16 KiB)
A2A_BIG_ROWS = 300  # the largest split: 4.9 MB, above NCCL's 4 MiB buffer
P2P_NUMEL = 2**21  # fp32 elements of the paired exchange: 8 MiB each way


def _splits(rank: int, peers: list[int], salt: int) -> list[int]:
    """Rows rank sends to each peer: uneven, zeros included, one above NCCL's buffer."""
    return [(0, 1, A2A_BIG_ROWS, 3)[(rank + 2 * i + salt) % 4] for i in range(len(peers))]


def _groups_check(hs, device) -> dict:
    """Every group kind of this rank (parallel/layout.GROUP_KINDS through HeteroParallelState.group):
    its members are the layout's, and an all_reduce over it sums their ranks."""
    import torch
    import torch.distributed as dist

    from megatron_hetermoe.parallel.layout import GROUP_KINDS

    out = {}
    for kind in GROUP_KINDS:
        try:
            want, g = hs.layout.ranks(kind), hs.group(kind)
        except Exception as e:  # noqa: BLE001 - the product's group API as this harness knows it
            out[kind] = f"MISSING ({type(e).__name__}: {str(e)[:120]})"
            continue
        if g is None:
            out[kind] = "none" if want is None or len(want) == 1 else f"MISSING (want {want})"
            continue
        got = dist.get_process_group_ranks(g)
        t = torch.tensor([float(hs.rank)], device=device)
        dist.all_reduce(t, group=g)
        ok = sorted(got) == sorted(want or []) and float(t.item()) == float(sum(got))
        out[kind] = f"ok {len(got)}" if ok else f"WRONG members {got} want {want}, sum {t.item()}"
    for comm in ("dispatch", "combine", "counts"):
        g = hs.group(comm)
        got = dist.get_process_group_ranks(g)
        out[comm] = f"ok {len(got)}" if sorted(got) == sorted(hs.layout.ranks("zp")) else f"WRONG {got}"
    return out


def _three_communicators(hs, device) -> str:
    """Uneven all_to_all_single with zero splits on the dispatch, combine and counts
    communicators at once (all issued async, then waited), values checked."""
    import torch
    import torch.distributed as dist

    members = sorted(dist.get_process_group_ranks(hs.group("dispatch")))
    me = members.index(hs.rank)
    works, checks = [], []
    for salt, comm, dtype in ((0, "dispatch", torch.float32), (1, "combine", torch.float32),
                              (2, "counts", torch.int64)):
        g = hs.group(comm)
        width = 1 if dtype == torch.int64 else A2A_ROW
        send = _splits(me, members, salt)
        recv = [_splits(k, members, salt)[me] for k in range(len(members))]
        x = torch.cat([torch.full((send[k], width), 1000 * me + 10 * k + salt, dtype=dtype, device=device)
                       for k in range(len(members))])
        out = torch.full((sum(recv), width), -1, dtype=dtype, device=device)
        works.append(dist.all_to_all_single(out, x, recv, send, group=g, async_op=True))
        want = torch.cat([torch.full((recv[k], width), 1000 * k + 10 * me + salt, dtype=dtype)
                          for k in range(len(members))])
        checks.append((comm, out, want, recv))
    for w in works:
        w.wait()
    bad = [f"{c} (splits in {r})" for c, out, want, r in checks if not torch.equal(out.cpu(), want)]
    if bad:
        raise AssertionError(f"all_to_all values wrong on {', '.join(bad)}")
    return "ok: " + ", ".join(f"{c} in {r}" for c, _, _, r in checks)


def _world_collectives(device) -> dict:
    """all_reduce, broadcast, all_gather, reduce_scatter and batched p2p over the world, values checked."""
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    res = {}

    def run(name, fn):
        try:
            res[name] = fn()
        except Exception as e:  # noqa: BLE001 - reported per collective
            res[name] = f"FAILED {type(e).__name__}: {str(e)[:200]}"

    def all_reduce():
        t = torch.full((P2P_NUMEL,), float(rank + 1), device=device)
        dist.all_reduce(t)
        assert bool((t == world * (world + 1) / 2).all()), "sum wrong"
        return "ok"

    def broadcast():
        t = torch.full((1024,), float(rank), device=device)
        dist.broadcast(t, src=world - 1)
        assert bool((t == world - 1).all()), "values wrong"
        return "ok"

    def all_gather():
        t = torch.full((1024,), float(rank), device=device)
        out = torch.empty(world * 1024, device=device)
        dist.all_gather_into_tensor(out, t)
        assert torch.equal(out.cpu(), torch.arange(world).float().repeat_interleave(1024)), "values wrong"
        return "ok"

    def reduce_scatter():
        t = torch.arange(world * 1024, dtype=torch.float32, device=device)
        out = torch.empty(1024, device=device)
        dist.reduce_scatter_tensor(out, t)
        assert torch.equal(out.cpu(), world * torch.arange(rank * 1024, (rank + 1) * 1024).float()), "values wrong"
        return "ok"

    def p2p():
        # A ring, then each pair (0,1), (2,3) sending and receiving 8 MiB at once: pipeline stages'
        # crossing send/recv, fused in one batch as Megatron's send_forward_recv_backward does.
        nxt, prv = (rank + 1) % world, (rank - 1) % world
        a = torch.full((1024,), float(rank), device=device)
        b = torch.empty(1024, device=device)
        for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, a, nxt), dist.P2POp(dist.irecv, b, prv)]):
            w.wait()
        assert bool((b == prv).all()), "ring values wrong"
        peer = rank ^ 1
        x = torch.full((P2P_NUMEL,), float(rank), device=device)
        y = torch.empty(P2P_NUMEL, device=device)
        for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, x, peer), dist.P2POp(dist.irecv, y, peer)]):
            w.wait()
        assert bool((y == peer).all()), "pair values wrong"
        return "ok"

    for name, fn in (("all_reduce", all_reduce), ("broadcast", broadcast), ("all_gather", all_gather),
                     ("reduce_scatter", reduce_scatter), ("batch_isend_irecv", p2p)):
        run(name, fn)
    return res


def worker_preflight(a) -> int:
    """One rank of the preflight (`torchrun ... rank.py main.py --worker preflight --plan P,...`):
    the product's own start (parallel/device.init_distributed: NCCL on a GPU, gloo on the CPU),
    the groups of each plan built by parallel/state.initialize_hetero_parallel, then the
    collectives. Rank 0 emits every rank's findings."""
    import torch
    import torch.distributed as dist

    from megatron_hetermoe.parallel.device import init_distributed
    from megatron_hetermoe.parallel.state import initialize_hetero_parallel
    from megatron_hetermoe.plan.hetero_plan import HeteroPlan

    t0 = time.perf_counter()
    device = init_distributed()
    mine: dict = {"rank": dist.get_rank(), "device": str(device), "backend": str(dist.get_backend()),
                  "nccl_hostid": os.environ.get("NCCL_HOSTID"), "groups": {}}
    ok = True
    try:
        for path in a.plan.split(","):
            name = Path(path).stem
            t = time.perf_counter()
            hs = initialize_hetero_parallel(HeteroPlan.load(path), device=device)
            mine["groups"][name] = _groups_check(hs, device)
            mine["groups"][name]["seconds"] = round(time.perf_counter() - t, 2)
            ok &= all(not str(v).startswith(("WRONG", "MISSING")) for v in mine["groups"][name].values())
            if name == Path(a.plan.split(",")[0]).stem:
                first = hs
        mine["all_to_all_3_communicators"] = _three_communicators(first, device)
    except Exception as e:  # noqa: BLE001 - reported
        import traceback

        traceback.print_exc()
        mine["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        ok = False
    mine["world"] = _world_collectives(device)
    # The world's collectives decide whether the 4-rank steps can run at all (else: the fallbacks);
    # a group kind's failure is the product's (or an API this harness no longer matches).
    mine["world_ok"] = all(v == "ok" for v in mine["world"].values())
    mine["ok"] = ok and mine["world_ok"]
    mine["seconds"] = round(time.perf_counter() - t0, 2)
    if device.type == "cuda":
        torch.cuda.synchronize()
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    print(json.dumps(mine, default=str))
    if dist.get_rank() == 0:
        emit({"ok": all(r["ok"] for r in every), "world_ok": all(r["world_ok"] for r in every), "ranks": every})
    dist.barrier()
    dist.destroy_process_group()
    return 0


def init_single(dev) -> None:
    """A world of one process (NCCL on a GPU, gloo on the CPU)."""
    import torch
    import torch.distributed as dist

    if dev.type == "cpu":
        from megatron_hetermoe.parallel import cpu_backend

        cpu_backend.apply()
    else:
        torch.cuda.set_device(dev)
    import atexit

    tmp = tempfile.mkdtemp(prefix="gpu-check-store-")
    atexit.register(shutil.rmtree, tmp, True)
    store = Path(tmp) / "store"
    kw = {"device_id": dev} if dev.type == "cuda" else {}
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", init_method=f"file://{store}",
                            rank=0, world_size=1, **kw)


def worker_gloo_a2a(a) -> int:
    """2 ranks (torchrun), one GPU, gloo: all_to_all_single on CUDA tensors with uneven splits."""
    import datetime

    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    res = {"ok": False, "rank": rank}
    try:
        W, H = 2, 8
        send_splits = [rank + 1, 2 * rank + 3]  # rows to rank 0, rank 1
        x = torch.cat([torch.full((send_splits[k], H), float(100 * rank + k), device=dev) for k in range(W)])
        recv_splits = [k + 1 if rank == 0 else 2 * k + 3 for k in range(W)]  # what rank k sends to me
        out = x.new_empty(sum(recv_splits), H)
        dist.all_to_all_single(out, x, recv_splits, send_splits)
        want = torch.cat([torch.full((recv_splits[k], H), float(100 * k + rank)) for k in range(W)])
        assert out.device.type == "cuda"
        ok = bool(torch.equal(out.cpu(), want))
        big = torch.ones(32 * 2**20, device=dev, dtype=torch.bfloat16)  # 64 MiB, half to each rank
        dst = torch.empty_like(big)
        dist.all_to_all_single(dst, big)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(3):
            dist.all_to_all_single(dst, big)
        torch.cuda.synchronize()
        sec = (time.perf_counter() - t0) / 3
        res = {"ok": ok and bool((dst == 1).all()), "rank": rank, "gbs": big.numel() * 2 / sec / 1e9,
               "values_ok": ok}
    except BaseException as e:  # noqa: BLE001 - reported
        res["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    flags = torch.tensor([1 if res.get("ok") else 0])
    try:
        dist.all_reduce(flags, op=dist.ReduceOp.MIN)
        res["ok"] = bool(flags.item()) and res.get("ok", False)
    except Exception:  # noqa: BLE001
        pass
    print(res)
    if rank == 0:
        emit(res)
    return 0


class _EachOnItsOwn:
    def wait(self) -> None:  # every collective inside was synchronous
        pass


def reduce_buckets_one_by_one() -> None:
    """gloo has allreduce_coalesced for CPU tensors only: Megatron DDP's grad buckets are reduced
    with one collective each instead (synchronously: --overlap-grad-reduce is off), so 2 ranks
    can share one GPU over gloo."""
    import contextlib

    import megatron.core.distributed.param_and_grad_buffer as pgb

    @contextlib.contextmanager
    def each_on_its_own(group=None, device=None, async_ops=False):
        if async_ops:
            raise RuntimeError("gpu_check's gloo-on-CUDA worker reduces gradients synchronously only")
        yield _EachOnItsOwn()

    pgb._coalescing_manager = each_on_its_own


def worker_hetero_train(a) -> int:
    """One rank of `torchrun --nproc-per-node N`: train_hetero over gloo, on the GPU (both ranks
    on cuda:LOCAL_RANK % GPUs, CUDA tensors over gloo) or, with CUDA_VISIBLE_DEVICES='', on
    the CPU. Rank 0 writes {"losses": [...]}."""
    import datetime

    import torch
    import torch.distributed as dist

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    cuda = torch.cuda.is_available()
    if cuda:
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
        torch.cuda.set_device(dev)
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    else:
        from megatron_hetermoe.parallel import cpu_backend

        cpu_backend.apply()
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
        dev = torch.device("cpu")
    from megatron_hetermoe.config import HeteroRunConfig, ModelConfig, TrainConfig
    from megatron_hetermoe.plan.hetero_plan import HeteroPlan
    from megatron_hetermoe.training.hetero import train_hetero
    from megatron_hetermoe.training.run_hooks import RunHooks

    if cuda:
        reduce_buckets_one_by_one()
    plan = HeteroPlan.load(a.plan)
    tiny = ModelConfig.load("tiny")
    # --pools: bf16 attention ranks, fp16 expert ranks (tokens cross in fp16), one fp16 loss scale.
    cfg = TrainConfig(model=tiny, micro_batch_size=1,
                      global_batch_size=plan.num_microbatches * len(plan.attention_ranks),
                      train_iters=a.iters, deterministic=True,  # quiet must agree on every rank (collective logging)
                      bf16=a.pools, initial_loss_scale=4096.0 if a.pools else 2.0**32)
    # The trainer puts a rank on the GPU only under NCCL (rank_device): this GPU, over gloo.
    res = train_hetero(cfg, plan, HeteroRunConfig(schedule=plan.schedule, expert_precision="fp16" if a.pools else None),
                       RunHooks(device=dev))
    if int(os.environ["RANK"]) == 0:
        Path(a.out).write_text(json.dumps({"losses": [float(x) for x in res.losses], "device": str(dev)}))
        print(f"rank 0 on {dev}: losses {res.losses}")
    dist.destroy_process_group()
    return 0
