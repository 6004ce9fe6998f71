//! Seeded inputs and the exact answer of their allreduce: what drills, checks and benchmarks
//! compare every `Ok` against.
//!
//! Every collective of a drill gets an input of its own, drawn from its index (`seed`) and the
//! rank, so an `Ok` computed from another collective's data (a stale slot, a replay that did
//! not run, a peer paired with the wrong collective) differs from the right answer in almost
//! every element instead of matching it bit for bit.
//!
//! The values keep every reduction exact in every type and order, for up to 15 ranks (8 for
//! E5M2): floats and signed integers are integers in [-8, 8] (products: ±1 or ±2, powers of
//! two; `i8` and `i16` products wrap, fp8 products saturate, as the reduction does), the
//! unsigned types are in [0, 15] (products: 1-3, `u8` wrapping), fp8 in {-1, 0, 1} (sums
//! stay exact: E4M3 holds every integer to 16, E5M2 to 8); an average is the exact sum
//! divided once, so only its last rounding is allowed for. A PreMulSum's rank passes the
//! scalar of [`rank_op`]: whole numbers that keep the sum exact (±1, ±2; ±1 for fp8; 1-3 for
//! the unsigned types), integer results wrapping as the reduction's do.

use float8::{F8E4M3, F8E5M2};
use half::{bf16, f16};

use crate::reduce::{DataType, ReduceOp};

/// One element of `rank`'s input to collective `seed`.
fn value(dtype: DataType, op: ReduceOp, rank: u32, i: usize, seed: u64) -> i64 {
    let h = mix(seed
        .wrapping_mul(0x9e37_79b9_7f4a_7c15)
        .wrapping_add(u64::from(rank).wrapping_mul(0xc2b2_ae3d_27d4_eb4f))
        .wrapping_add(i as u64));
    match (op, dtype) {
        (ReduceOp::Prod, d) if unsigned(d) => 1 + (h % 3) as i64,
        (ReduceOp::Prod, _) => [-2, -1, 1, 2][(h % 4) as usize],
        (_, d) if unsigned(d) => (h % 16) as i64,
        (_, DataType::F8E4M3 | DataType::F8E5M2) => (h % 3) as i64 - 1,
        _ => (h % 17) as i64 - 8,
    }
}

/// The scalar rank `rank` multiplies its input by in a seeded PreMulSum.
pub fn scalar(dtype: DataType, rank: u32) -> f64 {
    match dtype {
        d if unsigned(d) => f64::from(1 + rank % 3),
        DataType::F8E4M3 | DataType::F8E5M2 => [1.0, -1.0][(rank % 2) as usize],
        _ => [1.0, -1.0, 2.0, -2.0][(rank % 4) as usize],
    }
}

/// What rank `rank` passes for `op`: a PreMulSum with its seeded [`scalar`], else `op`.
pub fn rank_op(op: ReduceOp, dtype: DataType, rank: u32) -> ReduceOp {
    match op {
        ReduceOp::PreMulSum(_) => ReduceOp::pre_mul_sum(scalar(dtype, rank)),
        other => other,
    }
}

/// `v` wrapped into integer type `dtype` (as its sums and products wrap); others as they are.
fn wrap(dtype: DataType, v: i64) -> i64 {
    match dtype {
        DataType::U8 => i64::from(v as u8),
        DataType::I8 => i64::from(v as i8),
        DataType::I16 => i64::from(v as i16),
        DataType::U32 => i64::from(v as u32),
        DataType::I32 => i64::from(v as i32),
        _ => v,
    }
}

fn unsigned(dtype: DataType) -> bool {
    matches!(dtype, DataType::U8 | DataType::U32 | DataType::U64)
}

/// `v` (an integer these inputs reach, or an average) as one element of `dtype`.
fn encode(dtype: DataType, v: f64) -> Vec<u8> {
    match dtype {
        DataType::F32 => (v as f32).to_ne_bytes().to_vec(),
        DataType::F64 => v.to_ne_bytes().to_vec(),
        DataType::F16 => f16::from_f64(v).to_ne_bytes().to_vec(),
        DataType::Bf16 => bf16::from_f64(v).to_ne_bytes().to_vec(),
        DataType::I32 => (v as i32).to_ne_bytes().to_vec(),
        DataType::I64 => (v as i64).to_ne_bytes().to_vec(),
        DataType::U8 => vec![v as u8],
        DataType::I8 => (v as i8).to_ne_bytes().to_vec(),
        DataType::U32 => (v as u32).to_ne_bytes().to_vec(),
        DataType::U64 => (v as u64).to_ne_bytes().to_vec(),
        DataType::I16 => (v as i16).to_ne_bytes().to_vec(),
        DataType::F8E4M3 => vec![F8E4M3::from_f64(v).to_bits()],
        DataType::F8E5M2 => vec![F8E5M2::from_f64(v).to_bits()],
        other => unknown(other),
    }
}

/// splitmix64's finaliser: neighbouring seeds give unrelated values.
fn mix(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// `rank`'s input to collective `seed` of `op`: `count` elements of `dtype`, native-endian.
pub fn input(dtype: DataType, op: ReduceOp, rank: u32, count: usize, seed: u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(count * dtype.size());
    for i in 0..count {
        out.extend_from_slice(&encode(dtype, value(dtype, op, rank, i, seed) as f64));
    }
    out
}

/// Element `i` of the allreduce of collective `seed` over `world` ranks, as `f64` (exact for
/// every value these inputs reach).
pub fn expected(dtype: DataType, op: ReduceOp, world: u32, i: usize, seed: u64) -> f64 {
    let vals = (0..world).map(|r| value(dtype, op, r, i, seed));
    let folded: i64 = match op {
        ReduceOp::Sum | ReduceOp::Avg => vals.sum(),
        ReduceOp::Prod if dtype == DataType::U8 => {
            i64::from(vals.fold(1u8, |a, v| a.wrapping_mul(v as u8)))
        }
        ReduceOp::Prod => {
            let p: i64 = vals.product();
            match dtype {
                // Wrapping, as the reduction's products.
                DataType::I8 => i64::from(p as i8),
                DataType::I16 => i64::from(p as i16),
                // Saturating: a power of two past the largest finite value stops there in
                // every order (the partial products only grow).
                DataType::F8E4M3 => p.clamp(-448, 448),
                DataType::F8E5M2 => p.clamp(-57344, 57344),
                _ => p,
            }
        }
        ReduceOp::Min => vals.min().unwrap_or(0),
        ReduceOp::Max => vals.max().unwrap_or(0),
        ReduceOp::PreMulSum(_) => wrap(
            dtype,
            (0..world)
                .map(|r| scalar(dtype, r) as i64 * value(dtype, op, r, i, seed))
                .sum(),
        ),
        other => unknown(other),
    };
    match (op, dtype) {
        // Integer averages truncate toward zero, as the reduction's division does.
        (ReduceOp::Avg, d) if d.is_integer() => (folded / i64::from(world.max(1))) as f64,
        (ReduceOp::Avg, _) => folded as f64 / f64::from(world.max(1)),
        _ => folded as f64,
    }
}

fn decode(dtype: DataType, b: &[u8]) -> f64 {
    match dtype {
        DataType::F32 => f64::from(f32::from_ne_bytes(b.try_into().expect("4 bytes"))),
        DataType::F64 => f64::from_ne_bytes(b.try_into().expect("8 bytes")),
        DataType::F16 => f16::from_ne_bytes(b.try_into().expect("2 bytes")).to_f64(),
        DataType::Bf16 => bf16::from_ne_bytes(b.try_into().expect("2 bytes")).to_f64(),
        DataType::I32 => f64::from(i32::from_ne_bytes(b.try_into().expect("4 bytes"))),
        DataType::I64 => i64::from_ne_bytes(b.try_into().expect("8 bytes")) as f64,
        DataType::U8 => f64::from(b[0]),
        DataType::I8 => f64::from(b[0] as i8),
        DataType::U32 => f64::from(u32::from_ne_bytes(b.try_into().expect("4 bytes"))),
        DataType::U64 => u64::from_ne_bytes(b.try_into().expect("8 bytes")) as f64,
        DataType::I16 => f64::from(i16::from_ne_bytes(b.try_into().expect("2 bytes"))),
        DataType::F8E4M3 => F8E4M3::from_bits(b[0]).to_f64(),
        DataType::F8E5M2 => F8E5M2::from_bits(b[0]).to_f64(),
        other => unknown(other),
    }
}

/// A type or operation added to `nodetour_core::dtype` (non-exhaustive) that this reference
/// does not know yet: a drill cannot check it, so it stops.
fn unknown(what: impl std::fmt::Debug) -> ! {
    panic!("the seeded reference does not know {what:?}: teach seeded.rs before drilling it")
}

/// The rounding an average may carry (its one division); everything else is exact.
fn tolerance(dtype: DataType, op: ReduceOp) -> f64 {
    match (op, dtype) {
        (ReduceOp::Avg, DataType::F16) => 1e-3,
        (ReduceOp::Avg, DataType::Bf16) => 8e-3,
        (ReduceOp::Avg, DataType::F32) => 1e-7,
        (ReduceOp::Avg, DataType::F64) => 1e-15,
        (ReduceOp::Avg, DataType::F8E4M3) => 0.0625,
        (ReduceOp::Avg, DataType::F8E5M2) => 0.125,
        _ => 0.0,
    }
}

/// Whether `data` (whole elements of `dtype`) is the allreduce of collective `seed` over
/// `world` ranks; the first wrong element otherwise.
pub fn verify(
    dtype: DataType,
    op: ReduceOp,
    world: u32,
    data: &[u8],
    seed: u64,
) -> Result<(), String> {
    let es = dtype.size();
    for (i, b) in data.chunks_exact(es).enumerate() {
        let (got, want) = (decode(dtype, b), expected(dtype, op, world, i, seed));
        if (got - want).abs() > tolerance(dtype, op) * want.abs().max(1.0) {
            return Err(format!(
                "{dtype:?} {op:?} collective {seed}: element {i} is {got}, want {want}"
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reduce::reduce_into;

    /// The reference agrees with the library's own host reducer, in rank order and reversed.
    #[test]
    fn the_reference_is_the_host_reducers_answer_in_any_order() {
        for dtype in DataType::ALL {
            for op in ReduceOp::ALL {
                for world in [1u32, 2, 3, 8, 15] {
                    if dtype == DataType::F8E5M2 && world > 8 {
                        continue; // exact to 8 ranks (see the module's doc)
                    }
                    let count = 501;
                    let fold = |order: &mut dyn Iterator<Item = u32>| {
                        let mut acc: Option<Vec<u8>> = None;
                        for r in order {
                            let raw = input(dtype, op, r, count, 7);
                            let mut x = raw.clone();
                            crate::reduce::copy_scaled(dtype, rank_op(op, dtype, r), &mut x, &raw)
                                .unwrap();
                            match &mut acc {
                                None => acc = Some(x),
                                Some(a) => reduce_into(dtype, op, a, &x).unwrap(),
                            }
                        }
                        let mut a = acc.unwrap();
                        if op == ReduceOp::Avg {
                            crate::reduce::finish_avg(dtype, &mut a, world).unwrap();
                        }
                        a
                    };
                    for got in [fold(&mut (0..world)), fold(&mut (0..world).rev())] {
                        verify(dtype, op, world, &got, 7)
                            .unwrap_or_else(|e| panic!("{world} ranks: {e}"));
                    }
                }
            }
        }
    }

    /// Another collective's answer is wrong for this one: stale data cannot pass.
    #[test]
    fn another_collectives_answer_fails_the_check() {
        for dtype in DataType::ALL {
            for op in ReduceOp::ALL {
                let world = 3;
                let stale: Vec<u8> = (0..64)
                    .flat_map(|i| encode(dtype, expected(dtype, op, world, i, 4)))
                    .collect();
                assert!(
                    verify(dtype, op, world, &stale, 4).is_ok(),
                    "{dtype:?} {op:?}"
                );
                assert!(
                    verify(dtype, op, world, &stale, 5).is_err(),
                    "{dtype:?} {op:?}"
                );
            }
        }
    }
}
