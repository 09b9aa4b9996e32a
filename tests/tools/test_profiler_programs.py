"""Which program a time is for: the cost model prices one program (precision, attention kernel,
recompute), a runtime runs one, and both are named; a profile that cannot price a program says
so instead of pricing another one."""
import pytest

from megatron_hetermoe.config import ModelConfig
from megatron_hetermoe.planner.cost_model import (
    PAPER_PROGRAM,
    CostModel,
    Program,
    ProgramError,
    TrainSettings,
    runtime_program,
)
from megatron_hetermoe.planner.profiles import load_profile, load_profiles


def _cost(program=None, gpus=("A40", "V100-16GB"), model="w1", seq=4096):
    return CostModel(ModelConfig.load(model), load_profiles(set(gpus)), TrainSettings(seq, program=program))


def test_default_prices_each_profile_as_it_was_made():
    cm = _cost()
    assert cm.program_of("A40") == PAPER_PROGRAM and cm.program_of("V100-16GB") == PAPER_PROGRAM
    cpu = CostModel(ModelConfig.load("tiny"), {"cpu": load_profile("cpu")}, TrainSettings(32, False))
    p = cpu.program_of("cpu")
    assert (p.precision, p.attention, p.recompute) == ("fp32", "unfused", "none")  # what `hetermoe profile` ran
    assert "fp32" in cpu.programs()["cpu"]


def test_the_runtime_program_is_what_the_trainers_build():
    import torch

    from megatron_hetermoe.config import ParallelConfig
    from megatron_hetermoe.models.builder import transformer_config

    p = runtime_program()
    cfg = transformer_config(ModelConfig.load("tiny"), ParallelConfig())
    assert p.precision == "fp32" and cfg.params_dtype == torch.float32 and not cfg.bf16 and not cfg.fp16
    assert p.attention == "unfused" and p.recompute == "none" and runtime_program(recompute=True).recompute == "full"


def test_an_explicit_program_sets_bytes_and_recompute_and_changes_the_time():
    fp16 = _cost(PAPER_PROGRAM)
    assert fp16.settings.dtype_bytes == 2 and fp16.settings.activation_checkpointing
    fp32 = _cost(Program("fp32", "fused", "full"))
    assert fp32.settings.dtype_bytes == 4
    # fp32 runs on the fp32 peak (A40: 37.4 vs 149.7 TFLOPS): a compute-bound expert is ~4x slower
    r = fp32.expert_time("A40", 1 << 16) / fp16.expert_time("A40", 1 << 16)
    assert 3.0 < r < 4.5
    unfused = _cost(Program("fp16", "unfused", "full"))
    assert unfused.attention_time("A40", 4096) > fp16.attention_time("A40", 4096)
    assert unfused.attention_rank_bytes(4096, 1) >= fp16.attention_rank_bytes(4096, 1)


def test_a_profile_that_cannot_price_the_program_says_so():
    with pytest.raises(ProgramError, match="bf16"):
        _cost(Program("bf16", "fused", "full"))  # V100 has no bf16
    with pytest.raises(ProgramError, match="measured tables for fp32 with unfused"):
        CostModel(ModelConfig.load("tiny"), {"cpu": load_profile("cpu")}, TrainSettings(32, program=PAPER_PROGRAM))
    with pytest.raises(ProgramError, match="precision"):
        Program("fp8")


def test_every_shipped_gpu_profile_prices_fp32_from_a_datasheet_peak():
    from megatron_hetermoe.planner.profiles import known_gpu_types

    for name in known_gpu_types():
        p = load_profile(name)
        if p.measured is None:
            assert p.peak_fp32_tflops > 0 and p.source("peak_fp32_tflops").startswith("datasheet"), name
            assert p.peak_fp32_tflops < p.peak_fp16_tflops, name


def test_the_emulator_names_both_programs():
    from megatron_hetermoe.config import EmulationSpec
    from megatron_hetermoe.emulation.emulator import Emulator

    pr = Emulator(EmulationSpec("mini-2a40-2v100", "w1", 4096, 16)).programs()
    assert set(pr["predicted_program"]) == {"A40", "V100-16GB"}
    assert all("fp16" in v and "fused attention" in v for v in pr["predicted_program"].values())
    assert pr["runtime_program"].startswith("fp32, unfused attention")
