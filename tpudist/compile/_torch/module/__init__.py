"""`tpudist.compile(module)`: the same module, its forward and backward run as XLA executables.

`_module.CompiledModule` captures per input signature and train/eval mode; `_program.Program` feeds
one capture's executables torch's tensors; `_executables` compiles its forward, forward-with-VJP and
backward executables; `_autograd` puts them behind a torch.autograd.Function; `_spmd` runs a graph
that reaches other processes (ShardedEmbedding's lookup) as one program over them; `_dynamo` is the
`torch.compile(backend="tpudist")` backend, each dynamo graph a CompiledModule.
"""
