"""The index arrays the Triton kernels read (nsa_dsl.runtime.layout), against direct
loops over their definitions: sequence rows, key blocks of packed sequences, cleaned
selections and the selection transposed into per-key-block lists."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nsa_dsl
from nsa_dsl import codegen
from nsa_dsl.runtime import layout
from nsa_dsl.runtime.platform import for_device

CU_SEQLENS = [0, 15, 40, 61]  # rows 61.. of a 64-row batch belong to no sequence
TOTAL = 64
BLOCK = 16


def sequence_of(row):
    for n, (start, end) in enumerate(zip(CU_SEQLENS[:-1], CU_SEQLENS[1:])):
        if start <= row < end:
            return n, start, end
    return None


def test_rows_of_packed_sequences():
    rows = layout.rows(layout.sequence_offsets(np.array(CU_SEQLENS), 1, TOTAL), TOTAL)
    for row in range(TOTAL):
        found = sequence_of(row)
        if found is None:
            assert rows.pos[row] == -1
        else:
            _, start, end = found
            assert (rows.start[row], rows.end[row], rows.pos[row]) == (start, end, row - start)


@pytest.mark.parametrize("queries, offsets, keys", [
    (layout.QueryRows.shard(23, 30, 3), CU_SEQLENS, TOTAL),  # a shard across sequence edges
    (layout.QueryRows.of_batch_rows(np.array([5, 0, 18]), 2, 3, 20), [0, 20, 40, 60], 60),  # a decoding step
])
def test_rows_of_query_rows_are_their_key_rows_rows(queries, offsets, keys):
    """QueryRows.rows computes the Rows of the query rows alone: those of their key rows."""
    every = layout.rows(np.array(offsets, np.int32), keys)
    own = queries.rows(np.array(offsets, np.int32))
    for got, want in zip(own, every):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want)[np.asarray(queries.key_rows)])


def test_key_blocks_never_cross_a_sequence():
    offsets = layout.sequence_offsets(np.array(CU_SEQLENS), 1, TOTAL)
    blocks = layout.sequence_blocks(offsets, TOTAL, BLOCK)
    expected = [(0, 15), (15, 31), (31, 40), (40, 56), (56, 61)]
    got = list(zip(np.asarray(blocks.first_row).tolist(), np.asarray(blocks.end_row).tolist()))
    assert got[: len(expected)] == expected
    assert all(first == end for first, end in got[len(expected):])  # padding blocks are empty
    assert np.asarray(blocks.seq_first).tolist() == [0, 1, 3, 5]


@pytest.mark.parametrize("block, stride, rows", [
    (8, 3, None),  # key rows pooled by up to 3 compressed rows, the stride not dividing the block
    (8, 8, None),
    (6, 4, (4, 7)),  # a compressed cache's rows: 7 rows from row 4
])
def test_pooling_gradient_is_the_pooling_transposed_without_scatter(rng, block, stride, rows):
    """pool_compressed's gradient is P^T (P: the mean-pooling matrix, built here by a loop over the
    definition), summed by gathers: XLA's scatter-add adds repeats with atomics on a GPU, in an
    order that differs between runs, and a backward must give the same gradients every time."""
    offsets = layout.sequence_offsets(np.array(CU_SEQLENS), 1, TOTAL)
    count = layout.compressed_rows(TOTAL, len(CU_SEQLENS) - 1, stride)
    first, count = rows if rows is not None else (0, count)
    pooling = np.zeros((count, TOTAL))
    row = 0
    for start, end in zip(CU_SEQLENS[:-1], CU_SEQLENS[1:]):
        for i in range(max(end - start - block, -1) // stride + 1):
            if 0 <= row - first < count:
                pooling[row - first, start + i * stride:start + i * stride + block] = 1 / block
            row += 1
    k, v = rng.normal(size=(2, TOTAL, 2, 5)).astype(np.float32)
    weights = rng.normal(size=(2, count, 2, 5)).astype(np.float32)

    traced_rows = None if rows is None else (jnp.int32(first), count)

    def weighed(k, v):
        pooled = layout.pool_compressed(k, v, offsets, block, stride, rows=traced_rows)
        return jnp.sum(pooled.k * weights[0]) + jnp.sum(pooled.v * weights[1])

    d_k, d_v = jax.grad(weighed, argnums=(0, 1))(k, v)
    np.testing.assert_allclose(d_k, np.einsum("rt,rhd->thd", pooling, weights[0]), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(d_v, np.einsum("rt,rhd->thd", pooling, weights[1]), rtol=1e-5, atol=1e-6)
    assert "scatter" not in str(jax.make_jaxpr(jax.grad(weighed, argnums=(0, 1)))(k, v))


def test_clean_selection_keeps_exactly_the_entries_that_count(rng):
    heads_kv, width = 2, 5
    indices = rng.integers(-2, 5, (TOTAL, heads_kv, width)).astype(np.int32)
    counts = rng.integers(0, width + 1, (TOTAL, heads_kv)).astype(np.int32)
    offsets = layout.sequence_offsets(np.array(CU_SEQLENS), 1, TOTAL)
    rows = layout.rows(offsets, TOTAL)
    cleaned = np.asarray(layout.clean_selection(indices, counts, rows, BLOCK))
    for row in range(TOTAL):
        found = sequence_of(row)
        for h in range(heads_kv):
            seen = set()
            for e in range(width):
                block = int(indices[row, h, e])
                if found is None or e >= counts[row, h] or block < 0 or block in seen:
                    keep = False
                else:
                    _, start, _ = found
                    keep = block <= (row - start) // BLOCK
                seen.add(block)
                assert cleaned[row, h, e] == (block if keep else -1), (row, h, e)


@pytest.mark.parametrize("total, count", [(0, 5), (1, 1), (37, 9), (500, 600), (1000, 3)])
def test_count_below_is_a_left_search_of_every_value(rng, total, count):
    """layout.count_below and the Triton module's one-launch search of the pair lists
    (pair_list_starts) against np.searchsorted on fresh sorted values: runs of one value and of
    many, values with no run at the start, the middle and the end, no values at all."""
    source = "pattern p\nblock 16\nbranch c = compress(block=16, stride=16)\nbranch s = topk(4, block=16, score=c)"
    module = codegen.load_module("triton", nsa_dsl.compile(source).plan, for_device(None))
    values = np.sort(rng.integers(0, count, total)).astype(np.int32)
    want = np.searchsorted(values, np.arange(count + 1), side="left")
    for search in (layout.count_below, module.pair_list_starts):
        got = np.asarray(jax.jit(search, static_argnums=1)(values, count))
        np.testing.assert_array_equal(got, want, err_msg=str(search))


@pytest.mark.parametrize("short_keys", [True, False], ids=["uint16 list keys", "int32 list keys"])
def test_pair_lists_are_the_selection_transposed(rng, monkeypatch, short_keys):
    """Both sorts: the list ids as uint16 keys, and as int32 keys where there are too many lists;
    the lists' segments of 7 rows, the list of entries naming no block (every entry is in one list)
    included."""
    monkeypatch.setattr(layout, "SHORT_KEY_LISTS", layout.SHORT_KEY_LISTS if short_keys else 0)
    heads_kv, width = 3, 4
    offsets = layout.sequence_offsets(np.array(CU_SEQLENS), 1, TOTAL)
    rows = layout.rows(offsets, TOTAL)
    indices = rng.integers(-1, 3, (TOTAL, heads_kv, width)).astype(np.int32)
    cleaned = layout.clean_selection(indices, np.full((TOTAL, heads_kv), width, np.int32), rows, BLOCK)
    blocks = layout.sequence_blocks(offsets, TOTAL, BLOCK)
    pairs = layout.selection_by_key_block(cleaned, rows.seq, blocks, token_entries=True, segment_rows=7)
    tokens, bounds = np.asarray(pairs.tokens), np.asarray(pairs.offsets)
    token_entries = np.asarray(pairs.token_entries)
    np.testing.assert_array_equal(token_entries // width, tokens)
    slots = token_entries % width
    cleaned, seq_first = np.asarray(cleaned), np.asarray(blocks.seq_first)
    segments, per_list = np.asarray(pairs.segments), -(-TOTAL // 7)
    assert segments.shape == (heads_kv * (blocks.count + 1) * per_list + 1,) and segments[-1] == tokens.size
    for h in range(heads_kv):
        for b in range(blocks.count + 1):
            for r in range(per_list):
                at = (h * (blocks.count + 1) + b) * per_list + r
                span = slice(segments[at], segments[at + 1])
                listed = list(zip(tokens[span].tolist(), slots[span].tolist()))
                names = [
                    (row, e) for row in range(r * 7, min(r * 7 + 7, TOTAL)) for e in range(width)
                    if (seq_first[sequence_of(row)[0]] + cleaned[row, h, e] if cleaned[row, h, e] >= 0
                        else blocks.count) == b
                ]
                assert sorted(listed) == names, (h, b, r)
    for h in range(heads_kv):
        for b in range(blocks.count):
            expected = [
                (row, e)
                for row in range(TOTAL)
                for e in range(width)
                if cleaned[row, h, e] >= 0 and seq_first[sequence_of(row)[0]] + cleaned[row, h, e] == b
            ]
            listed = slice(bounds[h, b], bounds[h, b + 1])
            assert list(zip(tokens[listed].tolist(), slots[listed].tolist())) == expected, (h, b)


def test_longest_lists_first_orders_every_key_block_list_once(rng):
    """Random list lengths (ties among them, empty lists) of 3 KV heads' pair lists: each key
    block's list once, as head * blocks + block, by length descending, ties in id order; the lists
    of entries naming no block (the last column) never."""
    heads, num_blocks = 3, 7
    lengths = rng.integers(0, 5, (heads, num_blocks + 1))
    offsets = np.concatenate([np.zeros((heads, 1), np.int64), np.cumsum(lengths, axis=1)], axis=1)[:, :-1]
    offsets += np.arange(heads)[:, None] * 1000  # a head's lists start where the one before ends
    order = np.asarray(jax.jit(layout.longest_lists_first)(offsets.astype(np.int32)))
    ids = [(h * num_blocks + b) for h in range(heads) for b in range(num_blocks)]
    expected = sorted(ids, key=lambda i: (-lengths[i // num_blocks, i % num_blocks], i))
    assert order.tolist() == expected


@pytest.mark.parametrize(
    "queries, offsets, keys",
    [
        # rows 20..45 of packed sequences: one shift, sequences cut at both ends
        (layout.QueryRows.shard(20, 26, 3), np.array(CU_SEQLENS), TOTAL),
        # rows 13..17 of each of 3 batch rows of 40: a shift per batch row
        (layout.QueryRows.of_batch_rows(13, 5, 3, 40), np.arange(4) * 40, 120),
        # a decoding step: the last row of each of 4 batch rows of 24
        (layout.QueryRows.of_batch_rows(23, 1, 4, 24), np.arange(5) * 24, 96),
    ],
)
def test_query_tiles_map_every_row_they_read_to_a_query_row(queries, offsets, keys):
    """Query tiles of a shard (sequence_blocks with QueryRows) and their shifts (of_blocks): a
    tile's rows are query rows of its sequence, each at key row - shift; a padding tile's first
    row (which kernels clamp into) is a query row that exists."""
    blocks = layout.sequence_blocks(offsets, keys, 8, queries)
    low, high, shift = (np.asarray(x) for x in queries.of_blocks(blocks))
    key_rows = np.asarray(queries.key_rows)
    first, end = np.asarray(blocks.first_row), np.asarray(blocks.end_row)
    covered = []
    for b in range(blocks.count):
        assert 0 <= first[b] - shift[b] < queries.count, f"block {b} reads a row that does not exist"
        for row in range(first[b], end[b]):
            assert low[b] <= row < high[b] and key_rows[row - shift[b]] == row, (b, row)
            covered.append(row)
    assert sorted(covered) == sorted(key_rows.tolist()), "every query row in exactly one tile"
