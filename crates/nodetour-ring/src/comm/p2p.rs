//! Point-to-point on host memory: [`Communicator::send`], [`Communicator::recv`], and a
//! [`Batch`] of them in one call (NCCL's group of sends and receives, torch's
//! `batch_isend_irecv`). Each pair of ranks talks over a peer link of its own, formed the first
//! time the pair meets (within the joining timeout) and reused after (`crate::p2p`).
//!
//! Messages between two ranks match in order: the k-th send from a rank to a peer meets the
//! peer's k-th receive from that rank. A send and its receive must agree on the element count
//! and type: where they do not, both fail with [`Error::Disagreement`] and nothing is copied.
//! A call returns `Ok` once every part is done: a send once its receiver has every byte, a
//! receive with every byte in its memory. A send or receive to this rank itself meets its
//! counterpart in the same batch.

use super::peers::run::Part;
use super::*;
use crate::element::{Element, bytes, bytes_mut};
use crate::p2p::link::PartMemory;
use crate::p2p::protocol::Shape;

/// Sends and receives run together in one call ([`Communicator::batch`]): none waits for
/// another, whatever order each rank lists its parts in. Borrowing the memory of every part
/// until [`Batch::run`] returns.
pub struct Batch<'c, 'a> {
    comm: &'c Communicator,
    parts: Vec<Part<'a>>,
}

impl<'a> Batch<'_, 'a> {
    /// Adds a send of `data` to rank `peer`.
    pub fn send<T: Element>(&mut self, data: &'a [T], peer: u32) -> &mut Self {
        self.add::<T>(peer, data.len(), PartMemory::Send(bytes(data)))
    }

    /// Adds a receive into `data` from rank `peer` (exactly `data.len()` elements of `T`).
    pub fn recv<T: Element>(&mut self, data: &'a mut [T], peer: u32) -> &mut Self {
        let count = data.len();
        self.add::<T>(peer, count, PartMemory::Recv(bytes_mut(data)))
    }

    /// Adds a send of `data` (elements of a type known at run time) to rank `peer`.
    pub fn send_bytes(&mut self, data: HostBytes<'a>, peer: u32) -> &mut Self {
        let (bytes, dtype) = data.into_parts();
        let bytes: &'a [u8] = match bytes {
            Ok(w) => w,
            Err(r) => r,
        };
        let count = bytes.len() / dtype.size();
        self.add_typed(peer, count, dtype, PartMemory::Send(bytes))
    }

    /// Adds a receive into `data` (made by [`HostBytes::new_mut`]) from rank `peer`.
    pub fn recv_bytes(&mut self, data: HostBytes<'a>, peer: u32) -> Result<&mut Self> {
        let (bytes, dtype) = data.into_parts();
        let bytes = bytes.map_err(|_| Error::InvalidArgument {
            reason: "a receive into bytes made by HostBytes::new (read only): use new_mut".into(),
        })?;
        let count = bytes.len() / dtype.size();
        Ok(self.add_typed(peer, count, dtype, PartMemory::Recv(bytes)))
    }

    fn add<T: Element>(&mut self, peer: u32, count: usize, memory: PartMemory<'a>) -> &mut Self {
        self.add_typed(peer, count, T::DATA_TYPE, memory)
    }

    fn add_typed(
        &mut self,
        peer: u32,
        count: usize,
        dtype: DataType,
        memory: PartMemory<'a>,
    ) -> &mut Self {
        let shape = Shape {
            count: count as u64,
            dtype,
        };
        self.parts.push(Part {
            peer,
            shape,
            memory,
        });
        self
    }

    /// Runs every part: `Ok` once each is done, else the first failure (the peers whose parts
    /// met a failed one fail too, told why).
    pub fn run(self) -> Result<()> {
        self.comm.engine.point_to_point(self.parts)
    }
}

impl Communicator {
    /// A batch of sends and receives, run together by [`Batch::run`].
    ///
    /// ```no_run
    /// # fn demo(comm: &nodetour_ring::comm::Communicator) -> nodetour_ring::Result<()> {
    /// let (me, world) = (comm.rank(), comm.world());
    /// let mine = vec![me as f32; 1024];
    /// let mut from_prev = vec![0f32; 1024];
    /// let mut batch = comm.batch();
    /// batch.send(&mine, (me + 1) % world).recv(&mut from_prev, (me + world - 1) % world);
    /// batch.run()?;
    /// # Ok(()) }
    /// ```
    pub fn batch<'a>(&self) -> Batch<'_, 'a> {
        Batch {
            comm: self,
            parts: Vec::new(),
        }
    }

    /// Sends `data` to rank `peer`: returns once `peer` has received every byte (its matching
    /// [`Self::recv`]).
    pub fn send<T: Element>(&self, data: &[T], peer: u32) -> Result<()> {
        let mut b = self.batch();
        b.send(data, peer);
        b.run()
    }

    /// Receives into `data` from rank `peer` (its matching [`Self::send`], of exactly
    /// `data.len()` elements of `T`).
    pub fn recv<T: Element>(&self, data: &mut [T], peer: u32) -> Result<()> {
        let mut b = self.batch();
        b.recv(data, peer);
        b.run()
    }

    /// Waits until every rank has called `barrier` (a one-byte allreduce on the host ring).
    pub fn barrier(&self) -> Result<()> {
        let mut x = [0u8; 1];
        self.all_reduce_in_place(&mut x[..], ReduceOp::Max, Host)
    }
}

impl Engine {
    /// Runs `parts`: the parts to this rank itself pair up here; the rest go over the peer
    /// links, formed first where missing.
    pub(super) fn point_to_point(&self, parts: Vec<Part<'_>>) -> Result<()> {
        for p in &parts {
            if p.peer >= self.world {
                return Err(Error::InvalidArgument {
                    reason: format!("rank {} of a job of {}", p.peer, self.world),
                });
            }
        }
        let (own, parts): (Vec<Part<'_>>, Vec<Part<'_>>) =
            parts.into_iter().partition(|p| p.peer == self.rank);
        self.to_itself(own)?;
        if parts.is_empty() {
            return Ok(());
        }
        let mut state = self.usable()?;
        let aborted = || self.aborted.lock().ok().and_then(|a| a.clone());
        let job = state.job.as_mut().expect("usable: not closed");
        let r = job.point_to_point(parts, self.timeout, &aborted);
        if let Err(e) = &r {
            self.record_failure(&mut state, e);
        }
        r
    }

    /// Pairs the sends to this rank with its receives from itself, in order, and copies.
    fn to_itself(&self, parts: Vec<Part<'_>>) -> Result<()> {
        let (mut sends, mut recvs) = (Vec::new(), Vec::new());
        for p in parts {
            match p.memory {
                PartMemory::Send(b) => sends.push((p.shape, b)),
                PartMemory::Recv(b) => recvs.push((p.shape, b)),
            }
        }
        if sends.len() != recvs.len() {
            return Err(Error::InvalidArgument {
                reason: format!(
                    "{} sends to this rank itself and {} receives from it in one batch",
                    sends.len(),
                    recvs.len()
                ),
            });
        }
        for ((s, from), (r, to)) in sends.into_iter().zip(recvs) {
            if s != r {
                return Err(Error::Disagreement {
                    rank: self.rank,
                    peer: self.rank,
                    ours: format!("a receive of {} {}", r.count, r.dtype.name()),
                    theirs: format!("a send of {} {}", s.count, s.dtype.name()),
                });
            }
            to.copy_from_slice(from);
        }
        Ok(())
    }
}
