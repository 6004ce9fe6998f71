//! `nodetour._native`: the communicator for Python. Tensors cross as what torch (or any other
//! runtime) can give without nodetour knowing it: a data pointer, an element count, the type's
//! name and, for device memory, the GPU and a raw stream handle. Nothing here builds against
//! torch; `nodetour/torch.py` is the torch.distributed backend on top.
//!
//! `unsafe` is this crate's FFI boundary only: turning the caller's pointers into memory
//! nodetour may read and write for the length of one call (each block says why it holds).

#![deny(clippy::undocumented_unsafe_blocks)]

use std::sync::RwLock;
use std::time::Duration;

use nodetour::core::Deadline;
use nodetour::core::cuda::GpuStream;
use nodetour::core::memory::DeviceBuffer;
use nodetour::net::bootstrap;
use nodetour::{Communicator, DataType, Elements, Error, Host, HostBytes, Options, ReduceOp};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;

pyo3::create_exception!(
    _native,
    NodetourError,
    PyRuntimeError,
    "A nodetour call failed: the message names the rank at fault and the collective."
);

/// The Python error for `e`, raised by `what` on `rank`.
fn raise(rank: u32, what: &str, e: &Error) -> PyErr {
    NodetourError::new_err(format!("nodetour rank {rank}: {what}: {e}"))
}

/// Where a collective's memory lives: the host, or GPU `device` with the caller's stream.
#[derive(Clone, Copy)]
struct Place {
    /// `None`: host memory.
    device: Option<u32>,
    /// The raw `CUstream` (0: the legacy default stream of the calling thread's context).
    stream: usize,
}

impl Place {
    fn new(device: i64, stream: usize) -> PyResult<Place> {
        let device = match device {
            d if d < 0 => None,
            d => Some(u32::try_from(d).map_err(|_| PyValueError::new_err("device ordinal"))?),
        };
        Ok(Place { device, stream })
    }
}

/// One operand: `count` elements of `dtype` at `ptr`.
#[derive(Clone, Copy)]
struct Operand {
    ptr: usize,
    count: usize,
    dtype: DataType,
}

impl Operand {
    fn new(ptr: usize, count: usize, dtype: DataType) -> Operand {
        Operand { ptr, count, dtype }
    }

    fn bytes(&self) -> PyResult<usize> {
        self.count
            .checked_mul(self.dtype.size())
            .filter(|b| isize::try_from(*b).is_ok())
            .ok_or_else(|| PyValueError::new_err("the tensor's size overflows"))
    }

    /// The host bytes of this operand, written by the collective.
    ///
    /// # Safety
    ///
    /// `ptr` is the start of `count` live, writable elements of host memory that nothing else
    /// reads or writes until the returned slice is dropped (the Python layer passes a
    /// contiguous CPU tensor it holds for the call; torch's contract is that no other thread
    /// touches a tensor while a collective has it).
    unsafe fn host_mut<'a>(&self) -> PyResult<&'a mut [u8]> {
        let n = self.bytes()?;
        if n == 0 {
            return Ok(&mut []);
        }
        check_host(self.ptr, self.dtype)?;
        // SAFETY: the caller's contract above; the length was overflow-checked.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.ptr as *mut u8, n) })
    }

    /// As [`Self::host_mut`], read only.
    ///
    /// # Safety
    ///
    /// As [`Self::host_mut`], but nothing writes it for the length of the call.
    unsafe fn host<'a>(&self) -> PyResult<&'a [u8]> {
        let n = self.bytes()?;
        if n == 0 {
            return Ok(&[]);
        }
        check_host(self.ptr, self.dtype)?;
        // SAFETY: the caller's contract above; the length was overflow-checked.
        Ok(unsafe { std::slice::from_raw_parts(self.ptr as *const u8, n) })
    }

    /// The device memory of this operand (checked with the driver: device memory, one
    /// allocation).
    ///
    /// # Safety
    ///
    /// `ptr` is `count` elements of device memory that stays allocated until the collective
    /// queued on the caller's stream has run (the Python layer records the tensor on that
    /// stream, so torch's caching allocator does not reuse it before).
    unsafe fn device(&self) -> PyResult<DeviceBuffer> {
        let n = self.bytes()?.max(1);
        // SAFETY: the caller's contract above; `from_raw` asks the driver what it can check.
        unsafe { DeviceBuffer::from_raw(self.ptr as u64, n) }
            .map_err(|e| NodetourError::new_err(format!("a CUDA tensor: {e}")))
    }
}

/// Refuses parts whose memory overlaps where either is received into (the receive would write
/// what another part reads or writes: two borrows of one byte, one of them mutable).
fn disjoint(ops: &[(bool, usize, Operand, u32)]) -> PyResult<()> {
    let mut spans: Vec<(usize, usize, bool)> = ops
        .iter()
        .filter(|(_, n, _, _)| *n > 0)
        .map(|(send, n, op, _)| (op.ptr, op.ptr.saturating_add(*n), !*send))
        .collect();
    spans.sort_unstable();
    for (i, a) in spans.iter().enumerate() {
        for b in &spans[i + 1..] {
            if b.0 >= a.1 {
                break;
            }
            if a.2 || b.2 {
                return Err(PyValueError::new_err(
                    "two parts of one batch share memory and one of them receives into it",
                ));
            }
        }
    }
    Ok(())
}

fn check_host(ptr: usize, dtype: DataType) -> PyResult<()> {
    if ptr == 0 || !ptr.is_multiple_of(dtype.size()) {
        return Err(PyValueError::new_err(format!(
            "a host tensor at {ptr:#x} is null or not aligned to {}",
            dtype.name()
        )));
    }
    Ok(())
}

fn dtype(name: &str) -> PyResult<DataType> {
    DataType::from_name(name)
        .ok_or_else(|| PyValueError::new_err(format!("nodetour has no element type {name:?}")))
}

fn op(name: &str, scalar: f64) -> PyResult<ReduceOp> {
    Ok(match name {
        "sum" => ReduceOp::Sum,
        "prod" => ReduceOp::Prod,
        "min" => ReduceOp::Min,
        "max" => ReduceOp::Max,
        "avg" => ReduceOp::Avg,
        "premulsum" => ReduceOp::pre_mul_sum(scalar),
        other => {
            return Err(PyValueError::new_err(format!(
                "nodetour has no reduction {other:?}"
            )));
        }
    })
}

/// The caller's stream on `device`.
///
/// # Safety
///
/// `raw` is a live stream of GPU `device`'s primary context (torch's current stream), or 0,
/// and outlives the collectives queued on it by this call (torch's streams live as long as
/// the process).
unsafe fn stream(raw: usize) -> PyResult<GpuStream> {
    // SAFETY: the caller's contract above.
    unsafe { GpuStream::from_raw(raw as nodetour::cudarc::driver::sys::CUstream) }
        .map_err(|e| NodetourError::new_err(format!("the current CUDA stream: {e}")))
}

/// Binds this process's rendezvous listener as rank 0 of a job; returns the `host:port` to
/// publish to the other ranks (it carries no secret).
#[pyfunction]
fn bind_rendezvous() -> PyResult<String> {
    bootstrap::bind_rendezvous().map_err(|e| NodetourError::new_err(e.to_string()))
}

/// The doctor's report: `(text, exit status)` (`json`: the JSON document as text).
#[pyfunction]
#[pyo3(signature = (json=false, live=true))]
fn doctor(py: Python<'_>, json: bool, live: bool) -> PyResult<(String, u8)> {
    py.detach(|| {
        let config = nodetour::core::Config::from_env()
            .map_err(|e| NodetourError::new_err(e.to_string()))?;
        let report = nodetour_tools::doctor::examine(&config, live)
            .map_err(|e| NodetourError::new_err(e.to_string()))?;
        let text = if json {
            nodetour_tools::doctor::render_json(&report).to_string()
        } else {
            nodetour_tools::doctor::render_text(&report)
        };
        Ok((text, report.exit_code()))
    })
}

/// One rank's communicator.
#[pyclass(frozen, module = "nodetour._native")]
struct Comm {
    /// `None` once closed. Collectives hold it shared (several threads may call at once, as
    /// the Rust communicator allows); `close` takes it.
    inner: RwLock<Option<Communicator>>,
    rank: u32,
    world: u32,
}

impl Comm {
    /// Runs `f` on the communicator with the GIL released.
    fn with<R: Send>(
        &self,
        py: Python<'_>,
        what: &str,
        f: impl FnOnce(&Communicator) -> nodetour::Result<R> + Send,
    ) -> PyResult<R> {
        let rank = self.rank;
        py.detach(|| {
            let guard = self
                .inner
                .read()
                .map_err(|_| NodetourError::new_err("a thread panicked in nodetour"))?;
            let comm = guard.as_ref().ok_or_else(|| {
                NodetourError::new_err(format!(
                    "nodetour rank {rank}: {what}: the communicator is closed"
                ))
            })?;
            f(comm).map_err(|e| raise(rank, what, &e))
        })
    }
}

#[pymethods]
impl Comm {
    /// Forms rank `rank` of `world` with rank 0's rendezvous at `address` (from
    /// [`bind_rendezvous`], through the runtime's store). The job token is never passed here:
    /// `NODETOUR_JOB_TOKEN` from the environment, else an unauthenticated job keyed by `job`
    /// (a name every rank shares; warned). `timeout_s` bounds each collective's waits.
    #[new]
    #[pyo3(signature = (address, rank, world, job=None, timeout_s=None))]
    fn new(
        py: Python<'_>,
        address: String,
        rank: u32,
        world: u32,
        job: Option<String>,
        timeout_s: Option<f64>,
    ) -> PyResult<Comm> {
        let formed = py.detach(|| -> nodetour::Result<Communicator> {
            let env = nodetour::core::knobs::Env::process();
            let token = bootstrap::job_token_from(job.as_deref(), &|k| env.any(k))?;
            let mut options = Options::from_env()?;
            if let Some(t) = timeout_s.filter(|t| t.is_finite() && *t > 0.0) {
                options = options.with_timeout(Duration::from_secs_f64(t));
            }
            Communicator::from_rendezvous(&address, rank, world, token, options)
        });
        let comm = formed.map_err(|e| raise(rank, "forming the communicator", &e))?;
        Ok(Comm {
            inner: RwLock::new(Some(comm)),
            rank,
            world,
        })
    }

    /// This rank.
    #[getter]
    fn rank(&self) -> u32 {
        self.rank
    }

    /// Ranks in the job.
    #[getter]
    fn world(&self) -> u32 {
        self.world
    }

    /// How each link and each kind of memory travels, and why.
    fn paths(&self, py: Python<'_>) -> PyResult<String> {
        self.with(py, "paths", |c| Ok(c.paths().to_string()))
    }

    /// The communicator's first failure, if it is broken.
    fn error(&self, py: Python<'_>) -> PyResult<Option<String>> {
        self.with(py, "error", |c| Ok(c.error().map(|e| e.to_string())))
    }

    /// Aborts every collective of this communicator, here and (through the ring) on every
    /// rank; callable from any thread while a collective runs.
    fn abort(&self, reason: &str) -> PyResult<()> {
        let guard = self
            .inner
            .read()
            .map_err(|_| NodetourError::new_err("a thread panicked in nodetour"))?;
        if let Some(c) = guard.as_ref() {
            c.abort_handle().abort(reason);
        }
        Ok(())
    }

    /// Waits (at most `timeout_s`) for the device collectives queued so far, then tears the
    /// communicator down. Closing twice is a no-op.
    #[pyo3(signature = (timeout_s=30.0))]
    fn close(&self, py: Python<'_>, timeout_s: f64) -> PyResult<()> {
        let rank = self.rank;
        py.detach(|| {
            let taken = self
                .inner
                .write()
                .map_err(|_| NodetourError::new_err("a thread panicked in nodetour"))?
                .take();
            match taken {
                None => Ok(()),
                Some(c) => c
                    .close(Deadline::after(Duration::from_secs_f64(timeout_s.max(0.0))))
                    .map_err(|e| raise(rank, "close", &e)),
            }
        })
    }

    /// Allreduce of `count` elements of `dtype` from `send` into `recv` (the same pointer: in
    /// place) with `op` (`scalar`: PreMulSum's); `device < 0`: host memory (returns with the
    /// answer), else GPU `device`, queued on `stream`.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (send, recv, count, dtype, op, scalar, device, stream))]
    fn all_reduce(
        &self,
        py: Python<'_>,
        send: usize,
        recv: usize,
        count: usize,
        dtype: &str,
        op: &str,
        scalar: f64,
        device: i64,
        stream: usize,
    ) -> PyResult<()> {
        let (d, o, place) = (
            self::dtype(dtype)?,
            self::op(op, scalar)?,
            Place::new(device, stream)?,
        );
        let (s, r) = (Operand::new(send, count, d), Operand::new(recv, count, d));
        run(
            self,
            py,
            "allreduce",
            place,
            s,
            r,
            move |c, inp, out, q| match (inp, q) {
                (None, Queue::Host) => c.all_reduce_in_place(out.host()?, o, Host),
                (Some(i), Queue::Host) => c.all_reduce(i.host()?, out.host()?, o, Host),
                (None, Queue::Device(st)) => c.all_reduce_in_place(&mut out.device()?, o, st),
                (Some(i), Queue::Device(st)) => {
                    c.all_reduce(&i.device()?, &mut out.device()?, o, st)
                }
            },
        )
    }

    /// Reduce-scatter: `send` holds `world × count` elements, `recv` gets this rank's `count`.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (send, recv, count, dtype, op, scalar, device, stream))]
    fn reduce_scatter(
        &self,
        py: Python<'_>,
        send: usize,
        recv: usize,
        count: usize,
        dtype: &str,
        op: &str,
        scalar: f64,
        device: i64,
        stream: usize,
    ) -> PyResult<()> {
        let (d, o, place) = (
            self::dtype(dtype)?,
            self::op(op, scalar)?,
            Place::new(device, stream)?,
        );
        let whole = count
            .checked_mul(self.world as usize)
            .ok_or_else(|| PyValueError::new_err("the input's size overflows"))?;
        let (s, r) = (Operand::new(send, whole, d), Operand::new(recv, count, d));
        run(
            self,
            py,
            "reduce_scatter",
            place,
            s,
            r,
            move |c, inp, out, q| match (inp, q) {
                (None, _) => Err(Error::InvalidArgument {
                    reason: "reduce_scatter takes distinct send and recv".into(),
                }),
                (Some(i), Queue::Host) => c.reduce_scatter(i.host()?, out.host()?, o, Host),
                (Some(i), Queue::Device(st)) => {
                    c.reduce_scatter(&i.device()?, &mut out.device()?, o, st)
                }
            },
        )
    }

    /// All-gather: `send` holds `count` elements, `recv` gets `world × count` (block `r` from
    /// rank `r`).
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (send, recv, count, dtype, device, stream))]
    fn all_gather(
        &self,
        py: Python<'_>,
        send: usize,
        recv: usize,
        count: usize,
        dtype: &str,
        device: i64,
        stream: usize,
    ) -> PyResult<()> {
        let (d, place) = (self::dtype(dtype)?, Place::new(device, stream)?);
        let whole = count
            .checked_mul(self.world as usize)
            .ok_or_else(|| PyValueError::new_err("the output's size overflows"))?;
        let (s, r) = (Operand::new(send, count, d), Operand::new(recv, whole, d));
        run(
            self,
            py,
            "allgather",
            place,
            s,
            r,
            move |c, inp, out, q| match (inp, q) {
                (None, _) => Err(Error::InvalidArgument {
                    reason: "all_gather takes distinct send and recv".into(),
                }),
                (Some(i), Queue::Host) => c.all_gather(i.host()?, out.host()?, Host),
                (Some(i), Queue::Device(st)) => c.all_gather(&i.device()?, &mut out.device()?, st),
            },
        )
    }

    /// Broadcast of rank `root`'s `count` elements at `ptr` into `ptr` on every rank.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (ptr, count, dtype, root, device, stream))]
    fn broadcast(
        &self,
        py: Python<'_>,
        ptr: usize,
        count: usize,
        dtype: &str,
        root: u32,
        device: i64,
        stream: usize,
    ) -> PyResult<()> {
        let (d, place) = (self::dtype(dtype)?, Place::new(device, stream)?);
        let x = Operand {
            ptr,
            count,
            dtype: d,
        };
        run(
            self,
            py,
            "broadcast",
            place,
            x,
            x,
            move |c, _, out, q| match q {
                Queue::Host => c.broadcast_in_place(out.host()?, root, Host),
                Queue::Device(st) => c.broadcast_in_place(&mut out.device()?, root, st),
            },
        )
    }

    /// Sends and receives on host memory, run together as one batch (none waits for another,
    /// whatever order each rank lists its parts in): each part is `(send, ptr, count, dtype,
    /// peer)`, `send` true for a send of `count` elements at `ptr` to `peer`, false for a
    /// receive into them from `peer`. Returns once every part is done. No part's memory may
    /// overlap another's where either is received into.
    fn p2p(&self, py: Python<'_>, parts: Vec<(bool, usize, usize, String, u32)>) -> PyResult<()> {
        let mut ops = Vec::with_capacity(parts.len());
        for (send, ptr, count, name, peer) in &parts {
            let op = Operand::new(*ptr, *count, dtype(name)?);
            ops.push((*send, op.bytes()?, op, *peer));
        }
        disjoint(&ops)?;
        let mut lent = Vec::with_capacity(ops.len());
        for (send, _, op, peer) in &ops {
            let bytes = if *send {
                // SAFETY: `op` is a contiguous CPU tensor the Python layer holds for the call,
                // read only; no part received into overlaps it (`disjoint`).
                HostBytes::new(unsafe { op.host() }?, op.dtype)
            } else {
                // SAFETY: as above, written by this call alone: no other part overlaps it.
                HostBytes::new_mut(unsafe { op.host_mut() }?, op.dtype)
            }
            .map_err(|e| raise(self.rank, "p2p", &e))?;
            lent.push((*send, bytes, *peer));
        }
        self.with(py, "p2p", move |c| {
            let mut b = c.batch();
            for (send, bytes, peer) in lent {
                if send {
                    b.send_bytes(bytes, peer);
                } else {
                    b.recv_bytes(bytes, peer)?;
                }
            }
            b.run()
        })
    }

    /// Returns once every rank has called it (a one-byte host allreduce).
    fn barrier(&self, py: Python<'_>) -> PyResult<()> {
        self.with(py, "barrier", |c| {
            let mut b = [0u8; 1];
            c.all_reduce_in_place(&mut b[..], ReduceOp::Max, Host)
        })
    }
}

/// Where a collective is queued.
enum Queue<'a> {
    Host,
    Device(&'a GpuStream),
}

/// An operand as the collective borrows it.
enum Borrowed<'a> {
    Host(HostBytes<'a>),
    Device(DeviceBuffer, DataType, usize),
}

impl<'a> Borrowed<'a> {
    fn host(&mut self) -> nodetour::Result<&mut HostBytes<'a>> {
        match self {
            Borrowed::Host(h) => Ok(h),
            Borrowed::Device(..) => Err(mixed()),
        }
    }

    fn device(&self) -> nodetour::Result<Elements<'_>> {
        match self {
            Borrowed::Device(b, d, n) => Elements::new(b, *n, *d),
            Borrowed::Host(_) => Err(mixed()),
        }
    }
}

fn mixed() -> Error {
    Error::InvalidArgument {
        reason: "host and device memory in one collective".into(),
    }
}

/// Runs collective `what` with `send` (distinct from `recv`, or in place) and `recv` borrowed
/// from the caller's pointers for the call, with the GIL released.
#[allow(clippy::too_many_arguments)]
fn run(
    comm: &Comm,
    py: Python<'_>,
    what: &str,
    place: Place,
    send: Operand,
    recv: Operand,
    body: impl FnOnce(
        &Communicator,
        Option<&mut Borrowed<'_>>,
        &mut Borrowed<'_>,
        Queue<'_>,
    ) -> nodetour::Result<()>
    + Send,
) -> PyResult<()> {
    let in_place = send.ptr == recv.ptr && send.count == recv.count;
    let rank = comm.rank;
    let what_owned = what.to_owned();
    let (send_b, recv_b, queue) = match place.device {
        None => {
            // SAFETY: the Python layer passes contiguous CPU tensors it holds for the call
            // (`nodetour.torch`); `send` is only read, `recv` written; in place they are one
            // borrow (no aliasing slices).
            let out = unsafe { recv.host_mut()? };
            let inp = if in_place {
                None
            } else {
                // SAFETY: as above; a distinct tensor from `recv`.
                Some(Borrowed::Host(
                    HostBytes::new(unsafe { send.host()? }, send.dtype)
                        .map_err(|e| raise(rank, what, &e))?,
                ))
            };
            let out = HostBytes::new_mut(out, recv.dtype).map_err(|e| raise(rank, what, &e))?;
            (inp, Borrowed::Host(out), None)
        }
        Some(_) => {
            // SAFETY: the Python layer records every CUDA tensor on the stream the collective
            // is queued on (torch's `record_stream`) and holds it for the call, so the memory
            // stays allocated until the collective has run.
            let out = unsafe { recv.device()? };
            let inp = if in_place {
                None
            } else {
                // SAFETY: as above.
                Some(Borrowed::Device(
                    unsafe { send.device()? },
                    send.dtype,
                    send.count,
                ))
            };
            // SAFETY: torch's current stream of this device (or 0), which torch keeps alive.
            let st = unsafe { stream(place.stream)? };
            (inp, Borrowed::Device(out, recv.dtype, recv.count), Some(st))
        }
    };
    comm.with(py, &what_owned, move |c| {
        let mut send_b = send_b;
        let mut recv_b = recv_b;
        let q = match &queue {
            None => Queue::Host,
            Some(st) => Queue::Device(st),
        };
        body(c, send_b.as_mut(), &mut recv_b, q)
    })
}

/// The native module.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("NodetourError", m.py().get_type::<NodetourError>())?;
    m.add_class::<Comm>()?;
    m.add_function(wrap_pyfunction!(bind_rendezvous, m)?)?;
    m.add_function(wrap_pyfunction!(doctor, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
