//! The Huffman code DFloat11 0.5.0 uses: `dahuffman.HuffmanCodec.from_frequencies` (dahuffman 0.4.2)
//! followed by DFloat11's `get_32bit_codec` length limit.
//!
//! dahuffman's tree is not canonical: it pops the two lightest nodes `a`, `b` from a binary heap of
//! `(frequency, [leaves...])` tuples and prepends bit 0 to every code under `a`, bit 1 under `b`.
//! Ties in frequency fall back to Python's list comparison, i.e. to the first leaf of each node, where
//! the end-of-file symbol compares below every integer. The code table keeps the leaf order of that
//! list (leaves under `a` before leaves under `b`), and the LUT builder depends on that order.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use crate::{CodecError, Result};

/// Longest code the DFloat11 decoder handles (four LUT levels of 8 bits).
pub const MAX_CODE_BITS: u32 = 32;

/// Exponents from this value up are LUT pointers in DFloat11, so they cannot be coded.
pub const FIRST_POINTER: u8 = 240;

/// A symbol of the DFloat11 code: a BF16 exponent, or dahuffman's end-of-file marker (frequency 1),
/// whose code pads the last byte of the stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Symbol {
    Exponent(u8),
    Eof,
}

impl Symbol {
    /// Rank among equal frequencies in dahuffman's heap: `_EOF` is below every integer symbol.
    fn tie_rank(self) -> u16 {
        match self {
            Symbol::Eof => 0,
            Symbol::Exponent(e) => e as u16 + 1,
        }
    }
}

/// One code word: `bits` long, its bits are the low `bits` of `value`, first bit most significant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CodeEntry {
    pub symbol: Symbol,
    pub bits: u32,
    pub value: u32,
}

/// A complete prefix code over the used exponents plus EOF, every code at most 32 bits, entries in
/// dahuffman's table order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CodeTable {
    entries: Vec<CodeEntry>,
}

/// A leaf of a dahuffman tree before length limiting: codes may be longer than 64 bits then, so the
/// value is only meaningful when `bits <= 64`.
struct Leaf {
    symbol: Symbol,
    bits: u32,
    value: u64,
}

impl CodeTable {
    /// The code DFloat11 0.5.0 builds for an exponent histogram (`get_codec` + `get_32bit_codec`).
    ///
    /// Symbols enter in ascending exponent order, as `torch.unique` returns them. One documented
    /// divergence: when codes exceed 32 bits, DFloat11 sets the counts of the k rarest exponents to 1,
    /// picking them with `np.argpartition`, whose choice among equal counts is unspecified (it differs
    /// between numpy's SIMD and scalar selection); here ties go to the smaller exponent. Histograms
    /// without a tie at the k-th smallest count (all real cases seen) give identical tables.
    pub fn from_histogram(counts: &[u64; 256]) -> Result<CodeTable> {
        let counter: Vec<(u8, u64)> = (0..=255u8)
            .zip(counts.iter().copied())
            .filter(|&(_, c)| c > 0)
            .collect();
        if counter.is_empty() {
            return Err(CodecError::Unsupported(
                "DFloat11 cannot build a code for an empty exponent histogram".into(),
            ));
        }
        if let Some(&(e, c)) = counter.iter().find(|&&(e, _)| e >= FIRST_POINTER) {
            return Err(CodecError::Unsupported(format!(
                "exponent {e} occurs {c} times; DFloat11 reserves exponents {FIRST_POINTER}..=255 \
                 (|w| >= 2^113, inf, NaN) as LUT pointers"
            )));
        }
        let mut leaves = dahuffman_leaves(&counter);
        // get_32bit_codec: while some code is too long, set the k rarest counts to 1, k = 2, 3, ...
        let mut k = 2;
        while leaves.iter().any(|l| l.bits > MAX_CODE_BITS) {
            if k >= counter.len() {
                // np.argpartition(freq, k) rejects k >= len(freq): DFloat11 fails here too.
                return Err(CodecError::Unsupported(format!(
                    "cannot limit the Huffman code of {} exponents to {MAX_CODE_BITS} bits",
                    counter.len()
                )));
            }
            let mut rarest: Vec<usize> = (0..counter.len()).collect();
            rarest.sort_by_key(|&i| (counter[i].1, i));
            let mut limited = counter.clone();
            for &i in &rarest[..k] {
                limited[i].1 = 1;
            }
            leaves = dahuffman_leaves(&limited);
            k += 1;
        }
        let entries = leaves
            .into_iter()
            .map(|l| CodeEntry {
                symbol: l.symbol,
                bits: l.bits,
                value: l.value as u32,
            })
            .collect();
        Ok(CodeTable { entries })
    }

    /// Entries in dahuffman's table order.
    pub fn entries(&self) -> &[CodeEntry] {
        &self.entries
    }

    /// The end-of-file code.
    pub fn eof(&self) -> CodeEntry {
        // from_histogram always adds EOF; a fallback keeps this total.
        self.entries
            .iter()
            .copied()
            .find(|e| e.symbol == Symbol::Eof)
            .unwrap_or(CodeEntry {
                symbol: Symbol::Eof,
                bits: 0,
                value: 0,
            })
    }

    /// Code length and value of every exponent (length 0: exponent unused).
    pub fn exponent_codes(&self) -> ([u8; 256], [u32; 256]) {
        let mut lens = [0u8; 256];
        let mut values = [0u32; 256];
        for e in &self.entries {
            if let Symbol::Exponent(x) = e.symbol {
                lens[x as usize] = e.bits as u8;
                values[x as usize] = e.value;
            }
        }
        (lens, values)
    }

    /// Longest code length, EOF included.
    pub fn max_bits(&self) -> u32 {
        self.entries.iter().map(|e| e.bits).max().unwrap_or(0)
    }
}

/// dahuffman's `from_frequencies` with EOF (frequency 1) added; leaves in table order.
fn dahuffman_leaves(counter: &[(u8, u64)]) -> Vec<Leaf> {
    enum Node {
        Leaf(Symbol),
        Inner { zero: usize, one: usize },
    }
    let mut nodes: Vec<Node> = Vec::with_capacity(2 * counter.len() + 1);
    // Heap key: (frequency, rank of the node's first leaf). First leaves are distinct symbols, so
    // this is a strict total order and any correct heap pops the nodes Python's heapq pops.
    let mut heap = BinaryHeap::with_capacity(counter.len() + 1);
    let symbols = counter
        .iter()
        .map(|&(e, f)| (Symbol::Exponent(e), f))
        .chain(std::iter::once((Symbol::Eof, 1)));
    for (symbol, freq) in symbols {
        heap.push(Reverse((freq, symbol.tie_rank(), nodes.len())));
        nodes.push(Node::Leaf(symbol));
    }
    while heap.len() > 1 {
        let (Some(Reverse((fa, rank_a, a))), Some(Reverse((fb, _, b)))) = (heap.pop(), heap.pop())
        else {
            break;
        };
        heap.push(Reverse((fa + fb, rank_a, nodes.len())));
        nodes.push(Node::Inner { zero: a, one: b });
    }
    let Some(Reverse((_, _, root))) = heap.pop() else {
        return Vec::new();
    };
    // Depth-first, bit-0 child first: the order of dahuffman's concatenated leaf lists.
    let mut leaves = Vec::with_capacity(counter.len() + 1);
    let mut stack = vec![(root, 0u32, 0u64)];
    while let Some((node, bits, value)) = stack.pop() {
        match nodes[node] {
            Node::Leaf(symbol) => leaves.push(Leaf {
                symbol,
                bits,
                value,
            }),
            Node::Inner { zero, one } => {
                stack.push((one, bits + 1, (value << 1) | 1));
                stack.push((zero, bits + 1, value << 1));
            }
        }
    }
    leaves
}

#[cfg(test)]
mod tests {
    use super::*;

    fn histogram(pairs: &[(u8, u64)]) -> [u64; 256] {
        let mut h = [0u64; 256];
        for &(e, c) in pairs {
            h[e as usize] = c;
        }
        h
    }

    fn code_of(t: &CodeTable, s: Symbol) -> (u32, u32) {
        let e = t.entries().iter().find(|e| e.symbol == s).unwrap();
        (e.bits, e.value)
    }

    #[test]
    fn eof_loses_frequency_ties_and_takes_the_zero_side() {
        // heap: EOF(1) < 5(1) by the tie rule, so EOF is `a` (bit 0) in the first merge.
        let t = CodeTable::from_histogram(&histogram(&[(5, 1), (9, 4)])).unwrap();
        assert_eq!(code_of(&t, Symbol::Eof), (2, 0b00));
        assert_eq!(code_of(&t, Symbol::Exponent(5)), (2, 0b01));
        assert_eq!(code_of(&t, Symbol::Exponent(9)), (1, 0b1));
        let order: Vec<Symbol> = t.entries().iter().map(|e| e.symbol).collect();
        assert_eq!(
            order,
            vec![Symbol::Eof, Symbol::Exponent(5), Symbol::Exponent(9)]
        );
    }

    #[test]
    fn one_exponent_gets_a_one_bit_code_next_to_eof() {
        let t = CodeTable::from_histogram(&histogram(&[(120, 1000)])).unwrap();
        assert_eq!(code_of(&t, Symbol::Eof), (1, 0));
        assert_eq!(code_of(&t, Symbol::Exponent(120)), (1, 1));
    }

    #[test]
    fn codes_are_a_complete_prefix_code() {
        let pairs: Vec<(u8, u64)> = (100..140u8)
            .map(|e| (e, (e as u64 * 37) % 101 + 1))
            .collect();
        let t = CodeTable::from_histogram(&histogram(&pairs)).unwrap();
        let kraft: f64 = t
            .entries()
            .iter()
            .map(|e| 2f64.powi(-(e.bits as i32)))
            .sum();
        assert!((kraft - 1.0).abs() < 1e-12);
        for (i, a) in t.entries().iter().enumerate() {
            for b in &t.entries()[i + 1..] {
                let (s, l) = if a.bits <= b.bits { (a, b) } else { (b, a) };
                assert_ne!(
                    l.value >> (l.bits - s.bits),
                    s.value,
                    "{a:?} prefixes {b:?}"
                );
            }
        }
    }

    #[test]
    fn fibonacci_counts_are_limited_to_32_bits() {
        // Fibonacci counts make a maximally deep tree: 40 symbols would need 40-bit codes.
        let mut fib = vec![1u64, 1];
        while fib.len() < 40 {
            fib.push(fib[fib.len() - 1] + fib[fib.len() - 2]);
        }
        let pairs: Vec<(u8, u64)> = fib
            .iter()
            .enumerate()
            .map(|(i, &c)| (i as u8 + 80, c))
            .collect();
        let t = CodeTable::from_histogram(&histogram(&pairs)).unwrap();
        assert!(t.max_bits() <= MAX_CODE_BITS);
        assert!(
            t.max_bits() >= 30,
            "limit should only trim: {}",
            t.max_bits()
        );
    }

    #[test]
    fn reserved_exponents_and_empty_histograms_are_refused() {
        let err = CodeTable::from_histogram(&histogram(&[(120, 5), (255, 2)])).unwrap_err();
        assert!(matches!(err, CodecError::Unsupported(ref m) if m.contains("exponent 255")));
        assert!(CodeTable::from_histogram(&[0; 256]).is_err());
    }
}
