//! Helpers shared by the ring's integration tests.
#![allow(dead_code)] // each test binary uses its own subset

/// A small deterministic generator (xorshift), seeded per case.
pub(crate) struct Rng(pub u64);

impl Rng {
    /// The next value.
    pub(crate) fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// A value below `n`.
    pub(crate) fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// Every GPU of this machine, or `None` after printing `SKIP <reason>` (a failure instead when
/// `NODETOUR_REQUIRE_GPU=1`: on the GPU machines a missing GPU must not pass as a skip).
pub(crate) fn gpus() -> Option<Vec<std::sync::Arc<cudarc::driver::CudaContext>>> {
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
pub(crate) fn run_rank_processes(
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

/// What every rank must hold after an allreduce of `op` over `world` ranks whose inputs are
/// `input(rank)`: the fold in rank order by the host reducer (then divided for `Avg`).
pub(crate) fn fold_inputs(
    dtype: nodetour_ring::DataType,
    op: nodetour_ring::ReduceOp,
    world: u32,
    input: impl Fn(u32) -> Vec<u8>,
) -> Vec<u8> {
    let mut acc = input(0);
    for r in 1..world {
        nodetour_ring::reduce::reduce_into(dtype, op, &mut acc, &input(r)).unwrap();
    }
    if op == nodetour_ring::ReduceOp::Avg {
        nodetour_ring::reduce::finish_avg(dtype, &mut acc, world).unwrap();
    }
    acc
}

/// Panics naming rank `rank`, `what` and the first byte where `got` differs from `want`.
pub(crate) fn check_bytes(what: &str, rank: u32, got: &[u8], want: &[u8]) {
    assert_eq!(got.len(), want.len(), "rank {rank}: {what}: lengths");
    if let Some(i) = got.iter().zip(want).position(|(a, b)| a != b) {
        panic!(
            "rank {rank}: {what}: byte {i} is {:#04x}, want {:#04x}",
            got[i], want[i]
        );
    }
}

/// Rank `rank`'s input for case `seed`: `count` values of `dtype`, each `value(rng)` (rounded
/// for the integer types; u8 takes any byte), from a generator seeded by case and rank.
pub(crate) fn typed_input(
    dtype: nodetour_ring::DataType,
    rank: u32,
    count: usize,
    seed: u64,
    value: impl Fn(&mut Rng) -> f64,
) -> Vec<u8> {
    use nodetour_ring::DataType;
    let mut rng =
        Rng((seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ ((u64::from(rank) + 1) << 32)) | 1);
    let mut out = Vec::with_capacity(count * dtype.size());
    for _ in 0..count {
        let v = value(&mut rng);
        match dtype {
            DataType::F32 => out.extend_from_slice(&(v as f32).to_le_bytes()),
            DataType::F64 => out.extend_from_slice(&v.to_le_bytes()),
            DataType::F16 => out.extend_from_slice(&half::f16::from_f64(v).to_le_bytes()),
            DataType::Bf16 => out.extend_from_slice(&half::bf16::from_f64(v).to_le_bytes()),
            DataType::I32 => out.extend_from_slice(&(v.round() as i32).to_le_bytes()),
            DataType::I64 => out.extend_from_slice(&(v.round() as i64).to_le_bytes()),
            DataType::U8 => out.push(rng.below(256) as u8),
            DataType::I8 => out.extend_from_slice(&(v.round() as i8).to_le_bytes()),
            DataType::I16 => out.extend_from_slice(&(v.round() as i16).to_le_bytes()),
            // Wrapping: a negative value is a large one.
            DataType::U32 => out.extend_from_slice(&((v.round() as i64) as u32).to_le_bytes()),
            DataType::U64 => out.extend_from_slice(&((v.round() as i64) as u64).to_le_bytes()),
            DataType::F8E4M3 => out.push(float8::F8E4M3::from_f64(v).to_bits()),
            DataType::F8E5M2 => out.push(float8::F8E5M2::from_f64(v).to_bits()),
            other => panic!("no test inputs for {other:?}"),
        }
    }
    out
}

/// Ends the test process if the guard lives past `limit`: a GPU test that hangs (a wait with
/// no deadline, in nodetour or in the driver) then fails with what every thread was blocked in
/// (its name, state, kernel wait channel and system call, from `/proc/self/task`) instead of
/// holding the tier until its timeout. Dropping the guard disarms it.
pub(crate) struct Watchdog(std::sync::mpsc::Sender<()>);

pub(crate) fn watchdog(limit: std::time::Duration, what: &'static str) -> Watchdog {
    let (disarm, armed) = std::sync::mpsc::channel::<()>();
    std::thread::Builder::new()
        .name("test-watchdog".into())
        .spawn(move || {
            if armed.recv_timeout(limit) != Err(std::sync::mpsc::RecvTimeoutError::Timeout) {
                return;
            }
            // Straight to the process's stderr: libtest's capture (which `eprintln!` goes
            // through) is lost when the process exits.
            use std::io::Write;
            let mut err = std::io::stderr().lock();
            let _ = writeln!(
                err,
                "WATCHDOG: {what} still running after {limit:?}; threads:"
            );
            for line in thread_states() {
                let _ = writeln!(err, "WATCHDOG:   {line}");
            }
            let _ = writeln!(err, "test {what} ... FAILED (hung)");
            std::process::exit(101);
        })
        .expect("spawning the watchdog");
    Watchdog(disarm)
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        let _ = self.0.send(());
    }
}

/// One line per thread of this process: tid, name, state, wait channel, system call.
fn thread_states() -> Vec<String> {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return vec!["(no /proc/self/task)".into()];
    };
    let read = |tid: &str, f: &str| {
        std::fs::read_to_string(format!("/proc/self/task/{tid}/{f}"))
            .map(|s| s.trim().to_owned())
            .unwrap_or_else(|e| format!("({e})"))
    };
    let mut lines: Vec<String> = tasks
        .flatten()
        .map(|t| {
            let tid = t.file_name().to_string_lossy().into_owned();
            let stat = read(&tid, "stat");
            // The state follows the parenthesised name.
            let state = stat
                .rsplit_once(") ")
                .and_then(|(_, rest)| rest.split(' ').next())
                .unwrap_or("?")
                .to_owned();
            let syscall = read(&tid, "syscall");
            let number = syscall.split(' ').next().unwrap_or("?");
            // x86_64 numbers of the calls a blocked thread is usually in.
            let call = match number {
                "0" => "read",
                "7" => "poll",
                "16" => "ioctl",
                "35" => "nanosleep",
                "202" => "futex",
                "230" => "clock_nanosleep",
                "232" => "epoll_wait",
                "281" => "epoll_pwait",
                other => other,
            };
            // The stack pointer is the second last field of `syscall` while the thread is in
            // a system call: the return addresses on its stack locate it in the test binary.
            let sp = syscall
                .split(' ')
                .rev()
                .nth(1)
                .and_then(|v| u64::from_str_radix(v.trim_start_matches("0x"), 16).ok());
            format!(
                "tid {tid} {:?} state {state} wchan {} syscall {call}{}",
                read(&tid, "comm"),
                read(&tid, "wchan"),
                sp.map(stack_scan).unwrap_or_default(),
            )
        })
        .collect();
    lines.sort();
    lines
}

/// The words of a blocked thread's stack (from `sp`, up to 2 MiB: the driver's frames can be
/// large) that point into the test executable's code, innermost first, each as ` exe+OFFSET`
/// (the file offset: symbolize it with the unstripped binary: `scripts/symbolize-watchdog.sh`);
/// libcuda's words as ` libcuda(NAMES)`, each run of them once, naming the exported functions
/// they fall in (`?` for internal ones): the driver call a thread is blocked in.
fn stack_scan(sp: u64) -> String {
    use std::io::{Read, Seek, SeekFrom};
    let Ok(maps) = std::fs::read_to_string("/proc/self/maps") else {
        return String::new();
    };
    let exe = std::fs::read_link("/proc/self/exe").unwrap_or_default();
    // (start, end, file offset, whose code), and the mapping holding `sp`.
    let mut code: Vec<(u64, u64, u64, &'static str)> = Vec::new();
    let mut stack_end = sp;
    for line in maps.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        let (Some(range), Some(perms), Some(off)) = (f.first(), f.get(1), f.get(2)) else {
            continue;
        };
        let Some((a, b)) = range.split_once('-') else {
            continue;
        };
        let (Ok(a), Ok(b), Ok(off)) = (
            u64::from_str_radix(a, 16),
            u64::from_str_radix(b, 16),
            u64::from_str_radix(off, 16),
        ) else {
            continue;
        };
        if (a..b).contains(&sp) {
            stack_end = b;
        }
        let path = f.get(5).copied().unwrap_or("");
        if perms.contains('x') {
            if std::path::Path::new(path) == exe {
                code.push((a, b, off, "exe"));
            } else if path.contains("libcuda") {
                code.push((a, b, off, "libcuda"));
            }
        }
    }
    let len = (stack_end.saturating_sub(sp)).min(2 << 20) as usize;
    let mut bytes = vec![0u8; len];
    let read = std::fs::File::open("/proc/self/mem").and_then(|mut m| {
        m.seek(SeekFrom::Start(sp))?;
        m.read_exact(&mut bytes)
    });
    if read.is_err() {
        return " (stack unreadable)".into();
    }
    let cuda_path = maps
        .lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .find(|p| p.contains("libcuda"))
        .map(str::to_owned);
    let cuda_symbols = cuda_path.as_deref().map(elf_symbols).unwrap_or_default();
    let mut out = String::new();
    let mut shown = 0;
    let mut cuda_run: Vec<String> = Vec::new();
    let flush = |run: &mut Vec<String>, out: &mut String| {
        if !run.is_empty() {
            out.push_str(&format!(" libcuda({})", run.join(",")));
            run.clear();
        }
    };
    for w in bytes.chunks_exact(8) {
        let v = u64::from_le_bytes(w.try_into().expect("8 bytes"));
        let Some(&(a, _, off, whose)) = code.iter().find(|(a, b, _, _)| (*a..*b).contains(&v))
        else {
            continue;
        };
        if whose == "libcuda" {
            let name = cuda_symbols.name_at(v - a + off).unwrap_or("?").to_owned();
            if cuda_run.last() != Some(&name) && cuda_run.len() < 16 {
                cuda_run.push(name);
            }
            continue;
        }
        flush(&mut cuda_run, &mut out);
        out.push_str(&format!(" exe+{:#x}", v - a + off));
        shown += 1;
        if shown == 48 {
            break;
        }
    }
    flush(&mut cuda_run, &mut out);
    out
}

/// A shared library's exported functions, by file offset (from its ELF `.dynsym` and program
/// headers; empty where the file cannot be read or parsed).
#[derive(Default)]
pub(crate) struct ElfSymbols(pub(crate) Vec<(u64, u64, String)>);

impl ElfSymbols {
    /// The exported function whose bytes hold file offset `off`.
    pub(crate) fn name_at(&self, off: u64) -> Option<&str> {
        let i = self.0.partition_point(|(start, _, _)| *start <= off);
        let (start, size, name) = self.0.get(i.checked_sub(1)?)?;
        (off < start + size.max(&1)).then_some(name.as_str())
    }
}

pub(crate) fn elf_symbols(path: &str) -> ElfSymbols {
    let Ok(f) = std::fs::read(path) else {
        return ElfSymbols::default();
    };
    let u16_at = |o: usize| {
        f.get(o..o + 2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]) as usize)
    };
    let u32_at = |o: usize| {
        f.get(o..o + 4)
            .map(|b| u32::from_le_bytes(b.try_into().unwrap()))
    };
    let u64_at = |o: usize| {
        f.get(o..o + 8)
            .map(|b| u64::from_le_bytes(b.try_into().unwrap()))
    };
    let parse = || -> Option<Vec<(u64, u64, String)>> {
        (f.get(..4)? == b"\x7fELF" && f[4] == 2).then_some(())?;
        // Loadable segments: virtual address -> file offset.
        let (phoff, phent, phnum) = (u64_at(0x20)? as usize, u16_at(0x36)?, u16_at(0x38)?);
        let mut loads = Vec::new();
        for i in 0..phnum {
            let h = phoff + i * phent;
            if u32_at(h)? == 1 {
                loads.push((u64_at(h + 8)?, u64_at(h + 0x10)?, u64_at(h + 0x28)?));
            }
        }
        let (shoff, shent, shnum) = (u64_at(0x28)? as usize, u16_at(0x3A)?, u16_at(0x3C)?);
        let mut out = Vec::new();
        for i in 0..shnum {
            let h = shoff + i * shent;
            if u32_at(h + 4)? != 11 {
                continue; // not SHT_DYNSYM
            }
            let (off, size) = (u64_at(h + 0x18)? as usize, u64_at(h + 0x20)? as usize);
            let strtab = shoff + u32_at(h + 0x28)? as usize * shent;
            let str_off = u64_at(strtab + 0x18)? as usize;
            for s in (off..off + size).step_by(24) {
                let (name, info) = (u32_at(s)? as usize, *f.get(s + 4)?);
                let (value, len) = (u64_at(s + 8)?, u64_at(s + 16)?);
                if info & 0xf != 2 || value == 0 {
                    continue; // not a defined function
                }
                let Some(&(p_off, p_vaddr, _)) = loads
                    .iter()
                    .find(|(_, va, memsz)| (*va..va + memsz).contains(&value))
                else {
                    continue;
                };
                let start = str_off + name;
                let end = start + f.get(start..)?.iter().position(|&c| c == 0)?;
                let name = String::from_utf8_lossy(&f[start..end]).into_owned();
                out.push((value - p_vaddr + p_off, len, name));
            }
        }
        out.sort();
        Some(out)
    };
    ElfSymbols(parse().unwrap_or_default())
}

/// The operations device collectives take: every one (a PreMulSum's rank passes
/// [`rank_op`]; check it against [`as_summed`] inputs).
pub(crate) fn device_ops() -> impl Iterator<Item = nodetour_ring::ReduceOp> {
    nodetour_ring::ReduceOp::ALL.into_iter()
}

/// What rank `rank` passes for `op`: a PreMulSum with its seeded scalar
/// (`nodetour_ring::seeded::scalar`: ±1, ±2, 1-3 for unsigned types, exact on the tests'
/// values), else `op`.
pub(crate) fn rank_op(
    op: nodetour_ring::ReduceOp,
    dtype: nodetour_ring::DataType,
    rank: usize,
) -> nodetour_ring::ReduceOp {
    nodetour_ring::seeded::rank_op(op, dtype, rank as u32)
}

/// The ranks' inputs as `op` sums them: for a PreMulSum each multiplied by its rank's scalar
/// ([`rank_op`]), as the host multiplies (`reduce::scale_into`); otherwise as they are. The
/// reference is these reduced with `op` (a PreMulSum sums).
pub(crate) fn as_summed(
    dtype: nodetour_ring::DataType,
    op: nodetour_ring::ReduceOp,
    inputs: &[Vec<u8>],
) -> Vec<Vec<u8>> {
    inputs
        .iter()
        .enumerate()
        .map(|(r, x)| summed_as(dtype, op, r, x.clone()))
        .collect()
}

/// Rank `rank`'s input `x` as `op` sums it (see [`as_summed`]).
pub(crate) fn summed_as(
    dtype: nodetour_ring::DataType,
    op: nodetour_ring::ReduceOp,
    rank: usize,
    x: Vec<u8>,
) -> Vec<u8> {
    match rank_op(op, dtype, rank).scalar() {
        Some(s) => {
            let mut out = vec![0u8; x.len()];
            nodetour_ring::reduce::scale_into(dtype, s, &mut out, &x).expect("a scalar");
            out
        }
        None => x,
    }
}
