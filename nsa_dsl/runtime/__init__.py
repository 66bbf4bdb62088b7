"""The runtime: platform detection, input validation, host tables, dispatch to generated kernels."""

from . import compressed_cache
from .dispatch import (
    attend,
    block_table,
    branch_tables,
    check_supported,
    choose_platform,
    kernel,
    needs_scoring_query,
    selections,
    supports,
)
from .platform import available_platforms, resolve_platform

__all__ = [
    "attend",
    "available_platforms",
    "block_table",
    "branch_tables",
    "check_supported",
    "compressed_cache",
    "choose_platform",
    "kernel",
    "needs_scoring_query",
    "resolve_platform",
    "selections",
    "supports",
]
