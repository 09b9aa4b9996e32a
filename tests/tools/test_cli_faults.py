"""Issue 25's fault-and-input cases against `hetermoe` and pretrain_gpt: each ends in its category.

- named: a non-zero exit with one line naming the flag or file, no traceback, before any work;
- handled: the command does what was asked (or what Megatron means by it).

Most cases run the command in-process (`cli.main`: the same code as the console script, with no
interpreter start); signals, pipes, a second process on a locked --save and torchrun use real
processes (marked slow). Item numbers are the issue's. The SLURM renderer's cases (item 5) run
it in-process here; tests/tools/test_slurm.py runs launch.sh itself.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from megatron_hetermoe import commands as cli
from megatron_hetermoe.plan.hetero_plan import even_plan
from megatron_hetermoe.training.pretrain_gpt import recipe_args

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ["train", "--model", "tiny", "--nproc", "2", "--expert-model-parallel-size", "2", "--micro-batch-size", "2",
         "--global-batch-size", "4"]
RECIPE = recipe_args()  # --swiglu --normalization RMSNorm ...: required by train-gpt
PRETRAIN = ["train-gpt", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--ffn-hidden-size", "128", "--num-experts", "4", "--moe-router-topk", "2", "--seq-length", "32",
            "--max-position-embeddings", "32", *RECIPE, "--nproc", "2", "--expert-model-parallel-size", "2",
            "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "1"]


def hetermoe(argv: list[str], capfd) -> tuple[int, str, str]:
    """Run `hetermoe ARGV` in this process: (exit code, stdout, stderr), forked ranks' output included."""
    capfd.readouterr()
    try:
        code = cli.main(argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    out, err = capfd.readouterr()
    return code, out, err


def assert_named(code: int, err: str, *names: str, out: str = "") -> None:
    """The category `named`: non-zero, no traceback, the flag/file in the message, no step taken."""
    assert code != 0, err
    assert "Traceback" not in err + out, err[-3000:]
    for n in names:
        assert n in err, f"{n!r} not in: {err[-2000:]}"
    assert " iteration " not in out, "refused only after training"


def _cmd(*argv: str) -> list[str]:
    return [sys.executable, "-W", "ignore", "-m", "megatron_hetermoe.cli", *argv]


def _env(tmp: Path, **extra: str) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp), **extra}


# ---------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """A small indexed dataset (megatron-core's builder), tokens < 255 for NullTokenizer --vocab-size 255."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    d = tmp_path_factory.mktemp("data")
    prefix = d / "docs_text_document"
    b = IndexedDatasetBuilder(str(prefix) + ".bin", dtype=np.uint16)
    rng = np.random.default_rng(0)
    for _ in range(40):
        import torch

        b.add_document(torch.from_numpy(rng.integers(0, 255, 300).astype(np.int64)), [300])
    b.finalize(str(prefix) + ".idx")
    return prefix


def data_flags(prefix) -> list[str]:
    return ["--data-path", str(prefix), "--tokenizer-type", "NullTokenizer", "--vocab-size", "255"]


def copy_data(prefix: Path, dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    for ext in (".bin", ".idx"):
        (dest / (prefix.name + ext)).write_bytes(Path(str(prefix) + ext).read_bytes())
    return dest / prefix.name


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    """A 2-iteration checkpoint of the tiny model (EP 2 on 2 ranks)."""
    from megatron_hetermoe.config import ModelConfig, ParallelConfig, TrainConfig
    from megatron_hetermoe.training.args import run

    d = tmp_path_factory.mktemp("ckpt") / "ck"
    run(TrainConfig(ModelConfig.load("tiny"), ParallelConfig(ep=2), micro_batch_size=2, global_batch_size=4,
                    train_iters=2, quiet=True, save=str(d)), 2)
    return d


@pytest.fixture
def plan11(tmp_path) -> Path:
    p = tmp_path / "plan11.json"
    even_plan(2, 4, 1, 1).save(p)
    return p


# ---------------------------------------------------------------- 1, 11: signals, litter
def _rank_pids(parent: int) -> list[psutil.Process]:
    try:
        return psutil.Process(parent).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _wait_for(proc: subprocess.Popen, lines: list[str], text: str, timeout: float = 120) -> None:
    t0 = time.monotonic()
    while not any(text in line for line in lines):
        assert proc.poll() is None, "".join(lines)[-3000:]
        assert time.monotonic() - t0 < timeout, "".join(lines)[-3000:]
        time.sleep(0.1)


def _background(cmd: list[str], env: dict) -> tuple[subprocess.Popen, list[str]]:
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                         start_new_session=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(p.stdout), daemon=True).start()
    return p, lines


def _alive(procs: list[psutil.Process]) -> list[int]:
    out = []
    for c in procs:
        try:
            if c.is_running() and c.status() != psutil.STATUS_ZOMBIE:
                out.append(c.pid)
        except psutil.NoSuchProcess:
            pass
    return out


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_killed_launcher_leaves_no_rank_and_no_run_directory(tmp_path, sig):
    """1, 11: what SLURM, preemption or `kill` sends: every rank gone within 5 s (the process
    table), the run directory too; SIGTERM ends the launcher non-zero (143)."""
    p, lines = _background(_cmd(*TRAIN, "--train-iters", "100000"), _env(tmp_path))
    try:
        _wait_for(p, lines, " iteration ")
        ranks = _rank_pids(p.pid)
        assert len(ranks) >= 2
        t0 = time.monotonic()
        os.kill(p.pid, sig)
        while _alive(ranks) and time.monotonic() - t0 < 5:
            time.sleep(0.05)
        gone_s = time.monotonic() - t0
        assert not _alive(ranks), f"ranks {_alive(ranks)} alive 5 s after {sig.name} to the launcher"
        p.wait(timeout=10)
        while list(tmp_path.glob("hetermoe-launch-*")) and time.monotonic() - t0 < 5:
            time.sleep(0.05)
        assert not list(tmp_path.glob("hetermoe-launch-*")), "the run directory outlived the launcher"
        if sig == signal.SIGTERM:
            assert p.returncode == 143 and "terminated by SIGTERM" in "".join(lines), "".join(lines)[-2000:]
        print(f"{sig.name}: no rank alive after {gone_s:.2f} s")
    finally:
        os.killpg(p.pid, signal.SIGKILL) if p.poll() is None else None
        for pid in _alive(_rank_pids(p.pid)):
            os.kill(pid, signal.SIGKILL)


def _manager_rank(rank, world):
    """What megatron-core's dist_checkpointing does in a rank: a spawned multiprocessing Manager."""
    import multiprocessing as mp

    manager = mp.get_context("spawn").Manager()
    q = manager.Queue()
    q.put(rank)
    return q.get(), manager._process.pid


def test_multiprocessing_in_a_rank_leaves_no_process_and_no_pymp_dir(tmp_path, monkeypatch):
    """3, 11: a rank's spawned Manager (the export | cat hang) and its pymp-* directory end with the rank."""
    from megatron_hetermoe.parallel.launcher import launch

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)
    out = launch(_manager_rank, 2, timeout_s=120)
    assert [r for r, _ in out] == [0, 1]
    time.sleep(0.5)
    managers = [psutil.Process(pid) for _, pid in out if psutil.pid_exists(pid)]
    assert not _alive(managers), "a rank's Manager outlived it (it holds the caller's stdout: export | cat hung)"
    assert not list(tmp_path.glob("pymp-*")) and not list(tmp_path.glob("hetermoe-launch-*"))


@pytest.mark.slow
def test_export_piped_into_cat_ends(ckpt, tmp_path):
    """3: `hetermoe checkpoint export | cat` ends in seconds, and leaves nothing behind."""
    t0 = time.monotonic()
    r = subprocess.run(f"{' '.join(_cmd('checkpoint', 'export', '--load', str(ckpt), '-o', str(tmp_path / 'mega')))}"
                       f" | cat", shell=True, capture_output=True, text=True, timeout=120, env=_env(tmp_path))
    took = time.monotonic() - t0
    assert r.returncode == 0 and "exported iteration 2" in r.stdout, r.stderr[-2000:]
    assert took < 60, f"export | cat took {took:.0f} s"
    assert not list(tmp_path.glob("pymp-*")) and not list(tmp_path.glob("hetermoe-*"))
    print(f"export | cat: {took:.1f} s")


# ---------------------------------------------------------------- 2, 6: the progress watchdog
def _progressing(rank, world, seconds):
    """A rank that keeps reporting progress for `seconds`, then ends."""
    from megatron_hetermoe.parallel import watchdog

    t0, it = time.monotonic(), 0
    while time.monotonic() - t0 < seconds:
        it += 1
        watchdog.report(it)
        time.sleep(0.2)
    return it


def _falls_behind(rank, world, stalled):
    """Every rank reports iterations 1..3, but `stalled` stops after 1; then all wait."""
    from megatron_hetermoe.parallel import watchdog

    for it in range(1, 2 if rank == stalled else 4):
        watchdog.report(it)
    time.sleep(3600)


def _hangs_outside_a_collective(rank, world, stalled):
    import torch.distributed as dist

    dist.barrier()
    if rank == stalled:
        time.sleep(3600)  # e.g. a deadlock in its own code: its peers wait in the next collective
    dist.barrier()


def test_a_run_goes_on_while_it_makes_progress():
    """2: no wall-clock limit: a run four times longer than the progress timeout, progressing, ends normally."""
    from megatron_hetermoe.parallel.launcher import launch

    t0 = time.monotonic()
    its = launch(_progressing, 2, 4.0, timeout_s=None, progress_timeout_s=1.0)
    assert time.monotonic() - t0 >= 4.0 and min(its) >= 10


def test_a_run_without_progress_is_ended_naming_the_stalled_rank():
    """2, 6: the watchdog, with a short period, ends a run whose ranks stopped reporting, naming
    the rank furthest behind."""
    from megatron_hetermoe.parallel.launcher import LaunchError, launch

    t0 = time.monotonic()
    with pytest.raises(LaunchError) as e:
        launch(_falls_behind, 3, 1, timeout_s=None, progress_timeout_s=2.0)
    assert e.value.rank == 1 and time.monotonic() - t0 < 30
    assert e.value.user_message.startswith("no rank made progress for ")
    assert "(--progress-timeout 2); rank 1 is furthest behind (rank 0: iteration 3" in e.value.user_message


def test_peers_timing_out_blame_the_rank_they_waited_for():
    """6: when ranks time out in a collective, the rank they waited for (alive, no error of its
    own) is named, not the first to time out."""
    from megatron_hetermoe.parallel.launcher import LaunchError, launch

    with pytest.raises(LaunchError) as e:
        launch(_hangs_outside_a_collective, 3, 2, timeout_s=None, collective_timeout_s=2.0)
    assert e.value.rank == 2, str(e.value)[:2000]
    assert e.value.user_message.startswith("rank 2 made no progress (waiting) while its peers timed out")


def test_training_runs_have_no_wall_clock_cap(monkeypatch, capfd):
    """2: `hetermoe train` hands the launcher no job deadline, only the progress watchdog's period."""
    from megatron_hetermoe.parallel import launcher

    seen = {}

    class Stop(Exception):
        pass

    def fake_launch(fn, world, *args, **kw):
        seen.update(kw)
        raise Stop

    monkeypatch.setattr(launcher, "launch", fake_launch)
    with pytest.raises(Stop):
        cli.main([*TRAIN, "--train-iters", "1", "--progress-timeout", "120"])
    assert seen["timeout_s"] is None and seen["progress_timeout_s"] == 120
    code, _, err = hetermoe([*TRAIN, "--progress-timeout", "-1"], capfd)
    assert_named(code, err, "--progress-timeout -1")


@pytest.mark.slow
def test_a_stopped_rank_is_named(tmp_path):
    """6: SIGSTOP of rank 1 ends the job naming rank 1 (not rank 0, whose receive would time out)."""
    p, lines = _background(_cmd(*TRAIN, "--train-iters", "100000", "--progress-timeout", "3"), _env(tmp_path))
    try:
        _wait_for(p, lines, " iteration ")
        # Rank 1 writes to stderr only (rank 0 to both; the launcher's janitor to neither).
        rank1 = [c for c in _rank_pids(p.pid) if os.readlink(f"/proc/{c.pid}/fd/1") == "/dev/null"
                 and os.readlink(f"/proc/{c.pid}/fd/2") != "/dev/null"]
        assert len(rank1) == 1
        t0 = time.monotonic()
        os.kill(rank1[0].pid, signal.SIGSTOP)
        p.wait(timeout=60)
        text = "".join(lines)
        assert p.returncode == 1 and "error: rank 1 is stopped" in text, text[-3000:]
        assert "Traceback" not in text and time.monotonic() - t0 < 30
    finally:
        os.killpg(p.pid, signal.SIGKILL) if p.poll() is None else None


def test_watchdog_names_a_stopped_process():
    from megatron_hetermoe.parallel.watchdog import Watchdog

    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with tempfile.TemporaryDirectory() as d:
            dog = Watchdog(d, [other.pid, sleeper.pid], progress_timeout_s=None, stopped_after_s=0.3)
            assert dog.check() is None
            os.kill(sleeper.pid, signal.SIGSTOP)
            time.sleep(0.1)
            assert dog.stopped() == [1] and dog.check() is None  # not yet for 0.3 s
            time.sleep(0.4)
            stall = dog.check()
            assert stall.rank == 1 and "rank 1 is stopped (SIGSTOP?)" in stall.message
    finally:
        for p in (sleeper, other):
            p.kill()
            p.wait()


# ---------------------------------------------------------------- 4: one run per --save
def test_second_run_on_a_locked_save_is_refused_naming_the_first(tmp_path, capfd):
    from megatron_hetermoe.checkpoint.lock import LOCK_FILE, SaveLock

    save = tmp_path / "save"
    holder = subprocess.Popen([sys.executable, "-c", f"""
import sys, time
from megatron_hetermoe.checkpoint.lock import SaveLock
lock = SaveLock({str(save)!r}).acquire()
print("locked", flush=True)
time.sleep(60)
"""], stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert holder.stdout.readline().strip() == "locked"
        t0 = time.monotonic()
        code, out, err = hetermoe([*TRAIN, "--train-iters", "2", "--save", str(save)], capfd)
        assert_named(code, err, f"--save {save}: in use by another run", f"pid {holder.pid} on host", out=out)
        assert time.monotonic() - t0 < 10  # before any rank started
    finally:
        holder.kill()
        holder.wait()
    with SaveLock(save):  # the kernel dropped the dead holder's lock: no stale lock to clear
        assert json.loads((save / LOCK_FILE).read_text())["pid"] == os.getpid()
    assert (save / LOCK_FILE).read_text() == ""


# ---------------------------------------------------------------- 5: SLURM renderer
@pytest.fixture
def mixed_plan(tmp_path) -> Path:
    p = tmp_path / "mixed.json"
    even_plan(2, 4, 1, 2, groups=1, attention_gpu="A40", expert_gpu="V100-32GB").save(p)
    return p


def slurm(argv: list[str], capsys) -> tuple[int, str, str]:
    from megatron_hetermoe.tools import slurm as slurm_tool

    capsys.readouterr()
    try:
        code = slurm_tool.main(argv)
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def test_slurm_inputs(mixed_plan, tmp_path, capsys, monkeypatch):
    base = ["--plan", str(mixed_plan), "--gpus-per-node", "8"]
    flags = ["--", "--model", "tiny", *RECIPE, "--global-batch-size", "2"]
    code, out, err = slurm([*base, "--partition", "a40=gpu-a40", "--constraint", "v100-32gb=v100s", *flags], capsys)
    assert code == 0 and "#SBATCH --partition=gpu-a40" in out and "#SBATCH --constraint=v100s" in out, err
    for extra, train, name in ((["--partition", "h100=x"], flags, "the plan has no GPU type 'h100'"),
                               (["--master-port", "99999"], flags, "--master-port 99999: a TCP port is 1..65535"),
                               ([], [*flags, "--num-layers", "0"], "num_layers=0 must be a positive"),
                               ([], ["--", "--model", "tiny", "--frobnicate"], "unknown flag(s): --frobnicate")):
        code, out, err = slurm([*base, *extra, *train], capsys)
        assert_named(code, err, name)
        assert "#SBATCH" not in out
    # A relative --plan is the caller's file, not the repository's.
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "rel.json").write_text(mixed_plan.read_text())
    monkeypatch.chdir(tmp_path / "mine")
    code, out, err = slurm(["--plan", "rel.json", "--gpus-per-node", "8", *flags], capsys)
    assert code == 0 and f"--hetero-plan {tmp_path / 'mine' / 'rel.json'}" in out, err


# ---------------------------------------------------------------- 7: one line for a user's error
def test_user_errors_in_a_rank_are_one_line(ckpt, tmp_path, capfd, monkeypatch):
    """7: a checkpoint a rank refuses (here a truncated rank file) is `error: rank N: ...`; a
    traceback only with HETERMOE_TRACEBACK=1."""
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    f = next(bad.glob("iter_*/rank_00001/model_optim_rng.pt"))
    f.write_bytes(f.read_bytes()[:100])
    code, out, err = hetermoe([*TRAIN, "--train-iters", "3", "--load", str(bad)], capfd)
    assert_named(code, err, "hetermoe train: error: rank ", "model_optim_rng.pt is 100 bytes", out=out)
    assert len([line for line in err.splitlines() if "error" in line]) == 1, err
    monkeypatch.setenv("HETERMOE_TRACEBACK", "1")
    with pytest.raises(Exception, match="model_optim_rng.pt is 100 bytes") as e:
        cli.main([*TRAIN, "--train-iters", "3", "--load", str(bad)])
    assert "Traceback" in str(e.value)  # the rank's own traceback travels with the error


def test_named_errors_of_the_tools(tmp_path, capfd):
    """7: bench, timeline, regress and profile refuse bad inputs by name, before their work."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "bad.json").write_text("{not json")
    regress = ["--", "--nproc", "2", "--expert-model-parallel-size", "2", "--train-iters", "2",
               "--global-batch-size", "4"]
    for argv, names in (
            (["bench", "--cluster", "nosuch", "--model", "tiny", "--seq-len", "32"], ["clusters config 'nosuch'"]),
            (["bench", "--cluster", "mini-2a40-2v100", "--model", "tiny", "--seq-len", "32", "--global-batch", "-1"],
             ["--global-batch -1"]),
            (["bench", "--cluster", "mini-2a40-2v100", "--model", "tiny", "--seq-len", "0"], ["--seq-len 0"]),
            (["timeline", str(tmp_path / "empty")], [f"{tmp_path / 'empty'}: holds no timeline.rank*.json"]),
            (["regress", "--golden", str(tmp_path / "missing.json"), *regress], ["missing.json: cannot read it"]),
            (["regress", "--golden", str(tmp_path / "bad.json"), *regress], ["bad.json: not valid JSON"]),
            (["profile", "--model", "tiny", "--out", str(tmp_path / "nodir" / "p.yaml")],
             ["--out", "nodir does not exist"])):
        t0 = time.monotonic()
        code, out, err = hetermoe(argv, capfd)
        assert_named(code, err, *names, out=out)
        assert time.monotonic() - t0 < 10, f"{argv[0]} refused only after {time.monotonic() - t0:.0f} s of work"


def test_data_inputs(data, tmp_path, capfd):
    """7, 9: --split, truncated or mismatched .bin/.idx are refused by name before any rank."""
    for split in ("a,b,c", "1,2,3,4", "0,0,0"):
        code, out, err = hetermoe([*PRETRAIN, *data_flags(data), "--split", split], capfd)
        assert_named(code, err, f"--split {split}: give up to 3 proportions", out=out)
    for name, ext, cut, what in (("trunc_bin", ".bin", lambda b: b[: len(b) // 2], ".bin is"),
                                 ("trunc_idx", ".idx", lambda b: b[: len(b) // 2], ".idx is"),
                                 ("double_bin", ".bin", lambda b: b * 2, ".bin is")):
        prefix = copy_data(data, tmp_path / name)
        f = Path(str(prefix) + ext)
        f.write_bytes(cut(f.read_bytes()))
        code, out, err = hetermoe([*PRETRAIN, *data_flags(prefix)], capfd)
        assert_named(code, err, f"--data-path {prefix}", what, "preprocess_data.py", out=out)


def test_megatron_blend_syntax_trains(data, tmp_path, capfd):
    """7: --data-path 0.3 P 0.7 Q is Megatron's weighted blend; bad weights are refused by name."""
    other = copy_data(data, tmp_path / "other")
    code, out, err = hetermoe([*PRETRAIN, "--data-path", "0.3", str(data), "0.7", str(other),
                               "--tokenizer-type", "NullTokenizer", "--vocab-size", "255",
                               "--data-cache-path", str(tmp_path / "cache")], capfd)
    assert code == 0 and " iteration        1/       1 |" in out, err[-3000:]
    code, out, err = hetermoe([*PRETRAIN, "--data-path", "0", str(data), "0", str(other),
                               "--tokenizer-type", "NullTokenizer", "--vocab-size", "255"], capfd)
    assert_named(code, err, "blend weights [0.0, 0.0] must be finite", out=out)


def test_fault_injection_spec_is_checked(plan11, capfd, monkeypatch):
    """7, 9: a malformed $HETERMOE_INJECT_FAULT, or one aimed at a rank the job lacks, is refused."""
    argv = ["train", "--model", "tiny", "--hetero-plan", str(plan11), "--micro-batch-size", "2",
            "--global-batch-size", "2", "--train-iters", "1"]
    for spec, name in (("rank=x", "is malformed (ValueError"), ("rank=7,site=task,at=0", "aims at rank 7, but the "
                                                                                          "job has ranks 0..1")):
        monkeypatch.setenv("HETERMOE_INJECT_FAULT", spec)
        code, out, err = hetermoe(argv, capfd)
        assert_named(code, err, "$HETERMOE_INJECT_FAULT", name, out=out)


# ---------------------------------------------------------------- 8: write paths before the first step
def test_write_paths_are_checked_before_the_first_step(tmp_path, plan11, capfd):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    hetero = ["train", "--model", "tiny", "--hetero-plan", str(plan11), "--micro-batch-size", "2",
              "--global-batch-size", "2", "--train-iters", "1"]
    for argv, names in (
            ([*TRAIN, "--save", str(a_file)], [f"--save {a_file}: is a file"]),
            ([*TRAIN, "--save", "/proc/hetermoe-save"], ["--save /proc/hetermoe-save: cannot create"]),
            ([*TRAIN, "--golden-values-out", str(tmp_path / "nodir" / "g.json")], ["--golden-values-out",
                                                                                  "nodir does not exist"]),
            ([*TRAIN, "--tensorboard-dir", str(a_file)], [f"--tensorboard-dir {a_file}: is a file"]),
            ([*hetero, "--timeline-dir", str(a_file)], [f"--timeline-dir {a_file}: is a file"])):
        t0 = time.monotonic()
        code, out, err = hetermoe(argv, capfd)
        assert_named(code, err, *names, out=out)
        assert time.monotonic() - t0 < 10


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_read_only_save_is_refused(tmp_path, capfd):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    code, out, err = hetermoe([*TRAIN, "--save", str(ro)], capfd)
    assert_named(code, err, f"--save {ro}", "cannot write into", out=out)


# ---------------------------------------------------------------- 9: silently accepted before
def test_flags_accepted_silently_before(tmp_path, plan11, capfd):
    plan = json.loads(plan11.read_text())
    plan["version"] = "1"
    strver = tmp_path / "strver.json"
    strver.write_text(json.dumps(plan))
    for argv, names in (
            (["train", "--model", "tiny", "--nproc", "0", "--train-iters", "1"], ["--nproc 0: start 1 to 1024"]),
            ([*TRAIN, "--ckpt-step", "2"], ["--ckpt-step 2 needs --load DIR"]),
            (["train", "--model", "tiny", "--hetero-plan", str(strver), "--micro-batch-size", "2",
              "--global-batch-size", "2"], ["plan version '1' (a str) is not supported", 'the integer ("version": 1)']),
            ([*PRETRAIN, "--vocab-size", "-5"], ["--vocab-size -5: must be a positive integer"])):
        code, out, err = hetermoe(argv, capfd)
        assert_named(code, err, *names, out=out)


def test_resumed_run_numbers_its_steps_and_says_the_schedule_is_the_checkpoints(ckpt, tmp_path, capfd):
    """9: golden values of a run resumed at iteration 2 are steps 3..4; a new --lr / --train-iters is
    reported as not changing the checkpoint's LR schedule."""
    import shutil

    ck = tmp_path / "ck"
    shutil.copytree(ckpt, ck)
    g = tmp_path / "g.json"
    code, out, err = hetermoe([*TRAIN, "--load", str(ck), "--save", str(ck), "--train-iters", "4", "--lr", "5e-4",
                               "--golden-values-out", str(g)], capfd)
    assert code == 0, err[-3000:]
    golden = json.loads(g.read_text())["lm loss"]
    assert (golden["start_step"], golden["end_step"], list(golden["values"])) == (3, 4, ["3", "4"])
    assert ("note: resuming keeps the checkpoint's LR schedule (Megatron's use_checkpoint_opt_param_scheduler): "
            "--lr 0.001 (given now: 0.0005), --train-iters 2 (given now: 4)") in out
    assert "training runs to --train-iters 4, past the schedule's end (iteration 2) at --min-lr 0.0001" in out


# ---------------------------------------------------------------- 10: absurd sizes fail fast
def test_absurd_sizes_fail_fast(tmp_path, capfd):
    huge = tmp_path / "huge.yaml"
    huge.write_text((ROOT / "configs" / "models" / "tiny.yaml").read_text().replace("num_layers: 2",
                                                                                    "num_layers: " + "1" + "0" * 20))
    even = ["plan", "--even", "--attention-ranks", "1", "--expert-ranks", "1", "-o", str(tmp_path / "p.json")]
    for argv, names in (
            ([*even, "--model", str(huge)], ["num_layers=100000000000000000000 is above 4096", "limits.py"]),
            ([*even, "--model", "tiny", "--groups", "1000000000"], ["--groups 1000000000 x (--attention-ranks 1 + "
                                                                   "--expert-ranks 1) = 2000000000 ranks is above "
                                                                   "131072"]),
            (["plan", "--cluster", "mini-2a40-2v100", "--model", "tiny", "--seq-len", "32", "--global-batch",
              "1000000000000000"], ["--global-batch 1000000000000000 is above 16777216"]),
            ([*TRAIN, "--global-batch-size", "1000000000000000"], ["--global-batch-size 1000000000000000",
                                                                   "is above 16777216"])):
        t0 = time.monotonic()
        code, out, err = hetermoe(argv, capfd)
        assert_named(code, err, *names, out=out)
        assert time.monotonic() - t0 < 10


# ---------------------------------------------------------------- 11: litter
@pytest.mark.slow
def test_profile_leaves_no_temp_directory(tmp_path):
    r = subprocess.run(_cmd("profile", "--model", "tiny", "--out", str(tmp_path / "p.yaml"), "--repeats", "1",
                            "--seq-lens", "8", "--seqs", "1", "--expert-tokens", "8", "--a2a-bytes", "4096"),
                       capture_output=True, text=True, timeout=300, env=_env(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "torchinductor_root") == ["p.yaml"]


# ---------------------------------------------------------------- issue 24, item 8: torchrun
@pytest.mark.slow
def test_torchrun_rank_failure_ends_the_job_at_once(tmp_path, plan11):
    """A rank that raises under torchrun prints its traceback and exits at once, so torchrun stops
    the job in seconds (not after the other rank's collective timeout); a clean run ends 0."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-W", "ignore", "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(port), "-m", "megatron_hetermoe.training.args", "--model", "tiny",
           "--hetero-plan", str(plan11), "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "3"]
    env = _env(tmp_path, HETERMOE_INJECT_FAULT="rank=1,site=exchange,at=3", HETERMOE_COLLECTIVE_TIMEOUT_S="600")
    t0 = time.monotonic()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    took = time.monotonic() - t0
    text = r.stdout + r.stderr
    assert r.returncode != 0 and "FaultInjected: injected fault on rank 1" in text and "Traceback" in text, text[-3000:]
    assert took < 60, f"the job took {took:.0f} s to end (the collective timeout is 600 s)"
    print(f"torchrun job ended {took:.1f} s after start")


_JOINED = """
import sys, threading, time
import torch.distributed as dist
from megatron_hetermoe.training import args
# Something that keeps a process alive after an uncaught exception (NCCL's communicators did on an
# H200: an ordinary exit hung); a rank must end anyway, at once.
threading.Thread(target=time.sleep, args=(3600,), name="lingering").start()
code = args.main(sys.argv[1:])
print("process group destroyed:", not dist.is_initialized(), flush=True)
import os; os._exit(code)
"""


@pytest.mark.slow
def test_joined_rank_ends_at_once_on_failure_and_destroys_its_group_on_success(ckpt, tmp_path):
    """Issue 24 item 8 (the joining path, RANK set): a failing rank prints its error and exits
    even though something would keep the interpreter alive; a clean run destroys its group."""
    import shutil
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = _env(tmp_path, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               PYTHONWARNINGS="ignore")
    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    (bad / "iter_0000002" / "manifest.json").write_text("{}")
    one = ["--model", "tiny", "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "1"]
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", _JOINED, *one, "--load", str(bad)], capture_output=True, text=True,
                       timeout=120, env=env)
    assert r.returncode == 1 and "error: rank 0: " in r.stderr and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert time.monotonic() - t0 < 60
    r = subprocess.run([sys.executable, "-c", _JOINED, *one], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0 and "process group destroyed: True" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
