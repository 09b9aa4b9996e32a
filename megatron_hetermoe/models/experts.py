"""Expert computation on whichever rank holds the experts, and the expert ranks' runtime.

Tokens arrive grouped by source member, then by expert (the layer's travel order, see
HeteroParallelState.layer_order). `run_local_experts` regroups them by expert for megatron-core's
experts module (SequentialMLP, TEGroupedMLP or GroupedMLP, whichever the kernels build) and back
by source for the return trip; attention ranks holding offloaded experts (Asym-EA) use the same
function.

`ExpertRuntime` is what an expert rank holds: megatron-core expert modules for its experts of
every layer, named as in a plain Megatron model, and `forward_layer`, one layer's expert side of
a DistEP step. The schedules drive it (schedules/distep.py, schedules/zebra.py).
"""
from __future__ import annotations

import functools

import torch
import torch.utils.checkpoint

from megatron_hetermoe.parallel.state import HeteroParallelState
from megatron_hetermoe.plan import expert_names


@functools.lru_cache(maxsize=256)
def _chunk_order(n_src: int, n_exp: int, by_expert: bool, device: torch.device | None = None) -> torch.Tensor:
    """The chunk permutation [src][expert] -> [expert][src] (by_expert) or back; built once per shape
    and device."""
    if by_expert:
        order = [s * n_exp + e for e in range(n_exp) for s in range(n_src)]
    else:
        order = [e * n_src + s for s in range(n_src) for e in range(n_exp)]
    return torch.tensor(order, device=device)


def recomputes_experts(config, plan) -> bool:
    """Whether an expert holder keeps only its experts' inputs for backward and re-runs their
    forward there: the plan's expert_recompute 'keep-inputs', or Megatron's MoE-layer
    recomputation (--moe-layer-recompute, --recompute-modules moe), of which HeterMoE runs the part
    that replays no collective: the experts' intermediates are recomputed; the tokens they received
    came from other ranks and are kept (megatron_lm/replaced.py says so at run start)."""
    moe = getattr(config, "recompute_granularity", None) == "selective" and "moe" in (
        getattr(config, "recompute_modules", None) or ())
    return plan.expert_recompute == "keep-inputs" or moe


def run_local_experts(experts, recv: torch.Tensor, counts: torch.Tensor, probs: torch.Tensor | None = None,
                      recompute: bool = False) -> torch.Tensor:
    """counts[src, i]: tokens from member src for the i-th local expert, on the host (the route's);
    recv is laid out [src][expert]. Returns the experts' outputs in the same layout. `probs`: the
    routing probabilities of recv's rows, to weight inside the experts as Megatron's do (only in a
    ZP group of one, see HeteroTokenDispatcher); None: unweighted outputs. A rank holding no expert
    of the layer (experts None, no count columns; Asym-EA can empty an expert rank's layer)
    receives nothing and returns recv * 0: an empty output still tied to recv, so the transfer's
    backward runs as on every other member. `recompute` (the plan's expert_recompute
    'keep-inputs'): keep only the experts' inputs for backward and re-run their forward there."""
    from megatron.core.transformer.moe.moe_utils import sort_chunks_by_idxs

    n_src, n_exp = counts.shape
    if experts is None or n_exp == 0:
        if experts is not None or recv.shape[0]:
            raise ValueError(f"a rank without experts in this layer received {recv.shape[0]} tokens for "
                             f"{n_exp} local experts (experts module {'present' if experts is not None else 'absent'})")
        return recv * 0
    # --moe-permute-fusion: transformer-engine's fused chunk sort, which takes its sizes on the device
    # (a copy to it, never a read back); the unfused sort and the expert MLPs read them on the host.
    fused = bool(getattr(experts.config, "moe_permute_fusion", False))
    dev = recv.device if fused else None

    def sizes(t: torch.Tensor) -> torch.Tensor:
        return t.to(recv.device, non_blocking=True) if fused else t

    # One source member: the chunks are already by expert, nothing to sort.
    if n_src > 1:
        x, probs = sort_chunks_by_idxs(recv, sizes(counts.reshape(-1)), _chunk_order(n_src, n_exp, True, dev),
                                       probs=probs, fused=fused)
    else:
        x = recv
    if probs is None:
        # Probabilities are applied after combine on the attention rank (the paper's choice, so
        # the gate's gradient needs no expert rank): experts compute unweighted outputs.
        probs = torch.ones(x.shape[0], dtype=x.dtype, device=x.device)
    tokens_per_expert = counts.sum(0)
    if recompute:
        # Non-reentrant: the recomputation runs inside this graph's backward, with no RNG to
        # restore (experts have no dropout).
        y, bias = torch.utils.checkpoint.checkpoint(experts, x, tokens_per_expert, probs, use_reentrant=False)
    else:
        y, bias = experts(x, tokens_per_expert, probs)
    assert bias is None, "expert bias is not supported (Mixtral-style experts have none)"
    if n_src == 1:
        return y
    out, _ = sort_chunks_by_idxs(y, sizes(counts.t().reshape(-1)), _chunk_order(n_src, n_exp, False, dev),
                                 fused=fused)
    return out


def experts_sharded_state_dict(experts, global_ids: list[int], num_experts: int, replica_rank: int, prefix: str = "",
                               sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
    """megatron-core's checkpoint layout of `experts` (SequentialMLP, TEGroupedMLP or GroupedMLP:
    their own sharded state dicts, which all write the same global tensors) with the plan's
    expert ids: local expert i is global expert global_ids[i] on the expert axis, whatever the
    holder, so a HeterMoE checkpoint and a Megatron EP one name every expert alike and reshard into
    each other. `replica_rank`: this holder's index among the replicas of these experts (ZP groups)."""
    from megatron_hetermoe.models.expert_axis import plan_sharded_state_dict

    return plan_sharded_state_dict(experts, global_ids, num_experts, replica_rank, prefix, sharded_offsets, metadata)


def build_experts(config, experts_spec, num_local: int, pg_collection):
    from megatron_hetermoe import compat

    return compat.build_experts(experts_spec, num_local, config, pg_collection)


def _megatron_module():
    from megatron.core.transformer.module import MegatronModule

    return MegatronModule


class ExpertRuntime(_megatron_module()):
    """All experts an expert rank holds, named as in a plain Megatron model
    (decoder.layers.L.mlp.experts.local_experts.i with SequentialMLP; the kernels' own names
    otherwise, see plan/expert_names.py) so DDP, the optimizer and checkpoints treat them like
    Megatron's own. decoder.layers has one holder per decoder layer (a dense layer's is empty), so
    names carry the model's layer index; MTP layer k's experts sit where GPTModel has them
    (mtp.layers.k.transformer_layer.mlp.experts). The schedules address MoE layers (`experts_of`)."""

    def __init__(self, config, experts_spec, hs: HeteroParallelState):
        super().__init__(config=config)
        self.hs = hs
        pgc = hs.pg_collection()
        self.pg_collection = pgc  # as GPTModel keeps it (Megatron-LM's training_log reads it)

        def holder(model_layer: int) -> torch.nn.Module:
            h = torch.nn.Module()
            h.mlp = torch.nn.Module()
            layer = hs.plan.moe_index(model_layer)
            n = 0 if layer is None else len(hs.local_experts(layer))
            h.mlp.experts = build_experts(config, experts_spec, n, pgc) if n else None
            return h

        self.decoder = torch.nn.Module()
        self.decoder.layers = torch.nn.ModuleList(holder(i) for i in range(hs.plan.decoder_layers))
        if hs.plan.mtp_layers:
            self.mtp = torch.nn.Module()
            self.mtp.layers = torch.nn.ModuleList()
            for k in range(hs.plan.mtp_layers):
                wrap = torch.nn.Module()
                wrap.transformer_layer = holder(hs.plan.decoder_layers + k)
                self.mtp.layers.append(wrap)

    def _holder(self, model_layer: int) -> torch.nn.Module:
        d = self.hs.plan.decoder_layers
        return (self.decoder.layers[model_layer] if model_layer < d
                else self.mtp.layers[model_layer - d].transformer_layer)

    def experts_of(self, layer: int):
        """The experts this rank holds in MoE layer `layer` (None: none)."""
        return self._holder(self.hs.plan.moe_layer_ids[layer]).mlp.experts

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        """The experts' part of a plain Megatron GPTModel's sharded state dict: the keys and
        offsets TransformerBlock gives its layers' experts (layer axis first) and
        MultiTokenPredictionBlock its MTP layers' (no layer axis), with the plan's expert ids
        (experts_sharded_state_dict)."""
        import torch.distributed as dist
        from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding

        hs, out = self.hs, {}
        L, E = hs.plan.decoder_layers, hs.plan.num_experts
        replica = dist.get_rank(hs.group("replica"))
        freq = getattr(self.config, "moe_layer_freq", 1)
        # TransformerBlock's rule: dense layers (or a pattern) make its layers non-homogeneous.
        separate = ((metadata or {}).get("non_homogeneous_layers", False) or isinstance(freq, list) or freq > 1
                    or getattr(self.config, "hetereogenous_dist_checkpoint", False)
                    or getattr(self.config, "heterogeneous_block_specs", False))
        for model_layer, holder in enumerate(self.decoder.layers):
            if holder.mlp.experts is None:
                continue
            local = f"{prefix}decoder.layers.{model_layer}."
            sd = experts_sharded_state_dict(holder.mlp.experts, hs.plan.local_experts_at(hs.rank, model_layer), E,
                                            replica, f"{local}mlp.experts.",
                                            () if separate else ((0, model_layer, L),), metadata)
            replace_prefix_for_sharding(sd, local, local if separate else f"{prefix}decoder.layers.")
            out.update(sd)
        for k in range(hs.plan.mtp_layers):
            experts = self.mtp.layers[k].transformer_layer.mlp.experts
            if experts is not None:
                out.update(experts_sharded_state_dict(
                    experts, hs.plan.local_experts_at(hs.rank, L + k), E, replica,
                    f"{prefix}mtp.layers.{k}.transformer_layer.mlp.experts.", (), metadata))
        return out

    def canonical_names(self) -> dict[str, str]:
        """local name -> canonical name (global expert ids; a GroupedMLP weight's label)."""
        def ids_of(pre: str) -> list[int]:
            layer = expert_names.model_layer_of_prefix(pre, self.hs.plan.decoder_layers)
            return self.hs.plan.local_experts_at(self.hs.rank, layer)

        return {name: expert_names.canonical_name(name, ids_of) for name, _ in self.named_parameters()}

    # ---- one layer, forward: the expert side of dispatch -> experts -> combine ---------
    def forward_layer(self, layer: int, hidden_size: int, spans=None, microbatch: int = 0) -> torch.Tensor:
        """Receive this layer's tokens, run the local experts, send the outputs back; returns the
        (empty) result of the combine, whose backward is the gradient's return trip. `spans`
        (schedules/distep.py ExpertSpans): time the experts' forward and backward as `microbatch`'s."""
        route, _ = self.hs.transport.route(layer, None, hidden_size, self.config.params_dtype)
        leaf = route.empty().requires_grad_()
        recv = route.dispatch(leaf)
        experts = functools.partial(run_local_experts, self.experts_of(layer), counts=route.local_counts,
                                    recompute=recomputes_experts(self.config, self.hs.plan))
        out = experts(recv) if spans is None else spans.run(layer, microbatch, recv, experts)
        # The combined output lands on the attention ranks: nothing comes back here.
        return route.combine(out)
