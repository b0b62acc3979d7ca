#!/usr/bin/env bash
# Copy a real run directory (records, summary, plan, verify; no logs, no report) under
# results/examples/<notebook>/ so that notebooks and their CI test have real, small results.
# Usage: scripts/publish_example.sh RUN_DIR NOTEBOOK_NAME
set -euo pipefail
run_dir=${1:?run directory}; name=${2:?notebook name}
dest="$(dirname "$0")/../results/examples/$name/$(basename "$(dirname "$run_dir")")/$(basename "$run_dir")"
mkdir -p "$dest"
(cd "$run_dir" && tar --exclude=./report --exclude='*.log' -cf - .) | (cd "$dest" && tar -xf -)
du -sh "$dest"
