"""`LazyScalar`: a step's loss, left on the devices until someone reads it.

The fused step returns its loss without waiting for the step to finish, so the host can prepare
and launch the next step while the devices run this one. Reading the value (`float(loss)`,
`loss.item()`, printing, comparing, arithmetic, passing it to a torch function) waits for it and
copies it to the host then, once; `loss.tensor()` is the same value as a 0-d float32 torch tensor.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    import jax


class LazyScalar:
    """A float computed on the devices: the mean of this process's blocks of `array` (a global
    array with one element per device). Behaves like a 0-d float32 tensor wherever it is read."""

    __slots__ = ("_array", "_value")

    def __init__(self, array: "jax.Array"):
        self._array = array
        self._value: float | None = None

    # -- reading -----------------------------------------------------------------------------------

    def item(self) -> float:
        """The value (waits for the step that computes it)."""
        if self._value is None:
            from tpudist.compile._torch.train import _state
            values = [_state.to_host(s.data) for s in self._array.addressable_shards]
            self._value = float(np.mean([np.asarray(v, dtype=np.float32).reshape(-1)[0] for v in values],
                                        dtype=np.float32))
            self._array = None
        return self._value

    def tensor(self) -> torch.Tensor:
        """The value as a 0-d float32 torch tensor."""
        return torch.tensor(self.item(), dtype=torch.float32)

    def ready(self) -> bool:
        """Whether the devices have finished computing it (reading it then does not wait)."""
        return self._value is not None or self._array.is_ready()

    __float__ = item

    def __int__(self) -> int:
        return int(self.item())

    def __bool__(self) -> bool:
        return bool(self.item())

    def __repr__(self) -> str:
        return f"LazyScalar({self.item():.6g})" if self.ready() else "LazyScalar(<on the devices>)"

    def __format__(self, spec: str) -> str:
        return format(self.item(), spec)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        return np.asarray(self.item(), dtype=dtype or np.float32)

    def tolist(self) -> float:
        return self.item()

    def numpy(self) -> np.ndarray:
        return np.asarray(self.item(), dtype=np.float32)

    # a 0-d tensor's no-op conversions, so `loss.detach().cpu().item()` works unchanged
    def detach(self) -> "LazyScalar":
        return self

    def cpu(self) -> "LazyScalar":
        return self

    def float(self) -> "LazyScalar":
        return self

    @property
    def shape(self) -> torch.Size:
        return torch.Size([])

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    def dim(self) -> int:
        return 0

    def numel(self) -> int:
        return 1

    # -- as a tensor in torch code ----------------------------------------------------------------

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.tensor(), name)  # any other tensor method: on the value

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        convert = lambda a: a.tensor() if isinstance(a, LazyScalar) else a  # noqa: E731
        args, kwargs = torch.utils._pytree.tree_map(convert, (args, kwargs or {}))
        return func(*args, **kwargs)

    def __add__(self, other): return self.tensor() + _plain(other)
    def __radd__(self, other): return _plain(other) + self.tensor()
    def __sub__(self, other): return self.tensor() - _plain(other)
    def __rsub__(self, other): return _plain(other) - self.tensor()
    def __mul__(self, other): return self.tensor() * _plain(other)
    def __rmul__(self, other): return _plain(other) * self.tensor()
    def __truediv__(self, other): return self.tensor() / _plain(other)
    def __rtruediv__(self, other): return _plain(other) / self.tensor()
    def __neg__(self): return -self.tensor()
    def __lt__(self, other): return self.item() < float(_plain(other))
    def __le__(self, other): return self.item() <= float(_plain(other))
    def __gt__(self, other): return self.item() > float(_plain(other))
    def __ge__(self, other): return self.item() >= float(_plain(other))

    def __eq__(self, other: object) -> bool:
        return self.item() == float(_plain(other))  # type: ignore[arg-type]

    __hash__ = None  # type: ignore[assignment]


def _plain(value: Any) -> Any:
    return value.tensor() if isinstance(value, LazyScalar) else value
