"""Compiled Triton kernels on disk, for jax-triton.

jax-triton compiles a kernel from its Python source down to PTX while JAX lowers a call to it,
and keeps the result in a dict in memory: every new process compiles every kernel again
(measured on the H200 for examples/nsa.nsa's forward and backward at 8k tokens: 8.6 s of a 12.8 s
first call). JAX's persistent compilation cache cannot help, because lowering comes before its
lookup. This module gives the kernels of nsa_dsl's generated modules a disk cache under
`$NSA_DSL_CACHE_DIR/triton-kernels`: `install` wraps jax-triton's `get_or_create_triton_kernel`, which
then builds the kernel from a cache entry (PTX, kernel name, shared memory, TTIR and the pointer
arguments' specialisation) instead of compiling it. Kernels of other libraries pass through
untouched; `NSA_DSL_TRITON_CACHE=0` leaves jax-triton alone.

An entry's key covers everything jax-triton's own in-memory key does, with the kernel function
named by Triton's content hash of its source and dependencies (`JITFunction.cache_key`) rather
than by the object, plus the versions of Triton, jax-triton and jaxlib. Entries are written
atomically with a checksum; an entry that is missing, unreadable or fails its checksum is
compiled again and rewritten, never trusted.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import os
import threading
import warnings
from pathlib import Path

from .._version import __version__
from ..codegen.cache import CacheWarning, cache_root, library_version, write_atomically

# Generated modules are imported under this prefix (codegen.cache.load_module).
_GENERATED_PREFIX = "nsa_dsl_generated_"
# The parameters of jax_triton.triton_lib.get_or_create_triton_kernel this wrapper was written for
# (jax-triton 0.3.x); with any other signature the cache stays off rather than guess.
_EXPECTED_PARAMETERS = (
    "backend_init_func",
    "platform",
    "fn",
    "arg_dtypes",
    "scalar_args",
    "num_warps",
    "num_stages",
    "num_ctas",
    "compute_capability",
    "enable_fp_fusion",
    "metaparams",
    "dump",
)
_recorded = threading.local()


@functools.lru_cache(maxsize=1)
def install() -> None:
    """Route jax-triton's kernel compilation through the disk cache (once per process)."""
    if os.environ.get("NSA_DSL_TRITON_CACHE") == "0":
        return
    from jax_triton import triton_lib

    compile_kernel = triton_lib.get_or_create_triton_kernel
    if tuple(inspect.signature(compile_kernel).parameters) != _EXPECTED_PARAMETERS:
        warnings.warn(
            "nsa_dsl: this jax-triton's get_or_create_triton_kernel has an unknown signature; compiled Triton "
            "kernels are not cached on disk (every new process compiles them again)",
            stacklevel=2,
        )
        return
    compile_ttir = triton_lib.compile_ttir_inplace

    @functools.wraps(compile_ttir)
    def compile_ttir_recorded(ttir, *args, **kwargs):
        text = str(ttir)  # before the compiler's passes rewrite the module in place
        result = compile_ttir(ttir, *args, **kwargs)
        _recorded.compilation = (text, result)
        return result

    @functools.wraps(compile_kernel)
    def get_or_create_cached(backend_init_func, platform, fn, arg_dtypes, scalar_args, **options):
        key = _entry_key(triton_lib, platform, fn, arg_dtypes, scalar_args, options)
        if key is None:
            return compile_kernel(backend_init_func, platform, fn, arg_dtypes, scalar_args, **options)
        path = cache_root() / "triton-kernels" / key[:2] / f"{key}.json"
        entry = _read_entry(path)
        if entry is None:
            _recorded.compilation = None
            kernel, attrs = compile_kernel(backend_init_func, platform, fn, arg_dtypes, scalar_args, **options)
            if _recorded.compilation is not None:  # None: jax-triton had it in memory already
                _write_entry(path, _recorded.compilation, attrs)
            return kernel, attrs
        kernel = triton_lib.triton_kernel_call_lib.TritonKernel(
            entry["name"],
            options["num_warps"],
            options["num_ctas"],
            entry["shared_mem_bytes"],
            entry["binary"],
            entry["ttir"],
            _compute_capability(triton_lib, options),
        )
        return kernel, {(index,): attrs for index, attrs in entry["attrs"]}

    triton_lib.compile_ttir_inplace = compile_ttir_recorded
    triton_lib.get_or_create_triton_kernel = get_or_create_cached


def _compute_capability(triton_lib, options: dict) -> int:
    # jax-triton compiles for device 0 when it is not told otherwise; so does the cache key.
    given = options["compute_capability"]
    return given if given is not None else triton_lib.triton_kernel_call_lib.get_compute_capability(0)


def _entry_key(triton_lib, platform: str, fn, arg_dtypes, scalar_args, options: dict) -> str | None:
    """The entry's name, or None for a call this cache does not take: another library's kernel,
    a debug dump, launch settings left to jax-triton's defaults, or a non-CUDA platform (whose
    binary jax-triton passes as a temporary file's path)."""
    if (
        not getattr(fn, "__module__", "").startswith(_GENERATED_PREFIX)
        or platform != "cuda"
        or options["dump"]
        or options["num_warps"] is None
        or options["num_stages"] is None
    ):
        return None
    parts = {
        "kernel": fn.cache_key,
        "name": fn.__name__,
        "arg_dtypes": list(arg_dtypes),
        # jax-triton specialises a scalar only on being None or 1; its other values reach the kernel at launch.
        "scalars": [[index, dtype, None if value is None else value == 1] for index, dtype, value in scalar_args],
        "metaparams": sorted((name, repr(value)) for name, value in options["metaparams"].items()),
        "launch": [options["num_warps"], options["num_stages"], options["num_ctas"], options["enable_fp_fusion"]],
        "compute_capability": _compute_capability(triton_lib, options),
        "versions": [__version__, *(library_version(name) for name in ("triton", "jax-triton", "jaxlib"))],
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def _read_entry(path: Path) -> dict | None:
    """The entry at `path` if it is complete and its checksum matches, else None."""
    try:
        stored = json.loads(path.read_text())
        payload = stored["payload"]
        if not isinstance(payload, str) or hashlib.sha256(payload.encode()).hexdigest() != stored["sha256"]:
            return None
        entry = json.loads(payload)
        fields = {"name": str, "shared_mem_bytes": int, "binary": str, "ttir": str, "attrs": list}
        if not all(isinstance(entry.get(field), kind) for field, kind in fields.items()):
            return None
        return entry
    except (OSError, ValueError, KeyError, TypeError):  # missing, truncated, not JSON, wrong layout
        return None


def _write_entry(path: Path, compilation, attrs: dict) -> None:
    ttir, result = compilation
    payload = json.dumps(
        {
            "name": result.name,
            "shared_mem_bytes": result.shared_mem_bytes,
            "binary": result.binary,
            "ttir": ttir,
            "attrs": [[index, value] for (index,), value in sorted(attrs.items())],
        }
    )
    stored = json.dumps({"sha256": hashlib.sha256(payload.encode()).hexdigest(), "payload": payload})
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, stored.encode())
    except OSError as err:  # a read-only or full disk costs the next process a compile, nothing more
        warnings.warn(f"nsa_dsl could not cache a compiled Triton kernel at {path} ({err})", CacheWarning, stacklevel=2)
