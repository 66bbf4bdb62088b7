"""The generated kernels under jax_enable_x64.

Every platform computes in float32 (and 16-bit types), with int32 indices. Under x64 the Triton
module takes float64 inputs as float32 and returns float64 (`float64_in_float32`); integer
arguments reach it as int32 already (runtime.validate).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def float64_in_float32(entry):
    """A generated module's entry (query, key, value, **arguments) taking float64 inputs
    (jax_enable_x64): its kernels compute in float32, as every platform accumulates, and rank the
    top-k by keys built from 32-bit scores, so float64 arrays go in as float32 and its floating
    results come back as float64 (gradients follow the casts)."""

    def narrow(x):
        return x.astype(jnp.float32) if getattr(x, "dtype", None) == jnp.float64 else x

    @functools.wraps(entry)
    def run(query, key, value, **arguments):
        if query.dtype != jnp.float64:
            return entry(query, key, value, **arguments)
        result = entry(narrow(query), narrow(key), narrow(value), **jax.tree.map(narrow, arguments))
        return jax.tree.map(lambda x: x.astype(jnp.float64) if jnp.issubdtype(x.dtype, jnp.floating) else x, result)

    return run
