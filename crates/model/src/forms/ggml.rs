//! `ggml`: a GGUF tensor's quantised blocks exactly as the file stores them — every ggml type
//! [`crate::gguf::dequantize`] handles (legacy Q4_0…Q8_0, the k-quants Q2_K…Q6_K, IQ4_NL,
//! IQ4_XS, the FP4 types MXFP4 and NVFP4) — served from the file's own bytes, so a quantised
//! model is resident at about its file size instead of four bytes a weight. The product
//! dequantises a row's blocks with ggml's own arithmetic (`qtype::dequant`, checked bit for bit
//! against gguf-py) into a buffer and multiplies it with the f32 activations: the logits are
//! those of the f32 model made of ggml's dequantised weights, to f32 rounding.

use super::{Candidate, DeviceKind, Form, Source, Values};
use crate::error::{ModelError, Result};
use crate::gguf::GgmlType;
use crate::weights::Linear;
use rayon::prelude::*;
use std::ops::Range;
use std::sync::Arc;

pub struct GgmlForm;
pub static GGML: GgmlForm = GgmlForm;

/// A range of bytes of a shared buffer (a GGUF file's map): cloning it copies nothing.
#[derive(Clone)]
pub struct BlockBytes {
    owner: Arc<dyn AsRef<[u8]> + Send + Sync>,
    range: Range<usize>,
}

impl BlockBytes {
    /// `range` of `owner`'s bytes (clamped to them, so a handle never reaches past its buffer).
    pub fn new(owner: Arc<dyn AsRef<[u8]> + Send + Sync>, range: Range<usize>) -> BlockBytes {
        let len = (*owner).as_ref().len();
        let range = range.start.min(len)..range.end.min(len).max(range.start.min(len));
        BlockBytes { owner, range }
    }

    /// Bytes held by this handle alone.
    pub fn from_vec(bytes: Vec<u8>) -> BlockBytes {
        let len = bytes.len();
        BlockBytes::new(Arc::new(bytes), 0..len)
    }

    pub fn bytes(&self) -> &[u8] {
        &(*self.owner).as_ref()[self.range.clone()]
    }

    /// Bytes `range` of these (relative to them), sharing the owner.
    pub fn sub(&self, range: Range<usize>) -> BlockBytes {
        let end = (self.range.start + range.end).min(self.range.end);
        BlockBytes::new(Arc::clone(&self.owner), self.range.start + range.start..end)
    }
}

impl std::fmt::Debug for BlockBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "BlockBytes({} bytes)", self.range.len())
    }
}

impl PartialEq for BlockBytes {
    fn eq(&self, other: &Self) -> bool {
        self.bytes() == other.bytes()
    }
}

/// Elements that `bytes` of whole `ty` blocks hold (`None`: not whole blocks).
pub(crate) fn elements(ty: GgmlType, bytes: usize) -> Option<usize> {
    let (bs, ts) = ty.block_layout();
    bytes.is_multiple_of(ts).then_some(bytes / ts * bs)
}

/// The row-major f32 values of a `ggml` source (dense widening, [`super::dense::to_f32`]).
pub(crate) fn to_f32(ty: GgmlType, bytes: &BlockBytes) -> Vec<f32> {
    let mut out = vec![0f32; elements(ty, bytes.bytes().len()).unwrap_or(0)];
    crate::gguf::dequantize("ggml", ty, bytes.bytes(), &mut out)
        .expect("a ggml source holds whole blocks of a dequantisable type");
    out
}

/// A type's blocks as the codes an entropy coder codes and the group scales that make them
/// weights: [`int_values`]' integer codes, or MXFP4's and NVFP4's E2M1 codes (payload
/// `Fp4E2m1`, one a byte) with f32 scales per 32 (`2^(e−127)`) or 16 (the unsigned E4M3 scale),
/// whose products with the codes' values are ggml's weights exactly; `None` for IQ4 (codes index
/// a non-uniform table).
pub fn coded_values(ty: GgmlType, bytes: &[u8]) -> Option<Values> {
    if let Some(v) = int_values(ty, bytes) {
        return Some(v);
    }
    let (bs, ts) = ty.block_layout();
    let (group, sub) = match ty {
        GgmlType::MXFP4 => (32, 1),
        GgmlType::NVFP4 => (16, 4),
        _ => return None,
    };
    if !bytes.len().is_multiple_of(ts) {
        return None;
    }
    let blocks = bytes.len() / ts;
    let (mut codes, mut scales) = (
        Vec::with_capacity(blocks * bs),
        Vec::with_capacity(blocks * sub),
    );
    for b in bytes.chunks_exact(ts) {
        match ty {
            GgmlType::MXFP4 => {
                scales.push(2.0 * e8m0_half(b[0]));
                codes.extend(b[1..17].iter().map(|q| q & 15));
                codes.extend(b[1..17].iter().map(|q| q >> 4));
            }
            _ => {
                for s in 0..4 {
                    scales.push(2.0 * ue4m3_half(b[s]));
                    let q = &b[4 + 8 * s..12 + 8 * s];
                    codes.extend(q.iter().map(|q| q & 15));
                    codes.extend(q.iter().map(|q| q >> 4));
                }
            }
        }
    }
    Some(Values::Int {
        payload: entrollm_codec::Payload::Fp4E2m1,
        codes,
        groups: super::GroupScales {
            group,
            scales,
            mins: None,
            offset: 0.0,
            signed: false,
        },
    })
}

/// Blocks of a type whose weights are a code times its group's scale, plus the group's min
/// (Q4_0 … Q8_0, Q2_K … Q6_K) as integer codes with f32 group scales and mins, each the f32
/// product ggml forms (`d · sc`, `dmin · m`), so that `scale · (code − offset) + min` is ggml's
/// dequantisation bit for bit; `None` for other types (IQ4, FP4: their codes index tables).
pub fn int_values(ty: GgmlType, bytes: &[u8]) -> Option<Values> {
    use entrollm_format::kquants::split;
    let l = ty.int_codes()?;
    let (group, offset, signed, mins) = (l.group, l.offset as f32, l.signed, l.mins);
    let sp = split(ty, bytes).ok()?;
    let half = |h: u16| half::f16::from_bits(h).to_f32();
    let per = ty.block_size() / group;
    let blocks = sp.codes.len() / ty.block_size();
    let (mut sc, mut mn) = (Vec::with_capacity(blocks * per), Vec::new());
    let f = &sp.fields;
    for b in 0..blocks {
        let d = half(f[0][b]);
        match ty {
            GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => sc.push(d),
            GgmlType::Q4_1 | GgmlType::Q5_1 => {
                sc.push(d);
                mn.push(half(f[1][b]));
            }
            GgmlType::Q2_K | GgmlType::Q4_K | GgmlType::Q5_K => {
                let dmin = half(f[1][b]);
                let r = b * per..(b + 1) * per;
                for (&s, &m) in f[2][r.clone()].iter().zip(&f[3][r]) {
                    sc.push(d * f32::from(s));
                    mn.push(-(dmin * f32::from(m)));
                }
            }
            GgmlType::Q3_K => {
                sc.extend((b * per..(b + 1) * per).map(|j| d * (f[1][j] as f32 - 32.0)))
            }
            GgmlType::Q6_K => {
                sc.extend((b * per..(b + 1) * per).map(|j| d * f32::from(f[1][j] as u8 as i8)))
            }
            _ => return None,
        }
    }
    Some(Values::Int {
        payload: entrollm_codec::Payload::Int(ty.code_bits() as u8),
        codes: sp.codes,
        groups: super::GroupScales {
            group,
            scales: sc,
            mins: mins.then_some(mn),
            offset,
            signed,
        },
    })
}

/// `blocks` random blocks of `ty` from `seed` (test and selftest matrices): random bytes, with
/// finite, small f16 scales where the type keeps them (MXFP4: an E8M0 scale near one; NVFP4's
/// E4M3 scales are finite whatever their bytes).
pub fn synth_blocks(ty: GgmlType, blocks: usize, seed: u64) -> Vec<u8> {
    // A SplitMix64 stream: bytes, and uniforms for the scales.
    let mut r = entrollm_codec::rng::SplitMix64::new(seed);
    let mut next = move || r.next_u64();
    let (_, ts) = ty.block_layout();
    let mut out: Vec<u8> = (0..blocks * ts).map(|_| next() as u8).collect();
    // Where each type keeps its f16 super-scales (ggml-common.h).
    let at: &[usize] = match ty {
        GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 | GgmlType::IQ4_NL => &[0],
        GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4_K | GgmlType::Q5_K => &[0, 2],
        GgmlType::Q6_K => &[208],
        GgmlType::Q2_K => &[80, 82],
        GgmlType::Q3_K => &[108],
        GgmlType::IQ4_XS => &[0],
        _ => &[],
    };
    for b in out.chunks_exact_mut(ts) {
        for &a in at {
            // Uniform in ±0.02: the scales of weights of about 0.01–0.1.
            let u = (next() >> 11) as f32 / (1u64 << 53) as f32;
            let v = half::f16::from_f32((2.0 * u - 1.0) * 0.02);
            b[a..a + 2].copy_from_slice(&v.to_bits().to_le_bytes());
        }
        if ty == GgmlType::MXFP4 {
            // 2^-18 … 2^7: random bytes would overflow to infinities or flush to zero.
            b[0] = 110 + (next() % 26) as u8;
        }
    }
    out
}

/// A matrix of ggml blocks, each row a whole number of blocks.
pub struct GgmlLinear {
    rows: usize,
    cols: usize,
    ty: GgmlType,
    bytes: BlockBytes,
    row_bytes: usize,
    /// ggml's dequantisation of a block (rows, embedding lookups).
    block: entrollm_format::qtype::BlockFn,
    kernels: Kernels,
    /// The `q8` variant: activations quantised to 8 bits per 32 (llama.cpp's precision, integer
    /// dot products) instead of multiplied in f32.
    q8: bool,
    /// The blocks repacked for the `q8` products on AVX-512 VNNI (Q4_0, Q4_1, Q8_0, Q4_K).
    #[cfg(target_arch = "x86_64")]
    tiles: Option<tiles::Tiles>,
}

impl GgmlLinear {
    /// The ggml type of its blocks.
    pub fn ty(&self) -> GgmlType {
        self.ty
    }

    /// Whether its products take the activations as 8-bit codes (`--activations q8`).
    pub fn q8(&self) -> bool {
        self.q8
    }

    /// Its blocks, row-major: each row `cols / block size` whole blocks.
    pub fn blocks(&self) -> &[u8] {
        self.bytes.bytes()
    }

    fn row_blocks(&self, r: usize) -> &[u8] {
        &self.bytes.bytes()[r * self.row_bytes..(r + 1) * self.row_bytes]
    }

    fn dequant_row(&self, r: usize, out: &mut [f32]) {
        let (bs, ts) = self.ty.block_layout();
        for (b, y) in self
            .row_blocks(r)
            .chunks_exact(ts)
            .zip(out.chunks_exact_mut(bs))
        {
            (self.block)(b, y);
        }
    }

    /// `x`'s sums over each sub-block the offsets multiply (empty where the type has none).
    fn xsum(&self, x: &[f32]) -> Vec<f32> {
        match self.kernels.mins {
            true => x
                .chunks(self.kernels.group)
                .map(|c| c.iter().sum())
                .collect(),
            false => Vec::new(),
        }
    }

    /// `x` quantised as llama.cpp quantises it for this type, and the sums the offsets multiply
    /// (llama.cpp's block sums: so that a q8 product is the product with those activations).
    fn quantise(&self, x: &[f32]) -> (Q8Acts, Vec<f32>) {
        let a = self.kernels.act.quantise(x);
        let sums = match self.kernels.mins {
            true => a.group_sums(self.kernels.group),
            false => Vec::new(),
        };
        (a, sums)
    }

    /// Rows a task takes: about 256K weights (fewer where there are few rows: at least two
    /// tasks per thread), at least one row. Smaller tasks cost more in scheduling than they
    /// balance: a 7B's step is some 250,000 tasks at 32K weights; with the threads kept awake
    /// through a forward, SmolLM2's products ran faster at two tasks a thread than at sixteen.
    fn rows_per_task(&self) -> usize {
        let by_size = (1 << 18) / self.cols;
        let by_threads = self.rows.div_ceil(2 * rayon::current_num_threads());
        let per = by_size.min(by_threads).max(1);
        #[cfg(target_arch = "x86_64")]
        if self.tiles.is_some() {
            return per.next_multiple_of(tiles::TILE);
        }
        per
    }

    /// The `q8` products of rows `r0..r0 + out.len() / x.len()` (`r0` where a task starts).
    fn rows_q8(&self, r0: usize, x: &[Q8In], xsum: &[&[f32]], out: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        if let Some(t) = &self.tiles {
            // SAFETY: tiles are made only where `Isa::detect` found AVX-512 VNNI.
            return unsafe { t.rows_q8(r0, x, xsum, out) };
        }
        let (rb, r1) = (self.row_bytes, r0 + out.len() / x.len());
        (self.kernels.rows_q8)(&self.bytes.bytes()[r0 * rb..r1 * rb], rb, x, xsum, out)
    }
}

impl Linear for GgmlLinear {
    fn rows(&self) -> usize {
        self.rows
    }
    fn cols(&self) -> usize {
        self.cols
    }
    fn matvec(&self, x: &[f32], y: &mut [f32]) {
        assert_eq!((x.len(), y.len()), (self.cols, self.rows), "matvec shapes");
        let (acts, xsum) = match self.q8 {
            true => self.quantise(x),
            false => (Q8Acts::default(), self.xsum(x)),
        };
        let per = self.rows_per_task();
        let rb = self.row_bytes;
        crate::crew::chunks_mut(y, per, |chunk, ys| match self.q8 {
            true => self.rows_q8(chunk * per, &[acts.input()], &[&xsum], ys),
            false => {
                let rows = &self.bytes.bytes()[chunk * per * rb..(chunk * per + ys.len()) * rb];
                (self.kernels.rows)(rows, rb, &[x], &[&xsum], ys)
            }
        });
    }
    /// Each block is decoded once for up to four vectors (prefill); every vector's sums are
    /// those `matvec` makes, bit for bit.
    fn matmul(&self, x: &[f32], n: usize, y: &mut [f32]) {
        let (rows, cols, rb) = (self.rows, self.cols, self.row_bytes);
        assert_eq!((x.len(), y.len()), (n * cols, n * rows), "matmul shapes");
        if n == 1 {
            // A decode step: the product straight into `y`, without the batch's buffers.
            return self.matvec(x, y);
        }
        let xs: Vec<&[f32]> = x.chunks_exact(cols).collect();
        let (quantised, sums): (Vec<Q8Acts>, Vec<Vec<f32>>) = match self.q8 {
            true => xs.iter().map(|x| self.quantise(x)).unzip(),
            false => (Vec::new(), xs.iter().map(|x| self.xsum(x)).collect()),
        };
        let per = self.rows_per_task();
        let parts: Vec<Vec<f32>> = (0..rows.div_ceil(per))
            .into_par_iter()
            .map(|chunk| {
                let (r0, r1) = (chunk * per, ((chunk + 1) * per).min(rows));
                let block = &self.bytes.bytes()[r0 * rb..r1 * rb];
                let mut out = vec![0f32; (r1 - r0) * n];
                let mut tmp = vec![0f32; (r1 - r0) * VECS];
                for v0 in (0..n).step_by(VECS) {
                    let v1 = (v0 + VECS).min(n);
                    let sum: Vec<&[f32]> = sums[v0..v1].iter().map(|s| s.as_slice()).collect();
                    let k = v1 - v0;
                    let out_k = &mut tmp[..(r1 - r0) * k];
                    if self.q8 {
                        let x: Vec<Q8In> = quantised[v0..v1].iter().map(Q8Acts::input).collect();
                        self.rows_q8(r0, &x, &sum, out_k);
                    } else {
                        (self.kernels.rows)(block, rb, &xs[v0..v1], &sum, out_k);
                    }
                    for r in 0..r1 - r0 {
                        out[r * n + v0..r * n + v1].copy_from_slice(&tmp[r * k..(r + 1) * k]);
                    }
                }
                out
            })
            .collect();
        for (chunk, out) in parts.iter().enumerate() {
            let r0 = chunk * per;
            for (i, dots) in out.chunks_exact(n).enumerate() {
                for (b, &v) in dots.iter().enumerate() {
                    y[b * rows + r0 + i] = v;
                }
            }
        }
    }
    fn row(&self, r: usize, out: &mut [f32]) {
        self.dequant_row(r, out);
    }
    fn stored_bytes(&self) -> usize {
        self.bytes.bytes().len()
    }
    fn form(&self) -> super::FormId {
        super::FormId {
            form: "ggml",
            variant: if self.q8 { Q8.into() } else { String::new() },
        }
    }
    fn source(&self) -> Result<Source> {
        Source::new(
            self.rows,
            self.cols,
            Values::Ggml {
                ty: self.ty,
                bytes: self.bytes.clone(),
            },
        )
    }
    fn values_kind(&self) -> &'static str {
        "ggml"
    }
    fn layout_tag(&self) -> Option<&'static str> {
        Some(self.ty.name())
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

impl Form for GgmlForm {
    fn name(&self) -> &'static str {
        "ggml"
    }
    fn describe(&self) -> &'static str {
        "GGUF quantised blocks as the file stores them (legacy types, k-quants, IQ4_NL/XS, MXFP4, NVFP4)"
    }
    fn runs_on(&self, _device: DeviceKind) -> bool {
        // GPU: `ggml_mv` / `ggml_dequant` (entrollm_cuda::forms::ggml), every type of the
        // quant-type table's `gpu` rows.
        true
    }
    fn accepts(&self, src: &Source) -> bool {
        matches!(src.values, Values::Ggml { .. })
    }
    fn held_variant_chosen(&self) -> bool {
        true
    }
    fn variants(&self, src: &Source) -> Result<Vec<Candidate>> {
        let Values::Ggml { bytes, .. } = &src.values else {
            return Ok(Vec::new());
        };
        Ok(vec![Candidate {
            variant: String::new(),
            predicted_bytes: bytes.bytes().len() as f64,
        }])
    }
    fn predict(&self, src: &Source, variant: &str) -> Result<f64> {
        check_variant_name(variant)?;
        self.variants(src)?
            .first()
            .map(|c| c.predicted_bytes)
            .ok_or_else(|| ModelError::Unsupported("ggml holds ggml blocks only".into()))
    }
    fn encode(&self, src: &Source, variant: &str) -> Result<Arc<dyn Linear>> {
        check_variant_name(variant)?;
        self.encode_on(src, Isa::detect(), variant == Q8)
    }
    fn default_cost_us(&self, device: DeviceKind, weights: usize, bytes: f64) -> f64 {
        super::stream_cost_us(device, bytes)
            + match device {
                DeviceKind::Cpu => weights as f64 * 2.0e-3,
                // ggml_mv is bound by its decode arithmetic, not the stream (bench/RESULTS.md).
                DeviceKind::Cuda => weights as f64 * 0.6e-6,
            }
    }
}

/// The variant whose activations are quantised to 8 bits (llama.cpp's precision). Not among
/// [`Form::variants`]: it changes the products' values, so a tuner timing forms that hold a
/// matrix exactly never picks it; a user asks for it (`--activations q8`).
pub const Q8: &str = "q8";

fn check_variant_name(variant: &str) -> Result<()> {
    match variant {
        "" | Q8 => Ok(()),
        other => Err(ModelError::Unsupported(format!(
            "form ggml has variants \"\" (f32 activations) and \"{Q8}\", not {other:?}"
        ))),
    }
}

impl GgmlForm {
    /// [`Form::encode`] with the kernels of `isa`, f32 or 8-bit (`q8`) activations.
    fn encode_on(&self, src: &Source, isa: Isa, q8: bool) -> Result<Arc<dyn Linear>> {
        let Values::Ggml { ty, bytes } = &src.values else {
            return Err(ModelError::Unsupported(format!(
                "ggml holds ggml blocks only, not {}",
                src.values.kind()
            )));
        };
        let (block, kernels) = ty.row().to_f32.zip(kernels_for(*ty, isa)).ok_or_else(|| {
            ModelError::Unsupported(format!(
                "ggml type {ty} has no product kernel (form ggml: {})",
                entrollm_format::qtype::CPU.map(|t| t.name()).join(", ")
            ))
        })?;
        let (bs, ts) = ty.block_layout();
        if !src.cols.is_multiple_of(bs) {
            return Err(ModelError::Unsupported(format!(
                "rows of {} elements are not whole {ty} blocks of {bs}",
                src.cols
            )));
        }
        #[cfg(target_arch = "x86_64")]
        let tiles = match q8 && isa == Isa::Avx512Vnni {
            true => tiles::Tiles::new(*ty, bytes.bytes(), src.rows, src.cols / bs),
            false => None,
        };
        #[cfg(target_arch = "x86_64")]
        if tiles.is_some() {
            release_pages(bytes.bytes());
        }
        Ok(Arc::new(GgmlLinear {
            #[cfg(target_arch = "x86_64")]
            tiles,
            rows: src.rows,
            cols: src.cols,
            ty: *ty,
            bytes: bytes.clone(),
            row_bytes: src.cols / bs * ts,
            block,
            kernels,
            q8,
        }))
    }
}

/// The fused product of one ggml type: a block's codes decoded to small integers `q` with, per
/// sub-block of `G` elements, a factor `a` and an offset `m` such that each weight is `a·q + m`
/// (ggml's dequantisation, regrouped); a row's dot product is then `Σ a·Σq·x + Σ m·Σx`, with
/// each sub-block's `Σx` computed once per product for all rows.
trait Kind {
    /// The type; elements and bytes of a block (its row of the table), elements of a sub-block.
    const TY: GgmlType;
    const BS: usize = Self::TY.block_layout().0;
    const TS: usize = Self::TY.block_layout().1;
    const G: usize;
    /// Whether any weight has an offset (`m` is zero otherwise and is not read).
    const MINS: bool;
    fn decode(b: &[u8], q: &mut [i8], a: &mut [f32], m: &mut [f32]);
}

use entrollm_format::qtype::dequant::{
    e8m0_half, f16_at, q3k_scales, scale_min_k4, ue4m3_half, FP4_VALUES, IQ4NL_VALUES,
};

struct Q4_0;
impl Kind for Q4_0 {
    const TY: GgmlType = GgmlType::Q4_0;
    const G: usize = 32;
    const MINS: bool = false;
    #[inline(always)]
    fn decode(b: &[u8], q: &mut [i8], a: &mut [f32], _m: &mut [f32]) {
        a[0] = f16_at(b, 0);
        let qs = &b[2..18];
        for j in 0..16 {
            q[j] = (qs[j] & 0x0F) as i8 - 8;
            q[j + 16] = (qs[j] >> 4) as i8 - 8;
        }
    }
}

struct Q4_1;
impl Kind for Q4_1 {
    const TY: GgmlType = GgmlType::Q4_1;
    const G: usize = 32;
    const MINS: bool = true;
    #[inline(always)]
    fn decode(b: &[u8], q: &mut [i8], a: &mut [f32], m: &mut [f32]) {
        (a[0], m[0]) = (f16_at(b, 0), f16_at(b, 2));
        let qs = &b[4..20];
        for j in 0..16 {
            q[j] = (qs[j] & 0x0F) as i8;
            q[j + 16] = (qs[j] >> 4) as i8;
        }
    }
}

/// Q5_0/Q5_1's codes: low nibbles in `qs`, element j's fifth bit is bit j of `qh`.
#[inline(always)]
fn q5_codes(qh: &[u8], qs: &[u8], offset: i8, q: &mut [i8]) {
    let qh = u32::from_le_bytes([qh[0], qh[1], qh[2], qh[3]]);
    for j in 0..16 {
        let h0 = (((qh >> j) << 4) & 0x10) as u8;
        let h1 = ((qh >> (j + 12)) & 0x10) as u8;
        q[j] = ((qs[j] & 0x0F) | h0) as i8 - offset;
        q[j + 16] = ((qs[j] >> 4) | h1) as i8 - offset;
    }
}

struct Q5_0;
impl Kind for Q5_0 {
    const TY: GgmlType = GgmlType::Q5_0;
    const G: usize = 32;
    const MINS: bool = false;
    #[inline(always)]
    fn decode(b: &[u8], q: &mut [i8], a: &mut [f32], _m: &mut [f32]) {
        a[0] = f16_at(b, 0);
        q5_codes(&b[2..6], &b[6..22], 16, q);
    }
}

struct Q5_1;
impl Kind for Q5_1 {
    const TY: GgmlType = GgmlType::Q5_1;
    const G: usize = 32;
    const MINS: bool = true;
    #[inline(always)]
    fn decode(b: &[u8], q: &mut [i8], a: &mut [f32], m: &mut [f32]) {
        (a[0], m[0]) = (f16_at(b, 0), f16_at(b, 2));
        q5_codes(&b[4..8], &b[8..24], 0, q);
    }
}

struct Q8_0;
impl Kind for Q8_0 {
    const TY: GgmlType = GgmlType::Q8_0;
    const G: usize = 32;
    const MINS: bool = false;
    #[inline(always)]
    fn decode(b: &[u8], q: &mut [i8], a: &mut [f32], _m: &mut [f32]) {
        a[0] = f16_at(b, 0);
        for (q, &c) in q[..32].iter_mut().zip(&b[2..34]) {
            *q = c as i8;
        }
    }
}

/// 16 bytes of 4-bit indices into the IQ4 values: low nibbles the first 16, high the next 16.
#[inline(always)]
fn iq4_codes(qs: &[u8], q: &mut [i8]) {
    for j in 0..16 {
        q[j] = IQ4NL_VALUES[(qs[j] & 0x0F) as usize];
        q[j + 16] = IQ4NL_VALUES[(qs[j] >> 4) as usize];
    }
}

struct Iq4Nl;
impl Kind for Iq4Nl {
    const TY: GgmlType = GgmlType::IQ4_NL;
    const G: usize = 32;
    const MINS: bool = false;
    #[inline(always)]
    fn decode(b: &[u8], q: &mut [i8], a: &mut [f32], _m: &mut [f32]) {
        a[0] = f16_at(b, 0);
        iq4_codes(&b[2..18], q);
    }
}

struct Iq4Xs;
impl Kind for Iq4Xs {
    const TY: GgmlType = GgmlType::IQ4_XS;
    const G: usize = 32;
    const MINS: bool = false;
    #[inline(always)]
    fn decode(b: &[u8], q: &mut [i8], a: &mut [f32], _m: &mut [f32]) {
        let d = f16_at(b, 0);
        let scales_h = u16::from_le_bytes([b[2], b[3]]) as i32;
        let (scales_l, qs) = (&b[4..8], &b[8..136]);
        for ib in 0..8 {
            let ls = ((scales_l[ib / 2] >> (4 * (ib % 2))) & 0xf) as i32
                | (((scales_h >> (2 * ib)) & 3) << 4);
            a[ib] = d * (ls - 32) as f32;
            iq4_codes(&qs[16 * ib..16 * ib + 16], &mut q[32 * ib..32 * ib + 32]);
        }
    }
}

/// MXFP4: the codes are the doubled E2M1 values themselves, the factor the halved E8M0 scale.
struct Mxfp4;
impl Kind for Mxfp4 {
    const TY: GgmlType = GgmlType::MXFP4;
    const G: usize = 32;
    const MINS: bool = false;
    #[inline(always)]
    fn decode(b: &[u8], q: &mut [i8], a: &mut [f32], _m: &mut [f32]) {
        a[0] = e8m0_half(b[0]);
        let qs = &b[1..17];
        for j in 0..16 {
            q[j] = FP4_VALUES[(qs[j] & 0x0F) as usize];
            q[j + 16] = FP4_VALUES[(qs[j] >> 4) as usize];
        }
    }
}

/// NVFP4: four sub-blocks of 16, each its own halved E4M3 factor and 8 bytes of codes (low
/// nibbles its first 8, high nibbles its last 8).
struct Nvfp4;
impl Kind for Nvfp4 {
    const TY: GgmlType = GgmlType::NVFP4;
    const G: usize = 16;
    const MINS: bool = false;
    #[inline(always)]
    fn decode(b: &[u8], q: &mut [i8], a: &mut [f32], _m: &mut [f32]) {
        let qs = &b[4..36];
        for s in 0..4 {
            a[s] = ue4m3_half(b[s]);
            for j in 0..8 {
                let v = qs[8 * s + j];
                q[16 * s + j] = FP4_VALUES[(v & 0x0F) as usize];
                q[16 * s + 8 + j] = FP4_VALUES[(v >> 4) as usize];
            }
        }
    }
}

/// Q4_K/Q5_K's eight (factor, offset) pairs: `d·sc` and `−dmin·m`.
#[inline(always)]
fn k4_scales(b: &[u8], a: &mut [f32], m: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    for j in 0..8 {
        let (sc, mn) = scale_min_k4(j, &b[4..16]);
        a[j] = d * sc as f32;
        m[j] = -(dmin * mn as f32);
    }
}

struct Q4K;
impl Kind for Q4K {
    const TY: GgmlType = GgmlType::Q4_K;
    const G: usize = 32;
    const MINS: bool = true;
    #[inline(always)]
    fn decode(b: &[u8], q: &mut [i8], a: &mut [f32], m: &mut [f32]) {
        k4_scales(b, a, m);
        let qs = &b[16..144];
        for c in 0..4 {
            for l in 0..32 {
                let v = qs[32 * c + l];
                q[64 * c + l] = (v & 0x0F) as i8;
                q[64 * c + 32 + l] = (v >> 4) as i8;
            }
        }
    }
}

struct Q5K;
impl Kind for Q5K {
    const TY: GgmlType = GgmlType::Q5_K;
    const G: usize = 32;
    const MINS: bool = true;
    #[inline(always)]
    fn decode(b: &[u8], q: &mut [i8], a: &mut [f32], m: &mut [f32]) {
        k4_scales(b, a, m);
        let (qh, qs) = (&b[16..48], &b[48..176]);
        for c in 0..4 {
            for l in 0..32 {
                let v = qs[32 * c + l];
                let h = qh[l] >> (2 * c);
                q[64 * c + l] = ((v & 0x0F) | ((h & 1) << 4)) as i8;
                q[64 * c + 32 + l] = ((v >> 4) | ((h & 2) << 3)) as i8;
            }
        }
    }
}

struct Q6K;
impl Kind for Q6K {
    const TY: GgmlType = GgmlType::Q6_K;
    const G: usize = 16;
    const MINS: bool = false;
    #[inline(always)]
    fn decode(b: &[u8], q: &mut [i8], a: &mut [f32], _m: &mut [f32]) {
        let d = f16_at(b, 208);
        for s in 0..16 {
            a[s] = d * (b[192 + s] as i8) as f32;
        }
        for n in 0..2 {
            let ql = &b[64 * n..64 * n + 64];
            let qh = &b[128 + 32 * n..128 + 32 * n + 32];
            let q = &mut q[128 * n..128 * n + 128];
            for l in 0..32 {
                let h = qh[l];
                q[l] = ((ql[l] & 0x0F) | ((h & 3) << 4)) as i8 - 32;
                q[l + 32] = ((ql[l + 32] & 0x0F) | (((h >> 2) & 3) << 4)) as i8 - 32;
                q[l + 64] = ((ql[l] >> 4) | (((h >> 4) & 3) << 4)) as i8 - 32;
                q[l + 96] = ((ql[l + 32] >> 4) | ((h >> 6) << 4)) as i8 - 32;
            }
        }
    }
}

struct Q2K;
impl Kind for Q2K {
    const TY: GgmlType = GgmlType::Q2_K;
    const G: usize = 16;
    const MINS: bool = true;
    #[inline(always)]
    fn decode(b: &[u8], q: &mut [i8], a: &mut [f32], m: &mut [f32]) {
        let (d, dmin) = (f16_at(b, 80), f16_at(b, 82));
        for (s, &sc) in b[..16].iter().enumerate() {
            a[s] = d * (sc & 0xf) as f32;
            m[s] = -(dmin * (sc >> 4) as f32);
        }
        let qs = &b[16..80];
        for half in 0..2 {
            for j in 0..4 {
                for l in 0..32 {
                    q[128 * half + 32 * j + l] = ((qs[32 * half + l] >> (2 * j)) & 3) as i8;
                }
            }
        }
    }
}

struct Q3K;
impl Kind for Q3K {
    const TY: GgmlType = GgmlType::Q3_K;
    const G: usize = 16;
    const MINS: bool = false;
    #[inline(always)]
    fn decode(b: &[u8], q: &mut [i8], a: &mut [f32], _m: &mut [f32]) {
        let (hm, qs) = (&b[..32], &b[32..96]);
        let d_all = f16_at(b, 108);
        for (a, sc) in a[..16].iter_mut().zip(q3k_scales(&b[96..108])) {
            *a = d_all * (sc as i32 - 32) as f32;
        }
        for half in 0..2 {
            for j in 0..4 {
                let bit = 1u8 << (4 * half + j);
                for l in 0..32 {
                    let low = ((qs[32 * half + l] >> (2 * j)) & 3) as i8;
                    let high = if hm[l] & bit != 0 { 0 } else { 4 };
                    q[128 * half + 32 * j + l] = low - high;
                }
            }
        }
    }
}

/// A row's partial sums over its blocks: `acc += Σ_sub-blocks a·Σ(q·x)` for one block, the
/// activations `x` as the accumulator takes them ([`Acc::In`]: f32, or 8-bit codes and scales).
trait Acc: Copy {
    /// One vector's activations.
    type In<'a>: Copy;
    /// The activations of elements `c0..c0 + n` (a block).
    fn block<'a>(x: Self::In<'a>, c0: usize, n: usize) -> Self::In<'a>;
    fn zero() -> Self;
    /// Safety: the implementation's ISA must be present (`Isa::detect` checks it).
    unsafe fn add(self, q: &[i8], x: Self::In<'_>, a: &[f32], g: usize) -> Self;
    fn total(self) -> f32;
}

/// Eight f32 partial sums: `acc += (a·q)·x`.
impl Acc for [f32; 8] {
    type In<'a> = &'a [f32];
    fn block<'a>(x: Self::In<'a>, c0: usize, n: usize) -> Self::In<'a> {
        &x[c0..c0 + n]
    }
    fn zero() -> Self {
        [0.0; 8]
    }
    #[inline(always)]
    unsafe fn add(mut self, q: &[i8], x: &[f32], a: &[f32], g: usize) -> Self {
        for (s, (q, x)) in q.chunks_exact(g).zip(x.chunks_exact(g)).enumerate() {
            let a = a[s];
            for (q, x) in q.chunks_exact(8).zip(x.chunks_exact(8)) {
                for k in 0..8 {
                    self[k] += (a * q[k] as f32) * x[k];
                }
            }
        }
        self
    }
    fn total(self) -> f32 {
        self.iter().sum()
    }
}

/// Four independent accumulators: one FMA chain would wait on its own latency every 8 weights.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
struct Avx2([std::arch::x86_64::__m256; 4]);

#[cfg(target_arch = "x86_64")]
impl Acc for Avx2 {
    type In<'a> = &'a [f32];
    fn block<'a>(x: Self::In<'a>, c0: usize, n: usize) -> Self::In<'a> {
        &x[c0..c0 + n]
    }
    #[inline(always)]
    fn zero() -> Self {
        // SAFETY: SSE/AVX register zeroing; only called inside the AVX2 kernels.
        Avx2([unsafe { std::arch::x86_64::_mm256_setzero_ps() }; 4])
    }
    #[inline(always)]
    unsafe fn add(self, q: &[i8], x: &[f32], a: &[f32], g: usize) -> Self {
        use std::arch::x86_64::*;
        let [mut c0, mut c1, mut c2, mut c3] = self.0;
        let n = q.len().min(x.len());
        // 32 weights a step, in a fixed register each 8 (an indexed array would live in memory).
        assert!(n.is_multiple_of(32) && (g == 16 || g == 32) && a.len() >= n / g);
        let (q, x) = (q.as_ptr(), x.as_ptr());
        for k in (0..n).step_by(32) {
            let (lo, hi) = (_mm256_set1_ps(a[k / g]), _mm256_set1_ps(a[(k + 16) / g]));
            // SAFETY: k + 32 ≤ n, checked above.
            let w = |o: usize, s: __m256| {
                let qi = _mm256_cvtepi8_epi32(_mm_loadl_epi64(q.add(k + o) as *const __m128i));
                _mm256_mul_ps(_mm256_cvtepi32_ps(qi), s)
            };
            c0 = _mm256_fmadd_ps(w(0, lo), _mm256_loadu_ps(x.add(k)), c0);
            c1 = _mm256_fmadd_ps(w(8, lo), _mm256_loadu_ps(x.add(k + 8)), c1);
            c2 = _mm256_fmadd_ps(w(16, hi), _mm256_loadu_ps(x.add(k + 16)), c2);
            c3 = _mm256_fmadd_ps(w(24, hi), _mm256_loadu_ps(x.add(k + 24)), c3);
        }
        Avx2([c0, c1, c2, c3])
    }
    #[inline(always)]
    fn total(self) -> f32 {
        use std::arch::x86_64::*;
        let mut v = [0f32; 8];
        // SAFETY: register adds and an unaligned store of 8 f32 into 8 f32.
        unsafe {
            let [a, b, c, d] = self.0;
            let sum = _mm256_add_ps(_mm256_add_ps(a, b), _mm256_add_ps(c, d));
            _mm256_storeu_ps(v.as_mut_ptr(), sum)
        };
        v.iter().sum()
    }
}

/// `$kernel` instantiated for the batch's vector count (`n`): one copy per count, so that the
/// accumulators stay in registers.
macro_rules! by_vecs {
    ($kernel:ident::<$t:ident>, $n:expr, $($arg:expr),*) => {
        match $n {
            1 => $kernel::<$t, 1>($($arg),*),
            2 => $kernel::<$t, 2>($($arg),*),
            3 => $kernel::<$t, 3>($($arg),*),
            _ => $kernel::<$t, VECS>($($arg),*),
        }
    };
    ($kernel:ident, $n:expr, $($arg:expr),*) => {
        match $n {
            1 => $kernel::<1>($($arg),*),
            2 => $kernel::<2>($($arg),*),
            3 => $kernel::<3>($($arg),*),
            _ => $kernel::<VECS>($($arg),*),
        }
    };
}

/// Most vectors one pass over a row block multiplies (their sums stay in registers).
const VECS: usize = 4;

/// `out[r·n + v] = row r · x_v` for the rows in `rows` (whole rows of `K` blocks) and up to
/// [`VECS`] vectors; `xsum[v]` holds vector v's sums over each sub-block (read when `K::MINS`).
#[inline(always)]
unsafe fn rows_dot<K: Kind, A: Acc>(
    rows: &[u8],
    row_bytes: usize,
    xs: &[A::In<'_>],
    xsum: &[&[f32]],
    out: &mut [f32],
) {
    // One copy per vector count, so that the accumulators stay in registers.
    match xs.len() {
        1 => rows_dot_n::<K, A, 1>(rows, row_bytes, xs, xsum, out),
        2 => rows_dot_n::<K, A, 2>(rows, row_bytes, xs, xsum, out),
        3 => rows_dot_n::<K, A, 3>(rows, row_bytes, xs, xsum, out),
        _ => rows_dot_n::<K, A, VECS>(rows, row_bytes, xs, xsum, out),
    }
}

#[inline(always)]
unsafe fn rows_dot_n<K: Kind, A: Acc, const N: usize>(
    rows: &[u8],
    row_bytes: usize,
    xs: &[A::In<'_>],
    xsum: &[&[f32]],
    out: &mut [f32],
) {
    assert!(xs.len() == N && (!K::MINS || xsum.len() == N));
    let n = N;
    let mut q = [0i8; 256];
    let (mut a, mut m) = ([0f32; 16], [0f32; 16]);
    for (r, row) in rows.chunks_exact(row_bytes).enumerate() {
        let mut acc = [A::zero(); N];
        let mut off = [0f32; N];
        for (bi, b) in row.chunks_exact(K::TS).enumerate() {
            K::decode(b, &mut q, &mut a, &mut m);
            let c0 = bi * K::BS;
            for v in 0..n {
                acc[v] = acc[v].add(&q[..K::BS], A::block(xs[v], c0, K::BS), &a, K::G);
                if K::MINS {
                    let s0 = c0 / K::G;
                    for s in 0..K::BS / K::G {
                        off[v] += m[s] * xsum[v][s0 + s];
                    }
                }
            }
        }
        for v in 0..n {
            out[r * n + v] = acc[v].total() + off[v];
        }
    }
}

/// How llama.cpp quantises the activations of a product with a weight type (ggml's
/// `vec_dot_type`), bit for bit as its x86 code does, so that `--activations q8` multiplies what
/// llama.cpp multiplies.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum ActQuant {
    /// Q8_0: per 32, codes `round_even(x·(127/max|x|))` and the scale `f16(max|x|/127)`.
    Q8_0,
    /// Q8_1: Q8_0's codes and scale, and each block's sum `f16(d·Σq)` with `d` before its
    /// rounding to f16 (what the offsets of Q4_1 and Q5_1 multiply).
    Q8_1,
    /// Q8_K: per 256, `iscale = −127/m` for `m` the value of largest magnitude, codes
    /// `min(127, round_even(x·iscale))`, the f32 scale `1/iscale` (k-quants, IQ4_XS).
    Q8K,
}

/// One vector's 8-bit activations: codes, the scale of each 32 (Q8_K's repeated over its 256),
/// and what each 32's codes sum to times their scale (Q8_1: its f16 block sum).
#[derive(Default)]
pub(crate) struct Q8Acts {
    q: Vec<i8>,
    d: Vec<f32>,
    sums: Vec<f32>,
    /// The codes' integer sums a block of 32.
    qsum: Vec<i32>,
}

impl ActQuant {
    /// The activation quantiser of weight type `ty` (Q8_0 where ggml has no other).
    fn of(ty: GgmlType) -> ActQuant {
        match ty {
            GgmlType::Q4_1 | GgmlType::Q5_1 => ActQuant::Q8_1,
            GgmlType::Q2_K
            | GgmlType::Q3_K
            | GgmlType::Q4_K
            | GgmlType::Q5_K
            | GgmlType::Q6_K
            | GgmlType::IQ4_XS => ActQuant::Q8K,
            _ => ActQuant::Q8_0,
        }
    }

    /// `x` (a whole number of the quantiser's blocks) quantised.
    pub(crate) fn quantise(self, x: &[f32]) -> Q8Acts {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: AVX2 is present.
            return unsafe { self.quantise_avx2(x) };
        }
        self.quantise_with(x)
    }

    /// [`ActQuant::quantise`] compiled for AVX2 (rounding by `vroundps`: the same codes).
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    unsafe fn quantise_avx2(self, x: &[f32]) -> Q8Acts {
        self.quantise_with(x)
    }

    #[inline(always)]
    fn quantise_with(self, x: &[f32]) -> Q8Acts {
        let mut a = Q8Acts {
            q: vec![0i8; x.len()],
            d: Vec::with_capacity(x.len().div_ceil(32)),
            sums: Vec::with_capacity(x.len().div_ceil(32)),
            qsum: Vec::with_capacity(x.len().div_ceil(32)),
        };
        match self {
            ActQuant::Q8_0 | ActQuant::Q8_1 => {
                for (x, q) in x.chunks(32).zip(a.q.chunks_mut(32)) {
                    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
                    let d = amax / 127.0;
                    let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
                    for (q, &v) in q.iter_mut().zip(x) {
                        *q = (v * id).round_ties_even() as i8;
                    }
                    let sum: i32 = q.iter().map(|&q| q as i32).sum();
                    let dh = f16_round(d);
                    a.d.push(dh);
                    a.qsum.push(sum);
                    a.sums.push(match self {
                        ActQuant::Q8_1 => f16_round(d * sum as f32),
                        _ => dh * sum as f32,
                    });
                }
            }
            ActQuant::Q8K => {
                for (x, q) in x.chunks(256).zip(a.q.chunks_mut(256)) {
                    let (mut amax, mut max) = (0f32, 0f32);
                    for &v in x {
                        if v.abs() > amax {
                            (amax, max) = (v.abs(), v);
                        }
                    }
                    let d = match amax {
                        0.0 => 0.0,
                        _ => {
                            let iscale = -127.0 / max;
                            for (q, &v) in q.iter_mut().zip(x) {
                                *q = ((v * iscale).round_ties_even() as i32).min(127) as i8;
                            }
                            1.0 / iscale
                        }
                    };
                    for q in q.chunks(32) {
                        let sum = q.iter().map(|&q| q as i32).sum::<i32>();
                        a.d.push(d);
                        a.qsum.push(sum);
                        a.sums.push(d * sum as f32);
                    }
                }
            }
        }
        a
    }
}

/// `x` rounded to the nearest IEEE half (what ggml stores a Q8_0 or Q8_1 scale as).
fn f16_round(x: f32) -> f32 {
    half::f16::from_f32(x).to_f32()
}

impl Q8Acts {
    fn input(&self) -> Q8In<'_> {
        Q8In {
            q: &self.q,
            d: &self.d,
            qsum: &self.qsum,
        }
    }

    /// The activations the codes stand for.
    #[cfg(test)]
    fn values(&self) -> Vec<f32> {
        self.q
            .iter()
            .enumerate()
            .map(|(i, &q)| q as f32 * self.d[i / 32])
            .collect()
    }

    /// The sums the offsets of sub-blocks of `group` (16 or 32) multiply.
    fn group_sums(&self, group: usize) -> Vec<f32> {
        match group {
            32 => self.sums.clone(),
            _ => self
                .q
                .chunks(group)
                .enumerate()
                .map(|(g, q)| {
                    self.d[g * group / 32] * q.iter().map(|&q| q as i32).sum::<i32>() as f32
                })
                .collect(),
        }
    }
}

/// One vector's 8-bit activations as the kernels read them: codes `q`, their per-32 scales `d`
/// and sums `qsum`.
#[derive(Clone, Copy)]
struct Q8In<'a> {
    q: &'a [i8],
    d: &'a [f32],
    /// The codes' integer sums a block of 32.
    qsum: &'a [i32],
}

impl<'a> Q8In<'a> {
    fn block(self, c0: usize, n: usize) -> Self {
        Q8In {
            q: &self.q[c0..c0 + n],
            d: &self.d[c0 / 32..(c0 + n).div_ceil(32)],
            qsum: &self.qsum[c0 / 32..(c0 + n).div_ceil(32)],
        }
    }
}

/// The portable reference: exact integer sums per sub-block.
#[derive(Clone, Copy)]
struct ScalarQ8(f32);

/// `acc += Σ_sub-blocks a·d·Σ(q·xq)`.
impl Acc for ScalarQ8 {
    type In<'a> = Q8In<'a>;
    fn block<'a>(x: Self::In<'a>, c0: usize, n: usize) -> Self::In<'a> {
        x.block(c0, n)
    }
    fn zero() -> Self {
        ScalarQ8(0.0)
    }
    #[inline(always)]
    unsafe fn add(mut self, q: &[i8], x: Q8In<'_>, a: &[f32], g: usize) -> Self {
        let d = x.d;
        for (s, (q, x)) in q.chunks_exact(g).zip(x.q.chunks_exact(g)).enumerate() {
            let sum: i32 = q.iter().zip(x).map(|(&q, &x)| q as i32 * x as i32).sum();
            self.0 += a[s] * d[s * g / 32] * sum as f32;
        }
        self
    }
    fn total(self) -> f32 {
        self.0
    }
}

/// AVX2: 32 products a step through `maddubs` (|q| times x signed as q), two chains.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
struct Avx2Q8([std::arch::x86_64::__m256; 2]);

#[cfg(target_arch = "x86_64")]
impl Acc for Avx2Q8 {
    type In<'a> = Q8In<'a>;
    fn block<'a>(x: Self::In<'a>, c0: usize, n: usize) -> Self::In<'a> {
        x.block(c0, n)
    }
    #[inline(always)]
    fn zero() -> Self {
        // SAFETY: register zeroing; only called inside the AVX2 kernels.
        Avx2Q8([unsafe { std::arch::x86_64::_mm256_setzero_ps() }; 2])
    }
    #[inline(always)]
    unsafe fn add(self, q: &[i8], x: Q8In<'_>, a: &[f32], g: usize) -> Self {
        use std::arch::x86_64::*;
        let (xq, d) = (x.q, x.d);
        let [mut c0, mut c1] = self.0;
        let n = q.len().min(xq.len());
        assert!(n.is_multiple_of(32) && (g == 16 || g == 32) && a.len() >= n / g);
        assert!(d.len() >= n / 32);
        let ones = _mm256_set1_epi16(1);
        let (qp, xp) = (q.as_ptr(), xq.as_ptr());
        for (i, k) in (0..n).step_by(32).enumerate() {
            // SAFETY: k + 32 ≤ n, checked above.
            let qv = _mm256_loadu_si256(qp.add(k) as *const __m256i);
            let xv = _mm256_loadu_si256(xp.add(k) as *const __m256i);
            // |q| ≤ 128 and |x| ≤ 127: a pair of products fits in i16 (no saturation).
            let p = _mm256_maddubs_epi16(_mm256_abs_epi8(qv), _mm256_sign_epi8(xv, qv));
            // Lanes 0–3 sum bytes 0–15, lanes 4–7 bytes 16–31.
            let sums = _mm256_cvtepi32_ps(_mm256_madd_epi16(p, ones));
            let lo = a[k / g] * d[k / 32];
            let hi = a[(k + 16) / g] * d[k / 32];
            let scale = _mm256_set_m128(_mm_set1_ps(hi), _mm_set1_ps(lo));
            if i % 2 == 0 {
                c0 = _mm256_fmadd_ps(sums, scale, c0);
            } else {
                c1 = _mm256_fmadd_ps(sums, scale, c1);
            }
        }
        Avx2Q8([c0, c1])
    }
    #[inline(always)]
    fn total(self) -> f32 {
        use std::arch::x86_64::*;
        let mut v = [0f32; 8];
        // SAFETY: a register add and an unaligned store of 8 f32 into 8 f32.
        unsafe { _mm256_storeu_ps(v.as_mut_ptr(), _mm256_add_ps(self.0[0], self.0[1])) };
        v.iter().sum()
    }
}

/// Q4_K's `q8` product on AVX2, reading the nibbles in place (llama.cpp's scheme): each 32-byte
/// group of codes holds two sub-blocks, low and high nibbles, multiplied unsigned by the signed
/// activations with `maddubs` (no decode into a code array).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4k_q8_avx2_n<const N: usize>(
    rows: &[u8],
    row_bytes: usize,
    x: &[Q8In],
    xsum: &[&[f32]],
    out: &mut [f32],
) {
    use std::arch::x86_64::*;
    assert!(x.len() == N && xsum.len() == N);
    let (mask, ones) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi16(1));
    let (mut a, mut m) = ([0f32; 16], [0f32; 16]);
    for (r, row) in rows.chunks_exact(row_bytes).enumerate() {
        let mut acc = [_mm256_setzero_ps(); N];
        let mut off = [0f32; N];
        for (bi, b) in row.chunks_exact(144).enumerate() {
            prefetch_ahead(b, 3);
            k4_scales(b, &mut a, &mut m);
            let c0 = bi * 256;
            for c in 0..4 {
                // SAFETY: 16 + 32·c + 32 ≤ 144.
                let v = _mm256_loadu_si256(b.as_ptr().add(16 + 32 * c) as *const __m256i);
                let lo = _mm256_and_si256(v, mask);
                let hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
                for i in 0..N {
                    let e = c0 + 64 * c;
                    let Q8In { q: xq, d: xd, .. } = x[i];
                    assert!(xq.len() >= e + 64 && xd.len() > e / 32 + 1);
                    // SAFETY: e + 64 ≤ xq.len(), checked above.
                    let xl = _mm256_loadu_si256(xq.as_ptr().add(e) as *const __m256i);
                    let xh = _mm256_loadu_si256(xq.as_ptr().add(e + 32) as *const __m256i);
                    let sl = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, xl), ones);
                    let sh = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, xh), ones);
                    let (dl, dh) = (xd[e / 32], xd[e / 32 + 1]);
                    let fl = _mm256_set1_ps(a[2 * c] * dl);
                    let fh = _mm256_set1_ps(a[2 * c + 1] * dh);
                    acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sl), fl, acc[i]);
                    acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sh), fh, acc[i]);
                }
            }
            for i in 0..N {
                for s in 0..8 {
                    off[i] += m[s] * xsum[i][c0 / 32 + s];
                }
            }
        }
        for i in 0..N {
            out[r * N + i] = hsum(acc[i]) + off[i];
        }
    }
}

/// Q4_K's product with f32 activations on AVX2, reading the nibbles in place: each 32-byte
/// group of codes holds two sub-blocks (low and high nibbles), widened to f32 in registers.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4k_f32_avx2_n<const N: usize>(
    rows: &[u8],
    row_bytes: usize,
    xs: &[&[f32]],
    xsum: &[&[f32]],
    out: &mut [f32],
) {
    use std::arch::x86_64::*;
    assert!(xs.len() == N && xsum.len() == N);
    let blocks = row_bytes / 144;
    assert!(xs.iter().all(|x| x.len() >= blocks * 256));
    assert!(xsum.iter().all(|s| s.len() >= blocks * 8));
    let mask = _mm256_set1_epi8(0x0F);
    let (mut a, mut m) = ([0f32; 16], [0f32; 16]);
    for (r, row) in rows.chunks_exact(row_bytes).enumerate() {
        let mut acc = [_mm256_setzero_ps(); N];
        let mut off = [0f32; N];
        for (bi, b) in row.chunks_exact(144).enumerate() {
            prefetch_ahead(b, 3);
            k4_scales(b, &mut a, &mut m);
            let c0 = bi * 256;
            for c in 0..4 {
                // SAFETY: 16 + 32·c + 32 ≤ 144.
                let v = _mm256_loadu_si256(b.as_ptr().add(16 + 32 * c) as *const __m256i);
                let lo = widen32(_mm256_and_si256(v, mask));
                let hi = widen32(_mm256_and_si256(_mm256_srli_epi16(v, 4), mask));
                let (al, ah) = (_mm256_set1_ps(a[2 * c]), _mm256_set1_ps(a[2 * c + 1]));
                for i in 0..N {
                    // SAFETY: c0 + 64·c + 64 ≤ blocks·256 ≤ xs[i].len(), checked above.
                    let x = xs[i].as_ptr().add(c0 + 64 * c);
                    acc[i] = _mm256_fmadd_ps(dot32(&lo, x), al, acc[i]);
                    acc[i] = _mm256_fmadd_ps(dot32(&hi, x.add(32)), ah, acc[i]);
                }
            }
            for i in 0..N {
                for s in 0..8 {
                    off[i] += m[s] * xsum[i][c0 / 32 + s];
                }
            }
        }
        for i in 0..N {
            out[r * N + i] = hsum(acc[i]) + off[i];
        }
    }
}

#[cfg(target_arch = "x86_64")]
fn q4k_f32_avx2(rows: &[u8], rb: usize, x: &[&[f32]], s: &[&[f32]], out: &mut [f32]) {
    // SAFETY: picked only where the CPU has AVX2, FMA and F16C (`Isa::detect`).
    unsafe { by_vecs!(q4k_f32_avx2_n, x.len(), rows, rb, x, s, out) }
}

/// Half `n` of a Q6_K block's codes as four groups of 32 unsigned bytes in element order
/// (`q + 32`): low four bits from `ql`, high two from `qh`, as ggml's dequantisation puts them.
/// Safety: AVX2 present; `p` points at a whole 210-byte block, `n` < 2.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn q6k_codes(p: *const u8, n: usize) -> [std::arch::x86_64::__m256i; 4] {
    use std::arch::x86_64::*;
    let (m4, m3) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(0x03));
    // 64·n + 64 ≤ 128 and 128 + 32·n + 32 ≤ 192: within the block.
    let ql0 = _mm256_loadu_si256(p.add(64 * n) as *const __m256i);
    let ql1 = _mm256_loadu_si256(p.add(64 * n + 32) as *const __m256i);
    let qh = _mm256_loadu_si256(p.add(128 + 32 * n) as *const __m256i);
    let high = |h: __m256i| _mm256_slli_epi16(_mm256_and_si256(h, m3), 4);
    let low = |l: __m256i| _mm256_and_si256(l, m4);
    [
        _mm256_or_si256(low(ql0), high(qh)),
        _mm256_or_si256(low(ql1), high(_mm256_srli_epi16(qh, 2))),
        _mm256_or_si256(
            low(_mm256_srli_epi16(ql0, 4)),
            high(_mm256_srli_epi16(qh, 4)),
        ),
        _mm256_or_si256(
            low(_mm256_srli_epi16(ql1, 4)),
            high(_mm256_srli_epi16(qh, 6)),
        ),
    ]
}

/// Q6_K's product with f32 activations on AVX2, its codes put together in registers (low four
/// bits from `ql`, high two from `qh`, as ggml's dequantisation does) and widened to f32; a
/// sub-block is 16 weights, so each 32 codes carry two scales.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q6k_f32_avx2_n<const N: usize>(
    rows: &[u8],
    row_bytes: usize,
    xs: &[&[f32]],
    _xsum: &[&[f32]],
    out: &mut [f32],
) {
    use std::arch::x86_64::*;
    assert!(xs.len() == N);
    let blocks = row_bytes / 210;
    assert!(xs.iter().all(|x| x.len() >= blocks * 256));
    let k32 = _mm256_set1_epi8(32);
    for (r, row) in rows.chunks_exact(row_bytes).enumerate() {
        let mut acc = [_mm256_setzero_ps(); N];
        for (bi, b) in row.chunks_exact(210).enumerate() {
            prefetch_ahead(b, 4);
            let p = b.as_ptr();
            let d = f16_at(b, 208);
            let c0 = bi * 256;
            for n in 0..2 {
                let codes = q6k_codes(p, n);
                for (k, &c) in codes.iter().enumerate() {
                    let w = widen32(_mm256_sub_epi8(c, k32));
                    // Sub-blocks 8n + 2k and 8n + 2k + 1 (16 weights each).
                    let s = 8 * n + 2 * k;
                    let sa = _mm256_set1_ps(d * (b[192 + s] as i8) as f32);
                    let sb = _mm256_set1_ps(d * (b[193 + s] as i8) as f32);
                    for i in 0..N {
                        // SAFETY: c0 + 128·n + 32·k + 32 ≤ blocks·256 ≤ xs[i].len().
                        let x = xs[i].as_ptr().add(c0 + 128 * n + 32 * k);
                        let ea = _mm256_fmadd_ps(
                            w[1],
                            _mm256_loadu_ps(x.add(8)),
                            _mm256_mul_ps(w[0], _mm256_loadu_ps(x)),
                        );
                        let eb = _mm256_fmadd_ps(
                            w[3],
                            _mm256_loadu_ps(x.add(24)),
                            _mm256_mul_ps(w[2], _mm256_loadu_ps(x.add(16))),
                        );
                        acc[i] = _mm256_fmadd_ps(ea, sa, acc[i]);
                        acc[i] = _mm256_fmadd_ps(eb, sb, acc[i]);
                    }
                }
            }
        }
        for i in 0..N {
            out[r * N + i] = hsum(acc[i]);
        }
    }
}

#[cfg(target_arch = "x86_64")]
fn q6k_f32_avx2(rows: &[u8], rb: usize, x: &[&[f32]], s: &[&[f32]], out: &mut [f32]) {
    // SAFETY: picked only where the CPU has AVX2, FMA and F16C (`Isa::detect`).
    unsafe { by_vecs!(q6k_f32_avx2_n, x.len(), rows, rb, x, s, out) }
}

/// Q6_K's `q8` product on AVX2: the codes put together in registers as in
/// [`q6k_f32_avx2_n`], 32 products a step by one `maddubs` (|q| times x signed as q); the
/// lanes of each half carry one 16-weight sub-block, scaled by its own factor.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q6k_q8_avx2_n<const N: usize>(
    rows: &[u8],
    row_bytes: usize,
    x: &[Q8In],
    _xsum: &[&[f32]],
    out: &mut [f32],
) {
    use std::arch::x86_64::*;
    assert!(x.len() == N);
    let blocks = row_bytes / 210;
    assert!(x
        .iter()
        .all(|x| x.q.len() >= blocks * 256 && x.d.len() >= blocks * 8));
    let (k32, ones) = (_mm256_set1_epi8(32), _mm256_set1_epi16(1));
    for (r, row) in rows.chunks_exact(row_bytes).enumerate() {
        let mut acc = [_mm256_setzero_ps(); N];
        for (bi, b) in row.chunks_exact(210).enumerate() {
            prefetch_ahead(b, 4);
            let p = b.as_ptr();
            let d = f16_at(b, 208);
            let c0 = bi * 256;
            for n in 0..2 {
                let codes = q6k_codes(p, n);
                for (k, &c) in codes.iter().enumerate() {
                    let q = _mm256_sub_epi8(c, k32);
                    let qa = _mm256_abs_epi8(q);
                    let s = 8 * n + 2 * k;
                    let (sa, sb) = (d * (b[192 + s] as i8) as f32, d * (b[193 + s] as i8) as f32);
                    let e = c0 + 128 * n + 32 * k;
                    for i in 0..N {
                        // SAFETY: e + 32 ≤ blocks·256 ≤ x[i].q.len(), checked above.
                        let xv = _mm256_loadu_si256(x[i].q.as_ptr().add(e) as *const __m256i);
                        // |q| ≤ 32 and |x| ≤ 127: a pair of products fits in i16.
                        let p = _mm256_maddubs_epi16(qa, _mm256_sign_epi8(xv, q));
                        let sums = _mm256_cvtepi32_ps(_mm256_madd_epi16(p, ones));
                        let dx = x[i].d[e / 32];
                        let f = _mm256_set_m128(_mm_set1_ps(sb * dx), _mm_set1_ps(sa * dx));
                        acc[i] = _mm256_fmadd_ps(sums, f, acc[i]);
                    }
                }
            }
        }
        for i in 0..N {
            out[r * N + i] = hsum(acc[i]);
        }
    }
}

#[cfg(target_arch = "x86_64")]
fn q6k_q8_avx2(rows: &[u8], rb: usize, x: &[Q8In], s: &[&[f32]], out: &mut [f32]) {
    // SAFETY: picked only where the CPU has AVX2, FMA and F16C (`Isa::detect`).
    unsafe { by_vecs!(q6k_q8_avx2_n, x.len(), rows, rb, x, s, out) }
}

#[cfg(target_arch = "x86_64")]
fn q4k_q8_avx2(rows: &[u8], rb: usize, x: &[Q8In], s: &[&[f32]], out: &mut [f32]) {
    // SAFETY: picked only where the CPU has AVX2, FMA and F16C (`Isa::detect`).
    unsafe { by_vecs!(q4k_q8_avx2_n, x.len(), rows, rb, x, s, out) }
}

/// The legacy 32-weight blocks the AVX2 kernels below read in place (no decode into a code
/// array): one scale (f16) at byte 0, the min after it (Q4_1, Q5_1), the fifth bits (Q5_x), then
/// the codes.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy, PartialEq, Eq)]
enum Legacy {
    Q4_0 = 0,
    Q4_1 = 1,
    Q8_0 = 2,
    Q5_0 = 3,
    Q5_1 = 4,
}

#[cfg(target_arch = "x86_64")]
impl Legacy {
    const fn from_u8(t: u8) -> Legacy {
        match t {
            0 => Legacy::Q4_0,
            1 => Legacy::Q4_1,
            3 => Legacy::Q5_0,
            4 => Legacy::Q5_1,
            _ => Legacy::Q8_0,
        }
    }

    /// Whether the codes are unsigned with a min (the others are signed, without one).
    const fn mins(self) -> bool {
        matches!(self, Legacy::Q4_1 | Legacy::Q5_1)
    }

    /// The block's scale and (Q4_1, Q5_1) min, by F16C (exact, as [`f16_at`]).
    /// Safety: F16C present; `b` points at a whole block.
    #[inline(always)]
    unsafe fn scales(self, b: *const u8) -> (f32, f32) {
        use std::arch::x86_64::*;
        let h = std::ptr::read_unaligned(b as *const u32);
        let f = _mm_cvtph_ps(_mm_cvtsi32_si128(h as i32));
        (_mm_cvtss_f32(f), _mm_cvtss_f32(_mm_movehdup_ps(f)))
    }

    /// Bytes of a block, and where its codes start.
    const fn layout(self) -> (usize, usize) {
        match self {
            Legacy::Q4_0 => (18, 2),
            Legacy::Q4_1 => (20, 4),
            Legacy::Q8_0 => (34, 2),
            Legacy::Q5_0 => (22, 6),
            Legacy::Q5_1 => (24, 8),
        }
    }

    /// The block's 32 codes as bytes in element order: Q4_0's and Q5_0's signed (`q − 8`,
    /// `q − 16`), Q4_1's and Q5_1's unsigned, Q8_0's as stored.
    /// Safety: AVX2 present; `b` points at a whole block.
    #[inline(always)]
    unsafe fn codes(self, b: *const u8) -> std::arch::x86_64::__m256i {
        use std::arch::x86_64::*;
        let at = b.add(self.layout().1);
        match self {
            Legacy::Q8_0 => _mm256_loadu_si256(at as *const __m256i),
            _ => {
                let v = _mm_loadu_si128(at as *const __m128i);
                let m4 = _mm_set1_epi8(0x0F);
                let lo = _mm_and_si128(v, m4);
                let hi = _mm_and_si128(_mm_srli_epi16(v, 4), m4);
                let c = _mm256_set_m128i(hi, lo);
                match self {
                    Legacy::Q4_0 => _mm256_sub_epi8(c, _mm256_set1_epi8(8)),
                    Legacy::Q5_0 | Legacy::Q5_1 => {
                        // Element i's fifth bit is bit i of the u32 before the codes: each byte
                        // i picks byte i / 8 of it and tests bit i % 8 (llama.cpp's
                        // bytes_from_bits_32).
                        let qh = std::ptr::read_unaligned(at.sub(4) as *const u32);
                        let spread = _mm256_shuffle_epi8(
                            _mm256_set1_epi32(qh as i32),
                            _mm256_set_epi64x(
                                0x0303_0303_0303_0303,
                                0x0202_0202_0202_0202,
                                0x0101_0101_0101_0101,
                                0,
                            ),
                        );
                        let bit =
                            _mm256_or_si256(spread, _mm256_set1_epi64x(0x7fbf_dfef_f7fb_fdfe));
                        let set = _mm256_cmpeq_epi8(bit, _mm256_set1_epi64x(-1));
                        let c = _mm256_or_si256(c, _mm256_and_si256(set, _mm256_set1_epi8(0x10)));
                        match self {
                            Legacy::Q5_0 => _mm256_sub_epi8(c, _mm256_set1_epi8(16)),
                            _ => c,
                        }
                    }
                    _ => c,
                }
            }
        }
    }
}

/// How far ahead of the block being multiplied the in-place kernels prefetch (bytes).
#[cfg(target_arch = "x86_64")]
const PREFETCH: usize = 4096;

/// The `lines` cache lines [`PREFETCH`] bytes past the start of `block` asked for (a block's
/// worth: the rows stream faster than the hardware prefetcher brings them).
/// Safety: SSE present (any x86-64); the addresses are only hints, never read.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn prefetch_ahead(block: &[u8], lines: usize) {
    use std::arch::x86_64::*;
    for l in 0..lines {
        _mm_prefetch::<_MM_HINT_T0>(block.as_ptr().wrapping_add(PREFETCH + 64 * l) as *const i8);
    }
}

/// One legacy type's product with f32 activations on AVX2: per block the codes widened to f32
/// in registers, `Σ q·x` in two chains, times the block's scale (`a·Σq·x + m·Σx`, as
/// [`rows_dot`] regroups it).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn legacy_f32_avx2_n<const T: u8, const N: usize>(
    rows: &[u8],
    row_bytes: usize,
    xs: &[&[f32]],
    xsum: &[&[f32]],
    out: &mut [f32],
) {
    use std::arch::x86_64::*;
    let t = Legacy::from_u8(T);
    let ts = t.layout().0;
    let mins = t.mins();
    assert!(xs.len() == N && (!mins || xsum.len() == N));
    let blocks = row_bytes / ts;
    assert!(xs.iter().all(|x| x.len() >= blocks * 32));
    assert!(!mins || xsum.iter().all(|s| s.len() >= blocks));
    for (r, row) in rows.chunks_exact(row_bytes).enumerate() {
        let mut acc = [_mm256_setzero_ps(); N];
        let mut off = [0f32; N];
        for (bi, b) in row.chunks_exact(ts).enumerate() {
            prefetch_ahead(b, 1);
            let w = widen32(t.codes(b.as_ptr()));
            let (a, m) = t.scales(b.as_ptr());
            let a = _mm256_set1_ps(a);
            for v in 0..N {
                // SAFETY: 32·bi + 32 ≤ blocks·32 ≤ xs[v].len(), checked above.
                let x = xs[v].as_ptr().add(32 * bi);
                acc[v] = _mm256_fmadd_ps(dot32(&w, x), a, acc[v]);
                if mins {
                    off[v] += m * xsum[v][bi];
                }
            }
        }
        for v in 0..N {
            out[r * N + v] = hsum(acc[v]) + off[v];
        }
    }
}

/// The sum of a vector's eight lanes.
/// Safety: AVX present.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn hsum(v: std::arch::x86_64::__m256) -> f32 {
    let mut lanes = [0f32; 8];
    std::arch::x86_64::_mm256_storeu_ps(lanes.as_mut_ptr(), v);
    lanes.iter().sum()
}

/// 32 signed byte codes as four vectors of eight f32.
/// Safety: AVX2 present.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn widen32(c: std::arch::x86_64::__m256i) -> [std::arch::x86_64::__m256; 4] {
    use std::arch::x86_64::*;
    let (lo, hi) = (_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
    [
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)),
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))),
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)),
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8))),
    ]
}

/// `Σ w·x` over 32 elements, as eight partial sums (two chains).
/// Safety: AVX2 and FMA present; `x` points at 32 f32.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn dot32(w: &[std::arch::x86_64::__m256; 4], x: *const f32) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    let s0 = _mm256_fmadd_ps(
        w[2],
        _mm256_loadu_ps(x.add(16)),
        _mm256_mul_ps(w[0], _mm256_loadu_ps(x)),
    );
    let s1 = _mm256_fmadd_ps(
        w[3],
        _mm256_loadu_ps(x.add(24)),
        _mm256_mul_ps(w[1], _mm256_loadu_ps(x.add(8))),
    );
    _mm256_add_ps(s0, s1)
}

/// One legacy type's `q8` product on AVX2: per block 32 products by one `maddubs` (Q4_1's codes
/// unsigned as they are; signed ones through |q| and x signed as q), times `a·d`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn legacy_q8_avx2_n<const T: u8, const N: usize>(
    rows: &[u8],
    row_bytes: usize,
    x: &[Q8In],
    xsum: &[&[f32]],
    out: &mut [f32],
) {
    use std::arch::x86_64::*;
    let t = Legacy::from_u8(T);
    let ts = t.layout().0;
    let mins = t.mins();
    assert!(x.len() == N && (!mins || xsum.len() == N));
    let blocks = row_bytes / ts;
    assert!(x
        .iter()
        .all(|x| x.q.len() >= blocks * 32 && x.d.len() >= blocks));
    assert!(!mins || xsum.iter().all(|s| s.len() >= blocks));
    let ones = _mm256_set1_epi16(1);
    for (r, row) in rows.chunks_exact(row_bytes).enumerate() {
        let mut acc = [_mm256_setzero_ps(); N];
        let mut off = [0f32; N];
        for (bi, b) in row.chunks_exact(ts).enumerate() {
            prefetch_ahead(b, 1);
            let c = t.codes(b.as_ptr());
            let (a, m) = t.scales(b.as_ptr());
            let (cu, sgn) = match t {
                Legacy::Q4_1 | Legacy::Q5_1 => (c, None),
                _ => (_mm256_abs_epi8(c), Some(c)),
            };
            for v in 0..N {
                // SAFETY: 32·bi + 32 ≤ blocks·32 ≤ x[v].q.len(), checked above.
                let xv = _mm256_loadu_si256(x[v].q.as_ptr().add(32 * bi) as *const __m256i);
                let xv = match sgn {
                    Some(c) => _mm256_sign_epi8(xv, c),
                    None => xv,
                };
                // |q| ≤ 128 and |x| ≤ 127: a pair of products fits in i16 (no saturation).
                let sums = _mm256_madd_epi16(_mm256_maddubs_epi16(cu, xv), ones);
                let f = _mm256_set1_ps(a * x[v].d[bi]);
                acc[v] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), f, acc[v]);
                if mins {
                    off[v] += m * xsum[v][bi];
                }
            }
        }
        for v in 0..N {
            out[r * N + v] = hsum(acc[v]) + off[v];
        }
    }
}

/// The in-place AVX2 kernels of a legacy type, as [`Kernels`]' entries.
#[cfg(target_arch = "x86_64")]
macro_rules! legacy_avx2 {
    ($t:path) => {{
        const T: u8 = $t as u8;
        fn rows(rows: &[u8], rb: usize, xs: &[&[f32]], s: &[&[f32]], out: &mut [f32]) {
            // SAFETY: picked only where the CPU has AVX2, FMA and F16C (`Isa::detect`).
            unsafe { by_vecs!(legacy_f32_avx2_n::<T>, xs.len(), rows, rb, xs, s, out) }
        }
        fn rows_q8(rows: &[u8], rb: usize, x: &[Q8In], s: &[&[f32]], out: &mut [f32]) {
            // SAFETY: as above.
            unsafe { by_vecs!(legacy_q8_avx2_n::<T>, x.len(), rows, rb, x, s, out) }
        }
        (rows as RowsFn, rows_q8 as RowsQ8Fn)
    }};
}

/// The `q8` variant's product kernel of one type on one ISA (see [`rows_dot`]).
type RowsQ8Fn = fn(&[u8], usize, &[Q8In], &[&[f32]], &mut [f32]);

/// The product kernel of one type on one ISA (see [`rows_dot`]).
type RowsFn = fn(&[u8], usize, &[&[f32]], &[&[f32]], &mut [f32]);

/// A type's kernels: the portable one and, where the CPU has them, the AVX2+FMA one.
#[derive(Clone, Copy)]
struct Kernels {
    rows: RowsFn,
    rows_q8: RowsQ8Fn,
    /// Sub-block elements (what `xsum` sums over), and whether `xsum` is read.
    group: usize,
    mins: bool,
    /// How the q8 variant quantises the activations.
    act: ActQuant,
}

macro_rules! kernels {
    ($k:ty, $isa:expr, $ty:expr) => {{
        debug_assert_eq!(<$k>::TY, $ty, "a type's kernels are its Kind's");
        fn portable(rows: &[u8], rb: usize, xs: &[&[f32]], xsum: &[&[f32]], out: &mut [f32]) {
            // SAFETY: the portable accumulator needs no ISA.
            unsafe { rows_dot::<$k, [f32; 8]>(rows, rb, xs, xsum, out) }
        }
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn avx2_inner(
            rows: &[u8],
            rb: usize,
            xs: &[&[f32]],
            xsum: &[&[f32]],
            out: &mut [f32],
        ) {
            rows_dot::<$k, Avx2>(rows, rb, xs, xsum, out)
        }
        #[cfg(target_arch = "x86_64")]
        fn avx2(rows: &[u8], rb: usize, xs: &[&[f32]], xsum: &[&[f32]], out: &mut [f32]) {
            // SAFETY: picked only where the CPU has AVX2, FMA and F16C (`Isa::detect`).
            unsafe { avx2_inner(rows, rb, xs, xsum, out) }
        }
        fn portable_q8(rows: &[u8], rb: usize, x: &[Q8In], xsum: &[&[f32]], out: &mut [f32]) {
            // SAFETY: the portable accumulator needs no ISA.
            unsafe { rows_dot::<$k, ScalarQ8>(rows, rb, x, xsum, out) }
        }
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn avx2_q8_inner(
            rows: &[u8],
            rb: usize,
            x: &[Q8In],
            xsum: &[&[f32]],
            out: &mut [f32],
        ) {
            rows_dot::<$k, Avx2Q8>(rows, rb, x, xsum, out)
        }
        #[cfg(target_arch = "x86_64")]
        fn avx2_q8(rows: &[u8], rb: usize, x: &[Q8In], xsum: &[&[f32]], out: &mut [f32]) {
            // SAFETY: picked only where the CPU has AVX2, FMA and F16C (`Isa::detect`).
            unsafe { avx2_q8_inner(rows, rb, x, xsum, out) }
        }
        let (rows, rows_q8): (RowsFn, RowsQ8Fn) = match $isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 | Isa::Avx512Vnni => (avx2, avx2_q8),
            Isa::Portable => (portable, portable_q8),
        };
        Kernels {
            rows,
            rows_q8,
            group: <$k>::G,
            mins: <$k>::MINS,
            act: ActQuant::of(<$k>::TY),
        }
    }};
}

/// Which kernel implementation runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Isa {
    Portable,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    /// AVX2's kernels, with the q8 products of Q4_0, Q4_1, Q8_0 and Q4_K on AVX-512 VNNI over
    /// tiles (`ggml_tiles.rs`).
    #[cfg(target_arch = "x86_64")]
    Avx512Vnni,
}

impl Isa {
    pub(crate) fn detect() -> Isa {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            if has!("avx2") && has!("fma") && has!("f16c") {
                if has!("avx512f") && has!("avx512bw") && has!("avx512vl") && has!("avx512vnni") {
                    return Isa::Avx512Vnni;
                }
                return Isa::Avx2;
            }
        }
        Isa::Portable
    }

    /// Every implementation this CPU runs (the tests check each against the reference).
    #[cfg(test)]
    pub(crate) fn available() -> Vec<Isa> {
        let mut v = vec![Isa::Portable];
        #[cfg(target_arch = "x86_64")]
        {
            if Isa::detect() != Isa::Portable {
                v.push(Isa::Avx2);
            }
            if Isa::detect() == Isa::Avx512Vnni {
                v.push(Isa::Avx512Vnni);
            }
        }
        v
    }
}

/// The fused kernels of `ty` on `isa`, or `None` where the type has none.
fn kernels_for(ty: GgmlType, isa: Isa) -> Option<Kernels> {
    let k = match ty {
        GgmlType::Q4_0 => kernels!(Q4_0, isa, ty),
        GgmlType::Q4_1 => kernels!(Q4_1, isa, ty),
        GgmlType::Q5_0 => kernels!(Q5_0, isa, ty),
        GgmlType::Q5_1 => kernels!(Q5_1, isa, ty),
        GgmlType::Q8_0 => kernels!(Q8_0, isa, ty),
        GgmlType::Q2_K => kernels!(Q2K, isa, ty),
        GgmlType::Q3_K => kernels!(Q3K, isa, ty),
        GgmlType::Q4_K => kernels!(Q4K, isa, ty),
        GgmlType::Q5_K => kernels!(Q5K, isa, ty),
        GgmlType::Q6_K => kernels!(Q6K, isa, ty),
        GgmlType::IQ4_NL => kernels!(Iq4Nl, isa, ty),
        GgmlType::IQ4_XS => kernels!(Iq4Xs, isa, ty),
        GgmlType::MXFP4 => kernels!(Mxfp4, isa, ty),
        GgmlType::NVFP4 => kernels!(Nvfp4, isa, ty),
        _ => return None,
    };
    #[cfg(target_arch = "x86_64")]
    if isa != Isa::Portable {
        if let Some((rows, rows_q8)) = in_place_avx2(ty) {
            return Some(Kernels { rows, rows_q8, ..k });
        }
    }
    Some(k)
}

/// The types whose blocks the AVX2 kernels read in place (the types most files hold), in place of
/// the decode-then-multiply ones.
#[cfg(target_arch = "x86_64")]
fn in_place_avx2(ty: GgmlType) -> Option<(RowsFn, RowsQ8Fn)> {
    Some(match ty {
        GgmlType::Q4_0 => legacy_avx2!(Legacy::Q4_0),
        GgmlType::Q4_1 => legacy_avx2!(Legacy::Q4_1),
        GgmlType::Q5_0 => legacy_avx2!(Legacy::Q5_0),
        GgmlType::Q5_1 => legacy_avx2!(Legacy::Q5_1),
        GgmlType::Q8_0 => legacy_avx2!(Legacy::Q8_0),
        GgmlType::Q4_K => (q4k_f32_avx2, q4k_q8_avx2),
        GgmlType::Q6_K => (q6k_f32_avx2, q6k_q8_avx2),
        _ => return None,
    })
}

#[cfg(target_arch = "x86_64")]
#[path = "ggml_tiles.rs"]
mod tiles;

/// Asks the kernel to drop `bytes`' pages from the process's resident set once tiles hold them
/// (a model would otherwise be resident twice: the file's map and the tiles). Only a hint, and
/// harmless: a file map's pages come back from the file if read again (a container written
/// from the model, an embedding row), anonymous pages without swap stay as they are.
#[cfg(target_os = "linux")]
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
fn release_pages(bytes: &[u8]) {
    const PAGE: usize = 4096;
    let (start, end) = (
        bytes.as_ptr() as usize,
        bytes.as_ptr() as usize + bytes.len(),
    );
    let (first, last) = (start.next_multiple_of(PAGE), end / PAGE * PAGE);
    if last > first {
        // SAFETY: the range lies inside `bytes`, page-aligned; MADV_PAGEOUT never changes what
        // the pages hold.
        unsafe { libc::madvise(first as *mut libc::c_void, last - first, libc::MADV_PAGEOUT) };
    }
}

#[cfg(not(target_os = "linux"))]
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
fn release_pages(_: &[u8]) {}

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use super::super::*;
    use super::*;

    pub(crate) fn random_blocks(rng: &mut Rng, ty: GgmlType, blocks: usize) -> Vec<u8> {
        synth_blocks(ty, blocks, rng.next())
    }

    const TYPES: [GgmlType; 14] = entrollm_format::qtype::CPU;

    fn source(rng: &mut Rng, ty: GgmlType, rows: usize, blocks_per_row: usize) -> Source {
        let bytes = random_blocks(rng, ty, rows * blocks_per_row);
        let cols = blocks_per_row * ty.block_size();
        Source::new(
            rows,
            cols,
            Values::Ggml {
                ty,
                bytes: BlockBytes::from_vec(bytes),
            },
        )
        .unwrap()
    }

    /// The kernels exist for exactly the table's `cpu` rows, on every ISA (and each type's are its
    /// own `Kind`'s: `kernels!` asserts it).
    #[test]
    fn kernels_are_the_tables_cpu_rows() {
        for isa in Isa::available() {
            for ty in GgmlType::ALL {
                assert_eq!(kernels_for(ty, isa).is_some(), ty.row().cpu, "{ty} {isa:?}");
            }
        }
    }

    /// The types whose weights are codes times group scales, held as integer codes: the same
    /// weights, and in the `int` form the same products within f32 rounding.
    #[test]
    fn linear_types_as_int_codes_are_the_same_weights() {
        use super::super::int::INT;
        let mut rng = Rng::new(29);
        let mut converted = 0;
        for ty in TYPES {
            let linear = ty.int_codes().is_some();
            for (rows, blocks) in [(1, 1), (5, 2), (17, 3)] {
                let src = source(&mut rng, ty, rows, blocks);
                assert_eq!(INT.accepts(&src), linear, "{ty:?}");
                if !linear {
                    assert!(INT.variants(&src).unwrap().is_empty());
                    continue;
                }
                converted += 1;
                let g = GGML.encode(&src, "").unwrap();
                let i = INT.encode(&src, "").unwrap();
                assert_eq!(i.form().form, "int");
                let (mut a, mut b) = (vec![0f32; src.cols], vec![0f32; src.cols]);
                for r in 0..rows {
                    g.row(r, &mut a);
                    i.row(r, &mut b);
                    // Bit for bit, but for the sign of zeros: ggml's (q − 8)·d is −0 for
                    // negative d, the int form adds its (absent) min.
                    for c in 0..src.cols {
                        assert!(
                            a[c].to_bits() == b[c].to_bits() || a[c] == 0.0 && b[c] == 0.0,
                            "{ty:?} ({r}, {c}): {} vs {}",
                            a[c],
                            b[c]
                        );
                    }
                }
                let x: Vec<f32> = (0..src.cols).map(|_| rng.normal()).collect();
                let (mut ya, mut yb) = (vec![0f32; rows], vec![0f32; rows]);
                g.matvec(&x, &mut ya);
                i.matvec(&x, &mut yb);
                for (p, q) in ya.iter().zip(&yb) {
                    assert!(
                        (p - q).abs() <= 1e-4 * p.abs().max(1.0),
                        "{ty:?}: {p} vs {q}"
                    );
                }
                let p = INT.variants(&src).unwrap()[0].predicted_bytes;
                assert_eq!(p as usize, i.stored_bytes(), "{ty:?}");
            }
        }
        assert_eq!(converted, 10 * 3);
    }

    #[test]
    fn every_type_round_trips_and_multiplies_on_ragged_shapes() {
        let mut rng = Rng::new(23);
        for ty in TYPES {
            for (rows, blocks) in [(1, 1), (3, 2), (17, 3), (33, 1)] {
                let src = source(&mut rng, ty, rows, blocks);
                let bytes = check_variant(&GGML, &src, "", &mut rng);
                assert_eq!(bytes as usize, rows * blocks * ty.type_size(), "{ty}");
                check_all_forms(&src, &mut rng);
            }
        }
    }

    /// Rows are ggml's dequantisation of their blocks, bit for bit; the batched product is the
    /// per-vector one, bit for bit.
    #[test]
    fn rows_are_ggml_dequantisation_and_matmul_is_matvec() {
        let mut rng = Rng::new(5);
        for ty in TYPES {
            let src = source(&mut rng, ty, 9, 2);
            let m = GGML.encode(&src, "").unwrap();
            let Values::Ggml { bytes, .. } = &src.values else {
                unreachable!()
            };
            let all = to_f32(ty, bytes);
            let mut row = vec![0f32; src.cols];
            for r in 0..src.rows {
                m.row(r, &mut row);
                let want = &all[r * src.cols..(r + 1) * src.cols];
                assert!(
                    row.iter()
                        .zip(want)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{ty} row {r}"
                );
            }
            let n = 3;
            let x: Vec<f32> = (0..n * src.cols).map(|_| rng.normal()).collect();
            let mut y = vec![0f32; n * src.rows];
            m.matmul(&x, n, &mut y);
            for b in 0..n {
                let mut yb = vec![0f32; src.rows];
                m.matvec(&x[b * src.cols..(b + 1) * src.cols], &mut yb);
                assert_eq!(yb, y[b * src.rows..(b + 1) * src.rows], "{ty} vector {b}");
            }
        }
    }

    /// Every kernel (portable, and AVX2 where the CPU has it; f32 activations, and the q8
    /// variant's) against the f64 product of ggml's dequantised rows with the activations the
    /// kernel sees (the q8 variant: those its 8-bit codes stand for), on fresh random blocks of
    /// many shapes; the batched product equals the per-vector one bit for bit on every kernel.
    fn check_kernels(q8: bool, seed: u64) {
        let mut rng = Rng::new(seed);
        for isa in Isa::available() {
            for ty in TYPES {
                for (rows, blocks) in [(1, 1), (2, 5), (7, 3), (40, 2), (5, 9), (150, 3), (300, 2)]
                {
                    let src = source(&mut rng, ty, rows, blocks);
                    let m = GGML.encode_on(&src, isa, q8).unwrap();
                    assert_eq!(m.form().variant, if q8 { Q8 } else { "" });
                    let n = 6;
                    let x: Vec<f32> = (0..n * src.cols).map(|_| rng.normal()).collect();
                    let mut y = vec![0f32; n * rows];
                    m.matmul(&x, n, &mut y);
                    for v in 0..n {
                        let xv = &x[v * src.cols..(v + 1) * src.cols];
                        let act = ActQuant::of(ty);
                        let acts = act.quantise(xv);
                        let seen = match q8 {
                            true => acts.values(),
                            false => xv.to_vec(),
                        };
                        let mut want = reference_matvec(&*m, &seen);
                        if q8 && act == ActQuant::Q8_1 {
                            // Q8_1's offsets multiply its f16 block sums, not the sums of `seen`:
                            // each block's min (the f16 after the scale) times the difference.
                            for (r, w) in want.iter_mut().enumerate() {
                                let Values::Ggml { bytes, .. } = &src.values else {
                                    unreachable!()
                                };
                                let ts = ty.block_layout().1;
                                let row = &bytes.bytes()[r * blocks * ts..];
                                for b in 0..blocks {
                                    let blk = &row[b * ts..];
                                    let mn = half::f16::from_le_bytes([blk[2], blk[3]]).to_f64();
                                    let q: i32 =
                                        acts.q[32 * b..32 * b + 32].iter().map(|&q| q as i32).sum();
                                    *w += mn * (acts.sums[b] as f64 - acts.d[b] as f64 * q as f64);
                                }
                            }
                        }
                        let mut yv = vec![0f32; rows];
                        m.matvec(xv, &mut yv);
                        assert_eq!(yv, y[v * rows..(v + 1) * rows], "{ty} {isa:?} vector {v}");
                        let mut w = vec![0f32; src.cols];
                        let scale = (0..rows)
                            .map(|r| {
                                m.row(r, &mut w);
                                w.iter()
                                    .zip(&seen)
                                    .map(|(&w, &x)| (w as f64 * x as f64).abs())
                                    .sum::<f64>()
                            })
                            .fold(1e-6, f64::max);
                        for (r, (&got, &want)) in yv.iter().zip(&want).enumerate() {
                            assert!(
                                (got as f64 - want).abs() <= 2e-6 * scale,
                                "{ty} {isa:?} q8 {q8} {rows}x{} row {r}: {got} vs {want}",
                                src.cols
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn every_kernel_matches_the_dequantised_reference() {
        check_kernels(false, 77);
    }

    #[test]
    fn every_q8_kernel_matches_the_reference_on_its_activations() {
        check_kernels(true, 78);
    }

    #[test]
    fn activations_quantise_to_the_nearest_code_of_their_block_scale() {
        let mut rng = Rng::new(5);
        for act in [ActQuant::Q8_0, ActQuant::Q8_1, ActQuant::Q8K] {
            let block = if act == ActQuant::Q8K { 256 } else { 32 };
            let mut x: Vec<f32> = (0..4 * block).map(|_| rng.normal() * 3.0).collect();
            x[block..2 * block].fill(0.0); // a block of zeros: scale 0, codes 0
            let a = act.quantise(&x);
            assert_eq!(
                (a.q.len(), a.d.len(), a.sums.len()),
                (x.len(), x.len() / 32, x.len() / 32)
            );
            assert!(a.d[block / 32..2 * block / 32].iter().all(|&d| d == 0.0));
            for (i, (&x, &q)) in x.iter().zip(&a.q).enumerate() {
                let s = a.d[i / 32].abs();
                // Q8_0/Q8_1 round with 127/max|x| and store the scale in f16: within half a
                // code and the scale's rounding.
                let tol = s / 2.0 * (1.0 + 1e-6) + 127.0 * s * 2f32.powi(-11);
                assert!(
                    (x - q as f32 * a.d[i / 32]).abs() <= tol,
                    "{act:?} {i}: {x} {q} {s}"
                );
                assert!(q.unsigned_abs() <= 127);
            }
            // The largest magnitude of each block is ±127.
            for (b, c) in a.q.chunks(block).enumerate().filter(|(b, _)| *b != 1) {
                let m = c.iter().map(|q| q.unsigned_abs()).max();
                assert_eq!(m, Some(127), "{act:?} block {b}");
            }
            // Sums: Q8_1's the f16 of the unrounded scale times the codes' sum.
            for (g, q) in a.q.chunks(32).enumerate() {
                let sum = q.iter().map(|&q| q as i32).sum::<i32>() as f32;
                let amax = x[32 * g..32 * g + 32]
                    .iter()
                    .fold(0f32, |m, v| m.max(v.abs()));
                match act {
                    ActQuant::Q8_1 => assert_eq!(a.sums[g], f16_round(amax / 127.0 * sum)),
                    _ => assert_eq!(a.sums[g], a.d[g] * sum),
                }
            }
        }
        // ggml's values: Q8_K's scale is −max/127 for the value of largest magnitude (here −2),
        // Q8_0's f16(max|x|/127); halves round to even.
        let mut x = vec![0f32; 256];
        x[0] = -2.0;
        x[1] = 1.0;
        let k = ActQuant::Q8K.quantise(&x);
        assert_eq!((k.d[0], k.q[0], k.q[1]), (1.0 / (-127.0 / -2.0), -127, 64));
        let mut y = vec![0f32; 32];
        y[0] = 127.0;
        y[1] = 2.5;
        y[2] = -0.5;
        let z = ActQuant::Q8_0.quantise(&y);
        assert_eq!((z.d[0], z.q[1], z.q[2]), (1.0, 2, 0));
    }

    #[test]
    fn rows_that_are_not_whole_blocks_are_refused() {
        let src = Source::new(
            2,
            16,
            Values::Ggml {
                ty: GgmlType::Q4_0,
                bytes: BlockBytes::from_vec(vec![0; 18]),
            },
        )
        .unwrap();
        let err = GGML.encode(&src, "").err().unwrap().to_string();
        assert!(err.contains("whole Q4_0 blocks"), "{err}");
    }
}
