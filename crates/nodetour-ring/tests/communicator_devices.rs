//! Several GPUs of one process through the communicator ([`Communicator::from_devices`]),
//! against the host reducer: sets of 1-5 ranks spread over the GPUs present (several ranks per
//! GPU when there are fewer GPUs), every data type and operation, sizes that do not split
//! evenly; driven from one thread through a [`Group`] and from one thread per GPU. Inputs reach
//! the buffers by copies queued on the callers' streams just before the collective, so a
//! collective that did not wait for earlier work on its streams would read stale data. Needs a
//! GPU: `#[ignore]`d elsewhere (counted as skipped); run by `scripts/tiers/gpu-tier.sh` on the GPU
//! machines.

#![allow(clippy::needless_range_loop)] // ranks index several parallel vectors

use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DeviceRepr, ValidAsZeroBits};
use nodetour_core::Deadline;
use nodetour_core::cuda::GpuStream;
use nodetour_core::memory::DeviceBuffer;
use nodetour_ring::comm::{Communicator, DevicePath, Elements, Group, Host, Options};
use nodetour_ring::reduce::{finish_avg, reduce_into};
use nodetour_ring::{DataType, Element, Error, ReduceOp};

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
            DataType::I8 => out.push((x >> 37) as u8),
            DataType::I16 => out.extend_from_slice(&((x >> 21) as i16).to_ne_bytes()),
            DataType::U32 => out.extend_from_slice(&((x >> 9) as u32).to_ne_bytes()),
            DataType::U64 => out.extend_from_slice(&x.to_ne_bytes()),
            // Whole numbers in [-1, 1]: sums of up to 8 exact in both formats.
            DataType::F8E4M3 => out.push(float8::F8E4M3::from_f64((x % 3) as f64 - 1.0).to_bits()),
            DataType::F8E5M2 => out.push(float8::F8E5M2::from_f64((x % 3) as f64 - 1.0).to_bits()),
            other => panic!("no test inputs for {other:?}"),
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

/// The reduction of `inputs` as the host computes it.
fn reduced(dtype: DataType, op: ReduceOp, inputs: &[Vec<u8>]) -> Vec<u8> {
    let mut want = inputs[0].clone();
    for input in &inputs[1..] {
        reduce_into(dtype, op, &mut want, input).unwrap();
    }
    if op == ReduceOp::Avg {
        finish_avg(dtype, &mut want, inputs.len() as u32).unwrap();
    }
    want
}

fn no_mismatches(failures: &[String]) {
    assert!(
        failures.is_empty(),
        "{} mismatches:\n{}",
        failures.len(),
        failures[..failures.len().min(20)].join("\n")
    );
}

fn contexts(gpus: &[Arc<CudaContext>], ranks: usize) -> Vec<Arc<CudaContext>> {
    (0..ranks).map(|r| gpus[r % gpus.len()].clone()).collect()
}

fn options() -> Options {
    let mut o = Options::default();
    o.config.timeout = Duration::from_secs(20);
    o
}

#[test]
#[ignore = "needs a GPU"]
fn allreduce_in_a_group_matches_the_host_reducer() {
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
        let contexts = contexts(&gpus, ranks);
        let mut o = options();
        if !one_step {
            o.one_step_max = 0;
        }
        let comms = Communicator::from_devices(&contexts, o).unwrap();
        let DevicePath::InProcess { reason } = &comms[0].paths().device else {
            panic!("{}", comms[0].paths())
        };
        println!("{ranks} ranks (one step allowed: {one_step}): {reason}");
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
                for op in common::device_ops() {
                    let mut g = Group::new();
                    for r in 0..ranks {
                        streams[r].copy(&bufs[r], 0, &staging[r], 0, bytes).unwrap();
                        let (buf, stream) = (&bufs[r], &streams[r]);
                        let op = common::rank_op(op, dtype, r);
                        g.add(&comms[r], move |c| {
                            c.all_reduce_in_place(
                                &mut Elements::new(buf, count, dtype)?,
                                op,
                                stream,
                            )
                        })
                        .unwrap();
                    }
                    g.end().unwrap();
                    let want = reduced(dtype, op, &common::as_summed(dtype, op, &inputs));
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
        for c in comms {
            c.close(Deadline::after(Duration::from_secs(30))).unwrap();
        }
    }
    no_mismatches(&failures);
}

/// One rank's cudarc slices, stream and inputs for one case.
struct Rank<T: DeviceRepr> {
    /// Its seat in the set.
    seat: usize,
    stream: Arc<CudaStream>,
    send: CudaSlice<T>,
    recv: CudaSlice<T>,
}

fn upload<T: Element + DeviceRepr + ValidAsZeroBits>(
    stream: &Arc<CudaStream>,
    bytes: &[u8],
) -> CudaSlice<T> {
    let mut host = vec![T::zeroed(); bytes.len() / T::DATA_TYPE.size()];
    bytemuck::cast_slice_mut::<T, u8>(&mut host).copy_from_slice(bytes);
    stream.clone_htod(&host).unwrap()
}

fn download<T: Element + DeviceRepr>(stream: &Arc<CudaStream>, slice: &CudaSlice<T>) -> Vec<u8> {
    let host: Vec<T> = stream.clone_dtoh(slice).unwrap();
    bytemuck::cast_slice(&host).to_vec()
}

type Each<'f, T> = dyn Fn(&Communicator, &mut Rank<T>) -> Result<(), Error> + Sync + 'f;

/// Runs `each(comm, rank)` for every rank on its own thread, or as every rank's call in one
/// group.
fn drive<T: DeviceRepr>(
    comms: &[Communicator],
    threads: bool,
    rs: &mut [Rank<T>],
    each: &Each<'_, T>,
) {
    if threads {
        std::thread::scope(|s| {
            let hs: Vec<_> = comms
                .iter()
                .zip(rs.iter_mut())
                .map(|(c, r)| s.spawn(move || each(c, r)))
                .collect();
            for h in hs {
                h.join().unwrap().unwrap();
            }
        });
    } else {
        let mut g = Group::new();
        for (c, r) in comms.iter().zip(rs.iter_mut()) {
            g.add(c, move |c| each(c, r)).unwrap();
        }
        g.end().unwrap();
    }
}

/// Reduce-scatter, all-gather, allreduce out of place and broadcast of `T` on cudarc slices,
/// driven one thread per GPU (`threads`) or from one thread in groups; every rank's answer
/// checked.
fn slices_case<T: Element + DeviceRepr + ValidAsZeroBits>(
    comms: &[Communicator],
    contexts: &[Arc<CudaContext>],
    block: usize,
    threads: bool,
    failures: &mut Vec<String>,
) {
    let ranks = comms.len();
    let dtype = T::DATA_TYPE;
    let size = dtype.size();
    let whole = block * ranks;
    let inputs: Vec<_> = (0..ranks)
        .map(|r| values(dtype, (r * 7919 + block) as u64, whole))
        .collect();
    let fresh = || -> Vec<Rank<T>> {
        contexts
            .iter()
            .zip(&inputs)
            .enumerate()
            .map(|(seat, (c, input))| {
                let stream = c.new_stream().unwrap();
                Rank {
                    seat,
                    send: upload(&stream, input),
                    recv: stream.alloc_zeros(whole).unwrap(),
                    stream,
                }
            })
            .collect()
    };
    let drive = |rs: &mut Vec<Rank<T>>, each: &Each<'_, T>| drive(comms, threads, rs, each);
    let mode = if threads { "threads" } else { "group" };
    for op in common::device_ops() {
        // Reduce-scatter: `send` (every block) into the first `block` elements of `recv`.
        let mut rs = fresh();
        for r in rs.iter_mut() {
            r.recv = r.stream.alloc_zeros(block).unwrap();
        }
        let op_of = |seat: usize| common::rank_op(op, dtype, seat);
        drive(&mut rs, &|c, r| {
            c.reduce_scatter(&r.send, &mut r.recv, op_of(r.seat), &r.stream)
        });
        let want = reduced(dtype, op, &common::as_summed(dtype, op, &inputs));
        for (i, r) in rs.iter().enumerate() {
            let got = download(&r.stream, &r.recv);
            if first_difference(
                dtype,
                op,
                ranks,
                &got,
                &want[i * block * size..][..block * size],
            )
            .is_some()
            {
                failures.push(format!(
                    "reduce-scatter ({mode}), {ranks} ranks, {block} x {dtype:?} {op:?}: rank {i}"
                ));
            }
            // The input is never written.
            if download(&r.stream, &r.send) != inputs[i] {
                failures.push(format!("reduce-scatter ({mode}) wrote rank {i}'s input"));
            }
        }
        // Allreduce out of place.
        let mut rs = fresh();
        drive(&mut rs, &|c, r| {
            c.all_reduce(&r.send, &mut r.recv, op_of(r.seat), &r.stream)
        });
        for (i, r) in rs.iter().enumerate() {
            if first_difference(dtype, op, ranks, &download(&r.stream, &r.recv), &want).is_some() {
                failures.push(format!(
                    "allreduce ({mode}), {ranks} ranks, {block} x {dtype:?} {op:?}: rank {i}"
                ));
            }
        }
    }
    // All-gather: rank r contributes its first `block` elements.
    let mut rs = fresh();
    for (r, input) in rs.iter_mut().zip(&inputs) {
        r.send = upload(&r.stream, &input[..block * size]);
    }
    drive(&mut rs, &|c, r| {
        c.all_gather(&r.send, &mut r.recv, &r.stream)
    });
    let want: Vec<u8> = inputs
        .iter()
        .flat_map(|i| i[..block * size].to_vec())
        .collect();
    for (i, r) in rs.iter().enumerate() {
        if download(&r.stream, &r.recv) != want {
            failures.push(format!(
                "all-gather ({mode}), {ranks} ranks, {block} x {dtype:?}: rank {i}"
            ));
        }
    }
    // Broadcast from every root.
    for root in 0..ranks {
        let mut rs = fresh();
        drive(&mut rs, &|c, r| {
            c.broadcast_in_place(&mut r.send, root as u32, &r.stream)
        });
        for (i, r) in rs.iter().enumerate() {
            if download(&r.stream, &r.send) != inputs[root] {
                failures.push(format!(
                    "broadcast ({mode}) from {root}, {ranks} ranks, {block} x {dtype:?}: rank {i}"
                ));
            }
        }
    }
}

#[test]
#[ignore = "needs a GPU"]
fn every_collective_on_cudarc_slices_from_threads_and_from_groups() {
    let Some(gpus) = gpus() else { return };
    let mut failures = Vec::new();
    for ranks in 1..=4usize {
        let contexts = contexts(&gpus, ranks);
        let comms = Communicator::from_devices(&contexts, options()).unwrap();
        for threads in [true, false] {
            for block in [1usize, 4099] {
                slices_case::<f32>(&comms, &contexts, block, threads, &mut failures);
                slices_case::<half::bf16>(&comms, &contexts, block, threads, &mut failures);
                slices_case::<i64>(&comms, &contexts, block, threads, &mut failures);
                slices_case::<u8>(&comms, &contexts, block, threads, &mut failures);
            }
        }
        // A broadcast large enough for the pipeline's every chunk.
        slices_case::<f64>(
            &comms,
            &contexts,
            (40 << 20) / 8 / ranks,
            false,
            &mut failures,
        );
        for c in comms {
            c.close(Deadline::after(Duration::from_secs(30))).unwrap();
        }
    }
    no_mismatches(&failures);
}

#[test]
#[ignore = "needs a GPU"]
fn bad_arguments_are_typed_errors_before_anything_is_queued() {
    let Some(gpus) = gpus() else { return };
    let ctx = &gpus[0];
    let comms = Communicator::from_devices(&[ctx.clone(), ctx.clone()], options()).unwrap();
    let (a, b) = (
        DeviceBuffer::new(ctx, 1 << 20).unwrap(),
        DeviceBuffer::new(ctx, 1 << 16).unwrap(), // allocations are whole 64 KiB granules
    );
    let (s0, s1) = (GpuStream::new(ctx).unwrap(), GpuStream::new(ctx).unwrap());
    let (f32s, sum) = (DataType::F32, ReduceOp::Sum);
    let invalid = |r: Result<(), Error>| matches!(r, Err(Error::InvalidArgument { .. }));
    let group = |x: &DeviceBuffer, y: &DeviceBuffer, count| {
        let mut g = Group::new();
        let (s0, s1) = (&s0, &s1);
        g.add(&comms[0], move |c| {
            c.all_reduce_in_place(&mut Elements::new(x, count, f32s)?, sum, s0)
        })?;
        g.add(&comms[1], move |c| {
            c.all_reduce_in_place(&mut Elements::new(y, count, f32s)?, sum, s1)
        })?;
        g.end()
    };
    // Too small, the same buffer twice, an overflowing count.
    assert!(invalid(group(&a, &b, 100_000)));
    assert!(invalid(group(&a, &a, 16)));
    assert!(invalid(group(&a, &b, usize::MAX)));
    // A call missing for one GPU.
    let mut g = Group::new();
    g.add(&comms[0], |c| {
        c.all_reduce_in_place(&mut Elements::new(&a, 16, f32s)?, sum, &s0)
    })
    .unwrap();
    assert!(invalid(g.end()));
    // Host memory is for communicators of processes.
    let mut host = vec![1.0f32; 4];
    assert!(matches!(
        comms[0].all_reduce_in_place(&mut host, sum, Host),
        Err(Error::Unsupported { .. })
    ));
    assert!(Communicator::from_devices(&[], options()).is_err());
    // Nothing was queued: the set still works, and the answer is right.
    a.copy_from_host(0, &1.5f32.to_ne_bytes().repeat(256))
        .unwrap();
    b.copy_from_host(0, &2.0f32.to_ne_bytes().repeat(256))
        .unwrap();
    group(&a, &b, 256).unwrap();
    for (buf, s) in [(&a, &s0), (&b, &s1)] {
        s.synchronize().unwrap();
        let mut got = vec![0u8; 1024];
        buf.copy_to_host(0, &mut got).unwrap();
        assert_eq!(got, 3.5f32.to_ne_bytes().repeat(256));
    }
}

/// Members that call different collectives all fail with a disagreement and nothing is queued;
/// the set is broken afterwards (every member says so). A member called alone from one thread
/// (no group, no other threads) times out naming the cause.
#[test]
#[ignore = "needs a GPU"]
fn disagreement_and_a_missing_thread_fail_every_member_and_write_nothing() {
    let Some(gpus) = gpus() else { return };
    let ctx = &gpus[0];
    let comms = Communicator::from_devices(&[ctx.clone(), ctx.clone()], options()).unwrap();
    let streams: Vec<_> = (0..2).map(|_| ctx.new_stream().unwrap()).collect();
    let mut data: Vec<CudaSlice<f32>> = streams
        .iter()
        .map(|s| s.clone_htod(&[1.0f32; 64]).unwrap())
        .collect();
    let outcomes: Vec<Result<(), Error>> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .iter()
            .zip(data.iter_mut())
            .zip(&streams)
            .enumerate()
            .map(|(i, ((c, d), st))| {
                let op = if i == 0 { ReduceOp::Sum } else { ReduceOp::Max };
                s.spawn(move || c.all_reduce_in_place(d, op, st))
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for o in &outcomes {
        assert!(
            matches!(
                o,
                Err(Error::Disagreement { .. }) | Err(Error::Broken { .. })
            ),
            "{o:?}"
        );
    }
    assert!(
        outcomes
            .iter()
            .any(|o| matches!(o, Err(Error::Disagreement { .. })))
    );
    for (d, s) in data.iter().zip(&streams) {
        assert_eq!(s.clone_dtoh(d).unwrap(), vec![1.0f32; 64], "written");
    }
    for c in &comms {
        assert!(c.error().is_some());
    }
    // A fresh set, one member called without its partner: a timeout that says to use a group.
    let mut o = options();
    o.config.timeout = Duration::from_millis(300);
    let comms = Communicator::from_devices(&[ctx.clone(), ctx.clone()], o).unwrap();
    let t0 = std::time::Instant::now();
    let alone = comms[0].all_reduce_in_place(&mut data[0], ReduceOp::Sum, &streams[0]);
    assert!(t0.elapsed() < Duration::from_secs(10));
    match alone {
        Err(Error::Timeout { waiting_for, .. }) => {
            assert!(waiting_for.contains("Group"), "{waiting_for}")
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(comms[1].error(), Some(Error::Timeout { .. })));
}

/// An abort from another thread ends every member: threads waiting in a call leave with it,
/// `wait` and later calls say why, and the refused calls write nothing.
#[test]
#[ignore = "needs a GPU"]
fn an_abort_ends_every_member_and_refused_calls_write_nothing() {
    let Some(gpus) = gpus() else { return };
    let ctx = &gpus[0];
    let comms = Communicator::from_devices(&[ctx.clone(), ctx.clone()], options()).unwrap();
    let streams: Vec<_> = (0..2).map(|_| ctx.new_stream().unwrap()).collect();
    let count = 1 << 18;
    let mut data: Vec<CudaSlice<f32>> = streams
        .iter()
        .map(|s| s.clone_htod(&vec![1.0f32; count]).unwrap())
        .collect();
    {
        let mut g = Group::new();
        let (d0, d1) = data.split_at_mut(1);
        let (x, y) = (&mut d0[0], &mut d1[0]);
        let (s0, s1) = (&streams[0], &streams[1]);
        g.add(&comms[0], move |c| {
            c.all_reduce_in_place(x, ReduceOp::Sum, s0)
        })
        .unwrap();
        g.add(&comms[1], move |c| {
            c.all_reduce_in_place(y, ReduceOp::Sum, s1)
        })
        .unwrap();
        g.end().unwrap();
    }
    comms[0]
        .wait(Deadline::after(Duration::from_secs(30)))
        .unwrap();
    // Rank 0 waits in a call for rank 1, which never comes; the abort releases it.
    let handle = comms[1].abort_handle();
    let waiting = std::thread::scope(|s| {
        let c0 = &comms[0];
        let (d, st) = (&mut data[0], &streams[0]);
        let h = s.spawn(move || c0.all_reduce_in_place(d, ReduceOp::Sum, st));
        std::thread::sleep(Duration::from_millis(100));
        handle.abort("the test's watchdog");
        h.join().unwrap()
    });
    assert!(matches!(waiting, Err(Error::Broken { .. })), "{waiting:?}");
    let waited = comms[0].wait(Deadline::after(Duration::from_secs(30)));
    assert!(matches!(waited, Err(Error::Aborted { .. })), "{waited:?}");
    let refused = comms[1].all_reduce_in_place(&mut data[1], ReduceOp::Sum, &streams[1]);
    assert!(matches!(refused, Err(Error::Broken { .. })), "{refused:?}");
    // The first collective's result (2.0 everywhere) and nothing after it.
    for (d, s) in data.iter().zip(&streams) {
        assert!(
            s.clone_dtoh(d).unwrap() == vec![2.0f32; count],
            "a refused call wrote"
        );
    }
}

/// One collective of [`captured_in_one_graph_from_one_thread_and_replayed`], on every rank's
/// nodetour buffers: `send` (in) and `recv` (out; `send` itself for allreduces and broadcasts).
struct Captured {
    what: &'static str,
    dtype: DataType,
    op: ReduceOp,
    /// Elements per block (reduce-scatter, all-gather) or of the buffer.
    count: usize,
    root: usize,
    send: Vec<DeviceBuffer>,
    recv: Vec<Option<DeviceBuffer>>,
}

impl Captured {
    fn new(
        contexts: &[Arc<CudaContext>],
        what: &'static str,
        dtype: DataType,
        op: ReduceOp,
        count: usize,
        root: usize,
    ) -> Captured {
        let n = contexts.len();
        let block = count * dtype.size();
        let (send, recv) = match what {
            "reduce-scatter" => (block * n, Some(block)),
            "all-gather" => (block, Some(block * n)),
            _ => (block, None),
        };
        Captured {
            what,
            dtype,
            op,
            count,
            root,
            send: contexts
                .iter()
                .map(|c| DeviceBuffer::new(c, send).unwrap())
                .collect(),
            recv: contexts
                .iter()
                .map(|c| recv.map(|b| DeviceBuffer::new(c, b).unwrap()))
                .collect(),
        }
    }

    fn inputs(&self, seed: u64) -> Vec<Vec<u8>> {
        let n = self.send.len();
        let len = if self.what == "reduce-scatter" {
            self.count * n
        } else {
            self.count
        };
        (0..n)
            .map(|r| values(self.dtype, seed * 16 + r as u64, len))
            .collect()
    }

    fn fill(&self, seed: u64) {
        for (b, input) in self.send.iter().zip(self.inputs(seed)) {
            b.copy_from_host(0, &input).unwrap();
        }
    }

    /// Queues the collective for every rank, in one group.
    fn queue(&self, comms: &[Communicator], streams: &[GpuStream]) -> Result<(), Error> {
        let (t, n, op) = (self.dtype, self.count, self.op);
        let mut g = Group::new();
        for (r, c) in comms.iter().enumerate() {
            let (send, recv, s) = (&self.send[r], self.recv[r].as_ref(), &streams[r]);
            let (what, root, world) = (self.what, self.root as u32, comms.len());
            let op = common::rank_op(op, t, r);
            g.add(c, move |c| {
                let elements = |b, count| Elements::new(b, count, t);
                match what {
                    "allreduce" => c.all_reduce_in_place(&mut elements(send, n)?, op, s),
                    "reduce-scatter" => c.reduce_scatter(
                        &elements(send, n * world)?,
                        &mut elements(recv.unwrap(), n)?,
                        op,
                        s,
                    ),
                    "all-gather" => c.all_gather(
                        &elements(send, n)?,
                        &mut elements(recv.unwrap(), n * world)?,
                        s,
                    ),
                    _ => c.broadcast_in_place(&mut elements(send, n)?, root, s),
                }
            })?;
        }
        g.end()
    }

    /// Every rank's output against the inputs of `seed`.
    fn check(&self, when: &str, seed: u64, failures: &mut Vec<String>) {
        let inputs = self.inputs(seed);
        let ranks = inputs.len();
        let size = self.dtype.size();
        let summed = common::as_summed(self.dtype, self.op, &inputs);
        for r in 0..ranks {
            let want = match self.what {
                "allreduce" => reduced(self.dtype, self.op, &summed),
                "reduce-scatter" => reduced(self.dtype, self.op, &summed)[r * self.count * size..]
                    [..self.count * size]
                    .to_vec(),
                "all-gather" => inputs.concat(),
                _ => inputs[self.root].clone(),
            };
            let out = self.recv[r].as_ref().unwrap_or(&self.send[r]);
            let mut got = vec![0u8; want.len()];
            out.copy_to_host(0, &mut got).unwrap();
            if let Some(i) = first_difference(self.dtype, self.op, ranks, &got, &want) {
                failures.push(format!(
                    "{when}: {ranks} ranks, {} {:?} {:?} x {}: rank {r} element {i}",
                    self.what, self.dtype, self.op, self.count
                ));
            }
        }
    }
}

/// The one-process path captured into one CUDA graph from one thread: the capture starts on
/// rank 0's stream and every other rank's stream is forked from it (so the ranks' markers
/// become the graph's edges, across GPUs); every collective of every type (and operation) is
/// queued in groups, the graph replayed with new inputs each time and every rank's answer
/// checked, with eager collectives between the replays. Ranks 2-4 (two of them once in one
/// step and once through the ring). A capture that holds only some of the streams is refused,
/// typed, and the set goes on.
#[test]
#[ignore = "needs a GPU"]
fn captured_in_one_graph_from_one_thread_and_replayed() {
    let Some(gpus) = gpus() else { return };
    use cudarc::driver::sys;
    let relaxed = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
    let mut failures = Vec::new();
    for (ranks, one_step) in [(2, true), (2, false), (3, true), (4, true)] {
        let contexts = contexts(&gpus, ranks);
        let mut o = options();
        if !one_step {
            o.one_step_max = 0;
        }
        let comms = Communicator::from_devices(&contexts, o).unwrap();
        let cu: Vec<Arc<CudaStream>> = contexts.iter().map(|c| c.new_stream().unwrap()).collect();
        let streams: Vec<GpuStream> = cu.iter().map(GpuStream::of_cudarc).collect();
        let mut cases = Vec::new();
        for dtype in DataType::ALL {
            let (n, block) = (100_003usize, 4099usize);
            for op in common::device_ops() {
                cases.push(Captured::new(&contexts, "allreduce", dtype, op, n, 0));
                cases.push(Captured::new(
                    &contexts,
                    "reduce-scatter",
                    dtype,
                    op,
                    block,
                    0,
                ));
            }
            let (sum, root) = (ReduceOp::Sum, cases.len() % ranks);
            cases.push(Captured::new(&contexts, "all-gather", dtype, sum, block, 0));
            cases.push(Captured::new(&contexts, "broadcast", dtype, sum, n, root));
        }

        // Only rank 0's stream capturing: refused before anything is queued; the set goes on.
        let probe = Captured::new(&contexts, "allreduce", DataType::F32, ReduceOp::Sum, 7, 0);
        cu[0].begin_capture(relaxed).unwrap();
        let refused = probe.queue(&comms, &streams);
        drop(cu[0].end_capture(sys::CUgraphInstantiate_flags(0)).unwrap());
        assert!(
            matches!(&refused, Err(Error::Unsupported { reason }) if reason.contains("capture")),
            "{refused:?}"
        );

        cu[0].begin_capture(relaxed).unwrap();
        let fork = cu[0].record_event(None).unwrap();
        for s in &cu[1..] {
            s.wait(&fork).unwrap();
        }
        for c in &cases {
            c.queue(&comms, &streams).unwrap();
        }
        for s in &cu[1..] {
            cu[0].wait(&s.record_event(None).unwrap()).unwrap();
        }
        let graph = cu[0]
            .end_capture(sys::CUgraphInstantiate_flags(0))
            .unwrap()
            .expect("a graph with the captured collectives");
        for replay in 0..3u64 {
            for (k, c) in cases.iter().enumerate() {
                c.fill(1000 * replay + k as u64);
            }
            graph.launch().unwrap();
            cu[0].synchronize().unwrap();
            for (k, c) in cases.iter().enumerate() {
                let when = format!("replay {replay} (one step: {one_step})");
                c.check(&when, 1000 * replay + k as u64, &mut failures);
            }
            // Eager collectives between the replays, checked.
            for (k, c) in [&probe, &cases[1]].into_iter().enumerate() {
                let seed = 50_000 + 10 * replay + k as u64;
                c.fill(seed);
                c.queue(&comms, &streams).unwrap();
                for s in &cu {
                    s.synchronize().unwrap();
                }
                c.check(&format!("eager after replay {replay}"), seed, &mut failures);
            }
        }
        println!(
            "CAPTURED_SET ranks={ranks} one_step={one_step} cases={} replays=3",
            cases.len()
        );
        drop(graph);
        for c in comms {
            c.close(Deadline::after(Duration::from_secs(30))).unwrap();
        }
    }
    no_mismatches(&failures);
}

/// Queues the busy kernel on `stream` for about `ms` (calibrated on a stream of its own);
/// what it returns must outlive the kernel.
fn hold(
    ctx: &Arc<CudaContext>,
    stream: &GpuStream,
    ms: u64,
) -> (nodetour_core::cuda::reduce::ReduceKernels, DeviceBuffer) {
    let kernels = nodetour_core::cuda::reduce::ReduceKernels::load(ctx).unwrap();
    let sink = DeviceBuffer::new(ctx, 4096).unwrap();
    let probe = 1u32 << 20;
    let calibrate = GpuStream::new(ctx).unwrap();
    let start = calibrate.record().unwrap();
    kernels.busy(&calibrate, &sink, probe, 1).unwrap();
    let end = calibrate.record().unwrap();
    calibrate.synchronize().unwrap();
    let per_iter = f64::from(start.elapsed_ms(&end).unwrap()) / f64::from(probe);
    let iters = (ms as f64 / per_iter.max(1e-9)).clamp(1.0, f64::from(u32::MAX)) as u32;
    kernels.busy(stream, &sink, iters, 1).unwrap();
    (kernels, sink)
}

/// Issue 48, item 5: a group's calls on the caller's per-thread default stream. Each input
/// lands on that stream behind a long kernel; the members' threads (whose own per-thread
/// streams are other streams) must order the collective after it, and both the caller's
/// per-thread stream and a third stream (through cudarc's events alone) must read the result
/// after the collective: by the group's stand-ins, forked from the per-thread stream and joined
/// back on the caller's thread. Every round's inputs differ.
#[test]
#[ignore = "needs a GPU"]
fn a_group_on_the_callers_per_thread_stream_is_ordered_on_it() {
    // It hung on one H100 and one H200 (2026-12-07, the fix and its parent alike: the host
    // blocked in `Group::end`, the GPU idle): fail with every thread's state instead.
    let _watchdog = common::watchdog(
        Duration::from_secs(90),
        "a_group_on_the_callers_per_thread_stream_is_ordered_on_it",
    );
    let Some(gpus) = gpus() else { return };
    let ctxs = contexts(&gpus, 2);
    let comms = Communicator::from_devices(&ctxs, options()).unwrap();
    let count = 1 << 16;
    for round in 0..3u64 {
        let streams: Vec<Arc<CudaStream>> = ctxs.iter().map(|c| c.per_thread_stream()).collect();
        let side = ctxs[0].new_stream().unwrap();
        let inputs: Vec<Vec<u8>> = (0..2)
            .map(|r| values(DataType::F32, 40 + 2 * round + r, count))
            .collect();
        // Staged where they are ready now, copied in on the per-thread streams behind ~300 ms
        // of work.
        let staged: Vec<CudaSlice<f32>> = inputs.iter().map(|b| upload::<f32>(&side, b)).collect();
        side.synchronize().unwrap();
        let held: Vec<_> = ctxs
            .iter()
            .zip(&streams)
            .map(|(c, s)| hold(c, &GpuStream::of_cudarc(s), 300))
            .collect();
        eprintln!("round {round}: held");
        let mut data: Vec<CudaSlice<f32>> = streams
            .iter()
            .zip(&staged)
            .map(|(s, src)| {
                let mut d = s.alloc_zeros::<f32>(count).unwrap();
                s.memcpy_dtod(src, &mut d).unwrap();
                d
            })
            .collect();
        let mut g = Group::new();
        for ((c, d), s) in comms.iter().zip(data.iter_mut()).zip(&streams) {
            g.add(c, move |c| c.all_reduce_in_place(d, ReduceOp::Sum, s))
                .unwrap();
        }
        g.end().unwrap();
        eprintln!("round {round}: the group queued");
        let want = reduced(DataType::F32, ReduceOp::Sum, &inputs);
        // First on a third stream, ordered only by cudarc's events of each slice: the write
        // event must have been recorded after the collective (on the group's stand-in for the
        // per-thread stream), not on a member thread's own per-thread stream.
        let third = ctxs[0].new_stream().unwrap();
        for (r, d) in data.iter().enumerate() {
            let got = download(&third, d);
            assert_eq!(
                first_difference(DataType::F32, ReduceOp::Sum, 2, &got, &want),
                None,
                "round {round}, rank {r}: read on a third stream before the collective ran \
                 (cudarc's write event was not ordered after it)"
            );
        }
        eprintln!("round {round}: read back on a third stream");
        for (r, (s, d)) in streams.iter().zip(&data).enumerate() {
            let got = download(s, d);
            eprintln!("round {round}: rank {r} read back");
            assert_eq!(
                first_difference(DataType::F32, ReduceOp::Sum, 2, &got, &want),
                None,
                "round {round}, rank {r}: the collective ran before its input landed on the \
                 caller's per-thread stream, or was read before it ran"
            );
        }
        comms[0]
            .wait(Deadline::after(Duration::from_secs(20)))
            .unwrap();
        drop(held);
    }
}

/// Issue 48, item 4: two distinct GPUs of one process read and write each other's
/// memory-pool allocations (cudarc's `cuMemAllocAsync`, which `cuCtxEnablePeerAccess` does not
/// reach; `from_devices` grants pool access both ways), every collective on cudarc slices,
/// from threads and from groups, small and large; nodetour's own buffers (`cuMemAlloc`) in
/// `allreduce_in_a_group_matches_the_host_reducer`, graph capture (scratch from a pool too) in
/// `captured_in_one_graph_from_one_thread_and_replayed`, both of which spread their ranks over
/// two GPUs where there are two. Needs two GPUs: on one it prints `SKIP`.
#[test]
#[ignore = "needs 2 GPUs"]
fn two_gpus_read_each_others_pool_memory() {
    let Some(gpus) = gpus() else { return };
    if gpus.len() < 2 {
        println!("SKIP needs 2 GPUs ({} here)", gpus.len());
        return;
    }
    let contexts = vec![gpus[0].clone(), gpus[1].clone()];
    let comms = Communicator::from_devices(&contexts, options()).unwrap();
    let mut failures = Vec::new();
    for threads in [true, false] {
        for block in [4099usize, 3 << 20] {
            slices_case::<f32>(&comms, &contexts, block, threads, &mut failures);
            slices_case::<half::bf16>(&comms, &contexts, block, threads, &mut failures);
        }
    }
    for c in comms {
        c.close(Deadline::after(Duration::from_secs(30))).unwrap();
    }
    no_mismatches(&failures);
}
