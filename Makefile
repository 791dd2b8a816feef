# Two entry points for a fresh machine; both install into ./.venv first.
#   make demo   end-to-end demo on the embedded local S3 (SeaweedFS on loopback)
#   make test   lint, type-check and the whole test suite
#   make test-unit   the pure, fast tests alone (tests/unit, seconds)
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test test-unit lint venv clean

$(BIN)/activate:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(VENV)/.installed-demo: pyproject.toml | $(BIN)/activate
	$(BIN)/pip install --quiet -e '.[demo]'
	touch $@

$(VENV)/.installed-dev: pyproject.toml | $(BIN)/activate
	$(BIN)/pip install --quiet -e '.[dev,demo,trainers]'
	touch $@

venv: $(VENV)/.installed-dev

demo: $(VENV)/.installed-demo
	$(BIN)/python -m ckptd.devtools.demo

lint: venv
	$(BIN)/ruff check ckptd tests bench
	$(BIN)/ruff format --check ckptd tests bench
	$(BIN)/mypy ckptd

# The Slurm jobs (marker slurm: about 4 min, nearly all of it waiting on Slurm's own
# 30 s cycles and requeue delay) run beside the rest of the suite, their output after it;
# the target fails when either part fails.
test: lint
	@slurm_log=$$(mktemp); \
	$(BIN)/pytest -q -p no:cacheprovider -m slurm >"$$slurm_log" 2>&1 & slurm_pid=$$!; \
	$(BIN)/pytest -q -m 'not slurm'; rest=$$?; \
	wait $$slurm_pid; slurm=$$?; \
	echo "--- the Slurm tests, run beside the rest (pytest -m slurm):"; cat "$$slurm_log"; rm -f "$$slurm_log"; \
	[ $$rest -eq 0 ] && [ $$slurm -eq 0 ]

test-unit: venv
	$(BIN)/pytest -q tests/unit

clean:
	rm -rf $(VENV) .demo .mypy_cache .pytest_cache .ruff_cache
