#!/usr/bin/env bash
# The one-process two-rank step (both kernel) before (nodetour-old, 88473e6) and after (16-byte
# loads), two members on GPU 0 of one process, interleaved rounds.
cd "$(dirname "$0")"
out=$1
export NODETOUR_CACHE_DIR=$PWD/kernel-cache NODETOUR_LOG=warn
for r in 1 2 3; do
  for dt in bf16 f32; do
    for b in nodetour-old nodetour; do
      for op in sum avg; do
        ./$b perf --gpus 0,0 --compare ceiling --dtype $dt --op $op --sizes 64K:16M --factor 4 --iters 50 --warmup 5 --format csv 2>"$out/ab.err" \
          | grep -E '^[0-9]+,' | sed "s/^/AB round=$r bin=$b dtype=$dt op=$op /" >>"$out/ab-both.log" || echo "failed $b $dt $op" >>"$out/ab-both.log"
      done
    done
  done
done
python3 - "$out/ab-both.log" <<'PY'
import re, statistics, sys
rows = {}
for line in open(sys.argv[1]):
    m = re.match(r"AB round=(\d+) bin=(\S+) dtype=(\S+) op=(\S+) (.*)", line)
    if not m: continue
    f = m[5].split(",")
    rows.setdefault((m[3], m[4], int(f[0]), m[2]), []).append((float(f[3]), f[5]))
for (dt, op, b, bin_) in sorted(rows):
    if bin_ != "nodetour": continue
    new = rows[(dt, op, b, "nodetour")]; old = rows.get((dt, op, b, "nodetour-old"), [])
    mn, mo = statistics.median(x for x, _ in new), statistics.median(x for x, _ in old) if old else float("nan")
    ok = all(c == "true" for _, c in new + old)
    print(f"AB_BOTH dtype={dt} op={op} bytes={b} new_us={mn:.2f} old_us={mo:.2f} old_over_new={mo / mn:.3f} rounds={len(new)} check={'ok' if ok else 'wrong'}")
PY
