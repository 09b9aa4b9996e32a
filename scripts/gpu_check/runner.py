"""The GPU check's machinery: each step's work runs in subprocesses with their own timeouts (output
kept in the work directory, its tail shown in the log). A worker reports its result as one
`GPU_CHECK_RESULT {json}` line on stdout (emit), which the orchestrator reads back (Proc.result);
a 4-rank run's ranks report through rank.py's per-rank files (Run.reports).

Two sides of every 4-rank comparison (Side): the DEVICE run, four NCCL ranks on the one GPU (in
--dry-run four gloo ranks, through the same launch and the same per-rank environment), and the CPU
reference started beside it (gloo ranks; in --dry-run with ATEN_CPU_CAPABILITY=default, so the two
sides run different CPU kernels and their difference measures fp32 round-off)."""
from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from judge import Status

HERE = Path(__file__).resolve().parent  # scripts/gpu_check
REPO = HERE.parents[1]
MAIN = HERE / "main.py"  # the entry point; workers run as `python MAIN --worker NAME ...`
RANK = HERE / "rank.py"  # each rank of a torchrun run (per-rank NCCL_HOSTID, reports)
FORKRUN = HERE / "forkrun.py"  # --dry-run's launcher of CPU ranks (torchrun's environment, forked)
RESULT_TAG = "GPU_CHECK_RESULT "
WORLD = 4  # ranks of every multi-rank run: a 2+2 plan, or 2 stages of 1+1
# Four ranks on one GPU are four NCCL "hosts" (rank.py gives each its NCCL_HOSTID) that talk over
# loopback sockets; InfiniBand off so NCCL does not look for it.
NCCL_ONE_GPU = {"NCCL_NET": "Socket", "NCCL_SOCKET_IFNAME": "lo", "NCCL_IB_DISABLE": "1", "NCCL_DEBUG": "WARN"}
TERM_GRACE_S = 5.0  # torchrun forwards SIGTERM to its ranks; then SIGKILL


class Side(str, Enum):
    DEVICE = "gpu"  # four NCCL ranks on the GPU (--dry-run: four gloo ranks, same launch)
    CPU = "cpu"  # the reference: four gloo ranks on CPU

    def __str__(self) -> str:
        return self.value


@dataclass
class StepResult:
    name: str
    title: str
    status: Status = Status.SKIP
    summary: str = ""
    seconds: float = 0.0
    data: dict = field(default_factory=dict)


@dataclass
class Proc:
    label: str
    rc: int | None
    seconds: float
    output: str
    timed_out: bool

    @property
    def ok(self) -> bool:
        return self.rc == 0 and not self.timed_out

    def result(self) -> dict | None:
        """The last `GPU_CHECK_RESULT {json}` line a worker printed."""
        for line in reversed(self.output.splitlines()):
            if line.startswith(RESULT_TAG):
                try:
                    return json.loads(line[len(RESULT_TAG):])
                except json.JSONDecodeError:
                    return None
        return None

    def why(self) -> str:
        """The reason in one line: the ranks' first error (a user's error line, else an exception's),
        not torchrun's report of the failed children that follows it."""
        if self.timed_out:
            return f"timed out after {self.seconds:.0f} s"
        noise = ("torch.distributed.elastic", "ChildFailedError", "closing signal", "Warning", "warn(", "warnings.")
        lines = [ln.strip() for ln in self.output.splitlines() if ln.strip() and not any(n in ln for n in noise)]
        pick = None
        for test in (lambda ln: ln.startswith("error: rank ") or ": error: " in ln,
                     lambda ln: re.match(r"^[\w.]*(Error|Exception)\b.*:", ln) is not None,
                     lambda ln: "cannot" in ln or "error" in ln.lower()):
            pick = next((i for i, ln in enumerate(lines) if test(ln)), None)
            if pick is not None:
                break
        if pick is None:
            return f"exit {self.rc}: {lines[-1][:300] if lines else ''}"
        err = lines[pick] + (" " + lines[pick + 1] if lines[pick].endswith(":") and pick + 1 < len(lines) else "")
        return f"exit {self.rc}: {err[:300]}"


@dataclass
class Run:
    """One torchrun run of WORLD ranks through rank.py: its process and every rank's report."""
    proc: Proc
    side: Side
    rank_dir: Path

    @property
    def reports(self) -> dict[int, dict]:
        out = {}
        for r in range(WORLD):
            p = self.rank_dir / f"rank{r}.json"
            if p.exists():
                out[r] = json.loads(p.read_text())
        return out

    def losses(self) -> list[float] | None:
        """The world's per-step losses as rank 0's trainer returned them."""
        rep = self.reports.get(0, {}).get("train_hetero")
        return rep["losses"] if rep else None


class Check:
    def __init__(self, log_path: Path, out_dir: Path, work: Path, dry_run: bool, budget_s: float):
        self.log_path, self.out_dir, self.work, self.dry_run = log_path, out_dir, work, dry_run
        self.t0 = time.perf_counter()
        self.budget_s = budget_s
        self.reserve_s = 0.0  # kept for the last step (its own timeout), see main.orchestrate
        self.gpu = False
        self.env_info: dict = {}
        self.preflight_ok: bool | None = None
        self.env_ok = True  # the plugin and megatron-core import (step env)
        self.runs: dict[str, tuple[Run, Run | None]] = {}  # a step's runs, for the steps after it
        self.results: dict[str, StepResult] = {}
        self._log = open(log_path, "w")

    # ---- log -----------------------------------------------------------------------------
    def log(self, msg: str = "") -> None:
        self._log.write(msg + "\n")
        self._log.flush()
        print(msg, flush=True)

    def left(self) -> float:
        """Seconds left for the steps before the last one (its reserve kept aside)."""
        return self.budget_s - self.reserve_s - (time.perf_counter() - self.t0)

    def left_total(self) -> float:
        return self.budget_s - (time.perf_counter() - self.t0)

    def timeout(self, want: float) -> float:
        return max(1.0, min(want, self.left()))

    # ---- environments ----------------------------------------------------------------------
    def env(self, cpu: bool = False, threads: int | None = None) -> dict:
        e = dict(os.environ)
        e["PYTHONUNBUFFERED"] = "1"
        e["PYTHONPATH"] = str(REPO) + (os.pathsep + e["PYTHONPATH"] if e.get("PYTHONPATH") else "")
        if cpu:
            e["CUDA_VISIBLE_DEVICES"] = ""
        if threads is not None:
            e["OMP_NUM_THREADS"] = str(threads)
        return e

    def side_env(self, side: Side, rank_dir: Path, extra: dict | None = None) -> dict:
        """A 4-rank run's environment. DEVICE: the GPU, NCCL over loopback sockets, one NCCL host
        per rank (rank.py); in --dry-run the same, minus the GPU. CPU: gloo ranks (no CUDA
        visible: the product picks gloo and its CPU backend); in --dry-run on the baseline CPU
        kernels, so the two sides differ by kernels as a GPU and a CPU do."""
        e = self.env(cpu=side is Side.CPU or not self.gpu, threads=2 if side is Side.CPU and not self.dry_run else 1)
        e["GPU_CHECK_RANK_DIR"] = str(rank_dir)
        if side is Side.DEVICE:
            e.update(NCCL_ONE_GPU)
            e["GPU_CHECK_SAME_GPU"] = "1"
        elif self.dry_run:
            e["ATEN_CPU_CAPABILITY"] = "default"
        e.update(extra or {})
        return e

    # ---- subprocesses ----------------------------------------------------------------------
    def start(self, label: str, cmd: list[str], env: dict, cwd: Path | None = None):
        out = self.work / f"{label}.out"
        f = open(out, "w")
        shown = {k: env[k] for k in ("CUDA_VISIBLE_DEVICES", "ATEN_CPU_CAPABILITY", "CUDA_DEVICE_MAX_CONNECTIONS")
                 if k in env and env.get(k) != os.environ.get(k)}
        self.log(f"  $ {' '.join(shlex.quote(c) for c in cmd)}"
                 + (f"   [{' '.join(f'{k}={v!r}' for k, v in shown.items())}]" if shown else ""))
        # Own session: a timeout ends the whole tree by this group id (torchrun's ranks are in
        # sessions of their own: rank.py's pid files and PR_SET_PDEATHSIG reach them).
        p = subprocess.Popen(cmd, cwd=cwd or REPO, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        return (label, p, f, out, time.perf_counter(), env.get("GPU_CHECK_RANK_DIR"))

    def finish(self, handle, timeout: float) -> Proc:
        label, p, f, out, t0, rank_dir = handle
        timed_out = False
        try:
            p.wait(timeout=max(1.0, timeout - (time.perf_counter() - t0)))
        except subprocess.TimeoutExpired:
            timed_out = True
            self._stop(p, rank_dir)
        f.close()
        text = Path(out).read_text(errors="replace")
        r = Proc(label, p.returncode, time.perf_counter() - t0, text, timed_out)
        self._show(r)
        return r

    @staticmethod
    def _stop(p: subprocess.Popen, rank_dir: str | None) -> None:
        """SIGTERM to the run's process group (torchrun passes it to its ranks), then SIGKILL to the
        group and to every rank that wrote its pid (each in a session of its own)."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass
            if sig == signal.SIGTERM:
                try:
                    p.wait(timeout=TERM_GRACE_S)
                except subprocess.TimeoutExpired:
                    pass
        for pid_file in sorted(Path(rank_dir).glob("pid*")) if rank_dir else []:
            try:
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
            except (ProcessLookupError, ValueError, PermissionError):
                pass
        p.wait()

    def run(self, label: str, cmd: list[str], env: dict, timeout: float, cwd: Path | None = None) -> Proc:
        return self.finish(self.start(label, cmd, env, cwd), timeout)

    def _show(self, r: Proc) -> None:
        state = "ok" if r.ok else ("TIMEOUT" if r.timed_out else f"exit {r.rc}")
        self.log(f"  [{r.label}: {state}, {r.seconds:.1f} s]")
        lines = [ln for ln in r.output.splitlines()
                 if ln.strip() and not ln.startswith(RESULT_TAG) and "warnings.warn" not in ln
                 and "UserWarning" not in ln and "DeprecationWarning" not in ln and "FutureWarning" not in ln]
        keep = lines[-8:] if r.ok else lines[-60:]
        for ln in keep:
            self.log("    | " + ln[:400])

    # ---- commands ---------------------------------------------------------------------------
    def py(self, *args: str) -> list[str]:
        return [sys.executable, *args]

    def torchrun(self, n: int, *args: str) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n), *args]

    def worker(self, name: str, *args: str) -> list[str]:
        return [str(MAIN), "--worker", name, *args]

    def ranks(self, *entry: str, torchrun: bool = False) -> list[str]:
        """WORLD ranks, each through rank.py (`-m MODULE ARGS` or `SCRIPT ARGS`): torchrun, or in
        --dry-run forkrun.py (the same ranks forked from one process that imported torch and
        megatron once: a 4-rank run's imports cost ~16 s of CPU under torchrun) unless `torchrun`."""
        if self.dry_run and not torchrun:
            return [sys.executable, str(FORKRUN), "--nproc", str(WORLD), *entry]
        return self.torchrun(WORLD, str(RANK), *entry)

    # ---- a 4-rank run on each side -----------------------------------------------------------
    def start_side(self, label: str, side: Side, entry: list[str], extra_env: dict | None = None,
                   cwd: Path | None = None, torchrun: bool = False):
        rank_dir = self.work / f"{label}_{side}.ranks"
        rank_dir.mkdir(parents=True, exist_ok=True)
        for stale in rank_dir.iterdir():
            stale.unlink()
        cmd = self.ranks(*entry, torchrun=torchrun)
        return self.start(f"{label}_{side}", cmd, self.side_env(side, rank_dir, extra_env), cwd), side

    def finish_side(self, started, timeout: float) -> Run:
        handle, side = started
        proc = self.finish(handle, timeout)
        return Run(proc, side, Path(handle[5]))

    def pair(self, label: str, entry, timeout: float, cpu: bool = True, extra_env: dict | None = None,
             cwd: Path | None = None, dry_ref: bool = False) -> tuple[Run, Run | None]:
        """The DEVICE run and (cpu=True) its CPU reference, started side by side. `entry(side)`
        gives each side's rank.py arguments. In --dry-run both sides are CPU runs: the reference
        runs only where dry_ref says (one comparison of two CPU kernels is enough to exercise the
        comparison, and the CI budget has room for few 4-rank runs)."""
        cpu = cpu and (dry_ref or not self.dry_run)
        d = self.start_side(label, Side.DEVICE, entry(Side.DEVICE), extra_env, cwd)
        c = self.start_side(label, Side.CPU, entry(Side.CPU), extra_env, cwd) if cpu else None
        t = self.timeout(timeout)
        dev = self.finish_side(d, t)
        ref = self.finish_side(c, t) if c is not None else None
        return dev, ref


def emit(d: dict) -> None:
    """A worker's result, for Proc.result."""
    print(RESULT_TAG + json.dumps(d, default=str), flush=True)
