"""The errors einshard raises: :class:`EinshardError` (a ``ValueError``) and :class:`EinshardWarning`."""

from ._src.errors import EinshardError, EinshardWarning

__all__ = ["EinshardError", "EinshardWarning"]
