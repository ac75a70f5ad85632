"""Per-op tests of the torch -> XLA bridge, against eager torch.

Two levels:
- registry level: each ATen op's JAX lowering, called directly, against the ATen op run eagerly
  (values, and the VJP against torch autograd for every floating input); fast, so hypothesis
  explores shapes and arguments.
- module level: small modules using torch.nn.functional through `tpudist.compile`, which also
  covers torch.export's decomposition into the ops above.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st
from hypothesis.extra import numpy as hnp

import tpudist
from tpudist.compile._torch import CaptureError, supported_ops
from tpudist.compile._torch._convert import jax_dtype
from tpudist.compile._torch.lowering._registry import lookup

from compiled_check import Fn, check_compiled

aten = torch.ops.aten
# torch.export's own deprecation noise, not ours
pytestmark = pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")


def examples(n):
    """Hypothesis settings for these tests: few examples (each costs an XLA compile), no deadline,
    no example database written into the working tree."""
    return settings(max_examples=n, deadline=None, database=None)


# -- registry-level harness -------------------------------------------------------------------

def _to_jax(value):
    if isinstance(value, torch.Tensor):
        # through NumPy, not the bridge's DLPack path, so the harness is independent of it
        return jnp.asarray(value.detach().numpy(), dtype=jax_dtype(value.dtype))
    if isinstance(value, torch.dtype):
        return jax_dtype(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_to_jax(v) for v in value)
    return value


def _flat(value):
    return list(value) if isinstance(value, (list, tuple)) else [value]


class OpChecks:
    """A batch of ATen ops checked against their registered lowerings, in one XLA compilation.

    Each `add(op, *args, **kwargs)` runs the ATen op eagerly (and torch autograd with a random
    cotangent for every output torch can differentiate, w.r.t. every floating tensor argument not
    listed in `constant`); leaving the `with` block runs all lowerings and their jax.vjp in one
    jitted function and compares values and gradients case by case, naming the op on failure.
    outputs: which outputs of a multi-output op to compare (default all).
    """

    def __init__(self):
        self.cases = []

    def __enter__(self):
        return self

    def __exit__(self, kind, *_):
        if kind is None:
            self.run()

    def add(self, op, *args, outputs=None, grad=True, constant=(), rtol=1e-5, atol=1e-5, **kwargs):
        lowering = lookup(op)
        assert lowering is not None, f"{op} is not registered"
        diff = [i for i, a in enumerate(args)
                if grad and isinstance(a, torch.Tensor) and a.is_floating_point() and i not in constant]
        t_args = [a.detach().clone().requires_grad_(i in diff) if isinstance(a, torch.Tensor) else a
                  for i, a in enumerate(args)]
        expected = _flat(op(*t_args, **kwargs))
        keep = list(range(len(expected)) if outputs is None else outputs)
        differentiable = [k for k in keep if expected[k].requires_grad]
        gen = torch.Generator().manual_seed(len(self.cases))
        cotangents = {k: torch.randn(expected[k].shape, generator=gen) for k in differentiable}
        torch_grads = []
        if differentiable:
            grads = torch.autograd.grad([expected[k] for k in differentiable], [t_args[i] for i in diff],
                                        [cotangents[k] for k in differentiable], allow_unused=True)
            torch_grads = [np.zeros(args[i].shape) if g is None else g.double().numpy() for i, g in zip(diff, grads)]
        self.cases.append(dict(
            op=op, fn=lowering.fn, args=[_to_jax(a) for a in args], kwargs={k: _to_jax(v) for k, v in kwargs.items()},
            diff=diff, keep=keep, differentiable=bool(differentiable), tol=dict(rtol=rtol, atol=atol),
            cotangents=[cotangents[k].numpy() if k in cotangents else None for k in keep],
            expected=[expected[k].detach() for k in keep], torch_grads=torch_grads))
        return self

    def run(self):
        def one(case, diff_values):
            def lowered(values):
                full = list(case["args"])
                for i, v in zip(case["diff"], values):
                    full[i] = v
                return [_flat(case["fn"](*full, **case["kwargs"]))[k] for k in case["keep"]]

            got, vjp = jax.vjp(lowered, diff_values)
            cot = [jnp.zeros(g.shape, g.dtype) if c is None else jnp.asarray(c)
                   for g, c in zip(got, case["cotangents"])]
            return got, (vjp(cot)[0] if case["differentiable"] else [])

        results = jax.jit(lambda values: [one(case, v) for case, v in zip(self.cases, values)])(
            [[case["args"][i] for i in case["diff"]] for case in self.cases])
        for case, (got, grads) in zip(self.cases, results):
            op = case["op"]
            for k, g, want in zip(case["keep"], got, case["expected"]):
                assert tuple(g.shape) == tuple(want.shape), f"{op} output {k}: shape {g.shape} != torch {tuple(want.shape)}"
                np.testing.assert_allclose(np.asarray(g, np.float64), want.double().numpy(), **case["tol"],
                                           err_msg=f"{op} output {k}")
            for i, jg, tg in zip(case["diff"], grads, case["torch_grads"]):
                np.testing.assert_allclose(np.asarray(jg, np.float64), tg, **case["tol"],
                                           err_msg=f"{op} gradient of argument {i}")


def check_op(op, *args, **options):
    """One op, checked on its own (see OpChecks)."""
    OpChecks().add(op, *args, **options).run()


def randn(*shape, seed=0, low=None):
    t = torch.randn(tuple(shape), generator=torch.Generator().manual_seed(seed))
    return t.abs() + low if low is not None else t


# -- elementwise -----------------------------------------------------------------------------

UNARY = [aten.neg.default, aten.abs.default, aten.exp.default, aten.expm1.default, aten.sin.default,
         aten.cos.default, aten.tanh.default, aten.sigmoid.default, aten.relu.default, aten.silu.default,
         aten.erf.default, aten.floor.default, aten.ceil.default, aten.round.default, aten.trunc.default,
         aten.sign.default, aten.atan.default]
POSITIVE = [aten.log.default, aten.log2.default, aten.log1p.default, aten.sqrt.default, aten.rsqrt.default,
            aten.reciprocal.default]
BINARY = [aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.maximum.default,
          aten.minimum.default, aten.pow.Tensor_Tensor, aten.atan2.default, aten.eq.Tensor, aten.lt.Tensor,
          aten.ge.Tensor]


def test_unary_and_binary():
    # elementwise lowerings do not depend on shape: one tensor with both signs and an exact zero
    # (where torch's gradients have conventions: abs, relu, sign), and a broadcasting pair
    x = randn(3, 4)
    x[0, 0] = 0.0
    y = randn(2, 1, 4, seed=1)
    with OpChecks() as c:
        for op in UNARY:
            c.add(op, x)
        for op in POSITIVE:
            c.add(op, x.abs() + 0.1)
        for op in BINARY:
            c.add(op, x.abs() + 0.5 if op is aten.pow.Tensor_Tensor else x, y, rtol=1e-4)


@examples(3)
@given(shapes=hnp.mutually_broadcastable_shapes(num_shapes=2, max_dims=3, max_side=4), seed=st.integers(0, 99))
def test_broadcasting_gradients_sum_over_broadcast_dims(shapes, seed):
    x, y = randn(*shapes.input_shapes[0], seed=seed), randn(*shapes.input_shapes[1], seed=seed + 1)
    check_op(aten.mul.Tensor, x, y)


def test_scalar_forms_rounding_and_activations():
    x = randn(3, 4)
    ints, divisors = torch.tensor([7, -7, 7, -7, 0, 9]), torch.tensor([2, 2, -2, -2, 3, -4])
    with OpChecks() as c:
        c.add(aten.add.Tensor, x, randn(3, 4, seed=1), alpha=2.5)
        c.add(aten.sub.Scalar, x, 1.5, alpha=2)
        c.add(aten.rsub.Scalar, x, 3.0)
        c.add(aten.mul.Scalar, x, -0.5)
        c.add(aten.div.Scalar, x, 4.0)
        c.add(aten.pow.Tensor_Scalar, x, 2)
        c.add(aten.pow.Tensor_Scalar, x, 3.0)
        c.add(aten.pow.Tensor_Scalar, x.abs() + 0.1, 0.5)
        c.add(aten.pow.Scalar, 2.0, x)
        c.add(aten.remainder.Scalar, x * 5, 1.5, grad=False)
        c.add(aten.fmod.Scalar, x * 5, 1.5, grad=False)
        for mode in ("trunc", "floor", None):
            c.add(aten.div.Tensor_mode, ints, divisors, rounding_mode=mode)
            c.add(aten.div.Tensor_mode, ints.float() * 1.3, divisors.float(), rounding_mode=mode, grad=mode is None)
        for approximate in ("none", "tanh"):
            c.add(aten.gelu.default, x * 3, approximate=approximate)
        c.add(aten.leaky_relu.default, x * 3, 0.2)
        c.add(aten.hardtanh.default, x * 3, -0.5, 2.0)
        c.add(aten.elu.default, x * 60, 1.3)  # large inputs: the unused exp branch must not give NaN
        c.add(aten.hardswish.default, x * 3)
        c.add(aten.hardsigmoid.default, x * 3)


def test_clamp_where_logic_and_casts():
    bounds = torch.tensor([-2.0, -1.0, 0.0, 1.0, 2.0])  # clamp passes the gradient at its bounds, as torch
    x, y = randn(3, 4), randn(3, 4, seed=1)
    with OpChecks() as c:
        c.add(aten.clamp.default, bounds, -1.0, 1.0)
        c.add(aten.clamp.Tensor, bounds, torch.full((5,), -1.0), torch.full((5,), 1.0))
        c.add(aten.clamp_min.default, bounds, 0.0)
        c.add(aten.where.self, x > 0, x, y)
        c.add(aten.masked_fill.Scalar, x, y > 0, -1e9)
        c.add(aten.logical_and.default, x > 0, y > 0)
        c.add(aten.logical_not.default, x > 0)
        c.add(aten.bitwise_not.default, x > 0)
        c.add(aten._to_copy.default, x * 10, dtype=torch.int32)
        c.add(aten._to_copy.default, x, dtype=torch.bool)
        c.add(aten.isnan.default, torch.tensor([1.0, math.nan, math.inf]))


# -- reductions ------------------------------------------------------------------------------

@examples(3)
@given(shape=hnp.array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=4), data=st.data())
def test_reductions(shape, data):
    x = randn(*shape, seed=data.draw(st.integers(0, 99)))
    dims = data.draw(st.lists(st.integers(-len(shape), len(shape) - 1), min_size=1, max_size=len(shape),
                              unique_by=lambda d: d % len(shape)))
    keepdim = data.draw(st.booleans())
    d = dims[0]
    with OpChecks() as c:
        c.add(aten.sum.dim_IntList, x, dims, keepdim)
        c.add(aten.mean.dim, x, dims, keepdim)
        c.add(aten.amax.default, x, dims, keepdim)
        c.add(aten.amin.default, x, dims, keepdim)
        c.add(aten.var.correction, x, dims, correction=0, keepdim=keepdim)
        c.add(aten.any.dims, x > 0, dims, keepdim)
        c.add(aten.max.dim, x, d, keepdim)
        c.add(aten.min.dim, x, d, keepdim)
        c.add(aten.argmax.default, x, d, keepdim)
        c.add(aten.prod.dim_int, x, d, keepdim)
        c.add(aten.cumsum.default, x, d)
        c.add(aten._softmax.default, x, d, False)
        c.add(aten._log_softmax.default, x, d, False)
        c.add(aten.logsumexp.default, x, [d], keepdim)


def test_full_reductions_norms_and_sorting():
    x = randn(3, 5)
    with OpChecks() as c:
        c.add(aten.sum.default, x)
        c.add(aten.mean.default, x)
        c.add(aten.max.default, x)
        c.add(aten.min.default, x)
        c.add(aten.prod.default, x)
        c.add(aten.var.correction, x, None)
        c.add(aten.var_mean.correction, x, [1], correction=1, keepdim=True)
        c.add(aten.all.default, x > -3)
        c.add(aten.any.default, x > 3)
        for ord in (2, 1, 3.0, float("inf")):
            c.add(aten.linalg_vector_norm.default, x, ord, [1])
        c.add(aten.linalg_vector_norm.default, torch.zeros(2, 3), 2, [1])  # zero gradient at 0, as torch
        c.add(aten.topk.default, x, 3)
        c.add(aten.topk.default, x, 2, 0, False)
        c.add(aten.sort.default, x, 1, True)
        c.add(aten.sort.stable, x, stable=True, dim=0)


# -- shapes and views ------------------------------------------------------------------------

def test_views_layout_cat_split_select_pad():
    x = randn(2, 3, 4)
    with OpChecks() as c:
        c.add(aten.view.default, x, [6, -1])
        c.add(aten._unsafe_view.default, x, [4, 6])
        c.add(aten.permute.default, x, [2, 0, 1])
        c.add(aten.t.default, randn(3, 5))
        c.add(aten.transpose.int, x, 0, 2)
        c.add(aten.expand.default, randn(3, 1), [2, 3, 4])
        c.add(aten.expand.default, randn(3, 1), [-1, 5])
        c.add(aten.unsqueeze.default, x, -1)
        c.add(aten.squeeze.dims, randn(2, 1, 3, 1), [1, 2, -1])
        c.add(aten.squeeze.default, randn(1, 3, 1))
        c.add(aten.flip.default, x, [0, 2])
        c.add(aten.roll.default, x, [1, -2], [0, 2])
        c.add(aten.repeat.default, randn(2, 3), [2, 1, 2])
        c.add(aten.tril.default, randn(4, 4), -1)
        c.add(aten.triu.default, randn(4, 4), 1)
        c.add(aten.clone.default, x)
        c.add(aten.alias.default, x)
        c.add(aten.cat.default, [randn(2, 3), randn(2, 5, seed=1)], 1)
        c.add(aten.cat.default, [x, x, x], -2)
        c.add(aten.split_with_sizes.default, randn(7, 2), [2, 4, 1])
        c.add(aten.split.Tensor, randn(7, 2), 3)
        c.add(aten.unbind.int, randn(3, 2), 0)
        c.add(aten.select.int, x, 1, -1)
        c.add(aten.narrow.default, x, 2, 1, 3)
        c.add(aten.constant_pad_nd.default, x, [1, 2], 0.5)
        c.add(aten.constant_pad_nd.default, x, [0, 0, 2, -1, -1, 1])


@examples(4)
@given(size=st.integers(1, 6), start=st.one_of(st.none(), st.integers(-8, 8)),
       end=st.one_of(st.none(), st.integers(-8, 8), st.just(2**63 - 1)), step=st.integers(1, 3))
def test_slice_like_python(size, start, end, step):
    check_op(aten.slice.Tensor, randn(2, size), 1, start, end, step)


# -- indexing --------------------------------------------------------------------------------

def test_advanced_indexing_and_embeddings():
    x = randn(4, 5, 6)
    i, j = torch.tensor([0, 2, -1]), torch.tensor([[1], [4]])
    weight, bag_indices = randn(10, 4), torch.tensor([1, 3, 3, 7, 0, 9, 2, 3])
    with OpChecks() as c:
        c.add(aten.index.Tensor, x, [i])
        c.add(aten.index.Tensor, x, [None, j])
        c.add(aten.index.Tensor, x, [i, None, torch.tensor([0, 5, 2])])  # index dims split by a slice
        c.add(aten.index_put.default, x, [i], randn(3, 5, 6, seed=1))
        c.add(aten.index_put.default, x, [torch.tensor([1, 1, 2])], randn(6, seed=2), True)  # accumulate
        c.add(aten.index_select.default, x, 2, torch.tensor([5, 0, 0]))
        for padding_idx in (-1, 2):  # the padding row gets no gradient, as in torch
            c.add(aten.embedding.default, randn(6, 3), torch.tensor([[0, 2, 5], [2, 2, 1]]), padding_idx)
        for mode in (0, 1, 2):  # sum, mean, max; bag 1 is empty
            for include_last_offset, padding_idx in ((False, -1), (True, 3)):
                offsets = torch.tensor([0, 3, 3, 6] + ([8] if include_last_offset else []))
                weights = randn(8, seed=3) if mode == 0 else None
                c.add(aten._embedding_bag.default, weight, bag_indices, offsets, False, mode, False, weights,
                      include_last_offset, padding_idx, outputs=[0])


@examples(3)
@given(data=st.data())
def test_gather_scatter(data):
    shape = data.draw(hnp.array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=4))
    d = data.draw(st.integers(0, len(shape) - 1))
    # torch lets the index be smaller than the input in every dim
    ishape = tuple(data.draw(st.integers(1, s)) for s in shape)
    seed = data.draw(st.integers(0, 99))
    g = torch.Generator().manual_seed(seed)
    x = randn(*shape, seed=seed)
    index = torch.randint(0, shape[d], ishape, generator=g)
    src = randn(*ishape, seed=seed + 1)  # torch's own backward needs src shaped like the index
    # scatter with duplicate indices keeps an unspecified one: compare on a permutation only
    perm = torch.stack([torch.randperm(shape[d], generator=g) for _ in range(int(np.prod(shape)) // shape[d])])
    perm = perm.reshape(*[s for k, s in enumerate(shape) if k != d], shape[d]).movedim(-1, d)
    with OpChecks() as c:
        c.add(aten.gather.default, x, d, index)
        c.add(aten.scatter_add.default, x, d, index, src)
        for reduce in ("sum", "amax", "mean"):
            c.add(aten.scatter_reduce.two, x, d, index, src, reduce, include_self=data.draw(st.booleans()),
                  grad=reduce == "sum")
        c.add(aten.scatter.src, x, d, perm, randn(*shape, seed=seed + 2))
        c.add(aten.scatter.value, x, d, perm, 2.5)


# -- nn: matmul, conv, pooling, normalization, factories -----------------------------------------

def test_matmuls_norms_and_factories():
    a, b = randn(3, 4), randn(4, 5, seed=1)
    x = randn(4, 6, 5)
    with OpChecks() as c:
        c.add(aten.mm.default, a, b)
        c.add(aten.bmm.default, randn(2, 3, 4), randn(2, 4, 5, seed=1))
        c.add(aten.addmm.default, randn(5, seed=2), a, b)
        c.add(aten.addmm.default, randn(3, 5, seed=2), a, b, beta=0.5, alpha=2.0)
        c.add(aten.baddbmm.default, randn(2, 3, 5), randn(2, 3, 4), randn(2, 4, 5, seed=1))
        c.add(aten.mv.default, a, randn(4))
        c.add(aten.dot.default, randn(4), randn(4, seed=1))
        c.add(aten.native_layer_norm.default, x, [5], randn(5, seed=1), randn(5, seed=2), 1e-5, rtol=1e-4)
        c.add(aten.native_layer_norm.default, x, [6, 5], None, None, 1e-5, rtol=1e-4)
        # batch norm outputs: normalized, then the updated running mean and var (saved stats are internal)
        for training in (True, False):
            c.add(aten._native_batch_norm_legit_functional.default, x, randn(6, seed=3), randn(6, seed=4),
                  randn(6, seed=1), randn(6, seed=2, low=0.5), training, 0.1, 1e-5, outputs=[0, 3, 4],
                  constant=(3, 4), rtol=1e-4)
        c.add(aten._native_batch_norm_legit_no_training.default, x, randn(6, seed=1), None,
              randn(6, seed=2), randn(6, seed=3, low=0.5), 0.1, 1e-5, outputs=[0], constant=(3, 4), rtol=1e-4)
        c.add(aten.native_group_norm.default, x, randn(6, seed=4), randn(6, seed=5), 4, 6, 5, 3, 1e-5, rtol=1e-4)
        c.add(aten.full.default, [2, 3], 1.5, dtype=torch.float32)
        c.add(aten.full_like.default, randn(2, 2), 7)
        c.add(aten.arange.start_step, 1, 10, 3, dtype=torch.int64)
        c.add(aten.arange.default, 5)
        c.add(aten.scalar_tensor.default, -2.0)
        c.add(aten.zeros_like.default, randn(3))
        c.add(aten.new_ones.default, randn(3), [2, 2])


@examples(5)
@given(data=st.data())
def test_convolution(data):
    nd = data.draw(st.sampled_from([1, 2]))
    groups = data.draw(st.sampled_from([1, 2]))
    k = data.draw(st.integers(1, 3))
    stride, pad, dil = (data.draw(st.integers(1, 2)) for _ in range(3))
    transposed = data.draw(st.booleans())
    size = data.draw(st.integers(k * dil, 7))
    x = randn(2, 2 * groups, *([size] * nd))
    if transposed:
        pad = min(pad, dil * (k - 1))
        w = randn(2 * groups, 3, *([k] * nd), seed=1)  # (in, out/groups, k...)
        output_padding = data.draw(st.integers(0, max(stride, dil) - 1))
    else:
        w = randn(3 * groups, 2, *([k] * nd), seed=1)
        output_padding = 0
    bias = randn(w.shape[1] * groups if transposed else w.shape[0], seed=2) if data.draw(st.booleans()) else None
    check_op(aten.convolution.default, x, w, bias, [stride] * nd, [pad] * nd, [dil] * nd, transposed,
             [output_padding] * nd, groups, rtol=1e-4, atol=1e-4)


@examples(3)
@given(data=st.data())
def test_pooling(data):
    k = data.draw(st.integers(1, 3))
    stride = data.draw(st.integers(1, 3))
    pad = data.draw(st.integers(0, k // 2))
    ceil = data.draw(st.booleans())
    h, w = data.draw(st.integers(k, 7)), data.draw(st.integers(k, 7))
    x = randn(2, 3, h, w, seed=data.draw(st.integers(0, 99)))
    dil = data.draw(st.integers(1, 2))
    include_pad = data.draw(st.booleans())
    divisor = data.draw(st.sampled_from([None, 3]))
    oh, ow = data.draw(st.integers(1, 4)), data.draw(st.integers(1, 4))
    with OpChecks() as c:
        if dil * (k - 1) + 1 <= min(h, w) + 2 * pad:
            c.add(aten.max_pool2d_with_indices.default, x, [k, k], [stride, stride], [pad, pad], [dil, dil], ceil)
        c.add(aten.avg_pool2d.default, x, [k, k], [stride, stride], [pad, pad], ceil, include_pad, divisor)
        c.add(aten._adaptive_avg_pool2d.default, x, [oh, ow])


def test_pooling_3d():
    x = randn(1, 2, 5, 4, 6)
    with OpChecks() as c:
        c.add(aten.max_pool3d_with_indices.default, x, [2, 2, 3], [2, 1, 2], [1, 0, 1])
        c.add(aten.avg_pool3d.default, x, [2, 2, 2], [1, 2, 2], [1, 1, 0], True, False)


def test_every_lowering_is_a_real_aten_or_tpudist_op():
    names = supported_ops()
    assert len(names) == len(set(names)) > 150
    # torch's prims (what some of its decompositions emit); other libraries' ops, matched by name
    assert all(n.startswith(("aten.", "prims.", "tpudist.", "transformers.")) for n in names)


# -- module level: through tpudist.compile ------------------------------------------------------

def test_compiled_decomposed_functions_dtypes_and_stop_gradients():
    # functions torch.export decomposes into several core ops; results of every dtype family;
    # detach() and torch.no_grad() blocks, which decomposition would otherwise erase
    def fn(x):
        with torch.no_grad():
            scale = x.abs().sum()
        return (F.silu(x), F.softplus(x), F.mish(x), F.hardswish(x), F.logsigmoid(x), x.var(1), x.std(), x.norm(),
                x.logsumexp(1), x.max(1).values, x.argmax(1), x.to(torch.int64), (x * 3).int(), x > 0, x.double(),
                torch.arange(4), x.detach() * x + scale * x)
    check_compiled(fn, randn(4, 9) * 2)


def test_compiled_losses():
    logits, target = randn(6, 5), torch.tensor([0, 4, 2, 2, 1, 3])
    probs = torch.rand(6, 5, generator=torch.Generator().manual_seed(1))
    check_compiled(lambda x, t, p: (F.cross_entropy(x, t), F.cross_entropy(x, t, label_smoothing=0.1),
                                    F.cross_entropy(x, t, ignore_index=2, reduction="sum"),
                                    F.cross_entropy(x, p), F.nll_loss(F.log_softmax(x, 1), t),
                                    F.mse_loss(x, p), F.binary_cross_entropy_with_logits(x, p),
                                    F.binary_cross_entropy_with_logits(x, p, pos_weight=torch.full((5,), 2.0)),
                                    F.l1_loss(x, p), F.smooth_l1_loss(x, p), F.mse_loss(x, p, reduction="none")),
                   logits, target, probs)


def test_compiled_attention():
    q, k, v = randn(2, 3, 5, 4), randn(2, 3, 5, 4, seed=1), randn(2, 3, 5, 4, seed=2)
    boolean = torch.rand(5, 5, generator=torch.Generator().manual_seed(3)) > 0.3
    boolean[:, 0] = True  # no fully masked row
    additive = randn(5, 5, seed=4)
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    x = randn(2, 4, 8, seed=5)
    padding = torch.tensor([[False, False, True, True], [False, False, False, False]])
    check_compiled(lambda q, k, v, boolean, additive, x, padding: (
        F.scaled_dot_product_attention(q, k, v, is_causal=True),
        F.scaled_dot_product_attention(q, k, v, attn_mask=boolean),
        F.scaled_dot_product_attention(q, k, v, attn_mask=additive),
        *mha(x, x, x, key_padding_mask=padding)), q, k, v, boolean, additive, x, padding, rtol=1e-4)


def test_a_query_that_attends_nowhere_gives_zero_as_torch_does():
    """A left-padded batch's padding rows mask every key (all False, or all -inf): torch's
    attention gives 0 there, and 0 gradient (transformers relies on it); not NaN, which would
    spread through the next layer's keys into every row."""
    q, k, v = randn(2, 2, 4, 8), randn(2, 2, 4, 8, seed=1), randn(2, 2, 4, 8, seed=2)
    keep = torch.ones(2, 1, 4, 4, dtype=torch.bool)
    keep[0, :, :2] = False  # the first two queries of batch row 0 attend nowhere
    additive = torch.zeros(2, 1, 4, 4).masked_fill(~keep, float("-inf"))
    check_compiled(lambda q, k, v, keep, additive: (
        F.scaled_dot_product_attention(q, k, v, attn_mask=keep),
        F.scaled_dot_product_attention(q, k, v, attn_mask=additive)), q, k, v, keep, additive, rtol=1e-4)


def test_compiled_attention_forms():
    """Every form of F.scaled_dot_product_attention torch users (and Llama) write, values and
    gradients: grouped-query heads, a causal mask over more keys than queries, a scale, per-batch
    broadcast masks, 3-d inputs, a value width other than the key's."""
    q, kv = randn(2, 4, 3, 8), randn(2, 2, 6, 8, seed=1)
    per_batch = torch.rand(2, 1, 3, 6, generator=torch.Generator().manual_seed(2)) > 0.4
    per_batch[..., 0] = True
    bias = randn(1, 4, 3, 6, seed=3)
    q3, k3, v3 = randn(3, 5, 8, seed=4), randn(3, 7, 8, seed=5), randn(3, 7, 2, seed=6)
    check_compiled(lambda q, kv, per_batch, bias, q3, k3, v3: (
        F.scaled_dot_product_attention(q, kv, kv, enable_gqa=True),
        F.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True, scale=0.3),
        F.scaled_dot_product_attention(q, kv.repeat_interleave(2, 1), kv.repeat_interleave(2, 1), attn_mask=per_batch),
        F.scaled_dot_product_attention(q, kv.repeat_interleave(2, 1), kv.repeat_interleave(2, 1), attn_mask=bias),
        F.scaled_dot_product_attention(q3, k3, v3, is_causal=True),
        F.scaled_dot_product_attention(q3, k3, v3, scale=2.0)), q, kv, per_batch, bias, q3, k3, v3, rtol=1e-4)


def _repeat_kv(x: torch.Tensor, n: int) -> torch.Tensor:
    """How transformers shares key/value heads before attention with a mask (its `repeat_kv`)."""
    b, h, s, d = x.shape
    return x[:, :, None, :, :].expand(b, h, n, s, d).reshape(b, h * n, s, d)


def test_heads_repeated_before_attention_are_attended_as_they_are():
    """Llama-style attention (key/value heads repeated for the query heads, then a masked SDPA)
    computes eager torch's values and gradients, and is captured as grouped-query attention on the
    heads as they are: no copy of the keys and values per query head (a static KV cache's whole
    length, per layer and token, in decoding)."""
    from tpudist.compile._torch.lowering._capture import capture
    q, k, v = randn(2, 4, 3, 8), randn(2, 2, 6, 8, seed=1), randn(2, 2, 6, 8, seed=2)
    keep = torch.rand(2, 1, 3, 6, generator=torch.Generator().manual_seed(3)) > 0.3
    keep[..., 0] = True
    per_head = randn(2, 4, 3, 6, seed=4)
    attend = lambda q, k, v, keep, per_head: (  # noqa: E731
        F.scaled_dot_product_attention(q, _repeat_kv(k, 2), _repeat_kv(v, 2), attn_mask=keep),
        F.scaled_dot_product_attention(q, _repeat_kv(k, 2), _repeat_kv(v, 2), attn_mask=per_head),
        F.scaled_dot_product_attention(q, _repeat_kv(k, 2), _repeat_kv(v, 2), is_causal=True))
    check_compiled(attend, q, k, v, keep, per_head, rtol=1e-4)
    ops = capture(Fn(attend), (q, k, v, keep, per_head), {}).op_counts
    assert ops.get("tpudist.attention.default") == 3 and not any("expand" in op for op in ops), ops


def test_attention_is_one_op_and_its_dropout_is_random():
    from tpudist.compile._torch.lowering._capture import capture
    layer = torch.nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, batch_first=True)
    captured = capture(Fn(lambda q: F.scaled_dot_product_attention(q, q, q, is_causal=True)), (randn(2, 2, 5, 4),), {})
    assert captured.op_counts == {"tpudist.attention.default": 1}  # not torch's matmuls and softmax
    assert not captured.has_random
    assert "tpudist.attention.default" in capture(layer, (randn(2, 5, 8),), {}).op_counts
    # with dropout: the weights are dropped out and rescaled, so with all-ones values every output
    # is the sum of the kept weights / (1 - p): 1 on average, not always; a new draw every call
    q, v = randn(4, 2, 64, 8), torch.ones(4, 2, 64, 8)
    cm = tpudist.compile(Fn(lambda q, v: F.scaled_dot_product_attention(q, q, v, dropout_p=0.5)))
    torch.manual_seed(3)
    first = cm(q, v)
    torch.manual_seed(3)
    again, other = cm(q, v), cm(q, v)
    torch.testing.assert_close(first, again)
    assert not torch.equal(first, other)
    assert first.std() > 0.05 and abs(first.mean().item() - 1.0) < 0.05
    assert cm.stats.compiles == 1


def test_compiled_as_strided_views():
    """as_strided written by users and emitted by torch's own decompositions (a mean over a
    permuted, channels-last tensor; unfold), on contiguous and permuted inputs."""
    x = randn(4, 6)
    nhwc = randn(2, 5, 5, 3)
    check_compiled(lambda x, nhwc: (
        x.as_strided((3, 4), (6, 1)),            # a block
        x.as_strided((6, 4), (1, 6)),            # the transpose
        x.as_strided((5, 3), (2, 3), 1),         # overlapping windows, with an offset
        x.t().as_strided((2, 3), (1, 6)),        # through a permuted input's storage
        x.unfold(1, 3, 2),
        F.adaptive_avg_pool2d(nhwc.permute(0, 3, 1, 2), 1),
        nhwc.permute(0, 3, 1, 2).mean((-1, -2), keepdim=True)), x, nhwc)


def test_compiled_parts_of_one_tensor():
    """Parts cut from one tensor by select and slice, as MultiheadAttention's packed projection
    (`proj[0], proj[1], proj[2]`) and hand-written `x[..., :n], x[..., n:]` do (lowered as one
    split whose gradient is one concatenation): values and gradients equal eager torch's, with
    parts left unused, a part used twice, negative indices, parts overlapping (cut one by one), a
    select and a slice of the same dimension, a strided slice beside plain ones, and unbind."""
    proj, y, z = randn(3, 4, 5), randn(4, 6, seed=1), randn(5, 7, seed=2)

    def parts(proj, y, z):
        q, k, v = proj[0], proj[1], proj[2]
        return (q @ k.t() + v.sum(), y[:, -1] * y[:, 0],                  # ends of dim 1, middle unused
                y[..., :2] + y[..., 3:5] * y[..., :2],                      # a gap, a part used twice
                z[:, 0:3] - z[:, 2:5],                                      # overlapping: cut one by one
                z[1] + z[2:4].sum(0), z[:, ::2].sum(1) + z[:, 1:3].sum(1),  # select + slice; strided beside
                *y.unbind(0), *proj.unbind(2))
    check_compiled(parts, proj, y, z)


@examples(6)
@given(size=st.integers(2, 7), data=st.data())
def test_compiled_slices_cutting_one_dimension(size, data):
    """Slices cutting one dimension into parts (some unused, bounds written as Python allows:
    negative, None, past the end), with or without one more slice overlapping them, have eager
    torch's values and gradients."""
    cuts = sorted(data.draw(st.sets(st.integers(0, size), min_size=2, max_size=size + 1)))
    pieces = list(zip(cuts, cuts[1:]))
    used = data.draw(st.lists(st.sampled_from(pieces), min_size=2, max_size=len(pieces) + 1))

    def spelled(bound):
        forms = [bound, bound - size] + ([None] if bound in (0, size) else []) + ([size + 3] if bound == size else [])
        return data.draw(st.sampled_from(forms))
    ranges = [(spelled(a), spelled(b)) for a, b in used]
    if data.draw(st.booleans()):
        ranges.append((data.draw(st.integers(-size, size)), data.draw(st.integers(-size, size))))
    x = randn(3, size)
    check_compiled(lambda x: tuple(x[:, a:b] * (i + 1) for i, (a, b) in enumerate(ranges)), x)


@examples(8)
@given(lead=st.lists(st.integers(1, 4), min_size=1, max_size=3), k=st.integers(1, 6), n=st.integers(1, 5),
       bias=st.booleans(), layout=st.sampled_from(["plain", "permuted", "heads"]))
def test_compiled_linear_on_inputs_of_any_rank_and_layout(lead, k, n, bias, layout):
    """`F.linear` on an input of any rank (its leading dims flattened into rows by decomposition,
    and the weight's transpose contracted directly by the lowering), permuted before the product,
    or made of heads merged into the feature dim (MultiheadAttention's output projection): values
    and the input's, weight's and bias's gradients equal eager torch's."""
    heads = 2 if layout == "heads" else 1
    x = randn(heads, *lead, k) if layout == "heads" else randn(*lead, k)
    w, b = randn(n, k * heads, seed=1), randn(n, seed=2) if bias else None

    def fn(x, w, *b):
        if layout == "permuted" and x.ndim > 2:
            x = x.transpose(0, -2)
        elif layout == "heads":  # (heads, *lead, k) -> (*lead, heads * k)
            x = x.movedim(0, -2).reshape(*lead, heads * k)
        return F.linear(x, w, *b)
    check_compiled(fn, x, w, *([b] if bias else []))


def test_compiled_indexing_and_shapes():
    x, idx = randn(4, 6), torch.tensor([[0, 2, 5], [1, 1, 0], [3, 4, 5], [5, 0, 2]])
    check_compiled(lambda x, i: (x[i[:3, 0]], x[:, 1:5:2], x[..., None], torch.gather(x, 1, i),
                                 x.scatter(1, i[:, :1], 0.0), x.scatter_add(1, i, x[:, :3]), x.index_select(0, i[1]),
                                 x.masked_fill(x > 0.5, -1.0), torch.where(x > 0, x, x * 0.1),
                                 torch.cat([x, x * 2], 1), *x.split(2, 1), *x.chunk(2, 0), torch.stack([x, x]),
                                 x.t().reshape(-1), x.permute(1, 0).contiguous().view(3, -1), x.flip(0),
                                 F.pad(x, (1, 2)), x.unsqueeze(1).expand(4, 3, 6)), x, idx)


def test_compiled_pooling_and_norms():
    x = randn(2, 4, 7, 6)
    check_compiled(lambda x: (F.max_pool2d(x, 3, 2, 1, ceil_mode=True), F.avg_pool2d(x, 3, 2, 1, count_include_pad=False),
                              F.adaptive_avg_pool2d(x, (3, 2)), F.adaptive_avg_pool2d(x, 1), F.group_norm(x, 2),
                              F.instance_norm(x), F.layer_norm(x, (6,)), F.conv2d(x, x[:3, :, :2, :2])), x, rtol=1e-4)


def test_dropout_is_reproducible_scaled_and_off_in_eval():
    module = torch.nn.Dropout(0.25)
    cm = tpudist.compile(module)
    x = torch.ones(200, 50)
    torch.manual_seed(7)
    a = cm(x)
    torch.manual_seed(7)
    b = cm(x)
    c = cm(x)
    torch.testing.assert_close(a, b)  # the per-call key comes from torch's generator
    assert not torch.equal(a, c)
    assert set(a.unique().tolist()) == {0.0, float(np.float32(1 / 0.75))}
    assert abs((a == 0).float().mean().item() - 0.25) < 0.02
    module.eval()
    torch.testing.assert_close(cm(x), x)
    assert cm.stats.compiles == 2


@pytest.mark.parametrize("fn, op, rewrite", [
    (lambda x: torch.unique(x.round()), "aten._unique2", r"one_hot\(x, K\).sum\(0\)"),
])
def test_data_dependent_shapes_are_a_capture_error_naming_the_op_and_the_static_rewrite(fn, op, rewrite):
    cm = tpudist.compile(Fn(fn))
    with pytest.raises(CaptureError,
                       match=rf"{op}\S* in the top-level forward \(Fn\) produces a data-dependent shape.*{rewrite}"):
        cm(randn(5))


@pytest.mark.parametrize("fn", [
    lambda x: x[x > 0] * 2,
    lambda x: torch.masked_select(x, x > 0) * 2,
    lambda x: torch.nonzero(x > 0),
], ids=["mask_index", "masked_select", "nonzero"])
def test_a_length_computed_from_the_inputs_is_specialised_on_it_and_guarded(fn):
    cm = tpudist.compile(Fn(fn))
    x = randn(7)
    torch.testing.assert_close(cm(x), fn(x))
    torch.testing.assert_close(cm(x.flip(0)), fn(x.flip(0)))  # the same count elsewhere: no new capture
    assert cm.stats.recaptures == 0
    y = x.abs()  # another count: captured again, still equal to eager
    torch.testing.assert_close(cm(y), fn(y))
    assert cm.stats.recaptures == 1


def test_masked_select_that_broadcasts_x_against_the_mask_matches_eager():
    # (torch's shape function bounds the length by the mask's numel, not the broadcast's: the
    # guard's check of that bound fails, so each call captures again; the values stay eager's)
    def fn(x):
        return torch.masked_select(x.view(7, 1), x > 0)
    cm = tpudist.compile(Fn(fn))
    x = randn(7)
    for value in (x, x.flip(0), x.abs()):
        torch.testing.assert_close(cm(value), fn(value))


def test_grouped_matmul_of_mixture_of_experts_matches_eager():
    """torch._grouped_mm (F.grouped_mm) as MoE layers call it: rows sorted by expert, offsets the
    cumulative row counts, an expert with no rows.
    bfloat16: torch's shape function (which export runs) takes no other dtype."""
    x, w = randn(9, 8).bfloat16(), randn(3, 8, 8, seed=1).bfloat16()  # (torch: rows of a multiple of 16 bytes)
    offsets = torch.tensor([2, 2, 9], dtype=torch.int32)
    check_compiled(lambda x, w: F.grouped_mm(x, w, offs=offsets), x, w, rtol=2e-2, atol=2e-2)
    check_compiled(lambda a, b: F.grouped_mm(a, b), randn(3, 2, 8).bfloat16(), randn(3, 8, 8, seed=2).bfloat16(),
                   rtol=2e-2, atol=2e-2)


def test_shapes_and_outputs_without_tensors_come_back_as_in_eager():
    got = tpudist.compile(Fn(lambda x: (x.shape, torch.broadcast_shapes(x.shape, (3, 1, 1)), x * 2)))(randn(2))
    assert type(got[0]) is torch.Size and got[0] == (2,) and got[1] == torch.Size([3, 1, 2])
    assert tpudist.compile(Fn(lambda x: torch.broadcast_shapes((5, 1), (5,))))(randn(2)) == torch.Size([5, 5])
