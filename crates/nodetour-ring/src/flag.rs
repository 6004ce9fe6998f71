//! Words of each rank's flag page: the hand-off words the streams wait on and set, and the
//! host-only words of end notices, causes, descriptor cells, stop words and teardown
//! confirmations. One floor below the stream ring and the network link, which both use it.

/// Chunks that have landed in this rank's slots (written by the previous rank's stream).
pub const READY: u32 = 0;
/// Chunks of the next rank's slots this rank may overwrite again (written by the next
/// rank's stream once it has read them).
pub const RELEASED: u32 = 1;
/// The transport the previous rank chose for writing to this rank (written once at setup:
/// 1 = cuda-ipc, 2 = shm).
pub(crate) const MODE: u32 = 2;
/// Host page only: the previous rank ended the ring from collective `value - 1` on
/// (`0`: it did not), written by that rank's host.
pub const ENDED_BY_PREV: u32 = 3;
/// Host page only: the same from the next rank.
pub const ENDED_BY_NEXT: u32 = 4;
/// Host page only: the first of the cells that carry the previous rank's collective
/// descriptors, cell `seq mod (slots + 2)` for collective `seq`. Its word is
/// `seq:16 | 1 | tag:15`, set by the previous rank's send stream just before its first
/// chunk's ready flag and waited for (equal) by this rank's receive stream before it reads
/// any chunk of the collective;
/// bytes 32..64 hold the encoded descriptor, stored by the previous rank's host when it
/// queued the collective (read only to word an error).
pub const DESC_BASE: u32 = 5;
/// Descriptor cells: two halves (two rings over the same pages), each for at most 127
/// slots + 2.
pub(crate) const DESC_CELLS: u32 = 258;
/// Host page only: this rank's stop words (one per half, see
/// `StreamLinks::desc_half`), set by this rank's host when it aborts and never
/// cleared: every wait its streams queued ends, and no guarded write or signal starts
/// (`nodetour_core::transport::gpu::StopWord`).
pub const STOPPED: u32 = DESC_BASE + DESC_CELLS;
/// Host page only: the previous rank closed its mappings of this rank's memory (stored by
/// its host at teardown, after its streams drained): this rank may free what it exported
/// to it.
pub(crate) const CLOSED_BY_PREV: u32 = STOPPED + 2;
/// Host page only: the same from the next rank.
pub(crate) const CLOSED_BY_NEXT: u32 = STOPPED + 3;
/// Host page only: why the previous rank ended the ring ([`crate::RootCause`]'s word:
/// the rank at fault, in ring positions, and what happened there), stored before
/// [`ENDED_BY_PREV`].
pub(crate) const CAUSE_BY_PREV: u32 = STOPPED + 4;
/// Host page only: the same from the next rank.
pub(crate) const CAUSE_BY_NEXT: u32 = STOPPED + 5;
/// Words in the page.
pub const WORDS: u32 = STOPPED + 6;
