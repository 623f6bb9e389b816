//! Integer-quantised HF checkpoints (compressed-tensors pack-quantized, GPTQ, AWQ GEMM) against
//! the packers' own dequantisation and transformers' logits, from the files
//! tools/gen_hf_quant_testdata.py wrote; and hostile tensors and configs.

mod common;

use entrollm_format::{Dtype, SafetensorsFile, TensorView};
use entrollm_model::hf_quant::{OwnedTensors, Scheme};
use entrollm_model::load::SafetensorsSource;
use entrollm_model::{build_model, Engine, HostTensor, Linear};
use std::path::PathBuf;
use std::sync::Arc;

fn data(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/hfq")
        .join(name)
}

fn scheme(qcfg: &serde_json::Value) -> Result<Option<Scheme>, entrollm_model::ModelError> {
    Scheme::from_config_json(&serde_json::json!({ "quantization_config": qcfg }).to_string())
}

fn linear(t: HostTensor) -> Arc<dyn Linear> {
    match t {
        HostTensor::Linear(m) => m,
        _ => panic!("not a matrix"),
    }
}

fn f32s(v: &TensorView) -> Vec<f32> {
    assert_eq!(v.dtype, Dtype::F32);
    v.bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect()
}

#[test]
fn every_case_reads_back_as_the_reference_dequantisation_bit_for_bit() {
    let file = SafetensorsFile::open(&data("matrices.safetensors")).unwrap();
    let cases: Vec<serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(data("matrices.json")).unwrap()).unwrap();
    assert!(cases.len() >= 14);
    for case in &cases {
        let name = case["name"].as_str().unwrap();
        let s = scheme(&case["quantization_config"]).unwrap().unwrap();
        let m = linear(s.matrix(&file, &format!("{name}.weight")).unwrap().unwrap());
        assert_eq!(m.form().form, "int", "{name}");
        let r = file.get(&format!("{name}.ref")).unwrap();
        let want = f32s(&r);
        assert_eq!((m.rows(), m.cols()), (r.shape[0], r.shape[1]), "{name}");
        let mut row = vec![0f32; m.cols()];
        for i in 0..m.rows() {
            m.row(i, &mut row);
            for (c, (&a, &b)) in row.iter().zip(&want[i * m.cols()..]).enumerate() {
                assert_eq!(
                    a.to_bits(),
                    b.to_bits(),
                    "{name} ({i}, {c}): {a} vs reference {b}"
                );
            }
        }
        // The product is that matrix's, within f32 rounding.
        let x: Vec<f32> = (0..m.cols())
            .map(|i| ((i * 37 % 17) as f32 - 8.0) / 8.0)
            .collect();
        let mut y = vec![0f32; m.rows()];
        m.matvec(&x, &mut y);
        for (i, &y) in y.iter().enumerate() {
            let exact: f64 = want[i * m.cols()..(i + 1) * m.cols()]
                .iter()
                .zip(&x)
                .map(|(&w, &x)| w as f64 * x as f64)
                .sum();
            assert!(
                (y as f64 - exact).abs() < 1e-5,
                "{name} row {i}: {y} vs {exact}"
            );
        }
        // Codes and group scales, not floats: well under the f32 matrix's bytes.
        assert!(
            m.stored_bytes() * 2 < 4 * m.rows() * m.cols(),
            "{name}: {} bytes",
            m.stored_bytes()
        );
    }
}

/// The form a format's decoder matrices are served in.
fn served_form(fmt: &str) -> &'static str {
    match fmt {
        "nvfp4" | "mxfp4" => "ggml",
        _ => "int",
    }
}

fn logits_match_transformers(fmt: &str) {
    let src = SafetensorsSource::open(&data(fmt)).unwrap();
    let w = build_model(&src).unwrap();
    for l in &w.layers {
        for m in l.matrices() {
            assert_eq!(m.form().form, served_form(fmt), "{fmt}");
        }
    }
    let expected: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(data(&format!("{fmt}.expected.json"))).unwrap(),
    )
    .unwrap();
    let prompt: Vec<u32> = expected["prompt"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect();
    let want: Vec<f32> = expected["logits"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap() as f32)
        .collect();
    let mut engine = Engine::new(w, 64).unwrap();
    let got = engine.prefill(&prompt).unwrap();
    assert_eq!(got.len(), want.len());
    let worst = got
        .iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(worst <= 5e-4, "{fmt}: logits differ by {worst}");
}

#[test]
fn compressed_tensors_model_logits_match_transformers() {
    logits_match_transformers("ct");
}

#[test]
fn gptq_model_logits_match_transformers() {
    logits_match_transformers("gptq");
}

#[test]
fn awq_model_logits_match_transformers() {
    logits_match_transformers("awq");
}

#[test]
fn nvfp4_mxfp4_and_int8_model_logits_match_transformers() {
    for fmt in ["nvfp4", "mxfp4", "intq"] {
        logits_match_transformers(fmt);
    }
}

/// Tensors in memory, for hostile inputs.
type Mem = OwnedTensors;

/// The tensors of `file` named `prefix…`, renamed `as_prefix…`.
fn mem_from_file(file: &SafetensorsFile, prefix: &str, as_prefix: &str) -> Mem {
    OwnedTensors(
        file.tensors()
            .filter_map(|t| {
                let rest = t.name.strip_prefix(prefix)?;
                Some((
                    format!("{as_prefix}{rest}"),
                    (t.dtype, t.shape.to_vec(), t.bytes.to_vec()),
                ))
            })
            .collect(),
    )
}

fn case_config(name: &str) -> serde_json::Value {
    let cases: Vec<serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(data("matrices.json")).unwrap()).unwrap();
    cases.into_iter().find(|c| c["name"] == name).unwrap()["quantization_config"].clone()
}

fn err(s: &Scheme, t: &Mem) -> String {
    match s.matrix(t, "m.weight") {
        Ok(_) => panic!("accepted"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn hostile_tensors_are_errors_naming_tensor_and_field() {
    let file = SafetensorsFile::open(&data("matrices.safetensors")).unwrap();
    // GPTQ without qzeros.
    let s = scheme(&case_config("gptq_4_asym_g64_v1")).unwrap().unwrap();
    let mut t = mem_from_file(&file, "gptq_4_asym_g64_v1", "m");
    assert!(s.matrix(&t, "m.weight").is_ok());
    t.0.remove("m.qzeros");
    let e = err(&s, &t);
    assert!(e.contains("m.qzeros") && e.contains("missing"), "{e}");
    // Scales of the wrong shape.
    let mut t = mem_from_file(&file, "gptq_4_asym_g64_v1", "m");
    t.0.get_mut("m.scales").unwrap().1 = vec![2, 32];
    let e = err(&s, &t);
    assert!(e.contains("m.scales") && e.contains("shape"), "{e}");
    // qweight of the wrong dtype.
    let mut t = mem_from_file(&file, "gptq_4_asym_g64_v1", "m");
    t.0.get_mut("m.qweight").unwrap().0 = Dtype::F32;
    let e = err(&s, &t);
    assert!(e.contains("m.qweight") && e.contains("dtype"), "{e}");
    // g_idx groups of unequal sizes.
    let mut t = mem_from_file(&file, "gptq_4_asym_g64_v1", "m");
    t.0.get_mut("m.g_idx").unwrap().2[..4].copy_from_slice(&1i32.to_le_bytes());
    let e = err(&s, &t);
    assert!(e.contains("m.g_idx") && e.contains("group"), "{e}");
    // compressed-tensors asymmetric without zero points, and a wrong weight_shape.
    let s = scheme(&case_config("ct_int4_asym_g64")).unwrap().unwrap();
    let mut t = mem_from_file(&file, "ct_int4_asym_g64", "m");
    assert!(s.matrix(&t, "m.weight").is_ok());
    t.0.remove("m.weight_zero_point");
    let e = err(&s, &t);
    assert!(
        e.contains("m.weight_zero_point") && e.contains("missing"),
        "{e}"
    );
    let mut t = mem_from_file(&file, "ct_int4_asym_g64", "m");
    t.0.get_mut("m.weight_shape").unwrap().2[..8].copy_from_slice(&17i64.to_le_bytes());
    let e = err(&s, &t);
    assert!(e.contains("m.weight_packed") && e.contains("shape"), "{e}");
    // AWQ with the wrong number of scales.
    let s = scheme(&case_config("awq_g64")).unwrap().unwrap();
    let mut t = mem_from_file(&file, "awq_g64", "m");
    assert!(s.matrix(&t, "m.weight").is_ok());
    let sc = t.0.get_mut("m.scales").unwrap();
    sc.1 = vec![3, 16];
    sc.2.truncate(3 * 16 * 2);
    let e = err(&s, &t);
    assert!(e.contains("m.scales") && e.contains("shape"), "{e}");
    // A packed matrix with a scheme of other bits reads a shape it does not have.
    let mut cfg = case_config("gptq_4_asym_g64_v1");
    cfg["bits"] = 8.into();
    let s = scheme(&cfg).unwrap().unwrap();
    let t = mem_from_file(&file, "gptq_4_asym_g64_v1", "m");
    let e = err(&s, &t);
    assert!(e.contains("m.qweight") && e.contains("shape"), "{e}");
}

#[test]
fn unread_configs_are_errors_naming_the_field() {
    let bad = |qcfg: serde_json::Value, field: &str| {
        let e = scheme(&qcfg).unwrap_err().to_string();
        assert!(e.contains(field), "{e} (wanted {field})");
    };
    let mut c = case_config("gptq_4_asym_g64_v1");
    c["bits"] = 7.into();
    bad(c, "quantization_config.bits");
    let mut c = case_config("gptq_4_asym_g64_v1");
    c["checkpoint_format"] = "marlin".into();
    bad(c, "quantization_config.checkpoint_format");
    let mut c = case_config("awq_g64");
    c["version"] = "exllama".into();
    bad(c, "quantization_config.version");
    let mut c = case_config("awq_g64");
    c["bits"] = 3.into();
    bad(c, "quantization_config.bits");
    let mut c = case_config("ct_int4_asym_g64");
    c["format"] = "marlin-24".into();
    bad(c, "quantization_config.format");
    let mut c = case_config("ct_int4_asym_g64");
    c["config_groups"]["group_0"]["weights"]["num_bits"] = 7.into();
    // 7 bits are within what compressed-tensors packs (2 to 8): read.
    assert!(scheme(&c).unwrap().is_some());
    c["config_groups"]["group_0"]["weights"]["num_bits"] = 9.into();
    bad(c, "config_groups.group_0.weights.num_bits");
    let mut c = case_config("ct_int4_asym_g64");
    c["config_groups"]["group_0"]["weights"]["strategy"] = "tensor".into();
    bad(c, "config_groups.group_0.weights.strategy");
    bad(
        serde_json::json!({"quant_method": "bitsandbytes"}),
        "quant_method",
    );
    // FP8 compressed-tensors is no integer scheme (its tensors are read by their dtype).
    let fp8 = serde_json::json!({
        "quant_method": "compressed-tensors", "format": "float-quantized",
        "config_groups": { "group_0": { "targets": ["Linear"],
            "weights": { "num_bits": 8, "type": "float", "strategy": "channel", "symmetric": true } } },
        "ignore": ["lm_head"],
    });
    assert_eq!(scheme(&fp8).unwrap(), None);
}

/// Each packed checkpoint compressed: its packed codes stored as rANS-coded fields near their
/// entropy, the container served as the same integer matrices (logits bit for bit those of the
/// source) and decompressed to the source's files byte for byte.
#[test]
fn packed_checkpoints_code_serve_and_restore_bit_for_bit() {
    use entrollm_format::{restore_sources, ContainerReader, StoredData};
    use entrollm_model::compress::{compress, CompressOptions, NoProgress};
    use entrollm_model::load::ContainerSource;
    for fmt in ["ct", "gptq", "awq", "nvfp4", "mxfp4", "intq"] {
        let scratch = common::Scratch::new(&format!("hfq-{fmt}"));
        let dir = &scratch.0;
        let opts = CompressOptions {
            min_elements: 1024,
            ..CompressOptions::default()
        };
        compress(&data(fmt), &dir.join("c"), &opts, &mut NoProgress).unwrap();
        let r = ContainerReader::open(&dir.join("c")).unwrap();
        let mut fields = 0;
        for t in r.tensors() {
            if let StoredData::Coded(c) = &t.data {
                if c.coder == "rans-fields" {
                    fields += 1;
                    let stats = &c.params["stats"];
                    let (bpf, h) = (
                        stats["bits_per_field"].as_f64().unwrap(),
                        stats["entropy_bits"].as_f64().unwrap(),
                    );
                    // Packed codes at their entropy, but for the tables of these small tensors.
                    let codes = t.name.ends_with("qweight") || t.name.ends_with("weight_packed");
                    assert!(
                        !codes || bpf < h + 0.1,
                        "{fmt} {}: {bpf} bits a field, entropy {h}",
                        t.name
                    );
                }
            }
        }
        assert!(fields >= 3, "{fmt}: {fields} tensors coded as fields");

        let logits = |w: entrollm_model::ModelWeights| {
            for l in &w.layers {
                assert_eq!(
                    l.gated().unwrap().gate.form().form,
                    served_form(fmt),
                    "{fmt}"
                );
            }
            let mut e = Engine::new(w, 16).unwrap();
            e.prefill(&[1, 5, 9, 77, 3]).unwrap()
        };
        let want = logits(build_model(&SafetensorsSource::open(&data(fmt)).unwrap()).unwrap());
        // Decoded at load: the float matrices dense, as the source holds them.
        let got =
            logits(build_model(&ContainerSource::open(&dir.join("c"), false).unwrap()).unwrap());
        assert!(
            want.iter()
                .zip(&got)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{fmt}: the container's logits differ from the source's"
        );

        let back = dir.join("back");
        restore_sources(
            &r,
            &back,
            false,
            |t| -> Result<std::borrow::Cow<[u8]>, entrollm_format::FormatError> {
                match &t.data {
                    StoredData::Plain(b) => Ok(std::borrow::Cow::Borrowed(*b)),
                    StoredData::Coded(c) => Ok(std::borrow::Cow::Owned(
                        entrollm_format::coded::Coded::from_stored(t.dtype, t.shape, c)?
                            .decode()
                            .map_err(|e| entrollm_format::FormatError::Usage(e.to_string()))?,
                    )),
                }
            },
            None,
        )
        .unwrap();
        for f in ["model.safetensors", "config.json"] {
            assert!(
                std::fs::read(back.join(f)).unwrap() == std::fs::read(data(fmt).join(f)).unwrap(),
                "{fmt}: {f} differs"
            );
        }
    }
}

fn fp4_cases() -> Vec<serde_json::Value> {
    serde_json::from_str(&std::fs::read_to_string(data("fp4.json")).unwrap()).unwrap()
}

/// compressed-tensors NVFP4, MXFP4 and int-quantized matrices (tools/gen_hf_fp4_testdata.py:
/// compressed-tensors' own quantiser and compressors) against its dequantisation: MXFP4 and int8
/// values bit for bit (but for E2M1's negative zero); NVFP4's `fp4·s` scaled by `1/global` after
/// the product, within two ulps of the reference's `fp4·(s/global)`. FP4 is served as ggml
/// blocks, int8 values as `int` codes.
#[test]
fn fp4_and_int8_matrices_read_back_as_the_reference_dequantisation() {
    let file = SafetensorsFile::open(&data("fp4.safetensors")).unwrap();
    let cases = fp4_cases();
    assert_eq!(cases.len(), 7);
    for case in &cases {
        let name = case["name"].as_str().unwrap();
        let s = scheme(&case["quantization_config"]).unwrap().unwrap();
        let m = linear(s.matrix(&file, &format!("{name}.weight")).unwrap().unwrap());
        let nv = name.contains("nvfp4");
        let form = if name.contains("fp4") { "ggml" } else { "int" };
        assert_eq!(m.form().form, form, "{name}");
        let r = file.get(&format!("{name}.ref")).unwrap();
        let want = f32s(&r);
        assert_eq!((m.rows(), m.cols()), (r.shape[0], r.shape[1]), "{name}");
        let mut row = vec![0f32; m.cols()];
        for i in 0..m.rows() {
            m.row(i, &mut row);
            for (c, (&a, &b)) in row.iter().zip(&want[i * m.cols()..]).enumerate() {
                let ok = match nv {
                    true => (a - b).abs() <= b.abs() * 2.5e-7,
                    // E2M1's negative zero reads as ggml's zero.
                    false => a.to_bits() == b.to_bits() || (a == 0.0 && b == 0.0),
                };
                assert!(ok, "{name} ({i}, {c}): {a} vs reference {b}");
            }
        }
        let x: Vec<f32> = (0..m.cols())
            .map(|i| ((i * 37 % 17) as f32 - 8.0) / 8.0)
            .collect();
        let mut y = vec![0f32; m.rows()];
        m.matvec(&x, &mut y);
        for (i, &y) in y.iter().enumerate() {
            let w = &want[i * m.cols()..(i + 1) * m.cols()];
            let exact: f64 = w.iter().zip(&x).map(|(&w, &x)| w as f64 * x as f64).sum();
            let size: f64 = w
                .iter()
                .zip(&x)
                .map(|(&w, &x)| (w as f64 * x as f64).abs())
                .sum();
            assert!(
                (y as f64 - exact).abs() <= 1e-6 * size.max(1.0),
                "{name} row {i}: {y} vs {exact}"
            );
        }
        assert!(
            m.stored_bytes() * 2 < 4 * m.rows() * m.cols(),
            "{name}: {} bytes",
            m.stored_bytes()
        );
    }
}

#[test]
fn hostile_fp4_and_int8_tensors_are_errors_naming_the_tensor() {
    let file = SafetensorsFile::open(&data("fp4.safetensors")).unwrap();
    let cfg = |name: &str| {
        let c = fp4_cases().into_iter().find(|c| c["name"] == name).unwrap();
        scheme(&c["quantization_config"]).unwrap().unwrap()
    };
    // NVFP4: a negative scale, a NaN scale, a zero global scale, columns not whole blocks.
    let s = cfg("ct_nvfp4_24x128");
    let base = mem_from_file(&file, "ct_nvfp4_24x128", "m");
    assert!(s.matrix(&base, "m.weight").is_ok());
    for (b, what) in [(0x80 | 0x38, "negative"), (0x7F, "NaN")] {
        let mut t = mem_from_file(&file, "ct_nvfp4_24x128", "m");
        t.0.get_mut("m.weight_scale").unwrap().2[5] = b;
        let e = err(&s, &t);
        assert!(
            e.contains("m.weight_scale") && e.contains("element 5") && e.contains(what),
            "{e}"
        );
    }
    let mut t = mem_from_file(&file, "ct_nvfp4_24x128", "m");
    t.0.get_mut("m.weight_global_scale").unwrap().2 = 0f32.to_le_bytes().to_vec();
    let e = err(&s, &t);
    assert!(
        e.contains("m.weight_global_scale") && e.contains("positive"),
        "{e}"
    );
    let mut t = mem_from_file(&file, "ct_nvfp4_24x128", "m");
    t.0.remove("m.weight_global_scale");
    let e = err(&s, &t);
    assert!(
        e.contains("m.weight_global_scale") && e.contains("missing"),
        "{e}"
    );
    let mut t = mem_from_file(&file, "ct_nvfp4_24x128", "m");
    let p = t.0.get_mut("m.weight_packed").unwrap();
    p.1 = vec![64, 24];
    let e = err(&s, &t);
    assert!(
        e.contains("m.weight_packed") && e.contains("48 columns"),
        "{e}"
    );
    // MXFP4: scales of the wrong dtype and shape, a NaN exponent.
    let s = cfg("ct_mxfp4_10x96");
    let mut t = mem_from_file(&file, "ct_mxfp4_10x96", "m");
    assert!(s.matrix(&t, "m.weight").is_ok());
    t.0.get_mut("m.weight_scale").unwrap().0 = Dtype::I8;
    let e = err(&s, &t);
    assert!(e.contains("m.weight_scale") && e.contains("dtype"), "{e}");
    let mut t = mem_from_file(&file, "ct_mxfp4_10x96", "m");
    t.0.get_mut("m.weight_scale").unwrap().1 = vec![5, 6];
    let e = err(&s, &t);
    assert!(e.contains("m.weight_scale") && e.contains("shape"), "{e}");
    let mut t = mem_from_file(&file, "ct_mxfp4_10x96", "m");
    t.0.get_mut("m.weight_scale").unwrap().2[7] = 0xFF;
    let e = err(&s, &t);
    assert!(e.contains("m.weight_scale") && e.contains("NaN"), "{e}");
    // int-quantized: a value outside its bits, a zero point missing, packed codes for it.
    let s = cfg("ct_intq_int4_asym_g32");
    let mut t = mem_from_file(&file, "ct_intq_int4_asym_g32", "m");
    assert!(s.matrix(&t, "m.weight").is_ok());
    t.0.get_mut("m.weight").unwrap().2[3] = 9;
    let e = err(&s, &t);
    assert!(
        e.contains("m.weight") && e.contains("element 3 is 9"),
        "{e}"
    );
    let mut t = mem_from_file(&file, "ct_intq_int4_asym_g32", "m");
    t.0.remove("m.weight_zero_point");
    let e = err(&s, &t);
    assert!(
        e.contains("m.weight_zero_point") && e.contains("missing"),
        "{e}"
    );
    let t = mem_from_file(&file, "ct_mxfp4_10x96", "m");
    let e = err(&s, &t);
    assert!(
        e.contains("m.weight_packed") && e.contains("int-quantized"),
        "{e}"
    );
}

#[test]
fn fp4_configs_name_the_field_they_break() {
    let nv = fp4_cases()[0]["quantization_config"].clone();
    let mut c = nv.clone();
    c["config_groups"]["group_0"]["weights"]["group_size"] = 32.into();
    let e = scheme(&c).unwrap_err().to_string();
    assert!(
        e.contains("config_groups.group_0.weights.group_size"),
        "{e}"
    );
    let mut c = nv.clone();
    c["config_groups"]["group_0"]["weights"]["num_bits"] = 8.into();
    let e = scheme(&c).unwrap_err().to_string();
    assert!(e.contains("config_groups.group_0.weights.num_bits"), "{e}");
    let mut c = nv;
    c["format"] = "mxfp6-pack-quantized".into();
    let e = scheme(&c).unwrap_err().to_string();
    assert!(
        e.contains("mxfp6-pack-quantized") && e.contains("nvfp4-pack-quantized"),
        "{e}"
    );
}

/// OpenAI's MXFP4 (gpt-oss's experts, `quant_method: mxfp4`): the tiny gpt-oss checkpoint's
/// `_blocks`/`_scales` read as ggml MXFP4 blocks give, element for element, the E2M1 value of
/// its nibble (element 2j in the low nibble of byte j) times `2^(e − 127)` — transformers'
/// `convert_moe_packed_tensors` written out here — with the stack of experts as rows.
#[test]
fn openai_mxfp4_reads_as_its_blocks_bit_for_bit() {
    const E2M1: [f32; 16] = [
        0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
    ];
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/families/gpt_oss-mxfp4");
    let file = SafetensorsFile::open(&dir.join("model.safetensors")).unwrap();
    let config = std::fs::read_to_string(dir.join("config.json")).unwrap();
    let s = Scheme::from_config_json(&config).unwrap().unwrap();
    assert_eq!(s, Scheme::Mxfp4);
    let name = "model.layers.1.mlp.experts.gate_up_proj";
    let m = linear(s.matrix(&file, name).unwrap().unwrap());
    assert_eq!(
        m.form().form,
        "ggml",
        "served as its blocks, not a float copy"
    );
    let (blocks, scales) = (
        file.get(&format!("{name}_blocks")).unwrap(),
        file.get(&format!("{name}_scales")).unwrap(),
    );
    let (rows, groups) = (blocks.shape[0] * blocks.shape[1], blocks.shape[2]);
    assert_eq!((m.rows(), m.cols()), (rows, 32 * groups));
    let mut row = vec![0f32; m.cols()];
    for r in 0..rows {
        m.row(r, &mut row);
        for (c, &got) in row.iter().enumerate() {
            let (g, k) = (c / 32, c % 32);
            let byte = blocks.bytes[(r * groups + g) * 16 + k / 2];
            let nibble = if k % 2 == 0 { byte & 15 } else { byte >> 4 };
            let e = scales.bytes[r * groups + g] as i32 - 127;
            let want = E2M1[nibble as usize] * 2f32.powi(e);
            assert_eq!(got, want, "row {r} column {c}");
        }
    }
    // A plain tensor of the checkpoint (not quantised) is not the scheme's.
    assert!(s
        .matrix(&file, "model.layers.1.self_attn.q_proj.weight")
        .unwrap()
        .is_none());
}

/// Hostile OpenAI MXFP4 tensors: errors naming the tensor, never a panic.
#[test]
fn hostile_openai_mxfp4_tensors_are_errors_naming_the_tensor() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/families/gpt_oss-mxfp4");
    let file = SafetensorsFile::open(&dir.join("model.safetensors")).unwrap();
    let s = Scheme::Mxfp4;
    let prefix = "model.layers.0.mlp.experts.down_proj";
    let base = mem_from_file(&file, prefix, "m");
    let read = |t: &Mem| match s.matrix(t, "m") {
        Ok(_) => panic!("accepted"),
        Err(e) => e.to_string(),
    };
    assert!(s.matrix(&base, "m").unwrap().is_some());
    let mut t = mem_from_file(&file, prefix, "m");
    t.0.get_mut("m_scales").unwrap().2[3] = 0xFF;
    let e = read(&t);
    assert!(e.contains("m_scales") && e.contains("NaN"), "{e}");
    let mut t = mem_from_file(&file, prefix, "m");
    t.0.get_mut("m_scales").unwrap().1 = vec![4, 32, 2];
    let e = read(&t);
    assert!(e.contains("m_scales") && e.contains("shape"), "{e}");
    let mut t = mem_from_file(&file, prefix, "m");
    t.0.get_mut("m_blocks").unwrap().1 = vec![4, 64, 2, 8];
    let e = read(&t);
    assert!(e.contains("m_blocks") && e.contains("shape"), "{e}");
    let mut t = mem_from_file(&file, prefix, "m");
    t.0.get_mut("m_blocks").unwrap().0 = Dtype::I8;
    let e = read(&t);
    assert!(e.contains("m_blocks") && e.contains("dtype"), "{e}");
    let mut t = mem_from_file(&file, prefix, "m");
    t.0.remove("m_scales");
    let e = read(&t);
    assert!(e.contains("m_scales") && e.contains("missing"), "{e}");
}
