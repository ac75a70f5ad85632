"""Linear solves, inverses, determinants, pseudo-inverses and the matrix exponential (torch.linalg),
on the factorizations of `linalg_decompositions`.

Batch dims broadcast as in torch. A solve or inverse of a singular matrix gives the infinities and
NaNs of its LU factors with the `info` LAPACK would report; torch's non-`_ex` functions raise there
(`aten._linalg_check_errors`), which a compiled program cannot do mid-run.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import jax.scipy.linalg as jsp_linalg
from jax.lax import linalg as lax_linalg

from tpudist.compile._torch.lowering._table import register
from tpudist.compile._torch.lowering.ops._util import custom_vjp, unsupported_arg
from tpudist.compile._torch.lowering.ops.linalg_decompositions import hermitian as hermitian_matrix, lu_factor, mH, mT
from tpudist.compile._torch.lowering._table import aten  # an op this torch lacks is a MissingOp, skipped


def _broadcast_batch(a, b):
    batch = jnp.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    return jnp.broadcast_to(a, batch + a.shape[-2:]), jnp.broadcast_to(b, batch + b.shape[-2:])


@register(aten._linalg_check_errors.default)
def check_errors(info, api_name, *, is_matrix):
    # torch raises here when a factorization failed (info != 0); XLA cannot raise from a running
    # program, so the failed factorization's NaNs or infinities are the result, as in JAX
    return None


# -- triangular and Cholesky solves ----------------------------------------------------------------------

def _triangle(a, upper: bool, unitriangular: bool):
    """The triangle torch's solvers read; the rest (and a unit diagonal) gets no gradient, as in torch."""
    part = jnp.triu(a) if upper else jnp.tril(a)
    return jnp.where(jnp.eye(a.shape[-1], dtype=bool), 1, part).astype(a.dtype) if unitriangular else part


@register(aten.linalg_solve_triangular.default)
def linalg_solve_triangular(a, b, *, upper, left=True, unitriangular=False):
    a, b = _broadcast_batch(a, b)
    return lax_linalg.triangular_solve(_triangle(a, upper, unitriangular), b, left_side=left, lower=not upper)


@register(aten.triangular_solve.default)
def triangular_solve(b, a, upper=True, transpose=False, unitriangular=False):
    """(X, A): op(A) X = b, op a transpose (not conjugated) if `transpose`; A comes back broadcast."""
    a, b = _broadcast_batch(a, b)
    x = lax_linalg.triangular_solve(_triangle(a, upper, unitriangular), b, left_side=True, lower=not upper,
                                    transpose_a=transpose)
    return x, a


def _cholesky_solve_value(b, factor, upper):
    # A = L L^H (or U^H U): two triangular solves, reading only the factor's triangle
    factor = _triangle(factor, upper, False)
    first = lax_linalg.triangular_solve(factor, b, left_side=True, lower=not upper, transpose_a=upper,
                                        conjugate_a=upper)
    return lax_linalg.triangular_solve(factor, first, left_side=True, lower=not upper, transpose_a=not upper,
                                       conjugate_a=not upper)


@functools.partial(custom_vjp, nondiff_argnums=(2,))
def _cholesky_solve(b, factor, upper):
    """X with (L L^H) X = b, differentiated as torch does: as a function of the whole factor matrix,
    its unread triangle included (torch's formula assumes the factor is triangular)."""
    return _cholesky_solve_value(b, factor, upper)


def _cholesky_solve_fwd(b, factor, upper):
    x = _cholesky_solve_value(b, factor, upper)
    return x, (factor, x)


def _cholesky_solve_bwd(upper, residuals, g):
    factor, x = residuals
    # torch's cholesky_solve_backward, in JAX's convention for complex cotangents (conjugated)
    grad_b = _cholesky_solve_value(jnp.conj(g), factor, upper)
    common = grad_b @ mH(x)
    common = common + mH(common)
    grad_factor = -(factor @ common) if upper else -(common @ factor)
    return jnp.conj(grad_b), jnp.conj(grad_factor)


_cholesky_solve.defvjp(_cholesky_solve_fwd, _cholesky_solve_bwd)


@register(aten.cholesky_solve.default)
def cholesky_solve(b, factor, upper=False):
    b, factor = _broadcast_batch(b, factor)
    return _cholesky_solve(b, factor, upper)


@register(aten.cholesky_inverse.default)
def cholesky_inverse(factor, upper=False):
    eye = jnp.broadcast_to(jnp.eye(factor.shape[-1], dtype=factor.dtype), factor.shape)
    return _cholesky_solve(eye, factor, upper)


# -- LU solves, inverse, determinants ---------------------------------------------------------------------

def _lu_solve(lu, pivots, b, trans: int):
    """op(A) X = b from A's LU factors and 1-based pivots; op: 0 none, 1 transpose, 2 conjugate transpose."""
    return jsp_linalg.lu_solve((lu, pivots - 1), b, trans=trans)


@register(aten.linalg_lu_solve.default)
def linalg_lu_solve(lu, pivots, b, *, left=True, adjoint=False):
    batch = jnp.broadcast_shapes(lu.shape[:-2], b.shape[:-2])
    lu = jnp.broadcast_to(lu, batch + lu.shape[-2:])
    pivots = jnp.broadcast_to(pivots, batch + pivots.shape[-1:]).astype(jnp.int32)
    b = jnp.broadcast_to(b, batch + b.shape[-2:])
    if left:
        return _lu_solve(lu, pivots, b, 2 if adjoint else 0)
    # X A = B is A^T X^T = B^T; X A^H = B is A X^H = B^H
    if adjoint:
        return mH(_lu_solve(lu, pivots, mH(b), 0))
    return mT(_lu_solve(lu, pivots, mT(b), 1))


@register(aten.linalg_inv_ex.default)
def linalg_inv_ex(a, *, check_errors=False):
    _, _, _, info = lu_factor(a)
    return jnp.linalg.inv(a), info


def _is_vector_rhs(a, b) -> bool:
    # torch's rule: b is a (batch of) vector(s) when it is 1-d or has exactly A's batch-and-rows shape
    return b.ndim == 1 or (b.ndim == a.ndim - 1 and b.shape == a.shape[:-1])


@register(aten._linalg_solve_ex.default)
def linalg_solve_ex(a, b, *, left=True, check_errors=False):
    """(X, LU, pivots, info) with A X = B (X A = B unless `left`); LU of A itself, as torch's."""
    lu, pivots, _, info = lu_factor(a)
    vector = _is_vector_rhs(a, b)
    rhs = b[..., None] if vector else b
    a_, rhs = _broadcast_batch(a, rhs)
    x = jnp.linalg.solve(a_, rhs) if left else mT(jnp.linalg.solve(mT(a_), mT(rhs)))
    return (x[..., 0] if vector else x), lu, pivots, info


def _det_lu(a, meta):
    # torch factors a contiguous real matrix through its transpose (the F-contiguous view): the LU
    # outputs of det and slogdet are those of A^T then
    contiguous_real = meta is not None and meta.is_contiguous() and not meta.is_complex()
    lu, pivots, _, _ = lu_factor(mT(a) if contiguous_real else a)
    return lu, pivots


@register(aten._linalg_det.default, input_meta=True)
def linalg_det(a, *, meta=None):
    # (JAX's derivative of det fails on empty matrices, whose determinant is 1)
    det = jnp.linalg.det(a) if a.size else jnp.ones(a.shape[:-2], a.dtype)
    return (det, *_det_lu(a, meta))


@register(aten._linalg_slogdet.default, input_meta=True)
def linalg_slogdet(a, *, meta=None):
    if a.size:
        sign, logabsdet = jnp.linalg.slogdet(a)
    else:
        sign, logabsdet = jnp.ones(a.shape[:-2], a.dtype), jnp.zeros(a.shape[:-2], jnp.finfo(a.dtype).dtype)
    return (sign, logabsdet, *_det_lu(a, meta))


# -- pseudo-inverse, matrix exponential -------------------------------------------------------------------

@register(aten.linalg_pinv.atol_rtol_tensor, aten.linalg_pinv.atol_rtol_float)
def linalg_pinv(a, *, atol=None, rtol=None, hermitian=False):
    m, n = a.shape[-2:]
    if a.size == 0:
        return jnp.zeros(a.shape[:-2] + (n, m), a.dtype)
    real = jnp.finfo(a.dtype).dtype
    if rtol is None:
        # torch's default: eps * max(m, n), or none when a positive atol is given
        default = jnp.finfo(a.dtype).eps * max(m, n)
        rtol = default if atol is None else jnp.where(jnp.asarray(atol) > 0, 0.0, default)
    atol = jnp.zeros((), real) if atol is None else jnp.asarray(atol, real)
    return _pinv(a, atol, jnp.asarray(rtol, real), hermitian)


@functools.partial(custom_vjp, nondiff_argnums=(3,))
def _pinv(a, atol, rtol, hermitian: bool):
    """torch's pinv: singular values (|eigenvalues| if `hermitian`) at most max(atol, rtol * the
    largest) count as zero; differentiated by torch's closed form (valid where the rank is constant),
    not through the decomposition, whose derivative is infinite at repeated singular values."""
    if hermitian:
        v, w = lax_linalg.eigh(hermitian_matrix(a, upper=False), lower=True, symmetrize_input=False)
        return (v * _reciprocal_above(w, jnp.abs(w), atol, rtol).astype(a.dtype)[..., None, :]) @ mH(v)
    u, s, vh = lax_linalg.svd(a, full_matrices=False)
    return (mH(vh) * _reciprocal_above(s, s, atol, rtol).astype(a.dtype)[..., None, :]) @ mH(u)


def _reciprocal_above(values, magnitude, atol, rtol):
    tolerance = jnp.maximum(atol[..., None], rtol[..., None] * jnp.max(magnitude, axis=-1, keepdims=True))
    keep = magnitude > tolerance
    return jnp.where(keep, 1 / jnp.where(keep, values, 1), 0)


def _pinv_fwd(a, atol, rtol, hermitian):
    p = _pinv(a, atol, rtol, hermitian)
    return p, (a, p, atol, rtol)


def _pinv_bwd(hermitian, residuals, g):
    a, p, atol, rtol = residuals
    # torch's pinv_backward, in JAX's convention for complex cotangents (conjugated)
    g = jnp.conj(g)
    ph, gh = mH(p), mH(g)
    if a.shape[-2] <= a.shape[-1]:
        k = gh @ p
        kph = k @ ph
        grad = -mH(p @ k) + kph - (a @ p) @ kph + (ph @ p) @ (gh - k @ a)
    else:
        k = p @ gh
        phk = ph @ k
        grad = -mH(k @ p) + (gh - a @ k) @ p @ ph + phk - phk @ p @ a
    return jnp.conj(grad), jnp.zeros_like(atol), jnp.zeros_like(rtol)


_pinv.defvjp(_pinv_fwd, _pinv_bwd)


@register(aten.linalg_pinv.default, aten.linalg_pinv.rcond_tensor)
def linalg_pinv_rcond(a, rcond, hermitian=False):
    # NumPy's rcond is a relative tolerance
    return linalg_pinv(a, atol=0.0, rtol=rcond, hermitian=hermitian)


@register(aten.linalg_matrix_exp.default)
def linalg_matrix_exp(a):
    if a.dtype in (jnp.bfloat16, jnp.float16):
        # torch's CPU kernel in half precision returns NaN or garbage for most inputs: nothing to match
        raise unsupported_arg("aten.linalg_matrix_exp", f"a {a.dtype} input (compute it in float32)")
    return jsp_linalg.expm(a) if a.size else a
