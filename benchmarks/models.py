"""The three model kinds the benchmarks train: comm-heavy MLP, conv net with BatchNorm, transformer."""
from __future__ import annotations

import torch
import torch.nn as nn


def mlp() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """~4.2 M parameters and little compute: communication dominates."""
    model = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                          nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                          nn.Linear(1024, 10))
    return model, torch.randn(32, 512), torch.randint(0, 10, (32,))


def cnn() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """A small conv net with BatchNorm on 32x32 images."""
    def block(cin, cout):
        return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]
    model = nn.Sequential(*block(3, 32), *block(32, 32), nn.MaxPool2d(2), *block(32, 64),
                          *block(64, 64), nn.MaxPool2d(2), nn.Flatten(),
                          nn.Linear(64 * 8 * 8, 256), nn.ReLU(), nn.Linear(256, 10))
    return model, torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,))


class _Transformer(nn.Module):
    def __init__(self, vocab=2000, d=256, layers=2, heads=4, classes=10):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, heads, dim_feedforward=4 * d, batch_first=True,
                                           dropout=0.0)
        self.enc = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        return self.head(self.enc(self.emb(x)).mean(1))


def transformer() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """A 2-layer transformer encoder classifier on sequences of 64 tokens."""
    return _Transformer(), torch.randint(0, 2000, (16, 64)), torch.randint(0, 10, (16,))


MODELS = {"mlp": mlp, "cnn": cnn, "transformer": transformer}
