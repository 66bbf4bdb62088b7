"""Rendering kernel templates.

Templates hold kernel text; Python decides what goes in. Only validated numbers and
identifiers can reach generated source: the environment's `finalize` hook rejects any other
value at every `{{ ... }}`, so a hostile name or parameter cannot inject code even if it got
past the language's checks. Structured values (the plan, its host tables' branch names, the
config's settings) go in through the `literal` filter as Python literals built here from those
same validated atoms (`plan_literal`).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import keyword
import math
import re
from pathlib import Path
from typing import NamedTuple

import jinja2

from ..dsl import model
from ..plan import plan as plan_module
from ..plan.ranges import static_launches, tabled_branches, trailing_window
from ..resources import templates_dir

# Python the templates call to decide what goes in: how a plan's static branches run (triton),
# which branches' host tables the kernels read, which launches have Hopper kernels.
_TEMPLATE_GLOBALS = {
    "static_launches": static_launches, "tabled_branches": tabled_branches, "trailing_window": trailing_window,
}

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


# Generated lines stay under this width: a literal that does not fit is split one field a line.
_LINE_WIDTH = 100


def plan_literal(value: object, indent: int = 0) -> Code:
    """A Python expression that rebuilds `value` (a plan or part of one) in generated code,
    given `from nsa_dsl.dsl import model` and `from nsa_dsl.plan import plan`; laid out one
    field a line, indented from `indent`, where it does not fit on one line."""
    # Each part's one-line text is built once, by id (the parts outlive the call): a key set
    # nested n deep costs O(n), where rendering it again at each level doubled per level.
    one_lines: dict[int, str] = {}

    def one_line(part: object) -> str:
        if id(part) not in one_lines:
            shape = _literal_shape(part)
            one_lines[id(part)] = shape if isinstance(shape, str) else (
                shape.opening + ", ".join(name + one_line(item) for name, item in shape.items) + shape.trailing + ")"
            )
        return one_lines[id(part)]

    def laid_out(part: object, indent: int) -> str:
        text = one_line(part)
        shape = _literal_shape(part)
        if isinstance(shape, str) or indent + len(text) <= _LINE_WIDTH or not shape.items:
            return text
        inner = " " * (indent + 4)
        lines = [f"{inner}{name}{laid_out(item, indent + 4)}," for name, item in shape.items]
        return shape.opening + "\n" + "\n".join(lines) + "\n" + " " * indent + ")"

    return Code(laid_out(value, indent))


class _Composite(NamedTuple):
    """A tuple's or a plan dataclass's literal: its opening, (keyword, item) pairs and a 1-tuple's
    comma before the closing parenthesis."""

    opening: str
    items: list[tuple[str, object]]
    trailing: str


def _literal_shape(value: object) -> str | _Composite:
    """A leaf's validated text, or the parts of a composite's literal."""
    if value is None or isinstance(value, (bool, int, float)):
        return _safe(value) if value is not None else "None"
    if isinstance(value, str):
        if not is_identifier(value):
            raise UnsafeTemplateValue(f"refusing to render {value!r} into generated code")
        return repr(value)
    if isinstance(value, tuple):
        return _Composite("(", [("", item) for item in value], "," if len(value) == 1 else "")
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        cls = type(value)
        alias = _MODULE_ALIAS.get(cls.__module__)
        if alias is None:
            raise UnsafeTemplateValue(f"{cls.__qualname__} is not part of a plan")
        fields = [(f"{f.name}=", getattr(value, f.name)) for f in dataclasses.fields(value)]
        return _Composite(f"{alias}.{cls.__name__}(", fields, "")
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
    env.globals.update(_TEMPLATE_GLOBALS)
    return env


def render(template: str, **context: object) -> str:
    """Render `templates/<template>` (e.g. "xla/module.py.j2") with `context`."""
    return environment().get_template(template).render(**context)


def template_texts(backend: str) -> str:
    """Template text a backend's modules are rendered from, for cache keys: editing a template
    invalidates entries. Backends import each other's macros (triton renders token masks with
    xla/mask.j2), so every backend's key covers every template; `backend` names the entry. The
    source of the Python the templates call to decide what goes in (the Jinja globals) counts too,
    and so does that of every runtime module (nsa_dsl/runtime/*.py, which generated code imports),
    read as text: a module cached against one version of them is never run against another."""
    root = templates_dir()
    modules = dict.fromkeys(inspect.getmodule(fn) for fn in _TEMPLATE_GLOBALS.values())  # one each, in order
    deciders = "".join(f"\n{inspect.getsource(module)}" for module in modules)
    runtime = Path(__file__).resolve().parent.parent / "runtime"
    imported = "".join(f"\n{p.name}\n{p.read_text()}" for p in sorted(runtime.glob("*.py")))
    texts = "".join(f"\n{p.relative_to(root)}\n{p.read_text()}" for p in sorted(root.rglob("*.j2")))
    return backend + texts + deciders + imported
