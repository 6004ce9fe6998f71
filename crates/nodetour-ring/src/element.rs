//! The element types collectives take, sealed: each names its [`DataType`], and a slice of it is
//! seen as bytes without a copy and without `unsafe` (bytemuck), so a runtime passes its
//! `Vec<f32>` or `Vec<bf16>` as it is.

use crate::reduce::DataType;

mod sealed {
    pub trait Sealed {}
}

/// An element type of a collective: `f32`, `f64`, `half::f16`, `half::bf16`, `i32`, `i64`,
/// `u8`, `i8`, `u32`, `u64`, `i16`, `float8::F8E4M3`, `float8::F8E5M2`. Sealed: these are the
/// types nodetour reduces (on the host and in its GPU kernels).
pub trait Element: sealed::Sealed + bytemuck::Pod + Send + Sync + 'static {
    /// The type as collectives name it (on the wire, in descriptors, in the kernels).
    const DATA_TYPE: DataType;
}

macro_rules! elements {
    ($($t:ty => $d:ident),* $(,)?) => {
        $(
            impl sealed::Sealed for $t {}
            impl Element for $t {
                const DATA_TYPE: DataType = DataType::$d;
            }
        )*
    };
}

elements!(
    f32 => F32,
    f64 => F64,
    half::f16 => F16,
    half::bf16 => Bf16,
    i32 => I32,
    i64 => I64,
    u8 => U8,
    i8 => I8,
    u32 => U32,
    u64 => U64,
    i16 => I16,
    float8::F8E4M3 => F8E4M3,
    float8::F8E5M2 => F8E5M2,
);

/// The bytes of `data`.
pub fn bytes<T: Element>(data: &[T]) -> &[u8] {
    bytemuck::cast_slice(data)
}

/// The bytes of `data`, in place.
pub fn bytes_mut<T: Element>(data: &mut [T]) -> &mut [u8] {
    bytemuck::cast_slice_mut(data)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_element_names_a_type_of_its_size() {
        fn check<T: Element>() {
            assert_eq!(std::mem::size_of::<T>(), T::DATA_TYPE.size());
        }
        check::<f32>();
        check::<f64>();
        check::<half::f16>();
        check::<half::bf16>();
        check::<i32>();
        check::<i64>();
        check::<u8>();
        check::<i8>();
        check::<u32>();
        check::<u64>();
        check::<i16>();
        check::<float8::F8E4M3>();
        check::<float8::F8E5M2>();
        let mut v = vec![1.0f32, 2.0];
        assert_eq!(bytes_mut(&mut v).len(), 8);
    }
}
