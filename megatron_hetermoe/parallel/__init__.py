"""Process groups and transport: state.py (HeteroParallelState: the "hetero" dimension's groups
built from a plan, and the rank's device), comm.py (TokenRoute: the one attention<->expert token
transport), megatron_globals.py (the megatron-core globals with no explicit-group path),
launcher.py and cpu_backend.py (N CPU ranks on gloo; megatron-core on CPU)."""
