"""`python -m megatron_hetermoe.data.corpus`'s parser: a dataset of Python's documentation
(behaviour: data/corpus.py)."""
from __future__ import annotations

import argparse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m megatron_hetermoe.data.corpus",
                                description="make a Megatron dataset of Python's installed documentation")
    p.add_argument("--out-dir", required=True)
    p.add_argument("--vocab-size", type=int, default=1024)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--jsonl-only", action="store_true", help="only write the loose-JSON text file")
    return p
