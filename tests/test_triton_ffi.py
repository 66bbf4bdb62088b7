"""jax-triton's legacy kernel calls re-emitted as FFI calls (nsa_dsl/runtime/triton_ffi.py).

jax-triton cannot be imported without a GPU build of jax, so the rewrite is checked on a call
shaped like jax-triton's (target, API version 2, a compressed description as backend_config)
that a test primitive's lowering emits: the lowered module must hold the FFI call instead,
with the same operands, results, aliases and description bytes. On the H200 every Triton test and
benchmarks/gpu_check.py run through the FFI calls."""

from __future__ import annotations

import functools
import zlib

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.core import ShapedArray
from jax._src.interpreters import mlir
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import hlo

from nsa_dsl.runtime import triton_ffi


def legacy_call(description: bytes, target: str, ctx, *operands, input_output_aliases=(), negated=False):
    """A custom call as jax-triton 0.3.1 emits it (`negated`: its results passed through another op)."""
    results = mlir.custom_call(
        target,
        result_types=[ir.RankedTensorType.get(aval.shape, mlir.dtype_to_ir_type(aval.dtype)) for aval in ctx.avals_out],
        operands=list(operands),
        backend_config=description,
        api_version=2,
        operand_output_aliases=dict(input_output_aliases),
    ).results
    return [hlo.negate(result) for result in results] if negated else results


def lowered_calls(description: bytes, target: str, aliases, negated=False) -> tuple[ir.Module, list]:
    """The lowered module (the calls' owner: keep it alive while reading them) and its custom calls."""
    primitive = jax.extend.core.Primitive(f"legacy_triton_call_{target}_{negated}")
    primitive.multiple_results = True
    primitive.def_abstract_eval(
        lambda x, y, **params: [ShapedArray(x.shape, x.dtype), ShapedArray((3,), jnp.int32)]
    )
    legacy = functools.partial(legacy_call, description, target, negated=negated)
    rule = functools.partial(triton_ffi.as_ffi_call, legacy)
    mlir.register_lowering(primitive, rule)  # every platform: CI lowers for its CPU, the H200 for CUDA
    x = jnp.ones((4, 5), jnp.float32)
    y = jnp.ones((4, 5), jnp.float32)
    module = jax.jit(lambda x, y: primitive.bind(x, y, input_output_aliases=aliases)).lower(x, y).compiler_ir()
    calls = []

    def visit(operation):
        if operation.name == "stablehlo.custom_call":
            calls.append(operation)
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit)
    return module, calls


def test_a_legacy_call_becomes_the_ffi_call_to_the_same_kernel(rng):
    description = zlib.compress(rng.integers(0, 256, 300, dtype=np.uint8).tobytes())
    module, [call] = lowered_calls(description, triton_ffi.LEGACY_TARGET, aliases=((1, 0),))
    attributes = call.attributes
    assert ir.StringAttr(attributes["call_target_name"]).value == triton_ffi.FFI_TARGET
    # jax marks a typed-FFI call by its attribute dictionary (and leaves the opaque string empty)
    assert ir.StringAttr(attributes["backend_config"]).value_bytes == b""
    config = ir.DictAttr(attributes["mhlo.backend_config"])
    assert ir.StringAttr(config["opaque"]).value_bytes == description
    assert [str(operand.type) for operand in call.operands] == ["tensor<4x5xf32>", "tensor<4x5xf32>"]
    assert [str(result.type) for result in call.results] == ["tensor<4x5xf32>", "tensor<3xi32>"]
    assert "operand_index = 1" in str(attributes["output_operand_aliases"])


def test_other_calls_pass_through(rng):
    description = rng.integers(0, 256, 40, dtype=np.uint8).tobytes()
    module, [call] = lowered_calls(description, "some_other_call", aliases=())
    assert ir.StringAttr(call.attributes["call_target_name"]).value == "some_other_call"
    assert ir.StringAttr(call.attributes["backend_config"]).value_bytes == description


def test_results_not_made_by_a_custom_call_pass_through(rng):
    description = zlib.compress(rng.integers(0, 256, 40, dtype=np.uint8).tobytes())
    module, [call] = lowered_calls(description, triton_ffi.LEGACY_TARGET, aliases=(), negated=True)
    assert ir.StringAttr(call.attributes["call_target_name"]).value == triton_ffi.LEGACY_TARGET
    assert ir.StringAttr(call.attributes["backend_config"]).value_bytes == description


@pytest.mark.parametrize(
    "version, expected", [("0.10.2", False), ("0.9.0", False), ("0.10.3", True), ("0.11.2", True), ("1.0.0.dev1", True)]
)
def test_the_ffi_target_is_used_from_the_first_jaxlib_that_registers_it(monkeypatch, version, expected):
    import jaxlib

    monkeypatch.setattr(jaxlib, "__version__", version)
    assert triton_ffi.jaxlib_has_ffi_target() is expected


def test_the_environment_keeps_legacy_calls(monkeypatch):
    monkeypatch.setenv("NSA_DSL_TRITON_FFI", "0")
    assert triton_ffi.install.__wrapped__() is False
