"""Training: args.py (`hetermoe train` flags -> TrainConfig, ranks), megatron_ep.py and hetero.py
(the two trainers: model, optimizer and schedule per role), loop.py (the one loop both run),
step.py (forward_step, loss, optimizer, global grad norm and clip), logging.py (iteration lines,
TensorBoard, utilization), golden_values.py, pretrain_gpt.py and megatron_lm.py (Megatron-LM's
command line and its pretrain_gpt.py patch)."""
