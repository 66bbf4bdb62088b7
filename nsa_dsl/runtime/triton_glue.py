"""Launching generated Triton kernels from JAX: on a GPU through jax-triton, elsewhere in
Triton's interpreter.

A generated Triton module calls `launch` for every kernel. With a GPU build of jax the kernel
becomes an XLA custom call through `jax_triton.triton_call` (imported only then; its compiled
kernels are kept on disk by `triton_cache`, its calls reach XLA as FFI calls through `triton_ffi`).
Without a GPU
the very same `@triton.jit` functions run in Triton's interpreter (TRITON_INTERPRET=1) inside a
`jax.pure_callback`, on the host buffers of the callback's numpy arrays, so a generated module
works under `jax.jit` and `jax.grad` on a CPU: that is how CI checks the kernels. The
interpreter executes one program at a time in Python; it is for small shapes, float32 and
float16 (numpy has no bfloat16 for its matrix products).

Kernel signatures follow jax-triton's convention: input pointers and scalars in order, then
one pointer per output, then the `tl.constexpr` parameters by name.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from . import ptxas_cache, triton_cache, triton_ffi
from .layout import varying_like


@functools.lru_cache(maxsize=None)
def on_gpu() -> bool:
    """Whether jax runs on a GPU, i.e. kernels go through jax-triton rather than the interpreter."""
    return jax.default_backend() == "gpu"


def on_hopper() -> bool:
    """Whether the GPU is a Hopper (sm_90) that can run the Mosaic GPU kernels of the GPU module
    (templates/triton/hopper_window.py.j2, hopper_topk.py.j2), unless NSA_DSL_HOPPER=0 (read when a pattern's
    kernels are traced)."""
    return os.environ.get("NSA_DSL_HOPPER") != "0" and _compute_capability() == "9.0" and _mosaic_gpu_importable()


@functools.lru_cache(maxsize=1)
def import_jax_triton():
    """jax_triton, imported without its one side effect on the process: its import sets
    TRITON_CACHE_DIR to "", after which Triton's own compiler (torch.compile's kernels in this
    process, Triton in any child process) refuses to compile ("Could not create or locate cache
    dir"). The variable is put back as it was; jax-triton's compilation does not read it."""
    before = os.environ.get("TRITON_CACHE_DIR")
    import jax_triton

    if before is None:
        os.environ.pop("TRITON_CACHE_DIR", None)
    else:
        os.environ["TRITON_CACHE_DIR"] = before
    return jax_triton


@functools.lru_cache(maxsize=None)
def _compute_capability() -> str | None:
    return getattr(jax.devices()[0], "compute_capability", None) if on_gpu() else None


@functools.lru_cache(maxsize=None)
def multiprocessors() -> int:
    """The GPU's streaming multiprocessors: a persistent kernel's CTAs. Without a GPU (a kernel
    lowered for CUDA on a CPU, as CI does) an H100/H200's 132."""
    return getattr(jax.devices()[0], "core_count", 132) if on_gpu() else 132


@functools.lru_cache(maxsize=None)
def _mosaic_gpu_importable() -> bool:
    """Pallas' Mosaic GPU imports absl, which jax does not depend on (the `gpu` extra brings it):
    without it the Triton kernels run."""
    try:
        from jax.experimental.pallas import mosaic_gpu  # noqa: F401
    except ImportError:
        return False
    return True


@functools.lru_cache(maxsize=None)
def _device_memory_bytes() -> int | None:
    """Memory of the first local device as its allocator reports it; None where it reports none (a CPU)."""
    return (jax.local_devices()[0].memory_stats() or {}).get("bytes_limit")


def memory_share(variable: str, default: float) -> float:
    """A share of the device's memory: the environment variable's value (a number from 0 to 1),
    else `default`."""
    text = os.environ.get(variable)
    if text is None:
        return default
    try:
        share = float(text)
    except ValueError:
        share = float("nan")
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"{variable} must be a number from 0 to 1 (a share of the device's memory), got {text!r}")
    return share


def fits_device_memory(nbytes: int, share: float) -> bool:
    """Whether a buffer of `nbytes` takes at most `share` of the device's memory (always, where the
    device reports no limit: the interpreter's host memory)."""
    limit = _device_memory_bytes()
    return limit is None or nbytes <= share * limit


def prepare_kernels() -> None:
    """Call before a generated module imports triton. Without a GPU, every `triton.jit` function
    must be an interpreted one, Triton's own library functions (tl.zeros, ...) included, and
    `triton.jit` decides that when it decorates: at import time for the library."""
    if on_gpu():
        return
    if "triton" in sys.modules and not os.environ.get("TRITON_INTERPRET"):
        import triton.language as tl
        from triton.runtime.interpreter import InterpretedFunction

        if not isinstance(tl.zeros, InterpretedFunction):
            raise RuntimeError(
                "triton was imported before nsa_dsl could switch it to its interpreter (jax has no GPU "
                "here): set TRITON_INTERPRET=1 in the environment, or import triton after the first "
                "platform='triton' call"
            )
    os.environ["TRITON_INTERPRET"] = "1"
    _repair_interpreter_scalar_index()
    _patch_language_once_a_launch()


def _repair_interpreter_scalar_index() -> None:
    """Triton 3.6's interpreter holds a scalar as a one-element array and turns it into a Python
    int with int(array), which numpy >= 2.4 refuses: any loop whose bounds are loaded values
    fails (triton-lang/triton#9171, fixed upstream by #9172 with `.item()`-style extraction).
    Apply the same fix where it is missing."""
    try:
        int(np.ones(1))
        return  # this numpy still converts one-element arrays
    except TypeError:
        pass
    from triton.runtime import interpreter

    patch_tensor = interpreter._patch_lang_tensor
    if getattr(patch_tensor, "nsa_dsl_scalar_index", False):
        return

    def patch_lang_tensor(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patch_lang_tensor.nsa_dsl_scalar_index = True
    interpreter._patch_lang_tensor = patch_lang_tensor


def _patch_language_once_a_launch() -> None:
    """Triton 3.6's interpreter patches triton.language for the interpreter (`_patch_lang`:
    inspect.getmembers over tl, tl.tensor, tl.math, ...) when a launch starts and again on every
    call of a nested @triton.jit function, ~1 ms a call: a quarter to a third of the interpreter's
    time in kernels built of small helpers (the top-k's sorting networks). The patches replace
    attributes of those shared modules in place, so a nested call finds done what it would do
    for the modules the running launch has patched already; such a call skips it. The launch's
    own scope restores the modules at its end (in a `finally`), and forgets them then."""
    import inspect

    import triton.language as tl
    from triton.runtime import interpreter

    patch_lang = getattr(interpreter, "_patch_lang", None)
    if patch_lang is None or getattr(patch_lang, "nsa_dsl_once_a_launch", False):
        return
    patched: set[int] = set()  # ids of the language modules the running launch has patched

    def patch_lang_once(fn):
        languages = {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)}
        if patched and languages <= patched:
            return interpreter._LangPatchScope()  # a nested call: nothing to patch or restore
        scope = patch_lang(fn)
        if not patched:  # the launch's own scope
            restore = scope.restore

            def restore_and_forget():
                patched.clear()
                restore()

            scope.restore = restore_and_forget
        patched.update(languages)
        return scope

    patch_lang_once.nsa_dsl_once_a_launch = True
    interpreter._patch_lang = patch_lang_once


def check_dtype(dtype) -> None:
    """bfloat16 runs on GPUs only: the interpreter multiplies matrices with numpy, which has no bfloat16."""
    if not on_gpu() and jnp.dtype(dtype) == jnp.bfloat16:
        raise ValueError(
            "query: bfloat16 needs a GPU on the triton platform (on a CPU its kernels run in Triton's "
            "interpreter, which supports float32 and float16); use float16/float32 or platform='xla'"
        )


def next_power_of_two(n: int, minimum: int = 1) -> int:
    """The smallest power of two >= max(n, minimum): tile extents must be powers of two."""
    return max(1 << max(n - 1, 0).bit_length(), minimum)


def power_of_two_at_most(n: int) -> int:
    """The largest power of two <= n (n >= 1)."""
    return 1 << (n.bit_length() - 1)


def launch(
    kernel,
    grid: tuple[int, ...],
    inputs: Sequence,
    outputs: Sequence[jax.ShapeDtypeStruct],
    *,
    num_warps: int,
    num_stages: int,
    zeroed: Sequence[int] = (),
    aliases: dict[int, int] | None = None,
    **constants,
) -> list[jax.Array]:
    """Run `kernel` on `grid`. inputs: arrays and Python ints/floats, in the kernel's parameter
    order; outputs: shapes and dtypes of the output buffers that follow them (those listed in
    `zeroed` start as zeros, those `aliases` names, {input position: output index}, are that
    input's buffer, updated in place, and the others have undefined contents: NaN in the
    interpreter, so that tests catch an element a kernel fails to write); constants: the
    kernel's constexpr parameters. Returns the output arrays."""
    outputs = [jax.ShapeDtypeStruct(o.shape, o.dtype) for o in outputs]
    aliases = dict(aliases or {})
    arrays = [x for x in inputs if not _is_scalar(x)]
    if on_gpu():
        jax_triton = import_jax_triton()
        triton_cache.install()
        triton_ffi.install()
        ptxas_cache.install()

        def call(*array_values):
            return jax_triton.triton_call(
                *_with_numbers(inputs, array_values),
                kernel=kernel,
                out_shape=outputs,
                grid=grid,
                num_warps=num_warps,
                num_stages=num_stages,
                zeroed_outputs=tuple(zeroed),
                # jax-triton numbers the array inputs alone.
                input_output_aliases={_array_position(inputs, i): o for i, o in aliases.items()},
                **constants,
            )

        # jax-triton's call has no batching rule: under jax.vmap a launch runs once per element of
        # the mapped axis, as the interpreter's pure_callback does (vmap_method="sequential"), where
        # the call around it could not fold that axis into its batch (dispatch._batch_major).
        return varying_like(jax.custom_batching.sequential_vmap(call)(*arrays), inputs)
    callback = functools.partial(_interpret, kernel, grid, tuple(inputs), tuple(outputs), tuple(zeroed),
                                 tuple(aliases.items()), constants)
    return varying_like(jax.pure_callback(callback, outputs, *arrays, vmap_method="sequential"), arrays)


def _is_scalar(x) -> bool:
    return isinstance(x, (bool, int, float))


def _with_numbers(inputs: Sequence, arrays: Sequence) -> list:
    """inputs with its arrays, in order, replaced by `arrays` (its numbers kept)."""
    replacements = iter(arrays)
    return [x if _is_scalar(x) else next(replacements) for x in inputs]


def _array_position(inputs: Sequence, position: int) -> int:
    """The index of inputs[position], an array, among the inputs that are arrays."""
    if _is_scalar(inputs[position]):
        raise ValueError(f"input {position} is a number: only arrays alias outputs")
    return sum(not _is_scalar(x) for x in inputs[:position])


# The interpreter keeps the running program's grid position in module state: one launch at a time.
_interpreting = threading.Lock()


def _interpret(kernel, grid, inputs, outputs, zeroed, aliases, constants, *arrays):
    """The host side of `launch` without a GPU: run the kernel in the interpreter on numpy buffers."""
    host = iter(arrays)
    args = [x if _is_scalar(x) else HostBuffer(np.ascontiguousarray(next(host))) for x in inputs]
    # An aliased output starts as a copy of its input (the callback's input may be JAX's own buffer),
    # passed for both: one buffer, as on a GPU.
    aliased = {output: position for position, output in aliases}
    results = [
        np.array(args[aliased[i]].array) if i in aliased
        else np.zeros(o.shape, o.dtype) if i in zeroed
        else _unwritten(o)
        for i, o in enumerate(outputs)
    ]
    for output, position in aliased.items():
        args[position] = HostBuffer(results[output])
    with _interpreting:
        kernel[grid](*args, *(HostBuffer(r) for r in results), **constants)
    return results


def _unwritten(output: jax.ShapeDtypeStruct) -> np.ndarray:
    """A fresh output buffer that betrays elements nobody writes: NaN, or -1 for integers."""
    fill = np.nan if np.issubdtype(output.dtype, np.floating) else -1
    return np.full(output.shape, fill, output.dtype)


class HostBuffer:
    """A numpy array as Triton's interpreter sees a tensor argument.

    The interpreter is written for torch tensors: it reads `data_ptr()` and `dtype`, and copies
    every argument's storage to the host before the launch and back after it. The memory of a
    numpy array already is host memory, so here storage, host copy and tensor are one object,
    and the copies are no-ops."""

    def __init__(self, array: np.ndarray) -> None:
        self.array = array
        self.dtype = array.dtype

    def data_ptr(self) -> int:
        return self.array.ctypes.data

    # The storage protocol of GridExecutor._init_args_hst / _restore_args_dev.
    def untyped_storage(self) -> HostBuffer:
        return self

    def cpu(self) -> HostBuffer:
        return self

    def storage_offset(self) -> int:
        return 0

    def size(self) -> tuple[int, ...]:
        return self.array.shape

    def stride(self) -> tuple[int, ...]:
        return tuple(s // self.array.itemsize for s in self.array.strides)

    def new_empty(self, *args, **kwargs) -> HostBuffer:
        return HostBuffer(self.array)

    def set_(self, storage: HostBuffer, offset: int, size, stride) -> HostBuffer:
        self.array = storage.array
        return self

    def copy_(self, other: HostBuffer) -> HostBuffer:
        return self
