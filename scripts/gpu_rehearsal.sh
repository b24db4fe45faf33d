#!/bin/sh
# The GPU session's commands rehearsed on this machine's CPU, in an environment like the GPU
# machine's image (Python 3.12, torch 2.11, Triton 3.6, transformers 5.17: see
# /work/.library/device/KINDS.md) with the wheels `make gpu-wheels` fetched: a package, a path or
# an API that differs there is found here, not in a 10-minute GPU call (bench/RESULTS-gpu.md).
# The environment (about 5 GB: torch's CUDA libraries come with it) is built once in
# $REHEARSAL_VENV; the logs go to $OUT.
set -eu
VENV=${REHEARSAL_VENV:-/tmp/gpu-rehearsal}
OUT=${OUT:-/tmp/gpu-rehearsal-out}
if [ -z "${PYTHON312:-}" ]; then
    # the first that runs: pyenv's shim is on the PATH even where no 3.12 is selected
    for candidate in $(command -v python3.12) /root/.pyenv/versions/3.12*/bin/python3.12; do
        if "$candidate" -c pass 2>/dev/null; then
            PYTHON312=$candidate
            break
        fi
    done
fi
if [ -z "${PYTHON312:-}" ]; then
    echo "no Python 3.12 here: set PYTHON312" >&2
    exit 2
fi
if [ ! -x "$VENV/bin/python3" ]; then
    "$PYTHON312" -m venv "$VENV"
    # what the image has that the engine and its tests use, at its versions where known
    "$VENV/bin/pip" install --quiet torch==2.11.0 triton==3.6.0 transformers==5.17.0 numpy \
        tokenizers safetensors pytest hypothesis pytest-timeout prometheus-client attrs psutil \
        jinja2 sentencepiece tiktoken
fi
[ -d .whl ] || { echo "run make gpu-wheels first" >&2; exit 2; }
mkdir -p "$OUT"
rm -rf /tmp/site  # gpu_session.sh installs the wheels there, as on the GPU machine
# the benchmark's parts need CUDA: here they run as --smoke, each part as the GPU call runs it
PATH="$VENV/bin:$PATH" OUT="$OUT" sh bench/gpu_session.sh "${REHEARSAL_SECONDS:-900}" parity,tests
for rows in --core --rest; do
    PYTHONPATH="/tmp/site:$PWD/platform:$PWD" "$VENV/bin/python3" bench/gpu_throughput.py \
        --smoke "$rows" --model-dir "$OUT/tiny-model" 2>&1 | tee -a "$OUT/bench-smoke.log"
done
