"""One prepared check of HeterMoE on one GPU: `scripts/gpu_check.sh [--dry-run]`.

Made to fit a short lease of one GPU (about 7 minutes) and to leave one log behind:
$OUT/gpu_check.log when $OUT is set, else ./gpu_check.log (--log to choose), ending in a
SUMMARY block with PASS / FAIL / SKIP and the key numbers of every step; gpu_check.json beside
it has the same results for programs. Every step runs its work in subprocesses, each with its
own timeout, so one failure or hang does not stop the others.

Steps (`--steps 1,2,5` runs some; they always run in the order 1, 2, 5, 3, 4, 6, 7):
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
                  through the worker `--worker hetero-train` (train_hetero on CUDA tensors
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
  7 grouped ckpt  tests/checkpoint/test_grouped_experts.py (needs pytest): torch_dist checkpoints
                  of plan-placed GroupedMLP and, where transformer-engine is, TEGroupedMLP experts
                  against Megatron EP's SequentialMLP (its TEGroupedMLP cases skip on CPU).

--dry-run (or no GPU): every step that can run on the CPU runs at tiny sizes (CPU references
only), GPU-only parts are SKIP; the exit code is 0 when nothing FAILED.

A harness, not part of the package: `python scripts/gpu_check/main.py` from a checkout, with
megatron_hetermoe importable (this checkout's copy comes first for it and its subprocesses).
main.py is the CLI and the step loop with the SUMMARY; steps.py the steps; runner.py the
subprocesses and their result lines; workers.py and probes.py the subprocesses' entry points.
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

import probes
import workers
from runner import REPO, Check, StepResult
from steps import NAMES, ORDER, STEPS

if str(REPO) not in sys.path:  # the checkout's package, as the workers get it (Check.env)
    sys.path.insert(1, str(REPO))


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


# The subprocesses' entry points: `python scripts/gpu_check/main.py --worker NAME ...`.
WORKERS = {"env": workers.worker_env, "moe-layer": probes.worker_moe_layer, "gloo-a2a": workers.worker_gloo_a2a,
           "hetero-train": workers.worker_hetero_train, "overlap": probes.worker_overlap}


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
