//! Reductions on the host: every data type × operation nodetour supports, on raw bytes (as the
//! slots and the work buffer hold them), element by element.

use half::{bf16, f16};

use crate::error::{Error, Result};

pub use nodetour_core::dtype::{DataType, ReduceOp};

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
                ReduceOp::Sum | ReduceOp::Avg => typed(a, b, $sum),
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
                    ReduceOp::Sum | ReduceOp::Avg => $sum(x, y),
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

/// `acc = op(acc, other)`, element-wise (`Avg` sums; [`finish_avg`] divides at the end).
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
        DataType::I32 => apply!(
            acc,
            other,
            i32,
            op,
            i32::from_ne_bytes,
            i32::to_ne_bytes,
            i32::wrapping_add,
            i32::wrapping_mul
        ),
        DataType::I64 => apply!(
            acc,
            other,
            i64,
            op,
            i64::from_ne_bytes,
            i64::to_ne_bytes,
            i64::wrapping_add,
            i64::wrapping_mul
        ),
        DataType::U8 => apply!(
            acc,
            other,
            u8,
            op,
            u8::from_ne_bytes,
            u8::to_ne_bytes,
            u8::wrapping_add,
            u8::wrapping_mul
        ),
        other => return Err(not_reduced(other)),
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
}
