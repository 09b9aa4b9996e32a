"""`hetermoe pretrain` (megatron_lm/pretrain.py): Megatron's own pretrain() from a checkout
(MEGATRON_LM_DIR) or from megatron-core >= 0.19's megatron.training, and what it says when neither
is there. The no-checkout runs on megatron-core 0.19 are in test_megatron_lm_v019.py."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from megatron_lm_run import BATCH, CPU, DATA, ITERATION, MODEL, RECIPE, ROOT, env

from megatron_hetermoe import commands as cli
from megatron_hetermoe import compat


def _run(argv: list[str], capfd, **environ: str | None) -> tuple[int, str]:
    old = {k: os.environ.get(k) for k in environ}
    for k, v in environ.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    try:
        capfd.readouterr()
        code = cli.main(["pretrain", *argv])
        return code, capfd.readouterr().err
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _tree(tmp_path: Path, minor: int, patched: bool) -> Path:
    """A directory with what `hetermoe pretrain` reads of a checkout: its version and pretrain_gpt.py."""
    (tmp_path / "megatron" / "core").mkdir(parents=True)
    (tmp_path / "megatron" / "core" / "package_info.py").write_text(f"MAJOR = 0\nMINOR = {minor}\nPATCH = 0\n")
    call = "hetero_pretrain(pretrain, sys.argv[1:])" if patched else "pretrain()"
    (tmp_path / "pretrain_gpt.py").write_text(f"# Megatron-LM's script\n{call}\n")
    return tmp_path


@pytest.mark.skipif(compat.mcore_version()[:2] >= (0, 19), reason="megatron-core >= 0.19 has megatron.training")
def test_without_megatron_training_it_says_what_is_needed(capfd):
    code, err = _run([*MODEL, "--nproc", "1"], capfd, MEGATRON_LM_DIR=None)
    assert code == 1
    assert "ships no megatron.training" in err and "megatron-core>=0.19" in err and "MEGATRON_LM_DIR" in err, err
    assert "the same flags: hetermoe train" in err and "Traceback" not in err


def test_an_unpatched_checkout_is_named_with_its_patch(capfd, tmp_path):
    tree = _tree(tmp_path, 16, patched=False)
    code, err = _run([*MODEL], capfd, MEGATRON_LM_DIR=str(tree))
    assert code == 1
    assert f"MEGATRON_LM_DIR={tree} (core_v0.16.0)" in err and "does not have HeterMoE's patch" in err, err
    assert f"git -C {tree} apply {ROOT / 'patches' / 'megatron-lm-core_v0.16.1-pretrain_gpt.patch'}" in err, err


def test_a_checkout_of_another_release_is_refused(capfd, tmp_path):
    code, err = _run([*MODEL], capfd, MEGATRON_LM_DIR=str(_tree(tmp_path, 12, patched=True)))
    assert code == 1 and "no patch for Megatron-LM core_v0.12.0" in err, err


def test_nproc_is_checked(capfd, tmp_path):
    tree = _tree(tmp_path, 16, patched=True)
    code, err = _run(["--nproc", "0", *MODEL], capfd, MEGATRON_LM_DIR=str(tree))
    assert code == 1 and "--nproc 0: give at least 1 rank" in err, err
    code, err = _run(["--nproc", "2", *MODEL], capfd, MEGATRON_LM_DIR=str(tree), RANK="0", WORLD_SIZE="2")
    assert code == 1 and "--nproc 2 under torchrun" in err, err


def test_the_ranks_start_on_this_host_with_the_plans_world_size(tmp_path):
    from megatron_hetermoe.megatron_lm.pretrain import launch_command
    from megatron_hetermoe.plan.hetero_plan import even_plan

    even_plan(2, 4, 1, 1, groups=2).save(tmp_path / "plan.json")
    from megatron_hetermoe.megatron_lm.pretrain import _plan_world

    assert _plan_world(["--lr", "1", "--hetero-plan", str(tmp_path / "plan.json")]) == 4
    assert _plan_world(["--lr", "1"]) is None
    cmd = launch_command(["--lr", "1"], 4, ("wheel", None))
    assert cmd[1:5] == ["-m", "torch.distributed.run", "--nproc-per-node", "4"]
    assert cmd[-4:] == ["-m", "megatron_hetermoe.megatron_lm.pretrain", "--lr", "1"]
    cmd = launch_command([], 2, ("checkout", tmp_path))
    assert cmd[-1] == str(tmp_path / "pretrain_gpt.py")


@pytest.mark.slow
def test_with_a_patched_checkout_it_runs_megatron_lms_pretrain(mlm, data, tmp_path):
    """MEGATRON_LM_DIR names a patched checkout: `hetermoe pretrain` starts the plan's 2 ranks on
    that checkout's pretrain_gpt.py (Megatron-LM's pretrain() with HeterMoE's hooks)."""
    if compat.mcore_version()[:2] != (0, 16):
        pytest.skip("the core_v0.16.1 checkout needs megatron-core 0.16.x")
    from megatron_hetermoe.plan.hetero_plan import even_plan

    plan = tmp_path / "plan.json"
    even_plan(2, 4, 1, 1, num_microbatches=4).save(plan)  # global batch 8 = 2 x 4 microbatches x 1
    r = subprocess.run([sys.executable, "-W", "ignore", "-m", "megatron_hetermoe.cli", "pretrain", *MODEL, *BATCH,
                        *DATA, *RECIPE, *CPU, "--data-path", data, "--log-interval", "1", "--eval-interval", "100",
                        "--eval-iters", "0",
                        "--hetero-plan", str(plan)],
                       cwd=tmp_path, env={**env(), "MEGATRON_LM_DIR": str(mlm)}, capture_output=True, text=True,
                       timeout=600)
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-4000:]
    assert "1 attention ranks (Megatron's data parallel size) + 1 expert ranks" in log, log[-3000:]
    assert sorted(int(i) for i, _ in ITERATION.findall(log)) == [1, 2, 3], log[-3000:]


def test_slurm_entry_runs_hetermoe_pretrains_ranks(tmp_path, capsys):
    """scripts/slurm's --entry megatron-core: every task runs `python -m megatron_hetermoe.megatron_lm.pretrain`
    (megatron-core >= 0.19's pretrain(), no checkout); the flags are checked with megatron-core's own
    parser before the job is written, and a host without it says so."""
    from megatron_hetermoe.plan.hetero_plan import even_plan
    from megatron_hetermoe.tools import slurm

    plan = tmp_path / "plan.json"
    even_plan(2, 4, 1, 1, groups=2, attention_gpu="A40", expert_gpu="V100-32GB").save(plan)
    base = ["--plan", str(plan), "--gpus-per-node", "8", "--entry", "megatron-core", "--tasks", "--"]
    code = slurm.main([*base, *MODEL, "--lr", "1e-3"])
    out, err = capsys.readouterr()
    if compat.mcore_version()[:2] < (0, 19):
        assert code == 2 and "megatron-core 0.16" in err and "has no megatron.training to check the flags" in err, err
        return
    assert code == 0, err
    tasks = out.strip().splitlines()
    assert len(tasks) == 4 and all(f"-m megatron_hetermoe.megatron_lm.pretrain {' '.join(MODEL)} --lr 1e-3 "
                                   f"--hetero-plan {plan}" in t for t in tasks), tasks
    assert slurm.main([*base, *MODEL, "--frobnicate"]) == 2
    major, minor = compat.mcore_version()[:2]
    assert f"flag(s) --frobnicate: not flags of megatron-core {major}.{minor}" in capsys.readouterr().err
    assert slurm.main([*base, "--num-layers", "two"]) == 2
    assert "argument --num-layers: invalid int value: 'two'" in capsys.readouterr().err
