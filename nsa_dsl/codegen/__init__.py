"""Code generation: templates rendered from validated values, cached on disk, imported as modules."""

from .cache import CacheWarning, cache_path, cache_root, load_module, source
from .render import UnsafeTemplateValue, plan_literal, render

__all__ = ["CacheWarning", "UnsafeTemplateValue", "cache_path", "cache_root", "load_module", "plan_literal", "render", "source"]
