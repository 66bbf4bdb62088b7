"""A non-finite query, key, value or output gradient of one packed sequence reaches no other
sequence of the call.

Kernels load whole tiles and give the rows a query does not see zero weight, but 0 * inf is NaN:
a tile that reaches past its sequence (into the next packed one, or the first rows, where a
selection entry names no block) must zero what it does not see, in the forward and in the
backward (whose key-side kernels load tiles of query rows and their output gradients). Each case
runs on finite inputs and with NaNs and infs planted in one sequence's queries, keys, values and
output gradient; every other sequence's outputs and its rows of dq, dk and dv must come out as
they did. Three sequences cut off the block grid (and a block of 16 over 160 rows) so that
tiles straddle their boundaries; the planted rows sit in the middle of the second sequence, on
its first and last rows, and on the third's first.

Every platform's kernels isolate, the Pallas TPU variant's included (interpreted here). On a GPU
the compiled kernels run the same check in bfloat16; there a Hopper's Mosaic GPU kernels for
windows and `causal`, whose tiles span packed sequences, run only calls whose values are finite
(test_triton_static.py checks that choice on the CPU).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nsa_dsl
from conftest import gate, qkv, random_indices
from nsa_dsl.runtime import triton_glue

PATTERNS = {"window": "window({window})", "causal": "local(2147483647)"}


class Packing(NamedTuple):
    """A packed batch row and its settings; `planted`: (array, row, value) of each poisoned run."""

    cu_seqlens: np.ndarray
    block: int
    window: int
    heads_q: int
    heads_kv: int
    head_dim: int
    dtype: object
    planted: tuple


CPU_PACKING = Packing(np.array([0, 37, 100, 160], np.int32), 16, 20, 4, 2, 16, np.float32,
                      (("k", 60, np.nan), ("v", 99, np.inf), ("k", 100, -np.inf), ("v", 100, np.nan),
                       ("q", 37, np.inf), ("d_out", 100, np.nan)))
# The compiled kernels' tiles: blocks of 64, a 200-token window, the Hopper kernels' bf16 and head dim.
GPU_PACKING = Packing(np.array([0, 370, 1000, 1600], np.int32), 64, 200, 16, 2, 64, jnp.bfloat16,
                      (("k", 600, np.nan), ("v", 999, np.inf), ("k", 1000, -np.inf), ("v", 1000, np.nan),
                       ("q", 370, np.inf), ("d_out", 1000, np.nan)))
# Non-finite queries alone, in one KV group of one head (the plants' head 1 of k is q's): a NaN or
# +inf makes its row's output NaN, and so its delta (the backward's rowsum(d_out * out)); the -inf
# on the third sequence's first row meets only its own key, made positive: a score of -inf, an
# output of zeros and a finite delta, so the Hopper kernels' backward learns of it from the
# forward's lse alone (hopper_window.py.j2's queries_finite).
GPU_QUERY_PACKING = GPU_PACKING._replace(heads_q=2, heads_kv=2, planted=(
    ("q", 100, np.inf), ("q", 600, np.nan), ("k", 1000, 1.0), ("q", 1000, -np.inf)))
SCALE = 0.25


def attention_of(case, rng, platform, backend, packing):
    """(q, k, v) -> out for the case, its gates and selections drawn once; backend: the config's
    (None, or "tpu" for the Pallas TPU variant, interpreted)."""
    seq_len = int(packing.cu_seqlens[-1])
    cu_seqlens = jnp.asarray(packing.cu_seqlens)
    config = nsa_dsl.NativeSparseAttentionConfig(block_size=packing.block, backend=backend)
    if case == "compression":
        g_cmp, g_slc = (jnp.asarray(gate(rng, 1, seq_len, packing.heads_q)) for _ in range(2))
        return lambda q, k, v: nsa_dsl.native_sparse_attention(
            q, k, v, g_cmp, g_slc, None, 2, cu_seqlens, softmax_scale=SCALE, platform=platform, cfg=config)
    if case == "selection":
        indices = random_indices(rng, 1, seq_len, packing.heads_kv, 3, packing.block, packing.cu_seqlens)
        return lambda q, k, v: nsa_dsl.native_sparse_attention(
            q, k, v, None, None, jnp.asarray(indices), 3, cu_seqlens, softmax_scale=SCALE, platform=platform,
            cfg=config)
    keys = PATTERNS[case].format(window=packing.window)
    pattern = nsa_dsl.compile(f"pattern isolated_{case}\nblock {packing.block}\ncausal\nbranch main = {keys}\n",
                              config=config)
    return lambda q, k, v: pattern(q, k, v, cu_seqlens=cu_seqlens, softmax_scale=SCALE, platform=platform)


def assert_isolated(rng, case, platform, backend, packing, tolerance):
    """Each planted value leaves the other sequences' outputs and gradients as they were."""
    cu_seqlens = packing.cu_seqlens
    q, k, v = (jnp.asarray(x, packing.dtype) for x in qkv(
        rng, 1, int(cu_seqlens[-1]), packing.heads_q, packing.heads_kv, packing.head_dim))
    attention = attention_of(case, rng, platform, backend, packing)
    cotangent = rng.standard_normal(q.shape).astype(np.float32)

    @jax.jit
    def run(q, k, v, d_out):
        out, pullback = jax.vjp(attention, q, k, v)
        return (out, *pullback(d_out))

    def of_others(sequence, results):
        bounds = zip(cu_seqlens[:-1], cu_seqlens[1:])
        others = np.concatenate([np.arange(a, b) for s, (a, b) in enumerate(bounds) if s != sequence])
        return [np.asarray(x, np.float32)[0, others] for x in results]

    def loss_weights(sequence):  # the loss reads the other sequences only
        weights = cotangent.copy()
        weights[:, cu_seqlens[sequence]:cu_seqlens[sequence + 1]] = 0.0
        return jnp.asarray(weights, packing.dtype)

    # One poisoned run a sequence, with all of its plants: NaN and inf are absorbing, so a leak of
    # any of them shows in the other sequences as a non-finite value or a changed one.
    by_sequence = {}
    for name, row, value in packing.planted:
        by_sequence.setdefault(int(np.searchsorted(cu_seqlens, row, side="right")) - 1, []).append((name, row, value))
    for sequence, plants in by_sequence.items():
        clean = of_others(sequence, run(q, k, v, loss_weights(sequence)))
        planted = {name: np.array(x, np.float32) for name, x in
                   (("q", q), ("k", k), ("v", v), ("d_out", loss_weights(sequence)))}
        for name, row, value in plants:
            planted[name][0, row, 1, 3] = value
        poisoned = of_others(sequence, run(*(jnp.asarray(planted[x], packing.dtype) for x in ("q", "k", "v", "d_out"))))
        where = ", ".join(f"{value} in {name} row {row}" for name, row, value in plants)
        for what, expected, actual in zip(("out", "dq", "dk", "dv"), clean, poisoned):
            assert np.isfinite(actual).all(), f"{where}: {what} of other sequences not finite"
            np.testing.assert_allclose(actual, expected, rtol=tolerance, atol=tolerance,
                                       err_msg=f"{where}: {what} of other sequences")


KINDS = ("compression", "selection", "window", "causal")
CASES = [(case, platform, None) for platform in ("xla", "triton", "pallas") for case in KINDS]
CASES += [(case, "pallas", "tpu") for case in KINDS]


@pytest.mark.parametrize("case, platform, backend", CASES)
def test_a_non_finite_value_stays_in_its_sequence(rng, case, platform, backend):
    assert_isolated(rng, case, platform, backend, CPU_PACKING, 1e-6)


def runs_on_hopper(case, platform):
    """Whether the case's finite run takes the Mosaic GPU window/causal kernels, whose tiles span
    packed sequences: a call with a non-finite value then runs in Triton's (hopper_unless_leaking),
    so the two runs agree to bfloat16's rounding between two kernels rather than exactly."""
    return platform == "triton" and case in ("window", "causal") and triton_glue.on_hopper()


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU: the compiled kernels in bfloat16")
@pytest.mark.parametrize("case, platform", [(case, platform) for platform in ("triton", "pallas") for case in KINDS])
def test_a_non_finite_value_stays_in_its_sequence_compiled(rng, case, platform):
    """The compiled kernels, in bfloat16 as the Hopper kernels take it: without atomics, the clean
    and the poisoned runs agree exactly where one kernel runs both."""
    assert_isolated(rng, case, platform, None, GPU_PACKING, 2e-2 if runs_on_hopper(case, platform) else 0.0)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU: the compiled kernels in bfloat16")
@pytest.mark.parametrize("case", ["window", "causal"])
def test_a_non_finite_query_stays_in_its_sequence_compiled(rng, case):
    """The check that keeps a packed call from the Hopper kernels sees a non-finite query with no
    non-finite key, value or output gradient beside it to give the call away."""
    if not runs_on_hopper(case, "triton"):
        pytest.skip("the Mosaic GPU kernels run on a Hopper GPU only")
    assert_isolated(rng, case, "triton", None, GPU_QUERY_PACKING, 2e-2)
