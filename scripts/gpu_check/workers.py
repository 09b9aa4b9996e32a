"""The GPU check's workers that are not timing probes, each the entry point of a subprocess
(`main.py --worker NAME`, under torchrun when it takes ranks): the environment probe, gloo's
all_to_all on CUDA tensors, and train_hetero over gloo; init_single makes a world of one
process for the probes too."""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from runner import emit


def worker_env(a) -> int:
    import platform

    import torch

    info = {"python": platform.python_version(), "torch": torch.__version__, "cuda_build": torch.version.cuda,
            "cuda_available": torch.cuda.is_available(), "cpus": os.cpu_count(), "gpus": []}
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
    try:
        from importlib.metadata import version

        info["megatron_core"] = version("megatron-core")
    except Exception as e:  # noqa: BLE001
        info["megatron_core"] = f"not installed ({e})"
    for mod, key in (("transformer_engine.pytorch", "transformer_engine"), ("apex", "apex")):
        try:
            m = __import__(mod, fromlist=["_"])
            info[key] = f"imports ({getattr(sys.modules[mod.split('.')[0]], '__version__', '?')})"
            del m
        except BaseException as e:  # noqa: BLE001 - an import can fail in many ways
            info[key] = f"no ({type(e).__name__})"
    import megatron.core  # noqa: F401  - the plugin's import must work too

    import megatron_hetermoe  # noqa: F401

    info["hetermoe_imports"] = True
    for k, v in info.items():
        print(f"{k}: {v}")
    emit(info)
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
    cfg = TrainConfig(model=tiny, micro_batch_size=1, global_batch_size=plan.num_microbatches * len(plan.attention_ranks),
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
