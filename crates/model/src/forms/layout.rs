//! The launches of a model's forward pass (what a form is chosen for) and a model re-formed by a
//! choice per launch.

use super::{by_name, reform};
use crate::arch::Role;
use crate::coding_plan::Launch;
use crate::error::{ModelError, Result};
use crate::weights::{Linear, Mlp, ModelWeights};
use rayon::prelude::*;
use std::collections::BTreeMap;
use std::sync::Arc;

/// One launch of the forward pass: the matrices that share an input (q/k/v, gate/up) or one
/// matrix (o, down, the LM head, the embedding table).
#[derive(Clone)]
pub struct LaunchInstance {
    /// `layers.3.qkv`, `lm_head`, `embed`.
    pub id: String,
    pub launch: Launch,
    /// HF names of its matrices; a tied LM head also names the embedding.
    pub tensors: Vec<String>,
    pub matrices: Vec<Arc<dyn Linear>>,
}

impl LaunchInstance {
    /// Launches with equal keys have the same shapes, source kinds and layouts (a GGUF tensor's
    /// block type): timed once.
    pub fn shape_key(&self) -> String {
        let mut key = self.launch.name().to_string();
        for m in &self.matrices {
            key += &format!(":{}x{}", m.rows(), m.cols());
            if let Some(tag) = m.layout_tag() {
                key += &format!("({tag})");
            }
        }
        format!("{key}:{}", self.matrices[0].values_kind())
    }

    pub fn stored_bytes(&self) -> usize {
        self.matrices.iter().map(|m| m.stored_bytes()).sum()
    }
}

/// Every launch of `w`, in forward order (embedding, per layer q/k/v, o, gate/up, down, LM head).
/// A tied LM head is one launch with the embedding (one matrix, stored once).
pub fn launches(w: &ModelWeights) -> Vec<LaunchInstance> {
    let tied = Arc::ptr_eq(&w.embed, &w.lm_head);
    let mut out = Vec::new();
    let many = |id: &str, launch, tensors: Vec<String>, m: &[&Arc<dyn Linear>]| LaunchInstance {
        id: id.to_string(),
        launch,
        tensors,
        matrices: m.iter().map(|m| Arc::clone(m)).collect(),
    };
    let one = |id: &str, launch, names: &[&str], m: &[&Arc<dyn Linear>]| {
        many(id, launch, names.iter().map(|s| s.to_string()).collect(), m)
    };
    if !tied {
        out.push(one(
            "embed",
            Launch::Embed,
            &["model.embed_tokens.weight"],
            &[&w.embed],
        ));
    }
    let family = w.config.arch.family();
    for (i, l) in w.layers.iter().enumerate() {
        // The checkpoint's names of a launch's matrices: the fused tensor where the family
        // stores them as one.
        let names = |fused: Role, parts: &[Role]| -> Vec<String> {
            let roles = match family.has(fused) {
                true => vec![fused],
                false => parts.to_vec(),
            };
            roles
                .iter()
                .filter_map(|&r| family.hf_name(r, i, "weight"))
                .collect()
        };
        out.push(many(
            &format!("layers.{i}.qkv"),
            Launch::Qkv,
            names(Role::Qkv, &[Role::Q, Role::K, Role::V]),
            &[&l.q, &l.k, &l.v],
        ));
        out.push(many(
            &format!("layers.{i}.o"),
            Launch::O,
            names(Role::O, &[]),
            &[&l.o],
        ));
        match &l.mlp {
            Mlp::Gated(g) => {
                out.push(many(
                    &format!("layers.{i}.gate_up"),
                    Launch::GateUp,
                    names(Role::GateUp, &[Role::Gate, Role::Up]),
                    &[&g.gate, &g.up],
                ));
                out.push(many(
                    &format!("layers.{i}.down"),
                    Launch::Down,
                    names(Role::Down, &[]),
                    &[&g.down],
                ));
            }
            Mlp::Experts(e) => {
                out.push(many(
                    &format!("layers.{i}.router"),
                    Launch::Router,
                    names(Role::Router, &[]),
                    &[&e.router],
                ));
                // Each expert's gate/up and down are launches of their own: only the routed
                // ones run for a token, so each may take its own form.
                for (x, g) in e.experts.iter().enumerate() {
                    let n = |role| family.hf_expert_name(role, i, x).into_iter().collect();
                    let both = [n(Role::ExpertGate), n(Role::ExpertUp)].concat();
                    out.push(many(
                        &format!("layers.{i}.experts.{x}.gate_up"),
                        Launch::GateUp,
                        both,
                        &[&g.gate, &g.up],
                    ));
                    out.push(many(
                        &format!("layers.{i}.experts.{x}.down"),
                        Launch::Down,
                        n(Role::ExpertDown),
                        &[&g.down],
                    ));
                }
            }
        }
    }
    let head_names: &[&str] = match tied {
        true => &["lm_head.weight", "model.embed_tokens.weight"],
        false => &["lm_head.weight"],
    };
    out.push(one("lm_head", Launch::LmHead, head_names, &[&w.lm_head]));
    out
}

/// Bytes `m` takes in the form its values are held in at the source, its wrappers (row scales)
/// included: 2 a weight for BF16 and F16, 1 for FP8, 4 for F32, a GGUF's blocks, integer codes
/// as their own form holds them. A coded or lossy matrix counts its source's bytes (a lossy
/// matrix's values are those of the dtype it was coded from); the budget a model is served in by
/// default ("the weights as the checkpoint stores them").
pub fn source_bytes(m: &dyn Linear) -> Result<u64> {
    let n = (m.rows() * m.cols()) as u64;
    let inner = match m.values_kind() {
        "bf16" | "f16" => 2 * n,
        "fp8" => n,
        "f32" => 4 * n,
        "ggml" => {
            let tag = m.layout_tag().unwrap_or("");
            (0..64)
                .filter_map(crate::gguf::GgmlType::from_id)
                .find(|t| t.name() == tag)
                .and_then(|t| t.bytes_for(n))
                .ok_or_else(|| {
                    ModelError::Unsupported(format!(
                        "a ggml matrix of block type '{tag}' and {n} weights"
                    ))
                })?
        }
        kind => {
            // Integer codes: the size of their own form (the matrix as it is, where it is in it).
            let form = by_name(kind)?;
            let id = m.form();
            match id.form == kind && id.variant.is_empty() {
                true => (m.stored_bytes() - m.wrapper_bytes()) as u64,
                false => form.predict(&m.source()?, "")?.round() as u64,
            }
        }
    };
    Ok(inner + m.wrapper_bytes() as u64)
}

/// [`source_bytes`] of every launch of `w` (a tied LM head once): the weights' own size.
pub fn source_launch_bytes(w: &ModelWeights) -> Result<u64> {
    let mut total = 0;
    for l in launches(w) {
        for m in &l.matrices {
            total += source_bytes(&**m)?;
        }
    }
    Ok(total)
}

/// A form and variant for one launch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaunchForm {
    pub form: String,
    pub variant: String,
}

/// `w` with each launch named in `choices` (by launch id) re-formed; launches not named keep
/// their form. Matrices are re-formed in parallel; `progress(done, total)` after each.
pub fn apply(
    w: &ModelWeights,
    choices: &BTreeMap<String, LaunchForm>,
    progress: &(dyn Fn(usize, usize) + Sync),
) -> Result<ModelWeights> {
    let all = launches(w);
    for id in choices.keys() {
        if !all.iter().any(|l| &l.id == id) {
            return Err(ModelError::Config(format!(
                "the plan names launch '{id}', which this model does not have \
                 (a plan made for another model?)"
            )));
        }
    }
    let jobs: Vec<(&LaunchInstance, usize, &LaunchForm)> = all
        .iter()
        .filter_map(|l| choices.get(&l.id).map(|c| (l, c)))
        .flat_map(|(l, c)| (0..l.matrices.len()).map(move |i| (l, i, c)))
        .collect();
    // A matrix that several launches share (a synthetic model's layers hold layer 0's) is
    // re-formed once per form and variant, and the results share it again.
    let key = |&(l, i, c): &(&LaunchInstance, usize, &LaunchForm)| {
        let m = Arc::as_ptr(&l.matrices[i]) as *const () as usize;
        (m, c.form.clone(), c.variant.clone())
    };
    let mut unique = BTreeMap::new();
    for j in &jobs {
        unique.entry(key(j)).or_insert(*j);
    }
    let unique: Vec<_> = unique.into_iter().collect();
    let total = unique.len();
    let done = std::sync::atomic::AtomicUsize::new(0);
    let made: Vec<(_, Arc<dyn Linear>)> = unique
        .par_iter()
        .map(|(k, (l, i, c))| {
            let form = by_name(&c.form)?;
            // A launch chosen in the form its first matrix is held in keeps every matrix as held
            // (a GGUF's q/k/v of different block types: the launch as stored).
            let first = l.matrices[0].form();
            if first.form == c.form && first.variant == c.variant {
                return Ok((k.clone(), Arc::clone(&l.matrices[*i])));
            }
            let m = reform(&l.matrices[*i], form, &c.variant).map_err(|e| {
                ModelError::tensor(&l.tensors[*i], format!("as {} {}: {e}", c.form, c.variant))
            })?;
            progress(
                done.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1,
                total,
            );
            Ok((k.clone(), m))
        })
        .collect::<Result<_>>()?;
    let made: BTreeMap<_, Arc<dyn Linear>> = made.into_iter().collect();
    let formed: BTreeMap<(String, usize), Arc<dyn Linear>> = jobs
        .iter()
        .map(|j| ((j.0.id.clone(), j.1), Arc::clone(&made[&key(j)])))
        .collect();
    let get = |id: &str, i: usize, old: &Arc<dyn Linear>| {
        formed
            .get(&(id.to_string(), i))
            .map_or_else(|| Arc::clone(old), Arc::clone)
    };
    let tied = Arc::ptr_eq(&w.embed, &w.lm_head);
    let lm_head = get("lm_head", 0, &w.lm_head);
    let embed = match tied {
        true => Arc::clone(&lm_head),
        false => get("embed", 0, &w.embed),
    };
    let layers = w
        .layers
        .iter()
        .enumerate()
        .map(|(i, l)| {
            l.map_matrices(|launch, j, m| Ok::<_, ()>(get(&format!("layers.{i}.{launch}"), j, m)))
                .expect("re-forming was done above")
        })
        .collect();
    let out = ModelWeights {
        config: w.config.clone(),
        embed,
        layers,
        final_norm: w.final_norm.clone(),
        lm_head,
    };
    out.validate()?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synth::{shared_layer_weights, SynthShape};

    /// A GGUF's layers of one shape in different block types (a Q4_K_M file's Q4_K and Q6_K
    /// down projections) are timed apart; the same type shares its key.
    #[test]
    fn gguf_block_types_part_shape_keys() {
        use crate::forms::ggml::{synth_blocks, BlockBytes, GGML};
        use crate::forms::{Form, Values};
        use crate::gguf::GgmlType;
        let down = |ty: GgmlType| {
            let (rows, cols) = (4, 512);
            let bytes = synth_blocks(ty, rows * cols / ty.block_size(), 3);
            let values = Values::Ggml {
                ty,
                bytes: BlockBytes::from_vec(bytes),
            };
            let m = GGML
                .encode(&crate::forms::Source::new(rows, cols, values).unwrap(), "")
                .unwrap();
            LaunchInstance {
                id: "layers.0.down".into(),
                launch: Launch::Down,
                tensors: vec!["down".into()],
                matrices: vec![m],
            }
            .shape_key()
        };
        assert_ne!(down(GgmlType::Q4_K), down(GgmlType::Q6_K));
        assert_eq!(down(GgmlType::Q4_K), down(GgmlType::Q4_K));
    }

    #[test]
    fn shared_matrices_are_reformed_once_and_stay_shared() {
        let w = shared_layer_weights(&SynthShape::Tiny.config(), 3).unwrap();
        let pal = LaunchForm {
            form: "pal-bf16".into(),
            variant: "h4".into(),
        };
        let form = by_name(&pal.form).unwrap();
        let v = form.variants(&w.layers[0].o.source().unwrap()).unwrap();
        let pal = LaunchForm {
            variant: v[0].variant.clone(),
            ..pal
        };
        let choices: BTreeMap<String, LaunchForm> = ["layers.0.o", "layers.1.o", "layers.0.qkv"]
            .into_iter()
            .map(|id| (id.to_string(), pal.clone()))
            .collect();
        let calls = std::sync::atomic::AtomicUsize::new(0);
        let out = apply(&w, &choices, &|_, total| {
            calls.store(total, std::sync::atomic::Ordering::Relaxed)
        })
        .unwrap();
        // o is shared by both layers: one re-form for it, one each for layer 0's q, k and v.
        assert_eq!(calls.into_inner(), 4);
        assert!(Arc::ptr_eq(&out.layers[0].o, &out.layers[1].o));
        assert_eq!(out.layers[1].o.form().form, "pal-bf16");
        assert_eq!(out.layers[0].k.form().form, "pal-bf16");
        assert!(!Arc::ptr_eq(&out.layers[0].k, &out.layers[1].k));
        assert!(Arc::ptr_eq(&out.layers[1].k, &w.layers[1].k));
        let (mut a, mut b) = (
            vec![0f32; w.layers[0].o.cols()],
            vec![0f32; w.layers[0].o.cols()],
        );
        for r in 0..w.layers[0].o.rows() {
            w.layers[1].o.row(r, &mut a);
            out.layers[1].o.row(r, &mut b);
            assert_eq!(a, b, "row {r}");
        }
    }
}
