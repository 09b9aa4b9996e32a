"""A rank's device, and how a torchrun rank joins its job.

`init_distributed` is the joining path (torchrun, SLURM's rank.sh): it makes the rank's GPU
(LOCAL_RANK modulo the visible GPUs) the current device before anything touches CUDA, then
starts the default process group (NCCL on GPUs, gloo on CPUs). `rank_device` is where every
tensor the plugin allocates lives; `group_timeout` is a process group's timeout per backend;
`bind_device` carries a GPU into a worker thread (a new thread starts on cuda:0);
`reset_peak_memory` / `peak_gpu_mib` are the trainers' GPU memory report (absent on CPU).

The CPU fork launcher (launcher.py) starts gloo ranks itself and never touches CUDA.
"""
from __future__ import annotations

import datetime
import inspect
import os
from typing import Callable, TypeVar

import torch
import torch.distributed as dist

# Megatron-LM's --distributed-timeout-minutes default.
NCCL_TIMEOUT = datetime.timedelta(minutes=10)

T = TypeVar("T")


def _is_nccl(backend: str) -> bool:
    return "nccl" in str(backend)  # "nccl", or a per-device spec such as "cpu:gloo,cuda:nccl"


def group_timeout(backend: str | None = None) -> datetime.timedelta:
    """Timeout of a process group on `backend` (default: the default group's): NCCL gets
    Megatron's 10 minutes; gloo gets the CPU launcher's collective_timeout() (60 s unless
    $HETERMOE_COLLECTIVE_TIMEOUT_S says otherwise)."""
    from megatron_hetermoe.parallel.launcher import collective_timeout

    if backend is None:
        backend = dist.get_backend()
    return NCCL_TIMEOUT if _is_nccl(backend) else collective_timeout()


def rank_device(cuda: bool | None = None) -> torch.device:
    """Where this rank's tensors live: the current CUDA device when `cuda` is True or, by
    default, when the default process group runs NCCL; else the CPU. Call it on the rank's main
    thread (a worker thread starts on cuda:0) and pass the result on."""
    if cuda is None:
        cuda = dist.is_available() and dist.is_initialized() and _is_nccl(dist.get_backend())
    if cuda:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def local_cuda_device() -> torch.device:
    """This rank's GPU: LOCAL_RANK modulo the visible GPUs (all GPUs visible, or one per
    process through CUDA_VISIBLE_DEVICES)."""
    n = torch.cuda.device_count()
    if n == 0:
        raise RuntimeError("no CUDA device is visible (check CUDA_VISIBLE_DEVICES); run on a GPU host or "
                           "use backend 'gloo'")
    local = os.environ.get("LOCAL_RANK")
    if local is None:
        if n > 1:
            raise RuntimeError(f"LOCAL_RANK is not set and {n} GPUs are visible: every rank would take cuda:0; "
                               f"start the ranks with torchrun (or export LOCAL_RANK)")
        local = "0"
    return torch.device("cuda", int(local) % n)


def init_distributed(backend: str | None = None, timeout: datetime.timedelta | None = None) -> torch.device:
    """Join the surrounding job (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT and, on GPUs,
    LOCAL_RANK in the environment); return this rank's device.

    backend: "nccl" or "gloo"; default: nccl when CUDA is available. With NCCL the rank's GPU
    becomes the current device first, so megatron-core's torch.cuda.current_device() and
    all_gather_object find it. With gloo the ranks are CPU ranks (cpu_backend's patches).
    timeout: the default group's (Megatron-LM's --distributed-timeout-minutes when it hosts the
    run); default: this plugin's per-backend timeouts."""
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    store = _restart_store()
    if backend == "gloo":
        from megatron_hetermoe.parallel import cpu_backend

        cpu_backend.apply(force=True)
        dist.init_process_group("gloo", timeout=timeout or group_timeout("gloo"), **store)
        return torch.device("cpu")
    if backend != "nccl":
        raise ValueError(f"backend={backend!r}; use 'nccl' (GPUs) or 'gloo' (CPUs)")
    device = local_cuda_device()
    torch.cuda.set_device(device)
    # device_id (torch >= 2.3) binds the default group to this GPU at once.
    kw = {"device_id": device} if "device_id" in inspect.signature(dist.init_process_group).parameters else {}
    dist.init_process_group("nccl", timeout=timeout or NCCL_TIMEOUT, **kw, **store)
    return device


def _restart_store() -> dict:
    """init_process_group's store for a worker that torchrun's elastic agent restarted
    ($TORCHELASTIC_RESTART_COUNT > 0): the job's store under a prefix of its own per restart. With
    env:// a restarted gloo worker found the failed start's addresses in the agent's store and
    timed out connecting to them ("Gloo connectFullMesh failed ... Connection refused", torch 2.13,
    even for a bare init_process_group + new_group script); the prefix gives each start fresh keys.
    {} for a first start, and where the agents do not share their store with the workers
    (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: each round's rank 0 hosts a fresh store at a fresh
    port, so env:// finds no stale keys, and the agents' restart counts, which differ when a node
    joined later, must not split the workers into two prefixes)."""
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if not restart or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False)
    return {"store": dist.PrefixStore(f"/hetermoe/restart_{restart}/", base), "rank": rank, "world_size": world}


def check_native_bf16(device: torch.device) -> None:
    """Refuse --bf16 on a GPU without native bf16 (compute capability < 8.0: V100, T4).
    torch.cuda.is_bf16_supported() says True there (emulated), so the capability decides."""
    if device.type != "cuda":
        return
    major, minor = torch.cuda.get_device_capability(device)
    if major < 8:
        raise ValueError(f"--bf16 on {torch.cuda.get_device_name(device)} (compute capability {major}.{minor}): "
                         f"no native bf16 (it needs 8.0+, Ampere or newer); use --fp16")


def set_deterministic(device: torch.device) -> None:
    """torch.use_deterministic_algorithms(True), with the cuBLAS workspace setting it needs on
    CUDA (CUBLAS_WORKSPACE_CONFIG, read when cuBLAS starts: call this before the first matmul)."""
    if device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)


def bind_device(fn: Callable[[], T], device: torch.device | None = None) -> Callable[[], T]:
    """`fn`, to run on a new thread with `device` (default: this thread's current CUDA device)
    current there. Call it on the thread that creates the worker; returns `fn` itself for a CPU
    device, or, by default, where CUDA is not in use (CPU ranks)."""
    if device is None:
        if not torch.cuda.is_initialized():
            return fn
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type != "cuda":
        return fn

    def run() -> T:
        torch.cuda.set_device(device)
        return fn()

    return run


def reset_peak_memory(device: torch.device) -> None:
    """Start counting this rank's peak GPU memory now (torch.cuda.reset_peak_memory_stats: the
    peak restarts at what is allocated now, the model and optimizer included); no-op on CPU."""
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_gpu_mib(role: str, device: torch.device, group=None) -> list[tuple[str, float]] | None:
    """[(role, MiB)] per rank of `group`: each rank's torch.cuda.max_memory_allocated since
    reset_peak_memory, on every rank (collective over `group` on CUDA ranks). None on CPU ranks,
    without a collective: a world's ranks are all CUDA (NCCL) or all CPU (gloo), see rank_device."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    mine = (role, torch.cuda.max_memory_allocated(device) / 2**20)
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, mine, group=group)
    return [tuple(x) for x in out]


# ---- is this GPU the one the plan means, and can this torch run on it ------------------------
# torch builds (pip wheels) by the CUDA version they ship and the GPU architectures they carry
# kernels for (torch.cuda.get_arch_list()); docs/gpus.md has the table by GPU pair.
TORCH_BUILD_FOR_ARCH = (((5, 0), (7, 0), "cu126"),)  # (oldest, newest capability) that needs that build


def _parse_arch(arch: str) -> tuple[str, int, int, bool] | None:
    """'sm_86' -> ('sm', 8, 6, False); 'compute_90' -> ('compute', 9, 0, False); 'sm_90a' ->
    ('sm', 9, 0, True) (an arch-specific cubin: that exact GPU only); None if unreadable."""
    kind, _, num = arch.partition("_")
    exact = num.endswith(("a", "f"))
    num = num.rstrip("af")
    if kind not in ("sm", "compute") or len(num) < 2 or not num.isdigit():
        return None
    return kind, int(num[:-1]), int(num[-1]), exact


def arch_covered(capability: tuple[int, int], arch_list: list[str]) -> bool:
    """Whether a torch built for `arch_list` has kernels for a GPU of `capability`: a cubin of
    the same major version and a minor version up to the GPU's (sm_80 runs on 8.6), or PTX of any
    version up to the GPU's (compiled when loaded)."""
    major, minor = capability
    for a in arch_list:
        parsed = _parse_arch(a)
        if parsed is None:
            continue
        kind, ma, mi, exact = parsed
        if exact:
            if (ma, mi) == (major, minor):
                return True
        elif kind == "sm" and ma == major and mi <= minor:
            return True
        elif kind == "compute" and (ma, mi) <= (major, minor):
            return True
    return False


def arch_error(device_name: str, capability: tuple[int, int], arch_list: list[str], torch_version: str,
               cuda_version: str | None) -> str:
    """What to tell a rank whose GPU this torch has no kernels for, naming a build that has."""
    major, minor = capability
    fix = next((b for lo, hi, b in TORCH_BUILD_FOR_ARCH if lo <= capability <= hi), None)
    how = (f"install a {fix} build of torch (pip install torch --index-url https://download.pytorch.org/whl/{fix}), "
           f"or a container whose torch lists sm_{major}{minor}" if fix else
           f"install a torch build whose torch.cuda.get_arch_list() covers sm_{major}{minor}")
    return (f"this rank's GPU, {device_name} (compute capability {major}.{minor}, sm_{major}{minor}), has no kernels "
            f"in the installed torch {torch_version} (CUDA {cuda_version}), "
            f"built for {' '.join(arch_list) or 'no GPU'}; "
            f"its first kernel would fail with 'no kernel image is available'. {how} (docs/gpus.md)")


def gpu_type_matches(profile, device_name: str, total_gib: float) -> bool:
    """Whether a GPU named `device_name` with `total_gib` of memory is of the plan's type
    `profile` (a planner GpuProfile): its device_name pattern, or else its name's first part as a
    word of the device name ("V100" of "V100-16GB" in "Tesla V100-SXM2-16GB") and its memory within
    20 % of the profile's (16 GB and 32 GB V100s differ there)."""
    import re

    if profile.device_name is not None:
        return re.search(profile.device_name, device_name, re.IGNORECASE) is not None
    family = re.split(r"[-_ ]", profile.name)[0]
    if not re.search(rf"(?<![A-Za-z0-9]){re.escape(family)}(?![A-Za-z0-9])", device_name, re.IGNORECASE):
        return False
    return abs(total_gib - profile.memory_gib) <= 0.2 * profile.memory_gib


def check_rank_gpu(plan, rank: int, device: torch.device) -> None:
    """At a CUDA rank's start, before any group: the installed torch has kernels for its GPU, and
    the GPU is of the type the plan gives the rank (a scheduler's allocation order must not put
    attention on a V100). No-op on CPU ranks and for plan type 'cpu'."""
    if torch.device(device).type != "cuda":
        return
    name = torch.cuda.get_device_name(device)
    capability = tuple(torch.cuda.get_device_capability(device))
    arch_list = list(torch.cuda.get_arch_list())
    if not arch_covered(capability, arch_list):
        raise RuntimeError(f"rank {rank}: " + arch_error(name, capability, arch_list, torch.__version__,
                                                         torch.version.cuda))
    gpu_type = plan.gpu_types[rank]
    if gpu_type.lower() == "cpu":
        return
    from megatron_hetermoe.planner.profiles import load_profile

    profile = load_profile(gpu_type)
    total_gib = torch.cuda.get_device_properties(device).total_memory / 2**30
    if not gpu_type_matches(profile, name, total_gib):
        raise RuntimeError(
            f"rank {rank} ({plan.role(rank)} rank) is on a {name} ({total_gib:.0f} GiB) but the plan gives it a "
            f"{profile.name} ({profile.memory_gib:g} GB); launch so that each rank lands on its plan type (SLURM: "
            f"the --nodelist / --partition order of `hetermoe slurm`; CUDA_VISIBLE_DEVICES on a mixed node), or "
            f"remake the plan for this allocation (a profile's device_name names a GPU the default match misses)")
