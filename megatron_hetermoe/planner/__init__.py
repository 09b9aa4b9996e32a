"""HeterMoE planner: GPU profiles, cost model, step simulator, Asym-EA,
plan search. A guided tour, in the order data flows:
  gpu_profile.py     the profile data types (GpuProfile, MeasuredTables, LinkProfile, ProfileError)
  profiles.py        GPU profiles (configs/gpus/*.yaml): datasheet / paper-ratio / measured numbers
  cluster.py         cluster configs (configs/clusters/*.yaml) and the transfer model
  cost_model.py      seconds and bytes of every piece of a step, any model shape
  simulator.py       event simulation of the task lists of plan/tasks.py (C++ core: csrc/simulator.cpp)
  pipeline.py        pipeline stages: DistEP's step inside the stages and the memory rule
  baselines.py       EP, EP (Ideal), heterogeneity-aware PP, Megatron EP at its best TP/PP, the
                     physical and network limits
  asym_ea.py         expert assignment: the paper's Algorithm 1 and an optimal DP
  search.py          picks M:N, groups, R, TP, stages, waves and placement
  megatron_flags.py  the model and run of a pretrain_gpt.py command line (`hetermoe plan ... -- <flags>`)
  expert_load.py     measured expert loads and their stats file (docs/expert-load.md)
  rebalance.py       live re-placement for measured loads within the running plan's roles, with hysteresis
  inventory.py       the GPUs a job has, and the plan the search picks for them (--hetero-plan auto)
  cli_plan.py        `hetermoe plan`
Nothing here imports torch (`hetermoe profile`, which measures a device, is tools/profiler.py).
"""
