"""`python -m megatron_hetermoe.cli COMMAND ...`: the `hetermoe` command (commands.py). An entry
point nothing imports, so it sits at the top of the layers (tests/test_imports.py)."""
import sys

from megatron_hetermoe.commands import main

sys.exit(main())
