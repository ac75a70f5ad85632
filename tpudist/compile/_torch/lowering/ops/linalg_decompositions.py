"""Matrix decompositions (torch.linalg): Cholesky, LU, QR, SVD, Hermitian eigenvalues, Householder
reflectors, lowered to XLA's through jax.lax.linalg.

torch's conventions are LAPACK's: pivots are 1-based int32, `info` outputs are LAPACK's (0 when the
factorization succeeded), and a Hermitian input is read from one triangle. Outputs that torch
defines only up to a gauge -- the signs or phases of singular vectors and eigenvectors, the order
of a general matrix's eigenvalues -- are LAPACK's arbitrary choice, which XLA's algorithms do not
reproduce: reading one raises (see `Gauged`). The unique outputs lower: singular values, eigenvalues
of Hermitian matrices, Cholesky factors, LU with partial pivoting, and Householder QR (its signs
are the Householder convention LAPACK's geqrf and XLA's QR share).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.lax import linalg as lax_linalg

from tpudist.compile._torch.lowering._table import UnsupportedOpError, register
from tpudist.compile._torch.lowering.ops._util import unsupported_arg
from tpudist.compile._torch.lowering._table import aten  # an op this torch lacks is a MissingOp, skipped


def mT(x):
    return jnp.swapaxes(x, -1, -2)


def mH(x):
    return jnp.conj(mT(x))


def real_dtype(x) -> Any:
    return jnp.finfo(x.dtype).dtype


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def hermitian(a, upper: bool):
    """The Hermitian matrix torch's LAPACK kernels read from one triangle of `a` (and the real part of
    its diagonal), differentiated as `(a + a^H) / 2`: torch's gradients of Cholesky and eigh are
    Hermitian, the gradient of the symmetrized input."""
    eye = np.eye(a.shape[-1], dtype=bool)
    part = jnp.triu(a, 1) if upper else jnp.tril(a, -1)
    return jnp.where(eye, jnp.real(a).astype(a.dtype), part + mH(part))


@hermitian.defjvp
def _hermitian_jvp(upper, primals, tangents):
    (a,), (da,) = primals, tangents
    return hermitian(a, upper), (da + mH(da)) / 2


class Gauged(tuple):
    """A multi-output lowering's results where reading the entries at `hidden` raises `error`.

    For outputs torch takes from LAPACK up to a gauge (the sign of a singular vector): they are never
    computed, and a graph reading one fails while lowering, naming the op. A graph that reads only
    the unique outputs (singular values for `svdvals` and norms) lowers."""

    hidden: frozenset
    error: Exception

    def __new__(cls, values, hidden, error):
        result = super().__new__(cls, values)
        result.hidden = frozenset(i for i in hidden if values[i].size)  # empty ones are exact
        result.error = error
        return result

    def __getitem__(self, index):
        if isinstance(index, int) and index % len(self) in self.hidden:
            raise self.error
        return super().__getitem__(index)


def gauge_error(op: str, what: str, instead: str) -> UnsupportedOpError:
    return UnsupportedOpError(
        f"torch -> XLA: {op}'s {what} has no XLA lowering: torch returns the one LAPACK picks, which XLA's "
        f"algorithms do not reproduce. Read only gauge-independent results ({instead}), or compute it "
        "outside the compiled module.")


# -- Cholesky ---------------------------------------------------------------------------------------

def cholesky_factor(a, upper: bool = False):
    """(L, info): the lower factor of the Hermitian matrix in `a`'s lower triangle (or the upper
    factor of the one in its upper triangle) and LAPACK potrf's info."""
    h = hermitian(a, upper)
    if not a.size:
        return h, jnp.zeros(a.shape[:-2], jnp.int32)
    lower = lax_linalg.cholesky(h, symmetrize_input=False)
    # a failed factorization is NaN: only then is the order of the failing minor searched for
    failed = ~jnp.all(jnp.isfinite(lower), axis=(-2, -1))
    info = lax.cond(jnp.any(failed), _failing_minor, lambda m: jnp.zeros(a.shape[:-2], jnp.int32),
                    lax.stop_gradient(h))
    return (mH(lower) if upper else lower), jnp.where(failed, info, 0)


def _failing_minor(h):
    """potrf's info: the order of the first leading minor that is not positive-definite, 0 if none."""
    n = h.shape[-1]
    rows = jnp.arange(n)

    def step(k, state):
        m, info = state
        pivot = jnp.real(m[..., k, k])
        bad = ~(pivot > 0)  # NaN included, as in LAPACK
        info = jnp.where((info == 0) & bad, k + 1, info)
        column = jnp.where(rows > k, m[..., :, k], 0) / jnp.sqrt(jnp.where(bad, 1, pivot))[..., None]
        return m - column[..., :, None] * jnp.conj(column)[..., None, :], info

    return lax.fori_loop(0, n, step, (h, jnp.zeros(h.shape[:-2], jnp.int32)))[1]


@register(aten.cholesky.default)
def cholesky(a, upper=False):
    return cholesky_factor(a, upper)[0]


@register(aten.linalg_cholesky_ex.default)
def linalg_cholesky_ex(a, *, upper=False, check_errors=False):
    return cholesky_factor(a, upper)


# -- LU ---------------------------------------------------------------------------------------------

def lu_factor(a):
    """(LU, pivots, permutation, info) as LAPACK getrf: 1-based pivots, info the (1-based) first
    zero on U's diagonal."""
    lu, pivots, permutation = lax_linalg.lu(a)
    zero = jnp.diagonal(lu, axis1=-2, axis2=-1) == 0
    if not zero.shape[-1]:
        return lu, pivots + 1, permutation, jnp.zeros(a.shape[:-2], jnp.int32)
    info = jnp.where(jnp.any(zero, axis=-1), jnp.argmax(zero, axis=-1) + 1, 0).astype(jnp.int32)
    return lu, pivots + 1, permutation, info


def _unpack(lu):
    m, n = lu.shape[-2:]
    k = min(m, n)
    lower = jnp.tril(lu[..., :, :k], -1) + jnp.eye(m, k, dtype=lu.dtype)
    return lower, jnp.triu(lu[..., :k, :])


def permutation_matrix(permutation, dtype):
    """P with A = P L U: column j of P is e_{permutation[j]}."""
    m = permutation.shape[-1]
    return (permutation[..., None, :] == jnp.arange(m)[:, None]).astype(dtype)


def _check_pivot(op: str, pivot: bool) -> None:
    if not pivot:
        raise unsupported_arg(op, "pivot=False (LU without pivoting, which torch implements only on CUDA)")


@register(aten.linalg_lu_factor_ex.default)
def linalg_lu_factor_ex(a, *, pivot=True, check_errors=False):
    _check_pivot("aten.linalg_lu_factor_ex", pivot)
    lu, pivots, _, info = lu_factor(a)
    return lu, pivots, info


@register(aten.linalg_lu.default)
def linalg_lu(a, *, pivot=True):
    _check_pivot("aten.linalg_lu", pivot)
    lu, _, permutation, _ = lu_factor(a)
    return (permutation_matrix(permutation, a.dtype), *_unpack(lu))


@register(aten.lu_unpack.default)
def lu_unpack(lu, pivots, unpack_data=True, unpack_pivots=True):
    empty = jnp.zeros((0,), lu.dtype)
    p = empty
    if unpack_pivots:
        permutation = lax_linalg.lu_pivots_to_permutation(pivots.astype(jnp.int32) - 1, lu.shape[-2])
        p = permutation_matrix(permutation, lu.dtype)
    return (p, *_unpack(lu)) if unpack_data else (p, empty, empty)


# -- QR and Householder reflectors ---------------------------------------------------------------------

@register(aten.linalg_qr.default)
def linalg_qr(a, mode="reduced"):
    if mode not in ("reduced", "complete", "r"):
        raise unsupported_arg("aten.linalg_qr", f"mode={mode!r}")
    q, r = lax_linalg.qr(a, full_matrices=mode == "complete")
    return (jnp.zeros((0,), a.dtype) if mode == "r" else q), r


@register(aten.geqrf.default)
def geqrf(a):
    # NumPy's "raw" QR is LAPACK's geqrf, its matrix transposed (Fortran order)
    h, tau = jnp.linalg.qr(a, mode="raw")
    return mT(h), tau


def reflect(a, tau, c, left: bool, adjoint: bool):
    """`Q @ c` (`left`) or `c @ Q`, Q conjugate-transposed if `adjoint`, for Q = H_1 ... H_k the product
    of the Householder reflectors H_i = I - tau_i v_i v_i^H stored as LAPACK's geqrf leaves them: v_i
    is column i of `a` below the diagonal, with a 1 on it. One reflector per step: differentiable,
    which XLA's own Householder product is not."""
    k = tau.shape[-1]
    rows = jnp.arange(a.shape[-2])
    if adjoint:
        tau = jnp.conj(tau)

    def step(j, c):
        # Q c = H_1 (... (H_k c)) applies the last reflector first; Q^H c and c Q the first
        i = j if left == adjoint else k - 1 - j
        v = jnp.where(rows > i, a[..., :, i], 0) + (rows == i)
        t = tau[..., i][..., None, None]
        if left:
            return c - t * v[..., :, None] * jnp.einsum("...r,...rc->...c", jnp.conj(v), c)[..., None, :]
        return c - t * jnp.einsum("...cr,...r->...c", c, v)[..., :, None] * jnp.conj(v)[..., None, :]

    return lax.fori_loop(0, k, step, c)


@register(aten.linalg_householder_product.default)
def householder_product(a, tau):
    m, n = a.shape[-2:]
    eye = jnp.broadcast_to(jnp.eye(m, n, dtype=a.dtype), a.shape)
    return reflect(a, tau, eye, left=True, adjoint=False)


@register(aten.ormqr.default)
def ormqr(a, tau, other, left=True, transpose=False):
    return reflect(a, tau, other, left, transpose)


# -- singular values and Hermitian eigenvalues ----------------------------------------------------------

@register(aten._linalg_svd.default)
def linalg_svd(a, full_matrices=False, compute_uv=True, *, driver=None):
    batch, (m, n) = a.shape[:-2], a.shape[-2:]
    k = min(m, n)
    # the singular values alone: JAX differentiates them without the vectors
    s = (lax_linalg.svd(a, full_matrices=False, compute_uv=False) if a.size
         else jnp.zeros(batch + (k,), real_dtype(a)))
    if not compute_uv:
        return jnp.zeros((0,), a.dtype), s, jnp.zeros((0,), a.dtype)
    u = jnp.zeros(batch + (m, m if full_matrices else k), a.dtype)
    vh = jnp.zeros(batch + (n if full_matrices else k, n), a.dtype)
    error = gauge_error("aten._linalg_svd", "singular vectors (U, Vh: each unique only up to sign or phase)",
                        "torch.linalg.svdvals, matrix_norm, matrix_rank, pinv")
    return Gauged((u, s, vh), {0, 2}, error)


@register(aten._linalg_eigh.default)
def linalg_eigh(a, UPLO="L", compute_v=True):
    upper = UPLO == "U"
    if a.size:
        _, w = lax_linalg.eigh(hermitian(a, upper), lower=not upper, symmetrize_input=False)
    else:
        w = jnp.zeros(a.shape[:-1], real_dtype(a))
    if not compute_v:
        return w, jnp.zeros((0,), a.dtype)
    error = gauge_error("aten._linalg_eigh", "eigenvectors (each unique only up to sign or phase)",
                        "torch.linalg.eigvalsh, or functions of A such as matrix_exp and pinv(hermitian=True)")
    return Gauged((w, jnp.zeros_like(a)), {1}, error)


def _eigenvalues(a):
    if a.size:
        raise UnsupportedOpError(
            "torch -> XLA: torch.linalg.eig / eigvals of a general matrix has no XLA lowering: the order of "
            "its eigenvalues (and the phase of its eigenvectors) is LAPACK geev's, which XLA does not "
            "reproduce, and XLA has no general eigensolver on TPU. For symmetric / Hermitian matrices use "
            "torch.linalg.eigvalsh; otherwise compute it outside the compiled module.")
    return jnp.zeros(a.shape[:-1], jnp.complex64)


@register(aten.linalg_eig.default)
def linalg_eig(a):
    return _eigenvalues(a), jnp.zeros(a.shape, jnp.complex64)


@register(aten._linalg_eigvals.default)
def linalg_eigvals(a):
    return _eigenvalues(a)


@register(aten.linalg_ldl_factor_ex.default, aten.linalg_ldl_solve.default)
def linalg_ldl(*args, **kwargs):
    raise UnsupportedOpError(
        "torch -> XLA: torch.linalg.ldl_factor / ldl_solve have no XLA lowering: JAX and XLA have no LDL "
        "(Bunch-Kaufman, LAPACK sytrf) factorization whose pivots and blocks match torch's. Use "
        "torch.linalg.cholesky / solve instead, or compute them outside the compiled module.")
