#!/usr/bin/env python3
"""Print every command-line flag that Megatron-LM's training arguments parser defines.

Makes megatron_hetermoe/training/megatron_lm_flags.txt, the reference list that
`python -m megatron_hetermoe.training.pretrain_gpt` uses to tell "a Megatron flag we do not support"
from "not a Megatron flag at all". Many of Megatron-LM's flags are generated from dataclasses
(TransformerConfig, TrainingConfig, ...), so the list is read from the real parser built by
`megatron.training.arguments.add_megatron_arguments`, not from the source text.

    git -C Megatron-LM checkout core_v0.16.1     # or: git archive core_v0.16.1 | tar -x -C DIR
    python scripts/megatron_flags.py --checkout Megatron-LM > megatron_hetermoe/training/megatron_lm_flags.txt

Importing megatron.training needs a few pure-Python packages megatron-core does not install
(six, regex, pydantic; triton is imported too): `pip install --target DEPS six regex pydantic
triton` and put DEPS on PYTHONPATH.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

HEADER = ("# Flags of Megatron-LM's megatron/training/arguments.py (add_megatron_arguments) at {ref}; "
          "made by scripts/megatron_flags.py")


def parser_flags(checkout: Path) -> list[str]:
    """Long option strings of the parser that the checkout's add_megatron_arguments builds."""
    if not (checkout / "megatron" / "training" / "arguments.py").exists():
        raise SystemExit(f"{checkout} has no megatron/training/arguments.py: pass a Megatron-LM checkout")
    sys.path.insert(0, str(checkout))  # the checkout's megatron/ (core and training) wins
    try:
        from megatron.training.arguments import add_megatron_arguments
    except ModuleNotFoundError as e:
        raise SystemExit(f"importing Megatron-LM's megatron.training needs {e.name!r}: pip install --target DEPS "
                         f"six regex pydantic triton, then PYTHONPATH=DEPS") from e

    p = argparse.ArgumentParser(add_help=False)
    add_megatron_arguments(p)
    return sorted({s for a in p._actions for s in a.option_strings if s.startswith("--")})


def describe_ref(checkout: Path) -> str:
    r = subprocess.run(["git", "-C", str(checkout), "describe", "--tags", "--always"], capture_output=True, text=True)
    return r.stdout.strip() or "an unknown ref (not a git work tree)"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkout", type=Path, required=True, help="a Megatron-LM source tree (work tree, not bare)")
    p.add_argument("--ref", default=None, help="name of the tag/commit the tree is at, for the header line")
    a = p.parse_args(argv)
    flags = parser_flags(a.checkout.resolve())
    print(HEADER.format(ref=a.ref or describe_ref(a.checkout)))
    print("\n".join(flags))
    return 0


if __name__ == "__main__":
    sys.exit(main())
