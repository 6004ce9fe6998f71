//! The handshake that opens every authenticated connection (tcp links, the out-of-band
//! channel): the acceptor sends a nonce; the dialler answers with its rank, its proof over the
//! nonce (bound to the rank, the world size and the acceptor it means) and a nonce of its own;
//! the acceptor answers with its proof. Both then derive the connection's session keys. A
//! stranger learns nothing and gets [`ANSWER_WITHIN`] to answer.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use super::{Acceptor, JobToken, SessionKeys, nonce};
use crate::deadline::Deadline;
use crate::error::{Error, Result};

/// How long a connection may take to answer the challenge (a rank answers at once): what a
/// silent stranger costs one handshake, without holding up the others.
pub const ANSWER_WITHIN: Duration = Duration::from_secs(2);

/// The acceptor's side of the handshake on a new connection: challenge, check the dialler's
/// proof (made for this rank, `me`, and the rank it claims), answer with ours. Returns the
/// stream, the dialler's rank and the session keys.
pub fn accept(
    mut s: TcpStream,
    peer: &str,
    token: &JobToken,
    world_size: u32,
    me: Acceptor<'_>,
    deadline: Deadline,
) -> Result<(TcpStream, u32, SessionKeys)> {
    s.set_nonblocking(false).ok();
    let budget = deadline.remaining().min(ANSWER_WITHIN);
    let step = Deadline::after(budget);
    let io = |source| handshake_error(source, peer, budget);
    s.set_read_timeout(Some(step.remaining().max(Duration::from_millis(1))))
        .map_err(io)?;
    s.set_write_timeout(Some(step.remaining().max(Duration::from_millis(1))))
        .map_err(io)?;
    let challenge = nonce();
    s.write_all(&challenge).map_err(io)?;
    // The connector's rank, its proof over our nonce, and its own nonce for our proof.
    let mut answer = [0u8; 4 + 32 + 32];
    s.read_exact(&mut answer).map_err(io)?;
    let rank = u32::from_be_bytes(answer[..4].try_into().expect("4 bytes"));
    let proof: [u8; 32] = answer[4..36].try_into().expect("32 bytes");
    let theirs: [u8; 32] = answer[36..].try_into().expect("32 bytes");
    if !token.verify_client_to(&challenge, rank, world_size, me, &proof) {
        return Err(Error::Authenticate {
            peer: peer.to_owned(),
            reason: format!(
                "wrong job token, or a connection meant for another rank (claimed rank {rank})"
            ),
        });
    }
    s.write_all(&token.server_proof_to(&theirs, rank, world_size, me))
        .map_err(io)?;
    let keys = token.session(&challenge, &theirs, rank, world_size, true);
    Ok((s, rank, keys))
}

/// The dialler's side of the handshake on a connected stream: answer the challenge as rank
/// `my_rank` meaning acceptor `to`, check the acceptor's proof. Returns the session keys.
pub fn dial(
    s: &mut TcpStream,
    addr: &str,
    my_rank: u32,
    world_size: u32,
    token: &JobToken,
    to: Acceptor<'_>,
    deadline: Deadline,
) -> Result<SessionKeys> {
    let budget = deadline.remaining();
    let io = |source| handshake_error(source, addr, budget);
    s.set_read_timeout(Some(deadline.remaining().max(Duration::from_millis(1))))
        .map_err(io)?;
    let mut challenge = [0u8; 32];
    s.read_exact(&mut challenge).map_err(io)?;
    let ours = nonce();
    let mut answer = Vec::with_capacity(4 + 32 + 32);
    answer.extend_from_slice(&my_rank.to_be_bytes());
    answer.extend_from_slice(&token.client_proof_to(&challenge, my_rank, world_size, to));
    answer.extend_from_slice(&ours);
    s.write_all(&answer).map_err(io)?;
    // The acceptor proves the token too, over our nonce: a stranger that answers on the
    // address learns nothing and receives no frame.
    let mut proof = [0u8; 32];
    s.read_exact(&mut proof).map_err(|_| Error::Authenticate {
        peer: addr.to_owned(),
        reason: "the peer refused our job token, or is not the rank we meant (closed without \
                 its proof)"
            .into(),
    })?;
    if !token.verify_server_to(&ours, my_rank, world_size, to, &proof) {
        return Err(Error::Authenticate {
            peer: addr.to_owned(),
            reason: "the peer did not prove the job token as the rank we meant".into(),
        });
    }
    Ok(token.session(&challenge, &ours, my_rank, world_size, false))
}

/// A failed read or write of the tcp handshake with `peer`: a socket timeout (which the OS
/// reports as "Resource temporarily unavailable") is the handshake's deadline passing, said so.
pub(crate) fn handshake_error(source: std::io::Error, peer: &str, budget: Duration) -> Error {
    match source.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => Error::Timeout {
            what: format!("the tcp handshake with {peer} (the peer did not answer in time)"),
            after: budget,
        },
        _ => Error::Exchange {
            op: "authenticate",
            peer: peer.to_owned(),
            source,
        },
    }
}
