"""einshard's internals.  Nothing here is API: import from ``einshard`` and its public modules (docs/architecture.md).

Every module under ``_src`` may change or move without notice; the public faces (``einshard.analysis``,
``einshard.placement``, ...) re-export what users may rely on.
"""
