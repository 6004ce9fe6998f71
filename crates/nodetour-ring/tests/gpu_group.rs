//! The direct GPU ring ([`GpuGroup`]) against the host reducer: rings of 1-5 ranks spread over
//! the GPUs present (several ranks per GPU when there are fewer GPUs), every data type and
//! operation, sizes that do not split evenly. Inputs reach the buffers by copies queued on the
//! callers' streams just before the collective, so a collective that did not wait for earlier
//! work on its streams would read stale data. Needs a GPU: `#[ignore]`d elsewhere (counted as
//! skipped); run by `scripts/gpu-tier.sh` on the GPU machines.

use nodetour_core::cuda::GpuStream;
use nodetour_core::memory::DeviceBuffer;
use nodetour_ring::reduce::{finish_avg, reduce_into};
use nodetour_ring::{DataType, Error, GpuGroup, ReduceOp};

mod common;
use common::gpus;

/// Floats are quarters in [-4, 4] (sums of a few are exact in every float type); integers are
/// arbitrary bit patterns (wrapping arithmetic is exact in any order).
fn values(dtype: DataType, seed: u64, count: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut out = Vec::with_capacity(count * dtype.size());
    for _ in 0..count {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let q = ((x % 33) as f64 - 16.0) / 4.0;
        match dtype {
            DataType::F32 => out.extend_from_slice(&(q as f32).to_ne_bytes()),
            DataType::F64 => out.extend_from_slice(&q.to_ne_bytes()),
            DataType::F16 => out.extend_from_slice(&half::f16::from_f64(q).to_ne_bytes()),
            DataType::Bf16 => out.extend_from_slice(&half::bf16::from_f64(q).to_ne_bytes()),
            DataType::I32 => out.extend_from_slice(&((x >> 11) as i32).to_ne_bytes()),
            DataType::I64 => out.extend_from_slice(&((x >> 3) as i64).to_ne_bytes()),
            DataType::U8 => out.push((x >> 29) as u8),
        }
    }
    out
}

fn as_f64(dtype: DataType, b: &[u8]) -> f64 {
    match dtype {
        DataType::F16 => half::f16::from_ne_bytes([b[0], b[1]]).to_f64(),
        DataType::Bf16 => half::bf16::from_ne_bytes([b[0], b[1]]).to_f64(),
        _ => unreachable!("only halves are compared with a tolerance"),
    }
}

/// The first element where `got` and `want` differ beyond what the type allows: exact, except
/// products of halves (their rounding depends on the order the ring multiplies in).
fn first_difference(
    dtype: DataType,
    op: ReduceOp,
    ranks: usize,
    got: &[u8],
    want: &[u8],
) -> Option<usize> {
    let size = dtype.size();
    let inexact = op == ReduceOp::Prod && matches!(dtype, DataType::F16 | DataType::Bf16);
    let eps = if dtype == DataType::F16 {
        1.0 / 1024.0
    } else {
        1.0 / 128.0
    };
    (0..got.len() / size).find(|&i| {
        let (g, w) = (&got[i * size..][..size], &want[i * size..][..size]);
        if inexact {
            let (g, w) = (as_f64(dtype, g), as_f64(dtype, w));
            (g - w).abs() > w.abs() * eps * ranks as f64
        } else {
            g != w
        }
    })
}

#[test]
#[ignore = "needs a GPU"]
fn rings_over_the_gpus_match_the_host_reducer() {
    let Some(gpus) = gpus() else { return };
    println!("{} GPU(s)", gpus.len());
    let mut failures = Vec::new();
    // Two ranks twice: in one step (the default at these sizes) and through the ring.
    for (ranks, one_step) in [
        (1, true),
        (2, true),
        (2, false),
        (3, true),
        (4, true),
        (5, true),
    ] {
        let contexts: Vec<_> = (0..ranks).map(|r| gpus[r % gpus.len()].clone()).collect();
        let mut group = GpuGroup::new(&contexts).unwrap();
        if !one_step {
            group.set_one_step_max(0);
        }
        println!(
            "{ranks} ranks (one step allowed: {one_step}): {}",
            group.path()
        );
        let streams: Vec<_> = contexts
            .iter()
            .map(|c| GpuStream::new(c).unwrap())
            .collect();
        for count in [1usize, 7, 4099, 100_003] {
            for dtype in DataType::ALL {
                let bytes = count * dtype.size();
                let bufs: Vec<_> = contexts
                    .iter()
                    .map(|c| DeviceBuffer::new(c, bytes).unwrap())
                    .collect();
                let staging: Vec<_> = contexts
                    .iter()
                    .map(|c| DeviceBuffer::new(c, bytes).unwrap())
                    .collect();
                let inputs: Vec<_> = (0..ranks)
                    .map(|r| values(dtype, (r * 1000 + count) as u64, count))
                    .collect();
                for (s, input) in staging.iter().zip(&inputs) {
                    s.copy_from_host(0, input).unwrap();
                }
                for op in ReduceOp::ALL {
                    for r in 0..ranks {
                        streams[r].copy(&bufs[r], 0, &staging[r], 0, bytes).unwrap();
                    }
                    let b: Vec<&DeviceBuffer> = bufs.iter().collect();
                    let s: Vec<&GpuStream> = streams.iter().collect();
                    group.all_reduce(&b, &s, count, dtype, op).unwrap();
                    let mut want = inputs[0].clone();
                    for input in &inputs[1..] {
                        reduce_into(dtype, op, &mut want, input).unwrap();
                    }
                    if op == ReduceOp::Avg {
                        finish_avg(dtype, &mut want, ranks as u32);
                    }
                    for r in 0..ranks {
                        streams[r].synchronize().unwrap();
                        let mut got = vec![0u8; bytes];
                        bufs[r].copy_to_host(0, &mut got).unwrap();
                        if let Some(i) = first_difference(dtype, op, ranks, &got, &want) {
                            let e = i * dtype.size()..(i + 1) * dtype.size();
                            failures.push(format!(
                                "{ranks} ranks (one step: {one_step}), {count} x {dtype:?} \
                                 {op:?}: rank {r} element {i} is {:?}, want {:?}",
                                &got[e.clone()],
                                &want[e]
                            ));
                        }
                    }
                }
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} mismatches:\n{}",
        failures.len(),
        failures[..failures.len().min(20)].join("\n")
    );
}

#[test]
#[ignore = "needs a GPU"]
fn bad_arguments_are_typed_errors_before_anything_is_queued() {
    let Some(gpus) = gpus() else { return };
    let ctx = &gpus[0];
    let mut group = GpuGroup::new(&[ctx.clone(), ctx.clone()]).unwrap();
    let (a, b) = (
        DeviceBuffer::new(ctx, 1 << 20).unwrap(),
        DeviceBuffer::new(ctx, 1 << 16).unwrap(), // allocations are whole 64 KiB granules
    );
    let (s0, s1) = (GpuStream::new(ctx).unwrap(), GpuStream::new(ctx).unwrap());
    let f32s = DataType::F32;
    let sum = ReduceOp::Sum;
    let too_few = group.all_reduce(&[&a], &[&s0, &s1], 16, f32s, sum);
    assert!(
        matches!(too_few, Err(Error::InvalidArgument { .. })),
        "{too_few:?}"
    );
    let too_small = group.all_reduce(&[&a, &b], &[&s0, &s1], 100_000, f32s, sum);
    assert!(
        matches!(too_small, Err(Error::InvalidArgument { .. })),
        "{too_small:?}"
    );
    let same = group.all_reduce(&[&a, &a], &[&s0, &s1], 16, f32s, sum);
    assert!(
        matches!(same, Err(Error::InvalidArgument { .. })),
        "{same:?}"
    );
    let overflow = group.all_reduce(&[&a, &b], &[&s0, &s1], usize::MAX, f32s, sum);
    assert!(
        matches!(overflow, Err(Error::InvalidArgument { .. })),
        "{overflow:?}"
    );
    assert!(GpuGroup::new(&[]).is_err());
    if gpus.len() > 1 {
        let other = DeviceBuffer::new(&gpus[1], 4096).unwrap();
        let wrong_gpu = group.all_reduce(&[&a, &other], &[&s0, &s1], 16, f32s, sum);
        assert!(
            matches!(wrong_gpu, Err(Error::InvalidArgument { .. })),
            "{wrong_gpu:?}"
        );
    }
    // Nothing was queued: the group still works.
    group
        .all_reduce(&[&a, &b], &[&s0, &s1], 256, f32s, sum)
        .unwrap();
    s0.synchronize().unwrap();
    s1.synchronize().unwrap();
}

/// An abort from another thread ends the group: `wait` returns the typed error once the work
/// already queued has finished (its result is right: it waits on nothing outside the process),
/// and every later call is refused with the same error; nothing was written by the refused calls.
#[test]
#[ignore = "needs a GPU"]
fn an_aborted_group_refuses_later_collectives_and_wait_says_why() {
    let Some(gpus) = gpus() else { return };
    let ctx = &gpus[0];
    let mut group = GpuGroup::new(&[ctx.clone(), ctx.clone()]).unwrap();
    let count = 1 << 18;
    let (a, b) = (
        DeviceBuffer::new(ctx, count * 4).unwrap(),
        DeviceBuffer::new(ctx, count * 4).unwrap(),
    );
    let (s0, s1) = (GpuStream::new(ctx).unwrap(), GpuStream::new(ctx).unwrap());
    let one = 1.0f32.to_ne_bytes().repeat(count);
    a.copy_from_host(0, &one).unwrap();
    b.copy_from_host(0, &one).unwrap();
    let (f32s, sum) = (DataType::F32, ReduceOp::Sum);
    group
        .all_reduce(&[&a, &b], &[&s0, &s1], count, f32s, sum)
        .unwrap();
    group.wait(std::time::Duration::from_secs(30)).unwrap();
    let handle = group.abort_handle();
    std::thread::spawn(move || handle.abort("the test's watchdog"))
        .join()
        .unwrap();
    let waited = group.wait(std::time::Duration::from_secs(30));
    assert!(matches!(waited, Err(Error::Aborted { .. })), "{waited:?}");
    let refused = group.all_reduce(&[&a, &b], &[&s0, &s1], count, f32s, sum);
    assert!(matches!(refused, Err(Error::Aborted { .. })), "{refused:?}");
    let refused = group.broadcast(&[&a, &b], &[&s0, &s1], count * 4, 0);
    assert!(matches!(refused, Err(Error::Aborted { .. })), "{refused:?}");
    // The first collective's result (2.0 everywhere) and nothing after it.
    let two = 2.0f32.to_ne_bytes().repeat(count);
    for buf in [&a, &b] {
        let mut got = vec![0u8; count * 4];
        buf.copy_to_host(0, &mut got).unwrap();
        assert!(got == two, "a refused collective changed a buffer");
    }
}

#[test]
#[ignore = "needs a GPU"]
fn reduce_scatter_and_all_gather_match_the_host_reducer() {
    let Some(gpus) = gpus() else { return };
    let mut failures = Vec::new();
    for ranks in 1..=5usize {
        let contexts: Vec<_> = (0..ranks).map(|r| gpus[r % gpus.len()].clone()).collect();
        let mut group = GpuGroup::new(&contexts).unwrap();
        let streams: Vec<_> = contexts
            .iter()
            .map(|c| GpuStream::new(c).unwrap())
            .collect();
        let s: Vec<&GpuStream> = streams.iter().collect();
        for block in [1usize, 7, 4099] {
            for dtype in DataType::ALL {
                let size = dtype.size();
                let bytes = block * ranks * size;
                let bufs: Vec<_> = contexts
                    .iter()
                    .map(|c| DeviceBuffer::new(c, bytes).unwrap())
                    .collect();
                let b: Vec<&DeviceBuffer> = bufs.iter().collect();
                let inputs: Vec<_> = (0..ranks)
                    .map(|r| values(dtype, (r * 7919 + block) as u64, block * ranks))
                    .collect();
                for op in ReduceOp::ALL {
                    for (buf, input) in bufs.iter().zip(&inputs) {
                        buf.copy_from_host(0, input).unwrap();
                    }
                    group.reduce_scatter(&b, &s, block, dtype, op).unwrap();
                    let mut want = inputs[0].clone();
                    for input in &inputs[1..] {
                        reduce_into(dtype, op, &mut want, input).unwrap();
                    }
                    if op == ReduceOp::Avg {
                        finish_avg(dtype, &mut want, ranks as u32);
                    }
                    for r in 0..ranks {
                        streams[r].synchronize().unwrap();
                        let mut got = vec![0u8; block * size];
                        bufs[r].copy_to_host(r * block * size, &mut got).unwrap();
                        let want = &want[r * block * size..][..block * size];
                        if let Some(i) = first_difference(dtype, op, ranks, &got, want) {
                            failures.push(format!(
                                "reduce-scatter, {ranks} ranks, {block} x {dtype:?} {op:?}: \
                                 rank {r} element {i}"
                            ));
                        }
                    }
                }
                // All-gather: rank r contributes block r of its own input.
                for (buf, input) in bufs.iter().zip(&inputs) {
                    buf.copy_from_host(0, input).unwrap();
                }
                group.all_gather(&b, &s, block, dtype).unwrap();
                let mut want = Vec::with_capacity(bytes);
                for (r, input) in inputs.iter().enumerate() {
                    want.extend_from_slice(&input[r * block * size..][..block * size]);
                }
                for r in 0..ranks {
                    streams[r].synchronize().unwrap();
                    let mut got = vec![0u8; bytes];
                    bufs[r].copy_to_host(0, &mut got).unwrap();
                    if got != want {
                        failures.push(format!(
                            "all-gather, {ranks} ranks, {block} x {dtype:?}: rank {r} differs"
                        ));
                    }
                }
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} mismatches:\n{}",
        failures.len(),
        failures[..failures.len().min(20)].join("\n")
    );
}

#[test]
#[ignore = "needs a GPU"]
fn broadcast_reaches_every_rank_from_every_root() {
    let Some(gpus) = gpus() else { return };
    for ranks in 1..=5usize {
        let contexts: Vec<_> = (0..ranks).map(|r| gpus[r % gpus.len()].clone()).collect();
        let mut group = GpuGroup::new(&contexts).unwrap();
        let streams: Vec<_> = contexts
            .iter()
            .map(|c| GpuStream::new(c).unwrap())
            .collect();
        let s: Vec<&GpuStream> = streams.iter().collect();
        // One chunk, an uneven split into several, and the most chunks.
        for bytes in [1usize, 5_000_003, 40 << 20] {
            let bufs: Vec<_> = contexts
                .iter()
                .map(|c| DeviceBuffer::new(c, bytes).unwrap())
                .collect();
            let b: Vec<&DeviceBuffer> = bufs.iter().collect();
            for root in 0..ranks {
                let inputs: Vec<_> = (0..ranks)
                    .map(|r| values(DataType::U8, (r * 31 + root * 7 + bytes) as u64, bytes))
                    .collect();
                for (buf, input) in bufs.iter().zip(&inputs) {
                    buf.copy_from_host(0, input).unwrap();
                }
                group.broadcast(&b, &s, bytes, root).unwrap();
                for r in 0..ranks {
                    streams[r].synchronize().unwrap();
                    let mut got = vec![0u8; bytes];
                    bufs[r].copy_to_host(0, &mut got).unwrap();
                    assert!(
                        got == inputs[root],
                        "{ranks} ranks, {bytes} bytes from root {root}: rank {r} differs"
                    );
                }
            }
        }
    }
    let ctx = &gpus[0];
    let mut group = GpuGroup::new(&[ctx.clone(), ctx.clone()]).unwrap();
    let (a, b) = (
        DeviceBuffer::new(ctx, 4096).unwrap(),
        DeviceBuffer::new(ctx, 4096).unwrap(),
    );
    let (s0, s1) = (GpuStream::new(ctx).unwrap(), GpuStream::new(ctx).unwrap());
    let bad_root = group.broadcast(&[&a, &b], &[&s0, &s1], 16, 2);
    assert!(
        matches!(bad_root, Err(Error::InvalidArgument { .. })),
        "{bad_root:?}"
    );
}
