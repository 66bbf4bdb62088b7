"""The XLA kernel for explicit per-token selection (native_sparse_attention with block_indices)
against the float64 reference: forward and gradients, odd lengths, head dims, GQA groups,
per-token counts, packed sequences, out-of-range and repeated entries, bf16, jit."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nsa_dsl
import reference
from conftest import (
    BF16_TOLERANCE,
    FORWARD_TOLERANCE,
    GRADIENT_TOLERANCE,
    assert_close,
    gate,
    normal,
    qkv,
    random_indices,
)


def selection(q, k, v, g_slc, indices, counts, block, cu_seqlens=None, scale=None):
    cfg = nsa_dsl.NativeSparseAttentionConfig(block_size=block)
    return nsa_dsl.native_sparse_attention(q, k, v, None, g_slc, indices, counts, cu_seqlens, softmax_scale=scale, cfg=cfg)


def check_forward_and_gradients(rng, q, k, v, g_slc, indices, counts, block, cu_seqlens=None):
    scale = 1.0 / np.sqrt(q.shape[-1])
    mask = reference.selection_mask(indices, counts, block, cu_seqlens)
    out = selection(q, k, v, g_slc, indices, counts, block, cu_seqlens)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert_close(out, reference.forward(q, k, v, [mask], [g_slc], scale), FORWARD_TOLERANCE, "output")

    d_out = normal(rng, *out.shape)
    pullback = jax.jit(
        lambda q, k, v, g, d: jax.vjp(lambda *a: selection(*a, indices, counts, block, cu_seqlens), q, k, v, g)[1](d)
    )
    dq, dk, dv, dg = pullback(q, k, v, g_slc, d_out)
    expected = reference.gradients(q, k, v, [mask], [g_slc], scale, d_out)
    for name, actual, wanted in (("dq", dq, expected["q"]), ("dk", dk, expected["k"]), ("dv", dv, expected["v"]),
                                 ("dg_slc", dg, expected["gates"][0])):
        assert_close(actual, wanted, GRADIENT_TOLERANCE, name)


@pytest.mark.parametrize(
    "batch, seq_len, heads_q, heads_kv, head_dim, width, block, per_token_counts",
    [
        (2, 63, 4, 2, 60, 3, 16, True),  # group 2, T not a multiple of the block
        (1, 111, 3, 1, 100, 4, 16, False),  # group 3
        (1, 64, 16, 1, 128, 2, 32, True),  # group 16
        (2, 40, 4, 4, 32, 3, 16, False),  # group 1
        (1, 50, 8, 2, 64, 5, 16, True),  # group 4, more entries than blocks
    ],
)
def test_forward_and_gradients(rng, batch, seq_len, heads_q, heads_kv, head_dim, width, block, per_token_counts):
    q, k, v = qkv(rng, batch, seq_len, heads_q, heads_kv, head_dim)
    indices = random_indices(rng, batch, seq_len, heads_kv, width, block)
    counts = rng.integers(0, width + 1, (batch, seq_len, heads_kv)).astype(np.int32) if per_token_counts else width - 1
    check_forward_and_gradients(rng, q, k, v, gate(rng, batch, seq_len, heads_q), indices, counts, block)


def test_packed_sequences(rng):
    cu_seqlens = np.array([0, 15, 205, 550, 800], dtype=np.int32)
    q, k, v = qkv(rng, 1, 800, 2, 1, 32)
    indices = random_indices(rng, 1, 800, 1, 4, 32, cu_seqlens)
    counts = rng.integers(1, 5, (1, 800, 1)).astype(np.int32)
    check_forward_and_gradients(rng, q, k, v, gate(rng, 1, 800, 2), indices, counts, 32, cu_seqlens)


def test_nothing_to_attend_gives_zeros_and_finite_gradients(rng):
    q, k, v = qkv(rng, 1, 37, 4, 2, 16)
    indices = random_indices(rng, 1, 37, 2, 3, 16)
    indices[0, :20] = -1  # the first 20 tokens select nothing
    counts = np.full((1, 37, 2), 3, dtype=np.int32)
    counts[0, 30:, 1] = 0  # and KV head 1's group sees nothing from token 30 on

    def total(q, k, v):
        return jnp.sum(selection(q, k, v, None, indices, counts, 16) ** 2)

    out = selection(q, k, v, None, indices, counts, 16)
    assert not np.asarray(out[0, :20]).any()
    assert not np.asarray(out[0, 30:, 2:]).any()  # query heads 2, 3 form KV head 1's group
    assert np.asarray(out[0, 30:, :2]).any()
    grads = jax.grad(total, argnums=(0, 1, 2))(q, k, v)
    for grad in grads:
        assert np.isfinite(np.asarray(grad)).all()
    assert not np.asarray(grads[0][0, :20]).any()


def test_out_of_range_and_repeated_entries_are_ignored(rng):
    q, k, v = qkv(rng, 1, 70, 2, 1, 24)
    indices = np.array([-(2**31), -5, -1, 0, 1, 3, 4, 2**31 - 1, 10**6], dtype=np.int64)
    indices = np.broadcast_to(rng.permuted(np.tile(indices, (70, 1)), axis=1)[None, :, None, :], (1, 70, 1, 9))
    indices = np.concatenate([indices, indices[..., :3]], axis=-1)  # repeats of earlier entries
    mask = reference.selection_mask(indices, 12, 16)
    expected = reference.forward(q, k, v, [mask], [None], 1 / np.sqrt(24))
    assert_close(selection(q, k, v, None, indices, 12, 16), expected, FORWARD_TOLERANCE, "output")


def test_int64_entries_past_int32_are_out_of_range_not_wrapped(rng):
    """int64 block indices beyond int32's range are clamped (then out of range: ignored) in
    int64, before narrowing: cast first, 2**32 + 1 would wrap to block 1 and be attended; counts
    past int32 clamp to every entry."""
    q, k, v = qkv(rng, 1, 53, 2, 1, 20)
    big = np.array([2**32 + 1, 2**33 + 2, -(2**32) + 3, 2**32], dtype=np.int64)
    indices = np.where(rng.random((1, 53, 1, 4)) < 0.5, big[rng.integers(0, 4, (1, 53, 1, 4))],
                       rng.integers(0, 4, (1, 53, 1, 4))).astype(np.int64)
    counts = rng.integers(0, 5, (1, 53, 1)).astype(np.int64)
    counts[0, ::3] = 2**32 + 2  # wrapped: 2
    mask = reference.selection_mask(indices, np.minimum(counts, 4), 16)
    g_slc = gate(rng, 1, 53, 2)
    expected = reference.forward(q, k, v, [mask], [g_slc], 1 / np.sqrt(20))
    assert_close(selection(q, k, v, g_slc, indices, counts, 16), expected, FORWARD_TOLERANCE, "output")


def test_bfloat16_forward(rng):
    q, k, v = qkv(rng, 1, 90, 4, 2, 64)
    indices = random_indices(rng, 1, 90, 2, 3, 16)
    g_slc = gate(rng, 1, 90, 4)
    bf16 = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v, g_slc)]
    out = selection(*bf16, indices, 3, 16)
    assert out.dtype == jnp.bfloat16
    rounded = [np.asarray(x, np.float32) for x in bf16]
    expected = reference.forward(*rounded[:3], [reference.selection_mask(indices, 3, 16)], [rounded[3]], 1 / 8)
    assert_close(np.asarray(out, np.float32), expected, BF16_TOLERANCE, "bf16 output")


def test_jit_with_traced_scale_and_cu_seqlens(rng):
    cu_seqlens = np.array([0, 30, 31, 97], dtype=np.int32)
    q, k, v = qkv(rng, 1, 100, 4, 1, 32)  # rows 97..99 belong to no sequence
    indices = random_indices(rng, 1, 100, 1, 3, 16, cu_seqlens)
    attend = jax.jit(lambda q, k, v, scale, cu: selection(q, k, v, None, indices, 3, 16, cu, scale))
    for scale, cu in ((0.3, cu_seqlens), (0.05, np.array([0, 64, 64, 100], dtype=np.int32))):
        mask = reference.selection_mask(indices, 3, 16, cu)
        out = attend(q, k, v, jnp.float32(scale), jnp.asarray(cu))
        assert_close(out, reference.forward(q, k, v, [mask], [None], scale), FORWARD_TOLERANCE, f"scale {scale}")
    assert attend._cache_size() == 1  # one trace served both scales and both packings
