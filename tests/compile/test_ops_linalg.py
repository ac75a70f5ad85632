"""Linear algebra and FFT through tpudist.compile, against eager torch: the cases torch's OpInfo
samples (the first three of each, often empty matrices) do not reach -- non-square and batched
inputs, the triangle a Hermitian input is read from, LAPACK's `info` of failed factorizations,
subgradients of distances, every FFT normalization -- and the precise errors for what has no exact
lowering (gauge-dependent singular vectors and eigenvectors, general eigenvalues, LDL)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tpudist
from tpudist.compile import UnsupportedOpError

from compiled_check import Fn, check_compiled

pytestmark = [pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning"),
              pytest.mark.filterwarnings("ignore:torch.*is deprecated:UserWarning")]


def _matrices(seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(4, 4, generator=g) + 2 * torch.eye(4)
    base = torch.randn(4, 4, generator=g)
    pd = base @ base.T + 4 * torch.eye(4)
    # a Hermitian input with other values in the triangle torch does not read
    pd_mixed = pd + 0.3 * torch.triu(torch.randn(4, 4, generator=g), 1)
    wide, tall = torch.randn(3, 5, generator=g), torch.randn(2, 5, 3, generator=g)
    b = torch.randn(4, 2, generator=g)
    return a, pd_mixed, wide, tall, b


def test_decompositions_and_solves_match_torch():
    a, pd, wide, tall, b = _matrices()
    batch_b = torch.randn(3, 4, 2)
    vec = torch.randn(4)

    def fn(a, pd, wide, tall, b, batch_b, vec):
        # (the `_ex` forms: the checked ones need capture to drop torch's error checks, see below)
        lu, pivots, _ = torch.linalg.lu_factor_ex(a)
        lower = torch.linalg.cholesky_ex(pd).L
        sign, logabsdet = torch.linalg.slogdet(a)
        return (lower, torch.linalg.cholesky_ex(pd, upper=True).L, torch.cholesky(pd, upper=True),
                torch.linalg.cholesky_ex(pd).info,
                torch.linalg.eigvalsh(pd), torch.linalg.eigvalsh(pd, UPLO="U"),
                lu, pivots, torch.linalg.lu(tall), torch.linalg.lu(wide), torch.lu_unpack(lu, pivots),
                torch.linalg.lu_solve(lu, pivots, b), torch.linalg.lu_solve(lu, pivots, b.mT, left=False),
                torch.linalg.lu_solve(lu, pivots, b, adjoint=True),
                torch.linalg.lu_solve(lu, pivots, b.mT, left=False, adjoint=True),
                torch.linalg.qr(tall), torch.linalg.qr(wide), torch.linalg.qr(a, mode="complete"),
                torch.linalg.svdvals(tall), torch.linalg.matrix_norm(wide, "nuc"), torch.linalg.matrix_norm(tall, 2),
                torch.linalg.cond(a),
                torch.linalg.matrix_rank(tall),
                torch.linalg.det(a), sign, logabsdet, torch.linalg.inv_ex(a).inverse,
                torch.linalg.solve_ex(a, b).result, torch.linalg.solve_ex(a, vec).result,
                torch.linalg.solve_ex(a, batch_b).result, torch.linalg.solve_ex(a, b.mT, left=False).result,
                torch.linalg.solve_triangular(a, b, upper=True),
                torch.linalg.solve_triangular(a, b.mT, upper=False, left=False, unitriangular=True),
                torch.triangular_solve(b, a, upper=False, transpose=True),
                torch.cholesky_solve(b, lower), torch.cholesky_solve(b, pd, upper=True),
                torch.cholesky_inverse(lower + torch.triu(a, 1)),
                torch.linalg.pinv(tall), torch.linalg.pinv(pd, hermitian=True),
                torch.linalg.pinv(a, atol=2.5), torch.linalg.matrix_exp(0.3 * a))

    check_compiled(fn, a, pd, wide, tall, b, batch_b, vec)


def test_checked_functions_match_torch():
    a, pd, _, _, b = _matrices()

    def fn(a, pd, b):
        return (torch.linalg.cholesky(pd), torch.linalg.inv(a), torch.linalg.solve(a, b), torch.linalg.lu_factor(a),
                torch.linalg.tensorinv(a.reshape(2, 2, 4), ind=2))

    check_compiled(fn, a, pd, b)


def test_householder_products_match_torch():
    g = torch.Generator().manual_seed(1)
    reflectors, tau = torch.randn(2, 5, 3, generator=g), torch.rand(2, 3, generator=g)
    c, d = torch.randn(2, 5, 4, generator=g), torch.randn(2, 4, 5, generator=g)

    def fn(reflectors, tau, c, d):
        return (torch.linalg.householder_product(reflectors, tau),
                torch.ormqr(reflectors, tau, c), torch.ormqr(reflectors, tau, c, transpose=True),
                torch.ormqr(reflectors, tau, d, left=False), torch.ormqr(reflectors, tau, d, left=False, transpose=True))

    check_compiled(fn, reflectors, tau, c, d)
    check_compiled(lambda x: torch.geqrf(x), torch.randn(2, 5, 3, generator=g), grad=False)


def test_failed_factorizations_report_lapack_info():
    singular = torch.tensor([[1.0, 2, 3], [2, 4, 6], [1, 1, 1]])
    not_pd = torch.stack([torch.diag(torch.tensor([1.0, 2, 3])), torch.diag(torch.tensor([1.0, 2, -3]))])

    unread_nan = torch.diag(torch.tensor([2.0, 3, 4])) + torch.triu(torch.full((3, 3), float("nan")), 1)

    def fn(singular, not_pd, unread_nan):
        lu = torch.linalg.lu_factor_ex(singular)
        return (lu.LU, lu.pivots, lu.info, torch.linalg.inv_ex(singular).info,
                torch.linalg.solve_ex(singular, singular[:, :1]).info, torch.linalg.cholesky_ex(not_pd).info,
                torch.linalg.cholesky_ex(unread_nan), torch.linalg.eigvalsh(unread_nan))

    check_compiled(fn, singular, not_pd, unread_nan, grad=False)


def test_complex_inputs_match_torch_forward():
    g = torch.Generator().manual_seed(2)
    a = torch.randn(4, 4, dtype=torch.complex64, generator=g) + 2 * torch.eye(4)
    pd = a @ a.mH + torch.eye(4)
    b = torch.randn(4, 2, dtype=torch.complex64, generator=g)

    def fn(a, pd, b):
        return (torch.linalg.cholesky_ex(pd), torch.linalg.eigvalsh(pd), torch.linalg.qr(a), torch.linalg.lu_factor_ex(a),
                torch.linalg.det(a), torch.linalg.slogdet(a), torch.linalg.solve_ex(a, b), torch.linalg.svdvals(a),
                torch.linalg.pinv(a), torch.linalg.householder_product(a, b[:, 0]), torch.ormqr(a, b[:, 0], b))

    check_compiled(fn, a, pd, b, grad=False)


def test_fft_normalizations_and_sizes_match_torch():
    x = torch.randn(3, 4, 6, 5, generator=torch.Generator().manual_seed(3))

    def fn(x):
        half = torch.fft.rfft2(x, norm="ortho")
        spectrum = torch.fft.fft(half, dim=0)
        back = torch.fft.ifft(spectrum, dim=0, norm="forward")
        four = torch.fft.fftn(x.to(torch.complex64), dim=(0, 1, 2, 3), norm="backward")
        return (half, spectrum, back, four, torch.fft.rfft(x, n=8, dim=1, norm="forward"),
                torch.fft.irfft2(back, s=(6, 7), norm="ortho"), torch.fft.irfft(half, n=9, dim=-1),
                torch.fft.irfftn(half, dim=(-2, -1), norm="forward"))

    check_compiled(fn, x)


def test_distances_and_products_match_torch():
    g = torch.Generator().manual_seed(4)
    x1 = torch.randn(2, 4, 3, generator=g)
    x1[:, 1] = x1[:, 0]           # zero distances
    x1[:, 2, 0] = x1[:, 3, 0]     # a zero coordinate difference
    x2 = torch.cat([x1[:, :2], torch.randn(2, 1, 3, generator=g)], 1)
    bias, b1, b2 = torch.full((3, 5), float("nan")), torch.randn(4, 3, 2, generator=g), torch.randn(4, 2, 5, generator=g)
    weight = torch.randn(6, 3, 4, generator=g)
    y1, y2 = torch.randn(5, 3, generator=g), torch.randn(5, 4, generator=g)

    def fn(x1, x2, bias, b1, b2, weight, y1, y2):
        distances = [torch.cdist(x1, x2, p=p) for p in (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, float("inf"))]
        return (*distances, F.pdist(x1[0]), F.pdist(x1[0], p=1), torch.dist(y1, y1 + 1, p=3),
                torch.addbmm(bias, b1, b2, beta=0, alpha=2), torch.addbmm(b1[0] @ b2[0], b1, b2, beta=0.5),
                F.bilinear(y1, y2, weight), torch.diagonal(weight, 1, 2, 0), torch.diagonal(weight, -2, 1, 2),
                torch.trace(weight[0]))

    check_compiled(fn, x1, x2, bias, b1, b2, weight, y1, y2)


def _raises(fn, *inputs, match):
    with pytest.raises(UnsupportedOpError, match=match):
        tpudist.compile(Fn(fn))(*inputs)


def test_gauge_dependent_and_missing_decompositions_raise():
    a = torch.randn(4, 4)
    _raises(lambda a: torch.linalg.svd(a).U, a, match="singular vectors")
    _raises(lambda a: torch.linalg.eigh(a + a.mT).eigenvectors, a, match="eigenvectors")
    _raises(lambda a: torch.linalg.eigvals(a), a, match="general matrix")
    _raises(lambda a: torch.linalg.ldl_factor_ex(a + a.mT).LD, a, match="LDL")
    _raises(lambda a: torch.linalg.lu(a, pivot=False).L, a, match="pivot=False")
    _raises(lambda a: torch.linalg.matrix_exp(a.bfloat16()), a, match="bfloat16")
