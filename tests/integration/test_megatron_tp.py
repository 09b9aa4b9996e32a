"""Plain Megatron-Core MoE with tensor parallelism 2 + sequence parallelism on CPU ranks (gloo):
the same initial weights as TP=1 (models/tp_shards.py), and at identical parameters the same
losses, canonical gradients and grad norm as TP=1, same global batch and data-parallel size."""
import dataclasses
import math

import pytest
import torch
from margins import within

from megatron_hetermoe.config import ParallelConfig, TrainConfig
from megatron_hetermoe.models import tp_shards
from megatron_hetermoe.tools.parity import GRAD_TOL, LOSS_TOL, diff_by_category, max_rel_loss_diff

# Megatron's optimizer's grad norm, TP=2+SP against TP=1 at identical parameters. Measured worst
# 1.74e-7 (ATEN_CPU_CAPABILITY default, avx2, avx512): 5.7x inside.
GRAD_NORM_TOL = 1e-6


def test_tp2_sp_matches_tp1(tiny):
    # TP=1 EP=2 on 2 ranks (DP 2) against TP=2+SP EP=2 on 4 ranks (DP 2, expert DP 2), global
    # batch 8. Measured worst over 3 steps and ATEN_CPU_CAPABILITY default/avx2/avx512: loss
    # 8.8e-8 (bound LOSS_TOL 1e-6), grads 3.8e-7 (GRAD_TOL 1e-5), and the same on megatron-core
    # 0.19.2; initial weights bitwise equal.
    from megatron_hetermoe.training.args import run
    from megatron_hetermoe.training.run_hooks import RunHooks

    cfg = TrainConfig(tiny, ParallelConfig(ep=2), micro_batch_size=2, global_batch_size=8, train_iters=3, quiet=True)
    tp2 = dataclasses.replace(cfg, parallel=ParallelConfig(tp=2, ep=2, sequence_parallel=True))
    ref = run(cfg, 2, timeout_s=120, hooks=RunHooks(collect_grads=True))
    # Layout-invariant init: a TP=2 run starts from the TP=1 run's weights, bitwise.
    free = run(tp2, 4, timeout_s=120, hooks=RunHooks(collect_grads=True))
    assert free.initial_params.keys() == ref.initial_params.keys()
    assert all(torch.equal(free.initial_params[k], v) for k, v in ref.initial_params.items())
    assert free.dp == ref.dp == 2 and free.num_microbatches == ref.num_microbatches
    # At the reference's parameters of every step (canonical state cut to TP shards on load).
    pin = run(tp2, 4, timeout_s=120,
              hooks=RunHooks(init_state=ref.initial_params, pin_params=ref.step_params, collect_grads=True))
    assert len(pin.losses) == len(pin.grads) == 3
    within("loss", max_rel_loss_diff(pin.losses, ref.losses), LOSS_TOL)
    worst = max(max(diff_by_category(g, r, scale="category").values()) for g, r in zip(pin.grads, ref.grads))
    within("grad", worst, GRAD_TOL)
    # Norms and routers are replicated over TP (sequence parallel): their gradients must be the
    # TP-summed ones, so Megatron's grad norm (each replicated parameter counted once) is TP=1's.
    norm = max(abs(a - b) / b for a, b in zip(pin.grad_norms, ref.grad_norms))
    within("grad norm", norm, GRAD_NORM_TOL)
    exact = [math.sqrt(sum(float(v.double().pow(2).sum()) for v in g.values())) for g in ref.grads]
    within("grad norm vs canonical grads", max(abs(a - b) / b for a, b in zip(pin.grad_norms, exact)), GRAD_NORM_TOL)


# ---- tp_shards: full -> shards -> full, by hand ------------------------------------------------
def _param(shape, tp: bool = True, dim: int = 0, expert: bool = False) -> torch.nn.Parameter:
    p = torch.nn.Parameter(torch.zeros(shape))
    if tp:
        p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, dim, 1
    if expert:
        p.allreduce = False
    return p


def test_chunk_dim0_qkv_and_vocab():
    full = torch.arange(12.0).view(6, 2)  # rows 0..5
    spec = tp_shards.shard_spec(_param((3, 2)), "decoder.layers.0.self_attention.linear_qkv.weight", 1, 2)
    assert spec == tp_shards.ShardSpec("chunk", 0, 1, 2)
    assert torch.equal(tp_shards.shard(full, spec), torch.tensor([[6.0, 7.0], [8.0, 9.0], [10.0, 11.0]]))
    parts = {r: tp_shards.shard(full, spec._replace(tp_rank=r)) for r in range(2)}
    assert torch.equal(parts[0], torch.tensor([[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]))
    assert torch.equal(tp_shards.merge(parts, spec), full)
    assert tp_shards.full_shape(torch.Size([3, 2]), spec) == full.shape


def test_chunk_dim1_row_parallel():
    full = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]])
    spec = tp_shards.shard_spec(_param((2, 2), dim=1), "decoder.layers.0.self_attention.linear_proj.weight", 0, 2)
    assert spec.kind == "chunk" and spec.dim == 1
    assert torch.equal(tp_shards.shard(full, spec), torch.tensor([[1.0, 2.0], [5.0, 6.0]]))
    assert torch.equal(tp_shards.shard(full, spec._replace(tp_rank=1)), torch.tensor([[3.0, 4.0], [7.0, 8.0]]))
    parts = [tp_shards.shard(full, spec._replace(tp_rank=r)) for r in range(2)]
    assert torch.equal(tp_shards.merge(parts, spec), full)


def test_glu_fc1_is_gate_i_then_up_i():
    # [gate; up] with gate rows g0..g3, up rows u0..u3; TP 2: rank 0 [g0 g1 u0 u1], rank 1 [g2 g3 u2 u3].
    gate, up = torch.tensor([[10.0], [11.0], [12.0], [13.0]]), torch.tensor([[20.0], [21.0], [22.0], [23.0]])
    full = torch.cat([gate, up])
    spec = tp_shards.shard_spec(_param((4, 1)), "decoder.layers.0.mlp.linear_fc1.weight", 0, 2)
    assert spec.kind == "glu"
    r0, r1 = (tp_shards.shard(full, spec._replace(tp_rank=r)) for r in range(2))
    assert r0.flatten().tolist() == [10.0, 11.0, 20.0, 21.0]
    assert r1.flatten().tolist() == [12.0, 13.0, 22.0, 23.0]
    assert torch.equal(tp_shards.merge({0: r0, 1: r1}, spec), full)
    # not gated: a plain contiguous chunk
    assert tp_shards.shard_spec(_param((4, 1)), "decoder.layers.0.mlp.linear_fc1.weight", 0, 2,
                                glu=False).kind == "chunk"
    with pytest.raises(ValueError, match="does not split into 2 TP shards of"):
        tp_shards.shard(torch.zeros(6, 1), spec)


def test_a_stride_2_gated_fc1_is_the_glu_split():
    """megatron-core 0.16+ marks the gated fc1 of dense MLPs and shared experts partition_stride 2 (its
    [gate_i; up_i] on rank i: the glu split); stride 2 anywhere else stays refused by name."""
    p = _param((4, 1))
    p.partition_stride = 2
    assert tp_shards.shard_spec(p, "decoder.layers.0.mlp.shared_experts.linear_fc1.weight", 1, 2).kind == "glu"
    with pytest.raises(ValueError, match="linear_qkv.weight: partition_stride 2 is not handled"):
        tp_shards.shard_spec(p, "decoder.layers.0.self_attention.linear_qkv.weight", 1, 2)
    with pytest.raises(ValueError, match="partition_stride 2 is not handled"):  # an ungated fc1 has no gate
        tp_shards.shard_spec(p, "decoder.layers.0.mlp.linear_fc1.weight", 1, 2, glu=False)


def test_replicated_params_are_not_split():
    norm = _param((4,), tp=False)
    expert = _param((8, 4), expert=True)  # Megatron marks expert linears TP too; expert TP is 1 here
    for p, name in ((norm, "decoder.layers.0.input_layernorm.weight"),
                    (expert, "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight")):
        spec = tp_shards.shard_spec(p, name, 1, 2)
        assert not spec.split
        full = torch.randn(p.shape)
        assert tp_shards.shard(full, spec) is full and tp_shards.merge([full], spec) is full
    assert not tp_shards.shard_spec(_param((4, 4)), "x.linear_qkv.weight", 0, 1).split  # TP 1
    bad = _param((4, 4))
    bad.partition_stride = 2
    # megatron-core 0.16+ marks a gated fc1 stride 2: that is the glu split; elsewhere refused
    assert tp_shards.shard_spec(bad, "x.linear_fc1.weight", 0, 2).kind == "glu"
    for name, glu in (("x.linear_fc1.weight", False), ("x.linear_qkv.weight", True)):
        with pytest.raises(ValueError, match="partition_stride 2"):
            tp_shards.shard_spec(bad, name, 0, 2, glu=glu)


def test_shard_local_state_cuts_full_tensors_only(monkeypatch):
    m = torch.nn.Module()
    m.qkv = _param((3, 2))
    m.norm = _param((2,), tp=False)
    monkeypatch.setattr(tp_shards, "tp_coords", lambda group: (1, 2))
    full = torch.arange(12.0).view(6, 2)
    out = tp_shards.shard_local_state(m, {"qkv": full, "norm": torch.ones(2)}, tp_group=object())
    assert torch.equal(out["qkv"], full[3:]) and torch.equal(out["norm"], torch.ones(2))
    again = tp_shards.shard_local_state(m, {"qkv": full[3:], "norm": torch.ones(2)}, tp_group=object())
    assert torch.equal(again["qkv"], full[3:])  # already a shard: kept


# ---- refusals ---------------------------------------------------------------------------------
def test_parallel_config_sequence_parallel_rules():
    with pytest.raises(ValueError, match="--tensor-model-parallel-size 2 without --sequence-parallel: When using MoE "
                                         "and tensor parallelism, sequence parallelism must be used"):
        ParallelConfig(tp=2, ep=2)
    assert ParallelConfig(tp=2, sequence_parallel=True).sequence_parallel
    assert ParallelConfig(tp=1, sequence_parallel=True) == ParallelConfig()  # Megatron turns SP off at TP 1


def _validate(argv):
    """hetermoe train's checks of argv (no ranks started); the first refusal's message."""
    from megatron_hetermoe.training import args as train_args

    p = train_args.build_parser()

    def error(message):
        raise ValueError(message)

    p.error = error
    try:
        train_args.validate_run(p, p.parse_args(argv), check_outputs=False)
    except (ValueError, SystemExit) as e:
        return str(e)
    return None


def test_flags_refuse_tp_without_sequence_parallel():
    msg = _validate(["--nproc", "4", "--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2",
                     "--expert-tensor-parallel-size", "1"])
    assert msg and "--sequence-parallel" in msg and "sequence parallelism must be used" in msg, msg
    assert _validate(["--nproc", "4", "--tensor-model-parallel-size", "2", "--sequence-parallel",
                      "--expert-tensor-parallel-size", "1",
                      "--expert-model-parallel-size", "2"]) is None
    msg = _validate(["--nproc", "4", "--tensor-model-parallel-size", "2", "--sequence-parallel", "--save", "/tmp/x",
                     "--expert-tensor-parallel-size", "1"])
    assert msg and msg.startswith("--tensor-model-parallel-size 2: with --save: not supported"), msg
    msg = _validate(["--nproc", "4", "--tensor-model-parallel-size", "4", "--sequence-parallel", "--seq-length", "30",
                     "--expert-tensor-parallel-size", "1"])
    assert msg and "does not divide num_attention_heads=4" not in msg and "seq_length=30" in msg, msg


def test_pretrain_gpt_flags_take_sequence_parallel():
    from megatron_hetermoe.training.pretrain_gpt import FlagError, check_flags, recipe_args

    run = ["--model", "tiny", *recipe_args(), "--global-batch-size", "8", "--nproc", "4",
           "--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2"]
    check_flags([*run, "--sequence-parallel", "--expert-tensor-parallel-size", "1"])  # raises FlagError on any refusal
    with pytest.raises(FlagError, match="without --sequence-parallel"):
        check_flags([*run, "--expert-tensor-parallel-size", "1"])
    # Experts are never tensor-parallel here; Megatron's default expert TP is the TP size.
    with pytest.raises(FlagError, match="--expert-tensor-parallel-size 2: experts split"):
        check_flags([*run, "--sequence-parallel", "--expert-tensor-parallel-size", "2"])
    with pytest.raises(FlagError, match=r"--expert-tensor-parallel-size 2 \(Megatron's default: the "
                                        r"--tensor-model-parallel-size 2\).*pass --expert-tensor-parallel-size 1"):
        check_flags([*run, "--sequence-parallel"])


def test_hetero_plan_refuses_tensor_parallel(tmp_path):
    from megatron_hetermoe.plan.hetero_plan import even_plan

    plan = tmp_path / "plan.json"
    even_plan(2, 4, 1, 2, num_microbatches=2).save(plan)  # attention_tp 1
    msg = _validate(["--hetero-plan", str(plan), "--global-batch-size", "4", "--tensor-model-parallel-size", "2",
                     "--expert-tensor-parallel-size", "1",
                     "--sequence-parallel"])
    assert msg and "--tensor-model-parallel-size 2" in msg, msg
