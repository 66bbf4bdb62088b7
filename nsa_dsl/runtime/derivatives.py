"""Which derivatives the generated kernels have: first order, reverse mode.

A Triton or Pallas custom_vjp runs kernels JAX cannot differentiate. A second derivative
(jax.grad of jax.grad, jax.hessian) differentiates the rules themselves, the forward rule's
residuals first, and would fail deep inside JAX: Pallas with a bare AssertionError, Triton's
interpreter on a CPU with "Pure callbacks do not support JVP". `first_order` wraps both rules
so that differentiating either raises one clear error instead. A first derivative never
differentiates them (JAX runs the forward rule on primal values, the backward on cotangents).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax

from .promotion import allowing_rank_promotion


class SecondDerivativeError(NotImplementedError):
    """A custom_vjp rule of the Triton or Pallas kernels was differentiated."""


def first_order(platform: str, forward: Callable, backward: Callable) -> tuple[Callable, Callable]:
    """(forward, backward), a jax.custom_vjp's rules of `platform`'s kernels, as rules that run
    as they do but raise SecondDerivativeError when differentiated in either mode."""
    return _undifferentiable(platform, forward), _undifferentiable(platform, backward)


def _undifferentiable(platform: str, rule: Callable) -> Callable:
    rule = allowing_rank_promotion(rule)

    @functools.wraps(rule)
    def wrapped(*arguments):
        leaves, tree = jax.tree.flatten(arguments)
        # Only arrays can be custom_jvp arguments; the rule's static values (specs, Python
        # numbers) stay where they are.
        is_array = [isinstance(leaf, jax.Array) for leaf in leaves]

        @jax.custom_jvp
        def call(*arrays):
            given = iter(arrays)
            return rule(*jax.tree.unflatten(tree, [next(given) if a else x for x, a in zip(leaves, is_array)]))

        @call.defjvp
        def refuse(primals, tangents):
            raise SecondDerivativeError(
                f"the {platform} kernels of nsa_dsl have first derivatives in reverse mode only (jax.grad, "
                f"jax.vjp): their custom_vjp rules cannot be differentiated again (grad of grad, jax.hessian); "
                f"platform='xla' computes them (jax.hessian, grad of grad)"
            )

        return call(*[leaf for leaf, a in zip(leaves, is_array) if a])

    return wrapped
