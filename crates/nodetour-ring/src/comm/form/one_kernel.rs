//! Formation of the one-kernel allreduce (`nodetour_core::cuda::one_kernel`) for a GPU ring
//! whose ranks all share one host: every rank's scratch and signal page go to every other rank
//! (not only the ring's neighbours), each rank maps them all, and the ranks agree on whether
//! the path is on before any collective can choose it.
//!
//! Two exchanges, every rank with every rank: the first carries each rank's mode, threshold
//! and grant (or why it has none); from it every rank decides alike whether to try (modes and
//! thresholds must match, every rank must have a grant, and — unless forced — no two ranks may
//! share a GPU: ranks sharing a GPU are time-sliced and take the stream-ordered ring). The
//! second carries whether each rank mapped every peer; the path is on only if all did, so a
//! peer that could not map is never waited for by the kernel of one that could.

use nodetour_core::cuda::one_kernel::ONE_SHOT_MAX_RANKS;
use nodetour_core::transport::gpu::StopWord;
use nodetour_core::transport::one_kernel::{OneKernel, OneKernelArena, OneKernelGrant};

use super::gpu::Seat;
use crate::comm::gpu_options::OneKernelMode;
use crate::error::{Error, Result};

/// What forming the path gave: the connected path (if it is on) and why (for the log and
/// [`crate::comm::Paths`]).
pub(crate) struct OneKernelChoice {
    pub kernel: Option<OneKernel>,
    pub reason: String,
}

/// One rank's first message: its mode, its threshold, and its grant or why it has none.
struct Offer {
    mode: u8,
    max: u64,
    grant: std::result::Result<OneKernelGrant, String>,
}

impl Offer {
    fn encode(&self) -> Vec<u8> {
        let mut b = vec![self.mode];
        b.extend_from_slice(&self.max.to_be_bytes());
        match &self.grant {
            Ok(g) => {
                b.push(1);
                b.extend_from_slice(&g.encode());
            }
            Err(why) => {
                b.push(0);
                b.extend_from_slice(&why.as_bytes()[..why.len().min(512)]);
            }
        }
        b
    }

    fn decode(rank: u32, b: &[u8]) -> Result<Offer> {
        let bad = |reason: String| Error::Protocol { rank, reason };
        if b.len() < 10 {
            return Err(bad(format!("a one-kernel offer of {} bytes", b.len())));
        }
        let max = u64::from_be_bytes(b[1..9].try_into().expect("8 bytes"));
        let grant = match b[9] {
            1 => Ok(OneKernelGrant::decode(&b[10..])
                .map_err(|e| bad(format!("its one-kernel grant: {e}")))?),
            0 => Err(String::from_utf8_lossy(&b[10..]).into_owned()),
            v => return Err(bad(format!("a one-kernel offer of kind {v}"))),
        };
        Ok(Offer {
            mode: b[0],
            max,
            grant,
        })
    }
}

/// Where this rank sits (the GPU ring's seat) and what the path is asked to be.
pub(crate) struct OneKernelSeat<'a> {
    pub seat: &'a Seat<'a>,
    pub mode: OneKernelMode,
    pub max: usize,
    /// The ring's stop word, which the kernels poll.
    pub stop: StopWord,
}

/// What every rank's offer decides, alike on every rank (pure).
enum Decision {
    /// The path is off, and why.
    Off(String),
    /// Map every rank's grant; `shared`: two ranks that share a GPU (forced only).
    Map {
        grants: Vec<OneKernelGrant>,
        shared: Option<(usize, usize)>,
    },
}

/// Decides from every rank's offer (indexed by rank): modes and thresholds must match
/// (else an error naming both), every rank must have a grant, and (unless forced) no two
/// ranks may share a GPU.
fn decide(offers: &[Offer], me: u32, mode: OneKernelMode) -> Result<Decision> {
    let mine = &offers[me as usize];
    if let Some((r, o)) = offers
        .iter()
        .enumerate()
        .find(|(_, o)| o.mode != mine.mode || o.max != mine.max)
    {
        return Err(Error::InvalidArgument {
            reason: format!(
                "the ranks disagree on the one-kernel path: rank {r} has mode {} and threshold \
                 {} bytes, rank {me} mode {} and {} (NODETOUR_ONE_KERNEL and \
                 NODETOUR_ONE_KERNEL_MAX must be the same on every rank)",
                o.mode, o.max, mine.mode, mine.max
            ),
        });
    }
    if let Some((r, why)) = offers
        .iter()
        .enumerate()
        .find_map(|(r, o)| o.grant.as_ref().err().map(|w| (r, w)))
    {
        if mode == OneKernelMode::Force {
            return Err(Error::Unsupported {
                reason: format!("NODETOUR_ONE_KERNEL=force, but rank {r} has no path: {why}"),
            });
        }
        return Ok(Decision::Off(format!(
            "one kernel per allreduce: off (rank {r}: {why})"
        )));
    }
    let grants: Vec<OneKernelGrant> = offers.iter().filter_map(|o| o.grant.clone().ok()).collect();
    let shared = (0..grants.len()).find_map(|a| {
        (a + 1..grants.len())
            .find(|b| grants[*b].gpu == grants[a].gpu)
            .map(|b| (a, b))
    });
    if let (Some((a, b)), OneKernelMode::Auto) = (shared, mode) {
        return Ok(Decision::Off(format!(
            "one kernel per allreduce: off (ranks {a} and {b} share a GPU: time-sliced \
             contexts take the stream-ordered ring)"
        )));
    }
    Ok(Decision::Map { grants, shared })
}

/// Exchange: the same bytes to every other rank, every other rank's back (indexed by rank).
fn all_to_all(
    seat: &OneKernelSeat<'_>,
    bytes: Vec<u8>,
) -> Result<std::collections::HashMap<u32, Vec<u8>>> {
    let (job, me, world) = (seat.seat.job, seat.seat.me, seat.seat.world);
    let others: Vec<u32> = (0..world).filter(|r| *r != me).collect();
    let alive = || job.check_present();
    let address = |p: u32| job.peers()[p as usize].address.clone();
    Ok(seat.seat.endpoint.exchange(
        &others,
        me,
        world,
        &address,
        &|_| bytes.clone(),
        &alive,
        seat.seat.deadline,
    )?)
}

/// Every rank's offer, this rank's `mine` among them.
fn offers(seat: &OneKernelSeat<'_>, mine: &Offer) -> Result<Vec<Offer>> {
    let got = all_to_all(seat, mine.encode())?;
    (0..seat.seat.world)
        .map(|r| {
            if r == seat.seat.me {
                return Ok(Offer {
                    mode: mine.mode,
                    max: mine.max,
                    grant: mine.grant.clone(),
                });
            }
            let b = got.get(&r).ok_or_else(|| Error::Protocol {
                rank: r,
                reason: "sent no one-kernel offer".into(),
            })?;
            Offer::decode(r, b)
        })
        .collect()
}

/// Forms the path (every rank of the job calls it, after the ring's links are up): offer,
/// decide, map every peer, then agree that every rank mapped every peer.
pub(crate) fn form(seat: OneKernelSeat<'_>) -> Result<OneKernelChoice> {
    let (me, world, mode, max) = (seat.seat.me, seat.seat.world, seat.mode, seat.max);
    let off = |reason: String| {
        Ok(OneKernelChoice {
            kernel: None,
            reason,
        })
    };
    // Decided alike on every rank from what every rank knows (the job's size).
    if world as usize > ONE_SHOT_MAX_RANKS {
        return off(format!(
            "one kernel per allreduce: off ({world} ranks; at most {ONE_SHOT_MAX_RANKS})"
        ));
    }
    let arena = match mode {
        OneKernelMode::Off => Err("off (NODETOUR_ONE_KERNEL=off, or the staged path)".to_owned()),
        _ => OneKernelArena::create(seat.seat.context, me, world, max).map_err(|e| e.to_string()),
    };
    let mine = Offer {
        mode: mode.code(),
        max: max as u64,
        grant: match &arena {
            Ok(a) => a.grant().map_err(|e| e.to_string()),
            Err(why) => Err(why.clone()),
        },
    };
    let (grants, shared) = match decide(&offers(&seat, &mine)?, me, mode)? {
        Decision::Off(reason) => return off(reason),
        Decision::Map { grants, shared } => (grants, shared),
    };
    let mut kernel = arena
        .expect("every rank has a grant, this one too")
        .into_kernel(seat.stop.clone(), seat.seat.timeout);
    let mapped = kernel.map_peers(&grants.iter().copied().map(Some).collect::<Vec<_>>());
    agree(&seat, kernel, mapped, shared)
}

/// Whether every rank mapped every peer: the path is on only if all did, so a peer that could
/// not map is never waited for by the kernel of one that could.
fn agree(
    seat: &OneKernelSeat<'_>,
    mut kernel: OneKernel,
    mapped: nodetour_core::Result<()>,
    shared: Option<(usize, usize)>,
) -> Result<OneKernelChoice> {
    let (me, mode) = (seat.seat.me, seat.mode);
    let verdict = match &mapped {
        Ok(_) => vec![1],
        Err(e) => {
            let why = e.to_string();
            let mut v = vec![0];
            v.extend_from_slice(&why.as_bytes()[..why.len().min(512)]);
            v
        }
    };
    // Past here peers may have mapped this rank's scratch: a failure leaks it (logged)
    // rather than free it under their mappings.
    let verdicts = match all_to_all(seat, verdict.clone()) {
        Ok(v) => v,
        Err(e) => {
            kernel.close_imports();
            tracing::error!(
                error = %e,
                "one-kernel formation failed after the peers' mappings: its scratch is leaked"
            );
            std::mem::forget(kernel);
            return Err(e);
        }
    };
    let refused = std::iter::once((me, verdict.clone()))
        .chain(verdicts)
        .find(|(_, v)| v.first() != Some(&1));
    let Some((r, v)) = refused else {
        return Ok(OneKernelChoice {
            kernel: Some(kernel),
            reason: on_reason(seat.max, seat.seat.world, shared.is_some()),
        });
    };
    // Nobody uses the path: close this rank's mappings, wait until every rank has, then free
    // what this rank exported (dropping it; leaked if the barrier fails).
    kernel.close_imports();
    if let Err(e) = seat.seat.job.barrier(seat.seat.deadline) {
        std::mem::forget(kernel);
        return Err(e.into());
    }
    drop(kernel);
    let why = String::from_utf8_lossy(v.get(1..).unwrap_or_default()).into_owned();
    if mode == OneKernelMode::Force {
        return Err(Error::Unsupported {
            reason: format!("NODETOUR_ONE_KERNEL=force, but rank {r} could not map: {why}"),
        });
    }
    Ok(OneKernelChoice {
        kernel: None,
        reason: format!("one kernel per allreduce: off (rank {r} could not map its peers: {why})"),
    })
}

/// Why the path is on.
fn on_reason(max: usize, world: u32, shared: bool) -> String {
    use nodetour_core::cuda::one_kernel::{ONE_SHOT_BLOCKS, ONE_SHOT_THREADS, TWO_SHOT_ABOVE};
    let how = if shared {
        "forced, on a shared GPU: for tests (waits last a context switch)"
    } else {
        "every rank's scratch mapped by every rank"
    };
    let two_shot = if world > 2 {
        format!(", two-shot above {} KiB", TWO_SHOT_ABOVE >> 10)
    } else {
        String::new()
    };
    format!(
        "one kernel per allreduce up to {max} bytes ({how}; one-shot{two_shot}; \
         {ONE_SHOT_BLOCKS} blocks of {ONE_SHOT_THREADS} threads)"
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use nodetour_core::transport::gpu::IpcGrant;

    fn grant() -> OneKernelGrant {
        let ipc = |b: u8| IpcGrant {
            handle: [b; 64],
            offset: 0,
            len: 4 << 20,
        };
        OneKernelGrant {
            scratch: ipc(1),
            signals: ipc(2),
            gpu: [0, 0x1b, 0],
        }
    }

    #[test]
    fn every_rank_decides_alike_from_the_offers() {
        let on_gpu = |gpu: u32| Offer {
            mode: OneKernelMode::Auto.code(),
            max: 1 << 20,
            grant: Ok(OneKernelGrant {
                gpu: [0, gpu, 0],
                ..grant()
            }),
        };
        // Every rank with a grant on its own GPU: map them all.
        let offers = [on_gpu(0x1b), on_gpu(0x2b), on_gpu(0x3b)];
        for me in 0..3 {
            let d = decide(&offers, me, OneKernelMode::Auto).unwrap();
            assert!(matches!(d, Decision::Map { ref grants, shared: None } if grants.len() == 3));
        }
        // Two ranks on one GPU: off under auto (naming them), mapped when forced.
        let shared = [on_gpu(0x1b), on_gpu(0x1b)];
        let d = decide(&shared, 0, OneKernelMode::Auto).unwrap();
        assert!(matches!(&d, Decision::Off(why) if why.contains("ranks 0 and 1 share a GPU")));
        let forced = [on_gpu(0x1b), on_gpu(0x1b)].map(|o| Offer {
            mode: OneKernelMode::Force.code(),
            ..o
        });
        let d = decide(&forced, 1, OneKernelMode::Force).unwrap();
        assert!(matches!(
            d,
            Decision::Map {
                shared: Some((0, 1)),
                ..
            }
        ));
        // A rank without a grant: off with its reason; an error when forced.
        let mut none = [on_gpu(0x1b), on_gpu(0x2b)];
        none[1].grant = Err("no peer access".into());
        let d = decide(&none, 0, OneKernelMode::Auto).unwrap();
        assert!(matches!(&d, Decision::Off(why) if why.contains("rank 1: no peer access")));
        let forced = none.map(|o| Offer {
            mode: OneKernelMode::Force.code(),
            ..o
        });
        assert!(matches!(
            decide(&forced, 0, OneKernelMode::Force),
            Err(Error::Unsupported { .. })
        ));
        // Another threshold on one rank: an error naming it, on every rank.
        let mut other = [on_gpu(0x1b), on_gpu(0x2b)];
        other[1].max = 4096;
        for me in 0..2 {
            let e = decide(&other, me, OneKernelMode::Auto).err().unwrap();
            assert!(e.to_string().contains("NODETOUR_ONE_KERNEL_MAX"), "{e}");
        }
    }

    #[test]
    fn offers_round_trip_and_bad_ones_are_protocol_errors() {
        for offer in [
            Offer {
                mode: 0,
                max: 1 << 20,
                grant: Ok(grant()),
            },
            Offer {
                mode: 1,
                max: 4096,
                grant: Err("off (NODETOUR_ONE_KERNEL=off, or the staged path)".into()),
            },
        ] {
            let back = Offer::decode(3, &offer.encode()).unwrap();
            assert_eq!((back.mode, back.max), (offer.mode, offer.max));
            assert_eq!(back.grant, offer.grant);
        }
        let good = Offer {
            mode: 0,
            max: 1,
            grant: Ok(grant()),
        }
        .encode();
        for bad in [&good[..5], &good[..good.len() - 1]] {
            assert!(matches!(
                Offer::decode(2, bad),
                Err(Error::Protocol { rank: 2, .. })
            ));
        }
        let mut kind = good.clone();
        kind[9] = 7;
        assert!(matches!(
            Offer::decode(2, &kind),
            Err(Error::Protocol { .. })
        ));
    }

    #[test]
    fn a_long_reason_is_cut_to_512_bytes() {
        let offer = Offer {
            mode: 0,
            max: 1,
            grant: Err("x".repeat(5000)),
        };
        assert_eq!(offer.encode().len(), 10 + 512);
    }
}
