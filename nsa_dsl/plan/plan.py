"""The plan: what code generation and the runtime need to know about a pattern.

A `Plan` is independent of the sequence length: it is what generated kernels are specialised
on (and what the on-disk cache is keyed by). The length-dependent part, the static block
tables, is built per sequence length by `plan.tables.build_block_table` and passed to the
kernels as arrays.

Static branches are lowered to two things:
  * `block_atoms`: the block-level atoms of the branch's key set, in a fixed order; bit i of a
    table entry's `atom_bits` says whether atom i contains that (query block, key block) pair;
  * `mask`: the branch's key set rewritten over token-level windows and those atom bits. A
    kernel evaluates it only on tiles the table marks as partial; full tiles skip masking.
Causality and sequence bounds are not part of `mask`: kernels always apply them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Union as _U

from ..dsl.model import BlockAtom, Gate, KeySet


# ---- token-level mask expressions, evaluated inside kernels on partial tiles -------------
@dataclass(frozen=True)
class TokenWindow:
    """k_pos in (q_pos - left, q_pos + right]."""

    left: int
    right: int


@dataclass(frozen=True)
class AtomBit:
    """The tile's key block belongs to block atom `index` (bit `index` of atom_bits)."""

    index: int


@dataclass(frozen=True)
class AnyOf:
    parts: tuple[MaskExpr, ...]


@dataclass(frozen=True)
class AllOf:
    parts: tuple[MaskExpr, ...]


@dataclass(frozen=True)
class Without:
    left: MaskExpr
    right: MaskExpr


MaskExpr = _U[TokenWindow, AtomBit, AnyOf, AllOf, Without]


# ---- branches ------------------------------------------------------------------------------
@dataclass(frozen=True)
class StaticKeys:
    """A static key set, lowered: the source expression, its block atoms and its token mask."""

    keys: KeySet
    block_atoms: tuple[BlockAtom, ...]
    mask: MaskExpr


@dataclass(frozen=True)
class StaticBranch:
    name: str
    gate: Gate | None
    static: StaticKeys


@dataclass(frozen=True)
class CompressBranch:
    name: str
    gate: Gate | None
    block: int
    stride: int
    pool: str


@dataclass(frozen=True)
class TopKBranch:
    name: str
    gate: Gate | None
    count: int
    block: int
    score: str  # name of the CompressBranch whose probabilities score the blocks
    query_block: int  # 1 = per token; Q = one selection shared by Q consecutive queries
    force: StaticKeys | None


@dataclass(frozen=True)
class SelectBranch:
    """Per-token selection given by the caller: `block_indices [B,T,HKV,S]` of `block`-sized key
    blocks and `block_counts`. Causal: token t sees key s iff s <= t and s // block is among
    the first block_counts entries of t's row; out-of-range entries (< 0 or > t // block) are
    ignored. This is ejkernel's `native_sparse_attention` with explicit indices."""

    name: str
    gate: Gate | None
    block: int


BranchPlan = _U[StaticBranch, CompressBranch, TopKBranch, SelectBranch]


@dataclass(frozen=True)
class Plan:
    name: str
    block_size: int
    causal: bool
    params: tuple[tuple[str, int | float | bool], ...]
    branches: tuple[BranchPlan, ...]
    idle_gates: tuple[str, ...] = ()  # dsl.model.Pattern's: taken from a call and not read

    def __post_init__(self) -> None:
        # Selections are causal by definition (the DSL refuses compress/topk in bidirectional
        # patterns): every backend's selection kernels mask keys after the query unconditionally.
        selecting = [b.name for b in self.branches if isinstance(b, (CompressBranch, TopKBranch, SelectBranch))]
        if selecting and not self.causal:
            raise ValueError(f"plan {self.name!r}: branches {selecting} select blocks causally; the plan must be causal")

    @property
    def gates(self) -> tuple[Gate, ...]:
        return tuple(b.gate for b in self.branches if b.gate is not None)

    def branch(self, name: str) -> BranchPlan:
        for b in self.branches:
            if b.name == name:
                return b
        raise KeyError(name)

    def fitted(self, keys: int) -> Plan:
        """This plan on sequences of at most `keys` rows, with a block past them shrunk to the
        first power of two (at least 16) at or past them, and groups of queries (per block(Q))
        no larger. A block at or past every sequence's length is each sequence's only block (id
        0), whatever its size, so every key set and selection means the same; kernels that tile
        by the block then take tiles of the keys' length, not the language's 2**29 rows."""
        block = min(self.block_size, max(16, 1 << max(keys - 1, 0).bit_length()))
        if block == self.block_size:
            return self
        branches = tuple(replace(b, query_block=min(b.query_block, block)) if isinstance(b, TopKBranch) else b
                         for b in self.branches)
        return replace(self, block_size=block, branches=branches)
