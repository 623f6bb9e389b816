//! The ggml kernels (`ops::ggml`) against the CPU form, on fresh random blocks of every type the
//! kernels run, ragged shapes included: `ggml_dequant` bit for bit the CPU's dequantisation
//! (`gguf::dequantize`) rounded to BF16; `ggml_mv` within f32-summation tolerance of the CPU
//! form's product (`GgmlLinear::matvec`, itself checked against the dequantised weights), into an
//! offset of its output as a launch's second part writes. Part `ggml` of `selftest --gpu`.

use entrollm_model::forms::ggml::{synth_blocks, BlockBytes, GGML};
use entrollm_model::forms::{Form, Source, Values};
use entrollm_model::gguf::{dequantize, GgmlType};

use crate::selftest::{rel_l2, CaseResult, Rng, SelftestReport};
use entrollm_codec::rng::splitmix64;
use entrollm_cuda::device::GpuDevice;
use entrollm_cuda::error::{GpuError, Result};
use entrollm_cuda::mem::{download, upload};
use entrollm_cuda::ops::ggml::{
    launch_dequant, launch_mv, launch_mv_q8, launch_q8x, q8_types, types, GpuGgml, Q8Acts,
};

/// The product's tolerance (relative L2 against the CPU form's f32 product).
pub const MV_TOLERANCE: f64 = 1e-5;

/// Shapes (rows, columns): ragged rows, one block to a 14336-column row; those whose columns are
/// not whole blocks of a type are left out for it.
const SHAPES: [(usize, usize); 11] = [
    (1, 32),
    (2, 64),
    (3, 96),
    (1, 256),
    (17, 768),
    (70, 576),
    (37, 1536),
    (5, 4096),
    (130, 2304),
    (64, 2048),
    (11, 14336),
];

fn model(what: &str, e: impl std::fmt::Display) -> GpuError {
    GpuError::invalid("ggml selftest", format!("{what}: {e}"))
}

/// The CPU form's product and dequantisation of `bytes` (`rows` × `cols` of `ty`).
pub(crate) fn reference(
    ty: GgmlType,
    rows: usize,
    cols: usize,
    bytes: &[u8],
    x: &[f32],
) -> Result<(Vec<f32>, Vec<f32>)> {
    let src = Source::new(
        rows,
        cols,
        Values::Ggml {
            ty,
            bytes: BlockBytes::from_vec(bytes.to_vec()),
        },
    )
    .map_err(|e| model("source", e))?;
    let lin = GGML.encode(&src, "").map_err(|e| model("encode", e))?;
    let mut y = vec![0f32; rows];
    lin.matvec(x, &mut y);
    let mut w = vec![0f32; rows * cols];
    dequantize("selftest", ty, bytes, &mut w).map_err(|e| model("dequantize", e))?;
    Ok((y, w))
}

/// `x` as `ggml_q8x` quantises it, dequantised: per 32, `d·q` with `q = round_even(x·127/m)`,
/// `d = m/127` for `m = max|x|` (the same f32 operations, so the same codes).
pub(crate) fn q8_dequantised(x: &[f32]) -> Vec<f32> {
    x.chunks(32)
        .flat_map(|b| {
            let amax = b.iter().fold(0f32, |m, v| m.max(v.abs()));
            let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
            let d = amax / 127.0;
            b.iter().map(move |&v| d * (v * id).round_ties_even())
        })
        .collect()
}

/// The product of `w` (`rows` × `cols`, row-major) with `x` in f64, rounded to f32.
pub(crate) fn product(w: &[f32], x: &[f32]) -> Vec<f32> {
    w.chunks(x.len())
        .map(|r| {
            r.iter()
                .zip(x)
                .map(|(&a, &b)| a as f64 * b as f64)
                .sum::<f64>() as f32
        })
        .collect()
}

/// Runs every case; a case that fails is recorded (never an early return), a driver error ends it.
pub fn selftest(dev: &GpuDevice, seed: u64) -> Result<SelftestReport> {
    let mut cases = Vec::new();
    let mut rng = Rng::new(seed);
    let mut case = 0u64;
    for &ty in types() {
        let (bs, ts) = ty.block_layout();
        for &(rows, cols) in SHAPES.iter().filter(|(_, c)| c % bs == 0) {
            case += 1;
            let shape = format!("{rows}x{cols} {ty}");
            let bytes = synth_blocks(ty, rows * cols / bs, splitmix64(seed ^ case));
            debug_assert_eq!(bytes.len(), rows * cols / bs * ts);
            let x = rng.normals(cols, 1.0);
            let (want_y, want_w) = reference(ty, rows, cols, &bytes, &x)?;
            let m = GpuGgml::upload(dev, ty, rows, cols, &[&bytes])?;

            // Dequantisation into an offset of a larger buffer, bit for bit.
            let at = 8;
            let mut out = upload(dev, &vec![0xFFFFu16; at + rows * cols + 8])?;
            launch_dequant(dev, &m, &mut out, at)?;
            let got = download(dev, &out)?;
            let mismatched = got[at..at + rows * cols]
                .iter()
                .zip(&want_w)
                .filter(|(g, w)| **g != half::bf16::from_f32(**w).to_bits())
                .count();
            let untouched = got[..at].iter().chain(&got[at + rows * cols..]);
            let overwritten = untouched.filter(|&&g| g != 0xFFFF).count();
            cases.push(CaseResult {
                kernel: "ggml_dequant".into(),
                shape: shape.clone(),
                rel_l2: (mismatched + overwritten) as f64,
                tolerance: 0.0,
            });

            // The product into rows 3.. of the output, as a launch's second part writes.
            let dx = upload(dev, &x)?;
            let mut y = upload(dev, &vec![f32::NAN; rows + 4])?;
            launch_mv(dev, &m, &dx, &mut y, 3)?;
            let got = download(dev, &y)?;
            let outside = [got[0], got[1], got[2], got[rows + 3]];
            cases.push(CaseResult {
                kernel: "ggml_mv".into(),
                shape: shape.clone(),
                rel_l2: match outside.iter().all(|v| v.is_nan()) {
                    true => rel_l2(&got[3..rows + 3], &want_y),
                    false => f64::INFINITY,
                },
                tolerance: MV_TOLERANCE,
            });

            // The q8 product likewise: the dequantised weights by the quantised activations.
            if q8_types().contains(&ty) {
                let want = product(&want_w, &q8_dequantised(&x));
                let mut acts = Q8Acts::new(dev, cols)?;
                let mut y = upload(dev, &vec![f32::NAN; rows + 4])?;
                launch_q8x(dev, ty, &dx, &mut acts)?;
                launch_mv_q8(dev, &m, &acts, &mut y, 3)?;
                let got = download(dev, &y)?;
                let outside = [got[0], got[1], got[2], got[rows + 3]];
                cases.push(CaseResult {
                    kernel: "ggml_mv_q8".into(),
                    shape,
                    rel_l2: match outside.iter().all(|v| v.is_nan()) {
                        true => rel_l2(&got[3..rows + 3], &want),
                        false => f64::INFINITY,
                    },
                    tolerance: MV_TOLERANCE,
                });
            }
        }
    }
    dev.synchronize()?;
    Ok(SelftestReport {
        device: dev.info().name.clone(),
        cases,
    })
}
