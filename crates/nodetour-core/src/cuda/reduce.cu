
typedef unsigned long long u64;
struct h16 { unsigned short x; };
struct b16 { unsigned short x; };
__device__ __forceinline__ float wide(h16 v) { float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v.x)); return f; }
__device__ __forceinline__ h16 narrow_h(float f) { h16 v; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(v.x) : "f"(f)); return v; }
__device__ __forceinline__ float wide(b16 v) { return __uint_as_float(((unsigned)v.x) << 16); }
__device__ __forceinline__ b16 narrow_b(float f) {
    unsigned u = __float_as_uint(f); b16 v;
    if ((u & 0x7fffffffu) > 0x7f800000u) { v.x = (unsigned short)((u >> 16) | 0x40); return v; }
    u += 0x7fffu + ((u >> 16) & 1u); v.x = (unsigned short)(u >> 16); return v;
}
// fp8 (OCP E4M3 and E5M2): decoded exactly to f32, computed there, rounded to nearest even
// once per combination, saturating to the largest finite value; every NaN result is 0x7F. The
// rounding is cuda_fp8.hpp's __nv_cvt_double_to_fp8 (__NV_SATFINITE), as the host's float8
// crate: the same bits on both.
struct f8a { unsigned char x; };
struct f8b { unsigned char x; };
__device__ __forceinline__ float wide(f8a v) {
    const unsigned b = v.x, e = (b >> 3) & 15u, m = b & 7u;
    if ((b & 0x7fu) == 0x7fu) return __int_as_float(0x7fffffff);
    const float a = e == 0 ? (float)m * 0.001953125f : __int_as_float((int)(((e + 120u) << 23) | (m << 20)));
    return (b & 0x80u) ? -a : a;
}
__device__ __forceinline__ float wide(f8b v) {
    const unsigned b = v.x, e = (b >> 2) & 31u, m = b & 3u;
    if (e == 31u) return m ? __int_as_float(0x7fffffff) : ((b & 0x80u) ? -__int_as_float(0x7f800000) : __int_as_float(0x7f800000));
    const float a = e == 0 ? (float)m * 0.0000152587890625f : __int_as_float((int)(((e + 112u) << 23) | (m << 21)));
    return (b & 0x80u) ? -a : a;
}
__device__ __forceinline__ unsigned char nt_fp8(float f, bool e4m3) {
    if (f != f) return 0x7f;
    const u64 xb = (u64)__double_as_longlong((double)f);
    const unsigned char maxnorm = e4m3 ? 0x7e : 0x7b, mmask = e4m3 ? 7 : 3;
    const unsigned bias = e4m3 ? 7u : 15u, sbits = e4m3 ? 4u : 3u;
    const u64 mindenorm_o2 = e4m3 ? 0x3F50000000000000ull : 0x3EE0000000000000ull;
    const u64 overflow = e4m3 ? 0x407D000000000000ull : 0x40EE000000000000ull - 1;
    const u64 minnorm = e4m3 ? 0x3F90000000000000ull : 0x3F10000000000000ull;
    const u64 half_ulp = 1ull << (53 - sbits - 1);
    const unsigned char sign = (unsigned char)((xb >> 63) << 7);
    const unsigned char exp = (unsigned char)((unsigned)((xb >> 52) & 0x7ff) - 1023u + bias);
    const unsigned char mant = (unsigned char)((xb >> (53 - sbits)) & mmask);
    const u64 absx = xb & 0x7fffffffffffffffull;
    unsigned char res;
    if (absx <= mindenorm_o2) {
        res = 0;
    } else if (absx > overflow) {
        res = maxnorm;
    } else if (absx >= minnorm) {
        res = (unsigned char)((exp << (sbits - 1)) | mant);
        const u64 round = xb & ((half_ulp << 1) - 1);
        if (round > half_ulp || (round == half_ulp && (mant & 1))) res++;
    } else {
        const unsigned shift = (unsigned char)(1u - exp);
        res = (unsigned char)((mant | (1u << (sbits - 1))) >> shift);
        const u64 round = (xb | (1ull << 52)) & ((half_ulp << (shift + 1)) - 1);
        if (round > (half_ulp << shift) || (round == (half_ulp << shift) && (res & 1))) res++;
    }
    return (unsigned char)(res | sign);
}
__device__ __forceinline__ f8a narrow_e4(float f) { f8a v; v.x = nt_fp8(f, true); return v; }
__device__ __forceinline__ f8b narrow_e5(float f) { f8b v; v.x = nt_fp8(f, false); return v; }
struct Sum { template<class T> __device__ static T f(T a, T b) { return a + b; } };
struct Prod { template<class T> __device__ static T f(T a, T b) { return a * b; } };
struct Min { template<class T> __device__ static T f(T a, T b) { return b < a ? b : a; } };
struct Max { template<class T> __device__ static T f(T a, T b) { return b > a ? b : a; } };
// Integers wrap: compute in the unsigned type of the same width.
template<class Op> __device__ int combine(int a, int b) { return (int)Op::f((unsigned)a, (unsigned)b); }
template<> __device__ int combine<Min>(int a, int b) { return Min::f(a, b); }
template<> __device__ int combine<Max>(int a, int b) { return Max::f(a, b); }
template<class Op> __device__ long long combine(long long a, long long b) { return (long long)Op::f((u64)a, (u64)b); }
template<> __device__ long long combine<Min>(long long a, long long b) { return Min::f(a, b); }
template<> __device__ long long combine<Max>(long long a, long long b) { return Max::f(a, b); }
template<class Op> __device__ unsigned char combine(unsigned char a, unsigned char b) { return (unsigned char)Op::f((unsigned)a, (unsigned)b); }
template<class Op> __device__ signed char combine(signed char a, signed char b) { return (signed char)Op::f((unsigned)(unsigned char)a, (unsigned)(unsigned char)b); }
template<> __device__ signed char combine<Min>(signed char a, signed char b) { return Min::f(a, b); }
template<> __device__ signed char combine<Max>(signed char a, signed char b) { return Max::f(a, b); }
template<class Op> __device__ short combine(short a, short b) { return (short)Op::f((unsigned)(unsigned short)a, (unsigned)(unsigned short)b); }
template<> __device__ short combine<Min>(short a, short b) { return Min::f(a, b); }
template<> __device__ short combine<Max>(short a, short b) { return Max::f(a, b); }
template<class Op> __device__ unsigned combine(unsigned a, unsigned b) { return Op::f(a, b); }
template<class Op> __device__ u64 combine(u64 a, u64 b) { return Op::f(a, b); }
// fp8 min and max compare the values and keep an operand's bits; a NaN never compares.
template<class Op> __device__ f8a combine(f8a a, f8a b) { return narrow_e4(Op::f(wide(a), wide(b))); }
template<> __device__ f8a combine<Min>(f8a a, f8a b) { return wide(b) < wide(a) ? b : a; }
template<> __device__ f8a combine<Max>(f8a a, f8a b) { return wide(b) > wide(a) ? b : a; }
template<class Op> __device__ f8b combine(f8b a, f8b b) { return narrow_e5(Op::f(wide(a), wide(b))); }
template<> __device__ f8b combine<Min>(f8b a, f8b b) { return wide(b) < wide(a) ? b : a; }
template<> __device__ f8b combine<Max>(f8b a, f8b b) { return wide(b) > wide(a) ? b : a; }
template<class Op> __device__ float combine(float a, float b) { return Op::f(a, b); }
template<class Op> __device__ double combine(double a, double b) { return Op::f(a, b); }
template<class Op> __device__ h16 combine(h16 a, h16 b) { return narrow_h(Op::f(wide(a), wide(b))); }
template<class Op> __device__ b16 combine(b16 a, b16 b) { return narrow_b(Op::f(wide(a), wide(b))); }
// PreMulSum: a rank's own values multiplied by its scalar where they are first read, rounded
// to the type once, as the host's `reduce::scale_into`: f32 (and the 16- and 8-bit floats,
// widened) by the scalar rounded to f32, f64 by the scalar, integers by the whole scalar
// (`whole`: the scalar as a 64-bit two's-complement integer), wrapping. `__fmul_rn` and
// `__dmul_rn` keep the product from being fused into a following addition (one rounding per
// operation, as on the host).
struct NtScale { double f; u64 whole; };
__device__ __forceinline__ float nt_mul(float x, const NtScale& k) { return __fmul_rn(x, (float)k.f); }
__device__ __forceinline__ double nt_mul(double x, const NtScale& k) { return __dmul_rn(x, k.f); }
__device__ __forceinline__ h16 nt_mul(h16 x, const NtScale& k) { return narrow_h(__fmul_rn(wide(x), (float)k.f)); }
__device__ __forceinline__ b16 nt_mul(b16 x, const NtScale& k) { return narrow_b(__fmul_rn(wide(x), (float)k.f)); }
__device__ __forceinline__ f8a nt_mul(f8a x, const NtScale& k) { return narrow_e4(__fmul_rn(wide(x), (float)k.f)); }
__device__ __forceinline__ f8b nt_mul(f8b x, const NtScale& k) { return narrow_e5(__fmul_rn(wide(x), (float)k.f)); }
__device__ __forceinline__ int nt_mul(int x, const NtScale& k) { return (int)((unsigned)x * (unsigned)k.whole); }
__device__ __forceinline__ long long nt_mul(long long x, const NtScale& k) { return (long long)((u64)x * k.whole); }
__device__ __forceinline__ unsigned char nt_mul(unsigned char x, const NtScale& k) { return (unsigned char)((unsigned)x * (unsigned)k.whole); }
__device__ __forceinline__ signed char nt_mul(signed char x, const NtScale& k) { return (signed char)(unsigned char)((unsigned)(unsigned char)x * (unsigned)k.whole); }
__device__ __forceinline__ short nt_mul(short x, const NtScale& k) { return (short)(unsigned short)((unsigned)(unsigned short)x * (unsigned)k.whole); }
__device__ __forceinline__ unsigned nt_mul(unsigned x, const NtScale& k) { return x * (unsigned)k.whole; }
__device__ __forceinline__ u64 nt_mul(u64 x, const NtScale& k) { return x * k.whole; }
struct alignas(16) v16 { u64 a, b; };
template<class T> union Lanes { v16 v; T t[16 / sizeof(T)]; };
// The grid's threads over `n` elements: 16 bytes per thread and step (`lanes(v)`: the v-th
// 16 bytes, `16 / sizeof(T)` elements) where `wide` (every pointer 16-byte aligned), then the
// tail one element at a time (`one(i)`).
template<class T, class W, class O> __device__ __forceinline__ void over_lanes(u64 n, bool wide, W lanes, O one) {
    const unsigned per = 16 / sizeof(T);
    u64 i0 = blockIdx.x * (u64)blockDim.x + threadIdx.x, stride = (u64)gridDim.x * blockDim.x, done = 0;
    if (wide) {
        for (u64 v = i0; v < n / per; v += stride) lanes(v);
        done = n / per * per;
    }
    for (u64 i = done + i0; i < n; i += stride) one(i);
}
__device__ __forceinline__ bool aligned16(const void* a, const void* b) { return (((u64)a | (u64)b) & 15) == 0; }
template<class T, class Op> __device__ void reduce(T* __restrict__ d, const T* __restrict__ s, u64 n) {
    over_lanes<T>(n, aligned16(d, s), [=](u64 v) {
        Lanes<T> a, b;
        a.v = ((const v16*)d)[v];
        b.v = ((const v16*)s)[v];
#pragma unroll
        for (unsigned k = 0; k < 16 / sizeof(T); k++) a.t[k] = combine<Op>(a.t[k], b.t[k]);
        ((v16*)d)[v] = a.v;
    }, [=](u64 i) { d[i] = combine<Op>(d[i], s[i]); });
}
// d = scalar · s (PreMulSum's multiplication; d may be s).
template<class T> __device__ void scale_copy(T* d, const T* s, u64 n, NtScale k) {
    over_lanes<T>(n, aligned16(d, s), [=](u64 v) {
        Lanes<T> x;
        x.v = ((const v16*)s)[v];
#pragma unroll
        for (unsigned j = 0; j < 16 / sizeof(T); j++) x.t[j] = nt_mul(x.t[j], k);
        ((v16*)d)[v] = x.v;
    }, [=](u64 i) { d[i] = nt_mul(s[i], k); });
}
// d = scalar · d + s: a received partial sum combined with this rank's own values, multiplied
// as they are first read (PreMulSum in the ring's reduce-scatter).
template<class T> __device__ void reduce_premul(T* __restrict__ d, const T* __restrict__ s, u64 n, NtScale k) {
    over_lanes<T>(n, aligned16(d, s), [=](u64 v) {
        Lanes<T> a, b;
        a.v = ((const v16*)d)[v];
        b.v = ((const v16*)s)[v];
#pragma unroll
        for (unsigned j = 0; j < 16 / sizeof(T); j++) a.t[j] = combine<Sum>(nt_mul(a.t[j], k), b.t[j]);
        ((v16*)d)[v] = a.v;
    }, [=](u64 i) { d[i] = combine<Sum>(nt_mul(d[i], k), s[i]); });
}
__device__ float divide(float x, unsigned n) { return x / (float)n; }
__device__ double divide(double x, unsigned n) { return x / (double)n; }
__device__ h16 divide(h16 x, unsigned n) { return narrow_h(wide(x) / (float)n); }
__device__ b16 divide(b16 x, unsigned n) { return narrow_b(wide(x) / (float)n); }
__device__ int divide(int x, unsigned n) { return x / (int)n; }
__device__ long long divide(long long x, unsigned n) { return x / (long long)n; }
__device__ unsigned char divide(unsigned char x, unsigned n) { return (unsigned char)((unsigned)x / n); }
__device__ signed char divide(signed char x, unsigned n) { return (signed char)((long long)x / (long long)n); }
__device__ short divide(short x, unsigned n) { return (short)((long long)x / (long long)n); }
__device__ unsigned divide(unsigned x, unsigned n) { return x / n; }
__device__ u64 divide(u64 x, unsigned n) { return x / (u64)n; }
__device__ f8a divide(f8a x, unsigned n) { return narrow_e4(wide(x) / (float)n); }
__device__ f8b divide(f8b x, unsigned n) { return narrow_e5(wide(x) / (float)n); }
template<class T> __device__ void average(T* d, u64 n, unsigned ranks) {
    over_lanes<T>(n, aligned16(d, d), [=](u64 v) {
        Lanes<T> x;
        x.v = ((const v16*)d)[v];
#pragma unroll
        for (unsigned k = 0; k < 16 / sizeof(T); k++) x.t[k] = divide(x.t[k], ranks);
        ((v16*)d)[v] = x.v;
    }, [=](u64 i) { d[i] = divide(d[i], ranks); });
}
// Two ranks in one step: combine both, write the result to both (each rank does one half).
// `b` is often on the peer GPU: wide loads keep more bytes in flight over the link.
template<class T, class Op> __device__ T both_one(T x, T y, unsigned avg) {
    T r = combine<Op>(x, y);
    return avg ? divide(r, avg) : r;
}
template<class T, class Op> __device__ void both(T* __restrict__ a, T* __restrict__ b, u64 n, unsigned avg) {
    over_lanes<T>(n, aligned16(a, b), [=](u64 v) {
        Lanes<T> x, y;
        x.v = ((const v16*)a)[v];
        y.v = ((const v16*)b)[v];
#pragma unroll
        for (unsigned k = 0; k < 16 / sizeof(T); k++) x.t[k] = both_one<T, Op>(x.t[k], y.t[k], avg);
        ((v16*)a)[v] = x.v;
        ((v16*)b)[v] = x.v;
    }, [=](u64 i) {
        const T r = both_one<T, Op>(a[i], b[i], avg);
        a[i] = r; b[i] = r;
    });
}
// A test pattern: element i of a buffer whose first element is element `first` of the pattern
// holds ((first + i) * 7 + seed) mod 13, exact in every type but E5M2 (whose 9 and 11
// round to 8 and 12).
template<class T> __device__ T small(unsigned v) { return (T)v; }
template<> __device__ h16 small<h16>(unsigned v) { return narrow_h((float)v); }
template<> __device__ b16 small<b16>(unsigned v) { return narrow_b((float)v); }
template<> __device__ f8a small<f8a>(unsigned v) { return narrow_e4((float)v); }
template<> __device__ f8b small<f8b>(unsigned v) { return narrow_e5((float)v); }
template<class T> __device__ void pattern(T* d, u64 n, u64 first, unsigned seed) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        d[i] = small<T>((unsigned)(((first + i) * 7 + seed) % 13));
}
#define KERNELS(T, N) \
extern "C" __global__ void nt_pattern_##N(T* d, u64 n, u64 first, unsigned seed) { pattern<T>(d, n, first, seed); } \
extern "C" __global__ void nt_both_##N##_sum(T* a, T* b, u64 n, unsigned avg) { both<T, Sum>(a, b, n, avg); } \
extern "C" __global__ void nt_both_##N##_prod(T* a, T* b, u64 n, unsigned avg) { both<T, Prod>(a, b, n, avg); } \
extern "C" __global__ void nt_both_##N##_min(T* a, T* b, u64 n, unsigned avg) { both<T, Min>(a, b, n, avg); } \
extern "C" __global__ void nt_both_##N##_max(T* a, T* b, u64 n, unsigned avg) { both<T, Max>(a, b, n, avg); } \
extern "C" __global__ void nt_reduce_##N##_sum(T* d, const T* s, u64 n) { reduce<T, Sum>(d, s, n); } \
extern "C" __global__ void nt_reduce_##N##_prod(T* d, const T* s, u64 n) { reduce<T, Prod>(d, s, n); } \
extern "C" __global__ void nt_reduce_##N##_min(T* d, const T* s, u64 n) { reduce<T, Min>(d, s, n); } \
extern "C" __global__ void nt_reduce_##N##_max(T* d, const T* s, u64 n) { reduce<T, Max>(d, s, n); } \
extern "C" __global__ void nt_average_##N(T* d, u64 n, unsigned ranks) { average<T>(d, n, ranks); } \
extern "C" __global__ void nt_scale_##N(T* d, const T* s, u64 n, NtScale k) { scale_copy<T>(d, s, n, k); } \
extern "C" __global__ void nt_reduce_##N##_premul(T* d, const T* s, u64 n, NtScale k) { reduce_premul<T>(d, s, n, k); }
KERNELS(float, f32)
KERNELS(double, f64)
KERNELS(h16, f16)
KERNELS(b16, bf16)
KERNELS(int, i32)
KERNELS(long long, i64)
KERNELS(unsigned char, u8)
KERNELS(signed char, i8)
KERNELS(unsigned, u32)
KERNELS(u64, u64)
KERNELS(short, i16)
KERNELS(f8a, f8e4m3)
KERNELS(f8b, f8e5m2)
extern "C" __global__ void nt_copy(unsigned char* d, const unsigned char* s, u64 n) {
    u64 i0 = blockIdx.x * (u64)blockDim.x + threadIdx.x, stride = (u64)gridDim.x * blockDim.x, done = 0;
    if ((((u64)d | (u64)s) & 15) == 0) {
        done = n / 16 * 16;
        for (u64 i = i0; i < n / 16; i += stride) ((v16*)d)[i] = ((const v16*)s)[i];
    }
    for (u64 i = done + i0; i < n; i += stride) d[i] = s[i];
}
// Guarded hand-offs (the GPU ring). `stop` is a word of this rank's host flag page that its host
// sets to 1, once, when it aborts, and that nothing ever clears (a guarded wait that gives up at
// its deadline sets it to 2: the host reads why). Each stream runs a one-thread nt_wait before
// the work of a hand-off: it waits for its flags or for the stop, and writes the stream's
// `latch` (a word of this GPU's memory): 1 if the flags were reached (the peer's credit, the
// peer's data: genuine), 0 if the stop ended the wait. The kernels after it on the stream write
// a peer's memory and store a peer's flags only if the latch is 1. So once the stop is set every
// wait ends, whatever a peer stores later, and nothing is written into a peer's memory without
// that peer's credit. Only one-thread kernels wait: a kernel of many blocks that spun could hold
// every SM while the kernel that it waits for (another rank's, on a shared GPU) needs one.
//
// Flag operands (NtFlag) are fixed (a word and a value), or relative to the stream's counters
// (`base`: two 64-bit words of this GPU's memory that only this stream's kernels use, advanced
// by nt_advance at the stream's end of each collective): so work captured into a CUDA graph is
// the next collective at every replay, like work queued again.
//  - counted (cells == 0): value + the chunk counter rounded up to `align` (every collective
//    starts at slot 0 of an aligned link, so fixed slot addresses stay right);
//  - a descriptor cell (cells > 0): word `addr + stride * (collectives mod cells)`, value with
//    the collective counter's low 16 bits in its high half.
__device__ __forceinline__ void nt_pause() {
#if __CUDA_ARCH__ >= 700
    __nanosleep(200);
#endif
}
__device__ __forceinline__ u64 nt_now() { u64 t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t; }
struct NtFlag { u64 addr, base; unsigned value, align, cells, stride; };
__device__ __forceinline__ volatile unsigned* nt_flag(const NtFlag& f, unsigned* v) {
    u64 a = f.addr;
    unsigned x = f.value;
    if (a && f.base) {
        const volatile u64* c = (const volatile u64*)f.base;
        if (f.cells) {
            const u64 n = c[1];
            a += (u64)f.stride * (n % f.cells);
            x |= ((unsigned)n & 0xffffu) << 16;
        } else {
            const u64 al = f.align ? f.align : 1;
            x += (unsigned)((c[0] + al - 1) / al * al);
        }
    }
    *v = x;
    return (volatile unsigned*)a;
}
// One thread: until word 1 reaches its value (cyclically: (int)(w - v) >= 0, or == when `eq1`)
// and then word 2 reaches its (either may be absent), or `*stop` is set, or `timeout_ns` passed
// (then it sets `*stop` to 2 itself: every later wait of this rank ends at once, and the host
// reports the timeout); `*latch` := whether the words were reached (with neither, whether the
// stop is clear). The stop is read before the words: no wait succeeds once it is set, so an
// aborted rank never passes on data it did not finish.
__device__ bool nt_wait_word(volatile unsigned* w, unsigned v, bool eq, volatile unsigned* stop, u64 t0, u64 timeout_ns) {
    for (unsigned i = 0;; i++) {
        if ((i & 63) == 0) {
            if (*stop) return false;
            if (i && nt_now() - t0 > timeout_ns) { *stop = 2; __threadfence_system(); return false; }
        }
        const unsigned x = *w;
        if (eq ? x == v : (int)(x - v) >= 0) return true;
        if (i > 256) nt_pause();
    }
}
extern "C" __global__ void nt_wait(NtFlag f1, unsigned eq1, NtFlag f2, volatile unsigned* stop,
                                   volatile unsigned* latch, u64 timeout_ns) {
    unsigned v1, v2;
    volatile unsigned* w1 = nt_flag(f1, &v1);
    volatile unsigned* w2 = nt_flag(f2, &v2);
    const u64 t0 = nt_now();
    unsigned ok = *stop == 0;
    if (ok && w1) ok = nt_wait_word(w1, v1, eq1 != 0, stop, t0, timeout_ns);
    if (ok && w2) ok = nt_wait_word(w2, v2, false, stop, t0, timeout_ns);
    __threadfence_system();
    *latch = ok;
    __threadfence();
}
// `*a = va` (resolved), then `*b = vb` (if given), after system-wide fences.
__device__ __forceinline__ void nt_store_flags(const NtFlag& fa, const NtFlag& fb) {
    unsigned va, vb;
    volatile unsigned* a = nt_flag(fa, &va);
    volatile unsigned* b = nt_flag(fb, &vb);
    if (a) {
        *a = va;
        if (b) { __threadfence_system(); *b = vb; }
    }
}
// The end of a guarded kernel: once every block has finished, the last one stores flag `a` and
// then `b` (if given) if the latch is 1, after system-wide fences (whoever sees a value sees
// every byte written before). `done` is a zeroed word of this GPU's memory that only this
// stream's kernels use (the last block puts it back to 0).
__device__ void nt_finish(const volatile unsigned* latch, const NtFlag& a, const NtFlag& b, unsigned* done) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence_system();
        if (atomicAdd(done, 1u) == gridDim.x - 1) {
            __threadfence_system();
            *done = 0;
            if (*latch) nt_store_flags(a, b);
        }
    }
}
// A chunk sent (copied into the peer's slot) or received (copied out of this rank's slot, the
// credit back to the sender being `a`), if the latch is 1, then nt_finish.
extern "C" __global__ void nt_send(const volatile unsigned* latch, unsigned char* d, const unsigned char* s, u64 n,
                                   NtFlag a, NtFlag b, unsigned* done) {
    if (*latch) {
        u64 i0 = blockIdx.x * (u64)blockDim.x + threadIdx.x, stride = (u64)gridDim.x * blockDim.x, k = 0;
        if ((((u64)d | (u64)s) & 15) == 0) {
            k = n / 16 * 16;
            for (u64 i = i0; i < n / 16; i += stride) ((v16*)d)[i] = ((const v16*)s)[i];
        }
        for (u64 i = k + i0; i < n; i += stride) d[i] = s[i];
    }
    nt_finish(latch, a, b, done);
}
// A chunk received: reduced into this rank's buffer if the latch is 1, then nt_finish (the
// credit back to the sender).
template<class T, class Op> __device__ void reduce_then(T* d, const T* s, u64 n, const volatile unsigned* latch, const NtFlag& a, unsigned* done) {
    if (*latch) reduce<T, Op>(d, s, n);
    const NtFlag none = {0, 0, 0, 0, 0, 0};
    nt_finish(latch, a, none, done);
}
#define THEN(T, N) \
extern "C" __global__ void nt_reduce_then_##N##_sum(T* d, const T* s, u64 n, const unsigned* l, NtFlag a, unsigned* dn) { reduce_then<T, Sum>(d, s, n, l, a, dn); } \
extern "C" __global__ void nt_reduce_then_##N##_prod(T* d, const T* s, u64 n, const unsigned* l, NtFlag a, unsigned* dn) { reduce_then<T, Prod>(d, s, n, l, a, dn); } \
extern "C" __global__ void nt_reduce_then_##N##_min(T* d, const T* s, u64 n, const unsigned* l, NtFlag a, unsigned* dn) { reduce_then<T, Min>(d, s, n, l, a, dn); } \
extern "C" __global__ void nt_reduce_then_##N##_max(T* d, const T* s, u64 n, const unsigned* l, NtFlag a, unsigned* dn) { reduce_then<T, Max>(d, s, n, l, a, dn); } \
extern "C" __global__ void nt_reduce_then_##N##_premul(T* d, const T* s, u64 n, NtScale k, const volatile unsigned* l, NtFlag a, unsigned* dn) { \
    if (*l) reduce_premul<T>(d, s, n, k); \
    const NtFlag none = {0, 0, 0, 0, 0, 0}; \
    nt_finish(l, a, none, dn); \
} \
extern "C" __global__ void nt_send_scaled_##N(const volatile unsigned* l, T* d, const T* s, u64 n, NtScale k, NtFlag a, NtFlag b, unsigned* dn) { \
    if (*l) scale_copy<T>(d, s, n, k); \
    nt_finish(l, a, b, dn); \
}
THEN(float, f32)
THEN(double, f64)
THEN(h16, f16)
THEN(b16, bf16)
THEN(int, i32)
THEN(long long, i64)
THEN(unsigned char, u8)
THEN(signed char, i8)
THEN(unsigned, u32)
THEN(u64, u64)
THEN(short, i16)
THEN(f8a, f8e4m3)
THEN(f8b, f8e5m2)
// One thread: flag `a`, then `b` (if given), if the latch is 1, after system-wide fences.
extern "C" __global__ void nt_signal(const volatile unsigned* latch, NtFlag a, NtFlag b) {
    __threadfence_system();
    if (!*latch) return;
    nt_store_flags(a, b);
}
// One thread, first at a stream's start of a collective: claims the stream's guard words. A
// replay of a captured collective that runs beside another collective of this rank on the
// same guard would share its counters: a claim already held sets the stop word to 4 (unless
// already set), so every wait of this rank ends, nothing more is written to a peer, and the
// host reports the collectives that ran at once. Released by nt_advance.
extern "C" __global__ void nt_claim(unsigned* claim, volatile unsigned* stop) {
    if (atomicCAS(claim, 0u, 1u) != 0u) {
        if (*stop == 0) *stop = 4;
        __threadfence_system();
    }
    __threadfence();
}
// One thread, at a stream's end of a collective: the chunk counter rounded up to `align`, plus
// the chunks the collective moved on this stream; the collective counter plus one; the claim
// released.
extern "C" __global__ void nt_advance(volatile u64* c, unsigned align, unsigned chunks, unsigned* claim) {
    const u64 al = align ? align : 1;
    c[0] = (c[0] + al - 1) / al * al + chunks;
    c[1] = c[1] + 1;
    __threadfence();
    atomicExch(claim, 0u);
}
