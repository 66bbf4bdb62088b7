"""Index arrays the kernels read (every backend: rows, the rule for which selection entries
count, transposed selections and tables).

Kernels address the batch as N = B * T packed rows ([N, H, D] views of q, k, v). A sequence is
a range of rows [start, end): without cu_seqlens each batch row is one, with cu_seqlens they are
its offsets. Blocks are counted per sequence from its first row, so a sequence's last block may
be short and no block crosses a boundary.

What depends on the data (sequence offsets, selections) is built on device in JAX, jit-safe and
without a host round trip; what depends only on the pattern and the length (the transposed
block tables of static branches) is built once on the host and cached.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..plan.plan import StaticKeys
from .promotion import allowing_rank_promotion


def matmul_precision(dtype) -> lax.Precision:
    """The precision of JAX-level matrix products (the XLA engine's, Pallas' tiles) for inputs of
    `dtype`. XLA's default multiplies float32 in tf32 on NVIDIA GPUs and in one bfloat16 pass on
    TPUs (~5e-4 and ~4e-3 relative): float32 inputs get float32 products, as Triton's kernels
    compute them ("ieee"); 16-bit inputs lose nothing to the default, which is faster."""
    return lax.Precision.HIGHEST if jnp.dtype(dtype).itemsize >= 4 else lax.Precision.DEFAULT


def varying_axes(x) -> frozenset:
    """The mesh axes a value varies over inside `jax.shard_map` (empty outside)."""
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)  # jax >= 0.10; before it, aval.vma
    return manual.varying if manual is not None else getattr(aval, "vma", frozenset())


def _inputs_axes(inputs) -> frozenset:
    return frozenset().union(*(varying_axes(x) for x in inputs if isinstance(x, jax.Array)))


# Inside `jax.shard_map` a custom_vjp's gradients must carry the manual axes of its arguments,
# and the results of a Triton or Pallas call (like a pure_callback's) carry none of their own:
# the two helpers below give a kernel's outputs the axes its inputs vary over. Outside
# shard_map there are none and nothing changes.


def varying_like(outputs, inputs) -> list:
    """`outputs` of a kernel call, each marked as varying over the mesh axes of `inputs`."""
    axes = _inputs_axes(inputs)
    return [lax.pcast(out, tuple(sorted(axes - varying_axes(out))), to="varying") for out in outputs]


def varying_shape(shape: jax.ShapeDtypeStruct, inputs) -> jax.ShapeDtypeStruct:
    """An output shape declared as varying over the mesh axes of `inputs` (pallas_call's
    out_shape: inside shard_map it must say)."""
    axes = _inputs_axes(inputs)
    if not axes:
        return shape
    example = next(x for x in inputs if isinstance(x, jax.Array) and varying_axes(x))
    manual = getattr(jax.typeof(example), "manual_axis_type", None)
    typed = {"manual_axis_type": manual.update(varying=axes)} if manual is not None else {"vma": axes}
    return jax.ShapeDtypeStruct(shape.shape, shape.dtype, **typed)


def dq_scale(scale):
    """What the Triton and Pallas dq kernels multiply their float32 g = sum_j ds_ij k_j by before
    they store dq: the softmax scale, and 1 where it is 0. Scores are scale * q.k, so dq = scale * g,
    and d loss / d scale = sum(q . g), which scale_gradients reads back from the stored dq: at a
    scale of 0 dq would hold nothing to read it from (dq itself is 0 there: scale_gradients
    zeroes it). (Triton's kernels compute the same in their own dq_scale.)"""
    return jnp.where(scale == 0, 1.0, scale)


def scale_gradients(q, d_q, scale):
    """(d_q, d loss / d softmax_scale) from the dq kernels' d_q = dq_scale(scale) * g: d_q, with
    zeros where the scale is 0, and sum(q . g) in float32. A constant scale folds the select at
    compile time. Inside `jax.shard_map` each device holds its queries' part of the sum: the
    parts are added over the mesh axes the queries vary over and the scale does not."""
    total = jnp.sum(q.astype(jnp.float32) * d_q.astype(jnp.float32))
    d_scale = total / dq_scale(scale)
    shared = tuple(sorted(varying_axes(d_scale) - varying_axes(scale)))
    return jnp.where(scale == 0, jnp.zeros((), d_q.dtype), d_q), lax.psum(d_scale, shared) if shared else d_scale


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


def search_sorted(sorted_values: jax.Array, x: jax.Array, side: str) -> jax.Array:
    """jnp.searchsorted(sorted_values, x, side) in straight-line code. Its default method is a
    while loop, which XLA runs on a GPU as one kernel launch (and a loop-condition check) per
    halving of `sorted_values`: 4 to search the offsets of 8 sequences, and in a decoding step of
    8 sequences these loops were 20 of its 53 kernels (ncu, H200, session 19)."""
    return jnp.searchsorted(sorted_values, x, side=side, method="scan_unrolled")


def count_below(sorted_values: jax.Array, count: int) -> jax.Array:
    """[count + 1] int32: for each b in [0, count], how many of ascending int32 `sorted_values` lie
    below b (jnp.searchsorted(sorted_values, arange(count + 1), side="left"))."""
    return search_sorted(sorted_values, jnp.arange(count + 1, dtype=jnp.int32), side="left").astype(jnp.int32)


def rows(offsets: jax.Array, total: int) -> Rows:
    """The Rows of packed rows [0, total)."""
    return rows_at(offsets, jnp.arange(total, dtype=jnp.int32))


def in_sequences(offsets: jax.Array, row: jax.Array) -> jax.Array:
    """Whether each of the packed rows `row` is in one of the sequences (not past cu_seqlens[-1])."""
    return (row >= offsets[0]) & (row < offsets[-1])


def rows_at(offsets: jax.Array, row: jax.Array) -> Rows:
    """The Rows of the packed rows `row` (any shape, int32)."""
    seq = jnp.clip(search_sorted(offsets[1:], row, side="right"), 0, offsets.shape[0] - 2).astype(jnp.int32)
    start = offsets[seq]
    inside = in_sequences(offsets, row)
    return Rows(start, offsets[seq + 1], jnp.where(inside, row - start, -1), seq)


class QueryRows(NamedTuple):
    """The key rows a call's queries are. All of them, unless the queries are a shard of the
    sequence axis (context parallelism, a decoding step): then sequence s's query rows are its
    key rows [low[s], high[s]), and query row i of it is key row i + shift[s]. One shard of
    packed rows has one shift; a shard of each of B batch rows (rows [first, first + count) of
    every one) has a shift per batch row, so that one launch serves them all."""

    low: jax.Array  # [num_seqs] int32 (may lie outside the sequence: sequence_blocks clips)
    high: jax.Array  # [num_seqs] int32
    shift: jax.Array  # [num_seqs] int32
    key_rows: jax.Array  # [count] int32, the key row of each query row

    @property
    def count(self) -> int:
        return self.key_rows.shape[0]

    @classmethod
    def shard(cls, first, count: int, num_seqs: int) -> QueryRows:
        """Query row i is key row first + i (`first` may be traced): all rows with first 0 and
        count the keys."""
        first = jnp.asarray(first, jnp.int32)
        each = jnp.full((num_seqs,), first, jnp.int32)
        return cls(each, each + count, each, first + jnp.arange(count, dtype=jnp.int32))

    @classmethod
    def of_batch_rows(cls, first, count: int, batch: int, seq_len: int) -> QueryRows:
        """Rows [first, first + count) of each of `batch` rows of seq_len keys, batch row after
        batch row (first: a scalar, or one per batch row [batch])."""
        first = jnp.asarray(first, jnp.int32)
        row = jnp.arange(batch, dtype=jnp.int32)
        low = row * seq_len + first
        shift = low - row * count
        return cls(low, low + count, shift, jnp.arange(batch * count, dtype=jnp.int32) + jnp.repeat(shift, count))

    def rows(self, offsets: jax.Array) -> Rows:
        """The Rows of the query rows (of the sequences `offsets`): rows(offsets, N) of their key
        rows, computed for them only (a decoding step's few, not all N)."""
        return rows_at(offsets, self.key_rows)

    def own(self, x):
        """x (arrays, or a tuple of them) [N, ...] per key row -> [count, ...] for the query rows."""
        return jax.tree.map(lambda a: jnp.take(a, self.key_rows, axis=0, mode="clip"), x)

    def of_blocks(self, blocks: Blocks) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Per block of `blocks`: its sequence's query rows' (low, high, shift). A padding block
        has no query rows, and the shift that makes its first row query row 0: kernels clamp the
        rows they read into a block, and its first row must be one that exists."""
        seq = blocks.sequences()
        used = blocks.first_row < blocks.end_row
        start = blocks.seq_start
        return (jnp.where(used, self.low[seq], start), jnp.where(used, self.high[seq], start),
                jnp.where(used, self.shift[seq], start))


def query_rows(query_offset, batch: int, q_len: int, seq_len: int, offsets: jax.Array) -> QueryRows:
    """The key rows of a call's queries [B, Tq] against keys [B, T]: rows [query_offset,
    query_offset + Tq) of every batch row (of the packed rows with cu_seqlens, where B is 1);
    query_offset a scalar, or one per batch row [B]."""
    if batch == 1:
        return QueryRows.shard(jnp.asarray(query_offset, jnp.int32).reshape(()), q_len, offsets.shape[0] - 1)
    return QueryRows.of_batch_rows(query_offset, q_len, batch, seq_len)


class Blocks(NamedTuple):
    """The blocks of all sequences, sequence by sequence, padded to a static count: the key
    blocks of the backward kernels and the query tiles of static branches. Blocks count from
    their sequence's first row; taken for a shard of the queries (QueryRows), only those holding
    one of its rows, each clipped to them."""

    first_row: jax.Array  # [num] int32; padding blocks have first_row == end_row (empty)
    end_row: jax.Array  # [num] int32, <= first_row + block
    seq_start: jax.Array  # [num] int32, first row of the block's sequence
    seq_end: jax.Array  # [num] int32, end row of the block's sequence
    seq_first: jax.Array  # [num_seqs + 1] int32: id of each sequence's first block
    seq_first_block: jax.Array  # [num_seqs] int32: that block's number in its sequence

    @property
    def count(self) -> int:
        return self.first_row.shape[0]

    def sequences(self) -> jax.Array:
        """[num] int32: the sequence of each block (padding blocks: the last one)."""
        ids = jnp.arange(self.count, dtype=jnp.int32)
        seq = search_sorted(self.seq_first[1:], ids, side="right")
        return jnp.clip(seq, 0, self.seq_first.shape[0] - 2).astype(jnp.int32)

    def block_id(self, seq, block_number):
        """The id of block `block_number` (counted from its sequence's start) of sequence `seq`."""
        return self.seq_first[seq] + block_number - self.seq_first_block[seq]


def sequence_blocks(offsets: jax.Array, total: int, block: int, queries: QueryRows | None = None) -> Blocks:
    """The blocks of `block` rows of the sequences in rows [0, total); with `queries`, those
    holding a query row, clipped to the query rows. Padding blocks are empty at the first query
    row (whose sequence starts there), so that a kernel clamping into one reads a row that
    exists."""
    num_seqs = offsets.shape[0] - 1
    starts = offsets[:-1]
    ends = jnp.maximum(offsets[1:], starts)
    if queries is None:
        low, high = 0, total
        count = max((total + num_seqs * (block - 1)) // block, 1)  # >= sum of ceil(length / block)
    else:
        low, high = queries.low, queries.high
        # A sequence's part among the query rows, unaligned at both ends, spans at most
        # (length + 2 * block - 2) // block blocks.
        count = max((queries.count + num_seqs * (2 * block - 2)) // block, 1)
    part_low, part_high = jnp.clip(starts, low, high), jnp.clip(ends, low, high)
    first_block = (part_low - starts) // block
    end_block = jnp.where(part_high > part_low, -(-(part_high - starts) // block), first_block)
    seq_first = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(end_block - first_block).astype(jnp.int32)])
    ids = jnp.arange(count, dtype=jnp.int32)
    seq = jnp.clip(search_sorted(seq_first[1:], ids, side="right"), 0, num_seqs - 1)
    used = ids < seq_first[-1]
    block_first = starts[seq] + (first_block[seq] + ids - seq_first[seq]) * block
    padding = jnp.asarray(low if queries is None else queries.key_rows[0], jnp.int32)
    first = jnp.where(used, jnp.maximum(block_first, part_low[seq]), padding)
    end_row = jnp.where(used, jnp.minimum(block_first + block, part_high[seq]), padding)
    start = jnp.where(used, starts[seq], padding)
    end = jnp.where(used, ends[seq], padding)
    first, end_row, start, end = (x.astype(jnp.int32) for x in (first, end_row, start, end))
    return Blocks(first, end_row, start, end, seq_first, first_block.astype(jnp.int32))


def fitted_block(block: int, keys: int, multiple: int = 1) -> int:
    """A block of `block` rows as kernels take it where no sequence is longer than `keys` rows:
    at most the first multiple of `multiple` at or past `keys`. A longer block is every sequence's
    only block (id 0, holding each of its keys), as that one is, and tiles, gathers or scores of its
    length would only pad it: the language allows blocks of 2**29 rows, which ran out of memory,
    or made tiles no kernel compiles, on a sequence of 40."""
    return min(block, -(-keys // multiple) * multiple)


def fitted_query_block(query_block: int, keys: int) -> int:
    """The groups of `query_block` queries (per block(Q), a power of two) of a selection where no
    sequence is longer than `keys` rows: at most the first power of two at or past `keys`. A
    longer group is every sequence's only one, as that one is, and took tiles of its rows (2**20
    of them for per block(1048576), on a sequence of 40)."""
    return min(query_block, 1 << max(keys - 1, 0).bit_length())


def fitted_selection(count: int, block: int, stride: int, keys: int) -> tuple[int, int]:
    """(entries, block) of a top-`count` selection of `block`-row blocks, scored from compressed
    keys of `stride` rows, where no sequence is longer than `keys` rows: the block fitted
    (fitted_block; a multiple of the stride, as Eq. 9's units are), and no more entries than
    that leaves blocks (a count past them, up to the language's 2**31 - 1, made arrays too large
    to shape, or overflowed int32 offsets)."""
    block = fitted_block(block, keys, stride)
    return min(count, -(-keys // block)), block


def padded_entries(selected: jax.Array, count: int, blocks: int) -> jax.Array:
    """selected [..., S] with -1 entries up to a top-`count`'s width among `blocks` key blocks,
    min(count, blocks) (>= S): no row selects more blocks than there are, and a count of 2**31 - 1
    (every block) would ask for that many columns."""
    width = max(min(count, blocks), selected.shape[-1])
    return jnp.pad(selected, [(0, 0)] * (selected.ndim - 1) + [(0, width - selected.shape[-1])], constant_values=-1)


def clean_selection(block_indices, block_counts, row_info: Rows, block: int) -> jax.Array:
    """block_indices [N, HKV, S] with every ignored entry replaced by -1: entries past
    block_counts, negative ids, ids past the row's block (selection is causal), repeats of an
    earlier entry (a block is read once), and every entry of a row in no sequence. Each kept
    entry names a block holding at least one key its row sees."""
    entry = jnp.arange(block_indices.shape[-1])
    last_block = jnp.where(row_info.pos >= 0, row_info.pos // block, -1)
    used = (entry < block_counts[..., None]) & (block_indices >= 0) & (block_indices <= last_block[:, None, None])
    repeated = jnp.any(
        (block_indices[..., :, None] == block_indices[..., None, :]) & (entry[:, None] > entry[None, :]), axis=-1
    )
    return jnp.where(used & ~repeated, block_indices, -1).astype(jnp.int32)


class PairLists(NamedTuple):
    """The selection transposed: per (KV head, key block), the rows that selected it.

    tokens[offsets[h, b] : offsets[h, b + 1]] are the rows, ascending, whose selection for KV
    head h holds key block b (a Blocks id); token_entries[i], where asked for, is tokens[i] * S +
    the entry of row tokens[i]'s selection that names the block (the sort's own values: kernels
    that read both decode one load). A row is a token, or whatever the selections belong to (a
    `per block(Q)` group of tokens). Where asked for, segments cut every list (the
    last, of entries naming no block, included) by rows into spans of `segment_rows` rows:
    segments[(h * (num key blocks + 1) + b) * R + r] is where the rows [r * segment_rows,
    (r + 1) * segment_rows) of list (h, b) begin, R = ceil(N / segment_rows), and its last element
    the number of pairs."""

    tokens: jax.Array  # [HKV * N * S] int32
    offsets: jax.Array  # [HKV, num key blocks + 1] int32
    token_entries: jax.Array | None = None  # [HKV * N * S] int32
    segments: jax.Array | None = None  # [HKV * (num key blocks + 1) * R + 1] int32


# Pair lists sort each (row, entry) pair by its list alone, stably: a radix sort keeps a list's
# pairs in input order, rows ascending. Where the lists are fewer than SHORT_KEY_LISTS their ids
# sort as uint16 keys: XLA's radix sort (cub) then takes 2 passes of 8 bits, where a key of list
# and row in one int32 (~28 bits at 64k tokens) took 4.
SHORT_KEY_LISTS = 2**16


def selection_by_key_block(
    selected: jax.Array, seq: jax.Array, blocks: Blocks, token_entries: bool = False, segment_rows: int | None = None,
    search=count_below,
) -> PairLists:
    """Transpose cleaned selections [N, HKV, S] (clean_selection) of rows of the sequences `seq`
    [N] into pair lists, on device: number every (row, entry) pair by its (KV head, key block)
    list, sort, and find each list's range by binary search (`search`, as count_below: a backend's
    kernel may take its place); with `token_entries`, each pair's row * S + entry too; with
    `segment_rows`, the lists' segments of that many rows. Deterministic: no atomics, rows stay in
    ascending order."""
    total, heads_kv, entries = selected.shape
    lists_per_head = blocks.count + 1  # the last: entries naming no block, sorted after every real one
    block_id = jnp.where(selected >= 0, blocks.block_id(seq[:, None, None], selected), blocks.count)
    list_id = (jnp.arange(heads_kv, dtype=jnp.int32)[None, :, None] * lists_per_head + block_id).transpose(1, 0, 2)
    key_dtype = jnp.uint16 if heads_kv * lists_per_head <= SHORT_KEY_LISTS else jnp.int32
    # Each pair carries row * S + entry (the pairs in head, row, entry order).
    row_entries = jnp.broadcast_to(jnp.arange(total * entries, dtype=jnp.int32).reshape(1, total, entries), list_id.shape)
    lists, row_entries = lax.sort((list_id.reshape(-1).astype(key_dtype), row_entries.reshape(-1)), is_stable=True,
                                  num_keys=1)
    lists = lists.astype(jnp.int32)
    rows = row_entries // entries
    offsets = search(lists, heads_kv * lists_per_head)[:-1].reshape(heads_kv, lists_per_head)
    segments = None
    if segment_rows is not None:
        # (list, row // segment_rows) numbers the pairs' segments in their sorted order.
        per_list = -(-total // segment_rows)
        segments = search(lists * per_list + rows // segment_rows, heads_kv * lists_per_head * per_list)
    return PairLists(rows, offsets, row_entries if token_entries else None, segments)


def longest_lists_first(offsets: jax.Array) -> jax.Array:
    """[heads * B] int32: the key blocks' lists of PairLists.offsets [heads, B + 1] (the last
    column's lists, of entries naming no block, left out) as head * B + block, the longest first
    (ties by id). A kernel taking one list a program runs in this order so that no long list starts
    last and runs alone: the lists' lengths vary ~50-fold (a block early in its sequence lies
    before most of its tokens), and the long ones lie one or a few a head or sequence, where block
    order would start the last head's or sequence's late. The selection's dk/dv in this order (H100,
    forward + backward, session 73): 21.58 -> 20.17 ms at 32k on 16 packed documents, 46.19 -> 44.51
    at 64k unpacked."""
    lengths = (offsets[:, 1:] - offsets[:, :-1]).reshape(-1)
    lists = jnp.arange(lengths.shape[0], dtype=jnp.int32)
    return lax.sort((-lengths, lists), num_keys=1, is_stable=True)[1]


class TransposedTable(NamedTuple):
    """A static branch's block table read by key block: row kb lists the query blocks whose
    table rows hold kb, ascending, with that entry's full flag and atom bits."""

    query_blocks: np.ndarray  # [num key blocks, width] int32, -1 padded
    counts: np.ndarray  # [num key blocks] int32
    full: np.ndarray  # [num key blocks, width] int8
    atom_bits: np.ndarray  # [num key blocks, width] int32


@functools.lru_cache(maxsize=64)
def transposed_table(static: StaticKeys, block_size: int, causal: bool, seq_len: int) -> TransposedTable:
    """The transpose of the table dispatch.block_table builds for (static, block_size, causal, seq_len)."""
    from .dispatch import block_table  # the runtime's cache of tables; dispatch never imports this module

    indices, counts, full, atom_bits = block_table(static, block_size, causal, seq_len)
    used = np.arange(indices.shape[1])[None, :] < counts[:, None]
    query_block = np.broadcast_to(np.arange(indices.shape[0], dtype=np.int32)[:, None], indices.shape)[used]
    key_block, entry_full, entry_bits = indices[used], full[used], atom_bits[used]
    order = np.argsort(key_block, kind="stable")  # within a key block, query blocks stay ascending
    key_block, query_block, entry_full, entry_bits = (
        x[order] for x in (key_block, query_block, entry_full, entry_bits)
    )
    num_key_blocks = -(-seq_len // block_size)
    per_key = np.bincount(key_block, minlength=num_key_blocks).astype(np.int32)
    width = max(int(per_key.max(initial=0)), 1)
    column = np.arange(key_block.size) - np.repeat(np.cumsum(per_key) - per_key, per_key)
    table = TransposedTable(
        np.full((num_key_blocks, width), -1, np.int32),
        per_key,
        np.zeros((num_key_blocks, width), np.int8),
        np.zeros((num_key_blocks, width), np.int32),
    )
    table.query_blocks[key_block, column] = query_block
    table.full[key_block, column] = entry_full
    table.atom_bits[key_block, column] = entry_bits
    for array in table:
        array.setflags(write=False)
    return table


def kernel_tables(table, static: StaticKeys, block_size: int, causal: bool, seq_len: int, full_dtype) -> tuple:
    """A static branch's block table `table` (indices, counts, full, atom_bits; the call's
    argument) and its transpose, built on the host from the same keys, as the kernels read them:
    int32 arrays, the full flags in `full_dtype` (Triton loads int8, Pallas int32)."""

    def typed(parts):
        indices, counts, full, atom_bits = parts
        return (
            jnp.asarray(indices, jnp.int32), jnp.asarray(counts, jnp.int32),
            jnp.asarray(full, full_dtype), jnp.asarray(atom_bits, jnp.int32),
        )

    return typed(table), typed(transposed_table(static, block_size, causal, seq_len))


class Compressed(NamedTuple):
    """A compress branch's pooled keys and values [C, HKV, D] (C = N // stride + number of
    sequences, a static bound; rows past cmp_offsets[-1] are never visible) and where each
    sequence's live: its compressed key i is row cmp_offsets[n] + i, below cmp_offsets[n + 1]."""

    k: jax.Array
    v: jax.Array
    cmp_offsets: jax.Array  # [num_seqs + 1] int32


def seen_compressed(pos, block: int, stride: int) -> jax.Array:
    """How many compressed keys of compress(block, stride) a query at position `pos` of its
    sequence sees: key i once complete, i * stride + block - 1 <= pos (none for pos < 0)."""
    return jnp.where(pos >= block - 1, (pos - (block - 1)) // stride + 1, 0)


def compressed_offsets(offsets: jax.Array, block: int, stride: int) -> jax.Array:
    """[num_seqs + 1] int32: Compressed.cmp_offsets of compress(block, stride) over the sequences
    [offsets[n], offsets[n + 1]) (a sequence of L >= block rows has (L - block) // stride + 1 keys)."""
    lengths = jnp.maximum(offsets[1:] - offsets[:-1], 0)
    counts = jnp.where(lengths >= block, (lengths - block) // stride + 1, 0)
    return jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(counts).astype(jnp.int32)])


def compressed_rows(keys: int, num_seqs: int, stride: int) -> int:
    """The static row count of pool_compressed's arrays for `keys` key rows of num_seqs sequences."""
    return keys // stride + num_seqs


def pooled_first_tokens(offsets, cmp_offsets, first, count: int, stride: int) -> jax.Array:
    """[count] int32: the first key row that each of compressed rows [first, first + count) pools
    (a row pools `block` key rows from it; rows past the last sequence's keys point past its end)."""
    num_seqs = offsets.shape[0] - 1
    row = first + jnp.arange(count, dtype=jnp.int32)
    seq = jnp.clip(search_sorted(cmp_offsets[1:], row, side="right"), 0, num_seqs - 1)
    return offsets[seq] + (row - cmp_offsets[seq]) * stride


def _pooled_tokens(offsets, cmp_offsets, first, count: int, block: int, stride: int) -> jax.Array:
    """[count, block] int32: the key rows that compressed rows [first, first + count) pool."""
    first_tokens = pooled_first_tokens(offsets, cmp_offsets, first, count, stride)
    return first_tokens[:, None] + jnp.arange(block, dtype=jnp.int32)


def _gathered_blocks(k, v, offsets, cmp_offsets, first, count: int, block: int, stride: int):
    tokens = _pooled_tokens(offsets, cmp_offsets, first, count, block, stride)
    return tuple(jnp.take(x, tokens, axis=0, mode="clip").astype(jnp.float32) for x in (k, v))


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def pooled_blocks(k, v, offsets, cmp_offsets, first, count: int, block: int, stride: int):
    """The tokens compressed rows [first, first + count) pool: [count, block, HKV, D] float32 of
    k and of v (rows past the last sequence's keys read clipped rows; pool_compressed zeroes them).
    Its gradient gathers rather than scatter-adds: with stride < block a key row is pooled by up to
    ceil(block / stride) compressed rows, and XLA's scatter-add sums such repeats with atomics on a
    GPU, in an order that changes from run to run; each key row sums its own in a fixed order."""
    return _gathered_blocks(k, v, offsets, cmp_offsets, first, count, block, stride)


def _pooled_blocks_forward(k, v, offsets, cmp_offsets, first, count, block, stride):
    key_rows = jnp.zeros((k.shape[0], 0), k.dtype)  # the gradient's rows and dtype, holding nothing
    residuals = (key_rows, offsets, cmp_offsets, first)
    # the plain gather, not pooled_blocks: a second derivative (jax.hessian) runs this rule in
    # forward mode, which a custom_vjp function refuses
    return _gathered_blocks(k, v, offsets, cmp_offsets, first, count, block, stride), residuals


def _pooled_blocks_backward(count, block, stride, residuals, d_blocks):
    key_rows, offsets, cmp_offsets, first = residuals
    keys, num_seqs = key_rows.shape[0], offsets.shape[0] - 1
    key_row = jnp.arange(keys, dtype=jnp.int32)
    seq = jnp.clip(search_sorted(offsets[1:], key_row, side="right"), 0, num_seqs - 1)
    pos = key_row - offsets[seq]
    d_kv = [jnp.zeros((keys, *d.shape[2:]), jnp.float32) for d in d_blocks]
    for behind in range(-(-block // stride)):  # the rows pooling pos: the one starting at or before it, and earlier
        local = pos // stride - behind
        column = pos - local * stride
        row = cmp_offsets[seq] + local - first
        held = (local >= 0) & (local < cmp_offsets[seq + 1] - cmp_offsets[seq]) & (column < block)
        held &= (row >= 0) & (row < count)
        flat = jnp.where(held, row * block + column, 0)
        for i, d in enumerate(d_blocks):
            taken = jnp.take(d.reshape(count * block, *d.shape[2:]), flat, axis=0)
            d_kv[i] = d_kv[i] + jnp.where(held[:, None, None], taken, 0)
    d_k, d_v = (d.astype(key_rows.dtype) for d in d_kv)
    return d_k, d_v, None, None, None


pooled_blocks.defvjp(allowing_rank_promotion(_pooled_blocks_forward), allowing_rank_promotion(_pooled_blocks_backward))


def pool_compressed(
    k, v, offsets: jax.Array, block: int, stride: int, pool_fn=None, dtype=jnp.float32, rows=None
) -> Compressed:
    """compress(block, stride) of k/v [N, HKV, D]: key i of a sequence pools its tokens
    [i * stride, i * stride + block) (those of complete blocks only) as pool_fn(k_blocks, v_blocks)
    of the [C, block, HKV, D] float32 tokens (their mean when pool_fn is None), cast to `dtype`;
    rows past the last sequence's keys are zeros. A gather, so that gradients reach k, v and the
    pooling's parameters by autodiff. `rows`:
    (first, count) pools rows [first, first + count) only (first may be traced, count is static),
    the rows a compressed cache recomputes after new keys were written (compressed_cache.py)."""
    num_seqs = offsets.shape[0] - 1
    cmp_offsets = compressed_offsets(offsets, block, stride)
    first, count = rows if rows is not None else (0, compressed_rows(k.shape[0], num_seqs, stride))
    if block > k.shape[0]:  # no sequence completes a block: no key, and no [count, block] gather of nothing
        # Inside shard_map the zeros vary over the keys' axes, as pooled keys do: the attention's
        # custom_vjp gives them the queries' cotangent, which must match their type.
        zeros = [jnp.zeros((count, *x.shape[1:]), dtype) for x in (k, v)]
        return Compressed(*varying_like(zeros, (k, v)), cmp_offsets)
    row = first + jnp.arange(count, dtype=jnp.int32)
    k_blocks, v_blocks = pooled_blocks(k, v, offsets, cmp_offsets, first, count, block, stride)
    k_cmp, v_cmp = (k_blocks.mean(axis=1), v_blocks.mean(axis=1)) if pool_fn is None else pooled(pool_fn, k_blocks, v_blocks)
    live = (row < cmp_offsets[-1])[:, None, None]  # rows past every sequence's keys: zeros, whatever the tokens
    return Compressed(*(jnp.where(live, x, 0).astype(dtype) for x in (k_cmp, v_cmp)), cmp_offsets)


def pooled(pool_fn, k_blocks, v_blocks):
    """A learned pooling function's (k_cmp, v_cmp) of blocks [C, block, HKV, D], checked: each
    must be a floating [C, HKV, D] array (any other shape would broadcast into the compressed
    keys unnoticed)."""
    result = pool_fn(k_blocks, v_blocks)
    want = (k_blocks.shape[0], *k_blocks.shape[2:])
    pair = isinstance(result, (tuple, list)) and len(result) == 2
    if not pair or any(getattr(x, "shape", None) != want or not jnp.issubdtype(x.dtype, jnp.floating) for x in result):
        parts = result if isinstance(result, (tuple, list)) else [result]
        got = [(getattr(x, "shape", None), str(getattr(x, "dtype", type(x).__name__))) for x in parts]
        raise ValueError(
            f"pool_fns: a learned pooling function maps blocks [C, block, HKV, D] = {tuple(k_blocks.shape)} to a pair "
            f"(k_cmp, v_cmp) of floating [C, HKV, D] = {want} arrays; got {type(result).__name__} {got}"
        )
    return result


def first_compressed_row(offsets: jax.Array, key_row, block: int, stride: int) -> jax.Array:
    """The first row of pool_compressed's arrays whose compressed key pools key row `key_row` or
    a later row of the sequences [offsets[n], offsets[n + 1]) (the row after its sequence's
    keys when none of them does): rows before it pool only earlier key rows."""
    cmp_offsets = compressed_offsets(offsets, block, stride)
    seq = jnp.clip(search_sorted(offsets[1:], key_row, side="right"), 0, offsets.shape[0] - 2)
    first_key = jnp.maximum(-((block - 1 - (key_row - offsets[seq])) // stride), 0)  # ceil((pos - block + 1) / stride)
    return jnp.minimum(cmp_offsets[seq] + first_key, cmp_offsets[seq + 1]).astype(jnp.int32)


def cached_compressed(cache, offsets: jax.Array, block: int, stride: int, dtype) -> Compressed:
    """The compressed keys of the sequences `offsets`, read from a compressed cache (k_cmp, v_cmp)
    [B, R, HKV, D] of their keys (compressed_cache.py: each batch row's own pool_compressed rows)
    and cast to `dtype`. One batch row: its rows are pool_compressed's. B rows (a sequence each):
    the arrays as they are, [B * R, HKV, D], sequence b's keys from row b * R: a decoding step
    reads the cache in place rather than copying it into pool_compressed's packed rows. The rows
    past a sequence's keys, before the next one's, are zeros that no query sees."""
    batch, rows = cache[0].shape[:2]
    if batch == 1:
        cmp_offsets = compressed_offsets(offsets, block, stride)
    else:
        cmp_offsets = jnp.arange(batch + 1, dtype=jnp.int32) * rows
    k_cmp, v_cmp = (x.reshape(batch * rows, *x.shape[2:]).astype(dtype) for x in cache)
    return Compressed(k_cmp, v_cmp, cmp_offsets)
