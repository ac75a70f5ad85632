"""Indexing, scatter / segment reductions, cumulative ops, sorting and searching, histograms:
through `tpudist.compile` against eager torch, values and gradients, on the cases torch's OpInfo
samples do not reach (ties, NaN, -0.0, zeros in products, duplicate indices, empty segments,
0-d tensors) and on a mixture-of-experts routing step."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tpudist
from tpudist.compile import CaptureError, UnsupportedOpError

from compiled_check import Fn, check_compiled

# torch.export's own deprecation noise, not ours
pytestmark = [pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning"),
              # torch's own notes on the eager calls (beta API, deprecated reduce=, a non-contiguous view)
              pytest.mark.filterwarnings("ignore:index_reduce\\(\\) is in beta:UserWarning"),
              pytest.mark.filterwarnings("ignore:The reduce argument of torch.scatter:UserWarning"),
              pytest.mark.filterwarnings("ignore:torch.searchsorted\\(\\).*non-contiguous:UserWarning")]

NAN, INF = float("nan"), float("inf")


def test_sorting_ties_nan_signed_zero_and_order_statistics():
    ties = torch.tensor([[2., 0., -0., 1., 2., NAN, 0., 1., -0., NAN, 2., 0., 1., 1., 0., 2., -1., NAN, 0., 2.],
                         [3., 3., 1., 1., 2., 2., 0., 0., -1., -1., 3., 1., 2., 0., -1., 3., 1., 2., 0., -1.]])
    ints = torch.tensor([[3, -2147483648, 3, 0, 7, 0, -1, 3, 2147483647, 0, 3, 1, 1, 3, 0, 5, 3, 3]], dtype=torch.int32)
    small = torch.tensor([[4., 1., 4., 2., 1., 4., 3.], [5., 5., 5., 5., 1., 2., 5.]])  # mode's CPU kernel is exact
    distinct = torch.randn(3, 9, generator=torch.Generator().manual_seed(1))
    unsigned = torch.tensor([3, 0, 255, 3, 7, 0], dtype=torch.uint8)

    def fn(ties, distinct, small, ints, unsigned):
        return (torch.sort(ties, stable=True), torch.sort(ties, descending=True, stable=True),
                torch.sort(ints, stable=True), torch.sort(ints, descending=True, stable=True),
                torch.sort(unsigned, descending=True, stable=True), torch.argsort(ties, dim=1, stable=True),
                torch.topk(distinct, 3), torch.topk(distinct, 2, dim=0, largest=False),
                torch.kthvalue(distinct, 4, dim=1), torch.median(ties, dim=1), torch.median(ties[1], dim=0),
                torch.nanmedian(ties, dim=1, keepdim=True), torch.median(ties[1]), torch.nanmedian(ties),
                torch.median(ints, dim=1), torch.mode(small, dim=1), torch.mode(ties[1, :12], dim=0),
                ties.max(dim=1), ties.argmin(dim=1), distinct.argmax(), torch.tensor(2.5).max(dim=0),
                torch.sort(torch.tensor(1.5)), torch.kthvalue(torch.tensor(1.5), 1))
    check_compiled(fn, ties, distinct, small, ints, unsigned)


def test_topk_nan_and_ties_by_value():
    # which of several equal values topk returns is not specified by torch (CPU kernels differ by
    # size); values must agree, indices must point at them, NaN ranks above everything
    x = torch.tensor([[1., NAN, 3., 3., -0., 0., INF, -INF, 3., 2.]])
    values, index = tpudist.compile(Fn(lambda x: torch.topk(x, 5)))(x)
    torch.testing.assert_close(values, torch.topk(x, 5).values, equal_nan=True)
    torch.testing.assert_close(x.gather(1, index), values, equal_nan=True)
    values, index = tpudist.compile(Fn(lambda x: torch.topk(x, 4, largest=False)))(x)
    torch.testing.assert_close(values, torch.topk(x, 4, largest=False).values)
    assert index.tolist() == [[7, 4, 5, 0]]


def test_cumulative_ops_ties_nan_and_infinities():
    x = torch.tensor([[1., 3., 3., NAN, 2., NAN, 5., 0.], [2., -1., 2., -1., 4., 4., -2., 4.]])
    finite = torch.tensor([[1., 3., 3., 0.5, 2., 3., 5., 0.], [2., -1., 2., -1., 4., 4., -2., 4.]])
    extremes = torch.tensor([[-INF, -INF, 1., 2.], [0.5, INF, 1., INF]])

    def fn(x, finite, extremes):
        return (torch.cummax(x, 1), torch.cummin(x, 1), torch.cummax(finite, 0), torch.cummin(finite, 1),
                torch.logcumsumexp(finite, 1), torch.logcumsumexp(extremes, 1), torch.cumsum(finite, 1),
                torch.cumprod(finite, 1), torch.cumsum(x[0, 0], 0), torch.cummax(x[0, 0], 0),
                torch.cumsum(finite.bfloat16(), 1), torch.cumsum(finite.int(), 1))
    check_compiled(fn, x, finite, extremes)


def test_searching_and_histograms():
    boundaries = torch.tensor([-2., -1., 0., 0., 1.5, 3., NAN])
    values = torch.tensor([[-3., -1., 0., 0.7, NAN], [1.5, 3., 4., -2., 0.]])
    rows = torch.tensor([[0., 1., 2., 3.], [-1., 0., 0., 5.]])
    data = torch.tensor([0.1, 0.5, 0.5, 0.99, -1., 3., 1., 0., 2.5, NAN, 0.75, 0.25])
    weights = torch.linspace(0.5, 2.0, 12)
    points = torch.randn(20, 2, generator=torch.Generator().manual_seed(2))

    def fn(boundaries, values, rows, data, weights, points):
        data, weights, points = data.detach(), weights.detach(), points.detach()  # torch: no gradient
        clean = data.nan_to_num(0.0)
        return (torch.searchsorted(boundaries, values), torch.searchsorted(boundaries, values, right=True),
                torch.searchsorted(rows, values[:, :4], side="right"),
                torch.searchsorted(boundaries, values, sorter=torch.argsort(boundaries), out_int32=True),
                torch.bucketize(values, boundaries[:6]), torch.bucketize(values, boundaries[:6], right=True),
                torch.isin(values, boundaries), torch.histc(data, bins=4, min=0, max=1),
                torch.histc(clean, bins=5), torch.histc(clean.bfloat16(), bins=3, min=-1, max=3),
                torch.histogram(clean, bins=4), torch.histogram(clean, bins=3, range=(0., 1.), weight=weights,
                                                                density=True),
                torch.histogram(clean, bins=torch.tensor([-1., 0., 0.5, 3.])),
                torch.histogramdd(points, bins=[3, 4]))
    check_compiled(fn, boundaries, values, rows, data, weights, points)


def test_scatter_and_index_reductions_ties_zeros_and_duplicates():
    # duplicates, ties with self and among sources, one and several zeros per position
    x = torch.tensor([[1., 2., 0., 4.], [3., 3., 5., -1.], [0., 6., 2., 2.]])
    index = torch.tensor([[0, 0, 2, 2], [2, 0, 2, 1], [0, 1, 1, 2]])
    src = torch.tensor([[1., 2., 0., 4.], [3., 2., 5., 0.], [1., 0., 0., 2.]])
    rows = torch.tensor([0, 2, 0])

    def fn(x, src):
        out = []
        for reduce in ("sum", "prod", "mean", "amax", "amin"):
            for include_self in (True, False):
                out.append(x.scatter_reduce(0, index, src, reduce, include_self=include_self))
                if reduce != "sum":
                    out.append(x.index_reduce(0, rows, src, reduce, include_self=include_self))
        out.append(x.int().scatter_reduce(1, index, src.int(), "mean"))
        out.append(x.index_add(0, rows, src, alpha=2.0))
        out.append(x.scatter(1, index, src))  # duplicate targets: every source gets its gradient
        out.append(x.scatter_add(0, index, src))
        out.append(x.scatter(0, index, 2.0, reduce="multiply").detach())
        out.append(x.detach().scatter(1, index, src.detach(), reduce="add"))
        return out
    check_compiled(fn, x, src)


def test_index_put_masks_duplicates_and_writes():
    x = torch.arange(20.).reshape(4, 5)
    mask = torch.tensor([True, False, True, True])
    mask2d = x.remainder(3) == 0
    rows = torch.tensor([2, 0, 2])
    values = torch.tensor([[9., 8., 7., 6., 5.], [1., 2., 3., 4., 5.], [0., -1., -2., -3., -4.]])
    v = torch.tensor(7.5)

    def fn(x, values, v):
        a = x.clone(); a[mask] = v                      # one value for every selected row
        b = x.clone(); b[mask] = values                 # one row per selected row, in order
        c = torch.ops.aten.index_put(x, [None, mask2d[0]], v, True)
        d = x.clone(); d[mask2d] = -v
        e = x.clone(); e[rows] = values                 # duplicate rows: the last write lands
        f = x.index_put((rows, torch.tensor([1, 1, 4])), values[0, :3], accumulate=True)
        g = torch.put(x, torch.tensor([3, -1, 3]), values[1, :3], accumulate=True)
        h = torch.put(x, torch.tensor([3, -1, 0]), values[1, :3])
        i = x.masked_scatter(mask2d, values)
        j = torch.diagonal_scatter(x, values[0, :4], 1)
        k = x.clone(); k.as_strided((2, 2), (5, 2), 1).copy_(values[:2, :2])
        return a, b, c, d, e, f, g, h, i, j, k, torch.nonzero_static(mask2d, size=9)
    check_compiled(fn, x, values, v)


def test_rows_written_behind_dims_of_size_one():
    # a KV cache's write (index_copy_ along the sequence of a batch-1 cache), which the lowering
    # writes with the size-1 dims dropped: values and gradients as eager's, duplicates, a negative
    # index, broadcast values and size-1 dims between whole ones
    cache = torch.randn(1, 3, 6, 4, generator=torch.Generator().manual_seed(0))
    mixed = torch.randn(2, 1, 3, 6, 4, generator=torch.Generator().manual_seed(1))
    rows = torch.randn(1, 3, 2, 4, generator=torch.Generator().manual_seed(2))

    def fn(cache, mixed, rows):
        a = cache.clone(); a.index_copy_(2, torch.tensor([4, 1]), rows)
        b = torch.ops.aten.index_put(cache, [None, None, torch.tensor([5, 5])], rows)  # the last write lands
        c = torch.ops.aten.index_put(cache, [None, None, torch.tensor([-1])], rows[:, :, :1, :1])  # broadcast
        d = torch.ops.aten.index_put(mixed, [None, None, None, torch.tensor([0, 3])], rows[None] * 2)
        e = torch.ops.aten.index_put(cache, [None, None, torch.tensor([2, 2])], rows, accumulate=True)
        return a * cache, b, c, d.sum(1), e
    check_compiled(fn, cache, mixed, rows)


def test_segment_reduce_lengths_offsets_initial_and_ties():
    data = torch.tensor([[1., 3., 3., 0., 2., -1., 0., 0., 4., NAN],
                         [2., 2., 5., 1., 0., 3., 3., 3., 1., 2.]]).t().contiguous()  # (10, 2)
    lengths = torch.tensor([3, 0, 2, 3, 2])
    per_row = torch.tensor([[2, 0, 3], [1, 4, 0]])

    def fn(data):
        out = []
        for reduce in ("sum", "mean", "max", "min", "prod"):
            out.append(torch.segment_reduce(data, reduce, lengths=lengths))
            out.append(torch.segment_reduce(data, reduce, lengths=lengths, initial=2.0))
            out.append(torch.segment_reduce(data[:5].t(), reduce, lengths=per_row, axis=1))
        out.append(torch.segment_reduce(data, "max", offsets=torch.tensor([0, 3, 3, 5, 8, 10])))
        return out
    check_compiled(fn, data)


def test_moe_routing_step():
    # Mixtral / Qwen-MoE style routing over tokens x experts: softmax router, top-k experts, their
    # one-hot mask, per-expert capacity slots by cumsum, expert outputs gathered back by index_add
    tokens, experts, k, dim = 12, 4, 2, 6
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(tokens, dim, generator=gen)
    router = torch.randn(dim, experts, generator=gen)
    expert_w = torch.randn(experts, dim, dim, generator=gen) / dim

    def fn(hidden, router, expert_w):
        probs = torch.softmax(hidden @ router, dim=-1)
        weights, chosen = torch.topk(probs, k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        mask = F.one_hot(chosen, experts)                                  # tokens, k, experts
        slot = torch.cumsum(mask.reshape(-1, experts), dim=0).reshape(mask.shape) * mask
        load = torch.histc(chosen.float(), bins=experts, min=0, max=experts - 1)
        out = torch.zeros_like(hidden)
        for e in range(experts):
            hit = (chosen == e).float() * weights                         # tokens, k
            gate = hit.sum(dim=-1, keepdim=True)
            routed = torch.where(gate > 0, hidden @ expert_w[e], torch.zeros_like(hidden)) * gate
            out = out.index_add(0, torch.arange(tokens), routed)
        top = torch.zeros(tokens, experts).scatter_reduce(1, chosen, weights, "amax", include_self=False)
        return out, slot, load, top, probs.argmax(-1)
    check_compiled(fn, hidden, router, expert_w, rtol=1e-4, atol=1e-5)


def test_errors_name_the_static_rewrite():
    x = torch.arange(12.).reshape(3, 4)
    with pytest.raises(UnsupportedOpError, match="boolean mask together with other index"):
        tpudist.compile(Fn(lambda x: x.index_put((torch.tensor([True, False, True]), torch.tensor([0, 1])),
                                                 torch.tensor(1.))))(x)
    with pytest.raises((UnsupportedOpError, CaptureError), match="bincount"):
        # its length, max(ids) + 1, depends on the values: F.one_hot(ids, n).sum(0) is the static form
        tpudist.compile(Fn(lambda i: torch.bincount(i, minlength=4)))(torch.tensor([0, 2, 2]))
    y = x.clone().requires_grad_()
    out = tpudist.compile(Fn(lambda y: y.scatter(0, torch.tensor([[0, 1]]), 2.0, reduce="multiply")))(y)
    with pytest.raises(UnsupportedOpError, match="has no gradient"):
        out.sum().backward()
