//! Real verbs, on a real RDMA device: soft-RoCE inside `scripts/vm/rdma-vm.sh` in CI, or any NIC.
//!
//! These tests are `#[ignore]`d so that a plain `cargo test` on a machine without RDMA counts them
//! as skipped (never as passed); `scripts/test.sh` runs them with `--include-ignored` inside the
//! VM, where `NODETOUR_REQUIRE_RDMA=1` turns a missing device into a failure. Run by hand with
//! `cargo test -p nodetour-core --test verbs_rxe -- --include-ignored`; with no device each test
//! prints `SKIP <reason>`.
//!
//! Two endpoints: `NODETOUR_VM_DEV0` and `NODETOUR_VM_DEV1` (two rxe devices on a veth pair,
//! set by `rdma-vm.sh --nodes 2`), else the first device for both (its loopback path).

use std::os::fd::AsFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nodetour_core::cuda::GdrAttributes;
use nodetour_core::registration::{
    self, GdrMode, LadderBuffer, PeermemState, Probe, Registration, Rung,
};

use nodetour_core::memory::{HostBuffer, RdmaBuffer};
use nodetour_core::verbs::inject::{self, Call};
use nodetour_core::verbs::{
    Access, AsyncEvent, Completion, Context, DmabufSupport, GidChoice, LinkLayer, MemoryRegion,
    PathOptions, PortAttributes, ProtectionDomain, QpState, QueuePair, QueuePairOptions,
    RemoteRegion,
};
use nodetour_core::{Config, Deadline, Error};

struct Side {
    context: Arc<Context>,
    port: PortAttributes,
    gid: GidChoice,
    pd: Arc<ProtectionDomain>,
}

fn side(name: &str) -> Side {
    let context = Context::open(name).expect("open device");
    let port = context.first_active_port().expect("active port");
    let gid = context.choose_gid(&port, None).expect("gid");
    let pd = ProtectionDomain::new(&context).expect("pd");
    Side {
        context,
        port,
        gid,
        pd,
    }
}

/// The two device names to use, or `None` after printing `SKIP <reason>`.
fn devices() -> Option<(String, String)> {
    let found = match nodetour_core::verbs::devices() {
        Ok(list) if !list.is_empty() => list,
        Ok(_) => return skip("no RDMA device on this machine"),
        Err(e) => return skip(&format!("{e}")),
    };
    let first = found[0].name.clone();
    let dev0 = std::env::var("NODETOUR_VM_DEV0").unwrap_or_else(|_| first.clone());
    let dev1 = std::env::var("NODETOUR_VM_DEV1").unwrap_or(dev0.clone());
    Some((dev0, dev1))
}

fn skip<T>(reason: &str) -> Option<T> {
    if std::env::var("NODETOUR_REQUIRE_RDMA").as_deref() == Ok("1") {
        panic!("NODETOUR_REQUIRE_RDMA=1 but {reason}");
    }
    println!("SKIP {reason}");
    None
}

fn config() -> Config {
    Config {
        timeout: Duration::from_secs(20),
        ..Config::default()
    }
}

/// Two connected queue pairs and a target region on side B.
struct Pair {
    a: QueuePair,
    b: QueuePair,
    a_side: Side,
    b_side: Side,
}

fn connected(options: QueuePairOptions) -> Option<Pair> {
    let (d0, d1) = devices()?;
    let a_side = side(&d0);
    let b_side = side(&d1);
    let a = QueuePair::new(&a_side.pd, a_side.port.port, options).unwrap();
    let b = QueuePair::new(&b_side.pd, b_side.port.port, options).unwrap();
    let cfg = config();
    a.connect(
        &b.endpoint(&b_side.gid),
        &PathOptions::new(a_side.port.port, &a_side.gid, &cfg),
    )
    .unwrap();
    b.connect(
        &a.endpoint(&a_side.gid),
        &PathOptions::new(b_side.port.port, &b_side.gid, &cfg),
    )
    .unwrap();
    assert_eq!(a.state(), QpState::ReadyToSend);
    Some(Pair {
        a,
        b,
        a_side,
        b_side,
    })
}

impl Pair {
    /// A registered source region of `len` bytes on side A.
    fn source(&self, len: usize) -> Arc<MemoryRegion<HostBuffer>> {
        Arc::new(
            MemoryRegion::register(
                &self.a_side.pd,
                HostBuffer::new(len).unwrap(),
                Access::LOCAL,
            )
            .unwrap(),
        )
    }

    /// A remotely writable region of `len` bytes on side B.
    fn target(&self, len: usize) -> MemoryRegion<HostBuffer> {
        MemoryRegion::register(
            &self.b_side.pd,
            HostBuffer::new(len).unwrap(),
            Access::REMOTE,
        )
        .unwrap()
    }
}

fn deadline() -> Deadline {
    Deadline::after(Duration::from_secs(30))
}

fn pattern(i: usize) -> u8 {
    (i as u32).wrapping_mul(2_654_435_761).to_be_bytes()[0] ^ (i >> 16) as u8
}

#[test]
#[ignore = "needs an RDMA device"]
fn device_port_and_gid_are_read_from_the_device() {
    let Some((d0, _)) = devices() else { return };
    let s = side(&d0);
    assert!(s.context.attributes().ports >= 1);
    assert!(s.context.attributes().max_qp_wr > 0 && s.context.attributes().max_cqe > 0);
    assert!(s.port.active_mtu.is_some());
    if s.port.link_layer == LinkLayer::Ethernet {
        assert!(s.gid.reason.contains("RoCE v2"), "{}", s.gid.reason);
    }
    println!("{d0}: {:?} gid {} ({})", s.port, s.gid.index, s.gid.reason);
}

#[test]
#[ignore = "needs an RDMA device"]
fn bad_device_name_and_gid_index_are_typed_errors() {
    let Some((d0, _)) = devices() else { return };
    match Context::open("no_such_device") {
        Err(Error::DeviceNotFound { name, available }) => {
            assert_eq!(name, "no_such_device");
            assert!(available.contains(&d0), "{available}");
        }
        other => panic!("{other:?}"),
    }
    let s = side(&d0);
    match s.context.choose_gid(&s.port, Some(250)) {
        Err(Error::GidIndexOutOfRange { index: 250, .. }) => {}
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        s.context.port(0),
        Err(Error::PortOutOfRange { .. })
    ));
    assert!(matches!(
        s.context.port(99),
        Err(Error::PortOutOfRange { .. })
    ));
}

/// Host memory at an offset of one byte into a page: what a careless caller might register.
struct Misaligned(HostBuffer);
// SAFETY: the pointer is inside the HostBuffer's stable mapping, len stays within it.
unsafe impl RdmaBuffer for Misaligned {
    fn as_mut_ptr(&self) -> *mut u8 {
        // SAFETY: offset 1 is within the buffer (len >= 2).
        unsafe { self.0.as_mut_ptr().add(1) }
    }
    fn len(&self) -> usize {
        self.0.len() - 1
    }
    fn kind(&self) -> &'static str {
        "host"
    }
}

#[test]
#[ignore = "needs an RDMA device"]
fn registration_refusals_are_typed_with_hints() {
    let Some((d0, _)) = devices() else { return };
    let s = side(&d0);
    let r = MemoryRegion::register(
        &s.pd,
        Misaligned(HostBuffer::new(8192).unwrap()),
        Access::REMOTE,
    );
    assert!(
        matches!(r, Err(Error::InvalidRegistration { .. })),
        "{:?}",
        r.err()
    );
    inject::fail_next(Call::RegMr, libc::ENOMEM);
    match MemoryRegion::register(&s.pd, HostBuffer::new(4096).unwrap(), Access::REMOTE) {
        Err(e @ Error::RegisterMemory { .. }) => {
            assert_eq!(e.errno(), Some(libc::ENOMEM));
            assert!(e.to_string().contains("ulimit -l"), "{e}");
        }
        other => panic!("{other:?}"),
    }
    // The fault fired once: the next registration works, and gives its buffer back.
    let mr = MemoryRegion::register(&s.pd, HostBuffer::new(4096).unwrap(), Access::REMOTE).unwrap();
    assert!(mr.rkey() != 0 || mr.lkey() != 0);
    assert_eq!(mr.into_buffer().unwrap().len(), 4096);
}

#[test]
#[ignore = "needs an RDMA device"]
fn soft_roce_refuses_dma_buf_and_says_why() {
    let Some((d0, _)) = devices() else { return };
    let s = side(&d0);
    let support = s.pd.probe_dmabuf();
    println!("{d0}: dma-buf {support:?}");
    if d0.starts_with("rxe") || d0.starts_with("siw") {
        match support {
            DmabufSupport::Unsupported(reason) => assert!(
                reason.contains(&d0) || reason.contains("rdma-core"),
                "{reason}"
            ),
            other => panic!("soft-RoCE must refuse dma-buf, got {other:?}"),
        }
    }
}

#[test]
#[ignore = "needs an RDMA device"]
fn rdma_write_and_write_with_immediate_deliver_verified_data() {
    let Some(p) = connected(QueuePairOptions {
        send_depth: 16,
        recv_depth: 8,
        max_inline: 64,
    }) else {
        return;
    };
    const LEN: usize = 4 << 20;
    const CHUNK: usize = 256 << 10;
    let src = p.source(LEN);
    let dst = Arc::new(p.target(LEN + 4096));
    src.fill_with(0..LEN, pattern).unwrap();
    p.b.post_receives(2).unwrap();
    let remote = dst.remote();
    let start = Instant::now();
    let mut done = Vec::new();
    for (i, off) in (0..LEN).step_by(CHUNK).enumerate() {
        let last = off + CHUNK == LEN;
        loop {
            match p.a.post_write(
                &src,
                off..off + CHUNK,
                &remote,
                off as u64,
                last.then_some(0xabcd_0000 | i as u32),
                last,
            ) {
                Ok(_) => break,
                Err(Error::SendQueueFull { .. }) => {
                    p.a.wait(&mut done, deadline()).unwrap();
                }
                Err(e) => panic!("{e}"),
            }
        }
    }
    // An inline write carries its bytes in the request: no registration on the sending side.
    let tail = b"inline tail written by the sender";
    p.a.wait_idle(deadline()).unwrap();
    p.a.post_write_inline(tail, &remote, LEN as u64, None, true)
        .unwrap();
    p.a.wait_idle(deadline()).unwrap();
    let elapsed = start.elapsed();
    let mut got_imm = None;
    while got_imm.is_none() {
        done.clear();
        p.b.wait(&mut done, deadline()).unwrap();
        for c in &done {
            if let Completion::WriteWithImmediate {
                immediate,
                byte_len,
                ..
            } = c
            {
                got_imm = Some(*immediate);
                assert_eq!(*byte_len as usize, CHUNK);
            }
        }
    }
    assert_eq!(got_imm, Some(0xabcd_0000 | (LEN / CHUNK - 1) as u32));
    let mut got = vec![0u8; LEN + tail.len()];
    dst.read_at(0, &mut got).unwrap();
    let bad = got[..LEN]
        .iter()
        .enumerate()
        .position(|(i, b)| *b != pattern(i));
    assert_eq!(bad, None, "first corrupted byte");
    assert_eq!(&got[LEN..], tail);
    assert_eq!(p.a.outstanding_sends(), 0);
    assert_eq!(p.b.posted_receives(), 1);
    println!(
        "wrote {} MiB in {:.3} s ({:.1} MiB/s), verified byte for byte",
        LEN >> 20,
        elapsed.as_secs_f64(),
        LEN as f64 / elapsed.as_secs_f64() / 1_048_576.0
    );
}

#[test]
#[ignore = "needs an RDMA device"]
fn a_wrong_rkey_fails_the_write_with_a_remote_access_error() {
    let Some(p) = connected(QueuePairOptions::default()) else {
        return;
    };
    let src = p.source(4096);
    let dst = p.target(4096);
    let forged = RemoteRegion {
        rkey: dst.rkey() ^ 0x5a5a_0000,
        ..dst.remote()
    };
    p.a.post_write(&src, 0..4096, &forged, 0, None, true)
        .unwrap();
    let mut done = Vec::new();
    match p.a.wait(&mut done, deadline()) {
        Err(Error::WorkCompletion { status, hint, .. }) => {
            assert_eq!(status, "IBV_WC_REM_ACCESS_ERR");
            assert!(hint.contains("rkey"), "{hint}");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(p.a.state(), QpState::Error);
    assert!(matches!(
        p.a.post_write(&src, 0..16, &dst.remote(), 0, None, true),
        Err(Error::QueuePairNotReady { state: "ERR", .. })
    ));
    let mut zero = vec![1u8; 4096];
    dst.read_at(0, &mut zero).unwrap();
    assert!(zero.iter().all(|b| *b == 0), "nothing landed");
    // Some providers also report the violation to the responder as an asynchronous event
    // (rxe does not): if one comes, a wait there fails with it, typed.
    let short = Deadline::after(Duration::from_secs(2));
    match p.b.wait(&mut done, short) {
        Err(Error::AsyncEvent { event, hint, .. }) => {
            assert_eq!(event, AsyncEvent::QpAccessError { qpn: p.b.qpn() });
            assert!(hint.contains("remote key"), "{hint}");
        }
        Err(Error::Timeout { .. }) => {
            println!("responder: no asynchronous event from this provider")
        }
        other => panic!("{other:?}"),
    }
}

/// Takes the network interface under the second device down (and up again): the device raises
/// IBV_EVENT_PORT_ERR, and a queue pair waiting for completions on that port fails at once with
/// the typed event instead of at its deadline. Changes the VM's network, so the VM tier runs it
/// alone, last (`NODETOUR_VM_PORT_DOWN_TEST=1`).
#[test]
#[ignore = "takes a network interface down; the VM tier runs it last"]
fn a_port_that_goes_down_fails_waits_with_a_typed_event() {
    if std::env::var("NODETOUR_VM_PORT_DOWN_TEST").as_deref() != Ok("1") {
        println!("SKIP set NODETOUR_VM_PORT_DOWN_TEST=1 (inside the VM) to take a link down");
        return;
    }
    let Some(p) = connected(QueuePairOptions::default()) else {
        return;
    };
    let dev = p.b_side.context.name().to_owned();
    let port = p.b_side.port.port;
    let ndev = std::fs::read_to_string(format!(
        "/sys/class/infiniband/{dev}/ports/{port}/gid_attrs/ndevs/0"
    ))
    .expect("the netdev under the device")
    .trim()
    .to_owned();
    let ip = |state: &str| {
        let ok = std::process::Command::new("ip")
            .args(["link", "set", &ndev, state])
            .status()
            .map(|s| s.success())
            .unwrap_or(false);
        assert!(ok, "ip link set {ndev} {state}");
    };
    ip("down");
    let t = std::time::Instant::now();
    let mut done = Vec::new();
    let got =
        p.b.wait(&mut done, Deadline::after(Duration::from_secs(10)));
    ip("up");
    match got {
        Err(Error::AsyncEvent { event, hint, .. }) => {
            println!(
                "{dev} ({ndev} down): {event} after {:?}: {hint}",
                t.elapsed()
            );
            assert_eq!(event, AsyncEvent::PortError { port });
            assert!(hint.contains("link went down"), "{hint}");
        }
        other => panic!("{other:?}"),
    }
    assert!(t.elapsed() < Duration::from_secs(5), "noticed late");
}

#[test]
#[ignore = "needs an RDMA device"]
fn local_bounds_and_states_are_checked_before_posting() {
    let Some((d0, _)) = devices() else { return };
    let s = side(&d0);
    let qp = QueuePair::new(&s.pd, s.port.port, QueuePairOptions::default()).unwrap();
    assert_eq!(qp.state(), QpState::Init);
    let src = Arc::new(
        MemoryRegion::register(&s.pd, HostBuffer::new(4096).unwrap(), Access::LOCAL).unwrap(),
    );
    let remote = RemoteRegion {
        addr: 0x1000,
        len: 4096,
        rkey: 1,
    };
    assert!(matches!(
        qp.post_write(&src, 0..16, &remote, 0, None, true),
        Err(Error::QueuePairNotReady { state: "INIT", .. })
    ));
    let Some(p) = connected(QueuePairOptions::default()) else {
        return;
    };
    let src = p.source(4096);
    assert!(matches!(
        p.a.post_write(&src, 0..8192, &remote, 0, None, true),
        Err(Error::OutOfBounds { .. })
    ));
    assert!(matches!(
        p.a.post_write(&src, 0..4096, &remote, 1, None, true),
        Err(Error::OutOfBounds { .. })
    ));
    assert!(matches!(
        p.a.post_write_inline(&[0; 4096], &remote, 0, None, true),
        Err(Error::InvalidArgument { .. })
    ));
    assert!(matches!(
        QueuePair::new(
            &p.a_side.pd,
            p.a_side.port.port,
            QueuePairOptions {
                send_depth: 0,
                ..Default::default()
            }
        ),
        Err(Error::InvalidArgument { .. })
    ));
    assert!(matches!(
        QueuePair::new(
            &p.a_side.pd,
            p.a_side.port.port,
            QueuePairOptions {
                send_depth: u32::MAX / 4,
                ..Default::default()
            }
        ),
        Err(Error::InvalidArgument { .. })
    ));
}

#[test]
#[ignore = "needs an RDMA device"]
fn a_full_send_queue_is_reported_and_drains() {
    let Some(p) = connected(QueuePairOptions {
        send_depth: 4,
        recv_depth: 1,
        max_inline: 0,
    }) else {
        return;
    };
    let src = p.source(65536);
    let dst = p.target(65536);
    let mut full = false;
    for _ in 0..64 {
        match p
            .a
            .post_write(&src, 0..65536, &dst.remote(), 0, None, false)
        {
            Ok(_) => {}
            Err(Error::SendQueueFull { depth: 4, .. }) => {
                full = true;
                break;
            }
            Err(e) => panic!("{e}"),
        }
    }
    assert!(full, "four unretired writes fill a queue of four");
    p.a.wait_idle(deadline()).unwrap();
    assert_eq!(p.a.outstanding_sends(), 0);
    p.a.post_write(&src, 0..16, &dst.remote(), 0, None, true)
        .unwrap();
    p.a.wait_idle(deadline()).unwrap();
}

#[test]
#[ignore = "needs an RDMA device"]
fn waiting_with_nothing_in_flight_times_out_on_schedule() {
    let Some(p) = connected(QueuePairOptions::default()) else {
        return;
    };
    let start = Instant::now();
    let r =
        p.b.wait(&mut Vec::new(), Deadline::after(Duration::from_millis(300)));
    assert!(matches!(r, Err(Error::Timeout { .. })), "{r:?}");
    let took = start.elapsed();
    assert!(
        took >= Duration::from_millis(300) && took < Duration::from_secs(5),
        "{took:?}"
    );
}

#[test]
#[ignore = "needs an RDMA device"]
fn one_wait_covers_several_verbs_connections() {
    use nodetour_core::transport::verbs::PreparedVerbs;
    use nodetour_core::transport::{Event, HostConnection, SlotGrant, SlotRegion, wait_any};
    let Some((d0, d1)) = devices() else {
        return;
    };
    let (a_side, b_side) = (side(&d0), side(&d1));
    let options = QueuePairOptions {
        send_depth: 16,
        recv_depth: 8,
        max_inline: 0,
    };
    let cfg = config();
    let (mut a_conns, mut b_conns) = (Vec::new(), Vec::new());
    for _ in 0..2 {
        let qa = PreparedVerbs::new(&a_side.pd, a_side.port.port, options).unwrap();
        let qb = PreparedVerbs::new(&b_side.pd, b_side.port.port, options).unwrap();
        let (ea, eb) = (qa.endpoint(&a_side.gid), qb.endpoint(&b_side.gid));
        let path_a = PathOptions::new(a_side.port.port, &a_side.gid, &cfg);
        let path_b = PathOptions::new(b_side.port.port, &b_side.gid, &cfg);
        a_conns.push(qa.connect(&eb, &path_a, "b".into(), cfg.timeout).unwrap());
        b_conns.push(qb.connect(&ea, &path_b, "a".into(), cfg.timeout).unwrap());
    }
    let region = |pd: &Arc<ProtectionDomain>, access| {
        SlotRegion::registered(Arc::new(
            MemoryRegion::register(pd, HostBuffer::new(4096).unwrap(), access).unwrap(),
        ))
    };
    let target = region(&a_side.pd, Access::REMOTE);
    let source = region(&b_side.pd, Access::LOCAL);
    let grants: Vec<SlotGrant> = a_conns
        .iter_mut()
        .map(|a| a.grant(&target).unwrap())
        .collect();
    let mut events = Vec::new();
    let wait = |conns: &mut Vec<nodetour_core::transport::verbs::VerbsConnection>,
                events: &mut Vec<(usize, Event)>,
                d: Duration| {
        let mut refs: Vec<&mut dyn HostConnection> = conns
            .iter_mut()
            .map(|c| c as &mut dyn HostConnection)
            .collect();
        wait_any(&mut refs, events, Deadline::after(d)).unwrap();
    };

    // Nothing sent: the wait blocks until its deadline, with no events.
    let start = Instant::now();
    wait(&mut a_conns, &mut events, Duration::from_millis(300));
    let took = start.elapsed();
    assert!(events.is_empty(), "{events:?}");
    assert!(
        took >= Duration::from_millis(300) && took < Duration::from_secs(5),
        "{took:?}"
    );

    // A notification on the second connection while the wait blocks wakes it, by index, and
    // the completion channel's event is taken (the next wait blocks again).
    std::thread::scope(|s| {
        let (b, g, src) = (&mut b_conns[1], grants[1], &source);
        s.spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            b.write(src, 0..64, &g, 0, Some(7)).unwrap();
        });
        let start = Instant::now();
        wait(&mut a_conns, &mut events, Duration::from_secs(20));
        assert_eq!(events, vec![(1, Event::Notified(7))]);
        assert!(start.elapsed() < Duration::from_secs(10));
    });
    events.clear();
    let start = Instant::now();
    wait(&mut a_conns, &mut events, Duration::from_millis(200));
    assert!(events.is_empty(), "{events:?}");
    assert!(start.elapsed() >= Duration::from_millis(200));

    // Notifications on both, sent before the wait: both come, each once.
    for (i, b) in b_conns.iter_mut().enumerate() {
        b.write(&source, 0..8, &grants[i], 0, Some(10 + i as u32))
            .unwrap();
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    while events.len() < 2 && Instant::now() < deadline {
        wait(&mut a_conns, &mut events, Duration::from_secs(1));
    }
    events.sort_by_key(|e| e.0);
    assert_eq!(
        events,
        vec![(0, Event::Notified(10)), (1, Event::Notified(11))]
    );
}

#[test]
#[ignore = "needs an RDMA device"]
fn injected_completion_errors_and_call_failures_are_typed() {
    let Some(p) = connected(QueuePairOptions::default()) else {
        return;
    };
    let src = p.source(4096);
    let dst = p.target(4096);
    inject::fail_next(Call::PostSend, libc::ENOMEM);
    match p.a.post_write(&src, 0..64, &dst.remote(), 0, None, true) {
        Err(e @ Error::PostSend { .. }) => assert_eq!(e.errno(), Some(libc::ENOMEM)),
        other => panic!("{other:?}"),
    }
    assert_eq!(
        p.a.outstanding_sends(),
        0,
        "a refused post leaves no bookkeeping behind"
    );
    inject::fail_next(Call::PostRecv, libc::EINVAL);
    assert!(matches!(
        p.b.post_receives(1),
        Err(Error::PostReceive { .. })
    ));
    p.a.post_write(&src, 0..64, &dst.remote(), 0, None, true)
        .unwrap();
    inject::next_completion_status(12); // IBV_WC_RETRY_EXC_ERR
    match p.a.wait(&mut Vec::new(), deadline()) {
        Err(e @ Error::WorkCompletion { .. }) => {
            assert!(e.to_string().contains("ACS/IOMMU"), "{e}")
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(p.a.outstanding_sends(), 0, "the failed request is retired");
    inject::fail_next(Call::ModifyQp, libc::EINVAL);
    let qp = QueuePair::new(
        &p.a_side.pd,
        p.a_side.port.port,
        QueuePairOptions::default(),
    );
    assert!(
        matches!(qp, Err(Error::ModifyQueuePair { to: "INIT", .. })),
        "{qp:?}"
    );
    inject::fail_next(Call::CreateQp, libc::ENOMEM);
    assert!(matches!(
        QueuePair::new(
            &p.a_side.pd,
            p.a_side.port.port,
            QueuePairOptions::default()
        ),
        Err(Error::CreateQueuePair { .. })
    ));
    inject::fail_next(Call::CreateCq, libc::ENOMEM);
    assert!(matches!(
        QueuePair::new(
            &p.a_side.pd,
            p.a_side.port.port,
            QueuePairOptions::default()
        ),
        Err(Error::CreateCompletionQueue { .. })
    ));
    inject::fail_next(Call::AllocPd, libc::ENOMEM);
    assert!(matches!(
        ProtectionDomain::new(&p.a_side.context),
        Err(Error::AllocateProtectionDomain { .. })
    ));
    inject::fail_next(Call::QueryPort, libc::EIO);
    assert!(matches!(
        p.a_side.context.port(1),
        Err(Error::QueryPort { .. })
    ));
    inject::clear();
}

#[test]
#[ignore = "needs an RDMA device"]
fn teardown_with_writes_in_flight_is_orderly() {
    for _ in 0..3 {
        let Some(p) = connected(QueuePairOptions {
            send_depth: 32,
            recv_depth: 4,
            max_inline: 0,
        }) else {
            return;
        };
        let src = p.source(1 << 20);
        let dst = p.target(1 << 20);
        p.b.post_receives(4).unwrap();
        for _ in 0..16 {
            p.a.post_write(&src, 0..(1 << 20), &dst.remote(), 0, None, false)
                .unwrap();
        }
        // The caller lets go of its region while the NIC may still read it: the queue pair keeps
        // it registered until its teardown has drained.
        let weak = Arc::downgrade(&src);
        drop(src);
        assert!(
            weak.upgrade().is_some(),
            "posted work keeps the source region alive"
        );
        let Pair {
            a,
            b,
            a_side,
            b_side,
        } = p;
        drop(a);
        assert!(
            weak.upgrade().is_none(),
            "released after the queue pair is gone"
        );
        drop(b);
        drop(dst);
        drop((a_side, b_side));
    }
}

/// Host memory standing in for GPU memory on a machine without a GPU: its "dma-buf" is a plain
/// file, which a provider without dma-buf support refuses before looking at it.
struct StandInGpu(HostBuffer);

// SAFETY: delegates to the HostBuffer, whose address is stable and len valid.
unsafe impl RdmaBuffer for StandInGpu {
    fn as_mut_ptr(&self) -> *mut u8 {
        self.0.as_mut_ptr()
    }
    fn len(&self) -> usize {
        RdmaBuffer::len(&self.0)
    }
    fn kind(&self) -> &'static str {
        "gpu"
    }
}

impl LadderBuffer for StandInGpu {
    fn register_dmabuf(
        pd: &Arc<ProtectionDomain>,
        buffer: Self,
        access: Access,
    ) -> Result<MemoryRegion<Self>, (Error, Self)> {
        let file = tempfile::tempfile().unwrap();
        registration::register_with_dmabuf_fd(pd, buffer, file.as_fd(), 0, access)
    }
}

fn stand_in_gpu() -> GdrAttributes {
    GdrAttributes {
        gpu_direct_rdma: true,
        flush_writes_options: 1,
        writes_ordering: 100,
        dma_buf: true,
        host_register: true,
        gdr_with_vmm: true,
        stream_wait_value: true,
    }
}

#[test]
#[ignore = "needs an RDMA device"]
fn the_ladder_on_soft_roce_refuses_dmabuf_and_peermem_and_stages() {
    let Some((d0, _)) = devices() else { return };
    let s = side(&d0);
    let probe = Probe::gather(Ok(stand_in_gpu()), Ok(&s.pd));
    assert!(
        matches!(probe.nic_dmabuf, DmabufSupport::Unsupported(_)),
        "{:?}",
        probe.nic_dmabuf
    );
    assert!(
        !probe.peermem.loaded,
        "a VM without NVIDIA drivers has no nvidia-peermem"
    );
    let buffer = StandInGpu(HostBuffer::new(1 << 20).unwrap());
    let outcome =
        registration::register_gpu(&s.pd, buffer, &probe, GdrMode::Auto, Access::REMOTE).unwrap();
    println!("{d0}: {}", outcome.describe());
    assert_eq!(outcome.rung(), Rung::Staged);
    let reasons: Vec<_> = outcome
        .refused()
        .iter()
        .map(|r| (r.rung, r.reason.clone()))
        .collect();
    assert_eq!(reasons.len(), 2);
    assert!(
        reasons[0].0 == Rung::DmaBuf && reasons[0].1.contains("os error 95"),
        "{reasons:?}"
    );
    assert!(
        reasons[1].0 == Rung::PeerMem && reasons[1].1.contains("nvidia-peermem is not loaded"),
        "{reasons:?}"
    );
    // The buffer comes back whole for the staged path.
    match outcome {
        Registration::Staged { buffer, .. } => assert_eq!(RdmaBuffer::len(&buffer), 1 << 20),
        Registration::Direct { .. } => unreachable!(),
    }
    // Force mode turns the same outcome into an error that carries every reason.
    let buffer = StandInGpu(HostBuffer::new(1 << 20).unwrap());
    match registration::register_gpu(&s.pd, buffer, &probe, GdrMode::Force, Access::REMOTE) {
        Err(Error::Unsupported { reason, .. }) => {
            assert!(reason.contains("dma-buf:") && reason.contains("peermem:"))
        }
        other => panic!("{:?}", other.map(|o| o.describe())),
    }
}

#[test]
#[ignore = "needs an RDMA device"]
fn each_rung_is_attempted_and_its_failure_recorded() {
    let Some((d0, _)) = devices() else { return };
    let s = side(&d0);
    // The dma-buf probe answering oddly still lets the rung be tried: the real attempt fails
    // with EOPNOTSUPP and that is what is recorded.
    let mut probe = Probe::gather(Ok(stand_in_gpu()), Ok(&s.pd));
    probe.nic_dmabuf = DmabufSupport::Unknown("fixture".into());
    probe.peermem = PeermemState {
        loaded: true,
        evidence: "fixture".into(),
    };
    let buffer = StandInGpu(HostBuffer::new(1 << 20).unwrap());
    let outcome =
        registration::register_gpu(&s.pd, buffer, &probe, GdrMode::Auto, Access::REMOTE).unwrap();
    // The peermem rung is ibv_reg_mr on the buffer's address: host memory registers, so the
    // stand-in reaches "direct (peermem)" with the dma-buf attempt's failure on record.
    assert_eq!(outcome.rung(), Rung::PeerMem, "{}", outcome.describe());
    assert!(
        outcome.refused()[0].reason.contains("no dma-buf support"),
        "{}",
        outcome.describe()
    );
    drop(outcome);
    // An EFAULT from ibv_reg_mr (what a GPU pointer gives without a working nvidia-peermem)
    // is recorded as such, and the buffer goes to the staged path.
    inject::fail_next(Call::RegMr, libc::EFAULT);
    let buffer = StandInGpu(HostBuffer::new(1 << 20).unwrap());
    let outcome =
        registration::register_gpu(&s.pd, buffer, &probe, GdrMode::Auto, Access::REMOTE).unwrap();
    assert_eq!(outcome.rung(), Rung::Staged);
    assert!(
        outcome
            .describe()
            .contains("nvidia-peermem is missing or not working"),
        "{}",
        outcome.describe()
    );
    inject::fail_next(Call::RegDmabufMr, libc::ENOMEM);
    let buffer = StandInGpu(HostBuffer::new(1 << 20).unwrap());
    probe.peermem.loaded = false;
    let outcome =
        registration::register_gpu(&s.pd, buffer, &probe, GdrMode::Auto, Access::REMOTE).unwrap();
    assert!(
        outcome.describe().contains("BAR1"),
        "{}",
        outcome.describe()
    );
}

#[test]
#[ignore = "needs an RDMA device"]
fn a_read_flush_reads_landed_bytes_on_its_own_loopback_queue_pair() {
    use nodetour_core::transport::read_flush::ReadFlush;
    let Some((d0, _)) = devices() else { return };
    let s = side(&d0);
    // "GPU" slots registered for peers' writes only (the peermem rung: ibv_reg_mr on the
    // address), as the ring registers its receive slots.
    let mut memory = HostBuffer::new(1 << 20).unwrap();
    for (i, b) in memory.as_mut_slice().iter_mut().enumerate() {
        *b = (i % 251) as u8;
    }
    let slots =
        Arc::new(MemoryRegion::register(&s.pd, StandInGpu(memory), Access::REMOTE).unwrap());
    let mut flush = ReadFlush::new(
        &s.context,
        &s.port,
        &s.gid,
        &config(),
        &slots,
        Rung::PeerMem,
        Duration::from_secs(5),
    )
    .expect("a read flush on soft-RoCE (loopback queue pair, its own protection domain)");
    // Every chunk of the slots, many times over (each read completes before the next).
    for round in 0..50usize {
        for chunk in 0..16usize {
            let at = chunk * (64 << 10);
            flush
                .flush(at, 64 << 10)
                .unwrap_or_else(|e| panic!("round {round} chunk {chunk}: {e}"));
            let want: Vec<u8> = (at..at + 4).map(|i| (i % 251) as u8).collect();
            assert_eq!(flush.read_back().unwrap()[..], want[..], "chunk {chunk}");
        }
    }
    flush.flush(0, 0).unwrap();
    flush.flush((1 << 20) - 1, 1).unwrap();
    // Outside the slots: refused before anything is posted, and the flush still works after.
    assert!(matches!(
        flush.flush(1 << 20, 4),
        Err(Error::OutOfBounds { .. })
    ));
    flush.flush(0, 4).unwrap();
    // A queue pair that reaches a peer never reads: it was not made a reader.
    let peer_qp = QueuePair::new(&s.pd, s.port.port, QueuePairOptions::default()).unwrap();
    let target = Arc::new(
        MemoryRegion::register(&s.pd, HostBuffer::new(4096).unwrap(), Access::LOCAL).unwrap(),
    );
    assert!(matches!(
        peer_qp.post_read(&target, 0..4, &slots.remote(), 0),
        Err(Error::InvalidArgument { .. })
    ));
    // The dma-buf rung needs a buffer that exports one: the stand-in does not, and says so.
    match ReadFlush::new(
        &s.context,
        &s.port,
        &s.gid,
        &config(),
        &slots,
        Rung::DmaBuf,
        Duration::from_secs(5),
    ) {
        Err(Error::Unsupported { reason, .. }) => {
            assert!(reason.contains("no dma-buf"), "{reason}")
        }
        other => panic!("{:?}", other.err()),
    }
    drop(flush);
    // Teardown left the slots' own registration intact.
    assert_eq!(slots.len(), 1 << 20);
    println!("read flush: 801 reads of landed bytes on a loopback queue pair, each completed");
}
