# cgpu_km: the two commands are `make demo` and `make test`.
# Each sets up what it needs (Debian packages, .venv, C builds) on a fresh host.

PYTHON ?= python3
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

.PHONY: all setup apt venv build demo test test-python test-kmod lint bench clean

all: build

apt:
	tools/ensure-apt.sh $(APT_PACKAGES)

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $@

venv: $(VENV)/.installed

build:
	@for d in $(C_DIRS); do \
		if [ -f $$d/Makefile ]; then $(MAKE) -C $$d || exit 1; fi; \
	done

setup: apt venv build

demo: setup
	$(PY) -m cgpu_km.demo

lint: venv
	$(VENV)/bin/ruff check cgpu_km fuse_fs tests kmod/vm
	$(VENV)/bin/mypy
	$(VENV)/bin/mypy kmod/vm/node/checks.py

test-python: setup
	$(VENV)/bin/pytest -q tests

test-kmod:
	$(MAKE) -C kmod test

test: setup lint test-python test-kmod

bench: setup
	$(PY) -m tests.bench

clean:
	@for d in $(C_DIRS) kmod; do \
		if [ -f $$d/Makefile ]; then $(MAKE) -C $$d clean; fi; \
	done
	rm -rf $(VENV) *.egg-info
