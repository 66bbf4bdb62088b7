"""The Pallas kernels for explicit per-token selection, run with interpret=True on the CPU (the
same kernel functions pl.pallas_call lowers through Triton on a GPU), against the float64
reference: forward and gradients of q, k, v and the gate, float32, float16 and bfloat16, odd
lengths, head dims 16, 20 and 24, GQA groups 1, 3, 16 and 17, per-token counts, out-of-range and repeated
entries, packed sequences; the GPU's padded tile layouts in the interpreter, and the kernels
lowered (not run) for CUDA (what it shares with Triton is in test_interpreted_selection.py).
Interpreted programs run one at a time, so shapes are small."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nsa_dsl
from conftest import (
    BF16_TOLERANCE,
    FORWARD_TOLERANCE,
    GRADIENT_TOLERANCE,
    check_selection_against_reference,
    gate,
    lower_for_cuda,
    qkv,
    random_indices,
)
from nsa_dsl import codegen

# (forward, gradients). float16 and bfloat16 kernels round p and ds to the input type before
# their matrix products.
TOLERANCE = {
    np.float32: (FORWARD_TOLERANCE, GRADIENT_TOLERANCE),
    np.float16: (5e-3, 5e-3),
    jnp.bfloat16: (BF16_TOLERANCE, BF16_TOLERANCE),
}


def selection(q, k, v, g_slc, indices, counts, block, cu_seqlens=None, scale=None):
    cfg = nsa_dsl.NativeSparseAttentionConfig(block_size=block)
    return nsa_dsl.native_sparse_attention(
        q, k, v, None, g_slc, indices, counts, cu_seqlens, softmax_scale=scale, platform="pallas", cfg=cfg
    )


def check_forward_and_gradients(rng, q, k, v, g_slc, indices, counts, block, cu_seqlens=None, attention=selection):
    check_selection_against_reference(rng, attention, q, k, v, g_slc, indices, counts, block, cu_seqlens, TOLERANCE[q.dtype.type])


@pytest.mark.parametrize(
    "dtype, batch, seq_len, heads_q, heads_kv, head_dim, width, block, per_token_counts",
    [
        (np.float32, 2, 37, 1, 1, 16, 3, 16, True),  # group 1, T not a multiple of the block
        (np.float32, 1, 45, 6, 2, 24, 3, 8, True),  # group 3 over two KV heads, head dim not a power of two
        (np.float32, 1, 40, 3, 1, 16, 5, 16, False),  # more entries than blocks: repeats everywhere
        (np.float32, 1, 37, 16, 1, 20, 3, 16, True),  # group 16
        (np.float32, 1, 29, 34, 2, 16, 2, 8, True),  # group 17 over two KV heads
        (jnp.bfloat16, 1, 37, 3, 1, 24, 3, 16, True),
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
    q, k, v = qkv(rng, 1, 64, 3, 1, 24, dtype=dtype)
    indices = random_indices(rng, 1, 64, 1, 3, 16, cu_seqlens)
    counts = rng.integers(1, 4, (1, 64, 1)).astype(np.int32)
    g_slc = gate(rng, 1, 64, 3).astype(dtype)
    check_forward_and_gradients(rng, q, k, v, g_slc, indices, counts, 16, cu_seqlens)


def test_power_of_two_tiles_of_the_gpu_lowering(rng, monkeypatch):
    """On a GPU the group, head dim and block are padded to tiles of powers of two >= 16 (here
    3, 24 and 8 become 16, 32 and 16): the same kernels on those layouts, in the interpreter."""
    module = codegen.load_module("pallas", nsa_dsl.api.selection_plan(8))
    monkeypatch.setattr(module, "POWER_OF_TWO_TILES", True)

    def padded_tiles_attention(q, k, v, g_slc, indices, counts, block, cu_seqlens):
        return module.attention(
            q,
            k,
            v,
            gates={"g_slc": g_slc},
            tables={},
            cu_seqlens=cu_seqlens,
            softmax_scale=1.0 / np.sqrt(q.shape[-1]),
            block_indices=jnp.asarray(indices),
            block_counts=jnp.asarray(counts),
        )

    cu_seqlens = np.array([0, 13, 29], dtype=np.int32)
    q, k, v = qkv(rng, 1, 29, 3, 1, 24)
    indices = random_indices(rng, 1, 29, 1, 3, 8, cu_seqlens)
    counts = rng.integers(0, 4, (1, 29, 1)).astype(np.int32)
    g_slc = gate(rng, 1, 29, 3)
    check_forward_and_gradients(rng, q, k, v, g_slc, indices, counts, 8, cu_seqlens, attention=padded_tiles_attention)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernels_lower_to_triton_for_a_gpu(rng, monkeypatch, dtype):
    """Without a GPU here, lower (not run) forward and backward for CUDA: every kernel must go
    through Pallas' Triton lowering (power-of-two tiles, supported primitives)."""
    module = codegen.load_module("pallas", nsa_dsl.api.selection_plan(16))
    monkeypatch.setattr(module, "ON_GPU", True)
    monkeypatch.setattr(module, "POWER_OF_TWO_TILES", True)
    q, k, v = (jnp.asarray(x, dtype) for x in qkv(rng, 1, 37, 6, 2, 24))
    indices = jnp.asarray(random_indices(rng, 1, 37, 2, 3, 16))
    counts = jnp.full((1, 37, 2), 3, jnp.int32)

    def loss(q, k, v):
        out = module.attention(
            q, k, v, gates={}, tables={}, cu_seqlens=None, softmax_scale=0.2, block_indices=indices, block_counts=counts
        )
        return jnp.sum(out.astype(jnp.float32))

    for function, kernels in ((loss, 1), (jax.grad(loss, argnums=(0, 1, 2)), 3)):
        text = lower_for_cuda(jax.jit(function), q, k, v).as_text()
        assert text.count("__gpu$xla.gpu.triton") == kernels
