//! What a network link carries besides chunks: the words of a rank's mailbox and the notes
//! (data, credits, descriptor cells) encoded into them.

use super::*;

/// The words of a flag page the link reads and writes (the GPU ring's layout).
pub mod words {
    pub use crate::flag::{
        DESC_BASE, ENDED_BY_NEXT, ENDED_BY_PREV, READY, RELEASED, STOPPED, WORDS,
    };
}

/// Bytes of a cell (a flag word and the bytes after it, as in a host flag page).
pub const CELL: usize = nodetour_core::transport::gpu::FLAG_CELL;
/// Bytes of a mailbox (one cell per flag word).
pub const MAILBOX_BYTES: usize = flag::WORDS as usize * CELL;
/// The longest nap while chunks are in flight.
pub const NAP_MAX: Duration = Duration::from_micros(100);
/// How often an idle thread looks for notices.
pub const IDLE_WAKE: Duration = Duration::from_millis(2);

pub(super) const KIND_SHIFT: u32 = 29;
pub(super) const VALUE_MASK: u32 = (1 << KIND_SHIFT) - 1;
pub(super) const DATA: u32 = 1;
pub(super) const CREDIT: u32 = 2;
pub(super) const CELL_KIND: u32 = 3;

pub(super) fn note_value(kind: u32, value: u64) -> u32 {
    (kind << KIND_SHIFT) | (value as u32 & VALUE_MASK)
}

/// The receives a verbs connection of a network link keeps posted: every notification a
/// neighbour may send between two polls of the progress thread (chunks and credits, each at most
/// `slots` ahead; descriptor cells, at most `slots + 2` collectives ahead; end notices), with
/// room to spare, so that no write meets a receiver that is not ready.
pub fn receive_depth(slots: u32) -> u32 {
    4 * slots + 16
}

/// What a neighbour's notification asks of this end, as it reads it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Note {
    /// A chunk landed (its sequence number mod 2^29).
    Data(u32),
    /// Credit (chunks released, mod 2^29).
    Credit(u32),
    /// A cell of the mailbox changed: which, and whether it is the previous rank's (else the
    /// next rank's).
    Cell {
        /// The flag word.
        index: u32,
        /// From the previous rank's mailbox.
        from_prev: bool,
    },
    /// Nothing this neighbour may send: a protocol violation.
    Refused(String),
}

/// Reads notification `v` from a neighbour that is this rank's previous (`from_prev`), next
/// (`from_next`), or both (a ring of two), with the descriptor cells `desc_cells` (first,
/// count). Pure. Only the previous rank sends chunks, the descriptor cells and `ENDED_BY_PREV`;
/// only the next rank sends credit and `ENDED_BY_NEXT`; anything else is refused.
pub fn classify(v: u32, from_prev: bool, from_next: bool, desc_cells: (u32, u32)) -> Note {
    let value = v & VALUE_MASK;
    let (first, count) = desc_cells;
    match v >> KIND_SHIFT {
        DATA if from_prev => Note::Data(value),
        CREDIT if from_next => Note::Credit(value),
        CELL_KIND
            if from_prev
                && (value == flag::ENDED_BY_PREV
                    || (first..first.saturating_add(count)).contains(&value)) =>
        {
            Note::Cell {
                index: value,
                from_prev: true,
            }
        }
        CELL_KIND if from_next && value == flag::ENDED_BY_NEXT => Note::Cell {
            index: value,
            from_prev: false,
        },
        CELL_KIND => Note::Refused(format!("a cell it may not write ({value})")),
        DATA | CREDIT => Note::Refused(format!(
            "a notification of kind {} from the wrong neighbour",
            v >> KIND_SHIFT
        )),
        _ => Note::Refused(format!("an unknown notification {v:#010x}")),
    }
}

/// Encodes what a neighbour sends (the counterpart of [`classify`], for tests and fuzzing).
pub fn encode_note(note: &Note) -> Option<u32> {
    match *note {
        Note::Data(seq) => Some(note_value(DATA, u64::from(seq))),
        Note::Credit(n) => Some(note_value(CREDIT, u64::from(n))),
        Note::Cell { index, .. } => Some(note_value(CELL_KIND, u64::from(index))),
        Note::Refused(_) => None,
    }
}

/// The smallest value ≥ `base` that is `v` mod 2^29.
pub(super) fn unwrap29(base: u64, v: u32) -> u64 {
    base + u64::from(v.wrapping_sub(base as u32) & VALUE_MASK)
}

/// The smallest value ≥ `base` that is `v` mod 2^32 (a stream's counter word).
pub(super) fn unwrap32(base: u64, v: u32) -> u64 {
    base + u64::from(v.wrapping_sub(base as u32))
}
