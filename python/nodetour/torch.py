"""The ``"nodetour"`` backend of ``torch.distributed``, registered on import::

    import nodetour.torch  # noqa: F401  (registers the backend)
    import torch.distributed as dist
    dist.init_process_group("nodetour")  # torchrun's environment, as for "gloo" or "nccl"

DDP runs unchanged; FSDP2 (``fully_shard`` on a one-dimensional mesh) through
``all_gather_into_tensor`` and ``reduce_scatter_tensor``; pipeline stages through ``send``,
``recv``, ``isend`` and ``irecv`` on CPU tensors (posted, then run together as one nodetour
batch at the first wait or the group's next collective). CPU tensors: each call returns with
the answer (the GIL released meanwhile). CUDA tensors: each call is queued on torch's current
stream of the tensor's device (the default stream too) and returns at once; the tensors are
recorded on that stream, so the caching allocator does not reuse them before the collective
ran, and the work's future is completed on that stream (``wait`` makes the then current stream
wait for it). ``comm(group).paths()`` says which path each kind of memory takes, and why.

The job token never goes through torch's store: ``NODETOUR_JOB_TOKEN`` in every rank's
environment authenticates the job; without it the job is unauthenticated (a warning), keyed by
a name rank 0 draws and publishes. Rank 0 publishes its rendezvous address (no secret).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import secrets
from typing import Optional

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Work, _create_work_from_future
from torch.distributed import ReduceOp
from torch.futures import Future

from ._native import Comm

__all__ = ["NodetourProcessGroup", "comm", "BACKEND"]

BACKEND = "nodetour"

# torch's element types as nodetour names them (bool travels as u8; complex as pairs of its
# real type, for the operations that act on each part alone).
_TYPES = {
    torch.float32: ("f32", 1),
    torch.float64: ("f64", 1),
    torch.float16: ("f16", 1),
    torch.bfloat16: ("bf16", 1),
    torch.int8: ("i8", 1),
    torch.int16: ("i16", 1),
    torch.int32: ("i32", 1),
    torch.int64: ("i64", 1),
    torch.uint8: ("u8", 1),
    torch.bool: ("u8", 1),
    torch.complex64: ("f32", 2),
    torch.complex128: ("f64", 2),
}
for _name, _code in (
    ("uint32", "u32"),
    ("uint64", "u64"),
    ("float8_e4m3fn", "f8e4m3"),
    ("float8_e5m2", "f8e5m2"),
):
    if hasattr(torch, _name):
        _TYPES[getattr(torch, _name)] = (_code, 1)

_OPS = {
    ReduceOp.SUM: "sum",
    ReduceOp.PRODUCT: "prod",
    ReduceOp.MIN: "min",
    ReduceOp.MAX: "max",
    ReduceOp.AVG: "avg",
}


def _element(t: torch.Tensor) -> "tuple[str, int]":
    try:
        return _TYPES[t.dtype]
    except KeyError:
        raise TypeError(f"nodetour: no element type for {t.dtype}") from None


def _reduction(op, t: torch.Tensor) -> "tuple[str, float]":
    """nodetour's name of ``op`` (a ``ReduceOp`` of torch's) and PreMulSum's scalar."""
    kind = getattr(op, "op", op)
    premul = getattr(ReduceOp.RedOpType, "PREMUL_SUM", None)
    if premul is not None and kind == premul:
        factor = getattr(op, "factor", None)
        if factor is None:
            raise NotImplementedError(
                "nodetour: PREMUL_SUM's factor cannot be read from Python before torch 2.15 "
                "(use AVG, or SUM and scale)"
            )
        if isinstance(factor, torch.Tensor):
            factor = factor.item()
        return "premulsum", float(factor)
    for known, name in _OPS.items():
        if kind == getattr(known, "op", known) or op == known:
            if t.is_complex() and name not in ("sum", "avg"):
                raise NotImplementedError(f"nodetour: {name} of complex tensors")
            return name, 0.0
    raise NotImplementedError(f"nodetour: the reduction {op} (BAND, BOR and BXOR are not built)")


class _Operand:
    """A tensor as nodetour takes it: contiguous (a contiguous copy is written back)."""

    def __init__(self, t: torch.Tensor):
        self.tensor = t
        self.flat = t if t.is_contiguous() else t.contiguous()
        self.dtype, per = _element(t)
        self.count = self.flat.numel() * per
        self.ptr = self.flat.data_ptr()

    def write_back(self) -> None:
        if self.flat is not self.tensor:
            self.tensor.copy_(self.flat)


def _place(tensors) -> "tuple[int, int, Optional[torch.device]]":
    """(device ordinal or -1, raw current stream, device) of tensors that share one device."""
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"nodetour: one collective's tensors on several devices: {devices}")
    (device,) = devices
    if device.type == "cpu":
        return -1, 0, None
    if device.type != "cuda":
        raise NotImplementedError(f"nodetour: tensors on {device.type}")
    return device.index, torch.cuda.current_stream(device).cuda_stream, device


def _on(ordinal: int):
    """The tensor's GPU made current for the call (the default stream's handle, 0, names the
    calling thread's current context); nothing for host memory."""
    return torch.cuda.device(ordinal) if ordinal >= 0 else contextlib.nullcontext()


def _done(result, device: Optional[torch.device]):
    """A finished work whose future holds ``result`` (on ``device``'s current stream)."""
    fut = Future(devices=[device]) if device is not None else Future()
    fut.set_result(result)
    return _create_work_from_future(fut)


class _Posted(Work):
    """A send or receive posted to its group's batch (torch's ``isend``/``irecv``, and each
    part of ``batch_isend_irecv``): waiting for it, or the group's next collective, runs every
    send and receive posted so far as one nodetour batch, so none waits for another whatever
    order each rank posted its parts in."""

    def __init__(self, group: "NodetourProcessGroup"):
        super().__init__()
        self._group = group

    def wait(self, timeout=None) -> bool:
        self._group._flush()
        return True

    def is_completed(self) -> bool:
        return not self._group._posted

    def is_success(self) -> bool:
        return True

    def get_future(self):
        self._group._flush()
        fut = Future()
        fut.set_result(None)
        return fut


class NodetourProcessGroup(dist.ProcessGroup):
    """One rank's process group over a nodetour communicator (formed through ``store``)."""

    def __init__(self, store, rank: int, size: int, timeout: datetime.timedelta):
        super().__init__(rank, size)
        self._rank, self._size = rank, size
        self._group_name = ""
        self._group_desc = ""
        address_key, job_key = "nodetour/address", "nodetour/job"
        authenticated = bool(os.environ.get("NODETOUR_JOB_TOKEN"))
        # What this rank wrote to the store (tests read it: never a token).
        self.published = {}
        if rank == 0:
            self.published[address_key] = _bind()
            if not authenticated:
                self.published[job_key] = "torch-store:" + secrets.token_hex(16)
            for key, value in self.published.items():
                store.set(key, value)
        address = store.get(address_key).decode()
        job = None if authenticated else store.get(job_key).decode()
        self._comm = Comm(address, rank, size, job, timeout.total_seconds())
        # Sends and receives posted and not yet run (see _Posted).
        self._posted = []

    # -- what torch asks of every process group --

    def getBackendName(self) -> str:
        return BACKEND

    def getGroupName(self) -> str:
        return self._group_name

    def setGroupName(self, name: str) -> None:
        self._group_name = name

    def getGroupDesc(self) -> str:
        return self._group_desc

    def setGroupDesc(self, desc: str) -> None:
        self._group_desc = desc

    @property
    def group_name(self) -> str:
        return self._group_name

    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank

    def __repr__(self) -> str:
        return f"NodetourProcessGroup(rank={self._rank}, size={self._size})"

    @property
    def comm(self) -> Comm:
        """The nodetour communicator (``paths()``, ``error()``)."""
        return self._comm

    def shutdown(self) -> None:
        self._comm.close()

    def abort(self) -> None:
        self._comm.abort("torch.distributed aborted the process group")

    # -- collectives --

    def allreduce(self, tensors, opts=None):
        op = opts.reduceOp if opts is not None else ReduceOp.SUM
        ordinal, stream, device = _place(tensors)
        for t in tensors:
            self._all_reduce(t, op, ordinal, stream)
        return _done(list(tensors), device)

    def allreduce_coalesced(self, tensors, opts=None):
        return self.allreduce(tensors, opts)

    def _all_reduce(self, t, op, ordinal, stream) -> None:
        name, scalar = _reduction(op, t)
        x = _Operand(t)
        with _on(ordinal):
            self._flush()
            self._comm.all_reduce(x.ptr, x.ptr, x.count, x.dtype, name, scalar, ordinal, stream)
        self._after([x], stream, ordinal)
        x.write_back()

    def broadcast(self, tensors, opts=None):
        root = opts.rootRank if opts is not None else 0
        ordinal, stream, device = _place(tensors)
        for t in tensors:
            x = _Operand(t)
            with _on(ordinal):
                self._flush()
                self._comm.broadcast(x.ptr, x.count, x.dtype, root, ordinal, stream)
            self._after([x], stream, ordinal)
            x.write_back()
        return _done(list(tensors), device)

    def _all_gather_flat(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        if out.numel() != inp.numel() * self._size or out.dtype != inp.dtype:
            raise ValueError(
                f"nodetour: all_gather into {out.numel()} {out.dtype} elements from "
                f"{inp.numel()} {inp.dtype} on {self._size} ranks"
            )
        ordinal, stream, _ = _place([out, inp])
        i, o = _Operand(inp), _Operand(out)
        with _on(ordinal):
            self._flush()
            self._comm.all_gather(i.ptr, o.ptr, i.count, i.dtype, ordinal, stream)
        self._after([i, o], stream, ordinal)
        o.write_back()

    def _reduce_scatter_flat(self, out: torch.Tensor, inp: torch.Tensor, op) -> None:
        if inp.numel() != out.numel() * self._size or out.dtype != inp.dtype:
            raise ValueError(
                f"nodetour: reduce_scatter into {out.numel()} {out.dtype} elements from "
                f"{inp.numel()} {inp.dtype} on {self._size} ranks"
            )
        ordinal, stream, _ = _place([out, inp])
        name, scalar = _reduction(op, out)
        i, o = _Operand(inp), _Operand(out)
        with _on(ordinal):
            self._flush()
            self._comm.reduce_scatter(
                i.ptr, o.ptr, o.count, o.dtype, name, scalar, ordinal, stream
            )
        self._after([i, o], stream, ordinal)
        o.write_back()

    def allgather(self, output_tensors, input_tensors, opts=None):
        ordinal, stream, device = _place(list(input_tensors))
        for outs, inp in zip(output_tensors, input_tensors):
            flat = torch.empty((self._size * inp.numel(),), dtype=inp.dtype, device=inp.device)
            self._all_gather_flat(flat, inp)
            for o, part in zip(outs, flat.chunk(self._size)):
                o.copy_(part.view_as(o))
        return _done(list(output_tensors), device)

    def _allgather_base(self, output, input, opts=None):
        self._all_gather_flat(output, input)
        return _done([output], _place([output])[2])

    def all_gather_single(self, output, input, opts=None):
        return self._allgather_base(output, input, opts)

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        for o, i in zip(outputs, inputs):
            self._all_gather_flat(o, i)
        return _done(list(outputs), _place(list(outputs))[2] if outputs else None)

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        return self.allgather_into_tensor_coalesced(outputs, inputs, opts)

    def reduce_scatter(self, outputs, input_lists, opts=None):
        op = opts.reduceOp if opts is not None else ReduceOp.SUM
        for out, parts in zip(outputs, input_lists):
            flat = torch.cat([p.reshape(-1) for p in parts])
            self._reduce_scatter_flat(out, flat, op)
        return _done(list(outputs), _place(list(outputs))[2] if outputs else None)

    def _reduce_scatter_base(self, output, input, opts=None):
        op = opts.reduceOp if opts is not None else ReduceOp.SUM
        self._reduce_scatter_flat(output, input, op)
        return _done([output], _place([output])[2])

    def reduce_scatter_single(self, output, input, opts=None):
        return self._reduce_scatter_base(output, input, opts)

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        op = opts.reduceOp if opts is not None else ReduceOp.SUM
        for o, i in zip(outputs, inputs):
            self._reduce_scatter_flat(o, i, op)
        return _done(list(outputs), _place(list(outputs))[2] if outputs else None)

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        return self.reduce_scatter_tensor_coalesced(outputs, inputs, opts)

    def barrier(self, opts=None):
        self._flush()
        self._comm.barrier()
        return _done([], None)

    # -- point-to-point (host memory) --

    def send(self, tensors, dstRank, tag=0):
        return self._post(tensors, True, dstRank)

    def recv(self, tensors, srcRank, tag=0):
        return self._post(tensors, False, srcRank)

    def _post(self, tensors, send: bool, peer: int):
        ordinal, _, _ = _place(tensors)
        if ordinal >= 0:
            raise NotImplementedError("nodetour: send and recv of CUDA tensors are not built yet")
        for t in tensors:
            self._posted.append((send, _Operand(t), peer))
        return _Posted(self)

    def _flush(self) -> None:
        """Runs the sends and receives posted so far, together (before any later call)."""
        if not self._posted:
            return
        parts, self._posted = self._posted, []
        self._comm.p2p([(s, x.ptr, x.count, x.dtype, peer) for s, x, peer in parts])
        for s, x, _ in parts:
            if not s:
                x.write_back()

    # -- what nodetour does not build yet --

    def _missing(name):  # noqa: N805 (a factory of methods)
        def refuse(self, *args, **kwargs):
            raise NotImplementedError(f"nodetour: {name} is not built yet")

        refuse.__name__ = name
        return refuse

    alltoall = _missing("alltoall")
    alltoall_base = _missing("alltoall_base")
    all_to_all_single = _missing("all_to_all_single")
    recvAnysource = _missing("recvAnysource")
    reduce = _missing("reduce")
    gather = _missing("gather")
    scatter = _missing("scatter")
    del _missing

    # -- helpers --

    def _after(self, operands, stream: int, ordinal: int) -> None:
        """CUDA tensors: kept from reuse until the collective queued on ``stream`` ran."""
        if ordinal < 0:
            return
        s = torch.cuda.current_stream(torch.device("cuda", ordinal))
        for x in operands:
            x.flat.record_stream(s)


def _bind() -> str:
    from ._native import bind_rendezvous

    return bind_rendezvous()


def _create(store, rank, size, timeout):
    return NodetourProcessGroup(store, rank, size, timeout)


def comm(group=None) -> Comm:
    """The nodetour communicator of ``group`` (the default group if none)."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    if not isinstance(pg, NodetourProcessGroup):
        raise TypeError(f"{pg!r} is not a nodetour process group")
    return pg.comm


if BACKEND not in dist.Backend.backend_list:
    dist.Backend.register_backend(BACKEND, _create, devices=["cpu", "cuda"])
