//! The element types and reduction operations of nodetour's collectives, shared by the host
//! reducer (nodetour-ring) and the GPU kernels (`cuda::reduce`).

/// Element types.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DataType {
    /// 32-bit float.
    F32,
    /// 64-bit float.
    F64,
    /// IEEE half.
    F16,
    /// bfloat16.
    Bf16,
    /// 32-bit signed integer.
    I32,
    /// 64-bit signed integer.
    I64,
    /// Byte.
    U8,
    /// 8-bit signed integer.
    I8,
    /// 32-bit unsigned integer.
    U32,
    /// 64-bit unsigned integer.
    U64,
    /// 16-bit signed integer.
    I16,
    /// 8-bit float, OCP E4M3 (`float8::F8E4M3`): 4 exponent bits, 3 mantissa bits, no
    /// infinities, largest finite 448. Sums and products are computed in f32 and rounded to
    /// nearest even once per step, saturating to the largest finite value; NaN stays NaN.
    F8E4M3,
    /// 8-bit float, OCP E5M2 (`float8::F8E5M2`): 5 exponent bits, 2 mantissa bits, largest
    /// finite 57344. As [`DataType::F8E4M3`]: f32 within a step, one rounding per step,
    /// saturating to the largest finite value (an infinity too); NaN stays NaN.
    F8E5M2,
}

impl DataType {
    /// Every type, in a fixed order: a type's index is its code on the wire, so types are
    /// only ever appended.
    pub const ALL: [DataType; 13] = [
        DataType::F32,
        DataType::F64,
        DataType::F16,
        DataType::Bf16,
        DataType::I32,
        DataType::I64,
        DataType::U8,
        DataType::I8,
        DataType::U32,
        DataType::U64,
        DataType::I16,
        DataType::F8E4M3,
        DataType::F8E5M2,
    ];

    /// Whether the type is an integer (sums and products wrap, averages truncate).
    pub fn is_integer(self) -> bool {
        matches!(
            self,
            DataType::I32
                | DataType::I64
                | DataType::U8
                | DataType::I8
                | DataType::U32
                | DataType::U64
                | DataType::I16
        )
    }

    /// The type named `name` (as [`Self::name`] gives it).
    pub fn from_name(name: &str) -> Option<DataType> {
        DataType::ALL.into_iter().find(|d| d.name() == name)
    }

    /// The short name (`f32`, `bf16`, ...).
    pub fn name(self) -> &'static str {
        match self {
            DataType::F32 => "f32",
            DataType::F64 => "f64",
            DataType::F16 => "f16",
            DataType::Bf16 => "bf16",
            DataType::I32 => "i32",
            DataType::I64 => "i64",
            DataType::U8 => "u8",
            DataType::I8 => "i8",
            DataType::U32 => "u32",
            DataType::U64 => "u64",
            DataType::I16 => "i16",
            DataType::F8E4M3 => "f8e4m3",
            DataType::F8E5M2 => "f8e5m2",
        }
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DataType::F64 | DataType::I64 | DataType::U64 => 8,
            DataType::F32 | DataType::I32 | DataType::U32 => 4,
            DataType::F16 | DataType::Bf16 | DataType::I16 => 2,
            DataType::U8 | DataType::I8 | DataType::F8E4M3 | DataType::F8E5M2 => 1,
        }
    }
}

/// A [`ReduceOp::PreMulSum`] scalar: an `f64` kept as its bits, so that [`ReduceOp`] stays
/// `Eq` and `Hash` (two scalars are equal when their bits are; `-0.0` and `0.0` differ, and a
/// NaN equals itself).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Scalar(u64);

impl Scalar {
    /// One (`PreMulSum(Scalar::ONE)` is a sum).
    pub const ONE: Scalar = Scalar(0x3ff0_0000_0000_0000);

    /// The scalar `value`.
    pub fn new(value: f64) -> Scalar {
        Scalar(value.to_bits())
    }

    /// Its value.
    pub fn get(self) -> f64 {
        f64::from_bits(self.0)
    }
}

impl std::fmt::Debug for Scalar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.get())
    }
}

/// Reduction operations.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ReduceOp {
    /// Sum (integers wrap).
    Sum,
    /// Product (integers wrap).
    Prod,
    /// Minimum.
    Min,
    /// Maximum.
    Max,
    /// Mean: the sum divided by the number of ranks (integers truncate).
    Avg,
    /// `Σ scalar_r · x_r`: each rank's input multiplied by that rank's own scalar, then summed
    /// (NCCL's `ncclRedOpCreatePreMulSum`, torch's `PREMUL_SUM`; `scalar = 1 / world` is the
    /// data-parallel average). The scalar is per rank, so it is not part of what the ranks
    /// agree on: the collective is "a PreMulSum", whatever each rank multiplies by. Each
    /// element is multiplied as it is first read (the staging copy, the first reduction
    /// that reads it: no separate pass), in f32 for the 8- and 16-bit floats and f32, in f64
    /// for f64, and rounded to the type once; the products are then summed as [`ReduceOp::Sum`]
    /// sums. For integer types the scalar must be a whole number (the product wraps). On
    /// device memory the GPU ring multiplies in its first send and its reducing receives,
    /// the one-kernel path in its copy in (on a symmetric buffer, in place before its first
    /// barrier); one rank, the staged path and a `from_devices` set multiply in a pass of
    /// their own (`docs/internals.md`).
    PreMulSum(Scalar),
}

impl ReduceOp {
    /// Every operation, in a fixed order: an operation's index is its code on the wire, so
    /// operations are only ever appended (`PreMulSum` stands for every scalar).
    pub const ALL: [ReduceOp; 6] = [
        ReduceOp::Sum,
        ReduceOp::Prod,
        ReduceOp::Min,
        ReduceOp::Max,
        ReduceOp::Avg,
        ReduceOp::PreMulSum(Scalar::ONE),
    ];

    /// `PreMulSum(scalar)`.
    pub fn pre_mul_sum(scalar: f64) -> ReduceOp {
        ReduceOp::PreMulSum(Scalar::new(scalar))
    }

    /// The operation's wire code (its index in [`Self::ALL`]; a PreMulSum's scalar is not
    /// part of it).
    pub fn code(self) -> u8 {
        match self {
            ReduceOp::Sum => 0,
            ReduceOp::Prod => 1,
            ReduceOp::Min => 2,
            ReduceOp::Max => 3,
            ReduceOp::Avg => 4,
            ReduceOp::PreMulSum(_) => 5,
        }
    }

    /// The scalar this rank multiplies its input by (`PreMulSum` only).
    pub fn scalar(self) -> Option<f64> {
        match self {
            ReduceOp::PreMulSum(s) => Some(s.get()),
            _ => None,
        }
    }

    /// Whether the ranks' values are combined by addition (`Sum`, `Avg`, `PreMulSum`).
    pub fn adds(self) -> bool {
        matches!(self, ReduceOp::Sum | ReduceOp::Avg | ReduceOp::PreMulSum(_))
    }

    /// The short name (`sum`, ...).
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Prod => "prod",
            ReduceOp::Min => "min",
            ReduceOp::Max => "max",
            ReduceOp::Avg => "avg",
            ReduceOp::PreMulSum(_) => "premulsum",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_are_the_index_in_all_whatever_the_scalar() {
        for (i, op) in ReduceOp::ALL.into_iter().enumerate() {
            assert_eq!(usize::from(op.code()), i);
        }
        assert_eq!(ReduceOp::pre_mul_sum(0.125).code(), 5);
        assert_eq!(ReduceOp::pre_mul_sum(0.125).scalar(), Some(0.125));
        assert_ne!(ReduceOp::pre_mul_sum(0.125), ReduceOp::pre_mul_sum(0.25));
        assert_eq!(
            ReduceOp::pre_mul_sum(f64::NAN),
            ReduceOp::pre_mul_sum(f64::NAN)
        );
        assert_eq!(
            format!("{:?}", ReduceOp::pre_mul_sum(0.5)),
            "PreMulSum(0.5)"
        );
    }
}
