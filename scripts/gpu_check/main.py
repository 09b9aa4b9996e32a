"""One prepared check of HeterMoE on one GPU with four real NCCL ranks: `scripts/gpu_check.sh [--dry-run]`.

Made for one unattended call on one H200 (or H100), within 8 minutes (--budget, default 430 s; the
machine's start not included). It leaves one log: $OUT/gpu_check.log when $OUT is set, else
./gpu_check.log (--log to choose), ending in a SUMMARY block with PASS / FAIL / SKIP and the key
numbers of every step; gpu_check.json beside it has the same results for programs. Every run is a
subprocess with its own timeout, so one failure or hang does not stop the others.

Four NCCL ranks on one GPU: NCCL refuses two ranks on one device only when they share a host hash.
Every 4-rank run is `torchrun --nproc-per-node 4 scripts/gpu_check/rank.py <the product's entry
point>`: rank.py gives each rank its own NCCL_HOSTID (and LOCAL_RANK 0: a host of one GPU), with
NCCL_NET=Socket NCCL_SOCKET_IFNAME=lo NCCL_IB_DISABLE=1, then runs the entry point unchanged
(runpy). The entry points are the product's: `python -m megatron_hetermoe.cli train ...` and
Megatron-LM core_v0.16.1's pretrain_gpt.py with HeterMoE's patch. Each DEVICE run (4 NCCL ranks on
the GPU) has its CPU reference (4 gloo ranks, CUDA hidden) started beside it. The plans are
the product's even_plan (what `hetermoe plan --even` writes): the 2+2 plan is one ZP group of
2 attention + 2 expert ranks (R 4).

Steps, in the order they run (most important first; --steps a,b runs some, by name):
  env              Python, torch, the GPU, NCCL, every package the check imports (what is MISSING, by
                   name), Megatron-LM's tree and its helpers' build tools, transformer-engine.
  preflight        ~20 s: 4 NCCL ranks (the product's init_distributed); every group kind the product
                   creates (parallel/state.py on a 2+2, a PP 2 and an attention-TP 2 plan; members and
                   an all_reduce checked per kind); uneven all_to_all_single with zero splits on the
                   dispatch, combine and counts communicators at once (async, values checked); all_reduce,
                   broadcast, all_gather, reduce_scatter, batch_isend_irecv (8 MiB pairs). When it FAILs,
                   the 4-rank steps SKIP and the fallbacks run:
    nccl-1rank     (fallback) 1-rank train on NCCL vs CPU: EP, distep, zebra, threads, bf16, fp16.
    gloo-2ranks    (fallback) 2 ranks sharing the GPU over gloo vs CPU: distep, zebra, bf16/fp16 pools.
  zebra            `hetermoe train` zebra, --hetero-zebra-issuer single, fp32, 6 steps (saved after 3):
                   losses vs the CPU ranks' within judge.FP32_REL (fp32 round-off, from two CPU kernels x5).
  distep           the same with --hetero-schedule distep, vs CPU (and vs zebra, reported).
  zebra-threads    --hetero-zebra-issuer threads: refused by name (the error line), or bitwise zebra's.
  resume           zebra's runs resumed from their step-3 checkpoints: steps 4-6 bitwise (each side).
  pools            --bf16 --hetero-expert-precision fp16 (initial scale 2^23): parameter dtypes per
                   role, one loss-scale trajectory and the same skipped steps on every rank; vs CPU.
  fp16-overflow    --fp16 --initial-loss-scale 2^20 (overflows): the same skipped steps on every rank.
  distopt          zebra with --use-distributed-optimizer vs CPU, then save at 3 / resume, bitwise.
  pretrain         Megatron-LM's own pretrain() (core_v0.16.1 pretrain_gpt.py, patched) with
                   --hetero-plan (2+2 zebra) on the 4 ranks, CUDA_DEVICE_MAX_CONNECTIONS=1 as
                   Megatron's recipes, vs the same on CPU ranks; needs MEGATRON_LM_DIR or .whl's tarball.
  host-syncs       one process: host syncs per MoE layer forward+backward under
                   torch.cuda.set_sync_debug_mode("warn"), the attention side's HeteroMoELayer and the
                   expert runtime's run_local_experts (issue 43 item 6); GPU only.
  transformer-engine  zebra with --transformer-impl transformer_engine (and --moe-grouped-gemm), only
                   where `import transformer_engine` works.
  pp2-1f1b         last, with its own short timeout (90 s, kept out of the others' budget): PP 2 zebra
                   in the 1f1b wave order with an 8.4 MB stage message (> NCCL's 4 MiB buffer); a
                   timeout is a FAIL naming issue 43 item 1.
Extras (only by name with --steps): moe-layer (fwd+bwd timing, megatron vs hetero), overlap (GEMM vs
copy/all_to_all on two streams; the executors), profile (`hetermoe profile`), grouped-ckpt
(tests/checkpoint/test_grouped_experts.py).

--dry-run (CPU): the same harness with gloo ranks instead of NCCL: every 4-rank run through rank.py
with the same per-rank environment, result files, comparisons and SUMMARY. The preflight runs
under torchrun as on the GPU; the other runs fork their ranks from one process that imported
torch and megatron once (forkrun.py, torchrun's environment: a 4-rank run's imports cost ~16 s of
CPU under torchrun). Only zebra runs a CPU reference, on ATEN_CPU_CAPABILITY=default (two CPU
kernels). GPU-only parts SKIP, and so do distep and distopt ("the same harness path as zebra /
resume"). ~1 minute on two idle cores (tests/tools/test_gpu_check.py). Exit status 0 when no step
FAILed.

The device call (a machine with Python 3.12, torch, no megatron-core and no package registry;
docs/gpu-check.md says more). On a CPU machine with a registry, once: `make gpu-wheels` (megatron-core's
cp312 wheel, pydantic and what it needs, and Megatron-LM core_v0.16.1's tarball, into .whl/). Then
the device tool's run with carry [".whl"] and timeout_s 600:

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \\
      .whl/*.whl && export PYTHONPATH=/tmp/site || exit; PYTHON=python3 scripts/gpu_check.sh

(or set MEGATRON_LM_DIR to a core_v0.16.1 tree that travels). Results: $OUT/gpu_check.log,
$OUT/gpu_check.json.

A harness, not part of the package: `python scripts/gpu_check/main.py` from a checkout, with
megatron_hetermoe importable (this checkout's copy comes first for it and its subprocesses).
main.py is the CLI and the step loop with the SUMMARY; steps.py the steps, legacy.py the fallbacks
and extras, judge.py the judgements (pure functions), runner.py the subprocesses, rank.py each rank
of a 4-rank run, workers.py and probes.py the single-process and preflight workers.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import legacy
import probes
import steps
import workers
from judge import Status
from runner import REPO, Check, StepResult
from steps import StepDef, StepGroup

if str(REPO) not in sys.path:  # the checkout's package, as the workers get it (Check.env)
    sys.path.insert(1, str(REPO))

# Seconds for every step, the last one's reserve included; with a timeout's clean-up (SIGTERM, 5 s,
# SIGKILL) and the wheels' install before it (~20 s) the call stays inside 8 minutes.
DEFAULT_BUDGET_S = 430.0

STEPS: tuple[StepDef, ...] = (
    StepDef("env", "environment", steps.step_env, needs_world=False),
    StepDef("preflight", "4 NCCL ranks on one GPU: groups, collectives", steps.step_preflight, needs_world=False),
    StepDef("nccl-1rank", "fallback: 1-rank train on NCCL vs CPU", legacy.step_1rank, StepGroup.FALLBACK, False),
    StepDef("gloo-2ranks", "fallback: 2 ranks on one GPU over gloo", legacy.step_gloo2, StepGroup.FALLBACK, False),
    StepDef("zebra", "zebra, single issuer, fp32, 2+2 vs CPU", steps.step_zebra),
    StepDef("distep", "distep, 2+2 vs CPU", steps.step_distep, dry_run_as="zebra"),
    StepDef("cp2", "context parallelism: CP-2 member + 2, zebra vs CPU", steps.step_cp2),
    StepDef("zebra-threads", "zebra, threads issuer: refused or equal", steps.step_threads),
    StepDef("resume", "save at step 3, resume: steps 4-6 bitwise", steps.step_resume),
    StepDef("pools", "bf16 attention + fp16 experts: dtypes, one scale", steps.step_pools),
    StepDef("fp16-overflow", "fp16, overflowing scale: same skipped steps", steps.step_fp16),
    StepDef("distopt", "distributed optimizer vs CPU; save/resume", steps.step_distopt, dry_run_as="resume"),
    StepDef("pretrain", "Megatron-LM pretrain() with --hetero-plan vs CPU", steps.step_pretrain),
    StepDef("host-syncs", "host syncs per MoE layer fwd+bwd (item 6)", steps.step_host_syncs, needs_world=False),
    StepDef("transformer-engine", "transformer-engine variants", steps.step_te),
    StepDef("pp2-1f1b", "PP 2 zebra 1f1b, stage message > 4 MB (item 1)", steps.step_pp_1f1b),
    StepDef("moe-layer", "extra: MoE layer fwd+bwd (megatron vs hetero)", legacy.step_moe_layer, StepGroup.EXTRA,
            False),
    StepDef("overlap", "extra: stream overlap probe", legacy.step_overlap, StepGroup.EXTRA, False),
    StepDef("profile", "extra: hetermoe profile", legacy.step_profile, StepGroup.EXTRA, False),
    StepDef("grouped-ckpt", "extra: grouped-GEMM expert checkpoints", legacy.step_grouped_ckpt, StepGroup.EXTRA, False),
)
BY_NAME = {s.name: s for s in STEPS}
LAST = "pp2-1f1b"  # runs last, on the budget kept for it


def plan_steps(want: list[str] | None) -> list[StepDef]:
    """The steps to consider, in running order: the MAIN and FALLBACK ones by default (fallbacks
    run only when the preflight fails), or the named ones (env always first: it finds the GPU)."""
    if want is None:
        return [s for s in STEPS if s.group is not StepGroup.EXTRA]
    unknown = [w for w in want if w not in BY_NAME]
    if unknown:
        raise SystemExit(f"--steps: unknown {unknown}; steps: {', '.join(BY_NAME)}")
    return [s for s in STEPS if s.name in want or s.name == "env"]


def why_skip(ck: Check, s: StepDef, chosen: list[StepDef]) -> str | None:
    """Why step `s` does not run now (None: it runs)."""
    if s.name != "env" and not ck.env_ok:
        return "the plugin or megatron-core does not import here (step env says what is missing)"
    if s.group is StepGroup.FALLBACK and ck.preflight_ok is not False and any(c.name == "preflight" for c in chosen):
        return "preflight passed: fallbacks not needed"  # (named without the preflight, they run)
    if s.needs_world and ck.preflight_ok is False:
        return "preflight failed: 4 NCCL ranks on one GPU did not work (fallbacks ran instead)"
    if ck.dry_run and s.dry_run_as and any(c.name == s.dry_run_as for c in chosen):
        return f"--dry-run: the same harness path as step {s.dry_run_as} (runs on a GPU)"
    if s.name != "env" and ck.left() < 15 and s.name != LAST:
        return "out of time budget"
    return None


def orchestrate(a: argparse.Namespace) -> int:
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else Path.cwd()
    log_path = Path(a.log) if a.log else out_dir / "gpu_check.log"
    out_dir = log_path.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    chosen = plan_steps(a.steps.split(",") if a.steps else None)
    ck = Check(log_path, out_dir, work, a.dry_run, a.budget)
    if any(s.name == LAST for s in chosen):
        ck.reserve_s = steps.PP_TIMEOUT_S + 10
    ck.log(f"HeterMoE GPU check, {time.strftime('%Y-%m-%d %H:%M:%S')}, repo {REPO}, work dir {work}, "
           f"budget {a.budget:.0f} s" + (" [--dry-run]" if a.dry_run else ""))
    results: dict[str, StepResult] = {}
    for s in chosen:
        r = StepResult(s.name, s.title)
        t0 = time.perf_counter()
        if s.name == LAST:
            ck.reserve_s = 0.0
        skip = why_skip(ck, s, chosen)
        if skip is not None:
            r.status, r.summary = Status.SKIP, skip
            if s.group is StepGroup.FALLBACK and skip.startswith("preflight passed"):
                continue  # not listed: a fallback that was not needed
        else:
            ck.log(f"\n=== {s.name}: {s.title} (time left {ck.left_total():.0f} s) ===")
            try:
                s.fn(ck, r)
            except Exception as e:  # noqa: BLE001 - one step's bug must not stop the others
                import traceback

                ck.log(traceback.format_exc())
                r.status, r.summary = Status.FAIL, f"{type(e).__name__}: {e}"
            ck.log(f"--> {s.name} {r.status} ({time.perf_counter() - t0:.0f} s): {r.summary}")
        r.seconds = time.perf_counter() - t0
        results[s.name] = r
    total = time.perf_counter() - ck.t0
    n_fail = sum(r.status is Status.FAIL for r in results.values())
    n_skip = sum(r.status is Status.SKIP for r in results.values())
    ck.log("\n" + "=" * 30 + " SUMMARY " + "=" * 30)
    if ck.preflight_ok is False:
        ck.log("preflight FAILED: 4 NCCL ranks on one GPU did not work; the 4-rank steps SKIP, the fallbacks ran")
    for name, r in results.items():
        ck.log(f"{name:<19s} {r.status!s:<4s} {r.seconds:5.0f} s  {r.summary}")
    ck.log(f"overall: {'FAIL' if n_fail else 'PASS'} ({n_fail} FAIL, {n_skip} SKIP) in {total:.0f} s"
           + (" [--dry-run]" if a.dry_run else "" if ck.gpu else " [no GPU]"))
    ck.log("=" * 69)
    (out_dir / "gpu_check.json").write_text(json.dumps(
        {"dry_run": a.dry_run, "gpu": ck.gpu, "seconds": total, "preflight_ok": ck.preflight_ok,
         "steps": {n: {**asdict(r), "status": str(r.status)} for n, r in results.items()}}, indent=1, default=str))
    if not a.keep_work:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if n_fail else 0


# The subprocesses' entry points: `python scripts/gpu_check/main.py --worker NAME ...`.
WORKERS = {"env": workers.worker_env, "preflight": workers.worker_preflight, "host-syncs": probes.worker_host_syncs,
           "moe-layer": probes.worker_moe_layer, "gloo-a2a": workers.worker_gloo_a2a,
           "hetero-train": workers.worker_hetero_train, "overlap": probes.worker_overlap}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpu_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="CPU only: gloo ranks instead of NCCL, GPU-only parts SKIP")
    p.add_argument("--steps", default=None, help=f"comma-separated step names (default: all but the extras): "
                                                 f"{', '.join(BY_NAME)}")
    p.add_argument("--log", default=None, help="log file (default: $OUT/gpu_check.log, else ./gpu_check.log)")
    p.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S,
                   help="seconds for all steps; later steps SKIP when it runs out (the last keeps its own timeout)")
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
        # threads can hang at interpreter exit (seen on the H200), and a hung worker costs the
        # whole step its timeout.
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
