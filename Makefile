# cgpu_km: the two commands are `make demo` and `make test`.
# Each sets up what it needs (Debian packages, .venv, C builds) on a fresh host.
# `make check` is the fast tier alone (no root, no mounts), run as a normal user.

# The venv's interpreter must be one every user can run (make check drops to one
# that is not root): the system's python3 when there is one.
PYTHON ?= $(firstword $(wildcard /usr/bin/python3) python3)
VENV := .venv
PY := $(VENV)/bin/python
# Packages every part of the test suite needs; kmod/Makefile adds its own.
# Container engines for tests/containers and make demo: docker.io (with containerd,
# iptables, tini), podman (without recommends: no fuse3, which would replace fuse);
# python3-venv for the dev venv and cgpu-node's prefix; libc6-dev: gcc without its
# recommends has no C headers, procps: /bin/kill for the units (both found in a fresh
# debootstrap root); curl: the metrics page's commands, which tests/docs runs.
APT_PACKAGES := fuse libfuse2 busybox-static runc prometheus systemd kmod util-linux gcc libc6-dev make \
	procps python3 python3-venv docker.io containerd podman iptables curl

C_DIRS := simgpu libcgpu
TIERS := unit integration system

.PHONY: all setup apt venv build $(C_DIRS) demo check test $(TIERS:%=test-%) lint bench soak fuzz \
	clean $(C_DIRS:%=clean-%) clean-kmod

all: build

apt:
	tools/ensure-apt.sh $(APT_PACKAGES)

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $@

venv: $(VENV)/.installed

build: $(C_DIRS)

$(C_DIRS):
	$(MAKE) -C $@

setup: apt venv build

demo: setup
	$(PY) -m cgpu_km.demo

lint: venv
	$(VENV)/bin/ruff check cgpu_km fuse_fs tests kmod/vm
	$(VENV)/bin/mypy
	$(VENV)/bin/mypy kmod/vm/node/checks.py

# Test tiers: tests/conftest.py gives every test its tier (a table of folders).
# Each tier has its own per-test timeout; -rs says why tests skipped (tools/tiers.sh
# shows the first reason of a tier that ran none), --durations the slowest tests.
PYTEST := $(VENV)/bin/pytest -p no:cacheprovider -q -rs --durations=25

# unit: no root, no mounts, no containers; as a normal user (tools/as-user.sh
# drops root to nobody).
check: test-unit

test-unit: venv build
	tools/as-user.sh $(PYTEST) -m unit --timeout=60 tests

# integration: root, FUSE mounts, runc/Docker/podman/containerd, the daemon on simgpu.
test-integration: setup
	$(PYTEST) -m integration --timeout=300 tests

# system: the kernel module and the whole node in VMs (kmod/Makefile).
test-system: setup
	$(MAKE) -C kmod test

test: setup lint
	@MAKE="$(MAKE)" tools/tiers.sh $(TIERS)

bench: setup
	$(PY) -m tests.bench

# A simulated 8-GPU node under churn, live writes and faults (tests/soak): a table,
# and build/soak/soak.csv and soak.png (matplotlib: the bench extra). MINUTES=10.
MINUTES ?= 10
$(VENV)/.bench: $(VENV)/.installed
	$(PY) -m pip install -q -e '.[test,bench]'
	touch $@

soak: setup $(VENV)/.bench
	$(PY) -m tests.soak --minutes $(MINUTES)

# Property tests with new random examples, many more of them (make test draws the
# same ones every run): a failure found here becomes an @example.
fuzz: venv build
	CGPU_HYPOTHESIS=explore tools/as-user.sh $(PYTEST) -m unit --timeout=1800 tests

clean: $(C_DIRS:%=clean-%) clean-kmod
	rm -rf $(VENV) *.egg-info build

$(C_DIRS:%=clean-%) clean-kmod: clean-%:
	$(MAKE) -C $* clean
