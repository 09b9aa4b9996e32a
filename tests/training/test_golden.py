import json
import subprocess
import sys
from pathlib import Path

import pytest
from margins import within

from megatron_hetermoe.training.golden_values import (
    compare,
    read_golden,
    write_golden,
)

GOLDEN = Path(__file__).resolve().parents[1] / "golden_values" / "tiny_ep2_4ranks.json"
ARGS = ["--nproc", "4", "--expert-model-parallel-size", "2", "--train-iters", "10"]


def test_layout_is_megatrons(tmp_path):
    write_golden(tmp_path / "g.json", [3.0, 2.5])
    d = json.loads((tmp_path / "g.json").read_text())
    assert d == {"lm loss": {"start_step": 1, "end_step": 2, "step_interval": 1, "values": {"1": 3.0, "2": 2.5}}}
    assert read_golden(tmp_path / "g.json") == {1: 3.0, 2: 2.5}


def test_compare_rules():
    g = {1: 2.0, 2: 1.0}
    assert compare(g, [2.0, 1.0], 0.05, exact=True) == []
    assert compare(g, [2.09, 1.04], 0.05, exact=False) == []
    assert len(compare(g, [2.11, 1.0], 0.05, exact=False)) == 1
    assert len(compare(g, [2.0, 1.0 + 1e-7], 0.05, exact=True)) == 1
    assert compare(g, [2.0], 0.05, exact=False)[0].startswith("run has steps 1..1 but golden values cover steps 1..2")
    # A resumed run's losses start past step 1 and compare with the golden values of their own steps.
    assert compare({4: 2.0, 5: 1.0}, [2.0, 1.0], 0.05, exact=True, start_step=4) == []
    assert len(compare({4: 2.0, 5: 1.0}, [2.0, 1.0], 0.05, exact=True)) == 1
    assert len(compare(g, [float("nan"), 1.0], 0.05, exact=False)) == 1


def _regress(*args):
    return subprocess.run([sys.executable, "-W", "ignore", "-m", "megatron_hetermoe.cli", "regress", *args],
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_regress_passes_on_shipped_golden_values():
    import re

    r = _regress("--golden", str(GOLDEN), "--", *ARGS)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "OK: 10 steps match (rtol 0.05" in r.stdout
    # Measured worst over ATEN_CPU_CAPABILITY default/avx2/avx512: 5.2e-4 (96x inside 0.05).
    worst = float(re.search(r"max rel diff ([0-9.e+-]+)", r.stdout).group(1))
    within("golden lm loss", worst, 0.05)


@pytest.mark.slow
def test_regress_fails_when_loss_changes(tmp_path):
    g = tmp_path / "g.json"
    base = ["--nproc", "2", "--train-iters", "3", "--deterministic-mode"]
    assert _regress("--golden", str(g), "--update", "--", *base).returncode == 0
    same = _regress("--golden", str(g), "--", *base)
    assert same.returncode == 0, same.stdout + same.stderr
    other = _regress("--golden", str(g), "--", *base, "--seed", "7")
    assert other.returncode == 1 and "REGRESSION" in other.stdout, other.stdout + other.stderr
