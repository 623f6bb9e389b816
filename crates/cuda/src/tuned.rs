//! The tuned table: the fastest dtANS launch measured per Llama launch shape on the H200, and the
//! lossless BF16 coding and launch a shape gets from it. Serving (`linear::dtans_config_for`,
//! `engine_coded::tuned_plan`) reads it; the table is data, to come from a tune file.

use entrollm_codec::dtans::{Coding, Mode};

use crate::ops::dtans::DtansConfig;

/// The fastest launch measured per Llama launch shape on an H200 (bench/RESULTS.md): for
/// Llama-3.1-8B the fastest lossless BF16 Pair coding with its launch config, then for
/// Llama-3.1-8B and Llama-3.3-70B the compact plan's Single codings (crates/cuda/data/single-m8.json)
/// with theirs (`dtans_gpu_plan_sweep`): (name, rows, cols, coding, config, µs).
/// The Pair entry of a shape comes first ([`bf16_coding_for`] takes the first).
pub fn tuned_launches() -> [(&'static str, usize, usize, Coding, DtansConfig, f64); 15] {
    let pair = |sc| Coding {
        mode: Mode::Pair,
        log2_m: 8,
        sc,
        t: Some(16),
    };
    let single = |sc| Coding {
        mode: Mode::Single,
        log2_m: 8,
        sc,
        t: None,
    };
    let cfg = |warps, unroll, entry| DtansConfig {
        warps,
        min_warps: 0,
        rep: 0,
        unroll,
        fast: entry == 16,
        entry,
    };
    [
        ("qkv", 6144, 4096, pair(256), cfg(8, 4, 16), 22.93),
        ("o", 4096, 4096, pair(256), cfg(16, 0, 16), 17.11),
        ("gate_up", 28_672, 4096, pair(2048), cfg(16, 0, 16), 71.36),
        ("down", 4096, 14_336, pair(1024), cfg(16, 0, 16), 40.46),
        ("lm_head", 128_256, 4096, pair(512), cfg(8, 4, 16), 266.50),
        ("qkv", 6144, 4096, single(512), cfg(14, 8, 16), 31.43),
        ("o", 4096, 4096, single(512), cfg(8, 0, 16), 25.97),
        ("gate_up", 28_672, 4096, single(1024), cfg(28, 8, 4), 87.13),
        ("down", 4096, 14_336, single(512), cfg(32, 8, 4), 54.23),
        (
            "lm_head",
            128_256,
            4096,
            single(2048),
            cfg(32, 8, 4),
            352.32,
        ),
        ("qkv", 10_240, 8192, single(512), cfg(14, 8, 4), 77.30),
        ("o", 8192, 8192, single(512), cfg(32, 8, 4), 55.19),
        ("gate_up", 57_344, 8192, single(1024), cfg(28, 8, 4), 326.75),
        ("down", 8192, 28_672, single(512), cfg(16, 8, 4), 174.27),
        (
            "lm_head",
            128_256,
            8192,
            single(2048),
            cfg(32, 8, 4),
            699.52,
        ),
    ]
}

/// A lossless BF16 Pair coding and launch for an `n × k` matrix: the tuned one for the Llama-8B
/// shapes, else by tile count (narrow slices when there are few row bands, so that every SM gets
/// enough warps).
pub fn bf16_coding_for(n: usize, k: usize) -> (Coding, DtansConfig) {
    if let Some(t) = tuned_launches().into_iter().find(|t| t.1 == n && t.2 == k) {
        return (t.3, t.4);
    }
    let bands = n.div_ceil(32);
    let sc = [2048u32, 1024, 512, 256]
        .into_iter()
        .find(|&sc| bands * k.div_ceil(sc as usize) >= 8 * 1024)
        .unwrap_or(256);
    (
        Coding {
            mode: Mode::Pair,
            log2_m: 8,
            sc,
            t: Some(16),
        },
        DtansConfig::warps(8),
    )
}
