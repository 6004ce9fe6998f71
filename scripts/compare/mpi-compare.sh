#!/usr/bin/env bash
# mpi-compare.sh: nodetour's host-buffer allreduce over tcp against Open MPI's MPI_Allreduce
# over tcp loopback (`--mca btl tcp,self`), same machine, same run, interleaved batches
# (issue 16's reference). f32 sum in place, each collective timed alone on rank 0, the median
# of the timed iterations per batch; per size the median over batches and its spread.
# Prints one `MPI_COMPARE` line per ranks x size (time ratio nodetour / MPI: < 1 is faster;
# busbw ratio: > 1 is faster), then `MPI_COMPARE_SUMMARY`. Printed, not asserted.
#   scripts/compare/mpi-compare.sh [--ranks "2 4"] [--sizes 8:16M] [--factor 8] [--batches 5]
#                          [--iters 30] [--spin-us N]   (NODETOUR_SPIN_US and NODETOUR_RING_SPIN_US
#                                                        for nodetour's run: busy polling, like MPI)
# Needs mpicc and mpirun (Debian: openmpi-bin libopenmpi-dev); else prints SKIP and exits 0.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
ranks="2 4" sizes=8:16M factor=8 batches=5 iters=30 spin=
while (($#)); do
    case $1 in
        --ranks) ranks=$2; shift 2 ;;
        --sizes) sizes=$2; shift 2 ;;
        --factor) factor=$2; shift 2 ;;
        --batches) batches=$2; shift 2 ;;
        --iters) iters=$2; shift 2 ;;
        --spin-us) spin=$2; shift 2 ;;
        -h | --help) sed -n '2,/^set -uo/{/^#/s/^# \{0,1\}//p}' "${BASH_SOURCE[0]}"; exit 0 ;;
        *) echo "usage: $0 [--ranks LIST] [--sizes MIN:MAX] [--factor F] [--batches N] [--iters N] [--spin-us N]" >&2; exit 2 ;;
    esac
done
if ! command -v mpicc >/dev/null || ! command -v mpirun >/dev/null; then
    echo "SKIP mpi-compare: mpicc/mpirun not found (apt-get install openmpi-bin libopenmpi-dev)"
    exit 0
fi
target=${CARGO_TARGET_DIR:-target}
mkdir -p "$target/mpi"
mpicc -O2 -o "$target/mpi/allreduce" scripts/compare/mpi/allreduce.c || { echo "mpi-compare: mpicc failed"; exit 1; }
cargo build --release -q -p nodetour-tools --bin nodetour || { echo "mpi-compare: cargo build failed"; exit 1; }
nodetour=$target/release/nodetour
# The sizes, as nodetour perf parses them (powers of `factor` from MIN to MAX).
mapfile -t list < <(python3 - "$sizes" "$factor" <<'PY'
import sys
def parse(s):
    m = {'K': 1 << 10, 'M': 1 << 20, 'G': 1 << 30}
    return int(s[:-1]) * m[s[-1]] if s[-1] in m else int(s)
lo, hi = (parse(x) for x in sys.argv[1].split(':'))
f = int(sys.argv[2]); s = lo
while s <= hi:
    print(s); s *= f
PY
)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mpi_flags=(--allow-run-as-root --oversubscribe --mca btl tcp,self --mca btl_tcp_if_include lo --bind-to none)
echo "mpi-compare: $(mpirun --version 2>&1 | head -n 1); nodetour $(git rev-parse --short HEAD 2>/dev/null); ranks $ranks; ${#list[@]} sizes; $batches batches of $iters iterations, interleaved${spin:+; NODETOUR_SPIN_US=NODETOUR_RING_SPIN_US=$spin}"
failed=0
for n in $ranks; do
    for b in $(seq 1 "$batches"); do
        ITERS=$iters WARMUP=3 timeout 600 mpirun "${mpi_flags[@]}" -np "$n" "$target/mpi/allreduce" "${list[@]}" \
            >"$work/mpi-$n-$b.txt" 2>&1 || { echo "mpi-compare: MPI run failed (ranks $n)"; tail -5 "$work/mpi-$n-$b.txt"; failed=1; }
        env ${spin:+NODETOUR_SPIN_US=$spin NODETOUR_RING_SPIN_US=$spin} NODETOUR_TRANSPORT=tcp timeout 600 scripts/launch-local.sh -n "$n" --timeout 550 -- \
            "$nodetour" perf --sizes "$sizes" --factor "$factor" --iters "$iters" --warmup 3 --format csv \
            >"$work/nt-$n-$b.txt" 2>&1 || { echo "mpi-compare: nodetour run failed (ranks $n)"; tail -5 "$work/nt-$n-$b.txt"; failed=1; }
    done
done
python3 - "$work" "$ranks" "$batches" <<'PY'
import glob, re, statistics, sys
work, ranks, batches = sys.argv[1], sys.argv[2].split(), int(sys.argv[3])
def spread(v):
    return (max(v) - min(v)) if v else 0.0
met = total = 0
for n in ranks:
    mpi, nt, wrong = {}, {}, set()
    for b in range(1, batches + 1):
        for line in open(f"{work}/mpi-{n}-{b}.txt", errors="replace"):
            m = re.search(r"MPI_ROW bytes=(\d+) us=([\d.]+) check=(\w+)", line)
            if m:
                mpi.setdefault(int(m[1]), []).append(float(m[2]))
                if m[3] != "ok": wrong.add(("mpi", int(m[1])))
        for line in open(f"{work}/nt-{n}-{b}.txt", errors="replace"):
            m = re.match(r"\[rank 0\] (\d+),\d+,([\d.]+),[\d.]+,[\d.]+,(\w+),host", line)
            if m:
                nt.setdefault(int(m[1]), []).append(float(m[2]))
                if m[3] != "true": wrong.add(("nodetour", int(m[1])))
    k = int(n)
    for size in sorted(set(mpi) & set(nt)):
        a, b = statistics.median(nt[size]), statistics.median(mpi[size])
        busbw = lambda us: size / (us * 1e-6) / 1e9 * 2 * (k - 1) / k
        # The issue's targets: <= 2x MPI's time below 64 KiB; >= 1.0x its busbw from 1 MiB.
        # Judged on the median ratio alone (a verdict that a wide spread could never fail is
        # no verdict); the spread is printed beside it.
        if size < 64 << 10:
            ok = a <= 2 * b
        elif size >= 1 << 20:
            ok = a <= b
        else:
            ok = None
        if ok is not None:
            total += 1; met += ok
        print(f"MPI_COMPARE ranks={n} bytes={size} nodetour_us={a:.1f} mpi_us={b:.1f} "
              f"time_ratio={a / b:.2f} busbw_ratio={b / a:.2f} nodetour_busbw={busbw(a):.3f} "
              f"mpi_busbw={busbw(b):.3f} spread_us={spread(nt[size]):.1f}/{spread(mpi[size]):.1f} "
              f"batches={len(nt[size])}/{len(mpi[size])} target={'-' if ok is None else ('met' if ok else 'missed')}")
    for who, size in sorted(wrong):
        print(f"MPI_COMPARE WRONG {who} ranks={n} bytes={size}")
print(f"MPI_COMPARE_SUMMARY targets met {met} of {total}")
PY
exit $failed
