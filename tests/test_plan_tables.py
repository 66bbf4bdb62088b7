"""Block tables against the pattern oracle, on hand-picked and on generated patterns."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nsa_dsl.dsl import model as m
from nsa_dsl.plan import build_block_table, lower_keys, token_mask
from nsa_dsl.plan import plan as p
from nsa_dsl.plan import sampling

from conftest import mask_value


def mask_from_table(static: p.StaticKeys, block: int, causal: bool, seq_len: int) -> np.ndarray:
    """The token mask a kernel computes from the table: full tiles unmasked, partial tiles
    through the mask IR, causality and sequence bounds applied."""
    table = build_block_table(static, block, causal, seq_len)
    assert table.indices.shape == table.full.shape == table.atom_bits.shape
    mask = np.zeros((seq_len, seq_len), dtype=bool)
    for qb in range(table.num_query_blocks):
        row = table.indices[qb, : table.counts[qb]]
        assert (np.diff(row) > 0).all(), "a row must be ascending without repeats"
        assert (table.indices[qb, table.counts[qb] :] == -1).all(), "padding must be -1"
        for j, kb in enumerate(row):
            t = np.arange(qb * block, min(qb * block + block, seq_len))[:, None]
            s = np.arange(kb * block, min(kb * block + block, seq_len))[None, :]
            if table.full[qb, j]:
                visible = np.ones((t.size, s.size), dtype=bool)
                assert mask_value(static.mask, t, s, int(table.atom_bits[qb, j])).all()
            else:
                visible = mask_value(static.mask, t, s, int(table.atom_bits[qb, j]))
            if causal:
                visible = visible & (s <= t)
            mask[t, s] |= visible
    return mask


HAND_PICKED = [
    m.Window(5),
    m.Window(40, 3),
    m.Window(1, 30),
    m.Local(2),
    m.Local(1, 2),
    m.Stride(3, 1),
    m.Global(2),
    m.Blocks((0, 3, 7)),
    m.Random(2, 5),
    m.Union((m.Window(20), m.Global(1), m.Stride(4))),
    m.Intersection((m.Local(4), m.Stride(2))),
    m.Difference(m.Local(5), m.Window(17)),
    m.Difference(m.Union((m.Window(33, 9), m.Random(3, 1))), m.Stride(3, 2)),
    # Block atoms classifying candidates another atom adds: the blocks just outside local(2),
    # global(first=2) and local(1, 1), which the windows reach
    m.Union((m.Local(2), m.Window(40))),
    m.Difference(m.Window(50, 20), m.Union((m.Local(1, 1), m.Global(2)))),
]


@pytest.mark.parametrize("keys", HAND_PICKED, ids=repr)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("seq_len", [1, 16, 63, 111])
def test_table_matches_oracle(keys, causal, seq_len):
    static = lower_keys(keys)
    np.testing.assert_array_equal(mask_from_table(static, 16, causal, seq_len), token_mask(static, 16, causal, seq_len))


def _block_atoms():
    small = st.integers(1, 5)
    return st.one_of(
        st.builds(m.Local, small, st.integers(0, 2)),
        st.integers(1, 4).flatmap(lambda e: st.builds(m.Stride, st.just(e), st.integers(0, e - 1))),
        st.builds(m.Global, small),
        st.lists(st.integers(0, 9), min_size=1, max_size=4).map(lambda ids: m.Blocks(tuple(sorted(set(ids))))),
        st.builds(m.Random, st.integers(1, 3), st.integers(0, 1000)),
    )


def _key_sets():
    window = st.integers(0, 40).flatmap(lambda left: st.builds(m.Window, st.just(left), st.integers(1 if left == 0 else 0, 20)))
    leaves = st.one_of(window, _block_atoms())
    return st.recursive(
        leaves,
        lambda inner: st.one_of(
            st.lists(inner, min_size=2, max_size=3).map(lambda xs: m.Union(tuple(xs))),
            st.lists(inner, min_size=2, max_size=3).map(lambda xs: m.Intersection(tuple(xs))),
            st.builds(m.Difference, inner, inner),
        ),
        max_leaves=5,
    )


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(keys=_key_sets(), causal=st.booleans(), block=st.sampled_from([16, 32]), seq_len=st.integers(1, 140))
def test_generated_patterns_match_oracle(keys, causal, block, seq_len):
    static = lower_keys(keys)
    np.testing.assert_array_equal(mask_from_table(static, block, causal, seq_len), token_mask(static, block, causal, seq_len))


@given(rows=st.lists(st.tuples(st.integers(0, 10_000), st.integers(1, 300)), min_size=1, max_size=20),
       count=st.integers(1, 8), seed=st.integers(0, 2**40))
@settings(max_examples=100, deadline=None)
def test_vectorised_draw_equals_specification(rows, count, seed):
    ids = np.array([r for r, _ in rows])
    limits = np.array([lim for _, lim in rows])
    drawn = sampling.draw_rows(ids, limits, count, seed)
    for i, (row, limit) in enumerate(rows):
        got = sorted(int(x) for x in drawn[i] if x >= 0)
        assert got == sampling.draw_row(row, limit, count, seed)
        assert len(got) == min(count, limit) and all(0 <= x < limit for x in got)


def test_random_draw_is_spread_over_candidates():
    # A draw that always picked the same few blocks would still pass the equality tests.
    drawn = sampling.draw_rows(np.arange(4000), np.full(4000, 50), 1, seed=3)
    counts = np.bincount(drawn[:, 0], minlength=50)
    assert counts.min() > 40 and counts.max() < 130


def test_lowering_numbers_equal_atoms_once():
    keys = m.Union((m.Local(2), m.Intersection((m.Stride(4), m.Local(2))), m.Window(7)))
    static = lower_keys(keys)
    assert static.block_atoms == (m.Local(2), m.Stride(4))
    assert static.mask == p.AnyOf((p.AtomBit(0), p.AllOf((p.AtomBit(1), p.AtomBit(0))), p.TokenWindow(7, 0)))


def test_table_shares_one_row_layout_for_packed_sequences():
    # Positions are local to a sequence: the table for the packed length is a prefix-extension
    # of the table for any shorter sequence.
    static = lower_keys(m.Union((m.Window(40), m.Stride(3))))
    long, short = build_block_table(static, 16, True, 200), build_block_table(static, 16, True, 70)
    rows = short.num_query_blocks
    np.testing.assert_array_equal(long.indices[:rows, : short.width], short.indices)
    np.testing.assert_array_equal(long.full[:rows, : short.width], short.full)


@pytest.mark.parametrize(
    "branches, last_row_count",
    [
        # Last row: the 9 window blocks 16375..16383 and the global block 0.
        ((m.Window(512), m.Global(1)), 10),
        # Last row: 2048 stride blocks (block 0 = the global one among them) and the 9 window
        # blocks, of which 16376 is on the stride.
        ((m.Window(512), m.Global(1), m.Stride(8)), 2048 + 9 - 1),
    ],
)
def test_million_token_plans_build_in_memory_linear_in_their_blocks(branches, last_row_count):
    """The static tables are built in O(#blocks): at 1M tokens (16384 query blocks of 64) the build's
    peak allocation stays within a small multiple of the table it returns, where any intermediate
    over (query block, key block) pairs would take 16384^2 entries (268 MB of booleans against the
    window's 1 MB table). Memory, not time: on CI's virtual machine the CPU time of the same build
    ranged 0.27-2.7 s between runs (page faults of fresh memory), so no time bound is both safe and
    tight."""
    static = lower_keys(m.Union(branches))
    build_block_table(static, 64, True, 4096)  # numpy's first calls allocate for themselves
    tracemalloc.start()
    try:
        table = build_block_table(static, 64, True, 1 << 20)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert table.num_query_blocks == 16384
    assert table.counts[-1] == last_row_count
    size = sum(a.nbytes for a in (table.indices, table.full, table.counts, table.atom_bits))
    assert peak < 3 * size + (1 << 20), (peak, size)


def test_a_random_count_past_every_rows_candidates_costs_what_the_blocks_do():
    """random(count) with more draws than a row has candidate blocks takes them all: its table
    costs what the sequence's blocks do, not what `count` does (random(2**31 - 1) asked for 16
    GiB a row, and the draw's time grows with count squared)."""
    static = lower_keys(m.Random(20_000, 5))
    build_block_table(static, 16, False, 16)  # numpy's first calls allocate for themselves
    tracemalloc.start()
    try:
        table = build_block_table(static, 16, False, 111)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert (table.counts == 7).all()
    assert peak < 100_000, peak


def test_a_plan_that_selects_blocks_must_be_causal():
    """Selection kernels mask keys after the query unconditionally: a bidirectional plan with a
    selection branch is refused where it is built, not silently run causally."""
    select = p.SelectBranch(name="slc", gate=None, block=16)
    assert p.Plan("ok", 16, True, (), (select,)).causal
    with pytest.raises(ValueError, match=r"branches \['slc'\] select blocks causally; the plan must be causal"):
        p.Plan("bad", 16, False, (), (select,))
