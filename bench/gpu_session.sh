#!/bin/sh
# One GPU-machine call of issue 15's validation (bench/RESULTS-gpu.md), after `make gpu-wheels`
# here and with `.whl` carried:
#   sh bench/gpu_session.sh tests   # the engine's tests once, then the CUDA parity tests 4x more
#   sh bench/gpu_session.sh bench   # bench/gpu_throughput.py, every row
# Logs go to $OUT (the device tool brings them back). Each part stays inside the 10-minute call.
set -u
case "${1:-}" in
tests | bench) ;;
*)
    echo "usage: sh bench/gpu_session.sh tests|bench [extra gpu_throughput.py arguments]" >&2
    exit 2
    ;;
esac
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH="/tmp/site:$PWD/platform:$PWD" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
case "$1" in
tests)
    # SIGINT at the limit: pytest still prints what failed so far (a kill prints nothing)
    timeout -s INT -k 30 300 python3 -m pytest tests/inference_engine -q -p no:cacheprovider \
        -rfE --durations=15 2>&1 | tee "$OUT/tests.log"
    for i in 2 3 4 5; do
        echo "== parity run $i"
        timeout -s INT -k 10 65 python3 -m pytest tests/inference_engine/test_parity.py -q \
            -p no:cacheprovider -k "cuda or chunked_prefill" 2>&1 | tail -5
    done | tee "$OUT/parity.log"
    ;;
bench)
    timeout -s INT -k 10 570 python3 bench/gpu_throughput.py --out "$OUT/gpu.jsonl" ${2:-} 2>&1 \
        | tee "$OUT/bench.log"
    ;;
esac
