"""`hetermoe bench --layer`: both layers timed in one process, the ratio with its quartiles and each
layer's host reads printed (run as a user runs it: the console script, its own process)."""
import os
import re
import subprocess
import sys


def test_layer_bench_prints_both_layers_and_their_ratio():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-m", "megatron_hetermoe.cli", "bench", "--layer", "--model", "tiny",
                          "--tokens", "32", "--repeats", "4"], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    times = {m[0]: (float(m[1]), int(m[2])) for m in
             re.findall(r"(megatron MoELayer|HeteroMoELayer)\s+([\d.]+) ms\s+host reads per forward (\d+)", out.stdout)}
    assert set(times) == {"megatron MoELayer", "HeteroMoELayer"}, out.stdout
    assert all(t > 0 for t, _ in times.values()), out.stdout
    assert times["HeteroMoELayer"][1] <= times["megatron MoELayer"][1], out.stdout
    ratio = re.search(r"ratio HeterMoE / Megatron ([\d.]+) \(quartiles ([\d.]+) \.\. ([\d.]+)\)", out.stdout)
    assert ratio, out.stdout
    r, q1, q3 = map(float, ratio.groups())
    assert 0 < q1 <= r <= q3, out.stdout


def test_layer_bench_refuses_fewer_than_two_repeats():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-m", "megatron_hetermoe.cli", "bench", "--layer", "--repeats", "1"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode != 0 and "--repeats 1" in out.stderr, out.stderr[-2000:]
