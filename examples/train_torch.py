"""A PyTorch model trained data-parallel with `tpudist.fit`: the fused XLA step over every process.

    python -m tpudist.xla_dist --local --nproc-per-host 2 -- python examples/train_torch.py

The model is plain PyTorch: a bag of token ids through `tpudist.nn.ShardedEmbedding` (its rows
split over the processes), a category through `nn.Embedding`, then Linear / LayerNorm / GELU layers;
the loss is `F.cross_entropy` and the optimizer `torch.optim.AdamW` with a cosine LR schedule.
`tpudist.fit` runs each step as one XLA executable (forward, backward, gradient all-reduce and the
AdamW update; see `tpudist.compile_train_step`), gives every process its share of each global
batch, and shows a progress bar on rank 0. The task is synthetic but learnable: the label is the
sign of a hidden score of the tokens plus a per-category offset.

Every process builds the same data (same seeds), so any number of processes trains on the same
global batches. Rank 0 prints one line per epoch and, last, `accuracy <before> -> <after>` on
held-out examples.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

import tpudist


class BagClassifier(nn.Module):
    def __init__(self, vocab: int, categories: int, dim: int, hidden: int):
        super().__init__()
        self.tokens = tpudist.nn.ShardedEmbedding(vocab, dim, mode="mean")
        self.category = nn.Embedding(categories, dim)
        self.head = nn.Sequential(nn.Linear(2 * dim, hidden), nn.LayerNorm(hidden), nn.GELU(),
                                  nn.Linear(hidden, 2))

    def forward(self, tokens: torch.Tensor, category: torch.Tensor) -> torch.Tensor:
        return self.head(torch.cat([self.tokens(tokens), self.category(category)], dim=1))


def make_data(n: int, vocab: int, categories: int, bag: int, seed: int) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(vocab, generator=torch.Generator().manual_seed(0))       # the same rule for every split
    offset = torch.randn(categories, generator=torch.Generator().manual_seed(1)) * 0.5
    tokens = torch.randint(0, vocab, (n, bag), generator=g)
    category = torch.randint(0, categories, (n,), generator=g)
    label = (hidden[tokens].mean(dim=1) * bag ** 0.5 + offset[category] > 0).long()
    return torch.utils.data.TensorDataset(tokens, category, label)


@torch.no_grad()
def accuracy(model: nn.Module, data: torch.utils.data.TensorDataset) -> float:
    model.eval()
    tokens, category, label = data.tensors
    correct = (model(tokens, category).argmax(dim=1) == label).float().mean().item()
    model.train()
    return correct


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64, help="loader batch: one process's share of a step")
    parser.add_argument("--examples", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=5000)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args(argv)

    tpudist.init()
    rank = tpudist.process_index()
    torch.manual_seed(0)  # the same initial weights on every process (the sharded rows differ by rank)
    model = BagClassifier(args.vocab, categories=16, dim=32, hidden=64)
    train = make_data(args.examples, args.vocab, 16, bag=12, seed=2)
    test = make_data(1024, args.vocab, 16, bag=12, seed=3)
    loader = torch.utils.data.DataLoader(train, batch_size=args.batch, shuffle=True, drop_last=True,
                                         generator=torch.Generator().manual_seed(4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    before = accuracy(model, test)
    history = []
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)
    for _ in range(args.epochs):
        # one epoch at a time so the LR schedule steps between epochs (the fused step reads the LR anew)
        history += tpudist.fit(model, loader, optimizer, F.cross_entropy, epochs=1)
        schedule.step()
    after = accuracy(model, test)
    if rank == 0:
        print(f"processes {tpudist.process_count()}, {len(history)} epochs, "
              f"loss {history[0]['loss']:.4f} -> {history[-1]['loss']:.4f}, "
              f"{history[-1]['examples_per_s']:,.0f} examples/s in the last epoch", flush=True)
        print(f"accuracy {before:.3f} -> {after:.3f}", flush=True)


if __name__ == "__main__":
    main()
