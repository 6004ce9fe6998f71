"""Every collective of the nodetour backend against the gloo backend on the same inputs.

Run under torchrun (2 or 4 processes): the default group is nodetour's, a gloo group of every
rank is the reference (on CPU copies of the same inputs). ``--device cuda`` runs nodetour's
side on CUDA tensors (rank r on GPU r mod count). Every call gets inputs of its own (seeded by
the call's index and the rank). Prints ``COLLECTIVES OK rank=R world=W calls=N`` and exits 0,
else raises.
"""

import os
import sys

import torch
import torch.distributed as dist

import nodetour.torch as nt

dist.init_process_group("nodetour")
rank, world = dist.get_rank(), dist.get_world_size()
gloo = dist.new_group(backend="gloo")
calls = 0
dev = torch.device("cpu")
if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1] == "cuda":
    torch.cuda.set_device(rank % torch.cuda.device_count())
    dev = torch.device("cuda", torch.cuda.current_device())


def ours(x):
    """A copy of ``x`` for nodetour's side (on ``dev``)."""
    return x.clone().to(dev)


def data(shape, dtype, seed):
    """Input of call ``seed`` on this rank: small integers (exact in every type and order)."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    x = torch.randint(-8, 9, shape, generator=g)
    if dtype == torch.bool:
        return x > 0
    if dtype in (torch.uint8,):
        return (x + 8).to(dtype)
    return x.to(dtype)


def same(a, b, what):
    global calls
    calls += 1
    a, b = a.cpu(), b.cpu()
    if a.dtype.is_floating_point or a.dtype.is_complex:
        ok = torch.allclose(a.double() if not a.is_complex() else a, b.double() if not b.is_complex() else b, rtol=1e-2, atol=1e-2)
    else:
        ok = torch.equal(a, b)
    if not ok:
        raise AssertionError(f"rank {rank}: {what}: nodetour {a.flatten()[:8]} gloo {b.flatten()[:8]}")


SUM_TYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int32, torch.int64, torch.int8, torch.uint8]
seed = 0
for dtype in SUM_TYPES:
    for op in [dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN, dist.ReduceOp.PRODUCT, dist.ReduceOp.AVG]:
        if op == dist.ReduceOp.AVG and not dtype.is_floating_point:
            continue  # gloo has no integer average
        if op == dist.ReduceOp.PRODUCT:
            x = data((37,), dtype, seed).clamp(-2, 2)
            if dtype == torch.uint8:
                x = x.clamp(1, 2)
        else:
            x = data((37,), dtype, seed)
        seed += 1
        a, b = ours(x), x.clone()
        dist.all_reduce(a, op=op)
        dist.all_reduce(b, op=op, group=gloo)
        same(a, b, f"all_reduce {dtype} {op}")

# Out of the standard shapes: a non-contiguous tensor, bool, complex, several at once.
x = data((8, 6), torch.float32, seed).t()
seed += 1
a, b = ours(x).t().contiguous().t(), x.clone()
assert not a.is_contiguous()
dist.all_reduce(a)
dist.all_reduce(b, group=gloo)
same(a, b, "all_reduce of a non-contiguous tensor")
flags = data((19,), torch.bool, seed)
seed += 1
a = ours(flags)
dist.all_reduce(a, op=dist.ReduceOp.MAX)
b = flags.to(torch.uint8)
dist.all_reduce(b, op=dist.ReduceOp.MAX, group=gloo)
same(a.to(torch.uint8), b, "all_reduce of bool")
z = torch.complex(data((9,), torch.float32, seed), data((9,), torch.float32, seed + 1))
seed += 2
a, b = ours(z), z.clone()
dist.all_reduce(a)
dist.all_reduce(b, group=gloo)
same(a, b, "all_reduce of complex64")
many = [data((n,), torch.float32, seed + n) for n in (1, 5, 300)]
seed += 400
mine = [ours(t) for t in many]
dist.all_reduce_coalesced(mine)
ref = [t.clone() for t in many]
dist.all_reduce_coalesced(ref, group=gloo)
for o, r in zip(mine, ref):
    same(o, r, "all_reduce_coalesced")

# PREMUL_SUM: each rank's own factor (torch ≥ 2.15 exposes it to Python).
if hasattr(dist, "_make_nccl_premul_sum"):
    x = data((33,), torch.float32, seed)
    seed += 1
    a = x.clone()
    try:
        dist.all_reduce(a, op=dist._make_nccl_premul_sum(0.5 + rank))
        want = x * (0.5 + rank)
        dist.all_reduce(want, group=gloo)
        same(a, want, "all_reduce PREMUL_SUM")
    except NotImplementedError as e:
        print(f"rank {rank}: PREMUL_SUM skipped: {e}", file=sys.stderr)

# all_gather: the list form and into one tensor.
for dtype in [torch.float32, torch.int64, torch.bfloat16]:
    x = data((13,), dtype, seed)
    seed += 1
    outs = [torch.empty_like(x, device=dev) for _ in range(world)]
    refs = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(outs, ours(x))
    dist.all_gather(refs, x, group=gloo)
    for o, r in zip(outs, refs):
        same(o, r, f"all_gather {dtype}")
    flat = torch.empty(world * 13, dtype=dtype, device=dev)
    ref = torch.empty(world * 13, dtype=dtype)
    dist.all_gather_into_tensor(flat, ours(x))
    dist.all_gather_into_tensor(ref, x, group=gloo)
    same(flat, ref, f"all_gather_into_tensor {dtype}")

# reduce_scatter: the list form and from one tensor.
for op in [dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.AVG]:
    x = data((world * 11,), torch.float32, seed)
    seed += 1
    out, ref = torch.empty(11, device=dev), torch.empty(11)
    dist.reduce_scatter_tensor(out, ours(x), op=op)
    dist.reduce_scatter_tensor(ref, x, op=op, group=gloo)
    same(out, ref, f"reduce_scatter_tensor {op}")
    parts = list(ours(x).chunk(world))
    out2 = torch.empty(11, device=dev)
    dist.reduce_scatter(out2, parts, op=op)
    same(out2, ref, f"reduce_scatter {op}")

# broadcast from every root; barrier.
for root in range(world):
    x = data((29,), torch.float64, seed)
    seed += 1
    a, b = ours(x), x.clone()
    dist.broadcast(a, src=root)
    dist.broadcast(b, src=root, group=gloo)
    same(a, b, f"broadcast from {root}")
dist.barrier()

# Asynchronous calls return a finished work with a future.
x = data((7,), torch.float32, seed)
seed += 1
work = dist.all_reduce(ours(x), async_op=True)
work.wait()
assert work.is_completed()
fut = dist.all_reduce(ours(x), async_op=True).get_future()
(got,) = fut.wait()
want = x.clone()
dist.all_reduce(want, group=gloo)
same(got, want, "the future's value")

# Point-to-point on host memory: a ring both ways with irecv and isend (every rank posts its
# receives first), then blocking send/recv (even ranks send first), each checked.
if dev.type == "cpu":
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    for seed_p2p, (dtype, n) in enumerate([(torch.float32, 1000), (torch.int64, 3), (torch.bfloat16, 70000)]):
        mine = data((n,), dtype, seed + 100 + seed_p2p)
        from_prev, from_next = torch.zeros(n, dtype=dtype), torch.zeros(n, dtype=dtype)
        # What batch_isend_irecv does for a backend without coalescing (torch 2.15 refuses to
        # call it for a Python process group: it asks for a C++ backend object first).
        works = [
            dist.irecv(from_prev, prv),
            dist.irecv(from_next, nxt),
            dist.isend(mine, nxt),
            dist.isend(mine, prv),
        ]
        for w in works:
            w.wait()
        def theirs(r):
            g = torch.Generator().manual_seed((seed + 100 + seed_p2p) * 1000 + r)
            return torch.randint(-8, 9, (n,), generator=g).to(dtype)

        same(from_prev, theirs(prv), f"irecv from the previous rank ({dtype})")
        same(from_next, theirs(nxt), f"irecv from the next rank ({dtype})")
        calls += 1
    x = torch.full((5,), float(rank))
    y = torch.empty(5)
    if rank % 2 == 0:
        dist.send(x, dst=nxt)
        dist.recv(y, src=prv)
    else:
        dist.recv(y, src=prv)
        dist.send(x, dst=nxt)
    same(y, torch.full((5,), float(prv)), "send and recv around the ring")
    assert "peer link to rank" in nt.comm().paths() or world == 1, nt.comm().paths()
    calls += 1

# What is not built says so, naming the operation.
for name, call in [
    ("alltoall_base", lambda: dist.all_to_all_single(torch.empty(world, device=dev), torch.ones(world, device=dev))),
    ("reduce", lambda: dist.reduce(torch.ones(1, device=dev), dst=0)),
] + ([("send", lambda: dist.send(torch.ones(1, device=dev), dst=(rank + 1) % world))] if dev.type == "cuda" else []):
    try:
        call()
    except NotImplementedError as e:  # torch may wrap it, keeping the message
        assert "nodetour" in str(e), e
    except RuntimeError as e:
        assert "nodetour" in str(e) and "not built" in str(e), e
    else:
        raise AssertionError(f"{name} did not refuse")

# A subgroup of the first two ranks (a communicator of its own, formed through its own store
# prefix; torch calls the backend on members only), beside the default group.
sub = dist.new_group(ranks=[0, 1], backend="nodetour")
if rank < 2:
    x = data((17,), torch.int32, seed)
    a = ours(x)
    dist.all_reduce(a, group=sub)
    want = sum(
        torch.randint(-8, 9, (17,), generator=torch.Generator().manual_seed(seed * 1000 + r)).to(torch.int32)
        for r in range(2)
    )
    same(a, want, "all_reduce in a subgroup of ranks 0 and 1")
    assert nt.comm(sub).paths().startswith(f"rank {rank}/2"), nt.comm(sub).paths()
seed += 1
dist.barrier()

# The store never sees the job token: with one, rank 0 publishes its address alone.
pg = dist.distributed_c10d._get_default_group()
token = os.environ.get("NODETOUR_JOB_TOKEN")
if token:
    assert set(pg.published) <= {"nodetour/address"}, pg.published
    assert all(token not in v for v in pg.published.values()), pg.published
    assert "unauthenticated" not in nt.comm().paths(), nt.comm().paths()
else:
    # Unauthenticated, keyed by a name rank 0 drew: warned, and paths() says so.
    assert set(pg.published) <= {"nodetour/address", "nodetour/job"}, pg.published
    assert "unauthenticated" in nt.comm().paths(), nt.comm().paths()
paths = nt.comm().paths()
assert f"rank {rank}/{world}" in paths, paths
dist.barrier()
if dev.type == "cuda":
    torch.cuda.synchronize()
print(f"COLLECTIVES OK rank={rank} world={world} device={dev.type} calls={calls}")
dist.destroy_process_group()
