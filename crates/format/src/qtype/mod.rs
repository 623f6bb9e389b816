//! The ggml quant types, one table row each (ggml's `type_traits`): name, GGUF id, block size and
//! bytes, the block's codes and side fields, its dequantisation (the scalar reference), and which
//! parts of the engine handle it. The GGUF reader, the container ([`crate::kquants`],
//! [`crate::ggml_blocks`], `compress`), the CPU form (`forms::ggml`) and the GPU launcher key on
//! the row; [`GgmlType`] is the row's index. Adding a type: docs/format.md §"Adding a GGUF quant
//! type".

pub mod dequant;

use crate::dtype::Dtype;
use crate::kquants::{Field, FieldKind};
pub use dequant::BlockFn;
use std::fmt;

/// A ggml tensor type as stored in a GGUF tensor info: the index of its row in [`TYPES`]. Ids
/// that ggml removed (4, 5, 31–33, 36–38) and ids beyond the known range are not representable:
/// the reader rejects them, as gguf.cpp does.
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
    Q8_K,
    IQ2_XXS,
    IQ2_XS,
    IQ3_XXS,
    IQ1_S,
    IQ4_NL,
    IQ3_S,
    IQ2_S,
    IQ4_XS,
    I8,
    I16,
    I32,
    I64,
    F64,
    IQ1_M,
    BF16,
    TQ1_0,
    TQ2_0,
    MXFP4,
    NVFP4,
    Q1_0,
    Q2_0,
}

/// One quant type.
#[derive(Debug)]
pub struct QType {
    pub ty: GgmlType,
    /// ggml's name (`Q4_K`, `BF16`, ...).
    pub name: &'static str,
    /// The id a GGUF tensor info stores.
    pub id: u32,
    /// Weights (elements) per block.
    pub block_weights: usize,
    /// Bytes per block.
    pub block_bytes: usize,
    /// The block as integer codes and side fields ([`crate::kquants::split`]); `None` where the
    /// engine does not split it.
    pub codes: Option<Codes>,
    /// ggml's dequantisation of one block ([`dequant`]); `None` where the engine has none.
    pub to_f32: Option<BlockFn>,
    /// How the container stores a matrix of the type.
    pub store: Store,
    /// The CPU form `ggml` multiplies it in place (its fused kernels, `forms::ggml`).
    pub cpu: bool,
    /// The GPU kernels (`kernels/ggml.cu`) multiply and dequantise it.
    pub gpu: bool,
}

/// A block's codes: one per weight, weight order, and every other bit of the block in a field.
#[derive(Debug)]
pub struct Codes {
    /// Bits per code.
    pub bits: u32,
    /// The block's fields besides its codes, in the order [`crate::kquants::Split::fields`]
    /// holds them.
    pub fields: &'static [Field],
    /// How codes are weights where they are integers scaled per group; `None` where they index
    /// a table (IQ4, FP4).
    pub int: Option<IntCodes>,
}

/// Codes that are weights as `scale · (code − offset) + min`, a scale (and min) per group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IntCodes {
    /// Weights a scale.
    pub group: usize,
    /// The code that means zero before scaling.
    pub offset: u32,
    /// Codes are two's complement (Q8_0's i8).
    pub signed: bool,
    /// Groups have mins.
    pub mins: bool,
}

/// How the container stores a matrix of a type (smaller tensors are stored as they are).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Store {
    /// Integer codes coded as one stream, the per-block `d` (and `m`) beside
    /// ([`crate::ggml_blocks`], `ggml` coded tensors): the legacy 32-weight types.
    Codes,
    /// Codes and each side field coded where that pays ([`crate::kquants`], `ggml-blocks`).
    Split,
    /// Floats of this dtype.
    Float(Dtype),
    /// The bytes as they are.
    Bytes,
}

const D: Field = crate::kquants::field("d", 1, FieldKind::Half);
const DMIN: Field = crate::kquants::field("dmin", 1, FieldKind::Half);
const fn bits(name: &'static str, per_block: usize, bits: u8) -> Field {
    crate::kquants::field(name, per_block, FieldKind::Bits(bits))
}

const fn int(group: usize, offset: u32, signed: bool, mins: bool) -> Option<IntCodes> {
    Some(IntCodes {
        group,
        offset,
        signed,
        mins,
    })
}

const fn codes(bits: u32, fields: &'static [Field], int: Option<IntCodes>) -> Option<Codes> {
    Some(Codes { bits, fields, int })
}

/// A type the engine only reads the size of.
const fn sized(ty: GgmlType, name: &'static str, id: u32, bw: usize, bb: usize) -> QType {
    QType {
        ty,
        name,
        id,
        block_weights: bw,
        block_bytes: bb,
        codes: None,
        to_f32: None,
        store: Store::Bytes,
        cpu: false,
        gpu: false,
    }
}

/// A float type, one element a block.
const fn float(ty: GgmlType, name: &'static str, id: u32, dtype: Dtype, f: BlockFn) -> QType {
    let bytes = match dtype {
        Dtype::F32 => 4,
        _ => 2,
    };
    QType {
        to_f32: Some(f),
        store: Store::Float(dtype),
        ..sized(ty, name, id, 1, bytes)
    }
}

/// A quantised type the engine splits, dequantises and multiplies on CPU and GPU.
const fn quant(
    ty: GgmlType,
    name: &'static str,
    id: u32,
    (bw, bb): (usize, usize),
    codes: Option<Codes>,
    f: BlockFn,
    store: Store,
) -> QType {
    QType {
        codes,
        to_f32: Some(f),
        store,
        cpu: true,
        gpu: true,
        ..sized(ty, name, id, bw, bb)
    }
}

const ROWS: [QType; 35] = {
    use dequant as q;
    use GgmlType::*;
    use Store::{Codes as C, Split as S};
    const DM: [Field; 2] = [D, crate::kquants::field("m", 1, FieldKind::Half)];
    const Q2K: [Field; 4] = [D, DMIN, bits("sc", 16, 4), bits("mn", 16, 4)];
    const Q3K: [Field; 2] = [D, bits("sc", 16, 6)];
    const Q4K: [Field; 4] = [D, DMIN, bits("sc", 8, 6), bits("mn", 8, 6)];
    const Q6K: [Field; 2] = [D, bits("sc", 16, 8)];
    const IQ4XS: [Field; 2] = [D, bits("sc", 8, 6)];
    const MX: [Field; 1] = [bits("e", 1, 8)];
    const NV: [Field; 1] = [bits("d", 4, 8)];
    [
        float(F32, "F32", 0, Dtype::F32, q::f32_le),
        float(F16, "F16", 1, Dtype::F16, q::f16_le),
        quant(
            Q4_0,
            "Q4_0",
            2,
            (32, 18),
            codes(4, &[D], int(32, 8, false, false)),
            q::q4_0,
            C,
        ),
        quant(
            Q4_1,
            "Q4_1",
            3,
            (32, 20),
            codes(4, &DM, int(32, 0, false, true)),
            q::q4_1,
            C,
        ),
        quant(
            Q5_0,
            "Q5_0",
            6,
            (32, 22),
            codes(5, &[D], int(32, 16, false, false)),
            q::q5_0,
            C,
        ),
        quant(
            Q5_1,
            "Q5_1",
            7,
            (32, 24),
            codes(5, &DM, int(32, 0, false, true)),
            q::q5_1,
            C,
        ),
        quant(
            Q8_0,
            "Q8_0",
            8,
            (32, 34),
            codes(8, &[D], int(32, 0, true, false)),
            q::q8_0,
            C,
        ),
        sized(Q8_1, "Q8_1", 9, 32, 36),
        quant(
            Q2_K,
            "Q2_K",
            10,
            (256, 84),
            codes(2, &Q2K, int(16, 0, false, true)),
            q::q2_k,
            S,
        ),
        quant(
            Q3_K,
            "Q3_K",
            11,
            (256, 110),
            codes(3, &Q3K, int(16, 4, false, false)),
            q::q3_k,
            S,
        ),
        quant(
            Q4_K,
            "Q4_K",
            12,
            (256, 144),
            codes(4, &Q4K, int(32, 0, false, true)),
            q::q4_k,
            S,
        ),
        quant(
            Q5_K,
            "Q5_K",
            13,
            (256, 176),
            codes(5, &Q4K, int(32, 0, false, true)),
            q::q5_k,
            S,
        ),
        quant(
            Q6_K,
            "Q6_K",
            14,
            (256, 210),
            codes(6, &Q6K, int(16, 32, false, false)),
            q::q6_k,
            S,
        ),
        sized(Q8_K, "Q8_K", 15, 256, 292),
        sized(IQ2_XXS, "IQ2_XXS", 16, 256, 66),
        sized(IQ2_XS, "IQ2_XS", 17, 256, 74),
        sized(IQ3_XXS, "IQ3_XXS", 18, 256, 98),
        sized(IQ1_S, "IQ1_S", 19, 256, 50),
        quant(
            IQ4_NL,
            "IQ4_NL",
            20,
            (32, 18),
            codes(4, &[D], None),
            q::iq4_nl,
            S,
        ),
        sized(IQ3_S, "IQ3_S", 21, 256, 110),
        sized(IQ2_S, "IQ2_S", 22, 256, 82),
        quant(
            IQ4_XS,
            "IQ4_XS",
            23,
            (256, 136),
            codes(4, &IQ4XS, None),
            q::iq4_xs,
            S,
        ),
        sized(I8, "I8", 24, 1, 1),
        sized(I16, "I16", 25, 1, 2),
        sized(I32, "I32", 26, 1, 4),
        sized(I64, "I64", 27, 1, 8),
        sized(F64, "F64", 28, 1, 8),
        sized(IQ1_M, "IQ1_M", 29, 256, 56),
        float(BF16, "BF16", 30, Dtype::BF16, q::bf16_le),
        sized(TQ1_0, "TQ1_0", 34, 256, 54),
        sized(TQ2_0, "TQ2_0", 35, 256, 66),
        quant(
            MXFP4,
            "MXFP4",
            39,
            (32, 17),
            codes(4, &MX, None),
            q::mxfp4,
            S,
        ),
        quant(
            NVFP4,
            "NVFP4",
            40,
            (64, 36),
            codes(4, &NV, None),
            q::nvfp4,
            S,
        ),
        sized(Q1_0, "Q1_0", 41, 128, 18),
        sized(Q2_0, "Q2_0", 42, 64, 18),
    ]
};

/// The table: row `t as usize` is type `t`'s.
pub static TYPES: [QType; 35] = ROWS;

/// Each row's (weights, bytes) a block, for [`GgmlType::block_layout`] in const contexts.
const LAYOUTS: [(usize, usize); 35] = {
    let mut out = [(0, 0); 35];
    let mut i = 0;
    while i < 35 {
        out[i] = (ROWS[i].block_weights, ROWS[i].block_bytes);
        i += 1;
    }
    out
};

/// A part of the engine that handles some types.
#[derive(Clone, Copy)]
enum Part {
    Dequant,
    Cpu,
    Gpu,
}

const fn has(row: &QType, part: Part) -> bool {
    match part {
        Part::Dequant => row.to_f32.is_some(),
        Part::Cpu => row.cpu,
        Part::Gpu => row.gpu,
    }
}

const fn count(part: Part) -> usize {
    let (mut i, mut n) = (0, 0);
    while i < ROWS.len() {
        n += has(&ROWS[i], part) as usize;
        i += 1;
    }
    n
}

/// The types `part` handles, in id order.
const fn select<const N: usize>(part: Part) -> [GgmlType; N] {
    let mut out = [GgmlType::F32; N];
    let (mut i, mut n) = (0, 0);
    while i < ROWS.len() {
        if has(&ROWS[i], part) {
            out[n] = ROWS[i].ty;
            n += 1;
        }
        i += 1;
    }
    out
}

/// The types with a dequantisation ([`QType::to_f32`]).
pub const DEQUANTIZABLE: [GgmlType; count(Part::Dequant)] = select(Part::Dequant);
/// The types the CPU form multiplies in place ([`QType::cpu`]).
pub const CPU: [GgmlType; count(Part::Cpu)] = select(Part::Cpu);
/// The types the GPU kernels run ([`QType::gpu`]).
pub const GPU: [GgmlType; count(Part::Gpu)] = select(Part::Gpu);

impl GgmlType {
    /// Every type the reader accepts, in id order.
    pub const ALL: [GgmlType; 35] = {
        let mut out = [GgmlType::F32; 35];
        let mut i = 0;
        while i < 35 {
            out[i] = ROWS[i].ty;
            i += 1;
        }
        out
    };

    /// The type's row of [`TYPES`].
    pub fn row(self) -> &'static QType {
        &TYPES[self as usize]
    }

    /// The type with this on-disk id, or `None` for removed or unknown ids.
    pub fn from_id(id: u32) -> Option<GgmlType> {
        TYPES.iter().find(|r| r.id == id).map(|r| r.ty)
    }

    /// The type ggml names `name`.
    pub fn from_name(name: &str) -> Option<GgmlType> {
        TYPES.iter().find(|r| r.name == name).map(|r| r.ty)
    }

    pub fn id(self) -> u32 {
        self.row().id
    }

    /// ggml's name for the type (`Q4_K`, `BF16`, ...).
    pub fn name(self) -> &'static str {
        self.row().name
    }

    /// (elements per block, bytes per block), from ggml's type traits (`ggml-common.h`). A
    /// `const fn`: the CPU kernels' block sizes are compile-time constants.
    pub const fn block_layout(self) -> (usize, usize) {
        LAYOUTS[self as usize]
    }

    pub fn block_size(self) -> usize {
        self.block_layout().0
    }

    pub fn type_size(self) -> usize {
        self.block_layout().1
    }

    /// Bytes of `n` elements, or `None` if `n` is not a whole number of blocks or overflows.
    pub fn bytes_for(self, n: u64) -> Option<u64> {
        let (bs, ts) = self.block_layout();
        if !n.is_multiple_of(bs as u64) {
            return None;
        }
        (n / bs as u64).checked_mul(ts as u64)
    }

    /// Storage bits per weight of the type.
    pub fn bits_per_weight(self) -> f64 {
        self.row().block_bytes as f64 * 8.0 / self.row().block_weights as f64
    }

    /// Whether [`crate::kquants::split`] splits the type's blocks into codes and fields.
    pub fn splits(self) -> bool {
        self.row().codes.is_some()
    }

    /// Bits per code; 0 for a type that does not split ([`GgmlType::splits`]).
    pub fn code_bits(self) -> u32 {
        self.row().codes.as_ref().map_or(0, |c| c.bits)
    }

    /// The block's fields besides its codes (none for a type that does not split).
    pub fn fields(self) -> &'static [Field] {
        self.row().codes.as_ref().map_or(&[], |c| c.fields)
    }

    /// How the codes are integer weights, where they are.
    pub fn int_codes(self) -> Option<IntCodes> {
        self.row().codes.as_ref().and_then(|c| c.int)
    }

    /// The float dtype of a float type (F32, F16, BF16).
    pub fn float_dtype(self) -> Option<Dtype> {
        match self.row().store {
            Store::Float(d) => Some(d),
            _ => None,
        }
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Containers record a type by its ggml name.
impl serde::Serialize for GgmlType {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

impl<'de> serde::Deserialize<'de> for GgmlType {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<GgmlType, D::Error> {
        let name = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        GgmlType::from_name(&name)
            .ok_or_else(|| serde::de::Error::custom(format!("unknown ggml type `{name}`")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every row against the GGUF spec's numbers, written out independently of the table: gguf-py's
    /// `GGMLQuantizationType` ids and `GGML_QUANT_SIZES` (elements, bytes per block), which
    /// ggml-common.h's `static_assert`s on the block structs fix.
    #[test]
    fn every_row_agrees_with_the_gguf_spec() {
        #[rustfmt::skip]
        const SPEC: [(&str, u32, usize, usize); 35] = [
            ("F32", 0, 1, 4),
            ("F16", 1, 1, 2),
            ("Q4_0", 2, 32, 2 + 16),                                // d qs[16]
            ("Q4_1", 3, 32, 2 + 2 + 16),                            // d m qs[16]
            ("Q5_0", 6, 32, 2 + 4 + 16),                            // d qh[4] qs[16]
            ("Q5_1", 7, 32, 2 + 2 + 4 + 16),                        // d m qh[4] qs[16]
            ("Q8_0", 8, 32, 2 + 32),                                // d qs[32]
            ("Q8_1", 9, 32, 4 + 32),                                // ds qs[32]
            ("Q2_K", 10, 256, 16 + 64 + 2 + 2),                     // scales qs d dmin
            ("Q3_K", 11, 256, 32 + 64 + 12 + 2),                    // hmask qs scales d
            ("Q4_K", 12, 256, 2 + 2 + 12 + 128),                    // d dmin scales qs
            ("Q5_K", 13, 256, 2 + 2 + 12 + 32 + 128),               // d dmin scales qh qs
            ("Q6_K", 14, 256, 128 + 64 + 16 + 2),                   // ql qh scales d
            ("Q8_K", 15, 256, 4 + 256 + 2 * 16),                    // d qs bsums
            ("IQ2_XXS", 16, 256, 2 + 2 * 32),                       // d qs
            ("IQ2_XS", 17, 256, 2 + 2 * 32 + 8),                    // d qs scales
            ("IQ3_XXS", 18, 256, 2 + 96),                           // d qs
            ("IQ1_S", 19, 256, 2 + 32 + 2 * 8),                     // d qs qh
            ("IQ4_NL", 20, 32, 2 + 16),                             // d qs
            ("IQ3_S", 21, 256, 2 + 64 + 8 + 32 + 4),                // d qs qh signs scales
            ("IQ2_S", 22, 256, 2 + 64 + 8 + 8),                     // d qs qh scales
            ("IQ4_XS", 23, 256, 2 + 2 + 4 + 128),                   // d scales_h scales_l qs
            ("I8", 24, 1, 1),
            ("I16", 25, 1, 2),
            ("I32", 26, 1, 4),
            ("I64", 27, 1, 8),
            ("F64", 28, 1, 8),
            ("IQ1_M", 29, 256, 32 + 16 + 8),                        // qs qh scales
            ("BF16", 30, 1, 2),
            ("TQ1_0", 34, 256, (256 - 4 * 256 / 64) / 5 + 4 + 2),   // qs qh d
            ("TQ2_0", 35, 256, 64 + 2),                             // qs d
            ("MXFP4", 39, 32, 1 + 16),                              // e qs
            ("NVFP4", 40, 64, 4 + 32),                              // d[4] qs
            ("Q1_0", 41, 128, 2 + 128 / 8),                         // d qs
            ("Q2_0", 42, 64, 2 + 64 / 4),                           // d qs
        ];
        for (i, (row, &(name, id, bw, bb))) in TYPES.iter().zip(&SPEC).enumerate() {
            assert_eq!(row.ty as usize, i, "{name}: row {i} is {:?}'s", row.ty);
            assert_eq!(
                (row.name, row.id, row.block_weights, row.block_bytes),
                (name, id, bw, bb),
                "row {i}"
            );
            assert_eq!(format!("{:?}", row.ty), name);
            assert_eq!(GgmlType::from_id(id), Some(row.ty));
            assert_eq!(GgmlType::from_name(name), Some(row.ty));
        }
        for removed in [4, 5, 31, 32, 33, 36, 37, 38, 43, 1000] {
            assert_eq!(GgmlType::from_id(removed), None, "id {removed}");
        }
    }

    /// A split type's codes and fields hold every bit of its block once; the legacy types the
    /// container codes as [`Store::Codes`] are the 32-weight blocks of a scale `d` (and `m`) and
    /// 4-, 5- or 8-bit integer codes that [`crate::ggml_blocks`] unpacks.
    #[test]
    fn codes_and_fields_cover_each_block() {
        for row in &TYPES {
            let Some(c) = &row.codes else {
                assert!(
                    !matches!(row.store, Store::Codes | Store::Split),
                    "{}",
                    row.name
                );
                continue;
            };
            let field_bits: usize = c
                .fields
                .iter()
                .map(|f| {
                    f.per_block
                        * match f.kind {
                            FieldKind::Half => 16,
                            FieldKind::Bits(b) => b as usize,
                        }
                })
                .sum();
            let code_bits = row.block_weights * c.bits as usize;
            assert_eq!(field_bits + code_bits, 8 * row.block_bytes, "{}", row.name);
            if let Some(i) = c.int {
                assert!(row.block_weights.is_multiple_of(i.group), "{}", row.name);
                assert!(i.offset < 1 << c.bits && !(i.signed && i.offset != 0));
            }
            if row.store == Store::Codes {
                let names: Vec<&str> = c.fields.iter().map(|f| f.name).collect();
                let legacy = c
                    .int
                    .is_some_and(|i| i.group == 32 && i.mins == (names == ["d", "m"]));
                assert!(
                    row.block_weights == 32 && [4, 5, 8].contains(&c.bits),
                    "{}",
                    row.name
                );
                assert!(
                    legacy && names[0] == "d" && names.len() <= 2,
                    "{}",
                    row.name
                );
            }
        }
    }

    /// The kernels run what the reference dequantises; the GPU's selftest checks against the CPU
    /// form, so the GPU runs only CPU types.
    #[test]
    fn parts_handle_consistent_types() {
        for row in &TYPES {
            assert!(!row.cpu || row.to_f32.is_some(), "{}", row.name);
            assert!(!row.gpu || row.cpu, "{}", row.name);
            let float = row.ty.float_dtype().is_some();
            assert!(
                !float || (row.to_f32.is_some() && row.block_weights == 1),
                "{}",
                row.name
            );
        }
        assert!(CPU.windows(2).all(|w| w[0].id() < w[1].id()));
        assert_eq!(GgmlType::ALL.map(|t| t.row().ty), GgmlType::ALL);
    }

    #[test]
    fn types_serialize_by_name() {
        let j = serde_json::to_value(GgmlType::Q4_K).unwrap();
        assert_eq!(j, serde_json::json!("Q4_K"));
        assert_eq!(
            serde_json::from_value::<GgmlType>(j).unwrap(),
            GgmlType::Q4_K
        );
        assert!(serde_json::from_value::<GgmlType>(serde_json::json!("Q4K")).is_err());
    }
}
