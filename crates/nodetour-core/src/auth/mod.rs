//! Job-token challenge-response: each side proves it knows `NODETOUR_JOB_TOKEN` by an HMAC-SHA256
//! over a nonce the other side chose, before any address or key is shared. Proofs are compared
//! in constant time; the token itself never crosses the network.
//!
//! After the handshake both sides derive session keys from the token and both nonces (one key
//! per direction, [`JobToken::session`]): the tcp transport tags every frame's header (and the
//! payload of control-sized frames: notifications, grants, descriptors) with them, numbered so
//! that a replayed, reordered or dropped frame fails too.

use hmac::{Hmac, Mac};
use sha2::Sha256;

pub mod handshake;

/// A proof: HMAC-SHA256 output.
pub type Proof = [u8; 32];
/// A challenge nonce.
pub type Nonce = [u8; 32];

const CLIENT_LABEL: &[u8] = b"nodetour-bootstrap-v1 client";
const SERVER_LABEL: &[u8] = b"nodetour-bootstrap-v1 server";

/// The shared secret of a job, or (for a job without one) the launcher's name for the job.
#[derive(Clone)]
pub struct JobToken {
    key: Vec<u8>,
    /// Where the job has no secret: the launcher's job identity the key is made from.
    unauthenticated: Option<String>,
}

impl std::fmt::Debug for JobToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.unauthenticated {
            Some(job) => write!(f, "JobToken(unauthenticated: {job})"),
            None if self.key.is_empty() => f.write_str("JobToken(none)"),
            None => f.write_str("JobToken(<secret>)"),
        }
    }
}

impl JobToken {
    /// A token from bytes.
    pub fn new(secret: impl Into<Vec<u8>>) -> Self {
        JobToken {
            key: secret.into(),
            unauthenticated: None,
        }
    }

    /// `NODETOUR_JOB_TOKEN`, or the empty token (anyone who reaches the port can join). The
    /// communicator and the tools apply the job policy instead
    /// (`nodetour_net::bootstrap::job_token`): a launcher's job identity, else an error.
    pub fn from_env() -> Self {
        JobToken::new(
            crate::knobs::Env::process()
                .get("NODETOUR_JOB_TOKEN")
                .map(String::into_bytes)
                .unwrap_or_default(),
        )
    }

    /// A job without a secret, named by its launcher (`job`: e.g. `slurm:1234.0`): every proof
    /// and tag is keyed by the name, so two jobs never cross, but anyone who knows the name
    /// can join. [`Self::is_authenticated`] says so.
    pub fn unauthenticated(job: &str) -> Self {
        let mut key = b"nodetour unauthenticated job: ".to_vec();
        key.extend_from_slice(job.as_bytes());
        JobToken {
            key,
            unauthenticated: Some(job.to_owned()),
        }
    }

    /// Whether no secret and no job identity is set.
    pub fn is_empty(&self) -> bool {
        self.key.is_empty()
    }

    /// Whether the job has a secret (not a launcher's job identity, not empty).
    pub fn is_authenticated(&self) -> bool {
        self.unauthenticated.is_none() && !self.key.is_empty()
    }

    /// In words, for the paths report: "authenticated (job token)", or why not.
    pub fn describe(&self) -> String {
        match &self.unauthenticated {
            None if !self.key.is_empty() => "authenticated (job token)".into(),
            None => "unauthenticated (no job token: anyone who reaches the ports can join)".into(),
            Some(job) => format!(
                "unauthenticated (no NODETOUR_JOB_TOKEN; keyed by the launcher's job id {job}, \
                 which keeps jobs apart but lets anyone who knows it join)"
            ),
        }
    }

    /// A 16-byte secret for another purpose of the same job (`label`), derived from this
    /// token: every rank computes it, nothing travels (the tools' further communicators).
    pub fn derive(&self, label: &[u8]) -> [u8; 16] {
        let mut m = <Hmac<Sha256> as Mac>::new_from_slice(&self.key)
            .expect("HMAC takes keys of any length");
        m.update(b"nodetour derived token: ");
        m.update(label);
        let full = m.finalize().into_bytes();
        let mut out = [0u8; 16];
        out.copy_from_slice(&full[..16]);
        out
    }

    fn mac(
        &self,
        label: &[u8],
        nonce: &Nonce,
        rank: u32,
        world: u32,
        to: Acceptor<'_>,
    ) -> Hmac<Sha256> {
        let mut m = <Hmac<Sha256> as Mac>::new_from_slice(&self.key)
            .expect("HMAC takes keys of any length");
        m.update(label);
        m.update(nonce);
        m.update(&rank.to_be_bytes());
        m.update(&world.to_be_bytes());
        m.update(&to.rank.to_be_bytes());
        m.update(&(to.address.len() as u64).to_be_bytes());
        m.update(to.address.as_bytes());
        m
    }

    /// A client's answer to the server's `nonce`, bound to the rank and world size it claims
    /// (the acceptor unnamed: the rendezvous).
    pub fn client_proof(&self, nonce: &Nonce, rank: u32, world: u32) -> Proof {
        self.client_proof_to(nonce, rank, world, Acceptor::ANY)
    }

    /// [`Self::client_proof`] bound also to the acceptor the client means to reach: a
    /// connection redirected to another rank of the job (which knows the token too) fails.
    pub fn client_proof_to(&self, nonce: &Nonce, rank: u32, world: u32, to: Acceptor<'_>) -> Proof {
        self.mac(CLIENT_LABEL, nonce, rank, world, to)
            .finalize()
            .into_bytes()
            .into()
    }

    /// Checks a client's proof in constant time.
    pub fn verify_client(&self, nonce: &Nonce, rank: u32, world: u32, proof: &Proof) -> bool {
        self.verify_client_to(nonce, rank, world, Acceptor::ANY, proof)
    }

    /// Checks a client's proof made for acceptor `to` (this side) in constant time.
    pub fn verify_client_to(
        &self,
        nonce: &Nonce,
        rank: u32,
        world: u32,
        to: Acceptor<'_>,
        proof: &Proof,
    ) -> bool {
        self.verify(CLIENT_LABEL, nonce, (rank, world), to, proof)
    }

    fn verify(
        &self,
        label: &[u8],
        nonce: &Nonce,
        (rank, world): (u32, u32),
        to: Acceptor<'_>,
        proof: &Proof,
    ) -> bool {
        self.mac(label, nonce, rank, world, to)
            .verify_slice(proof)
            .is_ok()
    }

    /// The server's answer to the client's `nonce`.
    pub fn server_proof(&self, nonce: &Nonce, rank: u32, world: u32) -> Proof {
        self.server_proof_to(nonce, rank, world, Acceptor::ANY)
    }

    /// The server's answer, naming itself (`me`): the client checks it reached whom it meant.
    pub fn server_proof_to(&self, nonce: &Nonce, rank: u32, world: u32, me: Acceptor<'_>) -> Proof {
        self.mac(SERVER_LABEL, nonce, rank, world, me)
            .finalize()
            .into_bytes()
            .into()
    }

    /// Checks the server's proof in constant time.
    pub fn verify_server(&self, nonce: &Nonce, rank: u32, world: u32, proof: &Proof) -> bool {
        self.verify_server_to(nonce, rank, world, Acceptor::ANY, proof)
    }

    /// Checks the server's proof, made as acceptor `to`, in constant time.
    pub fn verify_server_to(
        &self,
        nonce: &Nonce,
        rank: u32,
        world: u32,
        to: Acceptor<'_>,
        proof: &Proof,
    ) -> bool {
        self.verify(SERVER_LABEL, nonce, (rank, world), to, proof)
    }
}

/// The accepting side of an authenticated connection as the proofs name it: its rank and the
/// address it published (in the authenticated bootstrap table). Both proofs cover it, so a
/// dial meant for one rank that reaches another (an on-path redirect to a rank that holds the
/// token too) fails on both sides.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Acceptor<'a> {
    /// Its rank (`u32::MAX`: not named).
    pub rank: u32,
    /// The address it published (empty: not named).
    pub address: &'a str,
}

impl Acceptor<'static> {
    /// No acceptor named (the rendezvous, which ranks may reach by any name; point-to-point
    /// connections made without a table).
    pub const ANY: Acceptor<'static> = Acceptor {
        rank: u32::MAX,
        address: "",
    };
}

const SESSION_LABEL: &[u8] = b"nodetour-session-v1";
const TO_DIALER: &[u8] = b"acceptor to dialer";
const TO_ACCEPTOR: &[u8] = b"dialer to acceptor";

/// Bytes of a message tag (HMAC-SHA256, truncated).
pub const TAG_LEN: usize = 16;
/// A message tag.
pub type Tag = [u8; TAG_LEN];

/// One direction's key of a session, and the number of the next message in that direction
/// (covered by each tag, never sent).
#[derive(Clone)]
pub struct SessionKey {
    mac: Hmac<Sha256>,
    seq: u64,
}

impl SessionKey {
    fn new(key: &[u8]) -> SessionKey {
        SessionKey {
            mac: <Hmac<Sha256> as Mac>::new_from_slice(key).expect("HMAC takes keys of any length"),
            seq: 0,
        }
    }

    fn mac_of(&self, parts: &[&[u8]]) -> Hmac<Sha256> {
        let mut m = self.mac.clone();
        m.update(&self.seq.to_be_bytes());
        for p in parts {
            m.update(&(p.len() as u64).to_be_bytes());
            m.update(p);
        }
        m
    }

    /// The tag of the next message, made of `parts`; numbers it.
    pub fn seal(&mut self, parts: &[&[u8]]) -> Tag {
        let full = self.mac_of(parts).finalize().into_bytes();
        self.seq += 1;
        let mut t = [0u8; TAG_LEN];
        t.copy_from_slice(&full[..TAG_LEN]);
        t
    }

    /// Whether `tag` is the next message's tag for `parts` (compared in constant time); numbers
    /// it either way (a connection stops at the first bad tag).
    pub fn open(&mut self, parts: &[&[u8]], tag: &Tag) -> bool {
        let ok = self.mac_of(parts).verify_truncated_left(tag).is_ok();
        self.seq += 1;
        ok
    }
}

/// A connection's two session keys, from one side's point of view.
#[derive(Clone)]
pub struct SessionKeys {
    /// Tags what this side sends.
    pub send: SessionKey,
    /// Checks what this side receives.
    pub recv: SessionKey,
}

impl JobToken {
    /// The session keys of a connection whose acceptor chose `acceptor_nonce` and whose dialler
    /// (rank `dialer_rank` of `world`) chose `dialer_nonce`, for the acceptor's side or the
    /// dialler's: each side's `send` is the other's `recv`.
    pub fn session(
        &self,
        acceptor_nonce: &Nonce,
        dialer_nonce: &Nonce,
        dialer_rank: u32,
        world: u32,
        acceptor: bool,
    ) -> SessionKeys {
        let mut m = <Hmac<Sha256> as Mac>::new_from_slice(&self.key)
            .expect("HMAC takes keys of any length");
        m.update(SESSION_LABEL);
        m.update(acceptor_nonce);
        m.update(dialer_nonce);
        m.update(&dialer_rank.to_be_bytes());
        m.update(&world.to_be_bytes());
        let master = m.finalize().into_bytes();
        let direction = |label: &[u8]| {
            let mut d = <Hmac<Sha256> as Mac>::new_from_slice(&master).expect("any length");
            d.update(label);
            SessionKey::new(&d.finalize().into_bytes())
        };
        let (to_dialer, to_acceptor) = (direction(TO_DIALER), direction(TO_ACCEPTOR));
        if acceptor {
            SessionKeys {
                send: to_dialer,
                recv: to_acceptor,
            }
        } else {
            SessionKeys {
                send: to_acceptor,
                recv: to_dialer,
            }
        }
    }
}

/// 32 random bytes from the kernel (`getrandom(2)`).
pub fn nonce() -> Nonce {
    crate::random::bytes()
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
        // Bound to the acceptor meant: another rank, or another address, fails.
        let to = Acceptor {
            rank: 1,
            address: "10.0.0.1:4000",
        };
        let p = t.client_proof_to(&n, 3, 8, to);
        assert!(t.verify_client_to(&n, 3, 8, to, &p));
        assert!(!t.verify_client_to(&n, 3, 8, Acceptor { rank: 2, ..to }, &p));
        assert!(!t.verify_client_to(
            &n,
            3,
            8,
            Acceptor {
                address: "10.0.0.2:4000",
                ..to
            },
            &p
        ));
        assert!(
            !t.verify_client(&n, 3, 8, &p),
            "a bound proof is not an unbound one"
        );
        let p = t.server_proof_to(&n, 3, 8, to);
        assert!(t.verify_server_to(&n, 3, 8, to, &p));
        assert!(!t.verify_server_to(&n, 3, 8, Acceptor { rank: 0, ..to }, &p));
    }

    #[test]
    fn session_tags_check_token_nonces_direction_order_and_content() {
        let t = JobToken::new("s3cret");
        let (na, nd) = (nonce(), nonce());
        let mut acc = t.session(&na, &nd, 1, 2, true);
        let mut dia = t.session(&na, &nd, 1, 2, false);
        let first = dia.send.seal(&[b"header", b"payload"]);
        let second = dia.send.seal(&[b"header", b"payload"]);
        assert_ne!(first, second, "numbered: the same message tags differently");
        assert!(acc.recv.clone().open(&[b"header", b"payload"], &first));
        let mut replay = acc.recv.clone();
        assert!(replay.open(&[b"header", b"payload"], &first));
        assert!(
            !replay.open(&[b"header", b"payload"], &first),
            "a replay fails"
        );
        assert!(!acc.recv.clone().open(&[b"header", b"payloaD"], &first));
        assert!(
            !acc.recv.clone().open(&[b"headerp", b"ayload"], &first),
            "parts are framed"
        );
        assert!(
            !acc.recv.clone().open(&[b"header", b"payload"], &second),
            "order counts"
        );
        let back = acc.send.seal(&[b"x"]);
        assert!(dia.recv.clone().open(&[b"x"], &back));
        assert!(
            !acc.recv.clone().open(&[b"x"], &back),
            "directions have their own keys"
        );
        for other in [
            JobToken::new("wrong").session(&na, &nd, 1, 2, true),
            t.session(&nonce(), &nd, 1, 2, true),
            t.session(&na, &nonce(), 1, 2, true),
            t.session(&na, &nd, 0, 2, true),
        ] {
            let mut r = other.recv;
            assert!(!r.open(&[b"header", b"payload"], &first));
        }
    }

    #[test]
    fn nonces_differ_and_tokens_do_not_print() {
        assert_ne!(nonce(), nonce());
        assert_eq!(format!("{:?}", JobToken::new("x")), "JobToken(<secret>)");
        assert!(JobToken::new("").is_empty());
    }
}
