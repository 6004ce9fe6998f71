//! CPU-only benches of the parts that run on every collective: the ring schedule driven through
//! a whole allreduce (ranks simulated in one thread, no data), the stream program of the GPU
//! ring, and the host reducer's throughput. Runs on any machine.

use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use nodetour_ring::reduce::reduce_into;
use nodetour_ring::stream_plan::{LinkCounters, program};
use nodetour_ring::{Action, DataType, Plan, ReduceOp, RingSchedule};

/// Drives `world` schedules through one allreduce of `plan`, delivering every action at once
/// (an ideal transport); returns the number of chunks moved.
fn simulate(plan: Plan, world: u32) -> usize {
    let now = Instant::now();
    let mut scheds: Vec<RingSchedule> = (0..world)
        .map(|r| RingSchedule::new(plan, r, 1, Duration::from_secs(10), now))
        .collect();
    let mut moved = 0;
    let mut done = 0;
    while done < world as usize {
        done = 0;
        for r in 0..world as usize {
            let next = (r + 1) % world as usize;
            let prev = (r + world as usize - 1) % world as usize;
            while let Some(a) = scheds[r].poll_action() {
                match a {
                    Action::Send { unit, imm, .. } => {
                        scheds[r].handle_sent(unit, now).expect("sent");
                        scheds[next].handle_arrived(imm, now).expect("arrived");
                        moved += 1;
                    }
                    Action::Reduce { unit, .. } | Action::Copy { unit, .. } => {
                        scheds[r].handle_processed(unit, now).expect("processed");
                    }
                    Action::Grant { slot } => {
                        scheds[prev].handle_granted(slot, now).expect("granted");
                    }
                    Action::Done => {}
                    Action::Failed(e) => panic!("{e}"),
                }
            }
            if scheds[r].is_done() {
                done += 1;
            }
        }
    }
    moved
}

fn schedule(c: &mut Criterion) {
    let mut g = c.benchmark_group("schedule");
    for (world, count) in [(2u32, 1u64 << 20), (8, 1 << 24)] {
        let plan = Plan::new(world, count, 4, 1 << 16, 4).expect("plan");
        let chunks = simulate(plan, world);
        g.throughput(Throughput::Elements(chunks as u64));
        g.bench_function(format!("ring_{world}_ranks_{chunks}_chunks"), |b| {
            b.iter(|| simulate(plan, world))
        });
    }
    let plan = Plan::new(8, 1 << 28, 4, 32 << 20, 2).expect("plan");
    g.bench_function("stream_program_8_ranks_1GiB", |b| {
        b.iter(|| {
            let mut counters = LinkCounters::default();
            program(&plan, 3, false, &mut counters)
        })
    });
    g.finish();
}

fn reducer(c: &mut Criterion) {
    let mut g = c.benchmark_group("host_reduce");
    let bytes = 4 << 20;
    g.throughput(Throughput::Bytes(bytes as u64));
    for dtype in [DataType::F32, DataType::Bf16, DataType::I64] {
        let mut acc = vec![1u8; bytes];
        let other = vec![2u8; bytes];
        g.bench_function(format!("{}_sum_4MiB", dtype.name()), |b| {
            b.iter(|| reduce_into(dtype, ReduceOp::Sum, &mut acc, &other).expect("reduce"))
        });
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20).measurement_time(Duration::from_secs(2)).warm_up_time(Duration::from_millis(500));
    targets = schedule, reducer
}
criterion_main!(benches);
