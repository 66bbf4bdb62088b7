#!/usr/bin/env bash
# The test suite compiled on the GPU machine, in three parts that each fit one device call (10 min):
#
#   bash benchmarks/gpu_tests.sh rest|selection|static|FILE... [-- pytest arguments]
#
# Run from the repository root on the device (the `run` tool, carry [".whl"]; wheels from
# ../shared/tools/device-wheels.sh). "selection": the Triton selection and NSA files and the pattern
# fuzz (each of its examples compiles kernels for new shapes); "static": the Triton static and
# context-parallel files, the Pallas GPU files and the packed-sequence isolation test; "rest": every
# other file, test_wheel only where .whl/build holds the tools it builds the wheel with (the image has
# no `build` or hatchling; benchmarks/README.md says how to fetch them). On an H100 with 8 workers
# (sessions 78-80) the parts took about 450, 270 and 450 s. pytest-xdist runs 8 workers and -v, so
# that a log cut at the call's limit still says what ran; the log lands in $OUT/gpu_tests.log.
# GPU_TESTS_S bounds pytest (default 540).
set -u
selection=(tests/test_triton_selection.py tests/test_triton_nsa.py tests/test_pattern_fuzz.py)
static=(tests/test_triton_static.py tests/test_triton_context_parallel.py tests/test_pallas_static.py
        tests/test_pallas_selection.py tests/test_pallas_nsa.py tests/test_sequence_isolation.py)
files=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do
    case $1 in
        rest)
            for f in tests/test_*.py; do
                [[ " ${selection[*]} ${static[*]} " == *" $f "* ]] && continue
                [[ $f == tests/test_wheel.py && ! -d .whl/build ]] && continue
                files+=("$f")
            done ;;
        selection) files+=("${selection[@]}") ;;
        static) files+=("${static[@]}") ;;
        *) files+=("$1") ;;
    esac
    shift
done
[ $# -gt 0 ] && shift
if [ ${#files[@]} -eq 0 ]; then
    echo "usage: bash benchmarks/gpu_tests.sh rest|selection|static|FILE... [-- pytest arguments]" >&2
    exit 2
fi
out=${OUT:-/tmp/gpu_tests_out}
mkdir -p "$out"
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader | tee "$out/gpu.txt"
[ -d /tmp/site ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 NSA_DSL_AUTOTUNE=0 PYTHONPATH=/tmp/site:$PWD
# test_wheel's build tools in a folder of their own, after the checkout: only `python -m build` needs them.
if [ -d .whl/build ]; then
    [ -d /tmp/buildsite ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --target /tmp/buildsite .whl/build/*.whl
    PYTHONPATH=$PYTHONPATH:/tmp/buildsite
fi
set -o pipefail
timeout -k 5 "${GPU_TESTS_S:-540}" python3 -m pytest -n 8 -v -p no:cacheprovider "${files[@]}" "$@" 2>&1 |
    tee "$out/gpu_tests.log" | grep -E "FAILED|ERROR|passed|failed" | tail -60
