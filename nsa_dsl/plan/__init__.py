"""Lowering patterns to plans and block tables (numpy only, no jax)."""

from .lower import lower, lower_keys
from .oracle import token_mask
from .plan import Plan
from .tables import BlockTable, build_block_table

__all__ = ["BlockTable", "Plan", "build_block_table", "lower", "lower_keys", "token_mask"]
