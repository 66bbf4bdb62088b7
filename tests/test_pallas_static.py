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
import reference
from conftest import (
    BF16_TOLERANCE,
    FORWARD_TOLERANCE,
    GRADIENT_TOLERANCE,
    assert_close,
    gate,
    lower_for_cuda,
    normal,
    qkv,
)

from nsa_dsl import codegen
from nsa_dsl.api import SparseAttention
from nsa_dsl.dsl import model
from nsa_dsl.plan import lower
from nsa_dsl.runtime import dispatch

W, L, S, G, BL, R = model.Window, model.Local, model.Stride, model.Global, model.Blocks, model.Random

# (forward, gradients); half-precision kernels round p and ds to the input type for their products.
TOLERANCE = {
    np.float32: (FORWARD_TOLERANCE, GRADIENT_TOLERANCE),
    np.float16: (5e-3, 5e-3),
    jnp.bfloat16: (BF16_TOLERANCE, BF16_TOLERANCE),
}


def compiled(keys_by_branch, *, causal=True, block=16, gates=None) -> SparseAttention:
    gates = gates or [None] * len(keys_by_branch)
    branches = tuple(model.Branch(f"b{i}", keys, g) for i, (keys, g) in enumerate(zip(keys_by_branch, gates)))
    pattern = model.Pattern("test", block, causal, (), branches)
    return SparseAttention(pattern, lower(pattern))


def through_the_api(attention, cu_seqlens):
    def run(q, k, v, gates):
        return attention(q, k, v, cu_seqlens=cu_seqlens, platform="pallas", **gates)

    return run


def check(rng, attention, q, k, v, gates=None, cu_seqlens=None, run=None):
    """Forward and gradients of q, k, v and the passed gates, computed in one jit by
    run(q, k, v, gates) (the public API by default), against the reference."""
    gates = gates or {}
    plan = attention.plan
    batch, seq_len, _, head_dim = q.shape
    # A gate not passed weighs its default; a branch with neither is skipped.
    running = [b for b in plan.branches if b.gate is None or b.gate.name in gates or b.gate.default is not None]
    masks = [reference.static_mask(b.static, plan.block_size, plan.causal, batch, seq_len, cu_seqlens) for b in running]
    gate_names = [None if b.gate is None else b.gate.name for b in running]
    d_out = normal(rng, *q.shape).astype(q.dtype)
    run = run or through_the_api(attention, cu_seqlens)

    def forward_and_gradients(q, k, v, gates, d_out):
        out, pullback = jax.vjp(run, q, k, v, gates)
        return out, pullback(d_out)

    out, grads = jax.jit(forward_and_gradients)(q, k, v, gates, d_out)
    assert out.dtype == q.dtype and all(g.dtype == q.dtype for g in grads[:3])
    # The reference sees the inputs the kernels saw (rounded to half precision where they were).
    as32 = lambda x: np.asarray(jnp.asarray(x, jnp.float32))
    q, k, v, d_out = (as32(x) for x in (q, k, v, d_out))
    weights = {name: as32(g) for name, g in gates.items()}
    branch_gates = [
        None if b.gate is None else weights.get(b.gate.name, np.full(q.shape[:3], b.gate.default, np.float32))
        for b in running
    ]
    forward_tolerance, gradient_tolerance = TOLERANCE[out.dtype.type]
    scale = 1.0 / np.sqrt(head_dim)
    assert_close(as32(out), reference.forward(q, k, v, masks, branch_gates, scale), forward_tolerance, "output")
    expected = reference.gradients(q, k, v, masks, branch_gates, scale, d_out)
    for name, actual, wanted in zip(("dq", "dk", "dv"), grads[:3], (expected["q"], expected["k"], expected["v"])):
        assert_close(as32(actual), wanted, gradient_tolerance, name)
    for name, actual in grads[3].items():
        # a gate shared by several branches collects the cotangents of all of them
        wanted = sum(dg for used, dg in zip(gate_names, expected["gates"]) if used == name)
        assert_close(as32(actual), wanted, gradient_tolerance, f"d{name}")


def test_causal_union_of_window_global_and_stride(rng):
    attention = compiled([model.Union((W(20), G(1), S(3, 1)))], gates=[model.Gate("g_slc", 1.0)])
    q, k, v = qkv(rng, 1, 75, 4, 2, 24)
    check(rng, attention, q, k, v, gates={"g_slc": gate(rng, 1, 75, 4)})


def test_bidirectional_nested_set_algebra_on_packed_sequences_float16(rng):
    keys = model.Difference(model.Union((L(2, 1), G(1), R(1, 3))), model.Intersection((S(2, 1), W(10, 10))))
    attention = compiled([keys], causal=False)
    q, k, v = qkv(rng, 1, 75, 3, 1, 20, dtype=np.float16)
    check(rng, attention, q, k, v, cu_seqlens=np.array([0, 30, 70], np.int32))  # rows 70.. in no sequence


def test_gated_branches(rng):
    """Each branch its own softmax: g_swa passed, g_slc weighing its default."""
    attention = compiled(
        [W(12), model.Intersection((W(40), S(2)))],
        gates=[model.Gate("g_swa", None), model.Gate("g_slc", 0.5)],
    )
    q, k, v = qkv(rng, 2, 40, 2, 2, 32)
    check(rng, attention, q, k, v, gates={"g_swa": gate(rng, 2, 40, 2)})


def test_gpu_tile_layouts_with_sixteen_heads_per_kv_head_bfloat16(rng, monkeypatch):
    """On a GPU the group, head dim and block are padded to powers of two (here 16, 24 -> 32, 16)
    and a query tile of 16 heads x 16 queries is split between two programs of 8 queries: the
    same kernels on those layouts, in the interpreter, on packed sequences."""
    attention = compiled([model.Difference(L(4), model.Union((W(5), BL((1,)))))], block=16)
    module = codegen.load_module("pallas", attention.plan)
    monkeypatch.setattr(module, "POWER_OF_TWO_TILES", True)
    assert module.tile_extents(16, 24, 2) == module.QueryTiles(16, 32, 16, 16, 8, 2)
    assert module.tile_extents(16, 24, 4) == module.QueryTiles(16, 32, 16, 16, 4, 4)  # float32: half the rows
    cu_seqlens = np.array([0, 21, 50], np.int32)
    tables = dispatch.branch_tables(attention.plan, 50)

    def padded_tiles(q, k, v, gates):
        return module.attention(q, k, v, gates=gates, tables=tables, cu_seqlens=cu_seqlens, softmax_scale=1 / np.sqrt(24))

    q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in qkv(rng, 1, 50, 16, 1, 24))
    check(rng, attention, q, k, v, cu_seqlens=cu_seqlens, run=padded_tiles)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernels_lower_to_triton_for_a_gpu(rng, monkeypatch, dtype):
    """Without a GPU here, lower (not run) forward and backward for CUDA: every kernel must go
    through Pallas' Triton lowering (power-of-two tiles, supported primitives)."""
    attention = compiled([model.Union((W(20), G(1), S(3, 1)))], causal=dtype == jnp.float32)
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
