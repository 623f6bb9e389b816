//! Cold-cache timing of the ggml kernels (`ops::ggml`) under the protocol of `bench.rs`: copies
//! of the matrix covering more than 2× L2, rotated through by a CUDA graph of ≥ 400 µs of
//! launches, median of 5 replays. `ggml_mv` is checked first against the CPU form's product.

use entrollm_model::forms::ggml::synth_blocks;
use entrollm_model::gguf::GgmlType;

use crate::ggml_selftest::{product, q8_dequantised, reference, MV_TOLERANCE};
use crate::selftest::{rel_l2, Rng};
use entrollm_cuda::device::GpuDevice;
use entrollm_cuda::error::{GpuError, Result};
use entrollm_cuda::mem::{download, upload};
use entrollm_cuda::ops::ggml::{
    launch_dequant, launch_mv, launch_mv_q8, launch_q8x, q8_types, GpuGgml, Q8Acts,
};
use entrollm_cuda::timing::{copies_for, time_cold};

/// What was timed on one matrix of one type.
#[derive(Clone, Debug)]
pub struct GgmlTiming {
    pub copies: usize,
    /// Bytes of the blocks (what one product reads).
    pub bytes: usize,
    /// Median µs of one batch-1 product, and its blocks read a second (TB/s).
    pub mv_us: f64,
    pub mv_tb_s: f64,
    /// Median µs of the q8 product (the activations' quantisation, then `ggml_mv_q8`) where the
    /// type has one, and of `ggml_mv_q8` alone.
    pub q8_us: Option<(f64, f64)>,
    /// Median µs of one dequantisation to BF16.
    pub dequant_us: f64,
    /// The product's relative L2 error against the CPU form's.
    pub mv_rel_l2: f64,
}

/// Random `ty` blocks of `rows` × `cols` (as many copies as cover 2× L2), the product checked
/// against the CPU's, then the product and the dequantisation timed cold.
pub fn time_ggml(
    dev: &GpuDevice,
    ty: GgmlType,
    rows: usize,
    cols: usize,
    seed: u64,
) -> Result<GgmlTiming> {
    let bs = ty.block_size();
    let blocks = synth_blocks(ty, rows * cols / bs.max(1), seed);
    let bytes = blocks.len();
    let copies = copies_for(bytes, dev.info().l2_bytes);
    let mats: Vec<GpuGgml> = (0..copies)
        .map(|_| GpuGgml::upload(dev, ty, rows, cols, &[&blocks]))
        .collect::<Result<_>>()?;
    let x = Rng::new(seed ^ 1).normals(cols, 1.0);
    let (want, _) = reference(ty, rows, cols, &blocks, &x)?;
    let dx = upload(dev, &x)?;
    let mut y = upload(dev, &vec![f32::NAN; rows])?;
    launch_mv(dev, &mats[0], &dx, &mut y, 0)?;
    let mv_rel_l2 = rel_l2(&download(dev, &y)?, &want);
    if mv_rel_l2 > MV_TOLERANCE {
        return Err(GpuError::invalid(
            "ggml bench",
            format!(
                "the product of a {rows} × {cols} {ty} matrix is off (relative L2 {mv_rel_l2:.2e})"
            ),
        ));
    }
    let (mv_us, _) = time_cold(dev, copies, bytes, |c| {
        launch_mv(dev, &mats[c], &dx, &mut y, 0)
    })?;
    let q8_us = match q8_types().contains(&ty) {
        true => {
            let mut acts = Q8Acts::new(dev, cols)?;
            launch_q8x(dev, ty, &dx, &mut acts)?;
            launch_mv_q8(dev, &mats[0], &acts, &mut y, 0)?;
            let (_, w) = reference(
                ty,
                rows.min(64),
                cols,
                &blocks[..blocks.len() / rows * rows.min(64)],
                &x,
            )?;
            let want = product(&w, &q8_dequantised(&x));
            let e = rel_l2(&download(dev, &y)?[..rows.min(64)], &want);
            if e > MV_TOLERANCE {
                return Err(GpuError::invalid(
                    "ggml bench",
                    format!("the q8 product of a {rows} × {cols} {ty} matrix is off (relative L2 {e:.2e})"),
                ));
            }
            let (both, _) = time_cold(dev, copies, bytes, |c| {
                launch_q8x(dev, ty, &dx, &mut acts)?;
                launch_mv_q8(dev, &mats[c], &acts, &mut y, 0)
            })?;
            let (alone, _) = time_cold(dev, copies, bytes, |c| {
                launch_mv_q8(dev, &mats[c], &acts, &mut y, 0)
            })?;
            Some((both, alone))
        }
        false => None,
    };
    let mut out = upload(dev, &vec![0u16; rows * cols])?;
    let (dequant_us, _) = time_cold(dev, copies, bytes + 2 * rows * cols, |c| {
        launch_dequant(dev, &mats[c], &mut out, 0)
    })?;
    Ok(GgmlTiming {
        copies,
        bytes,
        mv_us,
        mv_tb_s: bytes as f64 / (mv_us * 1e-6) / 1e12,
        q8_us,
        dequant_us,
        mv_rel_l2,
    })
}
