"""Text -> Megatron indexed dataset (.bin/.idx), as Megatron-LM's tools/preprocess_data.py.

Same input (loose JSON, one document per line, text under --json-keys), same output names
(`{output_prefix}_{key}_document.bin/.idx`, written by megatron-core's IndexedDatasetBuilder),
same flags for the supported subset. Tokenizers are the offline ones of `tokenizer.py`.
Documents are tokenized by --workers processes in input order, so the output is the same for
any worker count.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import time
from pathlib import Path

import numpy as np

from megatron_hetermoe.cli.preprocess import build_parser
from megatron_hetermoe.data.tokenizer import build_tokenizer

_tok = None  # the worker process's tokenizer


def _init_worker(kw: dict) -> None:
    global _tok
    _tok = build_tokenizer(**kw)


def _encode(job: tuple[str, list[str], bool]) -> tuple[dict[str, list[int]], int]:
    line, keys, append_eod = job
    doc = json.loads(line)
    out = {}
    for k in keys:
        if k not in doc:
            raise KeyError(f"JSON line has no key {k!r} (keys: {sorted(doc)}); set --json-keys")
        ids = _tok.tokenize(doc[k])
        if ids and append_eod:
            ids.append(_tok.eod)
        out[k] = ids
    return out, len(line)


def preprocess(a: argparse.Namespace) -> dict[str, str]:
    """Write one .bin/.idx pair per JSON key; return {key: path prefix}."""
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    if a.split_sentences:
        raise SystemExit("--split-sentences is not supported (it needs NLTK's sentence splitter); drop it")
    if a.partitions != 1:
        raise SystemExit(f"--partitions {a.partitions}: only 1 is supported; use --workers for parallelism")
    if a.workers < 1:
        raise SystemExit(f"--workers {a.workers}: must be at least 1")
    if not Path(a.input).is_file():
        raise SystemExit(f"--input {a.input}: no such file")
    tok_kw = {"tokenizer_type": a.tokenizer_type, "tokenizer_model": a.tokenizer_model,
              "vocab_file": a.vocab_file, "merge_file": a.merge_file, "vocab_size": a.vocab_size}
    tok = build_tokenizer(**tok_kw)
    dtype = DType.optimal_dtype(tok.vocab_size)
    Path(a.output_prefix).parent.mkdir(parents=True, exist_ok=True)
    prefixes = {k: f"{a.output_prefix}_{k}_document" for k in a.json_keys}
    builders = {k: IndexedDatasetBuilder(p + ".bin", dtype=dtype) for k, p in prefixes.items()}
    t0, nbytes, ndocs, ntok = time.perf_counter(), 0, 0, 0
    with open(a.input, encoding="utf-8") as f:
        jobs = ((line, a.json_keys, a.append_eod) for line in f if line.strip())
        if a.workers == 1:
            _init_worker(tok_kw)
            results = map(_encode, jobs)
            pool = None
        else:
            pool = multiprocessing.get_context("fork").Pool(a.workers, _init_worker, (tok_kw,))
            results = pool.imap(_encode, jobs, chunksize=8)  # imap keeps input order
        try:
            for doc, n in results:
                nbytes += n
                for k, ids in doc.items():
                    if not ids:
                        continue  # Megatron drops empty documents (keep_empty=False)
                    builders[k].add_document(np.asarray(ids, dtype=np.int64), [len(ids)])
                    ntok += len(ids)
                ndocs += 1
                if a.log_interval and ndocs % a.log_interval == 0:
                    dt = time.perf_counter() - t0
                    print(f"processed {ndocs} documents ({ndocs / dt:.1f} docs/s, {nbytes / dt / 2**20:.2f} MB/s)",
                          file=sys.stderr)
        finally:
            if pool is not None:
                pool.close()
                pool.join()
    for k, b in builders.items():
        b.finalize(prefixes[k] + ".idx")
    print(f"wrote {ndocs} documents, {ntok} tokens (vocab {tok.vocab_size}, {np.dtype(dtype).name}) to "
          f"{', '.join(p + '.{bin,idx}' for p in prefixes.values())}", file=sys.stderr)
    return prefixes


def main(argv: list[str] | None = None) -> int:
    preprocess(build_parser(__doc__.split("\n\n")[0]).parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
