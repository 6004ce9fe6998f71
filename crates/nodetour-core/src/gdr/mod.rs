//! GPUDirect RDMA in one room: the registration ladder that lets the NIC reach GPU memory
//! (dma-buf, then nvidia-peermem, else staging through host memory, each refusal with its
//! reason: [`registration`]), what makes a landed chunk visible to the GPU's readers
//! ([`visibility`]), and the flush by read that some GPUs need ([`read_flush`]). One floor
//! above verbs, CUDA and memory; the transports and the probe use it.

pub mod read_flush;
pub mod registration;
pub mod visibility;
