"""Real English text that is already installed: CPython's own documentation topics.

`pydoc_data/topics.py` ships with every CPython installation (it is what `help('if')` prints):
~80 documents, ~700 KB of the Python Language Reference's prose. Using it means the demo and
the tests train on real text without downloading anything. `build_text_dataset` runs the whole
path a Megatron user runs on their own corpus: text -> loose JSON -> tokenizer -> .bin/.idx.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from megatron_hetermoe.cli.corpus import build_parser

DOCS_NAME = "python-docs"


def python_docs() -> list[str]:
    """The documentation topics of the running Python, in a fixed (sorted by name) order."""
    try:
        from pydoc_data.topics import topics
    except ImportError as e:  # some distributions split it out (Debian: python3-doc / libpython3-stdlib)
        raise RuntimeError(
            "this Python has no pydoc_data.topics (the stdlib's help text); install your distribution's "
            "full Python standard library, or pass your own --input text"
        ) from e
    return [topics[k] for k in sorted(topics)]


def write_jsonl(texts: list[str], path: str | Path, key: str = "text") -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({key: t}) + "\n")
    return path


def build_text_dataset(out_dir: str | Path, vocab_size: int = 1024, workers: int = 1) -> dict[str, str]:
    """Python's docs as a Megatron indexed dataset with a BPE trained on them; reuses files that
    exist. Returns the flags to train on it: data_path prefix and tokenizer_model."""
    from megatron_hetermoe.data.preprocess import main as preprocess_main
    from megatron_hetermoe.data.tokenizer import train_bpe

    out = Path(out_dir)
    jsonl = out / f"{DOCS_NAME}.jsonl"
    tok_path = out / "tokenizer" / "tokenizer.json"
    prefix = out / f"{DOCS_NAME}_text_document"
    if not jsonl.exists():
        write_jsonl(python_docs(), jsonl)
    if not tok_path.exists():
        train_bpe((json.loads(line)["text"] for line in open(jsonl, encoding="utf-8")), vocab_size, tok_path)
    if not (prefix.with_suffix(".bin").exists() and prefix.with_suffix(".idx").exists()):
        preprocess_main(["--input", str(jsonl), "--output-prefix", str(out / DOCS_NAME),
                         "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tok_path),
                         "--append-eod", "--workers", str(workers)])
    return {"data_path": str(prefix), "tokenizer_model": str(tok_path)}


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if a.jsonl_only:
        print(write_jsonl(python_docs(), Path(a.out_dir) / f"{DOCS_NAME}.jsonl"))
        return 0
    r = build_text_dataset(a.out_dir, a.vocab_size, a.workers)
    print(f"--data-path {r['data_path']} --tokenizer-type HuggingFaceTokenizer "
          f"--tokenizer-model {r['tokenizer_model']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
