"""The Triton kernels for static patterns (block tables, token masks on partial tiles), run in
Triton's interpreter on the CPU, against the float64 reference built from the pattern oracle:
forward and gradients, float32 and float16, causal and bidirectional, every atom and operator,
GQA groups 2/3/16 (16 heads span two head chunks), packed sequences, gated branches."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import reference
from conftest import assert_close, gate, normal, qkv
from nsa_dsl.api import SparseAttention
from nsa_dsl.dsl import model
from nsa_dsl.plan import lower

W, L, S, G, BL, R = model.Window, model.Local, model.Stride, model.Global, model.Blocks, model.Random

TOLERANCE = {np.float32: 2e-5, np.float16: 5e-3}


def compiled(keys_by_branch, *, causal=True, block=16, gates=None) -> SparseAttention:
    gates = gates or [None] * len(keys_by_branch)
    branches = tuple(model.Branch(f"b{i}", keys, g) for i, (keys, g) in enumerate(zip(keys_by_branch, gates)))
    pattern = model.Pattern("test", block, causal, (), branches)
    return SparseAttention(pattern, lower(pattern))


def check(rng, attention, q, k, v, gates=None, cu_seqlens=None):
    """Forward and gradients of q, k, v (and of the passed gates) against the reference."""
    gates = gates or {}
    plan = attention.plan
    batch, seq_len, heads_q, head_dim = q.shape
    masks, branch_gates = [], []
    for b in plan.branches:  # a gate not passed weighs its default; a branch without one is skipped
        if b.gate is not None and b.gate.name not in gates and b.gate.default is None:
            continue
        masks.append(reference.static_mask(b.static, plan.block_size, plan.causal, batch, seq_len, cu_seqlens))
        if b.gate is None:
            branch_gates.append(None)
        else:
            branch_gates.append(gates.get(b.gate.name, np.full((batch, seq_len, heads_q), b.gate.default, np.float32)))
    tolerance = TOLERANCE[q.dtype.type]
    scale = 1.0 / np.sqrt(head_dim)
    names = sorted(gates)

    def run(q, k, v, *gate_values):
        return attention(q, k, v, cu_seqlens=cu_seqlens, platform="triton", **dict(zip(names, gate_values)))

    out, pullback = jax.vjp(run, q, k, v, *(gates[n] for n in names))
    assert out.dtype == q.dtype
    assert_close(out, reference.forward(q, k, v, masks, branch_gates, scale), tolerance, "output")
    d_out = normal(rng, *q.shape, dtype=q.dtype)
    grads = pullback(jnp.asarray(d_out))
    expected = reference.gradients(q, k, v, masks, branch_gates, scale, d_out)
    for name, actual, wanted in zip(("dq", "dk", "dv"), grads, (expected["q"], expected["k"], expected["v"])):
        assert_close(actual, wanted, tolerance, name)
    for name, actual in zip(names, grads[3:]):
        wanted = next(g for g, passed in zip(expected["gates"], branch_gates) if passed is gates[name])
        assert_close(actual, wanted, tolerance, f"d{name}")


def test_causal_union_of_window_global_and_stride(rng):
    attention = compiled([model.Union((W(20), G(1), S(3, 1)))])
    check(rng, attention, *qkv(rng, 1, 75, 4, 2, 24))


def test_bidirectional_nested_set_algebra_on_packed_sequences_float16(rng):
    keys = model.Difference(model.Union((L(2, 1), G(1), R(1, 3))), model.Intersection((S(2, 1), W(10, 10))))
    attention = compiled([keys], causal=False)
    check(rng, attention, *qkv(rng, 1, 75, 3, 1, 20, dtype=np.float16), cu_seqlens=np.array([0, 30, 70], np.int32))


def test_difference_with_sixteen_query_heads_per_kv_head(rng):
    attention = compiled([model.Difference(L(4), model.Union((W(5), BL((1,)))))])
    check(rng, attention, *qkv(rng, 1, 50, 16, 1, 16))


def test_gated_branches(rng):
    attention = compiled(
        [W(12), model.Intersection((W(40), S(2)))],
        gates=[model.Gate("g_swa", None), model.Gate("g_slc", 0.5)],
    )
    q, k, v = qkv(rng, 1, 40, 2, 2, 32)
    check(rng, attention, q, k, v, gates={"g_swa": gate(rng, 1, 40, 2)})  # g_slc weighs its default
    check(rng, attention, q, k, v, gates={"g_slc": gate(rng, 1, 40, 2)})  # b0 is skipped
