"""Process groups and transport: state.py (HeteroParallelState: the "hetero" dimension's groups
built from a plan, and the rank's device), comm.py (TokenRoute: the one attention<->expert token
transport), megatron_globals.py (the megatron-core globals with no explicit-group path),
device.py (a rank's device and group timeouts; torchrun ranks join with init_distributed, GPU
first), launcher.py and cpu_backend.py (N CPU ranks on gloo, even on a GPU host; megatron-core
on CPU)."""
