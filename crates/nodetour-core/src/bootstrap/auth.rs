//! Job-token challenge-response: each side proves it knows `NODETOUR_JOB_TOKEN` by an HMAC-SHA256
//! over a nonce the other side chose, before any address or key is shared. Proofs are compared
//! in constant time; the token itself never crosses the network.

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// A proof: HMAC-SHA256 output.
pub type Proof = [u8; 32];
/// A challenge nonce.
pub type Nonce = [u8; 32];

const CLIENT_LABEL: &[u8] = b"nodetour-bootstrap-v1 client";
const SERVER_LABEL: &[u8] = b"nodetour-bootstrap-v1 server";

/// The shared secret of a job.
#[derive(Clone)]
pub struct JobToken(Vec<u8>);

impl std::fmt::Debug for JobToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_empty() {
            "JobToken(none)"
        } else {
            "JobToken(<secret>)"
        })
    }
}

impl JobToken {
    /// A token from bytes.
    pub fn new(secret: impl Into<Vec<u8>>) -> Self {
        JobToken(secret.into())
    }

    /// `NODETOUR_JOB_TOKEN`, or the empty token (anyone who reaches the port can join: logged
    /// as a warning by the rendezvous).
    pub fn from_env() -> Self {
        JobToken(
            std::env::var("NODETOUR_JOB_TOKEN")
                .map(String::into_bytes)
                .unwrap_or_default(),
        )
    }

    /// Whether no secret is set.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    fn mac(&self, label: &[u8], nonce: &Nonce, rank: u32, world: u32) -> Hmac<Sha256> {
        let mut m =
            <Hmac<Sha256> as Mac>::new_from_slice(&self.0).expect("HMAC takes keys of any length");
        m.update(label);
        m.update(nonce);
        m.update(&rank.to_be_bytes());
        m.update(&world.to_be_bytes());
        m
    }

    /// A client's answer to the server's `nonce`, bound to the rank and world size it claims.
    pub fn client_proof(&self, nonce: &Nonce, rank: u32, world: u32) -> Proof {
        self.mac(CLIENT_LABEL, nonce, rank, world)
            .finalize()
            .into_bytes()
            .into()
    }

    /// Checks a client's proof in constant time.
    pub fn verify_client(&self, nonce: &Nonce, rank: u32, world: u32, proof: &Proof) -> bool {
        self.mac(CLIENT_LABEL, nonce, rank, world)
            .verify_slice(proof)
            .is_ok()
    }

    /// The server's answer to the client's `nonce`.
    pub fn server_proof(&self, nonce: &Nonce, rank: u32, world: u32) -> Proof {
        self.mac(SERVER_LABEL, nonce, rank, world)
            .finalize()
            .into_bytes()
            .into()
    }

    /// Checks the server's proof in constant time.
    pub fn verify_server(&self, nonce: &Nonce, rank: u32, world: u32, proof: &Proof) -> bool {
        self.mac(SERVER_LABEL, nonce, rank, world)
            .verify_slice(proof)
            .is_ok()
    }
}

/// 32 random bytes from the kernel (`getrandom(2)`).
pub fn nonce() -> Nonce {
    let mut n = [0u8; 32];
    let mut at = 0;
    while at < n.len() {
        // SAFETY: writes at most n.len() - at bytes into n[at..].
        let got = unsafe { libc::getrandom(n[at..].as_mut_ptr().cast(), n.len() - at, 0) };
        if got > 0 {
            at += got as usize;
        } else if std::io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
            panic!("getrandom failed: {}", std::io::Error::last_os_error());
        }
    }
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proofs_verify_only_with_the_same_token_nonce_rank_and_world() {
        let t = JobToken::new("s3cret");
        let n = nonce();
        let p = t.client_proof(&n, 3, 8);
        assert!(t.verify_client(&n, 3, 8, &p));
        assert!(!JobToken::new("wrong").verify_client(&n, 3, 8, &p));
        assert!(
            !t.verify_client(&nonce(), 3, 8, &p),
            "replayed against another nonce"
        );
        assert!(!t.verify_client(&n, 4, 8, &p), "bound to the claimed rank");
        assert!(
            !t.verify_client(&n, 3, 9, &p),
            "bound to the claimed world size"
        );
        assert!(
            !t.verify_server(&n, 3, 8, &p),
            "client and server proofs differ"
        );
        assert!(t.verify_server(&n, 3, 8, &t.server_proof(&n, 3, 8)));
    }

    #[test]
    fn nonces_differ_and_tokens_do_not_print() {
        assert_ne!(nonce(), nonce());
        assert_eq!(format!("{:?}", JobToken::new("x")), "JobToken(<secret>)");
        assert!(JobToken::new("").is_empty());
    }
}
