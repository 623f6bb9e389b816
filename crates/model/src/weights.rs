//! The weights the engine runs on. Every matrix is behind [`Linear`], so dense, GGUF-dequantised
//! and entropy-coded matrices are used the same way.

use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::forms::{FormId, Source};
use kernels::TILE_ROWS;
use rayon::prelude::*;
use std::sync::Arc;

/// A weight matrix W of shape [rows (outputs), cols (inputs)].
pub trait Linear: Send + Sync {
    fn rows(&self) -> usize;
    fn cols(&self) -> usize;
    /// y = W·x (x: cols, y: rows).
    fn matvec(&self, x: &[f32], y: &mut [f32]);
    /// Y = X·Wᵀ for `n` vectors stored row after row (x: n·cols, y: n·rows). The default runs
    /// `matvec` per vector; implementations override it to reuse decoded weights across the batch.
    fn matmul(&self, x: &[f32], n: usize, y: &mut [f32]) {
        let (c, r) = (self.cols(), self.rows());
        for i in 0..n {
            self.matvec(&x[i * c..(i + 1) * c], &mut y[i * r..(i + 1) * r]);
        }
    }
    /// Row `r` of W as f32 (embedding lookup).
    fn row(&self, r: usize, out: &mut [f32]);
    /// Bytes this matrix occupies in memory.
    fn stored_bytes(&self) -> usize;
    /// The weight form it is stored in, and the variant ([`crate::forms`]).
    fn form(&self) -> FormId;
    /// The exact values it holds (the form's CPU decode), without any wrapper's row scales or
    /// row order.
    fn source(&self) -> Result<Source>;
    /// [`source`](Self::source)'s rows `rows`, in that order (a sample to predict sizes from):
    /// forms that hold rows apart copy only those.
    fn source_rows(&self, rows: &[usize]) -> Result<Source> {
        self.source()?.gather_rows(rows)
    }
    /// [`Values::kind`](crate::forms::Values::kind) of [`source`](Self::source), without decoding.
    fn values_kind(&self) -> &'static str;
    /// What besides its shape and values' kind sets the speed of its forms (a GGUF tensor's block
    /// type): the tuner times launches that differ in it apart.
    fn layout_tag(&self) -> Option<&'static str> {
        None
    }
    /// The same matrix with its values in another form: `make` turns the values into the new
    /// inner matrix; wrappers (row scales, row order) wrap it again.
    fn reform(&self, make: &dyn Fn(&Source) -> Result<Arc<dyn Linear>>) -> Result<Arc<dyn Linear>> {
        make(&self.source()?)
    }
    /// The matrix as `Any`, for engines that upload a form's own arrays (the GPU engine).
    fn as_any(&self) -> &dyn std::any::Any;
    /// Bytes of [`stored_bytes`](Self::stored_bytes) that wrappers (row scales, row order) add
    /// beside the inner form's own: they stay when the matrix is re-formed.
    fn wrapper_bytes(&self) -> usize {
        0
    }
}

#[derive(Clone)]
pub struct LayerWeights {
    pub attn_norm: Vec<f32>,
    pub q: Arc<dyn Linear>,
    pub k: Arc<dyn Linear>,
    pub v: Arc<dyn Linear>,
    pub o: Arc<dyn Linear>,
    pub q_bias: Option<Vec<f32>>,
    pub k_bias: Option<Vec<f32>>,
    pub v_bias: Option<Vec<f32>>,
    pub mlp_norm: Vec<f32>,
    pub mlp: Mlp,
    /// The norms only some families have.
    pub norms: ExtraNorms,
}

/// A layer's MLP.
#[derive(Clone)]
pub enum Mlp {
    /// `down(act(gate·h) ⊙ up·h)`.
    Gated(GatedMlp),
    /// A mixture of experts: per token a router picks `top_k` experts ([`crate::config::Moe`])
    /// and the output is their outputs weighted by the router's probabilities.
    Experts(Experts),
}

/// The three matrices of a gated MLP (or of one expert).
#[derive(Clone)]
pub struct GatedMlp {
    pub gate: Arc<dyn Linear>,
    pub up: Arc<dyn Linear>,
    pub down: Arc<dyn Linear>,
}

/// A mixture of experts' router (`[experts, hidden]`) and experts.
#[derive(Clone)]
pub struct Experts {
    pub router: Arc<dyn Linear>,
    pub experts: Vec<GatedMlp>,
    /// The router's bias (`[experts]`; gpt-oss).
    pub router_bias: Option<Vec<f32>>,
    /// Per expert, the biases of its gate, up and down (empty: none; gpt-oss).
    pub biases: Vec<ExpertBiases>,
}

/// The biases of one expert's matrices.
#[derive(Clone, Debug, PartialEq)]
pub struct ExpertBiases {
    pub gate: Vec<f32>,
    pub up: Vec<f32>,
    pub down: Vec<f32>,
}

impl GatedMlp {
    fn map<E>(
        &self,
        prefix: &str,
        f: &mut impl FnMut(&str, usize, &Arc<dyn Linear>) -> std::result::Result<Arc<dyn Linear>, E>,
    ) -> std::result::Result<GatedMlp, E> {
        let (gate_up, down) = (format!("{prefix}gate_up"), format!("{prefix}down"));
        Ok(GatedMlp {
            gate: f(&gate_up, 0, &self.gate)?,
            up: f(&gate_up, 1, &self.up)?,
            down: f(&down, 0, &self.down)?,
        })
    }

    pub fn matrices(&self) -> [&Arc<dyn Linear>; 3] {
        [&self.gate, &self.up, &self.down]
    }
}

impl Mlp {
    /// The dense gated MLP, or `None` for a mixture of experts.
    pub fn gated(&self) -> Option<&GatedMlp> {
        match self {
            Mlp::Gated(g) => Some(g),
            Mlp::Experts(_) => None,
        }
    }

    /// Every matrix: gate, up, down; for experts the router, then each expert's three.
    pub fn matrices(&self) -> Vec<&Arc<dyn Linear>> {
        match self {
            Mlp::Gated(g) => g.matrices().to_vec(),
            Mlp::Experts(e) => std::iter::once(&e.router)
                .chain(e.experts.iter().flat_map(|x| x.matrices()))
                .collect(),
        }
    }
}

impl LayerWeights {
    /// Every matrix of the layer: q, k, v, o, then [`Mlp::matrices`].
    pub fn matrices(&self) -> Vec<&Arc<dyn Linear>> {
        let mut out = vec![&self.q, &self.k, &self.v, &self.o];
        out.extend(self.mlp.matrices());
        out
    }

    /// The dense MLP's matrices, or an error naming the layer for a mixture of experts (for
    /// code that runs only dense MLPs).
    pub fn gated(&self) -> Result<&GatedMlp> {
        self.mlp.gated().ok_or_else(|| {
            ModelError::Unsupported("a mixture-of-experts MLP where a dense one is needed".into())
        })
    }

    /// The layer with every matrix replaced by `f(launch, index in the launch, matrix)`; the
    /// launch is the id's tail of [`crate::forms::layout::launches`] (`qkv` with q, k, v as 0..3,
    /// `o`, `gate_up` with gate, up as 0, 1, `down`; `router`, `experts.E.gate_up`,
    /// `experts.E.down` in a mixture of experts); norms and biases kept.
    pub fn map_matrices<E>(
        &self,
        mut f: impl FnMut(&str, usize, &Arc<dyn Linear>) -> std::result::Result<Arc<dyn Linear>, E>,
    ) -> std::result::Result<LayerWeights, E> {
        Ok(LayerWeights {
            q: f("qkv", 0, &self.q)?,
            k: f("qkv", 1, &self.k)?,
            v: f("qkv", 2, &self.v)?,
            o: f("o", 0, &self.o)?,
            mlp: match &self.mlp {
                Mlp::Gated(g) => Mlp::Gated(g.map("", &mut f)?),
                Mlp::Experts(e) => Mlp::Experts(Experts {
                    router: f("router", 0, &e.router)?,
                    experts: e
                        .experts
                        .iter()
                        .enumerate()
                        .map(|(i, x)| x.map(&format!("experts.{i}."), &mut f))
                        .collect::<std::result::Result<_, E>>()?,
                    ..e.clone()
                }),
            },
            ..self.clone()
        })
    }
}

/// The vectors of a layer only some families have ([`crate::arch`]): RMSNorm weights as the
/// engine multiplies them (a Gemma checkpoint's `1 + w` already added), the attention output's
/// bias and attention sinks.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ExtraNorms {
    /// Per head of q and of k, before RoPE (`[head_dim]`; Qwen3, Gemma 3).
    pub q: Option<Vec<f32>>,
    pub k: Option<Vec<f32>>,
    /// Of the attention's output before its residual add (Gemma).
    pub post_attn: Option<Vec<f32>>,
    /// Of the MLP's output before its residual add (Gemma).
    pub post_mlp: Option<Vec<f32>>,
    /// The bias of the attention's output projection (`[hidden]`; gpt-oss, Llama with
    /// `attention_bias`).
    pub o_bias: Option<Vec<f32>>,
    /// Per head, a logit joined to the attention softmax's denominator and to no value
    /// (`[heads]`; gpt-oss).
    pub sinks: Option<Vec<f32>>,
}

impl ExtraNorms {
    fn vectors(&self) -> [&Option<Vec<f32>>; 6] {
        [
            &self.q,
            &self.k,
            &self.post_attn,
            &self.post_mlp,
            &self.o_bias,
            &self.sinks,
        ]
    }
}

pub struct ModelWeights {
    pub config: ModelConfig,
    /// [vocab, hidden]; shared with `lm_head` when embeddings are tied.
    pub embed: Arc<dyn Linear>,
    pub layers: Vec<LayerWeights>,
    pub final_norm: Vec<f32>,
    /// [vocab, hidden].
    pub lm_head: Arc<dyn Linear>,
}

/// A tensor as a loader hands it to [`build_model`](crate::weights): host data in its stored
/// precision, or a ready-made matrix (e.g. an entropy-coded one).
pub enum HostTensor {
    F32 { shape: Vec<usize>, data: Vec<f32> },
    Bf16 { shape: Vec<usize>, data: Vec<u16> },
    F16 { shape: Vec<usize>, data: Vec<u16> },
    Linear(Arc<dyn Linear>),
}

/// Where the engine gets tensors from, by Hugging Face name (`model.layers.0.self_attn.q_proj.weight`,
/// `model.embed_tokens.weight`, `lm_head.weight`, `model.norm.weight`, ...). Loaders (HF safetensors,
/// GGUF, entrollm containers) implement it; names and layouts are always HF's (GGUF llama Q/K rows
/// un-permuted by the loader).
pub trait TensorSource {
    /// The model's configuration.
    fn config(&self) -> crate::error::Result<ModelConfig>;
    /// The tensor with this HF name, or `None` if the checkpoint has no such tensor.
    fn tensor(&self, hf_name: &str) -> crate::error::Result<Option<HostTensor>>;
    /// Whether RMSNorm weights already hold the 1 that Gemma-style families add to them
    /// ([`crate::arch::Family::hf_norm_plus_one`]): llama.cpp's converter adds it to GGUF files.
    fn norms_hold_the_one(&self) -> bool {
        false
    }
}

/// How a dense matrix stores its elements and turns one into f32 (sealed: the SIMD kernels rely
/// on [`DenseElement::LAYOUT`] describing `Stored` exactly).
pub trait DenseElement: sealed::Sealed + Send + Sync + 'static {
    type Stored: Copy + Send + Sync + 'static;
    /// safetensors-style dtype name, for messages.
    const DTYPE: &'static str;
    const LAYOUT: ElementLayout;
    /// Branch-free, so the portable kernel vectorises.
    fn to_f32(s: Self::Stored) -> f32;
    /// The elements themselves when they already are f32 (no conversion needed).
    fn as_f32_slice(_s: &[Self::Stored]) -> Option<&[f32]> {
        None
    }
    /// The elements as the forms' exact [`Values`](crate::forms::Values).
    fn to_values(s: &[Self::Stored]) -> crate::forms::Values;
}

/// The bit layout of a stored element.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ElementLayout {
    F32,
    Bf16,
    F16,
    /// One byte, converted through [`FP8_E4M3_TO_F32`].
    Fp8E4m3,
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for super::F32 {}
    impl Sealed for super::Bf16 {}
    impl Sealed for super::F16 {}
    impl Sealed for super::Fp8E4m3 {}
}

/// f32 storage.
pub enum F32 {}
/// bfloat16 bit patterns (u16).
pub enum Bf16 {}
/// IEEE half bit patterns (u16).
pub enum F16 {}
/// OCP FP8 E4M3 ("fn") bytes.
pub enum Fp8E4m3 {}

/// Every FP8 E4M3 byte as f32 (0x7F and 0xFF are NaN; loaders reject them).
pub static FP8_E4M3_TO_F32: [f32; 256] = {
    let mut t = [0f32; 256];
    let mut b = 0;
    while b < 256 {
        let sign = ((b as u32) >> 7) << 31;
        let (e, m) = ((b as u32 >> 3) & 0xF, b as u32 & 7);
        let bits = if e == 15 && m == 7 {
            0x7FC0_0000
        } else if e > 0 {
            sign | (e + 127 - 7) << 23 | m << 20
        } else if m == 0 {
            sign
        } else {
            // Subnormal m·2^-9: normalise on m's leading bit p.
            let p = 31 - m.leading_zeros();
            sign | (p + 127 - 9) << 23 | (m - (1 << p)) << (23 - p)
        };
        t[b] = f32::from_bits(bits);
        b += 1;
    }
    t
};

impl DenseElement for Fp8E4m3 {
    type Stored = u8;
    const DTYPE: &'static str = "F8_E4M3";
    const LAYOUT: ElementLayout = ElementLayout::Fp8E4m3;
    #[inline(always)]
    fn to_f32(s: u8) -> f32 {
        FP8_E4M3_TO_F32[s as usize]
    }
    fn to_values(s: &[u8]) -> crate::forms::Values {
        crate::forms::Values::Fp8(s.to_vec())
    }
}

impl DenseElement for F32 {
    type Stored = f32;
    const DTYPE: &'static str = "F32";
    const LAYOUT: ElementLayout = ElementLayout::F32;
    #[inline(always)]
    fn to_f32(s: f32) -> f32 {
        s
    }
    fn as_f32_slice(s: &[f32]) -> Option<&[f32]> {
        Some(s)
    }
    fn to_values(s: &[f32]) -> crate::forms::Values {
        crate::forms::Values::F32(s.to_vec())
    }
}

impl DenseElement for Bf16 {
    type Stored = u16;
    const DTYPE: &'static str = "BF16";
    const LAYOUT: ElementLayout = ElementLayout::Bf16;
    #[inline(always)]
    fn to_f32(s: u16) -> f32 {
        f32::from_bits((s as u32) << 16)
    }
    fn to_values(s: &[u16]) -> crate::forms::Values {
        crate::forms::Values::Bf16(s.to_vec())
    }
}

impl DenseElement for F16 {
    type Stored = u16;
    const DTYPE: &'static str = "F16";
    const LAYOUT: ElementLayout = ElementLayout::F16;
    /// Exact for every input (subnormals, inf, NaN payloads), written with selects instead of
    /// branches (after F. Giesen's `half_to_float`).
    #[inline(always)]
    fn to_f32(s: u16) -> f32 {
        let h = s as u32;
        let shifted = (h & 0x7fff) << 13; // exponent and mantissa in f32 position
        let exp = shifted & (0x7c00 << 13);
        let rebased = shifted + ((127 - 15) << 23);
        let inf_nan = rebased + ((128 - 16) << 23);
        // Subnormal: give it the implicit 1 of exponent -14, then subtract that 1 (2^-14) exactly.
        let subnormal = (f32::from_bits(rebased + (1 << 23)) - f32::from_bits(113 << 23)).to_bits();
        let magnitude = if exp == 0x7c00 << 13 {
            inf_nan
        } else if exp == 0 {
            subnormal
        } else {
            rebased
        };
        f32::from_bits(magnitude | ((h & 0x8000) << 16))
    }
    fn to_values(s: &[u16]) -> crate::forms::Values {
        crate::forms::Values::F16(s.to_vec())
    }
}

/// A row-major [rows, cols] matrix kept in its stored precision.
pub struct Dense<E: DenseElement> {
    rows: usize,
    cols: usize,
    data: Vec<E::Stored>,
}

pub type DenseF32 = Dense<F32>;
pub type DenseBf16 = Dense<Bf16>;
pub type DenseF16 = Dense<F16>;
pub type DenseFp8 = Dense<Fp8E4m3>;

/// What a [`Wrapped`] matrix does around the matrix inside it: reorders or scales its input
/// columns, its output rows, or both. The wrappers differ only here; [`Wrapped`] delegates the
/// rest (form, source, layout, re-forming) to the matrix inside.
pub trait Wrap: Clone + Send + Sync + 'static {
    /// The input the inner matrix multiplies: `x` holds vectors of `cols`.
    fn input<'a>(&self, x: &'a [f32], _cols: usize) -> std::borrow::Cow<'a, [f32]> {
        std::borrow::Cow::Borrowed(x)
    }
    /// The inner matrix's output `y` (vectors of `rows`) made the wrapper's, in place.
    fn output(&self, _y: &mut [f32], _rows: usize) {}
    /// Row `r` of the wrapper's matrix into `out`, from the matrix inside.
    fn row(&self, inner: &dyn Linear, r: usize, out: &mut [f32]);
    /// Bytes the wrapper keeps beside the matrix inside.
    fn bytes(&self) -> usize;
}

/// A matrix seen through a [`Wrap`]: row scales ([`RowScaled`]), a column order
/// ([`crate::hf_quant::ColumnOrdered`]), a row order (GGUF's Q/K rows).
pub struct Wrapped<W: Wrap> {
    inner: Arc<dyn Linear>,
    wrap: W,
}

impl<W: Wrap> Wrapped<W> {
    /// `wrap` must fit `inner`'s shape: the wrappers' constructors check it.
    pub(crate) fn with(inner: Arc<dyn Linear>, wrap: W) -> Self {
        Wrapped { inner, wrap }
    }
    /// The matrix inside.
    pub fn inner(&self) -> &Arc<dyn Linear> {
        &self.inner
    }
    /// What it does around the matrix inside.
    pub fn wrap(&self) -> &W {
        &self.wrap
    }
}

impl<W: Wrap> Linear for Wrapped<W> {
    fn rows(&self) -> usize {
        self.inner.rows()
    }
    fn cols(&self) -> usize {
        self.inner.cols()
    }
    fn matvec(&self, x: &[f32], y: &mut [f32]) {
        self.inner.matvec(&self.wrap.input(x, self.cols()), y);
        self.wrap.output(y, self.rows());
    }
    fn matmul(&self, x: &[f32], n: usize, y: &mut [f32]) {
        self.inner.matmul(&self.wrap.input(x, self.cols()), n, y);
        self.wrap.output(y, self.rows());
    }
    fn row(&self, r: usize, out: &mut [f32]) {
        self.wrap.row(&*self.inner, r, out)
    }
    fn stored_bytes(&self) -> usize {
        self.inner.stored_bytes() + self.wrap.bytes()
    }
    fn wrapper_bytes(&self) -> usize {
        self.inner.wrapper_bytes() + self.wrap.bytes()
    }
    fn form(&self) -> FormId {
        self.inner.form()
    }
    fn source(&self) -> Result<Source> {
        self.inner.source()
    }
    fn source_rows(&self, rows: &[usize]) -> Result<Source> {
        self.inner.source_rows(rows)
    }
    fn values_kind(&self) -> &'static str {
        self.inner.values_kind()
    }
    fn layout_tag(&self) -> Option<&'static str> {
        self.inner.layout_tag()
    }
    fn reform(&self, make: &dyn Fn(&Source) -> Result<Arc<dyn Linear>>) -> Result<Arc<dyn Linear>> {
        Ok(Arc::new(Wrapped::with(
            self.inner.reform(make)?,
            self.wrap.clone(),
        )))
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// Row r multiplied by `scales[r]`.
#[derive(Clone)]
pub struct RowScales(Vec<f32>);

impl Wrap for RowScales {
    fn output(&self, y: &mut [f32], rows: usize) {
        for y in y.chunks_exact_mut(rows) {
            for (y, s) in y.iter_mut().zip(&self.0) {
                *y *= s;
            }
        }
    }
    fn row(&self, inner: &dyn Linear, r: usize, out: &mut [f32]) {
        inner.row(r, out);
        for v in out.iter_mut() {
            *v *= self.0[r];
        }
    }
    fn bytes(&self) -> usize {
        4 * self.0.len()
    }
}

/// A matrix whose row r is multiplied by `scales[r]`: FP8 checkpoints' per-channel `weight_scale`
/// around FP8 codes (dense or entropy-coded).
pub type RowScaled = Wrapped<RowScales>;

impl RowScaled {
    /// The matrix inside and the row scales, for an engine that keeps them apart (the GPU's FP8
    /// GEMV applies the scales in its epilogue).
    pub fn parts(&self) -> (&Arc<dyn Linear>, &[f32]) {
        (&self.inner, &self.wrap.0)
    }

    pub fn new(name: &str, inner: Arc<dyn Linear>, scales: Vec<f32>) -> Result<Self> {
        if scales.len() != inner.rows() {
            return Err(ModelError::tensor(
                name,
                format!(
                    "{} row scales for a matrix of {} rows",
                    scales.len(),
                    inner.rows()
                ),
            ));
        }
        Ok(Wrapped::with(inner, RowScales(scales)))
    }
}

impl<E: DenseElement> Dense<E> {
    /// `name` labels errors: `data` must hold exactly `rows · cols` elements, both non-zero.
    pub fn new(name: &str, rows: usize, cols: usize, data: Vec<E::Stored>) -> Result<Self> {
        if rows == 0 || cols == 0 {
            return Err(ModelError::tensor(
                name,
                format!("empty {} matrix [{rows}, {cols}]", E::DTYPE),
            ));
        }
        if rows.checked_mul(cols) != Some(data.len()) {
            return Err(ModelError::tensor(
                name,
                format!(
                    "{} matrix [{rows}, {cols}] needs {} elements, has {}",
                    E::DTYPE,
                    rows as u128 * cols as u128,
                    data.len()
                ),
            ));
        }
        let mut data = data;
        // stored_bytes() reports the length: keep no spare capacity behind it.
        data.shrink_to_fit();
        Ok(Dense { rows, cols, data })
    }

    /// The stored elements, row-major.
    pub fn data(&self) -> &[E::Stored] {
        &self.data
    }

    /// Rows per parallel task: enough work per task (~64K weights) to amortise scheduling, a
    /// multiple of the kernel's row tile.
    fn rows_per_task(&self) -> usize {
        let rows = (1usize << 16) / self.cols;
        rows.clamp(TILE_ROWS, 256) / TILE_ROWS * TILE_ROWS
    }
}

impl<E: DenseElement> Linear for Dense<E> {
    fn rows(&self) -> usize {
        self.rows
    }

    fn cols(&self) -> usize {
        self.cols
    }

    fn matvec(&self, x: &[f32], y: &mut [f32]) {
        assert_eq!(x.len(), self.cols, "matvec input length");
        assert_eq!(y.len(), self.rows, "matvec output length");
        let cols = self.cols;
        let task_rows = self.rows_per_task();
        let isa = kernels::Isa::detect();
        y.par_chunks_mut(task_rows)
            .zip(self.data.par_chunks(task_rows * cols))
            .for_each(|(y, w)| kernels::rows_times_vectors::<E>(isa, w, cols, x, 1, y));
    }

    /// Each task converts a block of weight rows to f32 once, then multiplies it with every input
    /// vector, so the weights are read once per batch.
    fn matmul(&self, x: &[f32], n: usize, y: &mut [f32]) {
        assert_eq!(x.len(), n * self.cols, "matmul input length");
        assert_eq!(y.len(), n * self.rows, "matmul output length");
        if n == 1 {
            return self.matvec(x, y);
        }
        let (rows, cols) = (self.rows, self.cols);
        let task_rows = self.rows_per_task();
        let isa = kernels::Isa::detect();
        // Tasks own whole row blocks, so they write the transposed product [rows, n].
        let mut y_t = vec![0f32; rows * n];
        y_t.par_chunks_mut(task_rows * n)
            .zip(self.data.par_chunks(task_rows * cols))
            .for_each(|(y_t, w)| {
                let converted: Vec<f32>;
                let w_f32 = match E::as_f32_slice(w) {
                    Some(w) => w,
                    None => {
                        converted = w.iter().map(|&s| E::to_f32(s)).collect();
                        &converted
                    }
                };
                kernels::rows_times_vectors::<F32>(isa, w_f32, cols, x, n, y_t);
            });
        untranspose(&y_t, n, y);
    }

    fn row(&self, r: usize, out: &mut [f32]) {
        assert!(r < self.rows, "row {r} of a {}-row matrix", self.rows);
        let src = &self.data[r * self.cols..(r + 1) * self.cols];
        for (o, &s) in out.iter_mut().zip(src) {
            *o = E::to_f32(s);
        }
    }

    fn stored_bytes(&self) -> usize {
        self.data.len() * std::mem::size_of::<E::Stored>()
    }
    fn form(&self) -> FormId {
        FormId {
            form: "dense",
            variant: self.values_kind().to_string(),
        }
    }
    fn source(&self) -> Result<Source> {
        Source::new(self.rows, self.cols, E::to_values(&self.data))
    }
    fn source_rows(&self, rows: &[usize]) -> Result<Source> {
        let c = self.cols;
        if let Some(&r) = rows.iter().find(|&&r| r >= self.rows) {
            return Err(ModelError::Unsupported(format!(
                "row {r} of a matrix of {} rows",
                self.rows
            )));
        }
        let picked: Vec<E::Stored> = rows
            .iter()
            .flat_map(|&r| self.data[r * c..(r + 1) * c].iter().copied())
            .collect();
        Source::new(rows.len(), c, E::to_values(&picked))
    }
    fn values_kind(&self) -> &'static str {
        E::to_values(&[]).kind()
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// `out[r·n + b] = w_r · x_b` for the f32 rows in `w` (`cols` wide) and the `n` vectors in `x`,
/// by the dense kernels: a form that decodes rows to f32 (`lossy`) sums exactly as `dense f32`.
pub(crate) fn f32_rows_times_vectors(w: &[f32], cols: usize, x: &[f32], n: usize, out: &mut [f32]) {
    kernels::rows_times_vectors::<F32>(kernels::Isa::detect(), w, cols, x, n, out)
}

/// `y[b·rows + r] = y_t[r·n + b]`: products the kernels wrote row by row ([rows, n]) as the
/// batch's vectors ([n, rows]).
pub(crate) fn untranspose(y_t: &[f32], n: usize, y: &mut [f32]) {
    let rows = y.len() / n;
    y.par_chunks_mut(rows).enumerate().for_each(|(b, y)| {
        for (r, out) in y.iter_mut().enumerate() {
            *out = y_t[r * n + b];
        }
    });
}

/// The dense dot-product kernels. Register tiles of rows × vectors with LANES-wide partial sums,
/// a fixed pairwise reduction and a scalar tail, so every (row, vector) dot product sums its
/// terms in the same order whatever the tiling (`matvec` and `matmul` agree bit for bit) and
/// whichever implementation runs: portable Rust that LLVM vectorises, or AVX2 intrinsics (no FMA,
/// for the same reason) picked at run time.
mod kernels {
    use super::DenseElement;
    use std::array;

    /// Partial sums per dot product (one AVX2 register of f32).
    const LANES: usize = 8;
    /// Weight rows per register tile.
    pub(super) const TILE_ROWS: usize = 4;
    /// Input vectors per register tile in batched products.
    const TILE_VECS: usize = 2;
    /// Input vectors kept hot in cache while a task walks its row block.
    const BATCH_CHUNK: usize = 32;

    /// Which tile implementation runs.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub(super) enum Isa {
        Portable,
        #[cfg(target_arch = "x86_64")]
        Avx2,
    }

    impl Isa {
        pub(super) fn detect() -> Isa {
            #[cfg(target_arch = "x86_64")]
            {
                if std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("f16c")
                {
                    return Isa::Avx2;
                }
            }
            Isa::Portable
        }
    }

    /// `out[r·n + b] = w_r · x_b` for the `out.len() / n` rows in `w` (row-major, `cols` wide) and
    /// the `n` vectors in `x`.
    pub(super) fn rows_times_vectors<E: DenseElement>(
        isa: Isa,
        w: &[E::Stored],
        cols: usize,
        x: &[f32],
        n: usize,
        out: &mut [f32],
    ) {
        let rows = out.len() / n;
        assert_eq!(w.len(), rows * cols, "weight block size");
        assert_eq!(x.len(), n * cols, "input size");
        let row = |r: usize| &w[r * cols..(r + 1) * cols];
        let vector = |b: usize| &x[b * cols..(b + 1) * cols];
        for b_start in (0..n).step_by(BATCH_CHUNK) {
            let b_end = (b_start + BATCH_CHUNK).min(n);
            let mut r = 0;
            while r < rows {
                if r + TILE_ROWS <= rows {
                    let ws: [&[E::Stored]; TILE_ROWS] = array::from_fn(|i| row(r + i));
                    tile_over_vectors::<E, TILE_ROWS>(
                        isa,
                        ws,
                        &vector,
                        b_start,
                        b_end,
                        |i, b, v| out[(r + i) * n + b] = v,
                    );
                    r += TILE_ROWS;
                } else {
                    tile_over_vectors::<E, 1>(isa, [row(r)], &vector, b_start, b_end, |_, b, v| {
                        out[r * n + b] = v
                    });
                    r += 1;
                }
            }
        }
    }

    /// Multiplies `R` weight rows with vectors `b_start..b_end`, `TILE_VECS` at a time.
    #[inline(always)]
    fn tile_over_vectors<'x, E: DenseElement, const R: usize>(
        isa: Isa,
        ws: [&[E::Stored]; R],
        vector: &impl Fn(usize) -> &'x [f32],
        b_start: usize,
        b_end: usize,
        mut store: impl FnMut(usize, usize, f32),
    ) {
        let mut b = b_start;
        while b < b_end {
            if b + TILE_VECS <= b_end {
                let dots = tile::<E, R, TILE_VECS>(isa, ws, array::from_fn(|j| vector(b + j)));
                for (i, row) in dots.iter().enumerate() {
                    for (j, &v) in row.iter().enumerate() {
                        store(i, b + j, v);
                    }
                }
                b += TILE_VECS;
            } else {
                let dots = tile::<E, R, 1>(isa, ws, [vector(b)]);
                for (i, row) in dots.iter().enumerate() {
                    store(i, b, row[0]);
                }
                b += 1;
            }
        }
    }

    /// The R×B dot products of `R` weight rows with `B` vectors, all of one length.
    #[inline(always)]
    pub(super) fn tile<E: DenseElement, const R: usize, const B: usize>(
        isa: Isa,
        w: [&[E::Stored]; R],
        x: [&[f32]; B],
    ) -> [[f32; B]; R] {
        let k = x[0].len();
        assert!(w.iter().all(|r| r.len() == k) && x.iter().all(|v| v.len() == k));
        match isa {
            Isa::Portable => tile_portable::<E, R, B>(w, x),
            // SAFETY: `Isa::detect` found AVX2 and F16C; all slices hold `k` elements.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => unsafe { tile_avx2::<E, R, B>(w, x) },
        }
    }

    #[inline(always)]
    fn tile_portable<E: DenseElement, const R: usize, const B: usize>(
        w: [&[E::Stored]; R],
        x: [&[f32]; B],
    ) -> [[f32; B]; R] {
        let k = x[0].len();
        let body = k - k % LANES;
        let mut acc = [[[0f32; LANES]; B]; R];
        let mut c = 0;
        while c < body {
            let xs: [&[f32]; B] = array::from_fn(|b| &x[b][c..c + LANES]);
            for r in 0..R {
                let wr = &w[r][c..c + LANES];
                let wf: [f32; LANES] = array::from_fn(|l| E::to_f32(wr[l]));
                for b in 0..B {
                    for l in 0..LANES {
                        acc[r][b][l] += wf[l] * xs[b][l];
                    }
                }
            }
            c += LANES;
        }
        let mut dots = [[0f32; B]; R];
        for r in 0..R {
            for b in 0..B {
                let a = &acc[r][b];
                let halves = array::from_fn(|l| a[l] + a[l + 4]);
                dots[r][b] = finish::<E>(halves, w[r], x[b], body);
            }
        }
        dots
    }

    /// Sums the four half-register partial sums `(a_l + a_{l+4})` pairwise, then adds the scalar
    /// tail `body..`.
    #[inline(always)]
    fn finish<E: DenseElement>(halves: [f32; 4], w: &[E::Stored], x: &[f32], body: usize) -> f32 {
        let mut sum = (halves[0] + halves[1]) + (halves[2] + halves[3]);
        for (&w, &x) in w[body..].iter().zip(&x[body..]) {
            sum += E::to_f32(w) * x;
        }
        sum
    }

    /// # Safety
    /// The CPU supports AVX2 and F16C, and every slice in `w` and `x` has `x[0].len()` elements.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn tile_avx2<E: DenseElement, const R: usize, const B: usize>(
        w: [&[E::Stored]; R],
        x: [&[f32]; B],
    ) -> [[f32; B]; R] {
        use super::ElementLayout;
        use std::arch::x86_64::*;
        let k = x[0].len();
        let body = k - k % LANES;
        let mut acc = [[_mm256_setzero_ps(); B]; R];
        let mut xv = [_mm256_setzero_ps(); B];
        let mut c = 0;
        while c < body {
            for b in 0..B {
                xv[b] = _mm256_loadu_ps(x[b].as_ptr().add(c));
            }
            for r in 0..R {
                let p = w[r].as_ptr().add(c);
                // The sealed DenseElement guarantees `Stored` matches `LAYOUT`.
                let wv = match E::LAYOUT {
                    ElementLayout::F32 => _mm256_loadu_ps(p as *const f32),
                    ElementLayout::Bf16 => {
                        let bits = _mm256_cvtepu16_epi32(_mm_loadu_si128(p as *const __m128i));
                        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(bits))
                    }
                    ElementLayout::F16 => _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)),
                    ElementLayout::Fp8E4m3 => {
                        let idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64(p as *const __m128i));
                        _mm256_i32gather_ps::<4>(super::FP8_E4M3_TO_F32.as_ptr(), idx)
                    }
                };
                for b in 0..B {
                    acc[r][b] = _mm256_add_ps(acc[r][b], _mm256_mul_ps(wv, xv[b]));
                }
            }
            c += LANES;
        }
        let mut dots = [[0f32; B]; R];
        for r in 0..R {
            for b in 0..B {
                let a = acc[r][b];
                let halves = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps::<1>(a));
                let mut h = [0f32; 4];
                _mm_storeu_ps(h.as_mut_ptr(), halves);
                dots[r][b] = finish::<E>(h, w[r], x[b], body);
            }
        }
        dots
    }
}

/// Builds the model from a loader: fetches every tensor the family's description names, keeps
/// matrices in their stored precision (or as the loader's own [`Linear`]), splits fused q/k/v and
/// gate/up tensors by rows, widens norms and biases to f32 (adding the 1 of Gemma-style norms
/// where the checkpoint does not hold it), shares one `Arc` between embedding and LM head when
/// they are tied, and checks every shape against the config.
pub fn build_model(source: &dyn TensorSource) -> Result<ModelWeights> {
    use crate::arch::Role;
    let config = source.config()?;
    config.validate()?;
    let family = config.arch.family();
    let fetch = |name: &str| -> Result<HostTensor> {
        source
            .tensor(name)?
            .ok_or_else(|| ModelError::tensor(name, "missing from the checkpoint"))
    };
    let matrix = |name: &str| fetch(name).and_then(|t| host_matrix(name, t));
    let vector = |name: &str| fetch(name).and_then(|t| host_vector(name, t));
    let plus_one = family.hf_norm_plus_one && !source.norms_hold_the_one();
    let norm = |name: &str| -> Result<Vec<f32>> {
        let mut v = vector(name)?;
        if plus_one {
            v.iter_mut().for_each(|w| *w += 1.0);
        }
        Ok(v)
    };

    let embed = matrix("model.embed_tokens.weight")?;
    let mut layers = Vec::with_capacity(config.num_layers);
    for i in 0..config.num_layers {
        let name = |role: Role, param: &str| {
            family
                .hf_name(role, i, param)
                .expect("roles asked for are the family's")
        };
        let has = |role| family.has(role);
        // transformers gives o_proj a bias with `attention_bias` (Llama, gpt-oss), Qwen2 none:
        // read where the checkpoint has one.
        let o_bias_name = name(Role::O, "bias");
        let o_bias = match source.tensor(&o_bias_name)? {
            Some(t) => Some(host_vector(&o_bias_name, t)?),
            None => None,
        };
        let (q, k, v) = match has(Role::Qkv) {
            true => {
                let qkv = name(Role::Qkv, "weight");
                let rows = [config.q_dim(), config.kv_dim(), config.kv_dim()];
                let [q, k, v]: [Arc<dyn Linear>; 3] = split_rows(&qkv, matrix(&qkv)?, &rows)?
                    .try_into()
                    .map_err(|_| ModelError::tensor(&qkv, "split into three"))?;
                (q, k, v)
            }
            false => (
                matrix(&name(Role::Q, "weight"))?,
                matrix(&name(Role::K, "weight"))?,
                matrix(&name(Role::V, "weight"))?,
            ),
        };
        let mlp = match config.block.moe_at(i) {
            Some(moe) => {
                let spec = family
                    .moe
                    .as_ref()
                    .expect("a config with experts is of a family with them");
                let fused = match &spec.hf_fused {
                    Some(f) => fused_experts(source, f, i, moe, config.hidden_size, spec.biases)?,
                    None => None,
                };
                let (experts, biases) = match fused {
                    Some(x) => x,
                    None => {
                        let tensor = |role, e, param: &str| {
                            family
                                .hf_expert_tensor(role, i, e, param)
                                .expect("roles asked for are the family's")
                        };
                        let experts = (0..moe.experts)
                            .map(|e| {
                                Ok(GatedMlp {
                                    gate: matrix(&tensor(Role::ExpertGate, e, "weight"))?,
                                    up: matrix(&tensor(Role::ExpertUp, e, "weight"))?,
                                    down: matrix(&tensor(Role::ExpertDown, e, "weight"))?,
                                })
                            })
                            .collect::<Result<_>>()?;
                        let biases = match spec.biases {
                            true => (0..moe.experts)
                                .map(|e| {
                                    Ok(ExpertBiases {
                                        gate: vector(&tensor(Role::ExpertGate, e, "bias"))?,
                                        up: vector(&tensor(Role::ExpertUp, e, "bias"))?,
                                        down: vector(&tensor(Role::ExpertDown, e, "bias"))?,
                                    })
                                })
                                .collect::<Result<_>>()?,
                            false => Vec::new(),
                        };
                        (experts, biases)
                    }
                };
                Mlp::Experts(Experts {
                    router: matrix(&name(Role::Router, "weight"))?,
                    router_bias: match spec.biases {
                        true => Some(vector(&name(Role::Router, "bias"))?),
                        false => None,
                    },
                    experts,
                    biases,
                })
            }
            None if has(Role::GateUp) => {
                let gu = name(Role::GateUp, "weight");
                let inter = config.intermediate_size;
                let [gate, up]: [Arc<dyn Linear>; 2] =
                    split_rows(&gu, matrix(&gu)?, &[inter, inter])?
                        .try_into()
                        .map_err(|_| ModelError::tensor(&gu, "split into two"))?;
                Mlp::Gated(GatedMlp {
                    gate,
                    up,
                    down: matrix(&name(Role::Down, "weight"))?,
                })
            }
            None => Mlp::Gated(GatedMlp {
                gate: matrix(&name(Role::Gate, "weight"))?,
                up: matrix(&name(Role::Up, "weight"))?,
                down: matrix(&name(Role::Down, "weight"))?,
            }),
        };
        let bias = |role: Role| -> Result<Option<Vec<f32>>> {
            match config.attention_bias {
                true => vector(&name(role, "bias")).map(Some),
                false => Ok(None),
            }
        };
        let optional_norm = |role: Role| -> Result<Option<Vec<f32>>> {
            match has(role) {
                true => norm(&name(role, "weight")).map(Some),
                false => Ok(None),
            }
        };
        layers.push(LayerWeights {
            attn_norm: norm(&name(Role::AttnNorm, "weight"))?,
            q,
            k,
            v,
            o: matrix(&name(Role::O, "weight"))?,
            q_bias: bias(Role::Q)?,
            k_bias: bias(Role::K)?,
            v_bias: bias(Role::V)?,
            mlp_norm: norm(&name(Role::MlpNorm, "weight"))?,
            mlp,
            norms: ExtraNorms {
                q: optional_norm(Role::QNorm)?,
                k: optional_norm(Role::KNorm)?,
                post_attn: optional_norm(Role::PostAttnNorm)?,
                post_mlp: optional_norm(Role::PostMlpNorm)?,
                o_bias,
                sinks: match has(Role::Sinks) {
                    true => Some(vector(&name(Role::Sinks, ""))?),
                    false => None,
                },
            },
        });
    }
    let final_norm = norm("model.norm.weight")?;
    let lm_head = match config.tie_word_embeddings {
        true => Arc::clone(&embed),
        false => matrix("lm_head.weight")?,
    };
    let weights = ModelWeights {
        config,
        embed,
        layers,
        final_norm,
        lm_head,
    };
    weights.validate()?;
    Ok(weights)
}

/// A layer's experts from the two tensors an HF checkpoint fuses them into ([`FusedExperts`]), or
/// `None` where the source has no such tensors (a GGUF serves each expert's own). Each expert's
/// gate (the even outputs of `gate_up`), up (the odd ones) and down are matrices of their own in
/// the form of the whole: a dense stack is transposed into them, a quantised one (its rows the
/// outputs, [`crate::hf_quant`]) gives its rows' blocks as they are.
///
/// [`FusedExperts`]: crate::arch::FusedExperts
fn fused_experts(
    source: &dyn TensorSource,
    fused: &crate::arch::FusedExperts,
    layer: usize,
    moe: &crate::config::Moe,
    hidden: usize,
    biases: bool,
) -> Result<Option<(Vec<GatedMlp>, Vec<ExpertBiases>)>> {
    let gu_name = format!("model.layers.{layer}.{}", fused.gate_up);
    let Some(gu) = source.tensor(&gu_name)? else {
        return Ok(None);
    };
    let down_name = format!("model.layers.{layer}.{}", fused.down);
    let down = source
        .tensor(&down_name)?
        .ok_or_else(|| ModelError::tensor(&down_name, "missing from the checkpoint"))?;
    let (n, inter) = (moe.experts, moe.intermediate_size);
    let gu = output_rows(&gu_name, gu, n, 2 * inter, hidden)?;
    let down = output_rows(&down_name, down, n, hidden, inter)?;
    let experts = (0..n)
        .map(|x| {
            let base = x * 2 * inter;
            Ok(GatedMlp {
                gate: take_rows(&gu_name, &gu, (0..inter).map(|j| base + 2 * j))?,
                up: take_rows(&gu_name, &gu, (0..inter).map(|j| base + 2 * j + 1))?,
                down: take_rows(&down_name, &down, x * hidden..(x + 1) * hidden)?,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    if !biases {
        return Ok(Some((experts, Vec::new())));
    }
    let flat = |name: String, len: usize| -> Result<Vec<f32>> {
        let t = source
            .tensor(&name)?
            .ok_or_else(|| ModelError::tensor(&name, "missing from the checkpoint"))?;
        let (shape, v) = match t {
            HostTensor::F32 { shape, data } => (shape, data),
            HostTensor::Bf16 { shape, data } => {
                (shape, data.into_iter().map(Bf16::to_f32).collect())
            }
            HostTensor::F16 { shape, data } => (shape, data.into_iter().map(F16::to_f32).collect()),
            HostTensor::Linear(_) => {
                return Err(ModelError::tensor(
                    &name,
                    "a matrix where biases are expected",
                ))
            }
        };
        if shape != [n, len / n] || v.len() != len {
            return Err(ModelError::tensor(
                &name,
                format!("shape {shape:?}, the config implies [{n}, {}]", len / n),
            ));
        }
        Ok(v)
    };
    let gu_bias = flat(format!("{gu_name}_bias"), n * 2 * inter)?;
    let down_bias = flat(format!("{down_name}_bias"), n * hidden)?;
    let biases = (0..n)
        .map(|x| {
            let b = &gu_bias[x * 2 * inter..(x + 1) * 2 * inter];
            ExpertBiases {
                gate: b.iter().step_by(2).copied().collect(),
                up: b.iter().skip(1).step_by(2).copied().collect(),
                down: down_bias[x * hidden..(x + 1) * hidden].to_vec(),
            }
        })
        .collect();
    Ok(Some((experts, biases)))
}

/// A stack of `experts` matrices of `outputs × inputs` as one matrix whose rows are every
/// expert's outputs in turn: a dense HF stack (`[experts, inputs, outputs]`, a linear layer's
/// weight transposed) transposed, a quantised one (already by outputs) as it is.
fn output_rows(
    name: &str,
    t: HostTensor,
    experts: usize,
    outputs: usize,
    inputs: usize,
) -> Result<Arc<dyn Linear>> {
    fn transposed<T: Copy>(v: &[T], experts: usize, inputs: usize, outputs: usize) -> Vec<T> {
        let mut out = Vec::with_capacity(v.len());
        for x in 0..experts {
            let m = &v[x * inputs * outputs..(x + 1) * inputs * outputs];
            for o in 0..outputs {
                out.extend((0..inputs).map(|i| m[i * outputs + o]));
            }
        }
        out
    }
    let check = |shape: &[usize], len: usize| -> Result<()> {
        if shape != [experts, inputs, outputs] || len != experts * inputs * outputs {
            return Err(ModelError::tensor(
                name,
                format!("shape {shape:?}, the config implies [{experts}, {inputs}, {outputs}]"),
            ));
        }
        Ok(())
    };
    let shape = vec![experts * outputs, inputs];
    let t = match t {
        HostTensor::F32 { shape: s, data } => {
            check(&s, data.len())?;
            HostTensor::F32 {
                shape,
                data: transposed(&data, experts, inputs, outputs),
            }
        }
        HostTensor::Bf16 { shape: s, data } => {
            check(&s, data.len())?;
            HostTensor::Bf16 {
                shape,
                data: transposed(&data, experts, inputs, outputs),
            }
        }
        HostTensor::F16 { shape: s, data } => {
            check(&s, data.len())?;
            HostTensor::F16 {
                shape,
                data: transposed(&data, experts, inputs, outputs),
            }
        }
        HostTensor::Linear(m) => {
            expect_matrix(name, &*m, experts * outputs, inputs)?;
            HostTensor::Linear(m)
        }
    };
    host_matrix(name, t)
}

/// Rows `rows` of `m` as a matrix in the form and variant of `m`.
fn take_rows(
    name: &str,
    m: &Arc<dyn Linear>,
    rows: impl Iterator<Item = usize>,
) -> Result<Arc<dyn Linear>> {
    if m.wrapper_bytes() > 0 {
        return Err(ModelError::Unsupported(format!(
            "tensor {name}: fused experts with row scales or a row order of their own"
        )));
    }
    let id = m.form();
    let form = crate::forms::by_name(id.form)?;
    let rows: Vec<usize> = rows.collect();
    let part = m
        .source()?
        .gather_rows(&rows)
        .map_err(|e| ModelError::tensor(name, e.to_string()))?;
    crate::forms::encode_checked(form, &part, &id.variant)
        .map_err(|e| ModelError::tensor(name, e.to_string()))
}

/// A fused matrix split by rows into matrices of `rows[i]` rows each, every part in the form and
/// variant of the whole.
fn split_rows(name: &str, m: Arc<dyn Linear>, rows: &[usize]) -> Result<Vec<Arc<dyn Linear>>> {
    if rows.iter().sum::<usize>() != m.rows() {
        return Err(ModelError::tensor(
            name,
            format!(
                "{} rows, the config implies {} ({})",
                m.rows(),
                rows.iter().sum::<usize>(),
                rows.iter()
                    .map(|r| r.to_string())
                    .collect::<Vec<_>>()
                    .join(" + ")
            ),
        ));
    }
    if m.wrapper_bytes() > 0 {
        return Err(ModelError::Unsupported(format!(
            "tensor {name}: a fused matrix with row scales or a row order of its own"
        )));
    }
    let id = m.form();
    let form = crate::forms::by_name(id.form)?;
    let parts = m
        .source()?
        .split_rows(rows)
        .map_err(|e| ModelError::tensor(name, e.to_string()))?;
    parts
        .iter()
        .map(|p| {
            crate::forms::encode_checked(form, p, &id.variant)
                .map_err(|e| ModelError::tensor(name, e.to_string()))
        })
        .collect()
}

impl ModelWeights {
    /// Checks the config and that every matrix and vector has the shape it implies; errors name
    /// the tensor by its HF name.
    pub fn validate(&self) -> Result<()> {
        let c = &self.config;
        c.validate()?;
        let (hidden, q_dim, kv_dim) = (c.hidden_size, c.q_dim(), c.kv_dim());
        expect_matrix(
            "model.embed_tokens.weight",
            &*self.embed,
            c.vocab_size,
            hidden,
        )?;
        if self.layers.len() != c.num_layers {
            return Err(ModelError::Config(format!(
                "num_layers is {} but the weights have {} layers",
                c.num_layers,
                self.layers.len()
            )));
        }
        let family = c.arch.family();
        for (i, l) in self.layers.iter().enumerate() {
            use crate::arch::Role;
            // The checkpoint's name of a tensor; a part of a fused one by the whole's name.
            let name = |role: Role, param: &str| {
                let fused = match role {
                    Role::Q | Role::K | Role::V => Some(Role::Qkv),
                    Role::Gate | Role::Up => Some(Role::GateUp),
                    _ => None,
                };
                family
                    .hf_name(role, i, param)
                    .or_else(|| {
                        let whole = family.hf_name(fused?, i, param)?;
                        Some(format!("{whole} ({role:?} rows)"))
                    })
                    .unwrap_or_else(|| format!("layer {i} {role:?} {param}"))
            };
            expect_vector(&name(Role::AttnNorm, "weight"), &l.attn_norm, hidden)?;
            expect_matrix(&name(Role::Q, "weight"), &*l.q, q_dim, hidden)?;
            expect_matrix(&name(Role::K, "weight"), &*l.k, kv_dim, hidden)?;
            expect_matrix(&name(Role::V, "weight"), &*l.v, kv_dim, hidden)?;
            expect_matrix(&name(Role::O, "weight"), &*l.o, hidden, q_dim)?;
            if let Some(b) = &l.norms.o_bias {
                expect_vector(&name(Role::O, "bias"), b, hidden)?;
            }
            if let Some(s) = &l.norms.sinks {
                expect_vector(&name(Role::Sinks, ""), s, c.num_heads)?;
            }
            for (role, bias, len) in [
                (Role::Q, &l.q_bias, q_dim),
                (Role::K, &l.k_bias, kv_dim),
                (Role::V, &l.v_bias, kv_dim),
            ] {
                if let Some(bias) = bias {
                    expect_vector(&name(role, "bias"), bias, len)?;
                }
            }
            expect_vector(&name(Role::MlpNorm, "weight"), &l.mlp_norm, hidden)?;
            for (role, norm, len) in [
                (Role::QNorm, &l.norms.q, c.head_dim),
                (Role::KNorm, &l.norms.k, c.head_dim),
                (Role::PostAttnNorm, &l.norms.post_attn, hidden),
                (Role::PostMlpNorm, &l.norms.post_mlp, hidden),
            ] {
                if let Some(norm) = norm {
                    expect_vector(&name(role, "weight"), norm, len)?;
                }
            }
            match (&l.mlp, c.block.moe_at(i)) {
                (Mlp::Gated(g), None) => {
                    let inter = c.intermediate_size;
                    expect_matrix(&name(Role::Gate, "weight"), &*g.gate, inter, hidden)?;
                    expect_matrix(&name(Role::Up, "weight"), &*g.up, inter, hidden)?;
                    expect_matrix(&name(Role::Down, "weight"), &*g.down, hidden, inter)?;
                }
                (Mlp::Experts(e), Some(moe)) => {
                    let router = name(Role::Router, "weight");
                    expect_matrix(&router, &*e.router, moe.experts, hidden)?;
                    if e.experts.len() != moe.experts {
                        return Err(ModelError::tensor(
                            &router,
                            format!(
                                "{} experts, the config says {}",
                                e.experts.len(),
                                moe.experts
                            ),
                        ));
                    }
                    let inter = moe.intermediate_size;
                    for (x, g) in e.experts.iter().enumerate() {
                        let n = |role| {
                            family
                                .hf_expert_name(role, i, x)
                                .unwrap_or_else(|| format!("layer {i} expert {x} {role:?}"))
                        };
                        expect_matrix(&n(Role::ExpertGate), &*g.gate, inter, hidden)?;
                        expect_matrix(&n(Role::ExpertUp), &*g.up, inter, hidden)?;
                        expect_matrix(&n(Role::ExpertDown), &*g.down, hidden, inter)?;
                    }
                    if let Some(b) = &e.router_bias {
                        expect_vector(&name(Role::Router, "bias"), b, moe.experts)?;
                    }
                    if !e.biases.is_empty() && e.biases.len() != moe.experts {
                        return Err(ModelError::tensor(
                            &router,
                            format!(
                                "{} experts' biases for {} experts",
                                e.biases.len(),
                                moe.experts
                            ),
                        ));
                    }
                    for (x, b) in e.biases.iter().enumerate() {
                        let n = |role| {
                            family
                                .hf_expert_tensor(role, i, x, "bias")
                                .unwrap_or_else(|| format!("layer {i} expert {x} {role:?} bias"))
                        };
                        expect_vector(&n(Role::ExpertGate), &b.gate, inter)?;
                        expect_vector(&n(Role::ExpertUp), &b.up, inter)?;
                        expect_vector(&n(Role::ExpertDown), &b.down, hidden)?;
                    }
                }
                _ => {
                    return Err(ModelError::Config(format!(
                        "layer {i}: its MLP is not what the config says (dense or experts)"
                    )))
                }
            }
        }
        expect_vector("model.norm.weight", &self.final_norm, hidden)?;
        expect_matrix("lm_head.weight", &*self.lm_head, c.vocab_size, hidden)
    }

    /// Bytes of all matrices and vectors (a tied LM head counted once).
    pub fn stored_bytes(&self) -> usize {
        let f32s = |v: &[f32]| std::mem::size_of_val(v);
        let layers: usize = self
            .layers
            .iter()
            .map(|l| {
                l.matrices()
                    .into_iter()
                    .map(|m| m.stored_bytes())
                    .sum::<usize>()
                    + f32s(&l.attn_norm)
                    + f32s(&l.mlp_norm)
                    + l.norms
                        .vectors()
                        .iter()
                        .map(|n| n.as_deref().map_or(0, f32s))
                        .sum::<usize>()
                    + [&l.q_bias, &l.k_bias, &l.v_bias]
                        .iter()
                        .map(|b| b.as_deref().map_or(0, f32s))
                        .sum::<usize>()
                    + match &l.mlp {
                        Mlp::Experts(e) => {
                            e.router_bias.as_deref().map_or(0, f32s)
                                + e.biases
                                    .iter()
                                    .map(|b| f32s(&b.gate) + f32s(&b.up) + f32s(&b.down))
                                    .sum::<usize>()
                        }
                        Mlp::Gated(_) => 0,
                    }
            })
            .sum();
        let lm_head = match Arc::ptr_eq(&self.embed, &self.lm_head) {
            true => 0,
            false => self.lm_head.stored_bytes(),
        };
        self.embed.stored_bytes() + layers + f32s(&self.final_norm) + lm_head
    }
}

fn expect_matrix(name: &str, m: &dyn Linear, rows: usize, cols: usize) -> Result<()> {
    if (m.rows(), m.cols()) != (rows, cols) {
        return Err(ModelError::tensor(
            name,
            format!(
                "shape [{}, {}], the config implies [{rows}, {cols}]",
                m.rows(),
                m.cols()
            ),
        ));
    }
    Ok(())
}

fn expect_vector(name: &str, v: &[f32], len: usize) -> Result<()> {
    if v.len() != len {
        return Err(ModelError::tensor(
            name,
            format!("length {}, the config implies {len}", v.len()),
        ));
    }
    Ok(())
}

/// A loader's 2-D tensor as a [`Linear`] in its stored precision.
pub fn host_matrix(name: &str, t: HostTensor) -> Result<Arc<dyn Linear>> {
    let dims = |shape: &[usize]| -> Result<(usize, usize)> {
        match *shape {
            [rows, cols] => Ok((rows, cols)),
            _ => Err(ModelError::tensor(
                name,
                format!("expected a matrix, got shape {shape:?}"),
            )),
        }
    };
    Ok(match t {
        HostTensor::F32 { shape, data } => {
            let (r, c) = dims(&shape)?;
            Arc::new(DenseF32::new(name, r, c, data)?)
        }
        HostTensor::Bf16 { shape, data } => {
            let (r, c) = dims(&shape)?;
            Arc::new(DenseBf16::new(name, r, c, data)?)
        }
        HostTensor::F16 { shape, data } => {
            let (r, c) = dims(&shape)?;
            Arc::new(DenseF16::new(name, r, c, data)?)
        }
        HostTensor::Linear(m) => m,
    })
}

/// A loader's 1-D tensor (norm weight, bias) widened to f32.
fn host_vector(name: &str, t: HostTensor) -> Result<Vec<f32>> {
    fn checked<T>(name: &str, shape: &[usize], data: Vec<T>) -> Result<Vec<T>> {
        match *shape {
            [len] if len == data.len() => Ok(data),
            [len] => Err(ModelError::tensor(
                name,
                format!("shape [{len}] but {} elements", data.len()),
            )),
            _ => Err(ModelError::tensor(
                name,
                format!("expected a vector, got shape {shape:?}"),
            )),
        }
    }
    Ok(match t {
        HostTensor::F32 { shape, data } => checked(name, &shape, data)?,
        HostTensor::Bf16 { shape, data } => checked(name, &shape, data)?
            .into_iter()
            .map(Bf16::to_f32)
            .collect(),
        HostTensor::F16 { shape, data } => checked(name, &shape, data)?
            .into_iter()
            .map(F16::to_f32)
            .collect(),
        HostTensor::Linear(m) => {
            return Err(ModelError::tensor(
                name,
                format!(
                    "expected a vector, got a [{}, {}] matrix",
                    m.rows(),
                    m.cols()
                ),
            ))
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// SplitMix64-driven values in [-1, 1).
    fn values(seed: u64, n: usize) -> Vec<f32> {
        let mut r = entrollm_codec::rng::SplitMix64::new(seed);
        (0..n)
            .map(|_| (r.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0)
            .collect()
    }

    #[test]
    fn f16_conversion_is_exact_for_every_bit_pattern() {
        for bits in 0..=u16::MAX {
            let ours = F16::to_f32(bits);
            let reference = half::f16::from_bits(bits).to_f32();
            if reference.is_nan() {
                assert!(ours.is_nan(), "{bits:#06x}");
                assert_eq!(
                    ours.to_bits() >> 31,
                    reference.to_bits() >> 31,
                    "sign {bits:#06x}"
                );
            } else {
                assert_eq!(ours.to_bits(), reference.to_bits(), "{bits:#06x}");
            }
        }
    }

    #[test]
    fn bf16_conversion_matches_half() {
        for bits in 0..=u16::MAX {
            let reference = half::bf16::from_bits(bits).to_f32();
            if !reference.is_nan() {
                assert_eq!(Bf16::to_f32(bits).to_bits(), reference.to_bits());
            }
        }
    }

    /// The three dense kinds holding (nearly) the same matrix, plus its f32 values as stored.
    fn dense_variants(rows: usize, cols: usize, seed: u64) -> Vec<(Arc<dyn Linear>, Vec<f32>)> {
        let w = values(seed, rows * cols);
        let bf16: Vec<u16> = w
            .iter()
            .map(|&v| half::bf16::from_f32(v).to_bits())
            .collect();
        let f16: Vec<u16> = w
            .iter()
            .map(|&v| half::f16::from_f32(v).to_bits())
            .collect();
        let bf16_f32 = bf16.iter().map(|&b| Bf16::to_f32(b)).collect();
        let f16_f32 = f16.iter().map(|&b| F16::to_f32(b)).collect();
        let fp8 = fp8_codes(&w);
        let fp8_f32 = fp8.iter().map(|&b| Fp8E4m3::to_f32(b)).collect();
        vec![
            (
                Arc::new(DenseFp8::new("w", rows, cols, fp8).unwrap()),
                fp8_f32,
            ),
            (
                Arc::new(DenseF32::new("w", rows, cols, w.clone()).unwrap()),
                w,
            ),
            (
                Arc::new(DenseBf16::new("w", rows, cols, bf16).unwrap()),
                bf16_f32,
            ),
            (
                Arc::new(DenseF16::new("w", rows, cols, f16).unwrap()),
                f16_f32,
            ),
        ]
    }

    #[test]
    fn matvec_matches_f64_reference() {
        // Shapes with row and column tails around the tile sizes, and one with many tasks.
        for (rows, cols) in [
            (1, 1),
            (3, 7),
            (4, 8),
            (9, 17),
            (33, 64),
            (130, 515),
            (700, 96),
        ] {
            let x = values(7, cols);
            for (m, w) in dense_variants(rows, cols, rows as u64 * 31 + cols as u64) {
                assert_eq!((m.rows(), m.cols()), (rows, cols));
                let mut y = vec![0f32; rows];
                m.matvec(&x, &mut y);
                for r in 0..rows {
                    let exact: f64 = (0..cols)
                        .map(|c| w[r * cols + c] as f64 * x[c] as f64)
                        .sum();
                    let bound: f64 = (0..cols)
                        .map(|c| (w[r * cols + c] as f64 * x[c] as f64).abs())
                        .sum::<f64>()
                        * 1e-6
                        + 1e-30;
                    assert!(
                        (y[r] as f64 - exact).abs() <= bound,
                        "[{rows}x{cols}] row {r}: {} vs {exact}",
                        y[r]
                    );
                }
            }
        }
    }

    #[test]
    fn matmul_equals_matvec_bit_for_bit() {
        for (rows, cols) in [(5, 9), (64, 40), (301, 33)] {
            for (m, _) in dense_variants(rows, cols, 99) {
                for n in [1, 2, 3, 32, 33, 70] {
                    let x = values(n as u64, n * cols);
                    let mut y = vec![0f32; n * rows];
                    m.matmul(&x, n, &mut y);
                    for b in 0..n {
                        let mut yb = vec![0f32; rows];
                        m.matvec(&x[b * cols..(b + 1) * cols], &mut yb);
                        assert_eq!(&y[b * rows..(b + 1) * rows], &yb[..], "n={n} b={b}");
                    }
                }
            }
        }
    }

    /// FP8 E4M3 codes of values scaled into the format's range (no NaN codes).
    fn fp8_codes(w: &[f32]) -> Vec<u8> {
        w.iter()
            .map(|&v| entrollm_codec::payload::f32_to_fp8_e4m3(v * 64.0))
            .collect()
    }

    #[test]
    fn fp8_table_matches_the_codec() {
        for b in 0..=255u8 {
            let (t, c) = (
                FP8_E4M3_TO_F32[b as usize],
                entrollm_codec::payload::fp8_e4m3_to_f32(b),
            );
            assert!(
                t.to_bits() == c.to_bits() || (t.is_nan() && c.is_nan()),
                "{b:#04x}: {t} vs {c}"
            );
        }
    }

    #[test]
    fn row_scaled_scales_each_output_row() {
        let w = values(3, 5 * 7);
        let dense: Arc<dyn Linear> = Arc::new(DenseF32::new("w", 5, 7, w.clone()).unwrap());
        let scales = vec![0.5, 2.0, -1.0, 0.0, 3.0];
        let m = RowScaled::new("w", dense.clone(), scales.clone()).unwrap();
        let x = values(4, 7);
        let (mut a, mut b) = (vec![0f32; 5], vec![0f32; 5]);
        dense.matvec(&x, &mut a);
        m.matvec(&x, &mut b);
        for r in 0..5 {
            assert_eq!(b[r], a[r] * scales[r]);
        }
        let mut row = vec![0f32; 7];
        m.row(1, &mut row);
        assert_eq!(row[3], w[7 + 3] * 2.0);
        assert!(RowScaled::new("w", dense, vec![1.0; 4]).is_err());
    }

    #[test]
    fn fp8_matrices_expose_their_codes_and_scales() {
        let codes: Vec<u8> = (0..12u8).map(|i| i * 7).collect();
        let fp8: Arc<dyn Linear> = Arc::new(DenseFp8::new("w", 3, 4, codes.clone()).unwrap());
        let scales = vec![0.5, 2.0, 4.0];
        let m = RowScaled::new("w", fp8.clone(), scales.clone()).unwrap();
        let (inner, s) = m.parts();
        assert_eq!(s, &scales[..]);
        let d = inner.as_any().downcast_ref::<DenseFp8>().unwrap();
        assert_eq!(d.data(), &codes[..]);
        // Re-formed, the scales wrap the new inner matrix.
        let f32m = m
            .reform(&|src| crate::forms::encode_checked(&crate::forms::dense::DENSE, src, "f32"))
            .unwrap();
        let rs = f32m.as_any().downcast_ref::<RowScaled>().unwrap();
        assert_eq!(rs.parts().1, &scales[..]);
        assert!(rs.parts().0.as_any().downcast_ref::<DenseF32>().is_some());
    }

    #[test]
    fn simd_and_portable_kernels_agree_bit_for_bit() {
        let isa = kernels::Isa::detect();
        println!("kernel: {isa:?}");
        for (rows, cols, n) in [
            (4, 8, 1),
            (7, 3, 2),
            (13, 77, 5),
            (40, 256, 3),
            (9, 1000, 1),
        ] {
            let w = values(rows as u64, rows * cols);
            let x = values(cols as u64, n * cols);
            let bf16: Vec<u16> = w
                .iter()
                .map(|&v| half::bf16::from_f32(v).to_bits())
                .collect();
            let f16: Vec<u16> = w
                .iter()
                .map(|&v| half::f16::from_f32(v).to_bits())
                .collect();
            let fp8 = fp8_codes(&w);
            let run = |isa| {
                let mut outs = vec![vec![0f32; rows * n]; 4];
                kernels::rows_times_vectors::<F32>(isa, &w, cols, &x, n, &mut outs[0]);
                kernels::rows_times_vectors::<Bf16>(isa, &bf16, cols, &x, n, &mut outs[1]);
                kernels::rows_times_vectors::<F16>(isa, &f16, cols, &x, n, &mut outs[2]);
                kernels::rows_times_vectors::<Fp8E4m3>(isa, &fp8, cols, &x, n, &mut outs[3]);
                outs
            };
            let to_bits = |o: Vec<Vec<f32>>| -> Vec<Vec<u32>> {
                o.into_iter()
                    .map(|v| v.into_iter().map(f32::to_bits).collect())
                    .collect()
            };
            assert_eq!(
                to_bits(run(isa)),
                to_bits(run(kernels::Isa::Portable)),
                "[{rows}x{cols}] n={n}"
            );
        }
    }

    #[test]
    fn row_and_stored_bytes() {
        let (rows, cols) = (6, 11);
        for ((m, w), elem_bytes) in dense_variants(rows, cols, 5).into_iter().zip([1, 4, 2, 2]) {
            let mut out = vec![0f32; cols];
            m.row(4, &mut out);
            assert_eq!(&out[..], &w[4 * cols..5 * cols]);
            assert_eq!(m.stored_bytes(), rows * cols * elem_bytes);
        }
    }

    #[test]
    fn dense_rejects_wrong_lengths() {
        let err = DenseBf16::new("blk.w", 3, 4, vec![0; 11]).err().unwrap();
        assert!(
            matches!(&err, ModelError::Tensor { name, msg } if name == "blk.w" && msg.contains("needs 12")),
            "{err}"
        );
        assert!(DenseF32::new("w", 0, 4, vec![]).is_err());
        assert!(DenseF16::new("w", usize::MAX, 2, vec![0; 4]).is_err());
    }

    #[test]
    fn host_tensors_to_matrices_and_vectors() {
        let m = host_matrix(
            "m",
            HostTensor::F16 {
                shape: vec![2, 3],
                data: vec![0x3c00; 6],
            },
        )
        .unwrap();
        let mut out = vec![0f32; 3];
        m.row(1, &mut out);
        assert_eq!(out, vec![1.0; 3]);
        let v = host_vector(
            "v",
            HostTensor::Bf16 {
                shape: vec![2],
                data: vec![0x3f80, 0xc000],
            },
        )
        .unwrap();
        assert_eq!(v, vec![1.0, -2.0]);

        let not_matrix = host_matrix(
            "norm",
            HostTensor::F32 {
                shape: vec![4],
                data: vec![0.0; 4],
            },
        );
        assert!(not_matrix
            .err()
            .unwrap()
            .to_string()
            .contains("expected a matrix"));
        let not_vector = host_vector("q", HostTensor::Linear(m));
        assert!(not_vector
            .err()
            .unwrap()
            .to_string()
            .contains("expected a vector"));
        let short = host_vector(
            "b",
            HostTensor::F32 {
                shape: vec![5],
                data: vec![0.0; 4],
            },
        );
        assert!(short
            .err()
            .unwrap()
            .to_string()
            .contains("shape [5] but 4 elements"));
    }
}
