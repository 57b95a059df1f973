"""The ecosystem's layout languages: read Keras, Flax NNX and MaxText rule sets into einshard path rules for a
pytree, and write einshard rules (a :class:`~einshard.LayoutPlan`'s) back in each of them.

* :func:`from_keras` — a Keras 3 ``LayoutMap`` (regex -> tuple of mesh axes), with Keras's matching rule;
  :func:`to_keras` writes one, :func:`keras_params` names a model's variables as Keras does.
* :func:`from_nnx` — Flax NNX variables' ``nnx.with_partitioning`` metadata with a logical rule list.
* :func:`from_maxtext` / :func:`from_logical` — a logical rule list and per-variable logical names as data;
  :func:`to_logical` writes both (``.flax_rules()``, ``.maxtext()``).

Every reader returns an :class:`ImportedRules`: ``rules`` for ``einshard.einshard(params, rules, mesh=...)``,
and per leaf the foreign rule that laid it out, or None where none did (the leaf is replicated):
``einshard.audit`` reports those.  Logical names are resolved by einshard's one resolver
(:mod:`einshard.core.logical`).  See docs/logical-axes.md.
"""

from ._leaves import ImportedRules, Leaf, LeafMatch
from .flax import from_nnx, nnx_names
from .keras import from_keras, keras_params, to_keras
from .logical import LogicalLayout, from_logical, from_maxtext, to_logical

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
