#!/bin/sh
# Wheels for the GPU machine (Python 3.12, x86-64): the packages the engine and its tests need
# that its image lacks (it has torch, transformers, Triton, tokenizers, numpy, pytest,
# hypothesis, pytest-timeout, prometheus-client), at the versions this checkout's .venv holds.
# They land in .whl/ (git ignores it); the GPU command in bench/RESULTS-gpu.md carries and
# installs them.
set -eu
PACKAGES="msgspec pyzmq xgrammar apache-tvm-ffi pydantic pydantic-core annotated-types
typing-inspection typing-extensions jsonschema jsonschema-specifications referencing rpds-py
pytest-asyncio"
rm -rf .whl
mkdir -p .whl
for name in $PACKAGES; do
    version=$(.venv/bin/python -c "import importlib.metadata as m; print(m.version('$name'))")
    .venv/bin/python -m pip download --quiet --no-deps --only-binary=:all: \
        --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_26_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
        -d .whl "$name==$version"
done
ls .whl
