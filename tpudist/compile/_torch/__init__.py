"""The torch -> XLA bridge: `tpudist.compile(module)` for a torch.nn.Module.

    cm = tpudist.compile(model)          # dispatches here for an nn.Module
    loss = loss_fn(cm(x), y)
    loss.backward()                      # XLA-computed gradients land in model's .grad
    optimizer.step()

Pipeline: capture (torch.export, core ATen; `_capture`) -> lowering through one op registry
(`_registry`, ops in `ops/`) -> XLA executables for forward and backward (`_program`, `_autograd`)
-> `CompiledModule` (`_module`). See docs/torch.md.
"""

from tpudist.compile._torch._capture import CaptureError
from tpudist.compile._torch._module import CompiledModule, TorchCompileStats, compile_module
from tpudist.compile._torch._registry import UnsupportedOpError, supported_ops

__all__ = ["CaptureError", "CompiledModule", "TorchCompileStats", "UnsupportedOpError", "compile_module",
           "supported_ops"]

# the public spelling, re-exported as tpudist.supported_torch_ops
supported_torch_ops = supported_ops
__all__.append("supported_torch_ops")
