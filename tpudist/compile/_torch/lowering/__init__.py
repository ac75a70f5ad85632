"""Lowering, the ground both products stand on: a torch.nn.Module and example inputs -> a JAX function.

`_capture.capture` traces the module with torch.export and decomposes it to core ATen; `_captured`
holds what that produced (the graph, which input is a parameter / buffer / constant / user input, which
outputs write back, which inputs a gradient reaches); `_lower.lower` interprets the graph with one JAX
function per ATen overload, looked up in `_registry` (filled by the `ops/` family modules through
`_table.register`). Custom autograd Functions and checkpoint regions become `jax.custom_vjp` /
`jax.checkpoint` (`_custom_grad`, `_custom_vjp`).
"""
