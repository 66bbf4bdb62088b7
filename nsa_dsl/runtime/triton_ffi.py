"""jax-triton's kernel calls as XLA FFI calls.

jax-triton 0.3.1 lowers every kernel call to jaxlib's legacy custom call `triton_kernel_call`,
whose compressed kernel description XLA hands to a C entry point at every launch, outside the
CUDA graphs XLA runs the program's other kernels from. jaxlib after 0.10.2 also registers
`triton_kernel_call_ffi`, a typed-FFI handler for the same description (Pallas' Triton lowering
and later jax-triton versions emit it): it reads the description once when the executable is
initialised, and XLA records its launches into those graphs (with DECODE_COMPILER_OPTIONS, a
decoding step's kernels then run from graphs back to back). On the H200 (jaxlib 0.11.2,
benchmarks/triton_call_probe.py) a jitted chain of six XLA fusions and six Triton calls ran in
99-110 us a step through the legacy call and 63-74 through the FFI one; an NSA decoding step of
8 sequences at 64k (benchmarks/bench_decode.py) in 0.229 ms and 0.107.

`install` wraps jax-triton's CUDA lowering: the call it emits is re-emitted, with the same
operands, results, aliases and compressed description, as an FFI call. Calls already emitted as
FFI (a newer jax-triton), and results not made by a custom call, pass through.
`NSA_DSL_TRITON_FFI=0` keeps the legacy calls.
"""

from __future__ import annotations

import functools
import os
import re

import jax

LEGACY_TARGET = "triton_kernel_call"
FFI_TARGET = "triton_kernel_call_ffi"
# The first jaxlib whose CUDA plugin registers FFI_TARGET (jax's Pallas switches to it after 0.10.2).
_FIRST_FFI_JAXLIB = (0, 10, 3)


def jaxlib_has_ffi_target() -> bool:
    import jaxlib

    numbers = [int(part) for part in re.findall(r"\d+", jaxlib.__version__)[:3]]
    return tuple(numbers) >= _FIRST_FFI_JAXLIB


def as_ffi_call(legacy_lowering, ctx, *operands, **params):
    """Lower through `legacy_lowering`, then replace the legacy custom call it emitted by the FFI
    call to the same kernel. `params` are the primitive's; its `input_output_aliases` (pairs of
    operand and result indices) carry over."""
    from jax._src.lib.mlir import ir

    results = legacy_lowering(ctx, *operands, **params)
    call = results[0].owner
    if call.name != "stablehlo.custom_call":
        return results
    if ir.StringAttr(call.attributes["call_target_name"]).value != LEGACY_TARGET:
        return results
    description = ir.StringAttr(call.attributes["backend_config"]).value_bytes
    aliases = dict(params.get("input_output_aliases", ()))
    ffi_call = jax.ffi.ffi_lowering(FFI_TARGET, api_version=4, operand_output_aliases=aliases)
    replaced = ffi_call(ctx, *operands, opaque=description)
    call.operation.erase()
    return replaced


@functools.lru_cache(maxsize=1)
def install() -> bool:
    """Re-emit jax-triton's CUDA calls as FFI calls (once per process). False where this jaxlib
    lacks the FFI handler, the user opted out, or jax-triton is not the 0.3 series this was written
    for (its lowering's two parts are looked up by name)."""
    if os.environ.get("NSA_DSL_TRITON_FFI") == "0" or not jaxlib_has_ffi_target():
        return False
    from jax._src.interpreters import mlir
    from jax_triton import triton_lib

    if not all(hasattr(triton_lib, name) for name in ("triton_kernel_call_lowering", "get_cuda_backend")):
        return False

    legacy_lowering = functools.partial(triton_lib.triton_kernel_call_lowering, triton_lib.get_cuda_backend)
    mlir.register_lowering(
        triton_lib.triton_kernel_call_p, functools.partial(as_ffi_call, legacy_lowering), platform="cuda"
    )
    return True
