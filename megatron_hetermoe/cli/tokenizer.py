"""`python -m megatron_hetermoe.data.tokenizer`'s parser: train a BPE tokenizer (behaviour:
data/tokenizer.py)."""
from __future__ import annotations

import argparse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m megatron_hetermoe.data.tokenizer",
                                description="train a byte-level BPE tokenizer on a loose-JSON text file")
    p.add_argument("--input", required=True, help="JSON lines file, one document per line (Megatron's format)")
    p.add_argument("--json-keys", nargs="+", default=["text"], help="keys of the text in each JSON line")
    p.add_argument("--vocab-size", type=int, default=1024, help="total vocabulary size, EOD included")
    p.add_argument("--output", required=True, help="where to write tokenizer.json (vocab.json, merges.txt beside it)")
    return p
