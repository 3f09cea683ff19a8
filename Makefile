# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp

.PHONY: demo demo-synthetic test test-fast e2e e2e-spot e2e-one bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[all,test]'
	touch $(STAMP)

# From a folder of text to a model transformers loads (CPU, a few minutes): a corpus of this
# Python's standard-library docstrings, a tokenizer trained on it, shards with a validation split,
# the quickstart trained on them with validation loss, then a sample, the weights and the report.
DTRUN := $(VENV)/bin/dtrun
demo: $(STAMP)
	$(PY) examples/stdlib_corpus.py runs/demo/corpus
	test -f runs/demo/tokenizer.json || $(DTRUN) data tokenizer runs/demo/corpus --vocab-size 2048 --out runs/demo/tokenizer.json
	$(DTRUN) data prepare runs/demo/corpus --out runs/demo/data --tokenizer runs/demo/tokenizer.json --val-tokens 50000 --shard-tokens 1000000
	$(DTRUN) up jobs/quickstart-text.yaml --yes
	$(DTRUN) sample quickstart-text --prompt "Return the" --tokens 40 -n 2
	$(DTRUN) weights quickstart-text --out runs/demo/model --format hf
	$(DTRUN) report quickstart-text --out runs/demo/report/report.html

demo-synthetic: $(STAMP)
	$(DTRUN) up jobs/quickstart.yaml --yes

test: $(STAMP)
	$(PY) -m pytest -q -m "not e2e"

# The inner loop: everything but the real-torchrun tests (marked slow) and the e2e suites.
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not e2e and not slow"

# End-to-end suites against the emulated clouds in tests/e2e/ (slow; some need root), and the
# whole fault/resume scenarios with the real trainer elsewhere in tests/ (marked e2e).
# The labs (tests/e2e/clouds/: Lambda, RunPod, Vast, Modal) need root, namespaces and
# sshd/rsync/sudo/tini: the script installs the missing packages (apt); the labs' runtime cache is
# built once in /var/cache/dtrun-lab. Two pytest sessions side by side (tests/e2e/split.py): the
# spot clouds' suites (RunPod, Vast, cross-cloud: 30.8 min) beside the rest (55.3 min; .ci/run on a
# fresh clone 64.8 min in all, 2026-12-07), output prefixed by group, exit 0 only if both pass.
e2e: $(STAMP)
	tests/e2e/clouds/lambdalab/setup-host.sh
	$(PY) -m tests.e2e.split --pytest-arg=-q --pytest-arg=--durations=15 \
	  spot=tests/e2e/runpod_cloud,tests/e2e/vast_cloud,tests/e2e/cross_cloud rest

# The spot clouds' suites alone, in one pytest session.
e2e-spot: $(STAMP)
	tests/e2e/clouds/lambdalab/setup-host.sh
	$(PY) -m pytest -q -m e2e tests/e2e/runpod_cloud tests/e2e/vast_cloud tests/e2e/cross_cloud

# One group alone, e.g. make e2e-one E2E=tests/e2e/runpod_cloud
e2e-one: $(STAMP)
	tests/e2e/clouds/lambdalab/setup-host.sh
	$(PY) -m pytest -q -m e2e $(E2E)

bench: $(STAMP)
	$(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) runs .pytest_cache
