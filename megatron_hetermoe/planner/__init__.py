"""HeterMoE planner: GPU profiles, cost model, step simulator, Asym-EA,
plan search. A guided tour, in the order data flows:

  gpu_profile.py     the profile data types (GpuProfile, MeasuredTables, LinkProfile, ProfileError)
  profiles.py        GPU profiles (configs/gpus/*.yaml): datasheet / paper-ratio / measured numbers
  profiler.py        `hetermoe profile`: measure this device into a profile
  cluster.py         cluster configs (configs/clusters/*.yaml) and the transfer model
  cost_model.py      seconds and bytes of every piece of a step, any model shape
  simulator.py       event simulation of the task lists of plan/tasks.py (C++ core: csrc/simulator.cpp)
  baselines.py       EP, EP (Ideal), heterogeneity-aware PP, physical limit
  asym_ea.py         expert assignment: the paper's Algorithm 1 and an optimal DP
  search.py          picks M:N, groups, R, placement; cli_plan.py is `hetermoe plan`

Nothing here imports torch except profiler.py.
"""
