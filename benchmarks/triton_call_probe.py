"""How a Triton kernel call reaches XLA, and what the host pays for it: one jitted chain of six XLA
fusions and six calls of one small Triton kernel (64k float32 elements), lowered three ways:

- `legacy`: jax-triton 0.3.1's own lowering, jaxlib's legacy custom call `triton_kernel_call`;
- `ffi`: the same call re-emitted by nsa_dsl.runtime.triton_ffi as jaxlib's typed-FFI
  `triton_kernel_call_ffi` (what nsa_dsl's Triton platform uses);
- `xla`: XLA's own Triton custom call `__gpu$xla.gpu.triton`, given the TTIR triton emitted
  (XLA compiles it with its bundled Triton; every scalar must then be a constexpr).

For each: the custom call targets in the compiled HLO, the largest error against float64, and the
wall time of a step (5 rounds of 500, after 50 warm-ups), compiled with nsa_dsl's
DECODE_COMPILER_OPTIONS. On the GPU machine, with jax-triton installed:

    python3 benchmarks/triton_call_probe.py

Session 25 ran its first version (H200, jaxlib 0.11.2, triton 3.6.0;
results/triton_call_probe_2026-12-01s25.log; its `ffi` path patched jax.ffi.ffi_lowering to emit the
call triton_ffi emits): legacy 99-110 us a step, ffi 63-105 (63-74 but one round), xla 51-62. nsa_dsl
takes the FFI call: it keeps jax-triton's compiler and nsa_dsl's disk caches, and XLA records it into
its CUDA graphs (decode_timeline.py: no host launch left between a step's kernels).
"""

from __future__ import annotations

import functools
import re
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
import triton
import triton.language as tl
from jax._src.core import ShapedArray
from jax._src.interpreters import mlir
from jax._src.lib.mlir import ir
from jax_triton import triton_lib

import nsa_dsl
from nsa_dsl.runtime import triton_ffi

N, BLOCK, LINKS = 1 << 16, 1024, 6


@triton.jit
def scale_add(x_ptr, y_ptr, out_ptr, N: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < N
    x = tl.load(x_ptr + offsets, mask=mask)
    tl.store(out_ptr + offsets, x * 1.5 + tl.load(y_ptr + offsets, mask=mask), mask=mask)


class Lowering:
    """Which way jax-triton's primitive lowers; a fresh jit of the chain picks up the change."""

    path = "legacy"
    ttir: str | None = None  # the TTIR of scale_add, as jax-triton handed it to Triton's compiler

    @classmethod
    def install(cls) -> None:
        legacy = functools.partial(triton_lib.triton_kernel_call_lowering, triton_lib.get_cuda_backend)

        def lowering(ctx, *operands, **params):
            if cls.path == "ffi":
                return triton_ffi.as_ffi_call(legacy, ctx, *operands, **params)
            return legacy(ctx, *operands, **params)

        mlir.register_lowering(triton_lib.triton_kernel_call_p, lowering, platform="cuda")
        compile_ttir = triton_lib.compile_ttir_inplace

        def recording(ttir, *args, **kwargs):
            cls.ttir = str(ttir)
            return compile_ttir(ttir, *args, **kwargs)

        triton_lib.compile_ttir_inplace = recording


xla_triton_p = jax.extend.core.Primitive("probe_xla_triton_call")
xla_triton_p.def_abstract_eval(lambda x, y: ShapedArray(x.shape, x.dtype))


def _xla_triton_lowering(ctx, x, y):
    [out] = ctx.avals_out
    config = dict(
        name=ir.StringAttr.get("scale_add"),
        ir=ir.StringAttr.get(Lowering.ttir),
        num_stages=mlir.i32_attr(3),
        num_warps=mlir.i32_attr(4),
        grid_x=mlir.i32_attr(N // BLOCK),
        grid_y=mlir.i32_attr(1),
        grid_z=mlir.i32_attr(1),
        debug=ir.BoolAttr.get(False),
    )
    result_type = ir.RankedTensorType.get(out.shape, mlir.dtype_to_ir_type(out.dtype))
    return mlir.custom_call(
        "__gpu$xla.gpu.triton", result_types=[result_type], operands=[x, y], backend_config=config, api_version=4
    ).results


mlir.register_lowering(xla_triton_p, _xla_triton_lowering, platform="cuda")


def kernel_call(path: str, x, y):
    if path == "xla":
        return xla_triton_p.bind(x, y)
    import jax_triton

    out = jax.ShapeDtypeStruct(x.shape, x.dtype)
    return jax_triton.triton_call(x, y, kernel=scale_add, out_shape=out, grid=(N // BLOCK,), N=N, BLOCK=BLOCK)


def chain(path: str, x, y):
    for _ in range(LINKS):
        x = kernel_call(path, jnp.sin(x) * 0.5 + 0.25, y)
    return x


def reference(x, y):
    for _ in range(LINKS):
        x = (np.sin(x) * 0.5 + 0.25) * 1.5 + y
    return x


def main() -> None:
    import jaxlib

    print("jax", jax.__version__, "jaxlib", jaxlib.__version__, "triton", triton.__version__, flush=True)
    Lowering.install()
    x, y = (jax.random.normal(jax.random.PRNGKey(seed), (N,), jnp.float32) for seed in (0, 1))
    expected = reference(np.asarray(x, np.float64), np.asarray(y, np.float64))
    jax.jit(functools.partial(chain, "legacy")).lower(x, y).compile()  # records the TTIR
    for path in ("legacy", "ffi", "xla"):
        Lowering.path = path
        try:
            compiled = (
                jax.jit(functools.partial(chain, path), compiler_options=nsa_dsl.DECODE_COMPILER_OPTIONS)
                .lower(x, y)
                .compile()
            )
            targets = re.findall(r'custom_call_target="([^"]+)"', compiled.as_text())
            error = np.max(np.abs(np.asarray(compiled(x, y)) - expected))
            for _ in range(50):
                result = compiled(x, y)
            result.block_until_ready()
            rounds = []
            for _ in range(5):
                start = time.perf_counter()
                for _ in range(500):
                    result = compiled(x, y)
                result.block_until_ready()
                rounds.append((time.perf_counter() - start) / 500 * 1e6)
            print(
                f"[{path}] calls {sorted(set(targets))} x{len(targets)}; max error {error:.2e}; "
                f"us a step {' '.join(f'{t:.1f}' for t in sorted(rounds))}",
                flush=True,
            )
        except Exception:  # a lowering this jaxlib refuses is a result of the probe, not its end
            print(f"[{path}] failed:", flush=True)
            traceback.print_exc(limit=3)


if __name__ == "__main__":
    main()
