//! The GPU ring's network link on the host (no GPU), over tcp loopback, the in-process transport
//! and, where an RDMA device exists (the soft-RoCE VM), verbs; each beside the bare transport in
//! the same run:
//! - `chunk_and_credit`: one chunk carried from one rank's outbox to the other's page and its
//!   credit back, beside the same round trip through the bare transport (a write with a
//!   notification, and a notification back). What the link adds is its threads' hand-offs;
//!   `NODETOUR_SPIN_US` sets how long they spin.
//! - `stream`: 32 chunks of 64 KiB through the link's 4 slots (the sender makes a chunk ready as
//!   soon as its slot's credit is back, the receiver releases each at once), beside the bare
//!   transport writing the same 32 chunks one at a time (`write`: each waited for) and all in
//!   flight (`post`, the last one waited for at the receiver): the link posts its chunks, so it
//!   should approach the second.

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
const SLOTS: u32 = 4;
const STREAM_CHUNKS: usize = 32;
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

/// Two connected ends.
type Connections = (Box<dyn HostConnection>, Box<dyn HostConnection>);

/// Makes connected pairs and the regions their transport writes (registered for verbs).
struct Wire {
    name: &'static str,
    make: Box<dyn Fn() -> Connections>,
    region: Box<dyn Fn(usize) -> SlotRegion>,
}

fn host_region(len: usize) -> SlotRegion {
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
fn link(wire: &Wire) -> (End, End) {
    let region = &wire.region;
    let (mut ca, mut cb) = (wire.make)();
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
            options: NetOptions::from_config(
                &nodetour::Config::from_env().expect("NODETOUR_* settings"),
            ),
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

fn bench_link(c: &mut Criterion, wire: &Wire) {
    let mut g = c.benchmark_group(format!("net_link_{}", wire.name));
    g.measurement_time(Duration::from_secs(3));
    g.sample_size(30);
    let (a, b) = link(wire);
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
    g.throughput(criterion::Throughput::Bytes(
        (STREAM_CHUNKS * SLOT_BYTES) as u64,
    ));
    g.bench_function("stream/link", |bench| {
        bench.iter(|| {
            stream(&a, &b, seq);
            seq += STREAM_CHUNKS as u32;
        })
    });
    drop((a, b));
    // The references: the same traffic through the bare transport.
    let (mut x, mut y) = (wire.make)();
    let region = &wire.region;
    let src = region(SLOTS as usize * SLOT_BYTES);
    let dst = region(SLOTS as usize * SLOT_BYTES);
    let back = region(4096);
    let grant = x.grant(&dst).unwrap();
    let back_grant = y.grant(&back).unwrap();
    let mut events = Vec::new();
    for size in SIZES {
        g.throughput(criterion::Throughput::Bytes(size as u64));
        g.bench_function(format!("bare_transport_round_trip/{size}"), |bench| {
            bench.iter(|| {
                y.write(&src, 0..size, &grant, 0, Some(1)).unwrap();
                wait_event(&mut *x, &mut events);
                x.write(&src, 0..0, &back_grant, 0, Some(2)).unwrap();
                wait_event(&mut *y, &mut events);
            })
        });
    }
    g.throughput(criterion::Throughput::Bytes(
        (STREAM_CHUNKS * SLOT_BYTES) as u64,
    ));
    for posted in [false, true] {
        let name = if posted {
            "stream/bare_post"
        } else {
            "stream/bare_write"
        };
        g.bench_function(name, |bench| {
            bench.iter(|| {
                for k in 0..STREAM_CHUNKS {
                    let at = (k % SLOTS as usize) * SLOT_BYTES;
                    let last = k + 1 == STREAM_CHUNKS;
                    let note = last.then_some(3);
                    let range = at..at + SLOT_BYTES;
                    if posted {
                        y.post(&src, range, &grant, at as u64, note).unwrap();
                    } else {
                        y.write(&src, range, &grant, at as u64, note).unwrap();
                    }
                }
                wait_event(&mut *x, &mut events);
                // Retire what was posted before the next round (reaps the completions).
                let mut none = Vec::new();
                y.poll(&mut none).unwrap();
            })
        });
    }
    g.finish();
}

/// Streams `STREAM_CHUNKS` full chunks from `a` to `b` through the link, both streams played
/// by this thread: `a` makes chunk k ready once the credit for its slot is back, `b` releases
/// every chunk as soon as it is ready. `base` is the sequence reached so far.
fn stream(a: &End, b: &End, base: u32) {
    let n = STREAM_CHUNKS as u32;
    a.link.plan(vec![SLOT_BYTES; STREAM_CHUNKS], []);
    b.link.plan([], vec![SLOT_BYTES; STREAM_CHUNKS]);
    let (mut made, mut released) = (0u32, 0u32);
    let mut idle = 0u32;
    while released < n {
        let mut moved = false;
        let credit = a.mine.words[words::RELEASED as usize].load(Ordering::Acquire);
        if made < n && credit.wrapping_sub(base).wrapping_add(SLOTS) > made {
            made += 1;
            a.out_next.store(words::READY, base + made).unwrap();
            moved = true;
        }
        let ready = b.mine.words[words::READY as usize]
            .load(Ordering::Acquire)
            .wrapping_sub(base);
        if ready > released && ready <= n {
            released = ready;
            b.out_prev.store(words::RELEASED, base + released).unwrap();
            moved = true;
        }
        if let Some(e) = a.link.failure().or(b.link.failure()) {
            panic!("the link failed: {e}");
        }
        idle = if moved { 0 } else { idle + 1 };
        if idle > 1000 {
            std::thread::yield_now();
        }
    }
    wait_word(&a.mine, words::RELEASED, base + n, &a.link);
}

fn wait_event(c: &mut dyn HostConnection, events: &mut Vec<Event>) {
    events.clear();
    while events.is_empty() {
        c.wait(events, Deadline::after(Duration::from_secs(5)))
            .expect("notification");
    }
}

fn net_link(c: &mut Criterion) {
    bench_link(
        c,
        &Wire {
            name: "tcp",
            make: Box::new(|| {
                let (a, b) = loopback_pair(&JobToken::new(b"net-link-bench".to_vec())).unwrap();
                (Box::new(a), Box::new(b))
            }),
            region: Box::new(host_region),
        },
    );
    bench_link(
        c,
        &Wire {
            name: "in_process",
            make: Box::new(|| {
                let (a, b) = MemConnection::pair();
                (Box::new(a), Box::new(b))
            }),
            region: Box::new(host_region),
        },
    );
    match verbs_wire() {
        Ok(w) => bench_link(c, &w),
        Err(why) => println!("SKIP net_link_verbs: {why}"),
    }
}

/// Verbs between two queue pairs of this process on the first RDMA device (in the soft-RoCE
/// VM), or why there is none.
fn verbs_wire() -> Result<Wire, String> {
    use nodetour_core::transport::verbs::PreparedVerbs;
    use nodetour_core::verbs::{
        Access, EndpointDescription, LocalSide, MemoryRegion, Near, PathOptions, QueuePairOptions,
    };
    match nodetour_core::verbs::devices() {
        Ok(d) if !d.is_empty() => {}
        Ok(_) => return Err("no RDMA device on this machine".into()),
        Err(e) => return Err(e.to_string()),
    }
    let config = nodetour_core::Config::default();
    let side = Arc::new(LocalSide::open(&config, Near::Host).map_err(|e| e.to_string())?);
    let s = side.clone();
    let make = move || {
        let options = QueuePairOptions {
            send_depth: 64,
            recv_depth: nodetour_ring::net_link::receive_depth(SLOTS),
            max_inline: 0,
        };
        let (qa, ea) = PreparedVerbs::for_peer_with(&s, options).unwrap();
        let (qb, eb) = PreparedVerbs::for_peer_with(&s, options).unwrap();
        let endpoint = |e: &[u8]| EndpointDescription::decode(e).unwrap().endpoint;
        let path = PathOptions::new(s.port.port, &s.gid, &config);
        let t = Duration::from_secs(10);
        let a = qa.connect(&endpoint(&eb), &path, "b".into(), t).unwrap();
        let b = qb.connect(&endpoint(&ea), &path, "a".into(), t).unwrap();
        (
            Box::new(a) as Box<dyn HostConnection>,
            Box::new(b) as Box<dyn HostConnection>,
        )
    };
    let pd = side.pd.clone();
    let region = move |len: usize| {
        let buffer = HostBuffer::new(len).expect("host memory");
        SlotRegion::registered(Arc::new(
            MemoryRegion::register(&pd, buffer, Access::REMOTE).expect("registration"),
        ))
    };
    Ok(Wire {
        name: "verbs",
        make: Box::new(make),
        region: Box::new(region),
    })
}

criterion_group!(benches, net_link);
criterion_main!(benches);
