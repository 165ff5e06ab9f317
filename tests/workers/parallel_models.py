"""Models for the parallel tests, each buildable dense (plain torch layers) or tensor-parallel
(hvdlite.torch.parallel layers) from the same seed: the same construction order draws the same
random numbers, so the tensor-parallel shards are slices of the dense weights."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from hvdlite.torch import parallel as P


# ---------------------------------------------------------------------- pipeline test model
class Split(nn.Module):
    """Tensor -> (first half, second half, an integer tensor that carries no gradient)."""

    def forward(self, x):
        h = x.shape[-1] // 2
        return x[..., :h], x[..., h:], (x.detach() > 0).sum(-1)


class TupleMix(nn.Module):
    def __init__(self, h: int):
        super().__init__()
        self.a = nn.Linear(h, h)
        self.b = nn.Linear(h, h)

    def forward(self, xs):
        x1, x2, count = xs
        return torch.tanh(self.a(x1)) * x2, self.b(x2), count


class Merge(nn.Module):
    def forward(self, xs):
        x1, x2, count = xs
        return torch.cat([x1, x2], dim=-1) + count.unsqueeze(-1).to(x1.dtype) * 0.01


class Gate(nn.Module):
    """A Pop combiner with parameters."""

    def __init__(self, h: int):
        super().__init__()
        self.w = nn.Linear(h, h)

    def forward(self, x, skip):
        return x + torch.sigmoid(self.w(skip)) * skip


def pp_layers(width: int = 16, n_in: int = 8, n_out: int = 4) -> list:
    """12 layers with tuple activations, an integer side tensor, and two skip connections that
    span several stages on a 2- or 4-stage split."""
    h = width
    return [
        nn.Linear(n_in, h),                 # 0
        nn.Tanh(),                          # 1
        P.Stash("long"),                    # 2   popped at layer 10
        nn.Linear(h, h),                    # 3
        Split(),                            # 4
        TupleMix(h // 2),                   # 5
        Merge(),                            # 6
        P.Stash("short"),                   # 7   popped at layer 9
        nn.LayerNorm(h),                    # 8
        P.Pop("short"),                     # 9
        P.Pop("long", Gate(h)),             # 10
        nn.Linear(h, n_out),                # 11
    ]


# ---------------------------------------------------------------------- GPT
class Embed(nn.Module):
    def __init__(self, vocab: int, hidden: int, seq: int, tp):
        super().__init__()
        self.tok = P.VocabParallelEmbedding(vocab, hidden, tp) if tp is not None else \
            nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(seq, hidden)

    def forward(self, ids):
        pos = torch.arange(ids.shape[1], device=ids.device)
        return self.tok(ids) + self.pos(pos)


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, tp):
        super().__init__()
        k = 1 if tp is None else tp.size()
        self.heads, self.local_heads, self.head_dim = heads, heads // k, hidden // heads
        self.ln1 = nn.LayerNorm(hidden)
        if tp is None:
            self.q, self.k, self.v = (nn.Linear(hidden, hidden) for _ in range(3))
            self.proj = nn.Linear(hidden, hidden)
        else:
            self.q, self.k, self.v = (P.ColumnParallelLinear(hidden, hidden, process_set=tp)
                                      for _ in range(3))
            self.proj = P.RowParallelLinear(hidden, hidden, process_set=tp)
        self.ln2 = nn.LayerNorm(hidden)
        if tp is None:
            self.fc1, self.fc2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)
        else:
            self.fc1 = P.ColumnParallelLinear(hidden, 4 * hidden, process_set=tp)
            self.fc2 = P.RowParallelLinear(4 * hidden, hidden, process_set=tp)

    def forward(self, x):
        b, t, _ = x.shape
        h = self.ln1(x)

        def heads(z):
            return z.view(b, t, self.local_heads, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.q(h)), heads(self.k(h)), heads(self.v(h))
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        att = scores.masked_fill(mask, float("-inf")).softmax(-1) @ v
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, self.local_heads * self.head_dim))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Head(nn.Module):
    """Final norm and the (vocabulary-sharded, under tensor parallelism) logits."""

    def __init__(self, hidden: int, vocab: int, tp):
        super().__init__()
        self.ln = nn.LayerNorm(hidden)
        self.lm = nn.Linear(hidden, vocab) if tp is None else \
            P.ColumnParallelLinear(hidden, vocab, process_set=tp)

    def forward(self, x):
        return self.lm(self.ln(x))


def gpt_layers(tp=None, vocab: int = 32, hidden: int = 16, heads: int = 4, seq: int = 8,
               blocks: int = 2) -> list:
    return [Embed(vocab, hidden, seq, tp)] + [Block(hidden, heads, tp) for _ in range(blocks)] \
        + [Head(hidden, vocab, tp)]


def gpt_batch(n: int, seq: int = 8, vocab: int = 32, seed: int = 7):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (n, seq + 1), generator=g)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def dense_lm_loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def tp_lm_loss(tp):
    def loss(logits, targets):
        return P.vocab_parallel_cross_entropy(logits, targets, tp)
    return loss
