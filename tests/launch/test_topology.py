"""Golden values for TPU slice types, written from published facts, not from the implementation.

Each row names where its numbers come from:

- [torch_xla] torch_xla/_internal/tpu.py `_ACCELERATOR_TYPE_TO_HOST_BOUNDS` (v2/v3 host bounds;
  2,2,1 chips per host) and test/pjrt/test_experimental_tpu.py (v4-8: 1,1,1 x 2,2,1; v4-16:
  1,1,2 x 2,2,1);
- [issue] the facts quoted in issue 4 (v4-32: 1,1,4; v4-64: 1,2,4; v3-128: 4,4,1; v6e-32:
  2,4,1; v5litepod-8 and v6e-8 are one worker with bounds 2,4,1);
- [tpu-env] a real v4-256 TPU VM's `tpu-env` (HOST_BOUNDS '2,2,8', CHIPS_PER_HOST_BOUNDS '2,2,1',
  TOPOLOGY '4x4x8');
- [docs] Cloud TPU docs per generation: the topology, chip count and host count of each type
  (v5e/v6e tables: 1x1 = 1 chip, 2x2 = 4, 2x4 = 8 on one host; 4x4 = 16 chips on 4 VMs ...);
  v5p/7x sizes from the v5p page and xpk's system_characteristics (4 chips per VM, tpu7x-<cores>).
"""

from __future__ import annotations

import pytest

from tpudist.launch.tpu.topology import (GENERATIONS, bounds_str, from_bounds, parse_bounds,
                                         slice_topology)

# type, chips, TensorCores/chip, workers, chips/worker, chips-per-host bounds, host bounds, topology
GOLDEN = [
    ("v2-8", 4, 2, 1, 4, (2, 2, 1), (1, 1, 1), "2x2"),  # [torch_xla] 1,1,1
    ("v2-32", 16, 2, 4, 4, (2, 2, 1), (2, 2, 1), "4x4"),  # [torch_xla] 2,2,1
    ("v2-512", 256, 2, 64, 4, (2, 2, 1), (8, 8, 1), "16x16"),  # [torch_xla] 8,8,1
    ("v3-8", 4, 2, 1, 4, (2, 2, 1), (1, 1, 1), "2x2"),  # [torch_xla] 1,1,1
    ("v3-64", 32, 2, 8, 4, (2, 2, 1), (2, 4, 1), "4x8"),  # [torch_xla] 2,4,1
    ("v3-128", 64, 2, 16, 4, (2, 2, 1), (4, 4, 1), "8x8"),  # [issue], [torch_xla] 4,4,1
    ("v3-2048", 1024, 2, 256, 4, (2, 2, 1), (16, 16, 1), "32x32"),  # [torch_xla] 16,16,1
    ("v4-8", 4, 2, 1, 4, (2, 2, 1), (1, 1, 1), "2x2x1"),  # [torch_xla test]
    ("v4-16", 8, 2, 2, 4, (2, 2, 1), (1, 1, 2), "2x2x2"),  # [torch_xla test]
    ("v4-32", 16, 2, 4, 4, (2, 2, 1), (1, 1, 4), "2x2x4"),  # [issue]
    ("v4-64", 32, 2, 8, 4, (2, 2, 1), (1, 2, 4), "2x4x4"),  # [issue]
    ("v4-256", 128, 2, 32, 4, (2, 2, 1), (2, 2, 8), "4x4x8"),  # [tpu-env]
    ("v4-4096", 2048, 2, 512, 4, (2, 2, 1), (4, 8, 16), "8x16x16"),  # [docs] largest v4 type
    ("v5litepod-1", 1, 1, 1, 1, (1, 1, 1), (1, 1, 1), "1x1"),  # [docs]
    ("v5litepod-4", 4, 1, 1, 4, (2, 2, 1), (1, 1, 1), "2x2"),  # [docs]
    ("v5litepod-8", 8, 1, 1, 8, (2, 4, 1), (1, 1, 1), "2x4"),  # [issue]
    ("v5litepod-16", 16, 1, 4, 4, (2, 2, 1), (2, 2, 1), "4x4"),  # [docs]
    ("v5litepod-256", 256, 1, 64, 4, (2, 2, 1), (8, 8, 1), "16x16"),  # [docs] full v5e pod
    ("v5p-8", 4, 2, 1, 4, (2, 2, 1), (1, 1, 1), "2x2x1"),  # [docs]
    ("v5p-128", 64, 2, 16, 4, (2, 2, 1), (2, 2, 4), "4x4x4"),  # [docs]
    ("v5p-384", 192, 2, 48, 4, (2, 2, 1), (2, 2, 12), "4x4x12"),  # [docs]
    ("v5p-17920", 8960, 2, 2240, 4, (2, 2, 1), (8, 10, 28), "16x20x28"),  # [docs] full v5p pod
    ("v6e-1", 1, 1, 1, 1, (1, 1, 1), (1, 1, 1), "1x1"),  # [docs]
    ("v6e-8", 8, 1, 1, 8, (2, 4, 1), (1, 1, 1), "2x4"),  # [issue]
    ("v6e-16", 16, 1, 4, 4, (2, 2, 1), (2, 2, 1), "4x4"),  # [docs]
    ("v6e-32", 32, 1, 8, 4, (2, 2, 1), (2, 4, 1), "4x8"),  # [issue]
    ("v6e-256", 256, 1, 64, 4, (2, 2, 1), (8, 8, 1), "16x16"),  # [docs] full v6e pod
    ("tpu7x-2", 1, 2, 1, 1, (1, 1, 1), (1, 1, 1), "1x1x1"),  # [docs] one-chip VM
    ("tpu7x-8", 4, 2, 1, 4, (2, 2, 1), (1, 1, 1), "2x2x1"),  # [docs]
    ("tpu7x-128", 64, 2, 16, 4, (2, 2, 1), (2, 2, 4), "4x4x4"),  # [docs]
    ("tpu7x-18432", 9216, 2, 2304, 4, (2, 2, 1), (8, 12, 24), "16x24x24"),  # [docs] full pod
]


@pytest.mark.parametrize("row", GOLDEN, ids=[r[0] for r in GOLDEN])
def test_golden_slice_types(row):
    name, chips, cores, workers, per_worker, chip_bounds, host_bounds, topology = row
    t = slice_topology(name)
    assert (t.chips, t.tensorcores_per_chip, t.workers, t.chips_per_worker) == \
        (chips, cores, workers, per_worker)
    assert t.chips_per_host_bounds == chip_bounds
    assert t.host_bounds == host_bounds
    assert t.topology == topology
    assert t.accelerator_type == name


def test_golden_table_covers_every_generation_and_enough_types():
    assert len(GOLDEN) >= 18
    prefixes = {r[0].rsplit("-", 1)[0] for r in GOLDEN}
    assert prefixes == {g.prefix for g in GENERATIONS}


def test_the_number_counts_tensorcores_or_chips_as_published():
    # v4-32 is 16 chips (2 TensorCores each); v5litepod-16 and v6e-16 are 16 chips (1 each).
    assert slice_topology("v4-32").chips == 16 and slice_topology("v4-32").tensorcores == 32
    assert slice_topology("v5p-32").chips == 16
    assert slice_topology("v5litepod-16").chips == 16 and slice_topology("v6e-16").tensorcores == 16


@pytest.mark.parametrize("bad", ["v9-8", "v5e-16", "v4", "tpu", "", "v4-32x", "v6e-eight"])
def test_unknown_types_are_refused_with_the_valid_forms(bad):
    with pytest.raises(ValueError) as err:
        slice_topology(bad)
    message = str(err.value)
    assert "valid forms" in message
    for form in ("v2-N", "v3-N", "v4-N", "v5litepod-N", "v5p-N", "v6e-N", "tpu7x-N"):
        assert form in message


def test_a_v5e_spelling_gets_a_hint():
    with pytest.raises(ValueError, match="spell it v5litepod-16"):
        slice_topology("v5e-16")


@pytest.mark.parametrize("impossible", ["v4-33", "v4-12", "v5litepod-3", "v3-16", "v6e-1000"])
def test_impossible_sizes_are_refused(impossible):
    with pytest.raises(ValueError, match="no documented default topology"):
        slice_topology(impossible)


def test_a_reported_topology_wins_over_the_default():
    # A non-default v4 shape: 4x4x12 = 192 chips = v4-384 (not in the default table).
    t = slice_topology("v4-384", "4x4x12")
    assert (t.chips, t.workers, t.host_bounds) == (192, 48, (2, 2, 12))
    # Same chip count as the default 2x4x4 for v4-64, other shape.
    t = slice_topology("v4-64", "4x4x2")
    assert t.host_bounds == (2, 2, 2) and t.topology == "4x4x2"


@pytest.mark.parametrize("accelerator_type, topology, message", [
    ("v4-32", "2x2x2", "has 8 chips = 16 TensorCores, but v4-32 has 32"),
    ("v5litepod-16", "2x2x4", "must have 2 axes"),
    ("v4-16", "2x2", "must have 3 axes"),
    ("v4-24", "3x2x2", "does not split into workers"),
    ("v4-32", "2by2by4", "must look like"),
])
def test_a_topology_that_cannot_be_that_type_is_refused(accelerator_type, topology, message):
    with pytest.raises(ValueError, match=message):
        slice_topology(accelerator_type, topology)


def test_bounds_from_metadata_for_a_type_the_table_does_not_know():
    t = from_bounds("v9-64", "2,2,1", "2,2,2")
    assert (t.chips, t.workers, t.chips_per_worker, t.topology) == (32, 8, 4, "4x4x2")
    assert t.generation == "unknown"


def test_bounds_parse_and_print():
    assert parse_bounds("2,2,1") == (2, 2, 1) and bounds_str((1, 1, 4)) == "1,1,4"
    for bad in ("2,2", "2,2,0", "a,b,c", "2,2,1,1"):
        with pytest.raises(ValueError, match="three positive integers"):
            parse_bounds(bad, "HOST_BOUNDS")


@pytest.mark.parametrize("generation", GENERATIONS, ids=[g.name for g in GENERATIONS])
def test_every_listed_size_is_consistent(generation):
    # Workers times chips per worker is the slice; host bounds times chip bounds is the topology.
    for topology in generation.default_topologies:
        axes = [int(a) for a in topology.split("x")]
        chips = 1
        for a in axes:
            chips *= a
        t = slice_topology(f"{generation.prefix}-{generation.type_number(chips)}")
        assert t.topology == topology and t.chips == chips
        assert t.workers * t.chips_per_worker == chips
        padded = (axes + [1])[:3]
        assert [h * c for h, c in zip(t.host_bounds, t.chips_per_host_bounds)] == padded
        assert t.chips_per_worker in (1, 4, 8)
