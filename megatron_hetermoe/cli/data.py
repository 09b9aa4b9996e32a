"""Megatron-LM's data and tokenizer flags, as `hetermoe train` / `train-gpt` take them
(behaviour: data/dataset.py)."""
from __future__ import annotations

import argparse

from megatron_hetermoe.config import TOKENIZER_TYPES


def add_data_args(p: argparse.ArgumentParser) -> None:
    """Megatron-LM's data and tokenizer flags (names and meanings) for the supported subset."""
    g = p.add_argument_group("data and tokenizer (Megatron-LM flags)")
    g.add_argument("--data-path", nargs="*", default=None,
                   help="indexed dataset prefixes (.bin/.idx), or a weighted blend w1 p1 w2 p2 ... (Megatron's: "
                        "samples drawn in proportion to the weights) (default: mock data)")
    g.add_argument("--mock-data", action="store_true", help="synthetic data (the default without --data-path)")
    g.add_argument("--split", default="969,30,1", help="train,valid,test proportions of the documents")
    g.add_argument("--tokenizer-type", default=None, choices=TOKENIZER_TYPES,
                   help="tokenizer of --data-path (Megatron-LM's names; required with it)")
    g.add_argument("--tokenizer-model", default=None, help="HuggingFaceTokenizer: a local tokenizer.json")
    g.add_argument("--vocab-file", default=None, help="GPT2BPETokenizer: vocab.json")
    g.add_argument("--merge-file", default=None, help="GPT2BPETokenizer: merges.txt")
    g.add_argument("--data-cache-path", default=None, help="where GPTDataset caches its sample index")
    g.add_argument("--eod-mask-loss", action="store_true", help="mask the loss at end-of-document tokens")
