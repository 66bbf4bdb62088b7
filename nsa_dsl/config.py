"""Execution settings of a kernel, kept apart from the pattern's meaning."""

from __future__ import annotations

import numbers
from dataclasses import dataclass, fields

from .dsl.model import MAX_TOKENS

PLATFORMS = ("xla", "triton", "pallas")
BACKENDS = ("gpu", "tpu", "cpu")
_TILES = ("block_q", "block_k", "block_d", "num_warps", "num_stages", "chunk_bytes")


@dataclass(frozen=True)
class NativeSparseAttentionConfig:
    """Settings for `native_sparse_attention` and compiled patterns.

    `block_size` is the key-block size of explicit `block_indices` (as in ejkernel) and part
    of the result's meaning; autotuning never changes it. It is native_sparse_attention's: a
    compiled pattern's blocks are its `block` statement's. Everything else only changes speed,
    and None leaves a setting to the kernel's built-in (measured) default:

    - `block_k`: keys per step of Triton's per-token loops (several selected blocks at once)
      and of its static-pattern kernels; `block_q`: query tile rows of Triton's static-pattern
      kernels and of Pallas' query-tile kernels; both powers of two. `block_d`: ejkernel's head-dimension tile, accepted so that its
      configurations run unchanged; no kernel here reads it (each keeps the whole head dimension
      in one tile).
    - `num_warps` (a power of two) and `num_stages`: Triton's launch settings, also used by
      Pallas' Triton lowering.
    - `chunk_bytes`: working set of one chunk of the XLA engine (16 MiB by default).
    - `platform`: "xla", "triton", "pallas", or None/"auto" for the most specialised one that
      runs here; `backend`: the device kind kernels are generated for, "gpu", "tpu", "cpu",
      or None/"any" for the one jax runs on.

    A platform ignores the settings its kernels do not read (nsa_dsl.kernel.settings_read).
    """

    block_size: int = 64
    block_q: int | None = None
    block_k: int | None = None
    block_d: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    platform: str | None = None
    backend: str | None = None
    chunk_bytes: int | None = None

    def __post_init__(self) -> None:
        for name in ("block_size", *_TILES):  # numpy's integers (sizes computed with numpy) as Python ints
            value = getattr(self, name)
            if isinstance(value, numbers.Integral) and not isinstance(value, bool | int):
                object.__setattr__(self, name, int(value))
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or not 1 <= self.block_size <= MAX_TOKENS:
            # A block no longer than the longest sequence the kernels run, as the .nsa language's.
            raise ValueError(f"cfg.block_size must be a positive int up to 2**29, got {self.block_size!r}")
        for name in _TILES:
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"cfg.{name} must be a positive int or None, got {value!r}")
        for name in ("block_q", "block_k", "num_warps"):
            value = getattr(self, name)
            if value is not None and value & (value - 1):
                raise ValueError(f"cfg.{name} must be a power of two (a tile extent of the kernels), got {value}")
        if self.platform is not None and self.platform not in PLATFORMS + ("auto",):
            raise ValueError(f"cfg.platform must be one of {PLATFORMS + ('auto',)} or None, got {self.platform!r}")
        if self.backend == "any":  # ejkernel's spelling of "wherever jax runs"
            object.__setattr__(self, "backend", None)
        if self.backend is not None and self.backend not in BACKENDS:
            raise ValueError(f"cfg.backend must be 'gpu', 'tpu', 'cpu', 'any' or None, got {self.backend!r}")

    @classmethod
    def of(cls, value: object, what: str, others: str) -> NativeSparseAttentionConfig:
        """`value` as a configuration: itself, or another library's configuration object with the
        same settings by name (ejkernel's NativeSparseAttentionConfig: its configurations run
        unchanged), setting by setting; a setting it lacks keeps its default. Anything else is a
        ValueError naming the argument (`what`) and the other values it takes (`others`)."""
        if isinstance(value, cls):
            return value
        if not hasattr(value, "block_size") or isinstance(value, type):
            raise ValueError(f"{what} must be a NativeSparseAttentionConfig (nsa_dsl's or ejkernel's), {others}, "
                             f"got {type(value).__name__}")
        settings = {f.name: getattr(value, f.name) for f in fields(cls) if hasattr(value, f.name)}
        return cls(**settings)
