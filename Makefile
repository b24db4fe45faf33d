# The two commands: `make run` serves the platform, `make test` runs the checks.
# Both build the virtual environment they need on first use.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
RUN_STAMP := $(VENV)/.installed-run
TEST_STAMP := $(VENV)/.installed-test
KERNELS_STAMP := $(VENV)/.cpu-kernels
PYTEST_ARGS ?= --durations=20

.PHONY: run test lint format worker migrate clean gpu-wheels gpu-rehearsal

run: $(RUN_STAMP) $(KERNELS_STAMP)
	exec $(BIN)/python manage.py runplatform

test: $(TEST_STAMP) $(KERNELS_STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# A Celery worker with beat, in whichever mode the environment selects.
worker: $(RUN_STAMP)
	exec $(BIN)/celery -A config worker --queues celery,batches --beat --loglevel INFO

migrate: $(RUN_STAMP)
	$(BIN)/python manage.py migrate

lint: $(TEST_STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

clean:
	rm -rf $(VENV) var test-artifacts .whl

# Wheels the GPU machine lacks, for its one-call test and benchmark run (bench/RESULTS-gpu.md).
gpu-wheels: $(TEST_STAMP)
	sh scripts/gpu_wheels.sh

# That run rehearsed on this CPU, in an environment like the GPU machine's image.
gpu-rehearsal: gpu-wheels
	sh scripts/gpu_rehearsal.sh

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# The .pth file puts platform/ (the web tier's source root) and the project root on the
# path of every process that runs from the venv: Daphne, Celery, pytest, scripts.
$(RUN_STAMP): requirements.txt | $(BIN)/python
	$(BIN)/pip install --quiet -r requirements.txt
	$(BIN)/python -c "import pathlib, sysconfig; root = pathlib.Path.cwd(); \
	pathlib.Path(sysconfig.get_paths()['purelib'], 'llm_platform.pth').write_text( \
	f'{root / \"platform\"}\n{root}\n')"
	touch $@

# The engine's C++ CPU kernels, built for this CPU before any engine starts (a machine
# without a compiler runs without them: the engine falls back to torch ops).
$(KERNELS_STAMP): inference_engine/csrc/paged_attention.cpp $(RUN_STAMP)
	$(BIN)/python -m inference_engine.cpu_kernels
	touch $@

$(TEST_STAMP): requirements-test.txt $(RUN_STAMP)
	$(BIN)/pip install --quiet -r requirements-test.txt
	sh scripts/ensure_chromium.sh
	touch $@
