//! The one-kernel allreduces of ranks on one host (one GPU each): their CUDA source (compiled
//! into the same module as [`super::reduce::SOURCE`], which defines the element types and
//! operations they use) and their argument block.
//!
//! One launch is a whole collective. Every rank owns a **scratch** allocation (two halves, by
//! the parity of the collective) and a **signal page**, both mapped by every other rank of the
//! host. The grid is a constant, [`ONE_SHOT_BLOCKS`], so every rank cuts the elements alike,
//! and block `b` of a rank meets only block `b` of its peers: at a barrier it stores its
//! **arrival word** into word `(rank, b)` of every peer's signal page (after a system-wide
//! fence: whoever sees the word sees what the block wrote before), and waits until word
//! `(peer, b)` of its own page reached `tick` for every peer — polling the rank's stop word and
//! the global timer between reads, so an abort or a deadline ends the wait, latched into the
//! block's word of the rank's status page (see [`status`]; the peer in bits 8..16, the
//! collective's number on this GPU in bits 16..32; the first failure stays).
//!
//! The arrival word is `tick` (16 bits: ranks are never more than one barrier apart), a
//! withdrawn bit, the collective's number on this GPU (15 bits) and the descriptor's digest
//! mixed with that number. A peer at this tick must carry this collective's number and digest
//! (else a disagreement); a peer already one tick ahead must be in the same collective (the
//! same number and digest, and this barrier not the launch's last) or in the next one (and
//! this barrier the last): any other word fails, so no arrival of another collective is ever
//! taken on trust.
//!
//! **A failure ends the rank.** A block that fails a barrier writes nothing more and sets the
//! rank's stop word itself ([`STOP_ONE_KERNEL`]), and every launch reads the stop word at its
//! start, before it writes anything: a rank whose barrier failed (its sequence words not
//! advanced) never arrives anywhere again, so no launch queued behind the failed one — eager or
//! a graph replay — reuses its tick and its half, where a late peer would pair its collective
//! with this rank's next one (`tests/one_kernel_model.rs` models it). A block that fails after
//! it arrived **takes its arrival back** (the withdrawn bit) before its kernel ends: the caller
//! may then reuse its buffer (a symmetric buffer, which peers read in place), and a late peer
//! must never pass a barrier on an arrival whose rank is gone.
//!
//! **One launch at a time per rank.** Each block claims its sequence words at the start of a
//! launch (an atomic, released at its end): the communicator queues its eager collectives on
//! one stream in call order, but a CUDA graph replay runs where the caller launches it, and
//! a replay that runs beside another of the rank's launches fails at its start (status
//! [`status::CONCURRENT`]) before it writes anything, rather than share a tick and a half.
//!
//! - **One-shot**: block `b` copies its slice of the caller's input into this rank's scratch
//!   half, meets its peers, and reduces the slice from every rank's half **in rank order**
//!   0, 1, …, world − 1 (halves and bfloat16 widened to f32 and rounded after each step, like
//!   the host reducer) into the output: every rank computes bitwise the same result.
//! - **Two-shot** (more ranks, larger sizes): the elements in `world` segments, block `b`
//!   owning sub-slice `b` of each. It copies its sub-slices in, meets its peers, reduces
//!   sub-slice `b` of segment `rank` (rank order) in place in this rank's half, meets its peers
//!   again, and gathers sub-slice `b` of every segment from the rank that reduced it. Each
//!   segment is reduced once, so again every rank holds the same bytes; each rank reads
//!   `2 (world − 1) / world` of the buffer from its peers instead of `world − 1`.
//!
//! - **Symmetric buffers** (`transport::one_kernel::OneKernel::symmetric_create`): the
//!   two-shot kernel in place on buffers every rank mapped, read directly (no copy in, one
//!   half), with a third barrier at its end: the caller may write its buffer as soon as the
//!   kernel ended, so every peer must have finished reading it.
//!
//! Each block's **sequence words** (this GPU's memory: the last barrier tick, and the
//! collectives it has run) are read at the start of a launch and advanced at its end by the
//! kernel itself, so a CUDA graph replay is the next collective like an eager launch.
//!
//! Why two halves suffice: a rank writes half `calls & 1` of collective `calls` only after its
//! block passed the first barrier of `calls`, for which every peer's block `b` had started
//! `calls`, so every peer's launch of `calls − 2` (stream-ordered before it) had finished
//! reading that half.

use super::reduce::NtScale;

/// The most ranks the one-kernel path takes (the signal and scratch tables of the launch).
pub const ONE_SHOT_MAX_RANKS: usize = 8;
/// Blocks per launch (of 512 threads): a constant, so every rank cuts the elements alike; the
/// SMs the collective occupies while it runs.
pub const ONE_SHOT_BLOCKS: u32 = 32;
/// Threads per block.
pub const ONE_SHOT_THREADS: u32 = 512;
/// Bytes of a rank's sequence words: per block, the last tick, the collectives run, and the
/// claim of the launch running.
pub const SEQUENCE_BYTES: usize = 12 * ONE_SHOT_BLOCKS as usize;
/// With more than two ranks, allreduces above this many bytes take the two-shot kernel (a
/// constant: every rank chooses alike). Two ranks always take the one-shot kernel, which reads
/// as much from the peer and meets it once instead of twice.
pub const TWO_SHOT_ABOVE: usize = 256 << 10;

/// A launch's arguments, passed by value (the layout of `struct OneShot` in [`SOURCE`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct OneShotArgs {
    /// Each rank's scratch (both halves), as mapped in this process.
    pub scratch: [u64; ONE_SHOT_MAX_RANKS],
    /// Each rank's signal page, as mapped in this process.
    pub signals: [u64; ONE_SHOT_MAX_RANKS],
    pub input: u64,
    pub output: u64,
    /// Elements.
    pub count: u64,
    /// Bytes per scratch half.
    pub half: u64,
    /// This rank's sequence words (this GPU's memory): [`ONE_SHOT_BLOCKS`] `u32` barrier ticks,
    /// then as many collective counts, then as many claims.
    pub counters: u64,
    /// The rank's stop word (host memory mapped into the GPU).
    pub stop: u64,
    /// The rank's status page (host memory mapped into the GPU): one word per block, 64 bytes
    /// apart.
    pub status: u64,
    /// How long a block waits for a peer before it gives up.
    pub timeout_ns: u64,
    pub world: u32,
    pub rank: u32,
    /// The collective's descriptor digest (every rank must pass the same).
    pub digest: u32,
    /// Divide the sum by `world` (`Avg`).
    pub average: u32,
    /// In place on a symmetric buffer (`scratch` are the ranks' buffers, one half, no copy in;
    /// two-shot only, with a barrier at the end).
    pub symmetric: u32,
    /// A PreMulSum: this rank's values are multiplied by `scale` as they are copied in (in
    /// place on a symmetric buffer, before the first barrier), then summed.
    pub premul: u32,
    /// The PreMulSum's scalar (`NtScale`).
    pub scale: NtScale,
}

// SAFETY: `repr(C)` plain data of the layout of the kernels' `struct OneShot`, passed by value.
unsafe impl cudarc::driver::DeviceRepr for OneShotArgs {}

/// What a block whose barrier failed stores into its rank's stop word (the host's abort stores
/// 1, a guarded wait that timed out [`crate::transport::gpu::STOP_TIMED_OUT`]).
pub const STOP_ONE_KERNEL: u32 = 3;

/// Status codes a block latches (low byte of its status word; the peer in bits 8..16, the
/// collective's number on this GPU, modulo 2^16, in bits 16..32).
pub mod status {
    /// The rank's stop word was set while the block waited.
    pub const ABORTED: u32 = 1;
    /// A peer did not arrive before the deadline.
    pub const TIMEOUT: u32 = 2;
    /// A peer arrived with another descriptor digest (or as another collective).
    pub const DISAGREEMENT: u32 = 3;
    /// Another launch of this rank's one-kernel collectives ran at the same time (a graph
    /// replay not ordered against the communicator's other collectives).
    pub const CONCURRENT: u32 = 4;
    /// A peer took its arrival back: it failed at this barrier after arriving.
    pub const PEER_GAVE_UP: u32 = 5;
}

/// The kernels' CUDA source (appended to [`super::reduce::SOURCE`]).
pub const SOURCE: &str = r#"
#define NT_ONE_MAX_RANKS 8
#define NT_STOP_ONE_KERNEL 3u
struct OneShot {
    u64 scratch[NT_ONE_MAX_RANKS];
    u64 signals[NT_ONE_MAX_RANKS];
    u64 input, output, count, half, counters, stop, status, timeout_ns;
    unsigned world, rank, digest, average, symmetric, premul;
    NtScale scale;
};
// 16 bytes from memory another GPU writes: from L2 (or the peer), never a stale L1 line.
__device__ __forceinline__ v16 nt_ld_cg(const v16* p) {
    v16 r; asm volatile("ld.global.cg.v2.u64 {%0, %1}, [%2];" : "=l"(r.a), "=l"(r.b) : "l"(p)); return r;
}
// One element from memory another GPU writes (as above).
template<class T> __device__ __forceinline__ T nt_ld1(const T* p) {
    union { T t; unsigned char c; unsigned short s; unsigned u; u64 l; } x;
    if (sizeof(T) == 1) { unsigned v; asm volatile("ld.global.cg.u8 %0, [%1];" : "=r"(v) : "l"(p)); x.c = (unsigned char)v; }
    else if (sizeof(T) == 2) { unsigned short v; asm volatile("ld.global.cg.u16 %0, [%1];" : "=h"(v) : "l"(p)); x.s = v; }
    else if (sizeof(T) == 4) { asm volatile("ld.global.cg.u32 %0, [%1];" : "=r"(x.u) : "l"(p)); }
    else { asm volatile("ld.global.cg.u64 %0, [%1];" : "=l"(x.l) : "l"(p)); }
    return x.t;
}
// The digest a rank's arrival carries: the descriptor's, mixed with the collective's number
// (its sequence words), so an arrival of another collective at the same tick never matches.
__device__ __forceinline__ unsigned nt_arrival_digest(const OneShot& a, unsigned calls) {
    return a.digest ^ (calls * 0x9e3779b1u);
}
// The arrival word: tick (16 bits), withdrawn (1), the collective's number (15), digest (32).
#define NT_WITHDRAWN (1ull << 47)
__device__ __forceinline__ u64 nt_arrival_word(const OneShot& a, unsigned tick, unsigned calls) {
    return ((u64)(tick & 0xffffu) << 48) | ((u64)(calls & 0x7fffu) << 32) | nt_arrival_digest(a, calls);
}
// Whether a peer's word `v` lets this block pass its barrier at `tick` of collective `calls`
// (0), makes it wait (-1), or fails it (a status code). `last`: this is the launch's last
// barrier.
__device__ __forceinline__ int nt_judge(u64 v, u64 mine, unsigned tick, unsigned calls, bool last) {
    const short ahead = (short)((unsigned short)(v >> 48) - (unsigned short)tick);
    if (ahead < 0) return -1;
    const bool withdrawn = (v & NT_WITHDRAWN) != 0;
    const unsigned peer_calls = (unsigned)(v >> 32) & 0x7fffu;
    // The collective's number and digest (bits 0..47), whatever the tick.
    const bool same = ((v ^ mine) & ((1ull << 47) - 1)) == 0;
    if (ahead == 0) return withdrawn ? 5 : same ? 0 : 3;
    // One tick ahead: the peer passed this barrier (it saw this block's arrival) and is at
    // the next barrier of this collective, or at the first of the next collective.
    if (ahead == 1 && same && !last) return 0;
    if (ahead == 1 && last && peer_calls == ((calls + 1) & 0x7fffu)) return 0;
    return 3;
}
// Thread 0 of a block: arrive at every peer, then wait for every peer's arrival at `tick`
// (or the stop word, or the deadline). Returns the status code (0: every peer arrived);
// `*arrived`: this block's arrival was stored.
__device__ unsigned nt_one_barrier(const OneShot& a, unsigned tick, unsigned calls, bool last, unsigned* who, bool* arrived) {
    const unsigned G = gridDim.x, b = blockIdx.x;
    const u64 word = nt_arrival_word(a, tick, calls);
    *arrived = false;
    // A stopped rank (aborted: its communicator is broken) arrives nowhere, even in a graph
    // replayed after the abort, and writes nothing.
    if (*(const volatile unsigned*)a.stop) { *who = a.rank; return 1; }
    for (unsigned r = 0; r < a.world; r++)
        if (r != a.rank) *(volatile u64*)(a.signals[r] + 8ull * ((u64)a.rank * G + b)) = word;
    *arrived = true;
    const u64 t0 = nt_now();
    for (unsigned r = 0; r < a.world; r++) {
        if (r == a.rank) continue;
        const volatile u64* w = (const volatile u64*)(a.signals[a.rank] + 8ull * ((u64)r * G + b));
        for (unsigned i = 0;; i++) {
            const int j = nt_judge(*w, word, tick, calls, last);
            if (j == 0) break;
            if (j > 0) { *who = r; return (unsigned)j; }
            if ((i & 63) == 63) {
                if (*(const volatile unsigned*)a.stop) { *who = r; return 1; }
                if (nt_now() - t0 > a.timeout_ns) { *who = r; return 2; }
            }
            if (i > 256) nt_pause();
        }
    }
    return 0;
}
// Thread 0 of a block that failed after arriving: takes the arrival back at every peer
// (before the kernel ends and the caller may reuse its buffer), so no late peer passes on it.
__device__ void nt_withdraw(const OneShot& a, unsigned tick, unsigned calls) {
    const unsigned G = gridDim.x, b = blockIdx.x;
    const u64 gone = nt_arrival_word(a, tick, calls) | NT_WITHDRAWN;
    for (unsigned r = 0; r < a.world; r++)
        if (r != a.rank) *(volatile u64*)(a.signals[r] + 8ull * ((u64)a.rank * G + b)) = gone;
    __threadfence_system();
}
// Thread 0: latches `code` into the block's status word unless an earlier failure is there
// (the first failure names the cause), and ends the rank: its stop word set, every later
// launch of this rank returns before it writes or arrives anywhere.
__device__ void nt_one_fail(const OneShot& a, unsigned code, unsigned who, unsigned calls) {
    volatile unsigned* st = (volatile unsigned*)(a.status + 64ull * blockIdx.x);
    if (*st == 0) *st = code | (who << 8) | (calls << 16);
    volatile unsigned* stop = (volatile unsigned*)a.stop;
    if (*stop == 0) *stop = NT_STOP_ONE_KERNEL;
    __threadfence_system();
}
// Every thread of the block: what it wrote is visible system-wide, then the block's barrier
// with every peer's block of the same index at `tick`; whether every peer arrived (else the
// block's status word says why, the rank is stopped, and the block must stop).
__device__ bool nt_sync_peers(const OneShot& a, unsigned tick, unsigned calls, bool last) {
    __shared__ unsigned s_ok;
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned who = 0;
        bool arrived = false;
        const unsigned code = nt_one_barrier(a, tick, calls, last, &who, &arrived);
        __threadfence_system();
        s_ok = code == 0;
        if (code && arrived) nt_withdraw(a, tick, calls);
        if (code) nt_one_fail(a, code, who, calls);
    }
    __syncthreads();
    return s_ok != 0;
}
// d[lo..hi) = s[lo..hi) (lo a multiple of the 16-byte lanes; `vec`: both 16-byte aligned).
template<class T> __device__ void nt_copy_range(T* d, const T* s, u64 lo, u64 hi, bool vec) {
    const unsigned lanes = 16 / sizeof(T);
    // An empty range (a block past the end of its segment can have hi < lo): nothing, not the
    // tail below hi, which another block owns.
    if (hi <= lo) return;
    u64 i0 = lo;
    if (vec) {
        for (u64 v = lo / lanes + threadIdx.x; v < hi / lanes; v += blockDim.x) ((v16*)d)[v] = nt_ld_cg((const v16*)s + v);
        i0 = hi / lanes * lanes;
    }
    for (u64 i = i0 + threadIdx.x; i < hi; i += blockDim.x) d[i] = nt_ld1(s + i);
}
// d[lo..hi) = scalar · s[lo..hi) (a PreMulSum's copy in; d may be s), as nt_copy_range.
template<class T> __device__ void nt_scale_range(T* d, const T* s, u64 lo, u64 hi, bool vec, const NtScale& k) {
    const unsigned lanes = 16 / sizeof(T);
    union Lanes { v16 v; T t[16 / sizeof(T)]; };
    if (hi <= lo) return;
    u64 i0 = lo;
    if (vec) {
        for (u64 v = lo / lanes + threadIdx.x; v < hi / lanes; v += blockDim.x) {
            Lanes x;
            x.v = nt_ld_cg((const v16*)s + v);
#pragma unroll
            for (unsigned j = 0; j < lanes; j++) x.t[j] = nt_mul(x.t[j], k);
            ((v16*)d)[v] = x.v;
        }
        i0 = hi / lanes * lanes;
    }
    for (u64 i = i0 + threadIdx.x; i < hi; i += blockDim.x) d[i] = nt_mul(nt_ld1(s + i), k);
}
// This rank's input into its scratch: copied, or multiplied by a PreMulSum's scalar.
template<class T> __device__ __forceinline__ void nt_copy_in(const OneShot& a, T* d, const T* s, u64 lo, u64 hi, bool vec) {
    if (a.premul) nt_scale_range(d, s, lo, hi, vec, a.scale);
    else nt_copy_range(d, s, lo, hi, vec);
}
// d[lo..hi) = the fold of every rank's scratch half over [lo..hi) in rank order 0..world-1
// (then divided by world for Avg): the same bytes whichever rank computes it.
template<class T, class Op> __device__ void nt_reduce_range(T* d, const OneShot& a, u64 half, u64 lo, u64 hi, bool vec) {
    const unsigned lanes = 16 / sizeof(T), W = a.world;
    union Lanes { v16 v; T t[16 / sizeof(T)]; };
    // An empty range: nothing (the two-shot kernel reduces in place, so a tail reduced by two
    // blocks would count the peers twice).
    if (hi <= lo) return;
    u64 i0 = lo;
    if (vec) {
        for (u64 v = lo / lanes + threadIdx.x; v < hi / lanes; v += blockDim.x) {
            Lanes acc, x;
            acc.v = nt_ld_cg((const v16*)(a.scratch[0] + half) + v);
            for (unsigned r = 1; r < W; r++) {
                x.v = nt_ld_cg((const v16*)(a.scratch[r] + half) + v);
#pragma unroll
                for (unsigned k = 0; k < lanes; k++) acc.t[k] = combine<Op>(acc.t[k], x.t[k]);
            }
            if (a.average) {
#pragma unroll
                for (unsigned k = 0; k < lanes; k++) acc.t[k] = divide(acc.t[k], W);
            }
            ((v16*)d)[v] = acc.v;
        }
        i0 = hi / lanes * lanes;
    }
    for (u64 i = i0 + threadIdx.x; i < hi; i += blockDim.x) {
        T acc = nt_ld1((const T*)(a.scratch[0] + half) + i);
        for (unsigned r = 1; r < W; r++) acc = combine<Op>(acc, nt_ld1((const T*)(a.scratch[r] + half) + i));
        if (a.average) acc = divide(acc, W);
        d[i] = acc;
    }
}
__device__ __forceinline__ u64 nt_round_up(u64 x, u64 m) { return (x + m - 1) / m * m; }
// This block's sequence words: the last barrier tick, the collectives run, and the claim of
// the launch running. Thread 0 claims them at the start (an atomic: a second launch of this
// rank running at once fails here, writing nothing), reads them, and at the end (only when
// every barrier passed) advances and releases them. `stopped`: the rank's stop word was set
// before this launch wrote anything (an abort, or a failed barrier of an earlier launch), or
// the claim was taken: the launch must return at once, writing nothing and arriving nowhere.
struct NtSeq { unsigned tick, calls, stopped; };
__device__ NtSeq nt_seq_begin(const OneShot& a) {
    __shared__ NtSeq s;
    if (threadIdx.x == 0) {
        unsigned* claim = (unsigned*)a.counters + 2 * gridDim.x + blockIdx.x;
        s.calls = ((volatile unsigned*)a.counters)[gridDim.x + blockIdx.x] + 1;
        s.stopped = *(const volatile unsigned*)a.stop != 0;
        if (s.stopped) {
            nt_one_fail(a, 1, a.rank, s.calls);
        } else if (atomicCAS(claim, 0u, 1u) != 0u) {
            // Another launch of this rank holds the words: a replay beside another collective.
            s.stopped = 1;
            nt_one_fail(a, 4, a.rank, s.calls);
        } else {
            __threadfence();
            s.tick = ((volatile unsigned*)a.counters)[blockIdx.x];
            s.calls = ((volatile unsigned*)a.counters)[gridDim.x + blockIdx.x] + 1;
        }
    }
    __syncthreads();
    return s;
}
__device__ void nt_seq_end(const OneShot& a, NtSeq s) {
    __syncthreads();
    if (threadIdx.x == 0) {
        ((volatile unsigned*)a.counters)[blockIdx.x] = s.tick;
        ((volatile unsigned*)a.counters)[gridDim.x + blockIdx.x] = s.calls;
        __threadfence();
        atomicExch((unsigned*)a.counters + 2 * gridDim.x + blockIdx.x, 0u);
    }
}
// One-shot: block b copies its slice of the input into this rank's scratch half, meets every
// peer's block b, and reduces the slice from every rank's half into the output.
template<class T, class Op> __device__ void one_shot(const OneShot& a) {
    const unsigned lanes = 16 / sizeof(T), G = gridDim.x, b = blockIdx.x;
    const u64 per = nt_round_up((a.count + G - 1) / G, lanes);
    const u64 lo = min(a.count, (u64)b * per), hi = min(a.count, lo + per);
    const bool vec = ((a.input | a.output) & 15) == 0;
    NtSeq s = nt_seq_begin(a);
    if (s.stopped) return;
    const u64 half = (u64)(s.calls & 1) * a.half;
    nt_copy_in(a, (T*)(a.scratch[a.rank] + half), (const T*)a.input, lo, hi, vec);
    if (!nt_sync_peers(a, ++s.tick, s.calls, true)) return;
    nt_reduce_range<T, Op>((T*)a.output, a, half, lo, hi, vec);
    nt_seq_end(a, s);
}
// Two-shot: the elements in `world` segments; block b owns sub-slice b of every segment. It
// copies its sub-slices of the input into this rank's half, meets the peers, reduces sub-slice
// b of segment `rank` from every rank's half into this rank's half (in place: no peer reads it
// before the next barrier), meets the peers again, and gathers sub-slice b of every segment
// from the rank that reduced it into the output. Each segment is reduced once, in rank order.
template<class T, class Op> __device__ void two_shot(const OneShot& a) {
    const unsigned lanes = 16 / sizeof(T), G = gridDim.x, b = blockIdx.x, W = a.world;
    const u64 seg = nt_round_up((a.count + W - 1) / W, lanes);
    const u64 sub = nt_round_up((seg + G - 1) / G, lanes);
    const bool vec = ((a.input | a.output) & 15) == 0;
    NtSeq s = nt_seq_begin(a);
    if (s.stopped) return;
    // Symmetric buffers: the ranks' own buffers are the scratch (one half, in place).
    const u64 half = a.symmetric ? 0 : (u64)(s.calls & 1) * a.half;
    T* mine = (T*)(a.scratch[a.rank] + half);
    // (On a symmetric buffer a PreMulSum multiplies this rank's sub-slices in place: no peer
    // reads them before the barrier below.)
    for (unsigned q = 0; q < W && (!a.symmetric || a.premul); q++) {
        const u64 lo = min(a.count, q * seg + b * sub), hi = min(min(a.count, (q + 1) * seg), lo + sub);
        nt_copy_in(a, mine, a.symmetric ? (const T*)mine : (const T*)a.input, lo, hi, vec);
    }
    if (!nt_sync_peers(a, ++s.tick, s.calls, false)) return;
    {
        const u64 lo = min(a.count, a.rank * seg + b * sub), hi = min(min(a.count, (a.rank + 1) * seg), lo + sub);
        nt_reduce_range<T, Op>(mine, a, half, lo, hi, true);
    }
    if (!nt_sync_peers(a, ++s.tick, s.calls, !a.symmetric)) return;
    for (unsigned q = 0; q < W; q++) {
        if (a.symmetric && q == a.rank) continue; // reduced in place already
        const u64 lo = min(a.count, q * seg + b * sub), hi = min(min(a.count, (q + 1) * seg), lo + sub);
        nt_copy_range((T*)a.output, (const T*)(a.scratch[q] + half), lo, hi, vec);
    }
    // Symmetric buffers have no second half: the caller may write its buffer as soon as this
    // kernel ends, so every peer must have finished reading this rank's segment first.
    if (a.symmetric && !nt_sync_peers(a, ++s.tick, s.calls, true)) return;
    nt_seq_end(a, s);
}
#define ONE_SHOT(T, N) \
extern "C" __global__ void nt_one_shot_##N##_sum(OneShot a) { one_shot<T, Sum>(a); } \
extern "C" __global__ void nt_one_shot_##N##_prod(OneShot a) { one_shot<T, Prod>(a); } \
extern "C" __global__ void nt_one_shot_##N##_min(OneShot a) { one_shot<T, Min>(a); } \
extern "C" __global__ void nt_one_shot_##N##_max(OneShot a) { one_shot<T, Max>(a); } \
extern "C" __global__ void nt_two_shot_##N##_sum(OneShot a) { two_shot<T, Sum>(a); } \
extern "C" __global__ void nt_two_shot_##N##_prod(OneShot a) { two_shot<T, Prod>(a); } \
extern "C" __global__ void nt_two_shot_##N##_min(OneShot a) { two_shot<T, Min>(a); } \
extern "C" __global__ void nt_two_shot_##N##_max(OneShot a) { two_shot<T, Max>(a); }
ONE_SHOT(float, f32)
ONE_SHOT(double, f64)
ONE_SHOT(h16, f16)
ONE_SHOT(b16, bf16)
ONE_SHOT(int, i32)
ONE_SHOT(long long, i64)
ONE_SHOT(unsigned char, u8)
ONE_SHOT(signed char, i8)
ONE_SHOT(unsigned, u32)
ONE_SHOT(u64, u64)
ONE_SHOT(short, i16)
ONE_SHOT(f8a, f8e4m3)
ONE_SHOT(f8b, f8e5m2)
"#;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_argument_block_matches_the_kernels_struct() {
        // 16 addresses, 8 words of 8 bytes, 6 of 4: no padding on either side.
        assert_eq!(
            std::mem::size_of::<OneShotArgs>(),
            16 * 8 + 8 * 8 + 6 * 4 + 16
        );
        assert!(
            SOURCE.contains("u64 input, output, count, half, counters, stop, status, timeout_ns;")
        );
        assert!(SOURCE.contains("unsigned world, rank, digest, average, symmetric, premul;"));
        assert!(SOURCE.contains("    NtScale scale;\n};"));
        assert!(super::super::reduce::SOURCE.contains("struct NtScale { double f; u64 whole; };"));
        assert_eq!(ONE_SHOT_MAX_RANKS, 8);
        assert!(SOURCE.contains("#define NT_ONE_MAX_RANKS 8"));
        assert_eq!(STOP_ONE_KERNEL, 3);
        assert!(SOURCE.contains("#define NT_STOP_ONE_KERNEL 3u"));
    }
}
