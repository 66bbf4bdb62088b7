"""Static patterns against the float64 reference built from the pattern oracle (tests/reference.py)
on one platform: the output and the gradients of q, k, v, the softmax scale and the passed gates.
Every static test of every platform (test_xla_static, test_triton_static, test_pallas_static and
the random patterns of test_pattern_fuzz) checks through check_static."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import reference
from conftest import (
    FORWARD_TOLERANCE,
    GRADIENT_TOLERANCE,
    assert_close,
    assert_scale_gradient_close,
    gradient_floor,
)

from nsa_dsl.api import SparseAttention
from nsa_dsl.dsl import model
from nsa_dsl.plan import lower

# (forward, gradients) against float64, by the inputs' dtype: accumulation error only in float32 (the
# interpreters' tiles included); in half precision, the rounding of the inputs the kernels' products
# take (p and ds among them) and of what they store. float64 inputs (jax_enable_x64) are computed in
# float32 on every platform.
TOLERANCE = {
    "float32": (FORWARD_TOLERANCE, GRADIENT_TOLERANCE),
    "float64": (FORWARD_TOLERANCE, GRADIENT_TOLERANCE),
    "float16": (5e-3, 5e-3),
    "bfloat16": (2e-2, 2e-2),
}


def static_attention(keys_by_branch, *, causal=True, block=16, gates=None, config=None) -> SparseAttention:
    """A pattern of one static branch per key set (branch i named b{i}, gated by gates[i])."""
    gates = gates or [None] * len(keys_by_branch)
    branches = tuple(model.Branch(f"b{i}", keys, g) for i, (keys, g) in enumerate(zip(keys_by_branch, gates)))
    pattern = model.Pattern("test", block, causal, (), branches)
    return SparseAttention(pattern, lower(pattern), config)


def check_static(rng, attention: SparseAttention, q, k, v, gates=None, cu_seqlens=None, *, platform=None, run=None):
    """Forward and gradients of q, k, v, the softmax scale and the passed `gates` (name -> [B, T, HQ]),
    computed in one jit by run(q, k, v, softmax_scale, gates) (by default the attention on `platform`),
    against the reference. A gate not passed weighs its default; a branch with neither is skipped."""
    gates = gates or {}
    plan = attention.plan
    batch, seq_len, _, head_dim = q.shape
    running = [b for b in plan.branches if b.gate is None or b.gate.name in gates or b.gate.default is not None]
    masks = [reference.static_mask(b.static, plan.block_size, plan.causal, batch, seq_len, cu_seqlens) for b in running]
    scale = 1.0 / np.sqrt(head_dim)
    d_out = rng.standard_normal(q.shape).astype(q.dtype)

    def through_the_api(q, k, v, softmax_scale, gates):
        return attention(q, k, v, softmax_scale=softmax_scale, cu_seqlens=cu_seqlens, platform=platform, **gates)

    def forward_and_gradients(q, k, v, softmax_scale, gates, d_out):
        out, pullback = jax.vjp(run or through_the_api, q, k, v, softmax_scale, gates)
        return out, pullback(d_out)

    out, (d_q, d_k, d_v, d_scale, d_gates) = jax.jit(forward_and_gradients)(
        q, k, v, jnp.float32(scale), gates, d_out)
    assert out.dtype == q.dtype and d_q.dtype == d_k.dtype == d_v.dtype == q.dtype
    # The reference sees the inputs the kernels saw (rounded to half precision where they were).
    as64 = lambda x: np.asarray(x, np.float64)
    inputs = [as64(x) for x in (q, k, v)]
    branch_gates = [
        None if b.gate is None else as64(gates[b.gate.name]) if b.gate.name in gates
        else np.full(q.shape[:3], b.gate.default)
        for b in running
    ]
    forward_tolerance, gradient_tolerance = TOLERANCE[q.dtype.name]
    assert_close(out, reference.forward(*inputs, masks, branch_gates, scale), forward_tolerance, "output")
    wanted = reference.gradients(*inputs, masks, branch_gates, scale, as64(d_out))
    floor = gradient_floor(wanted["q"], wanted["k"], wanted["v"])
    for name, actual in (("q", d_q), ("k", d_k), ("v", d_v)):
        assert_close(actual, wanted[name], gradient_tolerance, f"d{name}", least=floor)
    assert_scale_gradient_close(d_scale, wanted["scale"], q, wanted["q"], scale, gradient_tolerance)
    for name, actual in d_gates.items():
        # a gate shared by several branches collects the cotangents of all of them
        expected = sum(g for b, g in zip(running, wanted["gates"]) if b.gate is not None and b.gate.name == name)
        assert_close(actual, expected, gradient_tolerance, f"d{name}", least=floor)
