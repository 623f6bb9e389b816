//! Byte equality with DFloat11 0.5.0's own encoder: tests/data/df11_golden.json is written by
//! tools/df11_golden.py, which runs the reference `get_32bit_codec`, `get_luts` and `encode_weights`.

mod df11_support;

use df11_support::{base64_decode, from_histogram, geometric};
use entrollm_codec::df11::{
    build_luts, CodeTable, Df11Tensor, Symbol, BYTES_PER_THREAD, THREADS_PER_BLOCK,
};
use serde_json::Value;

fn golden() -> Value {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/df11_golden.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn generate(spec: &Value) -> Vec<u16> {
    let int = |k: &str| spec[k].as_u64().unwrap();
    match spec["kind"].as_str().unwrap() {
        "geometric" => geometric(
            int("seed"),
            int("n") as usize,
            int("base") as u32,
            int("cap") as u32,
        ),
        "histogram" => {
            let counts: Vec<(u8, usize)> = spec["counts"]
                .as_array()
                .unwrap()
                .iter()
                .map(|p| {
                    (
                        p[0].as_u64().unwrap() as u8,
                        p[1].as_u64().unwrap() as usize,
                    )
                })
                .collect();
            let tail: Vec<u8> = spec
                .get("tail")
                .and_then(Value::as_array)
                .map(|t| t.iter().map(|e| e.as_u64().unwrap() as u8).collect())
                .unwrap_or_default();
            from_histogram(int("seed"), &counts, &tail)
        }
        k => panic!("unknown generator {k}"),
    }
}

fn bytes(case: &Value, key: &str) -> Vec<u8> {
    base64_decode(case[key].as_str().unwrap())
}

/// The reference's code table rows `[symbol (-1 = EOF), bits, value]` versus ours, in order.
fn assert_same_code(ours: &CodeTable, reference: &Value, what: &str) {
    let rows = reference.as_array().unwrap();
    assert_eq!(ours.entries().len(), rows.len(), "{what}: number of codes");
    for (e, r) in ours.entries().iter().zip(rows) {
        let symbol = match r[0].as_i64().unwrap() {
            -1 => Symbol::Eof,
            x => Symbol::Exponent(x as u8),
        };
        let want = (
            symbol,
            r[1].as_u64().unwrap() as u32,
            r[2].as_u64().unwrap() as u32,
        );
        assert_eq!((e.symbol, e.bits, e.value), want, "{what}: code table");
    }
}

#[test]
fn kernel_constants_match_dfloat11() {
    let g = golden();
    assert_eq!(
        g["bytes_per_thread"].as_u64(),
        Some(BYTES_PER_THREAD as u64)
    );
    assert_eq!(
        g["threads_per_block"].as_u64(),
        Some(THREADS_PER_BLOCK as u64)
    );
}

#[test]
fn encoder_output_equals_dfloat11_byte_for_byte() {
    let g = golden();
    let mut compared = 0;
    for case in g["encode_cases"].as_array().unwrap() {
        let input = generate(&case["input"]);
        let what = format!("{}", case["input"]);
        assert_eq!(
            input.len() as u64,
            case["n"].as_u64().unwrap(),
            "{what}: generator"
        );
        let t = Df11Tensor::encode(&input).unwrap();
        assert_eq!(t.decode().unwrap(), input, "{what}: round trip");
        if let Some(err) = case.get("reference_error") {
            // DFloat11 fails on these (EOF code all zeros); ours codes and decodes them anyway.
            assert!(err.as_str().unwrap().contains("curr_val"), "{what}: {err}");
            continue;
        }
        let mut h = [0u64; 256];
        for &w in &input {
            h[((w >> 7) & 0xFF) as usize] += 1;
        }
        assert_same_code(
            &CodeTable::from_histogram(&h).unwrap(),
            &case["code"],
            &what,
        );
        assert_eq!(t.luts, bytes(case, "luts"), "{what}: luts");
        assert_eq!(
            t.encoded_exponent,
            bytes(case, "encoded_exponent"),
            "{what}: encoded_exponent"
        );
        assert_eq!(t.gaps, bytes(case, "gaps"), "{what}: gaps");
        let op: Vec<u32> = case["output_positions"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        assert_eq!(t.output_positions, op, "{what}: output_positions");
        let sign_mantissa: Vec<u8> = input
            .iter()
            .map(|&w| (((w >> 8) & 0x80) | (w & 0x7F)) as u8)
            .collect();
        assert_eq!(t.sign_mantissa, sign_mantissa, "{what}: sign_mantissa");
        compared += 1;
    }
    assert!(compared >= 5, "only {compared} cases compared");
}

#[test]
fn code_tables_and_luts_equal_dfloat11_for_deep_histograms() {
    let g = golden();
    for case in g["code_cases"].as_array().unwrap() {
        let mut h = [0u64; 256];
        for p in case["counts"].as_array().unwrap() {
            h[p[0].as_u64().unwrap() as usize] = p[1].as_u64().unwrap();
        }
        let what = format!("histogram {}", case["counts"]);
        let table = CodeTable::from_histogram(&h).unwrap();
        assert_same_code(&table, &case["code"], &what);
        assert_eq!(
            build_luts(&table).unwrap(),
            bytes(case, "luts"),
            "{what}: luts"
        );
    }
}
