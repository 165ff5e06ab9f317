"""Train a small GPT-style language model with tensor parallelism x pipeline parallelism
(x data parallelism), on hvdlite's engine.

    hvdlite-run -np 4 python examples/parallel/gpt_tp_pp.py                 # tp=2 x pp=2
    hvdlite-run -np 8 python examples/parallel/gpt_tp_pp.py --tp 2 --pp 2   # x dp=2
    hvdlite-run -np 2 python examples/parallel/gpt_tp_pp.py --tp 1 --pp 2 --schedule gpipe

The task is synthetic and learnable: every sequence counts modulo the vocabulary from its own
start with its own step (3, 6, 9, ... for step 3), so the model has to read the step off the
context. The loss
starts near ln(vocab) and falls well below 1; at the end the pipeline greedily continues a few
prompts (forward-only, variable sequence lengths) and checks the continuations.

What each piece does:
* `parallel.mesh(tp, pp)`: process sets in Megatron's layout (tp fastest varying);
* `ColumnParallelLinear` / `RowParallelLinear`: attention heads and MLP split over the tp group,
  `VocabParallelEmbedding` + `vocab_parallel_cross_entropy`: the vocabulary split, never gathered;
* `model_parallel_seed` + `get_rng_tracker().fork()`: dropout that is identical on tensor-parallel
  ranks outside TP regions and different inside them;
* `Pipeline(..., process_set=mesh.pp)`: the blocks split over stages, 1F1B or GPipe schedule;
* `DistributedOptimizer(..., process_set=mesh.dp)` and `parallel.clip_grad_norm_`: data-parallel
  gradient averaging and clipping by the norm of the whole model.
"""
from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn.functional as F
from torch import nn

import hvdlite.torch as hvd
from hvdlite.torch import parallel


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size")
    p.add_argument("--pp", type=int, default=2, help="pipeline stages")
    p.add_argument("--chunks", type=int, default=4, help="micro-batches per step")
    p.add_argument("--schedule", default="1f1b", choices=["1f1b", "gpipe"])
    p.add_argument("--checkpoint", default="never", choices=["never", "except_last", "always"])
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--batch", type=int, default=16, help="sequences per step per replica")
    p.add_argument("--seq", type=int, default=24)
    p.add_argument("--vocab", type=int, default=32)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2, help="transformer blocks")
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--max-step", type=int, default=4, help="sequences count in steps 1..this")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=10)
    return p.parse_args()


# ---------------------------------------------------------------------- the model
class Embed(nn.Module):
    def __init__(self, vocab, hidden, seq, dropout, tp):
        super().__init__()
        self.tok = parallel.VocabParallelEmbedding(vocab, hidden, tp)
        self.pos = nn.Embedding(seq, hidden)
        self.dropout = dropout

    def forward(self, ids):
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1]))
        return F.dropout(x, self.dropout, self.training)      # replicated region


class Block(nn.Module):
    def __init__(self, hidden, heads, dropout, tp):
        super().__init__()
        if heads % tp.size():
            raise ValueError(f"{heads} heads cannot be split over tp={tp.size()}")
        self.local_heads, self.head_dim = heads // tp.size(), hidden // heads
        self.dropout = dropout
        self.ln1 = nn.LayerNorm(hidden)
        self.qkv = nn.ModuleList(parallel.ColumnParallelLinear(hidden, hidden, process_set=tp)
                                 for _ in range(3))
        self.proj = parallel.RowParallelLinear(hidden, hidden, process_set=tp)
        self.ln2 = nn.LayerNorm(hidden)
        self.fc1 = parallel.ColumnParallelLinear(hidden, 4 * hidden, process_set=tp)
        self.fc2 = parallel.RowParallelLinear(4 * hidden, hidden, process_set=tp)

    def forward(self, x):
        b, t, _ = x.shape
        h = self.ln1(x)
        q, k, v = (lin(h).view(b, t, self.local_heads, self.head_dim).transpose(1, 2)
                   for lin in self.qkv)
        att = (q @ k.transpose(-1, -2)) / math.sqrt(self.head_dim)
        att = att.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        att = att.softmax(-1)
        with parallel.get_rng_tracker().fork():                 # this rank's heads only
            att = F.dropout(att, self.dropout, self.training)
        y = (att @ v).transpose(1, 2).reshape(b, t, -1)
        x = x + F.dropout(self.proj(y), self.dropout, self.training)
        return x + F.dropout(self.fc2(F.gelu(self.fc1(self.ln2(x)))), self.dropout,
                             self.training)


class Head(nn.Module):
    def __init__(self, hidden, vocab, tp):
        super().__init__()
        self.ln = nn.LayerNorm(hidden)
        self.lm = parallel.ColumnParallelLinear(hidden, vocab, process_set=tp)  # vocab-sharded

    def forward(self, x):
        return self.lm(self.ln(x))


# ---------------------------------------------------------------------- data
def batch(n, seq, vocab, max_step, gen):
    """Sequences counting modulo `vocab` from a random start in a random step 1..max_step."""
    start = torch.randint(0, vocab, (n, 1), generator=gen)
    step = torch.randint(1, max_step + 1, (n, 1), generator=gen)
    ids = (start + step * torch.arange(seq + 1)) % vocab
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def main():
    args = parse_args()
    torch.set_num_threads(1)
    hvd.init(process_sets="dynamic")
    mesh = parallel.mesh(tp=args.tp, pp=args.pp)
    if hvd.rank() == 0:
        print(mesh, flush=True)
    # Same seed everywhere: every rank draws the same full weights and keeps its shard.
    parallel.model_parallel_seed(args.seed, mesh.tp)
    layers = ([Embed(args.vocab, args.hidden, args.seq, args.dropout, mesh.tp)]
              + [Block(args.hidden, args.heads, args.dropout, mesh.tp)
                 for _ in range(args.layers)]
              + [Head(args.hidden, args.vocab, mesh.tp)])
    pipe = parallel.Pipeline(layers, chunks=args.chunks, schedule=args.schedule,
                             checkpoint=args.checkpoint, process_set=mesh.pp)
    reporter = pipe.is_last_stage and mesh.tp_rank == 0 and mesh.dp_rank == 0
    if mesh.tp_rank == 0 and mesh.dp_rank == 0:
        lo, hi = pipe.partition[pipe.stage]
        n_params = sum(q.numel() for q in pipe.parameters())
        print(f"stage {pipe.stage}: layers {lo}..{hi - 1}, {n_params} parameters on this rank",
              flush=True)
    if hvd.rank() == 0:
        print(f"schedule {args.schedule}, {args.chunks} micro-batches: simulated "
              f"{pipe.schedule_report}", flush=True)
    opt = hvd.DistributedOptimizer(torch.optim.AdamW(pipe.parameters(), lr=args.lr),
                                   named_parameters=pipe.named_parameters(),
                                   process_set=mesh.dp)

    def loss_fn(logits, targets):
        return parallel.vocab_parallel_cross_entropy(logits, targets, mesh.tp)

    # Each data-parallel replica reads its own batches; tp/pp ranks of a replica the same ones.
    gen = torch.Generator().manual_seed(1000 + mesh.dp_rank)
    first = last = None
    t0 = time.perf_counter()
    for step in range(1, args.steps + 1):
        inputs, targets = batch(args.batch, args.seq, args.vocab, args.max_step, gen)
        opt.zero_grad()
        loss = pipe.train_step(inputs, targets, loss_fn)
        opt.synchronize()                                  # data-parallel average
        norm = parallel.clip_grad_norm_(pipe.parameters(), args.clip, mesh)
        with opt.skip_synchronize():
            opt.step()
        if reporter:
            first = first if first is not None else loss.item()
            last = loss.item()
            if step % args.log_every == 0 or step == 1:
                print(f"step {step:4d}  loss {last:.4f}  grad norm {norm.item():.3f}  "
                      f"({(time.perf_counter() - t0) / step * 1e3:.0f} ms/step)", flush=True)

    # Greedy continuation of a few prompts: forward-only, growing sequence length.
    pipe.eval()
    starts = torch.randint(0, args.vocab, (args.chunks, 1), generator=torch.Generator()
                           .manual_seed(7))
    steps = torch.arange(args.chunks).unsqueeze(1) % args.max_step + 1
    prompts = (starts + steps * torch.arange(6)) % args.vocab
    seqs = prompts
    for _ in range(args.seq - 6):
        logits = pipe(seqs)                                # last stage: [B, T, vocab/tp]
        nxt = torch.zeros(seqs.shape[0], dtype=torch.long)
        if pipe.is_last_stage:
            full = parallel.gather_from_tensor_parallel_region(logits[:, -1], mesh.tp,
                                                               name="decode.logits")
            nxt = full.argmax(-1)
        nxt = hvd.broadcast(nxt, root_rank=pipe.stage_ranks[-1], name="decode.next",
                            process_set=mesh.pp)
        seqs = torch.cat([seqs, nxt.unsqueeze(1)], dim=1)
    step_size = (prompts[:, 1] - prompts[:, 0]) % args.vocab
    want = (prompts[:, :1] + step_size.unsqueeze(1) * torch.arange(seqs.shape[1])) % args.vocab
    correct = (seqs == want).all(1)
    if reporter:
        for s, ok in zip(seqs.tolist(), correct.tolist()):
            print(f"continuation {s[:6]} -> {s[6:12]}... {'correct' if ok else 'WRONG'}",
                  flush=True)
        print(f"final loss {last:.4f} (first {first:.4f}); {int(correct.sum())}/{len(correct)} "
              f"continuations correct; tp={mesh.tp_size} pp={mesh.pp_size} dp={mesh.dp_size}",
              flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
