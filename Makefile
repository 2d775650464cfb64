# cdcd — every target installs what it needs first.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
JARS   := $(VENV)/jars/.fetched-stamp
CDS    := $(VENV)/spark-driver.jsa

.PHONY: install lock test-latest test test-lake-python test-kafka-cluster test-under-load test-under-load-8 lint bench bench-pg bench-kafka fuzz chaos run run-cluster clean

# The venv, Delta's jars, Kafka, Kafka Connect and tmux; last, cdcd's and the tests' bytecode: pip compiles
# site-packages but not an editable project, and where PYTHONDONTWRITEBYTECODE is set (CI machines) every Python
# process would compile cdcd's modules again at its start.
install: $(STAMP) $(JARS)
	@bash scripts/ensure-kafka.sh
	@bash scripts/ensure-kafka-connect.sh
	@bash scripts/ensure-tmux.sh
	@$(BIN)/python -m compileall -q cdcd tests

# Every Python package at the version and hash requirements.lock names (scripts/install-python.sh); PYTHON_DEPS=latest
# (make test-latest) takes the newest versions pyproject.toml's ranges allow instead. setup.py and the C source: pip
# builds cdcd's C modules (cdcd/lake/landing/_rows.c, cdcd/wal/_entries.c) again when they change.
PYTHON_DEPS ?= locked
$(STAMP): pyproject.toml setup.py cdcd/lake/landing/_rows.c cdcd/wal/_entries.c requirements.lock
	@bash scripts/ensure-java.sh
	@bash scripts/ensure-cc.sh $(PYTHON)
	$(PYTHON) -m venv $(VENV)
	@bash scripts/install-python.sh $(VENV) $(PYTHON_DEPS)
	@VENV=$(VENV) bash scripts/ensure-minio.sh
	@touch $(STAMP)

# The lock again from pyproject.toml's ranges (and scripts/lock-build.in): the newest versions they allow today, with
# the hashes of every file PyPI serves for them, for every platform (uv: it resolves and hashes in seconds and writes
# the requirements format plain pip installs with --require-hashes). Commit it after make test-latest passes.
lock: $(STAMP)
	$(BIN)/uv pip compile --quiet --universal --python-version 3.11 --generate-hashes --extra dev --extra readers \
		--custom-compile-command 'make lock' pyproject.toml scripts/lock-build.in -o requirements.lock

# The suite on the newest versions the ranges allow, in a venv of its own (.venv-latest), so a release that breaks
# cdcd is found by us, not by a new user; it starts by listing what differs from the lock.
test-latest:
	@mkdir -p .venv-latest/bin
	@cp -p .venv/bin/minio .venv/bin/.minio-* .venv-latest/bin/ 2>/dev/null || true
	$(MAKE) VENV=.venv-latest PYTHON_DEPS=latest test

# Delta Lake's jars for Spark, from Maven Central once; later runs and tests need no network.
$(JARS): $(STAMP) scripts/fetch-delta-jars.sh cdcd/lake/spark.py
	bash scripts/fetch-delta-jars.sh $(BIN)/python
	@touch $(JARS)

# The Spark driver's classes, parsed once into a class-data-sharing archive that every Spark driver the tests start
# maps (scripts/spark_cds.py; tests/conftest.py sets SPARK_SUBMIT_OPTS when it exists). The JVM rejects the file
# when it was written by another JVM or for another classpath: it is written again when the JDK's java binary or
# pyspark (through the venv's stamp) changes.
JAVA_BIN := $(realpath $(shell command -v java 2>/dev/null))
$(CDS): $(JARS) scripts/spark_cds.py $(JAVA_BIN)
	@rm -f $@
	@echo "writing $@ (scripts/spark_cds.py)"
	@JDK_JAVA_OPTIONS="-XX:TieredStopAtLevel=1 -XX:+UseSerialGC" $(BIN)/python scripts/spark_cds.py $@ 2>$(VENV)/spark-cds.log || { tail -n 30 $(VENV)/spark-cds.log >&2; exit 1; }

# Three workers, one test file each at a time (module fixtures stay per file; each worker keeps one SparkSession):
# with two, the suite left a fifth of two cores idle while tests waited on processes; a third fills it.
# The 25 slowest test phases are listed at the end: where the suite's time goes, in every CI log.
PYTEST_WORKERS ?= 3
test: install $(CDS)
	$(BIN)/pytest -q -n $(PYTEST_WORKERS) --dist loadfile --durations=25
	CDCD_LAKE_ROWS=python $(BIN)/pytest -q -n $(PYTEST_WORKERS) --dist loadfile $(LAKE_ON_PYTHON)

# The lake again on the Python row builder (cdcd/lake/landing/rows_py.py), as a machine without the C module runs it:
# the many-partition writer end to end (its processes inherit CDCD_LAKE_ROWS). The row tests compare both builders
# column by column in the main run (row_builder fixture, tests/test_lake_keys.py); make test-lake-python runs all.
LAKE_ON_PYTHON := tests/test_lake_rows.py::test_this_process_uses_the_builder_the_environment_names \
	tests/test_lake_caches.py

# Every lake test file on the Python row builder.
test-lake-python: install $(CDS)
	CDCD_LAKE_ROWS=python $(BIN)/pytest -q -n $(PYTEST_WORKERS) --dist loadfile tests/test_lake*.py

# Three Kafka brokers, replication factor 3, a partition leader SIGKILLed mid-stream (~3 min).
test-kafka-cluster: install $(CDS)
	CDCD_KAFKA_CLUSTER=1 $(BIN)/pytest -q tests/test_kafka_cluster.py

# The same suite with every core kept busy by other processes: timing luck must not matter.
test-under-load: install $(CDS)
	PYTEST_WORKERS=$(PYTEST_WORKERS) bash scripts/test-under-load.sh

# The same with eight busy processes, whatever the core count (four per core on two cores).
test-under-load-8: install $(CDS)
	PYTEST_WORKERS=$(PYTEST_WORKERS) BUSY_PROCESSES=8 bash scripts/test-under-load.sh

lint: install
	$(BIN)/ruff check cdcd tests
	$(BIN)/ruff format --check cdcd tests
	$(BIN)/mypy

bench: install
	$(BIN)/python -m tests.bench.run

# cdcd and a private PostgreSQL cluster side by side (ARGS="--quick" for a few minutes).
bench-pg: install
	@bash scripts/ensure-postgres.sh
	$(BIN)/python -m tests.bench.bench_pg $(ARGS)

# cdcd -> Kafka and Debezium Server (PostgreSQL connector) -> Kafka into one local broker (ARGS="--quick").
bench-kafka: install
	@bash scripts/ensure-postgres.sh
	@bash scripts/ensure-debezium.sh
	$(BIN)/python -m tests.bench.bench_debezium $(ARGS)

# The WAL reader against a million random and mutated segments (FUZZ_ENGINE=hypothesis|atheris).
FUZZ_CASES  ?= 1000000
FUZZ_ENGINE ?= random
fuzz: install
	@if [ "$(FUZZ_ENGINE)" = atheris ]; then $(BIN)/pip install --quiet atheris; fi
	$(BIN)/python -m tests.fuzz.run --cases $(FUZZ_CASES) --engine $(FUZZ_ENGINE)

# Fault injection across node, daemon and sinks (CHAOS_ARGS="--short --only 'kill-*' --seed 7"; root for tmpfs).
chaos: install $(CDS)
	$(BIN)/pytest -q -m chaos
	$(BIN)/python -m tests.chaos.run $(CHAOS_ARGS)
	$(MAKE) test-kafka-cluster

run: install
	$(BIN)/cdcd demo --rate 2000

# Three nodes, three daemons, one Delta lake on MinIO, a Spark standalone cluster; Ctrl-C verifies (docs/cluster.md).
run-cluster: install
	$(BIN)/python scripts/run-cluster.py

clean:
	rm -rf var .pytest_cache .mypy_cache .ruff_cache
