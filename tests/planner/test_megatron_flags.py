"""`hetermoe plan ... -- <pretrain_gpt.py flags>` (issue 27 item 11, issue 42 item 1): the model and
the run read from the run's Megatron-LM flags, with Megatron's meanings and defaults; the same plan
as from the equivalent YAML; a plan that follows the run's TP, PP, virtual stages, EP and batch;
refusals and conflicts named."""
import json

import pytest

from megatron_hetermoe.config import ModelConfig
from megatron_hetermoe.plan.hetero_plan import HeteroPlan
from megatron_hetermoe.planner.cli_plan import main
from megatron_hetermoe.planner.megatron_flags import MegatronFlagsError, model_from_flags

# configs/models/tiny-dense.yaml as a pretrain_gpt.py command line (with flags that do not change the model)
TINY_DENSE = ["--num-layers", "3", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "256",
              "--moe-ffn-hidden-size", "64", "--num-experts", "4", "--moe-router-topk", "2",
              "--moe-aux-loss-coeff", "0.01", "--seq-length", "32", "--max-position-embeddings", "32",
              "--vocab-size", "256", "--moe-layer-freq", "([0]+[1]*2)", "--moe-shared-expert-intermediate-size", "128",
              "--swiglu", "--untie-embeddings-and-output-weights", "--normalization", "RMSNorm",
              "--disable-bias-linear", "--position-embedding-type", "rope",
              "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-3", "--train-iters", "10",
              "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall", "--bf16",
              "--hetero-plan", "plan.json"]
SHAPE = ["--num-layers", "4", "--hidden-size", "96", "--num-attention-heads", "6", "--num-experts", "8"]


def test_flags_give_the_yaml_model():
    fm = model_from_flags(TINY_DENSE)
    assert fm.model == ModelConfig.load("tiny-dense").replace(name=fm.model.name)
    assert (fm.seq_length, fm.global_batch_size, fm.notes) == (32, 8, [])


def test_megatron_defaults():
    """Megatron-LM core_v0.16.1 arguments.py: ffn = int(4 h * 2/3 / 64) * 64 with --swiglu (96:
    int(256 / 64) * 64 = 256), else 4 h = 384; moe ffn = ffn; top-2; aux coeff 0.0; every layer MoE;
    no shared expert; vocabulary padded to a multiple of 128 x TP; and (TransformerConfig,
    arguments.py) GeLU, LayerNorm, biases, tied embeddings, learned absolute positions, MHA of
    hidden / heads channels: each priced as Megatron builds it, not as the plugin's trainer does."""
    m = model_from_flags([*SHAPE, "--swiglu", "--vocab-size", "1000"]).model
    assert (m.ffn_hidden_size, m.moe_ffn_hidden_size, m.moe_router_topk, m.moe_aux_loss_coeff) == (256, 256, 2, 0.0)
    assert ((m.moe_layer_freq, m.dense_layers, m.moe_shared_expert_intermediate_size, m.vocab_size)
            == (1, [], None, 1024))
    fm = model_from_flags([*SHAPE, "--tensor-model-parallel-size", "3"])  # no --swiglu, no vocab
    assert (fm.model.ffn_hidden_size, fm.model.vocab_size) == (384, 32256)  # 4 h; 32000 up to a multiple of 384
    assert any("vocabulary of 32000" in n for n in fm.notes)
    d = fm.model
    assert (d.mlp_activation, d.normalization, d.add_bias_linear, d.untie_embeddings_and_output_weights,
            d.position_embedding_type, d.head_dim, d.query_groups) == ("gelu", "LayerNorm", True, False,
                                                                             "learned_absolute", 16, 6)
    # NullTokenizer: --vocab-size ids and the EOD after them (1001), padded
    assert model_from_flags([*SHAPE, "--tokenizer-type", "NullTokenizer",
                             "--vocab-size", "1000"]).model.vocab_size == 1024
    assert model_from_flags([*SHAPE, "--padded-vocab-size", "777"]).model.vocab_size == 777
    assert model_from_flags([*SHAPE, "--moe-layer-freq", "2"]).model.dense_layers == [1, 3]
    assert model_from_flags([*SHAPE, "--encoder-seq-length", "512"]).seq_length == 512


@pytest.mark.parametrize("extra, words", [
    (["--mtp-num-layers", "-1"], "--mtp-num-layers=-1 must be a positive integer"),
    (["--experimental-attention-variant", "dsa"], "--experimental-attention-variant (an attention variant"),
    (["--pipeline-model-parallel-layout", "Et|tL"], "--pipeline-model-parallel-layout (a custom pipeline layout"),
    (["--kv-channels", "33", "--position-embedding-type", "rope"], "head dim --kv-channels=33 is odd"),
    (["--group-query-attention", "--num-query-groups", "4"], "--num-query-groups=4 does not divide "
                                                             "--num-attention-heads=6"),
    (["--swiglu", "--quick-geglu"], "--swiglu and --quick-geglu after --: Megatron-LM takes one MLP activation"),
    (["--multi-latent-attention", "--group-query-attention"], "Megatron-LM refuses the pair"),
    (["--moe-layer-recompute", "--recompute-granularity", "full"], "Do not set --moe-layer-recompute with full"),
    (["--moe-shared-expert-intermediate-size", "32"],
     "SharedExpertMLP refuses biases; drop one (--disable-bias-linear)"),
    (["--num-layerz", "4"], "does not have: --num-layerz"),
    (["--moe-layer-freq", "([0]*4)"], "--moe-layer-freq='([0]*4)' is not a valid layer pattern"),
    (["--moe-layer-freq", "[0,1]"], "need 4 entries"),
    (["--num-experts", "0"], "no --num-experts"),
    (["--hidden-size", "big"], "argument --hidden-size: invalid int value: 'big'"),
    (["--moe-shared-expert-intermediate-size", "0"], "--moe-shared-expert-intermediate-size=0 must be a positive"),
    (["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "t.json"],
     "--tokenizer-type HuggingFaceTokenizer: the planner does not read tokenizer files; add --padded-vocab-size"),
    (["--tokenizer-type", "NullTokenizer"], "NullTokenizer needs --vocab-size"),
])
def test_refusals_name_the_flag(extra, words):
    with pytest.raises(MegatronFlagsError) as e:
        model_from_flags([*SHAPE, *extra])
    assert words in str(e.value), str(e.value)


def test_missing_shape_and_attention_as_megatron_reads_it():
    with pytest.raises(MegatronFlagsError, match="add --hidden-size --num-attention-heads"):
        model_from_flags(["--num-layers", "4", "--num-experts", "8"])
    m = model_from_flags([*SHAPE, "--group-query-attention", "--num-query-groups", "2", "--kv-channels", "32",
                          "--swiglu", "--untie-embeddings-and-output-weights", "--vocab-size", "128"]).model
    assert (m.head_dim, m.query_groups) == (32, 2)  # 6 heads of 32 != hidden 96: priced as given (Qwen3's case)
    # core_transformer_config_from_args: --num-query-groups counts only with --group-query-attention
    assert model_from_flags([*SHAPE, "--num-query-groups", "2"]).model.query_groups == 6
    # MLA ignores --kv-channels (DeepSeek-V2-Lite's conf passes 16): its heads are qk + rope and v wide
    mla = model_from_flags([*SHAPE, "--multi-latent-attention", "--kv-channels", "16", "--qk-head-dim", "8",
                            "--qk-pos-emb-head-dim", "4", "--v-head-dim", "8", "--kv-lora-rank", "16"]).model
    assert (mla.kv_channels, mla.qk_channels, mla.v_channels, mla.q_lora_rank) == (None, 12, 8, None)


def _plan_without_meta(path) -> dict:
    d = HeteroPlan.load(path).to_dict()
    d.pop("meta")
    return d


# The run's flags decide what the YAML leaves to hetermoe plan's flags: the even plan's R is the run's
# --global-batch-size 8 / (--micro-batch-size 2 x 1 attention rank); the search prices the run's
# recomputation (full here: the paper's program, which a search from a YAML prices) and its micro batch.
WITHOUT_MICRO_BATCH = [t for i, t in enumerate(TINY_DENSE)
                       if "--micro-batch-size" not in TINY_DENSE[max(0, i - 1):i + 1]]


@pytest.mark.parametrize("mode, yaml_extra, run", [
    (["--even", "--attention-ranks", "1", "--expert-ranks", "2", "--schedule", "zebra"], ["--microbatches", "4"],
     TINY_DENSE),
    (["--cluster", "mini-2a40-2v100"], ["--seq-len", "32", "--global-batch", "8"],
     [*WITHOUT_MICRO_BATCH, "--recompute-granularity", "full"])])
def test_plan_from_flags_equals_plan_from_yaml(tmp_path, capsys, mode, yaml_extra, run):
    a, b = tmp_path / "yaml.json", tmp_path / "flags.json"
    assert main([*mode, *yaml_extra, "--model", "tiny-dense", "-o", str(a)]) == 0
    assert main([*mode, "-o", str(b), "--", *run]) == 0  # seq len and batch from --seq-length / --global-batch-size
    assert _plan_without_meta(a) == _plan_without_meta(b)
    plan = HeteroPlan.load(b)
    assert plan.dense_layers == [0] and plan.num_layers == 2 and plan.meta["model_flags"] == run


def test_search_json_from_flags(capsys):
    assert main(["--cluster", "mini-2a40-2v100", "--json", "--", *TINY_DENSE]) == 0
    d = json.loads(capsys.readouterr().out)
    assert (d["seq_len"], d["global_batch"]) == (32, 8)


def test_cli_conflicts_are_named(capsys):
    assert main(["--even", "--attention-ranks", "1", "--expert-ranks", "1", "--model", "tiny", "--", *TINY_DENSE]) == 2
    assert "--model tiny and Megatron-LM flags after -- both give the model" in capsys.readouterr().err
    assert main(["--cluster", "mini-2a40-2v100", "--seq-len", "64", "--", *TINY_DENSE]) == 2
    assert "--seq-len 64 and --seq-length 32 after -- disagree" in capsys.readouterr().err
    assert main(["--cluster", "mini-2a40-2v100", "--global-batch", "16", "--", *TINY_DENSE]) == 2
    assert "--global-batch 16 and --global-batch-size 8 after -- disagree" in capsys.readouterr().err
    assert main(["--even", "--attention-ranks", "1", "--expert-ranks", "1"]) == 2
    assert "no model: give --model CONFIG, or the run's pretrain_gpt.py flags after --" in capsys.readouterr().err
    assert main(["--even", "--attention-ranks", "1", "--expert-ranks", "1", "--", *SHAPE, "--model", "tiny"]) == 2
    assert "--model after --" in capsys.readouterr().err
    # zebra runs the MTP block (models/stages.py): an even zebra plan of an MTP model is made
    assert main(["--even", "--attention-ranks", "1", "--expert-ranks", "1", "--schedule", "zebra", "--", *SHAPE,
                 "--mtp-num-layers", "1"]) == 0


@pytest.mark.parametrize("freq, dense, moe_layers", [("1", [], 5), ("([1]*3+[0])", [3, 4], 3)])
def test_even_plan_places_the_mtp_layers_after_the_decoder(tmp_path, freq, dense, moe_layers):
    """--mtp-num-layers 1 after --: one more model layer, of the last decoder layer's kind."""
    out = tmp_path / "p.json"
    assert main(["--even", "--attention-ranks", "1", "--expert-ranks", "2", "-o", str(out), "--", *SHAPE,
                 "--moe-layer-freq", freq, "--mtp-num-layers", "1"]) == 0
    plan = HeteroPlan.load(out)
    assert (plan.decoder_layers, plan.mtp_layers, plan.dense_layers, plan.num_layers) == (4, 1, dense, moe_layers)


def test_console_passes_the_flags_after_dashes(tmp_path):
    import subprocess
    import sys

    out = tmp_path / "p.json"
    r = subprocess.run([sys.executable, "-m", "megatron_hetermoe.cli", "plan", "--even", "--attention-ranks", "1",
                        "--expert-ranks", "1", "-o", str(out), "--", *TINY_DENSE], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert HeteroPlan.load(out).dense_layers == [0]
