//! What the collective verbs accept, through one sealed pair of traits: [`Input`] (read) and
//! [`Output`] (written), each for one kind of [`Queue`] (what the work is ordered on; the
//! table is on [`Input`]).
//!
//! The raw form (a pointer, a count, a [`DataType`], a raw stream: runtimes on another cudarc
//! version, foreign bindings) is an [`Elements`] over [`DeviceBuffer::from_raw`] with a
//! [`GpuStream::from_raw`] stream; both constructors are `unsafe` and state their contracts
//! there, and check what the driver can check (the pointer's range and context, the stream's
//! context).
//!
//! A device operand is lent to the collective only for the call: the verb queues its work on
//! the stream and returns; cudarc's own ordering (its read and write events) is kept. On a
//! group's member thread the per-thread default stream is lent as the group's stand-in for it
//! (`call_order`): cudarc's events are waited for and recorded there, never on the member
//! thread's own per-thread stream.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, CudaView, CudaViewMut};
use nodetour_core::cuda::GpuStream;
use nodetour_core::memory::{DeviceBuffer, with_cudarc_slice, with_cudarc_slice_mut};

use super::call_order::{with_resolved, with_resolved_cudarc};
use super::symmetric::{SymmetricBuffer, SymmetricElements};
use crate::element::{Element, bytes, bytes_mut};
use crate::error::{Error, Result};
use crate::reduce::DataType;

/// The queue of host memory: a collective on host slices is synchronous (it returns with the
/// answer in the output).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Host;

/// What a collective's work is ordered on: [`Host`] for host memory; for device memory the
/// caller's stream (`&Arc<CudaStream>` for cudarc slices, `&GpuStream` for [`Elements`]).
/// Sealed.
pub trait Queue: sealed::Queue {}

/// Memory a collective reads, on queue `Q`. Sealed; these are the types:
///
/// | memory | type | queue |
/// |---|---|---|
/// | host | `[T]`, `[T; N]`, `Vec<T>` of an [`Element`] | [`Host`] |
/// | host, type at run time | [`HostBytes`] | [`Host`] |
/// | device, cudarc | `CudaSlice<T>`, `CudaView<T>`, `CudaViewMut<T>` | `&Arc<CudaStream>` |
/// | device, type at run time | [`Elements`] over a [`DeviceBuffer`] (nodetour's, or a view of the caller's) | `&GpuStream` |
/// | device, every rank's part mapped | [`SymmetricElements`] (in-place allreduce only) | `&GpuStream` |
///
/// The raw form (a pointer, a count, a [`DataType`], a raw stream: runtimes on another cudarc
/// version, foreign bindings) is an [`Elements`] over [`DeviceBuffer::from_raw`] with a
/// [`GpuStream::from_raw`] stream; both constructors are `unsafe`, check what the driver can
/// check, and state their contracts in `nodetour_core::cuda`'s docs.
pub trait Input<Q: Queue>: sealed::Input<Q> {}

/// Memory a collective writes, on queue `Q`. Sealed: the types of [`Input`] that can be
/// written (not `CudaView`, nor a [`HostBytes`] made by [`HostBytes::new`]).
pub trait Output<Q: Queue>: Input<Q> + sealed::Output<Q> {}

/// Host memory holding whole elements of a type known at run time (native byte order), as
/// runtimes that carry their element types as values pass it.
#[derive(Debug)]
pub struct HostBytes<'a> {
    bytes: HostSide<'a>,
    dtype: DataType,
}

#[derive(Debug)]
enum HostSide<'a> {
    Read(&'a [u8]),
    Write(&'a mut [u8]),
}

impl<'a> HostBytes<'a> {
    /// `bytes` read by a collective (an input), as elements of `dtype`.
    pub fn new(bytes: &'a [u8], dtype: DataType) -> Result<HostBytes<'a>> {
        whole(bytes.len(), dtype)?;
        Ok(HostBytes {
            bytes: HostSide::Read(bytes),
            dtype,
        })
    }

    /// `bytes` written by a collective (an output, or both in place).
    pub fn new_mut(bytes: &'a mut [u8], dtype: DataType) -> Result<HostBytes<'a>> {
        whole(bytes.len(), dtype)?;
        Ok(HostBytes {
            bytes: HostSide::Write(bytes),
            dtype,
        })
    }
}

impl<'a> HostBytes<'a> {
    /// The bytes for reading, their element type, and whether they may be written (made by
    /// [`Self::new_mut`]).
    pub(crate) fn into_parts(self) -> (std::result::Result<&'a mut [u8], &'a [u8]>, DataType) {
        let bytes = match self.bytes {
            HostSide::Read(b) => Err(b),
            HostSide::Write(b) => Ok(b),
        };
        (bytes, self.dtype)
    }
}

fn whole(len: usize, dtype: DataType) -> Result<()> {
    if !len.is_multiple_of(dtype.size()) {
        return Err(Error::InvalidArgument {
            reason: format!("{len} bytes are not whole {dtype:?} elements"),
        });
    }
    Ok(())
}

/// The first `count` elements of `dtype` of a device buffer: nodetour's own
/// ([`DeviceBuffer::new`]), a view of the caller's ([`DeviceBuffer::borrowed`]) or a raw
/// pointer's ([`DeviceBuffer::from_raw`]); used on a [`GpuStream`] of the buffer's GPU.
#[derive(Debug)]
pub struct Elements<'a> {
    buffer: &'a DeviceBuffer,
    count: usize,
    dtype: DataType,
}

impl<'a> Elements<'a> {
    /// The first `count` elements of `dtype` of `buffer` (`InvalidArgument` unless it holds
    /// them).
    pub fn new(buffer: &'a DeviceBuffer, count: usize, dtype: DataType) -> Result<Elements<'a>> {
        fits(count, dtype, buffer.len())?;
        Ok(Elements {
            buffer,
            count,
            dtype,
        })
    }
}

/// `InvalidArgument` unless `count` elements of `dtype` fit in `bytes`.
pub(super) fn fits(count: usize, dtype: DataType, bytes: usize) -> Result<()> {
    match count.checked_mul(dtype.size()) {
        Some(b) if b <= bytes => Ok(()),
        _ => Err(Error::InvalidArgument {
            reason: format!("{count} elements of {dtype:?} in {bytes} bytes"),
        }),
    }
}

/// What an operand lends a collective for the length of the call.
pub enum Lent<'v> {
    Host(&'v [u8]),
    Device(&'v DeviceBuffer, &'v GpuStream),
}

/// What an output operand lends a collective (device memory is written through a view).
pub enum LentMut<'v> {
    Host(&'v mut [u8]),
    Device(&'v DeviceBuffer, &'v GpuStream),
    /// A symmetric buffer (reduced in place by the one-kernel path).
    Symmetric(&'v SymmetricBuffer<'v>, &'v GpuStream),
}

pub(crate) mod sealed {
    use super::*;

    pub trait Queue: Copy {
        /// The stream device work is queued on (`None` for host memory).
        fn stream(&self) -> Option<GpuStream>;
        /// Whether this is host memory's queue (its collectives never meet a GPU set's).
        fn is_host(&self) -> bool {
            false
        }
    }

    pub trait Input<Q> {
        /// Elements.
        fn count(&self) -> usize;
        /// Their type.
        fn dtype(&self) -> DataType;
        /// Runs `f` with the memory lent for reading.
        fn lend<R>(&self, queue: Q, f: impl FnOnce(Lent<'_>) -> Result<R>) -> Result<R>;
    }

    pub trait Output<Q>: Input<Q> {
        /// Runs `f` with the memory lent for writing.
        fn lend_mut<R>(&mut self, queue: Q, f: impl FnOnce(LentMut<'_>) -> Result<R>) -> Result<R>;
    }
}

impl sealed::Queue for Host {
    fn stream(&self) -> Option<GpuStream> {
        None
    }
    fn is_host(&self) -> bool {
        true
    }
}
impl Queue for Host {}

impl sealed::Queue for &Arc<CudaStream> {
    fn stream(&self) -> Option<GpuStream> {
        Some(GpuStream::of_cudarc(self))
    }
}
impl Queue for &Arc<CudaStream> {}

impl sealed::Queue for &GpuStream {
    fn stream(&self) -> Option<GpuStream> {
        Some((*self).clone())
    }
}
impl Queue for &GpuStream {}

// --- host memory ---

impl<T: Element> sealed::Input<Host> for [T] {
    fn count(&self) -> usize {
        self.len()
    }
    fn dtype(&self) -> DataType {
        T::DATA_TYPE
    }
    fn lend<R>(&self, _: Host, f: impl FnOnce(Lent<'_>) -> Result<R>) -> Result<R> {
        f(Lent::Host(bytes(self)))
    }
}
impl<T: Element> sealed::Output<Host> for [T] {
    fn lend_mut<R>(&mut self, _: Host, f: impl FnOnce(LentMut<'_>) -> Result<R>) -> Result<R> {
        f(LentMut::Host(bytes_mut(self)))
    }
}
impl<T: Element> Input<Host> for [T] {}
impl<T: Element> Output<Host> for [T] {}

impl<T: Element> sealed::Input<Host> for Vec<T> {
    fn count(&self) -> usize {
        self.len()
    }
    fn dtype(&self) -> DataType {
        T::DATA_TYPE
    }
    fn lend<R>(&self, q: Host, f: impl FnOnce(Lent<'_>) -> Result<R>) -> Result<R> {
        sealed::Input::lend(self.as_slice(), q, f)
    }
}
impl<T: Element> sealed::Output<Host> for Vec<T> {
    fn lend_mut<R>(&mut self, q: Host, f: impl FnOnce(LentMut<'_>) -> Result<R>) -> Result<R> {
        sealed::Output::lend_mut(self.as_mut_slice(), q, f)
    }
}
impl<T: Element> Input<Host> for Vec<T> {}
impl<T: Element> Output<Host> for Vec<T> {}

impl<T: Element, const N: usize> sealed::Input<Host> for [T; N] {
    fn count(&self) -> usize {
        N
    }
    fn dtype(&self) -> DataType {
        T::DATA_TYPE
    }
    fn lend<R>(&self, q: Host, f: impl FnOnce(Lent<'_>) -> Result<R>) -> Result<R> {
        sealed::Input::lend(self.as_slice(), q, f)
    }
}
impl<T: Element, const N: usize> sealed::Output<Host> for [T; N] {
    fn lend_mut<R>(&mut self, q: Host, f: impl FnOnce(LentMut<'_>) -> Result<R>) -> Result<R> {
        sealed::Output::lend_mut(self.as_mut_slice(), q, f)
    }
}
impl<T: Element, const N: usize> Input<Host> for [T; N] {}
impl<T: Element, const N: usize> Output<Host> for [T; N] {}

impl sealed::Input<Host> for HostBytes<'_> {
    fn count(&self) -> usize {
        let len = match &self.bytes {
            HostSide::Read(b) => b.len(),
            HostSide::Write(b) => b.len(),
        };
        len / self.dtype.size()
    }
    fn dtype(&self) -> DataType {
        self.dtype
    }
    fn lend<R>(&self, _: Host, f: impl FnOnce(Lent<'_>) -> Result<R>) -> Result<R> {
        match &self.bytes {
            HostSide::Read(b) => f(Lent::Host(b)),
            HostSide::Write(b) => f(Lent::Host(b)),
        }
    }
}
impl sealed::Output<Host> for HostBytes<'_> {
    fn lend_mut<R>(&mut self, _: Host, f: impl FnOnce(LentMut<'_>) -> Result<R>) -> Result<R> {
        match &mut self.bytes {
            HostSide::Write(b) => f(LentMut::Host(b)),
            HostSide::Read(_) => Err(Error::InvalidArgument {
                reason: "a read-only HostBytes (HostBytes::new) as a collective's output: \
                         make it with HostBytes::new_mut"
                    .into(),
            }),
        }
    }
}
impl Input<Host> for HostBytes<'_> {}
impl Output<Host> for HostBytes<'_> {}

// --- cudarc's device memory ---

macro_rules! cudarc_input {
    ($($ty:ty),*) => {$(
        impl<T: Element> sealed::Input<&Arc<CudaStream>> for $ty {
            fn count(&self) -> usize {
                cudarc::driver::DeviceSlice::len(self)
            }
            fn dtype(&self) -> DataType {
                T::DATA_TYPE
            }
            fn lend<R>(
                &self,
                stream: &Arc<CudaStream>,
                f: impl FnOnce(Lent<'_>) -> Result<R>,
            ) -> Result<R> {
                with_resolved_cudarc(stream, |stream| {
                    let s = GpuStream::of_cudarc(stream);
                    with_cudarc_slice(self, stream, |view| f(Lent::Device(view, &s)))?
                })
            }
        }
        impl<T: Element> Input<&Arc<CudaStream>> for $ty {}
    )*};
}

macro_rules! cudarc_output {
    ($($ty:ty),*) => {$(
        impl<T: Element> sealed::Output<&Arc<CudaStream>> for $ty {
            fn lend_mut<R>(
                &mut self,
                stream: &Arc<CudaStream>,
                f: impl FnOnce(LentMut<'_>) -> Result<R>,
            ) -> Result<R> {
                with_resolved_cudarc(stream, |stream| {
                    let s = GpuStream::of_cudarc(stream);
                    with_cudarc_slice_mut(self, stream, |view| f(LentMut::Device(view, &s)))?
                })
            }
        }
        impl<T: Element> Output<&Arc<CudaStream>> for $ty {}
    )*};
}

cudarc_input!(CudaSlice<T>, CudaView<'_, T>, CudaViewMut<'_, T>);
cudarc_output!(CudaSlice<T>, CudaViewMut<'_, T>);

// --- nodetour's device buffers, and views of the caller's ---

impl sealed::Input<&GpuStream> for Elements<'_> {
    fn count(&self) -> usize {
        self.count
    }
    fn dtype(&self) -> DataType {
        self.dtype
    }
    fn lend<R>(&self, stream: &GpuStream, f: impl FnOnce(Lent<'_>) -> Result<R>) -> Result<R> {
        with_resolved(stream, |s| f(Lent::Device(self.buffer, s)))
    }
}
impl sealed::Output<&GpuStream> for Elements<'_> {
    fn lend_mut<R>(
        &mut self,
        stream: &GpuStream,
        f: impl FnOnce(LentMut<'_>) -> Result<R>,
    ) -> Result<R> {
        // Nodetour's buffers are written through shared references (the GPU writes them; the
        // host never sees them as slices).
        with_resolved(stream, |s| f(LentMut::Device(self.buffer, s)))
    }
}
impl Input<&GpuStream> for Elements<'_> {}
impl Output<&GpuStream> for Elements<'_> {}

// --- symmetric buffers (the in-place allreduce only) ---

impl sealed::Input<&GpuStream> for SymmetricElements<'_> {
    fn count(&self) -> usize {
        self.count
    }
    fn dtype(&self) -> DataType {
        self.dtype
    }
    fn lend<R>(&self, _: &GpuStream, _: impl FnOnce(Lent<'_>) -> Result<R>) -> Result<R> {
        Err(Error::Unsupported {
            reason: "a symmetric buffer is reduced in place: all_reduce_in_place".into(),
        })
    }
}
impl sealed::Output<&GpuStream> for SymmetricElements<'_> {
    fn lend_mut<R>(
        &mut self,
        stream: &GpuStream,
        f: impl FnOnce(LentMut<'_>) -> Result<R>,
    ) -> Result<R> {
        with_resolved(stream, |s| f(LentMut::Symmetric(self.buffer, s)))
    }
}
impl Input<&GpuStream> for SymmetricElements<'_> {}
impl Output<&GpuStream> for SymmetricElements<'_> {}
