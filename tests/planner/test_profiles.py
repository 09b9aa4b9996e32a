"""GPU profiles: every shipped file loads, every number names its source, and the paper's
measured ratios come out of the cost model they were calibrated into."""
import pytest
import yaml

from megatron_hetermoe.config import ModelConfig
from megatron_hetermoe.paths import config_dir
from megatron_hetermoe.planner.cost_model import (
    CostModel,
    TrainSettings,
    attention_time_ratio,
)
from megatron_hetermoe.planner.gpu_profile import ProfileError
from megatron_hetermoe.planner.profiles import (
    SOURCE_TAGS,
    known_gpu_types,
    load_profile,
)

PAPER_TYPES = {"A40", "V100-16GB", "V100-32GB", "L40S", "T4", "A100-80GB", "H100", "H200", "cpu"}


def test_known_types_cover_the_brief():
    assert PAPER_TYPES <= set(known_gpu_types())


@pytest.mark.parametrize("name", sorted(PAPER_TYPES))
def test_every_number_has_a_tagged_source(name):
    p = load_profile(name)
    for field in ("memory_gib", "peak_fp16_tflops", "memory_bandwidth_gbs", "gemm_efficiency",
                  "attention_core_efficiency", "intra_node_gbs", "launch_overhead_us", "link_latency_us"):
        assert p.source(field).split(":")[0] in SOURCE_TAGS, (name, field, p.source(field))
    assert p.memory_gib > 0 and p.peak_fp16_tflops > 0 and 0 < p.gemm_efficiency <= 1


def test_v100_expert_ratio_is_the_papers_80_percent():
    m = ModelConfig.load("d1")
    cm = CostModel(m, {n: load_profile(n) for n in ("A40", "V100-16GB")}, TrainSettings(4096, False))
    tokens = 1 << 16  # compute-bound, where the ratio was stated
    r = cm.expert_time("V100-16GB", tokens) / cm.expert_time("A40", tokens)
    assert r == pytest.approx(1.25, rel=0.02)
    assert load_profile("V100-16GB").source("gemm_efficiency").startswith("paper-ratio")


def test_attention_ratios_grow_with_sequence_length():
    v, a, t, l = (load_profile(n) for n in ("V100-16GB", "A40", "T4", "L40S"))
    assert attention_time_ratio(v, a, 65536) == pytest.approx(3.7, rel=1e-3)  # calibrated
    assert attention_time_ratio(t, l, 65536) == pytest.approx(13.6, rel=1e-3)  # calibrated
    assert attention_time_ratio(v, a, 4096) < attention_time_ratio(v, a, 16384) < 3.7
    # not used in calibration: the paper measured 9.9x at 4K; the model predicts it within 20%
    assert attention_time_ratio(t, l, 4096) == pytest.approx(9.9, rel=0.2)


def test_bad_profile_names_the_field(tmp_path):
    bad = tmp_path / "x.yaml"
    bad.write_text(yaml.safe_dump({"name": "X", "fp16": True, "bf16": True, "flash_attention": True,
                                   "memory_gib": {"value": 16, "source": "guess"}}))
    with pytest.raises(ProfileError, match="memory_gib"):
        load_profile(str(bad))


def test_cpu_profile_is_measured_and_exact_at_its_samples():
    p = load_profile("cpu")
    assert p.measured is not None and p.source("memory_gib").startswith("measured")
    m = ModelConfig(**p.measured.model)
    cm = CostModel(m, {"cpu": p}, TrainSettings(m.seq_length, activation_checkpointing=False))
    for e in p.measured.expert:
        assert cm.expert_time("cpu", e.tokens) == pytest.approx(e.fwd_s, rel=1e-9)
        assert cm.expert_time("cpu", e.tokens, backward=True) == pytest.approx(e.bwd_s, rel=1e-9)
    a = p.measured.attention[-1]
    t = cm.attention_time("cpu", a.tokens, False, a.seq_len)
    assert t >= a.fwd_s and t == pytest.approx(a.fwd_s, rel=0.05)  # + elementwise traffic only


def test_cluster_configs_load():
    from megatron_hetermoe.planner.cluster import Cluster

    names = {p.stem for p in (config_dir() / "clusters").glob("*.yaml")}
    assert {"o1", "o2", "o3", "c1", "c2", "c1-200g", "c2-200g", "mixed-h100-a100"} <= names
    o1 = Cluster.load("o1")
    assert o1.counts() == {"A40": 6, "V100-16GB": 6}
    assert Cluster.load("c2").counts() == {"L40S": 2, "T4": 8}
    assert Cluster.load("mixed-h100-a100").counts() == {"H100": 64, "A100-80GB": 128}
    assert Cluster.load("c1").nic_gbs()[0] * 8 == 20 and Cluster.load("c1-200g").nic_gbs()[0] * 8 == 200
    known = set(known_gpu_types())
    for n in names:
        assert set(Cluster.load(n).counts()) <= known
