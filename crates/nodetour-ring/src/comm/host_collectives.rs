//! Collectives on host memory: synchronous, through the bounded staging region in pieces;
//! `Ok` only with the answer in the output, the same bits on every rank.

use super::*;

/// Element ranges of at most `per` elements covering `0..count` (none for an empty buffer).
pub(super) fn pieces(count: usize, per: usize) -> impl Iterator<Item = Range<usize>> {
    let per = per.max(1);
    (0..count.div_ceil(per)).map(move |i| i * per..((i + 1) * per).min(count))
}

/// Runs an all-gather piece staged by the caller and scatters the result: block `q` of the
/// ring's buffer (position `q`) goes to rank `order[q]`'s block of `out`, elements `r`.
#[allow(clippy::too_many_arguments)]
pub(super) fn gather_out(
    comm: &Engine,
    ring: &mut HostRing<'_>,
    what: &Descriptor,
    l: Layout,
    out: &mut [u8],
    n: usize,
    r: Range<usize>,
    alive: &Alive<'_>,
) -> Result<()> {
    let staged = Staged {
        shape: Shape::AllGather,
        count: (r.len() * comm.world as usize) as u64,
        dtype: what.dtype,
        op: ReduceOp::Sum,
    };
    let es = l.es;
    let mut outputs: Vec<(usize, &mut [u8])> = out
        .chunks_mut(n * es)
        .enumerate()
        .map(|(rank, block)| {
            (
                l.at(comm.position_of(rank as u32)),
                &mut block[r.start * es..r.end * es],
            )
        })
        .collect();
    ring.collective(staged, what, &mut outputs, alive)
}

impl Engine {
    /// The allreduce of `send` (or, without it, of `out` itself) into `out`.
    pub(super) fn all_reduce_bytes(
        &self,
        send: Option<&[u8]>,
        out: &mut [u8],
        dtype: DataType,
        op: ReduceOp,
    ) -> Result<()> {
        let es = dtype.size();
        let n = out.len() / es;
        let gather_max = {
            let state = self.usable()?;
            state.job.as_ref().map_or(0, HostJob::host_gather_max)
        };
        if self.world > 1 && n > 0 && out.len() <= gather_max {
            return self.all_reduce_gathered(send, out, dtype, op);
        }
        let what = self.descriptor(Collective::AllReduce, n, dtype, op, None);
        self.run_pieces(&what, n, 1, |ring, r, d, alive| {
            let b = r.start * es..r.end * es;
            let staged = Staged {
                shape: Shape::AllReduce,
                count: r.len() as u64,
                dtype,
                op,
            };
            // Reductions read the input where it is; the output is written once it finished.
            ring.all_reduce_from(staged, d, &send.unwrap_or(&*out)[b.clone()], alive)?;
            ring.read_out(staged, &mut [(0, &mut out[b])])
        })
    }

    /// A small allreduce: every rank's whole input goes to every rank (an all-gather around the
    /// ring: `world − 1` hops of the buffer, where the ring takes `2 (world − 1)` hops of a
    /// block), and each rank reduces the `world` inputs itself, in ring order from position 0:
    /// the same operations in the same order on every rank, so every rank's result is bitwise
    /// the same. The algorithm is in the descriptor the ranks agree on.
    pub(super) fn all_reduce_gathered(
        &self,
        send: Option<&[u8]>,
        out: &mut [u8],
        dtype: DataType,
        op: ReduceOp,
    ) -> Result<()> {
        let es = dtype.size();
        let n = out.len() / es;
        let world = self.world as usize;
        let what = Descriptor {
            algorithm: Algorithm::HostGather,
            ..self.descriptor(Collective::AllReduce, n, dtype, op, None)
        };
        self.run_pieces(&what, n, self.world, |ring, r, d, alive| {
            let b = r.start * es..r.end * es;
            let len = b.len();
            // Segment p of the gathered buffer is position p's input.
            ring.stage_in_as(
                ring.rank as usize * len,
                &send.unwrap_or(&*out)[b.clone()],
                dtype,
                op,
            )?;
            let staged = Staged {
                shape: Shape::AllGather,
                count: (r.len() * world) as u64,
                dtype,
                op,
            };
            let mut all = vec![0u8; len * world];
            ring.collective(staged, d, &mut [(0, &mut all[..])], alive)?;
            let result = &mut out[b];
            result.copy_from_slice(&all[..len]);
            for input in all[len..].chunks_exact(len) {
                crate::reduce::reduce_into(dtype, op, result, input)?;
            }
            if op == ReduceOp::Avg {
                crate::reduce::finish_avg(dtype, result, self.world)?;
            }
            Ok(())
        })
    }

    /// The reduce-scatter of `send` (or, without it, of `out` itself: `world` blocks of `n`
    /// elements of `dtype`) into the `n` elements of `out` at element `out_at`.
    pub(super) fn reduce_scatter_into(
        &self,
        send: Option<&[u8]>,
        out: &mut [u8],
        n: usize,
        out_at: usize,
        dtype: DataType,
        op: ReduceOp,
    ) -> Result<()> {
        let what = self.descriptor(Collective::ReduceScatter, n, dtype, op, None);
        let me = self.position();
        let es = dtype.size();
        self.run_pieces(&what, n, self.world, |ring, r, d, alive| {
            let l = Layout { es, len: r.len() };
            let input = send.unwrap_or(&*out);
            for rank in 0..self.world {
                let block = rank as usize * n;
                let src = &input[(block + r.start) * es..(block + r.end) * es];
                ring.stage_in_as(l.at(self.position_of(rank)), src, dtype, op)?;
            }
            let staged = Staged {
                shape: Shape::ReduceScatter,
                count: (r.len() * self.world as usize) as u64,
                dtype,
                op,
            };
            let dst = &mut out[(out_at + r.start) * es..(out_at + r.end) * es];
            ring.collective(staged, d, &mut [(l.at(me), dst)], alive)
        })
    }

    /// The all-gather of `send` (or, without it, of block `rank` of `out`; blocks of `n`
    /// elements of `dtype`) into `out`.
    pub(super) fn all_gather_into(
        &self,
        send: Option<&[u8]>,
        out: &mut [u8],
        n: usize,
        dtype: DataType,
    ) -> Result<()> {
        let what = self.descriptor(Collective::AllGather, n, dtype, ReduceOp::Sum, None);
        let me = self.position();
        let es = dtype.size();
        let mine = if send.is_some() {
            0
        } else {
            self.rank as usize * n
        };
        self.run_pieces(&what, n, self.world, |ring, r, d, alive| {
            let l = Layout { es, len: r.len() };
            let input = send.unwrap_or(&*out);
            ring.stage_in(l.at(me), &input[(mine + r.start) * es..(mine + r.end) * es])?;
            gather_out(self, ring, d, l, out, n, r, alive)
        })
    }

    /// The broadcast of the root's `send` (or, without it, of its `out`) into `out`.
    pub(super) fn broadcast_into(
        &self,
        send: Option<&[u8]>,
        out: &mut [u8],
        root: u32,
        dtype: DataType,
    ) -> Result<()> {
        let n = out.len() / dtype.size();
        let what = self.descriptor(Collective::Broadcast, n, dtype, ReduceOp::Sum, Some(root));
        self.broadcast_with(what, send, out, root)
    }

    /// The broadcast of rank `root`'s bytes in `out`, as the collective `what` (the device
    /// side's formation runs it under an algorithm of its own).
    pub(super) fn broadcast_as(&self, what: Descriptor, out: &mut [u8], root: u32) -> Result<()> {
        self.broadcast_with(what, None, out, root)
    }

    fn broadcast_with(
        &self,
        what: Descriptor,
        send: Option<&[u8]>,
        out: &mut [u8],
        root: u32,
    ) -> Result<()> {
        let (dtype, n) = (what.dtype, what.count as usize);
        let es = dtype.size();
        let is_root = self.rank == root;
        self.run_pieces(&what, n, 1, |ring, r, d, alive| {
            let b = r.start * es..r.end * es;
            if is_root {
                ring.stage_in(0, &send.unwrap_or(&*out)[b.clone()])?;
            }
            let staged = Staged {
                shape: Shape::Broadcast {
                    root: self.position_of(root),
                },
                count: r.len() as u64,
                dtype,
                op: ReduceOp::Sum,
            };
            // In place, the root's buffer already holds the answer.
            let mut outputs = if is_root && send.is_none() {
                vec![]
            } else {
                vec![(0, &mut out[b])]
            };
            ring.collective(staged, d, &mut outputs, alive)
        })
    }

    /// Runs `what` (per-rank count `n`) in pieces: each piece covers elements `r` of every
    /// rank's block (`blocks` blocks share the staging region) and is one ring collective with
    /// its own sequence number; `body` stages its input, runs it and fills its output. Any
    /// failure breaks the communicator (ranks were talking); the output then holds the results
    /// of the pieces that finished and the rest as it was.
    pub(super) fn run_pieces(
        &self,
        what: &Descriptor,
        n: usize,
        blocks: u32,
        mut body: impl FnMut(&mut HostRing<'_>, Range<usize>, &Descriptor, &Alive<'_>) -> Result<()>,
    ) -> Result<()> {
        let mut state = self.usable()?;
        let job = state.job.as_mut().expect("usable");
        let es = what.dtype.size();
        let per = job.piece_bytes() / es / blocks as usize;
        if per == 0 {
            return Err(Error::InvalidArgument {
                reason: format!(
                    "a staging region of {} bytes holds no piece of {blocks} blocks of {:?}: raise NODETOUR_PIECE_BYTES",
                    job.piece_bytes(),
                    what.dtype
                ),
            });
        }
        let aborted = self.aborted.clone();
        let call = self.next_call();
        let mut result = Ok(());
        for r in pieces(n, per) {
            result = job.run(&aborted, |ring, seq, alive| {
                body(ring, r, &Descriptor { seq, call, ..*what }, alive)
            });
            if result.is_err() {
                break;
            }
        }
        if let Err(e) = &result {
            self.record_failure(&mut state, e);
        }
        result
    }
}
