"""`hetermoe profile` on this machine's CPU: writes a profile that loads and that the cost model
reproduces. Runs in a subprocess (it initializes torch.distributed)."""
import os
import subprocess
import sys

from megatron_hetermoe.config import ModelConfig
from megatron_hetermoe.planner.cost_model import CostModel, TrainSettings
from megatron_hetermoe.planner.profiles import load_profile


def test_profile_cpu_tiny(tmp_path):
    out = tmp_path / "cpu.yaml"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "megatron_hetermoe.cli", "profile", "--model", "tiny", "--out", str(out),
                        "--name", "cpu-test", "--seq-lens", "16,32", "--seqs", "1,2", "--expert-tokens", "16,64",
                        "--repeats", "2", "--a2a-bytes", "4096,65536"],
                       capture_output=True, text=True, env=env, timeout=240)
    assert r.returncode == 0, r.stderr[-2000:]
    p = load_profile(str(out))
    assert p.name == "cpu-test" and p.measured is not None
    assert len(p.measured.attention) == 4 and len(p.measured.expert) == 2 and len(p.measured.all_to_all) == 2
    assert p.measured.info["expert_params_match_model_config"] is True
    assert p.source("peak_fp16_tflops").startswith("measured")
    m = ModelConfig(**p.measured.model)
    cm = CostModel(m, {p.name: p}, TrainSettings(32, activation_checkpointing=False))
    e = p.measured.expert[-1]
    assert abs(cm.expert_time(p.name, e.tokens) - e.fwd_s) <= 1e-9 * e.fwd_s
