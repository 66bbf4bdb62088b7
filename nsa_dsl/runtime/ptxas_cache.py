"""Compiled kernel binaries on disk, for jaxlib's Triton kernel calls.

triton_cache keeps each kernel's PTX on disk, but PTX is not what a GPU runs: jaxlib assembles it
with ptxas at the kernel's first launch in every process (jaxlib/gpu/triton_kernels.cc,
GetModuleImage) and keeps the binary in memory only. Measured on the H200 (bench_gpu's cold-start
children, 32k tokens): a second process spent 3.7-4.1 s of its ~5 s of first calls in 32 ptxas
runs, each repeating the previous process's work.

`install` puts a ptxas wrapper (the shell script bin/ptxas, shipped in the package) first on this
process's PATH, which is where XLA looks for ptxas. The wrapper answers a compilation it has seen
before from `$NSA_DSL_CACHE_DIR/ptxas/<id>/binaries`, keyed by the SHA-256 of the PTX and the
options, and passes every other call to the real ptxas unchanged; entries are written atomically
and carry checksums, so a torn or damaged entry is compiled again, never used. `<id>` names the
real ptxas (path, size, modification time) and the wrapper's text, so a different or updated ptxas
never reads another's binaries. The wrapper learns the real ptxas and the store from two variables
install sets; child processes inherit them with PATH, and a process whose cache directory differs
sets its own. The cache directory holds data only, so deleting it under a running process costs
that process its stored binaries, never its ptxas. `NSA_DSL_PTXAS_CACHE=0` leaves PATH alone.

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
import shutil
import warnings
from pathlib import Path

from ..codegen.cache import CacheWarning, cache_root

# The wrapper's first line after the interpreter: how `install` recognises wrappers already on PATH.
_MARKER = "# nsa_dsl ptxas cache"
WRAPPER = Path(__file__).with_name("bin") / "ptxas"
# What the wrapper reads: the ptxas it stands in for, and its store of binaries.
REAL_VARIABLE, STORE_VARIABLE = "NSA_DSL_PTXAS_REAL", "NSA_DSL_PTXAS_STORE"


@functools.lru_cache(maxsize=1)
def install() -> Path | None:
    """Put the caching ptxas first on PATH (once per process); returns its path, or None where it
    is switched off or cannot serve (no ptxas on PATH, no sha256sum, a wrapper installed without
    its executable bit)."""
    if os.environ.get("NSA_DSL_PTXAS_CACHE") == "0":
        return None
    entries = os.environ.get("PATH", "").split(os.pathsep)
    search_path = os.pathsep.join(entry for entry in entries if not _is_wrapper_dir(entry))
    real = shutil.which("ptxas", path=search_path)
    if real is None or shutil.which("sha256sum") is None:
        return None
    if not os.access(WRAPPER, os.X_OK):
        warnings.warn(f"nsa_dsl: ptxas outputs are not cached on disk ({WRAPPER} is not executable)", CacheWarning,
                      stacklevel=2)
        return None
    real = Path(real).absolute()  # XLA may run the wrapper from another directory
    os.environ[REAL_VARIABLE] = str(real)
    os.environ[STORE_VARIABLE] = str(_store(real))
    os.environ["PATH"] = os.pathsep.join((str(WRAPPER.parent), search_path))
    return WRAPPER


def _store(real: Path) -> Path:
    stat = real.stat()
    identity = json.dumps([str(real), stat.st_size, stat.st_mtime_ns, WRAPPER.read_text()])
    return cache_root() / "ptxas" / hashlib.sha256(identity.encode()).hexdigest()[:16] / "binaries"


def _is_wrapper_dir(entry: str) -> bool:
    try:
        with open(os.path.join(entry, "ptxas"), encoding="utf-8", errors="replace") as f:
            return f.readline() == "#!/bin/sh\n" and f.readline() == _MARKER + "\n"
    except OSError:
        return False
