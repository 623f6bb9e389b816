//! AVX2 decode of a tile's full steps, bit for bit the scalar decode ([`super::tcq`],
//! [`super::e8`]), which stays the reference and does each tile's ragged last step.
//!
//! The 32 lanes are four vectors of eight. A step gathers each lane's slot entry (one 64-bit entry
//! holds the frequency, the bias and the symbol's value, so a lane's symbol costs one load), and
//! TCQ gathers the lanes' next trellis states. Renormalisation takes the words of the lanes below
//! 2^16 in lane order, as the scalar reader does: per vector of eight, a mask of those lanes, one
//! unaligned load of the next eight words, and a permutation that hands the i-th of them to the
//! i-th masked lane (ryg_rans' SIMD word decoder). Loads only run while a whole step's words (32)
//! remain; nearer a tile's end the step renormalises with the scalar reader, so a truncated or
//! corrupt payload gives the scalar errors and nothing is read out of bounds.

use super::rans::{self, DecodeTable, Reader, LANES, STATE_MIN};
use crate::{CodecError, Result};
use std::arch::x86_64::*;
use std::sync::OnceLock;

/// Whether this CPU has AVX2 (detected once).
pub fn available() -> bool {
    static AVX2: OnceLock<bool> = OnceLock::new();
    *AVX2.get_or_init(|| is_x86_feature_detected!("avx2"))
}

/// A [`super::Decoder`]'s tables laid out for gathers.
pub struct Flat {
    prob_bits: u8,
    /// Table `t`'s slot `s` at `t · 2^prob_bits + s`: `(freq − 1) | bias << 16` in the low half, the
    /// symbol's value (table min added) in the high half.
    entries: Vec<u64>,
    /// TCQ's trellis as its feedback encoder; none for E8 (or a next-state table the encoder does
    /// not reproduce: then TCQ stays scalar).
    trellis: Option<Trellis>,
}

/// A trellis of 2^ν states whose next state is `(s >> 1 ⊕ z1·h1 ⊕ z0·h0) | z0 << (ν − 1)` with
/// z0 = s & 1 (the systematic feedback encoder of [`super::tcq`]): a few instructions instead of a
/// gather, off the critical path of the next step's table lookup.
#[derive(Clone, Copy)]
struct Trellis {
    h0: u32,
    h1: u32,
    top: u32,
}

impl Trellis {
    fn next(&self, s: u32, z1: u32) -> u32 {
        let z0 = s & 1;
        (s >> 1 ^ (self.h1 & 0u32.wrapping_sub(z1)) ^ (self.h0 & 0u32.wrapping_sub(z0)))
            | z0 << self.top
    }

    /// The encoder of `next[2·s + z1]`, if it is one.
    fn of(next: &[u16]) -> Option<Trellis> {
        let states = next.len() / 2;
        if states < 2 || !states.is_power_of_two() || next.len() != 2 * states {
            return None;
        }
        let top = states.trailing_zeros() - 1;
        let low = (1u32 << top) - 1;
        let t = Trellis {
            h0: next[2] as u32 & low,
            h1: next[1] as u32,
            top,
        };
        (0..2 * states)
            .all(|i| t.next((i / 2) as u32, (i & 1) as u32) == next[i] as u32)
            .then_some(t)
    }
}

impl Flat {
    pub fn new(tables: &[DecodeTable], prob_bits: u8, next: Option<&[u16]>) -> Flat {
        let m = 1usize << prob_bits.min(*rans::PROB_BITS.end());
        let mut entries = Vec::with_capacity(tables.len() * m);
        for t in tables {
            for s in 0..m {
                let (e, b) = (
                    t.slot.get(s).copied().unwrap_or(0),
                    t.bias.get(s).copied().unwrap_or(0),
                );
                let value = t.min.wrapping_add((e & 0xFFFF) as i32);
                entries.push((e >> 16 | (b as u32) << 16) as u64 | ((value as u32 as u64) << 32));
            }
        }
        Flat {
            prob_bits,
            entries,
            trellis: next.and_then(Trellis::of),
        }
    }

    /// Whether `tables` tables of full slots are here at a precision the decoder takes (else the
    /// scalar decoder does the whole tile, as it always could).
    fn usable(&self, tables: usize) -> bool {
        rans::PROB_BITS.contains(&self.prob_bits)
            && self.entries.len() >= tables << self.prob_bits
            && self.entries.len() <= i32::MAX as usize
    }

    /// TCQ's full steps of `out` (the first `out.len() / 32 · 32` points), from states `x` and trellis
    /// states `state`, both left where the scalar decoder continues. Returns the points decoded.
    pub fn tcq(
        &self,
        x: &mut [u32; LANES],
        state: &mut [u32; LANES],
        r: &mut Reader,
        out: &mut [f32],
    ) -> Result<usize> {
        let Some(t) = self.trellis.filter(|_| available() && self.usable(2)) else {
            return Ok(0);
        };
        // SAFETY: the CPU has AVX2 (checked above).
        unsafe { tcq_avx2(self, t, x, state, r, out) }
    }

    /// E8's full groups of `out` (32 blocks of eight), as [`Flat::tcq`].
    pub fn e8(&self, x: &mut [u32; LANES], r: &mut Reader, out: &mut [f32]) -> Result<usize> {
        if !available() || !self.usable(super::e8::TABLES) {
            return Ok(0);
        }
        // SAFETY: the CPU has AVX2 (checked above).
        unsafe { e8_avx2(self, x, r, out) }
    }
}

/// Per mask of eight lanes, the word each masked lane takes (its rank among the masked lanes),
/// one byte a lane.
const PERM: [u64; 256] = {
    let mut t = [0u64; 256];
    let mut m = 0;
    while m < 256 {
        let (mut k, mut i, mut v) = (0u64, 0, 0u64);
        while i < 8 {
            if m >> i & 1 == 1 {
                v |= k << (8 * i);
                k += 1;
            }
            i += 1;
        }
        t[m] = v;
        m += 1;
    }
    t
};

#[target_feature(enable = "avx2")]
fn load4(a: &[u32; LANES]) -> [__m256i; 4] {
    let mut x = [_mm256_setzero_si256(); 4];
    for (v, x) in x.iter_mut().enumerate() {
        // SAFETY: each load reads 8 of the array's 32 u32s, unaligned loads allowed.
        *x = unsafe { _mm256_loadu_si256(a.as_ptr().add(8 * v).cast()) };
    }
    x
}

#[target_feature(enable = "avx2")]
fn store4(a: &mut [u32; LANES], x: &[__m256i; 4]) {
    for (v, x) in x.iter().enumerate() {
        // SAFETY: each store writes 8 of the array's 32 u32s, unaligned stores allowed.
        unsafe { _mm256_storeu_si256(a.as_mut_ptr().add(8 * v).cast(), *x) };
    }
}

/// Each lane's entry at `idx`: (frequency − 1 | bias << 16, value). Lanes are gathered as
/// (0, 1, 4, 5) and (2, 3, 6, 7) so that one shuffle per half puts them back in order.
#[target_feature(enable = "avx2")]
fn entries(f: &Flat, idx: __m256i) -> (__m256i, __m256i) {
    let p = _mm256_permutevar8x32_epi32(idx, _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7));
    let base = f.entries.as_ptr() as *const i64;
    // SAFETY: callers form idx as table << prob_bits | (state & mask) with table below the tables
    // `usable` checked are there, so every index is within `entries`.
    let (g0, g1) = unsafe {
        (
            _mm256_i32gather_epi64::<8>(base, _mm256_castsi256_si128(p)),
            _mm256_i32gather_epi64::<8>(base, _mm256_extracti128_si256::<1>(p)),
        )
    };
    let (g0, g1) = (_mm256_castsi256_ps(g0), _mm256_castsi256_ps(g1));
    (
        _mm256_castps_si256(_mm256_shuffle_ps::<0b10_00_10_00>(g0, g1)),
        _mm256_castps_si256(_mm256_shuffle_ps::<0b11_01_11_01>(g0, g1)),
    )
}

/// One decode step of a vector: the new states from the lanes' entries (`x = f·(x >> b) + bias`).
#[target_feature(enable = "avx2")]
fn advance(x: __m256i, a: __m256i, cnt: __m128i) -> __m256i {
    let freq = _mm256_add_epi32(
        _mm256_and_si256(a, _mm256_set1_epi32(0xFFFF)),
        _mm256_set1_epi32(1),
    );
    _mm256_add_epi32(
        _mm256_mullo_epi32(freq, _mm256_srl_epi32(x, cnt)),
        _mm256_srli_epi32::<16>(a),
    )
}

/// After a step: each lane below 2^16 takes the next word, in lane order.
#[target_feature(enable = "avx2")]
fn renorm(x: &mut [__m256i; 4], r: &mut Reader) -> Result<()> {
    if r.words.len().saturating_sub(r.pos) < LANES {
        let mut a = [0u32; LANES];
        store4(&mut a, x);
        rans::renorm(&mut a, LANES, r)?;
        *x = load4(&a);
        return Ok(());
    }
    let mut pos = r.pos;
    let min = _mm256_set1_epi32(STATE_MIN as i32);
    for x in x.iter_mut() {
        // States are unsigned: x < 2^16 exactly where max(x, 2^16) ≠ x.
        let need = _mm256_xor_si256(
            _mm256_cmpeq_epi32(_mm256_max_epu32(*x, min), *x),
            _mm256_set1_epi32(-1),
        );
        let m = _mm256_movemask_ps(_mm256_castsi256_ps(need)) as usize & 0xFF;
        // SAFETY: 32 words remained at the step's start and each vector before this one took at
        // most 8, so words[pos..pos + 8] is in bounds.
        let w = unsafe { _mm_loadu_si128(r.words.as_ptr().add(pos).cast()) };
        let perm = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(PERM[m] as i64));
        let w = _mm256_permutevar8x32_epi32(_mm256_cvtepu16_epi32(w), perm);
        let refill = _mm256_or_si256(_mm256_slli_epi32::<16>(*x), w);
        *x = _mm256_blendv_epi8(*x, refill, need);
        pos += m.count_ones() as usize;
    }
    r.pos = pos;
    Ok(())
}

/// [`Flat::tcq`]'s work.
#[target_feature(enable = "avx2")]
fn tcq_avx2(
    f: &Flat,
    t: Trellis,
    x: &mut [u32; LANES],
    state: &mut [u32; LANES],
    r: &mut Reader,
    out: &mut [f32],
) -> Result<usize> {
    let b = f.prob_bits as i32;
    let cnt = _mm_cvtsi32_si128(b);
    let mask = _mm256_set1_epi32((1 << b) - 1);
    let one = _mm256_set1_epi32(1);
    let (h0, h1) = (
        _mm256_set1_epi32(t.h0 as i32),
        _mm256_set1_epi32(t.h1 as i32),
    );
    let top = _mm_cvtsi32_si128(t.top as i32);
    let zero = _mm256_setzero_si256();
    let mut xv = load4(x);
    let mut sv = load4(state);
    let steps = out.len() / LANES;
    for o in out.chunks_exact_mut(LANES) {
        for (v, o) in o.chunks_exact_mut(8).enumerate() {
            let s = sv[v];
            let z0 = _mm256_and_si256(s, one);
            let idx = _mm256_or_si256(_mm256_sll_epi32(z0, cnt), _mm256_and_si256(xv[v], mask));
            let (a, k) = entries(f, idx);
            xv[v] = advance(xv[v], a, cnt);
            let p = _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_add_epi32(k, k), z0));
            // SAFETY: `o` holds 8 floats.
            unsafe { _mm256_storeu_ps(o.as_mut_ptr(), p) };
            let z1 = _mm256_and_si256(k, one);
            let n = _mm256_xor_si256(
                _mm256_srli_epi32::<1>(s),
                _mm256_xor_si256(
                    _mm256_and_si256(h1, _mm256_sub_epi32(zero, z1)),
                    _mm256_and_si256(h0, _mm256_sub_epi32(zero, z0)),
                ),
            );
            sv[v] = _mm256_or_si256(n, _mm256_sll_epi32(z0, top));
        }
        renorm(&mut xv, r)?;
    }
    store4(x, &xv);
    store4(state, &sv);
    Ok(steps * LANES)
}

/// [`Flat::e8`]'s work.
#[target_feature(enable = "avx2")]
fn e8_avx2(f: &Flat, x: &mut [u32; LANES], r: &mut Reader, out: &mut [f32]) -> Result<usize> {
    use super::e8::DIM;
    let b = f.prob_bits as i32;
    let cnt = _mm_cvtsi32_si128(b);
    let mask = _mm256_set1_epi32((1 << b) - 1);
    let one = _mm256_set1_epi32(1);
    let mut xv = load4(x);
    let groups = out.len() / (LANES * DIM);
    for o in out.chunks_exact_mut(LANES * DIM) {
        let mut c = [_mm256_setzero_si256(); 4];
        for (v, c) in c.iter_mut().enumerate() {
            let (a, k) = entries(f, _mm256_and_si256(xv[v], mask));
            xv[v] = advance(xv[v], a, cnt);
            *c = k;
        }
        renorm(&mut xv, r)?;
        // Cosets index tables: anything but 0 or 1 is damage, as in the scalar decoder.
        let mut ok = _mm256_set1_epi32(-1);
        for c in &c {
            ok = _mm256_and_si256(ok, _mm256_cmpeq_epi32(_mm256_max_epu32(*c, one), one));
        }
        if _mm256_movemask_ps(_mm256_castsi256_ps(ok)) != 0xFF {
            let mut a = [0u32; LANES];
            store4(&mut a, &c);
            let bad = a.iter().find(|&&c| c > 1).copied().unwrap_or(0) as i32;
            return Err(CodecError::Corrupt(format!("coset {bad}")));
        }
        let mut half = [_mm256_setzero_ps(); 4];
        for (h, c) in half.iter_mut().zip(&c) {
            *h = _mm256_mul_ps(_mm256_cvtepi32_ps(*c), _mm256_set1_ps(0.5));
        }
        let mut p = [[_mm256_setzero_ps(); 8]; 4];
        let mut par = [_mm256_setzero_si256(); 4];
        for j in 1..9 {
            for v in 0..4 {
                let t = _mm256_add_epi32(c[v], _mm256_set1_epi32(2 * j as i32 - 1));
                let idx = _mm256_or_si256(_mm256_sll_epi32(t, cnt), _mm256_and_si256(xv[v], mask));
                let (a, k) = entries(f, idx);
                xv[v] = advance(xv[v], a, cnt);
                // As `e8::point`: z0..z6 plus the coset's half; z7 from m and the parity of z0..z6.
                let z = if j < 8 {
                    par[v] = _mm256_xor_si256(par[v], k);
                    k
                } else {
                    _mm256_add_epi32(_mm256_add_epi32(k, k), _mm256_and_si256(par[v], one))
                };
                p[v][j - 1] = _mm256_add_ps(_mm256_cvtepi32_ps(z), half[v]);
            }
            renorm(&mut xv, r)?;
        }
        for (v, o) in o.chunks_exact_mut(8 * DIM).enumerate() {
            let rows = transpose8(&p[v]);
            for (row, o) in rows.iter().zip(o.chunks_exact_mut(DIM)) {
                // SAFETY: `o` holds 8 floats.
                unsafe { _mm256_storeu_ps(o.as_mut_ptr(), *row) };
            }
        }
    }
    store4(x, &xv);
    Ok(groups * LANES * DIM)
}

/// Rows of an 8 × 8 matrix from its columns: coordinate vectors to per-lane points.
#[target_feature(enable = "avx2")]
fn transpose8(c: &[__m256; 8]) -> [__m256; 8] {
    let t0 = _mm256_unpacklo_ps(c[0], c[1]);
    let t1 = _mm256_unpackhi_ps(c[0], c[1]);
    let t2 = _mm256_unpacklo_ps(c[2], c[3]);
    let t3 = _mm256_unpackhi_ps(c[2], c[3]);
    let t4 = _mm256_unpacklo_ps(c[4], c[5]);
    let t5 = _mm256_unpackhi_ps(c[4], c[5]);
    let t6 = _mm256_unpacklo_ps(c[6], c[7]);
    let t7 = _mm256_unpackhi_ps(c[6], c[7]);
    let u0 = _mm256_shuffle_ps::<0x44>(t0, t2);
    let u1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
    let u2 = _mm256_shuffle_ps::<0x44>(t1, t3);
    let u3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
    let u4 = _mm256_shuffle_ps::<0x44>(t4, t6);
    let u5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
    let u6 = _mm256_shuffle_ps::<0x44>(t5, t7);
    let u7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
    [
        _mm256_permute2f128_ps::<0x20>(u0, u4),
        _mm256_permute2f128_ps::<0x20>(u1, u5),
        _mm256_permute2f128_ps::<0x20>(u2, u6),
        _mm256_permute2f128_ps::<0x20>(u3, u7),
        _mm256_permute2f128_ps::<0x31>(u0, u4),
        _mm256_permute2f128_ps::<0x31>(u1, u5),
        _mm256_permute2f128_ps::<0x31>(u2, u6),
        _mm256_permute2f128_ps::<0x31>(u3, u7),
    ]
}
