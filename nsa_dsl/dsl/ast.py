"""Syntax tree of a `.nsa` file: what was written, where, and nothing more.

Built by `dsl.parser` from Lark's parse tree. Every node carries the 1-based `line` and
`column` where it starts (for operators: where the operator is), so the checker can point at
it. Names are not resolved and nothing is typed here; `dsl.check` gives the tree its meaning.
"""

from __future__ import annotations

from dataclasses import dataclass


# ---- expressions ---------------------------------------------------------------------------
@dataclass(frozen=True)
class IntLiteral:
    value: int
    line: int
    column: int


@dataclass(frozen=True)
class FloatLiteral:
    value: float
    line: int
    column: int


@dataclass(frozen=True)
class BoolLiteral:
    value: bool
    line: int
    column: int


@dataclass(frozen=True)
class Name:
    """A bare name: a param, or another branch (whose key set it stands for)."""

    name: str
    line: int
    column: int


@dataclass(frozen=True)
class Argument:
    """One argument of a call; `keyword` is None for a positional argument."""

    keyword: str | None
    value: Expr
    line: int
    column: int


@dataclass(frozen=True)
class Call:
    function: str
    arguments: tuple[Argument, ...]
    line: int
    column: int


@dataclass(frozen=True)
class Binary:
    """`left op right`, op one of | & + - * / //; the position is the operator's."""

    op: str
    left: Expr
    right: Expr
    line: int
    column: int


@dataclass(frozen=True)
class Negate:
    operand: Expr
    line: int
    column: int


Expr = IntLiteral | FloatLiteral | BoolLiteral | Name | Call | Binary | Negate


# ---- statements ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Identifier:
    """A name being declared or referred to by a statement (pattern, param, branch, gate)."""

    name: str
    line: int
    column: int


@dataclass(frozen=True)
class Param:
    name: Identifier
    value: Expr
    line: int
    column: int


@dataclass(frozen=True)
class BlockSize:
    size: Expr
    line: int
    column: int


@dataclass(frozen=True)
class Masking:
    """`causal` (causal=True) or `bidirectional` (causal=False)."""

    causal: bool
    line: int
    column: int


@dataclass(frozen=True)
class GateDecl:
    name: Identifier
    line: int
    column: int


@dataclass(frozen=True)
class GateClause:
    """`gate NAME [default NUMBER]` after a branch's expression."""

    name: Identifier
    default: IntLiteral | FloatLiteral | None
    line: int
    column: int


@dataclass(frozen=True)
class PerToken:
    line: int
    column: int


@dataclass(frozen=True)
class PerBlock:
    size: Expr
    line: int
    column: int


@dataclass(frozen=True)
class IfClause:
    param: Identifier
    line: int
    column: int


BranchOption = GateClause | PerToken | PerBlock | IfClause


@dataclass(frozen=True)
class Branch:
    name: Identifier
    value: Expr
    options: tuple[BranchOption, ...]
    line: int
    column: int


Statement = Param | BlockSize | Masking | GateDecl | Branch


@dataclass(frozen=True)
class Pattern:
    name: Identifier
    statements: tuple[Statement, ...]
    line: int
    column: int


@dataclass(frozen=True)
class Module:
    """A whole `.nsa` file. `source` is kept so errors can quote the offending line."""

    file: str
    source: str
    patterns: tuple[Pattern, ...]
