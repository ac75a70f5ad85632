"""Eager (XLA-compiled) and in-graph collectives on torch tensors, numpy arrays and jax arrays."""

from tpudist.collectives._engine import CollectiveStats, collective_stats
from tpudist.collectives._ops import (all_gather, all_reduce, all_to_all, barrier, broadcast,
                                      collective_permute, reduce_scatter)
from tpudist.collectives._peers import CollectiveError, CollectiveTimeout

__all__ = ["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast",
           "collective_permute", "barrier", "collective_stats", "CollectiveStats", "CollectiveError",
           "CollectiveTimeout"]
