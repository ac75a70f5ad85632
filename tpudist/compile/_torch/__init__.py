"""The torch -> XLA bridge: three rooms on one floor.

    lowering/   capture (torch.export, core ATen) -> `Captured` (the graph and its input/output slots)
                -> the op registry (`ops/`) -> a JAX function of the graph's inputs
    module/     `tpudist.compile(module)`: a `CompiledModule` whose forward and backward are XLA
                executables behind torch autograd (`.grad`s, optimizers, train/eval as in eager)
    train/      `compile_train_step` and `fit`: forward, backward and the optimizer in one executable,
                the parameters and optimizer state kept on the devices between steps

The floor (this package's own modules) is what the rooms share: torch <-> JAX conversion
(`_convert`), devices and input staging (`_placement`), packing small arrays into one (`_pack`), which
fused steps hold a module's newest values (`_sync`), tpudist's custom torch ops (`_custom_ops`) and the
torch `ShardedEmbedding`. A room imports the floor and `lowering`; `module` and `train` never import
each other (tests/test_layout.py). See docs/torch.md and docs/torch_training.md.
"""

from tpudist.compile._torch.lowering._captured import CaptureError
from tpudist.compile._torch.lowering._registry import UnsupportedOpError, supported_ops
from tpudist.compile._torch.module._module import CompiledModule, TorchCompileStats, compile_module

__all__ = ["CaptureError", "CompiledModule", "TorchCompileStats", "UnsupportedOpError", "compile_module",
           "supported_ops", "supported_torch_ops"]

# the public spelling, re-exported as tpudist.supported_torch_ops
supported_torch_ops = supported_ops
