"""The injection guard: only validated identifiers and numbers reach generated source."""

from __future__ import annotations

import dataclasses
import importlib
import math
from collections.abc import Callable, Iterator
from pathlib import Path

import jinja2
import pytest

from nsa_dsl import dsl
from nsa_dsl.codegen import UnsafeTemplateValue, cache, plan_literal
from nsa_dsl.dsl import model
from nsa_dsl.errors import NsaSemanticError, NsaSyntaxError
from nsa_dsl.plan import plan

render_module = importlib.import_module("nsa_dsl.codegen.render")  # the attribute is the render function

HOSTILE = [
    'x"""; import os; os.system("echo pwned") #',
    "__import__('os').system('echo pwned')",
    "a\nimport os",
    "name with spaces",
    "1abc",
    "import",  # a keyword is no identifier
    "",
]


def make_plan(name: str = "demo", params: tuple = (("w", 8),), window: int = 8) -> plan.Plan:
    keys = plan.StaticKeys(keys=model.Window(window, 0), block_atoms=(), mask=plan.TokenWindow(window, 0))
    return plan.Plan(
        name=name,
        block_size=64,
        causal=True,
        params=params,
        branches=(plan.StaticBranch(name="main", gate=model.Gate("g_swa", 1.0), static=keys),),
    )


@pytest.fixture
def template(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., str]]:
    """Yields `write(text, backend="t")`: saves `text` as `<backend>/module.py.j2` of a private
    templates folder (with a private cache) and returns the template's name."""
    monkeypatch.setattr(render_module, "templates_dir", lambda: tmp_path)
    monkeypatch.setenv("NSA_DSL_CACHE_DIR", str(tmp_path / "cache"))
    render_module.environment.cache_clear()

    def write(text: str, backend: str = "t") -> str:
        path = tmp_path / backend / "module.py.j2"
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
        return f"{backend}/module.py.j2"

    yield write
    render_module.environment.cache_clear()


@pytest.mark.parametrize("hostile", HOSTILE)
def test_render_refuses_a_string_that_is_not_an_identifier(template, hostile: str) -> None:
    name = template("NAME = {{ value }}\n")
    with pytest.raises(UnsafeTemplateValue):
        render_module.render(name, value=hostile)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -math.inf, {"a": 1}, [1, 2], b"raw", None, object()])
def test_render_refuses_values_that_are_not_numbers_or_identifiers(template, value: object) -> None:
    name = template("X = {{ value }}\n")
    with pytest.raises(UnsafeTemplateValue):
        render_module.render(name, value=value)


def test_render_admits_identifiers_and_numbers(template) -> None:
    name = template("{{ a }} = {{ b }} + {{ c }} * {{ d }}\n")
    assert render_module.render(name, a="scale_0", b=3, c=0.125, d=True) == "scale_0 = 3 + 0.125 * True\n"


@pytest.mark.parametrize(
    "use", ["{{ absent }}", "{{ absent.size }}", "{% if absent %}1{% endif %}", "{% for x in absent %}{% endfor %}"]
)
def test_missing_context_variable_raises(template, use: str) -> None:
    name = template("X = {{ present }}\n" + use + "\n")
    with pytest.raises(jinja2.UndefinedError, match="absent"):
        render_module.render(name, present=1)


def test_plan_literal_rebuilds_the_plan() -> None:
    p = make_plan(params=(("w", 8), ("scale", 0.5), ("causal_ok", True)))
    assert eval(plan_literal(p), {"model": model, "plan": plan}) == p


def test_plan_literal_of_a_deep_key_set_looks_at_each_part_at_most_twice(monkeypatch) -> None:
    """Each level rendered its parts on one line and, where too long, again laid out: time doubled
    per level (`window(2048) - blocks(0) - ... - blocks(15)` took 71 s, a 12-deep mix of -, & and
    | over two minutes), and the cache key renders the plan on every kernel load."""
    import nsa_dsl

    source = "pattern p\nblock 16\nbranch m = window(2048) " + "".join(f"- blocks({i}) " for i in range(30))
    compiled = nsa_dsl.compile(source).plan
    parts = []
    looked_at = render_module._literal_shape

    def counted(value):
        parts.append(value)
        return looked_at(value)

    monkeypatch.setattr(render_module, "_literal_shape", counted)
    text = plan_literal(compiled)
    assert eval(text, {"model": model, "plan": plan}) == compiled
    assert len(parts) <= 2 * _tree_size(compiled)


def _alternating(depth: int) -> str:
    """A key set `depth + 1` deep: & and | alternate, so no level flattens into the next."""
    keys = "window(3)"
    for i in range(depth):
        keys = f"(window({i + 2}) {'|' if i % 2 else '&'} {keys})"
    return keys


def test_key_sets_as_deep_and_wide_as_the_language_allows_render_modules_that_compile() -> None:
    """A key set 99 deep (the limit was 100) rendered a plan literal of two parentheses a level,
    past the 200 nested ones CPython parses; a union 3,000 terms wide, a mask chain of 3,000 |
    past its compiler's recursion. Each checked, and no backend's module compiled."""
    import nsa_dsl
    from nsa_dsl.dsl.check import MAX_NESTING

    wide = " | ".join(f"(window({i + 2}) & window({i + 3}, 1))" for i in range(3000))  # 9,000 nodes
    for keys in (_alternating(MAX_NESTING - 1), wide):
        attention = nsa_dsl.compile(f"pattern p\nblock 16\nbranch m = {keys}\n")
        for platform in ("xla", "triton", "pallas"):
            compile(attention.source(platform), f"{platform}.py", "exec")
    with pytest.raises(NsaSemanticError, match="nested too deeply"):
        nsa_dsl.compile(f"pattern p\nblock 16\nbranch m = {_alternating(MAX_NESTING)}\n")


def _tree_size(value: object) -> int:
    """The parts of a plan, counted as a tree (a value met twice counts twice)."""
    if isinstance(value, tuple):
        return 1 + sum(map(_tree_size, value))
    if dataclasses.is_dataclass(value):
        return 1 + sum(_tree_size(getattr(value, f.name)) for f in dataclasses.fields(value))
    return 1


@pytest.mark.parametrize("hostile", HOSTILE)
def test_plan_literal_refuses_hostile_names(hostile: str) -> None:
    for p in (make_plan(name=hostile), make_plan(params=((hostile, 8),))):
        with pytest.raises(UnsafeTemplateValue):
            plan_literal(p)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -math.inf])
def test_plan_literal_refuses_non_finite_floats(value: float) -> None:
    with pytest.raises(UnsafeTemplateValue):
        plan_literal(make_plan(params=(("w", value),)))


def test_plan_literal_refuses_values_outside_a_plan() -> None:
    @dataclasses.dataclass(frozen=True)
    class Intruder:
        code: int = 1

    for value in (Intruder(), make_plan(params=(("w", "os.system('x')"),)), [1, 2], {"w": 1}, b"x", Intruder):
        with pytest.raises(UnsafeTemplateValue):
            plan_literal(value)


def test_hostile_pattern_name_cannot_reach_generated_source(template, tmp_path: Path) -> None:
    template('"""Pattern {{ plan.name }}."""\nPLAN = {{ plan | literal }}\n', backend="xla")
    hostile = make_plan(name=HOSTILE[0])
    for attempt in (
        lambda: render_module.render("xla/module.py.j2", plan=hostile),
        lambda: cache.source("xla", hostile),
        lambda: cache.load_module("xla", hostile),
    ):
        with pytest.raises(UnsafeTemplateValue):
            attempt()
    assert not (tmp_path / "cache").exists() or not any(p.is_file() for p in (tmp_path / "cache").rglob("*"))


HOSTILE_NSA = 'pattern x"""; import os; os.system("echo pwned") #\nblock 64\ncausal\nbranch main = local(1)\n'


def test_hostile_pattern_name_in_nsa_text_is_a_syntax_error() -> None:
    with pytest.raises(NsaSyntaxError) as error:
        dsl.load_pattern(HOSTILE_NSA)
    assert (error.value.line, error.value.column) == (1, 10)


@pytest.mark.parametrize("overrides", [{"w": "os.system('echo pwned')"}, {"w": 'x"""'}, {"__import__('os')": 1}])
def test_hostile_override_is_a_semantic_error(overrides: dict[str, object]) -> None:
    text = "pattern p\nparam w = 8\nblock 64\ncausal\nbranch main = window(w)\n"
    with pytest.raises(NsaSemanticError):
        dsl.load_pattern(text, overrides=overrides)


# What a generated module offers: the runtime reads attention, selections and TABLES, users also
# sparse_attention, compress, PLAN and BLOCK (README: "nsa-compile").
MODULE_ENTRIES = {"attention", "sparse_attention", "selections", "compress", "PLAN", "TABLES", "BLOCK"}


def _unreachable_definitions(text: str) -> set[str]:
    """Top-level functions, classes and constants of module `text` that neither its entries nor
    its module-level statements reach, through any chain of names read: text no call can run."""
    import ast

    definitions: dict[str, ast.stmt] = {}
    roots = set(MODULE_ENTRIES)
    for node in ast.parse(text).body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            definitions[node.name] = node
        elif isinstance(node, ast.Assign) and all(isinstance(t, ast.Name) for t in node.targets):
            definitions.update((target.id, node) for target in node.targets)
        else:
            roots |= {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
    reached, pending = set(), [name for name in roots if name in definitions]
    while pending:
        name = pending.pop()
        if name not in reached:
            reached.add(name)
            pending += [n.id for n in ast.walk(definitions[name]) if isinstance(n, ast.Name) and n.id in definitions]
    return set(definitions) - reached


def _names_read_but_never_bound(text: str) -> set[str]:
    """Global names that some function of module `text` reads and that the module never binds
    (nor are builtins): each a NameError once that function runs."""
    import builtins
    import symtable

    top = symtable.symtable(text, "<generated>", "exec")
    bound = {symbol.get_name() for symbol in top.get_symbols() if symbol.is_assigned() or symbol.is_imported()}
    bound |= set(dir(builtins))
    read = set()
    scopes = list(top.get_children())
    while scopes:
        scope = scopes.pop()
        # not is_local: symtable calls every symbol of a function named `top` global (its module's name)
        read |= {symbol.get_name() for symbol in scope.get_symbols()
                 if symbol.is_global() and not symbol.is_local() and symbol.is_referenced()}
        scopes += scope.get_children()
    return read - bound


def _rendered_modules(backend: str) -> Iterator[tuple[str, str]]:
    """(plan name, module text) on `backend` ("tpu": Pallas' TPU variant) of every example's
    patterns, native_sparse_attention's two plans and plan shapes the examples lack."""
    from nsa_dsl.config import NativeSparseAttentionConfig
    from nsa_dsl.kernel import compressed_selection_plan, selection_plan
    from nsa_dsl.plan import lower

    config = NativeSparseAttentionConfig(backend="tpu" if backend == "tpu" else "gpu")
    platform = "pallas" if backend == "tpu" else backend
    examples = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.nsa"))
    plans = [lower(pattern) for path in examples for pattern in dsl.load(path)]
    plans += [selection_plan(64), compressed_selection_plan(64, 16)]
    plans += [lower(dsl.load_pattern(f"pattern p\nblock 64\n{text}")) for text in (
        "branch c = compress(block=32, stride=16) gate g_cmp",  # a compression no top-k scores with
        "branch w = window(256)\nbranch c = compress(block=64) gate g_cmp",
        "branch a = window(100) | stride(4)\nbranch b = local(2) - blocks(1)",
        "bidirectional\nbranch w = window(64, 64)",
        "branch c = compress(block=64, pool=learned)\nbranch s = topk(8, score=c) per block(64)",
    )]
    for lowered in plans:
        yield lowered.name, cache._render_module(platform, lowered, config)


@pytest.mark.parametrize("backend", ["xla", "triton", "pallas", "tpu"])
def test_every_name_a_rendered_module_reads_is_defined(backend: str) -> None:
    """A template included for one feature emitted a function that called a name only another
    feature's template defines (nsa_meanpool's Triton module read range_attention, defined for
    static branches): dead there, a NameError wherever it would run."""
    for name, text in _rendered_modules(backend):
        assert _names_read_but_never_bound(text) == set(), name


@pytest.mark.parametrize("backend", ["xla", "triton", "pallas", "tpu"])
def test_a_rendered_module_holds_only_code_its_entries_reach(backend: str) -> None:
    """A kernel should read as one written for its pattern: nsa_meanpool's Triton module carried the
    Hopper window kernels (~500 lines) for a pattern without a window, bigbird's the range walks
    of patterns whose branches all walk tables."""
    for name, text in _rendered_modules(backend):
        assert _unreachable_definitions(text) == set(), name
