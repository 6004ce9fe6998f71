// A host-memory allreduce of two ranks (threads over tcp on loopback) through nodetour, in a
// graph whose cudarc has another crate's features: it builds, and it runs where CUDA is absent;
// where a GPU is, the added element types on device memory too (gpu_types.rs).

use nodetour::{Communicator, Host, Options, ReduceOp, UniqueId};

include!("../../gpu_types.rs");

fn main() -> R<()> {
    let id = UniqueId::create().map_err(nodetour::Error::from)?;
    let sums: Vec<nodetour::Result<Vec<i64>>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..2u32)
            .map(|r| {
                let id = &id;
                s.spawn(move || {
                    let comm = Communicator::from_unique_id(id, r, 2, Options::default())?;
                    let mut x: Vec<i64> = (0..1000).map(|i| i * (i64::from(r) + 1)).collect();
                    comm.all_reduce_in_place(&mut x, ReduceOp::Sum, Host)?;
                    Ok(x)
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().expect("rank thread"))
            .collect()
    });
    for (r, got) in sums.into_iter().enumerate() {
        let got = got?;
        let want: Vec<i64> = (0..1000).map(|i| 3 * i).collect();
        assert_eq!(got, want, "rank {r}");
    }
    gpu_types()?;
    println!("COMPAT OK {}", env!("CARGO_PKG_NAME"));
    Ok(())
}
