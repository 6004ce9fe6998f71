//! Helpers shared by the ring's integration tests.
#![allow(dead_code)] // each test binary uses its own subset

/// A small deterministic generator (xorshift), seeded per case.
pub struct Rng(pub u64);

impl Rng {
    /// The next value.
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// A value below `n`.
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// Every GPU of this machine, or `None` after printing `SKIP <reason>` (a failure instead when
/// `NODETOUR_REQUIRE_GPU=1`: on the GPU machines a missing GPU must not pass as a skip).
pub fn gpus() -> Option<Vec<std::sync::Arc<cudarc::driver::CudaContext>>> {
    match nodetour_core::cuda::gpus() {
        Ok(g) if !g.is_empty() => Some(
            (0..g.len())
                .map(|i| cudarc::driver::CudaContext::new(i).unwrap())
                .collect(),
        ),
        other => {
            let why = other.err().map_or("no GPU".to_owned(), |e| e.to_string());
            assert!(
                std::env::var("NODETOUR_REQUIRE_GPU").as_deref() != Ok("1"),
                "NODETOUR_REQUIRE_GPU=1 but {why}"
            );
            println!("SKIP {why}");
            None
        }
    }
}
