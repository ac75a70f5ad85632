"""A Hugging Face BERT trained data-parallel with `tpudist.fit`, written as its users write it.

    python -m tpudist.xla_dist --local --nproc-per-host 2 -- python examples/train_bert.py

`transformers.BertForSequenceClassification` from a config (random weights, no download; the
config's defaults otherwise: dropout 0.1, the default attention implementation), batches as the
model takes them (`input_ids`, `attention_mask`, `labels`), and no loss function: the model
returns its own loss, which `tpudist.fit(model, loader, optimizer)` trains. Each step is one XLA
executable over every process (forward, backward, gradient all-reduce and the AdamW update).

The task is synthetic but learnable: a sequence's label is whether its marker token appears in
it. Every process builds the same data (same seeds). Rank 0 prints one line per epoch and, last,
`loss <first epoch> -> <last epoch>` and `accuracy <before> -> <after>` on held-out sequences.
"""

from __future__ import annotations

import argparse

import torch

import tpudist

MARKER = 3


class Sequences(torch.utils.data.Dataset):
    """Token sequences with padding; label 1 when the marker token occurs among the real tokens."""

    def __init__(self, n: int, vocab: int, length: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(4, vocab, (n, length), generator=g)
        self.labels = torch.randint(0, 2, (n,), generator=g)
        where = torch.randint(0, length // 2, (n,), generator=g)
        self.ids[torch.arange(n)[self.labels == 1], where[self.labels == 1]] = MARKER
        lengths = torch.randint(length // 2, length + 1, (n,), generator=g)
        self.mask = (torch.arange(length)[None, :] < lengths[:, None]).long()
        self.ids[self.mask == 0] = 0  # the padding token

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i], "labels": self.labels[i]}


@torch.no_grad()
def accuracy(model: torch.nn.Module, data: Sequences) -> float:
    model.eval()
    logits = model(input_ids=data.ids, attention_mask=data.mask).logits
    model.train()
    return (logits.argmax(-1) == data.labels).float().mean().item()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch", type=int, default=16, help="loader batch: one process's share of a step")
    parser.add_argument("--examples", type=int, default=1024)
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args(argv)

    from transformers import BertConfig, BertForSequenceClassification

    tpudist.init()
    torch.manual_seed(0)  # the same initial weights on every process
    config = BertConfig(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, max_position_embeddings=64, num_labels=2)
    model = BertForSequenceClassification(config)
    train, test = Sequences(args.examples, 64, 24, seed=1), Sequences(256, 64, 24, seed=2)
    loader = torch.utils.data.DataLoader(train, batch_size=args.batch, shuffle=True, drop_last=True,
                                         generator=torch.Generator().manual_seed(3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    before = accuracy(model, test)
    history = tpudist.fit(model, loader, optimizer, epochs=args.epochs)
    if tpudist.process_index() == 0:
        print(f"bert: processes {tpudist.process_count()}, {args.epochs} epochs, loss "
              f"{history[0]['loss']:.4f} -> {history[-1]['loss']:.4f}; accuracy {before:.3f} -> "
              f"{accuracy(model, test):.3f}", flush=True)


if __name__ == "__main__":
    main()
