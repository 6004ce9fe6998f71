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
}

impl ReduceOp {
    /// Every operation, in a fixed order.
    pub const ALL: [ReduceOp; 5] = [
        ReduceOp::Sum,
        ReduceOp::Prod,
        ReduceOp::Min,
        ReduceOp::Max,
        ReduceOp::Avg,
    ];

    /// The short name (`sum`, ...).
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Prod => "prod",
            ReduceOp::Min => "min",
            ReduceOp::Max => "max",
            ReduceOp::Avg => "avg",
        }
    }
}
