"""Compile the Triton kernels a pattern launches for an H100/H200 (sm_90a) on a machine without a
GPU: Triton's compiler and the ptxas it ships need no GPU. Run as a process of its own (Triton must
be imported without TRITON_INTERPRET, which nsa_dsl would otherwise switch on here):

    python tests/triton_sm90.py SPEC_JSON

SPEC_JSON: a list of {"pattern": .nsa text or an examples/ file, "batch", "seq_len", "heads_q",
"heads_kv", "head_dim", "dtype", "selection": true for native_sparse_attention's explicit
block_indices, "decode": true for a decoding step}. Each case's forward and backward (both orders
of the selection backward) and its forward alone are traced (not run), or a decoding step's forward (one query a batch
row at its last key row, reading a compressed cache): every `triton_glue.launch`
is recorded with the argument types jax-triton would give the kernel (pointers 16-byte aligned,
integers i32, a scalar equal to 1 specialised to the constant), then each distinct kernel is
compiled for sm_90a with its launch's num_warps and num_stages. Prints one JSON line: per kernel
its name, shared memory in bytes and compile seconds, or the compiler's error."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

os.environ.pop("TRITON_INTERPRET", None)
import triton  # noqa: E402 - before nsa_dsl, and not interpreted
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import nsa_dsl  # noqa: E402
from nsa_dsl.runtime import triton_glue  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# jax-triton's pointer types per array dtype.
TRITON_TYPES = {
    "bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64", "bool": "i1",
    **{f"{sign}int{bits}": f"{sign[:1] or 'i'}{bits}" for sign in ("", "u") for bits in (8, 16, 32, 64)},
}
recorded: dict[tuple, dict] = {}


def record(kernel, grid, inputs, outputs, *, num_warps, num_stages, zeroed=(), aliases=None, **constants):
    """triton_glue.launch while recording: note the kernel's specialisation (which aliases do not
    change), return zeros."""
    signature, constexprs = {}, dict(constants)
    names = kernel.arg_names
    for name, arg in zip(names, [*inputs, *outputs]):
        if isinstance(arg, bool):
            signature[name] = "i1"
        elif isinstance(arg, int) and arg == 1:  # jax-triton compiles a scalar 1 in as a constant
            constexprs[name] = 1
        elif isinstance(arg, int):
            signature[name] = "i32" if -(2**31) <= arg < 2**31 else "i64"
        elif isinstance(arg, float):
            signature[name] = "fp64"
        else:
            signature[name] = "*" + TRITON_TYPES[jnp.dtype(arg.dtype).name]
    for name in constexprs:
        signature[name] = "constexpr"
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(names) if signature[name].startswith("*")}
    key = (kernel.__name__, json.dumps(signature), repr(sorted(constexprs.items())), num_warps, num_stages)
    recorded.setdefault(
        key,
        {
            "kernel": kernel,
            "signature": signature,
            "constexprs": constexprs,
            "attrs": attrs,
            "options": {"num_warps": num_warps, "num_stages": num_stages},
        },
    )
    return [jnp.zeros(o.shape, o.dtype) for o in outputs]


def trace(case: dict) -> None:
    """Trace one case's forward and backward under jit (nothing runs); with "hopper", as on a Hopper
    GPU: the Mosaic GPU kernels in place of some Triton ones, and the Triton kernels that take their
    results (the top-k ranking a given mass)."""
    on_hopper = triton_glue.on_hopper
    if case.get("hopper"):
        triton_glue.on_hopper = lambda: True
    try:
        trace_on_this_device(case)
    finally:
        triton_glue.on_hopper = on_hopper


def trace_on_this_device(case: dict) -> None:
    dtype = jnp.dtype(case["dtype"])
    shape_q = (case["batch"], case["seq_len"], case["heads_q"], case["head_dim"])
    shape_kv = (case["batch"], case["seq_len"], case["heads_kv"], case["head_dim"])
    q, k, v = (jax.ShapeDtypeStruct(s, dtype) for s in (shape_q, shape_kv, shape_kv))
    if case.get("selection"):
        indices = jnp.zeros((case["batch"], case["seq_len"], case["heads_kv"], 16), jnp.int32)

        def attention(q, k, v):
            return nsa_dsl.native_sparse_attention(q, k, v, None, None, indices, 16, None, platform="triton")
    else:
        text = case["pattern"]
        source = ROOT / "examples" / text if text.endswith(".nsa") else text
        compiled = nsa_dsl.compile(source)
        gates = {
            g.name: jnp.ones((case["batch"], case["seq_len"], case["heads_q"]), dtype) for g in compiled.plan.gates
        }

        def attention(q, k, v):
            return compiled(q, k, v, platform="triton", **gates)

        if case.get("decode"):
            step_q = jax.ShapeDtypeStruct((case["batch"], 1, case["heads_q"], case["head_dim"]), dtype)
            step_gates = {name: gate[:, -1:] for name, gate in gates.items()}

            def step(q, k, v):
                cache = compiled.compress(k, v)
                return compiled(q, k, v, query_offset=case["seq_len"] - 1, compressed=cache, platform="triton",
                                **step_gates)

            jax.jit(step).trace(step_q, k, v)
            return

    loss = lambda q, k, v: jnp.sum(attention(q, k, v).astype(jnp.float32))  # noqa: E731
    # Both orders of the selection backward: score gradients stored for dq, and recomputed by it; and
    # the forward alone (its gated kernels), with and without the memory for a key-block-outer forward.
    for stored in (True, False):
        triton_glue.fits_device_memory = lambda nbytes, share, stored=stored: stored
        jax.clear_caches()  # the generated entry points are jitted: trace them again
        jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).trace(q, k, v)
        jax.jit(attention).trace(q, k, v)


def record_launches(cases: list[dict]) -> None:
    """Trace `cases`, recording each distinct kernel launch in `recorded` (nothing runs)."""
    triton_glue.prepare_kernels = lambda: None  # keep the kernels compiled ones
    triton_glue.check_dtype = lambda dtype: None  # bfloat16 is what the GPU runs
    triton_glue.launch = record
    for case in cases:
        trace(case)


def main() -> None:
    record_launches(json.loads(sys.argv[1]))
    target = GPUTarget("cuda", 90, 32)
    results = []
    for entry in recorded.values():
        kernel = entry["kernel"]
        start = time.perf_counter()
        source = ASTSource(kernel, entry["signature"], entry["constexprs"], entry["attrs"])
        try:
            compiled = triton.compile(source, target=target, options=entry["options"])
            results.append(
                {
                    "kernel": kernel.__name__,
                    "shared": compiled.metadata.shared,
                    **entry["options"],
                    "seconds": round(time.perf_counter() - start, 1),
                }
            )
        except Exception as err:  # noqa: BLE001 - reported per kernel
            results.append({"kernel": kernel.__name__, "error": f"{type(err).__name__}: {err}"[-2000:]})
    print(json.dumps(results))


if __name__ == "__main__":
    main()
