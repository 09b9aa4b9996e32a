"""preprocess_data.py's parser (Megatron-LM's flags; behaviour: data/preprocess.py)."""
from __future__ import annotations

import argparse

from megatron_hetermoe.config import TOKENIZER_TYPES


def add_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    g.add_argument("--tokenizer-model", default=None, help="HuggingFaceTokenizer: a local tokenizer.json")
    g.add_argument("--vocab-file", default=None, help="GPT2BPETokenizer: vocab.json")
    g.add_argument("--merge-file", default=None, help="GPT2BPETokenizer: merges.txt")
    g.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer: size of vocab before EOD")
    g = p.add_argument_group("input data")
    g.add_argument("--input", required=True, help="path to input JSON lines")
    g.add_argument("--json-keys", nargs="+", default=["text"], help="keys to extract from each JSON line")
    g.add_argument("--split-sentences", action="store_true", help="not supported (Megatron uses NLTK for it)")
    g = p.add_argument_group("tokenization process")
    g.add_argument("--append-eod", action="store_true", help="append an EOD token to the end of each document")
    g = p.add_argument_group("output data")
    g.add_argument("--output-prefix", required=True, help="path to binary output file without suffix")
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, required=True, help="tokenizer processes")
    g.add_argument("--partitions", type=int, default=1, help="only 1 is supported")
    g.add_argument("--log-interval", type=int, default=1000, help="documents between progress lines")


def build_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="preprocess_data.py", description=description)
    add_args(p)
    return p
