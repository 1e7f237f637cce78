# The two commands of README's quick start, the three tiers of tests, lint, docs and bench.
#   make demo   virtualenv + only what the demo needs, then the ordering sample end to end
#   make check  no services at all: the unit, property and contract tests on memory:// and
#               mongomock (deselects the tests marked amqp, redis, postgres, mongodb,
#               torture, spark, slow or guard), in CHECK_WORKERS processes (pytest-xdist; most
#               of its time is waiting, not computing); under a minute and a half on 2 cores
#   make test   what CI runs (.ci/run): every test but the soaks, on RabbitMQ, PostgreSQL
#               and Redis, the reduced torture test, Spark, the docs site (mkdocs build
#               --strict), every snippet of the docs and the performance guard (calls per
#               message of the memory:// flow against bench/results/guard.json) included;
#               under 30 minutes
#   make soak   the soaks (tests marked slow), then the full-size torture run and the
#               torture run on a three-node RabbitMQ cluster (make torture-cluster)
#   make docs   the documentation site into build/site; make docs-serve serves it
#   make dist   a wheel in dist/ (pip install dist/idembus-*.whl)
# Every test has a time limit (setup.cfg: timeout, @pytest.mark.timeout for the long ones):
# a hang fails its test with every thread's stack instead of stalling the run.
# PYTEST_ARGS adds options to all three, e.g. make check PYTEST_ARGS="-x -k outbox".
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip --disable-pip-version-check --quiet

.PHONY: demo check test soak lint docs docs-serve dist bench torture torture-cluster screenshots clean

#: The tests that need no service, no Spark session and no soak (make check).
CHECK_MARKS := not amqp and not redis and not postgres and not mongodb and not torture \
	and not spark and not slow and not guard
CHECK_WORKERS ?= 4

$(BIN)/python:
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 10))' || \
	  { echo "idembus needs Python 3.10 or newer: run make PYTHON=python3.11 (or another 3.10+)"; exit 1; }
	$(PYTHON) -m venv $(VENV)

$(VENV)/.demo: setup.cfg pyproject.toml | $(BIN)/python
	$(PIP) install -e .
	touch $@

$(VENV)/.test: setup.cfg pyproject.toml | $(BIN)/python
	$(PIP) install -e '.[redis,postgres,web,spark,otel,prometheus,test,docs]'
	touch $@

$(VENV)/.bench: setup.cfg pyproject.toml | $(BIN)/python
	$(PIP) install -e '.[redis,postgres,web,spark,otel,prometheus,test,bench]'
	touch $@

$(VENV)/.lint: setup.cfg pyproject.toml | $(BIN)/python
	$(PIP) install -e '.[redis,postgres,web,spark,otel,prometheus,test,lint]'
	touch $@

$(VENV)/.docs: setup.cfg pyproject.toml | $(BIN)/python
	$(PIP) install -e '.[docs]'
	touch $@

demo: $(VENV)/.demo
	$(BIN)/python -m samples.ordering

check: $(VENV)/.test
	$(BIN)/python -m pytest -m "$(CHECK_MARKS)" -n $(CHECK_WORKERS) $(PYTEST_ARGS)

test: $(VENV)/.test
	$(BIN)/python -m pytest -m "not slow" $(PYTEST_ARGS)

soak: $(VENV)/.test
	$(BIN)/python -m pytest -m slow $(PYTEST_ARGS)
	$(BIN)/python -m samples.torture --orders 10000 $(TORTURE_ARGS)
	$(BIN)/python -m samples.torture --cluster --workers 2 --orders 2000 --kill-interval 5 $(TORTURE_ARGS)

# The site's pages are docs/, its navigation mkdocs.yml; the API reference is read from the
# docstrings of the public modules. Broken links and missing pages fail the build.
docs: $(VENV)/.docs
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs build --strict --site-dir build/site

docs-serve: $(VENV)/.docs
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs serve --dev-addr 127.0.0.1:8000

# idembus is not on PyPI: this wheel is what to install elsewhere (no build frontend needed).
dist: | $(BIN)/python
	rm -rf dist
	$(PIP) wheel --no-deps --wheel-dir dist .

# Public names (those the API reference renders) must have docstrings:
# tests/test_public_docstrings.py. mypy checks the package as it installs (the folders map onto the idembus namespace, which
# an editable install provides through an import hook mypy does not run).
lint: $(VENV)/.lint
	$(BIN)/ruff check --target-version py310 --line-length 100 --select E,F,W,I,UP,B --ignore UP042,B027 --config "lint.isort.known-first-party = ['idembus', 'tests', 'samples', 'bench']" bus handlers storage transports samples bench tests
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/test_public_docstrings.py
	rm -rf build/lint && $(PIP) install --no-deps --target build/lint .
	cd build/lint && ../../$(BIN)/mypy --config-file ../../setup.cfg -p idembus

bench: $(VENV)/.bench
	$(BIN)/python -m bench.throughput
	$(BIN)/python -m bench.async_handlers
	$(BIN)/python -m bench.postgres
	$(BIN)/python -m bench.spark_replay
	$(BIN)/python -m bench.gateway
	$(BIN)/python -m bench.database_queues

# The exactly-once torture test at full size on RabbitMQ and PostgreSQL (make test runs a
# reduced one; make soak runs this one): worker processes killed every ~2 s, RabbitMQ
# restarted once. With the queues in PostgreSQL (PostgreSQL restarted once with
# pg_ctlcluster instead):
#   make torture TORTURE_ARGS="--transport postgresql://postgres@127.0.0.1:5432/test"
torture: $(VENV)/.test
	$(BIN)/python -m samples.torture --orders 10000 $(TORTURE_ARGS)

# The torture test on three RabbitMQ nodes started for it on loopback (ports 5691-5693,
# IDEMBUS_CLUSTER_AMQP_PORT moves them; the machine's own RabbitMQ is not touched) and a
# PostgreSQL primary and synchronous standby (free loopback ports): halfway, the node
# leading the most queues is killed, PostgreSQL fails over (primary killed, standby
# promoted), the node is started again, then one is stopped gracefully and started again,
# while workers are killed (docs/operations/cluster.md).
torture-cluster: $(VENV)/.test
	$(BIN)/python -m samples.torture --cluster --workers 2 --orders 2000 --kill-interval 5 $(TORTURE_ARGS)

# README's pictures of the dashboard (docs/screenshots/*.png): its browser test run against
# RabbitMQ and PostgreSQL with Debian's Chromium, saving a PNG of each page it walks through.
screenshots: $(VENV)/.test
	IDEMBUS_SCREENSHOTS=docs/screenshots $(BIN)/python -m pytest -q -p no:cacheprovider tests/test_dashboard_browser.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .mypy_cache .ruff_cache *.egg-info
