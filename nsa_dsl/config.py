"""Execution settings of a kernel, kept apart from the pattern's meaning."""

from __future__ import annotations

from dataclasses import dataclass

PLATFORMS = ("xla", "triton", "pallas")


@dataclass(frozen=True)
class NativeSparseAttentionConfig:
    """Settings for `native_sparse_attention` and compiled patterns.

    `block_size` is the key-block size of explicit `block_indices` (as in ejkernel) and part
    of the result's meaning; everything else only changes speed: tile sizes (`block_q`,
    `block_k`, `block_d`), Triton's `num_warps`/`num_stages`, and where it runs (`platform`:
    "xla", "triton", "pallas" or None for automatic; `backend`: "gpu", "tpu", "cpu" or None).
    None leaves a setting to the backend's heuristic.
    """

    block_size: int = 64
    block_q: int | None = None
    block_k: int | None = None
    block_d: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    platform: str | None = None
    backend: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"cfg.block_size must be a positive int, got {self.block_size!r}")
        for name in ("block_q", "block_k", "block_d", "num_warps", "num_stages"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"cfg.{name} must be a positive int or None, got {value!r}")
        if self.platform is not None and self.platform not in PLATFORMS + ("auto",):
            raise ValueError(f"cfg.platform must be one of {PLATFORMS + ('auto',)} or None, got {self.platform!r}")
        if self.backend is not None and self.backend not in ("gpu", "tpu", "cpu"):
            raise ValueError(f"cfg.backend must be 'gpu', 'tpu', 'cpu' or None, got {self.backend!r}")
