//! Weight forms: how one matrix is stored and multiplied on the CPU.
//!
//! A *form* is one module here that says everything about itself: which sources it can hold
//! exactly ([`Form::accepts`]), the variants worth timing with their predicted sizes
//! ([`Form::variants`], pruned by predicted size), its exact encoding ([`Form::encode`]: a
//! [`Linear`] whose `matvec` is the form's CPU reference product and whose `source` is its CPU
//! decode), and its default cost model ([`Form::default_cost_us`], for plans made without a tune
//! file). The engines, `compress`, `inspect` and the tuner ask [`all`] / [`by_name`]; adding a
//! form is one module plus its line in [`all`] (docs/forms.md).

pub mod dense;
pub mod df11;
pub mod dtans;
pub mod ggml;
pub mod int;
pub mod layout;
pub mod lossy;
pub mod palette;

use crate::error::{ModelError, Result};
use crate::weights::Linear;
use entrollm_codec::Payload;
use entrollm_format::coded::Coded;
use std::sync::Arc;

pub use dtans::GroupScales;

/// The exact values a matrix holds, in their own representation (row-major `rows × cols`).
/// Wrappers (FP8 row scales, llama.cpp's Q/K row order) stay outside: see [`Linear::reform`].
#[derive(Clone, Debug, PartialEq)]
pub enum Values {
    F32(Vec<f32>),
    /// bfloat16 bit patterns.
    Bf16(Vec<u16>),
    /// IEEE half bit patterns.
    F16(Vec<u16>),
    /// FP8 E4M3 bytes.
    Fp8(Vec<u8>),
    /// Integer codes (one per byte) with per-group scales: GGUF's legacy blocks.
    Int {
        payload: Payload,
        codes: Vec<u8>,
        groups: GroupScales,
    },
    /// Whole ggml blocks of one type, as a GGUF file stores them (k-quants, IQ4, legacy types).
    Ggml {
        ty: crate::gguf::GgmlType,
        bytes: ggml::BlockBytes,
    },
}

impl Values {
    /// The name used in messages and variant strings.
    pub fn kind(&self) -> &'static str {
        match self {
            Values::F32(_) => "f32",
            Values::Bf16(_) => "bf16",
            Values::F16(_) => "f16",
            Values::Fp8(_) => "fp8",
            Values::Int { .. } => "int",
            Values::Ggml { .. } => "ggml",
        }
    }

    fn len(&self) -> usize {
        match self {
            Values::F32(v) => v.len(),
            Values::Bf16(v) | Values::F16(v) => v.len(),
            Values::Fp8(v) => v.len(),
            Values::Int { codes, .. } => codes.len(),
            // Not whole blocks: no shape matches, so `Source::new` refuses it.
            Values::Ggml { ty, bytes } => ggml::elements(*ty, bytes.bytes().len()).unwrap_or(0),
        }
    }
}

/// A matrix's exact content, as every form encodes from it.
#[derive(Clone, Debug, PartialEq)]
pub struct Source {
    pub rows: usize,
    pub cols: usize,
    pub values: Values,
}

impl Source {
    pub fn new(rows: usize, cols: usize, values: Values) -> Result<Source> {
        if rows == 0 || cols == 0 || rows.checked_mul(cols) != Some(values.len()) {
            return Err(ModelError::Unsupported(format!(
                "a {rows}×{cols} {} matrix cannot hold {} values",
                values.kind(),
                values.len()
            )));
        }
        Ok(Source { rows, cols, values })
    }

    pub fn weights(&self) -> usize {
        self.rows * self.cols
    }

    /// The matrix cut by rows into parts of `rows[i]` rows (a fused q/k/v or gate/up tensor),
    /// each exactly the values of its rows; GGUF blocks are shared, not copied.
    pub fn split_rows(&self, rows: &[usize]) -> Result<Vec<Source>> {
        if rows.iter().sum::<usize>() != self.rows || rows.contains(&0) {
            return Err(ModelError::Unsupported(format!(
                "{} rows cannot be split into {rows:?}",
                self.rows
            )));
        }
        let mut out = Vec::with_capacity(rows.len());
        let mut first = 0;
        for &n in rows {
            let (a, b) = (first * self.cols, (first + n) * self.cols);
            let values = match &self.values {
                Values::F32(v) => Values::F32(v[a..b].to_vec()),
                Values::Bf16(v) => Values::Bf16(v[a..b].to_vec()),
                Values::F16(v) => Values::F16(v[a..b].to_vec()),
                Values::Fp8(v) => Values::Fp8(v[a..b].to_vec()),
                Values::Int {
                    payload,
                    codes,
                    groups,
                } => {
                    if !self.cols.is_multiple_of(groups.group) {
                        return Err(ModelError::Unsupported(format!(
                            "integer codes in groups of {} that straddle rows of {} cannot be \
                             split by rows",
                            groups.group, self.cols
                        )));
                    }
                    let (ga, gb) = (a / groups.group, b / groups.group);
                    Values::Int {
                        payload: *payload,
                        codes: codes[a..b].to_vec(),
                        groups: GroupScales {
                            scales: groups.scales[ga..gb].to_vec(),
                            mins: groups.mins.as_ref().map(|m| m[ga..gb].to_vec()),
                            ..groups.clone()
                        },
                    }
                }
                Values::Ggml { ty, bytes } => {
                    let row_bytes = bytes.bytes().len() / self.rows;
                    Values::Ggml {
                        ty: *ty,
                        bytes: bytes.sub(first * row_bytes..(first + n) * row_bytes),
                    }
                }
            };
            out.push(Source::new(n, self.cols, values)?);
            first += n;
        }
        Ok(out)
    }
}

impl Source {
    /// The matrix of rows `rows` of this one, in that order (an interleaved fused tensor taken
    /// apart); each row exactly its values (GGUF blocks copied whole).
    pub fn gather_rows(&self, rows: &[usize]) -> Result<Source> {
        if rows.is_empty() || rows.iter().any(|&r| r >= self.rows) {
            return Err(ModelError::Unsupported(format!(
                "rows {rows:?} of a matrix of {} rows",
                self.rows
            )));
        }
        fn pick<T: Copy>(v: &[T], cols: usize, rows: &[usize]) -> Vec<T> {
            rows.iter()
                .flat_map(|&r| v[r * cols..(r + 1) * cols].iter().copied())
                .collect()
        }
        let values = match &self.values {
            Values::F32(v) => Values::F32(pick(v, self.cols, rows)),
            Values::Bf16(v) => Values::Bf16(pick(v, self.cols, rows)),
            Values::F16(v) => Values::F16(pick(v, self.cols, rows)),
            Values::Fp8(v) => Values::Fp8(pick(v, self.cols, rows)),
            Values::Int {
                payload,
                codes,
                groups,
            } => {
                if !self.cols.is_multiple_of(groups.group) {
                    return Err(ModelError::Unsupported(format!(
                        "integer codes in groups of {} that straddle rows of {} cannot be \
                         gathered by rows",
                        groups.group, self.cols
                    )));
                }
                let per_row = self.cols / groups.group;
                Values::Int {
                    payload: *payload,
                    codes: pick(codes, self.cols, rows),
                    groups: GroupScales {
                        scales: pick(&groups.scales, per_row, rows),
                        mins: groups.mins.as_ref().map(|m| pick(m, per_row, rows)),
                        ..groups.clone()
                    },
                }
            }
            Values::Ggml { ty, bytes } => {
                let row_bytes = bytes.bytes().len() / self.rows;
                Values::Ggml {
                    ty: *ty,
                    bytes: ggml::BlockBytes::from_vec(pick(bytes.bytes(), row_bytes, rows)),
                }
            }
        };
        Source::new(rows.len(), self.cols, values)
    }
}

/// Rows of one band of [`sample_rows`]: the dtANS coder's tile height, so a sample holds whole
/// tiles.
pub const SAMPLE_BAND: usize = 32;

/// Sizes of a large matrix are predicted on about this many of its weights ([`size_source`]): a
/// plan at load sizes every launch shape in every form, and the histograms of a million weights
/// predict a size within a bound (tested) of the whole's.
pub const SIZE_SAMPLE_WEIGHTS: usize = 1 << 20;

/// Bands of [`SAMPLE_BAND`] rows spread evenly over a `rows × cols` matrix, about `max_weights`
/// weights in all; `None` for a matrix of at most twice `max_weights` or of few bands (sized
/// whole).
pub fn sample_rows(rows: usize, cols: usize, max_weights: usize) -> Option<Vec<usize>> {
    let bands = rows / SAMPLE_BAND;
    if rows * cols <= 2 * max_weights || bands < 8 {
        return None;
    }
    let take = (max_weights / (SAMPLE_BAND * cols)).clamp(1, bands);
    Some(
        (0..bands)
            .step_by(bands / take)
            .take(take)
            .flat_map(|b| b * SAMPLE_BAND..(b + 1) * SAMPLE_BAND)
            .collect(),
    )
}

/// The values to predict `m`'s sizes in other forms from, and the factor that scales a size
/// predicted on them to the whole matrix: a large matrix's [`sample_rows`] (only those decoded
/// where its form holds rows apart) and rows over sampled rows — every form's size grows with
/// its rows, beside a few fixed bytes (tables) — else all of it and 1.
pub fn size_source(m: &dyn Linear, max_weights: usize) -> Result<(Source, f64)> {
    match sample_rows(m.rows(), m.cols(), max_weights) {
        Some(rows) => {
            let scale = m.rows() as f64 / rows.len() as f64;
            Ok((m.source_rows(&rows)?, scale))
        }
        None => Ok((m.source()?, 1.0)),
    }
}

/// Which form a matrix is in, and with which variant (the tunable parameters, as text).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct FormId {
    pub form: &'static str,
    pub variant: String,
}

impl std::fmt::Display for FormId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.variant.is_empty() {
            true => write!(f, "{}", self.form),
            false => write!(f, "{}:{}", self.form, self.variant),
        }
    }
}

/// A variant a form offers for a matrix, with its predicted stored bytes.
#[derive(Clone, Debug, PartialEq)]
pub struct Candidate {
    pub variant: String,
    pub predicted_bytes: f64,
}

/// Where a planner runs the matrix (the default cost model differs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceKind {
    Cpu,
    Cuda,
}

/// How a container holds a matrix in some form (`compress --plan`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Stored {
    /// The source's bytes as they are: a plain tensor.
    Raw,
    /// Coded by the container's coder of this name ([`entrollm_format::coded::coders`]), with
    /// this dtANS coding (`None`: the coder's).
    Coded {
        coder: &'static str,
        coding: Option<entrollm_codec::dtans::Coding>,
    },
}

/// A coded tensor as a loader finds it in a container, for [`Form::loads`].
#[derive(Clone, Copy, Debug)]
pub struct StoredMatrix<'a> {
    pub name: &'a str,
    pub dtype: entrollm_format::Dtype,
    pub shape: &'a [usize],
    /// In the container of a GGUF file, whose float matrices are read from the file's image
    /// (llama.cpp's row order), not served coded.
    pub in_gguf: bool,
}

/// One weight form. Implementations are stateless; [`all`] lists them.
pub trait Form: Send + Sync {
    /// Stable name, used in tune and plan files and containers.
    fn name(&self) -> &'static str;
    /// One line for `--help` and docs.
    fn describe(&self) -> &'static str;
    /// Whether this form holds `src` exactly.
    fn accepts(&self, src: &Source) -> bool;
    /// Whether the engine on `device` has kernels for this form.
    fn runs_on(&self, device: DeviceKind) -> bool;
    /// Whether the variant a matrix is held in is the user's choice (ggml's `q8`, from
    /// `--activations`), so that a plan offers no other variant of this form for it.
    fn held_variant_chosen(&self) -> bool {
        false
    }
    /// The variants worth timing for `src`, each with its predicted stored bytes, pruned by the
    /// form's own rules (a variant predicted no smaller than `src` as it is stored is dropped).
    /// Empty when the form does not accept `src`.
    fn variants(&self, src: &Source) -> Result<Vec<Candidate>>;
    /// The predicted stored bytes of `src` in `variant` (for other matrices of a launch whose
    /// variants were chosen on its first one).
    fn predict(&self, src: &Source, variant: &str) -> Result<f64>;
    /// The variant `src` is encoded in where a caller names the form but no variant (the Python
    /// modules): the smallest of [`variants`](Self::variants), else, where none would make `src`
    /// smaller, the form's own choice for it; `None` where the form cannot hold `src`.
    fn default_variant(&self, src: &Source) -> Result<Option<String>> {
        let smallest = self
            .variants(src)?
            .into_iter()
            .min_by(|a, b| a.predicted_bytes.total_cmp(&b.predicted_bytes));
        Ok(match smallest {
            Some(c) => Some(c.variant),
            // A form without variants: its one encoding.
            None => self.accepts(src).then(String::new),
        })
    }
    /// `src` in this form, exactly.
    fn encode(&self, src: &Source, variant: &str) -> Result<Arc<dyn Linear>>;
    /// Default latency model, µs of one batch-1 product: streaming `bytes` plus the form's decode
    /// work per weight (docs/forms.md gives the constants and where they come from).
    fn default_cost_us(&self, device: DeviceKind, weights: usize, bytes: f64) -> f64;
    /// How a container stores a matrix of `values` ([`Values::kind`]) in `variant` of this form;
    /// `None` where the container has no storage of its own for it: `compress --plan` then stores
    /// the source as it otherwise would, records the form, and the loader re-forms the matrix.
    fn stored(&self, _variant: &str, _values: &str) -> Result<Option<Stored>> {
        Ok(None)
    }
    /// Whether this form serves `coded` (as a container stores it) without decoding it to dense:
    /// its coder's tensors, where this form multiplies them as they are.
    fn loads(&self, _coded: &Coded, _t: &StoredMatrix<'_>) -> bool {
        false
    }
    /// `coded` served in this form; only where [`loads`](Self::loads) says so.
    fn load(&self, coded: Coded, t: &StoredMatrix<'_>) -> Result<Arc<dyn Linear>> {
        Err(ModelError::tensor(
            t.name,
            format!(
                "form {} does not serve {} tensors",
                self.name(),
                coded.coder()
            ),
        ))
    }
    /// Whether a loader that keeps coded matrices coded keeps this form's only when asked (the
    /// engine's plans start from the dense matrix, which DFloat11's layout has no kernel for).
    fn coded_only_when_asked(&self) -> bool {
        false
    }
}

/// The form that serves `coded` as stored ([`Form::loads`]), if any.
pub fn loader(coded: &Coded, t: &StoredMatrix<'_>) -> Option<&'static dyn Form> {
    all().iter().copied().find(|f| f.loads(coded, t))
}

/// Every form, in the order the tuner lists them.
pub fn all() -> &'static [&'static dyn Form] {
    static ALL: [&dyn Form; 8] = [
        &dense::DENSE,
        &int::INT,
        &ggml::GGML,
        &dtans::DTANS,
        &df11::DF11,
        &palette::PAL_FP8,
        &palette::PAL_BF16,
        &lossy::LOSSY,
    ];
    &ALL
}

/// The form named `name`, or an error listing the names.
pub fn by_name(name: &str) -> Result<&'static dyn Form> {
    all()
        .iter()
        .copied()
        .find(|f| f.name() == name)
        .ok_or_else(|| {
            let names: Vec<&str> = all().iter().map(|f| f.name()).collect();
            ModelError::Config(format!(
                "unknown weight form '{name}' (forms: {})",
                names.join(", ")
            ))
        })
}

/// Bytes per µs a CPU core pair streams a matrix at in the default cost model, and per-weight
/// decode work, ns: rough figures of the 2-core development machine (docs/forms.md).
pub(crate) fn stream_cost_us(device: DeviceKind, bytes: f64) -> f64 {
    let bytes_per_us = match device {
        DeviceKind::Cpu => 8.0e3,
        DeviceKind::Cuda => 3.0e6,
    };
    bytes / bytes_per_us
}

/// Σ a·b in eight interleaved partial sums, added in order: a fixed order, so a product does
/// not depend on tiling or on which implementation runs (AVX2 where the CPU has it, without FMA
/// for that reason; the portable loop otherwise, which LLVM vectorises for the base target).
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::OnceLock;
        static AVX2: OnceLock<bool> = OnceLock::new();
        if *AVX2.get_or_init(|| std::arch::is_x86_feature_detected!("avx2")) {
            // SAFETY: the CPU has AVX2 (checked above).
            return unsafe { dot_avx2(a, b) };
        }
    }
    dot_portable(a, b)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
    dot_portable(a, b)
}

#[inline(always)]
fn dot_portable(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0f32; 8];
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ac
        .remainder()
        .iter()
        .zip(bc.remainder())
        .map(|(a, b)| a * b)
        .sum();
    for (a, b) in ac.zip(bc) {
        for k in 0..8 {
            acc[k] += a[k] * b[k];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// The check of a form without variants: only the empty variant names it.
pub(crate) fn no_variants(form: &str, variant: &str) -> Result<()> {
    match variant.is_empty() {
        true => Ok(()),
        false => Err(ModelError::Config(format!(
            "{form} has no variants (got '{variant}')"
        ))),
    }
}

/// `make(src)`, checked to give back a matrix of the same shape.
pub fn encode_checked(form: &dyn Form, src: &Source, variant: &str) -> Result<Arc<dyn Linear>> {
    if !form.accepts(src) {
        return Err(ModelError::Unsupported(format!(
            "form {} cannot hold a {} matrix exactly",
            form.name(),
            src.values.kind()
        )));
    }
    let m = form.encode(src, variant)?;
    if (m.rows(), m.cols()) != (src.rows, src.cols) {
        return Err(ModelError::Unsupported(format!(
            "form {} gave a {}×{} matrix for a {}×{} one (a form bug)",
            form.name(),
            m.rows(),
            m.cols(),
            src.rows,
            src.cols
        )));
    }
    Ok(m)
}

/// `m` in `form`/`variant`, keeping its wrappers (row scales, row order).
pub fn reform(m: &Arc<dyn Linear>, form: &dyn Form, variant: &str) -> Result<Arc<dyn Linear>> {
    if m.form().form == form.name() && m.form().variant == variant {
        return Ok(Arc::clone(m));
    }
    m.reform(&|src| encode_checked(form, src, variant))
}

#[cfg(test)]
pub(crate) mod testing {
    //! Random sources of every kind, for the forms' round-trip tests.
    use super::*;

    pub struct Rng(entrollm_codec::rng::SplitMix64);
    impl Rng {
        pub fn new(seed: u64) -> Self {
            Rng(entrollm_codec::rng::SplitMix64::new(seed))
        }
        pub fn next(&mut self) -> u64 {
            self.0.next_u64()
        }
        /// Roughly normal, σ = 1.
        pub fn normal(&mut self) -> f32 {
            (0..4)
                .map(|_| (self.next() >> 40) as f32 / (1u64 << 24) as f32)
                .sum::<f32>()
                * 1.7
                - 3.4
        }
    }

    pub fn bf16_source(rng: &mut Rng, rows: usize, cols: usize, sigma: f32) -> Source {
        let v = (0..rows * cols)
            .map(|_| half::bf16::from_f32(rng.normal() * sigma).to_bits())
            .collect();
        Source::new(rows, cols, Values::Bf16(v)).unwrap()
    }

    /// y = W·x in f64 from the exact values, the truth every form's product is checked against.
    pub fn reference_matvec(m: &dyn Linear, x: &[f32]) -> Vec<f64> {
        let mut row = vec![0f32; m.cols()];
        (0..m.rows())
            .map(|r| {
                m.row(r, &mut row);
                row.iter().zip(x).map(|(&w, &x)| w as f64 * x as f64).sum()
            })
            .collect()
    }

    /// Every form that accepts `src`: the first variants it offers round-trip exactly, multiply
    /// as the reference does, and are the size predicted.
    pub fn check_all_forms(src: &Source, rng: &mut Rng) {
        for form in all().iter().filter(|f| f.accepts(src)) {
            for c in form.variants(src).unwrap().iter().take(4) {
                let exact = check_variant(*form, src, &c.variant, rng);
                assert!(
                    (c.predicted_bytes - exact).abs() <= 0.05 * exact + 256.0,
                    "{} {}: predicted {} vs {exact}",
                    form.name(),
                    c.variant,
                    c.predicted_bytes
                );
            }
        }
    }

    /// `src` in `form`/`variant`: exact round trip, product within f32 rounding of the f64
    /// reference; returns the stored bytes.
    pub fn check_variant(form: &dyn Form, src: &Source, variant: &str, rng: &mut Rng) -> f64 {
        let x: Vec<f32> = (0..src.cols).map(|_| rng.normal()).collect();
        let m = encode_checked(form, src, variant).unwrap();
        let id = m.form();
        assert_eq!((id.form, id.variant.as_str()), (form.name(), variant));
        let back = m.source().unwrap();
        if back.values.kind() == src.values.kind() {
            assert!(back == *src, "{} {variant}: not the source", form.name());
        } else {
            // Widened (dense f32) or converted (GGUF blocks held as integer codes): the same
            // numbers, bit for bit but for the sign of zeros (a product's sum cannot tell them).
            let bits = |s: &Source| -> Vec<u32> {
                dense::to_f32(s)
                    .iter()
                    .map(|&v| if v == 0.0 { 0 } else { v.to_bits() })
                    .collect()
            };
            assert!(
                bits(&back) == bits(src),
                "{} {variant}: values differ",
                form.name()
            );
        }
        let want = reference_matvec(&*m, &x);
        let mut y = vec![0f32; src.rows];
        m.matvec(&x, &mut y);
        let scale = want.iter().map(|v| v.abs()).fold(1e-3, f64::max);
        for (r, (&y, &w)) in y.iter().zip(&want).enumerate() {
            assert!(
                (y as f64 - w).abs() <= 1e-4 * scale,
                "{} {variant} row {r}: {y} vs {w}",
                form.name()
            );
        }
        m.stored_bytes() as f64
    }
}

#[cfg(test)]
mod tests {
    use super::testing::*;
    use super::*;

    /// How far a size predicted on a row sample and scaled ([`size_source`]: the tuner's and the
    /// planner's sizes of large matrices) may be from the size predicted on the whole matrix: 1 %,
    /// plus one band's share of the rows where they are not whole bands (the dtANS and palette
    /// layouts pad the last band, which the scaling prices at its rows only).
    fn sampled_bound(rows: usize) -> f64 {
        0.01 + (!rows.is_multiple_of(SAMPLE_BAND)) as u8 as f64 * SAMPLE_BAND as f64 / rows as f64
    }

    /// How far any size predicted on the whole matrix may be from its coded size here (the
    /// forms' own predictors, from histograms; `check_all_forms` allows 5 %).
    const WHOLE_BOUND: f64 = 0.03;

    /// Every form's first variants, chosen and sized on a sample of a large matrix's rows, are
    /// within [`sampled_bound`] of the size predicted on the whole matrix, and that within
    /// [`WHOLE_BOUND`] of the coded size: BF16 rows of scales spread over 4× (rows of a layer are
    /// not alike, and a sample must not take one kind of row) and 4-bit integer codes of a skewed
    /// distribution with group scales and mins, in rows of whole bands and ragged.
    #[test]
    fn sizes_predicted_on_a_row_sample_are_near_the_whole_and_coded_sizes() {
        let mut rng = Rng::new(29);
        for (rows, cols) in [(2304, 1024), (2 * 1024 + 3 * SAMPLE_BAND + 5, 1152)] {
            assert!(rows * cols > 2 * SIZE_SAMPLE_WEIGHTS);
            let bf16: Vec<u16> = (0..rows * cols)
                .map(|i| {
                    let r = i / cols;
                    let sigma = 0.01 * (0.5 + 1.5 * ((r * 7919) % rows) as f32 / rows as f32);
                    half::bf16::from_f32(rng.normal() * sigma).to_bits()
                })
                .collect();
            let groups = rows * cols / 32;
            let int = Values::Int {
                payload: entrollm_codec::Payload::Int(4),
                codes: (0..rows * cols)
                    .map(|_| (8.0 + 2.5 * rng.normal()).round().clamp(0.0, 15.0) as u8)
                    .collect(),
                groups: GroupScales {
                    group: 32,
                    scales: (0..groups).map(|_| 0.01 + 0.001 * rng.normal()).collect(),
                    mins: Some((0..groups).map(|_| -0.08 + 0.001 * rng.normal()).collect()),
                    offset: 0.0,
                    signed: false,
                },
            };
            for (values, held) in [(Values::Bf16(bf16), "bf16"), (int, "")] {
                let src = Source::new(rows, cols, values).unwrap();
                let form = by_name(if held.is_empty() { "int" } else { "dense" }).unwrap();
                let m = encode_checked(form, &src, held).unwrap();
                let (sample, scale) = size_source(&*m, SIZE_SAMPLE_WEIGHTS).unwrap();
                let picked = sample_rows(rows, cols, SIZE_SAMPLE_WEIGHTS).unwrap();
                assert!(sample.weights() <= SIZE_SAMPLE_WEIGHTS);
                assert_eq!(sample, src.gather_rows(&picked).unwrap());
                let mut checked = 0;
                for form in all().iter().filter(|f| f.accepts(&src)) {
                    for c in form.variants(&sample).unwrap().iter().take(3) {
                        let sampled = form.predict(&sample, &c.variant).unwrap() * scale;
                        let whole = form.predict(&src, &c.variant).unwrap();
                        let coded = encode_checked(*form, &src, &c.variant)
                            .unwrap()
                            .stored_bytes() as f64;
                        let what = format!(
                            "{} {} of {rows}×{cols} {}: on {} rows {sampled:.0}, whole \
                             {whole:.0}, coded {coded:.0}",
                            form.name(),
                            c.variant,
                            src.values.kind(),
                            sample.rows
                        );
                        assert!(
                            (sampled / whole - 1.0).abs() <= sampled_bound(rows),
                            "{what}"
                        );
                        assert!((whole / coded - 1.0).abs() <= WHOLE_BOUND, "{what}");
                        checked += 1;
                    }
                }
                assert!(checked >= 3, "{}: {checked} variants", src.values.kind());
            }
        }
    }

    #[test]
    fn small_matrices_are_sized_whole_and_samples_are_whole_bands() {
        let mut rng = Rng::new(3);
        let small =
            encode_checked(&dense::DENSE, &bf16_source(&mut rng, 64, 64, 0.02), "bf16").unwrap();
        let (s, scale) = size_source(&*small, SIZE_SAMPLE_WEIGHTS).unwrap();
        assert_eq!((s, scale), (small.source().unwrap(), 1.0));
        let (rows, cols) = (40 * SAMPLE_BAND + 7, 16);
        let src = bf16_source(&mut rng, rows, cols, 0.02);
        let m = encode_checked(&dense::DENSE, &src, "bf16").unwrap();
        let (s, scale) = size_source(&*m, 4 * SAMPLE_BAND * cols).unwrap();
        let picked = sample_rows(rows, cols, 4 * SAMPLE_BAND * cols).unwrap();
        assert_eq!(s.rows, 4 * SAMPLE_BAND);
        assert_eq!(
            picked[..SAMPLE_BAND],
            (0..SAMPLE_BAND).collect::<Vec<_>>()[..]
        );
        assert!((scale - rows as f64 / s.rows as f64).abs() < 1e-12);
        // Dense copies the rows itself: the same as the rows gathered from the whole.
        assert_eq!(s, src.gather_rows(&picked).unwrap());
        assert!(m.source_rows(&[rows]).is_err());
    }

    /// A matrix too small for any coding to pay still gets a variant from every form that holds
    /// it, and that variant encodes it exactly.
    #[test]
    fn default_variants_encode_what_the_form_holds() {
        let mut rng = Rng::new(3);
        for (rows, cols) in [(1, 64), (3, 320), (64, 512)] {
            let src = bf16_source(&mut rng, rows, cols, 0.05);
            for form in all() {
                match form.default_variant(&src).unwrap() {
                    Some(v) => {
                        check_variant(*form, &src, &v, &mut rng);
                    }
                    None => assert!(!form.accepts(&src), "{}", form.name()),
                }
            }
        }
    }
}
