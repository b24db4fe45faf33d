#!/bin/sh
# Issue 15's validation on the GPU machine in one device call (bench/RESULTS-gpu.md), after
# `make gpu-wheels` here and with `.whl` carried:
#   sh bench/gpu_session.sh [SECONDS] [PARTS]
# SECONDS (default 420) is the whole call's budget: pass the call's timeout_s less a minute.
# Each part runs under what is left of it, bench at most 240 s and parity 150 s (SIGINT at
# its end, so pytest still reports what failed so far); a part left with under a minute is
# skipped. PARTS, comma-separated, run in the order given (default bench,parity,tests):
#   bench   bench/gpu_throughput.py --core: the done-when's figures and a verdict on each
#   parity  the CUDA parity tests and the chunked-prefill one that once flaked, 5 times
#   tests   tests/inference_engine once, the GPU path's files first (the engines there run on
#           CUDA: device "auto"), then the compiled CPU kernels' files in a process of their
#           own (a crash there leaves its backtrace in segv.log), then the others (those no
#           GPU has run yet first), and the benchmark's smoke test last
#   rest    bench/gpu_throughput.py --rest: the benchmark's rows that --core leaves out
# A session has 15 minutes of device time, starts included: the default call leaves enough to
# start a second machine for a rerun after a fix, or for `rest`. Logs go to $OUT, which the
# device tool brings back.
set -u
BUDGET=${1:-420}
PARTS=${2:-bench,parity,tests}
START=$(date +%s)
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH="/tmp/site:$PWD/platform:$PWD" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1

# seconds a part may run: what is left of the budget, at most $1
allowance() {
    left=$((START + BUDGET - $(date +%s) - 5))
    if [ "$left" -gt "$1" ]; then echo "$1"; else echo "$left"; fi
}

for part in $(echo "$PARTS" | tr ',' ' '); do
    # the most each part may take, so that one slower than planned leaves the others time
    case "$part" in
    bench) most=240 ;;
    parity) most=150 ;;
    *) most=600 ;;
    esac
    limit=$(allowance "$most")
    if [ "$limit" -lt 60 ]; then
        echo "== $part: skipped, ${limit}s left of the budget" | tee -a "$OUT/skipped.log"
        continue
    fi
    echo "== $part (up to ${limit}s)"
    case "$part" in
    bench | rest)
        rows=--core
        [ "$part" = rest ] && rows=--rest
        timeout -s INT -k 10 "$limit" python3 bench/gpu_throughput.py "$rows" \
            --out "$OUT/gpu.jsonl" 2>&1 | tee -a "$OUT/bench.log"
        ;;
    parity)
        # one process runs them 5 times (pytest keeps the repeated ids), each a fresh engine
        cases=""
        for _ in 1 2 3 4 5; do cases="$cases tests/inference_engine/test_parity.py"; done
        # shellcheck disable=SC2086
        timeout -s INT -k 10 "$limit" python3 -m pytest $cases --keep-duplicates -q \
            -p no:cacheprovider -k "cuda or chunked_prefill" -rfE 2>&1 | tee "$OUT/parity.log"
        ;;
    tests)
        # the files that take the GPU's own paths first, so a budget that ends early has run
        # them; then the compiled CPU kernels' files in a process of their own (their error
        # path once crashed the whole run there: bench/RESULTS-gpu.md, session 26), with a
        # backtrace of any crash in segv.log; then the rest, under what is left
        gpu_files="test_triton_attention.py test_gpu_step.py test_async_scheduling.py
            test_parity.py"
        compiled_files="test_attention.py test_cpu_kernels.py test_cpu_linear.py"
        first="" compiled=""
        for file in $gpu_files; do
            first="$first tests/inference_engine/$file"
        done
        for file in $compiled_files; do
            compiled="$compiled tests/inference_engine/$file"
        done
        # the benchmark's smoke test last: on a GPU it runs every row of the script, which
        # the bench part has already run for real
        smoke=tests/inference_engine/test_gpu_bench_smoke.py
        # the rest in this order: the files no GPU has run yet (or whose GPU run a budget cut
        # short, or that were fixed after it) first, then every other file
        unrun="test_prompt_logprobs.py test_compile_queue.py test_server_grammar_compiles.py
            test_server_intake.py test_server.py test_server_output_processor.py
            test_structured_outputs.py test_tokenization.py test_tokenizer_limit.py
            test_llm.py test_mid_step_admission.py"
        rest=""
        for file in $unrun; do
            rest="$rest tests/inference_engine/$file"
        done
        for path in tests/inference_engine/test_*.py; do
            case " $first $compiled $rest $smoke " in
            *" $path "*) ;;
            *) rest="$rest $path" ;;
            esac
        done
        # shellcheck disable=SC2086
        timeout -s INT -k 30 "$limit" python3 -m pytest $first -q -p no:cacheprovider -rfE \
            --maxfail=25 --durations=10 --continue-on-collection-errors 2>&1 |
            tee "$OUT/tests.log"
        # the compiled kernels' files (seconds) before the rest, which may run out of time
        limit=$(allowance 240)
        if [ "$limit" -ge 30 ]; then
            # shellcheck disable=SC2086
            timeout -s INT -k 30 "$limit" python3 -m pytest $compiled -q -p no:cacheprovider \
                -rfE --maxfail=25 > "$OUT/compiled.log" 2>&1
            code=$?
            tee -a "$OUT/tests.log" < "$OUT/compiled.log"
            debugger=$(command -v cuda-gdb || command -v gdb)
            limit=$(allowance 150)
            # killed by a signal (timeout's own kill is 137, its time running out 124)
            if [ "$code" -ge 128 ] && [ "$code" -ne 137 ] && [ -n "$debugger" ] &&
                [ "$limit" -ge 30 ]; then
                # shellcheck disable=SC2086
                timeout -k 10 "$limit" "$debugger" -batch -ex run -ex "bt 40" --args python3 \
                    -m pytest $compiled -q -p no:cacheprovider > "$OUT/segv.log" 2>&1
            fi
        else
            echo "== the compiled kernels' tests: skipped, ${limit}s left" |
                tee -a "$OUT/tests.log"
        fi
        limit=$(allowance 600)
        if [ "$limit" -ge 30 ]; then
            # shellcheck disable=SC2086
            timeout -s INT -k 30 "$limit" python3 -m pytest $rest -q -p no:cacheprovider \
                -rfE --maxfail=25 --durations=10 --continue-on-collection-errors 2>&1 |
                tee -a "$OUT/tests.log"
        else
            echo "== the other engine tests: skipped, ${limit}s left" | tee -a "$OUT/tests.log"
        fi
        limit=$(allowance 600)
        if [ "$limit" -ge 60 ]; then
            timeout -s INT -k 30 "$limit" python3 -m pytest "$smoke" -q -p no:cacheprovider \
                -rfE 2>&1 | tee -a "$OUT/tests.log"
        else
            echo "== $smoke: skipped, ${limit}s left" | tee -a "$OUT/tests.log"
        fi
        ;;
    *)
        echo "no such part: $part (bench, parity, tests, rest)" >&2
        exit 2
        ;;
    esac
done
echo "== done in $(($(date +%s) - START))s of ${BUDGET}s"
