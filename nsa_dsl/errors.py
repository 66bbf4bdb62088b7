"""Errors raised for bad `.nsa` input.

Every error points at a place in the source: file, 1-based line and column, the offending
line with a caret under the column, and a hint where one helps (e.g. "did you mean ...").
`str(err)` is the full located message; the CLI prints exactly that, without a traceback.
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Iterable


class NsaError(Exception):
    """Base class of every error nsa_dsl raises about a pattern or its source."""

    def __init__(
        self,
        message: str,
        *,
        file: str = "<string>",
        line: int | None = None,
        column: int | None = None,
        source_line: str | None = None,
        hint: str | None = None,
    ) -> None:
        self.message = message
        self.file = file
        self.line = line
        self.column = column
        self.source_line = source_line
        self.hint = hint
        super().__init__(self._format())

    def __reduce__(self):
        # Pickled (process pools, multiprocessing) by its fields: rebuilt from its formatted text, the
        # copy's text gained a second "<string>: NsaSyntaxError:" prefix.
        fields = {name: getattr(self, name) for name in ("file", "line", "column", "source_line", "hint")}
        return functools.partial(type(self), **fields), (self.message,)

    def _format(self) -> str:
        where = self.file if self.line is None else f"{self.file}:{self.line}:{self.column}"
        text = f"{where}: {type(self).__name__}: {self.message}"
        if self.source_line is not None and self.column is not None:
            # The line is echoed as written, tabs included; indenting the caret with the same tabs
            # keeps it under the column whatever a terminal's tab width.
            before = self.source_line[: self.column - 1]
            indent = "".join(c if c == "\t" else " " for c in before).ljust(self.column - 1)
            text += f"\n    {self.source_line}\n    {indent}^"
        if self.hint:
            text += f"\n  hint: {self.hint}"
        return text


class NsaSyntaxError(NsaError):
    """The text is not a sentence of the `.nsa` language."""


class NsaSemanticError(NsaError):
    """The text parses but means nothing valid (unknown names, bad sizes, cycles, ...)."""


def did_you_mean(name: str, candidates: Iterable[str]) -> str | None:
    """A hint naming the closest candidate to `name`, or None if nothing is close."""
    close = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return f"did you mean '{close[0]}'?" if close else None
