#!/usr/bin/env bash
# Set up everything wanbench needs on a Debian machine (as root): system packages, a venv with
# torch (CPU wheel unless a GPU is present) and wanbench itself. Idempotent and quick when done.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(id -u)" -ne 0 ]; then
  echo "setup: run as root (sudo $0): network namespaces and apt-get need it" >&2
  exit 3
fi

# iproute2/iperf3/iputils-ping: build and measure the network; mininet + bridge-utils: the mininet
# backend and the up/down benchmark; dataset-fashion-mnist: offline Fashion-MNIST for the trainers;
# user-mode-linux + kmod: a guest kernel with sch_netem for proving the tc and mininet backends
# (scripts/netem-vm.sh, tests marked netem).
APT_PACKAGES=(iproute2 iperf3 iputils-ping mininet bridge-utils dataset-fashion-mnist python3-venv procps
              user-mode-linux kmod)
missing=()
for pkg in "${APT_PACKAGES[@]}"; do
  dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: apt-get install ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv with $($PY --version)"
  "$PY" -m venv .venv
fi
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  # Pinned: on our machines this version is a local CPU wheel; an unpinned torch pulls several GB
  # of CUDA packages. On a GPU machine the same pin takes the registry's CUDA build.
  .venv/bin/pip install -q torch==2.13.0
fi
if ! .venv/bin/python -c "import emulator, trainers, pytest, hypothesis, pyarrow, tensorboard, distributed" >/dev/null 2>&1 \
   || [ pyproject.toml -nt .venv/.wanbench-installed ]; then
  .venv/bin/pip install -q -e ".[test]"
  touch .venv/.wanbench-installed
fi
echo "setup: ready ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))"
