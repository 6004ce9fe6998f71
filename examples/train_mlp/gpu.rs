//! The model on the GPU: cuBLAS matrix products and a few NVRTC kernels on a compute stream,
//! the gradient buckets averaged by nodetour on a communication stream (each bucket as soon as
//! its layer's backward pass has produced it, while the layer below runs), all through cudarc.

use std::sync::Arc;

use anyhow::Context as _;
use nodetour::cudarc::driver::{
    CudaContext, CudaFunction, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg,
};
use nodetour::cudarc::nvrtc::compile_ptx;
use nodetour::{Communicator, Host, ReduceOp};

use cudarc::cublas::{CudaBlas, Gemm, GemmConfig, sys::cublasOperation_t};

use super::Trained;
use super::model::{self, Params, Shape};

const KERNELS: &str = r#"
extern "C" __global__ void bias_relu(float* z, float* a, const float* b, int rows, int cols) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < rows * cols) { float v = z[i] + b[i % cols]; z[i] = v; a[i] = v > 0.f ? v : 0.f; }
}
extern "C" __global__ void bias_add(float* y, const float* b, int rows, int cols) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < rows * cols) { y[i] += b[i % cols]; }
}
extern "C" __global__ void mse_grad(float* dy, const float* y, const float* t, int n, float scale) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) { dy[i] = (y[i] - t[i]) * scale; }
}
extern "C" __global__ void relu_grad(float* d, const float* z, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n && z[i] <= 0.f) { d[i] = 0.f; }
}
extern "C" __global__ void col_sum(float* out, const float* m, int rows, int cols) {
    int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j < cols) { float s = 0.f; for (int r = 0; r < rows; r++) { s += m[r * cols + j]; } out[j] = s; }
}
extern "C" __global__ void sgd(float* w, const float* g, int n, float lr) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) { w[i] -= lr * g[i]; }
}
"#;

/// The kernels, loaded once.
struct Kernels {
    bias_relu: CudaFunction,
    bias_add: CudaFunction,
    mse_grad: CudaFunction,
    relu_grad: CudaFunction,
    col_sum: CudaFunction,
    sgd: CudaFunction,
}

impl Kernels {
    fn load(ctx: &Arc<CudaContext>) -> anyhow::Result<Kernels> {
        let module = ctx.load_module(compile_ptx(KERNELS).context("NVRTC")?)?;
        let f = |name: &str| module.load_function(name);
        Ok(Kernels {
            bias_relu: f("bias_relu")?,
            bias_add: f("bias_add")?,
            mse_grad: f("mse_grad")?,
            relu_grad: f("relu_grad")?,
            col_sum: f("col_sum")?,
            sgd: f("sgd")?,
        })
    }
}

/// Row-major `c (m x n) = op(a) op(b)`, `op` transposing where `ta` / `tb`; `a`'s and `b`'s
/// buffers are row-major with `lda` / `ldb` columns. (cuBLAS is column-major: it computes
/// `cᵀ = op(b)ᵀ op(a)ᵀ`, and a row-major buffer is its transpose in column-major terms.)
#[allow(clippy::too_many_arguments)]
fn gemm(
    blas: &CudaBlas,
    (ta, tb): (bool, bool),
    (m, n, k): (usize, usize, usize),
    a: &impl DevicePtr<f32>,
    lda: usize,
    b: &impl DevicePtr<f32>,
    ldb: usize,
    c: &mut impl DevicePtrMut<f32>,
) -> anyhow::Result<()> {
    let op = |t| {
        if t {
            cublasOperation_t::CUBLAS_OP_T
        } else {
            cublasOperation_t::CUBLAS_OP_N
        }
    };
    let cfg = GemmConfig {
        transa: op(tb),
        transb: op(ta),
        m: n as i32,
        n: m as i32,
        k: k as i32,
        alpha: 1.0f32,
        lda: ldb as i32,
        ldb: lda as i32,
        beta: 0.0f32,
        ldc: n as i32,
    };
    // SAFETY: every buffer holds the elements its dimensions and leading dimension name
    // (allocated from `Shape` and the batch below), on the handle's stream.
    unsafe { blas.gemm(cfg, b, a, c) }?;
    Ok(())
}

fn grid(n: usize) -> LaunchConfig {
    LaunchConfig::for_num_elems(n as u32)
}

/// Trains on this rank's GPU (`comm.local_rank()` among the GPUs here).
pub(crate) fn train(
    comm: &Communicator,
    s: Shape,
    p: Params,
    x: &[f32],
    t: &[f32],
    steps: usize,
    lr: f32,
) -> anyhow::Result<Trained> {
    let gpus = nodetour::core::cuda::gpus()?.len().max(1);
    let ctx = CudaContext::new(comm.local_rank() as usize % gpus)?;
    let (compute, comms): (Arc<CudaStream>, Arc<CudaStream>) =
        (ctx.new_stream()?, ctx.new_stream()?);
    let k = Kernels::load(&ctx)?;
    let blas = CudaBlas::new(compute.clone())?;
    let b = x.len() / s.d_in;
    let (d, h, o) = (s.d_in, s.hidden, s.d_out);
    let (x, t) = (compute.clone_htod(x)?, compute.clone_htod(t)?);
    let (mut w1, mut b1) = (compute.clone_htod(&p.w1)?, compute.clone_htod(&p.b1)?);
    let (mut w2, mut b2) = (compute.clone_htod(&p.w2)?, compute.clone_htod(&p.b2)?);
    let mut z1 = compute.alloc_zeros::<f32>(b * h)?;
    let mut a1 = compute.alloc_zeros::<f32>(b * h)?;
    let mut y = compute.alloc_zeros::<f32>(b * o)?;
    let mut dy = compute.alloc_zeros::<f32>(b * o)?;
    let mut da1 = compute.alloc_zeros::<f32>(b * h)?;
    let mut grad2 = compute.alloc_zeros::<f32>(h * o + o)?; // bucket 1: dW2, db2
    let mut grad1 = compute.alloc_zeros::<f32>(d * h + h)?; // bucket 2: dW1, db1
    let (bi, hi, oi) = (b as i32, h as i32, o as i32);
    let mut loss = (0.0, 0.0);
    let average = ReduceOp::pre_mul_sum(1.0 / f64::from(comm.world()));
    for step in 0..steps {
        // Forward.
        gemm(&blas, (false, false), (b, h, d), &x, d, &w1, h, &mut z1)?;
        let mut l = compute.launch_builder(&k.bias_relu);
        l.arg(&mut z1).arg(&mut a1).arg(&b1).arg(&bi).arg(&hi);
        // SAFETY: the kernel's arguments are the buffers and sizes it is written for.
        unsafe { l.launch(grid(b * h)) }?;
        gemm(&blas, (false, false), (b, o, h), &a1, h, &w2, o, &mut y)?;
        let mut l = compute.launch_builder(&k.bias_add);
        l.arg(&mut y).arg(&b2).arg(&bi).arg(&oi);
        // SAFETY: as above.
        unsafe { l.launch(grid(b * o)) }?;
        if step == 0 || step + 1 == steps {
            let mut l = [model::loss(
                &compute.clone_dtoh(&y)?,
                &compute.clone_dtoh(&t)?,
                b,
            )];
            comm.all_reduce_in_place(&mut l, ReduceOp::Avg, Host)?;
            *(if step == 0 { &mut loss.0 } else { &mut loss.1 }) = l[0];
        }
        // Backward, layer 2: its bucket goes to the communication stream at once.
        let (n_out, scale) = ((b * o) as i32, 1.0f32 / b as f32);
        let mut l = compute.launch_builder(&k.mse_grad);
        l.arg(&mut dy).arg(&y).arg(&t).arg(&n_out).arg(&scale);
        // SAFETY: as above.
        unsafe { l.launch(grid(b * o)) }?;
        gemm(
            &blas,
            (true, false),
            (h, o, b),
            &a1,
            h,
            &dy,
            o,
            &mut grad2.slice_mut(..h * o),
        )?;
        let mut db2 = grad2.slice_mut(h * o..);
        let mut l = compute.launch_builder(&k.col_sum);
        l.arg(&mut db2).arg(&dy).arg(&bi).arg(&oi);
        // SAFETY: as above.
        unsafe { l.launch(grid(o)) }?;
        gemm(&blas, (false, true), (b, h, o), &dy, o, &w2, o, &mut da1)?;
        comms.join(&compute)?;
        // The average: every rank's gradients multiplied by 1 / world as the reduction first
        // reads them (PreMulSum), no scaling pass of their own.
        comm.all_reduce_in_place(&mut grad2, average, &comms)?;
        // Layer 1, while bucket 1 is averaged.
        let n_hidden = (b * h) as i32;
        let mut l = compute.launch_builder(&k.relu_grad);
        l.arg(&mut da1).arg(&z1).arg(&n_hidden);
        // SAFETY: as above.
        unsafe { l.launch(grid(b * h)) }?;
        gemm(
            &blas,
            (true, false),
            (d, h, b),
            &x,
            d,
            &da1,
            h,
            &mut grad1.slice_mut(..d * h),
        )?;
        let mut db1 = grad1.slice_mut(d * h..);
        let mut l = compute.launch_builder(&k.col_sum);
        l.arg(&mut db1).arg(&da1).arg(&bi).arg(&hi);
        // SAFETY: as above.
        unsafe { l.launch(grid(h)) }?;
        comms.join(&compute)?;
        comm.all_reduce_in_place(&mut grad1, average, &comms)?;
        // The step waits for both buckets.
        compute.join(&comms)?;
        for (w, g) in [
            (&mut w2, grad2.slice(..h * o)),
            (&mut b2, grad2.slice(h * o..)),
            (&mut w1, grad1.slice(..d * h)),
            (&mut b1, grad1.slice(d * h..)),
        ] {
            let n = g.len() as i32;
            let mut l = compute.launch_builder(&k.sgd);
            l.arg(w).arg(&g).arg(&n).arg(&lr);
            // SAFETY: `w` and `g` hold `n` elements.
            unsafe { l.launch(grid(n as usize)) }?;
        }
    }
    comm.wait(nodetour::Deadline::after(std::time::Duration::from_secs(
        60,
    )))?;
    let params = Params {
        w1: compute.clone_dtoh(&w1)?,
        b1: compute.clone_dtoh(&b1)?,
        w2: compute.clone_dtoh(&w2)?,
        b2: compute.clone_dtoh(&b2)?,
    };
    Ok(Trained { params, loss })
}
