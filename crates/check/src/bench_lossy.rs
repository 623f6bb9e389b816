//! Cold-cache timing of the lossy kernels (`ops::lossy`) under the protocol of `bench.rs`: copies
//! of the coded matrix covering more than 2× L2, rotated through by a CUDA graph of ≥ 400 µs of
//! launches, median of 5 replays. `lossy_decode` writes BF16 into one output buffer (its rate is
//! GB of BF16 written a second); `lossy_mv` is the batch-1 product, checked first against the
//! codec's CPU product.

use cudarc::driver::CudaSlice;
use entrollm_codec::lossy::LossyTensor;

use crate::lossy_selftest::{reference_mv, MV_TOLERANCE};
use crate::selftest::{rel_l2, Rng};
use entrollm_cuda::device::GpuDevice;
use entrollm_cuda::error::{DriverContext, GpuError, Result};
use entrollm_cuda::mem::{download, upload};
use entrollm_cuda::ops::lossy::{launch_decode, launch_mv, GpuLossy, LossyOut};
use entrollm_cuda::timing::{copies_for, time_cold};

/// What was timed on one coded matrix.
#[derive(Clone, Debug)]
pub struct LossyTiming {
    pub copies: usize,
    /// Median µs of one decode to BF16, and GB of BF16 written a second.
    pub decode_us: f64,
    pub decode_gb_s: f64,
    /// Median µs of one batch-1 product.
    pub mv_us: f64,
    /// The product's relative L2 error against the codec's.
    pub mv_rel_l2: f64,
}

/// Uploads `t` (as many copies as cover 2× L2), checks the product against the CPU's, and times
/// the decode and the product cold.
pub fn time_lossy(dev: &GpuDevice, t: &LossyTensor, seed: u64) -> Result<LossyTiming> {
    let (rows, cols) = (t.rows, t.cols);
    let bytes = t.stored_bytes();
    let copies = copies_for(bytes, dev.info().l2_bytes);
    let mats: Vec<GpuLossy> = (0..copies)
        .map(|_| GpuLossy::upload(dev, t))
        .collect::<Result<_>>()?;
    let x = Rng::new(seed).normals(cols, 1.0);
    let dx = upload(dev, &x)?;
    let mut y: CudaSlice<f32> = upload(dev, &vec![f32::NAN; rows])?;
    let mut err = upload(dev, &[0u32])?;
    launch_mv(
        dev,
        &[&mats[0]],
        LossyOut::Bf16,
        &dx,
        &mut y,
        Some(&mut err),
    )?;
    let got = download(dev, &y)?;
    let want = reference_mv(t, &x, LossyOut::Bf16)?;
    let mv_rel_l2 = rel_l2(&got, &want);
    if download(dev, &err)?[0] != 0 || mv_rel_l2 > MV_TOLERANCE {
        return Err(GpuError::invalid(
            "lossy bench",
            format!(
                "the product of a {rows} × {cols} {} matrix is off (relative L2 {mv_rel_l2:.2e})",
                t.quantizer
            ),
        ));
    }
    let (mv_us, _) = time_cold(dev, copies, bytes, |c| {
        launch_mv(dev, &[&mats[c]], LossyOut::Bf16, &dx, &mut y, None)
    })?;
    let mut out = dev
        .stream()
        .alloc_zeros::<u16>(rows * cols)
        .while_(|| "allocating the decode output".into())?;
    let (decode_us, _) = time_cold(dev, copies, bytes + 2 * rows * cols, |c| {
        launch_decode(dev, &mats[c], LossyOut::Bf16, &mut out, 0, None)
    })?;
    Ok(LossyTiming {
        copies,
        decode_us,
        decode_gb_s: (2 * rows * cols) as f64 / (decode_us * 1e-6) / 1e9,
        mv_us,
        mv_rel_l2,
    })
}
