"""PyTorch's allreduces on the GPUs of one host, for issue 17's reference run
(scripts/compare/onehost-reference.sh runs this under torchrun, one process per GPU, beside nodetour).

Per size, each implementation in turn (interleaved within the size), one batch each:
  torch-nccl          dist.all_reduce (NCCL) on an ordinary tensor, eager
  torch-nccl-graph    the same captured in a CUDA graph and replayed
  symm-one-shot       torch.ops.symm_mem.one_shot_all_reduce_out on a symmetric buffer, eager
  symm-one-shot-graph the same in a graph
  symm-two-shot       torch.ops.symm_mem.two_shot_all_reduce_ (in place), eager
  symm-two-shot-graph the same in a graph
A batch: warm-up calls, then `iters` calls timed together with CUDA events (time per call, as
nccl-tests report it). Before timing, each implementation reduces a known pattern once and the
result is checked exactly (small integers, exact in bf16). Multicast is never used
(TORCH_SYMM_MEM_DISABLE_MULTICAST=1 is required; no multimem op is called).

Prints one line per (implementation, size):
  REF impl=NAME world=N bytes=B batch=K us=T busbw=G check=ok|wrong|SKIP(reason)
"""

import argparse
import os
import sys

import torch
import torch.distributed as dist


def parse_size(s):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(s[:-1]) * units[s[-1]] if s[-1] in units else int(s)


def sizes_of(spec, factor):
    lo, hi = (parse_size(x) for x in spec.split(":"))
    out, s = [], lo
    while s <= hi:
        out.append(s)
        s *= factor
    if out and out[-1] != hi:
        out.append(hi)
    return out


def pattern(numel, rank, device, dtype):
    # (rank + 1) * (i % 7): sums over up to 8 ranks stay below 256, exact in bf16.
    i = torch.arange(numel, device=device, dtype=torch.int32) % 7
    return ((rank + 1) * i).to(dtype)


def expected(numel, world, device, dtype):
    i = torch.arange(numel, device=device, dtype=torch.int32) % 7
    return (world * (world + 1) // 2 * i).to(dtype)


class Impl:
    """One implementation: `call()` runs one allreduce of the current size on the current
    stream; `load(x)` puts the input in place; `result()` is the reduced tensor."""

    def __init__(self, name, call, load, result, graph):
        self.name, self.call, self.load, self.result, self.graph = name, call, load, result, graph


def build(args, world, rank, device, dtype, max_numel):
    group = dist.group.WORLD.group_name
    impls = []
    plain = torch.empty(max_numel, device=device, dtype=dtype)
    state = {"n": 0}

    def view(t):
        return t[: state["n"]]

    impls.append(
        Impl(
            "torch-nccl",
            lambda: dist.all_reduce(view(plain)),
            lambda x: view(plain).copy_(x),
            lambda: view(plain),
            False,
        )
    )
    impls.append(Impl("torch-nccl-graph", impls[0].call, impls[0].load, impls[0].result, True))
    try:
        import torch.distributed._symmetric_memory as symm_mem

        symm = symm_mem.empty(max_numel, device=device, dtype=dtype)
        symm_mem.rendezvous(symm, group)
        out = torch.empty(max_numel, device=device, dtype=dtype)
        one = Impl(
            "symm-one-shot",
            lambda: torch.ops.symm_mem.one_shot_all_reduce_out(view(symm), "sum", group, view(out)),
            lambda x: view(symm).copy_(x),
            lambda: view(out),
            False,
        )
        two = Impl(
            "symm-two-shot",
            lambda: torch.ops.symm_mem.two_shot_all_reduce_(view(symm), "sum", group),
            lambda x: view(symm).copy_(x),
            lambda: view(symm),
            False,
        )
        for i in (one, two):
            impls.append(i)
            impls.append(Impl(i.name + "-graph", i.call, i.load, i.result, True))
    except Exception as e:  # no symmetric memory here: say so, never silently
        for name in ("symm-one-shot", "symm-one-shot-graph", "symm-two-shot", "symm-two-shot-graph"):
            impls.append(Impl(name, None, None, None, False))
        state["symm_error"] = f"{type(e).__name__}: {e}".replace("\n", " ")[:200]
    return impls, state


def time_batch(impl, iters, warmup, graph_calls):
    """Time per call (seconds) of `iters` calls after `warmup`; in a graph, `graph_calls` calls
    are captured once and the graph replayed until `iters` calls ran."""
    stream = torch.cuda.current_stream()
    if impl.graph:
        side = torch.cuda.Stream()
        side.wait_stream(stream)
        with torch.cuda.stream(side):
            for _ in range(max(warmup, 1)):
                impl.call()
        stream.wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(graph_calls):
                impl.call()
        replays = max(1, iters // graph_calls)
        g.replay()
        secs = timed(g.replay, replays) / (replays * graph_calls)
        del g
        return secs
    for _ in range(warmup):
        impl.call()
    return timed(impl.call, iters) / iters


def timed(step, n):
    """Seconds that `n` calls of `step` take on the current stream (CUDA events)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        step()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="8K:4G")
    ap.add_argument("--factor", type=int, default=4)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--large-iters", type=int, default=10, help="iterations from 256 MiB")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--graph-calls", type=int, default=10)
    ap.add_argument("--batch", type=int, default=1, help="the batch's number, for the lines")
    ap.add_argument("--only", default="", help="comma-separated implementation names")
    args = ap.parse_args()
    for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
        want = "0" if k == "NCCL_NVLS_ENABLE" else "1"
        if os.environ.get(k) != want:
            sys.exit(f"onehost_reference: export {k}={want} (no multicast objects on these machines)")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    torch.cuda.set_device(local % torch.cuda.device_count())
    device = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("nccl", device_id=device)
    dtype = torch.bfloat16
    es = torch.tensor([], dtype=dtype).element_size()
    sizes = sizes_of(args.sizes, args.factor)
    impls, state = build(args, world, rank, device, dtype, max(sizes) // es)
    only = {x for x in args.only.split(",") if x}
    if rank == 0 and args.batch == 1:
        print(
            f"REF_VERSIONS torch={torch.__version__} nccl={'.'.join(map(str, torch.cuda.nccl.version()))} "
            f"cuda={torch.version.cuda} gpu={torch.cuda.get_device_name(device)!r} world={world}",
            flush=True,
        )
    for size in sizes:
        numel = size // es
        state["n"] = numel
        iters = args.large_iters if size >= 256 << 20 else args.iters
        want = expected(numel, world, device, dtype)
        for impl in impls:
            if only and impl.name not in only:
                continue
            if impl.call is None:
                line = f"check=SKIP({state.get('symm_error', 'unavailable')})"
                us = busbw = float("nan")
            else:
                impl.load(pattern(numel, rank, device, dtype))
                impl.call()
                torch.cuda.synchronize()
                ok = bool(torch.equal(impl.result(), want))
                # All ranks agree on whether every rank was right.
                flag = torch.tensor([0 if ok else 1], device=device)
                dist.all_reduce(flag)
                secs = time_batch(impl, iters, args.warmup, args.graph_calls)
                us = secs * 1e6
                busbw = size / secs / 1e9 * 2 * (world - 1) / world if world > 1 else float("nan")
                line = "check=" + ("ok" if flag.item() == 0 else "wrong")
            if rank == 0:
                print(
                    f"REF impl={impl.name} world={world} bytes={size} batch={args.batch} "
                    f"us={us:.2f} busbw={busbw:.2f} {line}",
                    flush=True,
                )
            dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
