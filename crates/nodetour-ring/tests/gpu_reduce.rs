//! The GPU reduction kernels against the host reducer, bit for bit, for every data type and
//! operation, and the on-disk CUBIN cache. Needs a GPU: `#[ignore]`d elsewhere (counted as
//! skipped); run by `scripts/tiers/gpu-tier.sh` on the GPU machines (`NODETOUR_REQUIRE_GPU=1` makes a
//! missing GPU a failure).

use std::time::Instant;

use cudarc::driver::CudaContext;
use nodetour_core::cuda::GpuStream;
use nodetour_core::cuda::reduce::{At, ReduceKernels, Reduction};
use nodetour_core::memory::DeviceBuffer;
use nodetour_ring::reduce::{finish_avg, reduce_into};
use nodetour_ring::{DataType, ReduceOp};

mod common;

/// The first GPU, or `None` after `SKIP`.
fn gpu() -> Option<std::sync::Arc<CudaContext>> {
    common::gpus()?.into_iter().next()
}

/// Deterministic bytes that are valid, finite values of every type.
fn values(dtype: DataType, seed: u64, count: usize) -> Vec<u8> {
    let mut x = seed | 1;
    let mut out = Vec::with_capacity(count * dtype.size());
    for _ in 0..count {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let v = (x % 2001) as f64 / 100.0 - 10.0; // -10.00 .. 10.00
        match dtype {
            DataType::F32 => out.extend_from_slice(&(v as f32).to_ne_bytes()),
            DataType::F64 => out.extend_from_slice(&v.to_ne_bytes()),
            DataType::F16 => out.extend_from_slice(&half::f16::from_f64(v).to_ne_bytes()),
            DataType::Bf16 => out.extend_from_slice(&half::bf16::from_f64(v).to_ne_bytes()),
            DataType::I32 => out.extend_from_slice(&((x as i32) >> 3).to_ne_bytes()),
            DataType::I64 => out.extend_from_slice(&((x as i64) >> 5).to_ne_bytes()),
            DataType::U8 => out.push(x as u8),
            DataType::I8 => out.push((x >> 11) as u8),
            DataType::I16 => out.extend_from_slice(&((x as i16) >> 1).to_ne_bytes()),
            DataType::U32 => out.extend_from_slice(&((x >> 7) as u32).to_ne_bytes()),
            DataType::U64 => out.extend_from_slice(&x.to_ne_bytes()),
            // Any value in [-10, 10]: the kernels must round as the host does, bit for bit.
            DataType::F8E4M3 => out.push(float8::F8E4M3::from_f64(v).to_bits()),
            DataType::F8E5M2 => out.push(float8::F8E5M2::from_f64(v).to_bits()),
            other => panic!("no test inputs for {other:?}"),
        }
    }
    out
}

#[test]
#[ignore = "needs a GPU"]
fn the_kernels_match_the_host_reducer_bit_for_bit() {
    let Some(ctx) = gpu() else { return };
    let t = Instant::now();
    let kernels = ReduceKernels::load(&ctx).unwrap();
    println!(
        "kernels loaded in {:.1} ms (from cache: {}, {:?})",
        t.elapsed().as_secs_f64() * 1e3,
        kernels.from_cache,
        kernels.cache_path
    );
    let stream = GpuStream::new(&ctx).unwrap();
    let count = 100_003;
    let mut failures = Vec::new();
    for dtype in DataType::ALL {
        let bytes = count * dtype.size();
        let (a, b) = (values(dtype, 11, count), values(dtype, 29, count));
        let (da, db) = (
            DeviceBuffer::new(&ctx, bytes).unwrap(),
            DeviceBuffer::new(&ctx, bytes).unwrap(),
        );
        // A PreMulSum multiplies the destination (this rank's own values) as it reads it.
        for op in common::device_ops().map(|op| common::rank_op(op, dtype, 2)) {
            da.copy_from_host(0, &a).unwrap();
            db.copy_from_host(0, &b).unwrap();
            kernels
                .reduce(
                    &stream,
                    Reduction { dtype, op },
                    At::new(&da, 0),
                    At::new(&db, 0),
                    count,
                )
                .unwrap();
            if op == ReduceOp::Avg {
                kernels.average(&stream, dtype, &da, 0, count, 2).unwrap();
            }
            stream.synchronize().unwrap();
            let mut got = vec![0u8; bytes];
            da.copy_to_host(0, &mut got).unwrap();
            let mut want = common::summed_as(dtype, op, 2, a.clone());
            reduce_into(dtype, op, &mut want, &b).unwrap();
            if op == ReduceOp::Avg {
                finish_avg(dtype, &mut want, 2).unwrap();
            }
            if let Some(i) = (0..count).find(|&i| {
                let r = i * dtype.size()..(i + 1) * dtype.size();
                got[r.clone()] != want[r]
            }) {
                let r = i * dtype.size()..(i + 1) * dtype.size();
                failures.push(format!(
                    "{dtype:?} {op:?}: element {i}: inputs {:?} {:?}, GPU {:?}, host {:?}",
                    &a[r.clone()],
                    &b[r.clone()],
                    &got[r.clone()],
                    &want[r]
                ));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "GPU and host reducers differ:\n{}",
        failures.join("\n")
    );
    // A second load finds the cached CUBIN.
    let t = Instant::now();
    let again = ReduceKernels::load(&ctx).unwrap();
    println!(
        "second load {:.2} ms (from cache: {})",
        t.elapsed().as_secs_f64() * 1e3,
        again.from_cache
    );
    assert!(again.from_cache || again.cache_path.is_none());
}

/// PreMulSum's multiplication on the GPU (`ReduceKernels::scale`, the kernel the one-rank,
/// staged and `from_devices` paths use; the ring's and the one-kernel path's fuse the same
/// `nt_mul`) against the host's `scale_into`, bit for bit: every type, fractions (floats),
/// whole numbers, a scalar that overflows (saturating fp8, infinite f16), in place and not.
#[test]
#[ignore = "needs a GPU"]
fn the_premulsum_multiplication_matches_the_host_bit_for_bit() {
    let Some(ctx) = gpu() else { return };
    let kernels = ReduceKernels::load(&ctx).unwrap();
    let stream = GpuStream::new(&ctx).unwrap();
    let count = 70_001;
    let mut failures = Vec::new();
    for dtype in DataType::ALL {
        let integer = !matches!(
            dtype,
            DataType::F32
                | DataType::F64
                | DataType::F16
                | DataType::Bf16
                | DataType::F8E4M3
                | DataType::F8E5M2
        );
        let scalars: &[f64] = if integer {
            &[3.0, -2.0, 0.0, 1e10]
        } else {
            &[0.1, -3.0, 1.0 / 3.0, 1e10]
        };
        let bytes = count * dtype.size();
        let a = values(dtype, 7, count);
        let (src, dst) = (
            DeviceBuffer::new(&ctx, bytes).unwrap(),
            DeviceBuffer::new(&ctx, bytes).unwrap(),
        );
        for &scalar in scalars {
            let mut want = vec![0u8; bytes];
            nodetour_ring::reduce::scale_into(dtype, scalar, &mut want, &a).unwrap();
            for in_place in [false, true] {
                src.copy_from_host(0, &a).unwrap();
                let out = if in_place { &src } else { &dst };
                kernels
                    .scale(
                        &stream,
                        dtype,
                        scalar,
                        At::new(out, 0),
                        At::new(&src, 0),
                        count,
                    )
                    .unwrap();
                stream.synchronize().unwrap();
                let mut got = vec![0u8; bytes];
                out.copy_to_host(0, &mut got).unwrap();
                let size = dtype.size();
                if let Some(i) =
                    (0..count).find(|&i| got[i * size..][..size] != want[i * size..][..size])
                {
                    let r = i * size..(i + 1) * size;
                    failures.push(format!(
                        "{dtype:?} × {scalar} (in place: {in_place}): element {i}: input {:?}, \
                         GPU {:?}, host {:?}",
                        &a[r.clone()],
                        &got[r.clone()],
                        &want[r]
                    ));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
#[ignore = "needs a GPU"]
fn kernel_arguments_are_checked() {
    let Some(ctx) = gpu() else { return };
    let kernels = ReduceKernels::load(&ctx).unwrap();
    let stream = GpuStream::new(&ctx).unwrap();
    let d = DeviceBuffer::new(&ctx, 4096).unwrap();
    let f32_sum = Reduction {
        dtype: DataType::F32,
        op: ReduceOp::Sum,
    };
    let reduce = |dst: usize, src: usize, count: usize| {
        kernels.reduce(&stream, f32_sum, At::new(&d, dst), At::new(&d, src), count)
    };
    assert!(reduce(0, 0, 100_000).is_err(), "out of bounds");
    assert!(reduce(2, 0, 4).is_err(), "misaligned");
    assert!(reduce(0, 2048, 0).is_ok(), "zero elements is a no-op");
}
