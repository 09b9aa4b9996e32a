"""megatron-core's alltoall token dispatcher (megatron.core.transformer.moe.token_dispatcher)."""
from __future__ import annotations

from typing import Callable


def all_to_all() -> Callable:
    """The all_to_all the dispatcher calls now (tensor_parallel's, unless replaced)."""
    from megatron.core.transformer.moe import token_dispatcher

    return token_dispatcher.all_to_all


def replace_all_to_all(fn: Callable) -> Callable[[], None]:
    """Make the dispatcher's dispatch and combine call `fn` (same arguments as tensor_parallel's
    all_to_all; megatron-core 0.19 adds use_nccl_stream=) until the returned undo is called.

    Why: emulated Megatron EP (emulation/megatron_ep.py) times each dispatch and combine, which
    the dispatcher calls through its module-level name in every release 0.16.1 .. 0.19."""
    from megatron.core.transformer.moe import token_dispatcher

    original = token_dispatcher.all_to_all
    token_dispatcher.all_to_all = fn

    def undo() -> None:
        token_dispatcher.all_to_all = original

    return undo
