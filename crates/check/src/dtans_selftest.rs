//! Selftest of the dtANS-LLM kernels (`ops::dtans`; part of `entrollm selftest --gpu`): decode
//! and dequant bit-exact against the codec's CPU decoder, mvm against the codec's f64 matvec, on
//! every compiled kind over ragged and regular shapes; and the kernel variants the selftest and
//! the tuned launches use (compiled in CI by tools/nvrtc-check); and the GPU encoder
//! (`ops::dtans_encode`) byte for byte against the CPU encoder ([`encode_selftest`]).
//!
//! Tolerances: decode and dequant are bit-exact; mvm is within 1e-5 of the codec's f64 matvec in L2
//! relative to the rows' Σ|w·x| (f32 accumulation in a different order; per-slice partial sums
//! added with f32 atomics).

use cudarc::driver::CudaSlice;
use entrollm_codec::dtans::{Coding, DtansTensor, Mode};
use entrollm_codec::matvec::Dequant;
use entrollm_codec::Payload;

use crate::selftest::{CaseResult, Rng, SelftestReport};
use entrollm_cuda::coded::GpuDtans;
use entrollm_cuda::device::GpuDevice;
use entrollm_cuda::error::{DriverContext, GpuError, Result};
use entrollm_cuda::jit::KernelVariant;
use entrollm_cuda::mem::{download, upload};
use entrollm_cuda::ops::dtans::*;
use entrollm_cuda::ops::dtans_encode::encode_bf16_host;

/// Kernel variants the selftest and the tuned Llama-8B launches use (compiled in CI by
/// tools/nvrtc-check).
pub fn builtin_variants() -> Vec<KernelVariant> {
    let mut v = Vec::new();
    let mut add = |kind: DtansKind, warps: DtansConfig, outs: &[DtansOut]| {
        for &out in outs {
            let var = kind.variant(warps, out);
            if !v.contains(&var) {
                v.push(var);
            }
        }
    };
    let all = [DtansOut::Mvm, DtansOut::Decode, DtansOut::Dequant];
    for kind in selftest_kinds() {
        add(kind, DtansConfig::DEFAULT, &all);
        for grouped in [false, true] {
            for cfg in selftest_store_configs(&kind, grouped) {
                add(kind, cfg, &[DtansOut::Decode, DtansOut::Dequant]);
            }
        }
        for cfg in selftest_mvm_configs(&kind) {
            add(kind, cfg, &[DtansOut::Mvm]);
        }
    }
    for (_, _, cols, coding, cfg, _) in entrollm_cuda::tuned::tuned_launches() {
        let kind = DtansKind::of(Payload::Bf16, &coding, cols, None);
        // The launches the tuner tries for the kind (its own tuned one among them).
        for c in entrollm_cuda::forms::dtans::launch_candidates(&kind, cfg) {
            add(kind, c, &[DtansOut::Mvm]);
        }
        add(
            kind,
            DtansConfig::DEFAULT,
            &[DtansOut::Dequant, DtansOut::Decode],
        );
    }
    v
}

/// Launches the selftest's mvm runs with: for bf16, 1, 4 and 8 warps per block (default entries),
/// 16-byte entries (4 warps, and 8 with `fast`), and the small entries (Pair: 4 and 8 bytes;
/// Single: 4 bytes in 16 copies, two lanes per bank); the default otherwise.
fn selftest_mvm_configs(kind: &DtansKind) -> Vec<DtansConfig> {
    if kind.bf16 {
        let mut v: Vec<DtansConfig> = [1, 4, 8].map(DtansConfig::warps).to_vec();
        v.push(DtansConfig {
            entry: 16,
            ..DtansConfig::warps(4)
        });
        v.push(DtansConfig {
            fast: true,
            entry: 16,
            ..DtansConfig::warps(8)
        });
        v.push(DtansConfig {
            entry: 4,
            rep: if kind.k == 1 && kind.log2_m <= 10 {
                16
            } else {
                0
            },
            ..DtansConfig::warps(8)
        });
        if kind.k == 2 {
            v.push(DtansConfig {
                entry: 8,
                ..DtansConfig::warps(8)
            });
        }
        v
    } else {
        vec![DtansConfig::DEFAULT]
    }
}

/// Launches the selftest's decode and dequant runs with: the default (4 warps, unroll 8; bf16 also
/// with the other entry sizes) and 8 warps with the smallest unroll the kind compiles for (the
/// narrowest staged rows of the transposed stores; matrices with dequant groups run at unroll 8
/// only).
fn selftest_store_configs(kind: &DtansKind, grouped: bool) -> Vec<DtansConfig> {
    let mut v = vec![DtansConfig::DEFAULT];
    if kind.bf16 {
        // The other entry size (bf16 default: Single 4 bytes, Pair 16).
        v.push(DtansConfig {
            entry: if kind.k == 1 { 16 } else { 4 },
            ..DtansConfig::DEFAULT
        });
    }
    let unrolls: &[u32] = if grouped { &[8] } else { &[2, 4] };
    if let Some(cfg) = unrolls
        .iter()
        .map(|&unroll| DtansConfig {
            unroll,
            ..DtansConfig::warps(8)
        })
        .find(|c| c.fits(kind))
    {
        v.push(cfg);
    }
    v
}

/// One selftest coding: payload, coding, dequant group (None: no dequant; usize::MAX: per row).
#[derive(Clone, Copy, Debug)]
struct Case {
    payload: Payload,
    mode: Mode,
    log2_m: u8,
    sc: u32,
    t: Option<u16>,
    group: Option<usize>,
    mins: bool,
    signed: bool,
}

fn selftest_cases() -> Vec<Case> {
    let mut v = Vec::new();
    let bf = |mode, log2_m, sc, t| Case {
        payload: Payload::Bf16,
        mode,
        log2_m,
        sc,
        t,
        group: None,
        mins: false,
        signed: false,
    };
    for log2_m in [8u8, 9, 10, 12] {
        let cap = match log2_m {
            8 => 16,
            9 => 22,
            10 => 32,
            _ => 64,
        };
        v.push(bf(Mode::Pair, log2_m, 2048, Some(cap)));
        v.push(bf(Mode::Pair, log2_m, 64, Some(cap / 2)));
        v.push(bf(Mode::Single, log2_m, 512, None));
    }
    v.push(bf(Mode::Single, 8, 64, Some(6))); // many escapes
    v.push(bf(Mode::Pair, 8, 256, Some(8)));
    v.push(bf(Mode::Pair, 8, 512, Some(16)));
    v.push(bf(Mode::Pair, 8, 1024, Some(16)));
    let int = |bits, mode, log2_m, sc, group, mins, signed| Case {
        payload: Payload::Int(bits),
        mode,
        log2_m,
        sc,
        t: None,
        group: Some(group),
        mins,
        signed,
    };
    v.push(int(4, Mode::Pair, 8, 2048, 32, true, false)); // Q4_1-like
    v.push(int(4, Mode::Pair, 9, 256, 64, true, false));
    v.push(int(4, Mode::Pair, 10, 512, 128, false, true));
    v.push(int(8, Mode::Single, 8, 1024, 32, false, true)); // Q8_0-like
    v.push(int(8, Mode::Single, 10, 256, 256, false, true));
    v.push(int(3, Mode::Single, 8, 128, usize::MAX, true, false));
    v.push(Case {
        payload: Payload::Fp8E4m3,
        mode: Mode::Single,
        log2_m: 8,
        sc: 1024,
        t: None,
        group: Some(usize::MAX),
        mins: false,
        signed: false,
    });
    v.push(Case {
        payload: Payload::Fp8E4m3,
        mode: Mode::Pair,
        log2_m: 12,
        sc: 512,
        t: Some(40),
        group: Some(usize::MAX),
        mins: false,
        signed: false,
    });
    v.push(Case {
        payload: Payload::Fp8E4m3,
        mode: Mode::Single,
        log2_m: 9,
        sc: 128,
        t: Some(20),
        group: None,
        mins: false,
        signed: false,
    });
    // A GGUF tensor's blocks coded as their codes (forms::ggml::coded_values): k-quants' groups of
    // 16 (Q2_K with mins, Q6_K's 6-bit codes), MXFP4's and NVFP4's E2M1 values per 32 and 16.
    v.push(int(2, Mode::Pair, 8, 256, 16, true, false));
    v.push(int(6, Mode::Single, 9, 256, 16, false, false));
    for (group, mode) in [(32, Mode::Pair), (16, Mode::Pair), (16, Mode::Single)] {
        v.push(Case {
            payload: Payload::Fp4E2m1,
            mode,
            log2_m: 8,
            sc: 256,
            t: None,
            group: Some(group),
            mins: false,
            signed: false,
        });
    }
    v
}

fn case_kind(c: &Case, cols: usize) -> DtansKind {
    let coding = Coding {
        mode: c.mode,
        log2_m: c.log2_m,
        sc: c.sc,
        t: c.t,
    };
    DtansKind::of(
        c.payload,
        &coding,
        cols,
        c.group.map(|g| if g == usize::MAX { cols } else { g }),
    )
}

fn selftest_kinds() -> Vec<DtansKind> {
    let mut v: Vec<DtansKind> = Vec::new();
    for c in selftest_cases() {
        // Per-row groups are never smaller than a slice in the selftest shapes' kernels.
        let k = case_kind(&c, usize::MAX / 2);
        if !v.contains(&k) {
            v.push(k);
        }
    }
    v
}

/// Model-like codes for a payload: BF16 ~ N(0, 0.02) with a few extremes; ints from a peaked
/// distribution; FP8 from N(0, 1) scaled into range.
fn random_elements(rng: &mut Rng, payload: Payload, n: usize) -> Vec<u8> {
    match payload {
        Payload::Bf16 => {
            let mut out = Vec::with_capacity(2 * n);
            for i in 0..n {
                let v = match rng.below(1000) {
                    0 => 0.0,
                    1 => rng.normal() * 40.0,
                    2 => rng.normal() * 1e-6,
                    _ => rng.normal() * 0.02,
                };
                let bits = if i % 4099 == 7 {
                    0x8000 // -0.0
                } else {
                    half::bf16::from_f32(v).to_bits()
                };
                out.extend_from_slice(&bits.to_le_bytes());
            }
            out
        }
        Payload::Int(bits) => {
            let top = (1u32 << bits) as f32;
            (0..n)
                .map(|_| {
                    let v = (rng.normal() * top / 6.0 + top / 2.0).round();
                    v.clamp(0.0, top - 1.0) as u8
                })
                .collect()
        }
        Payload::Fp8E4m3 => (0..n)
            .map(|_| entrollm_codec::payload::f32_to_fp8_e4m3(rng.normal() * 4.0))
            .collect(),
        _ => (0..n)
            .map(|_| rng.below(payload.alphabet() as u64) as u8)
            .collect(),
    }
}

struct DtansChecker<'a> {
    dev: &'a GpuDevice,
    rng: Rng,
    cases: Vec<CaseResult>,
    err: CudaSlice<u32>,
}

impl DtansChecker<'_> {
    fn record(&mut self, kernel: String, shape: String, rel: f64, tolerance: f64) {
        self.cases.push(CaseResult {
            kernel,
            shape,
            rel_l2: rel,
            tolerance,
        });
    }

    fn err_word(&mut self) -> Result<u32> {
        let e = download(self.dev, &self.err)?[0];
        self.dev
            .stream()
            .memset_zeros(&mut self.err)
            .while_(|| "clearing the error word".into())?;
        Ok(e)
    }

    /// A coded random matrix and its dequant arrays.
    fn make(
        &mut self,
        c: &Case,
        rows: usize,
        cols: usize,
    ) -> Result<(DtansTensor, Vec<f32>, Option<Vec<f32>>)> {
        let bytes = random_elements(&mut self.rng, c.payload, rows * cols);
        let (codes, raw) = c
            .payload
            .symbolize(&bytes)
            .map_err(|e| GpuError::invalid("dtans selftest", e.to_string()))?;
        let coding = Coding {
            mode: c.mode,
            log2_m: c.log2_m,
            sc: c.sc,
            t: c.t,
        };
        let t = DtansTensor::encode(c.payload, rows, cols, &codes, &raw, coding)
            .map_err(|e| GpuError::invalid("dtans selftest", e.to_string()))?;
        let (scales, mins) = match c.group {
            None => (Vec::new(), None),
            Some(g) => {
                let g = if g == usize::MAX { cols } else { g };
                let n = rows * cols.div_ceil(g);
                let s: Vec<f32> = (0..n)
                    .map(|_| 0.01 + self.rng.unit() as f32 * 0.02)
                    .collect();
                let m = c
                    .mins
                    .then(|| (0..n).map(|_| self.rng.normal() * 0.05).collect());
                (s, m)
            }
        };
        Ok((t, scales, mins))
    }

    fn case(&mut self, c: Case, shapes: &[(usize, usize)]) -> Result<()> {
        let label = format!(
            "{:?} {:?} M2^{} sc{} t{:?}{}",
            c.payload,
            c.mode,
            c.log2_m,
            c.sc,
            c.t,
            match c.group {
                None => String::new(),
                Some(usize::MAX) => " g=row".into(),
                Some(g) => format!(" g{g}{}", if c.mins { "+min" } else { "" }),
            }
        );
        // Three matrices with the same coding and columns but different rows/tables: one launch.
        for &(rows, cols) in shapes {
            let mut ts = Vec::new();
            for r in [rows, rows / 2 + 1, 33] {
                ts.push(self.make(&c, r, cols)?);
            }
            let dqs: Vec<Dequant> = ts
                .iter()
                .map(|(_, s, m)| match c.group {
                    None => Dequant::None,
                    Some(g) => Dequant::Groups {
                        group: if g == usize::MAX { cols } else { g },
                        scales: s,
                        mins: m.as_deref(),
                        offset: if c.signed || c.payload == Payload::Fp4E2m1 {
                            0.0
                        } else {
                            8.0
                        },
                        signed: c.signed,
                    },
                })
                .collect();
            let gpu: Vec<GpuDtans> = ts
                .iter()
                .zip(&dqs)
                .map(|((t, _, _), dq)| GpuDtans::upload(self.dev, t, dq))
                .collect::<Result<_>>()?;
            let shape = |t: &DtansTensor| {
                format!(
                    "{label} {}×{} ({:.2} b/w)",
                    t.rows,
                    t.cols,
                    t.bits_per_weight()
                )
            };
            // decode and dequant, bit-exact, on the first matrix (outputs poisoned first).
            let (t0, g0) = (&ts[0].0, &gpu[0]);
            let want = t0
                .decode()
                .map_err(|e| GpuError::invalid("dtans selftest", e.to_string()))?;
            let want_dq = dequant_ref(t0, &dqs[0])?;
            for cfg in selftest_store_configs(&DtansKind::of_tensor(g0), g0.groups.is_some()) {
                let mut out = upload(self.dev, &vec![0xA5u8; want.len()])?;
                launch_decode(self.dev, cfg, g0, &mut out, Some(&mut self.err))?;
                let got = download(self.dev, &out)?;
                let bad = got.iter().zip(&want).filter(|(a, b)| a != b).count();
                let e = self.err_word()?;
                self.record(
                    format!("dtans decode {cfg}"),
                    format!("{} err {e}", shape(t0)),
                    if e == 0 { bad as f64 } else { f64::INFINITY },
                    0.0,
                );
                let mut out = upload(self.dev, &vec![0x7FC1u16; want_dq.len()])?;
                launch_dequant(self.dev, cfg, g0, &mut out, Some(&mut self.err))?;
                let got = download(self.dev, &out)?;
                let bad = got.iter().zip(&want_dq).filter(|(a, b)| a != b).count();
                let e = self.err_word()?;
                self.record(
                    format!("dtans dequant {cfg}"),
                    format!("{} err {e}", shape(t0)),
                    if e == 0 { bad as f64 } else { f64::INFINITY },
                    0.0,
                );
            }
            // mvm of all three in one launch, with each warp count.
            let x = self.rng.normals(cols, 1.0);
            let x_d = upload(self.dev, &x)?;
            // Per row Σ|w·x|: the scale of f32 summation error (rows whose terms cancel are held to
            // what their terms allow, not to their small sum).
            let mags: Vec<Vec<f64>> = ts
                .iter()
                .zip(&dqs)
                .map(|((t, _, _), dq)| {
                    Ok(dequant_ref(t, dq)?
                        .chunks(t.cols)
                        .map(|row| {
                            row.iter()
                                .zip(&x)
                                .map(|(&w, &v)| {
                                    (entrollm_cuda::ops::bf16_to_f32(w) as f64 * v as f64).abs()
                                })
                                .sum()
                        })
                        .collect())
                })
                .collect::<Result<_>>()?;
            for cfg in selftest_mvm_configs(&DtansKind::of_tensor(g0)) {
                let mut ys: Vec<CudaSlice<f32>> = ts
                    .iter()
                    .map(|(t, _, _)| upload(self.dev, &vec![f32::NAN; t.rows]))
                    .collect::<Result<_>>()?;
                {
                    let mut yr: Vec<&mut CudaSlice<f32>> = ys.iter_mut().collect();
                    let mats: Vec<&GpuDtans> = gpu.iter().collect();
                    launch_mvm(self.dev, cfg, &mats, &x_d, &mut yr, Some(&mut self.err))?;
                }
                let e = self.err_word()?;
                for ((((t, _, _), dq), y), mag) in ts.iter().zip(&dqs).zip(&ys).zip(&mags) {
                    let got = download(self.dev, y)?;
                    let mut want = vec![0f32; t.rows];
                    t.matvec(&x, &mut want, dq)
                        .map_err(|e| GpuError::invalid("dtans selftest", e.to_string()))?;
                    let rel = if e == 0 && got.len() == want.len() {
                        let err: f64 = got
                            .iter()
                            .zip(&want)
                            .map(|(&g, &w)| (g as f64 - w as f64).powi(2))
                            .sum();
                        let scale: f64 = mag.iter().map(|m| m * m).sum();
                        (err / scale.max(f64::MIN_POSITIVE)).sqrt()
                    } else {
                        f64::INFINITY
                    };
                    self.record(
                        format!("dtans mvm {cfg}"),
                        format!("{} err {e}", shape(t)),
                        rel,
                        1e-5,
                    );
                }
            }
        }
        Ok(())
    }
}

/// Every compiled kind on fresh random matrices of ragged and regular shapes: decode and dequant
/// bit-exact against the codec's CPU decoder, mvm (three matrices per launch, 1/4/8 warps per
/// block) within 1e-5 of the codec's f64 matvec in L2 relative to ‖Σ|w·x|‖ over rows (the scale of
/// f32 summation error: a 1×100 row whose terms cancel measured 2.8e-5 relative to its own small
/// sum on the H200), and no error flag.
pub fn selftest(dev: &GpuDevice, seed: u64) -> Result<SelftestReport> {
    let mut c = DtansChecker {
        dev,
        rng: Rng::new(seed),
        cases: Vec::new(),
        err: upload(dev, &[0u32])?,
    };
    for case in selftest_cases() {
        let sc = case.sc as usize;
        // Ragged: a last slice of 8 columns, rows not a multiple of 32, rows whose BF16 start is
        // not 16-byte aligned (sc + 3: transposed stores element by element), one short row.
        let shapes = [
            (70, sc * 2 + 8),
            (129, 3 * sc),
            (45, sc + 3),
            (1, 100),
            (300, 4096),
        ];
        for &(rows, cols) in &shapes {
            if let Some(g) = case.group.filter(|&g| g != usize::MAX) {
                if g > cols
                    || entrollm_cuda::coded::check_group(
                        &Coding {
                            mode: case.mode,
                            log2_m: case.log2_m,
                            sc: case.sc,
                            t: case.t,
                        },
                        cols,
                        g,
                    )
                    .is_err()
                {
                    continue;
                }
            }
            c.case(case, &[(rows, cols)])?;
        }
    }
    let report = SelftestReport {
        device: format!("{} ({})", dev.info().name, dev.info().arch()),
        cases: c.cases,
    };
    if report.failures().next().is_some() {
        return Err(GpuError::Selftest(report.to_string()));
    }
    Ok(report)
}

/// Random BF16 weights with escapes to make: mostly N(0, 0.02), some huge, tiny, zero and -0.
fn random_bf16(rng: &mut Rng, n: usize) -> Vec<u16> {
    (0..n)
        .map(|i| {
            let v = match rng.below(500) {
                0 => 0.0,
                1 => rng.normal() * 300.0,
                2 => rng.normal() * 1e-9,
                _ => rng.normal() * 0.02,
            };
            if i % 3001 == 5 {
                0x8000
            } else {
                half::bf16::from_f32(v).to_bits()
            }
        })
        .collect()
}

/// The GPU encoder (`ops::dtans_encode`): GPU-encoded arrays against the CPU encoder's, byte for byte, and the CPU decoder on the GPU's
/// output, on fresh random BF16 matrices: ragged and regular shapes, Single and Pair, every table
/// size, several slice widths, with and without escapes.
pub fn encode_selftest(dev: &GpuDevice, seed: u64) -> Result<SelftestReport> {
    let mut rng = Rng::new(seed);
    let mut cases = Vec::new();
    let shapes_of = |sc: usize, extra: usize| {
        [
            (1, 1),
            (31, sc - 3),
            (33, sc + 1),
            (64, 2 * sc),
            (70, 3 * sc + 17),
            (257, 640 + extra),
        ]
    };
    for mode in [Mode::Single, Mode::Pair] {
        for log2_m in [8u8, 9, 10, 12] {
            for sc in [64u32, 256, 512, 2048] {
                for t in [None, Some(12u16), Some(40)] {
                    let coding = Coding {
                        mode,
                        log2_m,
                        sc,
                        t,
                    };
                    let extra = rng.below(sc as u64) as usize;
                    for (rows, cols) in shapes_of(sc as usize, extra) {
                        cases.push(encode_case(
                            dev,
                            &mut Rng::new(rng.next_u64()),
                            coding,
                            rows,
                            cols,
                        )?);
                    }
                }
            }
        }
    }
    let report = SelftestReport {
        device: format!("{} ({})", dev.info().name, dev.info().arch()),
        cases,
    };
    if report.failures().next().is_some() {
        return Err(GpuError::Selftest(report.to_string()));
    }
    Ok(report)
}

/// One shape and coding: 0 when the GPU's tensor equals the CPU's and decodes to the input; 1 when
/// an array differs; infinity when decoding fails or differs. A coding the coder rejects for
/// this matrix (too many distinct symbols for M) must be rejected by both.
fn encode_case(
    dev: &GpuDevice,
    rng: &mut Rng,
    coding: Coding,
    rows: usize,
    cols: usize,
) -> Result<CaseResult> {
    let bits = random_bf16(rng, rows * cols);
    let bytes: Vec<u8> = bits.iter().flat_map(|b| b.to_le_bytes()).collect();
    let (codes, raw) = Payload::Bf16
        .symbolize(&bytes)
        .map_err(|e| GpuError::invalid("dtans encode", e.to_string()))?;
    let cpu = DtansTensor::encode(Payload::Bf16, rows, cols, &codes, &raw, coding);
    let gpu = encode_bf16_host(dev, &bits, rows, cols, coding);
    let (rel, note) = match (cpu, gpu) {
        (Ok(c), Ok(g)) => {
            let diff: Vec<&str> = [
                ("table", c.table == g.table),
                ("tiles", c.tiles == g.tiles),
                ("stream", c.stream == g.stream),
                ("companion", c.companion == g.companion),
                ("raw", c.raw == g.raw),
            ]
            .iter()
            .filter(|(_, same)| !same)
            .map(|(n, _)| *n)
            .collect();
            let escapes = g
                .tiles
                .iter()
                .skip(1)
                .step_by(2)
                .filter(|&&m| m != 0)
                .count();
            if !diff.is_empty() {
                (1.0, format!("differs: {}", diff.join(",")))
            } else {
                match g.decode() {
                    Ok(d) if d == bytes => (
                        0.0,
                        format!("{} words, {escapes} esc tiles", g.stream.len()),
                    ),
                    Ok(_) => (f64::INFINITY, "decodes wrong".into()),
                    Err(e) => (f64::INFINITY, format!("decode: {e}")),
                }
            }
        }
        (Err(_), Err(_)) => (0.0, "rejected by both".into()),
        (Ok(_), Err(e)) => (f64::INFINITY, format!("gpu failed: {e}")),
        (Err(e), Ok(_)) => (f64::INFINITY, format!("cpu failed: {e}")),
    };
    Ok(CaseResult {
        kernel: "dtans_encode".into(),
        shape: format!("{rows}x{cols} {coding} {note}"),
        rel_l2: rel,
        tolerance: 0.0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench_coded::bench_kinds;

    #[test]
    fn variants_are_distinct_and_named() {
        let v = builtin_variants();
        let names: std::collections::HashSet<_> =
            v.iter().map(|v| v.cache_file_name("sm_90")).collect();
        assert_eq!(names.len(), v.len());
        assert!(v.len() >= 20);
    }

    #[test]
    fn shared_memory_fits_the_device() {
        for k in selftest_kinds().into_iter().chain(bench_kinds()) {
            for out in [DtansOut::Mvm, DtansOut::Decode, DtansOut::Dequant] {
                let b = k.shared_bytes(DtansConfig::warps(8), out);
                assert!(b <= 227 * 1024, "{k:?} {out:?}: {b}");
            }
        }
    }

    #[test]
    fn dequant_ref_of_bf16_is_the_elements() {
        let mut rng = Rng::new(3);
        let bytes = random_elements(&mut rng, Payload::Bf16, 64 * 70);
        let (codes, raw) = Payload::Bf16.symbolize(&bytes).unwrap();
        let coding = Coding {
            mode: Mode::Pair,
            log2_m: 8,
            sc: 64,
            t: Some(16),
        };
        let t = DtansTensor::encode(Payload::Bf16, 64, 70, &codes, &raw, coding).unwrap();
        let d = dequant_ref(&t, &Dequant::None).unwrap();
        let want: Vec<u16> = bytes
            .chunks(2)
            .map(|c| u16::from_le_bytes([c[0], c[1]]))
            .collect();
        assert_eq!(d, want);
    }
}
