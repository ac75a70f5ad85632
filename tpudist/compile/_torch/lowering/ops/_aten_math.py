"""Ports of the special functions torch computes in ATen/native/Math.h and JAX lacks: Bessel
functions of the first and second kind, modified Bessel functions of the second kind, the Airy
function Ai, the spherical Bessel function j0 (Cephes), and the orthogonal polynomials.

The same coefficients (as torch has them), branches, recurrences and order of operations, in
float32 through jax.numpy: values round as torch's float32 kernels do, up to the accuracy of XLA's
exp, log, sin, cos and acos, and to which multiply-adds each compiler fuses (which matters only
where a recurrence of tens of steps is ill-conditioned, near the ends of the polynomials' domains).
Every function takes and returns float arrays of one shape; the special cases (zeros, negatives,
infinities, NaN) are torch's.
"""

from __future__ import annotations

import jax.numpy as jnp
import jax.scipy.special as jss
import numpy as np
from jax import lax

_PI = np.float32(np.pi)


def polevl(x, coefficients):
    """Horner's rule from the highest-degree coefficient, as Cephes' polevl (torch starts from 0)."""
    result = jnp.zeros_like(x)
    for c in coefficients:
        result = result * x + c
    return result


def _chbevl(x, coefficients):
    """Cephes' chbevl: a Chebyshev series by Clenshaw's recurrence."""
    b0, b1, b2 = jnp.full_like(x, coefficients[0]), jnp.zeros_like(x), jnp.zeros_like(x)
    for c in coefficients[1:]:
        b2, b1 = b1, b0
        b0 = x * b1 - b2 + c
    return 0.5 * (b0 - b2)


# Cephes' coefficients, as torch's Math.h has them: the asymptotic expansion above 5 (PP, PQ, QP,
# QQ) is shared by J0 and Y0, and by J1 and Y1
_J0_PP = (7.96936729297347051624e-04, 8.28352392107440799803e-02, 1.23953371646414299388e+00,
          5.44725003058768775090e+00, 8.74716500199817011941e+00, 5.30324038235394892183e+00,
          9.99999999999999997821e-01)
_J0_PQ = (9.24408810558863637013e-04, 8.56288474354474431428e-02, 1.25352743901058953537e+00,
          5.47097740330417105182e+00, 8.76190883237069594232e+00, 5.30605288235394617618e+00,
          1.00000000000000000218e+00)
_J0_QP = (-1.13663838898469149931e-02, -1.28252718670509318512e+00, -1.95539544257735972385e+01,
          -9.32060152123768231369e+01, -1.77681167980488050595e+02, -1.47077505154951170175e+02,
          -5.14105326766599330220e+01, -6.05014350600728481186e+00)
_J0_QQ = (6.43178256118178023184e+01, 8.56430025976980587198e+02, 3.88240183605401609683e+03,
          7.24046774195652478189e+03, 5.93072701187316984827e+03, 2.06209331660327847417e+03,
          2.42005740240291393179e+02)
_J0_RP = (-4.79443220978201773821e+09, 1.95617491946556577543e+12, -2.49248344360967716204e+14,
          9.70862251047306323952e+15)
_J0_RQ = (4.99563147152651017219e+02, 1.73785401676374683123e+05, 4.84409658339962045305e+07,
          1.11855537045356834862e+10, 2.11277520115489217587e+12, 3.10518229857422583814e+14,
          3.18121955943204943306e+16, 1.71086294081043136091e+18)
_Y0_YP = (1.55924367855235737965e+04, -1.46639295903971606143e+07, 5.43526477051876500413e+09,
          -9.82136065717911466409e+11, 8.75906394395366999549e+13, -3.46628303384729719441e+15,
          4.42733268572569800351e+16, -1.84950800436986690637e+16)
_Y0_YQ = (1.04128353664259848412e+03, 6.26107330137134956842e+05, 2.68919633393814121987e+08,
          8.64002487103935000337e+10, 2.02979612750105546709e+13, 3.17157752842975028269e+15,
          2.50596256172653059228e+17)
_J1_PP = (7.62125616208173112003e-04, 7.31397056940917570436e-02, 1.12719608129684925192e+00,
          5.11207951146807644818e+00, 8.42404590141772420927e+00, 5.21451598682361504063e+00,
          1.00000000000000000254e+00)
_J1_PQ = (5.71323128072548699714e-04, 6.88455908754495404082e-02, 1.10514232634061696926e+00,
          5.07386386128601488557e+00, 8.39985554327604159757e+00, 5.20982848682361821619e+00,
          9.99999999999999997461e-01)
_J1_QP = (5.10862594750176621635e-02, 4.98213872951233449420e+00, 7.58238284132545283818e+01,
          3.66779609360150777800e+02, 7.10856304998926107277e+02, 5.97489612400613639965e+02,
          2.11688757100572135698e+02, 2.52070205858023719784e+01)
_J1_QQ = (7.42373277035675149943e+01, 1.05644886038262816351e+03, 4.98641058337653607651e+03,
          9.56231892404756170795e+03, 7.99704160447350683650e+03, 2.82619278517639096600e+03,
          3.36093607810698293419e+02)
_J1_RP = (-8.99971225705559398224e+08, 4.52228297998194034323e+11, -7.27494245221818276015e+13,
          3.68295732863852883286e+15)
_J1_RQ = (6.20836478118054335476e+02, 2.56987256757748830383e+05, 8.35146791431949253037e+07,
          2.21511595479792499675e+10, 4.74914122079991414898e+12, 7.84369607876235854894e+14,
          8.95222336184627338078e+16, 5.32278620332680085395e+18)
_Y1_YP = (1.26320474790178026440e+09, -6.47355876379160291031e+11, 1.14509511541823727583e+14,
          -8.12770255501325109621e+15, 2.02439475713594898196e+17, -7.78877196265950026825e+17)
_Y1_YQ = (5.94301592346128195359e+02, 2.35564092943068577943e+05, 7.34811944459721705660e+07,
          1.87601316108706159478e+10, 3.88231277496238566008e+12, 6.20557727146953693363e+14,
          6.87141087355300489866e+16, 3.97270608116560655612e+18)
_TWO_OVER_PI, _SQRT_TWO_OVER_PI = 0.636619772367581343075535053490057448, 0.797884560802865355879892119868763737


def _bessel_far(x, order, second):
    """J (or Y, `second`) of order 0 or 1 above 5, from the asymptotic expansion."""
    pp, pq, qp, qq = (_J0_PP, _J0_PQ, _J0_QP, _J0_QQ) if order == 0 else (_J1_PP, _J1_PQ, _J1_QP, _J1_QQ)
    z = 25 / (x * x) if order == 0 else 5 / x * (5 / x)
    p, q = polevl(z, pp) / polevl(z, pq), 5 / x * (polevl(z, qp) / polevl(z, qq))
    phase = x - (0.785398163397448309615660845819875721 if order == 0 else 2.356194490192344928846982537459627163)
    value = p * jnp.sin(phase) + q * jnp.cos(phase) if second else p * jnp.cos(phase) - q * jnp.sin(phase)
    return value * _SQRT_TWO_OVER_PI / jnp.sqrt(x)


def j0(x):
    x = jnp.abs(x)
    xx = x * x
    near = (xx - 5.78318596294678452118) * (xx - 30.4712623436620863991) * polevl(xx, _J0_RP) / polevl(xx, _J0_RQ)
    return jnp.where(x <= 5, jnp.where(x < 1e-5, 1 - xx / 4, near), _bessel_far(x, 0, False))


def j1(x):
    x, negative = jnp.where(x < 0, -x, x), x < 0
    xx = x * x
    near = polevl(xx, _J1_RP) / polevl(xx, _J1_RQ) * x * (xx - 14.6819706421238932572) * (xx - 49.2184563216946036703)
    value = jnp.where(x <= 5, near, _bessel_far(x, 1, False))
    return jnp.where(negative, -value, value)


def _y_near_edges(x, near):
    return jnp.where(x == 0, -jnp.inf, jnp.where(x < 0, jnp.nan, near))


def y0(x):
    near = polevl(x * x, _Y0_YP) / polevl(x * x, _Y0_YQ) + _TWO_OVER_PI * jnp.log(x) * j0(x)
    return jnp.where(x <= 5, _y_near_edges(x, near), _bessel_far(x, 0, True))


def y1(x):
    near = x * (polevl(x * x, _Y1_YP) / polevl(x * x, _Y1_YQ)) + _TWO_OVER_PI * (j1(x) * jnp.log(x) - 1 / x)
    return jnp.where(x <= 5, _y_near_edges(x, near), _bessel_far(x, 1, True))


_K0_A = (1.37446543561352307156e-16, 4.25981614279661018399e-14, 1.03496952576338420167e-11,
         1.90451637722020886025e-09, 2.53479107902614945675e-07, 2.28621210311945178607e-05,
         1.26461541144692592338e-03, 3.59799365153615016266e-02, 3.44289899924628486886e-01,
         -5.35327393233902768720e-01)
_K0_B = (5.30043377268626276149e-18, -1.64758043015242134646e-17, 5.21039150503902756861e-17,
         -1.67823109680541210385e-16, 5.51205597852431940784e-16, -1.84859337734377901440e-15,
         6.34007647740507060557e-15, -2.22751332699166985548e-14, 8.03289077536357521100e-14,
         -2.98009692317273043925e-13, 1.14034058820847496303e-12, -4.51459788337394416547e-12,
         1.85594911495471785253e-11, -7.95748924447710747776e-11, 3.57739728140030116597e-10,
         -1.69753450938905987466e-09, 8.57403401741422608519e-09, -4.66048989768794782956e-08,
         2.76681363944501510342e-07, -1.83175552271911948767e-06, 1.39498137188764993662e-05,
         -1.28495495816278026384e-04, 1.56988388573005337491e-03, -3.14481013119645005427e-02,
         2.44030308206595545468e+00)
_K1_A = (-7.02386347938628759343e-18, -2.42744985051936593393e-15, -6.66690169419932900609e-13,
         -1.41148839263352776110e-10, -2.21338763073472585583e-08, -2.43340614156596823496e-06,
         -1.73028895751305206302e-04, -6.97572385963986435018e-03, -1.22611180822657148235e-01,
         -3.53155960776544875667e-01, 1.52530022733894777053e+00)
_K1_B = (-5.75674448366501715755e-18, 1.79405087314755922667e-17, -5.68946255844285935196e-17,
         1.83809354436663880070e-16, -6.05704724837331885336e-16, 2.03870316562433424052e-15,
         -7.01983709041831346144e-15, 2.47715442448130437068e-14, -8.97670518232499435011e-14,
         3.34841966607842919884e-13, -1.28917396095102890680e-12, 5.13963967348173025100e-12,
         -2.12996783842756842877e-11, 9.21831518760500529508e-11, -4.19035475934189648750e-10,
         2.01504975519703286596e-09, -1.03457624656780970260e-08, 5.74108412545004946722e-08,
         -3.50196060308781257119e-07, 2.40648494783721712015e-06, -1.93619797416608296024e-05,
         1.95215518471351631108e-04, -2.85781685962277938680e-03, 1.03923736576817238437e-01,
         2.72062619048444266945e+00)


def k(x, order, scaled):
    """The modified Bessel function K of order 0 or 1 (times exp(x) when `scaled`)."""
    series = _chbevl(x * x - 2, _K0_A if order == 0 else _K1_A)
    if order == 0:
        near = series - jnp.log(0.5 * x) * jss.i0(x)
    else:
        near = jnp.log(0.5 * x) * jss.i1(x) + series / x
    far = _chbevl(8 / x - 2, _K0_B if order == 0 else _K1_B)
    near, far = (near * jnp.exp(x), far / jnp.sqrt(x)) if scaled else (near, jnp.exp(-x) * far / jnp.sqrt(x))
    return jnp.where(x == 0, jnp.inf, jnp.where(x < 0, jnp.nan, jnp.where(x <= 2, near, far)))


_AIRY_AN = (3.46538101525629032477e-01, 1.20075952739645805542e+01, 7.62796053615234516538e+01,
            1.68089224934630576269e+02, 1.59756391350164413639e+02, 7.05360906840444183113e+01,
            1.40264691163389668864e+01, 9.99999999999999995305e-01)
_AIRY_AD = (5.67594532638770212846e-01, 1.47562562584847203173e+01, 8.45138970141474626562e+01,
            1.77318088145400459522e+02, 1.64234692871529701831e+02, 7.14778400825575695274e+01,
            1.40959135607834029598e+01, 1.00000000000000000470e+00)
_AIRY_AFN = (-1.31696323418331795333e-01, -6.26456544431912369773e-01, -6.93158036036933542233e-01,
             -2.79779981545119124951e-01, -4.91900132609500318020e-02, -4.06265923594885404393e-03,
             -1.59276496239262096340e-04, -2.77649108155232920844e-06, -1.67787698489114633780e-08)
_AIRY_AFD = (1.33560420706553243746e+01, 3.26825032795224613948e+01, 2.67367040941499554804e+01,
             9.18707402907259625840e+00, 1.47529146771666414581e+00, 1.15687173795188044134e-01,
             4.40291641615211203805e-03, 7.54720348287414296618e-05, 4.51850092970580378464e-07)
_AIRY_AGN = (1.97339932091685679179e-02, 3.91103029615688277255e-01, 1.06579897599595591108e+00,
             9.39169229816650230044e-01, 3.51465656105547619242e-01, 6.33888919628925490927e-02,
             5.85804113048388458567e-03, 2.82851600836737019778e-04, 6.98793669997260967291e-06,
             8.11789239554389293311e-08, 3.41551784765923618484e-10)
_AIRY_AGD = (9.30892908077441974853e+00, 1.98352928718312140417e+01, 1.55646628932864612953e+01,
             5.47686069422975497931e+00, 9.54293611618961883998e-01, 8.64580826352392193095e-02,
             4.12656523824222607191e-03, 1.01259085116509135510e-04, 1.17166733214413521882e-06,
             4.91834570062930015649e-09)


def airy_ai(x):
    # below -2.09: the oscillating asymptotic expansion
    zeta = -2 * x * jnp.sqrt(-x) / 3
    z = 1 / zeta
    zz = z * z
    f = 1 + zz * polevl(zz, _AIRY_AFN) / polevl(zz, _AIRY_AFD)
    g = z * polevl(zz, _AIRY_AGN) / polevl(zz, _AIRY_AGD)
    t = zeta + 0.25 * _PI
    left = 5.64189583547756286948e-01 / jnp.sqrt(jnp.sqrt(-x)) * (jnp.sin(t) * f - jnp.cos(t) * g)
    # from 2.09: the decaying expansion
    zeta = 2 * x * jnp.sqrt(x) / 3
    ratio = polevl(1 / zeta, _AIRY_AN) / polevl(1 / zeta, _AIRY_AD)
    right = 5.64189583547756286948e-01 * ratio / (2 * jnp.sqrt(jnp.sqrt(x)) * jnp.exp(zeta))
    # between: the Maclaurin series, summed until a term falls below float32's epsilon
    z = x * x * x

    def term(state):
        k, m, n, f, g, active = state
        m1 = m * z / (k + 1) / (k + 2)
        n1 = n * z / (k + 2) / (k + 3)
        f1, g1 = f + m1, g + n1
        m, n, f, g = (jnp.where(active, new, old) for new, old in ((m1, m), (n1, n), (f1, f), (g1, g)))
        return k + 3, m, n, f, g, active & (jnp.abs(m1 / f1) > np.finfo(np.float32).eps)

    ones = jnp.ones_like(x)
    middle = (x >= -2.09) & (x < 2.09)
    _, _, _, f, g, _ = lax.while_loop(lambda s: jnp.any(s[5]), term, (np.float32(1), ones, x, ones, x, middle))
    series = 0.355028053887817239260 * f - 0.258819403792806798405 * g
    value = jnp.where(x < -2.09, left, jnp.where(x >= 2.09, right, series))
    return jnp.where(jnp.isinf(x), jnp.nan, jnp.where(x > 103.892, 0, value))


def spherical_j0(x):
    xx = x * x
    series = 1 + xx * (-1 / 6 + xx * (1 / 120 + xx * (-1 / 5040 + xx * (1 / 362880 + xx * (
        -1 / 39916800 + xx * (1 / 6227020800))))))
    return jnp.where(jnp.isinf(x), 0, jnp.where(jnp.abs(x) < 0.5, series, jnp.sin(x) / x))


# -- orthogonal polynomials -------------------------------------------------------------------------

def degree(n):
    """torch's `static_cast<int64_t>(n)` of a float degree, kept in float: truncated; NaN and
    infinities become negative (as x86 converts them, and hermite_polynomial_h says)."""
    return jnp.where(jnp.isfinite(n) & (jnp.abs(n) < 2.0 ** 63), jnp.trunc(n), -1.0)


def _recurrence(n, p1, step, stop_at_nan=True):
    """torch's loop: from P0 = 1 and P1, `q <- step(j, p, q)` for j = 1 .. n - 1 (per element),
    an element stopping early once its value is NaN; elements with n < 2 keep P1."""
    limit = jnp.minimum(n, 2.0 ** 31)  # the int32 counter stops there (2^31 steps: never in practice)

    def active(j, q):
        more = j.astype(q.dtype) < limit
        return more & ~jnp.isnan(q) if stop_at_nan else more

    def body(state):
        j, p, q = state
        on = active(j, q)
        return j + 1, jnp.where(on, q, p), jnp.where(on, step(j.astype(q.dtype), p, q), q)

    return lax.while_loop(lambda s: jnp.any(active(s[0], s[2])), body, (jnp.int32(1), jnp.ones_like(p1), p1))[2]


# per kind: (P1(t), the cut above which |t| < 1 takes the closed form, unshifted and shifted)
_CHEBYSHEV = {"t": (lambda t: t, 6, 6), "u": (lambda t: t + t, 8, 6),
              "v": (lambda t: t + t - 1, 8, 6), "w": (lambda t: t + t + 1, 8, 4)}


def chebyshev(kind, x, n, shifted):
    """Chebyshev polynomials T, U, V, W of x (of 2x - 1 when `shifted`), as torch evaluates them:
    the recurrence, closed forms in acos for high degrees inside (-1, 1), exact values at the ends."""
    n = degree(n)
    t = x + x - 1 if shifted else x
    if shifted:
        at_plus, at_minus = x == 1, x == 0
    else:
        at_plus, at_minus = (jnp.abs(x) == 1) & (x > 0), (jnp.abs(x) == 1) & ~(x > 0)
    even, odd = jnp.fmod(n, 2) == 0, n + n + 1
    plus, minus = {"t": (1, jnp.where(even, 1, -1)), "u": (n + 1, jnp.where(even, n + 1, -(n + 1))),
                   "v": (1, jnp.where(even, odd, -odd)), "w": (odd, jnp.where(even, 1, -1))}[kind]
    theta = jnp.arccos(t)
    if kind == "t":
        closed = jnp.cos(n * theta)
    elif kind == "u":
        s = jnp.sin(theta)
        closed = jnp.where(s != 0, jnp.sin((n + 1) * theta) / s, (n + 1) * jnp.cos((n + 1) * theta) / t)
    elif kind == "v":
        closed = jnp.where(jnp.sin(theta / 2) != 1, jnp.cos((n + 0.5) * theta) / jnp.cos(theta / 2), minus)
    else:  # torch's unshifted W falls back to its value at +1 there, the shifted one to that at -1
        fallback = minus if shifted else plus
        closed = jnp.where(jnp.cos(theta / 2) != 1, jnp.sin((n + 0.5) * theta) / jnp.sin(theta / 2), fallback)
    first, cut = _CHEBYSHEV[kind][0](t), _CHEBYSHEV[kind][2 if shifted else 1]
    use_closed = (n > cut) & (jnp.abs(t) < 1)
    looped = _recurrence(jnp.where(at_plus | at_minus | use_closed, 0, n), first, lambda j, p, q: (t + t) * q - p)
    value = jnp.where(n == 1, first, jnp.where(n == 0, 1, looped))
    value = jnp.where(at_minus, minus, jnp.where(at_plus, plus, jnp.where(use_closed, closed, value)))
    return jnp.where(n < 0, 0, value).astype(x.dtype)


def hermite(x, n, physicists):
    """Hermite polynomials H (`physicists`) or He; NaN above degree 128, as torch in float32."""
    n = degree(n)
    first = x + x if physicists else x
    if physicists:
        step = lambda j, p, q: (x + x) * q - (j + j) * p  # noqa: E731
    else:
        step = lambda j, p, q: x * q - j * p  # noqa: E731
    looped = _recurrence(jnp.where(n > 128, 0, n), first, step, stop_at_nan=False)
    value = jnp.where(n > 128, jnp.nan, looped)
    value = jnp.where(n == 1, first, jnp.where(n == 0, 1, value))
    return jnp.where(n < 0, 0, value).astype(x.dtype)


def laguerre(x, n):
    n = degree(n)
    looped = _recurrence(jnp.where(x == 0, 0, n), 1 - x, lambda j, p, q: (((j + j) + (1 - x)) * q - j * p) / (j + 1))
    value = jnp.where(x == 0, 1, jnp.where(n == 1, 1 - x, jnp.where(n == 0, 1, looped)))
    return jnp.where(n < 0, 0, value).astype(x.dtype)


def legendre(x, n):
    n = degree(n)
    edge = jnp.abs(x) == 1
    looped = _recurrence(jnp.where(edge, 0, n), x, lambda j, p, q: ((j + j + 1) * x * q - j * p) / (j + 1))
    value = jnp.where(n == 1, x, jnp.where(n == 0, 1, looped))
    value = jnp.where(edge, jnp.where((x > 0) | (jnp.fmod(n, 2) == 0), 1, -1), value)
    return jnp.where(n < 0, 0, value).astype(x.dtype)
