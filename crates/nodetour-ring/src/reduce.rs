//! Reductions on the host: every data type × operation nodetour supports, on raw bytes (as the
//! slots and the work buffer hold them), element by element.
//!
//! Integers wrap (sums, products) and truncate (averages). The 16-bit and 8-bit floats are
//! computed in f32 and rounded to nearest even once per combination of two operands (each step
//! of a ring, each rank a one-kernel fold takes in); fp8 saturates to its largest finite value
//! and a NaN comes out as the canonical NaN byte `0x7F`; min and max compare the values and keep
//! an operand's bits (exact). The GPU kernels (`nodetour_core::cuda::reduce`) compute the same
//! bits.

use float8::{F8E4M3, F8E5M2};
use half::{bf16, f16};

use crate::error::{Error, Result};

pub use nodetour_core::dtype::{DataType, ReduceOp, Scalar};

macro_rules! apply {
    ($acc:expr, $other:expr, $t:ty, $op:expr, $from:expr, $to:expr, $sum:expr, $prod:expr) => {{
        let aligned = bytemuck::try_cast_slice::<u8, $t>(&*$acc).is_ok()
            && bytemuck::try_cast_slice::<u8, $t>($other).is_ok();
        if aligned {
            // Typed, one loop per operation: the compiler vectorises it.
            let (a, b) = (
                bytemuck::cast_slice_mut::<u8, $t>($acc),
                bytemuck::cast_slice::<u8, $t>($other),
            );
            match $op {
                ReduceOp::Sum | ReduceOp::Avg | ReduceOp::PreMulSum(_) => typed(a, b, $sum),
                ReduceOp::Prod => typed(a, b, $prod),
                ReduceOp::Min => typed(a, b, |x: $t, y: $t| if y < x { y } else { x }),
                ReduceOp::Max => typed(a, b, |x: $t, y: $t| if y > x { y } else { x }),
                other => return Err(not_reduced(other)),
            }
        } else {
            const N: usize = std::mem::size_of::<$t>();
            for (a, b) in $acc.chunks_exact_mut(N).zip($other.chunks_exact(N)) {
                let x: $t = $from(a.try_into().expect("N bytes"));
                let y: $t = $from(b.try_into().expect("N bytes"));
                let r: $t = match $op {
                    ReduceOp::Sum | ReduceOp::Avg | ReduceOp::PreMulSum(_) => $sum(x, y),
                    ReduceOp::Prod => $prod(x, y),
                    ReduceOp::Min => {
                        if y < x {
                            y
                        } else {
                            x
                        }
                    }
                    ReduceOp::Max => {
                        if y > x {
                            y
                        } else {
                            x
                        }
                    }
                    other => return Err(not_reduced(other)),
                };
                a.copy_from_slice(&$to(r));
            }
        }
    }};
}

/// `a[i] = f(a[i], b[i])`.
#[inline(always)]
fn typed<T: Copy>(a: &mut [T], b: &[T], f: impl Fn(T, T) -> T) {
    for (x, y) in a.iter_mut().zip(b) {
        *x = f(*x, *y);
    }
}

/// `acc = op(acc, other)`, element-wise (`Avg` sums; [`finish_avg`] divides at the end;
/// `PreMulSum` sums operands already multiplied by [`scale_into`]).
pub fn reduce_into(dtype: DataType, op: ReduceOp, acc: &mut [u8], other: &[u8]) -> Result<()> {
    if acc.len() != other.len() || !acc.len().is_multiple_of(dtype.size()) {
        return Err(Error::Plan {
            reason: format!(
                "reducing {} bytes with {} bytes of {dtype:?}",
                acc.len(),
                other.len()
            ),
        });
    }
    // Integers wrap, as NCCL's and torch's do.
    macro_rules! wrapping {
        ($t:ident) => {
            apply!(
                acc,
                other,
                $t,
                op,
                $t::from_ne_bytes,
                $t::to_ne_bytes,
                $t::wrapping_add,
                $t::wrapping_mul
            )
        };
    }
    match dtype {
        DataType::F32 => apply!(
            acc,
            other,
            f32,
            op,
            f32::from_ne_bytes,
            f32::to_ne_bytes,
            |x: f32, y: f32| x + y,
            |x: f32, y: f32| x * y
        ),
        DataType::F64 => apply!(
            acc,
            other,
            f64,
            op,
            f64::from_ne_bytes,
            f64::to_ne_bytes,
            |x: f64, y: f64| x + y,
            |x: f64, y: f64| x * y
        ),
        DataType::F16 => apply!(
            acc,
            other,
            f16,
            op,
            f16::from_ne_bytes,
            f16::to_ne_bytes,
            |x: f16, y: f16| f16::from_f32(x.to_f32() + y.to_f32()),
            |x: f16, y: f16| f16::from_f32(x.to_f32() * y.to_f32())
        ),
        DataType::Bf16 => apply!(
            acc,
            other,
            bf16,
            op,
            bf16::from_ne_bytes,
            bf16::to_ne_bytes,
            |x: bf16, y: bf16| bf16::from_f32(x.to_f32() + y.to_f32()),
            |x: bf16, y: bf16| bf16::from_f32(x.to_f32() * y.to_f32())
        ),
        DataType::I32 => wrapping!(i32),
        DataType::I64 => wrapping!(i64),
        DataType::U8 => wrapping!(u8),
        DataType::I8 => wrapping!(i8),
        DataType::I16 => wrapping!(i16),
        DataType::U32 => wrapping!(u32),
        DataType::U64 => wrapping!(u64),
        DataType::F8E4M3 => fp8(
            op,
            acc,
            other,
            |v| F8E4M3::from_bits(v).to_f32(),
            |f| F8E4M3::from_f32(f).to_bits(),
        )?,
        DataType::F8E5M2 => fp8(
            op,
            acc,
            other,
            |v| F8E5M2::from_bits(v).to_f32(),
            |f| F8E5M2::from_f32(f).to_bits(),
        )?,
        other => return Err(not_reduced(other)),
    }
    Ok(())
}

/// Checks `op` for `dtype`: a `PreMulSum` scalar of an integer type must be a whole number
/// that an `i64` holds (the product wraps in the type, as a sum does).
pub fn check_op(dtype: DataType, op: ReduceOp) -> Result<()> {
    match op.scalar() {
        Some(s)
            if dtype.is_integer()
                && !(s.fract() == 0.0 && s.abs() < 9_223_372_036_854_775_808.0) =>
        {
            Err(Error::InvalidArgument {
                reason: format!(
                    "a PreMulSum of {} by {s}: an integer type is multiplied by a whole number \
                     (at most 2^63 in magnitude)",
                    dtype.name()
                ),
            })
        }
        _ => Ok(()),
    }
}

/// `dst = round(scalar · src)`, element-wise: a PreMulSum's multiplication of this rank's own
/// values, fused into the copy that first reads them (the staging copy, or the copy out of the
/// input that a reduction reads). In f64 for f64, in f32 for f32 and the 16- and 8-bit floats
/// (the scalar rounded to f32), rounded to the type once (fp8 as a sum rounds: saturating,
/// NaN as [`FP8_NAN`]); integers multiply by the whole scalar ([`check_op`]) and wrap.
pub fn scale_into(dtype: DataType, scalar: f64, dst: &mut [u8], src: &[u8]) -> Result<()> {
    if dst.len() != src.len() || !dst.len().is_multiple_of(dtype.size()) {
        return Err(Error::Plan {
            reason: format!(
                "scaling {} bytes into {} bytes of {dtype:?}",
                src.len(),
                dst.len()
            ),
        });
    }
    check_op(dtype, ReduceOp::pre_mul_sum(scalar))?;
    macro_rules! scale {
        ($t:ty, $from:expr, $to:expr, $mul:expr) => {{
            const N: usize = std::mem::size_of::<$t>();
            for (d, s) in dst.chunks_exact_mut(N).zip(src.chunks_exact(N)) {
                let x: $t = $from(s.try_into().expect("N bytes"));
                d.copy_from_slice(&$to($mul(x)));
            }
        }};
    }
    let (s32, whole) = (scalar as f32, scalar as i64);
    match dtype {
        DataType::F32 => scale!(f32, f32::from_ne_bytes, f32::to_ne_bytes, |x: f32| x * s32),
        DataType::F64 => scale!(f64, f64::from_ne_bytes, f64::to_ne_bytes, |x: f64| x
            * scalar),
        DataType::F16 => scale!(f16, f16::from_ne_bytes, f16::to_ne_bytes, |x: f16| {
            f16::from_f32(x.to_f32() * s32)
        }),
        DataType::Bf16 => scale!(bf16, bf16::from_ne_bytes, bf16::to_ne_bytes, |x: bf16| {
            bf16::from_f32(x.to_f32() * s32)
        }),
        DataType::I32 => scale!(i32, i32::from_ne_bytes, i32::to_ne_bytes, |x: i32| x
            .wrapping_mul(whole as i32)),
        DataType::I64 => scale!(i64, i64::from_ne_bytes, i64::to_ne_bytes, |x: i64| x
            .wrapping_mul(whole)),
        DataType::U8 => scale!(u8, u8::from_ne_bytes, u8::to_ne_bytes, |x: u8| x
            .wrapping_mul(whole as u8)),
        DataType::I8 => scale!(i8, i8::from_ne_bytes, i8::to_ne_bytes, |x: i8| x
            .wrapping_mul(whole as i8)),
        DataType::I16 => scale!(i16, i16::from_ne_bytes, i16::to_ne_bytes, |x: i16| x
            .wrapping_mul(whole as i16)),
        DataType::U32 => scale!(u32, u32::from_ne_bytes, u32::to_ne_bytes, |x: u32| x
            .wrapping_mul(whole as u32)),
        DataType::U64 => scale!(u64, u64::from_ne_bytes, u64::to_ne_bytes, |x: u64| x
            .wrapping_mul(whole as u64)),
        DataType::F8E4M3 => {
            for (d, &x) in dst.iter_mut().zip(src) {
                let f = F8E4M3::from_bits(x).to_f32() * s32;
                *d = fp8_round(f, |f| F8E4M3::from_f32(f).to_bits());
            }
        }
        DataType::F8E5M2 => {
            for (d, &x) in dst.iter_mut().zip(src) {
                let f = F8E5M2::from_bits(x).to_f32() * s32;
                *d = fp8_round(f, |f| F8E5M2::from_f32(f).to_bits());
            }
        }
        other => return Err(not_reduced(other)),
    }
    Ok(())
}

/// Copies `src` into `dst`, multiplied by the scalar of `op` if it is a `PreMulSum`.
pub(crate) fn copy_scaled(dtype: DataType, op: ReduceOp, dst: &mut [u8], src: &[u8]) -> Result<()> {
    match op.scalar() {
        Some(s) => scale_into(dtype, s, dst, src),
        None if dst.len() == src.len() => {
            dst.copy_from_slice(src);
            Ok(())
        }
        None => Err(Error::Plan {
            reason: format!("copying {} bytes into {}", src.len(), dst.len()),
        }),
    }
}

/// The canonical NaN of both fp8 formats (`S.1111.111` of E4M3, a quiet NaN of E5M2), sign
/// clear: what every NaN result is.
pub const FP8_NAN: u8 = 0x7F;

/// An fp8 value computed in f32, rounded once (saturating; NaN as [`FP8_NAN`]).
fn fp8_round(f: f32, narrow: impl Fn(f32) -> u8) -> u8 {
    if f.is_nan() { FP8_NAN } else { narrow(f) }
}

/// Every fp8 byte of `data` divided by `n` in f32, rounded once.
fn fp8_divide(data: &mut [u8], n: u32, wide: impl Fn(u8) -> f32, narrow: impl Fn(f32) -> u8) {
    for a in data.iter_mut() {
        *a = fp8_round(wide(*a) / n as f32, &narrow);
    }
}

/// `acc = op(acc, other)` on fp8 bytes: `wide` decodes one, `narrow` rounds an f32 to one.
fn fp8(
    op: ReduceOp,
    acc: &mut [u8],
    other: &[u8],
    wide: impl Fn(u8) -> f32,
    narrow: impl Fn(f32) -> u8,
) -> Result<()> {
    let f: fn(f32, f32) -> f32 = match op {
        ReduceOp::Sum | ReduceOp::Avg | ReduceOp::PreMulSum(_) => |x, y| x + y,
        ReduceOp::Prod => |x, y| x * y,
        ReduceOp::Min | ReduceOp::Max => {
            let min = op == ReduceOp::Min;
            for (a, &b) in acc.iter_mut().zip(other) {
                let (x, y) = (wide(*a), wide(b));
                // As the kernels: the other operand only where it compares strictly lower
                // (higher); a NaN never does.
                if (min && y < x) || (!min && y > x) {
                    *a = b;
                }
            }
            return Ok(());
        }
        other => return Err(not_reduced(other)),
    };
    for (a, &b) in acc.iter_mut().zip(other) {
        *a = fp8_round(f(wide(*a), wide(b)), &narrow);
    }
    Ok(())
}

/// A type or operation this build does not reduce (`DataType` and `ReduceOp` are
/// `#[non_exhaustive]`: a newer core may name more).
pub(crate) fn not_reduced(what: impl std::fmt::Debug) -> Error {
    Error::Unsupported {
        reason: format!("{what:?} is not reduced on the host by this build"),
    }
}

/// Divides every element by `world` (the end of an `Avg`).
pub fn finish_avg(dtype: DataType, data: &mut [u8], world: u32) -> Result<()> {
    let n = world.max(1);
    macro_rules! div {
        ($t:ty, $from:expr, $to:expr, $div:expr) => {{
            const N: usize = std::mem::size_of::<$t>();
            for a in data.chunks_exact_mut(N) {
                let x: $t = $from(a.try_into().expect("N bytes"));
                a.copy_from_slice(&$to($div(x)));
            }
        }};
    }
    match dtype {
        DataType::F32 => div!(f32, f32::from_ne_bytes, f32::to_ne_bytes, |x: f32| x / n
            as f32),
        DataType::F64 => div!(f64, f64::from_ne_bytes, f64::to_ne_bytes, |x: f64| x
            / f64::from(n)),
        DataType::F16 => div!(f16, f16::from_ne_bytes, f16::to_ne_bytes, |x: f16| {
            f16::from_f32(x.to_f32() / n as f32)
        }),
        DataType::Bf16 => div!(bf16, bf16::from_ne_bytes, bf16::to_ne_bytes, |x: bf16| {
            bf16::from_f32(x.to_f32() / n as f32)
        }),
        DataType::I32 => div!(i32, i32::from_ne_bytes, i32::to_ne_bytes, |x: i32| x / n
            as i32),
        DataType::I64 => div!(i64, i64::from_ne_bytes, i64::to_ne_bytes, |x: i64| x
            / i64::from(n)),
        DataType::U8 => div!(
            u8,
            u8::from_ne_bytes,
            u8::to_ne_bytes,
            |x: u8| (u32::from(x) / n) as u8
        ),
        // Truncating toward zero, as C's division in the kernels.
        DataType::I8 => div!(i8, i8::from_ne_bytes, i8::to_ne_bytes, |x: i8| {
            (i64::from(x) / i64::from(n)) as i8
        }),
        DataType::I16 => div!(i16, i16::from_ne_bytes, i16::to_ne_bytes, |x: i16| {
            (i64::from(x) / i64::from(n)) as i16
        }),
        DataType::U32 => div!(u32, u32::from_ne_bytes, u32::to_ne_bytes, |x: u32| x / n),
        DataType::U64 => div!(u64, u64::from_ne_bytes, u64::to_ne_bytes, |x: u64| x
            / u64::from(n)),
        DataType::F8E4M3 => fp8_divide(
            data,
            n,
            |v| F8E4M3::from_bits(v).to_f32(),
            |f| F8E4M3::from_f32(f).to_bits(),
        ),
        DataType::F8E5M2 => fp8_divide(
            data,
            n,
            |v| F8E5M2::from_bits(v).to_f32(),
            |f| F8E5M2::from_f32(f).to_bits(),
        ),
        other => return Err(not_reduced(other)),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes<T: Copy, const N: usize>(v: &[T], f: impl Fn(T) -> [u8; N]) -> Vec<u8> {
        v.iter().flat_map(|x| f(*x)).collect()
    }

    #[test]
    fn every_operation_on_f32_and_i64() {
        let a = [1.5f32, -2.0, 3.0];
        let b = [2.0f32, 4.0, -1.0];
        for (op, want) in [
            (ReduceOp::Sum, [3.5, 2.0, 2.0]),
            (ReduceOp::Prod, [3.0, -8.0, -3.0]),
            (ReduceOp::Min, [1.5, -2.0, -1.0]),
            (ReduceOp::Max, [2.0, 4.0, 3.0]),
        ] {
            let mut acc = bytes(&a, f32::to_ne_bytes);
            reduce_into(DataType::F32, op, &mut acc, &bytes(&b, f32::to_ne_bytes)).unwrap();
            assert_eq!(acc, bytes(&want, f32::to_ne_bytes), "{op:?}");
        }
        let mut acc = bytes(&[i64::MAX, 5], i64::to_ne_bytes);
        reduce_into(
            DataType::I64,
            ReduceOp::Sum,
            &mut acc,
            &bytes(&[1i64, -7], i64::to_ne_bytes),
        )
        .unwrap();
        assert_eq!(
            acc,
            bytes(&[i64::MIN, -2], i64::to_ne_bytes),
            "integers wrap"
        );
    }

    #[test]
    fn halves_bytes_and_averages() {
        let mut acc = bytes(&[f16::from_f32(1.5), f16::from_f32(2.0)], f16::to_ne_bytes);
        reduce_into(
            DataType::F16,
            ReduceOp::Sum,
            &mut acc,
            &bytes(&[f16::from_f32(0.5), f16::from_f32(-4.0)], f16::to_ne_bytes),
        )
        .unwrap();
        assert_eq!(
            acc,
            bytes(&[f16::from_f32(2.0), f16::from_f32(-2.0)], f16::to_ne_bytes)
        );
        let mut acc = bytes(&[bf16::from_f32(3.0)], bf16::to_ne_bytes);
        reduce_into(
            DataType::Bf16,
            ReduceOp::Max,
            &mut acc,
            &bytes(&[bf16::from_f32(7.0)], bf16::to_ne_bytes),
        )
        .unwrap();
        finish_avg(DataType::Bf16, &mut acc, 2).unwrap();
        assert_eq!(acc, bytes(&[bf16::from_f32(3.5)], bf16::to_ne_bytes));
        let mut acc = vec![250u8, 3];
        reduce_into(DataType::U8, ReduceOp::Sum, &mut acc, &[10, 4]).unwrap();
        assert_eq!(acc, [4, 7]);
        finish_avg(DataType::U8, &mut acc, 2).unwrap();
        assert_eq!(acc, [2, 3]);
        assert!(reduce_into(DataType::I32, ReduceOp::Sum, &mut [0u8; 4], &[0u8; 8]).is_err());
        assert!(reduce_into(DataType::I32, ReduceOp::Sum, &mut [0u8; 3], &[0u8; 3]).is_err());
    }

    #[test]
    fn the_added_integers_wrap_and_truncate() {
        let mut acc = bytes(&[i8::MAX, -7], i8::to_ne_bytes);
        reduce_into(
            DataType::I8,
            ReduceOp::Sum,
            &mut acc,
            &bytes(&[1i8, 2], i8::to_ne_bytes),
        )
        .unwrap();
        assert_eq!(acc, bytes(&[i8::MIN, -5], i8::to_ne_bytes));
        finish_avg(DataType::I8, &mut acc, 3).unwrap();
        assert_eq!(acc, bytes(&[-42i8, -1], i8::to_ne_bytes), "toward zero");
        let mut acc = bytes(&[300i16, -2], i16::to_ne_bytes);
        reduce_into(
            DataType::I16,
            ReduceOp::Prod,
            &mut acc,
            &bytes(&[300i16, 5], i16::to_ne_bytes),
        )
        .unwrap();
        assert_eq!(acc, bytes(&[(90_000i32 as i16), -10], i16::to_ne_bytes));
        let mut acc = bytes(&[u32::MAX, 7], u32::to_ne_bytes);
        reduce_into(
            DataType::U32,
            ReduceOp::Sum,
            &mut acc,
            &bytes(&[2u32, 1], u32::to_ne_bytes),
        )
        .unwrap();
        assert_eq!(acc, bytes(&[1u32, 8], u32::to_ne_bytes));
        let mut acc = bytes(&[u64::MAX, 3], u64::to_ne_bytes);
        reduce_into(
            DataType::U64,
            ReduceOp::Min,
            &mut acc,
            &bytes(&[5u64, 9], u64::to_ne_bytes),
        )
        .unwrap();
        assert_eq!(acc, bytes(&[5u64, 3], u64::to_ne_bytes), "unsigned order");
        let mut acc = bytes(&[-3i16, 4], i16::to_ne_bytes);
        reduce_into(
            DataType::I16,
            ReduceOp::Max,
            &mut acc,
            &bytes(&[2i16, -9], i16::to_ne_bytes),
        )
        .unwrap();
        assert_eq!(acc, bytes(&[2i16, 4], i16::to_ne_bytes), "signed order");
    }

    fn e4(f: f32) -> u8 {
        F8E4M3::from_f32(f).to_bits()
    }

    fn e5(f: f32) -> u8 {
        F8E5M2::from_f32(f).to_bits()
    }

    #[test]
    fn fp8_rounds_once_saturates_and_keeps_nan_canonical() {
        // 1.0 + 0.0625: between 1.0 and 1.125 (E4M3's step at 1), a tie: to even, 1.0.
        let mut acc = vec![e4(1.0), e4(400.0), e4(-1.5), FP8_NAN | 0x80, e4(0.0)];
        let other = [e4(0.0625), e4(400.0), e4(-0.25), e4(2.0), e4(-0.0)];
        reduce_into(DataType::F8E4M3, ReduceOp::Sum, &mut acc, &other).unwrap();
        assert_eq!(acc[0], e4(1.0), "a tie rounds to even");
        assert_eq!(
            acc[1],
            e4(448.0),
            "800 saturates to the largest finite E4M3"
        );
        assert_eq!(acc[2], e4(-1.75));
        assert_eq!(acc[3], FP8_NAN, "a NaN in is the canonical NaN out");
        assert_eq!(acc[4], e4(0.0));
        // E5M2: infinity saturates too; min and max keep an operand's bits.
        let inf = 0x7Cu8;
        let mut acc = vec![inf, e5(57344.0), e5(3.0), e5(-2.0)];
        reduce_into(
            DataType::F8E5M2,
            ReduceOp::Sum,
            &mut acc,
            &[e5(1.0), e5(57344.0), e5(0.5), e5(-2.0)],
        )
        .unwrap();
        assert_eq!(acc, [e5(57344.0), e5(57344.0), e5(3.5), e5(-4.0)]);
        let mut acc = vec![e5(-0.0), FP8_NAN, e5(1.0)];
        reduce_into(
            DataType::F8E5M2,
            ReduceOp::Min,
            &mut acc,
            &[e5(0.0), e5(1.0), FP8_NAN],
        )
        .unwrap();
        assert_eq!(
            acc,
            [e5(-0.0), FP8_NAN, e5(1.0)],
            "min: a NaN never compares lower"
        );
        let mut acc = vec![e4(3.0)];
        reduce_into(DataType::F8E4M3, ReduceOp::Max, &mut acc, &[e4(3.5)]).unwrap();
        finish_avg(DataType::F8E4M3, &mut acc, 2).unwrap();
        assert_eq!(acc, [e4(1.75)]);
    }

    #[test]
    fn every_type_names_itself_and_its_size() {
        for d in DataType::ALL {
            assert_eq!(DataType::from_name(d.name()), Some(d));
            let mut acc = vec![0u8; 2 * d.size()];
            for op in [ReduceOp::Sum, ReduceOp::Prod, ReduceOp::Min, ReduceOp::Max] {
                reduce_into(d, op, &mut acc, &vec![0u8; 2 * d.size()]).unwrap();
            }
            finish_avg(d, &mut acc, 2).unwrap();
        }
    }

    /// PreMulSum's multiplication: in f32 (f64 for f64), rounded to the type once; fp8
    /// saturating, NaN as `FP8_NAN`; integers by a whole scalar, wrapping; a fraction refused
    /// for an integer type.
    #[test]
    fn scale_rounds_once_saturates_and_wraps() {
        let mut out = [0u8; 8];
        scale_into(DataType::F64, 0.1, &mut out, &3.0f64.to_ne_bytes()).unwrap();
        assert_eq!(f64::from_ne_bytes(out), 3.0 * 0.1);
        let mut out = [0u8; 2];
        let x = half::bf16::from_f32(3.0);
        scale_into(DataType::Bf16, 1.0 / 3.0, &mut out, &x.to_ne_bytes()).unwrap();
        assert_eq!(
            half::bf16::from_ne_bytes(out),
            half::bf16::from_f32(3.0 * (1.0f64 / 3.0) as f32)
        );
        let e4 = |v: f32| F8E4M3::from_f32(v).to_bits();
        let mut out = [0u8; 3];
        scale_into(
            DataType::F8E4M3,
            2.0,
            &mut out,
            &[e4(448.0), e4(-3.0), FP8_NAN],
        )
        .unwrap();
        assert_eq!(out, [e4(448.0), e4(-6.0), FP8_NAN]);
        let mut out = [0u8; 2];
        scale_into(DataType::I8, -3.0, &mut out, &[100i8 as u8, 5]).unwrap();
        assert_eq!(out, [(100i8).wrapping_mul(-3) as u8, (-15i8) as u8]);
        let mut out = [0u8; 8];
        scale_into(DataType::U64, 3.0, &mut out, &u64::MAX.to_ne_bytes()).unwrap();
        assert_eq!(u64::from_ne_bytes(out), u64::MAX.wrapping_mul(3));
        for bad in [0.5, 1e19, f64::NAN, f64::INFINITY] {
            assert!(
                check_op(DataType::I32, ReduceOp::pre_mul_sum(bad)).is_err(),
                "{bad}"
            );
            assert!(scale_into(DataType::I32, bad, &mut [0u8; 4], &[0u8; 4]).is_err());
        }
        assert!(check_op(DataType::F16, ReduceOp::pre_mul_sum(0.5)).is_ok());
        assert!(scale_into(DataType::F32, 1.0, &mut [0u8; 4], &[0u8; 8]).is_err());
        // PreMulSum sums what was multiplied, as Sum does.
        let mut acc = 1.5f32.to_ne_bytes();
        reduce_into(
            DataType::F32,
            ReduceOp::pre_mul_sum(9.0),
            &mut acc,
            &2.0f32.to_ne_bytes(),
        )
        .unwrap();
        assert_eq!(f32::from_ne_bytes(acc), 3.5);
    }
}
