//! Coded tensors on the device: a codec [`DtansTensor`] uploaded for the dtANS-LLM kernels
//! (`ops::dtans`), with its dequantisation parameters.

use cudarc::driver::CudaSlice;
use entrollm_codec::dtans::{Coding, DtansTensor, Mode};
use entrollm_codec::matvec::Dequant;
use entrollm_codec::Payload;

use crate::device::GpuDevice;
use crate::error::{GpuError, Result};
use crate::mem::upload;

const OP: &str = "dtans upload";

/// Group scales (and mins) of an integer or scaled-float payload: `w = scale·(v − offset) + min`
/// per group of `group` columns of a row (see `entrollm_codec::matvec::Dequant::Groups`).
pub struct GpuGroups {
    pub group: usize,
    pub scales: CudaSlice<f32>,
    pub mins: Option<CudaSlice<f32>>,
    pub offset: f32,
    pub signed: bool,
}

/// A dtANS-LLM tensor in device memory, ready for `ops::dtans::launch_*`.
pub struct GpuDtans {
    pub payload: Payload,
    pub coding: Coding,
    pub rows: usize,
    pub cols: usize,
    /// The M decoder entries `r | d << 8 | payload << 16`.
    pub entries: CudaSlice<u32>,
    /// Value of each code as f32 bits (code-only payloads; signed integers as two's complement).
    pub lut: CudaSlice<u32>,
    pub tiles: CudaSlice<u32>,
    pub stream: CudaSlice<u32>,
    pub stream_len: usize,
    pub companion: CudaSlice<u32>,
    pub raw: CudaSlice<u8>,
    pub groups: Option<GpuGroups>,
    /// Bytes of the coded arrays (what a matvec reads), as `DtansTensor::stored_bytes`.
    pub stored_bytes: usize,
}

/// Whether the kernels handle this payload and coding; the reason if not.
pub fn check_supported(payload: Payload, coding: &Coding) -> Result<()> {
    coding
        .validate(payload)
        .map_err(|e| GpuError::invalid(OP, e.to_string()))?;
    if payload == Payload::Fp16 {
        return Err(GpuError::invalid(
            OP,
            "fp16 payloads have no GPU kernel yet (bf16, fp8, fp4 and int payloads do)",
        ));
    }
    if coding.mode == Mode::Quad {
        return Err(GpuError::invalid(
            OP,
            "Quad mode has no GPU kernel yet (Single and Pair do)",
        ));
    }
    Ok(())
}

/// Checks that groups of `group` columns fit the kernels' epilogues for this coding: smaller than a
/// slice, whole quartets that divide the slice and tile an 8-quartet iteration (or are whole
/// iterations); at least a slice, whole slices (or one group per row).
pub fn check_group(coding: &Coding, cols: usize, group: usize) -> Result<()> {
    let sc = coding.sc as usize;
    let k = coding.mode.values_per_symbol();
    let iter_cols = 32 * k;
    let ok = if group == 0 {
        false
    } else if group >= cols {
        true // one group per row
    } else if group < sc {
        group % (4 * k) == 0
            && sc % group == 0
            && (iter_cols % group == 0 || group % iter_cols == 0)
    } else {
        group % sc == 0
    };
    if ok {
        Ok(())
    } else {
        Err(GpuError::invalid(
            OP,
            format!(
                "groups of {group} columns do not fit slices of {sc} columns in {:?} mode \
                 (need a multiple of {} dividing {sc}, or a multiple of {sc}, or ≥ {cols})",
                coding.mode,
                4 * k
            ),
        ))
    }
}

pub(crate) fn lut(payload: Payload, signed: bool) -> Vec<u32> {
    (0..256u32)
        .map(|c| {
            let v = match payload {
                Payload::Int(bits) if c >= 1 << bits => 0.0,
                Payload::Int(bits) if signed && c >= 1 << (bits - 1) => {
                    c as f32 - (1u32 << bits) as f32
                }
                Payload::Int(_) => c as f32,
                Payload::Bf16 | Payload::Fp16 => 0.0,
                p if c >= p.alphabet() as u32 => 0.0,
                p => p.to_f32(c as u8, 0),
            };
            v.to_bits()
        })
        .collect()
}

/// Uploads a non-empty copy of `data` (the kernels never read the padding of empty arrays).
fn upload_nonempty<T: cudarc::driver::DeviceRepr + Clone + Default>(
    dev: &GpuDevice,
    data: &[T],
) -> Result<CudaSlice<T>> {
    if data.is_empty() {
        upload(dev, &vec![T::default(); 16])
    } else {
        upload(dev, data)
    }
}

impl GpuDtans {
    /// Uploads `t` with the dequantisation `dq` applied by the kernels. Checks the tensor's structure
    /// (sizes, table, tile offsets: what makes the kernels' memory accesses safe), that the kernels
    /// support its payload and coding, and the sizes of `dq`. The content is not decoded here: the
    /// kernels flag inconsistent streams through their error word, and the container's checksums
    /// catch the rest.
    pub fn upload(dev: &GpuDevice, t: &DtansTensor, dq: &Dequant) -> Result<Self> {
        check_supported(t.payload, &t.coding)?;
        t.validate()
            .map_err(|e| GpuError::invalid(OP, e.to_string()))?;
        dq.check(t.rows, t.cols)
            .map_err(|e| GpuError::invalid(OP, e.to_string()))?;
        if t.rows > i32::MAX as usize || t.cols > i32::MAX as usize {
            return Err(GpuError::invalid(
                OP,
                format!("{}×{} is too large", t.rows, t.cols),
            ));
        }
        let (groups, signed) = match *dq {
            Dequant::None => (None, false),
            Dequant::Groups {
                group,
                scales,
                mins,
                offset,
                signed,
            } => {
                check_group(&t.coding, t.cols, group)?;
                if group > i32::MAX as usize {
                    return Err(GpuError::invalid(OP, format!("group of {group} columns")));
                }
                (
                    Some(GpuGroups {
                        group,
                        scales: upload(dev, scales)?,
                        mins: mins.map(|m| upload(dev, m)).transpose()?,
                        offset,
                        signed,
                    }),
                    signed,
                )
            }
        };
        Ok(GpuDtans {
            payload: t.payload,
            coding: t.coding,
            rows: t.rows,
            cols: t.cols,
            entries: upload(dev, &t.table.decoder_entries())?,
            lut: upload(dev, &lut(t.payload, signed))?,
            tiles: upload(dev, &t.tiles)?,
            stream: upload(dev, &t.stream)?,
            stream_len: t.stream.len(),
            companion: upload_nonempty(dev, &t.companion)?,
            raw: upload_nonempty(dev, &t.raw)?,
            groups,
            stored_bytes: t.stored_bytes(),
        })
    }

    /// Bytes of the decoded elements (2 per element for 16-bit payloads, else 1).
    pub fn decoded_bytes(&self) -> usize {
        self.rows * self.cols * self.payload.element_bytes()
    }

    pub fn groups(&self) -> Option<&GpuGroups> {
        self.groups.as_ref()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn coding(mode: Mode, sc: u32) -> Coding {
        Coding {
            mode,
            log2_m: 8,
            sc,
            t: None,
        }
    }

    #[test]
    fn luts_hold_code_values() {
        let l = lut(Payload::Int(4), true);
        assert_eq!(f32::from_bits(l[3]), 3.0);
        assert_eq!(f32::from_bits(l[15]), -1.0);
        assert_eq!(f32::from_bits(l[16]), 0.0);
        let l = lut(Payload::Int(8), false);
        assert_eq!(f32::from_bits(l[200]), 200.0);
        let l = lut(Payload::Fp8E4m3, false);
        assert_eq!(f32::from_bits(l[0x38]), 1.0);
        assert_eq!(f32::from_bits(l[0]), 0.0);
    }

    #[test]
    fn groups_must_fit_the_epilogue() {
        let pair = coding(Mode::Pair, 2048);
        assert!(check_group(&pair, 4096, 32).is_ok());
        assert!(check_group(&pair, 4096, 128).is_ok());
        assert!(check_group(&pair, 4096, 2048).is_ok());
        assert!(check_group(&pair, 4096, 4096).is_ok());
        assert!(check_group(&pair, 5000, 5000).is_ok());
        assert!(check_group(&pair, 4096, 0).is_err());
        assert!(check_group(&pair, 4096, 4).is_err()); // not whole quartets
        assert!(check_group(&pair, 4096, 96).is_err()); // does not divide the slice
        assert!(check_group(&pair, 8192, 3072).is_err()); // not whole slices
        let single = coding(Mode::Single, 64);
        assert!(check_group(&single, 100, 32).is_ok());
        assert!(check_group(&single, 100, 16).is_ok());
        let single128 = coding(Mode::Single, 128);
        assert!(check_group(&single128, 100, 100).is_ok()); // one group per row
    }

    #[test]
    fn unsupported_codings_are_named() {
        assert!(check_supported(Payload::Bf16, &coding(Mode::Pair, 512)).is_ok());
        assert!(check_supported(Payload::Int(4), &coding(Mode::Pair, 512)).is_ok());
        assert!(check_supported(Payload::Fp16, &coding(Mode::Single, 512)).is_err());
        assert!(check_supported(Payload::Int(2), &coding(Mode::Quad, 512)).is_err());
        assert!(check_supported(Payload::Bf16, &coding(Mode::Pair, 100)).is_err());
    }
}
