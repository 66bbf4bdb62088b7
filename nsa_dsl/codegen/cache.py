"""The on-disk cache of generated modules.

An entry is `<root>/<backend>/<key[:2]>/<key>.py` plus a sidecar `<key>.json` recording the
module's sha256. The key covers everything the generated text depends on: the plan, the config,
the backend's template text and the versions of nsa_dsl and of the libraries the code runs on,
so a stale entry is never looked up rather than invalidated.

Several processes may compile the same pattern at once, and a process may die mid-write:
files are written to a temporary file in the same directory and moved into place with
`os.replace` (atomic), the sidecar after the module. Rendering is deterministic, so racing
writers write identical bytes and any interleaving leaves one valid entry. An entry whose
sidecar is missing, unreadable or disagrees with the module is regenerated, never trusted.
A cache that cannot take an entry (read-only, shared, a path taken by something else) costs the
entry, not the call: a CacheWarning, and the module runs from the text rendered in memory.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import linecache
import os
import re
import secrets
import sys
import threading
import types
import warnings
from pathlib import Path

from .._version import __version__
from ..config import NativeSparseAttentionConfig
from ..plan.plan import Plan
from .render import Code, UnsafeTemplateValue, plan_literal, render, template_texts

_LIBRARIES = ("jax", "jaxlib", "triton")


class CacheWarning(UserWarning):
    """An on-disk cache entry could not be written: the work goes on from memory, and a later
    process does it again."""


def cache_root() -> Path:
    """`$NSA_DSL_CACHE_DIR` (a leading ~ is the home, as a shell would have it), default
    `~/.cache/nsa_dsl`; read at every call so it can be redirected."""
    configured = os.environ.get("NSA_DSL_CACHE_DIR")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "nsa_dsl"


def library_version(name: str) -> str:
    # Metadata only: importing triton or jax here would cost seconds and may fail without a GPU.
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "none"


def cache_key(backend: str, plan: Plan, config: NativeSparseAttentionConfig | None = None) -> str:
    parts = {
        "backend": backend,
        "plan": str(plan_literal(plan)),
        "config": repr(config),
        "templates": template_texts(backend),
        "nsa_dsl": __version__,
        **{name: library_version(name) for name in _LIBRARIES},
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def _entry_path(backend: str, key: str) -> Path:
    return cache_root() / backend / key[:2] / f"{key}.py"


def cache_path(backend: str, plan: Plan, config: NativeSparseAttentionConfig | None = None) -> Path:
    """Where the generated module of (backend, plan, config) is cached (it may not exist yet)."""
    return _entry_path(backend, cache_key(backend, plan, config))


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write_atomically(path: Path, data: bytes, mode: int | None = None) -> None:
    """Write `data` to `path` so that readers see the old file or the whole new one, never a part;
    `mode` (permission bits) is set before the file appears under its name, else the process's
    umask decides them, as for any file it creates (tempfile.mkstemp's 0600 kept a cache that
    several users share unreadable to all but its writer, who then wrote every entry again)."""
    tmp = path.parent / f".{path.name}.{secrets.token_hex(8)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _read_valid(module_path: Path) -> str | None:
    """The cached source if the entry is complete and its checksum matches, else None."""
    try:
        data = module_path.read_bytes()
        sidecar = json.loads(module_path.with_suffix(".json").read_text())
        if not isinstance(sidecar, dict) or sidecar.get("sha256") != _sha256(data):
            return None
        return data.decode()
    except (OSError, ValueError):  # missing files, bad JSON or bad UTF-8 (ValueError covers both)
        return None


def holds_entry(module_path: Path) -> bool:
    """Whether `module_path` holds a complete cache entry (its checksum matches), not a damaged
    one that a cache which could not take the replacement left in place."""
    return _read_valid(module_path) is not None


def _version_text() -> Code:
    # Our own constant, not user input, but checked all the same: the render guard admits only
    # identifiers and numbers, and a version like "0.1.0" is neither.
    if not re.fullmatch(r"[0-9]+(\.[0-9A-Za-z]+)*", __version__):
        raise UnsafeTemplateValue(f"refusing to render version {__version__!r} into generated code")
    return Code(__version__)


def _render_module(backend: str, plan: Plan, config: NativeSparseAttentionConfig | None) -> str:
    return render(f"{backend}/module.py.j2", plan=plan, config=config, version=_version_text(), backend=backend)


# Modules rendered where the cache could not take them, by the path they were meant for: the
# process renders (and warns about) each once.
_unwritten: dict[Path, str] = {}


def _ensure_entry(backend: str, key: str, plan: Plan, config: NativeSparseAttentionConfig | None) -> tuple[Path, str]:
    """(path, source) of a valid cache entry under `key`, (re)generating it when needed."""
    path = _entry_path(backend, key)
    cached = _read_valid(path)
    if cached is not None:
        return path, cached
    if path in _unwritten:
        return path, _unwritten[path]
    text = _render_module(backend, plan, config)
    data = text.encode()
    sidecar = {"sha256": _sha256(data), "nsa_dsl": __version__, "backend": backend, "pattern": plan.name}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, data)
        write_atomically(path.with_suffix(".json"), json.dumps(sidecar, indent=1).encode())
    except OSError as err:
        warnings.warn(
            f"nsa_dsl could not write the generated module of pattern {plan.name!r} to its cache ({err}); running it "
            f"from memory. Point NSA_DSL_CACHE_DIR at a writable directory to keep it for later processes.",
            CacheWarning, stacklevel=4,
        )
        _unwritten[path] = text
    return path, text


def source(backend: str, plan: Plan, config: NativeSparseAttentionConfig | None = None) -> str:
    """The generated module text for (backend, plan, config), from the cache or freshly rendered."""
    return _ensure_entry(backend, cache_key(backend, plan, config), plan, config)[1]


_loaded: dict[str, types.ModuleType] = {}
_loading = threading.Lock()


def load_module(backend: str, plan: Plan, config: NativeSparseAttentionConfig | None = None) -> types.ModuleType:
    """Import the generated module for (backend, plan, config); one module object per key per process."""
    key = cache_key(backend, plan, config)
    with _loading:
        if key in _loaded:
            return _loaded[key]
        path, text = _ensure_entry(backend, key, plan, config)
        name = f"nsa_dsl_generated_{backend}_{key[:16]}"
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None  # a .py path always yields a spec
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses and pickling look their module up here
        # Run the text that was just verified (or rendered, where the cache could not take it), not
        # whatever the file holds a moment later; linecache serves the same text to tracebacks and
        # to Triton's JIT, which reads its kernels' source through inspect.
        linecache.cache[str(path)] = (len(text), None, text.splitlines(keepends=True), str(path))
        try:
            exec(compile(text, str(path), "exec"), module.__dict__)
        except BaseException:
            del sys.modules[name]
            raise
        _loaded[key] = module
        return module
