//! The lossy kernels (`ops::lossy`) against the codec's CPU decoder and product, on fresh random
//! matrices coded at several rates by every quantiser kind, ragged shapes included: the decode is
//! bit-exact at every output precision (FP8 E4M3 and INT8: the codes of the codec's `decode_low`);
//! the product is within f32-summation tolerance of the
//! codec's `matmul` over the same rounded weights; damaged tiles raise the error word wherever the
//! CPU decoder rejects them. Part `lossy` of `selftest --gpu`.

use entrollm_codec::lossy::low::LowPrecision;
use entrollm_codec::lossy::{LossyTensor, Options, Quantizer};

use crate::selftest::{rel_l2, CaseResult, Rng, SelftestReport};
use entrollm_codec::rng::splitmix64;
use entrollm_cuda::device::GpuDevice;
use entrollm_cuda::error::{GpuError, Result};
use entrollm_cuda::mem::{download, upload};
use entrollm_cuda::ops::lossy::{
    launch_decode, launch_decode_low, launch_mv, GpuLossy, GpuLowRows, LossyOut,
};

/// The product's tolerance (relative L2 against the codec's f32 product).
pub const MV_TOLERANCE: f64 = 1e-5;

/// The CPU reference of `lossy_mv`: `t` decoded, each weight rounded as `out` serves it, times
/// `x` (f32 sums in row order).
pub(crate) fn reference_mv(t: &LossyTensor, x: &[f32], out: LossyOut) -> Result<Vec<f32>> {
    let w = t.decode().map_err(codec)?;
    Ok(w.chunks_exact(t.cols)
        .map(|row| row.iter().zip(x).map(|(&w, &x)| out.round(w) * x).sum())
        .collect())
}

fn codec(e: entrollm_codec::CodecError) -> GpuError {
    GpuError::invalid("lossy selftest", e.to_string())
}

/// Model-like weights: N(0, 0.02²) with heavier rows.
pub fn synth_weights(rows: usize, cols: usize, seed: u64) -> Vec<f32> {
    let mut r = Rng::new(seed);
    let mut w = Vec::with_capacity(rows * cols);
    for _ in 0..rows {
        let s = 0.02 * (0.3 * r.normal()).exp();
        w.extend(r.normals(cols, s));
    }
    w
}

/// The device's decode of `m` at `out` as bit patterns, and whether it raised the error word.
fn decode_bits(dev: &GpuDevice, m: &GpuLossy, out: LossyOut) -> Result<(Vec<u32>, bool)> {
    let n = m.rows * m.cols;
    let mut err = upload(dev, &[0u32])?;
    let bits = match out {
        LossyOut::F32 => {
            let mut o = upload(dev, &vec![f32::NAN; n])?;
            launch_decode(dev, m, out, &mut o, 0, Some(&mut err))?;
            download(dev, &o)?.iter().map(|v| v.to_bits()).collect()
        }
        _ => {
            let mut o = upload(dev, &vec![0xFFFFu16; n])?;
            launch_decode(dev, m, out, &mut o, 0, Some(&mut err))?;
            download(dev, &o)?.iter().map(|&v| v as u32).collect()
        }
    };
    let e = download(dev, &err)?[0];
    Ok((bits, e != 0))
}

/// The device's `kind` codes of `m` under rows `low`, and whether it raised the error word.
fn decode_low_codes(dev: &GpuDevice, m: &GpuLossy, low: &GpuLowRows) -> Result<(Vec<u8>, bool)> {
    let mut err = upload(dev, &[0u32])?;
    // 0x80 is FP8's −0 and INT8's unused −128: a code never written shows.
    let mut o = upload(dev, &vec![0x80u8; m.rows * m.cols])?;
    launch_decode_low(dev, m, low, &mut o, 0, Some(&mut err))?;
    Ok((download(dev, &o)?, download(dev, &err)?[0] != 0))
}

/// Runs every case; a case that fails is recorded (never an early return), a driver error ends it.
pub fn selftest(dev: &GpuDevice, seed: u64) -> Result<SelftestReport> {
    let quantizers = [
        Quantizer::E8,
        Quantizer::Tcq { log2_states: 2 },
        Quantizer::Tcq { log2_states: 5 },
        Quantizer::Tcq { log2_states: 8 },
    ];
    let shapes = [
        (1usize, 8usize),
        (3, 40),
        (9, 72),
        (37, 264),
        (5, 4104),
        (70, 520),
        (64, 576),
        (130, 1536),
        (11, 14336),
    ];
    let mut cases = Vec::new();
    let mut case = 0u64;
    let mut rng = Rng::new(seed);
    for q in quantizers {
        for &(rows, cols) in &shapes {
            if cols % q.row_multiple() != 0 {
                continue;
            }
            for bits in [2.0, 3.0, 4.4, 6.0] {
                case += 1;
                let shape = format!("{rows}x{cols} {q} {bits} bits");
                let w = synth_weights(rows, cols, splitmix64(seed ^ case));
                let (t, _) =
                    LossyTensor::encode(&w, rows, cols, &Options::new(bits, q)).map_err(codec)?;
                let m = GpuLossy::upload(dev, &t)?;
                let want = t.decode().map_err(codec)?;
                for out in LossyOut::ALL {
                    let (got, err) = decode_bits(dev, &m, out)?;
                    let mismatched = got
                        .iter()
                        .zip(&want)
                        .filter(|(g, w)| **g != out.bits(**w))
                        .count();
                    cases.push(CaseResult {
                        kernel: format!("lossy_decode {out:?}"),
                        shape: shape.clone(),
                        // Mismatched weights (and the error word) against none allowed.
                        rel_l2: mismatched as f64 + err as u8 as f64,
                        tolerance: 0.0,
                    });
                }
                for kind in LowPrecision::ALL {
                    let want = t.decode_low(kind).map_err(codec)?;
                    let low = GpuLowRows::upload(dev, &want.rows)?;
                    let (got, err) = decode_low_codes(dev, &m, &low)?;
                    let mismatched = got.iter().zip(&want.codes).filter(|(g, w)| g != w).count();
                    cases.push(CaseResult {
                        kernel: format!("lossy_decode {kind}"),
                        shape: shape.clone(),
                        rel_l2: mismatched as f64 + err as u8 as f64,
                        tolerance: 0.0,
                    });
                }
                let x = rng.normals(cols, 1.0);
                let dx = upload(dev, &x)?;
                for out in [LossyOut::Bf16, LossyOut::F32] {
                    let mut y = upload(dev, &vec![f32::NAN; rows])?;
                    let mut err = upload(dev, &[0u32])?;
                    launch_mv(dev, &[&m], out, &dx, &mut y, Some(&mut err))?;
                    let got = download(dev, &y)?;
                    let want = reference_mv(&t, &x, out)?;
                    let e = download(dev, &err)?[0];
                    cases.push(CaseResult {
                        kernel: format!("lossy_mv {out:?}"),
                        shape: shape.clone(),
                        rel_l2: if e != 0 {
                            f64::INFINITY
                        } else {
                            rel_l2(&got, &want)
                        },
                        tolerance: MV_TOLERANCE,
                    });
                }
            }
        }
    }
    // Stacked launches: q/k/v-like parts of different rows and rates in one product.
    for q in quantizers {
        let cols = 264;
        let parts: Vec<LossyTensor> = [(64usize, 4.0), (9, 2.5), (33, 6.0)]
            .iter()
            .enumerate()
            .map(|(i, &(rows, bits))| {
                let w = synth_weights(rows, cols, seed ^ (0x5A + i as u64));
                LossyTensor::encode(&w, rows, cols, &Options::new(bits, q))
                    .map(|r| r.0)
                    .map_err(codec)
            })
            .collect::<Result<_>>()?;
        let x = rng.normals(cols, 1.0);
        let mut want = Vec::new();
        for t in &parts {
            want.extend(reference_mv(t, &x, LossyOut::Bf16)?);
        }
        let ms = parts
            .iter()
            .map(|t| GpuLossy::upload(dev, t))
            .collect::<Result<Vec<_>>>()?;
        let refs: Vec<&GpuLossy> = ms.iter().collect();
        for n in 1..=refs.len() {
            let rows: usize = refs[..n].iter().map(|m| m.rows).sum();
            let mut y = upload(dev, &vec![f32::NAN; rows])?;
            let mut err = upload(dev, &[0u32])?;
            launch_mv(
                dev,
                &refs[..n],
                LossyOut::Bf16,
                &upload(dev, &x)?,
                &mut y,
                Some(&mut err),
            )?;
            let got = download(dev, &y)?;
            let e = download(dev, &err)?[0];
            cases.push(CaseResult {
                kernel: "lossy_mv stacked".into(),
                shape: format!("{n} parts ×{cols} {q}"),
                rel_l2: if e != 0 {
                    f64::INFINITY
                } else {
                    rel_l2(&got, &want[..rows])
                },
                tolerance: MV_TOLERANCE,
            });
        }
    }
    // An outlier row: its points reach past 448 and past 127 INT8 units, so the row takes FP8's other
    // multiplier and INT8's max-abs unit; the codes still match the CPU's, and INT8 must count it.
    for q in quantizers {
        let (rows, cols) = (8, 4096);
        let mut w = synth_weights(rows, cols, seed ^ 0x0071);
        for v in &mut w[3 * cols..4 * cols] {
            *v *= 0.05;
        }
        w[3 * cols + 100] = 1.0;
        let (t, _) = LossyTensor::encode(&w, rows, cols, &Options::new(6.0, q)).map_err(codec)?;
        let m = GpuLossy::upload(dev, &t)?;
        for kind in LowPrecision::ALL {
            let want = t.decode_low(kind).map_err(codec)?;
            let (got, err) = decode_low_codes(dev, &m, &GpuLowRows::upload(dev, &want.rows)?)?;
            let mismatched = got.iter().zip(&want.codes).filter(|(g, w)| g != w).count();
            let uncounted = kind == LowPrecision::Int8 && want.rows.inexact_rows == 0;
            cases.push(CaseResult {
                kernel: format!("lossy_decode {kind} outlier"),
                shape: format!("{rows}x{cols} {q} 6 bits"),
                rel_l2: mismatched as f64 + err as u8 as f64 + uncounted as u8 as f64,
                tolerance: 0.0,
            });
        }
    }
    // Damage: a flipped payload word or state is caught by the error word exactly where the CPU
    // decoder fails.
    for q in [Quantizer::E8, Quantizer::Tcq { log2_states: 5 }] {
        let w = synth_weights(40, 512, seed ^ 0xDA);
        let (t, _) = LossyTensor::encode(&w, 40, 512, &Options::new(3.0, q)).map_err(codec)?;
        let mut disagree = 0;
        for i in 0..24usize {
            let mut d = t.clone();
            if i % 2 == 0 {
                let k = (i * 7919) % d.payload.len();
                d.payload[k] ^= 1 << (i % 16);
            } else {
                let k = (i * 13) % d.states.len();
                d.states[k] ^= 1 << (i % 17);
            }
            let m = GpuLossy::upload(dev, &d)?;
            let (_, err) = decode_bits(dev, &m, LossyOut::Bf16)?;
            disagree += (err != d.decode().is_err()) as usize;
        }
        cases.push(CaseResult {
            kernel: "lossy_decode damaged".into(),
            shape: format!("40x512 {q}, 24 damages"),
            rel_l2: disagree as f64,
            tolerance: 0.0,
        });
    }
    dev.synchronize()?;
    Ok(SelftestReport {
        device: dev.info().name.clone(),
        cases,
    })
}
