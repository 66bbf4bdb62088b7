"""Constants of the generated modules set for a measurement or a check (A/B variants, sweeps).

A generated module reads its tile sizes, thresholds and launch settings (LAUNCH) when its
functions are traced, so a variant sets them on every module loaded while it is in force and
clears the traces made under it when it ends.
"""

from __future__ import annotations

import contextlib

import jax

from nsa_dsl import codegen
from nsa_dsl.runtime import dispatch


def parse_variant(text: str) -> dict:
    """'NAME=VALUE,LAUNCH.<kernel>=WARPSxSTAGES,...' -> {NAME: int, "LAUNCH.<kernel>": (warps, stages)}."""
    constants = {}
    for item in filter(None, text.split(",")):
        name, value = item.split("=")
        constants[name] = tuple(int(x) for x in value.split("x")) if name.startswith("LAUNCH.") else int(value)
    return constants


@contextlib.contextmanager
def module_constants(constants: dict):
    """Modules loaded meanwhile (codegen.load_module) have `constants` (parse_variant's) set:
    NAME to its value, LAUNCH.<kernel> as that kernel's (num_warps, num_stages). Restored after,
    with the jitted entry points and JAX's traces cleared before and after, so that nothing traced
    under one set of constants runs under another."""
    load = codegen.load_module
    replaced = {}

    def loading(platform, plan, config=None):
        module = load(platform, plan, config)
        for name, value in constants.items():
            attribute, _, kernel = name.partition(".")
            replaced.setdefault((id(module), attribute), (module, getattr(module, attribute)))
            setattr(module, attribute, {**getattr(module, attribute), kernel: value} if kernel else value)
        return module

    codegen.load_module = loading
    dispatch.kernel.cache_clear()
    jax.clear_caches()
    try:
        yield
    finally:
        codegen.load_module = load
        for (_, attribute), (module, value) in replaced.items():
            setattr(module, attribute, value)
        dispatch.kernel.cache_clear()
        jax.clear_caches()
