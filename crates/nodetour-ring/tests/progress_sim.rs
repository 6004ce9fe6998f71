//! The network link's progress engine (`nodetour_ring::progress`) run by a simulator: a sender
//! stream making chunks ready, the sender's progress thread, a wire that lands writes in order
//! (into slot memory whose bytes the GPU sees only after a flush, where the GPU needs one), the
//! receiver's progress thread, and a receive stream that reads each slot once released and then
//! releases it. Events interleave at random. Every chunk the stream reads must be the one sent
//! (never a stale or overwritten slot), every run without faults must deliver every chunk, and
//! with an abort or a lost peer both ends must stop without a write after the stop. Dropping the
//! flush is caught (stale reads), which shows the simulator sees the hazard the engine prevents.

use std::collections::VecDeque;

use nodetour_ring::progress::{RecvAction, RecvEnd, SendAction, SendEnd, Stop};
use proptest::prelude::*;

mod common;
use common::Rng;

#[derive(Clone, Copy, Debug, PartialEq)]
enum Fault {
    None,
    /// The sender aborts after this many events.
    SenderAborts(usize),
    /// The receiver is lost after this many events (the sender hears of it).
    ReceiverLost(usize),
}

struct Outcome {
    /// Chunks the receive stream read, each checked.
    read: u64,
    /// A chunk read with the wrong contents.
    stale: bool,
    sender_stopped: Option<Stop>,
    receiver_stopped: Option<Stop>,
    /// Writes posted after the sender stopped.
    writes_after_stop: u32,
}

/// Runs `chunks` chunks over a link of `slots` slots; `needs_flush`: the GPU sees landed bytes
/// only after a flush; `engine_flushes`: the receiver's engine is told so (false with
/// `needs_flush` is the broken configuration the simulator must catch).
fn run(
    chunks: u64,
    slots: u32,
    needs_flush: bool,
    engine_flushes: bool,
    fault: Fault,
    seed: u64,
) -> Outcome {
    let mut rng = Rng(seed | 1);
    let mut send = SendEnd::new(slots);
    let mut recv = RecvEnd::new(slots, engine_flushes);
    let n = slots as usize;
    // What the NIC wrote into each slot, and what the GPU sees of it.
    let mut landed: Vec<Option<u64>> = vec![None; n];
    let mut visible: Vec<Option<u64>> = vec![None; n];
    let mut stream_sent = 0u64;
    let mut wire: VecDeque<(u64, u32)> = VecDeque::new(); // writes in flight, in order
    let mut completions: VecDeque<u64> = VecDeque::new(); // sender completions pending
    let mut credits: VecDeque<u64> = VecDeque::new(); // credit writes in flight
    let mut flush_pending: Option<u64> = None;
    let mut ready = 0u64;
    let mut read = 0u64;
    let mut released = 0u64;
    let (mut stale, mut sender_stopped, mut receiver_stopped) = (false, None, None);
    let mut writes_after_stop = 0;
    let mut fired = false;
    for step in 0..200_000usize {
        // The fault fires at its step, or when nothing else can happen (so it always fires).
        let due = |at: usize, idle: bool| !fired && (step == at || idle);
        let idle = step > 0
            && wire.is_empty()
            && completions.is_empty()
            && credits.is_empty()
            && flush_pending.is_none()
            && read == ready
            && released == read
            && stream_sent == chunks;
        match fault {
            Fault::SenderAborts(at) if due(at, idle) => {
                fired = true;
                send.abort();
                // Its abort notice (or the liveness mesh) reaches the receiver.
                recv.peer_lost();
            }
            Fault::ReceiverLost(at) if due(at, idle) => {
                fired = true;
                recv.abort();
                send.peer_lost();
            }
            _ => {}
        }
        // Engines act on everything they can now.
        while let Some(a) = send.poll() {
            match a {
                SendAction::Write { seq, slot } => {
                    if sender_stopped.is_some() {
                        writes_after_stop += 1;
                    }
                    wire.push_back((seq, slot));
                }
                SendAction::Stop(why) => sender_stopped = Some(why),
            }
        }
        while let Some(a) = recv.poll() {
            match a {
                RecvAction::Flush { upto } => flush_pending = Some(upto),
                RecvAction::Ready(r) => ready = r,
                RecvAction::Credit(c) => credits.push_back(c),
                RecvAction::Stop(why) => receiver_stopped = Some(why),
            }
        }
        // What may happen next, picked at random.
        let mut options: Vec<u8> = Vec::new();
        if stream_sent < chunks {
            options.push(0); // the send stream makes the next chunk ready
        }
        if !wire.is_empty() && receiver_stopped.is_none() {
            options.push(1); // the NIC lands the next write
        }
        if !completions.is_empty() {
            options.push(2); // the sender sees a completion
        }
        if !credits.is_empty() {
            options.push(3); // a credit write arrives
        }
        if flush_pending.is_some() {
            options.push(4); // the flush completes
        }
        if read < ready {
            options.push(5); // the receive stream reads the next released chunk
        }
        if released < read {
            options.push(6); // the receive stream releases what it read
        }
        if needs_flush && (0..n).any(|s| landed[s] != visible[s]) {
            options.push(7); // the GPU happens to see landed bytes without a flush
        }
        if options.is_empty() {
            break;
        }
        match options[rng.below(options.len())] {
            0 => {
                stream_sent += 1;
                send.stream_sent(stream_sent);
            }
            1 => {
                let (seq, slot) = wire.pop_front().expect("non-empty");
                landed[slot as usize] = Some(seq);
                if !needs_flush {
                    visible[slot as usize] = Some(seq);
                }
                completions.push_back(seq);
                recv.landed(seq);
            }
            2 => {
                let seq = completions.pop_front().expect("non-empty");
                send.write_completed(seq, true);
            }
            3 => {
                let c = credits.pop_front().expect("non-empty");
                send.credit(c);
            }
            4 => {
                flush_pending = None;
                visible.clone_from(&landed);
                recv.flushed(true);
            }
            5 => {
                let slot = (read % u64::from(slots)) as usize;
                if visible[slot] != Some(read) {
                    stale = true;
                }
                read += 1;
            }
            6 => {
                released += 1;
                recv.stream_released(released);
            }
            _ => {
                // Only a slot's older contents can show late: pick one slot and make its
                // landed bytes visible (what an unflushed GPU may or may not do).
                let s = (0..n).find(|&s| landed[s] != visible[s]).expect("listed");
                if rng.below(2) == 0 {
                    visible[s] = landed[s];
                }
            }
        }
    }
    Outcome {
        read,
        stale,
        sender_stopped,
        receiver_stopped,
        writes_after_stop,
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]
    #[test]
    fn every_interleaving_delivers_every_chunk_exactly(
        chunks in 0u64..40,
        slots in 1u32..5,
        needs_flush in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let o = run(chunks, slots, needs_flush, needs_flush, Fault::None, seed);
        prop_assert!(!o.stale, "a stale or overwritten slot was read");
        prop_assert_eq!(o.read, chunks);
        prop_assert!(o.sender_stopped.is_none() && o.receiver_stopped.is_none());
    }

    #[test]
    fn an_abort_or_a_lost_peer_stops_both_ends_and_nothing_is_written_after(
        chunks in 1u64..40,
        slots in 1u32..5,
        at in 0usize..60,
        lost in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let fault = if lost { Fault::ReceiverLost(at) } else { Fault::SenderAborts(at) };
        let o = run(chunks, slots, true, true, fault, seed);
        prop_assert!(!o.stale, "a stale or overwritten slot was read");
        prop_assert_eq!(o.writes_after_stop, 0);
        if o.read < chunks {
            // The collective did not finish: the end that failed stopped, typed.
            prop_assert!(o.sender_stopped.is_some() || o.receiver_stopped.is_some());
        }
        if lost {
            prop_assert_eq!(o.sender_stopped, Some(Stop::PeerLost));
            prop_assert_eq!(o.receiver_stopped, Some(Stop::Aborted));
        } else {
            prop_assert_eq!(o.sender_stopped, Some(Stop::Aborted));
            prop_assert_eq!(o.receiver_stopped, Some(Stop::PeerLost));
        }
    }
}

/// Without the flush a GPU that needs one reads stale slots in some interleaving.
#[test]
fn dropping_the_flush_is_caught() {
    let caught =
        (0..400u64).any(|seed| run(30, 2, true, false, Fault::None, seed * 7919 + 1).stale);
    assert!(
        caught,
        "no interleaving read a stale slot without the flush"
    );
}
