//! Which dtANS coding each matrix gets, by launch: the batch-1 products of a decoder layer (q/k/v
//! share an input and run as one launch, gate/up likewise) and the model's head. `compress
//! --coding-file` reads a plan; a tuner writes one.
//!
//! A plan file is a JSON object of launch name → coding (`Coding::parse`'s form, or `"auto"`):
//!
//! ```json
//! { "default": "auto", "qkv": "pair:8:256:16", "o": "pair:8:256:16",
//!   "gate_up": "pair:8:2048:16", "down": "pair:8:1024:16", "lm_head": "pair:8:512:16" }
//! ```

use crate::error::{ModelError, Result};
use entrollm_codec::dtans::Coding;
use std::collections::BTreeMap;
use std::path::Path;

/// A batch-1 launch of the forward pass (what a coding is tuned for).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Launch {
    Qkv,
    O,
    GateUp,
    Down,
    LmHead,
    Embed,
    /// A mixture of experts' router.
    Router,
}

impl Launch {
    pub const ALL: [Launch; 7] = [
        Launch::Qkv,
        Launch::O,
        Launch::GateUp,
        Launch::Down,
        Launch::LmHead,
        Launch::Embed,
        Launch::Router,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Launch::Qkv => "qkv",
            Launch::O => "o",
            Launch::GateUp => "gate_up",
            Launch::Down => "down",
            Launch::LmHead => "lm_head",
            Launch::Embed => "embed",
            Launch::Router => "router",
        }
    }

    pub fn from_name(s: &str) -> Option<Launch> {
        Self::ALL.into_iter().find(|l| l.name() == s)
    }

    /// The launch a tensor belongs to, from its Hugging Face or GGUF name in any family.
    pub fn of_tensor(name: &str) -> Option<Launch> {
        use crate::arch::Role;
        Some(match crate::arch::role_of_tensor(name)? {
            Role::Q | Role::K | Role::V | Role::Qkv => Launch::Qkv,
            Role::O => Launch::O,
            Role::Gate | Role::Up | Role::GateUp | Role::ExpertGate | Role::ExpertUp => {
                Launch::GateUp
            }
            Role::Down | Role::ExpertDown => Launch::Down,
            Role::Router => Launch::Router,
            Role::LmHead => Launch::LmHead,
            Role::Embed => Launch::Embed,
            Role::AttnNorm
            | Role::QNorm
            | Role::KNorm
            | Role::PostAttnNorm
            | Role::MlpNorm
            | Role::PostMlpNorm
            | Role::Sinks
            | Role::FinalNorm => return None,
        })
    }
}

/// A coding per launch (`None`: the coder chooses), with a default for the rest.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CodingPlan {
    pub default: Option<Coding>,
    pub launches: BTreeMap<Launch, Option<Coding>>,
}

impl CodingPlan {
    /// The same coding (or the coder's choice) for every tensor.
    pub fn uniform(coding: Option<Coding>) -> Self {
        CodingPlan {
            default: coding,
            launches: BTreeMap::new(),
        }
    }

    /// Parses a plan file's text (see the module docs); `default` is used where the file has no
    /// `"default"` entry.
    pub fn from_json(text: &str, default: Option<Coding>) -> Result<Self> {
        let bad = |m: String| ModelError::Config(format!("coding plan: {m}"));
        let map: BTreeMap<String, String> = serde_json::from_str(text).map_err(|e| {
            bad(format!(
                "expected an object of launch → coding strings: {e}"
            ))
        })?;
        let mut plan = CodingPlan::uniform(default);
        for (k, v) in map {
            let coding = Coding::parse(&v).map_err(bad)?;
            if k == "default" {
                plan.default = coding;
                continue;
            }
            let launch = Launch::from_name(&k).ok_or_else(|| {
                let names: Vec<&str> = Launch::ALL.iter().map(|l| l.name()).collect();
                bad(format!(
                    "unknown launch '{k}' (default, {})",
                    names.join(", ")
                ))
            })?;
            plan.launches.insert(launch, coding);
        }
        Ok(plan)
    }

    pub fn from_file(path: &Path, default: Option<Coding>) -> Result<Self> {
        let text =
            entrollm_format::input::read_text_limited(path, entrollm_format::input::JSON_LIMIT)
                .map_err(|e| ModelError::Io {
                    path: path.to_path_buf(),
                    error: e,
                })?;
        Self::from_json(&text, default)
            .map_err(|e| ModelError::Config(format!("{}: {e}", path.display())))
    }

    /// The coding of the tensor `name` (HF or GGUF name).
    pub fn coding_for(&self, name: &str) -> Option<Coding> {
        Launch::of_tensor(name)
            .and_then(|l| self.launches.get(&l).copied())
            .unwrap_or(self.default)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensors_map_to_their_launch() {
        for (name, launch) in [
            ("model.layers.3.self_attn.k_proj.weight", Some(Launch::Qkv)),
            ("blk.3.attn_v.weight", Some(Launch::Qkv)),
            ("model.layers.0.self_attn.o_proj.weight", Some(Launch::O)),
            ("blk.0.ffn_up.weight", Some(Launch::GateUp)),
            ("model.layers.9.mlp.down_proj.weight", Some(Launch::Down)),
            ("output.weight", Some(Launch::LmHead)),
            ("model.embed_tokens.weight", Some(Launch::Embed)),
            ("model.norm.weight", None),
        ] {
            assert_eq!(Launch::of_tensor(name), launch, "{name}");
        }
    }

    #[test]
    fn plans_parse_and_fall_back_to_the_default() {
        let plan = CodingPlan::from_json(
            r#"{"qkv": "pair:8:256:16", "down": "auto", "default": "single:10:2048"}"#,
            None,
        )
        .unwrap();
        let c = |s| Coding::parse(s).unwrap();
        assert_eq!(plan.coding_for("blk.1.attn_q.weight"), c("pair:8:256:16"));
        assert_eq!(plan.coding_for("blk.1.ffn_down.weight"), None);
        assert_eq!(
            plan.coding_for("blk.1.ffn_gate.weight"),
            c("single:10:2048")
        );
        assert_eq!(
            c("pair:8:256:16").unwrap().to_string(),
            "pair:8:256:16",
            "Display is what parse reads"
        );
        let err = |t: &str| CodingPlan::from_json(t, None).unwrap_err().to_string();
        assert!(err(r#"{"qkvv": "auto"}"#).contains("unknown launch 'qkvv'"));
        assert!(err(r#"{"o": "pair:x:256"}"#).contains("LOG2M"));
        assert!(err(r#"["o"]"#).contains("object"));
    }
}
