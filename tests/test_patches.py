"""patches/: the Megatron-LM pretrain_gpt.py patch and the hook module it calls."""
from __future__ import annotations

import os
import py_compile
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_hetermoe import megatron_lm
from megatron_hetermoe.pretrain_gpt import EXTENSION_FLAGS, build_parser, megatron_flags

ROOT = Path(__file__).resolve().parent.parent
PATCH = ROOT / "patches" / "megatron-lm-core_v0.16.1-pretrain_gpt.patch"


def test_patch_touches_only_pretrain_gpt_and_calls_real_hooks():
    text = PATCH.read_text()
    assert re.findall(r"^\+\+\+ b/(\S+)$", text, re.M) == ["pretrain_gpt.py"]
    added = "\n".join(line[1:] for line in text.splitlines() if line.startswith("+") and not line.startswith("+++"))
    imported = re.findall(r"from megatron_hetermoe\.megatron_lm import ([\w, ]+)", added)
    names = {n.strip() for group in imported for n in group.split(",")}
    assert names == {"hetero_requested", "run_hetero", "add_hetero_args"}
    assert all(callable(getattr(megatron_lm, n)) for n in names)
    assert "extra_args_provider=extra_args_provider" in added


def test_hetero_flags_same_on_both_sides():
    """The flags the patch adds to Megatron-LM's parser are pretrain_gpt's own and clash with none of Megatron-LM's."""
    import argparse

    p = megatron_lm.add_hetero_args(argparse.ArgumentParser())
    added = {s for a in p._actions for s in a.option_strings if s.startswith("--") and s != "--help"}
    assert added == set(megatron_lm.HETERO_FLAGS)
    ours = {s for a in build_parser()._actions for s in a.option_strings}
    assert added <= ours and added <= EXTENSION_FLAGS and not added & megatron_flags()
    assert megatron_lm.hetero_requested(["--num-layers", "2", "--hetero-plan", "p.json"])
    assert megatron_lm.hetero_requested(["--hetero-plan=p.json"])
    assert not megatron_lm.hetero_requested(["--num-layers", "2", "--hetero-schedule", "zebra"])
    assert not megatron_lm.hetero_requested(["--hetero-pla", "p.json"])  # no abbreviations


def _checkout() -> Path:
    src = os.environ.get("MEGATRON_LM_DIR")
    if not src:
        pytest.skip("set MEGATRON_LM_DIR to a Megatron-LM core_v0.16.1 work tree to check the patch against it")
    return Path(src)


def test_patch_applies_and_compiles(tmp_path):
    checkout = _checkout()
    r = subprocess.run(["bash", str(ROOT / "patches" / "check_patch.sh"), str(checkout)], capture_output=True, text=True)
    assert r.returncode == 0 and "applies: megatron-lm-core_v0.16.1-pretrain_gpt.patch" in r.stdout, r.stdout + r.stderr
    work = tmp_path / "mlm"
    work.mkdir()
    shutil.copy(checkout / "pretrain_gpt.py", work / "pretrain_gpt.py")
    subprocess.run(["git", "apply", str(PATCH)], cwd=work, check=True)
    py_compile.compile(str(work / "pretrain_gpt.py"), doraise=True)


@pytest.mark.slow
def test_patched_pretrain_gpt_trains_with_hetero_plan(tmp_path):
    """Megatron-LM's patched pretrain_gpt.py under torchrun, CPU ranks, a 1+1 plan."""
    checkout = _checkout()
    work = tmp_path / "mlm"  # the checkout, linked entry by entry, with a patched pretrain_gpt.py
    work.mkdir()
    for entry in checkout.iterdir():
        if entry.name not in (".git", "pretrain_gpt.py"):
            (work / entry.name).symlink_to(entry)
    shutil.copy(checkout / "pretrain_gpt.py", work / "pretrain_gpt.py")
    subprocess.run(["git", "apply", str(PATCH)], cwd=work, check=True)
    from megatron_hetermoe.plan import even_plan

    even_plan(2, 4, 1, 1, num_microbatches=4).save(tmp_path / "plan.json")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port),
                        "pretrain_gpt.py", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                        "--ffn-hidden-size", "128", "--num-experts", "4", "--seq-length", "32",
                        "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
                        "--train-iters", "2", "--mock-data", "--vocab-size", "256",
                        "--hetero-plan", str(tmp_path / "plan.json")],
                       cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert " iteration        2/       2 |" in r.stdout and "rank 1 (expert)" in r.stdout
