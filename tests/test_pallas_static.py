"""The Pallas kernels for static patterns (block tables, token masks on partial tiles), run with
interpret=True on the CPU (the same kernel functions pl.pallas_call lowers through Triton on a
GPU), against the float64 reference built from the pattern oracle: forward and gradients of q,
k, v and the gates, float32, float16 and bfloat16, causal and bidirectional, every atom and set
operator, GQA groups 1, 2, 3 and 16, head dims 20 and 24, odd lengths, packed sequences, gated
branches; the GPU's padded tile layouts in the interpreter (16 heads of a group then span two
programs per query tile); the kernels lowered (not run) for CUDA. Interpreted programs run one
at a time, and each case compiles once (forward and backward in one jit): shapes are small."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import gate, lower_for_cuda, qkv
from static_check import check_static, static_attention

from nsa_dsl import codegen
from nsa_dsl.dsl import model
from nsa_dsl.runtime import dispatch

W, L, S, G, BL, R = model.Window, model.Local, model.Stride, model.Global, model.Blocks, model.Random


def test_causal_union_of_window_global_and_stride(rng):
    attention = static_attention([model.Union((W(20), G(1), S(3, 1)))], gates=[model.Gate("g_slc", 1.0)])
    q, k, v = qkv(rng, 1, 75, 4, 2, 24)
    check_static(rng, attention, q, k, v, platform="pallas", gates={"g_slc": gate(rng, 1, 75, 4)})


def test_bidirectional_nested_set_algebra_on_packed_sequences_float16(rng):
    keys = model.Difference(model.Union((L(2, 1), G(1), R(1, 3))), model.Intersection((S(2, 1), W(10, 10))))
    attention = static_attention([keys], causal=False)
    q, k, v = qkv(rng, 1, 75, 3, 1, 20, dtype=np.float16)
    check_static(rng, attention, q, k, v, cu_seqlens=np.array([0, 30, 70], np.int32), platform="pallas")  # rows 70.. in no sequence


def test_gated_branches(rng):
    """Each branch its own softmax: g_swa passed, g_slc weighing its default."""
    attention = static_attention(
        [W(12), model.Intersection((W(40), S(2)))],
        gates=[model.Gate("g_swa", None), model.Gate("g_slc", 0.5)],
    )
    q, k, v = qkv(rng, 2, 40, 2, 2, 32)
    check_static(rng, attention, q, k, v, platform="pallas", gates={"g_swa": gate(rng, 2, 40, 2)})


def test_gpu_tile_layouts_with_sixteen_heads_per_kv_head_bfloat16(rng, monkeypatch):
    """On a GPU the group, head dim and block are padded to powers of two (here 16, 24 -> 32, 16)
    and a query tile of 16 heads x 16 queries is split between two programs of 8 queries: the
    same kernels on those layouts, in the interpreter, on packed sequences."""
    attention = static_attention([model.Difference(L(4), model.Union((W(5), BL((1,)))))], block=16)
    module = codegen.load_module("pallas", attention.plan)
    monkeypatch.setattr(module, "POWER_OF_TWO_TILES", True)
    assert module.tile_extents(16, 24, 2) == module.QueryTiles(16, 32, 16, 16, 8, 2)
    assert module.tile_extents(16, 24, 4) == module.QueryTiles(16, 32, 16, 16, 4, 4)  # float32: half the rows
    cu_seqlens = np.array([0, 21, 50], np.int32)
    tables = dispatch.branch_tables(attention.plan, 50)

    def padded_tiles(q, k, v, softmax_scale, gates):
        return module.attention(q, k, v, gates=gates, tables=tables, cu_seqlens=cu_seqlens, softmax_scale=softmax_scale)

    q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in qkv(rng, 1, 50, 16, 1, 24))
    check_static(rng, attention, q, k, v, cu_seqlens=cu_seqlens, run=padded_tiles)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernels_lower_to_triton_for_a_gpu(rng, monkeypatch, dtype):
    """Without a GPU here, lower (not run) forward and backward for CUDA: every kernel must go
    through Pallas' Triton lowering (power-of-two tiles, supported primitives)."""
    attention = static_attention([model.Union((W(20), G(1), S(3, 1)))], causal=dtype == jnp.float32)
    module = codegen.load_module("pallas", attention.plan)
    monkeypatch.setattr(module, "ON_GPU", True)
    monkeypatch.setattr(module, "POWER_OF_TWO_TILES", True)
    q, k, v = (jnp.asarray(x, dtype) for x in qkv(rng, 1, 75, 6, 2, 24))
    tables = dispatch.branch_tables(attention.plan, 75)

    def loss(q, k, v):
        out = module.attention(q, k, v, gates={}, tables=tables, cu_seqlens=None, softmax_scale=0.2)
        return jnp.sum(out.astype(jnp.float32))

    for function, kernels in ((loss, 1), (jax.grad(loss, argnums=(0, 1, 2)), 3)):
        text = lower_for_cuda(jax.jit(function), q, k, v).as_text()
        assert text.count("__gpu$xla.gpu.triton") == kernels
