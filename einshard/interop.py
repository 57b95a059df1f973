"""Rules from other libraries and back: Flax NNX, Keras, logical-axis tables (MaxText)."""

from ._src.interop import (
    ImportedRules,
    Leaf,
    LeafMatch,
    LogicalLayout,
    from_keras,
    from_logical,
    from_maxtext,
    from_nnx,
    keras_params,
    nnx_names,
    to_keras,
    to_logical,
)

__all__ = [
    "ImportedRules",
    "Leaf",
    "LeafMatch",
    "from_keras",
    "to_keras",
    "keras_params",
    "from_nnx",
    "nnx_names",
    "from_logical",
    "from_maxtext",
    "to_logical",
    "LogicalLayout",
]
