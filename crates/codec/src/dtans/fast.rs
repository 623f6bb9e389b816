//! The fast CPU decode-matvec of dtANS-coded codes that carry no raw bytes (integer, FP8 and FP4
//! codes: `compress --quantizer int|fp8`'s matrices, GGUF codes with group scales). It follows the
//! reference ([`DtansTensor::matvec`]) step for step but decodes a tile's 32 lanes together and
//! multiplies as it decodes: every lane of a tile is a row and every symbol position a column, so
//! a symbol's codes, across the lanes, meet one activation. Per band of 32 rows it keeps one sum
//! per lane for the current column group and folds it into the row's output at the group's end
//! (scale · Σ q·x + (min − scale · offset) · Σ x), so the group scales cost once a group, not
//! once a weight. Escapes are added afterwards, as their difference from the zero code they were
//! decoded as.
//!
//! Two implementations: a portable one (the scalar reference of the SIMD one, and the fallback)
//! and an AVX-512 one chosen at run time: the 32 lanes are two vectors of 16 states, the table
//! lookups are gathers, the mixed-radix accumulators four vectors of eight u64, and the words a
//! step reads go to the lanes that need them by an expanding load (the warp's read order).
//! Reads are checked as the reference checks them (corrupt input is an error, never a read out of
//! bounds).

use super::decode::{corrupt, lanes, ChunkReader};
use super::*;
use crate::matvec::Dequant;
use rayon::prelude::*;

/// How a code becomes the number it multiplies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
enum Value {
    /// Two's complement integer of `code_bits` bits.
    Signed = 0,
    Unsigned = 1,
    /// E4M3 as an FP16 number 2^-8 times its value (the exponent field moved down; exact,
    /// subnormals included); tables with NaN codes are left to the reference.
    Fp8E4m3 = 2,
    /// E5M2 is the high byte of an FP16.
    Fp8E5m2 = 3,
    Fp4 = 4,
}

/// A coded tensor's decoder table, built once, for [`CpuProduct::matvec`].
#[derive(Clone, Debug)]
pub struct CpuProduct {
    g: Geometry,
    entries: Vec<u32>,
    code_bits: u32,
    payload: Payload,
    /// The table codes an FP8 NaN (E4M3 has no FP16 twin for it).
    nan_codes: bool,
}

/// Whether this CPU runs the AVX-512 kernel (detected once).
pub fn avx512() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static F: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *F.get_or_init(|| is_x86_feature_detected!("avx512f"))
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// One band's sums: the current group's per lane, the rows' outputs, and the group scales of the
/// band's rows transposed (group-major, 32 lanes each; zero for rows past the matrix).
struct Band<'a> {
    q: [f32; LANES],
    y: [f32; LANES],
    /// Escapes' corrections.
    fix: [f32; LANES],
    scale: Vec<f32>,
    shift: Vec<f32>,
    /// Σ x over each group.
    xsum: &'a [f32],
    group: usize,
    cols: usize,
    /// The group being summed and the column where it ends (`usize::MAX` for the last one, which
    /// ends with the band).
    gi: usize,
    next: usize,
}

impl Band<'_> {
    fn boundary(&self, gi: usize) -> usize {
        match (gi + 1) * self.group < self.cols {
            true => (gi + 1) * self.group,
            false => usize::MAX,
        }
    }

    fn flush(&mut self) {
        let (s, c) = (
            &self.scale[self.gi * LANES..][..LANES],
            &self.shift[self.gi * LANES..][..LANES],
        );
        let xs = self.xsum[self.gi];
        for l in 0..LANES {
            self.y[l] += s[l] * self.q[l] + c[l] * xs;
            self.q[l] = 0.0;
        }
        self.gi += 1;
        self.next = self.boundary(self.gi);
    }
}

impl CpuProduct {
    /// `None` where the payload carries raw bytes (BF16, FP16: the reference multiplies those).
    pub fn new(t: &DtansTensor) -> Result<Option<CpuProduct>> {
        if t.payload.has_raw() {
            return Ok(None);
        }
        t.validate()?;
        let entries = t.table.decoder_entries();
        let g = t.geometry()?;
        if entries.len() != 1 << t.coding.log2_m {
            return Err(corrupt("the table does not fill its slots"));
        }
        let cb = t.payload.code_bits();
        let nan_codes = t.payload == Payload::Fp8E4m3
            && t.table
                .symbols
                .iter()
                .any(|&s| (0..g.k).any(|j| (s as u32 >> (j as u32 * cb)) & 0x7F == 0x7F));
        Ok(Some(CpuProduct {
            g,
            entries,
            code_bits: cb,
            payload: t.payload,
            nan_codes,
        }))
    }

    fn value_kind(&self, signed: bool) -> Option<Value> {
        Some(match self.payload {
            Payload::Int(_) if signed => Value::Signed,
            Payload::Int(_) => Value::Unsigned,
            Payload::Fp8E4m3 if !self.nan_codes => Value::Fp8E4m3,
            Payload::Fp8E5m2 => Value::Fp8E5m2,
            Payload::Fp4E2m1 => Value::Fp4,
            _ => return None,
        })
    }

    /// y = W·x with `dequant` (as [`DtansTensor::matvec`], which it falls back to where it does
    /// not apply: a group boundary inside a symbol, NaN FP8 codes). `simd`: the AVX-512 kernel
    /// where the CPU has it, else the portable one. `t` is the tensor this was made from.
    pub fn matvec(
        &self,
        t: &DtansTensor,
        x: &[f32],
        y: &mut [f32],
        dequant: &Dequant,
        simd: bool,
    ) -> Result<()> {
        let g = &self.g;
        g.check_matvec(x, y, dequant)?;
        let (group, signed) = match *dequant {
            Dequant::None => (g.cols, false),
            Dequant::Groups { group, signed, .. } => (group, signed),
        };
        let kind = self.value_kind(signed);
        let Some(kind) = kind.filter(|_| group >= g.cols || group.is_multiple_of(g.k)) else {
            return t.matvec(x, y, dequant);
        };
        let groups = g.cols.div_ceil(group);
        let xsum: Vec<f32> = x.chunks(group).map(|c| c.iter().sum()).collect();
        let mut xp = vec![0f32; g.slices * g.sc];
        xp[..g.cols].copy_from_slice(x);
        let simd = simd && avx512();
        y.par_chunks_mut(LANES)
            .enumerate()
            .try_for_each(|(band, ys)| {
                let mut b = Band {
                    q: [0.0; LANES],
                    y: [0.0; LANES],
                    fix: [0.0; LANES],
                    scale: vec![0.0; groups * LANES],
                    shift: vec![0.0; groups * LANES],
                    xsum: &xsum,
                    group,
                    cols: g.cols,
                    gi: 0,
                    next: 0,
                };
                b.next = b.boundary(0);
                for lane in 0..ys.len() {
                    let row = band * LANES + lane;
                    for gi in 0..groups {
                        let (s, c) = match *dequant {
                            Dequant::None => (1.0, 0.0),
                            Dequant::Groups {
                                scales,
                                mins,
                                offset,
                                ..
                            } => {
                                let i = row * groups + gi;
                                let s = scales[i];
                                (s, mins.map_or(0.0, |m| m[i]) - s * offset)
                            }
                        };
                        b.scale[gi * LANES + lane] = s;
                        b.shift[gi * LANES + lane] = c;
                    }
                }
                for slice in 0..g.slices {
                    let tile = slice * g.bands + band;
                    self.tile(t, tile, &xp, x, kind, dequant, simd, &mut b)
                        .map_err(|e| match e {
                            CodecError::Corrupt(m) => CodecError::Corrupt(format!(
                                "tile {tile} (rows {}.., columns {}..): {m}",
                                band * LANES,
                                slice * g.sc
                            )),
                            e => e,
                        })?;
                }
                b.flush();
                for (l, y) in ys.iter_mut().enumerate() {
                    *y = b.y[l] + b.fix[l];
                }
                Ok(())
            })
    }

    #[allow(clippy::too_many_arguments)]
    fn tile(
        &self,
        t: &DtansTensor,
        tile: usize,
        xp: &[f32],
        x: &[f32],
        kind: Value,
        dequant: &Dequant,
        simd: bool,
        b: &mut Band,
    ) -> Result<()> {
        let g = &self.g;
        let (row0, col0) = g.tile_origin(tile);
        let start = t.tiles[2 * tile] as usize;
        let end = t
            .tiles
            .get(2 * tile + 2)
            .map_or(t.stream.len(), |&o| o as usize);
        let s = t
            .stream
            .get(start..end)
            .filter(|s| s.len() > PROLOGUE_WORDS)
            .ok_or_else(|| corrupt("the tile's stream is out of order"))?;
        let mut reader = ChunkReader::new(&s[PROLOGUE_WORDS..])?;
        let comp = &t.companion[tile * LANES * g.companion_words..][..LANES * g.companion_words];
        let xs = &xp[col0..col0 + g.sc];
        let mut words = Vec::with_capacity(LANES);
        #[cfg(target_arch = "x86_64")]
        if simd {
            // SAFETY: `simd` is set only where the CPU has AVX-512F ([`avx512`]).
            unsafe {
                match (kind, g.k) {
                    (Value::Signed, 1) => {
                        self.main_avx512::<0, 1>(s, comp, &mut reader, xs, col0, b)
                    }
                    (Value::Signed, 2) => {
                        self.main_avx512::<0, 2>(s, comp, &mut reader, xs, col0, b)
                    }
                    (Value::Signed, _) => {
                        self.main_avx512::<0, 4>(s, comp, &mut reader, xs, col0, b)
                    }
                    (Value::Unsigned, 1) => {
                        self.main_avx512::<1, 1>(s, comp, &mut reader, xs, col0, b)
                    }
                    (Value::Unsigned, 2) => {
                        self.main_avx512::<1, 2>(s, comp, &mut reader, xs, col0, b)
                    }
                    (Value::Unsigned, _) => {
                        self.main_avx512::<1, 4>(s, comp, &mut reader, xs, col0, b)
                    }
                    (Value::Fp8E4m3, 1) => {
                        self.main_avx512::<2, 1>(s, comp, &mut reader, xs, col0, b)
                    }
                    (Value::Fp8E4m3, _) => {
                        self.main_avx512::<2, 2>(s, comp, &mut reader, xs, col0, b)
                    }
                    (Value::Fp8E5m2, 1) => {
                        self.main_avx512::<3, 1>(s, comp, &mut reader, xs, col0, b)
                    }
                    (Value::Fp8E5m2, _) => {
                        self.main_avx512::<3, 2>(s, comp, &mut reader, xs, col0, b)
                    }
                    (Value::Fp4, 1) => self.main_avx512::<4, 1>(s, comp, &mut reader, xs, col0, b),
                    (Value::Fp4, 2) => self.main_avx512::<4, 2>(s, comp, &mut reader, xs, col0, b),
                    (Value::Fp4, _) => self.main_avx512::<4, 4>(s, comp, &mut reader, xs, col0, b),
                }?
            }
        } else {
            self.main_scalar(s, comp, &mut reader, &mut words, xs, col0, kind, b)?;
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = simd;
            self.main_scalar(s, comp, &mut reader, &mut words, xs, col0, kind, b)?;
        }
        // Escapes: decoded as the zero code, corrected by their difference from it.
        let dequant = &dequant;
        super::decode::read_escapes(
            g,
            t.tiles[2 * tile + 1],
            (row0, col0),
            &mut reader,
            &mut words,
            |lane, col, rec| {
                let (row, c) = (row0 + lane, col0 + col);
                let (code, raw) = self.payload.split_element(rec);
                let w = |code| {
                    dequant.apply(self.payload, row, c, g.cols, self.payload.to_f32(code, raw))
                };
                b.fix[lane] += (w(code) - w(self.payload.zero_code())) * x[c];
            },
        )?;
        reader.finish()?;
        Ok(())
    }

    /// The portable main loop: the tile's quartets, every lane's four symbols, multiplied as they
    /// are decoded.
    #[allow(clippy::too_many_arguments)]
    fn main_scalar(
        &self,
        s: &[u32],
        comp: &[u32],
        reader: &mut ChunkReader,
        words: &mut Vec<u32>,
        xs: &[f32],
        col0: usize,
        kind: Value,
        b: &mut Band,
    ) -> Result<()> {
        let g = &self.g;
        let (cb, cbits) = (self.code_bits, g.companion_bits_per_symbol);
        let mut x: [u64; LANES] = std::array::from_fn(|l| s[l] as u64);
        let mut w: [u32; LANES] = std::array::from_fn(|l| s[LANES + l]);
        let mut e = [[0u32; LANES]; 4];
        let mask = (1u32 << cb) - 1;
        let value = |p: u32| -> f32 {
            match kind {
                Value::Signed => (((p << (32 - cb)) as i32) >> (32 - cb)) as f32,
                Value::Unsigned => p as f32,
                Value::Fp8E4m3 => crate::payload::fp8_e4m3_to_f32(p as u8),
                Value::Fp8E5m2 => half::f16::from_bits((p as u16) << 8).to_f32(),
                Value::Fp4 => crate::payload::fp4_e2m1_to_f32(p as u8),
            }
        };
        for q in 0..g.quartets {
            let bit = q * 4 * cbits as usize;
            for lane in 0..LANES {
                let cw = super::decode::companion_word(comp, bit, lane, cbits);
                let (mut big_r, mut d) = (1u64, 0u64);
                for (i, e) in e.iter_mut().enumerate() {
                    let hi = (cw >> (i as u32 * cbits)) & ((1 << cbits) - 1);
                    let v = self.entries[(((w[lane] >> (8 * i)) & 0xFF) | hi << 8) as usize];
                    big_r *= (v & 0xFF) as u64;
                    d = d * (v & 0xFF) as u64 + ((v >> 8) & 0xFF) as u64;
                    e[lane] = v >> 16;
                }
                x[lane] = x[lane] * big_r + d;
            }
            for (i, e) in e.iter().enumerate() {
                let c = (4 * q + i) * g.k;
                for j in 0..g.k {
                    let xv = xs[c + j];
                    for (acc, &e) in b.q.iter_mut().zip(e) {
                        *acc += value((e >> (j as u32 * cb)) & mask) * xv;
                    }
                }
                if col0 + c + g.k == b.next {
                    b.flush();
                }
            }
            if q + 1 < g.quartets {
                let mut need = 0u32;
                for lane in 0..LANES {
                    if x[lane] >> 32 != 0 {
                        w[lane] = x[lane] as u32;
                        x[lane] >>= 32;
                    } else {
                        need |= 1 << lane;
                    }
                }
                reader.read(q as u32, need.count_ones() as usize, words)?;
                for (lane, &v) in lanes(need).zip(words.iter()) {
                    w[lane] = v;
                }
            }
        }
        Ok(())
    }

    /// [`Self::main_scalar`] on AVX-512: `KIND` is a [`Value`], `K` the codes a symbol.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    unsafe fn main_avx512<const KIND: u8, const K: usize>(
        &self,
        s: &[u32],
        comp: &[u32],
        reader: &mut ChunkReader,
        xs: &[f32],
        col0: usize,
        b: &mut Band,
    ) -> Result<()> {
        use std::arch::x86_64::*;
        let g = &self.g;
        let (cb, cbits) = (self.code_bits, g.companion_bits_per_symbol);
        let sp = s.as_ptr();
        // Accumulators: lanes 0–7, 8–15, 16–23, 24–31.
        let mut x = [
            _mm512_cvtepu32_epi64(_mm256_loadu_si256(sp as *const __m256i)),
            _mm512_cvtepu32_epi64(_mm256_loadu_si256(sp.add(8) as *const __m256i)),
            _mm512_cvtepu32_epi64(_mm256_loadu_si256(sp.add(16) as *const __m256i)),
            _mm512_cvtepu32_epi64(_mm256_loadu_si256(sp.add(24) as *const __m256i)),
        ];
        // State words: lanes 0–15, 16–31.
        let mut w = [
            _mm512_loadu_si512(sp.add(LANES) as *const _),
            _mm512_loadu_si512(sp.add(LANES + 16) as *const _),
        ];
        let mut qs = [
            _mm512_loadu_ps(b.q.as_ptr()),
            _mm512_loadu_ps(b.q.as_ptr().add(16)),
        ];
        let mut ys = [
            _mm512_loadu_ps(b.y.as_ptr()),
            _mm512_loadu_ps(b.y.as_ptr().add(16)),
        ];
        let byte = _mm512_set1_epi32(0xFF);
        let cmask = _mm512_set1_epi32((1 << cbits) - 1);
        let entries = self.entries.as_ptr() as *const i32;
        let fp4 = _mm512_setr_ps(
            0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
        );
        let code_mask = _mm512_set1_epi32((1 << cb) - 1);
        // FP8 E4M3 values come out 2^-8 times too small; the activation carries the 2^8.
        let xscale = if KIND == Value::Fp8E4m3 as u8 {
            256.0
        } else {
            1.0
        };
        for q in 0..g.quartets {
            let bit = q * 4 * cbits as usize;
            let cw = if cbits > 0 {
                let c = comp.as_ptr().add((bit / 32) * LANES);
                let sh = _mm_cvtsi32_si128((bit % 32) as i32);
                [
                    _mm512_srl_epi32(_mm512_loadu_si512(c as *const _), sh),
                    _mm512_srl_epi32(_mm512_loadu_si512(c.add(16) as *const _), sh),
                ]
            } else {
                [_mm512_setzero_si512(); 2]
            };
            let mut e = [[_mm512_setzero_si512(); 2]; 4];
            for (i, e) in e.iter_mut().enumerate() {
                for h in 0..2 {
                    let lo = _mm512_and_si512(
                        _mm512_srl_epi32(w[h], _mm_cvtsi32_si128(8 * i as i32)),
                        byte,
                    );
                    let hi = _mm512_and_si512(
                        _mm512_srl_epi32(cw[h], _mm_cvtsi32_si128((i as u32 * cbits) as i32)),
                        cmask,
                    );
                    let idx = _mm512_or_si512(lo, _mm512_slli_epi32::<8>(hi));
                    e[h] = _mm512_i32gather_epi32::<4>(idx, entries);
                }
            }
            for h in 0..2 {
                let r = |i: usize| _mm512_and_si512(e[i][h], byte);
                let d = |i: usize| _mm512_and_si512(_mm512_srli_epi32::<8>(e[i][h]), byte);
                let (r0, r1, r2, r3) = (r(0), r(1), r(2), r(3));
                let big_r =
                    _mm512_mullo_epi32(_mm512_mullo_epi32(r0, r1), _mm512_mullo_epi32(r2, r3));
                let mut dd = _mm512_add_epi32(_mm512_mullo_epi32(d(0), r1), d(1));
                dd = _mm512_add_epi32(_mm512_mullo_epi32(dd, r2), d(2));
                dd = _mm512_add_epi32(_mm512_mullo_epi32(dd, r3), d(3));
                for part in 0..2 {
                    let (rr, d64) = match part {
                        0 => (
                            _mm512_cvtepu32_epi64(_mm512_castsi512_si256(big_r)),
                            _mm512_cvtepu32_epi64(_mm512_castsi512_si256(dd)),
                        ),
                        _ => (
                            _mm512_cvtepu32_epi64(_mm512_extracti64x4_epi64::<1>(big_r)),
                            _mm512_cvtepu32_epi64(_mm512_extracti64x4_epi64::<1>(dd)),
                        ),
                    };
                    let xi = &mut x[2 * h + part];
                    *xi = _mm512_add_epi64(_mm512_mul_epu32(*xi, rr), d64);
                }
            }
            for (i, e) in e.iter().enumerate() {
                let c = (4 * q + i) * K;
                for j in 0..K {
                    let xv = _mm512_set1_ps(*xs.get_unchecked(c + j) * xscale);
                    for h in 0..2 {
                        let p =
                            _mm512_srl_epi32(e[h], _mm_cvtsi32_si128((16 + j as u32 * cb) as i32));
                        let v = match KIND {
                            0 => {
                                let up = _mm_cvtsi32_si128((32 - cb) as i32);
                                _mm512_cvtepi32_ps(_mm512_sra_epi32(_mm512_sll_epi32(p, up), up))
                            }
                            1 => _mm512_cvtepi32_ps(_mm512_and_si512(p, code_mask)),
                            2 => {
                                // sign to bit 15, exponent and mantissa to bits 7..14.
                                let p = _mm512_and_si512(p, byte);
                                let h16 = _mm512_or_si512(
                                    _mm512_slli_epi32::<7>(_mm512_and_si512(
                                        p,
                                        _mm512_set1_epi32(0x7F),
                                    )),
                                    _mm512_slli_epi32::<8>(_mm512_and_si512(
                                        p,
                                        _mm512_set1_epi32(0x80),
                                    )),
                                );
                                _mm512_cvtph_ps(_mm512_cvtepi32_epi16(h16))
                            }
                            3 => _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_slli_epi32::<8>(
                                _mm512_and_si512(p, byte),
                            ))),
                            _ => _mm512_permutexvar_ps(_mm512_and_si512(p, code_mask), fp4),
                        };
                        qs[h] = _mm512_fmadd_ps(v, xv, qs[h]);
                    }
                }
                if col0 + c + K == b.next {
                    let gi = b.gi;
                    let xsum = _mm512_set1_ps(b.xsum[gi]);
                    for h in 0..2 {
                        let sv = _mm512_loadu_ps(b.scale.as_ptr().add(gi * LANES + 16 * h));
                        let cv = _mm512_loadu_ps(b.shift.as_ptr().add(gi * LANES + 16 * h));
                        ys[h] = _mm512_fmadd_ps(cv, xsum, _mm512_fmadd_ps(sv, qs[h], ys[h]));
                        qs[h] = _mm512_setzero_ps();
                    }
                    b.gi += 1;
                    b.next = b.boundary(b.gi);
                }
            }
            if q + 1 < g.quartets {
                let mut big = [0u8; 4];
                for (m, xi) in big.iter_mut().zip(x.iter_mut()) {
                    let hi = _mm512_srli_epi64::<32>(*xi);
                    *m = _mm512_test_epi64_mask(hi, hi);
                }
                for h in 0..2 {
                    let m = big[2 * h] as u16 | (big[2 * h + 1] as u16) << 8;
                    let low = _mm512_inserti64x4::<1>(
                        _mm512_castsi256_si512(_mm512_cvtepi64_epi32(x[2 * h])),
                        _mm512_cvtepi64_epi32(x[2 * h + 1]),
                    );
                    w[h] = _mm512_mask_mov_epi32(w[h], m, low);
                }
                for (m, xi) in big.iter().zip(x.iter_mut()) {
                    *xi = _mm512_mask_srli_epi64::<32>(*xi, *m, *xi);
                }
                let need = !(big[0] as u32
                    | (big[1] as u32) << 8
                    | (big[2] as u32) << 16
                    | (big[3] as u32) << 24);
                let n = need.count_ones() as usize;
                let mut copied = [0u32; LANES];
                let words: *const u32 = match reader.contiguous(q as u32, n) {
                    Some(ws) => ws.as_ptr(),
                    None => {
                        let mut v = Vec::with_capacity(LANES);
                        reader.read(q as u32, n, &mut v)?;
                        copied[..n].copy_from_slice(&v);
                        copied.as_ptr()
                    }
                };
                let (m0, m1) = (need as u16, (need >> 16) as u16);
                w[0] = _mm512_mask_expandloadu_epi32(w[0], m0, words as *const _);
                w[1] = _mm512_mask_expandloadu_epi32(
                    w[1],
                    m1,
                    words.add(m0.count_ones() as usize) as *const _,
                );
            }
        }
        _mm512_storeu_ps(b.q.as_mut_ptr(), qs[0]);
        _mm512_storeu_ps(b.q.as_mut_ptr().add(16), qs[1]);
        _mm512_storeu_ps(b.y.as_mut_ptr(), ys[0]);
        _mm512_storeu_ps(b.y.as_mut_ptr().add(16), ys[1]);
        Ok(())
    }
}
