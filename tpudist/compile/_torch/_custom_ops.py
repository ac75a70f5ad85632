"""`tpudist::stop_gradient`, the marker that keeps `detach()` and `torch.no_grad()` through capture.

Decomposing an exported program to core ATen turns `x.detach()` into a plain `aten.alias` and
inlines `torch.no_grad()` blocks, which is harmless for torch (the graph is not differentiated by
torch) but wrong for us: the backward pass is JAX's autodiff of the lowered graph, so both must
become `lax.stop_gradient`. Capture rewrites them to this custom op, which decomposition leaves alone.
"""

from __future__ import annotations

import torch


@torch.library.custom_op("tpudist::stop_gradient", mutates_args=())
def stop_gradient(x: torch.Tensor) -> torch.Tensor:
    """Returns a copy of `x` that gradients do not flow through (the graph-level `detach`)."""
    return x.clone()


@stop_gradient.register_fake
def _stop_gradient_fake(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


STOP_GRADIENT = torch.ops.tpudist.stop_gradient.default
