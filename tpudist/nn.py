"""`tpudist.nn`: torch modules whose state is split across processes.

    emb = tpudist.nn.ShardedEmbedding(1_000_000, 64, mode="sum")   # each process holds 1/N of the rows

The implementation lives beside the custom op its compiled lookup is captured as
(`tpudist/compile/_torch/_sharded_embedding.py`); see docs/torch_training.md.
"""

from tpudist.compile._torch._custom_ops import SHARDED_ATTR
from tpudist.compile._torch._sharded_embedding import ShardedEmbedding, rows_per_process

__all__ = ["ShardedEmbedding", "SHARDED_ATTR", "rows_per_process"]
