"""Running Megatron-LM's own pretrain_gpt.py from a checkout (MEGATRON_LM_DIR) in tests: the flags
of the tiny recipe, torchrun on CPU ranks, Megatron's tensorboard scalars, and the same run on the
plugin's trainer. The checkout and data fixtures are in tests/training/conftest.py."""
from __future__ import annotations

import atexit
import importlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import pytest

from megatron_hetermoe import megatron_lm

ROOT = Path(__file__).resolve().parents[1]
MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "128",
         "--num-experts", "4", "--seq-length", "32", "--max-position-embeddings", "32"]
BATCH = ["--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "3", "--lr", "1e-3"]
DATA = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "256", "--split", "90,5,5"]
# The plugin's trainer always builds this recipe; these are its Megatron-LM flags (Megatron's
# defaults differ: GeLU, LayerNorm, dropout 0.1, adam beta2 0.999, linear decay, min lr 0), which
# `hetermoe train-gpt` requires (all but --min-lr, whose default there is Megatron's 0).
RECIPE = ["--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--disable-bias-linear",
          "--untie-embeddings-and-output-weights", "--hidden-dropout", "0", "--attention-dropout", "0",
          "--adam-beta2", "0.95", "--lr-decay-style", "cosine", "--min-lr", "1e-4"]
# What Megatron-LM needs on a CPU without transformer-engine or apex, HeterMoE or not; the last two
# keep torch.compile (Megatron's jit_fuser) out: its C++ does not build under ATEN_CPU_CAPABILITY=default.
CPU = ["--transformer-impl", "local", "--distributed-backend", "gloo", "--no-rope-fusion", "--no-persist-layer-norm",
       "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion", "--no-bias-swiglu-fusion",
       "--no-bias-dropout-fusion", "--no-bias-gelu-fusion"]
# 16-bit losses, pretrain() vs the plugin's trainer: iteration 1 within one fp32 ulp (bitwise on default
# kernels), then |diff| <= 8.9e-5 (bf16),
# 2.7e-5 (fp16) and 9.2e-5 (bf16 attention + fp16 experts) measured over ATEN_CPU_CAPABILITY
# default/avx2/avx512 (the rounding of 16-bit gradients summed in another order moves the next step's
# weights by an ulp).
TOL_16 = 5e-4
ITERATION = re.compile(r" iteration\s+(\d+)/\s*\d+ \|.*? lm loss: ([0-9.E+-]+) \|")


def checkout_dir() -> Path:
    src = os.environ.get("MEGATRON_LM_DIR")
    if not src:
        pytest.skip("set MEGATRON_LM_DIR to a Megatron-LM core_v0.16.1 work tree to run its pretrain() with HeterMoE")
    checkout = Path(src)
    if megatron_lm.checkout_version(checkout)[:2] != (0, 16):
        pytest.skip(f"{checkout} is not core_v0.16.x: the pretrain() hooks are made for core_v0.16.1's")
    for name in ("six", "regex", "pydantic", "triton", "tensorboard"):
        try:
            importlib.import_module(name)
        except ImportError:
            pytest.skip(f"Megatron-LM's training side needs {name!r}: pip install -e '.[megatron-lm]'")
    return checkout


def env() -> dict:
    # Megatron-LM compiles its dataset helpers with `python3 -m pybind11` and `python3-config`:
    # this interpreter's, then its base installation's.
    path = os.pathsep.join([str(Path(sys.executable).parent), sysconfig.get_config_var("BINDIR"), os.environ["PATH"]])
    # CUDA_DEVICE_MAX_CONNECTIONS: Megatron-LM asserts it with TP > 1 before Blackwell; its recipes export it.
    return {**os.environ, "OMP_NUM_THREADS": "1", "PATH": path, "CUDA_DEVICE_MAX_CONNECTIONS": "1",
            "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}


# torchrun's ranks import torch, megatron and Megatron-LM each: ~10 s of a 4-rank run's ~14 s on 2
# cores. tests/fork_torchrun.py keeps one process per checkout and environment that imported them
# (a zygote) and forks each run's ranks from it, with torchrun's environment.
# HETERMOE_TESTS_TORCHRUN=1: torch.distributed.run itself (test_patches.py always uses it).
FORK_TORCHRUN = Path(__file__).with_name("fork_torchrun.py")
_ZYGOTES: dict[tuple, tuple[subprocess.Popen, str]] = {}  # (checkout, environment) -> (process, socket)
_ZYGOTES_KEPT = 2


def _stop(proc: subprocess.Popen, path: str) -> None:
    proc.kill()
    proc.wait()
    shutil.rmtree(os.path.dirname(path), ignore_errors=True)


def _stop_zygotes() -> None:
    for proc, path in _ZYGOTES.values():
        _stop(proc, path)
    _ZYGOTES.clear()


atexit.register(_stop_zygotes)


def _zygote(work: Path, environ: dict) -> str:
    """The socket of the zygote for `work` and this environment (pytest's per-test variable aside),
    started on first use; at most _ZYGOTES_KEPT stay up."""
    key = (str(work), tuple(sorted((k, v) for k, v in environ.items() if not k.startswith("PYTEST_"))))
    found = _ZYGOTES.get(key)
    if found is not None and found[0].poll() is None:
        _ZYGOTES[key] = _ZYGOTES.pop(key)  # most recently used last
        return found[1]
    if found is not None:  # it died: a new one (its log is gone with it)
        _stop(*_ZYGOTES.pop(key))
    while len(_ZYGOTES) >= _ZYGOTES_KEPT:
        _stop(*_ZYGOTES.pop(next(iter(_ZYGOTES))))
    # A Unix socket's path is at most 107 bytes: /tmp's, whatever TMPDIR is.
    path = os.path.join(tempfile.mkdtemp(prefix="hz-", dir="/tmp" if os.path.isdir("/tmp") else None), "s")
    log = open(path + ".log", "w")
    proc = subprocess.Popen([sys.executable, str(FORK_TORCHRUN), "--serve", path, "pretrain_gpt.py"], cwd=work,
                            env=environ, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    log.close()
    deadline = time.monotonic() + 300
    while not os.path.exists(path):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"fork_torchrun's zygote for {work} did not start:\n"
                               f"{Path(path + '.log').read_text()[-3000:]}")
        time.sleep(0.05)
    _ZYGOTES[key] = (proc, path)
    return path


def _forked_run(work: Path, nproc: int, port: int, argv: list[str], environ: dict,
                timeout: int) -> subprocess.CompletedProcess:
    path = _zygote(work, environ)
    out = path + f".{port}.out"
    req = {"argv": argv, "nproc": nproc, "port": port, "cwd": str(work), "env": environ, "out": out}
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
        c.settimeout(timeout)
        c.connect(path)
        c.sendall((json.dumps(req) + "\n").encode())
        reply = b""
        try:
            while reply.count(b"\n") < 2:
                chunk = c.recv(64)
                if not chunk:
                    raise RuntimeError(f"fork_torchrun's zygote for {work} ended during a run (log: {path}.log)")
                reply += chunk
        except socket.timeout:
            if reply:
                os.kill(int(reply.split(b"\n")[0]), signal.SIGKILL)  # its ranks die with it (PDEATHSIG)
            raise subprocess.TimeoutExpired(argv, timeout, output=Path(out).read_text() if os.path.exists(out) else "")
    text = Path(out).read_text()
    os.unlink(out)
    return subprocess.CompletedProcess(argv, int(reply.split(b"\n")[1]), text, "")


def torchrun(work: Path, nproc: int, flags: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    """`torchrun --nproc-per-node nproc pretrain_gpt.py flags` in `work`; stdout carries every rank's
    output (stderr too, in the forked runs). The master port is one the OS just gave out and took back;
    until the store listens on it another process (the other slow-test session's gloo pairs, a
    parallel part's run) may take it: a run whose store could not listen there (EADDRINUSE, before any
    rank did anything) is started again on a new port, twice at most."""
    for _ in range(3):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if os.environ.get("HETERMOE_TESTS_TORCHRUN") == "1":
            r = subprocess.run([sys.executable, "-W", "ignore", "-m", "torch.distributed.run", "--nproc-per-node",
                                str(nproc), "--master-port", str(port), "pretrain_gpt.py", *flags],
                               cwd=work, env=env(), capture_output=True, text=True, timeout=timeout)
        else:
            r = _forked_run(work, nproc, port, ["pretrain_gpt.py", *flags], env(), timeout)
        if r.returncode == 0 or "EADDRINUSE" not in r.stdout + r.stderr:
            break
    return r


def failure(log: str) -> str:
    """What to show of a failed torchrun's log: from the first rank's traceback on (torchrun's own
    report of the failed children fills the tail)."""
    i = log.find("Traceback (most recent call last)")
    return log[i:i + 4000] if i >= 0 else log[-4000:]


def tb_losses(tb: Path, tag: str = "lm loss") -> dict[int, float]:
    """Megatron-LM's own per-iteration values (its tensorboard scalars, written by the last rank:
    float32, unlike its 7-digit log lines)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(tb))
    ea.Reload()
    return {e.step: e.value for e in ea.Scalars(tag)}


def plugin_losses(tmp_path: Path, plan: Path, schedule: str, data_path: str, extra: tuple = ()) -> list[float]:
    """The same run on the plugin's own trainer (python -m megatron_hetermoe.training.pretrain_gpt)."""
    out = tmp_path / f"plugin-{schedule}.json"
    r = subprocess.run([sys.executable, "-W", "ignore", "-m", "megatron_hetermoe.training.pretrain_gpt", *MODEL, *BATCH,
                        *DATA, *RECIPE, "--data-path", data_path, "--nproc", "4", "--hetero-plan", str(plan),
                        "--hetero-schedule", schedule, "--golden-values-out", str(out), *extra],
                       cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    values = json.loads(out.read_text())["lm loss"]["values"]
    return [values[str(i)] for i in range(1, len(values) + 1)]




# Megatron-LM's own model defaults, as its MoE CI configs train them: GeLU, LayerNorm, learned absolute
# positions, tied embeddings, biased linear layers, no dropout.
MEGATRON_DEFAULTS = ["--hidden-dropout", "0", "--attention-dropout", "0"]


def run_losses(work: Path, tmp_path: Path, nproc: int, flags: list[str], name: str,
               tag: str = "lm loss") -> tuple[dict[int, float], str]:
    """torchrun pretrain_gpt.py with `flags` and its own --tensorboard-dir under tmp_path/name;
    returns (Megatron's per-iteration `tag` scalars, the log). Fails with the log's tail."""
    tb = tmp_path / name
    r = torchrun(work, nproc, [*flags, "--tensorboard-dir", str(tb)])
    log = r.stdout + r.stderr
    assert r.returncode == 0, failure(log)
    return tb_losses(tb, tag), log


# The 16-bit runs of both release lines' pretrain() tests: bf16, fp16, and per-pool precision.
PRECISIONS = {"bf16": ["--bf16"], "fp16": ["--fp16", "--initial-loss-scale", "4096"],
              "bf16-attention-fp16-experts": ["--bf16", "--hetero-expert-precision", "fp16", "--initial-loss-scale",
                                              "4096"]}
EVAL = ["--eval-interval", "2", "--eval-iters", "1"]  # validation after iteration 2, test after the last


def hetero_run(work: Path, plan: Path, data_path: str, tb: Path, extra: tuple | list = (), nproc: int = 4,
               data: tuple | list = DATA, evaluation: tuple | list = EVAL,
               recipe: tuple | list = RECIPE) -> tuple[str, dict[int, float]]:
    """torchrun pretrain_gpt.py of `work` with the tiny model on CPU ranks (`recipe`: the plugin
    trainer's recipe, or MEGATRON_DEFAULTS), `--hetero-plan plan`, its own --tensorboard-dir `tb`;
    returns (the log, Megatron's per-iteration lm loss). Fails with the log's tail. `data`: the
    tokenizer flags of that release (DATA is core_v0.16.1's)."""
    r = torchrun(work, nproc, [*MODEL, *BATCH, *data, *recipe, *CPU, "--data-path", data_path, "--log-interval", "1",
                               *evaluation, "--hetero-plan", str(plan), "--tensorboard-dir", str(tb), *extra])
    log = r.stdout + r.stderr
    assert r.returncode == 0, failure(log)
    return log, tb_losses(tb)


def resumes_bitwise(work: Path, plan: Path, data_path: str, tmp_path: Path, flags: list[str], nproc: int,
                    full: dict[int, float]) -> None:
    """A HeterMoE run of `plan` saved after iteration 2 (torch_dist, optimizer and RNG included) and
    resumed gives iteration 3 bitwise as the uninterrupted run `full` (its per-iteration losses)."""
    no_eval = ["--eval-interval", "100", "--eval-iters", "0"]
    ckpt = tmp_path / "ckpt"
    _, first = hetero_run(work, plan, data_path, tmp_path / "first", [*flags, "--save", str(ckpt), "--save-interval",
                                                                      "2", "--exit-interval", "2"], nproc=nproc,
                          evaluation=no_eval)
    log, resumed = hetero_run(work, plan, data_path, tmp_path / "resumed", [*flags, "--load", str(ckpt)], nproc=nproc,
                              evaluation=no_eval)
    assert sorted(first) == [1, 2] and sorted(resumed) == [3], log[-3000:]
    assert [first[1], first[2], resumed[3]] == [full[1], full[2], full[3]]


def checkpoints_both_ways(work: Path, plan: Path, data_path: str, tmp_path: Path, data: tuple | list = DATA,
                          extra: tuple | list = (), nproc: int = 4, plain_extra: tuple | list | None = None) -> None:
    """Megatron-LM's own EP run (2 ranks, EP 2) saves; a HeterMoE run of `plan` (4 ranks) loads it,
    as does Megatron EP; both continue with the same losses and the same routers' load-balancing
    loss (logged by the last rank: an expert rank in the HeterMoE run). Then the other way: the
    HeterMoE run's checkpoint loads into Megatron EP and into HeterMoE alike. dist_checkpointing
    reshards; --no-load-optim --no-load-rng as for any change of layout. `data`: the tokenizer
    flags of that release; `extra`: flags of every run (e.g. tensor parallelism), `plain_extra`:
    of the Megatron EP runs only (default: `extra`); `nproc`: the HeterMoE runs' ranks."""
    flags = [*MODEL, "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-3", *data, *RECIPE, *CPU,
             "--data-path", data_path, "--log-interval", "1", "--eval-interval", "100", "--eval-iters", "0",
             "--moe-aux-loss-coeff", "0.01"]
    ep = ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall"]
    plain_extra = list(extra) if plain_extra is None else list(plain_extra)
    ep = [*ep, *plain_extra]
    hetero = ["--hetero-plan", str(plan), *extra]
    cross = ["--no-load-optim", "--no-load-rng"]
    ck_ep, ck_h = tmp_path / "ep", tmp_path / "hetero"
    seen: list[dict] = []

    def run(nproc, extra):
        tb = tmp_path / f"tb{len(seen)}"
        r = torchrun(work, nproc, [*flags, *extra, "--tensorboard-dir", str(tb)])
        assert r.returncode == 0, failure(r.stdout + r.stderr)
        balance = tb_losses(tb, "load_balancing_loss")
        assert balance and all(v > 0.5 for v in balance.values()), balance
        seen.append(balance)
        return tb_losses(tb)

    first = run(2, [*ep, "--train-iters", "2", "--save", str(ck_ep), "--save-interval", "2"])
    assert sorted(first) == [1, 2]
    into_ep = run(2, [*ep, "--train-iters", "4", "--load", str(ck_ep), *cross])
    into_h = run(nproc, [*hetero, "--train-iters", "4", "--load", str(ck_ep), *cross, "--save", str(ck_h),
                     "--save-interval", "4"])
    assert sorted(into_ep) == sorted(into_h) == [3, 4]
    assert [into_h[i] for i in (3, 4)] == pytest.approx([into_ep[i] for i in (3, 4)], abs=3e-6), (into_h, into_ep)
    assert seen[2] == pytest.approx(seen[1], abs=3e-6)
    back_ep = run(2, [*ep, "--train-iters", "5", "--load", str(ck_h), *cross])
    back_h = run(nproc, [*hetero, "--train-iters", "5", "--load", str(ck_h), *cross])
    assert sorted(back_ep) == sorted(back_h) == [5]
    assert back_h[5] == pytest.approx(back_ep[5], abs=3e-6)
    assert seen[4] == pytest.approx(seen[3], abs=3e-6)


def continues_as_plain(work: Path, tmp_path: Path, plain_nproc: int, plain_flags: list[str], het_nproc: int,
                       het_flags: list[str]) -> None:
    """Plain Megatron (`plain_flags`) and HeterMoE with virtual stages (`het_flags`), both from one
    checkpoint through iteration 3 with validation after 2 and 3: the same training and validation
    losses (3e-6; measured bitwise or 4.8e-7 apart on default, avx2 and avx512 kernels)."""
    plain, _ = run_losses(work, tmp_path, plain_nproc, plain_flags, "tb1")
    het, log = run_losses(work, tmp_path, het_nproc, het_flags, "tb2")
    assert "Number of virtual stages per pipeline stage: 2" in log
    assert sorted(plain) == sorted(het) == [2, 3]
    assert [het[i] for i in (2, 3)] == pytest.approx([plain[i] for i in (2, 3)], abs=3e-6), (het, plain)
    v_plain, v_het = (tb_losses(tmp_path / "tb1", "lm loss validation"),
                      tb_losses(tmp_path / "tb2", "lm loss validation"))
    assert sorted(v_het) == sorted(v_plain) == [2, 3]
    assert [v_het[i] for i in (2, 3)] == pytest.approx([v_plain[i] for i in (2, 3)], abs=3e-6), (v_het, v_plain)


def virtual_stages_run(work: Path, data_path: str, tmp_path: Path, data: tuple | list = DATA,
                       resume: bool = True) -> None:
    """Virtual pipeline stages in pretrain(): plain Megatron EP 2 (2 ranks, 4 layers) saves after
    iteration 1; plain Megatron and HeterMoE at PP 2 x --num-virtual-stages-per-pipeline-rank 2
    (each stage 1 attention + 1 expert rank, DistEP) load it and continue with the same training
    and validation losses; then a HeterMoE run saved after iteration 2 (torch_dist: an attention
    rank's two model chunks, an expert rank's one module) and resumed gives iteration 3 bitwise as
    the uninterrupted run (`resume`). `data`: the tokenizer flags of that release."""
    from megatron_hetermoe.plan.hetero_plan import even_plan

    model = ["--num-layers", "4", *MODEL[2:]]
    flags = [*model, "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-3", *data, *RECIPE, *CPU,
             "--data-path", data_path, "--log-interval", "1", "--moe-aux-loss-coeff", "0.01"]
    ep = ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall"]
    no_eval = ["--eval-interval", "100", "--eval-iters", "0"]
    ckpt = tmp_path / "ckpt"
    run_losses(work, tmp_path, 2, [*flags, *ep, "--train-iters", "1", "--save", str(ckpt), "--save-interval", "1",
                                   *no_eval], "tb0")
    cross = ["--train-iters", "3", "--load", str(ckpt), "--no-load-optim", "--no-load-rng"]
    plan = tmp_path / "plan.json"
    even_plan(4, 4, 1, 1, num_microbatches=4, pipeline_stages=2, virtual_stages=2).save(plan)
    het_flags = [*flags, "--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2",
                 "--hetero-plan", str(plan)]
    continues_as_plain(work, tmp_path, 2, [*flags, *ep, *cross, *EVAL], 4, [*het_flags, *cross, *EVAL])
    if not resume:
        return
    full, _ = run_losses(work, tmp_path, 4, [*het_flags, "--train-iters", "3", *no_eval], "full")
    again = tmp_path / "again"
    first, _ = run_losses(work, tmp_path, 4, [*het_flags, "--train-iters", "3", *no_eval, "--save", str(again),
                                              "--save-interval", "2", "--exit-interval", "2"], "first")
    resumed, _ = run_losses(work, tmp_path, 4, [*het_flags, "--train-iters", "3", *no_eval, "--load", str(again)],
                            "resumed")
    assert sorted(first) == [1, 2] and sorted(resumed) == [3]
    assert [first[1], first[2], resumed[3]] == [full[1], full[2], full[3]]


def load_dcp(ckpt: Path) -> dict:
    """A torch_dist checkpoint as one dict of its global tensors and objects (torch DCP)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = ckpt.parent / (ckpt.name + ".pt")
    dcp_to_torch_save(str(ckpt), str(out))
    return torch.load(out, weights_only=False)


def same_state(a, b) -> bool:
    """Whether two loaded checkpoint states are bitwise equal: tensors (and their dtypes), numpy's
    RNG arrays, and the dicts, lists and values around them."""
    import numpy as np
    import torch

    if isinstance(a, np.ndarray):  # numpy's RNG state
        return isinstance(b, np.ndarray) and np.array_equal(a, b)
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b))
    return a == b


# --hetero-plan auto on CPU ranks: each names the GPU its node emulates, gathered as a GPU's device would be.
GPUS_ENV = "HETERMOE_GPU_TYPE"
NO_EVAL = ["--eval-interval", "100", "--eval-iters", "0"]


def auto_run(work: Path, data_path: str, tb: Path, monkeypatch, gpus: str, extra: list[str],
             data: tuple | list = DATA) -> tuple[str, dict[int, float]]:
    """hetero_run with --hetero-plan auto on one CPU rank per GPU type of `gpus` (comma-separated)."""
    monkeypatch.setenv(GPUS_ENV, gpus)
    return hetero_run(work, "auto", data_path, tb, extra, nproc=len(gpus.split(",")), data=data, evaluation=NO_EVAL)


def replans_and_resumes(work: Path, data_path: str, tmp_path: Path, monkeypatch, data: tuple | list = DATA) -> None:
    """2 A40 + 2 V100 plan themselves and train 4 iterations, saving after 2 and 4; a V100 lost, the
    3 GPUs left plan again and resume from iteration 2's checkpoint: iterations 3-4 equal the
    uninterrupted run's (the same weights, Adam state and samples on another plan; measured bitwise),
    and without the optimizer's state iteration 4 is visibly off."""
    from margins import within

    ckpt = tmp_path / "ckpt"
    log4, full = auto_run(work, data_path, tmp_path / "four", monkeypatch, "A40,A40,V100-16GB,V100-16GB",
                          ["--save", str(ckpt), "--save-interval", "2", "--train-iters", "4"], data)
    pick = next(line for line in log4.splitlines() if "--hetero-plan auto:" in line)
    assert "4 ranks: (2 V100-16GB attention | 2 A40 expert)" in pick, pick
    assert sorted(full) == [1, 2, 3, 4]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    (ckpt / "latest_checkpointed_iteration.txt").write_text("2")  # resume from iteration 2's
    load = ["--load", str(ckpt), "--train-iters", "4"]
    log3, resumed = auto_run(work, data_path, tmp_path / "three", monkeypatch, "A40,A40,V100-16GB", load, data)
    pick = next(line for line in log3.splitlines() if "--hetero-plan auto:" in line)
    assert "3 ranks: (2 A40 attention | 1 V100-16GB expert)" in pick, pick
    assert "the checkpoint was saved on another plan (4 ranks: 2 attention + 2 expert)" in log3, log3[-3000:]
    assert sorted(resumed) == [3, 4]
    _, cold = auto_run(work, data_path, tmp_path / "cold", monkeypatch, "A40,A40,V100-16GB",
                       [*load, "--no-load-optim"], data)
    near = max(abs(resumed[i] - full[i]) for i in (3, 4))
    within("resumed on another plan vs uninterrupted (lm loss, iterations 3-4)", near, 1e-5)
    assert abs(cold[4] - full[4]) > 20 * max(near, 1e-7), (resumed, cold, full)


# ---- live expert moves in pretrain() (test_megatron_lm_live_moves.py; core_v0.19.0: test_megatron_lm_v019.py) ----
def lopsided_plan(schedule: str):
    """2 attention + 2 expert ranks, one ZP group; each MoE layer's 4 experts all on one expert rank
    (rank 2 holds layer 0's, rank 3 layer 1's): under DistEP each layer waits for one rank doing
    all of its experts, and a placement of 2 + 2 per layer halves the predicted expert time for
    any routing. Each expert rank holds nothing in one layer."""
    from megatron_hetermoe.plan.hetero_plan import HeteroPlan, even_plan

    d = even_plan(2, 4, 2, 2, groups=1, num_microbatches=2, schedule=schedule).to_dict()
    d["groups"][0]["placement"] = [{"2": [0, 1, 2, 3]}, {"3": [0, 1, 2, 3]}]
    return HeteroPlan.from_dict(d)


def moves_live_and_resumes(work: Path, data_path: str, tmp_path: Path, data: tuple | list = DATA) -> None:
    """The load rule (margin 0, every 2 steps) moves the lopsided DistEP plan's experts after
    iteration 2; the 4 losses are bitwise the run's without moves; the checkpoint of iteration 2,
    saved after the move, records the moved plan and resumes on the starting plan (resharded by
    name) with iterations 3 and 4 as before."""
    from megatron.core.dist_checkpointing import load_common_state_dict

    from megatron_hetermoe.plan.hetero_plan import HeteroPlan

    tmp_path.mkdir(parents=True, exist_ok=True)
    plan = tmp_path / "plan.json"
    start = lopsided_plan("distep")
    start.save(plan)
    four = ["--train-iters", "4"]
    _, still = hetero_run(work, plan, data_path, tmp_path / "still", four, data=data, evaluation=NO_EVAL)
    ckpt = tmp_path / "ckpt"
    log, moved = hetero_run(work, plan, data_path, tmp_path / "moved",
                            [*four, "--hetero-replan-interval", "2", "--hetero-replan-margin", "0",
                             "--save", str(ckpt), "--save-interval", "2"], data=data, evaluation=NO_EVAL)
    lines = re.findall(r" live move at iteration (\d+): (\d+) expert\(s\)", log)
    assert lines and lines[0][0] == "2" and int(lines[0][1]) >= 2, log[-3000:]
    assert sorted(moved) == [1, 2, 3, 4]
    assert moved == still  # bitwise: a move changes no arithmetic
    common = load_common_state_dict(str(ckpt / "iter_0000002"))
    saved = HeteroPlan.from_dict(json.loads(common["args"].hetero_plan_json))
    assert saved.groups[0].placement != start.groups[0].placement
    assert any(2 in pl and 3 in pl for pl in [{int(r) for r, es in p.items() if es}
                                              for p in saved.groups[0].placement])
    (ckpt / "latest_checkpointed_iteration.txt").write_text("2")
    log, resumed = hetero_run(work, plan, data_path, tmp_path / "resumed", [*four, "--load", str(ckpt)], data=data,
                              evaluation=NO_EVAL)
    assert sorted(resumed) == [3, 4], log[-3000:]
    assert [resumed[3], resumed[4]] == [still[3], still[4]]


# The plugin trainer's forced moves (tests/integration/test_live_moves.py) on its sparse Asym-EA
# plan: to the even plan at iteration 2, on to each expert rank holding nothing in one layer at 4.
FORCED_MOVES = {2: [{2: [0, 1], 3: [2, 3]}, {2: [0, 1], 3: [2, 3]}],
                4: [{1: [1], 3: [0, 2, 3]}, {1: [2], 2: [0, 1, 3]}]}


def moved_experts(plan, forced: dict) -> list[tuple[str, str]]:
    """The (iteration, experts moved) pairs the live-move log lines name for `forced` moves of
    group 0 from `plan`: the (layer, expert) pairs whose holder changes at each."""
    out, at = [], [{e: r for r, es in pl.items() for e in es} for pl in plan.groups[0].placement]
    for it in sorted(forced):
        new = [{e: r for r, es in pl.items() for e in es} for pl in forced[it]]
        out.append((str(it), str(sum(a[e] != b[e] for a, b in zip(at, new) for e in b))))
        at = new
    return out


def forced_moves_change_no_loss(work: Path, data_path: str, tmp_path: Path, monkeypatch, schedule: str,
                                flags: list[str], data: tuple | list = DATA, plan=None, forced: dict | None = None,
                                recipe: tuple | list = RECIPE, nproc: int = 4,
                                same: tuple[str, ...] = ()) -> None:
    """`forced` moves of group 0 (FORCED_MOVES on the sparse Asym-EA plan by default) in pretrain()
    (tests/forced_moves/sitecustomize.py makes the ranks' decisions): 6 iterations' lm loss and
    gradient norm (what clipping, on at Megatron's default 1.0 unless `flags` say otherwise,
    divides by), and the tensorboard scalars `same` (the loss scale where it is dynamic), bitwise
    those of the run without moves."""
    from shared_plans import sparse_asym_ea_plan

    tmp_path.mkdir(parents=True, exist_ok=True)
    plan = sparse_asym_ea_plan(schedule) if plan is None else plan
    forced = FORCED_MOVES if forced is None else forced
    path = tmp_path / "plan.json"
    plan.save(path)
    six = ["--train-iters", "6", *flags]
    _, still = hetero_run(work, path, data_path, tmp_path / "still", six, nproc, data, NO_EVAL, recipe)
    monkeypatch.setenv("PYTHONPATH", str(ROOT / "tests" / "forced_moves"))
    monkeypatch.setenv("HETERMOE_TEST_FORCED_MOVES", json.dumps(forced))
    log, moved = hetero_run(work, path, data_path, tmp_path / "moved", [*six, "--hetero-replan-interval", "1"],
                            nproc, data, NO_EVAL, recipe)
    assert re.findall(r" live move at iteration (\d+): (\d+) expert", log) == moved_experts(plan, forced), log[-3000:]
    assert sorted(moved) == [1, 2, 3, 4, 5, 6]
    assert moved == still  # bitwise
    for tag in ("grad-norm", *same):
        a, b = tb_losses(tmp_path / "moved", tag), tb_losses(tmp_path / "still", tag)
        assert sorted(b) == [1, 2, 3, 4, 5, 6] and a == b, (tag, a, b)
