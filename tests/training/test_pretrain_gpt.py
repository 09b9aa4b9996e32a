"""`hetermoe train`'s pretrain_gpt.py form (`hetermoe train-gpt`, python -m megatron_hetermoe.training.pretrain_gpt):
Megatron-LM's flag names and meanings; a command line from which Megatron-LM would build or train another model is
refused; the rule by which `hetermoe train` picks this form or its config form."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_hetermoe.cli.train_forms import model_flags
from megatron_hetermoe.config import ModelConfig
from megatron_hetermoe.training import args as train_args
from megatron_hetermoe.training import command, pretrain_gpt
from megatron_hetermoe.training.pretrain_gpt import (
    EXTENSION_FLAGS,
    build_parser,
    check_flags,
    check_supported,
    megatron_flags,
    model_from_args,
    recipe_args,
)

ROOT = Path(__file__).resolve().parents[2]
TINY_FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "128",
              "--moe-ffn-hidden-size", "128", "--num-experts", "4", "--moe-router-topk", "2",
              "--moe-aux-loss-coeff", "0.01", "--seq-length", "32", "--max-position-embeddings", "32",
              "--vocab-size", "256"]
# The flags with which Megatron-LM builds and trains what this trainer always does (required here).
RECIPE = ["--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--disable-bias-linear",
          "--untie-embeddings-and-output-weights", "--hidden-dropout", "0", "--attention-dropout", "0",
          "--adam-beta2", "0.95", "--lr-decay-style", "cosine"]
RUN = [*TINY_FLAGS, *RECIPE, "--global-batch-size", "8"]


def _flags(p) -> set[str]:
    return {s for a in p._actions for s in a.option_strings if s.startswith("--") and s != "--help"}


def test_flag_names_are_megatron_lm_names():
    known = megatron_flags()
    # The list is Megatron-LM core_v0.16.1's whole parser (dataclass-generated flags included).
    assert len(known) > 600 and {"--num-layers", "--save", "--moe-router-topk", "--mock-data"} <= known
    ours = _flags(build_parser())
    not_megatron = ours - known
    assert not_megatron == ours & EXTENSION_FLAGS, \
        f"flags that look like Megatron's but are not: {sorted(not_megatron - EXTENSION_FLAGS)}"
    assert not (EXTENSION_FLAGS & known), "an extension flag shadows a Megatron-LM flag of the same name"
    assert len(ours & known) >= 45


def _run(args: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-W", "ignore", "-m", "megatron_hetermoe.training.pretrain_gpt", *args],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)


def test_ffn_default_is_megatrons():
    """Without --ffn-hidden-size Megatron-LM takes 4h, or with --swiglu 2/3 of it rounded down to a
    multiple of 64 (h=96: 256, not 384)."""
    p = build_parser()
    shape = ["--num-layers", "2", "--hidden-size", "96", "--num-attention-heads", "6", "--num-experts", "4",
             "--seq-length", "32", "--vocab-size", "256"]
    assert model_from_args(p.parse_args([*shape, "--swiglu"])).ffn_hidden_size == 256
    assert model_from_args(p.parse_args(shape)).ffn_hidden_size == 384
    assert model_from_args(p.parse_args([*shape, "--swiglu", "--ffn-hidden-size", "100"])).ffn_hidden_size == 100


def test_router_balancing_flags_keep_megatron_meaning():
    p = build_parser()
    m = model_from_args(p.parse_args(["--model", "tiny"]))
    # Megatron's defaults: aux_loss, softmax scores, no expert bias, update rate 1e-3.
    assert (m.moe_router_load_balancing_type, m.moe_router_score_function, m.moe_router_enable_expert_bias,
            m.moe_router_bias_update_rate) == ("aux_loss", "softmax", False, 1e-3)
    m = model_from_args(p.parse_args(["--model", "tiny", "--moe-router-load-balancing-type", "none",
                                      "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
                                      "--moe-router-bias-update-rate", "0.01"]))
    assert (m.moe_router_load_balancing_type, m.moe_router_score_function, m.moe_router_enable_expert_bias,
            m.moe_router_bias_update_rate) == ("none", "sigmoid", True, 0.01)
    from megatron_hetermoe.models.builder import transformer_config
    from megatron_hetermoe.config import ParallelConfig

    c = transformer_config(m, ParallelConfig())
    assert (c.moe_router_load_balancing_type, c.moe_router_score_function, c.moe_router_enable_expert_bias,
            c.moe_router_bias_update_rate) == ("none", "sigmoid", True, 0.01)
    for flags, want in ((["--moe-router-load-balancing-type", "sinkhorn"], "'sinkhorn' is not supported"),
                        (["--moe-router-load-balancing-type", "aux_loss", "seq_aux_loss"],
                         "combined load-balancing types are not supported here"),
                        (["--moe-router-enable-expert-bias"], "sigmoid scores only")):
        with pytest.raises(ValueError, match=want):
            model_from_args(p.parse_args(["--model", "tiny", *flags]))


def test_unsupported_and_unknown_flags_are_named():
    r = _run(TINY_FLAGS + ["--use-flash-attn", "--moe-use-legacy-grouped-gemm", "--not-a-flag", "3"])
    assert r.returncode == 2
    assert "unsupported Megatron-LM flag(s): --use-flash-attn --moe-use-legacy-grouped-gemm" in r.stderr
    assert "unknown flag(s): --not-a-flag" in r.stderr
    r = _run(TINY_FLAGS + ["--lr-warmup", "3"])  # a prefix of --lr-warmup-iters: no abbreviations
    assert r.returncode == 2 and "unknown flag(s): --lr-warmup" in r.stderr
    r = _run(RUN + ["--eval-iters", "10"])
    assert r.returncode == 2 and "--eval-iters 10: evaluation is not implemented" in r.stderr
    r = _run(["--num-layers", "2", "--hidden-size", "64", *RECIPE, "--global-batch-size", "8"])
    assert r.returncode == 2 and "give --num-attention-heads --num-experts --seq-length" in r.stderr


def test_model_shape_and_vocab_padding(tmp_path):
    p = build_parser()
    m = model_from_args(p.parse_args(["--num-layers", "3", "--hidden-size", "96", "--num-attention-heads", "6",
                                      "--num-experts", "8", "--seq-length", "128", "--vocab-size", "1000"]))
    # Megatron's defaults: ffn = 4h, moe ffn = ffn, top-2, no aux loss; vocab padded to 128 x TP.
    assert (m.ffn_hidden_size, m.moe_ffn_hidden_size, m.moe_router_topk, m.moe_aux_loss_coeff) == (384, 384, 2, 0.0)
    assert m.vocab_size == 1024
    m = model_from_args(p.parse_args(["--model", "tiny", "--vocab-size", "1000", "--tensor-model-parallel-size", "2",
                                      "--num-experts", "8"]))
    assert (m.num_layers, m.hidden_size, m.num_experts, m.vocab_size) == (2, 64, 8, 1024)
    m = model_from_args(p.parse_args(["--model", "tiny", "--vocab-size", "1030"]))
    assert m.vocab_size == 1152
    with pytest.raises(ValueError, match="--max-position-embeddings 16 < --seq-length 32"):
        model_from_args(p.parse_args(["--model", "tiny", "--max-position-embeddings", "16"]))
    from megatron_hetermoe.data.tokenizer import train_bpe

    train_bpe(["some real words " * 20, "more words here"], 300, tmp_path / "tokenizer.json")
    m = model_from_args(p.parse_args(["--model", "tiny", "--tokenizer-type", "HuggingFaceTokenizer",
                                      "--tokenizer-model", str(tmp_path / "tokenizer.json")]))
    assert m.vocab_size == 384  # the tokenizer's 300, padded like Megatron


@pytest.mark.slow
def test_same_losses_as_hetermoe_train(tmp_path):
    """The Megatron flags describe the same run as `hetermoe train --model tiny`."""
    common = ["--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "3", "--lr", "1e-3",
              "--expert-model-parallel-size", "2", "--nproc", "2", "--seed", "42", "--min-lr", "1e-4"]
    r = _run(TINY_FLAGS + RECIPE + common + ["--mock-data", "--golden-values-out", str(tmp_path / "a.json")])
    assert r.returncode == 0, r.stderr[-3000:]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r2 = subprocess.run([sys.executable, "-W", "ignore", "-m", "megatron_hetermoe.cli", "train", "--model", "tiny",
                         *common, "--golden-values-out", str(tmp_path / "b.json")],
                        capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert r2.returncode == 0, r2.stderr[-3000:]
    import json

    a, b = (json.loads((tmp_path / f).read_text())["lm loss"]["values"] for f in ("a.json", "b.json"))
    assert len(a) == 3 and a == b


def test_megatron_flag_list_matches_checkout():
    """Remake the list from a Megatron-LM checkout when one is given (MEGATRON_LM_DIR): at core_v0.16.1 it is
    megatron_lm_flags.txt exactly; at another release (core_v0.19.0) every Megatron-LM flag this entry point
    takes is still one of its flags, and no extension flag clashes with one."""
    import re

    from megatron_hetermoe.compat import mcore_version
    from megatron_hetermoe.megatron_lm import checkout_version

    src = os.environ.get("MEGATRON_LM_DIR")
    if not src:
        pytest.skip("set MEGATRON_LM_DIR to a Megatron-LM core_v0.16.1 (or core_v0.19.0) tree to check "
                    "megatron_lm_flags.txt")
    version = checkout_version(src)
    if version[:2] != mcore_version()[:2]:
        pytest.skip(f"the checkout is megatron-core {version[0]}.{version[1]}, this environment has "
                    f"{'.'.join(map(str, mcore_version()[:2]))}: its parser imports the checkout's megatron/, run with "
                    f"the environment of the checkout's release (make compat for 0.19)")
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "megatron_flags.py"), "--checkout", src],
                       capture_output=True, text=True, timeout=300)
    missing = re.search(r"megatron\.training needs '([^']+)'", r.stderr)
    if r.returncode != 0 and missing:
        pytest.skip(f"importing Megatron-LM's megatron.training needs the package {missing.group(1)!r} (Megatron-LM's "
                    f"own requirements): pip install --target DEPS six regex pydantic triton, then PYTHONPATH=DEPS")
    assert r.returncode == 0, r.stderr[-2000:]
    remade = {line for line in r.stdout.splitlines() if line.startswith("--")}
    if version[:2] == (0, 16):
        assert remade == set(megatron_flags())
    else:
        ours = _flags(build_parser()) & megatron_flags()
        assert ours <= remade, f"Megatron-LM flags taken here that this release lacks: {sorted(ours - remade)}"
        assert not (EXTENSION_FLAGS & remade), \
            f"extension flags that this release defines: {sorted(EXTENSION_FLAGS & remade)}"


def test_cli_registers_pretrain():
    from megatron_hetermoe.commands import SUBCOMMANDS

    assert SUBCOMMANDS["train-gpt"][0] == f"{pretrain_gpt.__name__}:main"
    assert SUBCOMMANDS["train"][0] == f"{command.__name__}:main"


# ---- `hetermoe train`: one command, two forms ----------------------------------------------------

def _hetermoe(args: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-W", "ignore", "-m", "megatron_hetermoe.cli", *args],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)


def test_train_with_pretrain_gpt_flags_runs_as_train_gpt_bitwise(tmp_path):
    """`hetermoe train <pretrain_gpt.py flags>` is the pretrain_gpt.py form: the same run, loss for loss, as
    `hetermoe train-gpt` with the same flags, with Megatron-LM's defaults (--min-lr 0, not the config form's)."""
    import json

    flags = [*RUN, "--micro-batch-size", "2", "--train-iters", "2", "--expert-model-parallel-size", "2", "--nproc", "2",
             "--mock-data"]
    runs = {cmd: _hetermoe([cmd, *flags, "--golden-values-out", str(tmp_path / f"{cmd}.json")])
            for cmd in ("train", "train-gpt")}
    for cmd, r in runs.items():
        assert r.returncode == 0, (cmd, r.stderr[-3000:])
        # 2 iterations of cosine decay from 1e-3: the second at the midpoint to the form's --min-lr 0
        # (the config form's default 1e-4 would give 5.5e-4).
        assert "learning rate: 5.000000E-04" in r.stdout, (cmd, r.stdout[-2000:])
    a, b = (json.loads((tmp_path / f"{cmd}.json").read_text())["lm loss"]["values"] for cmd in runs)
    assert len(a) == 2 and a == b


def _parsed_by(monkeypatch, argv: list[str]):
    """`hetermoe train ARGV` up to the run: the namespace run_from_args gets (nothing starts), with the
    model's YAML (the pretrain_gpt.py form writes the shape to a file that lives only during the call)."""
    seen = {}

    def spy(p, a):
        seen["a"], seen["model"] = a, ModelConfig.load(a.model)
        return 0

    monkeypatch.setattr(train_args, "run_from_args", spy)  # both forms run through it
    assert command.main(argv) == 0
    return seen["a"], seen["model"]


def test_config_form_is_unchanged(monkeypatch):
    """Without a flag of the pretrain_gpt.py form, `hetermoe train` parses with its own parser and defaults."""
    config = train_args.build_parser()
    assert {o for act in config._actions for o in act.option_strings}.isdisjoint(model_flags())
    a, model = _parsed_by(monkeypatch, [])
    assert (a.model, a.global_batch_size, a.lr, a.min_lr, a.train_iters) == ("tiny", 8, 1e-3, 1e-4, 5)
    assert not hasattr(a, "num_layers") and model.name == "tiny"
    a, _ = _parsed_by(monkeypatch, ["--model", "tiny", "--seq-length", "64", "--moe-aux-loss-coeff", "0.1"])
    assert (a.model, a.seq_length, a.moe_aux_loss_coeff, a.min_lr) == ("tiny", 64, 0.1, 1e-4)


def test_dispatch_rule():
    """The pretrain_gpt.py form's own flags are exactly those the config form lacks, the recipe flags among
    them (so every command line that form accepts picks it); a flag counts by its full name only."""
    from megatron_hetermoe.cli.train_forms import pretrain_gpt_form_flag
    from megatron_hetermoe.cli.train_gpt import RECIPE_FLAGS

    def opts(p):
        return {o for act in p._actions for o in act.option_strings}

    assert model_flags() == opts(build_parser()) - opts(train_args.build_parser())
    assert {flag for flag, _, _ in RECIPE_FLAGS.values()} <= model_flags()
    assert pretrain_gpt_form_flag(RUN) == "--num-layers"
    assert pretrain_gpt_form_flag(["--model", "tiny", "--lr", "1e-3", "--seq-length", "64"]) is None
    assert pretrain_gpt_form_flag(["--model", "tiny", "--vocab-size=512"]) == "--vocab-size"
    assert pretrain_gpt_form_flag(["--model", "tiny", *RECIPE]) == "--swiglu"
    assert pretrain_gpt_form_flag(["--num-lay", "2", "-h"]) is None  # no abbreviations: the config form refuses it


def test_model_with_pretrain_gpt_flags_is_that_form(monkeypatch, capsys):
    """--model with a flag of the pretrain_gpt.py form: that form, starting from the YAML (as train-gpt does);
    without the recipe flags it is refused by name, saying which flag picked the form."""
    with pytest.raises(SystemExit) as e:
        command.main(["--model", "tiny", "--num-experts", "8"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "usage: hetermoe train " in err
    assert "missing here: --swiglu (without it: GeLU MLPs)" in err
    assert ("[hetermoe train read these as Megatron-LM pretrain_gpt.py flags: --num-experts is one only that form "
            "takes") in err
    # A refusal once the form's own checks passed has no note: the line is pretrain_gpt.py's beyond doubt.
    with pytest.raises(SystemExit):
        command.main([*RUN, "--nproc", "0"])
    err = capsys.readouterr().err
    assert "--nproc 0: start 1 to" in err and "read these as" not in err
    # train-gpt is that form for any flags: without a form flag it still asks for the recipe, with no note.
    with pytest.raises(SystemExit):
        pretrain_gpt.main(["--model", "tiny", "--global-batch-size", "8"])
    err = capsys.readouterr().err
    assert "missing here: --swiglu" in err and "read these as" not in err
    # The config form refuses a flag of neither form as before.
    with pytest.raises(SystemExit):
        command.main(["--model", "tiny", "--num-lay", "2"])
    assert "unrecognized arguments: --num-lay 2" in capsys.readouterr().err
    a, model = _parsed_by(monkeypatch, ["--model", "tiny", "--num-experts", "8", *RECIPE, "--global-batch-size", "4"])
    assert (model.num_layers, model.hidden_size, model.num_experts, a.min_lr, a.global_batch_size) == (2, 64, 8, 0.0, 4)


def test_train_help_lists_both_forms(capsys):
    with pytest.raises(SystemExit):
        command.main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "pretrain_gpt.py form only:" in out and "`hetermoe train-gpt --help`" in out
    assert all(f in out.split("pretrain_gpt.py form only:")[1].split() for f in model_flags())
    with pytest.raises(SystemExit):
        command.main(["--num-layers", "2", "--help"])  # the pretrain_gpt.py form's own help
    out = capsys.readouterr().out
    assert out.startswith("usage: hetermoe train ") and "model (Megatron-LM flags)" in out


def _refusal(argv: list[str]) -> str:
    with pytest.raises(ValueError) as e:
        check_supported(build_parser().parse_args(argv))
    return str(e.value)


MISSING = {"--swiglu": "GeLU MLPs", "--normalization RMSNorm": "LayerNorm",
           "--position-embedding-type rope": "learned absolute position embeddings",
           "--disable-bias-linear": "biased linear layers",
           "--untie-embeddings-and-output-weights": "tied input and output embeddings",
           "--hidden-dropout 0": "hidden dropout 0.1", "--attention-dropout 0": "attention dropout 0.1",
           "--adam-beta2 0.95": "Adam beta2 0.999", "--lr-decay-style cosine": "linear LR decay"}


def test_missing_recipe_flags_are_refused_by_name():
    """Without the recipe's flags Megatron-LM builds another model (GeLU, LayerNorm, ...) or trains it
    otherwise: each missing flag is named with what Megatron-LM would do, and the fix is given."""
    r = subprocess.run([sys.executable, "-W", "ignore", "-m", "megatron_hetermoe.cli", "train-gpt", *TINY_FLAGS,
                        "--global-batch-size", "8"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    for flag, instead in MISSING.items():
        assert f"{flag} (without it: {instead})" in r.stderr, (flag, r.stderr[-2000:])
    assert "Add them, or run `hetermoe pretrain`" in r.stderr and "MEGATRON_LM_DIR" in r.stderr
    assert " iteration " not in r.stdout
    # One flag missing: that one alone is named (a dropout of 0 given is not "missing").
    for i, flag in enumerate(MISSING):
        n = len(flag.split())
        start = sum(len(f.split()) for f in list(MISSING)[:i])
        err = _refusal([*TINY_FLAGS, *RECIPE[:start], *RECIPE[start + n:], "--global-batch-size", "8"])
        assert f"missing here: {flag} (without it: {MISSING[flag]}). Add them" in err, err


def test_full_recipe_is_accepted():
    assert recipe_args() == RECIPE
    check_flags([*RUN, "--nproc", "2", "--micro-batch-size", "2"])  # raises FlagError on any refusal
    a = build_parser().parse_args(RUN)
    check_supported(a)
    assert (a.min_lr, a.eval_iters) == (0.0, None)  # Megatron-LM's min LR default


def test_flags_megatron_would_honour_otherwise_are_refused(tmp_path):
    """A flag taken but not honoured, or a default that differs from Megatron-LM's, is refused."""
    shape = [*TINY_FLAGS, *RECIPE]
    assert "--global-batch-size not given: Megatron-LM would take --micro-batch-size x the data-parallel size" \
        in _refusal(shape)
    assert "--eval-interval 5 without --eval-iters: Megatron-LM would evaluate" in \
        _refusal([*RUN, "--eval-interval", "5"])
    check_supported(build_parser().parse_args([*RUN, "--eval-interval", "5", "--eval-iters", "0"]))
    assert "--moe-router-topk 1: this trainer routes top-1 with the softmax before top-k" in \
        _refusal([*RUN, "--moe-router-topk", "1"])
    # Full recomputation outside zebra: refused by the run's validation (hetermoe train's too).
    from megatron_hetermoe.plan.hetero_plan import even_plan

    with pytest.raises(ValueError, match="--recompute-granularity full: this trainer recomputes only under the zebra"):
        check_flags([*RUN, "--recompute-granularity", "full"])
    plan = tmp_path / "plan.json"
    even_plan(2, 4, 1, 1, groups=1, num_microbatches=4).save(plan)  # distep; global batch 8 = 2 x 4 x 1
    with pytest.raises(ValueError, match="only under the zebra schedule"):
        check_flags([*RUN, "--recompute-granularity", "full", "--hetero-plan", str(plan)])
    check_flags([*RUN, "--recompute-granularity", "full", "--hetero-plan", str(plan), "--hetero-schedule", "zebra"])
    p = train_args.build_parser()

    def error(message: str):
        raise ValueError(message)

    p.error = error
    with pytest.raises(ValueError, match="--recompute-granularity full: this trainer recomputes only under the zebra"):
        train_args.validate_run(p, p.parse_args(["--model", "tiny", "--recompute-granularity", "full"]),
                                check_outputs=False)
    r = _run([*RUN, "--hidden-dropout", "0.1"])
    assert r.returncode == 2 and "argument --hidden-dropout: invalid choice: 0.1" in r.stderr


def test_kernel_flags_keep_megatron_meaning_and_refuse_what_cannot_run():
    """--transformer-impl and --moe-grouped-gemm are Megatron-LM's flags with its meaning; a request that
    cannot run on these (CPU) ranks is refused by name before any rank starts; without them the kernels are
    chosen and printed."""
    p = build_parser()
    a = p.parse_args(["--transformer-impl", "transformer_engine", "--moe-grouped-gemm"])
    assert (a.transformer_impl, a.moe_grouped_gemm) == ("transformer_engine", True)
    a = p.parse_args([])
    assert (a.transformer_impl, a.moe_grouped_gemm) == (None, None)  # not given: chosen automatically
    r = _run(RUN + ["--transformer-impl", "transformer_engine", "--nproc", "2", "--train-iters", "1"])
    assert r.returncode == 2 and "--transformer-impl transformer_engine:" in r.stderr, r.stderr[-2000:]
    r = _run(RUN + ["--transformer-impl", "local", "--moe-grouped-gemm", "--nproc", "2", "--train-iters", "1"])
    assert r.returncode == 2 and "GroupedMLP runs on CUDA ranks only" in r.stderr, r.stderr[-2000:]
    r = _run(RUN + ["--transformer-impl", "inference_optimized"])
    assert r.returncode == 2 and "invalid choice: 'inference_optimized'" in r.stderr
