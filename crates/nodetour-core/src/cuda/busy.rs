//! A compute-bound kernel, to measure collectives beside the compute they share a GPU with
//! (`nodetour perf --gpu --beside-compute`): each thread runs four independent chains of
//! fused multiply-adds in registers, touching no memory, like the inner loop of a GEMM. Its
//! source is compiled into the same module as [`super::reduce::SOURCE`].

/// The kernel's CUDA source.
pub const SOURCE: &str = r#"
extern "C" __global__ void nt_busy(float* sink, unsigned iters) {
    float a = threadIdx.x * 1e-3f, b = blockIdx.x * 1e-4f, c = 0.5f, d = 0.25f;
    const float m = 0.99999f, k = 1e-6f;
    for (unsigned i = 0; i < iters; i++) {
        a = fmaf(a, m, k); b = fmaf(b, m, k); c = fmaf(c, m, k); d = fmaf(d, m, k);
    }
    // Never true for these inputs, but the compiler cannot know: the loop stays.
    if (a + b + c + d == 1234.5f) sink[threadIdx.x] = a + b + c + d;
}
"#;

/// Threads per block of [`SOURCE`]'s kernel.
pub const BUSY_THREADS: u32 = 256;
