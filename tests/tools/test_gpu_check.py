"""scripts/gpu_check.sh --dry-run: every CPU-capable step runs at tiny sizes and nothing FAILs;
the check (scripts/gpu_check/) is a harness beside the package, not in it."""
import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_gpu_check_dry_run(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable, OMP_NUM_THREADS="1")
    p = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), "--dry-run"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=400)
    log = (tmp_path / "gpu_check.log").read_text()
    assert p.returncode == 0, log[-4000:] + p.stderr[-2000:]
    summary = log[log.index(" SUMMARY "):]
    lines = [ln for ln in summary.splitlines() if ln.startswith("step ")]
    assert len(lines) == 7, summary
    assert not [ln for ln in lines if " FAIL " in ln], summary
    assert "overall: PASS" in summary
    res = json.loads((tmp_path / "gpu_check.json").read_text())
    status = {int(k): v["status"] for k, v in res["steps"].items()}
    assert status == {1: "PASS", 2: "PASS", 3: "PASS", 4: "PASS", 5: "SKIP", 6: "PASS", 7: "PASS"}, summary
    assert res["dry_run"] and not res["gpu"]
    # the CPU references produced finite per-step losses, and the three 1-rank runs agree
    losses = res["steps"]["2"]["data"]["losses"]
    ep = losses["ep"]["cpu"]
    assert len(ep) == 4
    for name in ("distep", "zebra", "zebra-threads"):
        assert max(abs(a - b) / abs(b) for a, b in zip(losses[name]["cpu"], ep)) < 1e-4
    for name in ("zebra-bf16", "zebra-fp16"):  # the same training in 16 bit: close to fp32, not equal
        assert len(losses[name]["cpu"]) == 4 and losses[name]["cpu"] != ep
        assert max(abs(a - b) / abs(b) for a, b in zip(losses[name]["cpu"], ep)) < 2e-3  # measured 1.7e-4
    assert (tmp_path / "profile_cpu_tiny.yaml").exists()


def test_the_package_does_not_import_the_harness():
    pkg = REPO / "megatron_hetermoe"
    assert not list(pkg.rglob("gpu_check*.py"))
    imports = []
    for path in pkg.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                imports += [(path, a.name) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                imports += [(path, f"{node.module or ''}.{a.name}") for a in node.names]
    assert not [(p, n) for p, n in imports if "gpu_check" in n]
