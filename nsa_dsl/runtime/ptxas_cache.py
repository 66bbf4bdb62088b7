"""Compiled kernel binaries on disk, for jaxlib's Triton kernel calls.

triton_cache keeps each kernel's PTX on disk, but PTX is not what a GPU runs: jaxlib assembles it
with ptxas at the kernel's first launch in every process (jaxlib/gpu/triton_kernels.cc,
GetModuleImage) and keeps the binary in memory only. Measured on the H200 (bench_gpu's cold-start
children, 32k tokens): a second process spent 3.7-4.1 s of its ~5 s of first calls in 32 ptxas
runs, each repeating the previous process's work.

`install` puts a ptxas wrapper (the shell script ptxas_shim.sh) first on this process's PATH,
which is where XLA looks for ptxas. The wrapper answers a compilation it has seen before from
`$NSA_DSL_CACHE_DIR/ptxas/<id>/binaries`, keyed by the SHA-256 of the PTX and the options, and
passes every other call to the real ptxas unchanged; entries are written atomically and carry
checksums, so a torn or damaged entry is compiled again, never used. `<id>` names the real ptxas
(path, size, modification time) and the wrapper's text, so a different or updated ptxas never
reads another's binaries. Child processes inherit PATH and so the wrapper; a process whose cache
directory differs puts its own in front. `NSA_DSL_PTXAS_CACHE=0` leaves PATH alone.

XLA locates ptxas once per process for jaxlib's kernels (at the first Triton launch), so the
wrapper serves them when `install` runs before that: nsa_dsl installs it before its first Triton
call. It serves XLA's own kernels too once XLA's next lookup finds it (identical binaries, fetched
instead of assembled).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shlex
import shutil
import warnings
from pathlib import Path

from ..codegen.cache import CacheWarning, cache_root, write_atomically

# The wrapper's first line after the interpreter: how `install` recognises wrappers already on PATH.
_MARKER = "# nsa_dsl ptxas cache"


@functools.lru_cache(maxsize=1)
def install() -> Path | None:
    """Put the caching ptxas first on PATH (once per process); returns its path, or None where it
    is switched off or cannot serve (no ptxas on PATH, no sha256sum, an unwritable cache)."""
    if os.environ.get("NSA_DSL_PTXAS_CACHE") == "0":
        return None
    entries = os.environ.get("PATH", "").split(os.pathsep)
    search_path = os.pathsep.join(entry for entry in entries if not _is_wrapper_dir(entry))
    real = shutil.which("ptxas", path=search_path)
    if real is None or shutil.which("sha256sum") is None:
        return None
    try:
        wrapper = _write_wrapper(Path(real).absolute())  # XLA may run it from another directory
    except OSError as err:
        warnings.warn(f"nsa_dsl: ptxas outputs are not cached on disk ({err})", CacheWarning, stacklevel=2)
        return None
    os.environ["PATH"] = os.pathsep.join((str(wrapper.parent), search_path))
    return wrapper


def _write_wrapper(real: Path) -> Path:
    body = Path(__file__).with_name("ptxas_shim.sh").read_text()
    stat = real.stat()
    identity = hashlib.sha256(json.dumps([str(real), stat.st_size, stat.st_mtime_ns, body]).encode()).hexdigest()[:16]
    home = cache_root() / "ptxas" / identity
    text = "\n".join(
        ("#!/bin/sh", _MARKER, f"real={shlex.quote(str(real))}", f"store={shlex.quote(str(home / 'binaries'))}", body)
    )
    wrapper = home / "bin" / "ptxas"
    if not (wrapper.is_file() and os.access(wrapper, os.X_OK) and wrapper.read_text() == text):
        wrapper.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(wrapper, text.encode(), mode=0o755)
    return wrapper


def _is_wrapper_dir(entry: str) -> bool:
    try:
        with open(os.path.join(entry, "ptxas"), encoding="utf-8", errors="replace") as f:
            return f.readline() == "#!/bin/sh\n" and f.readline() == _MARKER + "\n"
    except OSError:
        return False
