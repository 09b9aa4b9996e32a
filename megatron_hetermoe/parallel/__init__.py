"""Ranks, process groups and token transport: grid.py (PoolGrid: each pool as a grid of named
axes, megatron-core's HyperCommGrid arithmetic over the plan's ranks), layout.py (RankLayout: a
rank's coordinates, role and groups by plan arithmetic, no process group), state.py
(HeteroParallelState: the "hetero" groups built from a plan, and the rank's device),
extension.py (the protocols a new backend
implements: Transport and its Route handle, TaskTiming, MicrobatchSource), transport.py (the
split-size token backends every transfer of a ZP group goes through: all-to-all, or loopback in
a one-rank group, and their SplitRoute), megatron_globals.py (which of the plan's groups serves each of
megatron-core's parallel_state globals; shims/parallel_state.py writes them), expert_load.py
(tokens each expert received and compute seconds per task kind, measured during training),
device.py (a rank's device and group timeouts; torchrun ranks join with init_distributed, GPU
first), launcher.py and watchdog.py (N CPU ranks on gloo, even on a GPU host, and the progress
watchdog), cpu_backend.py (megatron-core on CPU: which shims a CPU rank needs)."""
