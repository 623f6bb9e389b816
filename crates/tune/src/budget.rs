//! `--budget SIZE`: a byte count in decimal or binary units, or a share of free device memory.

use std::fmt;
use std::str::FromStr;

use crate::TuneError;

/// A memory budget as the user wrote it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Budget {
    /// An absolute size in bytes.
    Bytes(u64),
    /// A percentage (0 < p ≤ 100) of the device memory free when the model is loaded.
    Percent(f64),
}

/// Units, longest suffix first so that `GiB` is not read as `B`.
const UNITS: [(&str, u64); 10] = [
    ("kib", 1 << 10),
    ("mib", 1 << 20),
    ("gib", 1 << 30),
    ("tib", 1 << 40),
    ("kb", 1_000),
    ("mb", 1_000_000),
    ("gb", 1_000_000_000),
    ("tb", 1_000_000_000_000),
    ("b", 1),
    ("", 1),
];

impl Budget {
    /// The budget in bytes, given the free device memory for a percentage.
    pub fn resolve(&self, free_bytes: u64) -> u64 {
        match *self {
            Budget::Bytes(b) => b,
            Budget::Percent(p) => ((free_bytes as f64) * p / 100.0).floor() as u64,
        }
    }
}

fn syntax(text: &str, why: impl Into<String>) -> TuneError {
    TuneError::BudgetSyntax {
        text: text.to_string(),
        why: why.into(),
    }
}

/// A non-negative decimal number as (digits before the point, digits after it).
fn decimal<'a>(text: &str, num: &'a str) -> Result<(&'a str, &'a str), TuneError> {
    let (int, frac) = num.split_once('.').unwrap_or((num, ""));
    if int.is_empty() && frac.is_empty() {
        return Err(syntax(text, "no number"));
    }
    if !int.bytes().chain(frac.bytes()).all(|b| b.is_ascii_digit()) {
        return Err(syntax(text, format!("{num:?} is not a number")));
    }
    Ok((int, frac))
}

impl FromStr for Budget {
    type Err = TuneError;

    fn from_str(text: &str) -> Result<Self, TuneError> {
        let t = text.trim();
        if let Some(num) = t.strip_suffix('%') {
            let (int, frac) = decimal(text, num.trim_end())?;
            let p: f64 = format!("{}.{}0", if int.is_empty() { "0" } else { int }, frac)
                .parse()
                .map_err(|_| syntax(text, "not a percentage"))?;
            if !(p > 0.0 && p <= 100.0) {
                return Err(syntax(text, "a percentage must be above 0 and at most 100"));
            }
            return Ok(Budget::Percent(p));
        }
        let lower = t.to_ascii_lowercase();
        let split = lower
            .find(|c: char| c.is_ascii_alphabetic())
            .unwrap_or(lower.len());
        let (num, unit) = (lower[..split].trim_end(), &lower[split..]);
        let Some(&(_, mult)) = UNITS.iter().find(|(u, _)| *u == unit) else {
            return Err(syntax(text, format!("unknown unit {:?}", &t[split..])));
        };
        let (int, frac) = decimal(text, num)?;
        if frac.len() > 18 {
            return Err(syntax(text, "too many decimals"));
        }
        let too_big = || syntax(text, "larger than 2^64 bytes");
        let int_v: u128 = if int.is_empty() {
            0
        } else {
            int.parse::<u64>().map_err(|_| too_big())? as u128
        };
        let frac_v: u128 = if frac.is_empty() {
            0
        } else {
            frac.parse().unwrap_or(0)
        };
        let scale = 10u128.pow(frac.len() as u32);
        // Exact decimal arithmetic: 11.5GiB is 11·2^30 + 5·2^30/10 bytes, rounded down.
        let bytes = int_v * mult as u128 + frac_v * mult as u128 / scale;
        if bytes > u64::MAX as u128 {
            return Err(too_big());
        }
        if mult == 1 && !frac.is_empty() && frac_v != 0 {
            return Err(syntax(text, "a byte count is a whole number"));
        }
        Ok(Budget::Bytes(bytes as u64))
    }
}

impl fmt::Display for Budget {
    /// A form that parses back to the same budget: the largest unit that gives at most two
    /// decimals exactly, else plain bytes.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Budget::Percent(p) => write!(f, "{p}%"),
            Budget::Bytes(b) => {
                let names = ["TiB", "TB", "GiB", "GB", "MiB", "MB", "KiB", "kB"];
                let mults = [
                    1u64 << 40,
                    1_000_000_000_000,
                    1 << 30,
                    1_000_000_000,
                    1 << 20,
                    1_000_000,
                    1 << 10,
                    1_000,
                ];
                for (name, m) in names.iter().zip(mults) {
                    if b >= m && (b as u128 * 100).is_multiple_of(m as u128) {
                        let centi = b as u128 * 100 / m as u128;
                        let (int, frac) = (centi / 100, centi % 100);
                        return if frac == 0 {
                            write!(f, "{int}{name}")
                        } else {
                            let s = format!("{frac:02}");
                            write!(f, "{int}.{}{name}", s.trim_end_matches('0'))
                        };
                    }
                }
                write!(f, "{b}")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b(s: &str) -> Budget {
        s.parse().unwrap_or_else(|e| panic!("{s}: {e}"))
    }

    #[test]
    fn parses_every_accepted_form() {
        assert_eq!(b("12GB"), Budget::Bytes(12_000_000_000));
        assert_eq!(b("11.5GiB"), Budget::Bytes(23 << 29));
        assert_eq!(b("500MB"), Budget::Bytes(500_000_000));
        assert_eq!(b("500MiB"), Budget::Bytes(500 << 20));
        assert_eq!(b("123456"), Budget::Bytes(123456));
        assert_eq!(b("123456B"), Budget::Bytes(123456));
        assert_eq!(b(" 64 kib "), Budget::Bytes(65536));
        assert_eq!(b("2kB"), Budget::Bytes(2000));
        assert_eq!(b("1TiB"), Budget::Bytes(1 << 40));
        assert_eq!(b("0.5gb"), Budget::Bytes(500_000_000));
        assert_eq!(b(".25GiB"), Budget::Bytes(1 << 28));
        assert_eq!(b("1.0000000001GB"), Budget::Bytes(1_000_000_000));
        assert_eq!(b("80%"), Budget::Percent(80.0));
        assert_eq!(b("12.5 %"), Budget::Percent(12.5));
        assert_eq!(b("100%"), Budget::Percent(100.0));
    }

    #[test]
    fn refuses_with_the_accepted_forms() {
        for bad in [
            "",
            "GB",
            "12 XB",
            "12G",
            "-5GB",
            "1e9",
            "0%",
            "101%",
            "abc%",
            "1.5",
            "1.2.3GB",
            "99999999999999999999",
            "20000000000GB",
            "12GB extra",
        ] {
            let err = bad.parse::<Budget>().expect_err(bad).to_string();
            assert!(
                err.contains("11.5GiB") && err.contains("80%"),
                "{bad}: {err}"
            );
            assert!(err.contains(&format!("{bad:?}")), "{bad}: {err}");
        }
    }

    #[test]
    fn resolves_percentages_of_free_memory() {
        assert_eq!(b("80%").resolve(10_000), 8_000);
        assert_eq!(b("12.5%").resolve(1001), 125);
        assert_eq!(b("12GB").resolve(1), 12_000_000_000);
    }

    #[test]
    fn display_round_trips() {
        for (text, shown) in [
            ("12GB", "12GB"),
            ("11.5GiB", "11.5GiB"),
            ("500MiB", "500MiB"),
            ("123456", "123456"),
            ("1000", "1kB"),
            ("1024", "1KiB"),
            ("1536MiB", "1.5GiB"),
            ("80%", "80%"),
            ("0.5%", "0.5%"),
        ] {
            assert_eq!(b(text).to_string(), shown);
        }
        let mut g = entrollm_codec::rng::SplitMix64::new(1);
        for _ in 0..2000 {
            let s = g.next_u64();
            let v = Budget::Bytes(s >> (s % 60));
            assert_eq!(b(&v.to_string()), v, "{v}");
        }
    }
}
