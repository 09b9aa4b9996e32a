"""Every runtime patch the package makes to megatron-core, Megatron-LM or torch, one module per
patched thing, named for it: what is replaced, why (the failure or the missing hook), which
releases need it, and how it is undone (a patch made for good says so). Nothing outside this
package assigns to, setattr()s or deletes an attribute of those packages, nor replaces a method
of one of their objects (tests/test_imports.py test_no_patch_outside_shims).

Where the replacement's behaviour is HeterMoE's (the world-wide grad norm, the optimizer state's
resharding, the plan's process groups), the caller passes it in and the shim owns the act:
which attribute, the differences between releases, the undo. The layer sits right above
reliability/ (ARCHITECTURE.md), so every layer that patches can call it.

- torch_cuda: torch.cuda (streams, events, device, RNG, is_available) on CPU ranks
- tensor_parallel_random: megatron-core's CUDA RNG state setter on CPU ranks
- moe_utils: its split-size conversion on CPU, its unbound te_general_gemm (0.13-0.16)
- token_dispatcher: the alltoall dispatcher's all_to_all (emulated Megatron EP times it)
- torch_norm, dot_product_attention, multi_latent_attention: the local spec's modules
- parallel_state: megatron-core's parallel_state globals from the plan's groups
- torch_distributed: torch.distributed's collectives, traced
- distributed_data_parallel: DDP's param sync and grad sync finish (instances)
- megatron_optimizer: Megatron optimizer instances' step pieces, zero count, state dict I/O
- distrib_optimizer: DistributedOptimizer's state dict on torch's Adam (the class)
- pipeline_schedules: the schedules' output deallocation on CPU ranks
- datasets_utils: the dataset helpers' build step with a wheel's prebuilt helpers
- megatron_training: Megatron-LM's megatron.training (pretrain()'s hooks, its CPU ranks)
- pretrain_gpt: Megatron-LM's pretrain_gpt.py, patched in its files (patches/): which patch fits
"""
