"""nsa_dsl's array code under a caller's jax_numpy_rank_promotion.

The library broadcasts arrays of different ranks as NumPy does ([N, 1] + [M]). A caller may set
jax_numpy_rank_promotion to "raise" (or "warn") to catch that in their own model code; nsa_dsl's
entry points and custom_vjp rules then run with it allowed. The rules need their own wrapping:
JAX traces a rule when it differentiates, after the entry point has returned, under the caller's
setting again.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax


def allowing_rank_promotion(function: Callable) -> Callable:
    """`function`, run with jax_numpy_rank_promotion "allow" whatever the caller's setting."""

    @functools.wraps(function)
    def run(*arguments, **options):
        with jax.numpy_rank_promotion("allow"):
            return function(*arguments, **options)

    return run
