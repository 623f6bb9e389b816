//! GGUF value types (formats.md §1.1) and the ggml tensor types (§1.3, one table row each in
//! [`entrollm_format::qtype`]).

use std::fmt;

/// A ggml tensor type: the index of its row in the quant-type table
/// ([`entrollm_format::qtype::TYPES`]).
pub use entrollm_format::qtype::GgmlType;

/// The type tag of a metadata value (`gguf_metadata_value_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MetaType {
    U8,
    I8,
    U16,
    I16,
    U32,
    I32,
    F32,
    Bool,
    String,
    Array,
    U64,
    I64,
    F64,
}

impl MetaType {
    pub fn from_id(id: u32) -> Option<MetaType> {
        use MetaType::*;
        Some(match id {
            0 => U8,
            1 => I8,
            2 => U16,
            3 => I16,
            4 => U32,
            5 => I32,
            6 => F32,
            7 => Bool,
            8 => String,
            9 => Array,
            10 => U64,
            11 => I64,
            12 => F64,
            _ => return None,
        })
    }

    pub fn id(self) -> u32 {
        use MetaType::*;
        match self {
            U8 => 0,
            I8 => 1,
            U16 => 2,
            I16 => 3,
            U32 => 4,
            I32 => 5,
            F32 => 6,
            Bool => 7,
            String => 8,
            Array => 9,
            U64 => 10,
            I64 => 11,
            F64 => 12,
        }
    }

    /// The fewest bytes one value of this type occupies on disk (a string needs its u64 length;
    /// an array its element type and count). Used to bound counts by the bytes left in the file.
    pub fn min_size(self) -> u64 {
        use MetaType::*;
        match self {
            U8 | I8 | Bool => 1,
            U16 | I16 => 2,
            U32 | I32 | F32 => 4,
            U64 | I64 | F64 | String => 8,
            Array => 12,
        }
    }

    pub fn name(self) -> &'static str {
        use MetaType::*;
        match self {
            U8 => "uint8",
            I8 => "int8",
            U16 => "uint16",
            I16 => "int16",
            U32 => "uint32",
            I32 => "int32",
            F32 => "float32",
            Bool => "bool",
            String => "string",
            Array => "array",
            U64 => "uint64",
            I64 => "int64",
            F64 => "float64",
        }
    }
}

impl fmt::Display for MetaType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A metadata value. Arrays are stored typed, so a 150k-entry merge list is one `Vec<String>`.
#[derive(Clone, Debug, PartialEq)]
pub enum MetaValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(MetaArray),
    U64(u64),
    I64(i64),
    F64(f64),
}

/// A metadata array (nested arrays are rejected, as gguf.cpp does).
#[derive(Clone, Debug, PartialEq)]
pub enum MetaArray {
    U8(Vec<u8>),
    I8(Vec<i8>),
    U16(Vec<u16>),
    I16(Vec<i16>),
    U32(Vec<u32>),
    I32(Vec<i32>),
    F32(Vec<f32>),
    Bool(Vec<bool>),
    String(Vec<String>),
    U64(Vec<u64>),
    I64(Vec<i64>),
    F64(Vec<f64>),
}

impl MetaValue {
    pub fn meta_type(&self) -> MetaType {
        match self {
            MetaValue::U8(_) => MetaType::U8,
            MetaValue::I8(_) => MetaType::I8,
            MetaValue::U16(_) => MetaType::U16,
            MetaValue::I16(_) => MetaType::I16,
            MetaValue::U32(_) => MetaType::U32,
            MetaValue::I32(_) => MetaType::I32,
            MetaValue::F32(_) => MetaType::F32,
            MetaValue::Bool(_) => MetaType::Bool,
            MetaValue::String(_) => MetaType::String,
            MetaValue::Array(_) => MetaType::Array,
            MetaValue::U64(_) => MetaType::U64,
            MetaValue::I64(_) => MetaType::I64,
            MetaValue::F64(_) => MetaType::F64,
        }
    }

    /// The value as a signed integer if it is of any integer type (u64 above i64::MAX excluded).
    pub fn as_integer(&self) -> Option<i128> {
        Some(match *self {
            MetaValue::U8(v) => v.into(),
            MetaValue::I8(v) => v.into(),
            MetaValue::U16(v) => v.into(),
            MetaValue::I16(v) => v.into(),
            MetaValue::U32(v) => v.into(),
            MetaValue::I32(v) => v.into(),
            MetaValue::U64(v) => v.into(),
            MetaValue::I64(v) => v.into(),
            _ => return None,
        })
    }

    /// The value as a float if it is a float or an integer.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            MetaValue::F32(v) => Some(v.into()),
            MetaValue::F64(v) => Some(v),
            _ => self.as_integer().map(|v| v as f64),
        }
    }

    /// A short description for error messages: the type, and for arrays the element type.
    pub fn type_description(&self) -> String {
        match self {
            MetaValue::Array(a) => format!("array of {}", a.elem_type()),
            v => v.meta_type().to_string(),
        }
    }
}

impl MetaArray {
    pub fn elem_type(&self) -> MetaType {
        match self {
            MetaArray::U8(_) => MetaType::U8,
            MetaArray::I8(_) => MetaType::I8,
            MetaArray::U16(_) => MetaType::U16,
            MetaArray::I16(_) => MetaType::I16,
            MetaArray::U32(_) => MetaType::U32,
            MetaArray::I32(_) => MetaType::I32,
            MetaArray::F32(_) => MetaType::F32,
            MetaArray::Bool(_) => MetaType::Bool,
            MetaArray::String(_) => MetaType::String,
            MetaArray::U64(_) => MetaType::U64,
            MetaArray::I64(_) => MetaType::I64,
            MetaArray::F64(_) => MetaType::F64,
        }
    }

    pub fn len(&self) -> usize {
        match self {
            MetaArray::U8(v) => v.len(),
            MetaArray::I8(v) => v.len(),
            MetaArray::U16(v) => v.len(),
            MetaArray::I16(v) => v.len(),
            MetaArray::U32(v) => v.len(),
            MetaArray::I32(v) => v.len(),
            MetaArray::F32(v) => v.len(),
            MetaArray::Bool(v) => v.len(),
            MetaArray::String(v) => v.len(),
            MetaArray::U64(v) => v.len(),
            MetaArray::I64(v) => v.len(),
            MetaArray::F64(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Integer elements widened to i64 (u64 elements above i64::MAX give `None`), or `None` if
    /// the elements are not integers.
    pub fn to_i64_vec(&self) -> Option<Vec<i64>> {
        fn widen<T: Copy + Into<i64>>(v: &[T]) -> Option<Vec<i64>> {
            Some(v.iter().map(|&x| x.into()).collect())
        }
        match self {
            MetaArray::U8(v) => widen(v),
            MetaArray::I8(v) => widen(v),
            MetaArray::U16(v) => widen(v),
            MetaArray::I16(v) => widen(v),
            MetaArray::U32(v) => widen(v),
            MetaArray::I32(v) => widen(v),
            MetaArray::I64(v) => Some(v.clone()),
            MetaArray::U64(v) => v.iter().map(|&x| i64::try_from(x).ok()).collect(),
            _ => None,
        }
    }

    /// Numeric elements as f32 (integers and f64 converted), or `None` for strings and bools.
    pub fn to_f32_vec(&self) -> Option<Vec<f32>> {
        match self {
            MetaArray::F32(v) => Some(v.clone()),
            MetaArray::F64(v) => Some(v.iter().map(|&x| x as f32).collect()),
            other => other
                .to_i64_vec()
                .map(|v| v.into_iter().map(|x| x as f32).collect()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn type_ids_round_trip_and_removed_ids_are_rejected() {
        for t in GgmlType::ALL {
            assert_eq!(GgmlType::from_id(t.id()), Some(t), "{t}");
        }
        for removed in [4, 5, 31, 32, 33, 36, 37, 38, 43, 1000] {
            assert_eq!(GgmlType::from_id(removed), None, "id {removed}");
        }
    }

    #[test]
    fn block_layouts_match_the_ggml_structs() {
        assert_eq!(GgmlType::Q4_0.block_layout(), (32, 2 + 16));
        assert_eq!(GgmlType::Q4_1.block_layout(), (32, 2 + 2 + 16));
        assert_eq!(GgmlType::Q5_0.block_layout(), (32, 2 + 4 + 16));
        assert_eq!(GgmlType::Q5_1.block_layout(), (32, 2 + 2 + 4 + 16));
        assert_eq!(GgmlType::Q8_0.block_layout(), (32, 2 + 32));
        assert_eq!(GgmlType::Q4_K.block_layout(), (256, 2 + 2 + 12 + 128));
        assert_eq!(GgmlType::Q5_K.block_layout(), (256, 2 + 2 + 12 + 32 + 128));
        assert_eq!(GgmlType::Q6_K.block_layout(), (256, 128 + 64 + 16 + 2));
        assert_eq!(GgmlType::Q4_0.bytes_for(64), Some(36));
        assert_eq!(GgmlType::Q4_0.bytes_for(33), None);
        assert_eq!(GgmlType::F32.bytes_for(u64::MAX), None);
    }

    #[test]
    fn meta_type_ids_round_trip() {
        for id in 0..13 {
            assert_eq!(MetaType::from_id(id).unwrap().id(), id);
        }
        assert_eq!(MetaType::from_id(13), None);
    }

    #[test]
    fn arrays_widen() {
        assert_eq!(MetaArray::I32(vec![-1, 3]).to_i64_vec(), Some(vec![-1, 3]));
        assert_eq!(MetaArray::U64(vec![u64::MAX]).to_i64_vec(), None);
        assert_eq!(MetaArray::U8(vec![7]).to_f32_vec(), Some(vec![7.0]));
        assert_eq!(MetaArray::String(vec![]).to_f32_vec(), None);
    }
}
