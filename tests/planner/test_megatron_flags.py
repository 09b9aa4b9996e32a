"""`hetermoe plan ... -- <pretrain_gpt.py flags>` (issue 27 item 11): the model read from the run's
Megatron-LM flags, with Megatron's defaults; the same plan as from the equivalent YAML; refusals
and conflicts named."""
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
    no shared expert; vocabulary padded to a multiple of 128 x TP."""
    m = model_from_flags([*SHAPE, "--swiglu", "--vocab-size", "1000"]).model
    assert (m.ffn_hidden_size, m.moe_ffn_hidden_size, m.moe_router_topk, m.moe_aux_loss_coeff) == (256, 256, 2, 0.0)
    assert (m.moe_layer_freq, m.dense_layers, m.moe_shared_expert_intermediate_size, m.vocab_size) == (1, [], None, 1024)
    fm = model_from_flags([*SHAPE, "--tensor-model-parallel-size", "3"])  # no --swiglu, no vocab
    assert (fm.model.ffn_hidden_size, fm.model.vocab_size) == (384, 32256)  # 4 h; 32000 up to a multiple of 384
    assert any("--swiglu" in n for n in fm.notes) and any("vocabulary of 32000" in n for n in fm.notes)
    # NullTokenizer: --vocab-size ids and the EOD after them (1001), padded
    assert model_from_flags([*SHAPE, "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000"]).model.vocab_size == 1024
    assert model_from_flags([*SHAPE, "--padded-vocab-size", "777"]).model.vocab_size == 777
    assert model_from_flags([*SHAPE, "--moe-layer-freq", "2"]).model.dense_layers == [1, 3]
    assert model_from_flags([*SHAPE, "--encoder-seq-length", "512"]).seq_length == 512


@pytest.mark.parametrize("extra, words", [
    (["--mtp-num-layers", "-1"], "--mtp-num-layers=-1 must be a positive integer"),
    (["--multi-latent-attention"], "--multi-latent-attention (multi-latent attention"),
    (["--squared-relu"], "--squared-relu (the cost model prices SwiGLU"),
    (["--kv-channels", "32"], "--kv-channels 32: attention of width 32 x 6 heads != --hidden-size 96"),
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


def test_missing_shape_and_accepted_notes():
    with pytest.raises(MegatronFlagsError, match="add --hidden-size --num-attention-heads"):
        model_from_flags(["--num-layers", "4", "--num-experts", "8"])
    fm = model_from_flags([*SHAPE, "--group-query-attention", "--num-query-groups", "2", "--kv-channels", "16",
                           "--swiglu", "--untie-embeddings-and-output-weights", "--vocab-size", "128"])
    assert fm.notes and "multi-head" in fm.notes[0]  # GQA priced as MHA, said so


def _plan_without_meta(path) -> dict:
    d = HeteroPlan.load(path).to_dict()
    d.pop("meta")
    return d


@pytest.mark.parametrize("mode", [["--even", "--attention-ranks", "1", "--expert-ranks", "2", "--schedule", "zebra"],
                                  ["--cluster", "mini-2a40-2v100"]])
def test_plan_from_flags_equals_plan_from_yaml(tmp_path, capsys, mode):
    a, b = tmp_path / "yaml.json", tmp_path / "flags.json"
    search = ["--seq-len", "32", "--global-batch", "8"] if "--cluster" in mode else []
    assert main([*mode, *search, "--model", "tiny-dense", "-o", str(a)]) == 0
    assert main([*mode, "-o", str(b), "--", *TINY_DENSE]) == 0  # seq len and batch from --seq-length / --global-batch-size
    assert _plan_without_meta(a) == _plan_without_meta(b)
    plan = HeteroPlan.load(b)
    assert plan.dense_layers == [0] and plan.num_layers == 2 and plan.meta["model_flags"] == TINY_DENSE


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
    assert main(["--cluster", "mini-2a40-2v100", "--", *SHAPE, "--mtp-num-layers", "1"]) == 2
    assert "1 MTP layers (--mtp-num-layers): the search's cost model does not price multi-token prediction " \
           "layers; make an even plan" in capsys.readouterr().err
    assert main(["--even", "--attention-ranks", "1", "--expert-ranks", "1", "--schedule", "zebra", "--", *SHAPE,
                 "--mtp-num-layers", "1"]) == 2
    assert "zebra has no stage for the MTP block" in capsys.readouterr().err


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
