"""Megatron-LM's pretrain_gpt.py: the source patches in patches/ that put HeterMoE into a checkout's
copy, one per release line (pretrain_gpt.py differs between them), and which one fits a checkout
(patches/check_patch.sh does the same). The only patch of Megatron-LM made to its files rather
than at run time; it hands pretrain() to megatron_lm/ (hetero_pretrain, megatron_on_cpu)."""
from __future__ import annotations

import re
from pathlib import Path

# megatron-core release line (major, minor) of a Megatron-LM checkout -> the patch made for it.
PATCHES = {
    (0, 16): "megatron-lm-core_v0.16.1-pretrain_gpt.patch",
    (0, 19): "megatron-lm-core_v0.19.0-pretrain_gpt.patch",
    # Megatron-LM main d98e8a6 (megatron-core 0.20.0 in development): the canary, make canary-main
    (0, 20): "megatron-lm-core_v0.20.0-pretrain_gpt.patch",
}


def checkout_version(checkout) -> tuple[int, int, int]:
    """megatron-core version of a Megatron-LM checkout (its megatron/core/package_info.py)."""
    info = Path(checkout) / "megatron" / "core" / "package_info.py"
    if not info.is_file():
        raise ValueError(f"{checkout} has no megatron/core/package_info.py: pass a Megatron-LM work tree")
    text = info.read_text()
    parts = [re.search(rf"^{k}\s*=\s*(\d+)", text, re.M) for k in ("MAJOR", "MINOR", "PATCH")]
    if not all(parts):
        raise ValueError(f"cannot read MAJOR/MINOR/PATCH from {info}")
    return tuple(int(m.group(1)) for m in parts)


def patch_for(checkout) -> str:
    """File name (in patches/) of the patch made for this Megatron-LM checkout's release line."""
    v = checkout_version(checkout)
    name = PATCHES.get(v[:2])
    if name is None:
        made = ", ".join(f"core_v{a}.{b}.x" for a, b in sorted(PATCHES))
        raise ValueError(f"no patch for Megatron-LM core_v{'.'.join(map(str, v))} ({checkout}); "
                         f"patches exist for {made}")
    return name
