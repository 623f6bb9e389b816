//! safetensors dtypes (formats.md §2.2) and the byte size of a tensor.

use std::fmt;

/// An element type as safetensors names it. Names are the safetensors strings (`"BF16"`, ...).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Dtype {
    Bool,
    F4,
    F6E2M3,
    F6E3M2,
    U8,
    I8,
    F8E5M2,
    F8E4M3,
    F8E8M0,
    F8E4M3Fnuz,
    F8E5M2Fnuz,
    I16,
    U16,
    F16,
    BF16,
    I32,
    U32,
    F32,
    C64,
    F64,
    I64,
    U64,
}

impl Dtype {
    pub const ALL: [Dtype; 22] = [
        Dtype::Bool,
        Dtype::F4,
        Dtype::F6E2M3,
        Dtype::F6E3M2,
        Dtype::U8,
        Dtype::I8,
        Dtype::F8E5M2,
        Dtype::F8E4M3,
        Dtype::F8E8M0,
        Dtype::F8E4M3Fnuz,
        Dtype::F8E5M2Fnuz,
        Dtype::I16,
        Dtype::U16,
        Dtype::F16,
        Dtype::BF16,
        Dtype::I32,
        Dtype::U32,
        Dtype::F32,
        Dtype::C64,
        Dtype::F64,
        Dtype::I64,
        Dtype::U64,
    ];

    /// The safetensors name, e.g. `"F8_E4M3"`.
    pub fn name(self) -> &'static str {
        match self {
            Dtype::Bool => "BOOL",
            Dtype::F4 => "F4",
            Dtype::F6E2M3 => "F6_E2M3",
            Dtype::F6E3M2 => "F6_E3M2",
            Dtype::U8 => "U8",
            Dtype::I8 => "I8",
            Dtype::F8E5M2 => "F8_E5M2",
            Dtype::F8E4M3 => "F8_E4M3",
            Dtype::F8E8M0 => "F8_E8M0",
            Dtype::F8E4M3Fnuz => "F8_E4M3FNUZ",
            Dtype::F8E5M2Fnuz => "F8_E5M2FNUZ",
            Dtype::I16 => "I16",
            Dtype::U16 => "U16",
            Dtype::F16 => "F16",
            Dtype::BF16 => "BF16",
            Dtype::I32 => "I32",
            Dtype::U32 => "U32",
            Dtype::F32 => "F32",
            Dtype::C64 => "C64",
            Dtype::F64 => "F64",
            Dtype::I64 => "I64",
            Dtype::U64 => "U64",
        }
    }

    /// The dtype with this safetensors name (exact, case-sensitive), if any.
    pub fn from_name(name: &str) -> Option<Dtype> {
        Dtype::ALL.into_iter().find(|d| d.name() == name)
    }

    /// Bits per element.
    pub fn bits(self) -> u64 {
        match self {
            Dtype::F4 => 4,
            Dtype::F6E2M3 | Dtype::F6E3M2 => 6,
            Dtype::Bool
            | Dtype::U8
            | Dtype::I8
            | Dtype::F8E5M2
            | Dtype::F8E4M3
            | Dtype::F8E8M0
            | Dtype::F8E4M3Fnuz
            | Dtype::F8E5M2Fnuz => 8,
            Dtype::I16 | Dtype::U16 | Dtype::F16 | Dtype::BF16 => 16,
            Dtype::I32 | Dtype::U32 | Dtype::F32 => 32,
            Dtype::C64 | Dtype::F64 | Dtype::I64 | Dtype::U64 => 64,
        }
    }

    /// The alignment (bytes) a tensor of this dtype naturally wants: its element size, 1 for
    /// sub-byte types. Writers order tensors by it so every tensor starts aligned.
    pub fn alignment(self) -> usize {
        (self.bits() / 8).max(1) as usize
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl serde::Serialize for Dtype {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

impl<'de> serde::Deserialize<'de> for Dtype {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let name = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        Dtype::from_name(&name)
            .ok_or_else(|| serde::de::Error::custom(format!("unknown dtype '{name}'")))
    }
}

/// The number of bytes a tensor of `dtype` and `shape` occupies, or a message saying why the
/// shape is impossible (element count or bit count overflowing, or a sub-byte tensor that does
/// not end on a byte boundary).
pub fn tensor_byte_len(dtype: Dtype, shape: &[usize]) -> Result<usize, String> {
    let too_large = || format!("shape {shape:?} is too large: its size overflows");
    let numel = shape
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .ok_or_else(too_large)?;
    let bits = numel
        .checked_mul(dtype.bits() as usize)
        .ok_or_else(too_large)?;
    if bits % 8 != 0 {
        return Err(format!(
            "{numel} elements of {dtype} ({} bits each) do not fill whole bytes",
            dtype.bits()
        ));
    }
    Ok(bits / 8)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_are_unique() {
        for d in Dtype::ALL {
            assert_eq!(Dtype::from_name(d.name()), Some(d));
        }
        let mut names: Vec<_> = Dtype::ALL.iter().map(|d| d.name()).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), Dtype::ALL.len());
        assert_eq!(Dtype::from_name("bf16"), None);
        assert_eq!(Dtype::from_name("F8_E4M3FN"), None);
    }

    #[test]
    fn byte_lengths() {
        assert_eq!(tensor_byte_len(Dtype::BF16, &[3, 5]), Ok(30));
        assert_eq!(tensor_byte_len(Dtype::F32, &[]), Ok(4));
        assert_eq!(tensor_byte_len(Dtype::F32, &[0, 7]), Ok(0));
        assert_eq!(tensor_byte_len(Dtype::F4, &[2, 3]), Ok(3));
        assert_eq!(tensor_byte_len(Dtype::F6E2M3, &[4]), Ok(3));
        assert!(tensor_byte_len(Dtype::F4, &[3])
            .unwrap_err()
            .contains("whole bytes"));
        let e = tensor_byte_len(Dtype::U8, &[usize::MAX, 2]).unwrap_err();
        assert!(e.contains("overflows"), "{e}");
        // The element count fits but the bit count does not.
        let e = tensor_byte_len(Dtype::F64, &[usize::MAX / 8]).unwrap_err();
        assert!(e.contains("overflows"), "{e}");
    }

    #[test]
    fn serde_uses_safetensors_names() {
        let s = serde_json::to_string(&Dtype::F8E4M3).unwrap();
        assert_eq!(s, "\"F8_E4M3\"");
        let d: Dtype = serde_json::from_str("\"BF16\"").unwrap();
        assert_eq!(d, Dtype::BF16);
        let e = serde_json::from_str::<Dtype>("\"Q4_1\"")
            .unwrap_err()
            .to_string();
        assert!(e.contains("unknown dtype 'Q4_1'"), "{e}");
    }
}
