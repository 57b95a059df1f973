"""The boundary checks of the analysis' values (profiles, dtype names), registered by parameter name in
:data:`einshard._checks.RULES`."""

from __future__ import annotations

from typing import Any

from .._checks import RULES, argument_error
from ..errors import EinshardError


def _profile_rule(value: Any, where: str, name: str, arguments: dict[str, Any]) -> Any:
    from .cost import get_profile

    if value is not None and not isinstance(value, str) and type(value).__name__ != "Profile":
        raise argument_error(where, name, "an einshard.Profile or a preset name ('cpu', 'h100', 'tpu-v5p')", value)
    try:
        return get_profile(value)
    except EinshardError as err:
        raise EinshardError(f"{where}: {name}= {err.reason}", hint=err.hint) from None


def _dtype_name_rule(value: Any, where: str, name: str, arguments: dict[str, Any]) -> Any:
    from .einsum.read import dtype_info

    try:
        dtype_info(value)
    except EinshardError as err:
        raise EinshardError(f"{where}: {name}= {err.reason}", hint=err.hint) from None
    return value


RULES.update(profile=_profile_rule)
DTYPE_NAME = _dtype_name_rule
