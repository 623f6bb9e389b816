//! The integer-code kernels (`ops::int`) against the CPU form (`forms::int`), on fresh random codes
//! of every width the kernels run and every way a weight is made of its code (scaled, offset,
//! signed, with mins), groups of 16/32/64/128 columns and whole rows (16: GGUF Q2_K/Q3_K/Q6_K as
//! codes), columns in stored order and
//! permuted (GPTQ's act order), ragged shapes included:
//! `int_dequant` bit for bit the CPU form's weights rounded to BF16; `int_mv` within
//! f32-summation tolerance of the CPU form's product, into an offset of its output as a launch's
//! second part writes. Part `int` of `selftest --gpu`.

use entrollm_codec::Payload;
use entrollm_model::forms::int::{IntLinear, INT};
use entrollm_model::forms::{Form, GroupScales, Source, Values};
use entrollm_model::hf_quant::ColumnOrdered;
use entrollm_model::weights::Linear;
use std::sync::Arc;

use crate::selftest::{rel_l2, CaseResult, Rng, SelftestReport};
use entrollm_cuda::device::GpuDevice;
use entrollm_cuda::error::{GpuError, Result};
use entrollm_cuda::mem::{download, upload};
use entrollm_cuda::ops::int::{launch_dequant, launch_mv, GpuInt, IntPacked, BITS};

/// The product's tolerance (relative L2 against the CPU form's f32 product).
pub const MV_TOLERANCE: f64 = 1e-5;

/// Shapes (rows, columns): ragged rows; columns of one step, a ragged tail, whole superchunks.
const SHAPES: [(usize, usize); 10] = [
    (1, 32),
    (3, 100),
    (17, 576),
    (70, 1000),
    (5, 1024),
    (37, 1536),
    (9, 2052),
    (130, 2304),
    (4, 4096),
    (11, 14336),
];

/// How the codes become weights: (name, signed, offset, mins).
const KINDS: [(&str, bool, f32, bool); 5] = [
    ("scaled", false, 0.0, false),
    ("offset", false, 8.0, false),
    ("signed", true, 0.0, false),
    ("signed-offset", true, -1.0, false),
    ("mins", false, 0.0, true),
];

fn model(what: &str, e: impl std::fmt::Display) -> GpuError {
    GpuError::invalid("int selftest", format!("{what}: {e}"))
}

/// A random `rows` × `cols` matrix of `bits`-bit codes in the CPU form.
pub fn random_int(
    rng: &mut Rng,
    bits: u8,
    rows: usize,
    cols: usize,
    group: usize,
    (signed, offset, mins): (bool, f32, bool),
) -> Result<Arc<dyn Linear>> {
    let gpr = cols.div_ceil(group);
    let codes: Vec<u8> = (0..rows * cols)
        .map(|_| (rng.next_u64() % (1u64 << bits)) as u8)
        .collect();
    let scales = rng.normals(rows * gpr, 0.02);
    let groups = GroupScales {
        group,
        scales,
        mins: mins.then(|| rng.normals(rows * gpr, 0.05)),
        offset,
        signed,
    };
    let src = Source::new(
        rows,
        cols,
        Values::Int {
            payload: Payload::Int(bits),
            codes,
            groups,
        },
    )
    .map_err(|e| model("source", e))?;
    INT.encode(&src, "").map_err(|e| model("encode", e))
}

/// The kernels' host matrix of an `int` matrix.
pub fn packed(l: &dyn Linear) -> Result<IntPacked> {
    let m = l
        .as_any()
        .downcast_ref::<IntLinear>()
        .ok_or_else(|| model("pack", "not an int matrix"))?;
    IntPacked::new(m.bits(), m.rows(), m.cols(), &m.codes(), m.groups())
        .map_err(|e| model("pack", e))
}

/// Runs every case; a case that fails is recorded (never an early return), a driver error ends it.
pub fn selftest(dev: &GpuDevice, seed: u64) -> Result<SelftestReport> {
    let mut cases = Vec::new();
    let mut rng = Rng::new(seed);
    for &bits in &BITS {
        for (si, &(rows, cols)) in SHAPES.iter().enumerate() {
            // Each shape one kind and one group size, the kinds and groups cycling over the shapes.
            let (name, signed, offset, mins) = KINDS[(si + bits as usize) % KINDS.len()];
            let group = [32, 64, 128, cols, 16][si % 5];
            // Every third shape with its columns stored in another order (GPTQ's act order).
            let ordered = si % 3 == 1;
            let shape = format!(
                "{rows}x{cols} int{bits} {name} g{group}{}",
                if ordered { " act-order" } else { "" }
            );
            let inner = random_int(&mut rng, bits, rows, cols, group, (signed, offset, mins))?;
            let perm = ordered.then(|| {
                let mut p: Vec<u32> = (0..cols as u32).collect();
                for i in (1..cols).rev() {
                    p.swap(i, rng.below(i as u64 + 1) as usize);
                }
                p
            });
            let m: Arc<dyn Linear> = match &perm {
                Some(p) => Arc::new(
                    ColumnOrdered::new("selftest", Arc::clone(&inner), p.clone())
                        .map_err(|e| model("order", e))?,
                ),
                None => Arc::clone(&inner),
            };
            let x = rng.normals(cols, 1.0);
            let mut want_y = vec![0f32; rows];
            m.matvec(&x, &mut want_y);
            let mut want_w = vec![0f32; cols];
            let g = GpuInt::upload(dev, &packed(&*inner)?, perm.as_deref())?;

            // Dequantisation into an offset of a larger buffer, bit for bit.
            let at = 8;
            let mut out = upload(dev, &vec![0xFFFFu16; at + rows * cols + 8])?;
            launch_dequant(dev, &g, &mut out, at)?;
            let got = download(dev, &out)?;
            let mut mismatched = 0;
            for r in 0..rows {
                m.row(r, &mut want_w);
                let row = &got[at + r * cols..at + (r + 1) * cols];
                mismatched += row
                    .iter()
                    .zip(&want_w)
                    .filter(|(g, w)| **g != half::bf16::from_f32(**w).to_bits())
                    .count();
            }
            let untouched = got[..at].iter().chain(&got[at + rows * cols..]);
            let overwritten = untouched.filter(|&&g| g != 0xFFFF).count();
            cases.push(CaseResult {
                kernel: "int_dequant".into(),
                shape: shape.clone(),
                rel_l2: (mismatched + overwritten) as f64,
                tolerance: 0.0,
            });

            // The product into rows 3.. of the output, as a launch's second part writes.
            let dx = upload(dev, &x)?;
            let mut y = upload(dev, &vec![f32::NAN; rows + 4])?;
            launch_mv(dev, &g, &dx, &mut y, 3)?;
            let got = download(dev, &y)?;
            let outside = [got[0], got[1], got[2], got[rows + 3]];
            cases.push(CaseResult {
                kernel: "int_mv".into(),
                shape,
                rel_l2: match outside.iter().all(|v| v.is_nan()) {
                    true => rel_l2(&got[3..rows + 3], &want_y),
                    false => f64::INFINITY,
                },
                tolerance: MV_TOLERANCE,
            });
        }
    }
    dev.synchronize()?;
    Ok(SelftestReport {
        device: dev.info().name.clone(),
        cases,
    })
}

#[cfg(test)]
mod tests {
    use super::{packed, random_int};
    use crate::selftest::{rel_l2, Rng};
    use entrollm_cuda::ops::int::{unpack, IntPacked, Kind, BITS};

    /// The kernels' arithmetic in Rust over the packed arrays: the product (f32, a step's four
    /// products then the group's terms) and the dequantised weights.
    fn emulate(p: &IntPacked, x: &[f32]) -> (Vec<f32>, Vec<f32>) {
        let (l, cols) = (&p.layout, p.layout.cols);
        let stride = if p.kind == Kind::Mins { 2 } else { 1 };
        let mut y = vec![0f32; p.rows];
        let mut w = vec![0f32; p.rows * cols];
        for r in 0..p.rows {
            for c in (0..cols).step_by(4) {
                let q: Vec<f32> = (0..4)
                    .map(|e| unpack(l, &p.words, r, c + e) as f32)
                    .collect();
                let at = (r * p.groups_per_row + (c >> p.group_shift)) * stride;
                let (s, m) = (p.table[at], if stride == 2 { p.table[at + 1] } else { 0.0 });
                let d: f32 = (0..4).map(|e| q[e] * x[c + e]).sum();
                let xs: f32 = x[c..c + 4].iter().sum();
                y[r] += match p.kind {
                    Kind::Scaled => s * d,
                    Kind::Offset => s * (d - p.offset * xs),
                    Kind::Mins => s * (d - p.offset * xs) + m * xs,
                };
                for e in 0..4 {
                    w[r * cols + c + e] = s * (q[e] - p.offset) + m;
                }
            }
        }
        (y, w)
    }

    #[test]
    fn kernel_arithmetic_matches_the_cpu_form() {
        let mut rng = Rng::new(5);
        let kinds = [
            (false, 0.0, false),
            (false, 8.0, false),
            (true, 0.0, false),
            (true, -1.0, false),
            (false, 0.0, true),
        ];
        for (i, bits) in BITS.into_iter().enumerate() {
            for (j, (rows, cols)) in [(3, 100), (5, 576), (2, 1028), (4, 2304)]
                .into_iter()
                .enumerate()
            {
                let kind = kinds[(i + j) % kinds.len()];
                let group = [32, 16, 128, cols][j];
                let m = random_int(&mut rng, bits, rows, cols, group, kind).unwrap();
                let p = packed(&*m).unwrap();
                let x = rng.normals(cols, 1.0);
                let (y, w) = emulate(&p, &x);
                let mut want = vec![0f32; rows];
                m.matvec(&x, &mut want);
                let err = rel_l2(&y, &want);
                assert!(err < 1e-5, "int{bits} {rows}x{cols} {kind:?}: {err}");
                let mut row = vec![0f32; cols];
                for r in 0..rows {
                    m.row(r, &mut row);
                    for c in 0..cols {
                        assert_eq!(
                            w[r * cols + c].to_bits(),
                            row[c].to_bits(),
                            "int{bits} {kind:?} ({r}, {c})"
                        );
                    }
                }
            }
        }
    }
}
