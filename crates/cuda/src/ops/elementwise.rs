//! Embedding gather, RMSNorm, SwiGLU and residual add (`kernels/elementwise.cu`).

use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

use super::{as_i32, bf16_to_f32, check_len, grid_for};
use crate::device::GpuDevice;
use crate::error::{DriverContext, GpuError, Result};
use crate::jit::{KernelVariant, ELEMENTWISE};

pub fn variant() -> KernelVariant {
    KernelVariant::new(&ELEMENTWISE, vec![])
}

const BLOCK: u32 = 256;

/// `out[t, :] = table[tokens[t], :]` as f32; `table` is BF16 [vocab, dim]. Ids outside
/// `0..vocab` produce NaN rows (ids uploaded from the host should be checked with
/// [`check_token_ids`] first).
pub fn launch_embedding(
    dev: &GpuDevice,
    table: &CudaSlice<u16>,
    tokens: &CudaSlice<i32>,
    out: &mut CudaSlice<f32>,
    n_tokens: usize,
    vocab: usize,
    dim: usize,
) -> Result<()> {
    const OP: &str = "embedding";
    check_len(OP, "table", table, vocab * dim)?;
    check_len(OP, "tokens", tokens, n_tokens)?;
    check_len(OP, "out", out, n_tokens * dim)?;
    let (dim_i, vocab_i) = (as_i32(OP, "dim", dim)?, as_i32(OP, "vocab", vocab)?);
    let f = dev.function(&variant(), "embedding_gather")?;
    let cfg = LaunchConfig {
        grid_dim: (
            grid_for(dim, BLOCK),
            as_i32(OP, "n_tokens", n_tokens)? as u32,
            1,
        ),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    };
    if n_tokens == 0 {
        return Ok(());
    }
    let mut b = dev.stream().launch_builder(&f);
    b.arg(table).arg(tokens).arg(out).arg(&dim_i).arg(&vocab_i);
    // SAFETY: argument types and counts match the kernel; sizes were checked above.
    unsafe { b.launch(cfg) }.while_(|| "launching embedding_gather".into())?;
    Ok(())
}

/// Errors on the first token id outside `0..vocab`, naming it.
pub fn check_token_ids(tokens: &[i32], vocab: usize) -> Result<()> {
    match tokens.iter().position(|&t| t < 0 || t as usize >= vocab) {
        Some(i) => Err(GpuError::invalid(
            "embedding",
            format!(
                "token id {} at index {i} is outside the vocabulary (0..{vocab})",
                tokens[i]
            ),
        )),
        None => Ok(()),
    }
}

pub fn embedding_ref(table: &[u16], tokens: &[i32], dim: usize) -> Vec<f32> {
    let vocab = table.len() / dim;
    tokens
        .iter()
        .flat_map(|&t| {
            let valid = t >= 0 && (t as usize) < vocab;
            (0..dim).map(move |i| {
                if valid {
                    bf16_to_f32(table[t as usize * dim + i])
                } else {
                    f32::NAN
                }
            })
        })
        .collect()
}

/// `out[r, :] = x[r, :] / sqrt(mean(x[r, :]²) + eps) · weight` for `rows` rows of `dim`.
#[allow(clippy::too_many_arguments)]
pub fn launch_rmsnorm(
    dev: &GpuDevice,
    x: &CudaSlice<f32>,
    weight: &CudaSlice<u16>,
    out: &mut CudaSlice<f32>,
    rows: usize,
    dim: usize,
    eps: f32,
) -> Result<()> {
    const OP: &str = "rmsnorm";
    check_len(OP, "x", x, rows * dim)?;
    check_len(OP, "weight", weight, dim)?;
    check_len(OP, "out", out, rows * dim)?;
    if dim == 0 || !(eps.is_finite() && eps >= 0.0) {
        return Err(GpuError::invalid(
            OP,
            format!("dim {dim} / eps {eps} invalid"),
        ));
    }
    let dim_i = as_i32(OP, "dim", dim)?;
    if rows == 0 {
        return Ok(());
    }
    let f = dev.function(&variant(), "rmsnorm")?;
    let block = if dim >= 4096 { 1024 } else { 256 };
    let cfg = LaunchConfig {
        grid_dim: (as_i32(OP, "rows", rows)? as u32, 1, 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = dev.stream().launch_builder(&f);
    b.arg(x).arg(weight).arg(out).arg(&dim_i).arg(&eps);
    // SAFETY: argument types and counts match the kernel; sizes were checked above.
    unsafe { b.launch(cfg) }.while_(|| "launching rmsnorm".into())?;
    Ok(())
}

pub fn rmsnorm_ref(x: &[f32], weight: &[u16], dim: usize, eps: f32) -> Vec<f32> {
    x.chunks(dim)
        .flat_map(|row| {
            let ms = row.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / dim as f64;
            let inv = 1.0 / (ms + eps as f64).sqrt();
            row.iter()
                .zip(weight)
                .map(move |(&v, &w)| (v as f64 * inv * bf16_to_f32(w) as f64) as f32)
        })
        .collect()
}

/// `out[t, i] = silu(gate_up[t, i]) · gate_up[t, inter + i]`: `gate_up` is [n_tokens, 2·inter],
/// gate rows first, as one GEMV over the concatenated gate and up projections writes it.
pub fn launch_swiglu(
    dev: &GpuDevice,
    gate_up: &CudaSlice<f32>,
    out: &mut CudaSlice<f32>,
    n_tokens: usize,
    inter: usize,
) -> Result<()> {
    launch_swiglu_halves("swiglu", dev, gate_up, out, n_tokens, inter)
}

/// The SwiGLU over gate/up halves, into `out` of the kernel's element type (f32 or BF16 bits).
fn launch_swiglu_halves<T>(
    kernel: &'static str,
    dev: &GpuDevice,
    gate_up: &CudaSlice<f32>,
    out: &mut CudaSlice<T>,
    n_tokens: usize,
    inter: usize,
) -> Result<()> {
    check_len(kernel, "gate_up", gate_up, 2 * n_tokens * inter)?;
    check_len(kernel, "out", out, n_tokens * inter)?;
    let (inter_i, n_i) = (
        as_i32(kernel, "inter", inter)?,
        as_i32(kernel, "n_tokens", n_tokens)?,
    );
    as_i32(kernel, "2 * n_tokens * inter", 2 * n_tokens * inter)?;
    if n_tokens * inter == 0 {
        return Ok(());
    }
    let f = dev.function(&variant(), kernel)?;
    let cfg = LaunchConfig {
        grid_dim: (grid_for(n_tokens * inter, BLOCK), 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = dev.stream().launch_builder(&f);
    b.arg(gate_up).arg(out).arg(&inter_i).arg(&n_i);
    // SAFETY: argument types and counts match the kernel; sizes were checked above.
    unsafe { b.launch(cfg) }.while_(|| format!("launching {kernel}"))?;
    Ok(())
}

pub fn swiglu_ref(gate_up: &[f32], inter: usize) -> Vec<f32> {
    gate_up
        .chunks(2 * inter)
        .flat_map(|row| {
            (0..inter).map(move |i| {
                let g = row[i] as f64;
                (g / (1.0 + (-g).exp()) * row[inter + i] as f64) as f32
            })
        })
        .collect()
}

/// `out[i] = silu(gate_up[2i]) · gate_up[2i + 1]` for `n` (gate, up) pairs stored interleaved.
pub fn launch_swiglu_pairs(
    dev: &GpuDevice,
    gate_up: &CudaSlice<f32>,
    out: &mut CudaSlice<f32>,
    n: usize,
) -> Result<()> {
    const OP: &str = "swiglu_pairs";
    check_len(OP, "gate_up", gate_up, 2 * n)?;
    check_len(OP, "out", out, n)?;
    let n_i = as_i32(OP, "2 * n", 2 * n)? / 2;
    if n == 0 {
        return Ok(());
    }
    let f = dev.function(&variant(), "swiglu_pairs")?;
    let cfg = LaunchConfig {
        grid_dim: (grid_for(n, BLOCK), 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = dev.stream().launch_builder(&f);
    b.arg(gate_up).arg(out).arg(&n_i);
    // SAFETY: argument types and counts match the kernel; sizes were checked above.
    unsafe { b.launch(cfg) }.while_(|| "launching swiglu_pairs".into())?;
    Ok(())
}

/// `out[t, i] = bf16(silu(gate_up[t, i]) · gate_up[t, inter + i])`: [`launch_swiglu`] with BF16
/// output, for prefill over gate/up stored as halves.
pub fn launch_swiglu_halves_bf16(
    dev: &GpuDevice,
    gate_up: &CudaSlice<f32>,
    out: &mut CudaSlice<u16>,
    n_tokens: usize,
    inter: usize,
) -> Result<()> {
    launch_swiglu_halves("swiglu_halves_bf16", dev, gate_up, out, n_tokens, inter)
}

/// `x[..n] += y[..n]`.
pub fn launch_residual_add(
    dev: &GpuDevice,
    x: &mut CudaSlice<f32>,
    y: &CudaSlice<f32>,
    n: usize,
) -> Result<()> {
    const OP: &str = "residual_add";
    check_len(OP, "x", x, n)?;
    check_len(OP, "y", y, n)?;
    let n_i = as_i32(OP, "n", n)?;
    if n == 0 {
        return Ok(());
    }
    let f = dev.function(&variant(), "residual_add")?;
    let cfg = LaunchConfig {
        grid_dim: (grid_for(n, BLOCK), 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = dev.stream().launch_builder(&f);
    b.arg(x).arg(y).arg(&n_i);
    // SAFETY: argument types and counts match the kernel; sizes were checked above.
    unsafe { b.launch(cfg) }.while_(|| "launching residual_add".into())?;
    Ok(())
}

pub fn residual_add_ref(x: &[f32], y: &[f32]) -> Vec<f32> {
    x.iter().zip(y).map(|(a, b)| a + b).collect()
}

/// `counters[..n] += 1` on the device (decode position and KV length), for graph replays.
pub fn launch_advance_counters(
    dev: &GpuDevice,
    counters: &mut CudaSlice<i32>,
    n: usize,
) -> Result<()> {
    const OP: &str = "advance_counters";
    check_len(OP, "counters", counters, n)?;
    let n_i = as_i32(OP, "n", n)?;
    let f = dev.function(&variant(), "advance_counters")?;
    let cfg = LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (32, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = dev.stream().launch_builder(&f);
    b.arg(counters).arg(&n_i);
    // SAFETY: argument types and counts match the kernel; sizes were checked above.
    unsafe { b.launch(cfg) }.while_(|| "launching advance_counters".into())?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::f32_to_bf16;

    #[test]
    fn rmsnorm_ref_unit_rms_row() {
        // Row with mean square 1 and weight 2: output is 2·x (eps 0).
        let x = [1.0f32, -1.0, 1.0, -1.0];
        let w = vec![f32_to_bf16(2.0); 4];
        assert_eq!(rmsnorm_ref(&x, &w, 4, 0.0), vec![2.0, -2.0, 2.0, -2.0]);
    }

    #[test]
    fn swiglu_ref_known_values() {
        // silu(0) = 0; silu(large) ≈ large.
        let gu = [0.0f32, 20.0, 3.0, 0.5];
        let out = swiglu_ref(&gu, 2);
        assert_eq!(out[0], 0.0);
        assert!((out[1] - 10.0).abs() < 1e-6);
    }

    #[test]
    fn embedding_ref_gathers_rows_and_nans_bad_ids() {
        let table: Vec<u16> = [1.0f32, 2.0, 3.0, 4.0]
            .iter()
            .map(|&v| f32_to_bf16(v))
            .collect();
        let out = embedding_ref(&table, &[1, 0, 2], 2);
        assert_eq!(&out[..4], &[3.0, 4.0, 1.0, 2.0]);
        assert!(out[4].is_nan() && out[5].is_nan());
    }

    #[test]
    fn token_id_check_names_the_bad_id() {
        assert!(check_token_ids(&[0, 5, 9], 10).is_ok());
        let e = check_token_ids(&[0, 10], 10).unwrap_err().to_string();
        assert!(e.contains("token id 10 at index 1"), "{e}");
        assert!(check_token_ids(&[-1], 10).is_err());
    }
}
