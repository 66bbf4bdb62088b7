"""Static block tables, built analytically per sequence length.

A table lists, for every query block of a sequence of `seq_len` tokens, the key blocks the
static key set touches, in ascending order, each classified:

  full     every (query, key) pair of the tile is visible under the pattern and causality:
           kernels skip masking (sequence bounds are still applied: the last block of a
           sequence may be short);
  partial  kernels evaluate the branch's token mask (plan.StaticKeys.mask) on the tile.

Positions are local to a sequence, so one table serves every sequence of a packed batch
whose length is at most `seq_len` (entries past a sequence's end are skipped at run time).

Construction is O(#query blocks x entries per row) and vectorised: each atom yields its
candidate key blocks per row as a padded 2-D array (ranges, progressions, fixed lists,
samples), candidates are merged row-wise, and every atom is classified on the merged
(query block, key block) pairs with three-valued logic (0 empty, 1 partial, 2 full):
union = max, intersection = min, difference a - b = min(a, 2 - b). No T x T or even
blocks x blocks mask is ever formed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..dsl.model import Blocks, Difference, Global, Intersection, KeySet, Local, Random, Stride, Union, Window
from . import sampling
from .plan import StaticKeys


@dataclass(frozen=True, eq=False)
class BlockTable:
    block_size: int
    seq_len: int
    indices: np.ndarray  # [num_query_blocks, width] int32, ascending key blocks, -1 padded
    counts: np.ndarray  # [num_query_blocks] int32, valid entries per row
    full: np.ndarray  # [num_query_blocks, width] bool
    atom_bits: np.ndarray  # [num_query_blocks, width] uint8/16/32, bit i: block atom i holds

    @property
    def num_query_blocks(self) -> int:
        return self.indices.shape[0]

    @property
    def num_key_blocks(self) -> int:
        return -(-self.seq_len // self.block_size)

    @property
    def width(self) -> int:
        return self.indices.shape[1]


# Three-valued tile states.
EMPTY, PARTIAL, FULL = 0, 1, 2


# Query blocks handled per pass: small enough that a pass's arrays stay in cache.
_ROWS_PER_PASS = 256


def build_block_table(static: StaticKeys, block_size: int, causal: bool, seq_len: int) -> BlockTable:
    """The block table of a static key set for sequences of up to `seq_len` tokens."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    num_blocks = -(-seq_len // block_size)
    passes = [
        _build_rows(static, _Grid(num_blocks, block_size, causal, first, min(first + _ROWS_PER_PASS, num_blocks)))
        for first in range(0, num_blocks, _ROWS_PER_PASS)
    ]
    width = max(indices.shape[1] for indices, _, _ in passes)
    indices = np.full((num_blocks, width), -1, dtype=np.int32)
    full = np.zeros((num_blocks, width), dtype=bool)
    atom_bits = np.zeros((num_blocks, width), dtype=_bits_dtype(len(static.block_atoms)))
    for first, (part_indices, part_full, part_bits) in zip(range(0, num_blocks, _ROWS_PER_PASS), passes):
        rows, cols = slice(first, first + len(part_indices)), slice(0, part_indices.shape[1])
        indices[rows, cols], full[rows, cols], atom_bits[rows, cols] = part_indices, part_full, part_bits
    counts = (indices >= 0).sum(axis=1, dtype=np.int32)
    for array in (indices, counts, full, atom_bits):
        array.setflags(write=False)
    return BlockTable(block_size, seq_len, indices, counts, full, atom_bits)


def _build_rows(static: StaticKeys, grid: _Grid) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """indices (-1 padded), full and atom_bits of the grid's rows, as narrow as they fit."""
    indices = _sorted_unique_rows(grid.clip(_candidates(static.keys, grid)), grid.num_blocks)
    state, members = _classify_all(static, grid, indices)
    present = indices < grid.num_blocks
    emptied = (state == EMPTY) & present
    if emptied.any():  # only & and - empty a candidate tile; drop those and classify again
        indices = _sorted_unique_rows(np.where(emptied, grid.num_blocks, indices), grid.num_blocks)
        state, members = _classify_all(static, grid, indices)
        present = indices < grid.num_blocks
    full = (state == FULL) & present
    if grid.causal:
        full &= indices < grid.rows[:, None]  # the diagonal tile needs the causal mask
    bits = np.zeros(indices.shape, dtype=_bits_dtype(len(members)))
    for bit, member in enumerate(members):
        bits |= (member & present).astype(bits.dtype) << bits.dtype.type(bit)
    np.putmask(indices, ~present, -1)
    return indices, full, bits


def _bits_dtype(num_atoms: int) -> type:
    return np.uint8 if num_atoms <= 8 else np.uint16 if num_atoms <= 16 else np.uint32


class _Grid:
    """A range of query blocks of a table and what bounds their key blocks."""

    def __init__(self, num_blocks: int, block_size: int, causal: bool, first_row: int, end_row: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.causal = causal
        self.rows = np.arange(first_row, end_row, dtype=np.int32)
        # Last key block each query block may see.
        self.last = self.rows if causal else np.full_like(self.rows, num_blocks - 1)

    def clip(self, candidates: np.ndarray) -> np.ndarray:
        """Mark out-of-range candidates (negative, past the end, or after the query block in
        a causal pattern) as absent (= num_blocks)."""
        return np.where((candidates >= 0) & (candidates <= self.last[:, None]), candidates, self.num_blocks)

    def block_range(self, first: np.ndarray, last: np.ndarray) -> np.ndarray:
        """Per row, the key blocks first[r]..last[r], -1 padded."""
        first = np.maximum(first, 0)
        last = np.minimum(last, self.last)
        width = max(int((last - first).max(initial=-1)) + 1, 1)
        columns = first[:, None] + np.arange(width, dtype=np.int32)[None, :]
        return np.where(columns <= last[:, None], columns, -1)

    def draw(self, count: int, seed: int) -> np.ndarray:
        # No row has more candidates than the sequence has blocks, and a row with at most `count`
        # takes them all: a larger count draws the same, and would cost O(count) memory a row
        # and O(count^2) time.
        return sampling.draw_rows(self.rows, self.last + 1, min(count, self.num_blocks), seed)


def _candidates(node: KeySet, grid: _Grid) -> np.ndarray:
    """Key blocks that may belong to `node`, per query block ([num_blocks, w] int32, -1
    padded). A superset is fine (classification decides); a missing block would be a bug."""
    rows, b = grid.rows, grid.block_size
    match node:
        case Window(left, right):
            return grid.block_range((rows * b - left + 1) // b, (rows * b + b - 1 + right) // b)
        case Local(before, after):
            return grid.block_range(rows - before + 1, rows + after)
        case Global(first):
            return grid.block_range(np.zeros_like(rows), np.full_like(rows, first - 1))
        case Stride(every, offset):
            steps = max((int(grid.last.max(initial=0)) - offset) // every + 1, 1)
            columns = (offset + every * np.arange(steps, dtype=np.int32))[None, :]
            return np.where(columns <= grid.last[:, None], columns, -1)
        case Blocks(ids):
            return np.broadcast_to(np.asarray(ids, dtype=np.int32)[None, :], (len(grid.rows), len(ids)))
        case Random(count, seed):
            return grid.draw(count, seed)
        case Union(parts):
            return np.concatenate([_candidates(x, grid) for x in parts], axis=1)
        case Intersection(parts):
            return min((_candidates(x, grid) for x in parts), key=lambda c: c.shape[1])
        case Difference(left, _):
            return _candidates(left, grid)
    raise TypeError(f"not a static key set: {node!r}")


def _sorted_unique_rows(candidates: np.ndarray, absent: int) -> np.ndarray:
    """Each row ascending without repeats, absent entries (== `absent`) moved to the end and
    trimmed to the longest row (at least one column)."""
    # A row is the key sets' candidates side by side, each already ascending: the stable sort
    # (timsort for int32) merges such runs in near-linear time (1M tokens: 0.21 -> 0.08 s of sorting).
    merged = np.sort(candidates, axis=1, kind="stable")
    repeat = np.zeros(merged.shape, dtype=bool)
    np.equal(merged[:, 1:], merged[:, :-1], out=repeat[:, 1:])
    if repeat.any():
        merged[repeat] = absent
        merged.sort(axis=1, kind="stable")
    width = max(int((merged < absent).sum(axis=1).max(initial=0)), 1)
    return np.ascontiguousarray(merged[:, :width])


def _classify_all(static: StaticKeys, grid: _Grid, kb: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    """The three-valued state of every (row, kb) tile under the key set (causality aside), and
    each block atom's membership, in `static.block_atoms` order."""
    qb = grid.rows[:, None]
    members = [_member(atom, grid, qb, kb) for atom in static.block_atoms]
    lookup = dict(zip(static.block_atoms, members))

    def state(node: KeySet) -> np.ndarray:
        match node:
            case Window(left, right):
                return _window_state(left, right, grid.block_size, qb, kb)
            case Union(parts):
                return np.maximum.reduce([state(x) for x in parts])
            case Intersection(parts):
                return np.minimum.reduce([state(x) for x in parts])
            case Difference(left, right):
                return np.minimum(state(left), FULL - state(right))
            case _:
                return lookup[node].view(np.uint8) * np.uint8(FULL)

    return state(static.keys), members


def _window_state(left: int, right: int, b: int, qb: np.ndarray, kb: np.ndarray) -> np.ndarray:
    """Queries t in [t0, t1] see keys s in [s0, s1] = [kb*b, kb*b + b - 1] where
    t - left < s <= t + right. Some pair qualifies iff s1 >= t0 - left + 1 and s0 <= t1 + right;
    every pair does iff s0 >= t1 - left + 1 and s1 <= t0 + right. Solved for kb, each bound
    is a per-row threshold, so the tile test is two comparisons."""
    t0, t1 = qb * b, qb * b + b - 1
    some = (kb >= (t0 - left + 1) // b) & (kb <= (t1 + right) // b)
    full = (kb >= -((left - 1 - t1) // b)) & (kb <= (t0 + right - b + 1) // b)
    return some.view(np.uint8) + full.view(np.uint8)


def _member(atom: KeySet, grid: _Grid, qb: np.ndarray, kb: np.ndarray) -> np.ndarray:
    """Whether each key block belongs to a block atom, for its row's query block."""
    match atom:
        case Local(before, after):
            return (kb > qb - before) & (kb <= qb + after)
        case Stride(every, offset):
            return kb % every == offset
        case Global(first):
            return kb < first
        case Blocks(ids):
            lookup = np.zeros(grid.num_blocks + 1, dtype=bool)
            lookup[[i for i in ids if i < grid.num_blocks]] = True
            return lookup[kb]
        case Random(count, seed):
            drawn = grid.draw(count, seed)
            return (drawn[:, :, None] == kb[:, None, :]).any(axis=1)
    raise TypeError(f"not a block atom: {atom!r}")
