"""Every command-line parser of the package: one module per command, named for it, each building
its argparse parser (flags, choices, defaults, help, the formatter) and nothing else.

A command's behaviour stays in the module named for its idea (training/args.py, tools/bench.py,
...), which calls its builder here; values the flags take from a higher layer (a tolerance, a
module's docstring as the description) are passed in. This package sits just above plan/ so
that training/ and megatron_lm/ (Megatron-LM's extra_args_provider) can use the one --hetero-*
definition (cli/hetero.py), and it imports no torch or megatron at module level: planning and
`--help` run where torch is absent. tests/test_imports.py finds any parser outside it.

The `hetermoe` command itself dispatches to those modules, so it sits at the top:
megatron_hetermoe/commands.py (`python -m megatron_hetermoe.cli` runs it, through __main__.py).
"""
