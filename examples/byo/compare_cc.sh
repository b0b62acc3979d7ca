#!/bin/sh
# The example by hand on aws-4region at DELAY_SCALE (default 1), once per TCP congestion control
# (default: reno bbr), each set inside every node with sysctl; prints steps/s per congestion control.
# BYO_ARGS: more arguments for train_ddp.py (e.g. "--hidden 4096": a 1.7 MB gradient per step).
#   sudo examples/byo/compare_cc.sh [STEPS]     (from the repository root; WANBENCH_PREFIX respected)
# Records and reports: $OUT/<cc>/wanbench-run/report/ (OUT default /var/tmp/wanbench-byo-cc).
set -eu
steps=${1:-30}
root=$(cd "$(dirname "$0")/../.." && pwd)
wanbench="$root/.venv/bin/python -m harness.cli"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
out=${OUT:-/var/tmp/wanbench-byo-cc}
nodes="london-0 tokyo-0 oregon-0 ohio-0"
rm -rf "$out"
$wanbench up "$root/topologies/aws-4region.yaml" --backend tun --delay-scale "${DELAY_SCALE:-1}"
trap '$wanbench down' EXIT
cd "$root/examples/byo"
for cc in ${CCS:-reno bbr}; do
  for node in $nodes; do $wanbench exec "$node" -- sysctl -q -w net.ipv4.tcp_congestion_control="$cc"; done
  rank=0
  for node in $nodes; do
    WANBENCH_OUTPUT_DIR="$out/$cc" $wanbench exec "$node" -- torchrun --nnodes 4 --nproc-per-node 1 \
      --node-rank $rank --master-addr london-0 --master-port 29400 train_ddp.py --steps "$steps" ${BYO_ARGS:-} \
      > "$out.$cc.rank$rank.log" 2>&1 &
    rank=$((rank + 1))
  done
  wait
  $wanbench report "$out/$cc" > /dev/null 2>&1
  "$root/.venv/bin/python" - "$out/$cc/wanbench-run/report/summary.csv" "$cc" <<'PY'
import sys, pandas as pd
row = pd.read_csv(sys.argv[1]).iloc[0]
print(f"{sys.argv[2]}: {row['steps_per_s']:.3f} steps/s ({row['steps']} steps, {row['train_time_s']:.1f} s), "
      f"final accuracy {row['final_accuracy']:.3f}, in the nodes: {row['congestion_control']}")
PY
done
