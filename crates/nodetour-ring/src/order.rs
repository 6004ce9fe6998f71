//! The order ranks sit in the ring: ranks of one host next to each other, so that each pair of
//! hosts is crossed once per step (the network carries one stream per host, the in-host links
//! the rest). Pure: the input is each rank's host key (its boot id).

/// The ring order for ranks whose host keys are `hosts[rank]`: hosts in the order of their lowest
/// rank, and within a host, ranks ascending.
pub fn ring_order<K: PartialEq>(hosts: &[K]) -> Vec<u32> {
    let mut order = Vec::with_capacity(hosts.len());
    let mut placed = vec![false; hosts.len()];
    for first in 0..hosts.len() {
        if placed[first] {
            continue;
        }
        for (r, key) in hosts.iter().enumerate().skip(first) {
            if !placed[r] && *key == hosts[first] {
                placed[r] = true;
                order.push(r as u32);
            }
        }
    }
    order
}

/// This rank's neighbours in `order`: (previous, next).
pub fn neighbours(order: &[u32], rank: u32) -> Option<(u32, u32)> {
    let n = order.len();
    let at = order.iter().position(|r| *r == rank)?;
    Some((order[(at + n - 1) % n], order[(at + 1) % n]))
}

/// How many ring edges cross between hosts (what the order minimises).
pub fn host_crossings<K: PartialEq>(hosts: &[K], order: &[u32]) -> usize {
    let n = order.len();
    if n < 2 {
        return 0;
    }
    (0..n)
        .filter(|i| hosts[order[*i] as usize] != hosts[order[(i + 1) % n] as usize])
        .count()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn interleaved_hosts_are_grouped() {
        let hosts = ["A", "B", "A", "B"];
        let order = ring_order(&hosts);
        assert_eq!(order, [0, 2, 1, 3]);
        assert_eq!(host_crossings(&hosts, &order), 2);
        assert_eq!(
            host_crossings(&hosts, &[0, 1, 2, 3]),
            4,
            "rank order would cross every step"
        );
        assert_eq!(neighbours(&order, 2), Some((0, 1)));
        assert_eq!(neighbours(&order, 3), Some((1, 0)));
        assert_eq!(neighbours(&order, 9), None);
        assert_eq!(ring_order::<u8>(&[]), Vec::<u32>::new());
    }

    proptest! {
        #[test]
        fn every_host_is_entered_once(hosts in proptest::collection::vec(0u8..5, 1..40)) {
            let order = ring_order(&hosts);
            let mut sorted = order.clone();
            sorted.sort();
            prop_assert_eq!(sorted, (0..hosts.len() as u32).collect::<Vec<_>>());
            let distinct = { let mut d = hosts.clone(); d.sort(); d.dedup(); d.len() };
            let want = if distinct == 1 { 0 } else { distinct };
            prop_assert_eq!(host_crossings(&hosts, &order), want);
        }
    }
}
