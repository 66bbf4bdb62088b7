"""Rendering kernel templates.

Templates hold kernel text; Python decides what goes in. Only validated numbers and
identifiers can reach generated source: the environment's `finalize` hook rejects any other
value at every `{{ ... }}`, so a hostile name or parameter cannot inject code even if it got
past the language's checks. The one structured value rendered, the plan itself, goes in as
a Python literal built here from those same validated atoms (`plan_literal`).
"""

from __future__ import annotations

import dataclasses
import functools
import keyword
import math
import re

import jinja2

from ..dsl import model
from ..plan import plan as plan_module
from ..resources import templates_dir

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


class Code(str):
    """Source text produced by this module from validated values; rendered verbatim."""


class UnsafeTemplateValue(TypeError):
    """A value that is neither a number nor an identifier was about to enter generated code."""


def is_identifier(text: str) -> bool:
    return bool(_IDENTIFIER.match(text)) and not keyword.iskeyword(text)


def _safe(value: object) -> str:
    if isinstance(value, jinja2.Undefined):
        str(value)  # StrictUndefined raises UndefinedError naming the missing variable
    if isinstance(value, Code):
        return str(value)
    if isinstance(value, bool):
        return repr(value)
    if isinstance(value, int):
        return repr(int(value))
    if isinstance(value, float):
        if not math.isfinite(value):
            raise UnsafeTemplateValue(f"non-finite float {value!r} cannot be rendered")
        return repr(float(value))
    if isinstance(value, str) and is_identifier(value):
        return value
    raise UnsafeTemplateValue(f"refusing to render {value!r} ({type(value).__name__}) into generated code")


_MODULE_ALIAS = {model.__name__: "model", plan_module.__name__: "plan"}


def plan_literal(value: object) -> Code:
    """A Python expression that rebuilds `value` (a plan or part of one) in generated code,
    given `from nsa_dsl.dsl import model` and `from nsa_dsl.plan import plan`."""
    if value is None or isinstance(value, (bool, int, float)):
        return Code(_safe(value) if value is not None else "None")
    if isinstance(value, str):
        if not is_identifier(value):
            raise UnsafeTemplateValue(f"refusing to render {value!r} into generated code")
        return Code(repr(value))
    if isinstance(value, tuple):
        items = [plan_literal(v) for v in value]
        return Code("(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")")
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        cls = type(value)
        alias = _MODULE_ALIAS.get(cls.__module__)
        if alias is None:
            raise UnsafeTemplateValue(f"{cls.__qualname__} is not part of a plan")
        fields = ", ".join(f"{f.name}={plan_literal(getattr(value, f.name))}" for f in dataclasses.fields(value))
        return Code(f"{alias}.{cls.__name__}({fields})")
    raise UnsafeTemplateValue(f"refusing to render {value!r} ({type(value).__name__}) into generated code")


@functools.lru_cache(maxsize=None)
def environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates_dir())),
        undefined=jinja2.StrictUndefined,
        finalize=_safe,
        autoescape=False,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["literal"] = plan_literal
    return env


def render(template: str, **context: object) -> str:
    """Render `templates/<template>` (e.g. "xla/module.py.j2") with `context`."""
    return environment().get_template(template).render(**context)


def template_texts(backend: str) -> str:
    """Template text a backend's modules are rendered from, for cache keys: editing a template
    invalidates entries. Backends import each other's macros (triton renders token masks with
    xla/mask.j2), so every backend's key covers every template; `backend` names the entry."""
    root = templates_dir()
    return backend + "".join(f"\n{p.relative_to(root)}\n{p.read_text()}" for p in sorted(root.rglob("*.j2")))
