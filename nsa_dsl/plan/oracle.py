"""The pattern oracle: a static key set's token-level mask, straight from the language's meaning.

Builds the dense [T, T] boolean matrix (query rows, key columns) for one sequence by
evaluating every atom on every (t, s) pair. Quadratic and slow by design: it is the single
source of truth that block tables, kernels and references are tested against, so it shares
no code with them except the definition of `random`'s draw (plan.sampling.draw_row).
"""

from __future__ import annotations

import numpy as np

from ..dsl import model
from . import sampling
from .plan import StaticKeys


def token_mask(keys: model.KeySet | StaticKeys, block_size: int, causal: bool, seq_len: int) -> np.ndarray:
    """mask[t, s]: query t of a `seq_len`-token sequence sees key s."""
    if isinstance(keys, StaticKeys):
        keys = keys.keys
    t, s = np.meshgrid(np.arange(seq_len), np.arange(seq_len), indexing="ij")
    mask = _evaluate(keys, t, s, block_size, causal, seq_len)
    return mask & (s <= t) if causal else mask


def _evaluate(node: model.KeySet, t, s, block: int, causal: bool, seq_len: int) -> np.ndarray:
    qb, kb = t // block, s // block
    match node:
        case model.Window(left, right):
            return (s > t - left) & (s <= t + right)
        case model.Local(before, after):
            return (kb > qb - before) & (kb <= qb + after)
        case model.Stride(every, offset):
            return kb % every == offset
        case model.Global(first):
            return kb < first
        case model.Blocks(ids):
            return np.isin(kb, ids)
        case model.Random(count, seed):
            num_blocks = -(-seq_len // block)
            drawn = np.zeros((num_blocks, num_blocks), dtype=bool)
            for row in range(num_blocks):
                limit = row + 1 if causal else num_blocks
                drawn[row, sampling.draw_row(row, limit, count, seed)] = True
            return drawn[qb, kb]
        case model.Union(parts):
            return np.logical_or.reduce([_evaluate(p, t, s, block, causal, seq_len) for p in parts])
        case model.Intersection(parts):
            return np.logical_and.reduce([_evaluate(p, t, s, block, causal, seq_len) for p in parts])
        case model.Difference(left, right):
            return _evaluate(left, t, s, block, causal, seq_len) & ~_evaluate(right, t, s, block, causal, seq_len)
    raise TypeError(f"not a static key set: {node!r}")
