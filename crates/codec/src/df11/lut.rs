//! DFloat11's hierarchical decode tables, built exactly as `dfloat11_utils.get_luts` builds them.

use super::code::{CodeTable, Symbol, FIRST_POINTER};
use crate::{CodecError, Result};

/// Most prefix rows: row 0 plus the 16 sub-tables that pointer values 255..=240 can name.
pub const MAX_PREFIX_ROWS: usize = 256 - FIRST_POINTER as usize + 1;

/// A code prefix whose length is a multiple of 8 bits (one LUT row per prefix).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Prefix {
    bits: u32,
    value: u32,
}

/// The first `n` bits of a `bits`-long code.
fn head(value: u32, bits: u32, n: u32) -> u32 {
    ((value as u64) >> (bits - n)) as u32
}

/// The value of the code at the top of `bits` (MSB first) in the decode `rows` (the LUT without
/// its length row), the way DFloat11's kernel finds it: the first byte in row 0, then while the
/// value is a pointer `v >= 240` (at most three times), the next byte in row `256 - v`. After four
/// levels a pointer is returned as it is. `None` if a pointer leaves the table.
pub fn lut_lookup(rows: &[u8], bits: u64) -> Option<u8> {
    let mut v = *rows.get((bits >> 56) as usize)?;
    for level in 1..4 {
        if v < FIRST_POINTER {
            break;
        }
        let row = 256 - v as usize;
        v = *rows.get(row * 256 + ((bits >> (56 - 8 * level)) & 0xFF) as usize)?;
    }
    Some(v)
}

/// `(rows + 1) * 256` bytes: one 256-entry row per prefix, then the code-length row.
///
/// Row entries hold an exponent, or `256 - r` to continue in row `r` with the next byte. Entries
/// that no exponent code claims (the end-of-file code's range) repeat the last value written
/// before them, as DFloat11 does; DFloat11 carries that value over from the previous row, and
/// raises `UnboundLocalError` when row 0 starts with such an entry (the EOF code is all zeros,
/// common on small tensors). There we use the row's first claimed value, so every entry decodes.
pub fn build_luts(table: &CodeTable) -> Result<Vec<u8>> {
    let exponent_codes: Vec<(u8, u32, u32)> = table
        .entries()
        .iter()
        .filter_map(|e| match e.symbol {
            Symbol::Exponent(x) => Some((x, e.bits, e.value)),
            Symbol::Eof => None,
        })
        .collect();
    let mut prefixes = vec![Prefix { bits: 0, value: 0 }];
    for &(_, bits, value) in &exponent_codes {
        let plen = (bits - 1) / 8 * 8;
        let p = Prefix {
            bits: plen,
            value: head(value, bits, plen),
        };
        if !prefixes.contains(&p) {
            prefixes.push(p);
        }
    }
    prefixes.sort_by_key(|p| p.bits); // stable, like Python's list.sort
    if prefixes.len() > MAX_PREFIX_ROWS {
        return Err(CodecError::Unsupported(format!(
            "the code needs {} LUT sub-tables; DFloat11 pointers (values {FIRST_POINTER}..=255) \
             address at most {}",
            prefixes.len() - 1,
            MAX_PREFIX_ROWS - 1
        )));
    }
    let rows = prefixes.len();
    let mut luts = vec![0u8; (rows + 1) * 256];
    let mut carried: Option<u8> = None;
    for (pi, p) in prefixes.iter().enumerate() {
        let mut claimed: [Option<u8>; 256] = [None; 256];
        for &(exponent, bits, value) in &exponent_codes {
            if bits <= p.bits || head(value, bits, p.bits) != p.value {
                continue;
            }
            let (key, entry) = if (bits - 1) / 8 == p.bits / 8 {
                // The code ends in this row: its remaining 1..=8 bits, left-aligned.
                let rest = bits - p.bits;
                let key = (value & ((1u32 << rest) - 1)) << (8 - rest);
                (key as usize, exponent)
            } else {
                let next = Prefix {
                    bits: p.bits + 8,
                    value: head(value, bits, p.bits + 8),
                };
                let row = prefixes.iter().position(|q| *q == next).ok_or_else(|| {
                    CodecError::Unsupported(format!(
                        "LUT row for the {}-bit prefix of exponent {exponent}'s code is missing",
                        next.bits
                    ))
                })?;
                ((next.value & 0xFF) as usize, (256 - row) as u8)
            };
            match claimed[key] {
                Some(old) if old != entry => {
                    return Err(CodecError::Unsupported(format!(
                        "LUT row {pi} entry {key} is claimed twice ({old} and {entry})"
                    )))
                }
                _ => claimed[key] = Some(entry),
            }
        }
        let first = claimed.iter().flatten().next().copied();
        let row = &mut luts[pi * 256..(pi + 1) * 256];
        for (slot, c) in row.iter_mut().zip(claimed) {
            if c.is_some() {
                carried = c;
            }
            *slot = carried
                .or(first)
                .ok_or_else(|| CodecError::Unsupported(format!("LUT row {pi} has no code")))?;
        }
    }
    let lens = &mut luts[rows * 256..];
    for &(exponent, bits, _) in &exponent_codes {
        lens[exponent as usize] = bits as u8;
    }
    Ok(luts)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(pairs: &[(u8, u64)]) -> CodeTable {
        let mut h = [0u64; 256];
        for &(e, c) in pairs {
            h[e as usize] = c;
        }
        CodeTable::from_histogram(&h).unwrap()
    }

    #[test]
    fn every_exponent_code_decodes_through_the_luts() {
        // A deep code: geometric counts give codes from 1 to ~30 bits, so 4 LUT levels.
        let pairs: Vec<(u8, u64)> = (0..30u8).map(|i| (100 + i, 1u64 << (29 - i))).collect();
        let t = table(&pairs);
        let luts = build_luts(&t).unwrap();
        let rows = luts.len() / 256 - 1;
        assert!(rows > 3, "expected several sub-tables, got {rows}");
        let lens = &luts[rows * 256..];
        for e in t.entries() {
            if let Symbol::Exponent(x) = e.symbol {
                // Any continuation bits after the code must not matter.
                for tail in [0u64, u64::MAX] {
                    let aligned = ((e.value as u64) << (64 - e.bits)) | (tail >> e.bits);
                    assert_eq!(
                        lut_lookup(&luts[..rows * 256], aligned),
                        Some(x),
                        "code {e:?}"
                    );
                }
                assert_eq!(lens[x as usize] as u32, e.bits);
            }
        }
    }

    #[test]
    fn unclaimed_leading_entries_of_row_0_take_the_first_claimed_value() {
        // EOF = 00, exponent 5 = 01, exponent 9 = 1: row 0 keys 0..64 belong to EOF.
        let luts = build_luts(&table(&[(5, 2), (9, 4)])).unwrap();
        assert_eq!(luts.len(), 2 * 256);
        assert!(luts[..128].iter().all(|&v| v == 5));
        assert!(luts[128..256].iter().all(|&v| v == 9));
        assert_eq!((luts[256 + 5], luts[256 + 9]), (2, 1));
    }
}
