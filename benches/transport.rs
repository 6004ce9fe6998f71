//! One-sided writes through every transport this machine has: in-memory and tcp on loopback
//! always; verbs only where an RDMA device exists (else `SKIP`, with the reason). Throughput in
//! bytes. Beside them, in the same run, what a MAC over the bulk tcp payloads would cost on one
//! core (`bulk_mac`: HMAC-SHA256, keyed BLAKE3, Poly1305, and a memcpy of the same bytes as the
//! ceiling), the figures behind the choice in `docs/security-bulk-mac.md`. The GPU transports (cuda-ipc, shm) are measured between processes by
//! `nodetour perf --gpu` and `examples/gpu_transport_check` (a bench cannot start two
//! processes).

use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use nodetour_core::memory::HostBuffer;
use nodetour_core::transport::tcp::loopback_pair;
use nodetour_core::transport::{Event, HostConnection, MemConnection, SlotRegion};
use nodetour_core::{Config, Deadline};
use nodetour_net::bootstrap::JobToken;
use nodetour_tools::write_bw::{WriteBwOptions, run_client, run_server};

const SIZES: [usize; 2] = [64 << 10, 1 << 20];

/// Writes `len` bytes from `b` into `a`'s region, with a notification, and waits for it.
fn write_once(
    a: &mut dyn HostConnection,
    b: &mut dyn HostConnection,
    src: &SlotRegion,
    grant: &nodetour_core::transport::SlotGrant,
    len: usize,
    events: &mut Vec<Event>,
) {
    b.write(src, 0..len, grant, 0, Some(1)).expect("write");
    events.clear();
    while events.is_empty() {
        a.wait(events, Deadline::after(Duration::from_secs(5)))
            .expect("notification");
    }
}

fn bench_pair(
    c: &mut Criterion,
    name: &str,
    a: &mut dyn HostConnection,
    b: &mut dyn HostConnection,
) {
    let mut g = c.benchmark_group(format!("write_{name}"));
    let target = SlotRegion::host(HostBuffer::new(1 << 20).expect("buffer"));
    let src = SlotRegion::host(HostBuffer::new(1 << 20).expect("buffer"));
    let grant = a.grant(&target).expect("grant");
    let mut events = Vec::new();
    for len in SIZES {
        g.throughput(Throughput::Bytes(len as u64));
        g.bench_function(format!("{}KiB", len >> 10), |bn| {
            bn.iter(|| write_once(a, b, &src, &grant, len, &mut events))
        });
    }
    g.finish();
}

fn transports(c: &mut Criterion) {
    let (mut a, mut b) = MemConnection::pair();
    bench_pair(c, "mem", &mut a, &mut b);
    match loopback_pair(&JobToken::new("bench")) {
        Ok((mut a, mut b)) => bench_pair(c, "tcp_loopback", &mut a, &mut b),
        Err(e) => println!("SKIP write_tcp_loopback: {e}"),
    }
    verbs(c);
}

/// RDMA WRITE between two queue pairs of this machine (server thread and client, over the first
/// ACTIVE device, or NODETOUR_IB_DEVICE): the write phase of `nodetour write-bw`, timed from the
/// first post to the last completion.
fn verbs(c: &mut Criterion) {
    match nodetour_core::verbs::devices() {
        Ok(d) if !d.is_empty() => {}
        Ok(_) => return println!("SKIP write_verbs: no RDMA device on this machine"),
        Err(e) => return println!("SKIP write_verbs: {e}"),
    }
    let config = match Config::from_env() {
        Ok(c) => c,
        Err(e) => return println!("SKIP write_verbs: {e}"),
    };
    let mut g = c.benchmark_group("write_verbs");
    g.sample_size(10);
    for len in SIZES {
        g.throughput(Throughput::Bytes(len as u64));
        g.bench_function(format!("{}KiB", len >> 10), |bn| {
            bn.iter_custom(|iters| {
                let opts = WriteBwOptions {
                    size: len,
                    iters,
                    tx_depth: 128,
                    verify: false,
                };
                let port = 20000 + (std::process::id() % 20000) as u16;
                let (cs, addr) = (config.clone(), format!("127.0.0.1:{port}"));
                let listen = addr.clone();
                let token = JobToken::new("bench");
                let t2 = token.clone();
                let server = std::thread::spawn(move || run_server(&cs, &listen, &t2, opts));
                std::thread::sleep(Duration::from_millis(50));
                let report = run_client(&config, &addr, &token, opts).expect("verbs client");
                server.join().expect("server thread").expect("verbs server");
                report.elapsed
            })
        });
    }
    g.finish();
}

/// One core's throughput of each candidate MAC over a payload, beside a memcpy of it.
fn bulk_mac(c: &mut Criterion) {
    use hmac::{Hmac, Mac};
    use poly1305::universal_hash::KeyInit;
    use std::hint::black_box;
    let mut g = c.benchmark_group("bulk_mac");
    let data: Vec<u8> = (0..(1usize << 20)).map(|i| (i * 131) as u8).collect();
    let mut copy = vec![0u8; 1 << 20];
    let key = [7u8; 32];
    for len in SIZES {
        let d = &data[..len];
        g.throughput(Throughput::Bytes(len as u64));
        let kib = len >> 10;
        g.bench_function(format!("memcpy/{kib}KiB"), |b| {
            b.iter(|| {
                copy[..len].copy_from_slice(black_box(d));
                black_box(&copy);
            })
        });
        g.bench_function(format!("hmac_sha256/{kib}KiB"), |b| {
            b.iter(|| {
                let mut m = <Hmac<sha2::Sha256> as Mac>::new_from_slice(&key).expect("any key");
                m.update(black_box(d));
                black_box(m.finalize().into_bytes())
            })
        });
        g.bench_function(format!("blake3_keyed/{kib}KiB"), |b| {
            b.iter(|| black_box(blake3::keyed_hash(&key, black_box(d))))
        });
        // (A real use keys Poly1305 afresh per frame from a stream cipher: a few ns more.)
        g.bench_function(format!("poly1305/{kib}KiB"), |b| {
            b.iter(|| {
                black_box(poly1305::Poly1305::new((&key).into()).compute_unpadded(black_box(d)))
            })
        });
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20).measurement_time(Duration::from_secs(2)).warm_up_time(Duration::from_millis(500));
    targets = transports, bulk_mac
}
criterion_main!(benches);
