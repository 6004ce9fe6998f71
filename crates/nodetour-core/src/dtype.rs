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
}

impl DataType {
    /// Every type, in a fixed order.
    pub const ALL: [DataType; 7] = [
        DataType::F32,
        DataType::F64,
        DataType::F16,
        DataType::Bf16,
        DataType::I32,
        DataType::I64,
        DataType::U8,
    ];

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
        }
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DataType::F64 | DataType::I64 => 8,
            DataType::F32 | DataType::I32 => 4,
            DataType::F16 | DataType::Bf16 => 2,
            DataType::U8 => 1,
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
