"""User-facing tools built on the library: parity.py (`hetermoe parity`), bench.py (`hetermoe
bench`), demo.py (`make demo`), golden.py (`hetermoe regress`), timeline.py (`hetermoe
timeline`), slurm.py (SLURM launch rendering)."""
