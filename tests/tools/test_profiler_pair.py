"""`hetermoe profile --gpu-pair`: the all-to-all between two ranks. Without two GPUs it runs two
CPU processes over gloo, and every number says it is a CPU/gloo number; the file loads back as a
link profile with the runtime's precision."""
import os
import subprocess
import sys

import pytest

from megatron_hetermoe.planner.cost_model import runtime_program
from megatron_hetermoe.planner.gpu_profile import ProfileError
from megatron_hetermoe.planner.profiles import load_link_profile
from megatron_hetermoe.tools.profiler import _fit_link


@pytest.mark.slow
def test_gpu_pair_on_cpu_is_two_gloo_ranks_and_says_so(tmp_path):
    out = tmp_path / "link.yaml"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "megatron_hetermoe.cli", "profile", "--gpu-pair", "--out", str(out),
                        "--repeats", "2", "--a2a-bytes", "4096,262144,2097152"],
                       capture_output=True, text=True, env=env, timeout=240)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "CPU/gloo" in r.stdout
    link = load_link_profile(out)
    if link.backend == "gloo":  # no two GPUs here
        assert link.is_cpu and link.devices == ("cpu", "cpu")
        for key in ("link_latency_us", "intra_node_gbs"):
            assert link.sources[key].startswith("measured") and "CPU/gloo" in link.sources[key]
    assert link.precision == runtime_program().precision
    assert link.intra_node_gbs > 0 and link.link_latency_us >= 0
    assert [row["nbytes"] for row in link.all_to_all] == [4096, 262144, 2097152]


def test_link_fit_recovers_latency_and_bandwidth():
    rows = [{"peer_bytes": b, "seconds": 20e-6 + b / 5e9} for b in (1e3, 1e5, 1e6, 1e7)]
    lat, bw = _fit_link(rows)
    assert lat == pytest.approx(20e-6, rel=1e-6) and bw == pytest.approx(5e9, rel=1e-6)


def test_link_profile_refuses_unsourced_or_unlabelled_numbers(tmp_path):
    bad = tmp_path / "link.yaml"
    bad.write_text("kind: gpu-pair\ndevices: [cpu, cpu]\nbackend: gloo\nprecision: fp32\n"
                   "link_latency_us: {value: 100, source: 'measured: x'}\n"
                   "intra_node_gbs: {value: 1, source: 'measured: two processes'}\n"
                   "all_to_all: [{nbytes: 8, peer_bytes: 4, seconds: 0.001}]\n")
    with pytest.raises(ProfileError, match="CPU/gloo"):
        load_link_profile(bad)
    bad.write_text(bad.read_text().replace("kind: gpu-pair", "kind: gpu"))
    with pytest.raises(ProfileError, match="gpu-pair"):
        load_link_profile(bad)
