"""Resampling, pooling and normalization ops through tpudist.compile against eager torch: the cases
the OpInfo samples (see opinfo_harness.py) do not reach: every interpolation mode with sizes and
scale factors that do not divide, antialiasing, grid_sample's modes and paddings, pooling with
indices, non-finite inputs. Several cases share one module (one compile) where they can."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import tpudist

from compiled_check import Fn, check_compiled

A = torch.ops.aten


# -- interpolation ---------------------------------------------------------------------------------

def _interpolations(x1, x2, x3):
    # scale factors that do not divide the size, recomputed or not, and sizes; 2-d nearest and
    # bilinear in each form, the other modes once (OpInfo covers them too)
    out = []
    for mode, kw in (("nearest", {}), ("bilinear", {"align_corners": False})):
        out += [F.interpolate(x2, scale_factor=1.7, mode=mode, **kw),
                F.interpolate(x2, scale_factor=(0.45, 2.3), mode=mode, recompute_scale_factor=True, **kw),
                F.interpolate(x2, size=(7, 4), mode=mode, **kw)]
    out += [F.interpolate(x2, scale_factor=0.6, mode=mode) for mode in ("nearest-exact", "area")]
    out += [F.interpolate(x1, scale_factor=1.7, mode=mode) for mode in ("nearest", "linear")]
    out += [F.interpolate(x3, scale_factor=1.7, mode=mode) for mode in ("nearest", "trilinear")]
    return out


def test_interpolate_every_mode_scale_and_size():
    torch.manual_seed(0)
    check_compiled(_interpolations, torch.randn(2, 3, 9), torch.randn(2, 3, 6, 9), torch.randn(1, 2, 4, 5, 6))


def _antialiased(x):
    out = []
    for mode in ("bilinear", "bicubic"):
        out += [F.interpolate(x, size=(5, 4), mode=mode, antialias=True),
                F.interpolate(x, scale_factor=0.37, mode=mode, align_corners=True, antialias=True),
                F.interpolate(x, scale_factor=(1.6, 0.5), mode=mode, antialias=True),
                F.interpolate(x, size=(31, 2), mode=mode, align_corners=True, antialias=True)]
    return out


def test_interpolate_antialiased():
    torch.manual_seed(1)
    check_compiled(_antialiased, torch.randn(2, 3, 13, 17), rtol=2e-5, atol=2e-5)


def test_upsample_aliases_and_explicit_overloads():
    def fn(x):
        return (F.upsample(x, scale_factor=2), F.upsample_nearest(x, size=(5, 11)),
                F.upsample_bilinear(x, scale_factor=1.5), torch.nn.Upsample(scale_factor=(1.5, 2.5))(x),
                A.upsample_nearest2d(x, [7, 9]), A.upsample_nearest2d(x, [7, 9], 1.9, 1.3),
                A._upsample_nearest_exact2d(x, [7, 9]), A.upsample_nearest1d(x[0], [13]),
                A._upsample_nearest_exact1d(x[0], [13], 2.2), A.upsample_nearest3d(x[None], [3, 7, 9]),
                A._upsample_nearest_exact3d(x[None], [2, 7, 9], 1.0, 1.5, 1.9), A.upsample_bilinear2d(x, [7, 9], True),
                A.upsample_trilinear3d(x[None], [3, 7, 9], False, 1.5, 1.7, 1.9))
    check_compiled(fn, torch.randn(2, 3, 4, 6))


def test_interpolate_scale_factor_that_keeps_a_size():
    # 4 * 1.2 -> 4 and 5 * 2.1 -> 10: ATen's linear kernels copy the first side; nearest's
    # channels-last loop (2-d: also for small outputs) copies it and halves the index of the second,
    # and nearest's backward always does (torch's decompositions resample both)
    def fn(x, big, last, last3):
        return (F.interpolate(x, scale_factor=1.2, mode="bilinear"),
                F.interpolate(x, scale_factor=(1.2, 2.1), mode="bilinear", align_corners=True),
                F.interpolate(x[0], scale_factor=1.2, mode="linear"),
                F.interpolate(x[None], scale_factor=(1.2, 1.2, 2.1), mode="trilinear"),
                F.interpolate(x, scale_factor=(1.2, 2.1), mode="nearest"),
                F.interpolate(x[0], scale_factor=2.1, mode="nearest"),
                F.interpolate(x[None], scale_factor=(1.2, 1.2, 2.1), mode="nearest"),
                F.interpolate(big, scale_factor=(1.2, 1.6), mode="nearest"),
                F.interpolate(last, scale_factor=(1.2, 1.6), mode="nearest"),
                F.interpolate(last3, scale_factor=(1.0, 1.2, 2.1), mode="nearest"),
                F.interpolate(x, scale_factor=(1.2, 2.1), mode="nearest-exact"),
                F.interpolate(x, scale_factor=(1.2, 2.1), mode="bicubic"))
    last = torch.randn(1, 4, 4, 90).contiguous(memory_format=torch.channels_last)
    last3 = torch.randn(1, 4, 2, 4, 5).contiguous(memory_format=torch.channels_last_3d)
    check_compiled(fn, torch.randn(2, 3, 4, 5), torch.randn(1, 2, 4, 90), last, last3)


def test_interpolate_non_finite_input_spreads_as_in_torch():
    x = torch.randn(1, 1, 6, 7)
    x[0, 0, 2, 3], x[0, 0, 4, 1] = float("nan"), float("inf")

    def fn(x):
        return (F.interpolate(x, size=(4, 5), mode="bilinear", antialias=True),
                F.interpolate(x, size=(9, 13), mode="bicubic", antialias=True),
                F.interpolate(x, size=(9, 13), mode="nearest"),
                F.interpolate(x, scale_factor=(1.2, 2.0), mode="bilinear"))
    check_compiled(fn, x, grad=False)


def test_interpolate_in_bfloat16():
    x = torch.randn(2, 3, 6, 9).bfloat16()
    check_compiled(lambda x: (F.interpolate(x, scale_factor=1.7, mode="bilinear"),
                     F.interpolate(x, scale_factor=0.6, mode="nearest")), x, rtol=1e-2, atol=1e-2, grad=False)


# -- grid_sample -----------------------------------------------------------------------------------

def _grid(*shape):
    # some points far outside [-1, 1] and some exactly on the borders, to reach every padding rule
    torch.manual_seed(2)
    grid = torch.rand(*shape) * 3.4 - 1.7
    grid.view(-1)[::7] = 1.0
    grid.view(-1)[3::11] = -1.0
    return grid


def test_grid_sample_2d_every_mode_and_padding():
    combos = [(mode, padding) for mode in ("bilinear", "nearest", "bicubic") for padding in ("zeros", "border", "reflection")]

    def fn(x, grid):  # align_corners alternates along the combinations
        return [F.grid_sample(x, grid, mode=mode, padding_mode=padding, align_corners=i % 2 == 1)
                for i, (mode, padding) in enumerate(combos)]
    check_compiled(fn, torch.randn(2, 3, 5, 7), _grid(2, 4, 6, 2), rtol=2e-5, atol=2e-5)


def test_grid_sample_3d_every_mode_and_padding():
    combos = [(mode, padding) for mode in ("bilinear", "nearest") for padding in ("zeros", "border", "reflection")]

    def fn(x, grid):
        return [F.grid_sample(x, grid, mode=mode, padding_mode=padding, align_corners=i % 2 == 1)
                for i, (mode, padding) in enumerate(combos)]
    check_compiled(fn, torch.randn(2, 2, 3, 4, 5), _grid(2, 3, 2, 4, 3), rtol=2e-5, atol=2e-5)


def test_affine_grid_and_grid_sample():
    def fn(x, theta, theta3):
        grid = F.affine_grid(theta, [2, 3, 5, 6], align_corners=False)
        grid3 = F.affine_grid(theta3, [2, 3, 2, 5, 6], align_corners=True)
        return grid, grid3, F.grid_sample(x, grid, align_corners=False)
    torch.manual_seed(3)
    check_compiled(fn, torch.randn(2, 3, 4, 5), torch.randn(2, 2, 3), torch.randn(2, 3, 4))


def test_grid_sample_ignores_non_finite_values_it_does_not_read():
    x = torch.randn(1, 1, 4, 4)
    x[0, 0, 0, 0] = float("nan")
    grid = torch.tensor([[[[1.5, 1.5], [0.5, 0.2], [-3.0, -3.0]]]])
    check_compiled(lambda x, g: [F.grid_sample(x, g, mode=m, align_corners=False) for m in ("bilinear", "nearest", "bicubic")],
          x, grid, grad=False)


def test_safe_softmax_rows_of_only_minus_inf():
    x = torch.randn(3, 4, 5)
    x[0, 1] = float("-inf")
    x[2, :, 3] = float("-inf")
    check_compiled(lambda x: (A._safe_softmax(x, -1), A._safe_softmax(x, 1)), x)


# -- pooling ---------------------------------------------------------------------------------------

def test_adaptive_max_pool_ties_nan_and_uneven_windows():
    # integer-valued inputs tie often: the first maximum in scan order wins, a NaN wins over all
    x = torch.randint(-3, 3, (2, 3, 7, 5)).float()
    x[0, 0, 1, 1] = float("nan")
    x[1, 2] = float("-inf")

    def fn(x, x3):
        return (F.adaptive_max_pool2d(x, (3, 4), return_indices=True), F.adaptive_max_pool2d(x, 9, return_indices=True),
                F.adaptive_max_pool1d(x[0], 4, return_indices=True),
                F.adaptive_max_pool3d(x3, (2, 3, 2), return_indices=True))
    check_compiled(fn, x, torch.randint(-3, 3, (1, 2, 3, 5, 4)).float())


def test_fractional_max_pool_with_given_samples():
    # the samples fix the windows: deterministic, so values and indices must match exactly
    torch.manual_seed(4)

    def fn(x, x3, s2, s3):
        return (F.fractional_max_pool2d(x, 2, output_size=(4, 3), return_indices=True, _random_samples=s2),
                F.fractional_max_pool2d(x, (3, 2), output_ratio=(0.5, 0.5), return_indices=True, _random_samples=s2),
                F.fractional_max_pool3d(x3, 2, output_size=(2, 3, 2), return_indices=True, _random_samples=s3))
    check_compiled(fn, torch.randn(2, 3, 7, 6), torch.randn(2, 3, 4, 6, 5), torch.rand(2, 3, 2), torch.rand(2, 3, 3),
          constant=(2, 3))


def test_fractional_max_pool_draws_its_samples():
    x = torch.randn(2, 3, 8, 8)
    out, index = tpudist.compile(Fn(lambda x: F.fractional_max_pool2d(x, 2, output_size=4, return_indices=True)))(x)
    assert out.shape == (2, 3, 4, 4) and torch.equal(out, x.flatten(2).gather(2, index.flatten(2)).view_as(out))


def test_max_pool_backward_op_and_unpool():
    def fn(x, g):
        out, index = F.max_pool2d(x, 3, stride=2, padding=1, return_indices=True)
        return (A.max_pool2d_with_indices_backward(g, x, [3, 3], [2, 2], [1, 1], [1, 1], False, index),
                F.max_unpool2d(out, index, 3, stride=2, padding=1, output_size=x.shape[-2:]))
    check_compiled(fn, torch.randn(2, 3, 7, 6), torch.randn(2, 3, 4, 3))


def test_lp_pool_fold_unfold_pixel_shuffle():
    def fn(x, x1, x3, cols):
        return (F.lp_pool1d(x1, 2, 3, stride=2), F.lp_pool2d(x, 3.0, (2, 3)), F.lp_pool3d(x3, 2, 2),
                F.fold(cols, (5, 6), 2, padding=1, stride=2), F.unfold(x, (2, 3), dilation=(2, 1), padding=1),
                F.pixel_shuffle(x, 2), F.pixel_unshuffle(x, 2), F.channel_shuffle(x, 2))
    torch.manual_seed(5)
    check_compiled(fn, torch.rand(2, 8, 6, 6) + 0.1, torch.rand(2, 3, 9) + 0.1, torch.rand(1, 2, 4, 4, 4) + 0.1,
          torch.randn(2, 12, 12), rtol=2e-5, atol=2e-5)


# -- normalization ---------------------------------------------------------------------------------

def test_norm_saved_statistics_carry_no_gradient():
    # torch differentiates native_layer_norm / native_batch_norm through their output only
    def fn(x, w, b, running_mean, running_var):
        out, mean, rstd = torch.native_layer_norm(x, [5], w[:5], b[:5], 1e-5)
        bn, bn_mean, bn_rstd = torch.native_batch_norm(x, w[:3], b[:3], None, None, True, 0.1, 1e-5)
        ev, _, _ = torch.native_batch_norm(x, w[:3], b[:3], running_mean, running_var, False, 0.1, 1e-5)
        return out, bn, ev, mean.detach(), rstd.detach(), bn_mean.detach(), bn_rstd.detach()
    torch.manual_seed(6)
    check_compiled(fn, torch.randn(4, 3, 5), torch.randn(5), torch.randn(5), torch.randn(3), torch.rand(3) + 0.5,
          constant=(3, 4))


def test_batch_norm_module_updates_running_statistics():
    torch.manual_seed(7)
    eager, compiled = torch.nn.BatchNorm2d(3), torch.nn.BatchNorm2d(3)
    x = torch.randn(4, 3, 5, 5)
    tpudist.compile(compiled)(x).sum().backward()
    eager(x).sum().backward()
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(getattr(compiled, name), getattr(eager, name))
    torch.testing.assert_close(compiled.weight.grad, eager.weight.grad)
