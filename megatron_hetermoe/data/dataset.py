"""Training data: mock (Markov chain) or real (Megatron's indexed dataset through GPTDataset).

`make_data(cfg)` returns an object with `.microbatch(step, microbatch, micro_batch_size,
global_batch_size)`, the interface both trainers read. Global sample i of a step is
`step * global_batch_size + microbatch * micro_batch_size + i` for either source, so every
parallel layout (plain Megatron, any HeterMoE plan) sees the same samples in the same order.

Real data is built exactly as Megatron-LM's pretrain_gpt.py builds it: megatron-core's
BlendedMegatronDatasetBuilder + GPTDatasetConfig over --data-path prefixes (a blend of
"weight prefix" pairs allowed, `--data-path 0.3 A 0.7 B`: Megatron's BlendedDataset draws
samples from each prefix in proportion to its weight), with Megatron's --split and --seed
meanings; the shuffled sample index it writes is cached beside the data (or under
--data-cache-path).

Before any rank starts, every --data-path pair is checked (`check_data_files`): both files
exist, the .idx is whole, and the .bin is exactly as long as the .idx says (a truncated file,
or a .bin from another run, would otherwise fail deep inside a rank or train on garbage).
--split is checked the same way (Megatron's parser turns "a,b,c" into a division by zero).
"""
from __future__ import annotations

import argparse
import re
import struct
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from megatron_hetermoe.config import DataConfig
from megatron_hetermoe.data.tokenizer import build_tokenizer
from megatron_hetermoe.errors import UserError
from megatron_hetermoe.parallel.extension import MicrobatchSource

if TYPE_CHECKING:
    from megatron_hetermoe.config import TrainConfig

def data_tokenizer(data: DataConfig):
    """The tokenizer --tokenizer-type and its files name."""
    return build_tokenizer(data.tokenizer_type, data.tokenizer_model, data.vocab_file, data.merge_file,
                           data.vocab_size)


class DataError(UserError, ValueError):
    """A --data-path, --split or data file that cannot be read as asked; the message names it."""


class DataFileMissing(UserError, FileNotFoundError):
    """A --data-path prefix whose .bin or .idx does not exist."""


def blend(data_path: list[str]) -> tuple[list[str], list[float] | None]:
    """Megatron's reading of --data-path: prefixes, or "weight prefix" pairs (get_blend_from_list),
    with weights that are finite and >= 0, not all zero."""
    from megatron.core.datasets.utils import get_blend_from_list

    if not data_path:
        raise DataError("--data-path: give at least one prefix (or drop --data-path for mock data)")
    prefixes, weights = get_blend_from_list(list(data_path))
    if weights is not None and not (all(w >= 0 and w != float("inf") for w in weights) and sum(weights) > 0):
        raise DataError(f"--data-path {' '.join(data_path)}: blend weights {weights} must be finite, >= 0 and not "
                        f"all 0")
    return list(prefixes), weights


_IDX_HEADER = b"MMIDIDX\x00\x00"  # megatron-core's indexed dataset, version 1
_IDX_FIXED = 34  # header 9 + version 8 + dtype code 1 + sequence count 8 + document count 8


def check_indexed_pair(prefix: str) -> None:
    """The .idx is whole and the .bin is as long as it says (Megatron's layout: int32 lengths,
    int64 pointers, int64 document indices after a fixed header; tokens back to back in .bin)."""
    import numpy as np
    from megatron.core.datasets.indexed_dataset import DType

    idx, bin_ = Path(prefix + ".idx"), Path(prefix + ".bin")
    redo = "rebuild the pair with scripts/preprocess_data.py"
    with open(idx, "rb") as f:
        head = f.read(_IDX_FIXED)
    if len(head) < _IDX_FIXED or head[:9] != _IDX_HEADER:
        raise DataError(f"--data-path {prefix}: {idx} is not a megatron-core index (no MMIDIDX header, or "
                        f"truncated); {redo}")
    version, code, n_seq, n_doc = struct.unpack("<QBQQ", head[9:])
    try:
        itemsize = DType.size(DType.dtype_from_code(code))
    except (KeyError, ValueError):
        raise DataError(f"--data-path {prefix}: {idx} has an unknown token dtype code {code}; {redo}") from None
    want = _IDX_FIXED + n_seq * (4 + 8) + n_doc * 8
    have = idx.stat().st_size
    if version != 1 or have not in (want, want + n_seq):  # + one mode byte per sequence (multimodal)
        raise DataError(f"--data-path {prefix}: {idx} is {have} bytes but its header ({n_seq} sequences, {n_doc} "
                        f"documents) needs {want}; the file is truncated or corrupt: {redo}")
    lengths = np.memmap(idx, dtype=np.int32, mode="r", offset=_IDX_FIXED, shape=(n_seq,)) if n_seq else []
    tokens = int(np.sum(lengths, dtype=np.int64)) if n_seq else 0
    size = bin_.stat().st_size
    if size != tokens * itemsize:
        raise DataError(f"--data-path {prefix}: {bin_} is {size} bytes but {idx} describes {tokens} tokens of "
                        f"{itemsize} bytes ({tokens * itemsize} bytes); the pair does not match (a truncated "
                        f"file, or files of two runs): {redo}")


def check_data_files(data: DataConfig) -> None:
    for prefix in blend(list(data.data_path))[0]:
        for ext in (".bin", ".idx"):
            if not Path(prefix + ext).is_file():
                raise DataFileMissing(
                    f"--data-path {prefix}: {prefix + ext} does not exist; give the prefix without .bin/.idx, "
                    f"as written by scripts/preprocess_data.py --output-prefix P (P_text_document)"
                )
        check_indexed_pair(prefix)


def check_split(split: str) -> None:
    """--split as Megatron reads it (numbers separated by , or /, at most train,valid,test), refused
    where Megatron's parser would misread it: other text, more than 3 parts, all zero."""
    parts = re.split(r"\s*[,/]\s*", split.strip())
    try:
        values = [float(x) for x in parts]
    except ValueError:
        values = None
    if values is None or not 1 <= len(values) <= 3 or any(not 0 <= v < float("inf") for v in values) \
            or sum(values) <= 0:
        raise DataError(f"--split {split}: give up to 3 proportions train,valid,test (numbers >= 0, not all 0), "
                        f"e.g. --split 969,30,1")


def check_data(data: DataConfig, model) -> None:
    """Before any rank starts: the files exist and the model's vocab covers the tokenizer's."""
    if data.data_path is None:
        return
    check_split(data.split)
    check_vocab(data_tokenizer(data).vocab_size, model.vocab_size, model.name)
    check_data_files(data)


class GPTDataReader:
    """Microbatches from a built megatron-core GPTDataset (the train split)."""

    def __init__(self, dataset, seq_length: int):
        self.dataset, self.seq_length = dataset, seq_length

    def sample(self, index: int) -> dict:
        if index >= len(self.dataset):
            raise IndexError(f"sample {index} is past the {len(self.dataset)} samples built; "
                             f"the dataset was built for fewer --train-iters x --global-batch-size")
        return self.dataset[index]

    def microbatch(self, step: int, microbatch: int, micro_batch_size: int, global_batch_size: int) -> dict:
        first = step * global_batch_size + microbatch * micro_batch_size
        samples = [self.sample(first + i) for i in range(micro_batch_size)]
        return {
            "tokens": torch.stack([torch.as_tensor(s["tokens"]) for s in samples]).long(),
            "labels": torch.stack([torch.as_tensor(s["labels"]) for s in samples]).long(),
            "loss_mask": torch.stack([torch.as_tensor(s["loss_mask"]) for s in samples]).float(),
            "position_ids": torch.stack([torch.as_tensor(s["position_ids"]) for s in samples]).long(),
        }


def check_vocab(tokenizer_vocab: int, model_vocab: int, model_name: str) -> None:
    if tokenizer_vocab > model_vocab:
        raise DataError(
            f"the tokenizer has {tokenizer_vocab} tokens but model {model_name!r} has vocab_size={model_vocab}: "
            f"ids >= {model_vocab} would index past the embedding; set vocab_size >= {tokenizer_vocab} in the "
            f"model config (or use a smaller tokenizer)"
        )


def build_gpt_dataset(data: DataConfig, seq_length: int, seed: int, num_samples: int, tokenizer=None):
    """The train split of megatron-core's GPTDataset for these prefixes. Collective when
    torch.distributed is initialized: every rank must call it (rank 0 builds the index first)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    tokenizer = tokenizer or data_tokenizer(data)
    check_data_files(data)
    prefixes, weights = blend(list(data.data_path))
    config = GPTDatasetConfig(
        random_seed=seed, sequence_length=seq_length, blend=(prefixes, weights),
        split=data.split, path_to_cache=data.data_cache_path, tokenizer=tokenizer,
        reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=data.eod_mask_loss,
        create_attention_mask=False,  # the models here use a causal mask without a tensor
        num_dataset_builder_threads=1,
    )
    # Only the train split is read (no evaluation here). Dropping valid/test from the split
    # matrix keeps the train documents exactly Megatron's, and avoids megatron-core 0.16's
    # endless epoch loop for a split that gets no documents (e.g. "1" of 969,30,1 on a small set).
    config.split_matrix = [config.split_matrix[0], None, None]
    _check_train_documents(prefixes, config.split_matrix[0], data.split)
    # A weighted blend needs a size for every split (megatron-core asserts); the dropped ones get 0.
    sizes = [num_samples, None, None] if weights is None else [num_samples, 0, 0]
    train, _, _ = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()
    return train


def _check_train_documents(prefixes: list[str], train_range: tuple[float, float] | None, split: str) -> None:
    """Fail before building if a dataset's train split is empty (megatron-core would loop forever)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    if train_range is None:
        raise DataError(f"--split {split} gives the train split no share; e.g. --split 969,30,1")
    for prefix in prefixes:
        ds = IndexedDataset(prefix)
        n = len(ds.document_indices) - 1
        beg, end = (int(round(x * n)) for x in train_range)
        if end <= beg or int(ds.sequence_lengths[ds.document_indices[beg]:ds.document_indices[end]].sum()) == 0:
            raise DataError(f"--split {split} leaves no training tokens in {prefix} ({n} documents); "
                             f"give the train split a larger share, e.g. --split 100,0,0")


def make_data(cfg: "TrainConfig") -> MicrobatchSource:
    """The trainers' data source: MarkovMockData without a data path, else the GPTDataset reader."""
    data: DataConfig = getattr(cfg, "data", None) or DataConfig()
    mcfg = cfg.model
    if data.data_path is None:
        from megatron_hetermoe.data.mock import MarkovMockData

        return MarkovMockData(mcfg.vocab_size, mcfg.seq_length, cfg.seed)
    tok = data_tokenizer(data)
    check_vocab(tok.vocab_size, mcfg.vocab_size, mcfg.name)
    ds = build_gpt_dataset(data, mcfg.seq_length, cfg.seed, cfg.train_iters * cfg.global_batch_size, tok)
    return GPTDataReader(ds, mcfg.seq_length)


# ---- command line ------------------------------------------------------------------------
def data_config_from_args(a: argparse.Namespace, model=None) -> DataConfig:
    """The DataConfig of these flags; checked against `model` (a ModelConfig) when given."""
    if a.mock_data and a.data_path:
        raise DataError("--mock-data and --data-path both given: pick one")
    data = DataConfig(
        data_path=tuple(a.data_path) if a.data_path else None, split=a.split, tokenizer_type=a.tokenizer_type,
        tokenizer_model=a.tokenizer_model, vocab_file=a.vocab_file, merge_file=a.merge_file,
        # --vocab-size is pretrain_gpt's (Megatron's NullTokenizer size); `hetermoe train` has none
        vocab_size=getattr(a, "vocab_size", None), data_cache_path=a.data_cache_path, eod_mask_loss=a.eod_mask_loss,
    )
    if model is not None:
        check_data(data, model)
    return data
