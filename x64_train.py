"""A float32 training step in a process with jax_enable_x64 on (common in scientific code), and float64 inputs.
python x64_train.py PLATFORM PATTERN"""
import sys
import jax
jax.config.update("jax_enable_x64", True)
from common import *
platform, pattern = sys.argv[1], sys.argv[2]
HQ, HKV, D, T, L, dm, dff = 6, 2, 20, 77, 2, 32, 48
if pattern == "nsa_file":
    mod = nsa_dsl.compile(f"{EX}/nsa.nsa"); names = ("g_cmp", "g_slc", "g_swa")
    attn = lambda q, k, v, **g: mod(q, k, v, platform=platform, **g)
elif pattern == "native_cmp":
    cfg = nsa_dsl.NativeSparseAttentionConfig(block_size=16); names = ("g_cmp", "g_slc")
    attn = lambda q, k, v, g_cmp, g_slc: nsa_dsl.native_sparse_attention(q, k, v, g_cmp, g_slc, None, 2, platform=platform, cfg=cfg)
else:
    mod = nsa_dsl.compile(f"{EX}/longformer.nsa", window=40); names = ()
    attn = lambda q, k, v: mod(q, k, v, platform=platform)
for dt in (jnp.float32, jnp.float64):
    params = init_params(jax.random.key(0), L, dm, HQ, HKV, D, dff, dtype=dt, gates=bool(names), ngates=max(1, len(names)))
    x = jax.random.normal(jax.random.key(1), (2, T, dm), dt)
    f = jax.jit(jax.value_and_grad(lambda p, x, y: model_loss(p, x, y, attn, HQ, HKV, D, act_dtype=dt, remat="plain", gate_names=names), has_aux=True))
    try:
        (loss, aux), g = f(params, x, x)
        print(platform, pattern, "x64 on, dtype", dt.__name__, "loss", float(loss), loss.dtype, "grad dtypes", sorted(set(str(a.dtype) for a in jax.tree.leaves(g))), "out", aux["out"].dtype)
    except Exception as e:
        print(platform, pattern, "x64 on, dtype", dt.__name__, "FAILED", type(e).__name__, str(e).splitlines()[0][:300])
