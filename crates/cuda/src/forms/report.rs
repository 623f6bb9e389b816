//! What an upload did: the launches each GPU form took, keyed by the form's name. A leaf module:
//! the forms write it, the model builder and the CLI read it.

use std::collections::BTreeMap;

/// Where a BF16 matrix is coded: the host's encoder or the GPU's (byte-identical output; the
/// host makes the plan either way).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Encoder {
    Cpu,
    Gpu,
}

impl std::str::FromStr for Encoder {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "cpu" => Ok(Encoder::Cpu),
            "gpu" => Ok(Encoder::Gpu),
            _ => Err(format!("encoder '{s}': expected cpu or gpu")),
        }
    }
}

/// How the model builder ([`crate::GpuModel::upload_coded`]) served a model's layer and head
/// launches (stacked q/k/v, o, gate/up, down, LM head).
#[derive(Clone, Debug, Default)]
pub struct LoadReport {
    /// Launches each GPU form took, by its name ([`super::GpuForm::name`]); a launch no form took
    /// is served dense BF16 by the builder and not counted.
    pub launches: BTreeMap<&'static str, usize>,
    /// Launches served dense when coding at load, each with why.
    pub dense_notes: Vec<String>,
    /// Host: gathering each matrix's BF16 bits, the coder's choice (auto) and the plan.
    pub plan_s: f64,
    /// Uploading the BF16 matrices to code.
    pub upload_s: f64,
    /// Coding: the GPU encoder's passes (or, with [`Encoder::Cpu`], the host encoder and the upload
    /// of its arrays).
    pub encode_s: f64,
}

impl LoadReport {
    /// One launch taken by the form named `form`.
    pub fn took(&mut self, form: &'static str) {
        *self.launches.entry(form).or_default() += 1;
    }

    /// Launches the form named `form` took.
    pub fn by(&self, form: &str) -> usize {
        self.launches.get(form).copied().unwrap_or(0)
    }

    /// Launches the forms took.
    pub fn taken(&self) -> usize {
        self.launches.values().sum()
    }

    /// The launches taken as `form: n` pairs, for messages (`none` where no form took any).
    pub fn summary(&self) -> String {
        match self.launches.is_empty() {
            true => "none".to_string(),
            false => self
                .launches
                .iter()
                .map(|(f, n)| format!("{f}: {n}"))
                .collect::<Vec<_>>()
                .join(", "),
        }
    }

    /// Adds `other`'s launches (a layer copied from an earlier one is counted as that one was).
    pub fn add(&mut self, other: &BTreeMap<&'static str, usize>) {
        for (f, n) in other {
            *self.launches.entry(f).or_default() += n;
        }
    }

    /// The launches taken since `before` (an earlier copy of [`Self::launches`]).
    pub fn since(&self, before: &BTreeMap<&'static str, usize>) -> BTreeMap<&'static str, usize> {
        self.launches
            .iter()
            .map(|(f, n)| (*f, n - before.get(f).copied().unwrap_or(0)))
            .filter(|&(_, n)| n > 0)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn launches_are_counted_by_form_and_copied_as_deltas() {
        let mut r = LoadReport::default();
        assert_eq!(r.summary(), "none");
        r.took("dtans");
        let before = r.launches.clone();
        r.took("dtans");
        r.took("fp8");
        let delta = r.since(&before);
        assert_eq!(delta, BTreeMap::from([("dtans", 1), ("fp8", 1)]));
        r.add(&delta);
        assert_eq!((r.taken(), r.by("dtans"), r.by("int")), (5, 3, 0));
        assert_eq!(r.summary(), "dtans: 3, fp8: 2");
    }
}
