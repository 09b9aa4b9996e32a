"""One prepared check of HeterMoE on one GPU: `scripts/gpu_check.sh [--dry-run]`.

Made to fit a short lease of one GPU (about 7 minutes) and to leave one log behind:
$OUT/gpu_check.log when $OUT is set, else ./gpu_check.log (--log to choose), ending in a
SUMMARY block with PASS / FAIL / SKIP and the key numbers of every step; gpu_check.json beside
it has the same results for programs. Every step runs its work in subprocesses, each with its
own timeout, so one failure or hang does not stop the others.

Steps (`--steps 1,2,5` runs some; they always run in the order 1, 2, 5, 3, 4, 6):
  1 environment   python, torch, CUDA, the GPU, NCCL, megatron-core, transformer_engine.
  2 1-rank NCCL   `torchrun --nproc-per-node 1 -m megatron_hetermoe.cli train --model tiny
                  --deterministic-mode ...` for (a) Megatron EP (EP=1), (b) DistEP, (c) zebra
                  (the default issuer: single on the GPU, threads on the CPU), (d) zebra with
                  --hetero-zebra-issuer threads, (e) zebra --bf16 and (f) zebra --fp16
                  --initial-loss-scale 4096, on a 1-rank plan whose attention rank holds every
                  expert. `hetermoe plan
                  --even` refuses N=0 expert ranks, so the plan is written here with HeteroPlan
                  (its validate() accepts M=1, N=0). Each run is repeated with
                  CUDA_VISIBLE_DEVICES="" (gloo, the CPU reference) and the per-step relative
                  loss difference GPU vs CPU is printed (fp32: expect ~1e-6..1e-3; only a loose
                  sanity bound, 5e-2, fails the step).
  3 2 ranks/1 GPU two processes sharing the GPU over gloo: first a probe that gloo's
                  all_to_all_single takes CUDA tensors (uneven splits, checked values); then
                  DistEP, zebra, and zebra with per-pool precision (bf16 attention rank, fp16
                  expert rank, tokens in fp16) on an even 1 attention + 1 expert plan (`hetermoe plan --even`)
                  through this module's `--worker hetero-train` (train_hetero on CUDA tensors
                  over gloo: `hetermoe train` under torchrun picks NCCL, which refuses two ranks
                  on one GPU), with the same command on CPU as the reference. Seen on an H200:
                  gloo moves CUDA tensors in all_to_all, but Megatron DDP's grad sync
                  (allreduce_coalesced) has no gloo CUDA path; the worker now reduces DDP's
                  buckets one collective each (`reduce_buckets_one_by_one`; not yet run on a
                  GPU). Zebra runs the threaded issuer there (gloo's Work.wait blocks the
                  host). If the coalesced call still appears, the GPU runs SKIP with that reason.
  4 MoE layer     forward+backward time of one MoE layer, megatron-core's MoELayer and
                  HeteroMoELayer (a 1-rank hetero world holding every expert), on the D1 shape
                  (configs/models/d1.yaml) at 8K tokens, bf16 and fp32, one process each.
  5 overlap       GPU only. (a) a GEMM loop alone, a device-to-device copy alone and an NCCL
                  all_to_all (world of 1) alone, then GEMM and each on two CUDA streams:
                  overlap = (t_gemm + t_comm) / t_both (2.0 = perfect, 1.0 = serialized);
                  (b) the zebra executor itself (schedules/executor.py) on an expert rank's
                  task list with GEMM compute and all_to_all transfers: CudaStream and the
                  single issuer (schedules/issuer.py) against ThreadStream (all on the default
                  stream), with the transferred values checked.
  6 profile       `hetermoe profile --model d1 ...` of this GPU (a few shapes; the YAML is kept).

--dry-run (or no GPU): every step that can run on the CPU runs at tiny sizes (CPU references
only), GPU-only parts are SKIP; the exit code is 0 when nothing FAILED.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESULT_TAG = "GPU_CHECK_RESULT "
GLOO_NO_CUDA_COALESCED = "allreduce_coalesced: unsupported device type cuda"
LOOSE_REL = 5e-2  # GPU vs CPU loss: a sanity bound only (fp32 differences are ~1e-6..1e-3)
ORDER = (1, 2, 5, 3, 4, 6)
NAMES = {1: "environment", 2: "1-rank train on NCCL vs CPU", 3: "2 ranks on one GPU over gloo",
         4: "MoE layer fwd+bwd (megatron vs hetero)", 5: "stream overlap probe", 6: "hetermoe profile"}


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


# ================================================================ orchestration
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
        return ["-m", "megatron_hetermoe.tools.gpu_check", "--worker", name, *args]


def _losses(path: Path) -> list[float] | None:
    """Per-step losses from a golden-values JSON (hetermoe train) or {"losses": [...]}."""
    try:
        d = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if "losses" in d:
        return [float(x) for x in d["losses"]]
    vals = d.get("lm loss", {}).get("values", {})
    return [float(vals[k]) for k in sorted(vals, key=int)] or None


def _rel(a: list[float], b: list[float]) -> list[float]:
    return [abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b)]


def _fmt(xs: list[float], f: str = ".3g") -> str:
    return "[" + ", ".join(format(x, f) for x in xs) + "]"


def _finite(xs: list[float] | None) -> bool:
    return bool(xs) and all(math.isfinite(x) for x in xs)


# ================================================================ steps
def step_env(ck: Check, r: StepResult) -> None:
    p = ck.run("env", ck.py(*ck.worker("env")), ck.env(), timeout=90)
    info = p.result()
    if not p.ok or info is None:
        r.status, r.summary = "FAIL", f"environment probe failed ({p.why()})"
        return
    ck.env_info = info
    ck.gpu = bool(info.get("cuda_available")) and not ck.dry_run
    r.data = info
    gpu = (f"{info['gpus'][0]['name']} ({info['gpus'][0]['memory_gib']:.1f} GiB, sm_{info['gpus'][0]['capability']})"
           if info.get("gpus") else "no GPU")
    r.status = "PASS"
    r.summary = (f"Python {info['python']}, torch {info['torch']} (CUDA {info['cuda_build']}), {gpu}, "
                 f"NCCL {info.get('nccl')}, megatron-core {info['megatron_core']}, "
                 f"transformer_engine: {info['transformer_engine']}")
    if ck.dry_run and info.get("cuda_available"):
        r.summary += " [--dry-run: GPU parts skipped]"


def _plans(ck: Check) -> dict[str, Path]:
    """1-rank plans (written with HeteroPlan; `hetermoe plan --even` refuses N=0) and even 1+1
    plans (hetermoe plan --even), for model tiny with R=2."""
    from megatron_hetermoe.config import ModelConfig
    from megatron_hetermoe.plan.hetero_plan import HeteroPlan, ZPGroup

    tiny = ModelConfig.load("tiny")
    out = {}
    for sched in ("distep", "zebra"):
        plan = HeteroPlan(tiny.num_layers, tiny.num_experts, ["cpu"],
                          [ZPGroup([0], [], [{0: list(range(tiny.num_experts))} for _ in range(tiny.num_layers)])],
                          num_microbatches=2, schedule=sched,
                          meta={"model": tiny.name, "made_by": "gpu_check: 1 attention rank holding every expert"})
        plan.validate()
        out[f"1rank_{sched}"] = ck.work / f"plan_1rank_{sched}.json"
        plan.save(out[f"1rank_{sched}"])
    return out


def step_1rank(ck: Check, r: StepResult) -> None:
    plans = _plans(ck)
    # Record whether the plan CLI makes a 1-rank plan itself (it refuses N=0 today).
    p = ck.run("plan_even_N0", ck.py("-m", "megatron_hetermoe.cli", "plan", "--even", "--model", "tiny",
                                     "--attention-ranks", "1", "--expert-ranks", "0", "--microbatches", "2",
                                     "-o", str(ck.work / "plan_even_N0.json")), ck.env(cpu=True), timeout=60)
    note = ("`hetermoe plan --even --expert-ranks 0` works" if p.ok else
            "`hetermoe plan --even --expert-ranks 0` refused (1-rank plan written with HeteroPlan)")
    ck.log(f"  note: {note}")
    iters = 4
    base = ["-m", "megatron_hetermoe.cli", "train", "--model", "tiny", "--micro-batch-size", "1",
            "--global-batch-size", "2", "--train-iters", str(iters), "--deterministic-mode"]
    # zebra: the default issuer (on the GPU the single issuer, on the CPU reference the threaded
    # one); zebra-threads: the threaded issuer on both.
    runs = {"ep": [], "distep": ["--hetero-plan", str(plans["1rank_distep"])],
            "zebra": ["--hetero-plan", str(plans["1rank_zebra"])],
            "zebra-threads": ["--hetero-plan", str(plans["1rank_zebra"]), "--hetero-zebra-issuer", "threads"],
            # Megatron's mixed precision on the GPU (the CPU reference runs the same precision).
            "zebra-bf16": ["--hetero-plan", str(plans["1rank_zebra"]), "--bf16"],
            # --initial-loss-scale: Megatron's default 2**32 skips the first steps of 4 (overflow).
            "zebra-fp16": ["--hetero-plan", str(plans["1rank_zebra"]), "--fp16", "--initial-loss-scale", "4096"]}
    fails, parts, got = [], [], {}
    for name, extra in runs.items():
        if ck.left() < 20:
            fails.append(f"{name}: out of time budget")
            continue
        outs = {d: ck.work / f"s2_{name}_{d}.json" for d in ("gpu", "cpu")}
        cmd = lambda d: ck.torchrun(1, *base, *extra, "--golden-values-out", str(outs[d]))  # noqa: E731
        pg, pc, gpu, cpu = _gpu_and_cpu(ck, f"s2_{name}", cmd, outs, ck.gpu, threads=2, timeout=150)
        got[name] = {"cpu": cpu, "gpu": gpu}
        if not _finite(cpu):
            fails.append(f"{name} CPU: {pc.why() if not pc.ok else 'no finite losses'}")
        if pg is not None and not _finite(gpu):
            fails.append(f"{name} GPU: {pg.why() if not pg.ok else 'no finite losses'}")
        _log_gpu_vs_cpu(ck, name, "GPU", cpu, gpu, parts, fails)
    for dev in ("cpu", "gpu"):  # the three runs train the same model on the same data
        ref = got.get("ep", {}).get(dev)
        for name in ("distep", "zebra", "zebra-threads"):
            x = got.get(name, {}).get(dev)
            if _finite(ref) and _finite(x):
                d = max(_rel(x, ref))
                ck.log(f"  {name} vs ep on {dev.upper()}: max rel diff {d:.2e}")
                if dev == "gpu":
                    parts.append(f"{name}/ep on GPU {d:.1e}")
    r.data = {"losses": got, "note": note}
    if fails:
        r.status, r.summary = "FAIL", "; ".join(fails)
    else:
        r.status = "PASS"
        r.summary = ("; ".join(parts) if ck.gpu else "CPU references only (ep, distep, zebra, zebra-threads, zebra-bf16, zebra-fp16 ran; GPU part SKIP)")


def _gpu_and_cpu(ck: "Check", tag: str, cmd, outs: dict, on_gpu: bool, threads: int, timeout: float):
    """Start the GPU run (when on_gpu) and its CPU reference side by side; returns (gpu process or
    None, cpu process, gpu losses or None, cpu losses or None)."""
    hg = ck.start(f"{tag}_gpu", cmd("gpu"), ck.env()) if on_gpu else None
    hc = ck.start(f"{tag}_cpu", cmd("cpu"), ck.env(cpu=True, threads=threads))
    pg = ck.finish(hg, min(timeout, ck.left())) if hg is not None else None
    pc = ck.finish(hc, min(timeout, ck.left()))
    cpu = _losses(outs["cpu"]) if pc.ok else None
    gpu = _losses(outs["gpu"]) if pg is not None and pg.ok else None
    return pg, pc, gpu, cpu


def _log_gpu_vs_cpu(ck: "Check", name: str, gpu_label: str, cpu, gpu, parts: list, fails: list) -> None:
    """Log a run's CPU and GPU losses and their per-step relative difference; a difference over
    the loose sanity bound is a failure."""
    if _finite(cpu):
        ck.log(f"  {name}: CPU losses {_fmt(cpu, '.7f')}")
    if _finite(gpu):
        ck.log(f"  {name}: {gpu_label} losses {_fmt(gpu, '.7f')}")
    if _finite(cpu) and _finite(gpu):
        rel = _rel(gpu, cpu)
        ck.log(f"  {name}: GPU vs CPU rel diff per step {_fmt(rel, '.2e')}")
        parts.append(f"{name} GPU/CPU max rel {max(rel):.2e}")
        if max(rel) > LOOSE_REL:
            fails.append(f"{name}: GPU vs CPU rel diff {max(rel):.2e} > {LOOSE_REL}")


def step_gloo2(ck: Check, r: StepResult) -> None:
    plans = {}
    for sched in ("distep", "zebra"):
        path = ck.work / f"plan_even11_{sched}.json"
        p = ck.run(f"plan_even11_{sched}", ck.py("-m", "megatron_hetermoe.cli", "plan", "--even", "--model", "tiny",
                                                "--attention-ranks", "1", "--expert-ranks", "1", "--microbatches", "2",
                                                "--schedule", sched, "-o", str(path)), ck.env(cpu=True), timeout=60)
        if not p.ok:
            r.status, r.summary = "FAIL", f"hetermoe plan --even 1+1 failed ({p.why()})"
            return
        plans[sched] = path
    gloo_cuda, probe_note = False, "not run (no GPU)"
    if ck.gpu:
        p = ck.run("s3_gloo_a2a_probe", ck.torchrun(2, *ck.worker("gloo-a2a")), ck.env(), timeout=min(120, ck.left()))
        res = p.result()
        gloo_cuda = bool(p.ok and res and res.get("ok"))
        probe_note = ("gloo all_to_all_single takes CUDA tensors (uneven splits, values checked; "
                      f"{res.get('gbs', 0):.2f} GB/s at 64 MiB)" if gloo_cuda else
                      f"gloo all_to_all_single on CUDA tensors FAILED: {(res or {}).get('error') or p.why()}")
        ck.log(f"  {probe_note}")
    fails, parts, got, impossible = [], [], {}, []
    # zebra-pools: bf16 on the attention rank, fp16 on the expert rank (per-pool precision).
    runs = {"distep": (plans["distep"], []), "zebra": (plans["zebra"], []), "zebra-pools": (plans["zebra"], ["--pools"])}
    for sched, (plan, extra) in runs.items():
        if ck.left() < 25:
            fails.append(f"{sched}: out of time budget")
            continue
        outs = {d: ck.work / f"s3_{sched}_{d}.json" for d in ("gpu", "cpu")}
        cmd = lambda d: ck.torchrun(2, *ck.worker("hetero-train", "--plan", str(plan), "--iters", "4",  # noqa: E731
                                                   "--out", str(outs[d]), *extra))
        pg, pc, gpu, cpu = _gpu_and_cpu(ck, f"s3_{sched}", cmd, outs, gloo_cuda, threads=1, timeout=180)
        got[sched] = {"cpu": cpu, "gpu": gpu}
        if not _finite(cpu):
            fails.append(f"{sched} CPU: {pc.why() if not pc.ok else 'no finite losses'}")
        if pg is not None and not _finite(gpu):
            if not pg.ok and GLOO_NO_CUDA_COALESCED in pg.output:
                impossible.append(sched)
            else:
                fails.append(f"{sched} GPU(gloo): {pg.why() if not pg.ok else 'no finite losses'}")
        _log_gpu_vs_cpu(ck, sched, "GPU (gloo, 2 ranks on one GPU)", cpu, gpu, parts, fails)
    r.data = {"losses": got, "gloo_cuda_all_to_all": gloo_cuda, "probe": probe_note}
    if fails:
        r.status, r.summary = "FAIL", "; ".join(fails) + (f" | {probe_note}" if ck.gpu else "")
    elif impossible:
        r.status, r.summary = "SKIP", (f"{', '.join(impossible)} on CUDA over gloo: not possible (Megatron DDP's grad sync "
                                       f"needs allreduce_coalesced, which gloo has only for CPU tensors; seen on an H200); "
                                       f"multi-rank HeterMoE on GPUs needs NCCL and >= 2 GPUs | {probe_note}; CPU references ran")
    elif ck.gpu and not gloo_cuda:
        r.status, r.summary = "SKIP", f"{probe_note}; CPU references ran"
    else:
        r.status = "PASS"
        r.summary = ("; ".join(parts) + " | gloo all_to_all takes CUDA tensors" if ck.gpu
                     else "CPU references only (distep, zebra, zebra with bf16/fp16 pools on 1+1; GPU part SKIP)")


def step_moe_layer(ck: Check, r: StepResult) -> None:
    if ck.gpu:
        args = ["--model", "d1", "--tokens", "8192", "--dtypes", "bf16,fp32", "--repeats", "5"]
    else:
        args = ["--model", "tiny", "--tokens", "256", "--dtypes", "fp32", "--repeats", "2"]
    times, fails = {}, []
    for impl in ("megatron", "hetero"):
        if ck.left() < 20:
            fails.append(f"{impl}: out of time budget")
            continue
        p = ck.run(f"s4_{impl}", ck.py(*ck.worker("moe-layer", "--impl", impl, *args)),
                   ck.env() if ck.gpu else ck.env(cpu=True, threads=2), timeout=min(200, ck.left()))
        res = p.result()
        if not p.ok or not res:
            fails.append(f"{impl}: {p.why()}")
            continue
        times[impl] = res
        for dt, row in res["times"].items():
            ck.log(f"  {impl:8s} {dt}: fwd+bwd {row['ms']:.3f} ms (min {row['min_ms']:.3f}), "
                   f"fwd {row['fwd_ms']:.3f} ms, peak mem {row.get('peak_gib', 0):.2f} GiB, "
                   f"{res['shape']} on {res['device']}")
    parts = []
    for dt in (times.get("megatron") or times.get("hetero") or {}).get("times", {}):
        m = times.get("megatron", {}).get("times", {}).get(dt)
        h = times.get("hetero", {}).get("times", {}).get(dt)
        s = f"{dt}: megatron {m['ms']:.2f} ms" if m else f"{dt}: megatron n/a"
        s += f", hetero {h['ms']:.2f} ms" if h else ", hetero n/a"
        if m and h:
            s += f" (x{h['ms'] / m['ms']:.2f})"
        parts.append(s)
    r.data = times
    shape = next(iter(times.values()))["shape"] if times else ""
    if fails:
        r.status, r.summary = "FAIL", "; ".join(fails + parts)
    else:
        r.status = "PASS"
        r.summary = f"{shape}: " + "; ".join(parts) + ("" if ck.gpu else " [CPU, tiny shape]")


def step_overlap(ck: Check, r: StepResult) -> None:
    if not ck.gpu:
        r.status, r.summary = "SKIP", "GPU only"
        return
    p = ck.run("s5_overlap", ck.py(*ck.worker("overlap")), ck.env(), timeout=min(150, ck.left()))
    res = p.result()
    if not p.ok or not res:
        r.status, r.summary = "FAIL", p.why()
        return
    r.data = res
    parts, fails = [], []
    for k in ("copy", "a2a"):
        row = res.get(k)
        if row is None:
            parts.append(f"{k}: {res.get(k + '_error', 'n/a')}")
            continue
        ck.log(f"  gemm {row['t_gemm'] * 1e3:.1f} ms + {k} {row['t_comm'] * 1e3:.1f} ms alone; both on two streams "
               f"{row['t_both'] * 1e3:.1f} ms: overlap ratio {row['ratio']:.2f}")
        parts.append(f"gemm+{k} ratio {row['ratio']:.2f}")
    ex = res.get("executor")
    if ex is None:
        parts.append(f"executor: {res.get('executor_error', 'n/a')}")
        fails.append(f"executor probe: {res.get('executor_error', 'n/a')}")
    else:
        ck.log(f"  executor ({ex['tasks']}): ThreadStream {ex['t_thread'] * 1e3:.1f} ms, CudaStream "
               f"{ex['t_cuda'] * 1e3:.1f} ms (compute alone {ex['t_compute'] * 1e3:.1f} ms, transfers alone "
               f"{ex['t_transfer'] * 1e3:.1f} ms): speed-up x{ex['speedup']:.2f}; values ok: "
               f"thread {ex['ok_thread']}, cuda {ex['ok_cuda']}")
        ck.log(f"  single issuer {ex['t_single'] * 1e3:.1f} ms: speed-up x{ex['speedup_single']:.2f} vs ThreadStream; "
               f"values ok: {ex['ok_single']}")
        parts.append(f"executor CudaStream x{ex['speedup']:.2f}, single issuer x{ex['speedup_single']:.2f} "
                     f"vs ThreadStream")
        if not (ex["ok_thread"] and ex["ok_cuda"] and ex["ok_single"]):
            fails.append("executor: transferred values wrong (stream ordering bug)")
    r.status = "FAIL" if fails else "PASS"
    r.summary = "; ".join(fails + parts)


def step_profile(ck: Check, r: StepResult) -> None:
    out = ck.work / ("profile_gpu.yaml" if ck.gpu else "profile_cpu_tiny.yaml")
    if ck.gpu:
        args = ["--model", "d1", "--seq-lens", "1024,4096", "--seqs", "1,2", "--expert-tokens", "1024,4096,16384",
                "--repeats", "3", "--name", "gpu-check"]
        env = ck.env()
    else:
        args = ["--model", "tiny", "--seq-lens", "16,32", "--seqs", "1", "--expert-tokens", "32,64", "--repeats", "2",
                "--a2a-bytes", "4096,65536"]
        env = ck.env(cpu=True, threads=2)
    p = ck.run("s6_profile", ck.py("-m", "megatron_hetermoe.cli", "profile", *args, "--out", str(out)), env,
               timeout=min(200, ck.left()))
    if not p.ok or not out.exists():
        r.status, r.summary = "FAIL", p.why()
        return
    try:
        import yaml

        d = yaml.safe_load(out.read_text())
        v = lambda k: (d.get(k) or {}).get("value")  # noqa: E731
        r.data = {k: v(k) for k in ("peak_fp16_tflops", "memory_bandwidth_gbs", "gemm_efficiency",
                                    "launch_overhead_us", "intra_node_gbs", "memory_gib")}
        dtype = d.get("measured", {}).get("info", {}).get("dtype", "?")
        r.summary = (f"{dtype}: matmul {r.data['peak_fp16_tflops']:.1f} TFLOP/s, copy {r.data['memory_bandwidth_gbs']:.0f} "
                     f"GB/s, expert GEMM efficiency {r.data['gemm_efficiency']:.2f}, launch "
                     f"{r.data['launch_overhead_us']:.1f} us; wrote {out.name}")
    except Exception as e:  # noqa: BLE001 - the profile was written; its numbers are a bonus
        r.summary = f"wrote {out.name} (could not read it back: {e})"
    shutil.copy(out, ck.out_dir / out.name)
    r.status = "PASS"


STEPS = {1: step_env, 2: step_1rank, 3: step_gloo2, 4: step_moe_layer, 5: step_overlap, 6: step_profile}


def orchestrate(a: argparse.Namespace) -> int:
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else Path.cwd()
    log_path = Path(a.log) if a.log else out_dir / "gpu_check.log"
    out_dir = log_path.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    want = sorted({int(s) for s in a.steps.split(",")}) if a.steps else list(ORDER)
    ck = Check(log_path, out_dir, work, a.dry_run, a.budget)
    ck.log(f"HeterMoE GPU check, {time.strftime('%Y-%m-%d %H:%M:%S')}, repo {REPO}, work dir {work}"
           + (" [--dry-run]" if a.dry_run else ""))
    results: dict[int, StepResult] = {}
    for n in [s for s in ORDER if s in want or s == 1]:  # step 1 decides GPU or not
        r = StepResult(n, NAMES[n])
        ck.log(f"\n=== step {n}: {NAMES[n]} (time left {ck.left():.0f} s) ===")
        t0 = time.perf_counter()
        if n != 1 and ck.left() < 15:
            r.status, r.summary = "SKIP", "out of time budget"
        else:
            try:
                STEPS[n](ck, r)
            except Exception as e:  # noqa: BLE001 - one step's bug must not stop the others
                import traceback

                ck.log(traceback.format_exc())
                r.status, r.summary = "FAIL", f"{type(e).__name__}: {e}"
        r.seconds = time.perf_counter() - t0
        ck.log(f"--> step {n} {r.status} ({r.seconds:.0f} s): {r.summary}")
        results[n] = r
    total = time.perf_counter() - ck.t0
    n_fail = sum(r.status == "FAIL" for r in results.values())
    n_skip = sum(r.status == "SKIP" for r in results.values())
    ck.log("\n" + "=" * 30 + " SUMMARY " + "=" * 30)
    for n in sorted(results):
        r = results[n]
        ck.log(f"step {n} {r.name:<40s} {r.status:<4s} {r.seconds:5.0f} s  {r.summary}")
    ck.log(f"overall: {'FAIL' if n_fail else 'PASS'} ({n_fail} FAIL, {n_skip} SKIP) in {total:.0f} s"
           + (" [--dry-run]" if a.dry_run else "" if ck.gpu else " [no GPU]"))
    ck.log("=" * 69)
    (out_dir / "gpu_check.json").write_text(json.dumps(
        {"dry_run": a.dry_run, "gpu": ck.gpu, "seconds": total,
         "steps": {str(n): asdict(r) for n, r in sorted(results.items())}}, indent=1, default=str))
    if not a.keep_work:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if n_fail else 0


# ================================================================ workers (subprocesses)
def _emit(d: dict) -> None:
    print(RESULT_TAG + json.dumps(d, default=str), flush=True)


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
    _emit(info)
    return 0


def _init_single(dev) -> None:
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
    _init_single(dev)
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
    _emit({"impl": a.impl, "class": kind, "device": str(dev), "shape": f"{model.name} [{S}x{B}x{model.hidden_size}] "
           f"{model.num_experts} experts top-{model.moe_router_topk}", "times": times})
    return 0


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
        _emit(res)
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
    import megatron_hetermoe.training.hetero as H
    from megatron_hetermoe.config import HeteroRunConfig, ModelConfig, TrainConfig
    from megatron_hetermoe.plan.hetero_plan import HeteroPlan

    if cuda:
        reduce_buckets_one_by_one()
        # The trainer puts a rank on the GPU only under NCCL (rank_device): force this GPU.
        orig = H.initialize_hetero_parallel
        H.initialize_hetero_parallel = lambda plan, timeout=None, device=None, **kw: orig(plan, timeout, device=dev, **kw)
        if hasattr(H, "rank_device"):
            H.rank_device = lambda *x, **k: dev
    plan = HeteroPlan.load(a.plan)
    tiny = ModelConfig.load("tiny")
    # --pools: bf16 attention ranks, fp16 expert ranks (tokens cross in fp16), one fp16 loss scale.
    cfg = TrainConfig(model=tiny, micro_batch_size=1, global_batch_size=plan.num_microbatches * len(plan.attention_ranks),
                      train_iters=a.iters, deterministic=True,  # quiet must agree on every rank (collective logging)
                      bf16=a.pools, initial_loss_scale=4096.0 if a.pools else 2.0**32)
    res = H.train_hetero(cfg, plan, HeteroRunConfig(schedule=plan.schedule, expert_precision="fp16" if a.pools else None))
    if int(os.environ["RANK"]) == 0:
        Path(a.out).write_text(json.dumps({"losses": [float(x) for x in res["losses"]], "device": str(dev)}))
        print(f"rank 0 on {dev}: losses {res['losses']}")
    dist.destroy_process_group()
    return 0


def worker_overlap(a) -> int:
    """GPU only: GEMM vs copy / all_to_all on two streams, and the zebra executor's streams."""
    import torch
    import torch.distributed as dist

    dev = torch.device("cuda", 0)
    _init_single(dev)
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
    copy = lambda: dst.copy_(src)  # noqa: E731
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
    _emit(res)
    return 0


def _executor_probe(dev, gemm, timed, calibrate, numel: int = 64 * 2**20) -> dict:
    """The zebra executor on an expert rank's list (L=1, R=4) with GEMM compute and all_to_all
    transfers (world of 1: a copy through NCCL, one group per stream), CudaStream vs ThreadStream,
    and the single issuer (schedules/issuer.py: async collectives, a counts exchange per D_F on a
    third group). Each compute task writes its outputs after a long GEMM and each transfer sends a compute
    output (and vice versa), so a missing event wait shows as a wrong value."""
    import torch
    import torch.distributed as dist

    from megatron_hetermoe.config import ZebraConfig
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
    unit = lambda: dist.all_to_all_single(probe_y, probe_x, group=groups["dispatch"])  # noqa: E731
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
            IssueExecutor(1, ZebraConfig(issuer="single"), None, device=dev).run(tasks, compute, start)
        else:
            TaskExecutor(1, ZebraConfig(), None, make_stream=make_stream).run(tasks, compute, transfer)
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


WORKERS = {"env": worker_env, "moe-layer": worker_moe_layer, "gloo-a2a": worker_gloo_a2a,
           "hetero-train": worker_hetero_train, "overlap": worker_overlap}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpu_check", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="CPU only: tiny sizes, CPU references, GPU-only steps SKIP")
    p.add_argument("--steps", default=None, help="comma-separated step numbers (default: all)")
    p.add_argument("--log", default=None, help="log file (default: $OUT/gpu_check.log, else ./gpu_check.log)")
    p.add_argument("--budget", type=float, default=430.0, help="seconds for all steps; later steps SKIP when it runs out")
    p.add_argument("--keep-work", action="store_true", help="keep the work directory (plans, run outputs)")
    p.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    # worker arguments
    p.add_argument("--impl", choices=["megatron", "hetero"], help=argparse.SUPPRESS)
    p.add_argument("--model", default="tiny", help=argparse.SUPPRESS)
    p.add_argument("--tokens", type=int, default=256, help=argparse.SUPPRESS)
    p.add_argument("--dtypes", default="fp32", help=argparse.SUPPRESS)
    p.add_argument("--repeats", type=int, default=3, help=argparse.SUPPRESS)
    p.add_argument("--plan", help=argparse.SUPPRESS)
    p.add_argument("--iters", type=int, default=4, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--pools", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        # A worker ends with os._exit: a process holding NCCL communicators or CUDA-stream worker
        # threads can hang at interpreter exit (seen on the H200: step 4 and 5 hung after their
        # results), and a hung worker costs the whole step its timeout.
        try:
            rc = WORKERS[a.worker](a)
        except BaseException:  # noqa: BLE001 - shown, then the process ends
            import traceback

            traceback.print_exc()
            rc = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(int(rc or 0))
    return orchestrate(a)


if __name__ == "__main__":
    sys.exit(main())
