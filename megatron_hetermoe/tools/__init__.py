"""User-facing tools built on the library: parity.py (`hetermoe parity`), bench.py (`hetermoe
bench`), layer_bench.py (`hetermoe bench --layer`), demo.py (`make demo`), golden.py (`hetermoe
regress`), timeline.py (`hetermoe timeline`), profiler.py (`hetermoe profile`), slurm.py (SLURM
launch rendering, scripts/slurm/launch.sh)."""
