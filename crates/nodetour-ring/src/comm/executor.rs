//! The executors: one per kind of memory a collective runs on, behind one interface
//! ([`Executor`]), each handed the collective value ([`CallSpec`], built and checked once by
//! its verb) and what the operands lent for the call:
//!
//! | executor | memory | runs |
//! |---|---|---|
//! | [`HostMemory`] | host memory ([`HostOperands`]) | the host ring, synchronously (`host_collectives.rs`) |
//! | [`DeviceMemory`] | device memory of a communicator of processes ([`DeviceOperands`]) | the GPU ring on the stream (ranks of one host over cuda-ipc or shm, across hosts over network links), else staged through the host ring with the reason (`device_collectives.rs`, `device_buffers.rs`) |
//! | [`SetMember`] | device memory of one GPU of a set ([`DeviceOperands`]) | this member's share, meeting the other members' (`device_set.rs`) |
//!
//! The verbs (`verbs.rs`) choose the executor from the memory lent, in one place; the call
//! order across streams (`call_order.rs`) is the verb's, around the executor.

use nodetour_core::cuda::GpuStream;
use nodetour_core::memory::DeviceBuffer;

use super::device_set::SetMember;
use super::engine::Engine;
use crate::call::CallSpec;
use crate::error::Result;

/// Runs one collective on the memory of one kind.
pub(super) trait Executor {
    /// What the operands lent for one call.
    type Operands<'a>;

    /// Runs `call` (checked) on `on`: without an input, in place in the output.
    fn run(&self, call: CallSpec, on: Self::Operands<'_>) -> Result<()>;
}

/// Host memory lent for one call: returns with the answer in `out`.
pub(super) struct HostOperands<'a> {
    pub(super) send: Option<&'a [u8]>,
    pub(super) out: &'a mut [u8],
}

/// Device memory lent for one call, and the stream it is queued on.
pub(crate) struct DeviceOperands<'a> {
    pub(crate) send: Option<&'a DeviceBuffer>,
    pub(crate) out: &'a DeviceBuffer,
    pub(crate) stream: &'a GpuStream,
}

/// The executor of host memory of a communicator of processes (its engine).
pub(super) struct HostMemory<'c>(pub(super) &'c Engine);

/// The executor of device memory of a communicator of processes: the engine that runs on the
/// stream's GPU (the communicator's own, or its device side formed from a stream: see
/// `Communicator::on_device`).
pub(super) struct DeviceMemory<'c>(pub(super) &'c Engine);

impl Executor for HostMemory<'_> {
    type Operands<'a> = HostOperands<'a>;

    fn run(&self, call: CallSpec, on: HostOperands<'_>) -> Result<()> {
        self.0.host_verb(call, on.send, on.out)
    }
}

impl Executor for DeviceMemory<'_> {
    type Operands<'a> = DeviceOperands<'a>;

    fn run(&self, call: CallSpec, on: DeviceOperands<'_>) -> Result<()> {
        self.0.device_verb(call, on)
    }
}

impl Executor for SetMember {
    type Operands<'a> = DeviceOperands<'a>;

    fn run(&self, call: CallSpec, on: DeviceOperands<'_>) -> Result<()> {
        self.verb(call, on)
    }
}
