"""JAX transformations of nsa_dsl's attention beyond jit and grad (every backend's tests check
first-order reverse mode against the float64 reference): vmap over a leading axis and jax.checkpoint
give what the plain calls give; the Triton and Pallas kernels refuse to be differentiated twice with
one clear error (nsa_dsl.runtime.derivatives); XLA's forward over reverse (jax.hessian) matches the
float64 reference's."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference
from conftest import assert_close, qkv
from nsa_reference import small_example

import nsa_dsl

WINDOW = "pattern local\nblock 16\ncausal\nbranch w = window(21)\n"


def _window_attention_of_one_query_row(attention, q, k, v, row, platform):
    """The loss sum(out ** 2) as a function of q's `row`-th query of head 0."""
    def loss(q_row):
        return (attention(q.at[0, row, 0].set(q_row), k, v, platform=platform) ** 2).sum()
    return loss


@pytest.mark.parametrize("platform", ["triton", "pallas"])
@pytest.mark.parametrize("second", ["grad of grad", "hessian"])
def test_a_second_derivative_of_the_kernels_is_a_clear_error(rng, platform, second):
    attention = nsa_dsl.compile(WINDOW)
    q, k, v = (jnp.asarray(x) for x in qkv(rng, 1, 37, 2, 1, 12))
    loss = _window_attention_of_one_query_row(attention, q, k, v, 30, platform)
    # first order works: the rules run, undifferentiated
    assert np.isfinite(np.asarray(jax.grad(loss)(q[0, 30, 0]))).all()
    twice = jax.grad(lambda x: jax.grad(loss)(x).sum()) if second == "grad of grad" else jax.hessian(loss)
    with pytest.raises(nsa_dsl.SecondDerivativeError, match=f"the {platform} kernels of nsa_dsl have first derivatives"):
        twice(q[0, 30, 0])


@pytest.mark.parametrize("platform", ["triton", "pallas"])
def test_a_second_derivative_of_native_sparse_attention_is_a_clear_error(rng, platform):
    text, _ = small_example("nsa")
    attention = nsa_dsl.compile(text)
    q, k, v = (jnp.asarray(x) for x in qkv(rng, 1, 40, 2, 1, 16))
    gates = {name: jnp.asarray(rng.uniform(size=(1, 40, 2)), jnp.float32) for name in ("g_cmp", "g_slc", "g_swa")}

    def loss(q):
        return (attention(q, k, v, platform=platform, **gates) ** 2).sum()

    with pytest.raises(nsa_dsl.SecondDerivativeError):
        jax.grad(lambda q: jax.grad(loss)(q).sum())(q)


def test_xla_forward_over_reverse_matches_the_reference(rng):
    """jax.hessian of a loss of one query row, through XLA's backward, against the dense float64
    reference's (the XLA backward's while loops run forward mode)."""
    attention = nsa_dsl.compile(WINDOW)
    q, k, v = qkv(rng, 1, 37, 2, 1, 12)
    row = 30
    hessian = jax.hessian(_window_attention_of_one_query_row(attention, *map(jnp.asarray, (q, k, v)), row, "xla"))(
        jnp.asarray(q[0, row, 0])
    )
    mask = reference.static_mask(attention.plan.branches[0].static, 16, True, 1, 37)
    with jax.enable_x64(True):
        q64, k64, v64 = (jnp.asarray(x, jnp.float64) for x in (q, k, v))

        def reference_loss(q_row):
            out = reference.attention(q64.at[0, row, 0].set(q_row), k64, v64, mask, 12**-0.5, xp=jnp)
            return (out**2).sum()

        expected = np.asarray(jax.hessian(reference_loss)(q64[0, row, 0]))
    assert_close(np.asarray(hessian), expected, 1e-3, "hessian")


@pytest.mark.parametrize("platform", ["xla", "triton", "pallas"])
def test_vmap_and_checkpoint_give_what_the_plain_calls_give(rng, platform):
    """An ensemble axis in front of the batch (vmap: stacked models, per-example losses), and
    jax.checkpoint recomputing the forward in the backward: outputs and gradients equal those of
    the calls one by one, which the backends' own tests check against the float64 reference."""
    attention = nsa_dsl.compile(WINDOW)
    q_stack = jnp.asarray(np.stack([qkv(rng, 1, 37, 4, 2, 12)[0] for _ in range(3)]))
    _, k, v = (jnp.asarray(x) for x in qkv(rng, 1, 37, 4, 2, 12))
    g = jnp.asarray(rng.uniform(size=(1, 37, 4)), jnp.float32)

    def output(q):
        return attention(q, k, v, platform=platform)

    def loss(q):
        return (output(q) * g[..., None]).sum() + (output(q) ** 2).sum()

    one_by_one = [output(q) for q in q_stack]
    grads = [jax.grad(loss)(q) for q in q_stack]
    assert_close(jax.vmap(output)(q_stack), np.stack(one_by_one), 1e-6, "vmap")
    assert_close(jax.vmap(jax.grad(loss))(q_stack), np.stack(grads), 1e-5, "vmap of grad")
    assert_close(jax.grad(jax.checkpoint(loss))(q_stack[0]), grads[0], 1e-6, "checkpoint")
