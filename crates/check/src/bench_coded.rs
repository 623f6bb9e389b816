//! Cold-cache timing of the dtANS-LLM `mvm` kernel on BF16 weights coded losslessly, beside the
//! dense BF16 GEMV (ours and cuBLAS), under the protocol of `bench.rs`: copies of the coded arrays
//! covering more than 2× L2, rotated through by a CUDA graph of ≥ 400 µs of launches, median of 5
//! replays.
//!
//! Weights are model-like: BF16 of N(0, 0.02). Large matrices are coded from a base of
//! `BASE_ROWS` rows whose tiles are repeated band by band up to the full row count
//! ([`repeat_bands`]): every tile is stored (and read) separately, so memory traffic and decoding
//! work are those of the full matrix; only the encoding time is saved.

use cudarc::driver::CudaSlice;
use entrollm_codec::dtans::{Coding, DtansTensor, Geometry, Mode};
use entrollm_codec::matvec::Dequant;
use entrollm_codec::Payload;
use rayon::prelude::*;

use crate::dtans_selftest::builtin_variants;
use crate::selftest::{rel_l2, Rng};
use entrollm_codec::rng::GAMMA;
use entrollm_cuda::coded::GpuDtans;
use entrollm_cuda::device::GpuDevice;
use entrollm_cuda::error::{DriverContext, GpuError, Result};
use entrollm_cuda::jit::KernelVariant;
use entrollm_cuda::mem::{download, upload};
use entrollm_cuda::ops::dtans::{launch_dequant, launch_mvm, DtansConfig, DtansKind, DtansOut};
use entrollm_cuda::timing::{copies_for, time_cold};

/// Rows coded for real; larger matrices repeat these bands.
pub const BASE_ROWS: usize = 2048;

/// BF16 N(0, σ) weights as little-endian bytes, generated in parallel.
pub fn synth_bf16(rows: usize, cols: usize, sigma: f32, seed: u64) -> Vec<u8> {
    let mut out = vec![0u8; rows * cols * 2];
    out.par_chunks_mut(1 << 16).enumerate().for_each(|(i, c)| {
        // Seeds spread by GAMMA, as the measured benchmarks' data were made (bench/RESULTS.md).
        let mut rng = Rng::new(seed ^ (i as u64).wrapping_mul(GAMMA));
        for w in c.chunks_exact_mut(2) {
            let v = half::bf16::from_f32(rng.normal() * sigma).to_bits();
            w.copy_from_slice(&v.to_le_bytes());
        }
    });
    out
}

fn codec_err(e: entrollm_codec::CodecError) -> GpuError {
    GpuError::invalid("coded bench", e.to_string())
}

/// `t` with its bands repeated up to `rows` rows (a multiple of 32): band b of the result is band
/// b mod bands(t) of `t`, in every slice. Requires `t.rows` to be a multiple of 32.
pub fn repeat_bands(t: &DtansTensor, rows: usize) -> Result<DtansTensor> {
    let g = t.geometry().map_err(codec_err)?;
    if t.rows % 32 != 0 || rows % 32 != 0 || rows == 0 {
        return Err(GpuError::invalid(
            "repeat_bands",
            format!("{} → {rows} rows: both must be multiples of 32", t.rows),
        ));
    }
    let bands = rows / 32;
    let ng = Geometry::new(t.payload, &t.coding, rows, t.cols).map_err(codec_err)?;
    let comp_tile = 32 * g.companion_words;
    let raw_tile = if g.has_raw { 32 * g.sc } else { 0 };
    let mut tiles = Vec::with_capacity(2 * ng.tiles());
    let mut stream = Vec::new();
    let mut companion = Vec::with_capacity(ng.companion_len());
    let mut raw = Vec::with_capacity(ng.raw_len());
    for slice in 0..g.slices {
        for band in 0..bands {
            let src = slice * g.bands + band % g.bands;
            let start = t.tiles[2 * src] as usize;
            let end = t
                .tiles
                .get(2 * src + 2)
                .map_or(t.stream.len(), |&o| o as usize);
            let off = u32::try_from(stream.len())
                .map_err(|_| GpuError::invalid("repeat_bands", "stream exceeds 2^32 words"))?;
            tiles.extend([off, t.tiles[2 * src + 1]]);
            stream.extend_from_slice(&t.stream[start..end]);
            companion.extend_from_slice(&t.companion[src * comp_tile..(src + 1) * comp_tile]);
            raw.extend_from_slice(&t.raw[src * raw_tile..(src + 1) * raw_tile]);
        }
    }
    let out = DtansTensor {
        rows,
        tiles,
        stream,
        companion,
        raw,
        ..t.clone()
    };
    out.validate().map_err(codec_err)?;
    Ok(out)
}

/// Synthetic BF16 N(0, 0.02) `n × k` coded with `coding` (from up to BASE_ROWS coded rows).
pub fn coded_bf16(n: usize, k: usize, coding: Coding, seed: u64) -> Result<DtansTensor> {
    let base = n.min(BASE_ROWS);
    let bytes = synth_bf16(base, k, 0.02, seed);
    let (codes, raw) = Payload::Bf16.symbolize(&bytes).map_err(codec_err)?;
    let t = DtansTensor::encode(Payload::Bf16, base, k, &codes, &raw, coding).map_err(codec_err)?;
    if base == n {
        Ok(t)
    } else {
        repeat_bands(&t, n)
    }
}

/// A timed coded launch.
#[derive(Clone, Debug)]
pub struct CodedTiming {
    pub kernel: String,
    pub n: usize,
    pub k: usize,
    pub copies: usize,
    pub median_us: f64,
    pub bits_per_weight: f64,
    /// Dense-equivalent BF16 bytes (n·k·2) per second.
    pub dense_equiv_tb_per_s: f64,
    /// Coded bytes read per second.
    pub coded_tb_per_s: f64,
    pub log2_m: u8,
    pub sc: u32,
    pub t: u16,
}

/// One coded shape set up for cold-cache timing.
pub struct CodedBench<'a> {
    dev: &'a GpuDevice,
    pub tensor: DtansTensor,
    copies: Vec<GpuDtans>,
    x: Vec<f32>,
    x_d: CudaSlice<f32>,
    y: CudaSlice<f32>,
    reference: Option<Vec<f32>>,
}

impl<'a> CodedBench<'a> {
    pub fn new(dev: &'a GpuDevice, n: usize, k: usize, coding: Coding, seed: u64) -> Result<Self> {
        let tensor = coded_bf16(n, k, coding, seed)?;
        let bytes = tensor.stored_bytes();
        let copies = copies_for(bytes, dev.info().l2_bytes);
        let copies = (0..copies)
            .map(|_| GpuDtans::upload(dev, &tensor, &Dequant::None))
            .collect::<Result<Vec<_>>>()?;
        let x = Rng::new(seed + 1).normals(k, 1.0);
        Ok(CodedBench {
            dev,
            x_d: upload(dev, &x)?,
            x,
            y: dev
                .stream()
                .alloc_zeros(n)
                .while_(|| "allocating y".into())?,
            tensor,
            copies,
            reference: None,
        })
    }

    pub fn time(&mut self, cfg: DtansConfig) -> Result<CodedTiming> {
        let (dev, n, k) = (self.dev, self.tensor.rows, self.tensor.cols);
        let bytes = self.tensor.stored_bytes();
        let (copies, x, y) = (&self.copies, &self.x_d, &mut self.y);
        let (us, _) = time_cold(dev, copies.len(), bytes, |c| {
            launch_mvm(dev, cfg, &[&copies[c]], x, &mut [&mut *y], None)
        })?;
        let c = &self.tensor.coding;
        Ok(CodedTiming {
            kernel: format!("dtans {:?} M2^{} sc{} {cfg}", c.mode, c.log2_m, c.sc),
            n,
            k,
            copies: copies.len(),
            median_us: us,
            bits_per_weight: self.tensor.bits_per_weight(),
            dense_equiv_tb_per_s: (n * k * 2) as f64 / (us * 1e-6) / 1e12,
            coded_tb_per_s: bytes as f64 / (us * 1e-6) / 1e12,
            log2_m: c.log2_m,
            sc: c.sc,
            t: c.t.unwrap_or(0),
        })
    }

    /// Cold-cache µs of materialising the matrix as BF16 (`dequant`, for prefill GEMMs), and
    /// whether the result is bit-exact (checked on the last copy against the CPU decoder).
    pub fn time_dequant(&mut self, cfg: DtansConfig) -> Result<(f64, bool)> {
        let (dev, n, k) = (self.dev, self.tensor.rows, self.tensor.cols);
        let mut out = dev
            .stream()
            .alloc_zeros::<u16>(n * k)
            .while_(|| "allocating the dequant output".into())?;
        let copies = &self.copies;
        let (us, _) = time_cold(
            dev,
            copies.len(),
            self.tensor.stored_bytes() + 2 * n * k,
            |c| launch_dequant(dev, cfg, &copies[c], &mut out, None),
        )?;
        let got = download(dev, &out)?;
        let want = self.tensor.decode().map_err(codec_err)?;
        let exact = got
            .iter()
            .zip(want.chunks_exact(2))
            .all(|(&g, w)| g == u16::from_le_bytes([w[0], w[1]]));
        Ok((us, exact))
    }

    /// Relative L2 error of the mvm (on the last copy) against the codec's CPU matvec, and the
    /// error word.
    pub fn check(&mut self, cfg: DtansConfig) -> Result<(f64, u32)> {
        let mut err = upload(self.dev, &[0u32])?;
        let t = self
            .copies
            .last()
            .ok_or_else(|| GpuError::invalid("coded bench", "no uploaded copy"))?;
        launch_mvm(
            self.dev,
            cfg,
            &[t],
            &self.x_d,
            &mut [&mut self.y],
            Some(&mut err),
        )?;
        let got = download(self.dev, &self.y)?;
        let e = download(self.dev, &err)?[0];
        if self.reference.is_none() {
            let mut want = vec![0f32; self.tensor.rows];
            self.tensor
                .matvec(&self.x, &mut want, &Dequant::None)
                .map_err(codec_err)?;
            self.reference = Some(want);
        }
        Ok((rel_l2(&got, self.reference.as_deref().unwrap_or(&[])), e))
    }
}

/// Slice widths the timing compares.
pub const BENCH_SLICE_WIDTHS: [u32; 4] = [256, 512, 1024, 2048];

/// The BF16 codings the timing compares at slice width `sc`: Pair with M = 2^8, 2^9, 2^10 (0, 1, 2
/// companion bits per symbol; t = 16, 22, 32 kept exponents), and Single with M = 2^8.
pub fn bench_codings(sc: u32) -> Vec<Coding> {
    let mut v: Vec<Coding> = [(8u8, 16u16), (9, 22), (10, 32)]
        .into_iter()
        .map(|(log2_m, t)| Coding {
            mode: Mode::Pair,
            log2_m,
            sc,
            t: Some(t),
        })
        .collect();
    v.push(Coding {
        mode: Mode::Single,
        log2_m: 8,
        sc,
        t: None,
    });
    v
}

/// Every variant the timing sweep (`tests/dtans_gpu.rs`) launches: the built-in ones, and each
/// bench coding with each fitting [`bench_configs`] entry.
pub fn sweep_variants() -> Vec<KernelVariant> {
    let mut v = builtin_variants();
    for kind in bench_kinds() {
        let cfgs = bench_configs()
            .into_iter()
            .filter(|c| c.fits(&kind))
            .map(|c| (c, DtansOut::Mvm))
            .chain([4, 8].map(|w| (DtansConfig::warps(w), DtansOut::Dequant)));
        for (cfg, out) in cfgs {
            let var = kind.variant(cfg, out);
            if !v.contains(&var) {
                v.push(var);
            }
        }
    }
    v
}

/// Launch configurations the timing sweeps (unroll 4 only where the coding allows it).
pub fn bench_configs() -> Vec<DtansConfig> {
    let mut v = Vec::new();
    for fast in [false, true] {
        for (warps, min_warps, unroll) in [
            (4, 0, 0),
            (8, 0, 0),
            (16, 0, 0),
            (8, 24, 0),
            (8, 0, 4),
            (16, 0, 4),
        ] {
            v.push(DtansConfig {
                warps,
                min_warps,
                rep: 0,
                unroll,
                fast,
                entry: 16,
            });
        }
    }
    v
}

/// The BF16 codings the timing sweeps (`bench_coded::bench_codings`).
pub fn bench_kinds() -> Vec<DtansKind> {
    BENCH_SLICE_WIDTHS
        .into_iter()
        .flat_map(bench_codings)
        .map(|c| DtansKind::of(Payload::Bf16, &c, 4096, None))
        .collect()
}

/// The entry-size comparison of `dtans_gpu_entry_timing` for a launch whose engine configuration
/// is `base` (its warps, unroll and copies): 16-byte entries (plain and `fast`), the small entries (4 bytes, Pair also 8; Single
/// also 4 bytes in 16 copies) and the default entries with 4, 8 and 16 warps.
pub fn entry_timing_configs(kind: &DtansKind, base: DtansConfig) -> Vec<DtansConfig> {
    let base = DtansConfig {
        fast: false,
        entry: 0,
        ..base
    };
    let mut v = vec![
        DtansConfig { entry: 16, ..base },
        DtansConfig {
            entry: 16,
            fast: true,
            ..base
        },
        DtansConfig { entry: 4, ..base },
    ];
    if kind.k == 2 {
        v.push(DtansConfig { entry: 8, ..base });
    } else {
        v.push(DtansConfig {
            entry: 4,
            rep: 16,
            ..base
        });
    }
    for warps in [4, 8, 16] {
        if warps != base.warps {
            v.push(DtansConfig {
                warps,
                entry: 0,
                ..base
            });
        }
    }
    v.retain(|c| c.fits(kind));
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repeated_bands_decode_to_repeated_rows() {
        let coding = Coding {
            mode: Mode::Pair,
            log2_m: 8,
            sc: 64,
            t: Some(16),
        };
        let t = coded_bf16(64, 150, coding, 9).unwrap();
        let big = repeat_bands(&t, 160).unwrap();
        let (a, b) = (t.decode().unwrap(), big.decode().unwrap());
        let row = 150 * 2;
        for r in 0..160 {
            assert_eq!(
                &b[r * row..(r + 1) * row],
                &a[(r % 64) * row..(r % 64 + 1) * row]
            );
        }
        assert!(repeat_bands(&t, 100).is_err());
    }

    #[test]
    fn synthetic_weights_code_near_eleven_bits() {
        let t = coded_bf16(256, 4096, bench_codings(2048)[0], 1).unwrap();
        let bpw = t.bits_per_weight();
        assert!(bpw > 10.0 && bpw < 11.2, "{bpw}");
    }
}
