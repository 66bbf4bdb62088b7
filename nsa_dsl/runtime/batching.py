"""jax.vmap of an attention call as one call of a larger batch.

jax-triton's launches have no batching rule, so under jax.vmap each runs once per element of the
mapped axis (triton_glue.launch): V launches of B batch rows where one launch of V * B rows would
do, and each of them too small to fill a GPU when the element is one sequence (the per-example
models of Equinox and Flax's nn.vmap). Batch rows of an attention call never meet, so mapping it
is calling it once with the mapped axis folded into the batch axis: `folding_vmap`.

jax.custom_batching.custom_vmap has no reverse mode, so the folding rule sits under a custom_vjp
whose forward and backward rules are custom_vmap functions themselves (JAX's documented way).
Unmapped, they are the call's own forward and pullback (jax.vjp), residuals and all. Mapped, the
forward's residuals would be the folded call's, [V * B, ...] where JAX traced the backward with
one element's shapes: so the mapped forward hands over zeros of the element's shapes, which
nothing reads, and the mapped backward runs the folded call's forward and backward anew.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.custom_batching import custom_vmap

from . import derivatives


def folding_vmap(call: Callable[[Any, Any], jax.Array], platform: str) -> Callable[[Any, Any], jax.Array]:
    """`call(floats, indices)` -> [B, ...], where every leaf of the pytrees `floats` (the
    differentiable arrays) and `indices` (integer arrays) leads with the batch axis B and the
    output's batch row b depends on the inputs' rows b alone. Returns a function of the same value
    and first derivatives (in `floats`) whose jax.vmap over any axis of any leaves calls `call`
    once, on that axis folded into B ([V, B, ...] -> [V * B, ...]; leaves not mapped are repeated
    V times). Its vmap of a gradient (or gradient of a vmap) asks for the folded forward twice, for
    the output and in the backward: the same calls on the same operands, which XLA computes once
    under one jit (on an H100 such a vmap of a gradient took what the batched call's gradient did).
    Second derivatives raise SecondDerivativeError, as `platform`'s kernels do."""
    pullbacks = {}  # element types -> (the structure of call's pullback, its leaves' types)

    def folded_call(size, batched, floats, indices):
        """[size, B, ...]: the call of each element, as one call of the folded arrays."""
        if size == 0:  # no element, no rows: kernels are not launched on an empty batch
            element = jax.eval_shape(call, *_element_types(batched, (floats, indices)))
            return jnp.zeros((0, *element.shape), element.dtype)
        return _unfolded(size, attention(*_folded(size, batched, (floats, indices))))

    @custom_vmap
    def forward(floats, indices):
        return call(floats, indices)

    @forward.def_vmap
    def _forward_folded(size, batched, floats, indices):
        return folded_call(size, tuple(batched), floats, indices), True

    @jax.custom_vjp
    def attention(floats, indices):
        return forward(floats, indices)

    @custom_vmap
    def forward_with_residuals(floats, indices):
        out, pullback = jax.vjp(lambda f: call(f, indices), floats)
        leaves, structure = jax.tree.flatten(pullback)
        pullbacks[_types((floats, indices))] = structure, [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves]
        return out, leaves

    @forward_with_residuals.def_vmap
    def _forward_with_residuals_folded(size, batched, floats, indices):
        out = folded_call(size, tuple(batched), floats, indices)
        # custom_vmap traced the element's forward before calling this rule, which recorded its
        # residuals' types.
        _, residual_types = pullbacks[_types((floats, indices), batched)]
        unread = [jnp.zeros(t.shape, t.dtype) for t in residual_types]
        return (out, unread), (True, [False] * len(unread))

    @custom_vmap
    def backward(floats, indices, residuals, d_out):
        structure, _ = pullbacks[_types((floats, indices))]
        (d_floats,) = jax.tree.unflatten(structure, residuals)(d_out)
        return d_floats

    @backward.def_vmap
    def _backward_folded(size, batched, floats, indices, residuals, d_out):
        # The residuals are not read: even with the inputs not mapped here (jax.jacrev maps the
        # cotangents alone) they may be the zeros of a forward folded by an outer vmap.
        inputs_batched = (batched[0], batched[1])
        # Per element even where an input was not mapped: JAX sums those for a gradient of the
        # vmap, and keeps them apart for a vmap of the gradient.
        every_element = jax.tree.map(lambda _: True, floats)
        if size == 0:
            empty = jax.tree.map(lambda t: jnp.zeros((0, *t.shape), t.dtype), _element_types(batched[0], floats))
            return empty, every_element
        folded_floats, folded_indices = _folded(size, inputs_batched, (floats, indices))
        _, pullback = jax.vjp(lambda f: attention(f, folded_indices), folded_floats)
        (d_floats,) = pullback(_folded(size, batched[3], d_out))
        return _unfolded(size, d_floats), every_element

    def attention_forward(floats, indices):
        out, residuals = forward_with_residuals(floats, indices)
        return out, (floats, indices, residuals)

    def attention_backward(saved, d_out):
        floats, indices, residuals = saved
        return backward(floats, indices, residuals, d_out), None

    # The rules' own derivatives (jax.hessian, grad of grad) are refused as the kernels' are: the
    # folded rules call `attention` again, where JAX would refuse forward mode with a TypeError.
    attention.defvjp(*derivatives.first_order(platform, attention_forward, attention_backward))
    return attention


def _element_types(batched, tree):
    """A jax.ShapeDtypeStruct of each leaf of `tree` as one element of a vmap sees it: without the
    leading axis of the leaves `batched` marks."""
    def element(x, mapped):
        return jax.ShapeDtypeStruct(x.shape[1:] if mapped else x.shape, x.dtype)

    return jax.tree.map(element, tree, batched)


def _types(tree, batched=None) -> tuple:
    """The (shape, dtype) of each leaf of `tree` as one element of a vmap sees it (_element_types):
    a key of `pullbacks`."""
    marks = batched if batched is not None else jax.tree.map(lambda _: False, tree)
    return tuple((t.shape, jnp.dtype(t.dtype)) for t in jax.tree.leaves(_element_types(tuple(marks), tree)))


def _folded(size: int, batched, tree):
    """Each leaf with its mapped axis (leading) folded into its batch axis; a leaf not mapped is
    repeated `size` times first."""
    def fold(x, mapped):
        stacked = x if mapped else jnp.broadcast_to(x, (size, *x.shape))
        return stacked.reshape(size * stacked.shape[1], *stacked.shape[2:])

    return jax.tree.map(fold, tree, batched)


def _unfolded(size: int, tree):
    """Each leaf's batch axis [size * B, ...] split back into [size, B, ...]."""
    return jax.tree.map(lambda x: x.reshape(size, x.shape[0] // size, *x.shape[1:]), tree)
