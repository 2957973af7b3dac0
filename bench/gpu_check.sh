#!/usr/bin/env bash
# Everything a kernel change needs on a GPU host, in one go and in this order: the GPU test suite
# (stops here if it fails), the benchmark with the read-floor sweep (extra arguments go to it, e.g.
# --specs kv_copy=cp_async --iters 100), the per-phase timeline and the ablations. Logs, the JSON
# result and a BENCHMARKS.md section land in OUTDIR. GPU_CHECK_STEPS picks steps (default all:
# tests,bench,timeline,ablate), e.g. to fit each call of a time-limited GPU host.
#
#   [PYTHON=python3] [GPU_CHECK_STEPS=tests,bench] bench/gpu_check.sh OUTDIR [benchmark arguments...]
set -u
py=${PYTHON:-python3}
out=${1:?usage: bench/gpu_check.sh OUTDIR [benchmark arguments...]}
shift
mkdir -p "$out"
commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
steps=",${GPU_CHECK_STEPS:-tests,bench,timeline,ablate},"
wants() { [[ $steps == *",$1,"* ]]; }
for step in ${steps//,/ }; do
    case $step in tests|bench|timeline|ablate) ;; *) echo "GPU_CHECK_STEPS: unknown step '$step' (tests, bench, timeline, ablate)" >&2; exit 2 ;; esac
done

if wants tests; then
echo "GPU tests -> $out/tests.log"
# One process per core where pytest-xdist is there (the `test` extra): most of the suite is compiling.
parallel=()
"$py" -c "import xdist" 2>/dev/null && parallel=(-n auto --dist worksteal)
if ! SPLITKV_REQUIRE_GPU=1 "$py" -m pytest -q -m gpu ${parallel[@]+"${parallel[@]}"} tests/gpu -p no:cacheprovider > "$out/tests.log" 2>&1; then
    grep -E "^FAILED|^ERROR|passed|failed" "$out/tests.log" | tail -20
    exit 1
fi
tail -1 "$out/tests.log"
fi

if wants bench; then
echo "benchmark -> $out/bench.log"
"$py" -m splitkv.bench --floor-sweep --commit "$commit" --out "$out" --markdown "$out/bench.md" "$@" \
    > "$out/bench.log" 2>&1 || { tail -20 "$out/bench.log"; exit 1; }
grep -A 20 "^shape" "$out/bench.log"
fi

if wants timeline; then
echo "timeline -> $out/timeline.log"
"$py" bench/timeline.py --placement 2 > "$out/timeline.log" 2>&1 && cat "$out/timeline.log"
fi

if wants ablate; then
echo "ablations -> $out/ablate.log"
"$py" bench/ablate.py > "$out/ablate.log" 2>&1 && cat "$out/ablate.log"
fi
