"""The meaning of `random(count, seed)`: which key blocks a query block draws.

Query block qb draws `count` distinct key blocks among its candidates [0, limit), where
limit = qb + 1 in a causal pattern and the number of key blocks of the planned length
otherwise (all of them when there are at most `count`). The draw is Floyd's algorithm over a
counter-based hash of (seed, qb, step), so any row can be drawn on its own, in O(count^2),
without drawing the rows before it.

`draw_row` is the specification (plain Python, one row); `draw_rows` computes the same for
all rows at once with numpy and is what tables use. Tests hold them equal.
"""

from __future__ import annotations

import numpy as np

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _mix(x: int) -> int:
    """splitmix64's finaliser on a Python int."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK64
    return x ^ (x >> 31)


def _counter(seed: int, row: int, step: int) -> int:
    return (seed * _GOLDEN + row * 0xD1B54A32D192ED03 + step * 0xAF251AF3B0F025B5) & _MASK64


def draw_row(row: int, limit: int, count: int, seed: int) -> list[int]:
    """Key blocks drawn by query block `row` among [0, limit), ascending."""
    if limit <= count:
        return list(range(limit))
    chosen: set[int] = set()
    for j in range(limit - count, limit):
        pick = _mix(_counter(seed, row, j)) % (j + 1)
        chosen.add(j if pick in chosen else pick)
    return sorted(chosen)


def _mix_array(x: np.ndarray) -> np.ndarray:
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def draw_rows(rows: np.ndarray, limits: np.ndarray, count: int, seed: int) -> np.ndarray:
    """[len(rows), count] int32: query block rows[i]'s draw among [0, limits[i]), -1 padded
    where it has fewer than `count` candidates. Entries within a row are not sorted."""
    limits = np.asarray(limits, dtype=np.int64)
    rows = np.asarray(rows, dtype=np.uint64)
    out = np.full((len(limits), count), -1, dtype=np.int64)
    short = limits <= count
    take_all = np.arange(count)[None, :]
    out[short] = np.where(take_all < limits[short, None], take_all, -1)
    seed_term = np.uint64((seed * _GOLDEN) & _MASK64)
    with np.errstate(over="ignore"):
        for i in range(count):
            j = limits - count + i
            counter = seed_term + rows * np.uint64(0xD1B54A32D192ED03) + j.astype(np.uint64) * np.uint64(0xAF251AF3B0F025B5)
            pick = (_mix_array(counter) % np.maximum(j + 1, 1).astype(np.uint64)).astype(np.int64)
            taken = (out[:, :i] == pick[:, None]).any(axis=1)
            out[~short, i] = np.where(taken, j, pick)[~short]
    return out.astype(np.int32)
