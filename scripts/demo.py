"""`make demo`: HeterMoE on an emulated 2 A40 + 2 V100 cluster (see megatron_hetermoe/demo.py)."""
import sys

import megatron.core  # noqa: F401  - import once, then fork the ranks

from megatron_hetermoe.demo import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
