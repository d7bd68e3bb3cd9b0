# Set-up on a fresh clone: `make demo` runs the main job, `make test` passes the tests.
# Both create the virtual environment, install profstream and fetch the Kafka jars.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp

.PHONY: install jars demo system test test-faults test-cluster test-multiproc test-bundle test-secure test-mindspore test-fast lint bench stack-up stack-down clean dashboards gpu-check device-bundle

# Re-installed when the compiled Monitor's sources change too: pip rebuilds the extension,
# which an editable install would otherwise keep from before the change.
$(STAMP): pyproject.toml $(wildcard profstream/producers/csrc/*)
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "profstream needs Python 3.11+: install it or run make PYTHON=python3.11")'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	@touch $@

install: $(STAMP)

# Kafka jars into the user cache (or from $$KAFKA_HOME); needs Java 17+ and Maven.
jars: install
	@$(BIN)/python -c 'from profstream.stack import find_java, kafka_libs; find_java(); print("kafka jars:", kafka_libs())'

demo: jars
	$(BIN)/profstream demo $(DEMO_ARGS)

# `make test` also needs torch, transformers and lightning (the PyTorch producer and the
# trainer callbacks are tested for real, on CPU); `make demo` does not.
TORCH_STAMP := $(VENV)/.installed-torch-stamp
$(TORCH_STAMP): $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[dev,torch,transformers,lightning]'
	@touch $@

# tests/test_hta_compare.py checks the device figures against Holistic Trace Analysis.
# Installed without its declared dependencies: they include jupyterlab (~100 MB), which
# its analyses never import; what they do import is installed beside it (about 5 s).
HTA_STAMP := $(VENV)/.installed-hta-stamp
$(HTA_STAMP): $(STAMP)
	$(BIN)/python -m pip install --quiet --no-deps 'HolisticTraceAnalysis==0.5.0'
	$(BIN)/python -m pip install --quiet 'networkx>=3.1' 'plotly>=5.11' 'pydot>=1.3'
	@touch $@

# The Debian packages the tests need (Java, Maven, Prometheus, Chromium, g++...): installed
# when root or password-less sudo allows, else one line with the command; .ci/run uses it too.
system:
	@.ci/check-system

# Every suite runs under a wall-clock limit: a hung run (a deadlocked child process, an
# interpreter exit waiting on one) fails in minutes with one line instead of holding CI to
# its 90-minute limit. The limits are about twice what the suites take on 2 shared cores.
define pytest_limited
	@rc=0; timeout --kill-after=30 $(1)m $(BIN)/python -m pytest $(2) $(PYTEST_ARGS) || rc=$$?; \
	if [ $$rc -eq 124 ] || [ $$rc -eq 137 ]; then echo "make $@: pytest ran past $(1) minutes and was stopped (a hung test or exit): rerun with PYTEST_ARGS=-v to see where it stopped" >&2; fi; \
	exit $$rc
endef

test: system jars $(TORCH_STAMP) $(HTA_STAMP)
	$(BIN)/ruff check profstream tests $(wildcard benchmarks)
	$(call pytest_limited,20,-m "not mindspore and not faults and not multiproc and not bundle and not secure")

# The fault suite: a broker of its own stopped, killed and restarted under a streaming run,
# processors killed, the Monitor flushed and closed across outages, the leader of a 3-broker
# cluster killed under a 16-rank run (tests/faults, ~8 min).
test-faults: jars
	$(call pytest_limited,15,-m "faults and not cluster" tests/faults)

# The longer faults of a 3-broker cluster (6-9 min on 2 shared cores): a processor
# killed, it and the leader killed, the whole cluster down for 30 s during a 16-rank run, a
# Monitor's buffer overflowing meanwhile. (The leader kill itself is in test-faults.) Run by
# .ci/run last (docs/cluster.md).
test-cluster: jars
	$(call pytest_limited,20,-m cluster tests/faults)

# Real distributed jobs: torch.distributed (gloo, CPU) processes launched through
# `profstream run`, their collectives matched across ranks, with op capture and without it on
# a 2 x 2 "TP" x "DP" mesh (tests/test_multiproc.py, ~2 min); `profstream stacks` of gloo ranks in
# all_reduce and one that never came, and the hang alert naming that call (tests/test_stacks.py);
# a hang's stacks asked by autocapture and shown by `stacks --latest`, the timeline and the
# report (tests/test_hang_stacks_e2e.py).
test-multiproc: jars $(TORCH_STAMP)
	$(call pytest_limited,10,-m multiproc tests/test_multiproc.py tests/test_stacks.py tests/test_hang_stacks_e2e.py)

# The GPU path on a machine with an NVIDIA GPU, from a fresh copy: builds the environment,
# then a real bf16 training job under profstream run with its checks, the HTA comparison,
# overhead and sampler figures as one JSON summary (benchmarks/gpu_check.py; exit 2 and one
# line where there is no CUDA GPU).
gpu-check: system jars $(TORCH_STAMP) $(HTA_STAMP)
	$(BIN)/python benchmarks/gpu_check.py $(GPU_CHECK_ARGS)

# What a GPU machine with no registry and no Java runs: build/device-bundle (wheels for its
# Python 3.12, profstream's sources, benchmarks/device_check.py); there, `python3
# build/device-bundle/device_check.py --out $$OUT`; here, `.venv/bin/python
# benchmarks/device_results.py DIR` on the files that came back (docs/benchmarks.md).
device-bundle: install
	$(BIN)/python benchmarks/device_bundle.py $(DEVICE_BUNDLE_ARGS)

# The bundle built for this Python and run offline on CPU in a network namespace of its own,
# then judged against the real broker (tests/test_device_bundle.py, ~2 min).
test-bundle: jars $(TORCH_STAMP) $(HTA_STAMP)
	$(call pytest_limited,10,-m bundle tests/test_device_bundle.py)

# Against the secured broker of `profstream stack up --secure` (SASL_SSL with SCRAM, mutual
# TLS, the StandardAuthorizer with each role's ACLs), started once for the suite: the whole
# pipeline with SCRAM and with mTLS, each role's ACLs enforced, every bad credential,
# certificate and protocol one line (tests/test_secure_pipeline.py, test_acls.py,
# test_security_faults.py; ~5 min on 2 shared cores).
test-secure: jars
	$(call pytest_limited,15,-m secure tests/test_secure_pipeline.py tests/test_acls.py tests/test_security_faults.py)

# The MindSpore callback against a real MindSpore (CPU wheel, ~800 MB), in a virtual
# environment of its own so that the main one keeps its torch and numpy: docs/mindspore.md.
MS_VENV ?= build/venv-mindspore
test-mindspore: jars
	@test -x $(MS_VENV)/bin/python || $(PYTHON) -m venv $(MS_VENV)
	$(MS_VENV)/bin/python -m pip install --quiet -e '.[dev,mindspore]'
	$(MS_VENV)/bin/python -m pytest -m mindspore tests/test_mindspore.py $(PYTEST_ARGS)

# Unit tests only (no broker).
test-fast: install
	$(BIN)/python -m pytest -m "not kafka" $(PYTEST_ARGS)

lint: install
	$(BIN)/ruff check profstream tests $(wildcard benchmarks)

bench: jars
	@for b in benchmarks/bench_*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

# Regenerate the Grafana dashboards (dashboards/*.json) from dashboards/generate.py.
dashboards: install
	$(BIN)/python dashboards/generate.py

stack-up: jars
	$(BIN)/profstream stack up

stack-down: install
	$(BIN)/profstream stack down

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache .hypothesis
