"""The Triton kernels for explicit per-token selection, run in Triton's interpreter on the CPU
(the same @triton.jit functions jax-triton launches on a GPU), against the float64 reference:
forward and gradients of q, k, v and the gate, float32 and float16, odd lengths, head dims
32/60/64/100, GQA groups 1/3/4/16, per-token counts, out-of-range and repeated entries,
packed sequences, rows with nothing to attend to. The interpreter runs one program at a time
in Python, so shapes are small."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nsa_dsl
import reference
from conftest import assert_close, check_selection_against_reference, gate, normal, qkv, random_indices
from nsa_dsl.runtime import resolve_platform

# float16 kernels round p and ds to float16 before their matrix products.
TOLERANCE = {np.float32: 2e-5, np.float16: 5e-3}


def selection(q, k, v, g_slc, indices, counts, block, cu_seqlens=None, scale=None):
    cfg = nsa_dsl.NativeSparseAttentionConfig(block_size=block)
    return nsa_dsl.native_sparse_attention(
        q, k, v, None, g_slc, indices, counts, cu_seqlens, softmax_scale=scale, platform="triton", cfg=cfg
    )


def check_forward_and_gradients(rng, q, k, v, g_slc, indices, counts, block, cu_seqlens=None):
    tolerance = TOLERANCE[q.dtype.type]
    check_selection_against_reference(rng, selection, q, k, v, g_slc, indices, counts, block, cu_seqlens, (tolerance, tolerance))


@pytest.mark.parametrize(
    "dtype, batch, seq_len, heads_q, heads_kv, head_dim, width, block, per_token_counts",
    [
        (np.float32, 2, 63, 1, 1, 64, 3, 16, True),  # group 1, T not a multiple of the block
        (np.float16, 1, 111, 3, 1, 60, 4, 32, True),  # group 3, head dim not a power of two
        (np.float32, 1, 63, 16, 1, 32, 3, 16, False),  # group 16
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


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_packed_sequences(rng, dtype):
    cu_seqlens = np.array([0, 15, 40, 61], dtype=np.int32)  # rows 61..63 belong to no sequence
    q, k, v = qkv(rng, 1, 64, 4, 1, 32, dtype=dtype)
    indices = random_indices(rng, 1, 64, 1, 3, 16, cu_seqlens)
    counts = rng.integers(1, 4, (1, 64, 1)).astype(np.int32)
    g_slc = gate(rng, 1, 64, 4).astype(dtype)
    check_forward_and_gradients(rng, q, k, v, g_slc, indices, counts, 16, cu_seqlens)


def test_nothing_to_attend_gives_zeros_and_zero_gradients(rng):
    q, k, v = qkv(rng, 1, 37, 4, 2, 16)
    indices = random_indices(rng, 1, 37, 2, 3, 16)
    indices[0, :20] = -1  # the first 20 tokens select nothing
    indices[0, 20:25, :, :] = 99  # and these only blocks past their own
    out, pullback = jax.vjp(lambda q, k, v: selection(q, k, v, None, indices, 3, 16), q, k, v)
    assert np.all(np.asarray(out)[0, :25] == 0.0)
    dq, dk, dv = pullback(jnp.asarray(normal(rng, *q.shape)))
    assert all(np.isfinite(np.asarray(g)).all() for g in (dq, dk, dv))
    assert np.all(np.asarray(dq)[0, :25] == 0.0)
    mask = reference.selection_mask(indices, 3, 16)
    assert_close(out, reference.forward(q, k, v, [mask], [None], 0.25), TOLERANCE[np.float32], "output")


def test_traced_softmax_scale_and_its_gradient(rng):
    q, k, v = qkv(rng, 1, 33, 2, 1, 16)
    indices = random_indices(rng, 1, 33, 1, 2, 16)
    mask = reference.selection_mask(indices, 2, 16)
    d_out = normal(rng, *q.shape)

    def loss(q, scale):
        return jnp.sum(selection(q, k, v, None, indices, 2, 16, scale=scale) * d_out)

    value, (dq, d_scale) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(jnp.asarray(q), jnp.float32(0.3))
    with jax.enable_x64(True):
        q64, k64, v64, d64 = (jnp.asarray(x, jnp.float64) for x in (q, k, v, d_out))

        def reference_loss(q, scale):
            return jnp.sum(reference.attention(q, k64, v64, mask, scale, jnp) * d64)

        want_value, (want_dq, want_d_scale) = jax.value_and_grad(reference_loss, argnums=(0, 1))(q64, 0.3)
    assert abs(float(value) - float(want_value)) <= 1e-4 * abs(float(want_value))
    assert_close(dq, want_dq, 1e-4, "dq")
    assert abs(float(d_scale) - float(want_d_scale)) <= 1e-4 * abs(float(want_d_scale))


def test_triton_runs_on_cpu_only_when_asked_for():
    assert jax.default_backend() == "cpu"
    assert resolve_platform("triton") == "triton"
    assert resolve_platform(None) != "triton"  # the interpreter is for tests, never picked by itself


def test_bfloat16_needs_a_gpu(rng):
    q, k, v = (x.astype(jnp.bfloat16) for x in qkv(rng, 1, 16, 2, 1, 16))
    indices = np.zeros((1, 16, 1, 1), np.int32)
    with pytest.raises(ValueError, match="bfloat16 needs a GPU"):
        selection(q, k, v, None, indices, 1, 16)
