"""The GPU check's machinery: each step's work runs in a subprocess with its own timeout (its
output kept in the work directory, its tail shown in the log), and a worker reports its result
as one `GPU_CHECK_RESULT {json}` line on stdout (emit), which the orchestrator reads back
(Proc.result)."""
from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent  # scripts/gpu_check
REPO = HERE.parents[1]
MAIN = HERE / "main.py"  # the entry point; workers run as `python MAIN --worker NAME ...`
RESULT_TAG = "GPU_CHECK_RESULT "


@dataclass
class StepResult:
    step: int
    name: str
    status: str = "SKIP"  # PASS / FAIL / SKIP
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
        if self.timed_out:
            return f"timed out after {self.seconds:.0f} s"
        lines = [ln for ln in self.output.splitlines() if ln.strip() and "warn" not in ln.lower()]
        err = next((ln for ln in reversed(lines) if "Error" in ln or "error:" in ln), lines[-1] if lines else "")
        return f"exit {self.rc}: {err.strip()[:300]}"


class Check:
    def __init__(self, log_path: Path, out_dir: Path, work: Path, dry_run: bool, budget_s: float):
        self.log_path, self.out_dir, self.work, self.dry_run = log_path, out_dir, work, dry_run
        self.t0 = time.perf_counter()
        self.budget_s = budget_s
        self.gpu = False
        self.env_info: dict = {}
        self._log = open(log_path, "w")

    # ---- log -----------------------------------------------------------------------------
    def log(self, msg: str = "") -> None:
        self._log.write(msg + "\n")
        self._log.flush()
        print(msg, flush=True)

    def left(self) -> float:
        return self.budget_s - (time.perf_counter() - self.t0)

    # ---- subprocesses ----------------------------------------------------------------------
    def env(self, cpu: bool = False, threads: int | None = None) -> dict:
        e = dict(os.environ)
        e["PYTHONUNBUFFERED"] = "1"
        e["PYTHONPATH"] = str(REPO) + (os.pathsep + e["PYTHONPATH"] if e.get("PYTHONPATH") else "")
        if cpu:
            e["CUDA_VISIBLE_DEVICES"] = ""
        if threads is not None:
            e["OMP_NUM_THREADS"] = str(threads)
        return e

    def start(self, label: str, cmd: list[str], env: dict):
        out = self.work / f"{label}.out"
        f = open(out, "w")
        self.log(f"  $ {' '.join(shlex.quote(c) for c in cmd)}"
                 + ("   [CUDA_VISIBLE_DEVICES='']" if env.get("CUDA_VISIBLE_DEVICES") == "" else ""))
        # Own session: a timeout kills the whole tree (torchrun and its ranks) by this group id.
        p = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        return (label, p, f, out, time.perf_counter())

    def finish(self, handle, timeout: float) -> Proc:
        label, p, f, out, t0 = handle
        timed_out = False
        try:
            p.wait(timeout=max(1.0, timeout - (time.perf_counter() - t0)))
        except subprocess.TimeoutExpired:
            timed_out = True
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
        f.close()
        text = Path(out).read_text(errors="replace")
        r = Proc(label, p.returncode, time.perf_counter() - t0, text, timed_out)
        self._show(r)
        return r

    def run(self, label: str, cmd: list[str], env: dict, timeout: float) -> Proc:
        return self.finish(self.start(label, cmd, env), timeout)

    def _show(self, r: Proc) -> None:
        state = "ok" if r.ok else ("TIMEOUT" if r.timed_out else f"exit {r.rc}")
        self.log(f"  [{r.label}: {state}, {r.seconds:.1f} s]")
        lines = [ln for ln in r.output.splitlines()
                 if ln.strip() and not ln.startswith(RESULT_TAG) and "warnings.warn" not in ln
                 and "UserWarning" not in ln and "DeprecationWarning" not in ln and "FutureWarning" not in ln]
        keep = lines[-12:] if r.ok else lines[-60:]
        for ln in keep:
            self.log("    | " + ln[:400])

    # ---- python helpers -----------------------------------------------------------------------
    def py(self, *args: str) -> list[str]:
        return [sys.executable, *args]

    def torchrun(self, n: int, *args: str) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n), *args]

    def worker(self, name: str, *args: str) -> list[str]:
        return [str(MAIN), "--worker", name, *args]


def emit(d: dict) -> None:
    """A worker's result, for Proc.result."""
    print(RESULT_TAG + json.dumps(d, default=str), flush=True)
