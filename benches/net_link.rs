//! The GPU ring's network link on the host (no GPU): one chunk carried from one rank's outbox to
//! the other's page and its credit back (`net_link`'s threads over tcp loopback and the
//! in-process transport), beside the same round trip through the bare transport (a write with
//! a notification, and a notification back), measured in the same run. What the link adds is
//! its threads' hand-offs; `NODETOUR_SPIN_US` sets how long they spin.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};
use nodetour_core::Deadline;
use nodetour_core::memory::HostBuffer;
use nodetour_core::transport::tcp::loopback_pair;
use nodetour_core::transport::{Event, HostConnection, MemConnection, SlotRegion};
use nodetour_net::bootstrap::JobToken;
use nodetour_ring::net_link::{MAILBOX_BYTES, NetLink, NetLinkSetup, NetOptions, WordPage, words};

const SIZES: [usize; 3] = [8, 4 << 10, 64 << 10];
const SLOTS: u32 = 2;
const SLOT_BYTES: usize = 64 << 10;

/// A flag page in host memory: atomic words, cells behind a lock.
struct Page {
    words: Vec<AtomicU32>,
    cells: Mutex<Vec<u8>>,
}

impl Page {
    fn new() -> Arc<Page> {
        Arc::new(Page {
            words: (0..words::WORDS).map(|_| AtomicU32::new(0)).collect(),
            cells: Mutex::new(vec![0; MAILBOX_BYTES]),
        })
    }
}

fn oob(what: &'static str) -> nodetour_core::Error {
    nodetour_core::Error::OutOfBounds {
        what,
        offset: 0,
        len: 0,
        region_len: 0,
    }
}

impl WordPage for Page {
    fn read(&self, index: u32) -> nodetour_core::Result<u32> {
        let w = self.words.get(index as usize).ok_or_else(|| oob("word"))?;
        Ok(w.load(Ordering::Acquire))
    }
    fn store(&self, index: u32, value: u32) -> nodetour_core::Result<()> {
        let w = self.words.get(index as usize).ok_or_else(|| oob("word"))?;
        w.store(value, Ordering::Release);
        Ok(())
    }
    fn read_bytes(&self, index: u32, at: usize, dst: &mut [u8]) -> nodetour_core::Result<()> {
        let o = index as usize * 64 + at;
        let c = self.cells.lock().unwrap();
        dst.copy_from_slice(c.get(o..o + dst.len()).ok_or_else(|| oob("cell"))?);
        Ok(())
    }
    fn store_bytes(&self, index: u32, at: usize, src: &[u8]) -> nodetour_core::Result<()> {
        let o = index as usize * 64 + at;
        let mut c = self.cells.lock().unwrap();
        c.get_mut(o..o + src.len())
            .ok_or_else(|| oob("cell"))?
            .copy_from_slice(src);
        Ok(())
    }
}

fn region(len: usize) -> SlotRegion {
    SlotRegion::host(HostBuffer::new(len).expect("host memory"))
}

/// One end of the link.
struct End {
    link: NetLink,
    mine: Arc<Page>,
    out_next: Arc<Page>,
    out_prev: Arc<Page>,
}

/// Two ends joined by `pair`'s connections.
fn link(pair: (Box<dyn HostConnection>, Box<dyn HostConnection>)) -> (End, End) {
    let (mut ca, mut cb) = pair;
    let regions = || (region(SLOTS as usize * SLOT_BYTES), region(MAILBOX_BYTES));
    let ((ra, ma), (rb, mb)) = (regions(), regions());
    let ga = (ca.grant(&ra).unwrap(), ca.grant(&ma).unwrap());
    let gb = (cb.grant(&rb).unwrap(), cb.grant(&mb).unwrap());
    let end = |conn, recv: SlotRegion, mailbox: SlotRegion, peer: (_, _)| {
        let (mine, out_next, out_prev) = (Page::new(), Page::new(), Page::new());
        let w = |p: &Arc<Page>| -> Arc<dyn WordPage> { p.clone() };
        let link = NetLink::start(NetLinkSetup {
            next: 1,
            prev: 1,
            to_next: Some(conn),
            to_prev: None,
            same_peer: true,
            send_slots: Some(region(SLOTS as usize * SLOT_BYTES)),
            recv_slots: Some(recv),
            next_recv: Some(peer.0),
            next_mailbox: Some(peer.1),
            prev_mailbox: Some(peer.1),
            mailbox_from_prev: Some(mailbox.clone()),
            mailbox_from_next: Some(mailbox),
            cells: region(MAILBOX_BYTES),
            slots: SLOTS,
            slot_bytes: SLOT_BYTES,
            mine: w(&mine),
            out_next: w(&out_next),
            out_prev: w(&out_prev),
            desc_cells: (words::DESC_BASE, SLOTS + 2),
            stop_word: words::STOPPED,
            options: NetOptions::from_env(),
            lander: None,
        })
        .unwrap();
        End {
            link,
            mine,
            out_next,
            out_prev,
        }
    };
    let a = end(ca, ra, ma, gb);
    let b = end(cb, rb, mb, ga);
    (a, b)
}

/// Waits (spinning, then yielding) until `page`'s word reaches `value`.
fn wait_word(page: &Page, index: u32, value: u32, link: &NetLink) {
    let mut spins = 0u32;
    while (page.words[index as usize]
        .load(Ordering::Acquire)
        .wrapping_sub(value) as i32)
        < 0
    {
        if let Some(e) = link.failure() {
            panic!("the link failed: {e}");
        }
        spins += 1;
        if spins > 1000 {
            std::thread::yield_now();
        }
    }
}

fn bench_link(
    c: &mut Criterion,
    name: &str,
    make: &dyn Fn() -> (Box<dyn HostConnection>, Box<dyn HostConnection>),
) {
    let mut g = c.benchmark_group(format!("net_link_{name}"));
    g.measurement_time(Duration::from_secs(3));
    g.sample_size(30);
    let (a, b) = link(make());
    let mut seq = 0u32;
    for size in SIZES {
        g.bench_function(format!("chunk_and_credit/{size}"), |bench| {
            bench.iter(|| {
                seq += 1;
                a.link.plan([size], []);
                b.link.plan([], [size]);
                // A's stream made the chunk ready; B's stream reads it and releases the slot.
                a.out_next.store(words::READY, seq).unwrap();
                wait_word(&b.mine, words::READY, seq, &b.link);
                b.out_prev.store(words::RELEASED, seq).unwrap();
                wait_word(&a.mine, words::RELEASED, seq, &a.link);
            })
        });
    }
    drop((a, b));
    // The reference: the same round trip through the bare transport.
    let (mut x, mut y) = make();
    let src = region(SLOT_BYTES);
    let dst = region(SLOT_BYTES);
    let back = region(4096);
    let grant = x.grant(&dst).unwrap();
    let back_grant = y.grant(&back).unwrap();
    let mut events = Vec::new();
    for size in SIZES {
        g.bench_function(format!("bare_transport_round_trip/{size}"), |bench| {
            bench.iter(|| {
                y.write(&src, 0..size, &grant, 0, Some(1)).unwrap();
                wait_event(&mut *x, &mut events);
                x.write(&src, 0..0, &back_grant, 0, Some(2)).unwrap();
                wait_event(&mut *y, &mut events);
            })
        });
    }
    g.finish();
}

fn wait_event(c: &mut dyn HostConnection, events: &mut Vec<Event>) {
    events.clear();
    while events.is_empty() {
        c.wait(events, Deadline::after(Duration::from_secs(5)))
            .expect("notification");
    }
}

fn net_link(c: &mut Criterion) {
    bench_link(c, "tcp", &|| {
        let (a, b) = loopback_pair(&JobToken::new(b"net-link-bench".to_vec())).unwrap();
        (Box::new(a), Box::new(b))
    });
    bench_link(c, "in_process", &|| {
        let (a, b) = MemConnection::pair();
        (Box::new(a), Box::new(b))
    });
}

criterion_group!(benches, net_link);
criterion_main!(benches);
