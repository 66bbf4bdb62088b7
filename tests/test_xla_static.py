"""The XLA kernel for static patterns (block tables + token masks) against the float64
reference built from the pattern oracle: every atom and operator, causal and bidirectional,
gradients, packed sequences, gated branches."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import reference
from conftest import BF16_TOLERANCE, FORWARD_TOLERANCE, GRADIENT_TOLERANCE, assert_close, gate, normal, qkv
from nsa_dsl.api import SparseAttention
from nsa_dsl.dsl import model
from nsa_dsl.plan import lower

W, L, S, G, BL, R = model.Window, model.Local, model.Stride, model.Global, model.Blocks, model.Random


def compiled(keys_by_branch, *, causal=True, block=16, gates=None) -> SparseAttention:
    gates = gates or [None] * len(keys_by_branch)
    branches = tuple(model.Branch(f"b{i}", keys, g) for i, (keys, g) in enumerate(zip(keys_by_branch, gates)))
    pattern = model.Pattern("test", block, causal, (), branches)
    return SparseAttention(pattern, lower(pattern))


def masks_of(attention: SparseAttention, batch: int, seq_len: int, cu_seqlens=None):
    plan = attention.plan
    return [reference.static_mask(b.static, plan.block_size, plan.causal, batch, seq_len, cu_seqlens) for b in plan.branches]


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
}


@pytest.mark.parametrize("name", sorted(KEY_SETS))
def test_forward(rng, name):
    keys, causal = KEY_SETS[name]
    attention = compiled([keys], causal=causal)
    q, k, v = qkv(rng, 2, 75, 4, 2, 24)
    expected = reference.forward(q, k, v, masks_of(attention, 2, 75), [None], 1 / np.sqrt(24))
    assert_close(attention(q, k, v), expected, FORWARD_TOLERANCE, name)


@pytest.mark.parametrize("reach", [W(1, 2**31 - 1), L(1, 2**31 - 1)], ids=repr)
def test_extents_up_to_the_language_limit(rng, reach):
    """window(1, 2**31 - 1) and local(1, 2**31 - 1) see every key from the query's on: a position
    plus such an extent must not wrap around int32 (in the token mask or the block table)."""
    keys = model.Union((reach, BL((0,))))
    attention = compiled([keys], causal=False)
    q, k, v = qkv(rng, 1, 75, 2, 1, 16)
    expected = reference.forward(q, k, v, [reference.static_mask(keys, 16, False, 1, 75)], [None], 0.25)
    assert_close(attention(q, k, v), expected, FORWARD_TOLERANCE, repr(keys))


def reference_branches(attention: SparseAttention, q, passed: dict, cu_seqlens=None):
    """(masks, gates) of the branches that run given the `passed` gates: a passed gate weighs
    its branch, an absent one its default (a constant), and a branch with neither is skipped."""
    masks, gates = [], []
    for branch, mask in zip(attention.plan.branches, masks_of(attention, q.shape[0], q.shape[1], cu_seqlens)):
        if branch.gate is None:
            weight = None
        elif branch.gate.name in passed:
            weight = passed[branch.gate.name]
        elif branch.gate.default is not None:
            weight = np.full(q.shape[:3], branch.gate.default, dtype=np.float32)
        else:
            continue
        masks.append(mask)
        gates.append(weight)
    return masks, gates


def check_forward_and_gradients(rng, attention: SparseAttention, q, k, v, passed: dict, cu_seqlens=None, *, gradients=True):
    scale = 1 / np.sqrt(q.shape[-1])
    masks, gates = reference_branches(attention, q, passed, cu_seqlens)
    out = attention(q, k, v, cu_seqlens=cu_seqlens, **passed)
    assert_close(out, reference.forward(q, k, v, masks, gates, scale), FORWARD_TOLERANCE, "output")
    if not gradients:
        return

    d_out = normal(rng, *out.shape)
    names = sorted(passed)

    def with_gates(q, k, v, values):
        return attention(q, k, v, cu_seqlens=cu_seqlens, **dict(zip(names, values)))

    pullback = jax.jit(lambda q, k, v, values, d: jax.vjp(with_gates, q, k, v, values)[1](d))
    dq, dk, dv, d_gates = pullback(q, k, v, [passed[n] for n in names], d_out)
    expected = reference.gradients(q, k, v, masks, gates, scale, d_out)
    for name, actual, wanted in (("dq", dq, expected["q"]), ("dk", dk, expected["k"]), ("dv", dv, expected["v"])):
        assert_close(actual, wanted, GRADIENT_TOLERANCE, name)
    for name, actual in zip(names, d_gates):
        # a gate shared by several branches collects the cotangents of all of them
        wanted = sum(dg for g, dg in zip(gates, expected["gates"]) if g is passed[name])
        assert_close(actual, wanted, GRADIENT_TOLERANCE, f"d{name}")


def test_gradients_causal_union(rng):
    attention = compiled([model.Union((W(20), G(1), model.Difference(S(4), L(2))))], gates=[model.Gate("g_slc", 1.0)])
    q, k, v = qkv(rng, 2, 111, 8, 2, 100)
    check_forward_and_gradients(rng, attention, q, k, v, {"g_slc": gate(rng, 2, 111, 8)})


def test_gradients_bidirectional_random(rng):
    attention = compiled([model.Union((L(1, 1), R(2, 9)))], causal=False)
    q, k, v = qkv(rng, 1, 63, 3, 1, 60)
    check_forward_and_gradients(rng, attention, q, k, v, {})


def test_packed_sequences(rng):
    cu_seqlens = np.array([0, 15, 205, 550, 800], dtype=np.int32)
    attention = compiled([model.Union((L(2), G(1)))], block=32, gates=[model.Gate("g_swa")])
    q, k, v = qkv(rng, 1, 800, 4, 4, 32)
    check_forward_and_gradients(rng, attention, q, k, v, {"g_swa": gate(rng, 1, 800, 4)}, cu_seqlens)


def test_gated_branches(rng):
    """Each branch its own softmax; a passed gate multiplies, an absent one weighs its default,
    and a branch whose gate has no default is skipped when the gate is not passed."""
    attention = compiled(
        [W(12), model.Union((G(1), S(3))), L(1)],
        gates=[model.Gate("g_swa", 0.5), model.Gate("g_slc"), None],
    )
    q, k, v = qkv(rng, 1, 70, 4, 2, 16)
    check_forward_and_gradients(rng, attention, q, k, v, {"g_slc": gate(rng, 1, 70, 4)})
    check_forward_and_gradients(rng, attention, q, k, v, {"g_swa": gate(rng, 1, 70, 4)}, gradients=False)


def test_no_active_branch_is_an_error_naming_the_gates(rng):
    attention = compiled([W(8), L(1)], gates=[model.Gate("g_swa"), model.Gate("g_slc")])
    q, k, v = qkv(rng, 1, 20, 2, 1, 8)
    with pytest.raises(ValueError, match="g_swa, g_slc"):
        attention(q, k, v)
    assert_close(
        attention(q, k, v, g_slc=np.ones((1, 20, 2), np.float32) * 0.5),
        0.5 * reference.forward(q, k, v, masks_of(attention, 1, 20)[1:], [None], 1 / np.sqrt(8)),
        FORWARD_TOLERANCE,
        "only g_slc",
    )


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_precision_forward(rng, dtype):
    attention = compiled([model.Union((W(30), G(1)))], gates=[model.Gate("g_slc")])
    q, k, v = qkv(rng, 1, 90, 4, 2, 64)
    g_slc = gate(rng, 1, 90, 4)
    half = [jnp.asarray(x, dtype) for x in (q, k, v, g_slc)]
    out = attention(*half[:3], g_slc=half[3])
    assert out.dtype == dtype
    rounded = [np.asarray(x, np.float32) for x in half]
    expected = reference.forward(*rounded[:3], masks_of(attention, 1, 90), [rounded[3]], 1 / 8)
    assert_close(np.asarray(out, np.float32), expected, BF16_TOLERANCE, str(dtype))


def test_jit_with_traced_cu_seqlens(rng):
    attention = compiled([model.Union((L(2), S(3)))], causal=False)
    q, k, v = qkv(rng, 1, 96, 2, 1, 16)
    run = jax.jit(lambda q, k, v, cu, scale: attention(q, k, v, cu_seqlens=cu, softmax_scale=scale))
    for cu, scale in (([0, 40, 41, 90], 0.3), ([0, 17, 96, 96], 0.2)):
        cu = np.array(cu, dtype=np.int32)
        expected = reference.forward(q, k, v, masks_of(attention, 1, 96, cu), [None], scale)
        assert_close(run(q, k, v, jnp.asarray(cu), jnp.float32(scale)), expected, FORWARD_TOLERANCE, f"cu {cu.tolist()}")
    assert run._cache_size() == 1
