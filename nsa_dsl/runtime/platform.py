"""Where kernels run: which platforms have a code generator and can run on this machine.

A platform is usable when its templates exist (templates/<platform>/module.py.j2), the
device jax runs on supports it (XLA runs everywhere, Triton needs a GPU, Pallas a GPU or TPU)
and the packages its modules import are installed (Triton's come with the `gpu` extra).
`None`/"auto" picks the most specialised usable one.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import replace

import jax

from ..config import PLATFORMS, NativeSparseAttentionConfig
from ..resources import templates_dir

_DEVICES = {"xla": ("cpu", "gpu", "tpu"), "triton": ("gpu",), "pallas": ("gpu", "tpu")}


class PlatformLimitError(NotImplementedError):
    """A platform's kernels cannot run these shapes (raised while tracing, before anything runs);
    XLA can. A platform chosen automatically gives way to XLA (runtime.dispatch)."""
# Devices where a platform's kernels run in an interpreter (slow; for tests): used when asked
# for by name, never picked automatically.
_INTERPRETED = {"triton": ("cpu",), "pallas": ("cpu",)}
_PREFERENCE = ("triton", "pallas", "xla")


def has_generator(platform: str) -> bool:
    return (templates_dir() / platform / "module.py.j2").is_file()


def missing_packages(platform: str, device: str) -> list[str]:
    """The packages `platform`'s generated modules import on `device` that are not installed: a
    plain `pip install nsa_dsl` has neither triton nor jax-triton (a GPU launches Triton kernels
    through jax-triton; a CPU runs them in triton's interpreter)."""
    needed = {"triton": ("triton", "jax_triton") if device == "gpu" else ("triton",)}.get(platform, ())
    return [name for name in needed if importlib.util.find_spec(name) is None]


def device_kind(config: NativeSparseAttentionConfig | None = None) -> str:
    """"cpu", "gpu" or "tpu": the config's `backend` if set, else jax's default backend."""
    if config is not None and config.backend is not None:
        return config.backend
    return jax.default_backend()


def for_device(config: NativeSparseAttentionConfig | None) -> NativeSparseAttentionConfig:
    """`config` with its `backend` filled in: the device kind kernels are generated for (the
    Pallas templates render a GPU or a TPU variant from it)."""
    config = config or NativeSparseAttentionConfig()
    return config if config.backend is not None else replace(config, backend=device_kind(config))


def available_platforms(config: NativeSparseAttentionConfig | None = None) -> tuple[str, ...]:
    """The usable platforms, most specialised first."""
    device = device_kind(config)
    return tuple(
        p for p in _PREFERENCE if device in _DEVICES[p] and has_generator(p) and not missing_packages(p, device)
    )


def resolve_platform(
    requested: str | None,
    config: NativeSparseAttentionConfig | None = None,
    runs: Callable[[str], bool] = lambda platform: True,
) -> str:
    """The platform to run on: `requested`, else the config's, else the most specialised
    available one that `runs` the work (a plan whose branches it has kernels for)."""
    if requested is None and config is not None:
        requested = config.platform
    usable = available_platforms(config)
    if requested is None or requested == "auto":
        return next((p for p in usable if runs(p)), usable[-1])
    if requested not in PLATFORMS:
        raise ValueError(f"platform must be one of {', '.join(PLATFORMS)}, 'auto' or None, got {requested!r}")
    device = device_kind(config)
    missing = missing_packages(requested, device)
    interpreted = has_generator(requested) and device in _INTERPRETED.get(requested, ()) and not missing
    if requested not in usable and not interpreted:
        if not has_generator(requested):
            why = "nsa_dsl has no code generator for it yet"
        elif device not in _DEVICES[requested] + _INTERPRETED.get(requested, ()):
            why = f"it needs a {' or '.join(d.upper() for d in _DEVICES[requested])} and jax runs on {device.upper()}"
        else:
            why = f"its modules import {', '.join(missing)}, not installed here (pip install 'nsa_dsl[gpu]' brings them)"
        raise ValueError(f"platform={requested!r} is not available: {why}; available: {', '.join(usable)}")
    return requested
