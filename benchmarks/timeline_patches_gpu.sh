#!/usr/bin/env bash
# Kernel times under ncu of this tree and of copies patched with each PATCH, in one device call:
# one forward of the 64k NSA pattern each (benchmarks/forward_timeline.py), after a warm run, the
# trees in the order base, patch 1, ..., patch n, base, so that drift between the first and the
# last run of the base shows. A patch moves ~0.02-0.1 ms of a 19.5 ms kernel sum; bench_gpu's rows
# disagree by up to ~0.1 ms within a call, ncu's kernel times by ~0.01 (session 53).
#
#   bash benchmarks/timeline_patches_gpu.sh PATCH [PATCH ...]
#
# Run from the repository root on the device (the `run` tool, carry [".whl"]); each PATCH is a `git
# diff` of this tree. $OUT gets timeline_<name>.txt per run (name: base, or the patch's file name):
# each kernel's time, HBM bytes read and written, and L2 hit rate.
# Three runs took ~25 s each in session 53, after ~10 s of installing the wheels.
set -u
[ $# -ge 1 ] || { echo "usage: bash benchmarks/timeline_patches_gpu.sh PATCH [PATCH ...]" >&2; exit 2; }
out=${OUT:-$PWD/timeline_out}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 NSA_DSL_AUTOTUNE=0

trees=("$PWD")
names=(base)
for patch in "$@"; do
    name=$(basename "$patch" .patch)
    patch_path=$(realpath "$patch")
    tree=/tmp/timeline_$name
    rm -rf "$tree" && mkdir -p "$tree"
    tar --exclude=./scratch --exclude=./.whl --exclude=./.git -cf - . | tar -x -C "$tree"
    (cd "$tree" && patch -p1 --quiet < "$patch_path") || { echo "$patch does not apply"; exit 2; }
    trees+=("$tree")
    names+=("$name")
done
trees+=("$PWD")
names+=(base_again)

for i in "${!trees[@]}"; do
    (cd "${trees[$i]}" && export PYTHONPATH=/tmp/site:${trees[$i]}
     python3 benchmarks/forward_timeline.py 65536 > /dev/null 2>&1  # compile and warm (ncu on a cold run segfaulted)
     timeout -k 5 100 ncu --clock-control none --profile-from-start off --csv --print-units base \
         --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct \
         python3 benchmarks/forward_timeline.py 65536 > "/tmp/timeline_${names[$i]}.csv" 2>&1
     python3 benchmarks/forward_timeline.py --summarise "/tmp/timeline_${names[$i]}.csv" > "$out/timeline_${names[$i]}.txt" 2>&1)
    echo "== ${names[$i]}"
    grep -E "mosaic|topk|selection|merge|Sort|fusion|sum of" "$out/timeline_${names[$i]}.txt" | awk '$1 >= 0.03 || /sum of/'
done
