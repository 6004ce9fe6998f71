#!/usr/bin/env bash
# write-lat-compare.sh: our RDMA WRITE ping-pong (`nodetour write-lat`) against perftest's
# ib_write_lat, same sizes and iteration counts, alternating, several runs each, in one VM boot.
# Prints every run, the medians of t_typical (half round trip, µs) and the ratio ours/perftest,
# ours both with the default wait (spin 50 µs, then block) and polling like perftest
# (NODETOUR_SPIN_US=100000).
#
# Runs INSIDE the soft-RoCE VM:  scripts/vm/rdma-vm.sh --nodes 2 -- scripts/compare/write-lat-compare.sh
# Env: SIZES (default "8 4096"), RUNS (default 3), ITERS (default 1000), NODETOUR_BIN.
# Under emulation a round trip costs tens of microseconds of CPU: the ratio checks our
# notification path against perftest's memory polling, not real NIC latency.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/compare-common.sh"
SIZES=${SIZES:-"8 4096"}
ITERS=${ITERS:-1000}
port=19500

run_ours() { # size [spin µs] -> t_typical µs
  port=$((port + 1))
  export NODETOUR_SPIN_US=${2:-50}
  NODETOUR_IB_DEVICE=$SRV_DEV timeout 120 "$BIN" write-lat --listen "$SRV_IP:$port" -s "$1" -n "$ITERS" >/tmp/lat-srv.log 2>&1 &
  local spid=$!
  NODETOUR_IB_DEVICE=$CLI_DEV timeout 120 "$BIN" write-lat --connect "$SRV_IP:$port" -s "$1" -n "$ITERS" >/tmp/lat-cli.log 2>&1 || { cat /tmp/lat-cli.log /tmp/lat-srv.log >&2; return 1; }
  wait "$spid" || { cat /tmp/lat-srv.log >&2; return 1; }
  unset NODETOUR_SPIN_US
  sed -n 's/.*t_typical_us=\([0-9.]*\).*/\1/p' /tmp/lat-cli.log
}

run_perftest() { # size -> t_typical µs
  port=$((port + 1))
  timeout 120 ib_write_lat -d "$SRV_DEV" -x "$GID" -F -s "$1" -n "$ITERS" -p "$port" >/tmp/ptl-srv.log 2>&1 &
  local spid=$!
  wait_listen "$port" || { kill "$spid" 2>/dev/null; return 1; }
  timeout 120 ib_write_lat -d "$CLI_DEV" -x "$GID" -F -s "$1" -n "$ITERS" -p "$port" "$SRV_IP" >/tmp/ptl-cli.log 2>&1 || { cat /tmp/ptl-cli.log >&2; return 1; }
  wait "$spid" || true
  # "#bytes #iterations t_min t_max t_typical t_avg ...": t_typical is column 5.
  grep -A1 '#bytes' /tmp/ptl-cli.log | tail -1 | awk '{print $5}'
}

echo "write-lat-compare: client $CLI_DEV -> server $SRV_DEV ($SRV_IP), GID index $GID, $ITERS round trips, $RUNS runs per size, alternating"
for size in $SIZES; do
  for r in $(seq "$RUNS"); do
    ours=$(run_ours "$size"); busy=$(run_ours "$size" 100000); pt=$(run_perftest "$size")
    echo "run $r size $size: nodetour $ours us (spin 50 us then block), $busy us (NODETOUR_SPIN_US=100000), ib_write_lat $pt us"
    echo "$size ours $ours" >>"$results"; echo "$size busy $busy" >>"$results"; echo "$size perftest $pt" >>"$results"
  done
done
echo "== medians (t_typical, half a round trip, µs)"
for size in $SIZES; do
  o=$(median_of "$size" ours)
  b=$(median_of "$size" busy)
  p=$(median_of "$size" perftest)
  echo "WRITE_LAT_COMPARE size=$size nodetour_us=$o nodetour_busy_poll_us=$b ib_write_lat_us=$p ratio=$(ratio "$o" "$p") busy_poll_ratio=$(ratio "$b" "$p")"
done
