//! # nodetour-net
//!
//! Everything a rank learns from its peers before any data moves, with no `unsafe` code: the
//! bootstrap ([`bootstrap`]): who each process is (torchrun, Slurm, Open MPI or explicit
//! values), the rendezvous at rank 0 guarded by the job token (bounded resources before a peer
//! proves it: a cap on concurrent handshakes, a deadline each, no large read), the table each
//! rank receives (only the addresses a sharing policy names for it), barriers and the liveness
//! mesh that reports a lost or departed rank to everyone. Its wire codec has a fuzz target
//! (`bootstrap_message`). The system calls it needs come from `nodetour-core` (`net`, `random`,
//! `auth`).
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod bootstrap;
