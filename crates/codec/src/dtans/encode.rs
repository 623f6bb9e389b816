//! The dtANS-LLM encoder: chooses the table, then codes every tile (in parallel) backwards.

use super::table::EncoderTable;
use super::*;
use crate::histogram::{byte_histogram, top_t};
use rayon::prelude::*;

/// The host's choices for coding one tensor, made from its code histogram: which codes are kept,
/// the padding code and the table. The per-weight coding follows them, on the CPU
/// ([`DtansTensor::encode_planned`]) or on the GPU (entrollm-cuda's `dtans_encode`), with
/// identical output.
pub struct EncodePlan {
    pub payload: Payload,
    pub coding: Coding,
    pub geometry: Geometry,
    pub table: SymbolTable,
    /// Code → the code coded in its place (itself, or the zero code for escaped codes).
    pub coded_as: [u8; 256],
    pub escaped: [bool; 256],
    /// The code of padding positions (the most frequent kept code).
    pub pad: u8,
    enc: EncoderTable,
}

impl EncodePlan {
    /// Chooses the kept codes and builds the table for the row-major [rows × cols] `codes`.
    pub fn new(
        payload: Payload,
        rows: usize,
        cols: usize,
        codes: &[u8],
        coding: Coding,
    ) -> Result<EncodePlan> {
        let g = Geometry::new(payload, &coding, rows, cols)?;
        if codes.len() != rows * cols {
            return Err(CodecError::Shape(format!(
                "{rows}×{cols} {payload:?} needs {} codes, got {}",
                rows * cols,
                codes.len()
            )));
        }
        let hist = byte_histogram(codes);
        if let Some(c) = (payload.alphabet()..256).find(|&c| hist[c] > 0) {
            return Err(CodecError::Shape(format!(
                "code {c} does not fit the {}-bit {payload:?} payload",
                payload.code_bits()
            )));
        }
        let (coded_as, escaped, pad) = choose_values(payload, &hist, coding.t);
        let key_bits = coding.key_bits(payload);
        let keys = tuple_histogram(&g, payload, codes, &hist, &coded_as, pad, key_bits);
        let table = SymbolTable::build(&keys, coding.log2_m)?;
        let enc = table.encoder(key_bits);
        Ok(EncodePlan {
            payload,
            coding,
            geometry: g,
            table,
            coded_as,
            escaped,
            pad,
            enc,
        })
    }

    /// Per packed key (2^key_bits entries): its symbol's first slot (bits 0..16) and slot count
    /// (16..24), or 0 for a key without a symbol (it never occurs).
    pub fn key_slots(&self) -> Vec<u32> {
        self.enc
            .key_to_symbol
            .iter()
            .map(|&s| match s {
                u16::MAX => 0,
                s => self.enc.start[s as usize] as u32 | self.enc.count[s as usize] << 16,
            })
            .collect()
    }
}

/// What every tile's encoder shares.
struct Shared<'a> {
    payload: Payload,
    g: Geometry,
    codes: &'a [u8],
    raw: &'a [u8],
    coded_as: [u8; 256],
    escaped: [bool; 256],
    pad: u8,
    enc: &'a EncoderTable,
}

/// One lane's symbols and escapes for one tile.
struct Lane {
    symbols: Vec<u16>,
    /// (column in slice, element value), by column.
    escapes: Vec<(u32, u16)>,
}

impl DtansTensor {
    /// Codes `codes` (and, for 16-bit floats, `raw`), a row-major [rows × cols] matrix split by
    /// [`Payload::symbolize`].
    pub fn encode(
        payload: Payload,
        rows: usize,
        cols: usize,
        codes: &[u8],
        raw: &[u8],
        coding: Coding,
    ) -> Result<DtansTensor> {
        let plan = EncodePlan::new(payload, rows, cols, codes, coding)?;
        DtansTensor::encode_planned(&plan, codes, raw)
    }

    /// Codes `codes` (and, for 16-bit floats, `raw`) as `plan` (made from these codes) says.
    pub fn encode_planned(plan: &EncodePlan, codes: &[u8], raw: &[u8]) -> Result<DtansTensor> {
        let (payload, g) = (plan.payload, plan.geometry);
        let n = g.rows * g.cols;
        let raw_n = if payload.has_raw() { n } else { 0 };
        if codes.len() != n || raw.len() != raw_n {
            return Err(CodecError::Shape(format!(
                "{}×{} {payload:?} needs {n} codes and {raw_n} raw bytes, got {} and {}",
                g.rows,
                g.cols,
                codes.len(),
                raw.len()
            )));
        }
        let shared = Shared {
            payload: plan.payload,
            g,
            codes,
            raw,
            coded_as: plan.coded_as,
            escaped: plan.escaped,
            pad: plan.pad,
            enc: &plan.enc,
        };
        let (coding, rows, cols, table) = (plan.coding, g.rows, g.cols, plan.table.clone());

        let mut companion = vec![0u32; g.companion_len()];
        let mut raw_out = vec![0u8; g.raw_len()];
        let comp_per_tile = LANES * g.companion_words;
        let raw_per_tile = if g.has_raw { LANES * g.sc } else { 0 };
        let comp_slices = split_per_tile(&mut companion, comp_per_tile, g.tiles());
        let raw_slices = split_per_tile(&mut raw_out, raw_per_tile, g.tiles());
        let tiles: Vec<(Vec<u32>, u32)> = comp_slices
            .into_par_iter()
            .zip(raw_slices)
            .enumerate()
            .map(|(t, (comp, raw))| shared.encode_tile(t, comp, raw))
            .collect();

        let total: usize = tiles.iter().map(|(s, _)| s.len()).sum();
        let mut stream = Vec::with_capacity(total);
        let mut index = Vec::with_capacity(2 * tiles.len());
        for (s, mask) in tiles {
            index.push(u32::try_from(stream.len()).map_err(|_| {
                CodecError::Shape("coded stream exceeds 2^32 words; split the tensor".into())
            })?);
            index.push(mask);
            stream.extend_from_slice(&s);
        }
        Ok(DtansTensor {
            payload,
            coding,
            rows,
            cols,
            table,
            tiles: index,
            stream,
            companion,
            raw: raw_out,
        })
    }
}

/// One mutable slice of `per_tile` elements per tile (empty slices where a tile has none).
fn split_per_tile<T>(v: &mut [T], per_tile: usize, tiles: usize) -> Vec<&mut [T]> {
    if per_tile == 0 {
        (0..tiles).map(|_| &mut [][..]).collect()
    } else {
        v.chunks_mut(per_tile).collect()
    }
}

/// Which codes the table keeps: the `t` most frequent, with the zero code among them whenever
/// something is escaped (escaped weights are coded as the zero code). Returns the code each code is
/// coded as, which codes are escaped, and the padding code (the most frequent kept code).
pub(crate) fn choose_values(
    payload: Payload,
    hist: &[u64; 256],
    t: Option<u16>,
) -> ([u8; 256], [bool; 256], u8) {
    let alphabet = payload.alphabet();
    let present = hist[..alphabet].iter().filter(|&&c| c > 0).count();
    let t = t.map_or(alphabet, |t| t as usize);
    let mut kept = vec![false; 256];
    let order = top_t(&hist[..alphabet], t);
    for &c in &order {
        kept[c] = true;
    }
    let zero = payload.zero_code() as usize;
    if t < present && !kept[zero] {
        // Something is escaped, so the zero code must be in the table: it replaces the rarest kept
        // (`order` holds exactly t codes here, as more than t are present).
        if let Some(&last) = order.last() {
            kept[last] = false;
        }
        kept[zero] = true;
    }
    let pad = order.iter().copied().find(|&c| kept[c]).unwrap_or(zero) as u8;
    let mut coded_as = [0u8; 256];
    let mut escaped = [false; 256];
    for c in 0..256 {
        if kept[c] {
            coded_as[c] = c as u8;
        } else {
            coded_as[c] = zero as u8;
            escaped[c] = hist[c] > 0;
        }
    }
    (coded_as, escaped, pad)
}

/// Counts of every packed tuple over the padded tensor (padding included: it is coded too).
pub(crate) fn tuple_histogram(
    g: &Geometry,
    payload: Payload,
    codes: &[u8],
    code_hist: &[u64; 256],
    coded_as: &[u8; 256],
    pad: u8,
    key_bits: u32,
) -> Vec<u64> {
    let cb = payload.code_bits();
    let k = g.k;
    let padded_cols = g.slices * g.sc;
    let per_row = padded_cols / k;
    let pad_key = (0..k).fold(0usize, |key, j| key | (pad as usize) << (j as u32 * cb));
    if k == 1 {
        // Single mode: the code histogram already has the counts; only padding is added.
        let mut hist = vec![0u64; 1 << key_bits];
        for (c, &n) in code_hist.iter().enumerate().take(payload.alphabet()) {
            hist[coded_as[c] as usize] += n;
        }
        hist[pad_key] += (g.bands * LANES * padded_cols - g.rows * g.cols) as u64;
        return hist;
    }
    let size = 1usize << key_bits;
    let cols = g.cols;
    // Tuples wholly inside a row, then the row's last tuple where padding completes it.
    let inside = cols / k;
    // The coded values that occur (and the padding value), numbered densely: tuples are counted
    // in a table of n^k entries, which stays in L1 for the few values a trained matrix's codes
    // take, then spread to their keys.
    let mut dense = [u8::MAX; 256];
    let mut values: Vec<u8> = Vec::new();
    for v in (0..256)
        .filter(|&c| code_hist[c] > 0)
        .map(|c| coded_as[c])
        .chain([pad])
    {
        if dense[v as usize] == u8::MAX && values.len() < 255 {
            dense[v as usize] = values.len() as u8;
            values.push(v);
        }
    }
    let n = values.len();
    let compact = values.len() < 255 && n.pow(k as u32) <= 1 << 11;
    let (table, index_of) = match compact {
        true => (n.pow(k as u32), {
            let mut m = [0u16; 256];
            for c in 0..256 {
                m[c] = dense[coded_as[c] as usize].min(254) as u16;
            }
            m
        }),
        false => (size, {
            let mut m = [0u16; 256];
            for c in 0..256 {
                m[c] = coded_as[c] as u16;
            }
            m
        }),
    };
    // A tuple's index in the counting table: base n (compact) or 2^cb digits.
    let radix = if compact { n } else { 1 << cb };
    let pad_digit = if compact {
        dense[pad as usize] as usize
    } else {
        pad as usize
    };
    let index = |t: &[u8]| {
        t.iter()
            .rev()
            .fold(0usize, |a, &c| a * radix + index_of[c as usize] as usize)
    };
    // Blocks of about 2^22 codes, each counted in u32 tables (four, taking tuples in turn, so
    // that runs of one tuple do not wait on one counter), added into the split's u64 counts.
    let block_rows = ((1usize << 22) / cols).max(1);
    let counts = codes
        .par_chunks(cols * block_rows)
        .fold(
            || vec![0u64; table],
            |mut h, rows| {
                // (The full key space counts straight into `h`: four copies would not fit a
                // cache either.)
                let mut sub = vec![[0u32; 4]; if compact { table } else { 0 }];
                for row in rows.chunks(cols) {
                    let whole = row[..k * inside].chunks_exact(k);
                    match compact {
                        true => whole
                            .enumerate()
                            .for_each(|(i, t)| sub[index(t)][i & 3] += 1),
                        false => whole.for_each(|t| h[index(t)] += 1),
                    }
                    for p in inside..per_row {
                        let mut key = 0usize;
                        for j in (0..k).rev() {
                            let col = p * k + j;
                            let d = match col < cols {
                                true => index_of[row[col] as usize] as usize,
                                false => pad_digit,
                            };
                            key = key * radix + d;
                        }
                        h[key] += 1;
                    }
                }
                for (h, s) in h.iter_mut().zip(&sub) {
                    *h += s.iter().map(|&x| x as u64).sum::<u64>();
                }
                h
            },
        )
        .reduce(
            || vec![0u64; table],
            |mut a, b| {
                a.iter_mut().zip(b).for_each(|(x, y)| *x += y);
                a
            },
        );
    let mut hist = match compact {
        false => counts,
        true => {
            let mut hist = vec![0u64; size];
            for (i, &c) in counts.iter().enumerate().filter(|(_, &c)| c > 0) {
                let (mut rest, mut key) = (i, 0usize);
                for j in 0..k {
                    key |= (values[rest % n] as usize) << (j as u32 * cb);
                    rest /= n;
                }
                hist[key] += c;
            }
            hist
        }
    };
    hist[pad_key] += ((g.bands * LANES - g.rows) * per_row) as u64;
    hist
}

impl Shared<'_> {
    fn lane(&self, row: usize, col0: usize) -> Lane {
        let g = &self.g;
        let cb = self.payload.code_bits();
        let n_sym = g.sc / g.k;
        let mut symbols = Vec::with_capacity(n_sym);
        let mut escapes = Vec::new();
        let inside = row < g.rows && col0 + g.sc <= g.cols;
        if inside {
            // Whole row slice inside the matrix: no bounds checks per weight.
            let codes = &self.codes[row * g.cols + col0..][..g.sc];
            for (p, tuple) in codes.chunks_exact(g.k).enumerate() {
                let mut key = 0usize;
                for (j, &code) in tuple.iter().enumerate() {
                    key |= (self.coded_as[code as usize] as usize) << (j as u32 * cb);
                }
                symbols.push(self.enc.key_to_symbol[key]);
                if tuple.iter().any(|&c| self.escaped[c as usize]) {
                    for (j, &code) in tuple.iter().enumerate() {
                        if self.escaped[code as usize] {
                            let i = row * g.cols + col0 + p * g.k + j;
                            let raw = if g.has_raw { self.raw[i] } else { 0 };
                            escapes.push(((p * g.k + j) as u32, self.payload.element(code, raw)));
                        }
                    }
                }
            }
            return Lane { symbols, escapes };
        }
        for p in 0..n_sym {
            let mut key = 0usize;
            for j in 0..g.k {
                let c = p * g.k + j;
                let col = col0 + c;
                let code = if row < g.rows && col < g.cols {
                    let i = row * g.cols + col;
                    let code = self.codes[i];
                    if self.escaped[code as usize] {
                        let raw = if g.has_raw { self.raw[i] } else { 0 };
                        escapes.push((c as u32, self.payload.element(code, raw)));
                    }
                    self.coded_as[code as usize]
                } else {
                    self.pad
                };
                key |= (code as usize) << (j as u32 * cb);
            }
            symbols.push(self.enc.key_to_symbol[key]);
        }
        Lane { symbols, escapes }
    }

    /// Codes one tile; fills its companion words and raw bytes, returns its stream and escape mask.
    fn encode_tile(&self, tile: usize, comp: &mut [u32], raw_out: &mut [u8]) -> (Vec<u32>, u32) {
        let g = &self.g;
        let (row0, col0) = g.tile_origin(tile);
        let s_len = g.quartets;
        let mut x_init = [0u32; LANES];
        let mut b0 = [0u32; LANES];
        // Per lane, the words it emits, as (read step, word), last step first.
        let mut emits: Vec<Vec<(u32, u32)>> = Vec::with_capacity(LANES);
        let mut escapes: Vec<Vec<(u32, u16)>> = Vec::with_capacity(LANES);
        let cbits = g.companion_bits_per_symbol;
        for lane in 0..LANES {
            let row = row0 + lane;
            let Lane {
                symbols,
                escapes: esc,
            } = self.lane(row, col0);
            if g.has_raw && row < g.rows {
                // Raw bytes go in 16-byte units per lane; escaped weights keep a zero raw byte.
                let n = g.sc.min(g.cols.saturating_sub(col0));
                let src = &self.raw[row * g.cols + col0..][..n];
                for (u, unit) in src.chunks(RAW_UNIT).enumerate() {
                    let at = Geometry::raw_index(lane, u * RAW_UNIT);
                    raw_out[at..at + unit.len()].copy_from_slice(unit);
                }
                for &(c, _) in &esc {
                    raw_out[Geometry::raw_index(lane, c as usize)] = 0;
                }
            }
            // The word that quartet q's slots make, with its companion bits written out.
            // The word that quartet q's slots make; their high bits go to the companion stream
            // (4·cbits bits per quartet, which never straddle a word).
            let mut word = |q: usize, digits: [u32; 4]| -> u32 {
                let sym = &symbols[4 * q..4 * q + 4];
                let idx: [u32; 4] =
                    std::array::from_fn(|i| self.enc.start[sym[i] as usize] as u32 + digits[i]);
                if cbits > 0 {
                    let hi = (0..4).fold(0u32, |a, i| a | (idx[i] >> 8) << (i as u32 * cbits));
                    let bit = q * 4 * cbits as usize;
                    comp[(bit / 32) * LANES + lane] |= hi << (bit % 32);
                }
                (idx[0] & 0xFF)
                    | (idx[1] & 0xFF) << 8
                    | (idx[2] & 0xFF) << 16
                    | (idx[3] & 0xFF) << 24
            };
            // The last quartet takes no digits: the reservoir is empty when encoding starts.
            let mut x: u64 = 1;
            let mut b = word(s_len - 1, [0; 4]);
            let mut lane_emits = Vec::new();
            for q in (0..s_len - 1).rev() {
                let s: [usize; 4] = std::array::from_fn(|i| symbols[4 * q + i] as usize);
                let big_r = s.iter().map(|&s| self.enc.count[s] as u64).product::<u64>();
                let d = if x < big_r {
                    let xp = (x << 32) | b as u64;
                    x = xp / big_r;
                    (xp - x * big_r) as u32
                } else {
                    // x < 2^32 here, so a 32-bit division does.
                    lane_emits.push((q as u32, b));
                    let (x32, r32) = (x as u32, big_r as u32);
                    x = (x32 / r32) as u64;
                    x32 % r32
                };
                debug_assert!((1..1 << 32).contains(&x));
                // Mixed-radix digits of d, least significant (symbol 3) first.
                let (d, d3) = self.enc.divmod(d, s[3]);
                let (d, d2) = self.enc.divmod(d, s[2]);
                let (d0, d1) = self.enc.divmod(d, s[1]);
                b = word(q, [d0, d1, d2, d3]);
            }
            x_init[lane] = x as u32;
            b0[lane] = b;
            emits.push(lane_emits);
            escapes.push(esc);
        }

        let mut out = Vec::with_capacity(PROLOGUE_WORDS + 2 * CHUNK_WORDS);
        out.extend_from_slice(&x_init);
        out.extend_from_slice(&b0);
        let mut chunks = ChunkWriter::new(&mut out);
        let mut step_words = Vec::with_capacity(LANES);
        for step in 0..s_len.saturating_sub(1) as u32 {
            step_words.clear();
            for e in emits.iter_mut() {
                if e.last().is_some_and(|&(s, _)| s == step) {
                    step_words.push(e.pop().unwrap().1);
                }
            }
            chunks.step(step, &step_words);
        }
        let mut mask = 0u32;
        for (lane, e) in escapes.iter().enumerate() {
            if !e.is_empty() {
                mask |= 1 << lane;
            }
        }
        let rounds = escapes.iter().map(|e| e.len()).max().unwrap_or(0);
        for round in 0..rounds {
            step_words.clear();
            for e in &escapes {
                if let Some(&(col, value)) = e.get(round) {
                    let last = if round + 1 == e.len() { REC_LAST } else { 0 };
                    step_words.push(value as u32 | col << REC_COL_SHIFT | last);
                }
            }
            chunks.step((s_len - 1 + round) as u32, &step_words);
        }
        chunks.finish();
        out.resize(out.len().next_multiple_of(STREAM_ALIGN), 0);
        (out, mask)
    }
}

/// Appends read steps to a tile's stream in 1 KiB chunks; a chunk's first word is the read step at
/// which the warp runs out of it (the step's first lanes read its last words, the others the next
/// chunk's first), or [`NO_DUE`].
struct ChunkWriter<'a> {
    out: &'a mut Vec<u32>,
    header: usize,
    pos: usize,
}

impl<'a> ChunkWriter<'a> {
    fn new(out: &'a mut Vec<u32>) -> Self {
        let header = out.len();
        out.push(NO_DUE);
        ChunkWriter {
            out,
            header,
            pos: 1,
        }
    }

    fn step(&mut self, step: u32, words: &[u32]) {
        if self.pos + words.len() > CHUNK_WORDS {
            let avail = CHUNK_WORDS - self.pos;
            self.out[self.header] = step;
            self.out.extend_from_slice(&words[..avail]);
            self.header = self.out.len();
            self.out.push(NO_DUE);
            self.out.extend_from_slice(&words[avail..]);
            self.pos = 1 + words.len() - avail;
        } else {
            self.out.extend_from_slice(words);
            self.pos += words.len();
        }
    }

    fn finish(self) {
        self.out[self.header] = NO_DUE;
    }
}
