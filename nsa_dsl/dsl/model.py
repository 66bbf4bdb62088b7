"""The checked meaning of a `.nsa` pattern: frozen, typed, fully resolved values.

`dsl.check` turns the syntax tree into these; nothing downstream sees syntax. All sizes are
validated positive ints, all names validated identifiers, parameters substituted, branch
references inlined (after the cycle check).

Conventions, for a query at token position t of its own sequence and a key at position s
(both counted from the start of that sequence), with block size B, qb = t // B, kb = s // B:

  Window(left, right)   s in (t - left, t + right]     -- `left` keys at or before t, `right` after
  Local(before, after)  kb in (qb - before, qb + after] -- the same, in whole key blocks
  Stride(every, offset) kb % every == offset
  Global(first)         kb < first
  Blocks(ids)           kb in ids
  Random(count, seed)   `count` distinct key blocks drawn per query block (plan.sampling)

A `causal` pattern additionally requires s <= t; every pattern requires s to lie in t's own
sequence. Keys are combined with Union (|), Intersection (&) and Difference (-).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union as _U


@dataclass(frozen=True)
class Window:
    left: int
    right: int = 0


@dataclass(frozen=True)
class Local:
    before: int
    after: int = 0


@dataclass(frozen=True)
class Stride:
    every: int
    offset: int = 0


@dataclass(frozen=True)
class Global:
    first: int


@dataclass(frozen=True)
class Blocks:
    ids: tuple[int, ...]  # sorted, unique, >= 0


@dataclass(frozen=True)
class Random:
    count: int
    seed: int


@dataclass(frozen=True)
class Union:
    parts: tuple[KeySet, ...]


@dataclass(frozen=True)
class Intersection:
    parts: tuple[KeySet, ...]


@dataclass(frozen=True)
class Difference:
    left: KeySet
    right: KeySet


BlockAtom = _U[Local, Stride, Global, Blocks, Random]
"""Atoms whose membership depends only on (query block, key block)."""

# Distinct block atoms one key set may hold: lowering names each by a bit of an int32 block-table
# entry, and the sign bit stays clear.
MAX_BLOCK_ATOMS = 31

KeySet = _U[Window, Local, Stride, Global, Blocks, Random, Union, Intersection, Difference]


@dataclass(frozen=True)
class Compress:
    """Attention over pooled keys/values: compressed key i pools tokens [i*stride, i*stride + block)."""

    block: int
    stride: int
    pool: str = "mean"


@dataclass(frozen=True)
class TopK:
    """The `count` highest-scoring selection blocks of size `block`, scored by branch `score`
    (a Compress branch), plus the `force`d blocks (a block-level KeySet, or None)."""

    count: int
    block: int
    score: str
    force: KeySet | None = None


@dataclass(frozen=True)
class Gate:
    """A named gate input `[B, T, HQ]`. `default` is the weight used when the caller passes none;
    None means the branch is skipped when its gate is not passed."""

    name: str
    default: float | None = None


@dataclass(frozen=True)
class Branch:
    name: str
    keys: KeySet | Compress | TopK
    gate: Gate | None = None  # None: weight 1, always computed
    query_block: int = 1  # selection granularity: 1 = per token, Q = one selection per Q queries


@dataclass(frozen=True)
class Pattern:
    name: str
    block_size: int
    causal: bool
    params: tuple[tuple[str, int | float | bool], ...]
    branches: tuple[Branch, ...]
    # Gates the file names that no kept branch uses (declared with `gate`, or their branches
    # dropped by `if`): a call may pass them, so that one model serves every setting of its params.
    idle_gates: tuple[str, ...] = ()


BUILTIN_GATES = ("g_cmp", "g_slc", "g_swa")
# The longest sequence the kernels run: their int32 positions plus a clamped extent stay in range.
# A block may be no longer (it would be a sequence's one block at any length they run).
MAX_TOKENS = 1 << 29
