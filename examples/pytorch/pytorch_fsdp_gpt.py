"""A small GPT trained with parameter sharding (hvdlite.torch.fully_shard, FSDP2's pattern).

    hvdlite-run -np 2 python examples/pytorch/pytorch_fsdp_gpt.py
    hvdlite-run -np 4 python examples/pytorch/pytorch_fsdp_gpt.py --hybrid   # shard over 2,
                                                                            # replicate over 2
Options: --bf16 (compute in bfloat16, reduce in float32, float32 master weights), --steps,
--save PATH (a whole state dict, loadable by the plain model, written by rank 0).
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

import hvdlite.torch as hvd


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        n = x.shape[1]
        causal = torch.triu(torch.ones(n, n, dtype=torch.bool, device=x.device), 1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=causal, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab=512, d=128, layers=4, heads=4, context=64):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(context, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight          # tied: both live in the root's shard
        nn.init.normal_(self.tok.weight, std=0.02)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln(x))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--hybrid", action="store_true")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--save", default=None)
    args = p.parse_args()

    hvd.init(process_sets="dynamic" if args.hybrid else None)
    torch.manual_seed(0)                  # the same initial model on every rank
    model = GPT()
    where = None
    if args.hybrid:
        where = hvd.parallel.mesh(dp_shard=2)   # dp_replicate = size / 2
        if hvd.rank() == 0:
            print(where, flush=True)
    mp = hvd.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if args.bf16 else None
    for block in model.blocks:
        hvd.fully_shard(block, process_set=where, mp_policy=mp)
    hvd.fully_shard(model, process_set=where, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)

    g = torch.Generator().manual_seed(1 + hvd.rank())      # each rank its own data
    pattern = torch.arange(64) % 17                       # a sequence the model can learn
    for step in range(args.steps):
        start = torch.randint(0, 17, (8, 1), generator=g)
        idx = (pattern[None, :] + start) % 512
        logits = model(idx[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, 512), idx[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        norm = hvd.fsdp.clip_grad_norm_(model, 1.0)
        opt.step()
        if hvd.rank() == 0 and step % 5 == 0:
            print(f"step {step}: loss {loss.item():.3f}, grad norm {norm.item():.3f}", flush=True)

    held = sum(p.numel() for p in model.parameters())
    total = sum(p.numel() for p in GPT().parameters())
    full = hvd.full_state_dict(model)               # a collective: every rank calls it
    if hvd.rank() == 0:
        print(f"rank 0 holds {held:,} of {total:,} parameters", flush=True)
        if args.save:
            torch.save(full, args.save)
            GPT().load_state_dict(torch.load(args.save))   # the plain model loads it
            print(f"saved {args.save}", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
