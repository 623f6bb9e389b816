//! Cold-cache timing of the integer-code kernels (`ops::int`) under the protocol of `bench.rs`:
//! copies of the matrix covering more than 2× L2, rotated through by a CUDA graph of ≥ 400 µs of
//! launches, median of 5 replays. `int_mv` is checked first against the CPU form's product.

use crate::int_selftest::{packed, random_int, MV_TOLERANCE};
use crate::selftest::{rel_l2, Rng};
use entrollm_cuda::device::GpuDevice;
use entrollm_cuda::error::{GpuError, Result};
use entrollm_cuda::jit::KernelVariant;
use entrollm_cuda::mem::{download, upload};
use entrollm_cuda::ops::int::{launch_dequant, launch_mv, variant, GpuInt, Kind, ROWS};
use entrollm_cuda::timing::{copies_for, time_cold};

/// Rows a warp the timing compares (the served [`ROWS`] among them).
pub const ROWS_TRIED: [u32; 3] = [1, 2, 4];

/// The variants [`time_int`] may run beyond the served ones (for a kernel cache made ahead).
pub fn bench_variants() -> Vec<KernelVariant> {
    let mut v = Vec::new();
    for bits in entrollm_cuda::ops::int::BITS {
        for kind in Kind::ALL {
            for r in ROWS_TRIED.into_iter().filter(|&r| r != ROWS) {
                v.push(variant(bits, kind, r));
            }
        }
    }
    v
}

/// What was timed on one matrix.
#[derive(Clone, Debug)]
pub struct IntTiming {
    pub copies: usize,
    /// Bytes of the codes and scale table (what one product reads).
    pub bytes: usize,
    /// Median µs of one batch-1 product, and its bytes read a second (TB/s).
    pub mv_us: f64,
    pub mv_tb_s: f64,
    /// Median µs of one dequantisation to BF16.
    pub dequant_us: f64,
    /// The product's relative L2 error against the CPU form's.
    pub mv_rel_l2: f64,
}

/// How a timed matrix makes its weights: GPTQ symmetric (offset 2^(bits−1), one zero for all),
/// or asymmetric (a zero a group: mins).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Zeros {
    Symmetric,
    PerGroup,
}

/// A random `bits`-bit matrix of `rows` × `cols` in groups of `group` (as many copies as cover
/// 2× L2), the product checked against the CPU's, then the product (`rows_per_warp` rows a warp)
/// and the dequantisation timed cold.
#[allow(clippy::too_many_arguments)]
pub fn time_int(
    dev: &GpuDevice,
    bits: u8,
    zeros: Zeros,
    group: usize,
    rows: usize,
    cols: usize,
    rows_per_warp: u32,
    seed: u64,
) -> Result<IntTiming> {
    let mut rng = Rng::new(seed);
    let kind = match zeros {
        Zeros::Symmetric => (false, (1u32 << (bits - 1)) as f32, false),
        Zeros::PerGroup => (false, 0.0, true),
    };
    let m = random_int(&mut rng, bits, rows, cols, group, kind)?;
    let p = packed(&*m)?;
    let bytes = p.stored_bytes();
    let copies = copies_for(bytes, dev.info().l2_bytes);
    let mats: Vec<GpuInt> = (0..copies)
        .map(|_| {
            GpuInt::upload(dev, &p, None).map(|mut g| {
                g.rows_per_warp = rows_per_warp;
                g
            })
        })
        .collect::<Result<_>>()?;
    let x = rng.normals(cols, 1.0);
    let mut want = vec![0f32; rows];
    m.matvec(&x, &mut want);
    let dx = upload(dev, &x)?;
    let mut y = upload(dev, &vec![f32::NAN; rows])?;
    launch_mv(dev, &mats[0], &dx, &mut y, 0)?;
    let mv_rel_l2 = rel_l2(&download(dev, &y)?, &want);
    if mv_rel_l2 > MV_TOLERANCE {
        return Err(GpuError::invalid(
            "int bench",
            format!(
                "the product of a {rows} × {cols} {bits}-bit matrix is off (relative L2 {mv_rel_l2:.2e})"
            ),
        ));
    }
    let (mv_us, _) = time_cold(dev, copies, bytes, |c| {
        launch_mv(dev, &mats[c], &dx, &mut y, 0)
    })?;
    let mut out = upload(dev, &vec![0u16; rows * cols])?;
    let (dequant_us, _) = time_cold(dev, copies, bytes + 2 * rows * cols, |c| {
        launch_dequant(dev, &mats[c], &mut out, 0)
    })?;
    Ok(IntTiming {
        copies,
        bytes,
        mv_us,
        mv_tb_s: bytes as f64 / (mv_us * 1e-6) / 1e12,
        dequant_us,
        mv_rel_l2,
    })
}
