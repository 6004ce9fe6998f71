//! Length-prefixed fields in a rank's bootstrap blob (what a rank announces to the others).

use anyhow::Context as _;
use nodetour_core::{Config, Deadline};
use nodetour_net::bootstrap::{Bootstrap, HostIdentity, LaunchInfo, PeerEntry};

/// Joins the job of `info` (token from the environment, deadline from `config`), announcing
/// this host, `address` (empty where ranks meet only through shared memory) and `blob`.
pub fn rendezvous(
    info: &LaunchInfo,
    config: &Config,
    address: String,
    blob: Vec<u8>,
) -> anyhow::Result<Bootstrap> {
    let entry = PeerEntry {
        rank: info.rank,
        host: HostIdentity::current(),
        address,
        blob,
    };
    let token = nodetour_net::bootstrap::job_token(info)?;
    let deadline = Deadline::after(config.timeout);
    Ok(Bootstrap::rendezvous(
        &info.rendezvous_addr(),
        info.rank,
        info.world_size,
        entry,
        &token,
        deadline,
    )?)
}

/// Appends `field` (a 4-byte big-endian length, then the bytes).
pub fn put(blob: &mut Vec<u8>, field: &[u8]) {
    blob.extend_from_slice(&(field.len() as u32).to_be_bytes());
    blob.extend_from_slice(field);
}

/// The field at `*at`, advancing `*at` past it; a short blob is an error.
pub fn take<'a>(blob: &'a [u8], at: &mut usize) -> anyhow::Result<&'a [u8]> {
    let len = blob.get(*at..*at + 4).context("short blob")?;
    let n = u32::from_be_bytes(len.try_into()?) as usize;
    let field = blob
        .get(*at + 4..(*at + 4).saturating_add(n))
        .context("short blob")?;
    *at += 4 + n;
    Ok(field)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_round_trip_and_short_blobs_fail() {
        let mut b = Vec::new();
        put(&mut b, b"abc");
        put(&mut b, b"");
        let mut at = 0;
        assert_eq!(take(&b, &mut at).unwrap(), b"abc");
        assert_eq!(take(&b, &mut at).unwrap(), b"");
        assert!(take(&b, &mut at).is_err());
        assert!(take(&[0, 0, 0, 9, 1], &mut 0).is_err());
        assert!(take(&[0xff, 0xff, 0xff, 0xff], &mut 0).is_err());
    }
}
