//! The one-process host ring on typed buffers: `Vec<f32>`, `Vec<bf16>`, `Vec<i64>` go in as they
//! are (the element type names the data type); results are exact and identical on every rank.

use crate::host::HostRingOptions;
use crate::local::LocalRing;
use crate::reduce::ReduceOp;
use half::bf16;

fn ring(world: u32, max_bytes: usize) -> LocalRing {
    let options = HostRingOptions {
        slot_bytes: 4096,
        slots: 2,
        ..HostRingOptions::default()
    };
    LocalRing::new(world, max_bytes, options).unwrap()
}

#[test]
fn typed_buffers_reduce_exactly_and_identically_on_every_rank() {
    let world = 3u32;
    let count = 10_007; // several chunks, not a multiple of anything
    let mut r = ring(world, count * 8);

    // f32 sum of small integers: exact.
    let mut f: Vec<Vec<f32>> = (0..world)
        .map(|k| (0..count).map(|i| ((i + k as usize) % 17) as f32).collect())
        .collect();
    r.all_reduce_in_place(&mut f, ReduceOp::Sum).unwrap();
    for (i, got) in f[0].iter().enumerate() {
        let want: f32 = (0..world as usize).map(|k| ((i + k) % 17) as f32).sum();
        assert_eq!(*got, want, "f32 element {i}");
    }
    assert!(f.iter().all(|v| v == &f[0]), "f32: every rank the same");

    // bf16 max.
    let mut b: Vec<Vec<bf16>> = (0..world)
        .map(|k| {
            (0..count)
                .map(|i| bf16::from_f32(((i * 3 + k as usize) % 29) as f32))
                .collect()
        })
        .collect();
    r.all_reduce_in_place(&mut b, ReduceOp::Max).unwrap();
    for (i, got) in b[0].iter().enumerate() {
        let want = (0..world as usize)
            .map(|k| ((i * 3 + k) % 29) as f32)
            .fold(f32::MIN, f32::max);
        assert_eq!(*got, bf16::from_f32(want), "bf16 element {i}");
    }
    assert!(
        b.iter()
            .all(|v| v.iter().zip(&b[0]).all(|(x, y)| x.to_bits() == y.to_bits())),
        "bf16: every rank bit for bit the same"
    );

    // i64 sum beyond 32 bits.
    let mut n: Vec<Vec<i64>> = (0..world)
        .map(|k| (0..count).map(|i| (i as i64) << 33 | k as i64).collect())
        .collect();
    r.all_reduce_in_place(&mut n, ReduceOp::Sum).unwrap();
    for (i, got) in n[0].iter().enumerate() {
        let want: i64 = (0..world as i64).map(|k| (i as i64) << 33 | k).sum();
        assert_eq!(*got, want, "i64 element {i}");
    }
    assert!(n.iter().all(|v| v == &n[0]));
}
