//! What a rank sends each ring neighbour at formation, over the authenticated connection
//! between the two ([`super::tcp::TcpEndpoint::exchange`]) rather than through the bootstrap
//! that every rank hears: the grants that neighbour writes through, and the queue pair made for
//! it alone (verbs).

use super::SlotGrant;
use crate::error::{Error, Result};

/// One neighbour's setup, as sent (validated when decoded).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NeighbourSetup {
    /// The sender's receive slots (for its previous rank, which writes them).
    pub recv: Option<SlotGrant>,
    /// The sender's doorbell (for its next rank, which writes grants into it).
    pub bell: Option<SlotGrant>,
    /// The sender's queue pair for this neighbour, an encoded endpoint description (verbs).
    pub endpoint: Option<Vec<u8>>,
}

const HAS_RECV: u8 = 1;
const HAS_BELL: u8 = 2;

impl NeighbourSetup {
    /// Flags, the grants it holds, then the endpoint bytes (the rest).
    pub fn encode(&self) -> Vec<u8> {
        let flags =
            u8::from(self.recv.is_some()) * HAS_RECV + u8::from(self.bell.is_some()) * HAS_BELL;
        let mut b = vec![flags];
        for g in [&self.recv, &self.bell].into_iter().flatten() {
            b.extend_from_slice(&g.encode());
        }
        if let Some(e) = &self.endpoint {
            b.extend_from_slice(e);
        }
        b
    }

    /// Decodes what a neighbour sent: unknown flags, short grants and bad grants are refused.
    pub fn decode(b: &[u8]) -> Result<NeighbourSetup> {
        let bad = |reason: String| Error::Decode {
            what: "neighbour setup",
            reason,
        };
        let (&flags, mut rest) = b.split_first().ok_or_else(|| bad("empty".into()))?;
        if flags & !(HAS_RECV | HAS_BELL) != 0 {
            return Err(bad(format!("unknown flags {flags:#x}")));
        }
        let mut take = |on: bool| -> Result<Option<SlotGrant>> {
            if !on {
                return Ok(None);
            }
            let g = rest
                .get(..SlotGrant::ENCODED_LEN)
                .ok_or_else(|| bad(format!("{} bytes left for a grant", rest.len())))?;
            rest = &rest[SlotGrant::ENCODED_LEN..];
            SlotGrant::decode(g).map(Some)
        };
        let recv = take(flags & HAS_RECV != 0)?;
        let bell = take(flags & HAS_BELL != 0)?;
        let endpoint = (!rest.is_empty()).then(|| rest.to_vec());
        Ok(NeighbourSetup {
            recv,
            bell,
            endpoint,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_setup_decodes_only_what_it_says_it_holds() {
        let g = SlotGrant {
            key: 7,
            len: 4096,
            remote: None,
        };
        let both = NeighbourSetup {
            recv: Some(g),
            bell: Some(g),
            endpoint: Some(b"qp".to_vec()),
        };
        assert_eq!(NeighbourSetup::decode(&both.encode()).unwrap(), both);
        let bell_only = NeighbourSetup {
            recv: None,
            bell: Some(g),
            endpoint: None,
        };
        assert_eq!(
            NeighbourSetup::decode(&bell_only.encode()).unwrap(),
            bell_only
        );
        let long = both.encode();
        for bad in [&[][..], &[4u8][..], &[1u8, 0, 0][..], &long[..10]] {
            assert!(
                matches!(NeighbourSetup::decode(bad), Err(Error::Decode { .. })),
                "{bad:?}"
            );
        }
    }
}
