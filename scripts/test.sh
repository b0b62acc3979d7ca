#!/usr/bin/env bash
# README command 2: set up, then run every test tier that this machine can run.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Leftovers of an earlier crashed run must not make tests fail; our own prefixes only.
.venv/bin/python -m pytest -ra "$@"
