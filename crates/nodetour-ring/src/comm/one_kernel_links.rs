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

use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::CudaContext;
use nodetour_core::Deadline;
use nodetour_core::cuda::one_kernel::ONE_SHOT_MAX_RANKS;
use nodetour_core::transport::gpu::StopWord;
use nodetour_core::transport::one_kernel::{OneKernel, OneKernelArena, OneKernelGrant};
use nodetour_core::transport::tcp::TcpEndpoint;
use nodetour_net::bootstrap::Bootstrap;

use super::gpu_links::OneKernelMode;
use crate::error::{Error, Result};

/// What forming the path gave: the connected path (if it is on) and why (for the log and
/// [`super::Paths`]).
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

/// Where this rank sits and what it may use (the GPU ring's seat, narrowed).
pub(crate) struct OneKernelSeat<'a> {
    pub job: &'a Bootstrap,
    pub endpoint: &'a TcpEndpoint,
    pub context: &'a Arc<CudaContext>,
    pub me: u32,
    pub world: u32,
    pub mode: OneKernelMode,
    pub max: usize,
    /// How long a kernel waits for a peer (the collective timeout).
    pub timeout: Duration,
    /// The ring's stop word, which the kernels poll.
    pub stop: StopWord,
    pub deadline: Deadline,
}

/// Forms the path (every rank of the job calls it, after the ring's links are up).
pub(crate) fn form(seat: OneKernelSeat<'_>) -> Result<OneKernelChoice> {
    let OneKernelSeat {
        job,
        endpoint,
        context,
        me,
        world,
        mode,
        max,
        timeout,
        stop,
        deadline,
    } = seat;
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
        _ => OneKernelArena::create(context, me, world, max).map_err(|e| e.to_string()),
    };
    let mine = Offer {
        mode: mode.code(),
        max: max as u64,
        grant: match &arena {
            Ok(a) => a.grant().map_err(|e| e.to_string()),
            Err(why) => Err(why.clone()),
        },
    };
    let others: Vec<u32> = (0..world).filter(|r| *r != me).collect();
    let alive = || job.check_present();
    let address = |p: u32| job.peers()[p as usize].address.clone();
    // The same bytes to every other rank, every other rank's back.
    let all_to_all = |bytes: Vec<u8>| {
        endpoint.exchange(
            &others,
            me,
            world,
            &address,
            &|_| bytes.clone(),
            &alive,
            deadline,
        )
    };
    let got = all_to_all(mine.encode())?;
    let mut offers = Vec::with_capacity(world as usize);
    for r in 0..world {
        offers.push(if r == me {
            Offer {
                mode: mine.mode,
                max: mine.max,
                grant: mine.grant.clone(),
            }
        } else {
            let b = got.get(&r).ok_or_else(|| Error::Protocol {
                rank: r,
                reason: "sent no one-kernel offer".into(),
            })?;
            Offer::decode(r, b)?
        });
    }
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
        return off(format!("one kernel per allreduce: off (rank {r}: {why})"));
    }
    let grants: Vec<OneKernelGrant> = offers
        .iter()
        .map(|o| *o.grant.as_ref().expect("checked above"))
        .collect();
    let shared = (0..grants.len()).find_map(|a| {
        (a + 1..grants.len())
            .find(|b| grants[*b].gpu == grants[a].gpu)
            .map(|b| (a, b))
    });
    if let (Some((a, b)), OneKernelMode::Auto) = (shared, mode) {
        return off(format!(
            "one kernel per allreduce: off (ranks {a} and {b} share a GPU: time-sliced \
             contexts take the stream-ordered ring)"
        ));
    }
    let mut kernel = arena
        .expect("every rank has a grant, this one too")
        .into_kernel(stop, timeout);
    let mapped = kernel.map_peers(&grants.iter().copied().map(Some).collect::<Vec<_>>());
    // Whether every rank mapped every peer: the path is on only if all did.
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
    let verdicts = match all_to_all(verdict.clone()) {
        Ok(v) => v,
        Err(e) => {
            kernel.close_imports();
            tracing::error!(
                error = %e,
                "one-kernel formation failed after the peers' mappings: its scratch is leaked"
            );
            std::mem::forget(kernel);
            return Err(e.into());
        }
    };
    let refused = std::iter::once((me, verdict.clone()))
        .chain(verdicts)
        .find(|(_, v)| v.first() != Some(&1));
    match refused {
        None => {
            let how = if shared.is_some() {
                "forced, on a shared GPU: for tests (waits last a context switch)"
            } else {
                "every rank's scratch mapped by every rank"
            };
            Ok(OneKernelChoice {
                kernel: Some(kernel),
                reason: format!(
                    "one kernel per allreduce up to {max} bytes ({how}; one-shot{}; {} blocks \
                     of {} threads)",
                    if world > 2 {
                        format!(
                            ", two-shot above {} KiB",
                            nodetour_core::cuda::one_kernel::TWO_SHOT_ABOVE >> 10
                        )
                    } else {
                        String::new()
                    },
                    nodetour_core::cuda::one_kernel::ONE_SHOT_BLOCKS,
                    nodetour_core::cuda::one_kernel::ONE_SHOT_THREADS,
                ),
            })
        }
        Some((r, v)) => {
            // Nobody uses the path: close this rank's mappings, wait until every rank has,
            // then free what this rank exported (dropping it; leaked if the barrier fails).
            kernel.close_imports();
            if let Err(e) = job.barrier(deadline) {
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
            off(format!(
                "one kernel per allreduce: off (rank {r} could not map its peers: {why})"
            ))
        }
    }
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
