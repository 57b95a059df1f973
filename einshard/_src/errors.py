"""The one error type einshard raises for bad input."""

from __future__ import annotations

__all__ = ["EinshardError", "EinshardWarning"]


class EinshardError(ValueError):
    """Bad einshard input: a malformed expression, or one that does not fit the array or mesh.

    The message quotes the expression with a caret under the offending column
    when there is one, names the axes and sizes involved, and says how to fix it.

    Attributes:
        reason: the one-line reason, without the quoted expression.
        expression: the expression text, if the error is about one.
        column: 0-based column in ``expression`` the error points at, or None.

    Example:
        >>> import einshard
        >>> try:
        ...     einshard.spec("a b -> a c")
        ... except einshard.EinshardError as e:
        ...     print(e)
        axis 'c' on the right is not an axis of the array (the left side names: 'a', 'b')
            a b -> a c
                     ^
    """

    def __init__(
        self,
        reason: str,
        expression: str | None = None,
        column: int | None = None,
        hint: str | None = None,
    ) -> None:
        self.reason = reason
        self.expression = expression
        self.column = column
        self.hint = hint
        super().__init__(self._format())

    def _format(self) -> str:
        lines = [self.reason]
        if self.expression is not None:
            # Every whitespace character (newline, tab, form feed, ...) shows as one space,
            # so the caret line stays aligned with the quoted expression.
            text = "".join(" " if c.isspace() else c for c in self.expression)
            lines.append(f"    {text}")
            if self.column is not None:
                lines.append("    " + " " * self.column + "^")
        if self.hint:
            lines.append(self.hint)
        return "\n".join(lines)


class EinshardWarning(UserWarning):
    """Input einshard accepts but that probably does not do what was meant: an einsum's annotations that differ
    from its operands' own layouts, a rule set that matches no leaf or leaves a large one replicated.

    Turn it into an error with ``warnings.simplefilter("error", einshard.errors.EinshardWarning)``.
    """
