#!/usr/bin/env bash
# A kernel patch against the tree it applies to, on the GPU machine, in one device call: the
# patched tree's Hopper (Mosaic GPU) forward tests, ptxas's report on its kernels (spills and
# serialised wgmma), and bench_gpu on both trees, each bench after the other in the same call so
# that their ratio is measured on one machine (calls differ by ~0.3 ms at the 64k NSA forward).
#
#   bash benchmarks/ab_patch_gpu.sh PATCH [bench_gpu.py arguments]
#
# Run from the repository root on the device (the `run` tool, carry [".whl", ...]); PATCH is a
# `git diff` of this tree, such as benchmarks/results/*.patch. Without bench arguments it times the
# full NSA forward at 64k (`--cases nsa --impls ours-triton --lengths 65536`). Everything lands in
# $OUT: ab_ptxas.txt, ab_pytest.log, ab_bench_{base,patched}.log. The patched tree's tests run
# first, under a timeout: a kernel that hangs (a missed barrier) ends there, and its benches are
# skipped. Environment: AB_TEST_S (default 240), AB_BENCH_S (150), AB_TESTS (a pytest -k
# expression, default the Hopper compression and joined forward tests of tests/test_triton_nsa.py).
set -u
if [ $# -lt 1 ] || [ ! -f "$1" ]; then
    echo "usage: bash benchmarks/ab_patch_gpu.sh PATCH [bench_gpu.py arguments]   (PATCH: a git diff of this tree)" >&2
    exit 2
fi
patch=$(realpath "$1")
shift
bench_args=("$@")
[ ${#bench_args[@]} -gt 0 ] || bench_args=(--cases nsa --impls ours-triton --lengths 65536)
out=${OUT:-$PWD/ab_out}
mkdir -p "$out"
base=$PWD
patched=/tmp/ab_patched

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 NSA_DSL_AUTOTUNE=0

rm -rf "$patched" && mkdir -p "$patched"
tar --exclude=./scratch --exclude=./.whl --exclude=./.git -cf - . | tar -x -C "$patched"
(cd "$patched" && patch -p1 --quiet < "$patch") || { echo "the patch does not apply"; exit 2; }

# The default fits AB_TEST_S: with the NSA forward + gradients tests (in_one_hopper_forward) added,
# 12 tests took more than 240 s to compile and run (session 51).
tests=${AB_TESTS:-"(hopper_compression_forward or window_and_compression_forward) and not lowers"}
(cd "$patched" && PYTHONPATH=/tmp/site:$patched timeout -k 5 "${AB_TEST_S:-240}" \
    python3 -m pytest -q -x -p no:cacheprovider tests/test_triton_nsa.py -k "$tests" > "$out/ab_pytest.log" 2>&1)
tests_rc=$?
echo "patched tree's tests: exit $tests_rc ($(tail -n 1 "$out/ab_pytest.log"))"

bench() {  # bench TREE NAME [environment...]: bench_gpu on TREE into $out/ab_bench_NAME.log
    local tree=$1 name=$2
    shift 2
    (cd "$tree" && env "$@" PYTHONPATH=/tmp/site:$tree timeout -k 5 "${AB_BENCH_S:-150}" \
        python3 benchmarks/bench_gpu.py "${bench_args[@]}" --budget-s $(( ${AB_BENCH_S:-150} - 60 )) --grace-s 20 \
        --out "/tmp/ab_bench_$name" > "$out/ab_bench_$name.log" 2>&1)
}

if [ $tests_rc -eq 0 ]; then
    # Fresh caches: a cached kernel is not compiled again, and ptxas then reports nothing.
    bench "$patched" patched NSA_DSL_CACHE_DIR=/tmp/ab_cache NSA_DSL_JAX_CACHE=0 MOSAIC_GPU_DUMP_PTXAS=1
    grep -E 'C75[0-9][0-9]|spill' "$out/ab_bench_patched.log" | sort | uniq -c > "$out/ab_ptxas.txt"
    echo "ptxas on the patched kernels:"; cat "$out/ab_ptxas.txt"
fi
bench "$base" base
for name in base patched; do
    [ -f "$out/ab_bench_$name.log" ] && { echo "== $name"; grep -E "^nsa_dsl|MISSED|met " "$out/ab_bench_$name.log"; }
done
exit 0
