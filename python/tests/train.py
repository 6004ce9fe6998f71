"""Data-parallel training with a torch.distributed backend, checked against one process.

    torchrun --nproc-per-node N train.py --mode ddp|fsdp --backend nodetour|gloo [--device cpu|cuda]
        [--out params.pt]

Every rank trains the same small MLP on its shard of one synthetic batch (DDP, or FSDP2's
``fully_shard`` on a one-dimensional mesh); rank 0 also trains the model alone on the whole
batch. The final parameters must equal the one-process ones within float rounding; rank 0
writes them to ``--out`` (so a driver compares backends). ``--die-at STEP`` makes the last rank
exit at that step: every other rank must then raise an error naming it (printed as
``SURVIVOR OK``). Prints ``TRAIN OK mode=.. backend=.. rank=.. world=.. distance=..``.
"""

import argparse
import copy
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

import nodetour.torch  # noqa: F401  (registers the backend)

p = argparse.ArgumentParser()
p.add_argument("--mode", choices=["ddp", "fsdp"], required=True)
p.add_argument("--backend", default="nodetour")
p.add_argument("--device", default="cpu")
p.add_argument("--steps", type=int, default=8)
p.add_argument("--out")
p.add_argument("--die-at", type=int)
args = p.parse_args()

if args.backend == "nccl":
    # Every rank on one GPU (the lent machine): NCCL takes each for a host of its own.
    os.environ.setdefault("NCCL_HOSTID", f"nodetour-test-{os.environ.get('RANK', '0')}")
dist.init_process_group(args.backend)
rank, world = dist.get_rank(), dist.get_world_size()
if args.device == "cuda":
    # One GPU may hold every rank (the lent machine): rank r on GPU r mod count.
    torch.cuda.set_device(rank % torch.cuda.device_count())
    device = torch.device("cuda", torch.cuda.current_device())
else:
    device = torch.device("cpu")

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8), nn.Tanh(), nn.Linear(8, 4)).to(device)
reference = copy.deepcopy(model)
batch = 8 * world
g = torch.Generator().manual_seed(1)
x = torch.randn(batch, 16, generator=g).to(device)
t = torch.randn(batch, 4, generator=g).to(device)
shard = slice(rank * batch // world, (rank + 1) * batch // world)
lr = 0.05

if args.mode == "ddp":
    from torch.nn.parallel import DistributedDataParallel as DDP

    wrapped = DDP(model, device_ids=None, bucket_cap_mb=0.001)  # several buckets
else:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    wrapped = fully_shard(model, mesh=mesh)

opt = torch.optim.SGD(wrapped.parameters(), lr=lr)
try:
    for step in range(args.steps):
        if args.die_at is not None and step == args.die_at and rank == world - 1:
            print(f"rank {rank}: exiting at step {step}", flush=True)
            os._exit(17)
        opt.zero_grad()
        loss = ((wrapped(x[shard]) - t[shard]) ** 2).mean()
        loss.backward()
        opt.step()
except Exception as e:  # noqa: BLE001 (the drill checks what it says)
    if args.die_at is None:
        raise
    dead = world - 1
    message = str(e)
    assert f"rank {dead}" in message, f"rank {rank}: the error does not name rank {dead}: {message}"
    print(f"SURVIVOR OK rank={rank} error={message[:300]!r}", flush=True)
    os._exit(0)
if args.die_at is not None:
    raise SystemExit(f"rank {rank}: rank {world - 1} died at step {args.die_at}, and no call failed")


def full(p):
    """A parameter whole on every rank: FSDP2's shards (torch.chunk of dim 0) gathered through
    the backend itself (not DTensor's functional collectives, which torch 2.11 routes past a
    Python process group)."""
    if not hasattr(p, "to_local"):
        return p
    local = p.to_local().detach()
    rows = p.shape[0]
    per = -(-rows // world)
    padded = torch.zeros((per,) + tuple(p.shape[1:]), dtype=local.dtype, device=local.device)
    padded[: local.shape[0]] = local
    whole = torch.empty((per * world,) + tuple(p.shape[1:]), dtype=local.dtype, device=local.device)
    dist.all_gather_into_tensor(whole, padded)
    return whole[:rows]


final = [full(p).detach().cpu() for p in wrapped.parameters()]
if rank == 0:
    ref_opt = torch.optim.SGD(reference.parameters(), lr=lr)
    for step in range(args.steps):
        ref_opt.zero_grad()
        ((reference(x) - t) ** 2).mean().backward()
        ref_opt.step()
    want = [p.detach().cpu() for p in reference.parameters()]
    distance = max((a - b).abs().max().item() for a, b in zip(final, want))
    if distance > 1e-5:
        sys.exit(f"rank 0: {args.mode} with {args.backend} is {distance:.2e} from one process")
    if args.out:
        torch.save(final, args.out)
else:
    distance = float("nan")
# Every rank holds the same parameters (rank 0's, gathered through gloo-free means: the
# backend itself, so a wrong broadcast fails here too).
for p in final:
    q = p.clone().to(device)
    dist.broadcast(q, src=0)
    assert torch.equal(q.cpu(), p), f"rank {rank}: parameters differ from rank 0's"
print(
    f"TRAIN OK mode={args.mode} backend={args.backend} device={device.type} rank={rank} "
    f"world={world} distance={distance:.1e}",
    flush=True,
)
dist.destroy_process_group()
