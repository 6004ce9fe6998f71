#!/usr/bin/env bash
# symbolize-watchdog.sh BINARY LOG: the `exe+OFFSET` words a GPU test's watchdog printed (see
# crates/nodetour-ring/tests/common/mod.rs, `stack_scan`) as functions and lines of BINARY, the
# unstripped test executable the run's stripped copy came from (gpu-pack.sh keeps it under
# target/release/deps). Innermost first; words that are not return addresses show too (a
# stack scan, not an unwinder): read each thread's list for the nodetour frames.
set -euo pipefail
bin=$1 log=$2
python3 - "$bin" "$log" <<'PY'
import re, subprocess, sys
binary, log = sys.argv[1], sys.argv[2]
# LOAD segments: file offset -> virtual address.
segs = []
for line in subprocess.run(["readelf", "-lW", binary], capture_output=True, text=True).stdout.splitlines():
    f = line.split()
    if f and f[0] == "LOAD":
        segs.append((int(f[1], 16), int(f[2], 16), int(f[4], 16)))
def vaddr(off):
    for o, v, size in segs:
        if o <= off < o + size:
            return off - o + v
    return None
for line in open(log, errors="replace"):
    if "WATCHDOG:" not in line or "exe+" not in line:
        continue
    head = line.split(" exe+")[0].split("WATCHDOG:")[1].strip()
    print(head)
    addrs = [vaddr(int(m, 16)) for m in re.findall(r"exe\+(0x[0-9a-f]+)", line)]
    addrs = [a for a in addrs if a is not None]
    # A return address points after the call: look one byte back.
    out = subprocess.run(["addr2line", "-f", "-C", "-i", "-e", binary] + [hex(a - 1) for a in addrs],
                         capture_output=True, text=True).stdout.splitlines()
    for fn, where in zip(out[0::2], out[1::2]):
        if any(k in fn or k in where for k in ("nodetour", "cudarc", "communicator")):
            print(f"    {fn[:140]}  {where.split('/src/')[-1]}")
PY
