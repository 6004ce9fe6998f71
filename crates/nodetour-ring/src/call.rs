//! One collective as a caller asked for it ([`CallSpec`]), the value every executor runs:
//! built and checked once by its verb (`comm/verbs.rs`) before any memory is lent, then handed
//! whole to the executor of the memory it runs on (host memory, device memory of this
//! process's communicator, a member of a GPU set), as NCCL's `ncclInfo` is to its one enqueue
//! path. The ranks taking part agree on this value less each rank's own PreMulSum scalar
//! ([`CallSpec::agrees`]).
//!
//! A GPU ring runs the same collective in place on one buffer laid out in ring positions: the
//! [`RingCall`] that [`CallSpec::on_ring`] makes, which also gives the descriptor the ring's
//! ranks compare ([`RingCall::descriptor`]).

use crate::descriptor::{Algorithm, Collective, Descriptor};
use crate::error::{Error, Result};
use crate::plan::Shape;
use crate::reduce::{DataType, ReduceOp};

/// One collective: its kind, counts, type, operation and root.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct CallSpec {
    pub(crate) kind: Collective,
    /// Elements of one block (reduce-scatter, all-gather) or of the buffer (allreduce,
    /// broadcast).
    pub(crate) count: usize,
    pub(crate) dtype: DataType,
    /// The reduction (`Sum` for the kinds that reduce nothing).
    pub(crate) op: ReduceOp,
    /// The broadcast's root (0 for the other kinds).
    pub(crate) root: u32,
}

impl CallSpec {
    pub(crate) fn all_reduce(count: usize, dtype: DataType, op: ReduceOp) -> CallSpec {
        CallSpec {
            kind: Collective::AllReduce,
            count,
            dtype,
            op,
            root: 0,
        }
    }

    pub(crate) fn reduce_scatter(count: usize, dtype: DataType, op: ReduceOp) -> CallSpec {
        CallSpec {
            kind: Collective::ReduceScatter,
            ..CallSpec::all_reduce(count, dtype, op)
        }
    }

    pub(crate) fn all_gather(count: usize, dtype: DataType) -> CallSpec {
        CallSpec {
            kind: Collective::AllGather,
            ..CallSpec::all_reduce(count, dtype, ReduceOp::Sum)
        }
    }

    pub(crate) fn broadcast(count: usize, dtype: DataType, root: u32) -> CallSpec {
        CallSpec {
            kind: Collective::Broadcast,
            root,
            ..CallSpec::all_reduce(count, dtype, ReduceOp::Sum)
        }
    }

    /// The value, checked for a communicator of `world` ranks: the operation for the type
    /// (a reducing kind), the root (a broadcast), and the bytes of one block and of every
    /// rank's blocks within the address space.
    pub(crate) fn checked(self, world: u32) -> Result<CallSpec> {
        if self.reduces() {
            crate::reduce::check_op(self.dtype, self.op)?;
        }
        if self.root >= world {
            return Err(Error::InvalidArgument {
                reason: format!("root {} in a communicator of {world} ranks", self.root),
            });
        }
        let blocks = match self.kind {
            Collective::ReduceScatter | Collective::AllGather => world as usize,
            Collective::AllReduce | Collective::Broadcast => 1,
        };
        element_bytes(self.count, blocks, self.dtype)?;
        Ok(self)
    }

    /// Whether the kind reduces (allreduce, reduce-scatter).
    pub(crate) fn reduces(&self) -> bool {
        matches!(self.kind, Collective::AllReduce | Collective::ReduceScatter)
    }

    /// Bytes of one block (of the buffer, for allreduce and broadcast).
    pub(crate) fn block_bytes(&self) -> Result<usize> {
        element_bytes(self.count, 1, self.dtype)
    }

    /// The collective as a ring of `world` ranks runs it in place, this call's root at ring
    /// position `root_at` (a broadcast's; ignored for the other kinds): the buffer holds
    /// every rank's block for a reduce-scatter or an all-gather. Call on a checked value (its
    /// bytes are then within the address space).
    pub(crate) fn on_ring(&self, world: u32, root_at: u32) -> RingCall {
        let (shape, count) = match self.kind {
            Collective::AllReduce => (Shape::AllReduce, self.count),
            Collective::ReduceScatter => (Shape::ReduceScatter, self.count * world as usize),
            Collective::AllGather => (Shape::AllGather, self.count * world as usize),
            Collective::Broadcast => (Shape::Broadcast { root: root_at }, self.count),
        };
        let op = if self.reduces() {
            self.op
        } else {
            ReduceOp::Sum
        };
        RingCall {
            shape,
            count,
            dtype: self.dtype,
            op,
        }
    }

    /// Whether two ranks' values name the same collective: a PreMulSum's scalar is each
    /// rank's own (the operation's code is what they agree on).
    pub(crate) fn agrees(&self, other: &CallSpec) -> bool {
        let plain = |c: &CallSpec| CallSpec {
            op: ReduceOp::ALL[usize::from(c.op.code())],
            ..*c
        };
        plain(self) == plain(other)
    }
}

/// One collective as a ring runs it: in place on the first `count` elements of one buffer, in
/// ring positions (a broadcast's root is a position; reduce-scatter leaves segment `p` of
/// position `p` reduced, all-gather starts from it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RingCall {
    pub(crate) shape: Shape,
    /// Elements of the whole buffer.
    pub(crate) count: usize,
    pub(crate) dtype: DataType,
    /// The reduction (`Sum` for the shapes that reduce nothing).
    pub(crate) op: ReduceOp,
}

impl RingCall {
    /// Whether the shape reduces (allreduce, reduce-scatter).
    pub(crate) fn reduces(&self) -> bool {
        matches!(self.shape, Shape::AllReduce | Shape::ReduceScatter)
    }

    /// Bytes of the buffer it runs on, overflow-checked.
    pub(crate) fn bytes(&self) -> Result<usize> {
        element_bytes(self.count, 1, self.dtype)
    }

    /// What the ranks of the ring compare: this collective run by `algorithm`, the ring's
    /// `seq`-th, the communicator's `call`-th.
    pub(crate) fn descriptor(&self, algorithm: Algorithm, seq: u64, call: u32) -> Descriptor {
        let (collective, root) = match self.shape {
            Shape::AllReduce => (Collective::AllReduce, None),
            Shape::ReduceScatter => (Collective::ReduceScatter, None),
            Shape::AllGather => (Collective::AllGather, None),
            Shape::Broadcast { root } => (Collective::Broadcast, Some(root)),
        };
        Descriptor {
            collective,
            count: self.count as u64,
            dtype: self.dtype,
            op: self.op,
            root,
            algorithm,
            seq,
            call,
        }
    }
}

/// Bytes of `blocks` blocks of `count` elements of `dtype`, overflow-checked.
pub(crate) fn element_bytes(count: usize, blocks: usize, dtype: DataType) -> Result<usize> {
    count
        .checked_mul(blocks)
        .and_then(|c| c.checked_mul(dtype.size()))
        .ok_or_else(|| Error::InvalidArgument {
            reason: format!("{blocks} blocks of {count} elements of {dtype:?} overflow"),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checked_refuses_a_bad_root_an_overflow_and_a_bad_operation() {
        let ok = CallSpec::broadcast(10, DataType::F32, 3).checked(4);
        assert_eq!(ok.unwrap().root, 3);
        assert!(matches!(
            CallSpec::broadcast(10, DataType::F32, 4).checked(4),
            Err(Error::InvalidArgument { .. })
        ));
        assert!(matches!(
            CallSpec::all_gather(usize::MAX / 8, DataType::F64).checked(2),
            Err(Error::InvalidArgument { .. })
        ));
        // An integer type is multiplied by a whole number only.
        assert!(
            CallSpec::all_reduce(4, DataType::I32, ReduceOp::pre_mul_sum(0.5))
                .checked(2)
                .is_err()
        );
        // A kind that reduces nothing never looks at the operation.
        assert!(CallSpec::all_gather(4, DataType::I32).checked(2).is_ok());
    }

    #[test]
    fn a_call_on_the_ring_holds_every_block_and_names_its_root_by_position() {
        let rs = CallSpec::reduce_scatter(5, DataType::F32, ReduceOp::Max).on_ring(4, 0);
        assert_eq!(
            (rs.shape, rs.count, rs.op),
            (Shape::ReduceScatter, 20, ReduceOp::Max)
        );
        let ag = CallSpec::all_gather(5, DataType::F32).on_ring(4, 0);
        assert_eq!((ag.shape, ag.count), (Shape::AllGather, 20));
        let b = CallSpec::broadcast(7, DataType::I8, 3).on_ring(4, 1);
        assert_eq!((b.shape, b.count), (Shape::Broadcast { root: 1 }, 7));
        let d = b.descriptor(Algorithm::StreamRing, 9, 11);
        assert_eq!((d.root, d.seq, d.call, d.count), (Some(1), 9, 11, 7));
        let ar = CallSpec::all_reduce(6, DataType::F64, ReduceOp::Avg).on_ring(4, 0);
        assert_eq!(
            (ar.shape, ar.count, ar.op),
            (Shape::AllReduce, 6, ReduceOp::Avg)
        );
        assert_eq!(
            ar.descriptor(Algorithm::OneShot, 2, 3),
            Descriptor {
                call: 3,
                ..Descriptor::all_reduce(6, DataType::F64, ReduceOp::Avg, Algorithm::OneShot, 2)
            }
        );
    }

    #[test]
    fn ranks_agree_whatever_their_premulsum_scalars() {
        let a = CallSpec::all_reduce(8, DataType::F32, ReduceOp::pre_mul_sum(0.25));
        let b = CallSpec::all_reduce(8, DataType::F32, ReduceOp::pre_mul_sum(4.0));
        assert!(a.agrees(&b));
        assert!(!a.agrees(&CallSpec::all_reduce(8, DataType::F32, ReduceOp::Sum)));
        assert!(!a.agrees(&CallSpec::reduce_scatter(
            8,
            DataType::F32,
            ReduceOp::pre_mul_sum(1.0)
        )));
        assert!(!a.agrees(&CallSpec::all_reduce(
            9,
            DataType::F32,
            ReduceOp::pre_mul_sum(0.25)
        )));
    }
}
