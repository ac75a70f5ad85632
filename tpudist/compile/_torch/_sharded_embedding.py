"""`tpudist.nn.ShardedEmbedding`: a torch embedding whose rows are split across processes.

    import torch, tpudist
    tpudist.init()
    emb = tpudist.nn.ShardedEmbedding(1_000_000, 64, mode="sum")   # each process holds 1/N of the rows
    vectors = emb(ids)                 # ids: this process's (batch, bag) LongTensor -> (batch, 64)
    loss = head(vectors).mean()
    loss.backward()                    # every process must call backward: it runs a collective
    tpudist.optimizer_step(opt)        # averages replicated grads; scales the sharded rows' grads

This is the embedding for data-parallel PyTorch programs. It runs in eager torch (its collectives
are tpudist's eager ones, with autograd), under `tpudist.compile(model)` (the graph then runs as
one program over the processes) and inside the fused train step (`tpudist.compile_train_step`,
`tpudist.fit`); compiled, its lookup is in-graph collectives. The JAX embedding is
`tpudist.ShardedEmbedding` (tpudist/compile/_embedding.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tpudist._runtime import local_devices, process_count, process_index
from tpudist.collectives import all_gather, reduce_scatter
from tpudist.compile._torch._custom_ops import SHARDED_ATTR, sharded_embedding_lookup
from tpudist.compile._torch._sync import sync_module

__all__ = ["ShardedEmbedding", "rows_per_process"]

MODES = (None, "sum", "mean")


def _exporting() -> bool:
    is_exporting = getattr(torch.compiler, "is_exporting", None)  # torch >= 2.6
    return bool(is_exporting and is_exporting())


def rows_per_process(num_embeddings: int) -> int:
    """Rows each process holds: an equal share, rounded up to a multiple of its local device count
    so that the fused train step can split the block evenly over those devices."""
    local = len(local_devices())
    share = -(-num_embeddings // process_count())
    return -(-share // local) * local


class ShardedEmbedding(nn.Module):
    """An embedding table whose rows are split across all processes of the job.

    Process p holds rows [p * R, (p + 1) * R) of the table in `self.weight`, where
    R = ceil(num_embeddings / process_count) rounded up to a multiple of the process's local device
    count (see `rows_per_process`): the table is padded with zero rows (padding rows are never
    looked up and never receive gradient).

    `forward(ids)` is a collective: every process calls it at the same time with its own batch of
    ids, and all processes' `ids` must have the same shape (pad ragged batches). With `mode=None`
    the result has shape `ids.shape + (embedding_dim,)`, as `nn.Embedding`; with `mode="sum"` or
    `"mean"` the last dimension of `ids` is a bag that is reduced, as `nn.EmbeddingBag` with 2-D
    input: `ids.shape[:-1] + (embedding_dim,)`.

    Backward is a collective too: each process must run backward through its output. Afterwards
    `self.weight.grad` holds, for this process's rows, the gradient of the SUM of every process's
    loss; `tpudist.optimizer_step` divides it by the process count so that it matches the mean
    of the losses, the convention it uses for replicated parameters.

    How: forward all-gathers the ids, looks up the locally owned rows (zeros for rows owned
    elsewhere) and reduce-scatters (sum) the partial vectors back to the process each id came
    from. Backward all-gathers the output gradients and index-adds those of locally owned ids.

    Example (2 processes)::

        emb = tpudist.nn.ShardedEmbedding(10, 4)     # rows 0-4 on rank 0, 5-9 on rank 1
        out = emb(torch.tensor([[1, 7]]))            # shape (1, 2, 4) on each rank
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, mode: str | None = None, *,
                 dtype: torch.dtype = torch.float32, _weight: torch.Tensor | None = None):
        super().__init__()
        if not isinstance(num_embeddings, int) or num_embeddings < 1:
            raise ValueError(f"num_embeddings={num_embeddings!r} must be a positive int")
        if not isinstance(embedding_dim, int) or embedding_dim < 1:
            raise ValueError(f"embedding_dim={embedding_dim!r} must be a positive int")
        if mode not in MODES:
            raise ValueError(f"mode={mode!r} is not one of {MODES}; use None (one vector per id) or "
                             "'sum' / 'mean' (reduce the last ids dimension as a bag)")
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.mode = mode
        self.process_count = process_count()
        self.rank = process_index()
        self.rows_per_process = rows_per_process(num_embeddings)
        self.row_offset = self.rank * self.rows_per_process
        if _weight is None:
            _weight = self._init_block(dtype)
        assert _weight.shape == (self.rows_per_process, embedding_dim), _weight.shape
        self.weight = nn.Parameter(_weight)
        setattr(self.weight, SHARDED_ATTR, True)

    def _init_block(self, dtype: torch.dtype) -> torch.Tensor:
        # N(0, 1) like nn.Embedding. The seed comes from torch's global RNG, so torch.manual_seed
        # controls it and ranks with the same seed agree on it; mixing in the rank keeps the
        # shards from being copies of each other. The table therefore depends on the process
        # count; build from a dense table (from_dense) when it must not.
        seed = int(torch.randint(0, 2**62, (), dtype=torch.int64))
        gen = torch.Generator().manual_seed(seed + 1_000_003 * self.rank)
        block = torch.randn(self.rows_per_process, self.embedding_dim, generator=gen).to(dtype)
        block[max(0, self.num_embeddings - self.row_offset):] = 0  # padding rows
        return block

    @classmethod
    def from_dense(cls, weight: torch.Tensor, mode: str | None = None) -> ShardedEmbedding:
        """A ShardedEmbedding holding this process's rows of `weight` (num_embeddings, dim).

        Every process must pass the same table. Example::

            emb = ShardedEmbedding.from_dense(torch.randn(10, 4), mode="mean")
        """
        if not isinstance(weight, torch.Tensor) or weight.ndim != 2:
            raise ValueError(f"from_dense needs a 2-D (num_embeddings, embedding_dim) tensor, got "
                             f"{getattr(weight, 'shape', type(weight).__name__)}")
        n, dim = weight.shape
        rank = process_index()
        rows = rows_per_process(n)
        block = torch.zeros(rows, dim, dtype=weight.dtype)
        real = weight.detach()[rank * rows:(rank + 1) * rows]
        block[:len(real)] = real
        return cls(n, dim, mode, dtype=weight.dtype, _weight=block)

    def full_weight(self) -> torch.Tensor:
        """The whole (num_embeddings, embedding_dim) table, gathered from every process (a
        collective: for tests and checkpoints, not the training loop). Current with any fused step
        training it (a door, like `state_dict()`)."""
        sync_module(self)
        return all_gather(self.weight.detach(), dim=0)[:self.num_embeddings].clone()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not isinstance(ids, torch.Tensor) or ids.is_floating_point() or ids.is_complex():
            raise TypeError(f"rank {self.rank}: ShardedEmbedding takes an integer tensor of ids, got "
                            f"{getattr(ids, 'dtype', type(ids).__name__)}")
        if self.mode is not None and (ids.ndim == 0 or ids.shape[-1] == 0):
            raise ValueError(f"rank {self.rank}: mode={self.mode!r} reduces the last ids dimension as a "
                             f"bag, so ids need at least one dimension of size >= 1; got shape {tuple(ids.shape)}")
        if _exporting():
            # captured by the fused train step as one node, lowered to in-graph collectives
            bag = ids.shape[-1] if self.mode is not None else 1
            out = sharded_embedding_lookup(self.weight, ids.reshape(-1, bag), self.mode or "none")
        else:
            out = _Lookup.apply(self.weight, ids, self)
        shape = ids.shape[:-1] if self.mode is not None else ids.shape
        return out.reshape(*shape, self.embedding_dim)

    def _localize(self, gathered: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(local row index, owned mask) for gathered ids of shape (processes, ids per process)."""
        low, high = (int(gathered.min()), int(gathered.max())) if gathered.numel() else (0, 0)
        if low < 0 or high >= self.num_embeddings:
            bad = ((gathered < 0) | (gathered >= self.num_embeddings)).any(dim=1).nonzero().flatten().tolist()
            raise ValueError(f"ShardedEmbedding ids must be in [0, {self.num_embeddings}); the ids of "
                             f"rank(s) {bad} range over [{low}, {high}]")
        local = gathered - self.row_offset
        owned = (local >= 0) & (local < self.rows_per_process)
        return torch.where(owned, local, torch.zeros_like(local)), owned

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, mode={self.mode!r}, rows "
                f"{self.row_offset}..{self.row_offset + self.rows_per_process - 1} of "
                f"{self.rows_per_process * self.process_count} on rank {self.rank}")


class _Lookup(torch.autograd.Function):
    """weight block, local ids -> this process's (ids per process or bags, dim) vectors."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, ids: torch.Tensor, emb: ShardedEmbedding) -> torch.Tensor:
        n, dim = emb.process_count, emb.embedding_dim
        bag = ids.shape[-1] if emb.mode is not None else 1
        gathered = all_gather(ids.reshape(1, -1).to(torch.int64), dim=0)   # (n, ids per process)
        local, owned = emb._localize(gathered)
        vectors = weight[local].masked_fill(~owned.unsqueeze(-1), 0)       # (n, m, dim)
        # Reduce bags before the exchange: it is linear, so partial bag sums add up across
        # processes, and each process then sends (bags, dim) instead of (bags * bag, dim).
        vectors = vectors.reshape(n, -1, bag, dim).sum(dim=2)
        if emb.mode == "mean":
            vectors = vectors / bag
        out = reduce_scatter(vectors, op="sum", dim=0)                      # (1, m / bag, dim)
        ctx.save_for_backward(local, owned)
        ctx.emb, ctx.bag = emb, bag
        return out.reshape(out.shape[1:]).clone()  # own the memory: the result may be written in place

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        local, owned = ctx.saved_tensors
        emb, bag = ctx.emb, ctx.bag
        grads = all_gather(grad.contiguous().unsqueeze(0), dim=0)          # (n, m / bag, dim)
        if emb.mode == "mean":
            grads = grads / bag
        grads = grads.unsqueeze(2).expand(-1, -1, bag, -1).reshape(local.shape + (emb.embedding_dim,))
        grad_weight = torch.zeros(emb.rows_per_process, emb.embedding_dim, dtype=grad.dtype)
        grad_weight.index_add_(0, local[owned], grads[owned])
        return grad_weight, None, None
