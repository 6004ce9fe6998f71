//! A ring of ranks inside one process over the in-memory transport, one thread per rank per
//! collective: the same `HostRing` code path as a job of processes, without sockets or NICs.
//! For benches, tests and examples (on GPU buffers it runs the staged path, each rank's chunks
//! staged through its host slots and reduced on its GPU).

use std::thread;

use nodetour_core::memory::HostBuffer;
use nodetour_core::transport::{HostConnection, MemConnection, SlotGrant, SlotRegion};

use crate::error::{Error, Result};
use crate::host::{BELL_BYTES, HostRing, HostRingOptions, Links};
use crate::reduce::{DataType, ReduceOp};

/// One rank's connections and regions.
struct Rank {
    next: MemConnection,
    prev: MemConnection,
    recv: SlotRegion,
    bell: SlotRegion,
    work: SlotRegion,
    next_slots: SlotGrant,
    prev_slots: SlotGrant,
    backlog: Vec<u32>,
    owed: Vec<u8>,
}

/// `world` ranks in this process, joined in a ring over [`MemConnection`]s.
///
/// A test and benchmark harness of the host ring (no sockets, no NICs); runtimes use
/// [`crate::comm::Communicator`].
pub(crate) struct LocalRing {
    ranks: Vec<Rank>,
    options: HostRingOptions,
    seq: u64,
}

/// What one rank's thread runs for one collective.
type RankFn<'a> = dyn Fn(usize, &mut HostRing<'_>, u64) -> Result<()> + Sync + 'a;

impl LocalRing {
    /// A ring of `world` ranks for buffers of up to `max_bytes` (pinned for GPU copies where
    /// CUDA is present, so the staged GPU path runs at pinned speed).
    pub(crate) fn new(world: u32, max_bytes: usize, options: HostRingOptions) -> Result<LocalRing> {
        Self::with_pinning(world, max_bytes, options, None)
    }

    fn with_pinning(
        world: u32,
        max_bytes: usize,
        options: HostRingOptions,
        pin: Option<&std::sync::Arc<cudarc::driver::CudaContext>>,
    ) -> Result<LocalRing> {
        if world == 0 {
            return Err(Error::InvalidArgument {
                reason: "a ring of zero ranks".into(),
            });
        }
        let n = world as usize;
        let region = |len: usize| -> Result<SlotRegion> {
            let mut b = HostBuffer::new(len.max(64))?;
            if let Some(context) = pin {
                b.register_with_cuda(context)?;
            }
            Ok(SlotRegion::host(b))
        };
        // Connection r joins rank r (its next side) and rank r + 1 (its prev side).
        let mut nexts = Vec::with_capacity(n);
        let mut prevs: Vec<Option<MemConnection>> = (0..n).map(|_| None).collect();
        for r in 0..n {
            let (a, b) = MemConnection::pair();
            nexts.push(a);
            prevs[(r + 1) % n] = Some(b);
        }
        let mut prevs: Vec<MemConnection> = prevs.into_iter().flatten().collect();
        let slot_memory = options.slots as usize * options.slot_bytes;
        let recv = (0..n)
            .map(|_| region(slot_memory))
            .collect::<Result<Vec<_>>>()?;
        let bells = (0..n)
            .map(|_| region(BELL_BYTES))
            .collect::<Result<Vec<_>>>()?;
        let work = (0..n)
            .map(|_| region(max_bytes))
            .collect::<Result<Vec<_>>>()?;
        // Rank r grants its slots on its prev connection, a doorbell on its next connection.
        let mut recv_grants = Vec::with_capacity(n);
        let mut bell_grants = Vec::with_capacity(n);
        for r in 0..n {
            recv_grants.push(prevs[r].grant(&recv[r])?);
            bell_grants.push(nexts[r].grant(&bells[r])?);
        }
        let ranks = nexts
            .into_iter()
            .zip(prevs)
            .enumerate()
            .map(|(r, (next, prev))| Rank {
                next,
                prev,
                recv: recv[r].clone(),
                bell: bells[r].clone(),
                work: work[r].clone(),
                next_slots: recv_grants[(r + 1) % n],
                prev_slots: bell_grants[(r + n - 1) % n],
                backlog: Vec::new(),
                owed: Vec::new(),
            })
            .collect();
        Ok(LocalRing {
            ranks,
            options,
            seq: 0,
        })
    }

    /// Ranks in the ring.
    pub(crate) fn world(&self) -> u32 {
        self.ranks.len() as u32
    }

    /// Allreduces `data[r]` (rank r's elements) in place, all ranks at once: the element type
    /// names the data type (`Vec<f32>`, `Vec<half::bf16>`, ...).
    pub(crate) fn all_reduce_in_place<T: crate::Element>(
        &mut self,
        data: &mut [Vec<T>],
        op: ReduceOp,
    ) -> Result<()> {
        let mut bytes: Vec<&mut [u8]> = data
            .iter_mut()
            .map(|d| crate::element::bytes_mut(d))
            .collect();
        self.all_reduce_bytes(&mut bytes, T::DATA_TYPE, op)
    }

    fn all_reduce_bytes(
        &mut self,
        data: &mut [&mut [u8]],
        dtype: DataType,
        op: ReduceOp,
    ) -> Result<()> {
        self.check_count(data.len())?;
        let cells: Vec<std::sync::Mutex<&mut &mut [u8]>> =
            data.iter_mut().map(std::sync::Mutex::new).collect();
        self.run(&|r, ring, seq| {
            let mut d = cells[r].lock().map_err(|_| Error::Aborted {
                reason: "a rank's thread panicked".into(),
            })?;
            ring.all_reduce(&mut d, dtype, op, seq, &|| Ok(()))
        })
    }

    fn check_count(&self, got: usize) -> Result<()> {
        if got != self.ranks.len() {
            return Err(Error::InvalidArgument {
                reason: format!("{got} buffers for a ring of {} ranks", self.ranks.len()),
            });
        }
        Ok(())
    }

    fn run(&mut self, f: &RankFn<'_>) -> Result<()> {
        let world = self.world();
        let (options, seq) = (self.options, self.seq);
        self.seq += 1;
        thread::scope(|s| {
            let handles: Vec<_> = self
                .ranks
                .iter_mut()
                .enumerate()
                .map(|(r, rank)| {
                    s.spawn(move || {
                        let links = if world == 1 {
                            None
                        } else {
                            Some(Links::Two {
                                next: &mut rank.next as &mut dyn HostConnection,
                                prev: &mut rank.prev as &mut dyn HostConnection,
                            })
                        };
                        let Some(links) = links else {
                            return Ok(());
                        };
                        let mut ring = HostRing {
                            rank: r as u32,
                            world,
                            links,
                            next_slots: rank.next_slots,
                            prev_slots: rank.prev_slots,
                            recv: rank.recv.clone(),
                            bell: rank.bell.clone(),
                            work: rank.work.clone(),
                            options,
                            backlog: std::mem::take(&mut rank.backlog),
                            owed: std::mem::take(&mut rank.owed),
                        };
                        ring.owe_release(seq);
                        let result = f(r, &mut ring, seq);
                        rank.backlog = std::mem::take(&mut ring.backlog);
                        rank.owed = std::mem::take(&mut ring.owed);
                        result
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join().unwrap_or_else(|_| {
                        Err(Error::Aborted {
                            reason: "a rank's thread panicked".into(),
                        })
                    })
                })
                .collect::<Result<Vec<()>>>()
                .map(|_| ())
        })
    }
}

#[cfg(test)]
#[path = "local_tests.rs"]
mod tests;
