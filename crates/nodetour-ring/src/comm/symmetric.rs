//! Symmetric buffers: device memory every rank of the host allocates together and every rank
//! maps, so that an allreduce on it reads the peers' parts directly (one two-shot kernel, no
//! copy into the communicator's scratch). The one-kernel path must be on
//! (`Paths` says `one kernel per allreduce`).
//!
//! The memory belongs to the communicator: a peer may have it mapped, so it is freed only by
//! the communicator's teardown, after every rank closed its mappings (the handshake). A
//! [`SymmetricBuffer`] borrows the communicator, so the communicator cannot be closed while
//! one is held; dropping one frees nothing.

use nodetour_core::memory::DeviceBuffer;
use nodetour_core::transport::gpu::IpcGrant;

use super::Communicator;
use super::engine::Engine;
use crate::call::CallSpec;
use crate::error::{Error, Result};
use crate::reduce::DataType;
use nodetour_core::cuda::GpuStream;

/// This rank's part of a symmetric buffer ([`Communicator::symmetric_buffer`]).
pub struct SymmetricBuffer<'c> {
    engine: &'c Engine,
    id: usize,
    bytes: usize,
}

impl std::fmt::Debug for SymmetricBuffer<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SymmetricBuffer #{} of {} bytes", self.id, self.bytes)
    }
}

/// The first `count` elements of `dtype` of a [`SymmetricBuffer`]: what
/// [`Communicator::all_reduce_in_place`] takes, with a `&GpuStream` of this rank's GPU, to
/// allreduce it in place on every rank in one kernel that reads every rank's part directly and
/// meets the peers again before it ends (so the buffer may be written again in stream order).
/// Like the other device collectives it returns once queued (failures: [`Communicator::wait`]),
/// and it can be captured into a CUDA graph. Only the in-place allreduce takes it.
///
/// ```no_run
/// # fn demo(comm: &nodetour_ring::comm::Communicator, stream: &nodetour_core::cuda::GpuStream)
/// # -> nodetour_ring::Result<()> {
/// use nodetour_ring::{DataType, ReduceOp};
/// let sym = comm.symmetric_buffer(4 << 20)?;
/// // ... fill it on `stream` (SymmetricBuffer::with_device_buffer) ...
/// comm.all_reduce_in_place(&mut sym.elements(1 << 20, DataType::F32)?, ReduceOp::Sum, stream)?;
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct SymmetricElements<'a> {
    pub(super) buffer: &'a SymmetricBuffer<'a>,
    pub(super) count: usize,
    pub(super) dtype: DataType,
}

impl<'c> SymmetricBuffer<'c> {
    /// Its first `count` elements of `dtype` (`InvalidArgument` unless it holds them).
    pub fn elements(&'c self, count: usize, dtype: DataType) -> Result<SymmetricElements<'c>> {
        super::operand::fits(count, dtype, self.bytes)?;
        Ok(SymmetricElements {
            buffer: self,
            count,
            dtype,
        })
    }
}

impl SymmetricBuffer<'_> {
    /// Whether it is `engine`'s.
    pub(super) fn of(&self, engine: &Engine) -> bool {
        std::ptr::eq(self.engine, engine)
    }

    /// Bytes of this rank's part (as asked for).
    pub fn len(&self) -> usize {
        self.bytes
    }

    /// Whether it has no bytes (never: empty buffers are refused).
    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }

    /// Runs `f` on this rank's part (queue your kernels or copies that fill it, or read the
    /// result, on your stream). Peers read it while an allreduce on it runs: write it only in
    /// stream order before or after the collectives that use it.
    ///
    /// The communicator is held while `f` runs: a call of it from inside `f` fails with
    /// `InvalidArgument` (instead of waiting for itself forever), and a panic in `f` leaves it
    /// usable (the panic continues once it is released).
    pub fn with_device_buffer<R>(&self, f: impl FnOnce(&DeviceBuffer) -> R) -> Result<R> {
        let state = self.engine.usable()?;
        let ring = state
            .job
            .as_ref()
            .and_then(|j| j.gpu_ring.as_ref())
            .ok_or_else(|| Error::Unsupported {
                reason: "this communicator has no GPU ring".into(),
            })?;
        let buffer = ring
            .symmetric_buffer(self.id)
            .ok_or_else(|| Error::InvalidArgument {
                reason: format!("no symmetric buffer {} here", self.id),
            })?;
        let ran = {
            let _inside = Inside::enter();
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(buffer)))
        };
        // Released before a panic goes on: the communicator is not poisoned by the caller's.
        drop(state);
        match ran {
            Ok(r) => Ok(r),
            Err(panic) => std::panic::resume_unwind(panic),
        }
    }
}

/// Every rank's entry of the table of symmetric buffer grants (`per` bytes each: made or not,
/// the grant, the size asked for), checked against this rank's `bytes`; the first rank that
/// made no part.
fn read_grants(
    all: &[u8],
    per: usize,
    bytes: usize,
) -> Result<(Vec<Option<IpcGrant>>, Option<usize>)> {
    let at = 1 + IpcGrant::ENCODED_LEN;
    let mut grants = Vec::with_capacity(all.len() / per);
    let mut refused = None;
    for (r, m) in all.chunks(per).enumerate() {
        let their_bytes = u64::from_be_bytes(m[at..].try_into().expect("8 bytes"));
        if their_bytes != bytes as u64 {
            return Err(Error::InvalidArgument {
                reason: format!(
                    "symmetric buffer of {bytes} bytes here, {their_bytes} on rank {r}: every \
                     rank must ask for the same size"
                ),
            });
        }
        if m[0] != 1 {
            refused.get_or_insert(r);
            grants.push(None);
            continue;
        }
        let grant = IpcGrant::decode(&m[1..at]).map_err(|e| Error::Protocol {
            rank: r as u32,
            reason: format!("its symmetric buffer grant: {e}"),
        })?;
        grants.push(Some(grant));
    }
    Ok((grants, refused))
}

thread_local! {
    // Whether this thread runs a `with_device_buffer` closure (the communicator is held).
    static INSIDE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether this thread is inside a [`SymmetricBuffer::with_device_buffer`] closure.
pub(super) fn inside_closure() -> bool {
    INSIDE.with(std::cell::Cell::get)
}

/// Marks this thread as inside the closure until dropped (a panic included).
struct Inside(bool);

impl Inside {
    fn enter() -> Inside {
        Inside(INSIDE.with(|c| c.replace(true)))
    }
}

impl Drop for Inside {
    fn drop(&mut self) {
        INSIDE.with(|c| c.set(self.0));
    }
}

impl Communicator {
    /// Allocates a symmetric buffer of `bytes` on every rank of the host (collective: every
    /// rank calls it in the same order with the same size), each rank's part mapped by every
    /// rank. Needs the one-kernel path (ranks of one host, a GPU each); otherwise
    /// `Unsupported`, saying why. A rank that cannot allocate or map fails every rank's call.
    pub fn symmetric_buffer(&self, bytes: usize) -> Result<SymmetricBuffer<'_>> {
        // Formed without a GPU: the device side's, once a device collective formed it.
        self.device
            .engine()
            .unwrap_or(&self.engine)
            .symmetric_buffer(bytes)
    }
}

impl Engine {
    /// [`Communicator::symmetric_buffer`] on this engine.
    fn symmetric_buffer(&self, bytes: usize) -> Result<SymmetricBuffer<'_>> {
        // 1. This rank's part (or why not), then every rank's grant.
        let created = {
            let mut state = self.usable()?;
            let ring = state.job.as_mut().and_then(|j| j.gpu_ring.as_mut());
            match ring.and_then(|r| r.one_kernel_mut()) {
                Some(k) => k.symmetric_create(bytes).map_err(Error::from),
                None => Err(Error::Unsupported {
                    reason: format!(
                        "symmetric buffers need the one-kernel path, which is off here ({})",
                        self.paths
                    ),
                }),
            }
        };
        let mut mine = vec![0u8; 1 + IpcGrant::ENCODED_LEN + 8];
        if let Ok((_, g)) = &created {
            mine[0] = 1;
            mine[1..1 + IpcGrant::ENCODED_LEN].copy_from_slice(&g.encode());
        }
        let at = 1 + IpcGrant::ENCODED_LEN;
        mine[at..].copy_from_slice(&(bytes as u64).to_be_bytes());
        let per = mine.len();
        let mut all = vec![0u8; per * self.world as usize];
        // Every rank sees the same table: where it says no, no rank maps anything, so this
        // rank's part (if it made one) is freed at once; its id stays taken on every rank.
        let release = || {
            if let Ok((id, _)) = &created
                && let Ok(mut state) = self.usable()
            {
                let ring = state.job.as_mut().and_then(|j| j.gpu_ring.as_mut());
                if let Some(k) = ring.and_then(|r| r.one_kernel_mut()) {
                    k.symmetric_release_unmapped(*id);
                }
            }
        };
        let grants_of_all = CallSpec::all_gather(per, DataType::U8).checked(self.world)?;
        if let Err(e) = self.host_verb(grants_of_all, Some(&mine), &mut all) {
            release();
            return Err(e);
        }
        let (mut grants, refused) = match read_grants(&all, per, bytes) {
            Ok(read) => read,
            Err(e) => {
                release();
                return Err(e);
            }
        };
        if let Some(r) = refused {
            release();
            created?;
            return Err(Error::Unsupported {
                reason: format!("rank {r} could not allocate its part of the symmetric buffer"),
            });
        }
        let (id, _) = created?;
        grants[self.rank as usize] = None;
        self.map_parts(id, &grants)?;
        Ok(SymmetricBuffer {
            engine: self,
            id,
            bytes,
        })
    }

    /// Every peer's part of symmetric buffer `id` mapped here (from `grants`), then whether
    /// every rank mapped all: an error on every rank unless each did.
    fn map_parts(&self, id: usize, grants: &[Option<IpcGrant>]) -> Result<()> {
        let mapped = {
            let mut state = self.usable()?;
            let ring = state.job.as_mut().and_then(|j| j.gpu_ring.as_mut());
            match ring.and_then(|r| r.one_kernel_mut()) {
                Some(k) => k.symmetric_map(id, grants).map_err(Error::from),
                None => Err(Error::Unsupported {
                    reason: "the one-kernel path went away".into(),
                }),
            }
        };
        let mut verdicts = vec![0u8; self.world as usize];
        let verdict_of_all = CallSpec::all_gather(1, DataType::U8).checked(self.world)?;
        self.host_verb(
            verdict_of_all,
            Some(&[u8::from(mapped.is_ok())]),
            &mut verdicts,
        )?;
        mapped?;
        if let Some(r) = verdicts.iter().position(|v| *v != 1) {
            return Err(Error::Unsupported {
                reason: format!("rank {r} could not map every part of the symmetric buffer"),
            });
        }
        Ok(())
    }

    /// The allreduce `call` in place of `buffer` (this engine's), on every rank, queued on
    /// `stream` (see [`SymmetricElements`]).
    pub(super) fn all_reduce_symmetric(
        &self,
        buffer: &SymmetricBuffer<'_>,
        call: &CallSpec,
        stream: &GpuStream,
    ) -> Result<()> {
        let on_ring = call.on_ring(self.world, 0);
        self.in_call_order(stream, |lane| {
            self.on_gpu_ring(|ring| ring.symmetric_all_reduce(buffer.id, on_ring, lane))
        })
    }
}
