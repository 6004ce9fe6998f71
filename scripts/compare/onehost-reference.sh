#!/usr/bin/env bash
# onehost-reference.sh: issue 17's reference run, on the GPU machine, from the packed directory
# (scripts/gpu-pack.sh copies it there with onehost_reference.py):
#   ./onehost-reference.sh OUTDIR [small|large|cost|pipeline] [--rounds N] [--gpus N] [--mps]
# One allreduce (bf16 sum), the same sizes for every implementation, rounds interleaved: per
# round PyTorch's implementations (dist.all_reduce over NCCL and symmetric memory's one-shot and
# two-shot, eager and in a CUDA graph, interleaved within each size: onehost_reference.py under
# torchrun), then nodetour's per-process GPU ring (direct and staged, with NCCL called from our
# binary on the same buffers; up to 1 MiB the direct column is the one-kernel path where the GPUs
# are the ranks' own, and the small part runs the ring beside it with that path off:
# nodetour-ring-direct; each path also captured into a CUDA graph and replayed:
# nodetour-direct-graph, nodetour-staged-graph), then nodetour's one-process ring over the GPUs
# (`--gpus`).
# Per implementation and size: the median over rounds (5 by default with two GPUs) and its spread, as
# ONEHOST lines, and per size the fastest of ours against the fastest reference (ONEHOST_BEST).
#   small: 16 KiB to 64 MiB by 4, 50 iterations;  large: 256 MiB to 4 GiB by 4, 10 iterations;
#   cost: the honest cost, 64 KiB to 256 MiB by 4, 20 iterations: nodetour's per-process direct
#   path (as shipped, and with the ring's kernels capped at 32 blocks: NODETOUR_RING_BLOCKS)
#   and NCCL from our binary, each beside a compute load on another stream of every GPU
#   (`nodetour perf --beside-compute`): busbw beside compute, and the share of the compute's
#   throughput each leaves (ONEHOST_COST lines); PyTorch's references are not run in this part.
#   pipeline: the per-process ring's chunking, 64 KiB to 256 MiB by 4, 20 iterations:
#   NODETOUR_SHM_PIPELINE and NODETOUR_IPC_PIPELINE at 1 (whole slots), 2, 4 and 8, and the
#   staged path with every chunk copied in before its reduce (NODETOUR_SHM_READ_MAX=0), the
#   direct path with the one-kernel two-shot path up to 4 and 32 MiB (NODETOUR_ONE_KERNEL_MAX),
#   received copies by the copy engine (NODETOUR_SLOT_COPY_KERNEL_MAX=0) or by a kernel up to 16 MiB,
#   interleaved within each round, direct and staged, beside the copy ceilings and, with two
#   GPUs, NCCL (NCCL_P2P_DISABLE=1 beside the staged path: NCCL's own staging through host
#   memory); ONEHOST_PIPE lines give each variant's busbw against d1 in the same round
#   (PIPELINE_VARIANTS="d1 copyin" runs only those; d1 is the reference, keep it).
#   --mps: run nodetour's processes under an MPS daemon of this script's own (a private pipe
#   directory, stopped at the end): on one GPU the two ranks then run at once instead of taking
#   turns, so the staged path's copies and the hand-offs are timed for real (one GPU's PCIe link
#   and copy engines shared by both ranks, HBM in place of NVLink: a substitute, not the figures).
# Each part is one command of well under 10 minutes on two H200s.
# With one GPU, nothing here is a measurement: PyTorch runs as a world of one (the script's own
# check), nodetour's ring runs two processes on the shared GPU (correctness only), and NCCL and
# the one-process ring are skipped (SKIP lines). Multicast is off in every process.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
out=${1:?usage: ./onehost-reference.sh OUTDIR [small|large|cost] [--rounds N] [--gpus N]}
part=${2:-small}
shift $(($# >= 2 ? 2 : 1))
rounds= gpus=$(nvidia-smi -L 2>/dev/null | wc -l) mps=0
while (($#)); do
    case $1 in
        --rounds) rounds=$2; shift 2 ;;
        --gpus) gpus=$2; shift 2 ;;
        --mps) mps=1; shift ;;
        *) echo "usage: ./onehost-reference.sh OUTDIR [small|large|cost|pipeline] [--rounds N] [--gpus N] [--mps]" >&2; exit 2 ;;
    esac
done
case $part in
    small) sizes=16K:64M iters=50 ;;
    large) sizes=256M:4G iters=10 ;;
    cost|pipeline) sizes=64K:256M iters=20 ;;
    *) echo "part: small, large, cost or pipeline" >&2; exit 2 ;;
esac
# Five rounds where they measure something; on one GPU (a check of the script: two processes
# share the GPU, the large part alone takes ~3 minutes a round) two and one.
if [[ -z $rounds ]]; then
    if [[ $part == cost || $part == pipeline ]]; then rounds=$((gpus >= 2 ? 3 : 2))
    elif [[ $gpus -ge 2 ]]; then rounds=5; elif [[ $part == small ]]; then rounds=2; else rounds=1; fi
fi
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export NODETOUR_CACHE_DIR=$PWD/kernel-cache NODETOUR_LOG=${NODETOUR_LOG:-warn}
mkdir -p "$out"
log=$out/onehost-$part.log
: >"$log"
if [[ $gpus -lt 1 ]]; then
    echo "SKIP onehost-reference: no GPU" | tee -a "$log"
    exit 0
fi
world=$((gpus >= 2 ? 2 : 1)) ranks=2
echo "onehost-reference: $part, sizes $sizes, $rounds rounds, $gpus GPU(s): $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1); nodetour $(cat VERSION 2>/dev/null || ./nodetour --version)" | tee -a "$log"
if [[ $gpus -lt 2 && $part == pipeline ]]; then
    echo "SKIP NCCL on one GPU: it refuses two ranks on one GPU; nodetour's ring runs as two processes sharing the GPU (with --mps at once: a substitute, else taking turns: correctness only)" | tee -a "$log"
elif [[ $gpus -lt 2 ]]; then
    echo "SKIP references on one GPU: PyTorch runs as a world of one (a check of this script, not a reference), nodetour's ring as two processes sharing the GPU (correctness only); NCCL and the one-process ring need two GPUs" | tee -a "$log"
fi
failed=0
if ((mps)); then
    # A daemon of our own: only processes given this pipe directory become its clients.
    export CUDA_MPS_PIPE_DIRECTORY=$PWD/mps-pipe CUDA_MPS_LOG_DIRECTORY=$PWD/mps-log
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    if nvidia-cuda-mps-control -d; then
        trap 'echo quit | nvidia-cuda-mps-control >/dev/null 2>&1' EXIT
        echo "onehost-reference: under MPS (pipe $CUDA_MPS_PIPE_DIRECTORY): the ranks run at once" | tee -a "$log"
    else
        echo "SKIP MPS: nvidia-cuda-mps-control -d failed (the ranks take turns on a shared GPU)" | tee -a "$log"
        unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
    fi
fi
if [[ $part == pipeline ]]; then
    # Variants: d1 (whole slots, the default), d2, d4, d8 (both paths' pipelines); staged only,
    # copyin (every chunk copied into GPU scratch by the copy engine before its reduce,
    # NODETOUR_SHM_READ_MAX=0, where the default reduces chunks up to 1 MiB straight out of the
    # host slot); direct only, ok4m and ok32m (the one-kernel two-shot path up to 4 or 32 MiB,
    # NODETOUR_ONE_KERNEL_MAX, where the default hands over to the ring above 1 MiB: with GPUs
    # of their own; ranks sharing a GPU never take that path, so there they repeat d1); ck0
    # (received copies by the copy engine and a credit kernel, NODETOUR_SLOT_COPY_KERNEL_MAX=0,
    # where the default copies chunks up to 1 MiB out of the slot by one kernel that credits
    # it; direct only: host slots always take the copy engine) and ck16m (that kernel up to
    # 16 MiB).
    for r in $(seq 1 "$rounds"); do
        for variant in ${PIPELINE_VARIANTS:-d1 d2 d4 d8 copyin ck0 ck16m ok4m ok32m}; do
            for path in direct staged; do
                [[ $variant == copyin && $path == direct ]] && continue
                [[ $variant == ok* && $path == staged ]] && continue
                [[ $variant == ck* && $path == staged ]] && continue
                case $variant in
                    d*) knobs=(NODETOUR_SHM_PIPELINE=${variant#d} NODETOUR_IPC_PIPELINE=${variant#d}) ;;
                    copyin) knobs=(NODETOUR_SHM_READ_MAX=0) ;;
                    ok*) knobs=(NODETOUR_ONE_KERNEL_MAX=$((${variant//[^0-9]/} << 20))) ;;
                    ck0) knobs=(NODETOUR_SLOT_COPY_KERNEL_MAX=0) ;;
                    ck16m) knobs=(NODETOUR_SLOT_COPY_KERNEL_MAX=$((16 << 20))) ;;
                    *) echo "PIPELINE_VARIANTS: unknown variant $variant" >&2; exit 2 ;;
                esac
                cmp=(--compare ceiling) p2p=()
                # NCCL beside d1 only (its own staging for the staged path).
                if [[ $gpus -ge 2 && $variant == d1 ]]; then
                    cmp=(--compare nccl,ceiling)
                    [[ $path == staged ]] && p2p=(NCCL_P2P_DISABLE=1)
                fi
                if env "${p2p[@]}" "${knobs[@]}" timeout 300 \
                    ./launch-local.sh -n "$ranks" --timeout 280 -- ./nodetour perf --gpu --path "$path" "${cmp[@]}" \
                    --dtype bf16 --sizes "$sizes" --factor 4 --iters "$iters" --warmup 3 --format csv >"$out/nt.tmp" 2>&1; then
                    grep -h 'ceilings:' "$out/nt.tmp" | head -n 1 | sed "s/^/round=$r variant=$variant $path /" >>"$log"
                    sed -n 's/^\[rank 0\] //p' "$out/nt.tmp" | grep -E '^[0-9]+,' | sed "s/^/NT_PIPE round=$r variant=$variant /" >>"$log"
                else
                    echo "onehost-reference: the pipeline run failed (round $r, $path, $variant)"; tail -5 "$out/nt.tmp"; failed=1
                fi
            done
        done
    done
    rm -f "$out/nt.tmp"
    # bytes,count,path,time_us,busbw,correct,ceiling,vs_ceiling,nccl_us,nccl_busbw,nccl_correct,ratio
    python3 - "$log" "$gpus" "$mps" <<'PY' | tee "$out/onehost-pipeline-summary.txt"
import re, statistics, sys
log, gpus, mps = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
rows = {}  # (path, variant, bytes) -> {round: fields}
for line in open(log, errors="replace"):
    m = re.match(r"NT_PIPE round=(\d+) variant=(\S+) (.*)", line)
    if m:
        f = m[3].split(",")
        rows.setdefault((f[2], m[2], int(f[0])), {})[int(m[1])] = f
med = lambda v: statistics.median(v) if v else float("nan")
bad = False
note = "" if gpus >= 2 else (" (one GPU under MPS: a substitute)" if mps else " (one GPU, ranks taking turns: not a measurement)")
for (path, variant, b), by_round in sorted(rows.items()):
    ok = all(f[5] == "true" and f[10] in ("", "true") for f in by_round.values())
    bad |= not ok
    one = rows.get((path, "d1", b), {})
    # Against d1 of the same round, then the median of those ratios.
    ratios = [float(f[4]) / float(one[r][4]) for r, f in by_round.items() if r in one and float(one[r][4]) > 0]
    bw = med([float(f[4]) for f in by_round.values()])
    ceil = med([float(f[6]) for f in by_round.values() if f[6]])
    nccl = med([float(f[9]) for f in by_round.values() if len(f) > 9 and f[9]])
    print(f"ONEHOST_PIPE path={path} variant={variant} bytes={b} busbw={bw:.2f} vs_d1={med(ratios):.3f} "
          f"spread_vs_d1={(max(ratios) - min(ratios)) if ratios else float('nan'):.3f} ceiling={ceil:.1f} "
          f"nccl_busbw={nccl:.2f} rounds={len(by_round)} check={'ok' if ok else 'wrong'}{note}")
sys.exit(1 if bad or not rows else 0)
PY
    [[ ${PIPESTATUS[0]} == 0 ]] || failed=1
    echo "onehost-reference: failed=$failed"
    exit "$failed"
fi
if [[ $part == cost ]]; then
    compare=()
    [[ $gpus -ge 2 ]] && compare=(--compare nccl)
    # Ours as shipped (blocks=0: up to 4 x SMs per kernel), then with the ring's kernels capped
    # at 32 blocks (NODETOUR_RING_BLOCKS; about NCCL's channel count), NCCL beside the first.
    for r in $(seq 1 "$rounds"); do
        for blocks in 0 32; do
            cmp=("${compare[@]}")
            [[ $blocks == 0 ]] || cmp=()
            if NODETOUR_RING_BLOCKS=$blocks timeout 500 ./launch-local.sh -n "$ranks" --timeout 480 -- ./nodetour perf --gpu --path direct "${cmp[@]}" \
                --beside-compute --dtype bf16 --sizes "$sizes" --factor 4 --iters "$iters" --warmup 3 --format csv >"$out/nt.tmp" 2>&1; then
                grep -h 'compute load' "$out/nt.tmp" | head -n 2 >>"$log"
                sed -n 's/^\[rank 0\] //p' "$out/nt.tmp" | grep -E '^[0-9]+,' | sed "s/^/NT_COST round=$r blocks=$blocks /" >>"$log"
            else
                echo "onehost-reference: the cost run failed (round $r, NODETOUR_RING_BLOCKS=$blocks)"; tail -5 "$out/nt.tmp"; failed=1
            fi
        done
    done
    rm -f "$out/nt.tmp"
    # bytes,count,path,time_us,busbw,correct,ceiling,vs_ceiling,nccl_us,nccl_busbw,nccl_correct,ratio,compute_share,nccl_compute_share
    python3 - "$log" <<'PY' | tee "$out/onehost-cost-summary.txt"
import re, statistics, sys
rows = {}
for line in open(sys.argv[1], errors="replace"):
    m = re.match(r"NT_COST round=\d+ blocks=(\d+) (.*)", line)
    if m:
        f = m[2].split(",")
        rows.setdefault((int(m[1]), int(f[0])), []).append(f)
def med(v):
    v = [float(x) for x in v if x]
    return f"{statistics.median(v):.3f}" if v else "-"
bad = False
for (blocks, b), fs in sorted(rows.items()):
    ok = all(f[5] == "true" and f[10] in ("", "true") for f in fs)
    bad |= not ok
    print(f"ONEHOST_COST blocks={blocks or 'default'} bytes={b} busbw={med(f[4] for f in fs)} nccl_busbw={med(f[9] for f in fs)} "
          f"compute_share={med(f[12] for f in fs)} nccl_compute_share={med(f[13] for f in fs)} "
          f"rounds={len(fs)} check={'ok' if ok else 'wrong'}")
sys.exit(1 if bad or not rows else 0)
PY
    [[ ${PIPESTATUS[0]} == 0 ]] || failed=1
    echo "onehost-reference: failed=$failed"
    exit "$failed"
fi
for r in $(seq 1 "$rounds"); do
    echo "== round $r" >>"$log"
    timeout 300 torchrun --standalone --nproc-per-node="$world" onehost_reference.py \
        --sizes "$sizes" --factor 4 --iters "$iters" --large-iters "$iters" --batch "$r" >>"$log" 2>&1 ||
        { echo "onehost-reference: the PyTorch run failed (round $r; see $log)"; failed=1; }
    compare=() nt_path=both
    [[ $gpus -ge 2 ]] && compare=(--compare nccl)
    if timeout 300 ./launch-local.sh -n "$ranks" --timeout 280 -- ./nodetour perf --gpu --path "$nt_path" "${compare[@]}" \
        --graph --dtype bf16 --sizes "$sizes" --factor 4 --iters "$iters" --warmup 3 --format csv >"$out/nt.tmp" 2>&1; then
        sed -n 's/^\[rank 0\] //p' "$out/nt.tmp" | grep -E '^[0-9]+,' | sed "s/^/NT_PROCESS round=$r /" >>"$log"
    else
        echo "onehost-reference: nodetour's per-process ring failed (round $r)"; tail -5 "$out/nt.tmp"; failed=1
    fi
    # With GPUs of their own the ranks take the one-kernel path up to 1 MiB (the direct column):
    # the stream-ordered ring beside it at those sizes, the path turned off.
    if [[ $gpus -ge 2 && $part == small ]]; then
        if NODETOUR_ONE_KERNEL=off timeout 300 ./launch-local.sh -n "$ranks" --timeout 280 -- ./nodetour perf --gpu \
            --path direct --dtype bf16 --sizes 16K:1M --factor 4 --iters "$iters" --warmup 3 --format csv >"$out/nt.tmp" 2>&1; then
            sed -n 's/^\[rank 0\] //p' "$out/nt.tmp" | grep -E '^[0-9]+,' | sed "s/^/NT_RING round=$r /" >>"$log"
        else
            echo "onehost-reference: nodetour's ring with the one-kernel path off failed (round $r)"; tail -5 "$out/nt.tmp"; failed=1
        fi
    fi
    if [[ $gpus -ge 2 ]]; then
        if timeout 300 ./nodetour perf --gpus "$(seq -s, 0 $((world - 1)))" --dtype bf16 --sizes "$sizes" --factor 4 \
            --iters "$iters" --warmup 3 --format csv >"$out/nt.tmp" 2>&1; then
            grep -E '^[0-9]+,' "$out/nt.tmp" | sed "s/^/NT_ONEPROC round=$r /" >>"$log"
        else
            echo "onehost-reference: nodetour's one-process ring failed (round $r)"; tail -5 "$out/nt.tmp"; failed=1
        fi
    fi
done
rm -f "$out/nt.tmp"
grep -h REF_VERSIONS "$log" | head -n 1
python3 - "$log" "$world" "$gpus" <<'PY' | tee "$out/onehost-$part-summary.txt"
import math, re, statistics, sys
log, world, gpus = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rows = {}  # (impl, bytes) -> [us per round]
wrong = set()
skipped = {}
def add(impl, b, us, ok):
    if not math.isnan(us):
        rows.setdefault((impl, b), []).append(us)
    if not ok:
        wrong.add((impl, b))
for line in open(log, errors="replace"):
    m = re.match(r"REF impl=(\S+) world=\d+ bytes=(\d+) batch=\d+ us=(\S+) busbw=\S+ check=(\S+)", line)
    if m:
        if m[4].startswith("SKIP"):
            skipped[m[1]] = m[4]
            continue
        add(m[1], int(m[2]), float(m[3]), m[4] == "ok")
        continue
    m = re.match(r"NT_(PROCESS|ONEPROC|RING) round=\d+ (.*)", line)
    if m:
        f = m[2].split(",")
        # bytes,count,path,time_us,busbw,correct,ceiling,vs_ceiling,nccl_us,nccl_busbw,nccl_correct,ratio
        b, path, us, ok = int(f[0]), f[2], float(f[3]), f[5] == "true"
        impl = "nodetour-" + {"ONEPROC": "one-process", "RING": "ring-" + path}.get(m[1], path)
        add(impl, b, us, ok)
        if m[1] == "PROCESS" and len(f) > 10 and f[8] and path in ("direct", "auto"):
            add("nccl-from-nodetour", b, float(f[8]), f[10] == "true")
for impl, why in sorted(skipped.items()):
    print(f"SKIP impl={impl} {why}")
n = world if world > 1 else 2
def busbw(b, us):
    return b / (us * 1e-6) / 1e9 * 2 * (n - 1) / n
ours = lambda i: i.startswith("nodetour")
for b in sorted({k[1] for k in rows}):
    best = {}
    for (impl, bb), v in sorted(rows.items()):
        if bb != b:
            continue
        med = statistics.median(v)
        print(f"ONEHOST bytes={b} impl={impl} median_us={med:.2f} spread_us={max(v) - min(v):.2f} "
              f"busbw={busbw(b, med):.1f} rounds={len(v)} check={'wrong' if (impl, b) in wrong else 'ok'}")
        side = "ours" if ours(impl) else "ref"
        if side not in best or med < best[side][1]:
            best[side] = (impl, med)
    if "ours" in best and "ref" in best:
        (oi, ot), (ri, rt) = best["ours"], best["ref"]
        note = "" if gpus >= 2 else " (one GPU: not a measurement)"
        print(f"ONEHOST_BEST bytes={b} ours={oi}:{ot:.2f}us ref={ri}:{rt:.2f}us time_ratio={ot / rt:.2f}{note}")
if wrong:
    print("ONEHOST_WRONG " + " ".join(f"{i}@{b}" for i, b in sorted(wrong)))
    sys.exit(1)
PY
[[ ${PIPESTATUS[0]} == 0 ]] || failed=1
echo "onehost-reference: failed=$failed"
exit "$failed"
