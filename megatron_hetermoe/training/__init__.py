"""Training: command.py (`hetermoe train`: which of its two forms a command line is), args.py (its
config form: flags -> TrainConfig, ranks), pretrain_gpt.py (its pretrain_gpt.py form, also `hetermoe
train-gpt`: Megatron-LM's pretrain_gpt.py flags for the subset the plugin's trainer builds; their
parsers are cli/'s), hetero_args.py (the parsed --hetero-* flags -> HeteroRunConfig), validation.py (every input
checked before any process group exists), assembly.py (RoleAssembly: a HeterMoE rank put together
for both hostings), megatron_ep.py and hetero.py (the two trainers), loop.py (the one loop both
run), step.py (forward_step, loss, optimizer, one loss scale), world_stats.py (params norm and
zero count over the world), nan_check.py (Megatron's NaN check, world-wide), expert_load_log.py
(measured expert loads in the log, both hostings), elastic.py (--elastic-restarts: re-plan and
continue when ranks are lost), replan.py and expert_move.py (--hetero-replan-interval: experts re-placed
for the measured loads and moved live between steps), logging.py (iteration lines, TensorBoard, utilization),
golden_values.py, run_hooks.py and result.py (what a trainer takes besides its config, and
returns)."""
