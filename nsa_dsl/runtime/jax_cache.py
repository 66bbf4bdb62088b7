"""Damaged entries of JAX's persistent compilation cache under `$NSA_DSL_CACHE_DIR/jax`.

JAX writes a cache entry in place (`<key>-cache`, compressed), not atomically: a process killed
while writing one leaves it truncated. JAX then warns ("Error reading persistent compilation
cache entry") and compiles again in every later process, and never rewrites the entry, since it
does not write over a key that exists. So the directory nsa_dsl gives JAX is checked when a
process turns the cache on (dispatch.use_compilation_cache): an entry that does not decompress is
removed with a CacheWarning, and the next compilation writes it again. Only entries written
since the last check are read (a marker file records how far it got), and only once they are
`SETTLED_S` old: a younger one may be another process's write in progress.
"""

from __future__ import annotations

import os
import time
import warnings
from pathlib import Path

from ..codegen.cache import CacheWarning

# An entry younger than this may be one that another process is still writing.
SETTLED_S = 60.0
# Its modification time: the newest entry's that a check has read (entries at or before it are not read again).
MARKER = ".nsa_dsl_checked"
_ENTRY_SUFFIX = "-cache"  # JAX's file cache (jax._src.lru_cache): `<key>-cache`, beside `<key>-atime`


def discard_damaged(directory: Path, now: float | None = None) -> list[Path]:
    """Remove the entries of JAX's file cache in `directory` that were written since the last
    check, are SETTLED_S old at `now` (default: the time) and do not decompress; returns them.
    A directory this process cannot write is left alone (it could not remove an entry, nor record
    the check, so it would decompress every entry in every process). Without JAX's decompression
    (an API this was written against, jax 0.10-0.11) nothing is checked."""
    try:
        from jax._src.compilation_cache import decompress_executable
    except ImportError:
        return []
    if not os.access(directory, os.W_OK):  # no cache yet, or one this process could not repair
        return []
    now = time.time() if now is None else now
    marker = directory / MARKER
    try:
        entries = list(os.scandir(directory))
        checked_ns = marker.stat().st_mtime_ns if marker.exists() else 0
    except OSError:  # a cache this process cannot read: JAX's own reads decide
        return []
    settled_ns = int((now - SETTLED_S) * 1e9)
    newest_ns, removed = checked_ns, []
    for entry in entries:
        if not entry.name.endswith(_ENTRY_SUFFIX):
            continue
        try:
            written_ns = entry.stat().st_mtime_ns
            if written_ns <= checked_ns or written_ns > settled_ns:
                continue
            data = Path(entry.path).read_bytes()
        except OSError:  # removed meanwhile, or unreadable: JAX's own read decides
            continue
        try:
            decompress_executable(data)
        except Exception as err:  # noqa: BLE001 - zstd's and zlib's errors alike: the entry is damaged
            try:
                os.unlink(entry.path)
            except FileNotFoundError:  # another process removed it first
                pass
            except OSError:  # an entry this process cannot remove: JAX warns as it reads it
                continue
            removed.append(Path(entry.path))
            warnings.warn(f"nsa_dsl removed a damaged entry of JAX's compilation cache, {entry.path} "
                          f"(it does not decompress: {type(err).__name__}: {err}); it is compiled and written again",
                          CacheWarning, stacklevel=2)
        newest_ns = max(newest_ns, written_ns)
    if newest_ns > checked_ns:
        try:
            marker.touch()
            os.utime(marker, ns=(newest_ns, newest_ns))
        except OSError:  # a cache that cannot be written: checked again next time
            pass
    return removed
