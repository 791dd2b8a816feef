# Two entry points for a fresh machine; both install into ./.venv first.
#   make demo   end-to-end demo on the embedded local S3 (SeaweedFS on loopback)
#   make s3     a local S3 (SeaweedFS on loopback) to try ckptd with; prints the exports; Ctrl-C stops it
#   make test   lint, type-check and the whole test suite (but the peers' fault rig: pytest -m peers_faults)
#               (mypy runs beside the tests, whose two pytest processes run side by side)
#   make test-unit   the pure, fast tests alone (tests/unit, seconds)
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo s3 test test-unit lint venv clean

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

s3: $(VENV)/.installed-demo
	$(BIN)/python -m ckptd.devtools.locals3

lint: venv
	$(BIN)/ruff check ckptd tests bench
	$(BIN)/ruff format --check ckptd tests bench
	$(BIN)/mypy ckptd

# The Slurm jobs (marker slurm: about 4 min, nearly all of it waiting on Slurm's own
# 30 s cycles and requeue delay), the campaigns' short versions (marker campaign, about
# 4 min, built to run on a loaded machine) and the end-to-end tests with real trainers
# (marker e2e: every test under tests/e2e, about 11 min) run in a second pytest beside
# the rest of the suite, which mostly waits on its processes too; their output comes after
# it, and the target fails when either part fails.
# Each part draws its test ports from a range of its own below the kernel's ephemeral one
# (TEST_PORT_RANGE, ckptd.devtools.locals3.free_port): a port one part found free cannot
# be taken by the other part's daemon, nor by an outgoing connection, before it is bound.
# The container test (marker container: podman builds and runs the image, about 40 s) goes
# beside too, which had the room. mypy (about 50 s on a fresh clone) runs beside both.
BESIDE := slurm or campaign or e2e or container
test: venv
	$(BIN)/ruff check ckptd tests bench
	$(BIN)/ruff format --check ckptd tests bench
	@beside_log=$$(mktemp); mypy_log=$$(mktemp); \
	$(BIN)/mypy ckptd >"$$mypy_log" 2>&1 & mypy_pid=$$!; \
	TEST_PORT_RANGE=27000-32000 $(BIN)/pytest -q -p no:cacheprovider -m '($(BESIDE)) and not peers_faults' >"$$beside_log" 2>&1 & beside_pid=$$!; \
	TEST_PORT_RANGE=20000-26999 $(BIN)/pytest -q -m 'not ($(BESIDE)) and not peers_faults'; rest=$$?; \
	wait $$mypy_pid; types=$$?; wait $$beside_pid; beside=$$?; \
	echo "--- mypy ckptd (beside the tests):"; cat "$$mypy_log"; rm -f "$$mypy_log"; \
	echo "--- run beside the rest (pytest -m '($(BESIDE)) and not peers_faults'):"; cat "$$beside_log"; rm -f "$$beside_log"; \
	[ $$rest -eq 0 ] && [ $$beside -eq 0 ] && [ $$types -eq 0 ]

test-unit: venv
	$(BIN)/pytest -q tests/unit

clean:
	rm -rf $(VENV) .demo .mypy_cache .pytest_cache .ruff_cache
