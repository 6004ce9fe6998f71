#!/usr/bin/env bash
# go.sh OUT STEP...: issue 48's device steps, each skipped once 500 s have passed.
set -uo pipefail
out=$1; shift
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export COST_ROUNDS=${COST_ROUNDS:-1} JOB_TIMEOUT=${JOB_TIMEOUT:-60}
r=.device/run
start=$SECONDS
chmod +x $r/*/* 2>/dev/null
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for step in "$@"; do
  if (( SECONDS - start > ${BUDGET:-500} )); then echo "NOT_RUN $step (time)"; continue; fi
  t0=$SECONDS
  echo "##### $step"
  case $step in
    order|waits|per-thread|group|cost) scripts/drills/stream-order.sh $r/parent $r/fix $out/$step $step ;;
    differ) cp $r/fix/launch-local.sh $r/fix3/ 2>/dev/null; scripts/drills/stream-order.sh $r/parent $r/fix3 $out/differ differ ;;
    tier-*)
      b=${step#tier-}
      (cd $r/fix3 && NODETOUR_REQUIRE_GPU=1 NODETOUR_CACHE_DIR=$PWD/kernel-cache timeout 300 ./$b --include-ignored --test-threads 1 ${SKIP:+--skip $SKIP} >$out/$step.log 2>&1; echo "rc=$?" >>$out/$step.log)
      grep -E '^test result|FAILED|panicked|^rc=' $out/$step.log | head -20 ;;
    diag)
      (cd $r/fix3 && export NODETOUR_REQUIRE_GPU=1 NODETOUR_CACHE_DIR=$PWD/kernel-cache
       which gdb eu-stack; echo CUDA_MODULE_LOADING=${CUDA_MODULE_LOADING:-unset}
       NODETOUR_LOG=debug RUST_BACKTRACE=1 ./communicator_devices_tests --include-ignored --exact a_group_on_the_callers_per_thread_stream_is_ordered_on_it --nocapture >$out/diag-lazy.log 2>&1 &
       pid=$!; sleep 40; nvidia-smi --query-gpu=utilization.gpu --format=csv >>$out/diag-lazy.log
       if kill -0 $pid 2>/dev/null; then echo HUNG_LAZY; gdb -p $pid -batch -ex "thread apply all bt" >$out/diag-stacks.txt 2>&1 || eu-stack -p $pid >$out/diag-stacks.txt 2>&1; kill -9 $pid; else wait $pid; echo "lazy rc=$?"; fi
       CUDA_MODULE_LOADING=EAGER NODETOUR_LOG=debug timeout 40 ./communicator_devices_tests --include-ignored --exact a_group_on_the_callers_per_thread_stream_is_ordered_on_it --nocapture >$out/diag-eager.log 2>&1; echo "eager rc=$?")
      tail -5 $out/diag-lazy.log; tail -5 $out/diag-eager.log; grep -c . $out/diag-stacks.txt ;;
    ringall)
      (cd $r/fix3 && NODETOUR_CACHE_DIR=$PWD/kernel-cache timeout 300 ./launch-local.sh -n 2 --timeout 290 -- ./gpu_ring_check --all >$out/ringall.log 2>&1; echo "rc=$?" >>$out/ringall.log)
      grep -E 'GPU_RING|rror|^rc=' $out/ringall.log | head -20 ;;
  esac
  echo "##### $step took $((SECONDS - t0)) s"
done
