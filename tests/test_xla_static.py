"""The XLA kernel for static patterns (block tables + token masks) against the float64
reference built from the pattern oracle: every atom and operator, causal and bidirectional,
gradients, packed sequences, gated branches."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference
from conftest import FORWARD_TOLERANCE, assert_close, gate, qkv
from static_check import check_static, static_attention

from nsa_dsl.dsl import model

W, L, S, G, BL, R = model.Window, model.Local, model.Stride, model.Global, model.Blocks, model.Random


KEY_SETS = {
    "window": (W(20), True),
    "window_both_sides": (W(9, 12), False),
    "local": (L(2), True),
    "local_both_sides": (L(1, 2), False),
    "stride": (S(3, 1), True),
    "global": (G(2), True),
    "blocks": (BL((0, 2, 5)), False),
    "random": (R(2, 11), True),
    "random_bidirectional": (R(3, 5), False),
    "union": (model.Union((W(7), G(1), S(4, 3))), True),
    "intersection": (model.Intersection((W(40), S(2))), True),
    "difference": (model.Difference(L(4), model.Union((W(5), BL((1,))))), True),
    "nested": (model.Difference(model.Union((L(2, 1), G(1), R(1, 3))), model.Intersection((S(2, 1), W(10, 10)))), False),
    # more than four parts render as a balanced tree of | or & (templates/xla/mask.j2)
    "wide_union": (model.Union((W(3), L(1), W(9, 2), G(1), BL((3,)), S(5, 2), W(30, 1), R(1, 7), model.Intersection((W(50), L(3))))), True),
    "wide_intersection": (model.Intersection((W(60, 9), L(3, 1), W(45, 20), model.Union((S(2), W(6, 6))), W(70), G(4))), False),
}


@pytest.mark.parametrize("name", sorted(KEY_SETS))
def test_every_key_set(rng, name):
    keys, causal = KEY_SETS[name]
    check_static(rng, static_attention([keys], causal=causal), *qkv(rng, 2, 75, 4, 2, 24), platform="xla")


@pytest.mark.parametrize("reach", [W(1, 2**31 - 1), L(1, 2**31 - 1)], ids=repr)
def test_extents_up_to_the_language_limit(rng, reach):
    """window(1, 2**31 - 1) and local(1, 2**31 - 1) see every key from the query's on: a position
    plus such an extent must not wrap around int32 (in the token mask or the block table)."""
    attention = static_attention([model.Union((reach, BL((0,))))], causal=False)
    check_static(rng, attention, *qkv(rng, 1, 75, 2, 1, 16), platform="xla")


def test_gradients_causal_union(rng):
    attention = static_attention([model.Union((W(20), G(1), model.Difference(S(4), L(2))))], gates=[model.Gate("g_slc", 1.0)])
    q, k, v = qkv(rng, 2, 111, 8, 2, 100)
    check_static(rng, attention, q, k, v, {"g_slc": gate(rng, 2, 111, 8)}, platform="xla")


def test_gradients_bidirectional_random(rng):
    attention = static_attention([model.Union((L(1, 1), R(2, 9)))], causal=False)
    q, k, v = qkv(rng, 1, 63, 3, 1, 60)
    check_static(rng, attention, q, k, v, platform="xla")


def test_packed_sequences(rng):
    cu_seqlens = np.array([0, 15, 205, 550, 800], dtype=np.int32)
    attention = static_attention([model.Union((L(2), G(1)))], block=32, gates=[model.Gate("g_swa")])
    q, k, v = qkv(rng, 1, 800, 4, 4, 32)
    check_static(rng, attention, q, k, v, {"g_swa": gate(rng, 1, 800, 4)}, cu_seqlens, platform="xla")


def test_gated_branches(rng):
    """Each branch its own softmax; a passed gate multiplies, an absent one weighs its default,
    and a branch whose gate has no default is skipped when the gate is not passed."""
    attention = static_attention(
        [W(12), model.Union((G(1), S(3))), L(1)],
        gates=[model.Gate("g_swa", 0.5), model.Gate("g_slc"), None],
    )
    q, k, v = qkv(rng, 1, 70, 4, 2, 16)
    check_static(rng, attention, q, k, v, {"g_slc": gate(rng, 1, 70, 4)}, platform="xla")
    check_static(rng, attention, q, k, v, {"g_swa": gate(rng, 1, 70, 4)}, platform="xla")


def test_no_active_branch_is_an_error_naming_the_gates(rng):
    attention = static_attention([W(8), L(1)], gates=[model.Gate("g_swa"), model.Gate("g_slc")])
    q, k, v = qkv(rng, 1, 20, 2, 1, 8)
    with pytest.raises(ValueError, match="g_swa, g_slc"):
        attention(q, k, v)
    check_static(rng, attention, q, k, v, {"g_slc": gate(rng, 1, 20, 2)}, platform="xla")  # g_swa's branch skipped


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_precision(rng, dtype):
    attention = static_attention([model.Union((W(30), G(1)))], gates=[model.Gate("g_slc")])
    q, k, v = (jnp.asarray(x, dtype) for x in qkv(rng, 1, 90, 4, 2, 64))
    check_static(rng, attention, q, k, v, {"g_slc": jnp.asarray(gate(rng, 1, 90, 4), dtype)}, platform="xla")


def test_jit_with_traced_cu_seqlens(rng):
    attention = static_attention([model.Union((L(2), S(3)))], causal=False)
    q, k, v = qkv(rng, 1, 96, 2, 1, 16)
    run = jax.jit(lambda q, k, v, cu, scale: attention(q, k, v, cu_seqlens=cu, softmax_scale=scale))
    for cu, scale in (([0, 40, 41, 90], 0.3), ([0, 17, 96, 96], 0.2)):
        cu = np.array(cu, dtype=np.int32)
        mask = reference.static_mask(attention.plan.branches[0].static, 16, False, 1, 96, cu)
        expected = reference.forward(q, k, v, [mask], [None], scale)
        assert_close(run(q, k, v, jnp.asarray(cu), jnp.float32(scale)), expected, FORWARD_TOLERANCE, f"cu {cu.tolist()}")
    assert run._cache_size() == 1
