"""The undo bookkeeping the shim modules share (not a way to patch: each public function of a
shim names what it replaces and why)."""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator


def wrap(original: Callable, hook: Callable) -> Callable:
    """`hook(original, *args, **kwargs)` in place of `original`."""
    return lambda *a, **k: hook(original, *a, **k)


@contextlib.contextmanager
def replaced(replacements: list) -> Iterator[None]:
    """Set each (owner, name, value) for the block, then put the originals back."""
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in replacements]
    for owner, name, new in replacements:
        setattr(owner, name, new)
    try:
        yield
    finally:
        for owner, name, old in reversed(saved):
            setattr(owner, name, old)
