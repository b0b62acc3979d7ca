#!/usr/bin/env bash
# README command 1: set up, then run the main job on the default backend.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/wanbench run scenarios/quickstart.yaml "$@"
