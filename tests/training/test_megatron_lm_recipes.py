"""Megatron-LM's own MoE recipes, read from the core_v0.16.1 tree (MEGATRON_LM_DIR) as a user runs them,
shrunk to CPU size, with --hetero-plan added (issue 27's verification): each trains under zebra and
distep, and from the same plain Megatron EP checkpoint the next 3 iterations' lm losses equal
Megatron EP's. The plan is `hetermoe plan --even -- <the recipe's flags>`.

What changes besides the sizes (each for a reason that is not HeterMoE's):
- --moe-grouped-gemm is dropped: Megatron's grouped GEMM has no CPU kernel (Megatron EP cannot run it
  on CPU either); --bf16 is dropped: the comparison is at fp32 round-off (16-bit runs are checked
  against the plugin's trainer in test_megatron_lm_pretrain.py);
- PP becomes 1 (test_mixtral_recipe_with_its_pipeline_stages runs Mixtral at its own PP) and EP 2 for the
  Megatron EP reference (HeterMoE's replace_flags sets it to 1 with a line); TP stays the recipe's: the plan's
  attention members are tensor-parallel alike (attention_tp), the reference runs on 2 x TP ranks, and
  Megatron's expert TP (the TP size by default) is replaced by the plan's whole experts, with a line;
- the tokenizer and data are NullTokenizer on a locally built corpus; --lr-warmup-iters 1 and
  --train-iters 4 (a recipe's warmup of hundreds of steps would leave the weights unmoved);
- the CPU flags of docs/megatron-lm.md; --log-interval 1; --lr 1e-4 and dropout 0 where a conf leaves them to
  Megatron's defaults (zebra runs the microbatches' layers in another order than Megatron, so its
  dropout masks are other draws: Qwen3's conf at Megatron's 0.1 differs by 4.7e-3 under zebra,
  not under distep).
Multi-latent attention runs as the confs give it (DeepSeek-V2-Lite's; the CPU backend's
core_attention_kv_channels and mla_have_te make megatron-core's local MLA spec build), with the confs' head
widths' shape; --kv-channels keeps its multiple of hidden / heads. The flagship shapes (DeepSeek-V3, Kimi-K2,
Qwen3-30B-A3B) run in test_megatron_lm_flagships.py with these helpers, checkpoints and resume included.
Megatron's MoE CI config named by the issue (tests/functional_tests/test_cases/moe/
gpt3_mcore_te_tp2_pp1_te_8experts2parallel_top2router/model_config.yaml) is not part of the shared tree:
CI_CONFIG below is its MODEL_ARGS as Megatron-LM's public repository has them (paths, data and the
launcher's nccl2 backend name left out), Megatron's own model defaults (GeLU, LayerNorm, learned absolute
positions) with --log-params-norm, --log-num-zeros-in-grad, --deterministic-mode (and the config's
ENV_VARS), --async-save and --sequence-parallel (which Megatron turns off at TP 1); its
--lr-warmup-fraction .01 of 320000 decay iterations is replaced by the warmup iteration above (the
weights would not move in 4 iterations), and --use-persistent-ckpt-worker and --log-memory-to-tensorboard
are dropped (Megatron's persistent checkpoint process sets a CUDA device, and the memory log reads CUDA
allocator statistics: plain Megatron fails with either on CPU)."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from margins import within
from megatron_lm_run import CPU, DATA, run_losses

from megatron_hetermoe.plan.hetero_plan import HeteroPlan
from megatron_hetermoe.planner.cli_plan import main as plan_main

pytestmark = pytest.mark.slow
MIXTRAL = "examples/mixtral/train_mixtral_8x7b_distributed.sh"
CONF = "examples/post_training/modelopt/conf"
RECIPES = {"mixtral-8x7b": MIXTRAL, "deepseek-v2-lite": f"{CONF}/deepseek-ai/DeepSeek-V2-Lite.sh",
           "moe-ci-tp2-ep2-top2": "CI_CONFIG"}
CI_CONFIG = """--num-layers 12 --hidden-size 512 --num-attention-heads 8 --log-params-norm --log-num-zeros-in-grad
--log-validation-ppl-to-tensorboard --log-timers-to-tensorboard --micro-batch-size 4 --global-batch-size 32
--seq-length 1024 --max-position-embeddings 1024 --train-iters 50 --timing-log-level 0 --lr-decay-iters 320000
--split 949,50,1 --lr 0.00015 --lr-decay-style cosine --min-lr 1.0e-5 --weight-decay 1e-2 --clip-grad 1.0
--lr-warmup-fraction .01 --log-interval 1 --save-interval 10000 --eval-interval 1000 --eval-iters 10
--transformer-impl transformer_engine --tensor-model-parallel-size 2 --pipeline-model-parallel-size 1
--expert-model-parallel-size 2 --disable-bias-linear --sequence-parallel --num-experts 8
--moe-router-load-balancing-type aux_loss --moe-router-topk 2 --moe-aux-loss-coeff 1e-2 --deterministic-mode
--no-gradient-accumulation-fusion --moe-grouped-gemm --attention-softmax-in-fp32 --use-mcore-models
--ckpt-format torch_dist --dist-ckpt-strictness log_all --bf16 --attention-backend unfused --no-bias-gelu-fusion
--log-memory-to-tensorboard --async-save --use-persistent-ckpt-worker"""
# The config's ENV_VARS (--deterministic-mode asserts NCCL_ALGO is set, even on gloo)
RECIPE_ENV = {"moe-ci-tp2-ep2-top2": {"CUDA_DEVICE_MAX_CONNECTIONS": "1", "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0",
                                      "NCCL_ALGO": "Ring", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}}
# The sizes (flag -> value), applied where the recipe passes the flag. MLA's widths keep the confs' shape:
# q/k heads (qk 16 + rope 8) wider than v heads (16), a q LoRA rank above the kv one.
SHRINK = {"--num-layers": "2", "--hidden-size": "64", "--ffn-hidden-size": "128", "--num-attention-heads": "4",
          "--num-query-groups": "2", "--num-experts": "8", "--moe-ffn-hidden-size": "64",
          "--moe-shared-expert-intermediate-size": "96", "--seq-length": "32", "--max-position-embeddings": "32",
          "--q-lora-rank": "48", "--kv-lora-rank": "32", "--v-head-dim": "16", "--qk-head-dim": "16",
          "--qk-pos-emb-head-dim": "8", "--micro-batch-size": "2", "--global-batch-size": "8", "--train-iters": "4",
          "--lr-warmup-iters": "1", "--pipeline-model-parallel-size": "1",
          "--expert-model-parallel-size": "2", "--moe-layer-freq": "([0]+[1]*2)",
          "--make-vocab-size-divisible-by": "128", "--padded-vocab-size": "384",
          # DeepSeek-V3's 8 groups of 32 experts, 4 groups kept: 4 groups of 2, 2 kept, top-4 from their 4
          "--moe-router-num-groups": "4", "--moe-router-group-topk": "2"}
TOPK_MOST = 4  # of the 8 shrunk experts
HEAD = 16  # the shrunk hidden size / heads
# --use-persistent-ckpt-worker: Megatron's persistent checkpoint process sets a CUDA device, and
# --log-memory-to-tensorboard reads CUDA allocator statistics (plain Megatron fails with either on CPU);
# --async-save stays (its per-save worker).
DROP = {"--moe-grouped-gemm": 0, "--bf16": 0, "--lr-warmup-fraction": 1, "--use-persistent-ckpt-worker": 0,
        "--log-memory-to-tensorboard": 0, "--tokenizer-type": 1, "--tokenizer-model": 1, "--data-path": 1,
        "--split": 1, "--save-interval": 1, "--save": 1, "--load": 1, "--log-interval": 1, "--eval-interval": 1,
        "--eval-iters": 1}
EVAL_OFF = ["--log-interval", "1", "--eval-interval", "100", "--eval-iters", "0"]


def recipe_flags(tree: Path, path: str) -> list[str]:
    """The Megatron-LM flags a recipe passes to pretrain_gpt.py: the bash arrays of Mixtral's
    script (model, MoE, training, model-parallel), the MODEL_ARGS string of a modelopt conf, or
    the MoE CI config's (CI_CONFIG)."""
    if path == "CI_CONFIG":
        return shlex.split(CI_CONFIG)
    text = (tree / path).read_text()
    arrays = [m.group(1) for name in ("MODEL_ARGS", "MOE_ARGS", "TRAINING_ARGS", "MODEL_PARALLEL_ARGS")
              for m in [re.search(rf"^{name}=\((.*?)^\)", text, re.DOTALL | re.MULTILINE)] if m]
    strings = [m.group(1) for m in [re.search(r'^MODEL_ARGS="(.*?)"', text, re.DOTALL | re.MULTILINE)] if m]
    flags = [t for part in arrays + strings for t in shlex.split(part.replace("\\\n", " "))]
    assert flags and flags[0].startswith("--"), (path, flags[:5])
    return flags


def _value(flags: list[str], flag: str, default: str | None = None) -> str | None:
    return flags[flags.index(flag) + 1] if flag in flags else default


def shrunk(flags: list[str]) -> list[str]:
    """SHRINK's sizes, DROP's flags removed (a flag and its value count), the rest as the recipe has them;
    --kv-channels keeps its multiple of hidden / heads (Qwen3's 128 = 2 x 2048 / 32: 32 = 2 x 64 / 4)."""
    out, i = [], 0
    while i < len(flags):
        f = flags[i]
        if f in DROP:
            i += 1 + DROP[f]
            continue
        if f == "--kv-channels":
            heads, hidden = int(_value(flags, "--num-attention-heads")), int(_value(flags, "--hidden-size"))
            out += [f, str(HEAD * max(1, round(int(flags[i + 1]) * heads / hidden)))]
            i += 2
            continue
        if f in SHRINK:
            out += [f, SHRINK[f]]
            i += 2
            continue
        if f == "--moe-router-topk":
            out += [f, str(min(int(flags[i + 1]), TOPK_MOST))]
            i += 2
            continue
        out.append(f)
        i += 1
    if "--moe-layer-freq" in out:  # the first-k dense pattern, at 3 layers: one dense, two MoE
        out[out.index("--num-layers") + 1] = "3"
    for f, v in {**{f: SHRINK[f] for f in ("--micro-batch-size", "--global-batch-size", "--train-iters",
                                             "--lr-warmup-iters")}, "--lr": "1e-4",
                 "--attention-dropout": "0", "--hidden-dropout": "0"}.items():
        # The modelopt confs leave the schedule to the script that sources them; dropout 0 for a
        # loss comparison (zebra draws the masks in another order: test_megatron_lm_recipe_flags.py
        # checks recomputation with dropout on).
        if f not in out:
            out += [f, v]
    return out


_EP_RUNS: dict[str, tuple] = {}


def _resume(mlm, tmp_path, nproc, flags, ckpt, name) -> dict[int, float]:
    losses, _ = run_losses(mlm, tmp_path, nproc, [*flags, "--load", str(ckpt), "--ckpt-step", "1", "--no-load-optim",
                                                  "--no-load-rng"], name)
    assert sorted(losses) == [2, 3, 4], losses
    return losses


@pytest.mark.parametrize("schedule", ["zebra", "distep"])
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_recipe_trains_unchanged_with_megatron_eps_losses(mlm, data, tmp_path, tmp_path_factory, monkeypatch, recipe,
                                                          schedule):
    """The recipe's flags (shrunk) with --hetero-plan added train, and continue a plain Megatron EP
    checkpoint with Megatron EP's losses."""
    for k, v in RECIPE_ENV.get(recipe, {}).items():
        monkeypatch.setenv(k, v)
    flags = [*shrunk(recipe_flags(mlm, RECIPES[recipe])), *DATA, *CPU, *EVAL_OFF, "--data-path", data]
    tp = int(flags[flags.index("--tensor-model-parallel-size") + 1]) if "--tensor-model-parallel-size" in flags else 1
    if recipe not in _EP_RUNS:  # data parallel 2 at the recipe's TP
        tmp = tmp_path_factory.mktemp(f"ep-{recipe}")
        ckpt = tmp / "ckpt"
        run_losses(mlm, tmp, 2 * tp, [*flags, "--save", str(ckpt), "--save-interval", "1", "--train-iters", "1",
                                      "--lr-warmup-iters", "0"], "tb")  # Megatron: warmup < decay (= train) iters
        _EP_RUNS[recipe] = ckpt, _resume(mlm, tmp, 2 * tp, flags, ckpt, "resumed")
    ckpt, ep = _EP_RUNS[recipe]
    plan = tmp_path / "plan.json"
    # As a user makes it: TP and R (= 8 / (2 x 2 attention members)) from the run's flags.
    assert plan_main(["--even", "--attention-ranks", str(tp), "--expert-ranks", "1", "--groups", "2", "--schedule",
                      schedule, "-o", str(plan), "--", *flags]) == 0
    p = HeteroPlan.load(plan)
    assert (p.attention_tp, p.num_microbatches) == (tp, 2)
    if "--moe-layer-freq" in flags:
        assert p.dense_layers == [0]
    het = _resume(mlm, tmp_path, 2 * (tp + 1), [*flags, "--hetero-plan", str(plan)], ckpt, "het")
    within(f"recipe {recipe}, {schedule} vs Megatron EP ({het} vs {ep})", max(abs(het[i] - ep[i]) for i in ep), 3e-6)


def test_mixtral_recipe_with_its_pipeline_stages(mlm, data, tmp_path):
    """Mixtral's script at its own --pipeline-model-parallel-size (4; one shrunk layer a stage): plain
    Megatron at PP 4 (EP 1: one data-parallel rank) saves after iteration 1, and HeterMoE with a plan of
    4 pipeline stages (each 1 attention + 1 expert rank; distep: Megatron's 1F1B, the expert ranks
    mirroring it) continues that checkpoint with plain Megatron's losses."""
    recipe = recipe_flags(mlm, MIXTRAL)
    pp = recipe[recipe.index("--pipeline-model-parallel-size") + 1]
    assert pp == "4"
    flags = [*shrunk(recipe), *DATA, *CPU, *EVAL_OFF, "--data-path", data]
    for flag, value in (("--pipeline-model-parallel-size", pp), ("--num-layers", pp)):
        flags[flags.index(flag) + 1] = value
    ref = [*flags, "--expert-model-parallel-size", "1"]  # the last wins: EP 1 over PP 4's one DP rank
    ckpt = tmp_path / "ckpt"
    run_losses(mlm, tmp_path, 4, [*ref, "--save", str(ckpt), "--save-interval", "1", "--train-iters", "1",
                                  "--lr-warmup-iters", "0"], "tb")
    plain = _resume(mlm, tmp_path, 4, ref, ckpt, "resumed")
    plan = tmp_path / "plan.json"
    assert plan_main(["--even", "--attention-ranks", "1", "--expert-ranks", "1", "--pipeline-stages", pp,
                      "--microbatches", "4", "-o", str(plan), "--", *flags]) == 0
    assert HeteroPlan.load(plan).pipeline_stages == 4
    het = _resume(mlm, tmp_path, 8, [*flags, "--hetero-plan", str(plan)], ckpt, "het")
    within(f"Mixtral at PP {pp}, distep vs Megatron ({het} vs {plain})", max(abs(het[i] - plain[i]) for i in plain),
           3e-6)
