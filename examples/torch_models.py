"""Reference PyTorch models for the torch -> XLA bridge: used by its tests and by
scripts/bench_torch.py, so both exercise the same four models.

Each `Reference` builds a model (at a size: "test" is tiny, "bench" is a realistic small model),
makes a batch of inputs and targets from a torch.Generator, and computes the loss.

    ref = REFERENCES["mlp"]
    model = ref.build("test")
    inputs, target = ref.batch("test", 64, torch.Generator().manual_seed(0))
    loss = ref.loss(model(*inputs), target)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    """Linear -> GELU (tanh) -> Linear -> SiLU -> Dropout -> Linear."""

    def __init__(self, features: int, hidden: int, classes: int, dropout: float = 0.0):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(features, hidden), nn.GELU(approximate="tanh"),
            nn.Linear(hidden, hidden), nn.SiLU(), nn.Dropout(dropout),
            nn.Linear(hidden, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class EmbeddingBagMLP(nn.Module):
    """A bag of token ids (EmbeddingBag, mean, 0 = padding) and a category id (Embedding) -> MLP."""

    def __init__(self, vocab: int, categories: int, dim: int, hidden: int, classes: int):
        super().__init__()
        self.bag = nn.EmbeddingBag(vocab, dim, mode="mean", padding_idx=0)
        self.category = nn.Embedding(categories, dim)
        self.mlp = nn.Sequential(nn.Linear(2 * dim, hidden), nn.ReLU(), nn.LayerNorm(hidden), nn.Linear(hidden, classes))

    def forward(self, tokens: torch.Tensor, category: torch.Tensor) -> torch.Tensor:
        return self.mlp(torch.cat([self.bag(tokens), self.category(category)], dim=1))


class TransformerClassifier(nn.Module):
    """Token + position embeddings -> TransformerEncoderLayer(s) -> LayerNorm -> mean pool -> Linear."""

    def __init__(self, vocab: int, length: int, dim: int, heads: int, ff: int, layers: int, classes: int,
                 dropout: float = 0.0):
        super().__init__()
        self.tokens = nn.Embedding(vocab, dim)
        self.position = nn.Parameter(torch.randn(length, dim) * 0.02)
        layer = nn.TransformerEncoderLayer(dim, heads, ff, dropout=dropout, activation="gelu", batch_first=True)
        self.encoder = nn.ModuleList([layer] + [nn.TransformerEncoderLayer(
            dim, heads, ff, dropout=dropout, activation="gelu", batch_first=True) for _ in range(layers - 1)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tokens(tokens) + self.position[: tokens.shape[1]]
        for layer in self.encoder:
            x = layer(x)
        return self.head(self.norm(x).mean(dim=1))


class ConvNet(nn.Module):
    """ResNet-style: conv-BN-ReLU stem, max pool, one residual block, avg pool, adaptive avg pool, Linear.

    Convolutions before a BatchNorm have no bias, as in ResNet (a bias there has zero gradient).
    """

    def __init__(self, channels: int, classes: int):
        super().__init__()
        c = channels
        self.stem = nn.Sequential(nn.Conv2d(3, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU(),
                                  nn.MaxPool2d(3, stride=2, padding=1))
        self.block = nn.Sequential(nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU(),
                                   nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c))
        self.down = nn.Sequential(nn.Conv2d(c, 2 * c, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(2 * c),
                                  nn.ReLU(), nn.AvgPool2d(2))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(2 * c, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.stem(images)
        x = F.relu(x + self.block(x))
        return self.head(torch.flatten(self.pool(self.down(x)), 1))


@dataclass(frozen=True)
class Reference:
    """A reference model: how to build it, feed it and score it, at "test" or "bench" size."""

    name: str
    build: Callable[[str], nn.Module]
    batch: Callable[[str, int, torch.Generator], tuple[tuple[torch.Tensor, ...], torch.Tensor]]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


_SIZES = {
    "mlp": {"test": dict(features=12, hidden=16, classes=5), "bench": dict(features=256, hidden=1024, classes=10)},
    "embedding_bag": {"test": dict(vocab=40, categories=7, dim=8, hidden=16, classes=3, length=6),
                      "bench": dict(vocab=20000, categories=100, dim=64, hidden=512, classes=10, length=32)},
    "transformer": {"test": dict(vocab=30, length=6, dim=16, heads=2, ff=32, layers=1, classes=3),
                    "bench": dict(vocab=1000, length=32, dim=128, heads=4, ff=512, layers=2, classes=10)},
    "conv": {"test": dict(channels=4, classes=3, image=12), "bench": dict(channels=32, classes=10, image=32)},
}


def _mlp_batch(size, n, g):
    s = _SIZES["mlp"][size]
    return (torch.randn(n, s["features"], generator=g),), torch.randint(0, s["classes"], (n,), generator=g)


def _bag_build(size):
    s = dict(_SIZES["embedding_bag"][size])
    s.pop("length")
    return EmbeddingBagMLP(**s)


def _bag_batch(size, n, g):
    s = _SIZES["embedding_bag"][size]
    tokens = torch.randint(1, s["vocab"], (n, s["length"]), generator=g)
    # ragged bags: a random tail of each row is padding (id 0)
    lengths = torch.randint(1, s["length"] + 1, (n, 1), generator=g)
    tokens = torch.where(torch.arange(s["length"]) < lengths, tokens, 0)
    category = torch.randint(0, s["categories"], (n,), generator=g)
    return (tokens, category), torch.randint(0, s["classes"], (n,), generator=g)


def _transformer_batch(size, n, g):
    s = _SIZES["transformer"][size]
    return (torch.randint(0, s["vocab"], (n, s["length"]), generator=g),), torch.randint(0, s["classes"], (n,), generator=g)


def _conv_build(size):
    s = dict(_SIZES["conv"][size])
    s.pop("image")
    return ConvNet(**s)


def _conv_batch(size, n, g):
    s = _SIZES["conv"][size]
    return (torch.randn(n, 3, s["image"], s["image"], generator=g),), torch.randint(0, s["classes"], (n,), generator=g)


REFERENCES: dict[str, Reference] = {
    "mlp": Reference("mlp", lambda size: MLP(**_SIZES["mlp"][size]), _mlp_batch, F.cross_entropy),
    "embedding_bag": Reference("embedding_bag", _bag_build, _bag_batch, F.cross_entropy),
    "transformer": Reference("transformer", lambda size: TransformerClassifier(**_SIZES["transformer"][size]),
                             _transformer_batch, F.cross_entropy),
    "conv": Reference("conv", _conv_build, _conv_batch, F.cross_entropy),
}


class WithLoss(nn.Module):
    """model + loss in one module, so one compiled call covers the whole forward (as the benchmark does)."""

    def __init__(self, model: nn.Module, loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
        super().__init__()
        self.model, self.loss = model, loss

    def forward(self, *inputs_and_target: torch.Tensor) -> torch.Tensor:
        *inputs, target = inputs_and_target
        return self.loss(self.model(*inputs), target)
