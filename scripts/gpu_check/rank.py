"""One rank of a GPU-check run: `torchrun ... scripts/gpu_check/rank.py (-m MODULE | SCRIPT) ARGS...`.

torchrun gives every rank the same environment, and NCCL refuses two ranks on one GPU ("Duplicate
GPU detected") only when they share a host hash. With GPU_CHECK_SAME_GPU=1 this wrapper makes each
rank a host of its own with one GPU before anything imports torch.distributed: its own NCCL_HOSTID
(from torchrun's LOCAL_RANK), and LOCAL_RANK=0, LOCAL_WORLD_SIZE=1 (Megatron-LM's initialize takes
cuda:LOCAL_RANK, which a one-GPU host does not have beyond 0; torchrun's value stays in
GPU_CHECK_LOCAL_RANK). The caller sets NCCL_NET=Socket NCCL_SOCKET_IFNAME=lo NCCL_IB_DISABLE=1,
so four ranks on one GPU are four real NCCL ranks talking over loopback sockets. Then the real
entry point runs unchanged, as `python -m MODULE ARGS` or `python SCRIPT ARGS` would run it
(runpy, as __main__).

Observation only, never a change of what the product computes:
- GPU_CHECK_RANK_DIR: each rank writes `pid<RANK>` at start (the orchestrator kills leftover
  ranks by these ids after a timeout) and `rank<RANK>.json` at the end: its exit status and, for
  the plugin's CLI (`-m megatron_hetermoe...`), what train_hetero returned on this rank (losses,
  loss scales, skipped steps, parameter dtypes, kernels). A script (Megatron-LM's
  pretrain_gpt.py) gets nothing imported ahead of it, so its imports resolve as they would alone.
- The rank ends with its parent (PR_SET_PDEATHSIG): torchrun puts each rank in a session of its
  own, so killing torchrun's process group would not reach them.
- After the entry point returns, interpreter exit gets EXIT_GRACE_S; a rank hung there (NCCL
  communicators, CUDA-stream threads) says so and ends, instead of costing the step its timeout.
"""
from __future__ import annotations

import ctypes
import json
import os
import runpy
import signal
import sys
import threading
import time

EXIT_GRACE_S = 20.0
PR_SET_PDEATHSIG = 1


def host_id(local_rank: str) -> str:
    """The NCCL_HOSTID of a rank that shares its GPU with the other ranks of its host."""
    return f"gpu-check-{os.uname().nodename}-rank{local_rank}"


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux/glibc: the orchestrator's pid files remain
        pass


def _report_dir() -> str | None:
    return os.environ.get("GPU_CHECK_RANK_DIR") or None


def _write(name: str, data: dict) -> None:
    d = _report_dir()
    if d is None:
        return
    tmp = os.path.join(d, f".{name}.tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, default=str)
    os.replace(tmp, os.path.join(d, name))  # the orchestrator never reads half a file


def _observe_train_hetero(record: dict) -> None:
    """Record what the plugin's trainer returns on this rank (the function is looked up at call
    time by the CLI's rank main, so wrapping the module attribute sees every call)."""
    from megatron_hetermoe.training import hetero

    real = hetero.train_hetero

    def observed(*args, **kwargs):
        result = real(*args, **kwargs)
        record["train_hetero"] = {
            "losses": [float(x) for x in result.losses], "start_iteration": result.start_iteration,
            "loss_scales": [float(x) for x in result.loss_scales], "overflow_skipped": list(result.overflow_skipped),
            "nan_skipped": list(result.skipped), "param_dtypes": list(result.param_dtypes),
            "kernels": result.kernels, "schedule": result.schedule, "peak_gpu_mib": result.peak_gpu_mib}
        return result

    hetero.train_hetero = observed


def _exit_watchdog(rank: str, code: int) -> None:
    def watch() -> None:
        time.sleep(EXIT_GRACE_S)
        print(f"gpu_check: rank {rank}: the run returned (exit {code}) but interpreter exit hung for "
              f"{EXIT_GRACE_S:.0f} s; ending the process", file=sys.stderr, flush=True)
        os._exit(code)

    threading.Thread(target=watch, daemon=True).start()


def main(argv: list[str]) -> int:
    if len(argv) < 1 or (argv[0] == "-m" and len(argv) < 2):
        print("usage: rank.py (-m MODULE | SCRIPT) ARGS...", file=sys.stderr)
        return 2
    rank = os.environ.get("RANK", "0")
    local = os.environ.get("LOCAL_RANK", "0")
    if os.environ.get("GPU_CHECK_SAME_GPU") == "1":
        # Each rank a host of its own with one GPU: its NCCL host id, and the local rank of a
        # one-GPU host (Megatron-LM's initialize takes cuda:LOCAL_RANK; the plugin LOCAL_RANK modulo
        # the GPUs, the same cuda:0 either way).
        os.environ["NCCL_HOSTID"] = host_id(local)
        os.environ.update(LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", GPU_CHECK_LOCAL_RANK=local)
    _die_with_parent()
    record: dict = {"rank": int(rank), "local_rank": int(local), "pid": os.getpid(),
                    "nccl_hostid": os.environ.get("NCCL_HOSTID")}
    if _report_dir() is not None:
        with open(os.path.join(_report_dir(), f"pid{rank}"), "w") as f:
            f.write(str(os.getpid()))
    if argv[0] == "-m":
        if _report_dir() is not None and argv[1].startswith("megatron_hetermoe"):
            _observe_train_hetero(record)
        target, rest = argv[1], argv[2:]
        sys.argv = [target, *rest]
        run = lambda: runpy.run_module(target, run_name="__main__", alter_sys=True)  # noqa: E731
    else:
        target, rest = argv[0], argv[1:]
        sys.argv = [target, *rest]
        sys.path[0] = os.path.dirname(os.path.abspath(target))  # as `python SCRIPT` sets it
        run = lambda: runpy.run_path(target, run_name="__main__")  # noqa: E731
    code = 0
    try:
        run()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
    record["exit"] = code
    _write(f"rank{rank}.json", record)
    sys.stdout.flush()
    sys.stderr.flush()
    _exit_watchdog(rank, code)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
