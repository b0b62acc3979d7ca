#!/usr/bin/env bash
# README command 2: set up, then run the CI regression benchmark and every test tier this machine
# can run (integration tests need root and /dev/net/tun; they skip, saying why, without them).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ "$(id -u)" -eq 0 ] && [ -e /dev/net/tun ]; then
  # scenarios/ci/*.yaml against results/baselines/ (exit 1 on a regression); before pytest so that
  # pytest's summary is the last line of the log.
  .venv/bin/wanbench regress
fi
exec .venv/bin/python -m pytest -ra "$@"
