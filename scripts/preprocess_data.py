#!/usr/bin/env python3
"""Megatron-LM's tools/preprocess_data.py for this plugin: loose JSON text -> .bin/.idx.

    python scripts/preprocess_data.py --input docs.jsonl --output-prefix data/docs \
        --tokenizer-type HuggingFaceTokenizer --tokenizer-model data/tokenizer/tokenizer.json \
        --append-eod --workers 2

The code lives in megatron_hetermoe/data/preprocess.py so it can be imported and tested.
"""
import sys

from megatron_hetermoe.data.preprocess import main

if __name__ == "__main__":
    sys.exit(main())
