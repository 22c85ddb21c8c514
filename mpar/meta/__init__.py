"""Building models larger than one host: meta construction, layout-independent
initialisation, and which part of each tensor a rank stores.

* :func:`materialize` allocates and initialises a meta-built model in one process;
  :class:`RankMaterializer` does it for one rank's stages (``DistributedModel``
  uses it when it is given a meta model or a factory).
* :mod:`mpar.meta._owned` says which elements of each tensor this rank stores
  (``load_pretrained`` and ``save_pretrained`` read and write exactly those).
"""

from mpar.meta._init import InitError, InitFn, stable_seed
from mpar.meta._materialize import (
    RankMaterializer,
    build_module,
    find_units_meta,
    has_meta,
    materialize,
    renew_tensors,
    start_materialize,
    tensor_shapes,
)

__all__ = [
    "InitError",
    "InitFn",
    "RankMaterializer",
    "build_module",
    "start_materialize",
    "find_units_meta",
    "has_meta",
    "materialize",
    "renew_tensors",
    "stable_seed",
    "tensor_shapes",
]
