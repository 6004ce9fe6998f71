// Shared by the compat crates' programs (include!d): `CudaSlice<F8E4M3>`, `CudaSlice<u32>` and
// `CudaSlice<i16>` (candle's types that nodetour added, issue 49) allreduced on the GPU once.

use std::sync::Arc;

use nodetour::cudarc::driver::{CudaContext, CudaSlice, CudaStream, DeviceRepr};
use nodetour::{Element, float8::F8E4M3};

type R<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// The element types candle has that nodetour added for it allreduced on GPU 0 once, two
/// ranks as threads; `SKIP` without a GPU.
fn gpu_types() -> R<()> {
    // nodetour's probe first: cudarc's own loading panics where libcuda is absent.
    let ctx: Arc<CudaContext> = match nodetour::core::cuda::open_context(0) {
        Ok(ctx) => ctx,
        Err(e) => {
            println!("SKIP the GPU types: {e}");
            return Ok(());
        }
    };
    // Each rank's input: rank + 1 everywhere; the sum of two ranks: 3, exact in every type.
    let fp8 = sums::<F8E4M3>(&ctx, |r| F8E4M3::from_f32(r as f32 + 1.0))?;
    assert!(fp8.iter().all(|v| v.to_f32() == 3.0), "fp8 sums");
    let u = sums::<u32>(&ctx, |r| r as u32 + 1)?;
    assert!(u.iter().all(|v| *v == 3), "u32 sums");
    let i = sums::<i16>(&ctx, |r| r as i16 + 1)?;
    assert!(i.iter().all(|v| *v == 3), "i16 sums");
    println!("COMPAT GPU TYPES OK");
    Ok(())
}

/// Rank 0's result of an allreduce (sum) of 4099 elements of `T` over two ranks (threads) on
/// GPU 0, each rank's elements `value(rank)`.
fn sums<T: Element + DeviceRepr + Copy + PartialEq>(
    ctx: &Arc<CudaContext>,
    value: impl Fn(u32) -> T + Sync,
) -> R<Vec<T>> {
    let id = UniqueId::create().map_err(nodetour::Error::from)?;
    let results: Vec<R<Vec<T>>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..2u32)
            .map(|r| {
                let (id, value) = (&id, &value);
                s.spawn(move || -> R<Vec<T>> {
                    let comm = Communicator::from_unique_id(id, r, 2, Options::default())?;
                    let stream: Arc<CudaStream> = ctx.new_stream()?;
                    let mut x: CudaSlice<T> = stream.clone_htod(&vec![value(r); 4099])?;
                    comm.all_reduce_in_place(&mut x, ReduceOp::Sum, &stream)?;
                    let out = stream.clone_dtoh(&x)?;
                    comm.close(nodetour::Deadline::after(std::time::Duration::from_secs(
                        20,
                    )))?;
                    Ok(out)
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().expect("rank thread"))
            .collect()
    });
    let mut results = results.into_iter();
    let first = results.next().expect("two ranks")?;
    for other in results {
        assert!(other? == first, "the ranks' results differ");
    }
    Ok(first)
}
