"""ATen -> JAX lowerings, one module per op family; importing this package fills the registry."""

from tpudist.compile._torch.ops import (  # noqa: F401  (imported for their registrations)
    attention,
    collective,
    conv_pool,
    creation,
    fft,
    grouped,
    index,
    linalg,
    linalg_decompositions,
    linalg_solvers,
    norm,
    pointwise,
    random,
    resample,
    reduction,
    scan,
    shape,
    special,
)
