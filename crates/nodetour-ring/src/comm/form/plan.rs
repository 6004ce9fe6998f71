//! Formation's plan, pure: from every rank's announcement and host (what the bootstrap
//! carried) and this rank's own facts, the settings' agreement, the ring order, this rank's
//! neighbours, one host link per neighbour (kind, landing, reason: the transport table's
//! choice), whether the ring spins politely, and how GPU buffers will travel. No I/O, clocks
//! or CUDA: every rank computes the same choice for a link from the same announcements, and
//! the tests below run it on fixtures of hosts and ranks.

use nodetour_core::transport::TransportKind;
use nodetour_net::bootstrap::HostIdentity;

use super::super::links::Announcement;
use super::super::options::check_agreement;
use super::super::paths::{Direction, LinkPath};
use super::table::{self, Pair, Why};
use crate::error::{Error, Result};
use crate::order::{neighbours, ring_order};

/// What formation knows before it plans: every rank's announcement and host (indexed by
/// rank), and this rank's own facts.
pub(crate) struct Facts<'a> {
    /// This rank.
    pub me: u32,
    /// Every rank's announcement (this rank's too, at `me`).
    pub announced: &'a [Announcement],
    /// Every rank's host.
    pub hosts: &'a [&'a HostIdentity],
    /// Why this rank has no RDMA device (when it announced none).
    pub why_no_verbs: &'a str,
    /// `NODETOUR_TRANSPORT` on this rank (every rank's must match: the table checks).
    pub forced: Option<TransportKind>,
    /// Whether this rank passes GPU memory (it has a CUDA context for the GPU ring).
    pub gpu: bool,
    /// CPUs this process may run on.
    pub cpus: usize,
}

/// How collectives on GPU memory will travel, as planned (the GPU ring's own formation
/// chooses each in-host link's kind and the network link's landing).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum DevicePlan {
    /// This rank passes no GPU memory.
    None,
    /// Staged through the host ring: the transport table's reason.
    Staged(Why),
    /// A GPU ring whose links all join GPUs of one host.
    InHost,
    /// A GPU ring with network links: whether each neighbour's link stays in this host.
    Network {
        /// The link to the next rank stays in this host.
        next_local: bool,
        /// The link from the previous rank stays in this host.
        prev_local: bool,
    },
}

/// The plan of this rank's ring.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct RingPlan {
    /// This rank.
    pub me: u32,
    /// Ranks in the job.
    pub world: u32,
    /// The ring order (ranks of one host next to each other).
    pub order: Vec<u32>,
    /// The previous rank in the ring.
    pub prev: u32,
    /// The next rank in the ring.
    pub next: u32,
    /// One host link per neighbour (none for one rank; one for two ranks).
    pub links: Vec<LinkPath>,
    /// This rank's place among the ranks of its host (the local rank: how many ranks below it
    /// share its host), and how many ranks its host has.
    pub local: (u32, u32),
    /// Ranks on this host and this process's CPUs, where the ranks outnumber the CPUs: the
    /// ring then yields its CPU while it spins.
    pub oversubscribed: Option<(usize, usize)>,
    /// How GPU buffers travel.
    pub device: DevicePlan,
}

/// Which ranks each rank learns the address of (rank 0's bootstrap shares them): every other
/// rank. An address is where a rank's authenticated endpoint listens, no secret: connecting
/// needs the job token, and what only a peer may use (keys, queue pairs, handles, names) goes
/// to that peer alone over the pair's own authenticated connection. Every rank may need any
/// other's: the one-kernel path maps every rank of a host, and a point-to-point link forms
/// the first time two ranks meet.
pub(crate) fn address_book(world: usize) -> Vec<Vec<u32>> {
    let n = world as u32;
    (0..n)
        .map(|r| (0..n).filter(|p| *p != r).collect())
        .collect()
}

impl RingPlan {
    /// Plans this rank's ring from `facts`. A rank whose must-agree settings differ from this
    /// rank's fails it here, naming the setting and both values.
    pub(crate) fn new(facts: &Facts<'_>) -> Result<RingPlan> {
        let Facts {
            me,
            announced,
            hosts,
            ..
        } = *facts;
        let world = announced.len() as u32;
        let ours = announced
            .get(me as usize)
            .ok_or_else(|| Error::InvalidArgument {
                reason: format!("rank {me} of a job of {world}"),
            })?;
        for (rank, theirs) in announced.iter().enumerate() {
            check_agreement(&ours.settings, &theirs.settings, rank as u32)?;
        }
        let keys: Vec<&str> = hosts.iter().map(|h| h.boot_id.as_str()).collect();
        let order = ring_order(&keys);
        let (prev, next) = neighbours(&order, me).ok_or_else(|| Error::InvalidArgument {
            reason: format!("rank {me} is not in the ring order"),
        })?;
        let mut plan = RingPlan {
            me,
            world,
            order,
            prev,
            next,
            links: Vec::new(),
            local: (0, 1),
            oversubscribed: None,
            device: DevicePlan::None,
        };
        for peer in plan.linked() {
            let pair = plan.pair(facts, me, peer, facts.why_no_verbs);
            let (transport, landing, why) = table::host_link(&pair)?;
            let direction = match (next == prev, peer == next) {
                (true, _) => Direction::Both,
                (false, true) => Direction::Next,
                (false, false) => Direction::Prev,
            };
            plan.links.push(LinkPath {
                peer,
                direction,
                transport,
                landing,
                reason: why.to_string(),
            });
        }
        let here = |h: &&&HostIdentity| h.same_host(hosts[me as usize]);
        let local_ranks = hosts.iter().filter(here).count();
        let below = hosts[..me as usize].iter().filter(here).count();
        plan.local = (below as u32, local_ranks as u32);
        plan.oversubscribed = (local_ranks > facts.cpus).then_some((local_ranks, facts.cpus));
        plan.device = plan.device_plan(facts);
        Ok(plan)
    }

    /// The ranks this rank links with: none alone, one in a ring of two, else next and
    /// previous.
    pub(crate) fn linked(&self) -> Vec<u32> {
        match self.world {
            1 => vec![],
            _ if self.next == self.prev => vec![self.next],
            _ => vec![self.next, self.prev],
        }
    }

    /// The host link kind to `peer` (a neighbour).
    pub(crate) fn kind(&self, peer: u32) -> Option<TransportKind> {
        self.links
            .iter()
            .find(|l| l.peer == peer)
            .map(|l| l.transport)
    }

    /// The neighbours linked by `kind`.
    pub(crate) fn peers_over(&self, kind: TransportKind) -> Vec<u32> {
        self.linked()
            .into_iter()
            .filter(|p| self.kind(*p) == Some(kind))
            .collect()
    }

    /// This rank's position in the ring order (the schedule numbers ranks by it).
    pub(crate) fn position(&self) -> u32 {
        position(&self.order, self.me)
    }

    /// The link from `a` to `b` as the transport table sees it.
    fn pair<'a>(&self, facts: &Facts<'a>, a: u32, b: u32, why_no_verbs: &'a str) -> Pair<'a> {
        let hosts = facts.hosts;
        Pair {
            ours: (&facts.announced[a as usize], a),
            theirs: (&facts.announced[b as usize], b),
            same_host: hosts[a as usize].same_host(hosts[b as usize]),
            why_no_verbs,
        }
    }

    /// GPU buffers take a GPU ring when every link of the ring has a GPU row and no two ranks
    /// share a process, else the host ring (staged). Every rank decides from the same
    /// announcements, so all take the same branch.
    fn device_plan(&self, facts: &Facts<'_>) -> DevicePlan {
        if !facts.gpu {
            return DevicePlan::None;
        }
        let n = self.order.len();
        let ring: Vec<Pair<'_>> = (0..n)
            .filter(|_| self.world > 1)
            .map(|i| self.pair(facts, self.order[i], self.order[(i + 1) % n], ""))
            .collect();
        let mut processes: Vec<(&str, u32)> = facts
            .announced
            .iter()
            .zip(facts.hosts)
            .map(|(a, h)| (h.boot_id.as_str(), a.pid))
            .collect();
        processes.sort_unstable();
        processes.dedup();
        let pids_distinct = processes.len() == facts.announced.len();
        if let Err(why) = table::device_ring(&ring, facts.forced, pids_distinct) {
            return DevicePlan::Staged(why);
        }
        let network = |l: &Pair<'_>| table::network_link(l, facts.forced);
        if !ring.iter().any(network) {
            return DevicePlan::InHost;
        }
        let in_host = |a: u32, b: u32| {
            ring.iter()
                .find(|l| l.ours.1 == a && l.theirs.1 == b)
                .is_some_and(|l| !network(l))
        };
        DevicePlan::Network {
            next_local: in_host(self.me, self.next),
            prev_local: in_host(self.prev, self.me),
        }
    }
}

/// The ring position of `rank` in `order`.
pub(crate) fn position(order: &[u32], rank: u32) -> u32 {
    order.iter().position(|r| *r == rank).unwrap_or(0) as u32
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::Options;
    use crate::comm::paths::Landing;

    fn host(boot: &str) -> HostIdentity {
        HostIdentity {
            boot_id: boot.into(),
            net_ns: 1,
            ipc_ns: 1,
            mnt_ns: 1,
        }
    }

    fn rank(pid: u32, verbs: bool, gpu: bool) -> Announcement {
        Announcement {
            pid,
            ..Announcement::ours(
                None,
                verbs,
                gpu.then_some(0),
                Options::default().must_agree(),
            )
        }
    }

    fn plan(me: u32, announced: &[Announcement], hosts: &[HostIdentity], gpu: bool) -> RingPlan {
        let hosts: Vec<&HostIdentity> = hosts.iter().collect();
        RingPlan::new(&Facts {
            me,
            announced,
            hosts: &hosts,
            why_no_verbs: "no device",
            forced: None,
            gpu,
            cpus: 8,
        })
        .unwrap()
    }

    #[test]
    fn ranks_of_a_host_sit_together_and_links_follow_the_table() {
        // Ranks 0 and 2 on host a, 1 and 3 on host b: the order groups them.
        let hosts = [host("a"), host("b"), host("a"), host("b")];
        let ranks: Vec<Announcement> = (0..4).map(|r| rank(r + 10, r != 3, false)).collect();
        let p = plan(2, &ranks, &hosts, false);
        assert_eq!(p.order, [0, 2, 1, 3]);
        assert_eq!(p.local, (1, 2), "rank 2 is the second of host a's two");
        assert_eq!((p.prev, p.next), (0, 1));
        assert_eq!(p.position(), 1);
        assert_eq!(p.linked(), [1, 0]);
        assert_eq!(p.kind(1), Some(TransportKind::Verbs));
        assert_eq!(p.links[0].landing, Landing::RegisteredHost);
        assert_eq!(p.links[0].direction, Direction::Next);
        // Rank 1's next is rank 3, which has no RDMA device: tcp, saying so.
        let q = plan(1, &ranks, &hosts, false);
        assert_eq!(q.kind(3), Some(TransportKind::Tcp));
        let to_3 = q.links.iter().find(|l| l.peer == 3).unwrap();
        assert!(
            to_3.reason.contains("rank 3 has no RDMA device"),
            "{}",
            to_3.reason
        );
        assert_eq!(q.peers_over(TransportKind::Verbs), [2]);
        assert_eq!(p.device, DevicePlan::None);
    }

    #[test]
    fn both_ends_of_every_link_plan_the_same_kind() {
        let hosts = [host("a"), host("a"), host("b")];
        let ranks = [
            rank(1, true, false),
            rank(2, false, false),
            rank(3, true, false),
        ];
        let plans: Vec<RingPlan> = (0..3).map(|r| plan(r, &ranks, &hosts, false)).collect();
        for p in &plans {
            let theirs = &plans[p.next as usize];
            assert_eq!(p.kind(p.next), theirs.kind(p.me), "{p:?}");
        }
    }

    #[test]
    fn one_and_two_ranks() {
        let one = plan(0, &[rank(1, true, true)], &[host("a")], true);
        assert!(one.linked().is_empty() && one.links.is_empty());
        let two = plan(
            1,
            &[rank(1, false, true), rank(2, false, true)],
            &[host("a"), host("a")],
            true,
        );
        assert_eq!(two.linked(), [0]);
        assert_eq!(two.links[0].direction, Direction::Both);
        assert_eq!(two.device, DevicePlan::InHost);
    }

    #[test]
    fn gpu_buffers_take_a_gpu_ring_or_are_staged_with_the_reason() {
        let gpus: Vec<Announcement> = (0..4).map(|r| rank(r + 1, false, true)).collect();
        let two_hosts = [host("a"), host("a"), host("b"), host("b")];
        // Rank 1: next is rank 2 on host b (network), previous rank 0 on host a.
        assert_eq!(
            plan(1, &gpus, &two_hosts, true).device,
            DevicePlan::Network {
                next_local: false,
                prev_local: true
            }
        );
        // Ranks sharing a process: staged, with the table's reason.
        let mut shared = gpus.clone();
        shared[1].pid = shared[0].pid;
        let staged = plan(
            0,
            &shared,
            &[host("a"), host("a"), host("a"), host("a")],
            true,
        )
        .device;
        assert_eq!(
            staged,
            DevicePlan::Staged(Why::OneProcess { me: 0, peer: 1 })
        );
        // A rank that passes host memory: staged, naming it.
        let mut host_only = gpus.clone();
        host_only[3] = rank(4, false, false);
        let staged = plan(0, &host_only, &two_hosts, true).device;
        assert_eq!(staged, DevicePlan::Staged(Why::HostMemoryOnly { rank: 3 }));
        assert!(
            Why::HostMemoryOnly { rank: 3 }
                .to_string()
                .contains("rank 3 passes host memory only")
        );
    }

    #[test]
    fn a_rank_with_another_setting_fails_the_plan_naming_it() {
        let mut ranks = [rank(1, false, false), rank(2, false, false)];
        ranks[1].settings[0] += 1;
        let hosts = [host("a"), host("a")];
        let hosts: Vec<&HostIdentity> = hosts.iter().collect();
        let e = RingPlan::new(&Facts {
            me: 0,
            announced: &ranks,
            hosts: &hosts,
            why_no_verbs: "",
            forced: None,
            gpu: false,
            cpus: 8,
        })
        .unwrap_err();
        assert!(matches!(e, Error::SettingDiffers { peer: 1, .. }), "{e}");
    }

    #[test]
    fn oversubscription_and_the_address_book() {
        let hosts = [host("a"), host("a"), host("a")];
        let ranks = [
            rank(1, false, true),
            rank(2, false, true),
            rank(3, false, true),
        ];
        let refs: Vec<&HostIdentity> = hosts.iter().collect();
        let p = RingPlan::new(&Facts {
            me: 0,
            announced: &ranks,
            hosts: &refs,
            why_no_verbs: "",
            forced: None,
            gpu: true,
            cpus: 2,
        })
        .unwrap();
        assert_eq!(p.oversubscribed, Some((3, 2)));
        // Every rank learns every other's address (point-to-point links to any peer).
        assert_eq!(address_book(3), [vec![1, 2], vec![0, 2], vec![0, 1]]);
        assert_eq!(address_book(1), [Vec::<u32>::new()]);
    }
}
