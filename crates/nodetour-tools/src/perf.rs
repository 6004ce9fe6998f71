//! `nodetour perf`: allreduce sweeps in the manner of NCCL's `all_reduce_perf`: for each size,
//! the time of one collective (median of the timed iterations after warm-ups, on rank 0), algbw
//! (bytes / time), busbw (algbw × 2(n−1)/n, comparable across ring sizes) and a correctness
//! check of the result against a float64 reference. This module runs the ring over host buffers
//! across processes (tcp or verbs); `--gpus` runs the GPUs of one process ([`crate::perf_gpu`]).

use std::time::Instant;

use anyhow::bail;
use nodetour_ring::{DataType, ReduceOp};
use serde_json::json;

use nodetour_ring::comm::{Communicator, Host, HostBytes};
use nodetour_ring::seeded::{input, verify};

/// One measured size.
#[derive(Clone, Debug, PartialEq)]
pub struct Row {
    /// Bytes per rank.
    pub bytes: usize,
    /// Elements.
    pub count: usize,
    /// Median time of one collective, seconds.
    pub seconds: f64,
    /// bytes / time, GB/s.
    pub algbw: f64,
    /// algbw × 2(n−1)/n, GB/s.
    pub busbw: f64,
    /// Whether the result matched the reference on this rank.
    pub correct: bool,
}

/// Parses `--sizes MIN:MAX` with K/M/G suffixes (powers of two).
pub fn parse_sizes(spec: &str, factor: usize) -> anyhow::Result<Vec<usize>> {
    let parse = |s: &str| -> anyhow::Result<usize> {
        let s = s.trim();
        let (num, mult) = match s.chars().last() {
            Some('K' | 'k') => (&s[..s.len() - 1], 1usize << 10),
            Some('M' | 'm') => (&s[..s.len() - 1], 1 << 20),
            Some('G' | 'g') => (&s[..s.len() - 1], 1 << 30),
            _ => (s, 1),
        };
        Ok(num
            .parse::<usize>()
            .map_err(|_| anyhow::anyhow!("bad size {s:?}"))?
            * mult)
    };
    let (lo, hi) = match spec.split_once(':') {
        Some((a, b)) => (parse(a)?, parse(b)?),
        None => (parse(spec)?, parse(spec)?),
    };
    if lo == 0 || hi < lo || factor < 2 {
        bail!("--sizes must be MIN:MAX with 0 < MIN <= MAX, and --factor at least 2");
    }
    let mut out = vec![];
    let mut s = lo;
    while s <= hi {
        out.push(s);
        s = s.saturating_mul(factor);
    }
    Ok(out)
}

/// Parses a data type name.
pub fn parse_dtype(s: &str) -> anyhow::Result<DataType> {
    Ok(match s {
        "f32" | "float" => DataType::F32,
        "f64" | "double" => DataType::F64,
        "f16" | "half" => DataType::F16,
        "bf16" => DataType::Bf16,
        "i32" | "int" => DataType::I32,
        "i64" => DataType::I64,
        "u8" | "uint8" => DataType::U8,
        "i8" | "int8" => DataType::I8,
        "u32" | "uint32" => DataType::U32,
        "u64" | "uint64" => DataType::U64,
        "i16" | "int16" => DataType::I16,
        "f8e4m3" | "e4m3" => DataType::F8E4M3,
        "f8e5m2" | "e5m2" => DataType::F8E5M2,
        _ => bail!(
            "unknown data type {s:?} ({})",
            DataType::ALL.map(DataType::name).join(", ")
        ),
    })
}

/// Parses an operation name.
pub fn parse_op(s: &str) -> anyhow::Result<ReduceOp> {
    Ok(match s {
        "sum" => ReduceOp::Sum,
        "prod" => ReduceOp::Prod,
        "min" => ReduceOp::Min,
        "max" => ReduceOp::Max,
        "avg" => ReduceOp::Avg,
        _ => bail!("unknown operation {s:?} (sum, prod, min, max, avg)"),
    })
}

/// The median of `v` (the upper one of an even count); `v` must not be empty.
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// `1048576` → `1 MiB` (exact binary units, else bytes).
pub fn human_size(b: usize) -> String {
    match b {
        b if b >= 1 << 30 && b % (1 << 30) == 0 => format!("{} GiB", b >> 30),
        b if b >= 1 << 20 && b % (1 << 20) == 0 => format!("{} MiB", b >> 20),
        b if b >= 1 << 10 && b % (1 << 10) == 0 => format!("{} KiB", b >> 10),
        b => format!("{b} B"),
    }
}

/// Every type × operation when `all` (host or `device` memory alike: `device` is kept for
/// callers that name it), else `few`.
pub fn cases(all: bool, device: bool, few: &[(DataType, ReduceOp)]) -> Vec<(DataType, ReduceOp)> {
    let _ = device;
    if all {
        DataType::ALL
            .iter()
            .flat_map(|t| ReduceOp::ALL.iter().map(move |o| (*t, *o)))
            .collect()
    } else {
        few.to_vec()
    }
}

/// Measures every size on `comm`.
pub fn sweep(
    comm: &Communicator,
    sizes: &[usize],
    dtype: DataType,
    op: ReduceOp,
    warmup: usize,
    iters: usize,
) -> anyhow::Result<Vec<Row>> {
    let es = dtype.size();
    let n = f64::from(comm.world());
    let mut rows = Vec::new();
    for (k, &size) in sizes.iter().enumerate() {
        if comm.rank() == 0 {
            progress(k, sizes.len(), &format!("{size} bytes"));
        }
        let count = size / es;
        let bytes = count * es;
        // The last iteration gets an input of its own: its check cannot pass on an earlier
        // iteration's answer.
        let seed = 2 * k as u64;
        let inputs = [seed, seed + 1].map(|s| input(dtype, op, comm.rank(), count, s));
        let last = warmup + iters.max(1) - 1;
        let mut data = inputs[0].clone();
        let mut times = Vec::with_capacity(iters);
        for i in 0..=last {
            data.copy_from_slice(&inputs[usize::from(i == last)]);
            let t = Instant::now();
            comm.all_reduce_in_place(&mut HostBytes::new_mut(&mut data, dtype)?, op, Host)?;
            if i >= warmup {
                times.push(t.elapsed().as_secs_f64());
            }
        }
        let seconds = median(times);
        let algbw = bytes as f64 / seconds / 1e9;
        let correct = verify(dtype, op, comm.world(), &data, seed + 1).is_ok();
        rows.push(Row {
            bytes,
            count,
            seconds,
            algbw,
            busbw: algbw * 2.0 * (n - 1.0) / n,
            correct,
        });
    }
    if comm.rank() == 0 {
        progress(sizes.len(), sizes.len(), "done");
    }
    Ok(rows)
}

/// The rows as text (the all_reduce_perf layout), CSV or JSON.
pub fn render(
    rows: &[Row],
    format: &str,
    world: u32,
    transport: &str,
    dtype: DataType,
    op: ReduceOp,
) -> String {
    match format {
        "json" => serde_json::to_string_pretty(&json!({
            "collective": "all_reduce", "ranks": world, "transport": transport, "path": "host",
            "dtype": format!("{dtype:?}").to_lowercase(), "op": format!("{op:?}").to_lowercase(),
            "rows": rows.iter().map(|r| json!({"bytes": r.bytes, "count": r.count, "time_us": r.seconds * 1e6,
                "algbw_GBps": r.algbw, "busbw_GBps": r.busbw, "correct": r.correct})).collect::<Vec<_>>(),
        }))
        .unwrap_or_default(),
        "csv" => {
            let mut s = "bytes,count,time_us,algbw_GBps,busbw_GBps,correct,path,transport\n".to_owned();
            for r in rows {
                s.push_str(&format!("{},{},{:.1},{:.4},{:.4},{},host,{transport}\n", r.bytes, r.count, r.seconds * 1e6, r.algbw, r.busbw, r.correct));
            }
            s
        }
        _ => {
            let mut s = format!("# nodetour perf: all_reduce, {world} ranks, {transport}, host buffers, {dtype:?} {op:?}\n");
            s.push_str(&format!("{:>12} {:>12} {:>12} {:>10} {:>10} {:>7}\n", "size(B)", "count", "time(us)", "algbw", "busbw", "check"));
            for r in rows {
                s.push_str(&format!(
                    "{:>12} {:>12} {:>12.1} {:>10.3} {:>10.3} {:>7}\n",
                    r.bytes,
                    r.count,
                    r.seconds * 1e6,
                    r.algbw,
                    r.busbw,
                    if r.correct { "ok" } else { "WRONG" }
                ));
            }
            s
        }
    }
}

/// A one-line progress report on stderr for long sweeps (only when stderr is a terminal; host
/// and GPU sweeps both use it).
pub fn progress(done: usize, total: usize, what: &str) {
    use std::io::IsTerminal as _;
    if std::io::stderr().is_terminal() {
        eprint!("\r[{done}/{total}] {what}\x1b[K");
        if done == total {
            eprintln!();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_like_all_reduce_perf() {
        assert_eq!(parse_sizes("8:64", 2).unwrap(), [8, 16, 32, 64]);
        assert_eq!(parse_sizes("1K:4K", 4).unwrap(), [1024, 4096]);
        assert_eq!(parse_sizes("1M", 2).unwrap(), [1 << 20]);
        assert!(
            parse_sizes("0:8", 2).is_err()
                && parse_sizes("8:4", 2).is_err()
                && parse_sizes("8:64", 1).is_err()
                && parse_sizes("x", 2).is_err()
        );
        assert_eq!(parse_dtype("bf16").unwrap(), DataType::Bf16);
        assert!(parse_dtype("f8").is_err());
        assert_eq!(parse_op("avg").unwrap(), ReduceOp::Avg);
    }
}
