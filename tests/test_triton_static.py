"""The Triton kernels of static branches, run in Triton's interpreter on the CPU, against the
float64 reference built from the pattern oracle: forward and gradients, float32 and float16.

Branches whose keys are ranges of the query position (nsa_dsl.plan.ranges: windows, local
blocks, global prefixes, every key, a stride progression, and unions of them) compute their key
ranges in the kernel; the rest walk their block tables. Both, and several range branches fused
into one launch with gates in its epilogue, on odd lengths, non-power-of-two head dims, GQA
groups 1/3/4/16, query tiles holding several heads, packed sequences and batches. Tiles are set
small (cfg.block_q / block_k) so that every loop -- masked and unmasked steps, each range of a
union, both segments of a progression -- runs on these short sequences."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import gate, lower_for_cuda, qkv, record_calls
from static_check import check_static, static_attention

from nsa_dsl import codegen
from nsa_dsl.api import SparseAttention
from nsa_dsl.config import NativeSparseAttentionConfig
from nsa_dsl.dsl import model
from nsa_dsl.plan import lower, lower_keys
from nsa_dsl.plan.ranges import (
    EVERY_KEY,
    MAX_TOKENS,
    KeyRanges,
    key_ranges,
    static_launches,
    trailing_window,
)
from nsa_dsl.runtime import dispatch, triton_glue
from nsa_dsl.runtime.platform import for_device

W, L, S, G, BL, R = model.Window, model.Local, model.Stride, model.Global, model.Blocks, model.Random
U = lambda *parts: model.Union(parts)


def compiled(keys_by_branch, *, causal=True, block=16, gates=None, tiles=(16, 16), heads=None) -> SparseAttention:
    """A pattern of one static branch per key set; its Triton kernels take tiles of tiles[0]
    queries and tiles[1] keys, and the forward and dq query tiles hold `heads` query heads."""
    config = NativeSparseAttentionConfig(block_size=block, block_q=tiles[0], block_k=tiles[1])
    attention = static_attention(keys_by_branch, causal=causal, block=block, gates=gates, config=config)
    if heads is not None:  # a module constant, read when the kernels are first traced
        module = codegen.load_module("triton", attention.plan, for_device(config))
        for kernel in ("static_forward", "static_fused_forward", "static_backward_dq"):
            module.STATIC_TILES[kernel] = (*module.STATIC_TILES[kernel][:2], heads)
    return attention


check = functools.partial(check_static, platform="triton")


# ---- which form a branch takes -----------------------------------------------------------------


def test_range_forms_of_key_sets():
    def form(keys, causal=True):
        return key_ranges(lower_keys(keys), 16, causal)

    assert form(W(512)) == KeyRanges(False, 0, W(512), None, None)
    # windows that hold the query merge, so do locals; globals keep the longest prefix
    assert form(U(W(8, 2), W(3, 5), L(2), L(1, 1), G(2), G(3))) == KeyRanges(False, 3, W(8, 5), L(2, 1), None)
    assert form(U(L(2), S(8, 7))) == KeyRanges(False, 0, None, L(2), S(8, 7))
    assert form(W(0, 4)) == KeyRanges(False, 0, W(0, 4), None, None)  # one range need not hold the query
    # every key: stride(1), or a part reaching past every sequence (in both directions unless causal)
    for every_key in (U(W(5), S(1)), L(2**31 - 1), U(G(1), W(2**40)), G(2**40)):
        assert form(every_key) == EVERY_KEY, every_key
    assert form(L(2**31 - 1, 2), causal=False) == KeyRanges(False, 0, None, L(MAX_TOKENS // 16, 2), None)
    assert form(U(W(3, 2**31), S(2**40, 2**39)), causal=False) == KeyRanges(
        False, 0, W(3, MAX_TOKENS), None, S(MAX_TOKENS // 16, MAX_TOKENS // 16)  # clamped: no int32 overflow
    )
    for table in (
        R(2, 1),
        BL((0, 3)),
        model.Intersection((W(40), S(2))),
        model.Difference(L(4), W(5)),
        U(W(5), R(1, 0)),
        U(S(2), S(3)),  # two progressions may share blocks
        U(W(0, 4), L(2)),  # the window misses the query: the union may have a gap
    ):
        assert form(table) is None, table


def test_range_branches_share_a_launch_and_read_no_table():
    pattern = model.Pattern("p", 64, True, (), (
        model.Branch("swa", W(512), model.Gate("g_swa")),
        model.Branch("sink", G(1)),
        model.Branch("drawn", R(2, 0)),
    ))
    plan = lower(pattern)
    launches = static_launches(plan)
    assert [(launch.name, launch.fused, launch.ranges is None) for launch in launches] == [
        ("ranges", True, False), ("table_drawn", False, True),
    ]
    # Keys a query sees beyond the global prefix (what bounds a decoding step's walk): the window's;
    # a table launch's unbounded.
    assert [launch.reach(64) for launch in launches] == [512, MAX_TOKENS]
    source = codegen.source("triton", plan, None)
    assert "fused_output(\n        static_kernels_ranges," in source
    assert 'table_attention(Static(static_kernels_table_drawn' in source
    assert 'tables["swa"]' not in source and 'tables["sink"]' not in source
    forward = source[source.index("def branch_forward_swa("):source.index("def branch_dq_swa(")]
    assert "q_first - 511" in forward and "tl.load" not in forward  # the window's range, from its constants
    # Dispatch builds only the tables the kernels read: at a million tokens the window's would
    # hold 16384 x 9 entries, a causal pattern's 16384^2.
    assert codegen.load_module("triton", plan, None).TABLES == ("drawn",)
    assert set(dispatch.kernel_tables("triton", plan, None, 1 << 20)) == {"drawn"}
    assert codegen.load_module("xla", plan, None).TABLES == ("swa", "sink", "drawn")
    causal = lower(model.Pattern("causal", 64, True, (), (model.Branch("all", W(MAX_TOKENS)),)))
    assert dispatch.kernel_tables("triton", causal, None, 1 << 20) == {}


def test_tiles_shrink_to_fit_wide_heads_and_float32_in_shared_memory():
    plan = compiled([U(W(64), S(4, 1))], block=64).plan
    module = codegen.load_module("triton", plan, None)
    spec = module.Static(module.static_kernels_ranges, 2, 4, 192, False)
    for dtype, itemsize in (("bfloat16", 2), ("float32", 4)):
        row = 256 * itemsize  # head dim 192, padded to 256
        forward = module.range_settings(spec, "static_forward", dtype)
        dq = module.range_settings(spec, "static_backward_dq", dtype)
        dkdv = module.range_settings(spec, "static_backward_dkdv", dtype)
        assert forward["HEADS"] * forward["BLOCK_M"] * row <= module.RESIDENT_BYTES
        assert 2 * dq["HEADS"] * dq["BLOCK_M"] * row <= module.RESIDENT_BYTES  # q and d_out
        assert 2 * dkdv["BLOCK_N"] * row <= module.RESIDENT_BYTES  # k and v
        for settings, step in ((forward, "BLOCK_N"), (dq, "BLOCK_N"), (dkdv, "BLOCK_M")):
            assert 2 * 2 * settings[step] * row <= module.PIPELINE_BYTES  # two stages of a step's two tiles
        assert forward["UNIT"] % 64 == 0 and forward["UNIT"] % forward["BLOCK_N"] == 0  # steps align to blocks
        assert dkdv["BLOCK_N"] <= 64  # a dk/dv key tile within one block of the progression
    assert module.range_settings(spec, "static_forward", "bfloat16")["BLOCK_M"] == module.STATIC_TILES["static_forward"][0]


def test_a_decoding_steps_tiles_hold_the_groups_heads():
    """Queries that are a shard of few rows a batch row (a decoding step's one) take query tiles of
    that many rows and more of the group's heads, as many tile rows and 16 at least (tl.dot's):
    not 128 positions of which one holds a query."""
    plan = compiled([W(MAX_TOKENS)], block=64).plan
    module = codegen.load_module("triton", plan, None)
    cases = ((16, 1, 1, 16), (4, 1, 4, 4), (1, 1, 16, 1), (16, 3, 4, 16), (16, 0, 128, 1))
    for group, shard_rows, rows, heads in cases:
        spec = module.Static(module.static_kernels_ranges, 2, group, 64, False, shard_rows=shard_rows)
        for kernel in ("static_forward", "static_backward_dq"):
            settings = module.range_settings(spec, kernel, "float16")
            assert (settings["BLOCK_M"], settings["HEADS"]) == (rows, heads), (group, shard_rows, kernel, settings)
            assert settings["CHUNKS"] == -(-group // heads)


# ---- range branches ----------------------------------------------------------------------------


def test_causal_window_gqa3_odd_length_padded_head_dim(rng):
    attention = compiled([W(40)])
    check(rng, attention, *qkv(rng, 1, 45, 3, 1, 24))


@pytest.mark.parametrize("window", [17, 18, 33, 34])
def test_causal_windows_whose_edge_meets_a_tile_edge(rng, window):
    """Windows of a tile (16 keys) plus one or two: a query tile's oldest key, and a key's last
    query, fall on or beside a tile's edge, where a walk's bound one key off changes which tiles
    are walked (W(40) on 45 tokens clamps every bound to 0 and would not see it)."""
    check(rng, compiled([W(window)]), *qkv(rng, 1, 67, 2, 1, 16))


def test_every_key_causal_batch_float16_two_heads_a_tile(rng):
    attention = compiled([L(2**31 - 1)], tiles=(16, 32), heads=2)  # every block up to the query's
    check(rng, attention, *qkv(rng, 2, 37, 4, 1, 16, dtype=np.float16))


def test_prefix_and_window_on_packed_sequences_float16(rng):
    attention = compiled([U(W(20), G(1))], tiles=(16, 32))
    q, k, v = qkv(rng, 1, 64, 2, 2, 16, dtype=np.float16)
    check(rng, attention, q, k, v, cu_seqlens=np.array([0, 9, 40, 61], np.int32))


def test_prefix_and_window_gqa24(rng):
    """A group of 24 heads: tiles of 32 head slots, 8 of them padding."""
    attention = compiled([U(W(20), G(1))], tiles=(16, 32))
    check(rng, attention, *qkv(rng, 1, 45, 24, 1, 16))


def test_local_blocks_and_a_stride_progression(rng):
    attention = compiled([U(L(2), S(3, 2))], tiles=(32, 16))
    check(rng, attention, *qkv(rng, 1, 90, 2, 1, 20))


def test_causal_stride_progression_alone_masks_the_querys_own_block(rng):
    """A causal stride progression with no sliding range beside it: the member block a query tile
    starts in is seen only up to each query (masked), the members below it whole; a bound one
    block off (blocks_shared) would walk the tile's own member unmasked. Odd length, GQA 3."""
    for keys in ([S(3, 1)], [S(2)]):
        check(rng, compiled(keys), *qkv(rng, 1, 53, 3, 1, 16))


def test_bidirectional_union_of_every_range_kind_gqa16(rng):
    # keys a step (32) span two blocks of the progression; dk/dv key tiles shrink to one block
    attention = compiled([U(W(7, 9), L(1, 1), S(4, 1), G(1))], causal=False, tiles=(16, 32), heads=4)
    check(rng, attention, *qkv(rng, 1, 40, 16, 1, 12))


def test_fused_gated_branches_with_a_table_branch_beside(rng):
    gates = [model.Gate("g_swa"), model.Gate("g_slc", 0.5), None, model.Gate("g_cmp")]
    attention = compiled([W(12), U(G(1), S(2)), L(1, 1), R(1, 3)], gates=gates)
    assert [launch.fused for launch in static_launches(attention.plan)] == [True, False]
    q, k, v = qkv(rng, 1, 36, 2, 1, 16)
    check(rng, attention, q, k, v, gates={"g_swa": gate(rng, 1, 36, 2), "g_cmp": gate(rng, 1, 36, 2)})
    # g_slc alone: the fused launch runs two of its three branches, the table branch is skipped
    check(rng, attention, q, k, v, gates={"g_slc": gate(rng, 1, 36, 2)}, cu_seqlens=np.array([0, 13, 31], np.int32))


def test_fused_ranges_that_miss_the_query_float16(rng):
    gates = [model.Gate("g_swa"), None]
    # the window's reach past every sequence is clamped (kernels compute positions in int32)
    attention = compiled([W(0, 5), U(L(1, 1), W(2, 2**31 - 1))], causal=False, gates=gates, tiles=(32, 16))
    check(rng, attention, *qkv(rng, 1, 50, 2, 2, 16, dtype=np.float16), gates={"g_swa": gate(rng, 1, 50, 2)})


# ---- the Hopper forward of trailing windows -----------------------------------------------------


def test_only_trailing_windows_of_causal_patterns_have_hopper_kernels():
    def window(keys_by_branch, causal=True):
        attention = compiled(keys_by_branch, causal=causal)
        (launch, *_) = static_launches(attention.plan)
        return trailing_window(launch, causal), "def hopper_window_forward(" in codegen.source(
            "triton", attention.plan, None)

    assert window([W(512)]) == (512, True)
    assert window([L(2**31 - 1)]) == (MAX_TOKENS, True)  # plain causal: every key up to the query
    for keys, causal in (([W(8, 2)], True), ([U(W(5), G(1))], True), ([U(W(5), L(2))], True), ([W(5)], False),
                         ([W(5), W(9)], True), ([R(1, 0)], True)):
        assert window(keys, causal) == (None, False), keys


def test_hopper_kernels_need_sm90_mosaic_gpu_and_no_opt_out(monkeypatch):
    monkeypatch.setattr(triton_glue, "_compute_capability", lambda: "9.0")
    monkeypatch.setattr(triton_glue, "_mosaic_gpu_importable", lambda: True)
    monkeypatch.delenv("NSA_DSL_HOPPER", raising=False)
    assert triton_glue.on_hopper()
    monkeypatch.setenv("NSA_DSL_HOPPER", "0")
    assert not triton_glue.on_hopper()
    monkeypatch.setenv("NSA_DSL_HOPPER", "1")
    monkeypatch.setattr(triton_glue, "_mosaic_gpu_importable", lambda: False)  # no absl: Triton runs
    assert not triton_glue.on_hopper()
    monkeypatch.setattr(triton_glue, "_mosaic_gpu_importable", lambda: True)
    monkeypatch.setattr(triton_glue, "_compute_capability", lambda: "10.0")  # wgmma is Hopper's
    assert not triton_glue.on_hopper()


# (rows of the batch row, cu_seqlens or None): whole tiles; a ragged length; packed sequences with
# boundaries inside tiles, an empty one and rows past the last; packed sequences on tile edges but
# one, which ends a row before a block's edge.
HOPPER_LAYOUTS = [
    (1024, None), (1000, None), (1000, (0, 37, 300, 300, 301, 383, 700, 905)), (1024, (0, 256, 447, 512, 1024))
]


def test_hopper_kernels_take_aligned_rows_of_whole_tiles_of_eight_float16_bfloat16_and_head_dims_64_128(monkeypatch):
    monkeypatch.setattr(triton_glue, "on_hopper", lambda: True)
    attention = compiled([W(512)])
    module = codegen.load_module("triton", attention.plan, for_device(attention.config))

    def applies(seq_len, head_dim=64, dtype=jnp.bfloat16, packed=False):
        spec = module.Static(module.static_kernels_ranges, 2, 2, head_dim, packed, seq_len=seq_len)
        return module.hopper_window_applies(spec, jax.ShapeDtypeStruct((seq_len, 4, head_dim), dtype))

    assert applies(1024) and applies(328) and applies(1000, 128, jnp.float16, packed=True)
    assert not applies(0)  # queries that are a shard of the keys' rows
    assert not applies(333) and not applies(1000, 96) and not applies(1024, 64, jnp.float32)


@pytest.mark.parametrize("seq_len, cu_seqlens", HOPPER_LAYOUTS)
def test_hopper_kernels_cover_every_visible_pair_and_skip_the_mask_only_where_all_are_visible(seq_len, cu_seqlens):
    """The Hopper kernels' schedules, which CI cannot run: for every query tile of dq the key blocks
    walked hold every key its rows see, and the steps run without a mask hold only visible pairs;
    the same for every key tile's query blocks (dk/dv); the forward's walks:
    test_hopper_forward_walks_cover_what_their_rows_see. Rows and keys past the batch row count for
    nothing (TMA drops their stores; zero q and d_out add nothing to dk/dv); with cu_seqlens, rows past
    its end are real rows that see nothing and that no query sees."""
    attention = compiled([W(512)])
    module = codegen.load_module("triton", attention.plan, for_device(attention.config))
    rows = module.HOPPER_BLOCK_Q
    padded = -(-seq_len // (2 * rows)) * 2 * rows
    packed = cu_seqlens is not None
    spec = module.Static(module.static_kernels_ranges, 1, 1, 64, packed, seq_len=seq_len)
    if packed:
        offsets = jnp.asarray(cu_seqlens, jnp.int32)
        starts, ends = (np.asarray(x)[0] for x in module._sequence_rows(spec, offsets, padded))
    else:
        starts, ends = np.zeros(padded, np.int32), np.full(padded, seq_len, np.int32)
    q_pos, k_pos = np.arange(padded)[:, None], np.arange(padded)[None, :]
    in_row = (q_pos < seq_len) & (k_pos < seq_len)
    for window in (1, 2, 37, 64, 65, 66, 128, 130, 200, 511, 512, 1000, 2**29):
        visibility = module._Visibility(window, seq_len, packed)
        bounded = window < seq_len
        sees = (k_pos <= q_pos) & (k_pos >= starts[:, None]) & ((k_pos > q_pos - window) | (not bounded)) & in_row
        # the kernels' mask on the steps that take one, against this
        kernel_mask = visibility.sees(q_pos, k_pos) & (k_pos >= starts[:, None]) & in_row
        assert (kernel_mask == sees).all()
        assert (sees.any(axis=1) == (starts <= np.arange(padded)) & (np.arange(padded) < seq_len)).all()

        def first_seen(query):
            return visibility.first_seen(starts[None], 0, query)

        def past_seen(key):
            return visibility.past_seen(ends[None], 0, key)

        for tile_first in range(0, padded, 2 * rows):
            tile_rows = sees[tile_first : tile_first + 2 * rows]
            block = module.HOPPER_DQ_STEP
            first_block, steps = (int(x) for x in module._tile_keys(tile_first, first_seen(tile_first), block))
            walked = slice(first_block * block, (first_block + steps) * block)
            assert steps >= 1 and tile_rows.sum() == tile_rows[:, walked].sum()
            for first_row in (tile_first, tile_first + rows):
                last_first_seen = first_seen(first_row + rows - 1)
                lower, upper = module._unmasked_steps(first_row, last_first_seen, first_block * block, steps, block)
                kept = slice(first_row, min(first_row + rows, seq_len))
                for step in range(int(lower), int(upper)):
                    keys = slice((first_block + step) * block, (first_block + step + 1) * block)
                    assert sees[kept, keys].all(), (window, first_row, block, step)
            block = module.HOPPER_DKDV_STEP
            spans = module._tile_queries(tile_first, past_seen(tile_first), past_seen(tile_first + 2 * rows - 1), block)
            first, end, lower, upper = (int(x) for x in spans)
            tile_keys = sees[:, tile_first : tile_first + 2 * rows]
            assert first < end and tile_keys.sum() == tile_keys[first * block : end * block].sum()
            kept_keys = slice(tile_first, min(tile_first + 2 * rows, seq_len))
            for query_block in range(lower, upper):
                queries = slice(query_block * block, min((query_block + 1) * block, seq_len))
                assert sees[queries, kept_keys].all(), (window, tile_first, query_block)


def test_hopper_dkdv_splits_groups_of_unequal_key_tiles_and_of_too_few_ctas(monkeypatch):
    attention = compiled([L(2**31 - 1)])
    module = codegen.load_module("triton", attention.plan, for_device(attention.config))
    monkeypatch.setattr(triton_glue, "multiprocessors", lambda: 132)

    def splits(window, seq_len, heads_kv, group, batch=1, packed=False):
        visibility = module._Visibility(window, seq_len, packed)
        return module._dkdv_splits(visibility, heads_kv, batch, group)

    causal, shares = 2**31 - 1, module.HOPPER_DKDV_SHARES
    assert shares > 1
    for seq_len in (2000, 8192, 65536):  # unequal tiles: the first is seen by every query
        assert splits(causal, seq_len, 4, 16) == shares
        assert splits(seq_len * 3 // 4, seq_len, 4, 16) == shares
    assert splits(causal, 1000, 4, 16) == 8  # 32 CTAs: as many as it takes to fill the GPU
    assert splits(causal, 8192, 4, 6) == max(s for s in (1, 2, 3, 6) if s <= shares)
    # More CTAs than measured (2048 at 64k): no float32 shares
    assert splits(causal, 131072, 4, 16) == 1 and splits(causal, 8192, 4, 16, batch=64) == 1
    assert splits(causal, 8192, 64, 1) == 1
    assert splits(512, 8192, 4, 16) == 1  # equal tiles, 256 CTAs
    assert splits(causal, 8192, 4, 16, packed=True) == 1  # sequences unknown: counted as equal
    assert splits(512, 8192, 4, 16, batch=3) == 1
    assert splits(512, 1024, 2, 16) == 16  # 16 CTAs: as many as it takes
    assert splits(100, 512, 4, 12) == 12  # 16 CTAs, a bounded window within the rows
    assert splits(100, 1024, 4, 12, packed=True) == 6  # 32 CTAs


@pytest.mark.parametrize("end", [64, 56])
def test_packed_calls_holding_a_non_finite_value_leave_the_hopper_kernels_for_triton(rng, monkeypatch, end):
    """The Hopper kernels' tiles span packed sequences (a NaN or Inf would reach the neighbours:
    tests/test_sequence_isolation.py runs them on a GPU), so a packed call runs them only where the
    values that reach another sequence's rows are finite: k and v in the forward, and q, k, v and
    d_out (through its rows' delta) in the backward, q through the forward's lse in the rows of a
    sequence and read in rows past the last (`end` < 64); otherwise Triton's kernels, which
    isolate. CI cannot run the Mosaic GPU kernels: stand-ins that return a mark show which ran, the
    forward's lse as the kernel's (not finite where the query is, -inf in a row of no sequence)."""
    monkeypatch.setattr(triton_glue, "on_hopper", lambda: True)
    attention = compiled([W(24)], block=8)  # a pattern of this test alone: its traces hold the stand-ins
    module = codegen.load_module("triton", attention.plan, for_device(attention.config))
    mark = 1234.0
    cu_seqlens = jnp.asarray([0, 21, 40, end], jnp.int32)
    inside = (jnp.arange(64) < end)[:, None]

    def forward_stand_in(spec, q, *_):
        lse = jnp.where(inside, 0.0 * q.astype(jnp.float32).sum(axis=-1), -jnp.inf)
        return jnp.full(q.shape, mark, q.dtype), lse

    def backward_stand_in(spec, q, k, v, *_):
        return tuple(jnp.full(x.shape, mark, x.dtype) for x in (q, k, v))

    monkeypatch.setattr(module, "hopper_window_forward", forward_stand_in)
    monkeypatch.setattr(module, "hopper_window_backward", backward_stand_in)
    q, k, v = (jnp.asarray(x, jnp.float16) for x in qkv(rng, 1, 64, 4, 2, 64))
    d_out = jnp.asarray(rng.standard_normal(q.shape), jnp.float16)

    @jax.jit
    def run(q, k, v, d_out):
        out, pullback = jax.vjp(lambda q, k, v: attention(q, k, v, cu_seqlens=cu_seqlens, platform="triton"), q, k, v)
        return out, *pullback(d_out)

    def on_hopper(q=q, k=k, v=v, d_out=d_out):  # for out, dq, dk, dv: whether the Hopper kernels ran
        return [bool((np.asarray(x, np.float32)[0, 0] == mark).all()) for x in run(q, k, v, d_out)]

    def planted(x, value, row=30):
        return x.at[0, row, 1, 3].set(value)

    assert on_hopper() == [True] * 4
    for value in (np.nan, np.inf, -np.inf):
        assert on_hopper(k=planted(k, value)) == [False] * 4
        assert on_hopper(v=planted(v, value)) == [False] * 4
        for row in (30, 60):  # inside the second sequence; the third's or none's
            assert on_hopper(q=planted(q, value, row)) == [True, False, False, False]
        assert on_hopper(d_out=planted(d_out, value)) == [True, False, False, False]


@pytest.mark.parametrize("keys", [W(512), W(200), L(2**31 - 1)])
def test_hopper_kernels_lower_for_cuda(keys):
    """Mosaic GPU kernels run only on a Hopper GPU, and jax 0.10's Mosaic GPU interpreter lacks the
    transposed shared-memory operand of wgmma: on the CPU, the forward and backward kernels are
    lowered for CUDA (Pallas to Mosaic GPU, layouts included); test_hopper_kernels_of_trailing_windows
    runs them on a GPU."""
    pytest.importorskip("absl")  # Mosaic GPU's lowering logs through absl
    attention = compiled([keys])
    module = codegen.load_module("triton", attention.plan, for_device(attention.config))
    # dk/dv of the last case in one share of the group (float16 stores), of the others in several
    # (float32 partial sums).
    cases = ((2, 256, 2, 3, 64, jnp.float16, None), (1, 1024, 1, 16, 128, jnp.bfloat16, None),
             (3, 200, 1, 4, 64, jnp.bfloat16, None), (1, 1000, 2, 2, 128, jnp.float16, (0, 300, 999)),
             (1, 4096, 16, 1, 128, jnp.float16, None))
    for batch, seq_len, heads_kv, group, head_dim, dtype, cu_seqlens in cases:
        packed = cu_seqlens is not None
        spec = module.Static(module.static_kernels_ranges, heads_kv, group, head_dim, packed, seq_len=seq_len)
        offsets = jnp.asarray(cu_seqlens if packed else np.arange(batch + 1) * seq_len, jnp.int32)
        q = jax.ShapeDtypeStruct((batch * seq_len, heads_kv * group, head_dim), dtype)
        k = jax.ShapeDtypeStruct((batch * seq_len, heads_kv, head_dim), dtype)
        scale = jax.ShapeDtypeStruct((1,), jnp.float32)
        forward = jax.jit(lambda q, k, v, scale: module.hopper_window_forward(spec, q, k, v, scale, offsets))
        text = lower_for_cuda(forward, q, k, k, scale).as_text()
        assert "mosaic_gpu" in text
        rows = jax.ShapeDtypeStruct(q.shape[:2], jnp.float32)
        backward = jax.jit(lambda *args: module.hopper_window_backward(spec, *args, offsets))
        text = lower_for_cuda(backward, q, k, k, q, rows, rows, scale).as_text()
        assert text.count("mosaic_gpu") >= 2  # the dq and the dk/dv kernels


@pytest.mark.parametrize("window, group", [(512, 16), (512, 4), (200, 8), (200, 32), (40, 64), (1, 8), (130, 1),
                                           (65, 16), (2**31 - 1, 16)])
def test_hopper_forward_walks_cover_what_their_rows_see(window, group):
    """The Hopper forward's walk of each item (_item_walk: whole steps of 128 keys from a whole tile of
    8 key rows, then a last step) covers every key its rows see, within the static bound the kernel
    sizes its query buffers by, and the keys of the steps it leaves unmasked are seen by every row of
    the compute warpgroup. A KV group's heads share rows where the window is bounded (_Rows.of): the
    window of 512 with 16 heads a group walks 4 steps of 128 and one of 16 keys a row, where 128
    tokens of one head walk 5 of 128."""
    attention = compiled([W(window)])
    module = codegen.load_module("triton", attention.plan, for_device(attention.config))
    block = module.HOPPER_BLOCK_KV
    for seq_len, cu_seqlens in ((1000, None), (1000, [0, 3, 300, 301, 990])):
        packed = cu_seqlens is not None
        spec = module.Static(module.static_kernels_ranges, 1, group, 64, packed, seq_len=seq_len)
        offsets = jnp.asarray(cu_seqlens if packed else [0, seq_len], jnp.int32)
        starts = module._sequence_rows(spec, offsets, module._tiles(seq_len) * 2 * module.HOPPER_BLOCK_Q)[0]
        visibility = module._Visibility.of(spec)
        rows = module._Rows.of(visibility, group)
        assert rows.heads == (group if window < seq_len and group >= 8 else 1)
        most_steps = rows.most_steps(visibility)

        def seen(token):  # [first, last] keys of a query token
            start = int(starts[0, token]) if packed else 0
            return (max(start, token - window + 1) if visibility.bounded else start), token

        for tile_first in range(0, seq_len, 2 * rows.tokens):
            first_key, whole, steps, short = map(int, module._item_walk(visibility, rows, starts, 0,
                                                                         jnp.int32(tile_first)))
            assert not short  # rows.halves: the compression's only
            end_key = first_key + whole * block + (rows.last_step if steps else 0)
            assert first_key % module.HOPPER_ROW_MULTIPLE == 0 and steps <= most_steps
            for member in range(2):
                tokens = range(tile_first + member * rows.tokens, tile_first + (member + 1) * rows.tokens)
                for token in tokens:
                    low, high = seen(token)
                    assert low > high or first_key <= low and high < end_key, (tile_first, token)
                lower, upper = map(int, visibility.unmasked(starts, 0, tokens[0], tokens[-1], first_key, whole, block))
                for step in range(lower, upper):
                    assert all(seen(token)[0] <= first_key + step * block and first_key + (step + 1) * block - 1
                               <= token for token in tokens), (tile_first, member, step)
            if (window, group) == (512, 16) and not packed and tile_first >= 512:
                assert (whole, rows.last_step) == (4, 16)


@pytest.mark.skipif(not triton_glue.on_hopper(), reason="Mosaic GPU kernels: a Hopper GPU only")
@pytest.mark.parametrize("keys", [W(154), W(140), W(200), L(2**31 - 1)])
def test_hopper_kernels_of_trailing_windows(rng, monkeypatch, keys):
    attention = compiled([keys])
    module = codegen.load_module("triton", attention.plan, for_device(attention.config))
    calls = record_calls(monkeypatch, module, "hopper_window_forward", "hopper_window_backward")
    # The third shape has more work items (query tiles x heads x rows) than the GPU has CTAs; then a
    # ragged length, packed sequences with boundaries inside tiles and rows past the last, and one
    # query head per KV head (dk/dv unsplit; the others split their groups: few key tiles). Groups of
    # 8, 16 and 32 heads share a warpgroup's rows (_Rows.of); their forward's last step takes 48 keys
    # of window 154 (V in a buffer of its own, 32-byte swizzle), 32 (64-byte) or 48 of window 140, and
    # 128 of window 200.
    shapes = [((2, 384, 4, 4, 64), None), ((1, 384, 32, 2, 128), None), ((3, 384, 48, 3, 64), None),
              ((2, 328, 8, 2, 128), None), ((1, 520, 16, 2, 64), np.array([0, 100, 101, 357, 500], np.int32)),
              ((1, 256, 8, 1, 64), None), ((1, 264, 32, 1, 128), None)]
    for shape, cu_seqlens in shapes:
        calls.clear()
        check(rng, attention, *qkv(rng, *shape, dtype=np.float16), cu_seqlens=cu_seqlens)
        assert set(calls) == {"hopper_window_forward", "hopper_window_backward"}, f"no Hopper kernels at {shape}"


@pytest.mark.skipif(not triton_glue.on_hopper(), reason="Mosaic GPU kernels: a Hopper GPU only")
def test_hopper_forward_lse_tells_whether_packed_queries_are_finite(rng):
    """queries_finite learns of a packed call's queries from the Hopper forward's lse: all finite
    on finite inputs (rows past the last sequence, whose lse is -inf, included), and not where a
    query holds a NaN, an inf, or a -inf whose every visible score is -inf (its output is zeros);
    a row past the last sequence is read from q itself."""
    attention = compiled([W(200)])
    module = codegen.load_module("triton", attention.plan, for_device(attention.config))
    seq_len, heads_kv, group, head_dim = 1000, 2, 2, 64
    spec = module.Static(module.static_kernels_ranges, heads_kv, group, head_dim, True, seq_len=seq_len)
    offsets = jnp.asarray([0, 300, 997], jnp.int32)
    q, k, v = (jnp.asarray(x[0], jnp.float16) for x in qkv(rng, 1, seq_len, heads_kv * group, heads_kv, head_dim))
    scale = jnp.full((1,), head_dim**-0.5, jnp.float32)

    def finite(q, k):
        _, lse = module.hopper_window_forward(spec, q, k, v, scale, offsets)
        return bool(module.queries_finite(q, lse, offsets))

    assert finite(q, k)
    for value in (np.nan, np.inf, -np.inf):
        assert not finite(q.at[500, 1, 3].set(value), k)
        assert not finite(q.at[998, 1, 3].set(value), k)
    # The second sequence's first row sees its own key alone, made positive where the query is -inf.
    assert not finite(q.at[300, 1, 3].set(-np.inf), k.at[300, 0, 3].set(1.0))


@pytest.mark.skipif(not triton_glue.on_hopper(), reason="Mosaic GPU kernels: a Hopper GPU only")
def test_hopper_kernels_under_vmap_of_packed_calls(rng, monkeypatch):
    """jax.vmap of a packed call is not folded into its batch (runtime/batching.py): the mapped axis
    reaches the Mosaic GPU kernels (Pallas' batching rule) and the finiteness check, whose mapped
    predicate makes both launches run and selects between them. Each element of the mapped call,
    and of its gradient, is the call of that element alone (rows past the last sequence included)."""
    attention = compiled([W(200)])
    module = codegen.load_module("triton", attention.plan, for_device(attention.config))
    calls = record_calls(monkeypatch, module, "hopper_window_forward", "hopper_window_backward")
    cu_seqlens = jnp.asarray([0, 300, 997], jnp.int32)
    stacks = [jnp.asarray(np.stack(x), jnp.float16) for x in zip(*(qkv(rng, 1, 1000, 4, 2, 64) for _ in range(3)))]
    cotangent = jnp.asarray(rng.standard_normal(stacks[0].shape[1:]), jnp.float16)

    def output(q, k, v):
        return attention(q, k, v, cu_seqlens=cu_seqlens, platform="triton")

    def loss(q, k, v):
        return jnp.sum(output(q, k, v).astype(jnp.float32) * cotangent)

    for function in (output, jax.grad(loss, argnums=(0, 1, 2))):
        calls.clear()
        mapped = jax.jit(jax.vmap(function))(*stacks)
        assert "hopper_window_forward" in calls
        one_by_one = [jax.jit(function)(*(x[i] for x in stacks)) for i in range(3)]
        for i, element in enumerate(one_by_one):
            for got, wanted in zip(jax.tree.leaves(mapped), jax.tree.leaves(element)):
                np.testing.assert_allclose(np.asarray(got[i], np.float32), np.asarray(wanted, np.float32),
                                           rtol=1e-2, atol=1e-2, err_msg=f"element {i}")


# ---- table branches ----------------------------------------------------------------------------


def test_bidirectional_nested_set_algebra_on_packed_sequences_float16(rng):
    keys = model.Difference(U(L(2, 1), G(1), R(1, 3)), model.Intersection((S(2, 1), W(10, 10))))
    attention = compiled([keys], causal=False)
    check(rng, attention, *qkv(rng, 1, 48, 3, 1, 20, dtype=np.float16), cu_seqlens=np.array([0, 21, 44], np.int32))


def test_difference_with_sixteen_query_heads_per_kv_head_four_a_tile(rng):
    attention = compiled([model.Difference(L(4), U(W(5), BL((1,))))], tiles=(64, 16))
    check(rng, attention, *qkv(rng, 1, 35, 16, 1, 16))


# ---- head dims the issue names --------------------------------------------------------------------


@pytest.mark.parametrize("head_dim, heads_q, heads_kv, dtype, cu_seqlens", [
    (60, 3, 1, np.float32, np.array([0, 11, 50, 70], np.int32)),  # group 3, packed, rows past the last
    (100, 2, 2, np.float16, None),  # group 1, a batch of two rows
    (192, 16, 1, np.float32, np.array([0, 29, 71], np.int32)),  # group 16, packed; padded to 256
    (256, 4, 2, np.float16, np.array([0, 40, 73], np.int32)),  # the widest head dim the issue names, unpadded
])
def test_head_dims_60_100_192_256_fused_ranges_and_a_table(rng, head_dim, heads_q, heads_kv, dtype, cu_seqlens):
    """The head dims the Triton issue names (60, 100, 192: no power of two, every load, product and
    store masks the padded columns; 256, its widest), on gated range branches fused into one launch
    beside a table branch: the output and the gradients of q, k, v, the scale and both gates, odd
    lengths, packed sequences."""
    gates = [model.Gate("g_swa"), model.Gate("g_sink"), None]
    attention = compiled([W(21), U(G(1), S(3, 1)), R(1, 5)], gates=gates)
    assert [launch.fused for launch in static_launches(attention.plan)] == [True, False]
    batch, seq_len = (2, 41) if cu_seqlens is None else (1, 73)
    q, k, v = qkv(rng, batch, seq_len, heads_q, heads_kv, head_dim, dtype=dtype)
    check(rng, attention, q, k, v, gates={name: gate(rng, batch, seq_len, heads_q).astype(dtype)
                                          for name in ("g_swa", "g_sink")}, cu_seqlens=cu_seqlens)
