"""The Triton kernels for explicit per-token selection, run in Triton's interpreter on the CPU
(the same @triton.jit functions jax-triton launches on a GPU), against the float64 reference:
forward and gradients of q, k, v and the gate, float32 and float16, odd lengths, head dims
32/60/64/100/192, GQA groups 1/3/4/16/24, per-token counts, out-of-range and repeated entries,
packed sequences (what it shares with Pallas is in test_interpreted_selection.py), and every
order of the backward (dq from stored score gradients, or for small groups summed from stored dq
parts, all KV heads at once or in slices of heads, and dq recomputing the score gradients where
they would not fit in memory). The interpreter runs one program at a time in Python, so shapes are
small."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import check_selection_against_reference, gate, qkv, random_indices, triton_launches

import nsa_dsl
from nsa_dsl.runtime import triton_glue

# float16 kernels round p and ds to float16 before their matrix products.
TOLERANCE = {np.float32: 2e-5, np.float16: 5e-3}


def selection(q, k, v, g_slc, indices, counts, block, cu_seqlens=None, scale=None, block_k=None):
    cfg = nsa_dsl.NativeSparseAttentionConfig(block_size=block, block_k=block_k)
    return nsa_dsl.native_sparse_attention(
        q, k, v, None, g_slc, indices, counts, cu_seqlens, softmax_scale=scale, platform="triton", cfg=cfg
    )


def check_forward_and_gradients(rng, q, k, v, g_slc, indices, counts, block, cu_seqlens=None, scale=None):
    tolerance = TOLERANCE[q.dtype.type]
    check_selection_against_reference(rng, functools.partial(selection, scale=scale), q, k, v, g_slc, indices, counts,
                                      block, cu_seqlens, (tolerance, tolerance), scale)


@pytest.mark.parametrize(
    "dtype, batch, seq_len, heads_q, heads_kv, head_dim, width, block, per_token_counts",
    [
        (np.float32, 2, 63, 1, 1, 64, 3, 16, True),  # group 1, T not a multiple of the block
        (np.float16, 1, 111, 3, 1, 60, 4, 32, True),  # group 3, head dim not a power of two
        (np.float32, 1, 63, 16, 1, 32, 3, 16, False),  # group 16
        (np.float32, 1, 37, 24, 1, 32, 3, 16, True),  # group 24: 32 head slots a token, 8 of them padding
        (np.float16, 1, 48, 4, 1, 100, 2, 16, True),  # group 4, head dim 100
        (np.float32, 1, 40, 4, 1, 32, 6, 16, True),  # more entries than blocks: repeats everywhere
    ],
)
def test_forward_and_gradients(rng, dtype, batch, seq_len, heads_q, heads_kv, head_dim, width, block, per_token_counts):
    q, k, v = qkv(rng, batch, seq_len, heads_q, heads_kv, head_dim, dtype=dtype)
    indices = random_indices(rng, batch, seq_len, heads_kv, width, block)
    counts = rng.integers(0, width + 1, (batch, seq_len, heads_kv)).astype(np.int32) if per_token_counts else width - 1
    g_slc = gate(rng, batch, seq_len, heads_q).astype(dtype)
    check_forward_and_gradients(rng, q, k, v, g_slc, indices, counts, block)


@pytest.mark.parametrize("dtype, cu_seqlens", [(np.float32, None), (np.float16, np.array([0, 7, 23, 40], np.int32))])
def test_few_programs_split_their_walks_over_the_selected_blocks(rng, monkeypatch, dtype, cu_seqlens):
    """A launch of few programs (a decoding step's: here 2 x 20 tokens of one KV head) splits each
    token's walk over its selected blocks into shares, a program each (17 entries, one a step:
    7 shares, enough for SPLIT_PROGRAMS = 256 programs), merged as one walk would have: the
    reference's output, differentiated (the
    selection's own output and lse) and not (gated_merge: the shares merged as the gate applies); with
    counts of 0 to 17 (shares that see nothing), entries past the blocks there are, and packed
    sequences (rows of none)."""
    batch = 1 if cu_seqlens is not None else 2
    q, k, v = qkv(rng, batch, 40 // batch, 4, 1, 32, dtype=dtype)
    indices = random_indices(rng, batch, 40 // batch, 1, 17, 8, cu_seqlens)
    counts = rng.integers(0, 18, (batch, 40 // batch, 1)).astype(np.int32)
    g_slc = gate(rng, batch, 40 // batch, 4).astype(dtype)
    tolerance = TOLERANCE[q.dtype.type]
    small_steps = functools.partial(selection, block_k=16)
    launches = triton_launches(monkeypatch, lambda: check_selection_against_reference(
        rng, small_steps, q, k, v, g_slc, indices, counts, 8, cu_seqlens, (tolerance, tolerance)))
    assert {grid[2] for name, grid in launches if name == "selection_forward"} == {7}, launches
    assert "gated_merge" in {name for name, _ in launches}, "not differentiated: the shares merge as the gate applies"


@pytest.mark.parametrize(
    "dtype, batch, seq_len, heads_q, heads_kv, head_dim, width, block, cu_seqlens, memory, slices",
    [
        (np.float32, 2, 63, 2, 1, 60, 4, 16, None, None, (1, 1)),  # group 2, T not a multiple of the block
        (np.float16, 1, 70, 16, 2, 32, 3, 8, None, None, (1, 1)),  # group 8 with 2 KV heads
        # group 8, whole blocks of 16: segments after a block's own tokens skip the visibility test
        (np.float16, 1, 90, 8, 1, 64, 4, 16, None, None, (1, 1)),
        # the backward's score gradients in two slices of one KV head (300 KB: parts fit, half the scores)
        (np.float16, 1, 70, 16, 2, 32, 3, 8, None, 300_000, (1, 2)),
        # the forward's parts in two slices (150 KB: one KV head's, 108 KB); dq recomputes the scores
        (np.float16, 1, 70, 16, 2, 32, 3, 8, None, 150_000, (2, 1)),
        (np.float32, 1, 45, 17, 1, 32, 5, 8, np.array([0, 9, 30, 40], np.int32), None, (1, 1)),  # group 17, packed, rows of none
    ],
)
def test_key_block_outer_forward(rng, monkeypatch, block_outer_forward, dtype, batch, seq_len, heads_q, heads_kv,
                                 head_dim, width, block, cu_seqlens, memory, slices):
    """The forward key block by key block (selection_forward_by_block: each entry's part of a
    token's softmax, merged by merge_splits, or by gated_merge as the gate applies), with per-token
    counts of 0 to S (entries naming no block), out-of-range entries and repeats: the reference's
    output and gradients, the backward walking the forward's pair lists (by slices of KV heads
    where `memory` holds the score gradients of one), the forward by slices of KV heads where it
    holds the parts of fewer than all: `slices`, (the forward's, dk/dv's)."""
    if memory is not None:
        monkeypatch.setattr(triton_glue, "_device_memory_bytes", lambda: memory)
        monkeypatch.setenv("NSA_DSL_PAIR_PARTS_SHARE", "1")
    q, k, v = qkv(rng, batch, seq_len, heads_q, heads_kv, head_dim, dtype=dtype)
    indices = random_indices(rng, batch, seq_len, heads_kv, width, block, cu_seqlens)
    counts = rng.integers(0, width + 1, (batch, seq_len, heads_kv)).astype(np.int32)
    g_slc = gate(rng, batch, seq_len, heads_q).astype(dtype)
    launches = [name for name, _ in triton_launches(monkeypatch, lambda: check_forward_and_gradients(
        rng, q, k, v, g_slc, indices, counts, block, cu_seqlens))]
    forward_slices, backward_slices = slices
    assert launches.count("selection_forward_by_block") == 2 * forward_slices, launches  # differentiated and not
    assert "selection_forward" not in launches and "gated_selection_forward" not in launches, launches
    assert "gated_merge" in launches, "not differentiated: the parts merge as the gate applies"
    assert launches.count("selection_backward_dkdv") == backward_slices, launches


def test_key_block_outer_rows_inside_their_own_block(rng, monkeypatch, block_outer_forward):
    """Every token takes its own block first (as topk's force=local(1) does), so a block's list
    opens with a run of its own tokens, each seeing only part of it: the walk that tests visibility
    must take all of them, up to the row before the block's last key."""
    seq_len, block = 75, 16
    q, k, v = qkv(rng, 1, seq_len, 8, 2, 32, dtype=np.float32)
    indices = random_indices(rng, 1, seq_len, 2, 3, block, None)
    indices[..., 0] = (np.arange(seq_len) // block)[None, :, None]
    counts = np.full((1, seq_len, 2), 3, np.int32)
    g_slc = gate(rng, 1, seq_len, 8)
    launches = [name for name, _ in triton_launches(monkeypatch, lambda: check_forward_and_gradients(
        rng, q, k, v, g_slc, indices, counts, block))]
    assert "selection_forward_by_block" in launches, launches


@pytest.mark.parametrize("seq_len, sequences", [(70, 7), (200, 21)])
def test_key_block_outer_programs_reach_the_last_block_of_many_short_sequences(rng, monkeypatch, block_outer_forward,
                                                                               seq_len, sequences):
    """Packed sequences of 9 rows in blocks of 8 (each a partial last block, so block ids run ahead
    of rows) and rows past the last one, in segments of 16 rows: every token takes its own block
    first. A launch that bounded a segment's blocks by its rows (as session 63's triangular launch
    did) would fail here with the bound one block short."""
    block = 8
    cu_seqlens = np.arange(0, 9 * sequences + 1, 9, dtype=np.int32)
    q, k, v = qkv(rng, 1, seq_len, 4, 1, 32, dtype=np.float32)
    indices = random_indices(rng, 1, seq_len, 1, 3, block, cu_seqlens)
    starts = np.repeat(cu_seqlens[:-1], np.diff(cu_seqlens))
    indices[0, :cu_seqlens[-1], :, 0] = ((np.arange(cu_seqlens[-1]) - starts) // block)[:, None]
    counts = np.full((1, seq_len, 1), 3, np.int32)
    g_slc = gate(rng, 1, seq_len, 4)
    launches = [name for name, _ in triton_launches(monkeypatch, lambda: check_forward_and_gradients(
        rng, q, k, v, g_slc, indices, counts, block, cu_seqlens))]
    assert "selection_forward_by_block" in launches, launches


@pytest.mark.parametrize("scale", [-0.4, 0.0, 1.7])
def test_key_block_outer_softmax_scales(rng, monkeypatch, block_outer_forward, scale):
    """The forward key block by key block folds the scale into its exponent: a negative scale
    (keys negated), zero (every key seen weighs alike) and a large one, against the reference."""
    q, k, v = qkv(rng, 1, 75, 4, 1, 32, dtype=np.float32)
    indices = random_indices(rng, 1, 75, 1, 4, 16, None)
    counts = rng.integers(0, 5, (1, 75, 1)).astype(np.int32)
    g_slc = gate(rng, 1, 75, 4).astype(np.float32)
    launches = [name for name, _ in triton_launches(monkeypatch, lambda: check_forward_and_gradients(
        rng, q, k, v, g_slc, indices, counts, 16, scale=scale))]
    assert "selection_forward_by_block" in launches, launches


@pytest.mark.parametrize(
    "dtype, seq_len, heads_q, head_dim, width, block",
    [(np.float32, 63, 3, 60, 4, 16), (np.float16, 50, 16, 32, 3, 16)],
)
def test_recomputed_score_gradients(rng, recomputed_scores, dtype, seq_len, heads_q, head_dim, width, block):
    q, k, v = qkv(rng, 1, seq_len, heads_q, 1, head_dim, dtype=dtype)
    indices = random_indices(rng, 1, seq_len, 1, width, block)
    counts = rng.integers(0, width + 1, (1, seq_len, 1)).astype(np.int32)
    g_slc = gate(rng, 1, seq_len, heads_q).astype(dtype)
    check_forward_and_gradients(rng, q, k, v, g_slc, indices, counts, block)


@pytest.mark.parametrize(
    "dtype, seq_len, heads_q, heads_kv, head_dim, width, block",
    [(np.float32, 57, 8, 2, 48, 3, 16), (np.float16, 40, 12, 4, 32, 4, 16)],
)
def test_score_gradients_in_head_slices(rng, scores_in_head_slices, dtype, seq_len, heads_q, heads_kv, head_dim, width,
                                        block):
    q, k, v = qkv(rng, 1, seq_len, heads_q, heads_kv, head_dim, dtype=dtype)
    indices = random_indices(rng, 1, seq_len, heads_kv, width, block)
    counts = rng.integers(0, width + 1, (1, seq_len, heads_kv)).astype(np.int32)
    g_slc = gate(rng, 1, seq_len, heads_q).astype(dtype)
    check_forward_and_gradients(rng, q, k, v, g_slc, indices, counts, block)
    every_head = scores_in_head_slices[0]
    assert every_head // 2 in scores_in_head_slices, "the backward did not try slices of half the KV heads"


def backward_launches(monkeypatch, rng, heads_q, heads_kv, dtype, block, cu_seqlens=None):
    """The kernels a gradient of a per-token selection launches, having checked it against the
    reference (counts from 0: tokens without any block)."""
    seq_len, width = 53, 4
    q, k, v = qkv(rng, 1, seq_len, heads_q, heads_kv, 40, dtype=dtype)
    indices = random_indices(rng, 1, seq_len, heads_kv, width, block, cu_seqlens)
    counts = rng.integers(0, width + 1, (1, seq_len, heads_kv)).astype(np.int32)
    g_slc = gate(rng, 1, seq_len, heads_q).astype(dtype)
    return {name for name, _ in triton_launches(monkeypatch, lambda: check_forward_and_gradients(
        rng, q, k, v, g_slc, indices, counts, block, cu_seqlens))}


@pytest.mark.parametrize("dtype, heads_q, heads_kv, block, cu_seqlens", [
    (np.float32, 2, 2, 16, None),  # group 1
    (np.float16, 3, 3, 32, None),  # group 1, 3 KV heads
    (np.float32, 4, 2, 32, np.array([0, 20, 21, 47], np.int32)),  # group 2, rows past the last sequence
])
def test_small_groups_sum_dq_from_parts_the_key_gradients_store(rng, monkeypatch, dtype, heads_q, heads_kv, block,
                                                                cu_seqlens):
    """Groups whose rows weigh less than a block's keys: dk/dv store each pair's ds @ k, which XLA
    sums per token (entries naming no block left out: the interpreter's unwritten outputs are NaN),
    and no dq kernel runs."""
    launches = backward_launches(monkeypatch, rng, heads_q, heads_kv, dtype, block, cu_seqlens)
    assert "selection_backward_dkdv" in launches and not launches & {
        "selection_backward_dq_from_scores", "selection_backward_dq"}, launches


def test_larger_groups_read_stored_score_gradients_with_the_keys(rng, monkeypatch):
    launches = backward_launches(monkeypatch, rng, 8, 2, np.float32, 16)
    assert "selection_backward_dq_from_scores" in launches, launches


def test_dq_parts_in_head_slices(rng, monkeypatch, scores_in_head_slices):
    launches = backward_launches(monkeypatch, rng, 3, 3, np.float32, 16)
    assert "selection_backward_dq_from_scores" not in launches, launches
    assert scores_in_head_slices[0] // 3 in scores_in_head_slices, "the backward did not try slices of one KV head"


def test_the_score_gradients_memory_share(monkeypatch):
    """Stored where they fit in the share of the device's memory; the environment sets the share."""
    monkeypatch.setattr(triton_glue, "_device_memory_bytes", lambda: 1000)
    monkeypatch.delenv("NSA_DSL_STORED_SCORES_SHARE", raising=False)
    assert triton_glue.memory_share("NSA_DSL_STORED_SCORES_SHARE", 0.125) == 0.125
    assert triton_glue.fits_device_memory(125, 0.125) and not triton_glue.fits_device_memory(126, 0.125)
    monkeypatch.setenv("NSA_DSL_STORED_SCORES_SHARE", "0.5")
    assert triton_glue.fits_device_memory(400, triton_glue.memory_share("NSA_DSL_STORED_SCORES_SHARE", 0.125))
    for bad in ("1.5", "-0.1", "half", "nan"):
        monkeypatch.setenv("NSA_DSL_STORED_SCORES_SHARE", bad)
        with pytest.raises(ValueError, match="NSA_DSL_STORED_SCORES_SHARE must be a number from 0 to 1"):
            triton_glue.memory_share("NSA_DSL_STORED_SCORES_SHARE", 0.125)


@pytest.mark.parametrize("dtype, heads_q, head_dim", [
    (np.float32, 4, 32),
    (np.float16, 4, 32),
    (np.float32, 16, 192),  # group 16, head dim 192 (padded to 256)
    (np.float16, 1, 100),  # group 1, head dim 100
    (np.float32, 3, 60),  # group 3, head dim 60
])
def test_packed_sequences(rng, dtype, heads_q, head_dim):
    cu_seqlens = np.array([0, 15, 40, 61], dtype=np.int32)  # rows 61..63 belong to no sequence
    q, k, v = qkv(rng, 1, 64, heads_q, 1, head_dim, dtype=dtype)
    indices = random_indices(rng, 1, 64, 1, 3, 16, cu_seqlens)
    counts = rng.integers(1, 4, (1, 64, 1)).astype(np.int32)
    g_slc = gate(rng, 1, 64, heads_q).astype(dtype)
    check_forward_and_gradients(rng, q, k, v, g_slc, indices, counts, 16, cu_seqlens)


@pytest.mark.parametrize("heads_q, heads_kv", [(2, 2), (6, 2), (17, 1)])
def test_one_program_loads_a_kv_groups_query_heads(rng, monkeypatch, heads_q, heads_kv):
    """Group-centric (the Triton issue): the forward's and dq's programs each take one token's G
    query heads of one KV head, sharing every K/V tile among them (grid: tokens x KV heads, whatever
    G: 1, 3, 17), and dk/dv's programs one key block of one KV head (a program a list, for every
    list of every KV head); no launch runs a program per query head. Traced, not run."""
    seq_len, block = 45, 16
    q, k, v = qkv(rng, 1, seq_len, heads_q, heads_kv, 32)
    indices = random_indices(rng, 1, seq_len, heads_kv, 3, block)

    def loss(q, k, v):
        return jnp.sum(selection(q, k, v, None, indices, 3, block) * q)

    launches = dict(triton_launches(monkeypatch, lambda: jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)))
    # A group of one sums dq from the parts dk/dv store (test_small_groups_sum_dq_from_parts...).
    token_kernels = ("selection_forward", "selection_backward_dq_from_scores")[:1 if heads_q == heads_kv else 2]
    for name in token_kernels:
        assert launches[name][:2] == (seq_len, heads_kv), (name, launches)
    assert launches["selection_backward_dkdv"] == (-(-seq_len // block) * heads_kv,), launches


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="the interpreter's limit: a GPU runs bfloat16")
def test_bfloat16_needs_a_gpu(rng):
    q, k, v = (x.astype(jnp.bfloat16) for x in qkv(rng, 1, 16, 2, 1, 16))
    indices = np.zeros((1, 16, 1, 1), np.int32)
    with pytest.raises(ValueError, match="bfloat16 needs a GPU"):
        selection(q, k, v, None, indices, 1, 16)
