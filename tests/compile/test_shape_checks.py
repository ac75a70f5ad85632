"""Shapes eager torch refuses at run time (its CPU kernels check them; torch.export's meta kernels do
not) are refused at capture, never computed into a loss."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

import tpudist


class Loss(torch.nn.Module):
    def forward(self, x, t):
        return F.cross_entropy(x, t)


@pytest.mark.parametrize("shapes", [((2, 3, 8, 8), (2, 4, 4), torch.long), ((3, 2, 5, 5), (3, 5, 4), torch.long)])
def test_a_loss_target_of_the_wrong_shape_is_a_capture_error(shapes):
    """Targets smaller than the input's spatial dims pass torch's meta kernels (a larger one already
    fails the trace, as a CaptureError too)."""
    x_shape, t_shape, dtype = shapes
    x = torch.randn(x_shape)
    t = torch.randint(0, 3, t_shape) if dtype == torch.long else torch.rand(t_shape)
    with pytest.raises((RuntimeError, ValueError)):
        F.cross_entropy(x, t)  # eager torch refuses it
    with pytest.raises(tpudist.CaptureError, match=rf"aten.cross_entropy_loss.*{re.escape(str(list(x_shape)))}.*{re.escape(str(list(t_shape)))}") as e:
        tpudist.compile(Loss())(x, t)
    assert "test_shape_checks.py" in str(e.value)  # the user's line


def test_matching_shapes_still_compile_and_equal_eager():
    x, t = torch.randn(2, 3, 8, 8), torch.randint(0, 3, (2, 8, 8))
    assert tpudist.compile(Loss())(x, t).item() == pytest.approx(F.cross_entropy(x, t).item(), rel=1e-5)
    p = torch.softmax(torch.randn(4, 5), 1)
    x = torch.randn(4, 5)
    assert tpudist.compile(Loss())(x, p).item() == pytest.approx(F.cross_entropy(x, p).item(), rel=1e-5)
