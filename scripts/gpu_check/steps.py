"""The GPU check's steps (orchestrator side): what each runs, through Check's subprocesses, and
how its results are judged (judge.py) and logged. main.py lists them, in the order they run.

Every 4-rank run is the product unchanged under torchrun (rank.py only names each rank's NCCL
host and records what the trainer returned): `hetermoe train` for the plugin's trainer, a patched
Megatron-LM core_v0.16.1 pretrain_gpt.py for Megatron-LM's own pretrain(). The DEVICE run (four
NCCL ranks on the one GPU) and its CPU reference (four gloo ranks) start side by side."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Callable

import judge
from judge import FP32_REL, LOOSE_REL, Status
from runner import REPO, WORLD, Check, Run, Side, StepResult

# ---- the runs' shapes --------------------------------------------------------------------------
ITERS = 6  # steps of every training run; the resume runs restart after SAVE_AT
SAVE_AT = 3
MICROBATCHES = 4  # R of the 2+2 plan (zebra overlaps R microbatches)
GBS = MICROBATCHES * 2  # micro-batch size 1 x R x 2 attention ranks (Megatron's data-parallel size)
# --fp16 --initial-loss-scale 2^20 on the 2+2 run: steps 1, 2 and 4 overflow and are skipped, the
# scale ends at 2^18 (measured on CPU ranks, --dry-run; 2^18 from the start overflows at step 1 too).
FP16_SCALE = 2.0**20
# --bf16 --hetero-expert-precision fp16 --initial-loss-scale 2^23: the fp16 expert ranks' gradients
# overflow at steps 1-3, then the world's one scale trains at 2^21 (measured on CPU ranks, --dry-run;
# 2^20 from the start never overflows there).
POOLS_SCALE = 2.0**23
RUN_TIMEOUT_S = 90.0  # one 4-rank training run and its reference, side by side
PRETRAIN_TIMEOUT_S = 150.0  # Megatron-LM's start-up is longer
PP_TIMEOUT_S = 90.0  # the last step's own timeout (item 1's hang ends there)
# PP 2 zebra in the 1f1b wave order, each stage message above NCCL's 4 MiB buffer: [seq, mbs, hidden]
# fp32 = 1024 x 4 x 512 x 4 bytes = 8.4 MB. Narrow experts and 2 steps keep the CPU reference short
# (3 steps took 65 s on 2 busy cores with ffn 1024).
PP_SHAPE = {"hidden_size": 512, "ffn": 256, "seq_length": 1024, "micro_batch": 4, "iters": 2}
PP_SHAPE_DRY = {"hidden_size": 64, "ffn": 128, "seq_length": 32, "micro_batch": 2, "iters": 2}
NCCL_BUFFER = 4 * 2**20
MEGATRON_LM_TARBALL = "Megatron-LM-core_v0.16.1.tar.gz"  # what `make gpu-wheels` puts into .whl/
WHEELS = REPO / ".whl"
# Megatron-LM's pretrain_gpt.py on the 2+2 plan (tests/megatron_lm_run.py's tiny recipe): the model,
# the batch, mock data, and the kernels a host without transformer-engine and apex runs (local
# spec; no fusions that need apex/TE or torch.compile).
MLM_MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "128",
             "--num-experts", "4", "--seq-length", "32", "--max-position-embeddings", "32"]
MLM_BATCH = ["--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "3", "--lr", "1e-3"]
MLM_DATA = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "256", "--mock-data", "--split", "90,5,5"]
MLM_RECIPE = ["--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--disable-bias-linear",
              "--untie-embeddings-and-output-weights", "--hidden-dropout", "0", "--attention-dropout", "0",
              "--adam-beta2", "0.95", "--lr-decay-style", "cosine", "--min-lr", "1e-4"]
MLM_KERNELS = ["--transformer-impl", "local", "--no-rope-fusion", "--no-persist-layer-norm",
               "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion", "--no-bias-swiglu-fusion",
               "--no-bias-dropout-fusion", "--no-bias-gelu-fusion"]
MLM_EVAL = ["--log-interval", "1", "--eval-interval", "2", "--eval-iters", "1"]


class StepGroup(str, Enum):
    MAIN = "main"  # the default run, in this order
    FALLBACK = "fallback"  # only when the preflight fails (right after it)
    EXTRA = "extra"  # only when named with --steps


@dataclass(frozen=True)
class StepDef:
    name: str
    title: str
    fn: Callable[[Check, StepResult], None]
    group: StepGroup = StepGroup.MAIN
    needs_world: bool = True  # needs the preflight's 4 NCCL ranks on the GPU
    dry_run_as: str | None = None  # --dry-run skips it: the same harness path as this step


def _plan(ck: Check, name: str, model: str = "tiny", **kw) -> Path:
    """A plan as `hetermoe plan --even` writes it (the product's even_plan, which that command
    calls), for `model` (a configs/models name or a YAML path)."""
    from megatron_hetermoe.config import ModelConfig
    from megatron_hetermoe.plan.hetero_plan import even_plan

    path = ck.work / f"plan_{name}.json"
    if not path.exists():
        m = ModelConfig.load(model)
        plan = even_plan(m.num_layers, m.num_experts, **kw)
        plan.meta = {**(plan.meta or {}), "model": m.name, "made_by": f"gpu_check: even_plan {kw}"}
        plan.validate()
        plan.save(path)
        ck.log(f"  plan {path.name}: even_plan({m.name}, {kw})")
    return path


def plan_2x2(ck: Check, microbatches: int = MICROBATCHES) -> Path:
    """One ZP group of 2 attention + 2 expert ranks (the 2+2 plan), zebra."""
    return _plan(ck, f"2x2_r{microbatches}", attention_ranks=2, expert_ranks=2, num_microbatches=microbatches,
                 schedule="zebra")


def plan_pp2(ck: Check, model: str = "tiny") -> Path:
    """Two pipeline stages of 1 attention + 1 expert rank, zebra in 2 waves in the 1f1b order."""
    return _plan(ck, f"pp2_1f1b_{Path(model).stem}", model, attention_ranks=1, expert_ranks=1, pipeline_stages=2,
                 num_microbatches=MICROBATCHES, schedule="zebra", zebra_waves=2, zebra_wave_order="1f1b")


def plan_tp2(ck: Check) -> Path:
    """2 attention ranks as one tensor-parallel member + 2 expert ranks (the tp groups)."""
    return _plan(ck, "tp2", attention_ranks=2, expert_ranks=2, attention_tp=2, num_microbatches=2, schedule="zebra")


def plan_cp2(ck: Check) -> Path:
    """2 attention ranks as one context-parallel member (each its two of the sequence's 4 chunks,
    gathering the other's keys and values) + 2 expert ranks."""
    return _plan(ck, "cp2", attention_ranks=2, expert_ranks=2, attention_cp=2, num_microbatches=4, schedule="zebra")


def roles(plan: Path) -> dict[int, str]:
    from megatron_hetermoe.plan.hetero_plan import HeteroPlan

    p = HeteroPlan.load(plan)
    return {r: str(p.role(r)) for r in range(p.world_size)}


def train_entry(plan: Path, *flags: str, iters: int = ITERS, gbs: int = GBS, model: str = "tiny",
                mbs: int = 1) -> list[str]:
    """`hetermoe train` of `plan` (rank.py runs it as `python -m megatron_hetermoe.cli`); each rank's
    losses, loss scales and dtypes come back through rank.py's report."""
    return ["-m", "megatron_hetermoe.cli", "train", "--model", model, "--micro-batch-size", str(mbs),
            "--global-batch-size", str(gbs), "--train-iters", str(iters), "--deterministic-mode",
            "--hetero-plan", str(plan), *flags]


def _side_label(ck: Check, side: Side) -> str:
    if side is Side.CPU:
        return "CPU" + (" (ATEN_CPU_CAPABILITY=default)" if ck.dry_run else "")
    return "GPU" if ck.gpu else "gloo"


def _losses(run: Run | None) -> list[float] | None:
    return run.losses() if run is not None and run.proc.ok else None


def _why(run: Run) -> str:
    return run.proc.why() if not run.proc.ok else "no losses reported"


def _log_losses(ck: Check, name: str, runs: dict[Side, Run | None]) -> None:
    for side, run in runs.items():
        xs = _losses(run)
        if xs:
            ck.log(f"  {name} {_side_label(ck, side)} losses {judge.fmt(xs, '.7f')}")


def _compare(ck: Check, name: str, dev: Run, ref: Run | None, bound: float, fails: list, parts: list) -> None:
    """The DEVICE run's losses against its CPU reference's, per step, within `bound`."""
    _log_losses(ck, name, {Side.DEVICE: dev, Side.CPU: ref})
    got = _losses(dev)
    if got is None:
        fails.append(f"{name} {_side_label(ck, Side.DEVICE)}: {_why(dev)}")
    if ref is None:
        return
    want = _losses(ref)
    if want is None:
        fails.append(f"{name} CPU reference: {_why(ref)}")
    if got is None or want is None:
        return
    ok, line = judge.compare_losses(name, got, want, bound, _side_label(ck, Side.DEVICE), "CPU")
    ck.log(f"  {line}; per step {judge.fmt(judge.rel_diffs(got, want), '.2e')}")
    (parts if ok else fails).append(line)


def _finish(r: StepResult, fails: list, parts: list, ok_note: str = "") -> None:
    r.status = Status.FAIL if fails else Status.PASS
    r.summary = "; ".join(fails + parts) if fails else "; ".join(parts) + ok_note


# ---- environment --------------------------------------------------------------------------------
def megatron_lm_source() -> tuple[Path | None, str]:
    """Where Megatron-LM core_v0.16.1 comes from: MEGATRON_LM_DIR, else the tarball in .whl/."""
    src = os.environ.get("MEGATRON_LM_DIR")
    if src:
        return Path(src), f"MEGATRON_LM_DIR={src}"
    tar = WHEELS / MEGATRON_LM_TARBALL
    if tar.exists():
        return tar, f".whl/{MEGATRON_LM_TARBALL}"
    return None, (f"no Megatron-LM tree: set MEGATRON_LM_DIR to a core_v0.16.1 tree, or put {MEGATRON_LM_TARBALL} "
                  f"into .whl/ (make gpu-wheels) and carry .whl")


def step_env(ck: Check, r: StepResult) -> None:
    p = ck.run("env", ck.py(*ck.worker("env")), ck.env(), timeout=60)
    info = p.result()
    if not p.ok or info is None:
        r.status, r.summary = Status.FAIL, f"environment probe failed ({p.why()})"
        return
    ck.env_info = info
    ck.gpu = bool(info.get("cuda_available")) and not ck.dry_run
    src, src_note = megatron_lm_source()
    info["megatron_lm"] = src_note
    r.data = info
    gpu = (f"{info['gpus'][0]['name']} ({info['gpus'][0]['memory_gib']:.1f} GiB, sm_{info['gpus'][0]['capability']})"
           if info.get("gpus") else "no GPU")
    missing = [f"{m['dist']} (for {m['for']}: {m['error'][:100]})" for m in info.get("missing", [])]
    tools = [t for t, where in info.get("build_tools", {}).items() if not where]
    for line in missing:
        ck.log(f"  MISSING: {line}")
    if tools:
        ck.log(f"  not on the PATH: {', '.join(tools)} (Megatron-LM builds its dataset helpers with make, c++ and "
               f"python3-config; the pretrain step puts the helpers prebuilt by megatron-core's wheel in place)")
    if not info.get("python_h"):
        ck.log("  Python.h not found (python3-dev): Megatron-LM cannot compile its dataset helpers here")
    ck.log(f"  Megatron-LM: {src_note}")
    if ck.gpu and not info.get("cuda_home"):
        ck.log("  CUDA_HOME not found: Megatron-LM's start-up runs CUDA_HOME/bin/nvcc -V (its fused kernels' "
               "loader) and fails without it")
    ck.log(f"  transformer_engine: {info.get('transformer_engine')}; apex: {info.get('apex')}")
    r.summary = (f"Python {info['python']}, torch {info['torch']} (CUDA {info['cuda_build']}), {gpu}, "
                 f"NCCL {info.get('nccl')}, megatron-core {info['megatron_core']}, "
                 f"transformer_engine: {info['transformer_engine']}")
    plugin = info.get("hetermoe_imports") is True
    if missing or not plugin:
        what = "; ".join(missing) or f"the plugin does not import: {info.get('hetermoe_imports')}"
        r.status = Status.FAIL
        r.summary = (f"MISSING {what} (gather the wheels on a CPU machine with `make gpu-wheels`, carry .whl, "
                     f"install as docs/gpu-check.md says) | " + r.summary)
        ck.env_ok = plugin and not any(m["for"] == "plugin" for m in info.get("missing", []))
        return
    ck.env_ok = True
    r.status = Status.PASS
    if ck.dry_run and info.get("cuda_available"):
        r.summary += " [--dry-run: GPU parts skipped]"


# ---- preflight ----------------------------------------------------------------------------------
def step_preflight(ck: Check, r: StepResult) -> None:
    """Four ranks through rank.py on the GPU (NCCL; --dry-run: gloo): the product's own start, the
    groups of three plans (2+2; PP 2; attention TP 2: every group kind) and the collectives."""
    plans = [plan_2x2(ck), plan_pp2(ck), plan_tp2(ck)]
    side = Side.DEVICE
    extra = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET"} if ck.gpu else {}
    # torchrun in --dry-run too: this run checks the launch the GPU runs use.
    started = ck.start_side("preflight", side, ck.worker("preflight", "--plan", ",".join(map(str, plans))), extra,
                            torchrun=True)
    run = ck.finish_side(started, ck.timeout(75))
    res = run.proc.result()
    r.data = res or {}
    if not run.proc.ok or res is None:
        ck.preflight_ok = False
        r.status = Status.FAIL
        r.summary = f"4 ranks on one {'GPU (NCCL)' if ck.gpu else 'CPU (gloo)'}: {run.proc.why()}"
        return
    fails = []
    for rank in res["ranks"]:
        for plan, groups in rank.get("groups", {}).items():
            bad = {k: v for k, v in groups.items() if str(v).startswith(("WRONG", "MISSING"))}
            if bad:
                fails.append(f"rank {rank['rank']} {plan}: {bad}")
        if rank.get("error"):
            fails.append(f"rank {rank['rank']}: {rank['error']}")
        bad = {k: v for k, v in rank.get("world", {}).items() if v != "ok"}
        if bad:
            fails.append(f"rank {rank['rank']}: {bad}")
    r0 = res["ranks"][0]
    hostids = sorted({str(x.get("nccl_hostid")) for x in res["ranks"]})
    for plan, groups in r0.get("groups", {}).items():
        ck.log(f"  rank 0 groups of {plan}: {groups}")
    ck.log(f"  rank 0 all_to_all on 3 communicators at once: {r0.get('all_to_all_3_communicators')}")
    ck.log(f"  rank 0 world collectives: {r0.get('world')}")
    ck.log(f"  backend {r0.get('backend')}, device {r0.get('device')}, NCCL_HOSTID per rank: {hostids}")
    socket = "NET/Socket" in run.proc.output
    if ck.gpu:
        ck.log(f"  NCCL transport NET/Socket {'seen' if socket else 'NOT seen'} in NCCL's INFO lines")
    secs = max(float(x.get("seconds", 0)) for x in res["ranks"])
    # Fallbacks only when the four ranks cannot run the world's collectives: a group kind or the
    # ZP communicators failing is a FAIL here, and the 4-rank steps still run (and show it too).
    ck.preflight_ok = bool(res.get("world_ok"))
    if fails or not res.get("ok"):
        r.status = Status.FAIL
        r.summary = (("the world's collectives work (the 4-rank steps run); " if ck.preflight_ok else "")
                     + ("; ".join(fails) or "a rank reported a failure (see the log)"))
        return
    r.status = Status.PASS
    kinds = sorted({k for g in r0.get("groups", {}).values() for k, v in g.items() if str(v).startswith("ok")})
    r.summary = (f"4 {'NCCL ranks on one GPU' if ck.gpu else 'gloo ranks'} ({len(hostids)} NCCL host ids"
                 f"{', NET/Socket' if socket else ''}): groups {', '.join(kinds)} of 3 plans; uneven all_to_all "
                 f"with zero splits on 3 communicators at once, all_reduce, broadcast, all_gather, reduce_scatter, "
                 f"batch_isend_irecv: values ok; {secs:.1f} s in the ranks")


# ---- the plugin's trainer on the 2+2 plan ----------------------------------------------------------
def _ckpt(ck: Check, name: str, side: Side) -> Path:
    return ck.work / f"ckpt_{name}_{side}"


def _full_run(ck: Check, name: str, *flags: str, dry_ref: bool = False) -> tuple[Run, Run | None]:
    """6 steps of the 2+2 plan, saved after step 3 (and 6), on each side."""
    plan = plan_2x2(ck)

    def entry(side: Side) -> list[str]:
        return train_entry(plan, *flags, "--save", str(_ckpt(ck, name, side)), "--save-interval", str(SAVE_AT))

    return ck.pair(name, entry, RUN_TIMEOUT_S, dry_ref=dry_ref)


def step_zebra(ck: Check, r: StepResult) -> None:
    """Zebra with the single issuer in fp32, the 2+2 plan, vs the same on CPU ranks."""
    dev, ref = _full_run(ck, "zebra", "--hetero-zebra-issuer", "single", dry_ref=True)
    ck.runs["zebra"] = (dev, ref)
    fails, parts = [], []
    _compare(ck, "zebra single issuer fp32", dev, ref, FP32_REL, fails, parts)
    reps = dev.reports
    if len(reps) == WORLD:
        ok, line = judge.same_on_every_rank(reps, "losses")
        (parts if ok else fails).append("losses reported alike on every rank" if ok else line)
    r.data = {"gpu": _losses(dev), "cpu": _losses(ref)}
    _finish(r, fails, parts)


def step_distep(ck: Check, r: StepResult) -> None:
    plan = plan_2x2(ck)
    dev, ref = ck.pair("distep", lambda side: train_entry(plan, "--hetero-schedule", "distep"), RUN_TIMEOUT_S)
    fails, parts = [], []
    _compare(ck, "distep fp32", dev, ref, FP32_REL, fails, parts)
    zebra = ck.runs.get("zebra", (None, None))[0]
    if _losses(dev) and _losses(zebra):
        ok, line = judge.compare_losses("distep vs zebra", _losses(dev), _losses(zebra), FP32_REL,
                                        _side_label(ck, Side.DEVICE), _side_label(ck, Side.DEVICE))
        ck.log(f"  {line}")
        parts.append(line)  # two schedules on one device: reported, judged against CPU above
    r.data = {"gpu": _losses(dev), "cpu": _losses(ref)}
    _finish(r, fails, parts)


def step_cp2(ck: Check, r: StepResult) -> None:
    """A CP-2 attention member + 2 expert ranks, zebra's single issuer, vs the same on CPU ranks: the
    K/V all-gather and its reduce-scatter over NCCL, the attention core on the GPU (transformer-
    engine's, which does CP itself, where the kernels pick it; else models/context_attention.py)."""
    plan = plan_cp2(ck)
    flags = ("--hetero-zebra-issuer", "single", "--context-parallel-size", "2")
    dev, ref = ck.pair("cp2", lambda side: train_entry(plan, *flags, gbs=4), RUN_TIMEOUT_S,  # 1 member x R 4
                       dry_ref=True)
    fails, parts = [], []
    _compare(ck, "zebra CP 2 fp32", dev, ref, FP32_REL, fails, parts)
    r.data = {"gpu": _losses(dev), "cpu": _losses(ref)}
    _finish(r, fails, parts)


def step_threads(ck: Check, r: StepResult) -> None:
    """--hetero-zebra-issuer threads: refused by name on NCCL, or the single issuer's losses."""
    plan = plan_2x2(ck)
    dev, _ = ck.pair("zebra_threads", lambda side: train_entry(plan, "--hetero-zebra-issuer", "threads"),
                     RUN_TIMEOUT_S, cpu=False)
    single = _losses(ck.runs.get("zebra", (None, None))[0])
    refused = judge.refusal(dev.proc.output, "--hetero-zebra-issuer") or judge.refusal(dev.proc.output, "threads")
    got = _losses(dev)
    r.data = {"refused": refused, "losses": got, "single": single}
    if not dev.proc.ok and refused:
        r.status, r.summary = Status.PASS, f"refused by name: {refused[:240]}"
    elif got is None:
        r.status, r.summary = Status.FAIL, f"neither refused by name nor trained: {dev.proc.why()}"
    elif single is None:
        r.status, r.summary = Status.FAIL, "trained, but the single issuer's run (step zebra) has no losses to compare"
    elif got == single:
        r.status, r.summary = Status.PASS, f"not refused; losses bitwise the single issuer's ({len(got)} steps)"
    else:
        ok, line = judge.compare_losses("threads vs single", got, single, FP32_REL, "threads", "single")
        r.status, r.summary = Status.FAIL, f"not refused, and not equal to the single issuer: {line}"


def _resume(ck: Check, name: str, full: tuple[Run, Run], *flags: str) -> tuple[list, list]:
    """Resume each side's run `name` from its step-3 checkpoint; steps 4-6 bitwise the full run's."""
    fails, parts = [], []
    plan = plan_2x2(ck)
    if _losses(full[0]) is None or (full[1] is not None and _losses(full[1]) is None):
        return [f"{name}: the uninterrupted runs did not finish (no checkpoint to resume)"], []

    def entry(side: Side) -> list[str]:
        return train_entry(plan, *flags, "--load", str(_ckpt(ck, name, side)), "--ckpt-step", str(SAVE_AT))

    dev, ref = ck.pair(f"{name}_resume", entry, RUN_TIMEOUT_S, cpu=full[1] is not None)
    for side, run, whole in ((Side.DEVICE, dev, full[0]), (Side.CPU, ref, full[1])):
        if run is None:
            continue
        got = _losses(run)
        if got is None:
            fails.append(f"{name} resume {_side_label(ck, side)}: {_why(run)}")
            continue
        ck.log(f"  {name} resumed {_side_label(ck, side)}: {judge.fmt(got, '.7f')}")
        ok, line = judge.resumed_bitwise(_losses(whole), got, SAVE_AT)
        (parts if ok else fails).append(f"{name} {_side_label(ck, side)}: {line}")
    return fails, parts


def step_resume(ck: Check, r: StepResult) -> None:
    """The zebra run saved after step 3 (torch_dist, from the GPU); resumed, steps 4-6 bitwise."""
    full = ck.runs.get("zebra")
    if full is None:
        r.status, r.summary = Status.SKIP, "needs step zebra's runs (their checkpoints)"
        return
    fails, parts = _resume(ck, "zebra", full, "--hetero-zebra-issuer", "single")
    _finish(r, fails, parts)


def step_distopt(ck: Check, r: StepResult) -> None:
    """--use-distributed-optimizer: 6 steps vs CPU, then save at 3 / resume, bitwise."""
    flags = ("--hetero-zebra-issuer", "single", "--use-distributed-optimizer")
    full = _full_run(ck, "distopt", *flags)
    fails, parts = [], []
    _compare(ck, "zebra --use-distributed-optimizer", full[0], full[1], FP32_REL, fails, parts)
    zebra = ck.runs.get("zebra", (None, None))[0]
    if _losses(full[0]) and _losses(zebra):
        ok, line = judge.compare_losses("distributed vs plain optimizer", _losses(full[0]), _losses(zebra), FP32_REL,
                                        "distributed", "plain")
        ck.log(f"  {line}")
        parts.append(line)
    f2, p2 = _resume(ck, "distopt", full, *flags)
    _finish(r, fails + f2, parts + p2)


def _scale_runs(ck: Check, name: str, flags: tuple) -> tuple[Run, Run | None]:
    plan = plan_2x2(ck)
    return ck.pair(name, lambda side: train_entry(plan, *flags), RUN_TIMEOUT_S)


def _per_rank_16bit(ck: Check, name: str, dev: Run, ref: Run | None, fails: list, parts: list) -> None:
    """One loss-scale trajectory and the same skipped steps on every rank of each side (judged);
    the device's against the CPU's (reported: an overflow near the threshold may differ by
    device); losses within the 16-bit sanity bound."""
    seen = {}
    for side, run in ((Side.DEVICE, dev), (Side.CPU, ref)):
        if run is None:
            continue
        reps = run.reports
        if len(reps) != WORLD or not run.proc.ok:
            fails.append(f"{name} {_side_label(ck, side)}: {_why(run)} ({len(reps)} of {WORLD} ranks reported)")
            continue
        agree = True
        for key in ("loss_scales", "overflow_skipped"):
            ok, line = judge.same_on_every_rank(reps, key)
            ck.log(f"  {name} {_side_label(ck, side)}: {line}")
            if not ok:
                fails.append(f"{name} {_side_label(ck, side)}: {line}")
                agree = False
        if agree:
            seen[side] = reps[0]["train_hetero"]
    if Side.DEVICE in seen:
        d = seen[Side.DEVICE]
        parts.append(f"skipped steps {d['overflow_skipped']} (0-based) and loss scales "
                     f"{judge.fmt(d['loss_scales'], '.0f')} alike on every rank")
        c = seen.get(Side.CPU)
        if c is not None and (c["overflow_skipped"], c["loss_scales"]) != (d["overflow_skipped"], d["loss_scales"]):
            parts.append(f"the CPU ranks skipped {c['overflow_skipped']} (reported: differs by device)")
    _compare(ck, name, dev, ref, LOOSE_REL, fails, parts)


def step_pools(ck: Check, r: StepResult) -> None:
    """--bf16 --hetero-expert-precision fp16: bf16 attention ranks, fp16 expert ranks, one loss scale."""
    flags = ("--bf16", "--hetero-expert-precision", "fp16", "--initial-loss-scale", f"{POOLS_SCALE:.0f}")
    dev, ref = _scale_runs(ck, "pools", flags)
    fails, parts = [], []
    rl = roles(plan_2x2(ck))
    for side, run in ((Side.DEVICE, dev), (Side.CPU, ref)):
        if run is not None and len(run.reports) == WORLD:
            ok, line = judge.dtypes_by_role(run.reports, rl, {"attention": "torch.bfloat16", "expert": "torch.float16"})
            ck.log(f"  {_side_label(ck, side)}: {line}")
            if not ok:
                fails.append(f"{_side_label(ck, side)}: {line}")
            elif side is Side.DEVICE:
                parts.append(line)
    _per_rank_16bit(ck, "bf16 attention + fp16 experts", dev, ref, fails, parts)
    _finish(r, fails, parts)


def step_fp16(ck: Check, r: StepResult) -> None:
    """--fp16 with an initial loss scale that overflows: the same skipped steps on every rank."""
    dev, ref = _scale_runs(ck, "fp16", ("--fp16", "--initial-loss-scale", f"{FP16_SCALE:.0f}"))
    fails, parts = [], []
    _per_rank_16bit(ck, "fp16", dev, ref, fails, parts)
    if len(dev.reports) == WORLD and dev.proc.ok and not dev.reports[0]["train_hetero"]["overflow_skipped"]:
        fails.append(f"no step overflowed at --initial-loss-scale {FP16_SCALE:.0f}: the skip was not exercised")
    _finish(r, fails, parts)


# ---- Megatron-LM's own pretrain() ------------------------------------------------------------------
def megatron_lm_env(extra_path: str | None = None) -> dict:
    """PATH as Megatron-LM's helpers build needs it (this interpreter's directory, then its base
    installation's: `python3 -m pybind11`, `python3-config`), as tests/megatron_lm_run.py sets it;
    CUDA_DEVICE_MAX_CONNECTIONS=1 as Megatron-LM's recipes export it."""
    path = [str(Path(sys.executable).parent), sysconfig.get_config_var("BINDIR") or "", os.environ.get("PATH", "")]
    if extra_path:
        path.insert(0, extra_path)
    return {"PATH": os.pathsep.join(path), "CUDA_DEVICE_MAX_CONNECTIONS": "1"}


PYTHON3_CONFIG_SHIM = """#!/bin/sh
# gpu_check: python3-config is not installed here; Megatron-LM's dataset-helpers Makefile asks it
# for the extension suffix (and the helpers are already built: megatron-core's wheel ships them).
case "$1" in
  --extension-suffix) exec "{python}" -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))" ;;
  --includes) exec "{python}" -c "import sysconfig; print('-I' + sysconfig.get_paths()['include'])" ;;
  *) echo "gpu_check's python3-config shim knows --extension-suffix and --includes only" >&2; exit 1 ;;
esac
"""


def installed_helpers() -> Path | None:
    """The installed megatron-core's compiled dataset helpers (its wheel ships them), found
    without importing megatron.core."""
    import importlib.util

    spec = importlib.util.find_spec("megatron")
    name = f"helpers_cpp{sysconfig.get_config_var('EXT_SUFFIX')}"
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = Path(root) / "core" / "datasets" / name
        if path.exists():
            return path
    return None


def prepare_megatron_lm(ck: Check) -> tuple[Path, dict, list[str]]:
    """A private copy of the core_v0.16.1 tree (never the caller's: Megatron-LM builds into it)
    with HeterMoE's patch applied to pretrain_gpt.py, and megatron-core's prebuilt dataset helpers
    in place (so its start-up `make` has nothing to compile). Returns (tree, env, notes)."""
    from megatron_hetermoe.shims.pretrain_gpt import checkout_version, patch_for

    src, note = megatron_lm_source()
    if src is None:
        raise FileNotFoundError(note)
    work = ck.work / "megatron-lm"
    if src.is_dir():
        shutil.copytree(src, work, symlinks=True, ignore=shutil.ignore_patterns(".git", "*.so", "__pycache__"))
    else:
        with tarfile.open(src) as t:
            t.extractall(ck.work / "megatron-lm-tar", filter="data")
        (top,) = list((ck.work / "megatron-lm-tar").iterdir())
        top.rename(work)
    if checkout_version(work)[:2] != (0, 16):
        raise ValueError(f"{note}: core_v{'.'.join(map(str, checkout_version(work)))}, not core_v0.16.x")
    patch = REPO / "patches" / patch_for(work)
    notes = [note]
    for cmd in (["git", "apply", str(patch)], ["patch", "-p1", "-i", str(patch)]):
        if shutil.which(cmd[0]) is None:
            continue
        p = subprocess.run(cmd, cwd=work, capture_output=True, text=True)
        if p.returncode == 0:
            notes.append(f"patched with {cmd[0]}")
            break
        notes.append(f"{cmd[0]} failed: {(p.stdout + p.stderr).strip()[:200]}")
    else:
        raise RuntimeError(f"cannot apply {patch.name}: " + ("; ".join(notes[1:]) or "neither git nor patch is here"))
    if "hetero_pretrain" not in (work / "pretrain_gpt.py").read_text():
        raise RuntimeError(f"{patch.name} did not apply: " + "; ".join(notes[1:]))
    built = installed_helpers()
    dest = work / "megatron" / "core" / "datasets"
    if built is not None:
        shutil.copyfile(built, dest / built.name)
        os.utime(dest / built.name)  # newer than helpers.cpp: make has nothing to do
        notes.append(f"dataset helpers: the installed megatron-core's prebuilt {built}")
    else:
        notes.append("megatron-core has no prebuilt dataset helpers: Megatron-LM compiles them (make, c++, Python.h)")
    shim = None
    env = megatron_lm_env()
    if shutil.which("python3-config", path=env["PATH"]) is None:
        shim = ck.work / "shim"
        shim.mkdir(exist_ok=True)
        (shim / "python3-config").write_text(PYTHON3_CONFIG_SHIM.format(python=sys.executable))
        (shim / "python3-config").chmod(0o755)
        notes.append("python3-config missing: a shim answers the helpers' Makefile")
    if shutil.which("make", path=env["PATH"]) is None:
        notes.append("make is missing: Megatron-LM's start-up helpers build (make -C megatron/core/datasets) will fail")
    return work, megatron_lm_env(str(shim) if shim else None), notes


def step_pretrain(ck: Check, r: StepResult) -> None:
    """Megatron-LM's own pretrain() (core_v0.16.1 pretrain_gpt.py, patched) with --hetero-plan on the
    four ranks, vs the same on CPU ranks (gloo)."""
    src, note = megatron_lm_source()
    if src is None:
        r.status = Status.SKIP if ck.dry_run else Status.FAIL
        r.summary = "MISSING " + note
        return
    missing = [m["dist"] for m in ck.env_info.get("missing", []) if m["for"] == "Megatron-LM"]
    if missing:
        r.status, r.summary = Status.FAIL, (f"MISSING Megatron-LM's training-side packages {missing} "
                                            f"(make gpu-wheels gathers them)")
        return
    tree, env, notes = prepare_megatron_lm(ck)
    for n in notes:
        ck.log(f"  {n}")
    plan = plan_2x2(ck, microbatches=2)  # global batch 8 = micro-batch 2 x R 2 x 2 attention ranks

    def entry(side: Side) -> list[str]:
        flags = [*MLM_MODEL, *MLM_BATCH, *MLM_DATA, *MLM_RECIPE, *MLM_KERNELS, *MLM_EVAL, "--hetero-plan", str(plan)]
        gloo = side is Side.CPU or not ck.gpu  # Megatron-LM's default backend is NCCL
        return [str(tree / "pretrain_gpt.py"), *flags, *(["--distributed-backend", "gloo"] if gloo else [])]

    dev, ref = ck.pair("pretrain", entry, PRETRAIN_TIMEOUT_S, extra_env=env, cwd=tree)
    fails, parts = [], []
    sides = [(Side.DEVICE, dev)] + ([(Side.CPU, ref)] if ref is not None else [])
    got = {s: judge.losses_from_log(run.proc.output) for s, run in sides}
    for side, run in sides:
        if not run.proc.ok or sorted(got[side]) != [1, 2, 3]:
            fails.append(f"pretrain() {_side_label(ck, side)}: {run.proc.why() if not run.proc.ok else got[side]}")
        else:
            ck.log(f"  pretrain() {_side_label(ck, side)}: lm loss {got[side]}")
            parts.append(f"{_side_label(ck, side)} lm loss {judge.fmt([got[side][i] for i in (1, 2, 3)], '.7g')}")
        if run.proc.ok and "validation loss at iteration 2" not in run.proc.output:
            fails.append(f"pretrain() {_side_label(ck, side)}: no validation at iteration 2")
    if not fails and ref is not None:
        # Megatron-LM logs 7 significant digits: rounding both sides adds <= 2e-7 (relative, at
        # losses ~5), well inside FP32_REL.
        ok, line = judge.compare_losses("pretrain() zebra", [got[Side.DEVICE][i] for i in (1, 2, 3)],
                                        [got[Side.CPU][i] for i in (1, 2, 3)], FP32_REL, _side_label(ck, Side.DEVICE))
        (parts if ok else fails).append(line)
    r.data = {str(k): v for k, v in got.items()}
    _finish(r, fails, parts, " (Megatron-LM core_v0.16.1, 2+2 zebra, CUDA_DEVICE_MAX_CONNECTIONS=1)")


# ---- host syncs (item 6) --------------------------------------------------------------------------
def step_host_syncs(ck: Check, r: StepResult) -> None:
    """Host syncs per MoE layer forward+backward under torch.cuda.set_sync_debug_mode("warn"):
    the attention side's HeteroMoELayer and the expert runtime's computation (probes.py)."""
    iters = 3
    p = ck.run("host_syncs", ck.py(*ck.worker("host-syncs", "--model", "tiny", "--iters", str(iters))),
               ck.env() if ck.gpu else ck.env(cpu=True, threads=1), timeout=ck.timeout(120))
    res = p.result()
    if not p.ok or res is None:
        r.status, r.summary = Status.FAIL, f"probe failed ({p.why()})"
        return
    r.data = res
    if not ck.gpu:
        r.status, r.summary = Status.SKIP, (f"GPU only (torch.cuda.set_sync_debug_mode); the probe ran on CPU "
                                            f"({res.get('layer')}, kernels {res.get('kernels')})")
        return
    parts, fails = [], []
    for side in ("attention", "expert"):
        row = res[side]
        per = judge.per_layer(row["total"], iters)
        other = judge.per_layer(row["total"] - row["route"], iters)
        ck.log(f"  {side}: {per:g} host syncs per MoE layer fwd+bwd ({row['route'] / iters:g} the route's counts "
               f"read; {row['c10'] / iters:g} reported by c10 with no Python line); sites {row['sites']}")
        parts.append(f"{side} {per:g}/layer (route {row['route'] / iters:g})")
        if other > 0:
            fails.append(f"{side} side: {other:g} host syncs per MoE layer fwd+bwd besides the route's counts read "
                         f"(issue 43 item 6); sites {row['sites']}")
    _finish(r, fails, parts, f" ({res.get('layer')}, kernels {res.get('kernels')})")


# ---- transformer-engine --------------------------------------------------------------------------
def step_te(ck: Check, r: StepResult) -> None:
    te = str(ck.env_info.get("transformer_engine", "no"))
    if not te.startswith("imports"):
        r.status, r.summary = Status.SKIP, f"transformer_engine does not import here: {te}"
        return
    if not ck.gpu:
        r.status, r.summary = Status.SKIP, "transformer_engine needs CUDA ranks (--dry-run)"
        return
    plan = plan_2x2(ck)
    fails, parts = [], []
    local = _losses(ck.runs.get("zebra", (None, None))[0])
    for name, flags in (("te", ("--transformer-impl", "transformer_engine")),
                        ("te-grouped", ("--transformer-impl", "transformer_engine", "--moe-grouped-gemm"))):
        dev, _ = ck.pair(f"zebra_{name}",
                         lambda side, f=flags: train_entry(plan, "--hetero-zebra-issuer", "single", *f),
                         RUN_TIMEOUT_S, cpu=False)
        got = _losses(dev)
        if got is None:
            fails.append(f"{name}: {_why(dev)}")
        elif local is not None:
            ok, line = judge.compare_losses(name, got, local, LOOSE_REL, name, "local")
            (parts if ok else fails).append(line)
    _finish(r, fails, parts)


# ---- pipeline stages, last -------------------------------------------------------------------------
def step_pp_1f1b(ck: Check, r: StepResult) -> None:
    """PP 2 zebra in the 1f1b wave order, each stage message above NCCL's 4 MiB buffer: the
    unbatched crossing isend/recv of issue 43 item 1 hangs here if it is not fixed."""
    shape = PP_SHAPE if ck.gpu else PP_SHAPE_DRY
    model = ck.work / "pp_model.yaml"
    from megatron_hetermoe.config import ModelConfig

    tiny = ModelConfig.load("tiny")
    model.write_text(
        f"name: gpu-check-pp\nnum_layers: 2\nhidden_size: {shape['hidden_size']}\nnum_attention_heads: 4\n"
        f"ffn_hidden_size: {shape['ffn']}\nmoe_ffn_hidden_size: {shape['ffn']}\n"
        f"num_experts: {tiny.num_experts}\nmoe_router_topk: {tiny.moe_router_topk}\nmoe_aux_loss_coeff: 0.01\n"
        f"vocab_size: {tiny.vocab_size}\nseq_length: {shape['seq_length']}\n")
    msg = judge.stage_message_bytes(shape["hidden_size"], shape["seq_length"], shape["micro_batch"])
    plan = plan_pp2(ck, str(model))
    gbs = shape["micro_batch"] * MICROBATCHES
    budget = max(1.0, min(PP_TIMEOUT_S, ck.left_total()))
    flags = ("--hetero-zebra-issuer", "single", "--pipeline-model-parallel-size", "2")
    dev, ref = ck.pair("pp2_1f1b", lambda side: train_entry(plan, *flags, iters=shape["iters"], gbs=gbs,
                                                            model=str(model), mbs=shape["micro_batch"]), budget)
    size = (f"stage message {msg / 1e6:.1f} MB ({'above' if msg > NCCL_BUFFER else 'below'} NCCL's "
            f"{NCCL_BUFFER // 2**20} MiB buffer)")
    fails, parts = [], []
    if dev.proc.timed_out:
        fails.append(f"{_side_label(ck, Side.DEVICE)} timed out after {dev.proc.seconds:.0f} s: the hang of issue 43 "
                     f"item 1 (zebra's pipeline-stage isend/recv unbatched in the 1f1b order; {size})")
    _compare(ck, "PP 2 zebra 1f1b", dev, ref, FP32_REL, [] if dev.proc.timed_out else fails, parts)
    parts.append(size)
    r.data = {"gpu": _losses(dev), "cpu": _losses(ref), "message_bytes": msg}
    _finish(r, fails, parts)
