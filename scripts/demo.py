"""`make demo`: HeterMoE on an emulated 2 A40 + 2 V100 cluster (see megatron_hetermoe/tools/demo.py)."""
import sys

from megatron_hetermoe.parallel.launcher import show_warnings_once

show_warnings_once()  # megatron's warnings once for the demo, not once per rank

import megatron.core  # noqa: E402,F401  - import once, then fork the ranks

from megatron_hetermoe import MissingExtraError  # noqa: E402
from megatron_hetermoe.tools.demo import main  # noqa: E402

if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except MissingExtraError as e:
        sys.exit(f"demo: {e}")
