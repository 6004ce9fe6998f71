#!/usr/bin/env bash
# go.sh OUT STEP...: the device steps of issues 48-49 (session of 2026-12-07 evening), from a
# clone carrying .device/$PACK (scripts/gpu-pack.sh, or a subset of it) and, for `python`,
# target/wheels (scripts/python.sh --wheel).
# Each step is skipped once BUDGET seconds (default 520) have passed since the start.
set -uo pipefail
out=$1; shift
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export NODETOUR_REQUIRE_GPU=1 NODETOUR_CACHE_DIR=/tmp/nodetour-kernel-cache
r=$PWD/.device/${PACK:-run}
start=$SECONDS
chmod +x "$r"/* 2>/dev/null
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
cat "$r/VERSION"
tier() { # NAME BINARY [ARGS...]: one test binary, one test at a time
    local name=$1 bin=$2; shift 2
    (cd "$r" && timeout 300 "./$bin" --include-ignored --test-threads 1 "$@" >"$out/$name.log" 2>&1; echo "rc=$?" >>"$out/$name.log")
    grep -E '^test result|FAILED|panicked|WATCHDOG|^rc=' "$out/$name.log" | cut -c1-400 | head -40
}
for step in "$@"; do
    if (( SECONDS - start > ${BUDGET:-520} )); then echo "NOT_RUN $step (time)"; continue; fi
    t0=$SECONDS
    echo "##### $step"
    case $step in
        group|group-old) # under scripts/stacks.py: every thread's place if it hangs; the GPU's load then
            bin=communicator_devices_tests; [[ $step == group-old ]] && bin=old_devices_tests
            (sleep 75; nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader >"$out/$step.gpu" 2>&1) & smi=$!
            (cd "$r" && timeout 150 python3 "$OLDPWD/scripts/stacks.py" --after 80 --samples 3 --every 2 -- \
                "./$bin" --include-ignored --test-threads 1 --exact a_group_on_the_callers_per_thread_stream_is_ordered_on_it --nocapture \
                >"$out/$step.log" 2>&1; echo "rc=$?" >>"$out/$step.log")
            kill $smi 2>/dev/null; wait $smi 2>/dev/null
            grep -E '^test result|FAILED|panicked|round|STACKS|^rc=' "$out/$step.log" | cut -c1-300 | head -20
            cat "$out/$step.gpu" 2>/dev/null ;;
        reduce) tier reduce gpu_reduce_tests ;;
        devices) tier devices communicator_devices_tests --skip a_group_on_the_callers_per_thread_stream ;;
        devices-old) tier devices-old old_devices_tests --skip a_group_on_the_callers_per_thread_stream ;;
        comm-gpu) tier comm-gpu communicator_gpu_tests ;;
        one-kernel) tier one-kernel one_kernel_tests ;;
        capture) tier capture ring_capture_tests ;;
        gpu-tests) tier gpu-tests gpu_tests ;;
        ringall)
            (cd "$r" && timeout 300 ./launch-local.sh -n 2 --timeout 290 -- ./gpu_ring_check --all >"$out/ringall.log" 2>&1; echo "rc=$?" >>"$out/ringall.log")
            grep -E 'GPU_RING|rror|^rc=' "$out/ringall.log" | cut -c1-300 | head -20 ;;
        archeck)
            (cd "$r" && timeout 300 ./launch-local.sh -n 2 --timeout 290 -- ./allreduce_check --gpu --all >"$out/archeck.log" 2>&1; echo "rc=$?" >>"$out/archeck.log")
            grep -E 'ALLREDUCE|rror|^rc=' "$out/archeck.log" | cut -c1-300 | head -20 ;;
        trainmlp)
            (cd "$r" && timeout 240 ./launch-local.sh -n 2 --timeout 200 -- ./train_mlp --device gpu >"$out/trainmlp.log" 2>&1; echo "rc=$?" >>"$out/trainmlp.log")
            grep -E 'TRAIN_MLP|rror|^rc=' "$out/trainmlp.log" | cut -c1-300 | head -10 ;;
        compat)
            (cd "$r" && timeout 120 ./plain-cudarc >"$out/compat.log" 2>&1; echo "rc=$?" >>"$out/compat.log")
            tail -5 "$out/compat.log" ;;
        python)
            OUT=$out/python timeout 420 scripts/python-gpu.sh 2 >"$out/python.log" 2>&1; echo "rc=$?" >>"$out/python.log"
            tail -15 "$out/python.log" ;;
    esac
    echo "##### $step took $((SECONDS - t0)) s"
done
