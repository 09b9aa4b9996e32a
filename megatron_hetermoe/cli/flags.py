"""Flag tables: a parser's flags as rows of (flag, add_argument's keywords but help, help), added
in the row order (the --help order)."""
from __future__ import annotations

import argparse
from typing import Any

FlagRows = tuple[tuple[str, dict[str, Any], str], ...]


def add_flags(container: argparse.ArgumentParser | argparse._ArgumentGroup, rows: FlagRows) -> None:
    """add_argument(flag, help=help, **keywords) on `container` (a parser or an argument group) for each row."""
    for flag, keywords, text in rows:
        container.add_argument(flag, help=text, **keywords)
