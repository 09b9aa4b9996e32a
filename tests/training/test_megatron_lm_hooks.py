"""megatron_lm/ without a Megatron-LM checkout: the refusals and the hooks'
installation (the runs themselves: test_megatron_lm_pretrain.py, with MEGATRON_LM_DIR)."""
from __future__ import annotations

import argparse

import pytest

from megatron_hetermoe.megatron_lm import refusals
from megatron_hetermoe.megatron_lm.hooks import HeteroPretrain
from megatron_hetermoe.training.pretrain_gpt import megatron_flags


def _megatron_defaults(**given) -> argparse.Namespace:
    """The Megatron-LM core_v0.16.1 defaults of the attributes the refusals read."""
    a = dict(tensor_model_parallel_size=1, sequence_parallel=False, pipeline_model_parallel_size=1,
             context_parallel_size=1, expert_model_parallel_size=1, expert_tensor_parallel_size=None,
             num_experts=4, moe_layer_freq=1,
             mtp_num_layers=None, use_legacy_models=False, spec=None, heterogeneous_layers_config_path=None,
             experimental_attention_variant=None, moe_shared_expert_intermediate_size=None,
             moe_expert_capacity_factor=None, moe_permute_fusion=False, moe_enable_deepep=False,
             moe_apply_probs_on_input=False, overlap_moe_expert_parallel_comm=False, delay_wgrad_compute=False,
             moe_use_upcycling=False, use_torch_fsdp2=False, use_megatron_fsdp=False, overlap_grad_reduce=False,
             overlap_param_gather=False, recompute_granularity=None, moe_layer_recompute=False,
             calculate_per_token_loss=False, log_num_zeros_in_grad=False, fp16=False, bf16=False,
             ckpt_format="torch_dist", hetero_ckpt_reshard=False, add_bias_linear=False, yaml_cfg=None,
             embedding_init_method_std=None, apply_layernorm_1p=False, init_model_with_meta_device=False,
             data_parallel_random_init=False,
             moe_grouped_gemm=False, save=None, load=None, log_params_norm=False, log_max_attention_logit=False,
             qk_clip=False, transformer_impl="local", distributed_backend="gloo",
             use_distributed_optimizer=False)
    a.update(given)
    return argparse.Namespace(**a)


def test_every_refused_flag_is_a_megatron_lm_flag():
    known = megatron_flags() | {"--hetero-ckpt-reshard"}
    names = [flag for flags in refusals._REFUSED.values() for flag in flags]
    assert set(names) <= known, set(names) - known
    assert len(names) == len(set(names))


def test_megatron_defaults_are_not_refused():
    assert refusals.refusals(_megatron_defaults()) == []
    assert refusals.refusals(_megatron_defaults(use_distributed_optimizer=True)) == []  # supported
    assert refusals.refusals(_megatron_defaults(bf16=True)) == []
    assert refusals.refusals(_megatron_defaults(fp16=True)) == []


@pytest.mark.parametrize("given,expect", [
    ({"hierarchical_context_parallel_sizes": [2, 2]},
     "--hierarchical-context-parallel-sizes [2, 2]: HeterMoE's context parallelism is one flat group"),
    ({"pipeline_model_parallel_layout": "Et|tL"}, "--pipeline-model-parallel-layout 'Et|tL': the plan's pipeline "
                                                  "stages split the decoder layers evenly or by the first"),
    ({"num_experts": None}, "--num-experts: HeterMoE trains MoE models; give --num-experts"),
    ({"use_torch_fsdp2": True}, "--use-torch-fsdp2 True: not supported with HeterMoE"),
    ({"ckpt_format": "torch"},
     "--ckpt-format 'torch': HeterMoE checkpoints inside pretrain() are Megatron's torch_dist"),
    ({"moe_enable_deepep": True}, "--moe-enable-deepep True: HeterMoE's dispatcher replaces"),
    ({"data_parallel_random_init": True}, "--data-parallel-random-init True: HeterMoE initializes every parameter"),
    ({"non_persistent_ckpt_type": "local"}, "--non-persistent-ckpt-type 'local': Megatron's local checkpoints need"),
])
def test_each_refusal_names_flag_value_and_reason(given, expect):
    out = refusals.refusals(_megatron_defaults(**given))
    assert len(out) == 1 and out[0].startswith(expect), out


def test_grouped_experts_are_accepted_with_checkpoints():
    # their torch_dist layout is megatron-core's, renumbered to the plan (tests/checkpoint/test_grouped_experts.py)
    assert refusals.refusals(_megatron_defaults(moe_grouped_gemm=True)) == []
    assert refusals.refusals(_megatron_defaults(moe_grouped_gemm=True, save="/ckpt", load="/ckpt")) == []


def test_mtp_is_accepted_under_both_schedules():
    args = _megatron_defaults(mtp_num_layers=1)
    assert refusals.refusals(args) == []
    assert refusals.schedule_refusals(args, "distep") == [] and refusals.schedule_refusals(args, "zebra") == []


def test_flags_naming_what_hetermoe_replaces_are_accepted_with_a_note():
    """Issue 27 item 1: the dispatcher type (any value), the EP size and --moe-permute-fusion are no
    refusals; each given one gets a line and the value the run uses (Megatron's checks see that)."""
    from megatron_hetermoe.megatron_lm.replaced import replace_flags
    from megatron_hetermoe.plan.hetero_plan import even_plan

    plan = even_plan(2, 8, 2, 2, groups=2)
    for flags in ({"moe_token_dispatcher_type": "flex"}, {"expert_model_parallel_size": 8},
                  {"moe_permute_fusion": True}):
        assert refusals.refusals(_megatron_defaults(**flags)) == []
    args = _megatron_defaults(moe_token_dispatcher_type="flex", expert_model_parallel_size=8, moe_permute_fusion=True)
    notes = replace_flags(args, ["--moe-token-dispatcher-type", "flex", "--expert-model-parallel-size", "8",
                                 "--moe-permute-fusion"], plan)
    assert notes[0].startswith("--moe-token-dispatcher-type flex: replaced by HeterMoE's attention->expert dispatcher")
    assert notes[1] == ("--expert-model-parallel-size 8: the plan's placement wins: 8 experts a layer over each of 2 "
                        "ZP group(s) of 2+2 (attention + expert) ranks")
    assert notes[2].startswith("--moe-permute-fusion: megatron-core has no fused permute on this host")  # CPU
    assert (args.moe_token_dispatcher_type, args.expert_model_parallel_size, args.moe_permute_fusion) == \
        ("alltoall", 1, False)
    # Megatron's defaults, not given: nothing to say, nothing changed.
    args = _megatron_defaults(moe_token_dispatcher_type="allgather")
    assert replace_flags(args, ["--num-layers", "2"], plan) == [] and args.moe_token_dispatcher_type == "allgather"
    # Expert TP is the expert layout too: Megatron's default (the TP size) and any given value become
    # the plan's whole experts, with a line; at TP 1 and by default nothing is said.
    tp_plan = even_plan(2, 8, 2, 2, attention_tp=2)
    args = _megatron_defaults(tensor_model_parallel_size=2, sequence_parallel=True)
    notes = replace_flags(args, ["--tensor-model-parallel-size", "2"], tp_plan)
    assert notes == ["--expert-tensor-parallel-size 2 (Megatron's default: the TP size): the plan's expert ranks hold "
                     "whole experts (expert tensor parallelism 1); the plan's placement decides where they fit"]
    assert args.expert_tensor_parallel_size == 1
    args = _megatron_defaults(tensor_model_parallel_size=2, expert_tensor_parallel_size=4)
    assert replace_flags(args, [], tp_plan)[0].startswith("--expert-tensor-parallel-size 4: the plan's expert ranks")
    args = _megatron_defaults(expert_tensor_parallel_size=1)
    assert replace_flags(args, [], plan) == []


def test_transformer_engine_default_needs_transformer_engine():
    pytest.importorskip("torch")
    try:
        import transformer_engine  # noqa: F401
        pytest.skip("transformer-engine is installed here")
    except ImportError:
        pass
    out = refusals.refusals(_megatron_defaults(transformer_impl="transformer_engine"))
    assert out == ["--transformer-impl transformer_engine (Megatron-LM's default): transformer-engine is not "
                   "installed; install it or pass --transformer-impl local"]


def test_cpu_host_needs_gloo(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = refusals.refusals(_megatron_defaults(distributed_backend="nccl"))
    assert out == ["--distributed-backend 'nccl': this host has no CUDA; pass --distributed-backend gloo to run the "
                   "ranks on the CPU"]


@pytest.mark.parametrize("bf16", [True, False])
def test_bf16_on_a_plan_with_v100_experts_is_refused_with_the_fix(tmp_path, bf16):
    from megatron_hetermoe.plan.hetero_plan import even_plan
    from megatron_hetermoe.training.validation import ConfigError

    plan = even_plan(2, 4, 1, 1, gpu_types=["A100-80GB", "V100-32GB"])
    plan.save(tmp_path / "plan.json")
    args = _megatron_defaults(bf16=bf16, fp16=not bf16, hetero_plan=str(tmp_path / "plan.json"), world_size=2,
                              global_batch_size=1, micro_batch_size=1, num_layers=2, hetero_schedule=None, rank=1)
    validated = []
    run = HeteroPretrain([])
    if bf16:
        with pytest.raises(ConfigError, match=r"--bf16: plan .* has GPU type\(s\) without native bf16.*V100-32GB "
                                              r"\(ranks \[1\]\); use --fp16"):
            run.validate_args(lambda a, d: validated.append(a), args)
        assert not validated  # refused before Megatron validates anything
    else:
        run.validate_args(lambda a, d: validated.append(a), args)
        assert validated and run.schedule == "distep"



@pytest.mark.parametrize("rank", [0, 1])
def test_bf16_attention_fp16_experts_set_each_rank_to_its_pool(tmp_path, rank):
    import torch

    from megatron_hetermoe.plan.hetero_plan import even_plan
    from megatron_hetermoe.training.validation import ConfigError

    plan = even_plan(2, 4, 1, 1, gpu_types=["A100-80GB", "V100-32GB"])
    plan.save(tmp_path / "plan.json")

    def args(**kw):
        base = dict(bf16=True, hetero_plan=str(tmp_path / "plan.json"), world_size=2, global_batch_size=1,
                    micro_batch_size=1, num_layers=2, hetero_schedule=None, rank=rank, loss_scale=None,
                    check_for_nan_in_loss_and_grad=True, accumulate_allreduce_grads_in_fp32=True,
                    params_dtype=torch.bfloat16)
        return _megatron_defaults(**{**base, **kw})

    a = args(hetero_expert_precision="fp16")
    run = HeteroPretrain([])
    run.validate_args(lambda a, d: None, a)
    want = (True, False, torch.bfloat16) if rank == 0 else (False, True, torch.float16)  # attention, expert
    assert (a.bf16, a.fp16, a.params_dtype) == want
    assert a.check_for_nan_in_loss_and_grad is False  # dynamic scaling (fp16 pool), on every rank
    assert a.accumulate_allreduce_grads_in_fp32
    a = args(hetero_expert_precision="fp16", loss_scale=1024.0)
    HeteroPretrain([]).validate_args(lambda a, d: None, a)
    assert a.check_for_nan_in_loss_and_grad is True  # a constant scale keeps Megatron's NaN check
    with pytest.raises(ConfigError, match=r"--hetero-expert-precision bf16: plan .*'s expert pool has .*"
                                          r"V100-32GB \(ranks \[1\]\); use --hetero-expert-precision fp16"):
        HeteroPretrain([]).validate_args(lambda a, d: None, args(bf16=False, fp16=True,
                                                                      hetero_expert_precision="bf16"))
    with pytest.raises(ConfigError, match=r"pools of different precision must both be 16-bit"):
        HeteroPretrain([]).validate_args(lambda a, d: None, args(hetero_expert_precision="fp32"))


def test_recomputation_choice():
    """Issue 27 item 7: which of Megatron's recomputation flags a schedule honours, and how."""
    from megatron_hetermoe.megatron_lm.replaced import recompute_choice

    def choice(schedule, **kw):
        return recompute_choice(_megatron_defaults(**{"recompute_method": None, "recompute_num_layers": None,
                                                      "recompute_modules": None, "num_layers": 4, **kw}), schedule)

    assert choice("zebra") == (False, [], [])
    for schedule in ("zebra", "distep"):
        assert choice(schedule, recompute_granularity="selective") == (False, [], [])  # core_attn
        assert choice(schedule, recompute_granularity="selective",
                      recompute_modules=["core_attn", "moe_act", "shared_experts"]) == (False, [], [])
        # the MoE layer: its experts recompute, the dispatch is not replayed (a note says so)
        on, notes, bad = choice(schedule, recompute_granularity="selective", recompute_modules=["core_attn", "moe"])
        assert not on and not bad and notes[0].startswith("--recompute-modules moe: the experts keep their inputs")
        on, notes, bad = choice(schedule, moe_layer_recompute=True)  # Megatron's deprecated flag, the same
        assert not on and not bad and notes[0].startswith("--moe-layer-recompute: the experts keep their inputs")
        _, _, bad = choice(schedule, recompute_granularity="selective", recompute_modules=["core_attn", "attn"])
        assert bad == ["--recompute-modules attn: not a module Megatron recomputes inside one rank; keep "
                       "['core_attn', 'layernorm', 'mla_up_proj', 'mlp', 'moe', 'moe_act', 'shared_experts']"]
    assert choice("distep", recompute_granularity="selective", recompute_modules=["layernorm"]) == (False, [], [])
    _, _, bad = choice("zebra", recompute_granularity="selective", recompute_modules=["layernorm"])
    assert bad[0].startswith("--recompute-modules layernorm with the zebra schedule: not supported")
    on, notes, bad = choice("zebra", recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2)
    assert on and not bad and notes[0].endswith("(each layer's input kept; --recompute-num-layers 2 would keep fewer)")
    assert choice("zebra", recompute_granularity="full", recompute_method="block", recompute_num_layers=4)[0]
    _, _, bad = choice("zebra", recompute_granularity="full", recompute_method="block", recompute_num_layers=2)
    assert bad[0].startswith("--recompute-method block --recompute-num-layers 2: zebra recomputes every layer")
    _, _, bad = choice("distep", recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    assert bad[0].startswith("--recompute-granularity full with the distep schedule: Megatron's recomputation would")
