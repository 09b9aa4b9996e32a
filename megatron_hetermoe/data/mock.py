"""Deterministic mock data that a model can learn: a random sparse Markov chain over the
vocabulary. Sample i of a run depends only on (seed, i), so every parallel layout sees the
same global batch, microbatch for microbatch."""
from __future__ import annotations

import torch


class MarkovMockData:
    def __init__(self, vocab_size: int, seq_length: int, seed: int, branching: int = 4):
        self.vocab_size, self.seq_length, self.seed = vocab_size, seq_length, seed
        g = torch.Generator().manual_seed(seed)
        # Each token has `branching` likely successors: a next-token loss well below log(V).
        self.next_tokens = torch.randint(0, vocab_size, (vocab_size, branching), generator=g)
        self.next_probs = torch.softmax(torch.randn(vocab_size, branching, generator=g) * 2, dim=-1)

    def sample(self, index: int) -> torch.Tensor:
        """seq_length + 1 token ids for global sample `index`."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        out = torch.empty(self.seq_length + 1, dtype=torch.long)
        out[0] = torch.randint(0, self.vocab_size, (1,), generator=g)
        choices = torch.multinomial(self.next_probs, self.seq_length, replacement=True, generator=g)
        for t in range(self.seq_length):
            out[t + 1] = self.next_tokens[out[t], choices[out[t], t]]
        return out

    def microbatch(self, step: int, microbatch: int, micro_batch_size: int, global_batch_size: int) -> dict:
        """Global microbatch `microbatch` (0-based, counted across DP ranks) of `step`."""
        first = step * global_batch_size + microbatch * micro_batch_size
        x = torch.stack([self.sample(first + i) for i in range(micro_batch_size)])
        tokens, labels = x[:, :-1].contiguous(), x[:, 1:].contiguous()
        s = self.seq_length
        return {
            "tokens": tokens,
            "labels": labels,
            "loss_mask": torch.ones(micro_batch_size, s, dtype=torch.float),
            "position_ids": torch.arange(s).unsqueeze(0).expand(micro_batch_size, s).contiguous(),
        }
