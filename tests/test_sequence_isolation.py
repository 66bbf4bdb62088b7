"""A non-finite key or value of one packed sequence reaches no other sequence of the call.

Kernels load whole tiles and give the rows a query does not see zero weight, but 0 * inf is NaN:
a tile that reaches past its sequence (into the next packed one, or the first rows, where a
selection entry names no block) must zero what it does not see, in the forward and in the
backward. Each case runs once on finite inputs and once with a NaN or an inf planted in one
sequence's keys or values; every other sequence's outputs and its rows of dq, dk and dv must come
out as they did. Three sequences cut off the block grid (and a block of 16 over 160 rows) so that
tiles straddle their boundaries; the planted rows sit in the middle of the second sequence, on
its last row, and on the third's first.

Every platform's kernels isolate, the Pallas TPU variant's included (interpreted here); the
Mosaic GPU kernels a Hopper runs for windows and `causal` are checked on a GPU only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nsa_dsl
from conftest import gate, qkv, random_indices

CU_SEQLENS = np.array([0, 37, 100, 160], np.int32)
BLOCK = 16
SCALE = 0.25
PATTERNS = {"window": "window(20)", "causal": "local(2147483647)"}


def attention_of(case, rng, platform, backend, heads_q):
    """(q, k, v) -> out for the case, its gates and selections drawn once; backend: the config's
    (None, or "tpu" for the Pallas TPU variant, interpreted)."""
    seq_len = int(CU_SEQLENS[-1])
    cu_seqlens = jnp.asarray(CU_SEQLENS)
    config = nsa_dsl.NativeSparseAttentionConfig(block_size=BLOCK, backend=backend)
    if case == "compression":
        g_cmp, g_slc = (jnp.asarray(gate(rng, 1, seq_len, heads_q)) for _ in range(2))
        return lambda q, k, v: nsa_dsl.native_sparse_attention(
            q, k, v, g_cmp, g_slc, None, 2, cu_seqlens, softmax_scale=SCALE, platform=platform, cfg=config)
    if case == "selection":
        indices = jnp.asarray(random_indices(rng, 1, seq_len, 2, 3, BLOCK, CU_SEQLENS))
        return lambda q, k, v: nsa_dsl.native_sparse_attention(
            q, k, v, None, None, indices, 3, cu_seqlens, softmax_scale=SCALE, platform=platform, cfg=config)
    source = f"pattern isolated_{case}\nblock {BLOCK}\ncausal\nbranch main = {PATTERNS[case]}\n"
    pattern = nsa_dsl.compile(source, config=config)
    return lambda q, k, v: pattern(q, k, v, cu_seqlens=cu_seqlens, softmax_scale=SCALE, platform=platform)


def rows_of_others(sequence):
    return np.concatenate([np.arange(a, b) for s, (a, b) in enumerate(zip(CU_SEQLENS[:-1], CU_SEQLENS[1:]))
                           if s != sequence])


CASES = [(case, platform, None) for platform in ("xla", "triton", "pallas")
         for case in ("compression", "selection", "window", "causal")]
CASES += [(case, "pallas", "tpu") for case in ("compression", "selection", "window", "causal")]


@pytest.mark.parametrize("case, platform, backend", CASES)
def test_a_non_finite_key_or_value_stays_in_its_sequence(rng, case, platform, backend):
    heads_q, heads_kv, dim = 4, 2, 16
    q, k, v = (jnp.asarray(x) for x in qkv(rng, 1, int(CU_SEQLENS[-1]), heads_q, heads_kv, dim))
    attention = attention_of(case, rng, platform, backend, heads_q)
    cotangent = rng.standard_normal(q.shape).astype(np.float32)
    for name, row, value in (("k", 60, np.nan), ("v", 99, np.inf), ("k", 100, -np.inf), ("v", 100, np.nan)):
        sequence = int(np.searchsorted(CU_SEQLENS, row, side="right")) - 1
        others = rows_of_others(sequence)
        weights = cotangent.copy()
        weights[:, CU_SEQLENS[sequence]:CU_SEQLENS[sequence + 1]] = 0.0  # the loss reads the others only

        def run(q, k, v):
            out, pullback = jax.vjp(attention, q, k, v)
            return (out, *pullback(jnp.asarray(weights)))

        clean = [np.asarray(x)[0, others] for x in run(q, k, v)]
        planted = {"k": np.asarray(k).copy(), "v": np.asarray(v).copy()}
        planted[name][0, row, 1, 3] = value
        poisoned = [np.asarray(x)[0, others] for x in run(q, jnp.asarray(planted["k"]), jnp.asarray(planted["v"]))]
        for what, expected, actual in zip(("out", "dq", "dk", "dv"), clean, poisoned):
            assert np.isfinite(actual).all(), f"{value} in {name} row {row}: {what} of other sequences not finite"
            np.testing.assert_allclose(actual, expected, rtol=1e-6, atol=1e-6,
                                       err_msg=f"{value} in {name} row {row}: {what} of other sequences")
