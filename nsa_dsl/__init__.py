"""nsa_dsl: a sparse-attention kernel compiler for JAX.

    import nsa_dsl
    attention = nsa_dsl.compile("examples/longformer.nsa", window=256)
    out = attention(q, k, v)                                   # [B, T, HQ, D]
    out = nsa_dsl.native_sparse_attention(q, k, v, None, g_slc, block_indices)  # ejkernel's API
    kernel = nsa_dsl.NativeSparseAttention()                   # ejkernel's Kernel interface
    cfg = kernel.autotune(kernel.invocation(q, k, v, None, g_slc, block_indices))
"""

from ._version import __version__
from .api import DECODE_COMPILER_OPTIONS, SparseAttention, compile, native_sparse_attention
from .autotune import AutotuneWarning
from .codegen import CacheWarning, UnsafeTemplateValue
from .config import NativeSparseAttentionConfig
from .errors import NsaError, NsaSemanticError, NsaSyntaxError
from .kernel import Invocation, Kernel, NativeSparseAttention
from .runtime.compressed_cache import CompressedCache
from .runtime.derivatives import SecondDerivativeError
from .runtime.platform import PlatformLimitError

__all__ = [
    "AutotuneWarning",
    "CacheWarning",
    "CompressedCache",
    "DECODE_COMPILER_OPTIONS",
    "Invocation",
    "Kernel",
    "NativeSparseAttention",
    "NativeSparseAttentionConfig",
    "NsaError",
    "NsaSemanticError",
    "NsaSyntaxError",
    "PlatformLimitError",
    "SecondDerivativeError",
    "SparseAttention",
    "UnsafeTemplateValue",
    "__version__",
    "compile",
    "native_sparse_attention",
]
