# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp

.PHONY: demo demo-synthetic test test-fast e2e e2e-spot bench clean

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
# The Lambda lab (tests/e2e/clouds/lambdalab) needs root, namespaces and sshd/rsync/sudo/tini: the script
# installs the missing packages (apt); the lab's runtime cache is built once in /var/cache/dtrun-lab.
e2e: $(STAMP)
	tests/e2e/clouds/lambdalab/setup-host.sh
	$(PY) -m pytest -q -m e2e tests --ignore=tests/e2e/runpod_cloud --ignore=tests/e2e/vast_cloud

# The spot clouds' labs (tests/e2e/clouds/runpodlab, vastlab; same host packages as the Lambda lab):
# out of `make e2e` to keep `.ci/run` under 75 minutes (~22 min together: RunPod 290 s + 280 s, Vast 466 s + 278 s measured). The RunPod suite failed
# in CI right after the Lambda suite in one session (cause not found); it passes alone, beside a running
# Lambda lab, and right after the Lambda lab's gc test (2 passed in 261 s).
e2e-spot: $(STAMP)
	tests/e2e/clouds/lambdalab/setup-host.sh
	$(PY) -m pytest -q -m e2e tests/e2e/runpod_cloud tests/e2e/vast_cloud

bench: $(STAMP)
	$(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) runs .pytest_cache
