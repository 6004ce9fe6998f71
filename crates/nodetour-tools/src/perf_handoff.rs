//! `nodetour perf --handoff`: what one chunk's hand-off across a network link adds, on one GPU
//! and in one process (no time slicing between processes, no spinning kernel: only the copy
//! engines and stream memory operations).
//!
//! **Network**: stream A copies the chunk into its host send slot and stores `ready`; A's link
//! thread sees it and writes the chunk over tcp loopback into B's receive slot; B's link thread
//! stores `ready` in B's page; stream B, waiting for it, copies the chunk into GPU memory and
//! releases the slot (the credit goes back). **Local** (the reference, same run): the same two
//! copies with stream B waiting for a word stream A stores directly, no thread and no wire. The
//! time is GPU time from an event before A's copy to an event after B's, per chunk, median of
//! the iterations; `added` is network minus local. `NODETOUR_NET_SPIN_US` sets how long the link
//! threads spin before they nap.

use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::CudaContext;
use nodetour_core::auth::JobToken;
use nodetour_core::cuda::GpuStream;
use nodetour_core::memory::{DeviceBuffer, HostBuffer};
use nodetour_core::transport::gpu::{FlagPage, Flags, LinkSlots, StagedReceive};
use nodetour_core::transport::tcp::loopback_pair;
use nodetour_core::transport::{HostConnection, SlotRegion};
use nodetour_ring::net_link::{MAILBOX_BYTES, NetLink, NetLinkSetup, NetOptions, WordPage, words};

use crate::perf::median;

/// One size.
#[derive(Clone, Debug, PartialEq)]
pub struct HandoffRow {
    /// Bytes per chunk.
    pub bytes: usize,
    /// Microseconds per chunk through the network link.
    pub network_us: f64,
    /// Microseconds per chunk handed over by a stored word (no thread, no wire).
    pub local_us: f64,
}

const SLOTS: u32 = 2;

fn page(context: &Arc<CudaContext>) -> nodetour_ring::Result<Arc<Flags>> {
    let f = Flags::create(context, words::WORDS)?;
    f.unlink()?;
    Ok(Arc::new(f))
}

fn region(len: usize, context: Option<&Arc<CudaContext>>) -> nodetour_ring::Result<SlotRegion> {
    let mut b = HostBuffer::new(len.max(4096))?;
    if let Some(c) = context {
        b.register_with_cuda(c)?;
    }
    Ok(SlotRegion::host(b))
}

/// One end: its pages and slots.
struct End {
    mine: Arc<Flags>,
    out_next: Arc<Flags>,
    out_prev: Arc<Flags>,
    send: SlotRegion,
    recv: SlotRegion,
    mailbox: SlotRegion,
}

impl End {
    fn new(context: &Arc<CudaContext>, slot_bytes: usize) -> nodetour_ring::Result<End> {
        let total = SLOTS as usize * slot_bytes;
        Ok(End {
            mine: page(context)?,
            out_next: page(context)?,
            out_prev: page(context)?,
            send: region(total, Some(context))?,
            recv: region(total, Some(context))?,
            mailbox: region(MAILBOX_BYTES, None)?,
        })
    }
}

/// Measures `sizes` (bytes per chunk), `iters` chunks each, on GPU `ordinal`.
pub fn handoff(
    ordinal: usize,
    sizes: &[usize],
    iters: usize,
) -> nodetour_ring::Result<Vec<HandoffRow>> {
    let context = nodetour_core::cuda::open_context(ordinal)?;
    let largest = sizes.iter().copied().max().unwrap_or(8).max(8);
    let spin = NetOptions::from_config(&nodetour_core::Config::from_env()?).spin;
    let (a, b) = (End::new(&context, largest)?, End::new(&context, largest)?);
    let token = JobToken::new(nodetour_core::random::bytes::<16>().to_vec());
    let (ca, cb) = loopback_pair(&token)?;
    let (mut ca, mut cb): (Box<dyn HostConnection>, Box<dyn HostConnection>) =
        (Box::new(ca), Box::new(cb));
    // Grants first (each end grants on its own connection), then the links take them.
    let ga = (ca.grant(&a.recv)?, ca.grant(&a.mailbox)?);
    let gb = (cb.grant(&b.recv)?, cb.grant(&b.mailbox)?);
    let start = |end: &End, conn, peer: (nodetour_core::transport::SlotGrant, _)| {
        let w = |f: &Arc<Flags>| -> Arc<dyn WordPage> { f.clone() };
        NetLink::start(NetLinkSetup {
            next: 1,
            prev: 1,
            to_next: Some(conn),
            to_prev: None,
            same_peer: true,
            send_slots: Some(end.send.clone()),
            recv_slots: Some(end.recv.clone()),
            next_recv: Some(peer.0),
            next_mailbox: Some(peer.1),
            prev_mailbox: Some(peer.1),
            mailbox_from_prev: Some(end.mailbox.clone()),
            mailbox_from_next: Some(end.mailbox.clone()),
            cells: region(MAILBOX_BYTES, None).expect("host memory for cells"),
            slots: SLOTS,
            slot_bytes: largest,
            mine: w(&end.mine),
            out_next: w(&end.out_next),
            out_prev: w(&end.out_prev),
            desc_cells: (words::DESC_BASE, SLOTS + 2),
            stop_word: words::STOPPED,
            options: NetOptions { spin },
            lander: None,
        })
    };
    let link_a = start(&a, ca, gb)?;
    let link_b = start(&b, cb, ga)?;
    let (sa, sb) = (GpuStream::new(&context)?, GpuStream::new(&context)?);
    let src = DeviceBuffer::new(&context, largest)?;
    let dst = DeviceBuffer::new(&context, largest)?;
    let (a_send, b_recv) = (
        LinkSlots::new(a.send.clone())?,
        LinkSlots::new(b.recv.clone())?,
    );
    let local_word = page(&context)?;
    let mut seq = 0u64;
    let mut local_seq = 0u32;
    let mut rows = Vec::new();
    for &bytes in sizes {
        let (mut net, mut local) = (Vec::new(), Vec::new());
        for i in 0..iters + 2 {
            // Network: A's stream → A's thread → tcp → B's thread → B's stream.
            let slot = (seq % u64::from(SLOTS)) as usize * largest;
            link_a.plan([bytes], []);
            link_b.plan([], [bytes]);
            let t0 = sa.record()?;
            a_send.enqueue_copy_in(&sa, &src, 0, slot, bytes)?;
            FlagPage::enqueue_set(&*a.out_next, &sa, words::READY, (seq + 1) as u32)?;
            FlagPage::enqueue_wait(&*b.mine, &sb, words::READY, (seq + 1) as u32)?;
            b_recv.enqueue_copy_out(&sb, &dst, 0, slot, bytes)?;
            FlagPage::enqueue_set(&*b.out_prev, &sb, words::RELEASED, (seq + 1) as u32)?;
            let t1 = sb.record()?;
            let ms = t0.elapsed_ms(&t1)?;
            seq += 1;
            // Local: the same copies, B's stream waiting for a word A's stream stores.
            local_seq += 1;
            let u0 = sa.record()?;
            a_send.enqueue_copy_in(&sa, &src, 0, 0, bytes)?;
            FlagPage::enqueue_set(&*local_word, &sa, words::READY, local_seq)?;
            FlagPage::enqueue_wait(&*local_word, &sb, words::READY, local_seq)?;
            b_recv.enqueue_copy_out(&sb, &dst, 0, 0, bytes)?;
            let u1 = sb.record()?;
            let local_ms = u0.elapsed_ms(&u1)?;
            // Until B's credit is back at A, the slot is not A's to refill.
            while WordPage::read(&*a.mine, words::RELEASED)? < seq as u32 {
                if let Some(e) = link_a.failure().or_else(|| link_b.failure()) {
                    return Err(e);
                }
                std::thread::sleep(Duration::from_micros(5));
            }
            if i >= 2 {
                net.push(f64::from(ms) * 1e3);
                local.push(f64::from(local_ms) * 1e3);
            }
        }
        rows.push(HandoffRow {
            bytes,
            network_us: median(net),
            local_us: median(local),
        });
    }
    drop((link_a, link_b));
    Ok(rows)
}
