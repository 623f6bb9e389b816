//! dtANS-LLM encoding of BF16 matrices on the GPU (`kernels/dtans_encode.cu`): the host makes the
//! plan (histogram, kept codes, table: [`EncodePlan`]), the device does the per-weight work (raw
//! bytes, escapes, every lane's backward pass) and lays out each tile's stream; the output is
//! byte-identical to the CPU encoder's (`DtansTensor::encode`), which `dtans_selftest::encode_selftest`
//! checks.
//!
//! Where time goes: the plan needs the codes' histogram on the host (one pass over the codes; a
//! tuple histogram too in Pair mode); on the device, one pass for the lanes and two for the streams
//! (measure, write), with one small download of the tile lengths between them for the offsets.

use std::time::Instant;

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig, PushKernelArg};
use entrollm_codec::dtans::{Coding, DtansTensor, EncodePlan, LANES};
use entrollm_codec::Payload;
use rayon::prelude::*;

use crate::coded::GpuDtans;
use crate::device::GpuDevice;
use crate::error::{DriverContext, GpuError, Result};
use crate::jit::{KernelSource, KernelVariant};
use crate::mem::{download, upload};

pub static DTANS_ENCODE: KernelSource = KernelSource {
    name: "dtans_encode.cu",
    source: include_str!("../../kernels/dtans_encode.cu"),
};

const OP: &str = "dtans encode";
const BLOCK: u32 = 128;

/// The one compiled variant (every parameter is a runtime argument).
pub fn variant() -> KernelVariant {
    KernelVariant::new(&DTANS_ENCODE, vec![])
}

#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
struct EncParams {
    w: u64,
    key_slots: u64,
    coded_as: u64,
    escaped: u64,
    companion: u64,
    raw: u64,
    words: u64,
    flags: u64,
    prologue: u64,
    esc_count: u64,
    tiles_out: u64,
    lengths: u64,
    stream: u64,
    rows: i64,
    cols: i64,
    k: i32,
    sc: i32,
    bands: i32,
    n_tiles: i32,
    quartets: i32,
    cbits: i32,
    comp_words: i32,
    flag_words: i32,
    pad: i32,
    write: i32,
}

// SAFETY: plain-old-data with the C layout of the kernel's parameter struct.
unsafe impl DeviceRepr for EncParams {}

/// The codes of BF16 elements (the exponent byte), for the host's plan.
pub fn bf16_codes(bits: &[u16]) -> Vec<u8> {
    bits.par_iter()
        .map(|&b| Payload::Bf16.split16(b).0)
        .collect()
}

/// Where one GPU encode spent its time (seconds, host clock, device synchronised).
#[derive(Clone, Copy, Debug, Default)]
pub struct EncodeTimes {
    /// Lanes pass and the measuring pass of the streams.
    pub lanes_s: f64,
    /// Offsets (host prefix sum) and the writing pass.
    pub streams_s: f64,
    /// Copying the coded arrays to the host.
    pub download_s: f64,
}

/// Codes the BF16 matrix `w` (row-major [rows × cols], on the device) as `plan` (made on the host
/// from the same matrix's codes) says; returns the coded tensor on the host, byte-identical to
/// `DtansTensor::encode` of the same matrix and coding.
pub fn encode_bf16(
    dev: &GpuDevice,
    w: &CudaSlice<u16>,
    plan: &EncodePlan,
) -> Result<(DtansTensor, EncodeTimes)> {
    let (t, mut times) = encode_bf16_device(dev, w, plan)?;
    let g = plan.geometry;
    let t2 = Instant::now();
    let mut stream = download(dev, &t.stream)?;
    stream.truncate(t.stream_len);
    let mut index = download(dev, &t.tiles)?;
    index.truncate(2 * g.tiles());
    let mut companion = download(dev, &t.companion)?;
    companion.truncate(g.companion_len());
    let mut raw = download(dev, &t.raw)?;
    raw.truncate(g.raw_len());
    times.download_s = t2.elapsed().as_secs_f64();
    Ok((
        DtansTensor {
            payload: plan.payload,
            coding: plan.coding,
            rows: g.rows,
            cols: g.cols,
            table: plan.table.clone(),
            tiles: index,
            stream,
            companion,
            raw,
        },
        times,
    ))
}

/// Bytes of the coded arrays of a tensor coded by `plan` whose stream has `stream_len` words: what
/// `DtansTensor::stored_bytes` gives for the same tensor.
fn stored_bytes(plan: &EncodePlan, stream_len: usize) -> usize {
    let g = plan.geometry;
    4 * (2 * g.tiles() + stream_len + g.companion_len())
        + g.raw_len()
        + 5 * plan.table.symbols.len()
}

/// Codes the BF16 matrix `w` (on the device) as `plan` says and keeps the coded arrays on the
/// device, ready for the fused kernels (code at load: nothing coded is copied to the host). Host
/// traffic: the plan's tables up, the tile lengths down and the tile offsets up. The arrays are
/// those [`encode_bf16`] downloads (its `download_s` is 0 here).
pub fn encode_bf16_device(
    dev: &GpuDevice,
    w: &CudaSlice<u16>,
    plan: &EncodePlan,
) -> Result<(GpuDtans, EncodeTimes)> {
    if plan.payload != Payload::Bf16 {
        return Err(GpuError::invalid(
            OP,
            format!(
                "GPU encoding takes BF16 matrices, not {:?} (encode on the host)",
                plan.payload
            ),
        ));
    }
    let g = plan.geometry;
    super::check_len(OP, "w", w, g.rows * g.cols)?;
    if g.rows > i32::MAX as usize || g.cols > i32::MAX as usize {
        return Err(GpuError::invalid(
            OP,
            format!("{}×{} is too large", g.rows, g.cols),
        ));
    }
    let tiles = g.tiles();
    let steps = g.quartets - 1;
    let flag_words = steps.div_ceil(32);
    let i32_of = |name: &str, v: usize| super::as_i32(OP, name, v);
    let n_tiles = i32_of("tiles", tiles)?;
    let threads = tiles
        .checked_mul(LANES)
        .filter(|&t| t.div_ceil(BLOCK as usize) <= i32::MAX as usize)
        .ok_or_else(|| GpuError::invalid(OP, format!("{tiles} tiles are too many")))?;
    let s = dev.stream();
    let t0 = Instant::now();
    let key_slots = upload(dev, &plan.key_slots())?;
    let coded_as = upload(dev, &plan.coded_as)?;
    let escaped_bytes: Vec<u8> = plan.escaped.iter().map(|&e| e as u8).collect();
    let escaped = upload(dev, &escaped_bytes)?;
    let alloc = |n: usize, what: &str| -> Result<CudaSlice<u32>> {
        s.alloc_zeros::<u32>(n.max(1))
            .while_(|| format!("allocating {n} words for the {what}"))
    };
    let mut companion = alloc(g.companion_len(), "companion")?;
    let mut raw = s
        .alloc_zeros::<u8>(g.raw_len().max(1))
        .while_(|| "allocating the raw bytes".into())?;
    let mut words = alloc(tiles * LANES * steps, "emitted words")?;
    let mut flags = alloc(tiles * LANES * flag_words, "emit flags")?;
    let mut prologue = alloc(tiles * 2 * LANES, "prologues")?;
    let mut esc_count = alloc(tiles * LANES, "escape counts")?;
    let mut tiles_out = alloc(2 * tiles, "tile index")?;
    let mut lengths = alloc(tiles, "tile lengths")?;
    let f_lanes = dev.function(&variant(), "dtans_encode_lanes")?;
    let f_asm = dev.function(&variant(), "dtans_encode_assemble")?;
    let mut p = EncParams {
        w: w.device_ptr(s).0,
        key_slots: key_slots.device_ptr(s).0,
        coded_as: coded_as.device_ptr(s).0,
        escaped: escaped.device_ptr(s).0,
        companion: companion.device_ptr_mut(s).0,
        raw: raw.device_ptr_mut(s).0,
        words: words.device_ptr_mut(s).0,
        flags: flags.device_ptr_mut(s).0,
        prologue: prologue.device_ptr_mut(s).0,
        esc_count: esc_count.device_ptr_mut(s).0,
        tiles_out: tiles_out.device_ptr_mut(s).0,
        lengths: lengths.device_ptr_mut(s).0,
        stream: 0,
        rows: g.rows as i64,
        cols: g.cols as i64,
        k: g.k as i32,
        sc: g.sc as i32,
        bands: i32_of("bands", g.bands)?,
        n_tiles,
        quartets: g.quartets as i32,
        cbits: g.companion_bits_per_symbol as i32,
        comp_words: g.companion_words as i32,
        flag_words: flag_words as i32,
        pad: plan.pad as i32,
        write: 0,
    };
    let lc = LaunchConfig {
        grid_dim: (threads.div_ceil(BLOCK as usize) as u32, 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    };
    let launch = |f: &cudarc::driver::CudaFunction, p: &EncParams, what: &str| -> Result<()> {
        let mut b = s.launch_builder(f);
        b.arg(p);
        // SAFETY: `p` matches the kernel's parameter struct; every buffer was allocated above for
        // this geometry (w checked against rows × cols).
        unsafe { b.launch(lc) }
            .map(|_| ())
            .while_(|| format!("launching {what} on {}×{}", g.rows, g.cols))
    };
    launch(&f_lanes, &p, "dtans_encode_lanes")?;
    launch(&f_asm, &p, "dtans_encode_assemble (measure)")?;
    let lens = download(dev, &lengths)?;
    let lanes_s = t0.elapsed().as_secs_f64();

    let t1 = Instant::now();
    let mut index = vec![0u32; 2 * tiles];
    let mut total = 0u64;
    for (t, &n) in lens[..tiles].iter().enumerate() {
        index[2 * t] = u32::try_from(total).map_err(|_| {
            GpuError::invalid(OP, "coded stream exceeds 2^32 words; split the tensor")
        })?;
        total += n as u64;
    }
    let total = total as usize;
    s.memcpy_htod(&index, &mut tiles_out)
        .while_(|| "uploading tile offsets".into())?;
    let mut stream = alloc(total, "stream")?;
    p.stream = stream.device_ptr_mut(s).0;
    p.write = 1;
    launch(&f_asm, &p, "dtans_encode_assemble (write)")?;
    dev.synchronize()?;
    let streams_s = t1.elapsed().as_secs_f64();

    drop((words, flags, prologue, esc_count, lengths));
    Ok((
        GpuDtans {
            payload: plan.payload,
            coding: plan.coding,
            rows: g.rows,
            cols: g.cols,
            entries: upload(dev, &plan.table.decoder_entries())?,
            lut: upload(dev, &crate::coded::lut(plan.payload, false))?,
            tiles: tiles_out,
            stream,
            stream_len: total,
            companion,
            raw,
            groups: None,
            stored_bytes: stored_bytes(plan, total),
        },
        EncodeTimes {
            lanes_s,
            streams_s,
            download_s: 0.0,
        },
    ))
}

/// Plans on the host and encodes on the GPU: `bits` is uploaded, coded, and the tensor returned.
pub fn encode_bf16_host(
    dev: &GpuDevice,
    bits: &[u16],
    rows: usize,
    cols: usize,
    coding: Coding,
) -> Result<DtansTensor> {
    let codec = |e: entrollm_codec::CodecError| GpuError::invalid(OP, e.to_string());
    let plan =
        EncodePlan::new(Payload::Bf16, rows, cols, &bf16_codes(bits), coding).map_err(codec)?;
    let w = upload(dev, bits)?;
    Ok(encode_bf16(dev, &w, &plan)?.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn params_layout_matches_the_kernel() {
        assert_eq!(std::mem::size_of::<EncParams>(), 13 * 8 + 2 * 8 + 10 * 4);
    }

    #[test]
    fn stored_bytes_match_the_host_tensor() {
        for (rows, cols, coding) in [
            (33, 300, "single:8:256"),
            (64, 1024, "pair:9:512:12"),
            (5, 70, "pair:8:64"),
        ] {
            let coding = Coding::parse(coding).unwrap().unwrap();
            // Small values and, every 97th, a large one (escapes).
            let bits: Vec<u16> = (0..rows * cols)
                .map(|i| {
                    let v = if i % 97 == 5 {
                        300.0
                    } else {
                        (i * 37 % 101) as f32 * 4e-4 - 0.02
                    };
                    half::bf16::from_f32(v).to_bits()
                })
                .collect();
            let codes = bf16_codes(&bits);
            let raw: Vec<u8> = bits.iter().map(|&b| Payload::Bf16.split16(b).1).collect();
            let plan = EncodePlan::new(Payload::Bf16, rows, cols, &codes, coding).unwrap();
            let t = DtansTensor::encode_planned(&plan, &codes, &raw).unwrap();
            assert_eq!(stored_bytes(&plan, t.stream.len()), t.stored_bytes());
        }
    }

    #[test]
    fn bf16_codes_are_the_exponent_byte() {
        assert_eq!(
            bf16_codes(&[0x3F80, 0x8000, 0xFFFF, 0x0080]),
            [0x7F, 0, 0xFF, 1]
        );
    }
}
