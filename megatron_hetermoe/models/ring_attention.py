"""Ring attention: causal self-attention over a context-parallel (CP) group that passes keys and values
around the group (Megatron's `--cp-comm-type p2p`), instead of all-gathering them.

Sequence layout: Megatron's load-balanced split (get_batch_on_this_cp_rank): CP rank r holds chunk r and
chunk 2 x cp - 1 - r of the sequence's 2 x cp chunks. In step i of cp, rank r attends from its queries to
the keys and values of rank (r - i) mod cp while it sends them on to rank r + 1 and receives the next
block from rank r - 1. The partial softmaxes are merged online (running max and sum, as flash attention
does), in fp32 (fp64 inputs: fp64). Causality leaves half of each off-diagonal block dead, and which half is
known from the split: from an earlier rank's block only its first chunk is seen (by all local queries),
from a later rank's block only the local second chunk sees anything (all of it); those sub-blocks alone
are computed, so every rank does the same work in every step.

Backward passes the keys and values around again, each block with its fp32 key/value gradient, which
collects every rank's contribution and arrives home after cp hops; scores are recomputed from the
saved log-sum-exp (nothing of size s x S is kept but dropout's keep masks, when dropout is on).

Memory per rank: two key/value blocks (the one in use and the one arriving) and the s_local x s_local
scores of one block, not the full sequence's keys and values (all-gather: S x ...) nor s_local x S scores.
The sums are not those of one softmax over the gathered row: the results equal all-gather's within
fp32 rounding, not bit for bit.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, ContextManager, Optional

import torch
import torch.distributed as dist
from torch import Tensor


def local_positions(s_local: int, cp_size: int, cp_rank: int, device=None) -> Tensor:
    """The positions in the full sequence of CP rank `cp_rank`'s `s_local` tokens, in the order it holds
    them (get_batch_on_this_cp_rank's split: chunk cp_rank, then chunk 2 x cp - 1 - cp_rank)."""
    chunk = s_local // 2
    first, second = cp_rank * chunk, (2 * cp_size - 1 - cp_rank) * chunk
    return torch.cat([torch.arange(first, first + chunk, device=device),
                      torch.arange(second, second + chunk, device=device)])


def live_block(cp_rank: int, src_rank: int, s_local: int) -> tuple[slice, slice]:
    """The query rows of `cp_rank` and key columns of `src_rank`'s block that see each other under the
    causal mask: the rest of the s_local x s_local block is masked for every pair."""
    half = s_local // 2
    if src_rank == cp_rank:
        return slice(0, s_local), slice(0, s_local)  # the diagonal: causal inside
    if src_rank < cp_rank:
        return slice(0, s_local), slice(0, half)  # its first chunk precedes both of ours; its second follows
    return slice(half, s_local), slice(0, s_local)  # only our second chunk follows its chunks


@dataclass(frozen=True)
class RingConfig:
    """What one ring attention call needs besides the tensors."""
    group: dist.ProcessGroup  # the CP group
    scale: float  # applied to q.k (Megatron's softmax_scale x the query-key layer scaling coefficient)
    dropout: float = 0.0  # on the attention probabilities, as torch.nn.Dropout (scaled by 1 / (1 - p))
    rng: Callable[[], ContextManager] = contextlib.nullcontext  # the RNG context dropout draws in


def _neighbours(group: dist.ProcessGroup) -> tuple[int, int]:
    """The global ranks of the next and the previous CP rank."""
    r, c = group.rank(), group.size()
    return dist.get_global_rank(group, (r + 1) % c), dist.get_global_rank(group, (r - 1) % c)


def _shift(tensors: list[Tensor], group: dist.ProcessGroup) -> Callable[[], list[Tensor]]:
    """Start sending `tensors` to the next CP rank and receiving the same shapes from the previous one;
    the returned call waits and gives the received tensors."""
    nxt, prev = _neighbours(group)
    got = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t, nxt, group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, g, prev, group) for g in got]
    reqs = dist.batch_isend_irecv(ops)

    def wait() -> list[Tensor]:
        for req in reqs:
            req.wait()
        return got
    return wait


def _mask(q_pos: Tensor, k_pos: Tensor, data_mask: Optional[Tensor]) -> Tensor:
    """True where masked: the future (key after query), or where the data's mask says so."""
    masked = (k_pos[None, :] > q_pos[:, None])[None, None]
    return masked if data_mask is None else masked | data_mask


def _acc(t: Tensor) -> Tensor:
    """The tensor in the dtype the ring computes and accumulates in: fp32 (fp64 stays fp64)."""
    return t if t.dtype == torch.float64 else t.float()


def _heads_first(t: Tensor, heads: int) -> Tensor:
    """[s, b, groups, hn] -> [b, heads, s, hn] in the accumulation dtype, each group repeated heads /
    groups times (GQA, as DotProductAttention's repeat_interleave)."""
    rep = heads // t.size(2)
    t = _acc(t).permute(1, 2, 0, 3)
    return t.repeat_interleave(rep, dim=1) if rep > 1 else t


def _to_groups(grad: Tensor, groups: int) -> Tensor:
    """A gradient [b, heads, s, hn] of _heads_first's output -> [b, groups, s, hn] (sum over the copies)."""
    b, heads, s, hn = grad.shape
    return grad.view(b, groups, heads // groups, s, hn).sum(2) if heads != groups else grad


def _block_scores(qf: Tensor, kv: list[Tensor], cp_rank: int, src: int, q_pos: Tensor, data_mask: Optional[Tensor],
                  cp: int, scale: float) -> tuple[slice, slice, Tensor, Tensor, Tensor]:
    """Source rank `src`'s key/value block `kv` against this rank's queries qf [b, heads, s, hn]: the
    live rows and columns (live_block), the block's keys and values there [b, heads, cols, hn] and the
    scaled scores [b, heads, rows, cols], -inf where masked."""
    s, heads = qf.size(2), qf.size(1)
    rows, cols = live_block(cp_rank, src, s)
    k_pos = local_positions(s, cp, src, device=qf.device)[cols]
    kb = _heads_first(kv[0], heads)[:, :, cols]
    vb = _heads_first(kv[1], heads)[:, :, cols]
    scores = torch.matmul(qf[:, :, rows], kb.transpose(-1, -2)) * scale
    cols_of_data = None if data_mask is None else data_mask[:, :, rows][..., k_pos]
    scores = scores.masked_fill(_mask(q_pos[rows], k_pos, cols_of_data), float("-inf"))
    return rows, cols, kb, vb, scores


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, data_mask: Optional[Tensor], cfg: RingConfig) -> Tensor:
        group = cfg.group
        c, r = group.size(), group.rank()
        s, b, heads, _ = q.shape
        q_pos = local_positions(s, c, r, device=q.device)
        qf = _acc(q).permute(1, 2, 0, 3)  # [b, heads, s, hn]
        hv = v.size(3)  # the values' head dim (MLA's differs from the queries' and keys')
        acc = torch.zeros((b, heads, s, hv), device=q.device, dtype=qf.dtype)
        row_max = torch.full((b, heads, s), float("-inf"), device=q.device, dtype=qf.dtype)
        row_sum = torch.zeros((b, heads, s), device=q.device, dtype=qf.dtype)
        keeps: list[Optional[Tensor]] = []
        kv = [k.contiguous(), v.contiguous()]
        for step in range(c):
            src = (r - step) % c
            wait = _shift(kv, group) if step < c - 1 else None  # the next block travels while this one computes
            rows, cols, _, vb, scores = _block_scores(qf, kv, r, src, q_pos, data_mask, c, cfg.scale)
            new_max = torch.maximum(row_max[:, :, rows], scores.amax(-1))
            # A row with nothing seen yet keeps max -inf: shift by 0 there (exp(-inf) = 0, no NaN).
            shift = torch.where(torch.isinf(new_max), torch.zeros_like(new_max), new_max)
            probs = torch.exp(scores - shift[..., None])
            fade = torch.exp(row_max[:, :, rows] - shift)
            row_sum[:, :, rows] = row_sum[:, :, rows] * fade + probs.sum(-1)
            keep = None
            if cfg.dropout > 0:
                with cfg.rng():
                    keep = torch.rand_like(probs) >= cfg.dropout
                probs = probs * keep / (1.0 - cfg.dropout)
            keeps.append(keep)
            acc[:, :, rows] = acc[:, :, rows] * fade[..., None] + torch.matmul(probs, vb)
            row_max[:, :, rows] = new_max
            if wait is not None:
                kv = wait()
        seen = row_sum > 0
        out = acc / torch.where(seen, row_sum, torch.ones_like(row_sum))[..., None]
        # log-sum-exp per row; +inf where a row saw nothing (backward's exp(score - lse) is then 0).
        lse = torch.where(seen, row_max + torch.log(torch.where(seen, row_sum, torch.ones_like(row_sum))),
                          torch.full_like(row_sum, float("inf")))
        ctx.save_for_backward(q, k, v, data_mask, out, lse, *[t for t in keeps if t is not None])
        ctx.cfg, ctx.has_keep = cfg, [t is not None for t in keeps]
        return out.to(q.dtype).permute(2, 0, 1, 3).reshape(s, b, heads * hv)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        q, k, v, data_mask, out, lse, *saved_keeps = ctx.saved_tensors
        cfg: RingConfig = ctx.cfg
        group = cfg.group
        c, r = group.size(), group.rank()
        s, b, heads, _ = q.shape
        groups = k.size(2)
        it = iter(saved_keeps)
        keeps = [next(it) if has else None for has in ctx.has_keep]
        q_pos = local_positions(s, c, r, device=q.device)
        qf = _acc(q).permute(1, 2, 0, 3)
        hv = v.size(3)
        dout = _acc(grad_out).reshape(s, b, heads, hv).permute(1, 2, 0, 3)  # [b, heads, s, hv]
        delta = (dout * out).sum(-1)  # rowsum(P o dP): the softmax's backward term
        dq = torch.zeros_like(qf)
        kv = [k.contiguous(), v.contiguous()]
        # The key and value gradients of the block in hand, fp32, groups' layout; they travel with it.
        dkv = [torch.zeros((b, groups, s, t.size(3)), device=q.device, dtype=qf.dtype) for t in (k, v)]
        for step in range(c):
            src = (r - step) % c
            wait = _shift(kv, group) if step < c - 1 else None  # the next block travels while this one computes
            rows, cols, kb, vb, scores = _block_scores(qf, kv, r, src, q_pos, data_mask, c, cfg.scale)
            q_rows = qf[:, :, rows]
            probs = torch.exp(scores - lse[:, :, rows, None])  # the softmax's probabilities, masked = 0
            d_rows = dout[:, :, rows]
            d_probs = torch.matmul(d_rows, vb.transpose(-1, -2))
            kept = probs
            if keeps[step] is not None:
                kept = probs * keeps[step] / (1.0 - cfg.dropout)
                d_probs = d_probs * keeps[step] / (1.0 - cfg.dropout)
            d_scores = probs * (d_probs - delta[:, :, rows, None]) * cfg.scale
            dq[:, :, rows] += torch.matmul(d_scores, kb)
            dkv[0][:, :, cols] += _to_groups(torch.matmul(d_scores.transpose(-1, -2), q_rows), groups)
            dkv[1][:, :, cols] += _to_groups(torch.matmul(kept.transpose(-1, -2), d_rows), groups)
            # The gradient follows its block one hop; after cp hops it is home with every rank's part.
            if c > 1:
                dkv = _shift(dkv, group)()
            if wait is not None:
                kv = wait()
        dk, dv = (g.permute(2, 0, 1, 3).to(t.dtype) for g, t in zip(dkv, (k, v)))
        return dq.permute(2, 0, 1, 3).to(q.dtype), dk, dv, None, None


def ring_attention(q: Tensor, k: Tensor, v: Tensor, attention_mask: Optional[Tensor], cfg: RingConfig) -> Tensor:
    """Causal attention of this CP rank's queries over the whole sequence, passing keys and values
    around cfg.group. q and k [s_local, b, heads or groups, hn], v [s_local, b, groups, hv] (this rank's tokens in
    get_batch_on_this_cp_rank's order); attention_mask None or [b or 1, 1, s_local, S] (True = masked,
    columns in sequence order), on top of the causal mask. Returns [s_local, b, heads x hv] in q's dtype."""
    mask = None if attention_mask is None else attention_mask.to(torch.bool)
    return _RingAttention.apply(q, k, v, mask, cfg)
