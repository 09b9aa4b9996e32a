"""The GPU check's earlier steps, kept as fallbacks and extras (main.py lists when each runs):
one rank on NCCL vs CPU and two ranks sharing the GPU over gloo (the fallbacks when the 4-rank
NCCL preflight fails), and the MoE layer timing, the stream-overlap probe, `hetermoe profile` and
the grouped-GEMM checkpoint tests (extras, by name with --steps)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from judge import LOOSE_REL, Status
from judge import finite as _finite
from judge import fmt as _fmt
from judge import rel_diffs as _rel
from runner import Check, StepResult

GLOO_NO_CUDA_COALESCED = "allreduce_coalesced: unsupported device type cuda"


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
        r.status, r.summary = Status.FAIL, "; ".join(fails)
    else:
        r.status = Status.PASS
        r.summary = ("; ".join(parts) if ck.gpu
                     else "CPU references only (ep, distep, zebra, zebra-threads, zebra-bf16, zebra-fp16 ran; "
                          "GPU part SKIP)")


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
            r.status, r.summary = Status.FAIL, f"hetermoe plan --even 1+1 failed ({p.why()})"
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
    runs = {"distep": (plans["distep"], []), "zebra": (plans["zebra"], []),
            "zebra-pools": (plans["zebra"], ["--pools"])}
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
        r.status, r.summary = Status.FAIL, "; ".join(fails) + (f" | {probe_note}" if ck.gpu else "")
    elif impossible:
        r.status, r.summary = Status.SKIP, (f"{', '.join(impossible)} on CUDA over gloo: not possible "
                                            f"(Megatron DDP's grad sync needs allreduce_coalesced, which gloo has "
                                            f"only for CPU tensors; seen on an H200); multi-rank HeterMoE on GPUs "
                                            f"needs NCCL and >= 2 GPUs | {probe_note}; CPU references ran")
    elif ck.gpu and not gloo_cuda:
        r.status, r.summary = Status.SKIP, f"{probe_note}; CPU references ran"
    else:
        r.status = Status.PASS
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
        r.status, r.summary = Status.FAIL, "; ".join(fails + parts)
    else:
        r.status = Status.PASS
        r.summary = f"{shape}: " + "; ".join(parts) + ("" if ck.gpu else " [CPU, tiny shape]")


def step_overlap(ck: Check, r: StepResult) -> None:
    if not ck.gpu:
        r.status, r.summary = Status.SKIP, "GPU only"
        return
    p = ck.run("s5_overlap", ck.py(*ck.worker("overlap")), ck.env(), timeout=min(150, ck.left()))
    res = p.result()
    if not p.ok or not res:
        r.status, r.summary = Status.FAIL, p.why()
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
    r.status = Status.FAIL if fails else Status.PASS
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
        r.status, r.summary = Status.FAIL, p.why()
        return
    try:
        import yaml

        d = yaml.safe_load(out.read_text())
        v = lambda k: (d.get(k) or {}).get("value")  # noqa: E731
        r.data = {k: v(k) for k in ("peak_fp16_tflops", "memory_bandwidth_gbs", "gemm_efficiency",
                                    "launch_overhead_us", "intra_node_gbs", "memory_gib")}
        dtype = d.get("measured", {}).get("info", {}).get("dtype", "?")
        r.summary = (f"{dtype}: matmul {r.data['peak_fp16_tflops']:.1f} TFLOP/s, "
                     f"copy {r.data['memory_bandwidth_gbs']:.0f} GB/s, "
                     f"expert GEMM efficiency {r.data['gemm_efficiency']:.2f}, launch "
                     f"{r.data['launch_overhead_us']:.1f} us; wrote {out.name}")
    except Exception as e:  # noqa: BLE001 - the profile was written; its numbers are a bonus
        r.summary = f"wrote {out.name} (could not read it back: {e})"
    shutil.copy(out, ck.out_dir / out.name)
    r.status = Status.PASS


def step_grouped_ckpt(ck: Check, r: StepResult) -> None:
    """tests/checkpoint/test_grouped_experts.py: Megatron EP's experts <-> plan-placed GroupedMLP and
    TEGroupedMLP holders through torch_dist (the TEGroupedMLP cases need transformer-engine and CUDA)."""
    try:
        import pytest  # noqa: F401
    except ImportError:
        r.status, r.summary = Status.SKIP, "pytest is not installed here"
        return
    p = ck.run("s7_grouped_ckpt", ck.py("-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                                        "tests/checkpoint/test_grouped_experts.py"),
               ck.env(), timeout=min(120, ck.left()))
    tail = [ln for ln in p.output.splitlines() if " passed" in ln or " failed" in ln or " skipped" in ln]
    r.status = Status.PASS if p.ok else Status.FAIL
    r.summary = (tail[-1].strip() if tail else p.why())[:300]
    if p.ok and "TEGroupedMLP" in p.output and "SKIPPED" in p.output:
        r.summary += " (TEGroupedMLP cases skipped: see the log)"
