"""The generated kernels under jax_enable_x64.

Every platform computes in float32 (and 16-bit types), with int32 indices. Under x64 the Triton
and Pallas modules take float64 inputs as float32 and return float64 (`float64_in_float32`);
integer arguments reach them as int32 already (runtime.validate). Pallas needs more: where x64 is
on, Python ints in its kernels and their glue become int64s and meet the kernels' int32 indices
(TypeErrors while tracing, and in the interpreter's state discharge at lowering; Mosaic refuses
64-bit types). Its entry points and custom_vjp rules therefore run with x64 off (`without_x64`;
JAX traces the rules when it differentiates, after an entry point has returned), and its kernels
lower with x64 off too (`pallas_call`): a jit around them, the user's, lowers later still, under
the user's setting. The Pallas kernels then trace and lower as they do where x64 is off.
"""

from __future__ import annotations

import contextvars
import functools

import jax
import jax.numpy as jnp

# pallas_call metadata marking the kernels that lower with x64 off; the lowering removes it.
_LOWERED_WITHOUT_X64 = {"nsa_dsl": "lowered without x64"}
# Whether the caller of the running `without_x64` function had x64 on: only then are its kernels
# marked, so that where x64 is off nothing differs from a plain pl.pallas_call.
_CALLER_HAS_X64 = contextvars.ContextVar("nsa_dsl_caller_has_x64", default=False)


def float64_in_float32(entry):
    """A generated module's entry (query, key, value, **arguments) taking float64 inputs
    (jax_enable_x64): its kernels compute in float32, as every platform accumulates, and rank the
    top-k by keys built from 32-bit scores, so float64 arrays go in as float32 and its floating
    results come back as float64 (gradients follow the casts)."""

    @functools.wraps(entry)
    def run(query, key, value, **arguments):
        if query.dtype != jnp.float64:
            return entry(query, key, value, **arguments)
        result = entry(_narrow(query), _narrow(key), _narrow(value), **jax.tree.map(_narrow, arguments))
        return jax.tree.map(lambda x: x.astype(jnp.float64) if jnp.issubdtype(x.dtype, jnp.floating) else x, result)

    return run


def _narrow(x):
    return x.astype(jnp.float32) if getattr(x, "dtype", None) == jnp.float64 else x


def without_x64(function):
    """`function` run with jax_enable_x64 off where it is on. Float64 arrays among its arguments go
    in as float32 (x64 off holds none); functions among its keyword arguments (a caller's pooling
    functions, which may hold float64 parameters) run with x64 on, their float64 results narrowed.
    Its results are 32-bit: float64_in_float32 around it returns float64 for float64 inputs."""

    @functools.wraps(function)
    def run(*arguments, **options):
        if not jax.config.jax_enable_x64:
            return function(*arguments, **options)
        arguments = jax.tree.map(_narrow, arguments)
        options = jax.tree.map(lambda x: _with_x64(x) if callable(x) else _narrow(x), options)
        marking = _CALLER_HAS_X64.set(True)
        try:
            with jax.enable_x64(False):
                return function(*arguments, **options)
        finally:
            _CALLER_HAS_X64.reset(marking)

    return run


def _with_x64(function):
    @functools.wraps(function)
    def run(*arguments):
        with jax.enable_x64(True):
            return jax.tree.map(_narrow, function(*arguments))

    return run


def pallas_call(kernel, **options):
    """pl.pallas_call(kernel, **options), lowered with jax_enable_x64 off whatever the setting
    where the program around it lowers; unchanged where its caller has x64 off."""
    from jax.experimental import pallas as pl

    if not _CALLER_HAS_X64.get():
        return pl.pallas_call(kernel, **options)
    _lower_marked_kernels_without_x64()
    return pl.pallas_call(kernel, metadata=_LOWERED_WITHOUT_X64, **options)


@functools.lru_cache(maxsize=1)
def _lower_marked_kernels_without_x64() -> None:
    """Wrap Pallas' lowering of pallas_call (once per process): a call that `pallas_call` marked
    lowers with x64 off, without the mark (the HLO is what it is without x64); others as before."""
    from jax._src.interpreters import mlir
    from jax._src.pallas.pallas_call import pallas_call_p

    lowering = mlir._lowerings[pallas_call_p]

    def lower(ctx, *operands, metadata, **params):
        if metadata is None or dict(metadata) != _LOWERED_WITHOUT_X64:
            return lowering.rule(ctx, *operands, metadata=metadata, **params)
        with jax.enable_x64(False):
            return lowering.rule(ctx, *operands, metadata=None, **params)

    mlir.register_lowering(pallas_call_p, lower, inline=lowering.inline)
