"""Cost model: FLOP scaling to other shapes, checkpointing, stages, transfer model."""
import pytest

from megatron_hetermoe.config import ModelConfig
from megatron_hetermoe.planner.cluster import (
    Cluster,
    Links,
    collective_time,
    rank1_collective_time,
    transfer_time,
)
from megatron_hetermoe.planner.cost_model import CostModel, TrainSettings, expert_flops
from megatron_hetermoe.planner.profiles import load_profile, load_profiles


def cm(model="d1", seq=4096, ckpt=True, gpus=("A40", "V100-16GB", "cpu")):
    return CostModel(ModelConfig.load(model), load_profiles(gpus), TrainSettings(seq, ckpt))


def test_measured_profile_scales_by_flops_to_any_shape():
    p = load_profile("cpu")
    small = ModelConfig(**p.measured.model)
    big = small.replace(hidden_size=2 * small.hidden_size, moe_ffn_hidden_size=3 * small.moe_ffn_hidden_size)
    a = CostModel(small, {"cpu": p}, TrainSettings(32, False)).expert_time("cpu", 128)
    b = CostModel(big, {"cpu": p}, TrainSettings(32, False)).expert_time("cpu", 128)
    assert b / a == pytest.approx(expert_flops(big, 128) / expert_flops(small, 128), rel=1e-9)


def test_checkpointing_adds_one_forward_to_backward():
    on, off = cm(ckpt=True), cm(ckpt=False)
    for g in ("A40", "V100-16GB"):
        assert on.expert_time(g, 5000, True) == pytest.approx(off.expert_time(g, 5000, True) + off.expert_time(g, 5000))
        assert on.attention_time(g, 8192, True) == pytest.approx(off.attention_time(g, 8192, True)
                                                                 + off.attention_time(g, 8192))


def test_times_grow_with_tokens_and_seq_len():
    c = cm()
    for g in ("A40", "V100-16GB", "cpu"):
        ts = [c.expert_time(g, t) for t in (64, 256, 1024, 4096, 16384)]
        assert ts == sorted(ts) and ts[0] > 0
        assert c.attention_time(g, 16384, seq_len=16384) > c.attention_time(g, 16384, seq_len=1024)


def test_stages():
    c = cm()
    L = c.model.num_layers
    mid = c.stage_time("A40", 1, 4096)
    assert c.stage_time("A40", 3, 4096) == mid
    assert c.stage_time("A40", L, 4096) != mid  # output head + loss
    with pytest.raises(ValueError, match="outside"):
        c.stage_time("A40", L + 1, 4096)
    with pytest.raises(KeyError, match="no profile"):
        c.expert_time("H100", 10)


def test_transfer_model():
    cl = Cluster.load("o1")
    prof = load_profiles(set(cl.gpu_types()))
    # A40 rank 0 -> V100 rank 6: other node, 100 Gbps NIC
    t = transfer_time(cl, prof, 0, 6, 125e6)
    assert t == pytest.approx(125e6 / 12.5e9 + Links.for_ranks(cl, [0, 6], prof).latency_s)
    # rank-1 shortcut equals the full byte matrix
    ranks = [0, 1, 6, 7, 8]
    links = Links.for_ranks(cl, ranks, prof)
    s, w = [3.0, 1.0, 0.0, 0.0, 2.0], [0.0, 0.5, 0.25, 0.25, 0.0]
    full = [[1e6 * s[i] * w[j] for j in range(5)] for i in range(5)]
    assert rank1_collective_time(links, s, w, 1e6) == pytest.approx(collective_time(links, full))
