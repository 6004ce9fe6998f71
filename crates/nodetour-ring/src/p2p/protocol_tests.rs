//! The peer link's protocol, simulated: two [`Link`]s joined by two in-order wires, parts
//! posted in random orders and interleaved with deliveries at random, every byte checked; and
//! the faults: disagreeing shapes, counts of sends and receives that differ, ends from either
//! side, forged notices and headers.

use std::collections::{HashMap, VecDeque};

use super::protocol::{Action, Failure, HEADER, Header, Link, PartId, Shape};
use crate::reduce::DataType;

/// What one side's wire carries to the other, in order.
enum Wire {
    /// Bytes into a slot, then its data notice.
    Data {
        slot: u32,
        bytes: Vec<u8>,
    },
    Credit {
        slot: u32,
    },
    Disagree {
        seq: u32,
        shape: Shape,
    },
    End {
        cause: u32,
    },
}

/// One side: its link, its slot memory, what it sends and receives, and how each part ended.
struct Side {
    link: Link,
    slots: Vec<Vec<u8>>,
    sends: HashMap<PartId, Vec<u8>>,
    recvs: HashMap<PartId, Vec<u8>>,
    ended: HashMap<PartId, Result<(), Failure>>,
}

const SLOT_BYTES: usize = HEADER + 40;

impl Side {
    fn new(slots: u32) -> Side {
        Side {
            link: Link::new(slots, SLOT_BYTES),
            slots: vec![vec![0; SLOT_BYTES]; slots as usize],
            sends: HashMap::new(),
            recvs: HashMap::new(),
            ended: HashMap::new(),
        }
    }

    /// Runs every action, pushing what goes to the peer onto `out`.
    fn drain(&mut self, out: &mut VecDeque<Wire>) {
        while let Some(a) = self.link.poll_action() {
            match a {
                Action::Write { id, slot, header } => {
                    let src = &self.sends[&id];
                    let (at, len) = (header.offset as usize, header.len as usize);
                    let mut bytes = header.encode().to_vec();
                    bytes.extend_from_slice(&src[at..at + len]);
                    out.push_back(Wire::Data { slot, bytes });
                }
                Action::CopyOut {
                    id,
                    slot,
                    offset,
                    len,
                } => {
                    let (at, len) = (offset as usize, len as usize);
                    let from = &self.slots[slot as usize][HEADER..HEADER + len];
                    self.recvs.get_mut(&id).unwrap()[at..at + len].copy_from_slice(from);
                    out.push_back(Wire::Credit { slot });
                }
                Action::Disagree { seq, ours } => {
                    out.push_back(Wire::Disagree { seq, shape: ours })
                }
                Action::End { cause } => out.push_back(Wire::End { cause }),
                Action::Done(id) => assert!(self.ended.insert(id, Ok(())).is_none()),
                Action::Failed(id, f) => assert!(self.ended.insert(id, Err(f)).is_none()),
            }
        }
    }

    /// Takes one thing off the wire from the peer.
    fn deliver(&mut self, w: Wire) {
        match w {
            Wire::Data { slot, bytes } => {
                let header = self.slots.get_mut(slot as usize).map(|s| {
                    s[..bytes.len()].copy_from_slice(&bytes);
                    let h: [u8; HEADER] = s[..HEADER].try_into().unwrap();
                    Header::decode(&h)
                });
                self.link.handle_data(slot, header.flatten());
            }
            Wire::Credit { slot } => self.link.handle_credit(slot),
            Wire::Disagree { seq, shape } => self.link.handle_disagree(seq, Some(shape)),
            Wire::End { cause } => self.link.handle_end(cause),
        }
    }
}

/// A small deterministic generator (xorshift), seeded per case.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n.max(1)
    }
}

/// A message's bytes, seeded by its index and direction (every message differs).
fn payload(index: usize, from_a: bool, bytes: usize) -> Vec<u8> {
    (0..bytes)
        .map(|i| (i as u64 * 31 + index as u64 * 7 + u64::from(from_a) * 101) as u8)
        .collect()
}

/// A part of one side's script: send or receive message `index` of `shape`.
#[derive(Clone, Copy)]
struct Part {
    send: bool,
    index: usize,
    shape: Shape,
}

/// Runs both scripts to the end, interleaving posts and deliveries at random. Returns both
/// sides.
fn run(rng: &mut Rng, slots: u32, scripts: [Vec<Part>; 2]) -> [Side; 2] {
    let mut sides = [Side::new(slots), Side::new(slots)];
    let mut wires: [VecDeque<Wire>; 2] = [VecDeque::new(), VecDeque::new()];
    let mut next = [0usize; 2];
    for _ in 0..100_000 {
        let mut choices = Vec::new();
        for s in 0..2 {
            if next[s] < scripts[s].len() {
                choices.push((0, s));
            }
            if !wires[s].is_empty() {
                choices.push((1, s));
            }
        }
        if choices.is_empty() {
            return sides;
        }
        let (what, s) = choices[rng.below(choices.len() as u64) as usize];
        if what == 0 {
            let p = scripts[s][next[s]];
            next[s] += 1;
            let id = (p.index as u64) << 1 | u64::from(p.send);
            let bytes = p.shape.bytes().unwrap() as usize;
            if p.send {
                sides[s].sends.insert(id, payload(p.index, s == 0, bytes));
                sides[s].link.post_send(id, p.shape);
            } else {
                sides[s].recvs.insert(id, vec![0xEE; bytes]);
                sides[s].link.post_recv(id, p.shape);
            }
        } else {
            let w = wires[s].pop_front().unwrap();
            sides[1 - s].deliver(w);
        }
        let (a, b) = wires.split_at_mut(1);
        sides[0].drain(&mut a[0]);
        sides[1].drain(&mut b[0]);
    }
    panic!("the simulation did not settle");
}

fn shape(count: u64, dtype: DataType) -> Shape {
    Shape { count, dtype }
}

/// Both directions' messages, each side's sends and receives in a random order of its own
/// (the order within a direction kept).
fn scripts(rng: &mut Rng, a_to_b: &[Shape], b_to_a: &[Shape]) -> [Vec<Part>; 2] {
    let side = |rng: &mut Rng, sends: &[Shape], recvs: &[Shape]| {
        let (mut i, mut j) = (0, 0);
        let mut v = Vec::new();
        while i < sends.len() || j < recvs.len() {
            let send = j == recvs.len() || (i < sends.len() && rng.below(2) == 0);
            if send {
                v.push(Part {
                    send,
                    index: i,
                    shape: sends[i],
                });
                i += 1;
            } else {
                v.push(Part {
                    send,
                    index: j,
                    shape: recvs[j],
                });
                j += 1;
            }
        }
        v
    };
    [side(rng, a_to_b, b_to_a), side(rng, b_to_a, a_to_b)]
}

#[test]
fn messages_of_every_size_arrive_whole_in_any_interleaving() {
    for case in 0..300u64 {
        let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ (case + 1));
        let messages = |rng: &mut Rng| {
            (0..rng.below(6))
                .map(|_| {
                    let dtype = [DataType::U8, DataType::F32, DataType::F64][rng.below(3) as usize];
                    shape(rng.below(70), dtype)
                })
                .collect::<Vec<_>>()
        };
        let (ab, ba) = (messages(&mut rng), messages(&mut rng));
        let slots = 1 + rng.below(4) as u32;
        let s = scripts(&mut rng, &ab, &ba);
        let sides = run(&mut rng, slots, s);
        for (me, msgs) in [(0usize, &ba), (1, &ab)] {
            let side = &sides[me];
            for (index, m) in msgs.iter().enumerate() {
                let id = (index as u64) << 1;
                assert_eq!(
                    side.ended.get(&id),
                    Some(&Ok(())),
                    "case {case}: receive {index}"
                );
                let want = payload(index, me == 1, m.bytes().unwrap() as usize);
                assert_eq!(
                    side.recvs[&id], want,
                    "case {case}: receive {index}'s bytes"
                );
            }
            let sent = if me == 0 { &ab } else { &ba };
            for index in 0..sent.len() {
                let id = (index as u64) << 1 | 1;
                assert_eq!(
                    side.ended.get(&id),
                    Some(&Ok(())),
                    "case {case}: send {index}"
                );
            }
            assert!(side.link.is_idle() && side.link.failure().is_none());
        }
    }
}

#[test]
fn a_send_and_receive_that_disagree_fail_on_both_sides_and_copy_nothing() {
    for case in 0..50u64 {
        let mut rng = Rng(0xD1B5_4A32_D192_ED03 ^ (case + 1));
        let sent = shape(1 + rng.below(60), DataType::F32);
        let wanted = if case % 2 == 0 {
            shape(sent.count + 1, DataType::F32) // a count that differs
        } else {
            shape(sent.count, DataType::I32) // a type that differs
        };
        let s = [
            vec![Part {
                send: true,
                index: 0,
                shape: sent,
            }],
            vec![Part {
                send: false,
                index: 0,
                shape: wanted,
            }],
        ];
        let sides = run(&mut rng, 2, s);
        let expect_a = Failure::Disagreement {
            ours: sent,
            theirs: wanted,
        };
        let expect_b = Failure::Disagreement {
            ours: wanted,
            theirs: sent,
        };
        assert_eq!(sides[0].ended.get(&1), Some(&Err(expect_a)), "case {case}");
        assert_eq!(sides[1].ended.get(&0), Some(&Err(expect_b)), "case {case}");
        assert!(
            sides[1].recvs[&0].iter().all(|b| *b == 0xEE),
            "case {case}: nothing copied"
        );
    }
}

#[test]
fn a_send_without_its_receive_stays_open_for_the_deadline_and_then_fails_on_both() {
    // Two sends, one receive: the second send waits (its deadline is the driver's); ending it
    // from the sender's side fails the peer's parts too.
    let mut rng = Rng(7);
    let m = shape(100, DataType::U8);
    let s = [
        vec![
            Part {
                send: true,
                index: 0,
                shape: m,
            },
            Part {
                send: true,
                index: 1,
                shape: m,
            },
        ],
        vec![
            Part {
                send: false,
                index: 0,
                shape: m,
            },
            Part {
                send: false,
                index: 1,
                shape: shape(1, DataType::U8),
            },
        ],
    ];
    // The second receive disagrees on count: both fail typed (no hang, nothing truncated).
    let sides = run(&mut rng, 3, s);
    assert_eq!(sides[0].ended.get(&1), Some(&Ok(())));
    assert!(matches!(
        sides[0].ended.get(&3),
        Some(Err(Failure::Disagreement { .. }))
    ));
    assert!(matches!(
        sides[1].ended.get(&2),
        Some(Err(Failure::Disagreement { .. }))
    ));

    let mut a = Side::new(2);
    a.sends.insert(1, vec![1; 500]);
    a.link.post_send(1, shape(500, DataType::U8));
    let mut wire = VecDeque::new();
    a.drain(&mut wire);
    assert!(
        a.ended.is_empty(),
        "a send is open until its receive credits every chunk"
    );
    a.link.fail("timed out".into(), 9);
    a.drain(&mut wire);
    assert_eq!(
        a.ended.get(&1),
        Some(&Err(Failure::Local("timed out".into())))
    );
    let mut b = Side::new(2);
    b.recvs.insert(0, vec![0; 500]);
    b.link.post_recv(0, shape(500, DataType::U8));
    let mut back = VecDeque::new();
    while let Some(w) = wire.pop_front() {
        b.deliver(w);
        b.drain(&mut back);
    }
    assert_eq!(b.ended.get(&0), Some(&Err(Failure::Ended(9))));
}

#[test]
fn forged_notices_and_headers_fail_the_link_naming_what_was_wrong() {
    let m = shape(10, DataType::U8);
    let header = |seq, offset, len| Header {
        seq,
        shape: m,
        offset,
        len,
    };
    type Forgery<'a> = Box<dyn Fn(&mut Link) + 'a>;
    let cases: Vec<(&str, Forgery<'_>)> = vec![
        (
            "slot out of range",
            Box::new(|l| l.handle_data(9, Some(header(0, 0, 10)))),
        ),
        ("malformed header", Box::new(|l| l.handle_data(0, None))),
        (
            "wrong sequence",
            Box::new(|l| l.handle_data(0, Some(header(1, 0, 10)))),
        ),
        (
            "wrong offset",
            Box::new(|l| l.handle_data(0, Some(header(0, 4, 6)))),
        ),
        (
            "too long",
            Box::new(|l| l.handle_data(0, Some(header(0, 0, 11)))),
        ),
        (
            "slot written twice",
            Box::new(|l| {
                // Message 0 meets the receive (its slot goes back); message 1 waits in slot 1,
                // which the peer then writes again.
                l.handle_data(0, Some(header(0, 0, 10)));
                l.handle_data(1, Some(header(1, 0, 10)));
                l.handle_data(1, Some(header(2, 0, 10)));
            }),
        ),
        (
            "shape changed",
            Box::new(|l| {
                let big = shape(100, DataType::U8);
                l.handle_data(
                    0,
                    Some(Header {
                        seq: 0,
                        shape: big,
                        offset: 0,
                        len: 40,
                    }),
                );
                l.handle_data(
                    1,
                    Some(Header {
                        seq: 0,
                        shape: shape(1000, DataType::U8),
                        offset: 40,
                        len: 40,
                    }),
                );
            }),
        ),
        ("credit for nothing", Box::new(|l| l.handle_credit(0))),
        (
            "disagree with nothing",
            Box::new(|l| l.handle_disagree(0, Some(m))),
        ),
    ];
    for (what, forge) in cases {
        let mut l = Link::new(2, SLOT_BYTES);
        forge(&mut l);
        // A receive posted after the forgery fails with it.
        l.post_recv(0, m);
        assert!(
            matches!(l.failure(), Some(Failure::Protocol(_))),
            "{what}: {:?}",
            l.failure()
        );
        let actions: Vec<Action> = std::iter::from_fn(|| l.poll_action()).collect();
        assert!(
            actions.iter().any(|a| matches!(a, Action::End { .. })),
            "{what}: the peer is told"
        );
        assert!(
            actions
                .iter()
                .any(|a| matches!(a, Action::Failed(0, Failure::Protocol(_))))
                || actions.contains(&Action::Done(0)),
            "{what}: the receive fails, unless it ended before the forgery"
        );
        l.post_send(5, m);
        assert!(
            matches!(l.poll_action(), Some(Action::Failed(5, _))),
            "{what}: later parts fail"
        );
    }
}

#[test]
fn headers_notices_and_shapes_round_trip_and_reject_junk() {
    use super::protocol::Notice;
    let h = Header {
        seq: 0xDEAD_BEEF,
        shape: shape(u64::MAX / 8, DataType::F64),
        offset: 77,
        len: 5,
    };
    assert_eq!(Header::decode(&h.encode()), Some(h));
    let mut junk = h.encode();
    junk[30] = 1;
    assert_eq!(Header::decode(&junk), None);
    junk = h.encode();
    junk[4] = 200;
    assert_eq!(Header::decode(&junk), None);
    for n in [
        Notice::Data { slot: 3 },
        Notice::Credit { slot: 0 },
        Notice::Disagree { seq: 12 },
        Notice::End { cause: 4 },
    ] {
        assert_eq!(Notice::decode(n.encode()), Some(n));
    }
    assert_eq!(Notice::decode(0), None);
    assert_eq!(Notice::decode(0xF000_0000), None);
    let s = shape(123, DataType::Bf16);
    assert_eq!(Shape::decode(&s.encode()), Some(s));
    assert_eq!(Shape::decode(&[0; 3]), None);
    assert_eq!(shape(u64::MAX, DataType::F32).bytes(), None);
}
