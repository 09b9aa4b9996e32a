"""`hetermoe pretrain`: Megatron's own pretrain() with Megatron-LM's flags, with or without a checkout.

    hetermoe pretrain [--nproc N] <Megatron-LM pretrain_gpt.py flags> [--hetero-plan plan.json]
    torchrun --nproc-per-node N -m megatron_hetermoe.megatron_lm.pretrain <the same flags>

Where Megatron's training loop comes from, in this order:
- MEGATRON_LM_DIR names a Megatron-LM checkout: its own pretrain_gpt.py runs (with the patch from
  patches/ applied, which the command checks), on either release line.
- megatron-core >= 0.19 is installed: its wheel ships `megatron.training` (pretrain(), arguments,
  checkpointing, the loop) but not pretrain_gpt.py. This module fulfils pretrain_gpt.py's contract
  for GPT pre-training from Megatron's public API (the forward step and its loss, the datasets
  provider, the model provider for a --hetero-plan run) and calls pretrain() the way pretrain_gpt.py
  does, so every flag is parsed, validated and honoured by Megatron itself. A plain run's model is
  built by Megatron from the flags (the config container's GPT model config); a --hetero-plan run's
  by the plugin's builder, with the same hooks as the patched pretrain_gpt.py (hooks.py).
- Otherwise (megatron-core 0.16.x has no megatron.training) the command says what is needed.
What pretrain_gpt.py also does and this module does not (SFT, FIM, packed sequences, cached-logit
distillation, ModelOpt, --spec modules) is refused by name.

`hetermoe pretrain` outside torchrun starts the ranks itself with torch.distributed.run on this host
(--nproc, default: the plan's world size, else 1); under torchrun (RANK set) it is one rank.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import socket
import subprocess
import sys
import time
from functools import lru_cache, partial
from pathlib import Path
from typing import Any, Callable

from megatron_hetermoe.errors import UserError
from megatron_hetermoe.shims import datasets_utils

_PROGRAM_START = time.time()

# pretrain_gpt.py's flags whose code path this module does not carry: (dest, flag, what it asks for).
NOT_PROVIDED = (
    ("sft", "--sft", "supervised fine-tuning datasets with packed sequences"),
    ("fim_data", "--fim-data", "fill-in-the-middle datasets"),
    ("logits_load_dir", "--logits-load-dir", "distillation from cached teacher logits"),
    ("dataloader_inter_document_masking", "--dataloader-inter-document-masking", "packed-sequence attention"),
    ("hybrid_context_parallel", "--hybrid-context-parallel", "hybrid context parallelism"),
    ("spec", "--spec", "a layer spec module"),
    ("modelopt_enabled", "ModelOpt", "ModelOpt's model builder and loss"),
)

BATCH_KEYS = ("attention_mask", "labels", "loss_mask", "position_ids", "tokens")
SPIKY_LOSS_FACTOR = 10  # Megatron-LM's: a loss 10x the largest seen is spiky


class PretrainError(UserError):
    """A `hetermoe pretrain` request that cannot run here (the message says what to install, set or drop)."""


def training_source() -> tuple[str, Path | None]:
    """("checkout", dir) for MEGATRON_LM_DIR, ("wheel", None) for megatron-core >= 0.19's
    megatron.training; raises a user error naming both options otherwise."""
    src = os.environ.get("MEGATRON_LM_DIR")
    if src:
        from megatron_hetermoe.shims.pretrain_gpt import checkout_version, patch_for

        checkout = Path(src)
        try:
            version, patch = checkout_version(checkout), patch_for(checkout)
        except ValueError as e:
            raise PretrainError(f"MEGATRON_LM_DIR={src}: {e}") from None
        script = checkout / "pretrain_gpt.py"
        if not script.is_file() or "hetero_pretrain" not in script.read_text():
            raise PretrainError(
                f"MEGATRON_LM_DIR={src} (core_v{'.'.join(map(str, version))}): its pretrain_gpt.py does not have "
                f"HeterMoE's patch; apply it with `git -C {src} apply {_patch_path(patch)}`")
        return "checkout", checkout
    from megatron_hetermoe.compat import mcore_version

    has_training = importlib.util.find_spec("megatron") is not None and \
        importlib.util.find_spec("megatron.training") is not None
    if has_training and mcore_version()[:2] >= (0, 19):
        return "wheel", None
    found = ".".join(map(str, mcore_version()))
    raise PretrainError(
        f"Megatron's pretrain() is not here: megatron-core {found} ships no megatron.training (0.19 and later "
        f"do; they need Python >= 3.12). Install megatron-core>=0.19, or set MEGATRON_LM_DIR to a Megatron-LM "
        f"checkout (core_v0.16.1 or core_v0.19.0) with patches/'s pretrain_gpt.py patch applied. The plugin's own "
        f"trainer takes the same flags: hetermoe train")


def _patch_path(name: str) -> str:
    """The patch in this source tree's patches/, else where it is in megatron-hetermoe's repository."""
    path = Path(__file__).resolve().parents[2] / "patches" / name
    return str(path) if path.is_file() else f"<megatron-hetermoe repository>/patches/{name}"


# ---- the ranks: pretrain_gpt.py's contract, from Megatron's public API (megatron-core >= 0.19) ----

@lru_cache(maxsize=1)
def _transformer_config(args_id: int):
    from megatron.training import get_args
    from megatron.training.arguments import core_transformer_config_from_args

    return core_transformer_config_from_args(get_args())


def _config():
    from megatron.training import get_args

    return _transformer_config(id(get_args()))


def _mtp_on_this_rank(vp_stage: int | None) -> bool:
    from megatron.core.transformer.multi_token_prediction import mtp_on_this_rank

    config = _config()
    return mtp_on_this_rank(layout=config.pipeline_model_parallel_layout, mtp_num_layers=config.mtp_num_layers,
                            ignore_virtual=False, vp_stage=vp_stage)


def get_batch(data_iterator, vp_stage: int | None = None) -> dict[str, Any]:
    """This rank's micro-batch: read on tensor-parallel rank 0, broadcast over its group, cut for
    context parallelism. Stages that neither embed nor compute the loss (nor MTP) get Nones."""
    import torch
    from megatron.core import mpu
    from megatron.core.parallel_state import get_context_parallel_group
    from megatron.core.utils import get_batch_on_this_cp_rank, get_batch_on_this_tp_rank
    from megatron.training import get_args
    from megatron.training.utils import is_first_or_last_pipeline_stage

    args = get_args()
    mtp_here = _mtp_on_this_rank(vp_stage)
    if not is_first_or_last_pipeline_stage(vp_stage) and not mtp_here:
        return dict.fromkeys(BATCH_KEYS)
    tp_rank = mpu.get_tensor_model_parallel_rank()
    batch: dict[str, Any] = {}
    if tp_rank == 0:
        raw = next(data_iterator)
        device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
        batch = {k: None for k in ("cu_seqlens", "cu_seqlens_padded", "max_seqlen", "local_cp_size")}
        batch.update({k: raw[k].to(device, non_blocking=True) if raw.get(k) is not None else None
                      for k in BATCH_KEYS})
    batch = get_batch_on_this_tp_rank(
        batch, has_cu_seqlens=False, is_hybrid_cp=False,
        create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
        broadcast_src_rank=mpu.get_tensor_model_parallel_src_rank(),
        broadcast_group=mpu.get_tensor_model_parallel_group(), cp_size=args.context_parallel_size,
        tp_rank=tp_rank, micro_batch_size=args.micro_batch_size, seq_length=args.seq_length,
        mtp_on_this_rank=mtp_here, pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        is_pipeline_first_stage=mpu.is_pipeline_first_stage(), is_pipeline_last_stage=mpu.is_pipeline_last_stage())
    batch = get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=get_context_parallel_group())
    return {k: batch.get(k) for k in BATCH_KEYS}


def loss_func(loss_mask, output_tensor, model=None):
    """Megatron's GPT loss: the masked sum over this micro-batch, its token count, and the
    `lm loss` report (sum, tokens) that the loop reduces over data-parallel ranks; NaN/Inf and
    spiky losses go to the rerun state machine as --check-for-nan-in-loss-and-grad and
    --check-for-spiky-loss ask."""
    import torch
    from megatron.core.rerun_state_machine import get_rerun_state_machine
    from megatron.training import get_args

    args = get_args()
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    report = {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}
    rerun = get_rerun_state_machine()
    if args.check_for_nan_in_loss_and_grad:
        for bad, what in ((torch.isnan, "NaN"), (torch.isinf, "Inf")):
            rerun.validate_result(result=loss, rejection_func=bad, tolerance=0.0, fatal=True,
                                  message=f"found {what} in local forward loss calculation")
    if args.check_for_spiky_loss:
        rerun.validate_result(
            result=loss, rejection_func=partial(rerun.is_unexpectedly_large, threshold=SPIKY_LOSS_FACTOR,
                                                context="loss"),
            message="Spiky loss", tolerance=0.0, fatal=False)
    return loss, num_tokens, report


def forward_step(data_iterator, model, return_schedule_plan: bool = False):
    """One micro-batch through the model; returns (output, the loss function for it)."""
    from megatron.core.utils import StragglerDetector, get_attr_wrapped_model
    from megatron.training import get_args, get_timers

    stimer = StragglerDetector()  # one detector per process (--log-straggler)
    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    with stimer(bdata=True):
        b = get_batch(data_iterator, get_attr_wrapped_model(model, "vp_stage"))
    timers("batch-generator").stop()
    with stimer:
        if return_schedule_plan:
            if not get_args().overlap_moe_expert_parallel_comm:
                raise ValueError("a schedule plan is built only with --overlap-moe-expert-parallel-comm")
            plan = model.build_schedule_plan(b["tokens"], b["position_ids"], b["attention_mask"],
                                             labels=b["labels"], loss_mask=b["loss_mask"])
            return plan, partial(loss_func, b["loss_mask"], model=model)
        output = model(b["tokens"], b["position_ids"], b["attention_mask"], labels=b["labels"],
                       loss_mask=b["loss_mask"])
    return output, partial(loss_func, b["loss_mask"], model=model)


def _dataset_built_on_rank(vp_stage: int | None = None) -> bool:
    from megatron.core import mpu
    from megatron.training.utils import is_first_or_last_pipeline_stage

    if mpu.get_tensor_model_parallel_rank() != 0:
        return False
    return is_first_or_last_pipeline_stage(vp_stage) or _mtp_on_this_rank(vp_stage)


def gpt_dataset_config(args: argparse.Namespace):
    """megatron-core's GPTDatasetConfig from the flags, field by field as Megatron-LM fills it."""
    import json

    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
    from megatron.training.utils import get_blend_and_blend_per_split

    blend, blend_per_split = get_blend_and_blend_per_split(args)
    sequences_per_dataset = None
    if args.per_dataset_sequences_path is not None:
        with open(args.per_dataset_sequences_path) as f:
            sequences_per_dataset = json.load(f)
    return GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length, blend=blend, blend_per_split=blend_per_split,
        split=args.split, multiple_validation_sets=args.multiple_validation_sets,
        full_validation=args.full_validation, num_dataset_builder_threads=args.num_dataset_builder_threads,
        path_to_cache=args.data_cache_path, mmap_bin_files=args.mmap_bin_files, tokenizer=build_tokenizer(args),
        reset_position_ids=args.reset_position_ids, reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss, create_attention_mask=args.create_attention_mask_in_dataloader,
        object_storage_cache_path=args.object_storage_cache_path,
        mid_level_dataset_surplus=args.mid_level_dataset_surplus,
        allow_ambiguous_pad_tokens=args.allow_ambiguous_pad_tokens, fast_cache_load=args.dataloader_fast_cache_load,
        sequences_per_dataset=sequences_per_dataset, defer_npy_index_mmap=args.dataloader_defer_npy_index_mmap,
        context_parallel_size=args.context_parallel_size, data_parallel_size=args.data_parallel_size,
        sequence_parallel_size=args.tensor_model_parallel_size * args.sequence_parallel,
        hybrid_context_parallel=False, inter_document_masking=False)


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage: int | None = None):
    """GPT datasets (mock with --mock-data) built by megatron-core's BlendedMegatronDatasetBuilder."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, MockGPTDataset
    from megatron.training import get_args, print_rank_0

    args = get_args()
    kind = MockGPTDataset if args.mock_data else GPTDataset
    print_rank_0("> building train, validation, and test datasets for GPT ...")
    built = BlendedMegatronDatasetBuilder(kind, train_val_test_num_samples, partial(_dataset_built_on_rank, vp_stage),
                                          gpt_dataset_config(args)).build()
    print_rank_0("> finished creating GPT datasets ...")
    return built


train_valid_test_datasets_provider.is_distributed = True  # built on every rank's own schedule


def get_embedding_ranks(pp_ranks: list[int]) -> list[int]:
    """The pipeline ranks holding an embedding: the first, the last with tied embeddings, and MTP's."""
    from megatron.core.transformer.multi_token_prediction import get_mtp_ranks
    from megatron.training import get_args

    ranks = [pp_ranks[0]]
    if len(pp_ranks) > 1:
        if not get_args().untie_embeddings_and_output_weights:
            ranks.append(pp_ranks[-1])
        ranks.extend(get_mtp_ranks(pp_ranks, _config()))
    return sorted(set(ranks))


def model_provider(builder: Callable, pre_process: bool = True, post_process: bool = True,
                   vp_stage: int | None = None, config=None, pg_collection=None):
    """pretrain()'s model_provider for a --hetero-plan run: the plugin's builder with Megatron's args."""
    from megatron.training import get_args

    return builder(get_args(), pre_process, post_process, vp_stage, config=config, pg_collection=pg_collection)


def refuse_not_provided(args: argparse.Namespace) -> None:
    """Name the flags that ask for a pretrain_gpt.py path this module does not carry."""
    asked = [(flag, what) for dest, flag, what in NOT_PROVIDED if getattr(args, dest, None)]
    if asked:
        raise PretrainError("; ".join(f"{flag} ({what})" for flag, what in asked)
                          + ": not provided by `hetermoe pretrain` without a checkout; run Megatron-LM's "
                          "pretrain_gpt.py (set MEGATRON_LM_DIR to a patched checkout), or drop the flag")


def run_rank(argv: list[str]) -> None:
    """One rank (under torchrun): pretrain() as pretrain_gpt.py calls it, with this module's providers."""
    from megatron.core.enums import ModelType
    from megatron.training import inprocess_restart, pretrain
    from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args

    from megatron_hetermoe.megatron_lm import add_hetero_args, hetero_pretrain, hetero_requested, megatron_on_cpu

    sys.argv = [sys.argv[0], *argv]  # Megatron's parser reads sys.argv
    if {"-h", "--help"} & set(argv):
        from megatron.training.arguments import parse_args

        parse_args(add_hetero_args)  # prints Megatron's help with the --hetero-* flags, and exits
    try:
        from megatron.training import set_startup_timestamps

        set_startup_timestamps(program_start=_PROGRAM_START, main_entry=time.time())
    except ImportError:  # a 0.19 release without the startup report
        pass
    run, store = inprocess_restart.maybe_wrap_for_inprocess_restart(pretrain)
    parse, extra = parse_and_validate_args, {}
    if hetero_requested(argv):
        run, builder = hetero_pretrain(run, argv)
        parse = run.parse_with_hooks(parse)
        # Megatron builds the model with model_provider: the hooks drop the container's model.
        extra["model_provider"] = partial(model_provider, builder)
    else:
        run = megatron_on_cpu(run)
    args = parse(extra_args_provider=add_hetero_args, args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
    refuse_not_provided(args)
    container = pretrain_cfg_container_from_args(args, gpt_config_from_args(args))
    with datasets_utils.prebuilt_helpers():
        run(container, train_valid_test_datasets_provider, ModelType.encoder_or_decoder, forward_step, store=store,
            get_embedding_ranks=get_embedding_ranks, **extra)


def build_parser() -> argparse.ArgumentParser:
    """`hetermoe pretrain`'s own flags (cli/pretrain.py), described by this module's first paragraph."""
    from megatron_hetermoe.cli.pretrain import build_parser

    return build_parser(__doc__.split("\n\n")[0])


def _take_nproc(argv: list[str]) -> tuple[int | None, bool, list[str]]:
    known, rest = build_parser().parse_known_args(argv)
    if known.nproc is not None and known.nproc < 1:
        raise PretrainError(f"--nproc {known.nproc}: give at least 1 rank")
    return known.nproc, known.help, rest


def _plan_world(argv: list[str]) -> int | None:
    from megatron_hetermoe.megatron_lm import hetero_plan_path

    path = hetero_plan_path(argv)
    if path is None:
        return None
    from megatron_hetermoe.plan.hetero_plan import HeteroPlan

    if path == "auto":  # the job's GPUs: --hetero-gpus (CPU ranks), else --nproc
        from megatron_hetermoe.cli.pretrain import hetero_plan_parser
        from megatron_hetermoe.planner.inventory import Inventory

        gpus = hetero_plan_parser().parse_known_args(argv)[0].hetero_gpus
        if gpus is None:
            raise PretrainError("--hetero-plan auto outside torchrun: give --nproc N (the ranks to start on this "
                                "host) or --hetero-gpus (the GPUs to plan for, one per rank)")
        return Inventory.from_spec(gpus).size
    return HeteroPlan.load(path).world_size


def _checkout_env(checkout: Path) -> dict[str, str]:
    """This environment with the checkout first on PYTHONPATH (its megatron/, as pretrain_gpt.py expects)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(checkout), *filter(None, [os.environ.get("PYTHONPATH")])])}


def describe(source: tuple[str, Path | None]) -> str:
    """Which pretrain() runs, in words."""
    kind, checkout = source
    if kind == "checkout":
        return f"Megatron-LM's {checkout / 'pretrain_gpt.py'}"
    from megatron_hetermoe.compat import mcore_version

    where = Path(importlib.util.find_spec("megatron.training").origin).parent
    return f"megatron-core {'.'.join(map(str, mcore_version()))}'s pretrain() ({where}) with the plugin's GPT providers"


def launch_command(argv: list[str], nproc: int, source: tuple[str, Path | None]) -> list[str]:
    """The torch.distributed.run command that starts `nproc` ranks of this run on this host."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    kind, checkout = source
    entry = [str(checkout / "pretrain_gpt.py")] if kind == "checkout" else ["-m", __name__]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
            str(port), *entry, *argv]


def _help() -> int:
    """This command's flags, then Megatron-LM's (from the pretrain() that would run)."""
    build_parser().print_help()
    try:
        source = training_source()
    except PretrainError as e:
        print(f"\nMegatron-LM's flags: not available here ({e})")
        return 0
    print(f"\nMegatron-LM's flags ({describe(source)}):", flush=True)
    if source[0] == "checkout":
        return subprocess.run([sys.executable, str(source[1] / "pretrain_gpt.py"), "--help"],
                              env=_checkout_env(source[1])).returncode
    from megatron.training.arguments import parse_args

    from megatron_hetermoe.megatron_lm import add_hetero_args

    sys.argv = [sys.argv[0], "--help"]
    expand = argparse.HelpFormatter._expand_help

    def as_written(self, action):
        # megatron-core 0.19.2 has a flag whose help holds a bare "%" (argparse's own formatting of
        # it fails: Megatron's --help exits with a ValueError); that one is printed as written.
        try:
            return expand(self, action)
        except (ValueError, TypeError, KeyError):
            return action.help

    argparse.HelpFormatter._expand_help = as_written
    try:
        parse_args(add_hetero_args)  # argparse prints the help and exits
    except SystemExit as e:
        return int(e.code or 0)
    finally:
        argparse.HelpFormatter._expand_help = expand
    return 0


def main(argv: list[str] | None = None) -> int:
    """`hetermoe pretrain`: one rank under torchrun, else start the ranks on this host."""
    argv = list(sys.argv[1:] if argv is None else argv)
    nproc, want_help, argv = _take_nproc(argv)
    if want_help:
        return _help()
    source = training_source()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # a rank of a torchrun (or SLURM) job
        if nproc is not None:
            raise PretrainError(f"--nproc {nproc} under torchrun: the job's ranks are torchrun's (drop --nproc)")
        if source[0] == "checkout":
            raise PretrainError("under torchrun with MEGATRON_LM_DIR set, run the checkout's pretrain_gpt.py itself "
                              f"({source[1] / 'pretrain_gpt.py'})")
        run_rank(argv)
        return 0
    if nproc is None:
        nproc = _plan_world(argv) or 1
    print(f"hetermoe pretrain: {nproc} rank(s) on this host, {describe(source)}", flush=True)
    env = _checkout_env(source[1]) if source[0] == "checkout" else None
    return subprocess.run(launch_command(argv, nproc, source), env=env).returncode


if __name__ == "__main__":  # torchrun -m megatron_hetermoe.megatron_lm.pretrain
    from megatron_hetermoe.errors import run_command

    sys.exit(run_command("hetermoe pretrain", main))
