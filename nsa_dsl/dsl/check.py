"""Syntax tree to checked model: names resolved, expressions typed and evaluated, sizes
validated, branch references inlined. Every problem is an `NsaSemanticError` pointing at the
node that causes it.

Expressions have one grammar and two kinds of value: numbers (int, float; bools for `if`)
and key sets (`dsl.model` values). A call of an atom (window, local, ...) is a key set; a
bare name is a param's value or, if it names a static branch, that branch's key set.
`|` and `&` take key sets; `-` is set difference between key sets and subtraction between
numbers; `+ * / //` take numbers. compress(...) and topk(...) only stand alone, as a
branch's whole expression.
"""

from __future__ import annotations

import keyword
import math
import operator
import re
from collections.abc import Mapping
from typing import NamedTuple

from ..errors import NsaSemanticError, did_you_mean
from . import ast, model
from .parser import source_line

RESERVED_WORDS = frozenset(
    "pattern param block causal bidirectional gate branch default per token if true false".split()
)
# Names a gate or param cannot take because Python calls pass them by name beside the call's own
# arguments (SparseAttention.__call__'s and generated modules' sparse_attention's for gates,
# nsa_dsl.compile's for param overrides).
CALL_ARGUMENTS = {
    "gate": frozenset(
        "self query key value cu_seqlens softmax_scale platform block_indices block_counts pool_fns query_offset "
        "scoring_query compressed config".split()
    ),
    "param": frozenset(("path_or_source", "pattern", "config")),
}
MAX_SIZE = 2**31 - 1  # sizes, counts, ids and seeds: kernels index with int32
MAX_INT = 2**63 - 1  # any integer an expression may produce
MAX_GATE = 3.4028234663852886e38  # float32's largest: a gate's default is a float32 weight
# calls, unary minus, right-nested operators and forward branch references; a key set's plan literal
# spends two parentheses a level, and CPython parses at most 200 nested ones
MAX_NESTING = 64
MAX_KEYSET_NODES = 10_000  # a key set after inlining branch references, counted as a tree

_KEYSET_TYPES = (
    model.Window, model.Local, model.Stride, model.Global, model.Blocks, model.Random,
    model.Union, model.Intersection, model.Difference,
)  # fmt: skip
_REQUIRED = object()
_SIGNATURES: dict[str, tuple[tuple[str, object], ...]] = {
    "window": (("left", _REQUIRED), ("right", 0)),
    "local": (("before", _REQUIRED), ("after", 0)),
    "stride": (("every", _REQUIRED), ("offset", 0)),
    "global": (("first", _REQUIRED),),
    "random": (("count", _REQUIRED), ("seed", 0)),
    "compress": (("block", _REQUIRED), ("stride", None), ("pool", None)),
    "topk": (("count", _REQUIRED), ("block", None), ("score", _REQUIRED), ("force", None)),
}
_VARIADIC = "blocks"  # blocks(i, j, ...): positional block ids only
_DYNAMIC = ("compress", "topk")
_FUNCTIONS = (*_SIGNATURES, _VARIADIC)
_POOLS = ("mean", "learned")  # learned: a callable the caller passes (pool_fns=)
_ARITHMETIC = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv, "//": operator.floordiv}

Scalar = int | float | bool
Value = Scalar | model.KeySet


class _Scope(NamedTuple):
    """Where an expression is evaluated. `stack`: branches being inlined (for cycles);
    `block_level`: inside topk's force= (no token-level window); `params_only`: a param's
    or the block size's value (no branch references)."""

    stack: tuple[str, ...] = ()
    block_level: bool = False
    params_only: bool = False


_PARAMS = _Scope(params_only=True)


def check(module: ast.Module, overrides: Mapping[str, object] | None = None) -> tuple[model.Pattern, ...]:
    """Every pattern of `module`, checked. An override applies to each pattern declaring that
    param; naming a param that no pattern declares is an error."""
    overrides = dict(overrides or {})
    _check_pattern_names(module)
    declared = set().union(*(_param_names(decl) for decl in module.patterns))
    _check_override_names(module, overrides, declared, "any pattern")
    patterns = []
    for decl in module.patterns:
        names = _param_names(decl)
        patterns.append(_PatternChecker(module, decl, {k: v for k, v in overrides.items() if k in names}).check())
    return tuple(patterns)


def check_pattern(
    module: ast.Module, *, name: str | None = None, overrides: Mapping[str, object] | None = None
) -> model.Pattern:
    """The pattern `name` of `module` (which may be omitted if there is only one), checked."""
    _check_pattern_names(module)
    names = [decl.name.name for decl in module.patterns]
    if name is None:
        if len(names) > 1:
            raise NsaSemanticError(
                f"{module.file} holds {len(names)} patterns; say which one",
                file=module.file,
                hint="pick one of: " + ", ".join(names)
                + " (nsa_dsl.compile(..., pattern=NAME), nsa-compile --pattern NAME, dsl.load_pattern(..., name=NAME))",
            )
        name = names[0]
    if name not in names:
        raise NsaSemanticError(
            f"no pattern named {name!r}",
            file=module.file,
            hint=did_you_mean(name, names) or "patterns here: " + ", ".join(names),
        )
    decl = module.patterns[names.index(name)]
    overrides = dict(overrides or {})
    _check_override_names(module, overrides, _param_names(decl), f"pattern '{name}'")
    return _PatternChecker(module, decl, overrides).check()


def _param_names(decl: ast.Pattern) -> set[str]:
    return {s.name.name for s in decl.statements if isinstance(s, ast.Param)}


def _check_pattern_names(module: ast.Module) -> None:
    seen: dict[str, ast.Identifier] = {}
    for decl in module.patterns:
        first = seen.setdefault(decl.name.name, decl.name)
        if first is not decl.name:
            raise _error(
                module, decl.name, f"duplicate pattern '{decl.name.name}' (first declared on line {first.line})"
            )


def _check_override_names(module: ast.Module, overrides: dict, declared: set[str], where: str) -> None:
    for name in overrides:
        if name not in declared:
            raise NsaSemanticError(
                f"override {name!r} names no param of {where}",
                file=module.file,
                hint=did_you_mean(str(name), declared) or "params: " + (", ".join(sorted(declared)) or "none"),
            )


def _error(module: ast.Module, node, message: str, hint: str | None = None) -> NsaSemanticError:
    return NsaSemanticError(
        message,
        file=module.file,
        line=node.line,
        column=node.column,
        source_line=source_line(module.source, node.line),
        hint=hint,
    )


class _PatternChecker:
    def __init__(self, module: ast.Module, decl: ast.Pattern, overrides: dict[str, object]) -> None:
        self.module = module
        self.decl = decl
        self.overrides = overrides
        self.param_decls: dict[str, ast.Param] = {}
        self.branch_decls: dict[str, ast.Branch] = {}
        self.gate_decls: dict[str, ast.GateDecl] = {}
        self.block_decl: ast.BlockSize | None = None
        self.masking_decl: ast.Masking | None = None
        self.params: dict[str, Scalar] = {}
        self.block_size = 0
        self.static_keys: dict[str, model.KeySet] = {}  # evaluated static branches, for inlining
        self.compressions: dict[str, model.Compress] = {}

    def error(self, node, message: str, hint: str | None = None) -> NsaSemanticError:
        return _error(self.module, node, message, hint)

    # ---- the pattern ---------------------------------------------------------------------
    def check(self) -> model.Pattern:
        self.identifier(self.decl.name, "pattern")
        self.collect_statements()
        for decl in self.param_decls.values():
            self.params[decl.name.name] = self.param_value(decl)
        if self.block_decl is None:
            raise self.error(
                self.decl.name, f"pattern '{self.decl.name.name}' has no block size", "add e.g. `block 64`"
            )
        self.block_size = self.block_size_value(self.block_decl.size, "block size", minimum=16)
        if not self.branch_decls:
            raise self.error(
                self.decl.name,
                f"pattern '{self.decl.name.name}' has no branches",
                "add e.g. `branch main = window(256)`",
            )
        branches = [self.branch(decl) for decl in self.branch_decls.values()]
        self.check_gates_agree(branches)
        kept = [branch for branch, condition in branches if condition is None or self.params[condition.param.name]]
        if not kept:
            raise self.error(
                self.decl.name, f"pattern '{self.decl.name.name}' keeps no branch: every branch's `if` param is false"
            )
        self.check_scores_kept(kept)
        used = {branch.gate.name for branch in kept if branch.gate is not None}
        named = dict.fromkeys([*self.gate_decls, *(branch.gate.name for branch, _ in branches if branch.gate)])
        return model.Pattern(
            name=self.decl.name.name,
            block_size=self.block_size,
            causal=self.causal,
            params=tuple(self.params.items()),
            branches=tuple(kept),
            idle_gates=tuple(name for name in named if name not in used),
        )

    def collect_statements(self) -> None:
        names: dict[str, ast.Param | ast.Branch] = {}  # params and branches share bare names
        for statement in self.decl.statements:
            if isinstance(statement, ast.BlockSize):
                self.only_once(self.block_decl, statement, "block")
                self.block_decl = statement
            elif isinstance(statement, ast.Masking):
                self.only_once(self.masking_decl, statement, "causal/bidirectional")
                self.masking_decl = statement
            elif isinstance(statement, ast.GateDecl):
                name = self.identifier(statement.name, "gate")
                if name in self.gate_decls:
                    first = self.gate_decls[name]
                    raise self.error(statement.name, f"duplicate gate '{name}' (first declared on line {first.line})")
                self.gate_decls[name] = statement
            else:
                what = "param" if isinstance(statement, ast.Param) else "branch"
                name = self.identifier(statement.name, what)
                if name in names:
                    first = names[name]
                    kind = "param" if isinstance(first, ast.Param) else "branch"
                    raise self.error(statement.name, f"duplicate name '{name}': already a {kind} (line {first.line})")
                names[name] = statement
                target = self.param_decls if isinstance(statement, ast.Param) else self.branch_decls
                target[name] = statement

    def only_once(self, first: ast.Statement | None, statement: ast.Statement, word: str) -> None:
        if first is not None:
            raise self.error(statement, f"duplicate `{word}` statement (first on line {first.line})")

    @property
    def causal(self) -> bool:
        return self.masking_decl is None or self.masking_decl.causal

    def identifier(self, ident: ast.Identifier, what: str) -> str:
        if ident.name in RESERVED_WORDS:
            raise self.error(ident, f"'{ident.name}' is a reserved word and cannot name a {what}")
        if keyword.iskeyword(ident.name) or ident.name == "__debug__":
            # (__debug__ is no keyword, but Python refuses it as a keyword argument's name too)
            raise self.error(
                ident,
                f"'{ident.name}' is a Python keyword and cannot name a {what}",
                "names become identifiers in generated Python code",
            )
        if ident.name in CALL_ARGUMENTS.get(what, ()):
            raise self.error(
                ident,
                f"'{ident.name}' cannot name a {what}: it is an argument of the Python call that takes {what}s by name",
                f"the call's own arguments: {', '.join(sorted(CALL_ARGUMENTS[what]))}",
            )
        return ident.name

    # ---- params ----------------------------------------------------------------------------
    def param_value(self, decl: ast.Param) -> Scalar:
        value = self.evaluate(decl.value, _PARAMS, 0)
        if _is_keyset(value):
            raise self.error(decl.value, f"param '{decl.name.name}' must be a number or bool, not a key set")
        if decl.name.name not in self.overrides:
            return value
        return self.override(decl, value, self.overrides[decl.name.name])

    def override(self, decl: ast.Param, declared: Scalar, raw: object) -> Scalar:
        """`raw` (a Python value or -D text) as a value of the declared param's type."""
        kind = _kind(declared)
        value = _parse_override(raw, type(declared)) if isinstance(raw, str) else _python_scalar(raw)
        kinds = (int, float) if type(declared) is float else (type(declared),)
        if type(value) not in kinds:
            raise self.error(
                decl.name,
                f"override {decl.name.name}={raw!r} does not fit: param '{decl.name.name}' is {kind}",
                f"give {kind}, e.g. -D {decl.name.name}={_show(declared)}",
            )
        # (a bool is never out of range: |True| = 1; an int compares with 1e308 exactly, where
        # math.isfinite(10**400) would overflow; NaN compares False)
        too_large = abs(value) > MAX_INT if type(declared) is int else not abs(value) <= 1e308
        if too_large:
            limit = "2**63 - 1" if type(declared) is int else "1e308"
            raise self.error(decl.name, f"override {decl.name.name}={raw!r} is out of range: at most {limit} in magnitude")
        return float(value) if type(declared) is float else value

    # ---- expressions -----------------------------------------------------------------------
    def evaluate(self, node: ast.Expr, scope: _Scope, depth: int) -> Value:
        if depth > MAX_NESTING:
            raise self.error(
                node,
                "expression nested too deeply",
                f"at most {MAX_NESTING} levels of nested calls, operators and forward branch references",
            )
        if isinstance(node, ast.IntLiteral | ast.BoolLiteral):
            return node.value
        if isinstance(node, ast.FloatLiteral):
            if not math.isfinite(node.value):
                raise self.error(node, "number too large")
            return node.value
        if isinstance(node, ast.Name):
            return self.lookup(node, scope, depth)
        if isinstance(node, ast.Negate):
            value = self.evaluate(node.operand, scope, depth + 1)
            if not _is_number(value):
                raise self.error(node, f"unary '-' needs a number, got {_kind(value)}")
            return -value
        if isinstance(node, ast.Binary):
            # Left-associative chains (a | b | c ...) are folded iteratively, so a long chain
            # costs no nesting; only right operands recurse.
            chain = []
            while isinstance(node, ast.Binary):
                chain.append(node)
                node = node.left
            value = self.evaluate(node, scope, depth + 1)
            for operation in reversed(chain):
                value = self.binary(operation, value, self.evaluate(operation.right, scope, depth + 1))
            return value
        return self.call(node, scope, depth)

    def binary(self, node: ast.Binary, left: Value, right: Value) -> Value:
        op = node.op
        if op in ("|", "&") or (op == "-" and (_is_keyset(left) or _is_keyset(right))):
            for side, value in (("left", left), ("right", right)):
                if not _is_keyset(value):
                    meaning = {"|": "union", "&": "intersection", "-": "set difference"}[op]
                    raise self.error(
                        node,
                        f"'{op}' ({meaning}) needs key sets, but its {side} side is {_kind(value)}",
                        "'-' is set difference between key sets and subtraction between numbers"
                        if op == "-"
                        else "use + - * / // for numbers",
                    )
            if op == "-":
                return model.Difference(left, right)
            combine = model.Union if op == "|" else model.Intersection
            parts = [p for value in (left, right) for p in (value.parts if isinstance(value, combine) else (value,))]
            return combine(tuple(parts))
        for side, value in (("left", left), ("right", right)):
            if not _is_number(value):
                raise self.error(
                    node,
                    f"'{op}' needs numbers, but its {side} side is {_kind(value)}",
                    "combine key sets with | (union), & (intersection) and - (difference)"
                    if _is_keyset(value)
                    else None,
                )
        if op in ("/", "//") and right == 0:
            raise self.error(node, "division by zero")
        try:
            result = _ARITHMETIC[op](left, right)
        except OverflowError:
            raise self.error(node, "number too large") from None
        if (isinstance(result, int) and abs(result) > MAX_INT) or (
            isinstance(result, float) and not math.isfinite(result)
        ):
            raise self.error(node, "number too large")
        return result

    def lookup(self, node: ast.Name, scope: _Scope, depth: int) -> Value:
        name = node.name
        if name in self.params:
            return self.params[name]
        if name in self.param_decls:  # declared, not yet evaluated: a later param
            declared = self.param_decls[name]
            raise self.error(
                node,
                f"param '{name}' (line {declared.line}) has no value yet here; a param may only use earlier params",
            )
        if name in self.branch_decls:
            if scope.params_only:
                raise self.error(node, f"'{name}' is a branch; only params can be used here")
            return self.inlined_branch(node, scope, depth)
        candidates = list(self.params) + ([] if scope.params_only else list(self.branch_decls))
        hint = did_you_mean(name, candidates)
        if hint is None and name in _FUNCTIONS:
            hint = f"'{name}' is a function: call it, e.g. {name}(...)"
        raise self.error(node, f"unknown name '{name}'", hint)

    def inlined_branch(self, node: ast.Name, scope: _Scope, depth: int) -> model.KeySet:
        name = node.name
        if name in scope.stack:
            cycle = (*scope.stack[scope.stack.index(name) :], name)
            raise self.error(node, "cycle between branches: " + " -> ".join(cycle))
        kind = _branch_kind(self.branch_decls[name])
        if kind != "static":
            raise self.error(
                node,
                f"branch '{name}' is a {kind}() branch; only static key-set branches can be used in expressions",
            )
        keys = self.static_branch_keys(name, scope.stack, depth + 1)
        if scope.block_level and _contains_window(keys):
            raise self.error(
                node,
                f"branch '{name}' uses window(), which is token-level; force= takes block-level key sets only",
                "use local(...) for whole neighbouring blocks",
            )
        return keys

    def static_branch_keys(self, name: str, stack: tuple[str, ...], depth: int) -> model.KeySet:
        if name not in self.static_keys:
            decl = self.branch_decls[name]
            self.static_keys[name] = self.keyset(decl.value, _Scope(stack=(*stack, name)), depth, f"branch '{name}'")
        return self.static_keys[name]

    def keyset(self, node: ast.Expr, scope: _Scope, depth: int, what: str) -> model.KeySet:
        """`node` evaluated as a key set of bounded size."""
        value = self.evaluate(node, scope, depth)
        if not _is_keyset(value):
            raise self.error(node, f"{what} must be a key set, got {_kind(value)} ({_show(value)})")
        nesting, nodes = _measure(value)
        if nesting > MAX_NESTING or nodes > MAX_KEYSET_NODES:
            raise self.error(
                node,
                f"{what} is too large after inlining branch references "
                f"({nodes} nodes nested {nesting} deep; at most {MAX_KEYSET_NODES} nodes, {MAX_NESTING} deep)",
            )
        atoms = _block_atoms(value)
        if len(atoms) > model.MAX_BLOCK_ATOMS:
            raise self.error(
                node,
                f"{what} uses {len(atoms)} distinct block atoms; at most {model.MAX_BLOCK_ATOMS}",
                "block atoms are the local, stride, global, blocks and random calls, counted after inlining "
                "branch references; equal ones count once",
            )
        return value

    # ---- calls -----------------------------------------------------------------------------
    def call(self, node: ast.Call, scope: _Scope, depth: int) -> model.KeySet:
        function = node.function
        if function in _DYNAMIC:
            raise self.error(node, f"{function}() must be a branch's whole expression, not part of one")
        if function not in _FUNCTIONS:
            hint = did_you_mean(function, _FUNCTIONS) or "functions: " + ", ".join(sorted(_FUNCTIONS))
            if function in self.param_decls or function in self.branch_decls:
                hint = f"'{function}' is a name, not a function: write it without parentheses"
            raise self.error(node, f"unknown function '{function}'", hint)
        if function == "window" and scope.block_level:
            raise self.error(
                node,
                "window() is token-level; force= takes block-level key sets only",
                "use local(...) for whole neighbouring blocks",
            )
        if function == _VARIADIC:
            return self.blocks(node, scope, depth)
        args = self.bind(node)

        def size(name: str, minimum: int) -> int:
            value = args[name]
            return (
                value
                if isinstance(value, int)
                else self.size(value, scope, depth + 1, f"{function}() argument '{name}'", minimum)
            )

        if function in ("window", "local"):
            first, second = (name for name, _ in _SIGNATURES[function])
            a, b = size(first, 0), size(second, 0)
            if a + b < 1:
                raise self.error(node, f"{function}({a}, {b}) is empty: {first} + {second} must be >= 1")
            return model.Window(a, b) if function == "window" else model.Local(a, b)
        if function == "stride":
            every, offset = size("every", 1), size("offset", 0)
            if offset >= every:
                raise self.error(args["offset"], f"stride() offset must be below every ({every}), got {offset}")
            return model.Stride(every, offset)
        if function == "global":
            return model.Global(size("first", 1))
        return model.Random(size("count", 1), size("seed", 0))

    def blocks(self, node: ast.Call, scope: _Scope, depth: int) -> model.Blocks:
        if not node.arguments:
            raise self.error(node, "blocks() needs at least one block id")
        ids = set()
        for argument in node.arguments:
            if argument.keyword is not None:
                raise self.error(argument, "blocks() takes block ids as positional arguments only")
            ids.add(self.size(argument.value, scope, depth + 1, "blocks() id", 0))
        return model.Blocks(tuple(sorted(ids)))

    def bind(self, node: ast.Call) -> dict[str, object]:
        """Arguments of `node` by parameter name: the expression, or the default where omitted."""
        signature = _SIGNATURES[node.function]
        names = [name for name, _ in signature]
        bound: dict[str, object] = {}
        seen_keyword = False
        for index, argument in enumerate(node.arguments):
            if argument.keyword is None:
                if seen_keyword:
                    raise self.error(argument, f"{node.function}(): positional argument after a keyword argument")
                if index >= len(names):
                    raise self.error(
                        argument,
                        f"{node.function}() takes at most {len(names)} arguments ({', '.join(names)})",
                    )
                name = names[index]
            else:
                seen_keyword = True
                name = argument.keyword
                if name not in names:
                    raise self.error(
                        argument,
                        f"{node.function}() has no argument '{name}'",
                        did_you_mean(name, names) or f"its arguments: {', '.join(names)}",
                    )
                if name in bound:
                    raise self.error(argument, f"{node.function}() got two values for '{name}'")
            bound[name] = argument.value
        for name, default in signature:
            if name not in bound:
                if default is _REQUIRED:
                    raise self.error(node, f"{node.function}() needs argument '{name}'")
                bound[name] = default
        return bound

    def size(self, node: ast.Expr, scope: _Scope, depth: int, what: str, minimum: int) -> int:
        value = self.evaluate(node, scope, depth)
        if type(value) is not int:
            hint = _integer_hint(node) if type(value) is float else None
            raise self.error(node, f"{what} must be an integer, got {_kind(value)} ({_show(value)})", hint)
        if value < minimum:
            raise self.error(node, f"{what} must be >= {minimum}, got {value}")
        if value > MAX_SIZE:
            raise self.error(node, f"{what} must be at most 2**31 - 1, got {value}")
        return value

    def block_size_value(self, node: ast.Expr, what: str, minimum: int, scope: _Scope = _PARAMS) -> int:
        value = self.size(node, scope, 0, what, 1)
        if value < minimum or value & (value - 1):
            raise self.error(node, f"{what} must be a power of two >= {minimum}, got {value}")
        return self.not_past_a_sequence(node, what, value)

    def not_past_a_sequence(self, node: ast.Expr, what: str, value: int) -> int:
        """`value`, a block's rows, if no longer than the longest sequence the kernels run: a
        longer one (2**30, say) made some platforms build arrays of its length that XLA could not
        even shape, aborting the process."""
        if value > model.MAX_TOKENS:
            raise self.error(node, f"{what} must be at most 2**29, the longest sequence nsa_dsl runs, got {value}")
        return value

    # ---- branches --------------------------------------------------------------------------
    def branch(self, decl: ast.Branch) -> tuple[model.Branch, ast.IfClause | None]:
        name = decl.name.name
        kind = _branch_kind(decl)
        if kind == "compress":
            keys = self.compression(name)
        elif kind == "topk":
            keys = self.topk(decl.value)
        else:
            keys = self.static_branch_keys(name, (), 0)
        options: dict[str, ast.BranchOption] = {}
        for option in decl.options:
            word = {ast.GateClause: "gate", ast.IfClause: "if"}.get(type(option), "per")
            if word in options:
                raise self.error(
                    option,
                    f"branch '{name}' has a second `{word}` clause (the first is on line {options[word].line})",
                    "a `gate NAME` right after a branch's expression is that branch's gate clause; "
                    "declare extra gates before the branches"
                    if word == "gate"
                    else None,
                )
            options[word] = option
        gate_clause = options.get("gate")
        per = options.get("per")
        condition = options.get("if")
        query_block = 1
        if per is not None and kind != "topk":
            clause = "per block(...)" if isinstance(per, ast.PerBlock) else "per token"
            raise self.error(per, f"`{clause}` sets a topk branch's selection granularity; '{name}' is a {kind} branch")
        if isinstance(per, ast.PerBlock):
            query_block = self.block_size_value(per.size, "per block size", minimum=1, scope=_Scope())
            if query_block > self.block_size:
                # Kernels tile queries by the pattern's block; a selection group must fit in a tile.
                raise self.error(
                    per.size, f"per block({query_block}) must not exceed the pattern's block size ({self.block_size})"
                )
        if condition is not None:
            self.check_condition(condition)
        gate = None if gate_clause is None else self.gate(gate_clause)
        return model.Branch(name=name, keys=keys, gate=gate, query_block=query_block), condition

    def gate(self, clause: ast.GateClause) -> model.Gate:
        name = self.identifier(clause.name, "gate")
        if name not in model.BUILTIN_GATES and name not in self.gate_decls:
            raise self.error(
                clause.name,
                f"unknown gate '{name}'",
                did_you_mean(name, (*model.BUILTIN_GATES, *self.gate_decls))
                or f"declare it with `gate {name}` before the branches "
                f"(built-in gates: {', '.join(model.BUILTIN_GATES)})",
            )
        default = None if clause.default is None else float(self.evaluate(clause.default, _PARAMS, 0))
        if default is not None and not abs(default) <= MAX_GATE:
            raise self.error(
                clause.default,
                f"gate default {_show(default)} is out of range: a gate is a float32 weight, "
                "at most 3.4e38 in magnitude",
            )
        return model.Gate(name, default)

    def check_condition(self, clause: ast.IfClause) -> None:
        name = clause.param.name
        if name not in self.params:
            flags = [p for p, v in self.params.items() if type(v) is bool]
            raise self.error(
                clause.param,
                f"unknown param '{name}'",
                did_you_mean(name, flags)
                or ("bool params: " + ", ".join(flags) if flags else "declare e.g. `param use_it = true`"),
            )
        value = self.params[name]
        if type(value) is not bool:
            raise self.error(clause.param, f"`if` needs a bool param; '{name}' is {_kind(value)} ({_show(value)})")

    def compression(self, name: str) -> model.Compress:
        if name not in self.compressions:
            node = self.branch_decls[name].value
            args = self.bind(node)
            scope = _Scope()
            what = "compress() argument 'block'"
            block = self.not_past_a_sequence(args["block"], what, self.size(args["block"], scope, 1, what, 1))
            stride = (
                block
                if args["stride"] is None
                else self.size(args["stride"], scope, 1, "compress() argument 'stride'", 1)
            )
            if stride > block:
                raise self.error(
                    args["stride"], f"compress() stride ({stride}) must be <= block ({block}): windows would leave gaps"
                )
            if block % stride:
                # Selection scores count the stride-sized units a compressed block shares with
                # each selection block (the paper's Eq. 9), so a block is whole units.
                raise self.error(
                    args["stride"], f"compress() block ({block}) must be a multiple of its stride ({stride})"
                )
            if not self.causal:
                raise self.error(
                    node,
                    "compress() needs a causal pattern: compressed blocks and top-k selection are defined "
                    "over the keys that precede a query",
                    "declare `causal` (the default) or drop the compress/topk branches",
                )
            pool = args["pool"]
            if pool is not None and not (isinstance(pool, ast.Name) and pool.name in _POOLS):
                raise self.error(
                    pool,
                    "compress() pool must be one of: " + ", ".join(_POOLS),
                    did_you_mean(pool.name, _POOLS) if isinstance(pool, ast.Name) else None,
                )
            self.compressions[name] = model.Compress(
                block=block, stride=stride, pool="mean" if pool is None else pool.name
            )
        return self.compressions[name]

    def topk(self, node: ast.Call) -> model.TopK:
        args = self.bind(node)
        scope = _Scope()
        count = self.size(args["count"], scope, 1, "topk() argument 'count'", 1)
        score_node = args["score"]
        compress_branches = [n for n, d in self.branch_decls.items() if _branch_kind(d) == "compress"]
        if not isinstance(score_node, ast.Name):
            raise self.error(
                score_node,
                "topk() score= must name a compress branch",
                _listing("compress branches", compress_branches),
            )
        score = score_node.name
        if score not in self.branch_decls:
            raise self.error(
                score_node,
                f"unknown branch '{score}'",
                did_you_mean(score, compress_branches) or _listing("compress branches", compress_branches),
            )
        if score not in compress_branches:
            raise self.error(
                score_node,
                f"topk() score= must name a compress branch; "
                f"'{score}' is a {_branch_kind(self.branch_decls[score])} branch",
                _listing("compress branches", compress_branches),
            )
        stride = self.compression(score).stride
        if args["block"] is None:
            block = self.block_size
            where = node
        else:
            block = self.block_size_value(args["block"], "topk() argument 'block'", minimum=16, scope=scope)
            where = args["block"]
        if block % stride:
            raise self.error(
                where,
                f"topk() block ({block}) must be a multiple of the stride ({stride}) of compress branch '{score}'",
            )
        force = None
        if args["force"] is not None:
            force = self.keyset(args["force"], _Scope(block_level=True), 1, "topk() force=")
            # No sequence has more blocks than the longest the kernels run (past that, a bigger
            # force set adds nothing, and the hint would name a count the language refuses).
            most_blocks = -(-model.MAX_TOKENS // block)
            forced = min(_always_forced(force), most_blocks)
            if count < forced:
                raise self.error(
                    args["count"],
                    f"topk({count}) cannot hold the {forced} blocks force= always adds",
                    f"count includes the forced blocks: use at least topk({forced}, ...)",
                )
            # Forced blocks are always selected, so none may be left out where force= adds more
            # than `count` (the kernels would keep the lowest ids: a query's own block dropped).
            bound = _most_forced(force)
            if bound is None:
                raise self.error(
                    args["force"],
                    f"force= adds more blocks the longer the sequence (a stride), more than topk({count}) holds",
                    "bound it, e.g. `stride(2) & local(16)`, and count the bound in topk's count",
                )
            bound = min(bound, most_blocks)
            if count < bound:
                raise self.error(
                    args["count"],
                    f"topk({count}) cannot hold the up to {bound} blocks force= adds",
                    f"count includes the forced blocks: use at least topk({bound}, ...)",
                )
        return model.TopK(count=count, block=block, score=score, force=force)

    # ---- pattern-wide consistency ----------------------------------------------------------
    def check_gates_agree(self, branches: list[tuple[model.Branch, ast.IfClause | None]]) -> None:
        first: dict[str, tuple[model.Gate, str]] = {}
        for branch, _ in branches:
            if branch.gate is None:
                continue
            gate, owner = first.setdefault(branch.gate.name, (branch.gate, branch.name))
            if gate != branch.gate:
                clause = next(o for o in self.branch_decls[branch.name].options if isinstance(o, ast.GateClause))
                raise self.error(
                    clause,
                    f"gate '{gate.name}' has default {_show_default(branch.gate.default)} here "
                    f"but {_show_default(gate.default)} on branch '{owner}'",
                    "a gate's default must be the same on every branch that uses it",
                )

    def check_scores_kept(self, kept: list[model.Branch]) -> None:
        kept_names = {branch.name for branch in kept}
        for branch in kept:
            if isinstance(branch.keys, model.TopK) and branch.keys.score not in kept_names:
                condition = next(o for o in self.branch_decls[branch.keys.score].options if isinstance(o, ast.IfClause))
                raise self.error(
                    self.branch_decls[branch.name].value,
                    f"topk branch '{branch.name}' is scored by '{branch.keys.score}', "
                    f"which `if {condition.param.name}` drops",
                    f"add `if {condition.param.name}` to '{branch.name}' too, or keep '{branch.keys.score}'",
                )


# ---- helpers -------------------------------------------------------------------------------
def _is_keyset(value: object) -> bool:
    return isinstance(value, _KEYSET_TYPES)


def _is_number(value: object) -> bool:
    return type(value) in (int, float)


def _kind(value: object) -> str:
    if _is_keyset(value):
        return "a key set"
    return {bool: "a bool", int: "an integer", float: "a float"}[type(value)]


def _show(value: object) -> str:
    if type(value) is bool:
        return "true" if value else "false"
    return "a key set" if _is_keyset(value) else repr(value)


def _integer_hint(node: ast.Expr) -> str:
    """Why an expression that should be an integer made a float."""
    if isinstance(node, ast.Binary) and node.op == "/":
        return "use // for integer division"
    return "write integers: a decimal point, an exponent (1e2) or a float operand (7.5 // 2) makes a float"


def _show_default(default: float | None) -> str:
    return "none" if default is None else _show(default)


def _listing(what: str, names: list[str]) -> str:
    return f"{what}: " + ", ".join(names) if names else f"this pattern has no {what}"


def _branch_kind(decl: ast.Branch) -> str:
    value = decl.value
    return value.function if isinstance(value, ast.Call) and value.function in _DYNAMIC else "static"


def _python_scalar(value: object) -> object:
    """A numpy scalar (or any 0-d array, as configs and array code hand out) as its Python value,
    which override() then types like any other; other values as they are."""
    item = getattr(value, "item", None)
    return item() if callable(item) and getattr(value, "shape", None) == () else value


def _parse_override(text: str, kind: type) -> object:
    """-D text as a value of `kind`, or the text itself if it is not one (reported by the caller)."""
    text = text.strip()
    if kind is bool:
        return {"true": True, "false": False}.get(text, text)
    # ASCII digits only, as in the language (\d, int() and float() take any Unicode digit); as many as
    # int() converts, so that a number too large is told so (override() checks the range)
    if re.fullmatch(r"[+-]?[0-9]{1,4000}", text):
        return int(text)
    if kind is float and re.fullmatch(r"[+-]?([0-9]+\.[0-9]*|\.[0-9]+|[0-9]+)([eE][+-]?[0-9]{1,3})?", text):
        return float(text)
    return text


def _children(keys: model.KeySet) -> tuple[model.KeySet, ...]:
    if isinstance(keys, model.Union | model.Intersection):
        return keys.parts
    if isinstance(keys, model.Difference):
        return (keys.left, keys.right)
    return ()


def _measure(keys: model.KeySet) -> tuple[int, int]:
    """(nesting depth, node count as a tree) of a key set. Iterative, and each shared sub-set
    is visited once, so a set built by repeatedly inlining a branch costs no more than its DAG."""
    sizes: dict[int, tuple[int, int]] = {}
    stack = [(keys, False)]
    while stack:
        node, children_done = stack.pop()
        if id(node) in sizes:
            continue
        children = _children(node)
        if children_done:
            below = [sizes[id(child)] for child in children]
            sizes[id(node)] = (1 + max((d for d, _ in below), default=0), 1 + sum(n for _, n in below))
        else:
            stack.append((node, True))
            stack.extend((child, False) for child in children)
    return sizes[id(keys)]


def _block_atoms(keys: model.KeySet) -> set[model.BlockAtom]:
    """The distinct block atoms of a key set, each of which lowering numbers by a bit of a table
    entry. Walked as a tree, which the node limit checked first keeps small."""
    atoms = set()
    stack = [keys]
    while stack:
        node = stack.pop()
        if isinstance(node, model.BlockAtom):
            atoms.add(node)
        stack.extend(_children(node))
    return atoms


def _contains_window(keys: model.KeySet) -> bool:
    return isinstance(keys, model.Window) or any(_contains_window(child) for child in _children(keys))


def _most_forced(force: model.KeySet) -> int | None:
    """At most how many blocks `force` adds to a query block's selection, None where that grows
    with the sequence (a stride that no & bounds): _always_forced's count of local, global and
    blocks parts (their overlaps only lower it), each random(...)'s count, an intersection's
    smallest bound and a difference's left operand's."""
    if isinstance(force, model.Stride):
        return None
    if isinstance(force, model.Random):
        return force.count
    if isinstance(force, model.Intersection):
        return min((b for b in map(_most_forced, force.parts) if b is not None), default=None)
    if isinstance(force, model.Difference):
        return _most_forced(force.left)
    parts = force.parts if isinstance(force, model.Union) else (force,)
    atoms = model.Local | model.Global | model.Blocks
    counted = tuple(p for p in parts if isinstance(p, atoms))
    others = [_most_forced(p) for p in parts if not isinstance(p, atoms)]
    if None in others:
        return None
    return _always_forced(model.Union(counted)) + sum(others)


def _always_forced(force: model.KeySet) -> int:
    """How many blocks `force` adds to every query block's selection, as far as that can be
    counted statically: its local(...) parts (selection is causal, so the blocks after the
    query's own never count) plus its global(...) and blocks(...) ids, which lie before a
    far-enough query block. Other parts (stride, random, & and -) count 0."""
    parts = force.parts if isinstance(force, model.Union) else (force,)
    forced = max((p.before for p in parts if isinstance(p, model.Local)), default=0)
    first = max((p.first for p in parts if isinstance(p, model.Global)), default=0)
    ids = {i for p in parts if isinstance(p, model.Blocks) for i in p.ids if i >= first}
    return forced + first + len(ids)
