"""Index arrays the Triton kernels read, built on device in JAX (jit-safe, no host round trip).

Kernels address the batch as N = B * T packed rows ([N, H, D] views of q, k, v). A sequence is
a range of rows [start, end): without cu_seqlens each batch row is one, with cu_seqlens they are
its offsets. Key blocks are counted per sequence from its first row, so a sequence's last block
may be short and no block crosses a boundary.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax


class Rows(NamedTuple):
    """Per packed row: its sequence's first row and end row, and its position in the sequence
    (-1 for rows past cu_seqlens[-1], which belong to no sequence)."""

    start: jax.Array  # [N] int32
    end: jax.Array  # [N] int32
    pos: jax.Array  # [N] int32
    seq: jax.Array  # [N] int32, the row's sequence (clamped for rows in none)


def sequence_offsets(cu_seqlens, batch: int, seq_len: int) -> jax.Array:
    """cu_seqlens as int32, or the offsets of the B batch rows when it is None."""
    if cu_seqlens is None:
        return jnp.arange(batch + 1, dtype=jnp.int32) * seq_len
    return jnp.asarray(cu_seqlens, jnp.int32)


def rows(offsets: jax.Array, total: int) -> Rows:
    row = jnp.arange(total, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(offsets[1:], row, side="right"), 0, offsets.shape[0] - 2).astype(jnp.int32)
    start = offsets[seq]
    inside = (row >= offsets[0]) & (row < offsets[-1])
    return Rows(start, offsets[seq + 1], jnp.where(inside, row - start, -1), seq)


class KeyBlocks(NamedTuple):
    """The key blocks of all sequences, sequence by sequence, padded to a static count."""

    first_row: jax.Array  # [num] int32; padding blocks have first_row == end_row (empty)
    end_row: jax.Array  # [num] int32, <= first_row + block
    seq_first: jax.Array  # [num_seqs + 1] int32: id of each sequence's first key block

    @property
    def count(self) -> int:
        return self.first_row.shape[0]


def key_blocks(offsets: jax.Array, total: int, block: int) -> KeyBlocks:
    num_seqs = offsets.shape[0] - 1
    lengths = jnp.maximum(offsets[1:] - offsets[:-1], 0)
    seq_first = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(-(-lengths // block)).astype(jnp.int32)])
    count = max((total + num_seqs * (block - 1)) // block, 1)  # >= sum of ceil(length / block)
    ids = jnp.arange(count, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(seq_first[1:], ids, side="right"), 0, num_seqs - 1)
    first = offsets[seq] + (ids - seq_first[seq]) * block
    used = ids < seq_first[-1]
    first = jnp.where(used, first, 0)
    end = jnp.where(used, jnp.minimum(first + block, offsets[seq + 1]), 0)
    return KeyBlocks(first.astype(jnp.int32), end.astype(jnp.int32), seq_first)


def clean_selection(block_indices, block_counts, row_info: Rows, block: int, causal: bool) -> jax.Array:
    """block_indices [N, HKV, S] with every ignored entry replaced by -1: entries past
    block_counts, negative ids, ids past the row's block (causal) or past its sequence's last
    block, repeats of an earlier entry (a block is read once), and every entry of a row in no
    sequence. Each kept entry names a block holding at least one key its row sees."""
    entry = jnp.arange(block_indices.shape[-1])
    last = row_info.pos if causal else row_info.end - row_info.start - 1
    last_block = jnp.where(row_info.pos >= 0, last // block, -1)
    used = (entry < block_counts[..., None]) & (block_indices >= 0) & (block_indices <= last_block[:, None, None])
    repeated = jnp.any(
        (block_indices[..., :, None] == block_indices[..., None, :]) & (entry[:, None] > entry[None, :]), axis=-1
    )
    return jnp.where(used & ~repeated, block_indices, -1).astype(jnp.int32)


class PairLists(NamedTuple):
    """The selection transposed: per (KV head, key block), the rows that selected it.

    tokens[offsets[h, b] : offsets[h, b + 1]] are the rows, ascending, whose selection for KV
    head h holds key block b (a KeyBlocks id)."""

    tokens: jax.Array  # [HKV * N * S] int32
    offsets: jax.Array  # [HKV, num key blocks + 1] int32


def selection_by_key_block(selected: jax.Array, row_info: Rows, blocks: KeyBlocks) -> PairLists:
    """Transpose cleaned selections [N, HKV, S] (clean_selection) into pair lists, on device:
    number every (row, entry) pair by its key block, stable-sort by that number, and find each
    block's range by binary search. Deterministic: no atomics, rows stay in ascending order."""
    total, heads_kv, entries = selected.shape
    absent = blocks.count  # sorts after every real block
    block_id = jnp.where(selected >= 0, blocks.seq_first[row_info.seq][:, None, None] + selected, absent)
    keys = block_id.transpose(1, 0, 2).reshape(heads_kv, total * entries)
    tokens = jnp.broadcast_to(jnp.repeat(jnp.arange(total, dtype=jnp.int32), entries), keys.shape)
    keys, tokens = lax.sort((keys, tokens), dimension=1, is_stable=True, num_keys=1)
    bounds = jnp.arange(blocks.count + 1, dtype=keys.dtype)
    offsets = jax.vmap(lambda k: jnp.searchsorted(k, bounds, side="left"))(keys).astype(jnp.int32)
    offsets = offsets + (jnp.arange(heads_kv, dtype=jnp.int32) * (total * entries))[:, None]
    return PairLists(tokens.reshape(-1), offsets)
