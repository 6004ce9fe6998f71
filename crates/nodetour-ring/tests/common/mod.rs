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

/// Runs `world` copies of this test binary as the ranks of one job (each runs the ignored test
/// `child_test` with `child_env` set, the `NODETOUR_*` launch variables, a job token and
/// `NODETOUR_TIMEOUT_MS=timeout_ms`; `per_rank` adds to rank `r`'s command), and waits for all,
/// at most `limit` (then every rank is killed): panics naming a rank that failed.
pub fn run_rank_processes(
    child_test: &str,
    child_env: &str,
    world: u32,
    timeout_ms: u32,
    per_rank: impl Fn(u32, &mut std::process::Command),
    limit: std::time::Duration,
) {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let exe = std::env::current_exe().unwrap();
    let mut children: Vec<_> = (0..world)
        .map(|r| {
            let mut c = std::process::Command::new(&exe);
            c.args(["--exact", child_test, "--include-ignored", "--nocapture"])
                .env(child_env, "1")
                .env("NODETOUR_RANK", r.to_string())
                .env("NODETOUR_WORLD_SIZE", world.to_string())
                .env("NODETOUR_LOCAL_RANK", r.to_string())
                .env("NODETOUR_MASTER_ADDR", "127.0.0.1")
                .env("NODETOUR_PORT", port.to_string())
                .env("NODETOUR_JOB_TOKEN", format!("{child_test}-{port}"))
                .env("NODETOUR_TIMEOUT_MS", timeout_ms.to_string());
            per_rank(r, &mut c);
            c.spawn().unwrap()
        })
        .collect();
    let deadline = std::time::Instant::now() + limit;
    for r in 0..children.len() {
        let status = loop {
            if let Some(s) = children[r].try_wait().unwrap() {
                break s;
            }
            if std::time::Instant::now() > deadline {
                // Every rank goes (a rank left behind would hold the output open).
                for c in children.iter_mut() {
                    let _ = c.kill();
                    let _ = c.wait();
                }
                panic!("{world} ranks: rank {r} did not finish in {limit:?}");
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        };
        assert!(status.success(), "{world} ranks: rank {r} failed: {status}");
    }
}
