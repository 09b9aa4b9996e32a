"""megatron-core's dataset utilities (megatron.core.datasets.utils): its index helpers' build step."""
from __future__ import annotations

import contextlib
import importlib.util
from pathlib import Path
from typing import Iterator

from megatron_hetermoe.shims._replace import replaced


@contextlib.contextmanager
def prebuilt_helpers() -> Iterator[None]:
    """megatron-core's wheel ships its dataset index helpers built (helpers_cpp) but not their
    Makefile, and megatron.training's initialize still runs `make` in that directory on rank 0,
    which fails there. With the built module present, that step has nothing to do."""
    import megatron.core.datasets.utils as utils

    if importlib.util.find_spec("megatron.core.datasets.helpers_cpp") is None or \
            (Path(utils.__file__).parent / "Makefile").is_file():
        yield  # a tree that builds them (a checkout): Megatron's own step
        return
    with replaced([(utils, "compile_helpers", lambda: None)]):
        yield
