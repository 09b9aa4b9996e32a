"""Fixtures of the tests that run Megatron-LM's own pretrain() from a checkout (MEGATRON_LM_DIR):
the checkout with the patched pretrain_gpt.py, and a small real-text dataset; made once per session."""
from __future__ import annotations

import importlib
import json
import subprocess
from pathlib import Path

import pytest
from megatron_lm_run import ROOT, checkout_dir

from megatron_hetermoe import megatron_lm


@pytest.fixture(scope="session")
def mlm(tmp_path_factory) -> Path:
    """The checkout, linked entry by entry, with the patched pretrain_gpt.py."""
    checkout = checkout_dir()
    work = tmp_path_factory.mktemp("mlm")
    for entry in checkout.iterdir():
        if entry.name not in (".git", "pretrain_gpt.py"):
            (work / entry.name).symlink_to(entry)
    (work / "pretrain_gpt.py").write_text((checkout / "pretrain_gpt.py").read_text())
    subprocess.run(["git", "apply", str(ROOT / "patches" / megatron_lm.patch_for(checkout))], cwd=work, check=True)
    return work


@pytest.fixture(scope="session")
def data(tmp_path_factory) -> str:
    """Real text (the docstrings of Python's standard library) as UTF-8 byte ids, preprocessed by the
    plugin's preprocess_data for NullTokenizer --vocab-size 256."""
    from megatron_hetermoe.data.preprocess import main as preprocess

    d = tmp_path_factory.mktemp("data")
    docs = []
    for m in ("json", "collections", "argparse", "functools", "itertools", "pathlib", "inspect", "logging",
              "threading", "dataclasses", "heapq", "random", "statistics", "textwrap"):
        mod = importlib.import_module(m)
        for name in sorted(dir(mod)):
            doc = getattr(getattr(mod, name), "__doc__", None)
            if isinstance(doc, str) and len(doc) > 200:
                docs.append(" ".join(str(b) for b in doc.encode("utf-8")))
    (d / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    assert preprocess(["--tokenizer-type", "NullTokenizer", "--vocab-size", "256", "--input", str(d / "docs.jsonl"),
                       "--output-prefix", str(d / "docs"), "--append-eod", "--workers", "1"]) in (0, None)
    return str(d / "docs_text_document")


