"""patches/: the Megatron-LM pretrain_gpt.py patches (core_v0.16.1, core_v0.19.0) and the hook
module they call. Tests against a real checkout run when MEGATRON_LM_DIR names one (a work tree
at core_v0.16.1 or core_v0.19.0); those that import Megatron-LM's training side also need its
extra packages (six, regex, pydantic, ...) and skip, naming the one missing, without them."""
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

from megatron_hetermoe import compat, megatron_lm
from megatron_hetermoe.cli.hetero import HETERO_FLAGS
from megatron_hetermoe.training.pretrain_gpt import (
    EXTENSION_FLAGS,
    build_parser,
    megatron_flags,
)

ROOT = Path(__file__).resolve().parents[2]
PATCH_DIR = ROOT / "patches"
PATCH_FILES = sorted(PATCH_DIR.glob("*.patch"))


def test_every_patch_is_known_and_named_for_its_release():
    assert {p.name for p in PATCH_FILES} == set(megatron_lm.PATCHES.values())
    for (major, minor), name in megatron_lm.PATCHES.items():
        assert name.startswith(f"megatron-lm-core_v{major}.{minor}.") and name.endswith("-pretrain_gpt.patch")


@pytest.mark.parametrize("patch", PATCH_FILES, ids=lambda p: p.name)
def test_patch_touches_only_pretrain_gpt_and_calls_real_hooks(patch):
    text = patch.read_text()
    assert re.findall(r"^\+\+\+ b/(\S+)$", text, re.M) == ["pretrain_gpt.py"]
    added = "\n".join(line[1:] for line in text.splitlines() if line.startswith("+") and not line.startswith("+++"))
    imported = re.findall(r"from megatron_hetermoe\.megatron_lm import ([\w, ]+)", added)
    names = {n.strip() for group in imported for n in group.split(",")}
    assert all(callable(getattr(megatron_lm, n)) for n in names)
    assert "extra_args_provider=extra_args_provider" in added
    # Every release line: Megatron-LM's own pretrain() runs, with the plugin's hooks and model
    # builder (a plain run with the CPU layer on a host without CUDA).
    assert names == {"hetero_requested", "hetero_pretrain", "add_hetero_args", "megatron_on_cpu"}
    assert "pretrain, builder = hetero_pretrain(pretrain, sys.argv[1:])" in added
    assert "pretrain = megatron_on_cpu(pretrain)" in added
    assert "partial(model_provider, builder)" in added
    if "core_v0.16" not in patch.name:
        # core_v0.19.0 (and main, 0.20 dev) parses and validates the flags before pretrain(): with validate_args' hook.
        assert "parse_and_validate_args = pretrain.parse_with_hooks(parse_and_validate_args)" in added
        assert text.index("parse_with_hooks") < text.index("args = parse_and_validate_args(")


def test_hetero_flags_same_on_both_sides():
    """The flags the patch adds to Megatron-LM's parser are pretrain_gpt's own and clash with none of Megatron-LM's."""
    import argparse

    p = megatron_lm.add_hetero_args(argparse.ArgumentParser())
    added = {s for a in p._actions for s in a.option_strings if s.startswith("--") and s != "--help"}
    assert added == set(HETERO_FLAGS)
    ours = {s for a in build_parser()._actions for s in a.option_strings}
    assert added <= ours and added <= EXTENSION_FLAGS and not added & megatron_flags()
    assert megatron_lm.hetero_requested(["--num-layers", "2", "--hetero-plan", "p.json"])
    assert megatron_lm.hetero_requested(["--hetero-plan=p.json"])
    assert not megatron_lm.hetero_requested(["--num-layers", "2", "--hetero-schedule", "zebra"])
    assert not megatron_lm.hetero_requested(["--hetero-pla", "p.json"])  # no abbreviations


def test_patch_for_reads_the_checkout_version(tmp_path):
    info = tmp_path / "megatron" / "core"
    info.mkdir(parents=True)
    for version, want in (((0, 16, 1), "core_v0.16.1"), ((0, 19, 1), "core_v0.19.0"), ((0, 19, 2), "core_v0.19.0"),
                          ((0, 20, 0), "core_v0.20.0")):
        (info / "package_info.py").write_text("MAJOR = {}\nMINOR = {}\nPATCH = {}\nPRE_RELEASE = ''\n".format(*version))
        assert megatron_lm.checkout_version(tmp_path) == version
        assert want in megatron_lm.patch_for(tmp_path)
    (info / "package_info.py").write_text("MAJOR = 0\nMINOR = 14\nPATCH = 0\n")
    with pytest.raises(ValueError, match=r"no patch for Megatron-LM core_v0\.14\.0 .* "
                                         r"core_v0\.16\.x, core_v0\.19\.x, core_v0\.20\.x"):
        megatron_lm.patch_for(tmp_path)
    with pytest.raises(ValueError, match="no megatron/core/package_info.py"):
        megatron_lm.patch_for(tmp_path / "nowhere")


def _checkout() -> Path:
    src = os.environ.get("MEGATRON_LM_DIR")
    if not src:
        pytest.skip("set MEGATRON_LM_DIR to a Megatron-LM work tree (core_v0.16.1 or core_v0.19.0) to check the patch "
                    "against it")
    return Path(src)


def _patched_copy(checkout: Path, work: Path) -> Path:
    """The checkout, linked entry by entry, with a patched pretrain_gpt.py."""
    work.mkdir()
    for entry in checkout.iterdir():
        if entry.name not in (".git", "pretrain_gpt.py"):
            (work / entry.name).symlink_to(entry)
    shutil.copy(checkout / "pretrain_gpt.py", work / "pretrain_gpt.py")
    subprocess.run(["git", "apply", str(PATCH_DIR / megatron_lm.patch_for(checkout))], cwd=work, check=True)
    return work


def _same_release_line(checkout: Path) -> None:
    """A run from the checkout imports the checkout's megatron/ (it is first on sys.path), so the
    interpreter must suit that release: 0.17+ need Python 3.12 (make compat makes such a venv)."""
    want, have = megatron_lm.checkout_version(checkout)[:2], compat.mcore_version()[:2]
    if want != have:
        pytest.skip(f"the checkout is megatron-core {want[0]}.{want[1]}, this environment has {have[0]}.{have[1]}: "
                    f"run with the environment of the checkout's release (make compat for 0.19)")


def test_patch_applies_and_compiles(tmp_path):
    checkout = _checkout()
    name = megatron_lm.patch_for(checkout)
    r = subprocess.run(["bash", str(PATCH_DIR / "check_patch.sh"), str(checkout)], capture_output=True, text=True)
    assert r.returncode == 0 and f"applies: {name}" in r.stdout and f"use: {name}" in r.stdout, r.stdout + r.stderr
    others = [p.name for p in PATCH_FILES if p.name != name]
    # core_v0.16.x has its own patch; core_v0.19.0's and main's (0.20 dev) differ by context offsets only (main
    # moved its warning filters above the hunks), so each of those two also applies to the other's tree.
    may_cross = set() if "core_v0.16" in name else {o for o in others if "core_v0.16" not in o}
    assert all(f"does not apply: {o}" in r.stdout for o in others if o not in may_cross), r.stdout
    work = tmp_path / "mlm"
    work.mkdir()
    shutil.copy(checkout / "pretrain_gpt.py", work / "pretrain_gpt.py")
    subprocess.run(["git", "apply", str(PATCH_DIR / name)], cwd=work, check=True)
    py_compile.compile(str(work / "pretrain_gpt.py"), doraise=True)


def test_check_patch_refuses_a_tree_without_pretrain_gpt(tmp_path):
    r = subprocess.run(["bash", str(PATCH_DIR / "check_patch.sh"), str(tmp_path)], capture_output=True, text=True)
    assert r.returncode == 2 and "has no pretrain_gpt.py" in r.stderr


_PARSE = """
import sys
sys.argv = ["pretrain_gpt.py", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
            "--hetero-plan", "plan.json", "--hetero-schedule", "zebra"]
try:
    import pretrain_gpt
    from megatron.training.arguments import parse_args
except ModuleNotFoundError as e:
    print("MISSING-PACKAGE", e.name)
    raise SystemExit(0)
args = parse_args(pretrain_gpt.extra_args_provider)
print("PARSED", args.hetero_plan, args.hetero_schedule, args.hetero_ckpt_reshard)
"""


def test_megatron_lm_parser_takes_hetero_flags(tmp_path):
    """Megatron-LM's own parser, extended by the patched pretrain_gpt.py's extra_args_provider."""
    checkout = _checkout()
    _same_release_line(checkout)
    work = _patched_copy(checkout, tmp_path / "mlm")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        [str(work), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    r = subprocess.run([sys.executable, "-W", "ignore", "-c", _PARSE], cwd=work, env=env, capture_output=True,
                       text=True, timeout=300)
    missing = re.search(r"^MISSING-PACKAGE (\S+)", r.stdout, re.M)
    if missing:
        pytest.skip(f"importing Megatron-LM's pretrain_gpt.py needs the package {missing.group(1)!r} (Megatron-LM's "
                    f"own requirements, not megatron-core's): pip install --target DEPS six regex pydantic ..., "
                    f"then PYTHONPATH=DEPS")
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert "PARSED plan.json zebra False" in r.stdout, (r.stdout + r.stderr)[-3000:]


@pytest.mark.slow
def test_patched_pretrain_gpt_trains_with_hetero_plan(tmp_path):
    """Megatron-LM's patched pretrain_gpt.py runs its own pretrain() with --hetero-plan (under
    torchrun, CPU ranks, a 1+1 plan, mock data), on the checkout's release line (the losses against
    the plugin's trainer: test_megatron_lm_pretrain.py for core_v0.16.1, test_megatron_lm_v019.py
    for core_v0.19.0)."""
    checkout = _checkout()
    _same_release_line(checkout)
    work = tmp_path / "mlm"
    work.mkdir()
    for entry in checkout.iterdir():
        if entry.name not in (".git", "pretrain_gpt.py", "megatron"):
            (work / entry.name).symlink_to(entry)
    # A copy of megatron/: Megatron-LM compiles its dataset helpers into megatron/core/datasets/.
    shutil.copytree(checkout / "megatron", work / "megatron", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    shutil.copy(checkout / "pretrain_gpt.py", work / "pretrain_gpt.py")
    subprocess.run(["git", "apply", str(PATCH_DIR / megatron_lm.patch_for(checkout))], cwd=work, check=True)
    from megatron_hetermoe.plan.hetero_plan import even_plan

    even_plan(2, 4, 1, 1, num_microbatches=4).save(tmp_path / "plan.json")
    # Megatron-LM compiles its dataset helpers with `python3 -m pybind11` and `python3-config`.
    import sysconfig

    path = os.pathsep.join([str(Path(sys.executable).parent), sysconfig.get_config_var("BINDIR"), os.environ["PATH"]])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PATH": path, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = subprocess.run([sys.executable, "-W", "ignore", "-m", "torch.distributed.run", "--nproc-per-node", "2",
                        "--master-port", str(port), "pretrain_gpt.py", "--num-layers", "2", "--hidden-size", "64",
                        "--num-attention-heads", "4", "--ffn-hidden-size", "128", "--num-experts", "4",
                        "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
                        "--global-batch-size", "8", "--train-iters", "2", "--lr", "1e-3", "--eval-iters", "0",
                        "--eval-interval", "10",
                        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "257",
                        "--transformer-impl", "local", "--distributed-backend", "gloo", "--no-rope-fusion",
                        "--no-persist-layer-norm", "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion",
                        "--no-bias-swiglu-fusion", "--no-bias-dropout-fusion", "--no-bias-gelu-fusion",
                        "--log-interval", "1", "--hetero-plan", str(tmp_path / "plan.json")],
                       cwd=work, env=env, capture_output=True, text=True, timeout=300)
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-3000:]
    assert " iteration        2/       2 |" in log and "HeterMoE rank 1 (expert, ZP group 0" in log, log[-3000:]
