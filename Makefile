# One command to set up and run the tests, one to open the course.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup test test-fast course demo soak lint format clean

setup: $(STAMP)

# In a terminal pip shows what it fetches and installs, with its progress bars; elsewhere
# (CI logs, a pipe) it stays quiet.
$(STAMP): pyproject.toml
	@echo "make setup: a virtual environment in $(VENV) with pgqueue, JupyterLab and the test tools"
	@echo "            (about 120 packages: a minute or two the first time)"
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	@if [ -t 1 ]; then quiet=; else quiet=--quiet; fi; \
	echo "$(PY) -m pip install -e '.[dev]' $$quiet"; \
	$(PY) -m pip install -e '.[dev]' $$quiet
	touch $(STAMP)
	@echo "make setup: done. Next: make demo (the story in the terminal), make course (JupyterLab)"

## make test: library tests, fault tests and every notebook (nbval), on a throwaway server;
## then the Django backend's tests (make test-django), whether or not the first part passed.
## It says how each part went and fails if either did.
PYTEST_ALL   = $(PY) -m pytest -n 2 --dist loadfile --nbval --nbval-sanitize-with notebooks/sanitize.cfg tests notebooks
DJANGO_SUITE = bash .ci/django-suite
test: setup
	@echo '$(PYTEST_ALL)'; $(PYTEST_ALL); pytest=$$?; \
	echo '$(DJANGO_SUITE)'; $(DJANGO_SUITE); django=$$?; \
	verdict() { case "$$1" in 0) echo passed;; 3) echo "skipped (no Python >= 3.12 here)";; \
	  *) echo "FAILED (exit $$1)";; esac; }; \
	echo "make test: tests and notebooks $$(verdict $$pytest); Django tests $$(verdict $$django)"; \
	[ "$$pytest" = 0 ] && { [ "$$django" = 0 ] || [ "$$django" = 3 ]; }

## make test-fast: the tiers a change to the library needs first: tests/fast (no database,
## seconds) and tests/library (against PostgreSQL), without the slow ones
test-fast: setup
	$(PY) -m pytest -n 2 -m "not slow and not browser and not binder" tests/fast tests/library

## make exercises: write notebooks/exercises/ (the lessons without their solutions) from notebooks/
.PHONY: exercises
exercises: setup
	$(PY) -m pgqueue.course.exercises

## make data: refresh the committed benchmark results in data/ (full run, about 16 minutes;
## BENCH_ARGS passes options on). Plain `pgqueue bench` writes outside the repository.
.PHONY: data
data: setup
	$(VENV)/bin/pgqueue bench --out data $(BENCH_ARGS)

## make soak: ten minutes of real workers under kills, pauses, cut sessions and a restart,
## then the fence's model-based test with its longer profile (500 examples)
soak: setup
	$(VENV)/bin/pgqueue chaos --duration 600
	PGQUEUE_MODEL_EXAMPLES=500 PGQUEUE_MODEL_STEPS=60 $(PY) -m pytest -q --timeout 3600 tests/library/test_fence_model.py

## make course: open the notebooks in JupyterLab
course: setup
	PATH="$(abspath $(VENV))/bin:$$PATH" binder/prepare-lab
	$(VENV)/bin/jupyter lab $(if $(filter 0,$(shell id -u)),--allow-root) notebooks/01-the-table.ipynb

## make demo: the paused-worker story in the terminal
demo: setup
	$(VENV)/bin/pgqueue demo

lint: setup
	$(VENV)/bin/ruff check pgqueue tests notebooks
	$(VENV)/bin/ruff format --check pgqueue tests notebooks
	$(PY) pgqueue/tools/async_to_sync.py --check
	$(VENV)/bin/actionlint .github/workflows/*.yml

format: setup
	$(PY) pgqueue/tools/async_to_sync.py
	$(VENV)/bin/ruff format pgqueue tests notebooks
	$(VENV)/bin/ruff check --fix pgqueue tests notebooks

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache

## make test-django: the django.tasks backend's tests and Django's own tests/tasks suite,
## in .venv-django (Django 6 needs Python >= 3.12: skipped with a message where none is found)
.PHONY: test-django
test-django:
	@$(DJANGO_SUITE) || [ $$? = 3 ]  # 3: skipped, no Python >= 3.12 (said above)
