//! # nodetour-tools
//!
//! What the `nodetour` command, the examples and the benches share, kept out of the published
//! `nodetour` package so that a runtime linking nodetour compiles neither clap nor the
//! benchmark harness: the doctor, the perf sweeps (host, GPU, against NCCL and the copy
//! ceilings), plots, the write bandwidth and latency tools, the two-process verbs link, the GPU
//! ring job of the perf tool, the out-of-band channel (`oob`: two processes exchange endpoint
//! descriptions over authenticated TCP), logging set-up. Not published (`publish = false`); binaries use
//! `anyhow`, library code here too (it is tooling, not library API).
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod blob;
pub mod ceiling;
pub mod compute_load;
pub mod doctor;
pub mod gpu_job;
pub mod link;
pub mod logging;
pub mod nccl_ref;
pub mod oob;
pub mod perf;
pub mod perf_gpu;
pub mod perf_handoff;
pub mod perf_p2p;
pub mod plot;
pub mod write_bw;
pub mod write_lat;
