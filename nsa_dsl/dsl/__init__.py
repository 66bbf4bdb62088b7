"""The `.nsa` language: parse (text -> `ast`), check (`ast` -> `model`), and load (both).

    parse(text, file=...)                       syntax tree only; NsaSyntaxError on bad syntax
    load(source, overrides=..., file=...)       every pattern of a file or text, checked
    load_pattern(source, name=..., overrides=...)  one pattern, checked

`source` is a path (a PathLike, or a one-line str ending in ".nsa") or `.nsa` text.
`overrides` replace param values before evaluation: ints, floats, bools, or their text as
given to `nsa-compile -D name=value` ("1024", "0.5", "true").
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from . import ast, model
from .check import check, check_pattern
from .parser import parse, read


def load(
    source: str | os.PathLike, *, overrides: Mapping[str, object] | None = None, file: str | None = None
) -> tuple[model.Pattern, ...]:
    """Every pattern in `source`, checked, in file order."""
    return check(read(source, file=file), overrides)


def load_pattern(
    source: str | os.PathLike, *, name: str | None = None, overrides: Mapping[str, object] | None = None
) -> model.Pattern:
    """The pattern `name` of `source`, checked; `name` may be omitted when there is only one."""
    return check_pattern(read(source), name=name, overrides=overrides)


__all__ = ["ast", "check", "check_pattern", "load", "load_pattern", "model", "parse", "read"]
