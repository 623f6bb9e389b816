//! The decode step each GPU model configuration gets (`plan::decode_plan`), on the CPU: the plan
//! text of every form (dense BF16, FP8 as stored and palette-packed, BF16 palette-packed,
//! dtANS-coded with the tuned codings, a container's mix) and every `DecodeOptions` toggle against
//! the golden files in `tests/plans/`, which were written from the engine's decode step before it
//! ran from a plan. The engine checks each captured graph against its plan on the device, so a
//! change in which kernels run shows up here. An intended change: rerun with
//! `ENTROLLM_BLESS_PLANS=1` to rewrite the files, and review their diff.

use std::path::{Path, PathBuf};

use entrollm_check::families_selftest::{family_config, mixtral_q8_0_config, phi3_96_config};
use entrollm_codec::dtans::Coding;
use entrollm_codec::Payload;
use entrollm_cuda::engine_coded::{e2e_config, tuned_plan, COMPACT_PLAN_JSON};
use entrollm_cuda::forms;
use entrollm_cuda::plan::{decode_plan, text_diff, DecodeOptions, ModelDesc};
use entrollm_model::coding_plan::{CodingPlan, Launch};
use entrollm_model::config::Arch;
use entrollm_model::gguf::GgmlType;
use entrollm_model::synth::SynthShape;
use entrollm_model::ModelConfig;

/// SMs of the H200 (the palette and FP8 SwiGLU launches depend on it).
const SMS: u32 = 132;

fn golden(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/plans")
        .join(format!("{name}.txt"))
}

/// Compares the plan of `m` under `opts` with `tests/plans/NAME.txt`, printing a diff.
fn check(name: &str, m: &ModelDesc, opts: DecodeOptions, greedy: bool) {
    let got = decode_plan(m, &opts, greedy).unwrap().to_string() + "\n";
    let path = golden(name);
    if std::env::var_os("ENTROLLM_BLESS_PLANS").is_some() {
        std::fs::write(&path, &got).unwrap();
        return;
    }
    let want = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (ENTROLLM_BLESS_PLANS=1 writes it)", path.display()));
    if let Some(d) = text_diff(&want, &got) {
        panic!(
            "the decode plan `{name}` differs from {} (- expected, + got); if intended, rerun \
             with ENTROLLM_BLESS_PLANS=1 and review the diff:\n{d}",
            path.display()
        );
    }
}

fn opts(knobs: &[(&str, &str)]) -> DecodeOptions {
    let mut o = DecodeOptions::default();
    for (k, v) in knobs {
        o.set(k, v).unwrap();
    }
    o
}

fn llama8b(layers: usize) -> ModelConfig {
    let mut c = SynthShape::Llama31_8B.config();
    c.num_layers = layers;
    c
}

fn dense(c: &ModelConfig) -> ModelDesc {
    ModelDesc::build(c, SMS, |_, r, k| Ok(forms::bf16::desc(r, k))).unwrap()
}

/// An FP8 checkpoint served with its codes as stored (`palette` false) or palette-packed; its
/// BF16 LM head dense, or palette-packed with the palette form (`pal_bf16_head`).
fn fp8(c: &ModelConfig, palette: bool) -> ModelDesc {
    ModelDesc::build(c, SMS, |launch, r, k| {
        Ok(match (launch, palette) {
            ("lm_head", false) => forms::bf16::desc(r, k),
            ("lm_head", true) => forms::pal_bf16::desc(r, k, SMS),
            _ => forms::fp8::desc(r, k, palette, SMS),
        })
    })
    .unwrap()
}

/// Every launch dtANS-coded whole as `plan` says (`GpuModel::upload_coded`: one part a launch,
/// gate/up rows interleaved).
fn coded(c: &ModelConfig, plan: &CodingPlan) -> ModelDesc {
    ModelDesc::build(c, SMS, |launch, r, k| {
        let l = Launch::from_name(launch).unwrap();
        let coding = plan.launches.get(&l).copied().flatten().or(plan.default);
        forms::dtans::desc(Payload::Bf16, coding.unwrap(), r, k, 1, false)
    })
    .unwrap()
}

#[test]
fn dense_bf16() {
    let d = dense(&llama8b(32));
    check("dense-bf16-8b", &d, DecodeOptions::default(), true);
    let e = dense(&e2e_config());
    check("dense-bf16-e2e", &e, DecodeOptions::default(), true);
    check("dense-bf16-e2e-logits", &e, DecodeOptions::default(), false);
}

#[test]
fn dense_bf16_under_each_option() {
    let e = dense(&e2e_config());
    for (name, knobs) in [
        (
            "dense-bf16-e2e-fused-attention",
            &[("attention", "fused")][..],
        ),
        ("dense-bf16-e2e-fused-norm", &[("norm", "fused")]),
        ("dense-bf16-e2e-split-norm", &[("norm", "split")]),
        ("dense-bf16-e2e-split-rope", &[("rope", "split")]),
        ("dense-bf16-e2e-pdl-off", &[("pdl", "off")]),
    ] {
        check(name, &e, opts(knobs), true);
    }
    // Dense BF16 has no FP8 GEMV: `pdl all` is `pdl on`.
    let all = decode_plan(&e, &opts(&[("pdl", "all")]), true).unwrap();
    let on = decode_plan(&e, &DecodeOptions::default(), true).unwrap();
    assert_eq!(all.launches, on.launches);
}

#[test]
fn fp8_as_stored_and_palette_packed() {
    let c = llama8b(3);
    let d = fp8(&c, false);
    check("fp8-dense-8b", &d, DecodeOptions::default(), true);
    check("fp8-dense-8b-pdl-all", &d, opts(&[("pdl", "all")]), true);
    let p = fp8(&c, true);
    check("fp8-palette-8b", &p, DecodeOptions::default(), true);
    check(
        "fp8-palette-8b-split-norm",
        &p,
        opts(&[("norm", "split")]),
        true,
    );
}

#[test]
fn bf16_palette_packed() {
    let m = ModelDesc::build(&llama8b(3), SMS, |_, r, k| {
        Ok(forms::pal_bf16::desc(r, k, SMS))
    })
    .unwrap();
    check("bf16-palette-8b", &m, DecodeOptions::default(), true);
}

#[test]
fn dtans_tuned_codings() {
    let c = llama8b(3);
    check(
        "dtans-tuned-pair-8b",
        &coded(&c, &tuned_plan(&c)),
        DecodeOptions::default(),
        true,
    );
    let plan = CodingPlan::from_json(COMPACT_PLAN_JSON, None).unwrap();
    check(
        "dtans-tuned-single-8b",
        &coded(&c, &plan),
        DecodeOptions::default(),
        true,
    );
}

#[test]
fn container_mix() {
    let mut c = e2e_config();
    c.tie_word_embeddings = true;
    c.attention_bias = true;
    let mut m = dense(&c);
    let coding = |s: &str| Coding::parse(s).unwrap().unwrap();
    let dtans = |s, r, k, parts, halves| {
        forms::dtans::desc(Payload::Bf16, coding(s), r, k, parts, halves).unwrap()
    };
    for l in &mut m.layers {
        l.qkv_bias = true;
    }
    m.layers[0].qkv = dtans("pair:8:128:16", 512, 256, 3, false);
    m.layers[0].gate_up = dtans("pair:8:256:16", 1040, 256, 2, true);
    m.layers[1].down = dtans("single:8:512", 256, 520, 1, false);
    assert!(m.lm_head.is_none());
    check("container-mix-e2e", &m, DecodeOptions::default(), true);
}

/// The families beyond Llama (`families_selftest::family_config`: Qwen3's q/k norms, Phi-3's
/// partial rotary and windows, Gemma 2's GeGLU, post norms, embedding scale, soft-caps and
/// alternating windows, Gemma 3's q/k norms, post norms and local RoPE), dense BF16, and Qwen3
/// and Gemma 3 as FP8 checkpoints palette-packed (the norms inside the GEMVs).
#[test]
fn families() {
    for arch in FAMILY_ARCHS {
        let c = family_config(arch);
        let name = format!("family-{}-dense", arch.family().name);
        check(&name, &dense(&c), DecodeOptions::default(), true);
    }
    for arch in [Arch::Qwen3, Arch::Gemma3] {
        let c = family_config(arch);
        let name = format!("family-{}-fp8-palette", arch.family().name);
        check(&name, &fp8(&c, true), DecodeOptions::default(), true);
    }
    // Mixtures of experts: dense BF16 experts (one gathered GEMV each of gate/up and down), and
    // Mixtral's experts as GGUF Q8_0 blocks (the gathered ggml product, SwiGLU after it).
    for arch in MOE_ARCHS {
        let c = family_config(arch);
        let name = format!("family-{}-dense", arch.family().name);
        check(&name, &dense(&c), DecodeOptions::default(), true);
    }
    // Phi-3-mini's heads of 96, every dimension rotated: RoPE in the q/k/v GEMV's epilogue.
    check(
        "family-phi3-96-dense",
        &dense(&phi3_96_config()),
        DecodeOptions::default(),
        true,
    );
    check(
        "family-mixtral-ggml-experts",
        &ggml_experts(&mixtral_q8_0_config(), GgmlType::Q8_0),
        DecodeOptions::default(),
        true,
    );
    // gpt-oss: sinks in the attention lines, o into y then its bias and the residual add, the
    // router's top-k of its biased logits, the experts' plain gate/up product then `moe_glu`
    // (clamped SwiGLU, the experts' biases), the combine with their down biases; dense BF16 and
    // with its experts as MXFP4 blocks (gate/up as halves).
    let g = gpt_oss(dense(&family_config(Arch::GptOss)));
    check("family-gpt_oss-dense", &g, DecodeOptions::default(), true);
    let g = gpt_oss(ggml_experts(&family_config(Arch::GptOss), GgmlType::MXFP4));
    check(
        "family-gpt_oss-mxfp4-experts",
        &g,
        DecodeOptions::default(),
        true,
    );
    let g = family_config(Arch::Gemma2);
    check(
        "family-gemma2-dense-logits",
        &dense(&g),
        DecodeOptions::default(),
        false,
    );
}

/// gpt-oss's description with the biases a description built from the config leaves out: q/k/v's
/// and o's (`attention_bias`).
fn gpt_oss(mut m: ModelDesc) -> ModelDesc {
    for l in &mut m.layers {
        l.qkv_bias = true;
        l.o_bias = true;
    }
    m
}

/// Experts as blocks of `ty` (gate/up as halves), the other launches dense BF16.
fn ggml_experts(c: &ModelConfig, ty: GgmlType) -> ModelDesc {
    use entrollm_cuda::forms::ggml::GgmlLaunch;
    use entrollm_cuda::plan::LinearDesc;
    // (Called with one expert's shape; the stack holds every expert's rows.)
    let experts = c.block.moe.as_ref().map_or(1, |m| m.experts);
    ModelDesc::build(c, SMS, |launch, r, k| {
        Ok(match launch {
            "gate_up" | "down" => LinearDesc::new(
                GgmlLaunch {
                    q8: false,
                    types: vec![(ty, r * experts)],
                    halves: launch == "gate_up",
                },
                r,
                k,
            ),
            _ => forms::bf16::desc(r, k),
        })
    })
    .unwrap()
}

/// What each family's decode step launches beyond Llama's, and that Llama's launches none of it.
#[test]
fn family_launches() {
    let kernels = |c: &ModelConfig| -> Vec<&'static str> {
        decode_plan(&dense(c), &DecodeOptions::default(), true)
            .unwrap()
            .launches
            .iter()
            .map(|l| l.kernel)
            .collect()
    };
    let count = |k: &[&str], name: &str| k.iter().filter(|&&x| x == name).count();
    let family_kernels = [
        "rope_heads_f32q",
        "add_rmsnorm",
        "geglu_f32",
        "scale_f32",
        "softcap_f32",
        "moe_topk",
        "gemv_bf16_experts",
        "moe_combine",
    ];
    let llama = kernels(&e2e_config());
    assert!(family_kernels.iter().all(|k| count(&llama, k) == 0));
    let layers = 3;
    // Qwen3 and Phi-3: RoPE per head (q/k norms, partial rotary) instead of the q/k/v GEMV's
    // epilogue; the rest is Llama's.
    for arch in [Arch::Qwen3, Arch::Phi3] {
        let k = kernels(&family_config(arch));
        assert_eq!(count(&k, "rope_heads_f32q"), layers, "{arch:?}");
        assert_eq!(count(&k, "gemv_bf16_rope"), 0, "{arch:?}");
        for f in &family_kernels[1..] {
            assert_eq!(count(&k, f), 0, "{arch:?} {f}");
        }
    }
    // Gemma: two post-norm adds a layer, GeGLU, the embedding scale; soft-capping on Gemma 2.
    for (arch, cap, heads) in [(Arch::Gemma2, 1, 0), (Arch::Gemma3, 0, layers)] {
        let k = kernels(&family_config(arch));
        assert_eq!(count(&k, "add_rmsnorm"), 2 * layers, "{arch:?}");
        assert_eq!(count(&k, "geglu_f32"), layers, "{arch:?}");
        assert_eq!(count(&k, "scale_f32"), 1, "{arch:?}");
        assert_eq!(count(&k, "softcap_f32"), cap, "{arch:?}");
        assert_eq!(count(&k, "rope_heads_f32q"), heads, "{arch:?}");
        // The post norms leave the next norm's output: one RMSNorm kernel, for layer 0.
        assert_eq!(count(&k, "rmsnorm_f32w"), 1, "{arch:?}");
    }
    // A mixture of experts: per layer of experts the router's GEMV, the top-k, one gathered
    // launch each of gate/up and down, the combine; no dense gate/up or down GEMV there.
    for (arch, moe_layers) in [(Arch::Mixtral, 3), (Arch::Qwen3Moe, 2)] {
        let k = kernels(&family_config(arch));
        assert_eq!(count(&k, "moe_topk"), moe_layers, "{arch:?}");
        assert_eq!(count(&k, "gemv_bf16_experts"), 2 * moe_layers, "{arch:?}");
        assert_eq!(count(&k, "moe_combine"), moe_layers, "{arch:?}");
        let dense_mlp = layers - moe_layers;
        assert!(count(&k, "gemv_bf16_accum_norm") >= dense_mlp, "{arch:?}");
    }
    // gpt-oss: per layer the o bias's add, the experts' activation kernel; the routing and the
    // gathered products as the other mixtures'.
    let k: Vec<&'static str> = decode_plan(
        &gpt_oss(dense(&family_config(Arch::GptOss))),
        &DecodeOptions::default(),
        true,
    )
    .unwrap()
    .launches
    .iter()
    .map(|l| l.kernel)
    .collect();
    for (kernel, n) in [
        ("bias_residual", layers),
        ("moe_glu_f32", layers),
        ("moe_topk", layers),
        ("gemv_bf16_experts", 2 * layers),
        ("moe_combine", layers),
        ("gemv_bf16_accum_norm", 0),
    ] {
        assert_eq!(count(&k, kernel), n, "gpt-oss {kernel}");
    }
    assert_eq!(
        count(&llama, "bias_residual") + count(&llama, "moe_glu_f32"),
        0
    );
    // Windows and local RoPE are in the launch lines of the layers that have them.
    let plan = decode_plan(
        &dense(&family_config(Arch::Gemma3)),
        &DecodeOptions::default(),
        true,
    )
    .unwrap()
    .to_string();
    assert_eq!(plan.matches("window=29").count(), 2, "{plan}");
    assert_eq!(plan.matches("rope=local").count(), 2, "{plan}");
}

const FAMILY_ARCHS: [Arch; 4] = [Arch::Qwen3, Arch::Phi3, Arch::Gemma2, Arch::Gemma3];
/// The mixtures of experts (their experts' forms with a gathered product: dense BF16, ggml).
const MOE_ARCHS: [Arch; 2] = [Arch::Mixtral, Arch::Qwen3Moe];

/// Every kernel a plan names is a `__global__` function of the kernel sources (the names the
/// launchers pass to `GpuDevice::function`).
#[test]
fn plans_name_real_kernels() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../cuda/kernels");
    let mut src = String::new();
    for e in std::fs::read_dir(&dir).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "cu") {
            src += &std::fs::read_to_string(p).unwrap();
        }
    }
    let lines: Vec<&str> = src.lines().collect();
    let defined = |name: &str| {
        let call = format!("{name}(");
        lines.iter().enumerate().any(|(i, l)| {
            let starts = l.find(&call).is_some_and(|at| {
                at == 0
                    || !l.as_bytes()[at - 1].is_ascii_alphanumeric() && l.as_bytes()[at - 1] != b'_'
            });
            starts && (l.contains("__global__") || i > 0 && lines[i - 1].contains("__global__"))
        })
    };
    let c = llama8b(2);
    let mut models = vec![
        dense(&c),
        fp8(&c, false),
        fp8(&c, true),
        ModelDesc::build(&c, SMS, |_, r, k| Ok(forms::pal_bf16::desc(r, k, SMS))).unwrap(),
        coded(&c, &tuned_plan(&c)),
    ];
    for arch in FAMILY_ARCHS {
        let f = family_config(arch);
        models.extend([dense(&f), fp8(&f, false), fp8(&f, true)]);
    }
    for arch in MOE_ARCHS {
        models.push(dense(&family_config(arch)));
    }
    models.push(ggml_experts(&family_config(Arch::Mixtral), GgmlType::Q8_0));
    models.push(gpt_oss(dense(&family_config(Arch::GptOss))));
    models.push(gpt_oss(ggml_experts(
        &family_config(Arch::GptOss),
        GgmlType::MXFP4,
    )));
    let knobs: [&[(&str, &str)]; 5] = [
        &[],
        &[("attention", "fused")],
        &[("norm", "fused")],
        &[("norm", "split"), ("rope", "split")],
        &[("pdl", "all")],
    ];
    let mut seen = std::collections::BTreeSet::new();
    for m in &models {
        for k in knobs {
            for greedy in [true, false] {
                for l in decode_plan(m, &opts(k), greedy).unwrap().launches {
                    if l.is_kernel() {
                        seen.insert(l.kernel);
                    }
                }
            }
        }
    }
    for k in &seen {
        assert!(
            defined(k),
            "kernel `{k}` is not a __global__ function of kernels/*.cu"
        );
    }
    assert!(seen.len() >= 25, "{seen:?}");
}
