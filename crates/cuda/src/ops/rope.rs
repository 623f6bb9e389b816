//! Rotary position embedding (`kernels/rope.cu`), in place on the q and k projections.

use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

use super::{as_i32, check_len};
use crate::device::GpuDevice;
use crate::error::{DriverContext, GpuError, Result};
use crate::jit::{KernelVariant, ROPE};

pub fn variant() -> KernelVariant {
    KernelVariant::new(&ROPE, vec![])
}

/// Which pairs of a head's dimensions are rotated together.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeLayout {
    /// HF / NEOX: (x[i], x[i + d/2]).
    Neox,
    /// GGUF llama: (x[2i], x[2i + 1]).
    Interleaved,
}

/// Shapes of one RoPE launch: q is [n_tokens, n_q_heads, head_dim], k [n_tokens, n_kv_heads, head_dim].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RopeShape {
    pub n_tokens: usize,
    pub n_q_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub layout: RopeLayout,
}

/// Rotates q and k in place at `positions[t]`. `inv_freq` [head_dim / 2] holds radians per
/// position with the model's frequency scaling applied on the host (e.g. `rope_inv_freq` of the
/// CPU engine, llama3 scaling included); it and the angles are f64.
pub fn launch_rope(
    dev: &GpuDevice,
    q: &mut CudaSlice<f32>,
    k: &mut CudaSlice<f32>,
    positions: &CudaSlice<i32>,
    inv_freq: &CudaSlice<f64>,
    s: RopeShape,
) -> Result<()> {
    const OP: &str = "rope";
    if s.head_dim == 0 || s.head_dim % 2 != 0 {
        return Err(GpuError::invalid(
            OP,
            format!("head_dim {} must be even and > 0", s.head_dim),
        ));
    }
    check_len(OP, "q", q, s.n_tokens * s.n_q_heads * s.head_dim)?;
    check_len(OP, "k", k, s.n_tokens * s.n_kv_heads * s.head_dim)?;
    check_len(OP, "positions", positions, s.n_tokens)?;
    check_len(OP, "inv_freq", inv_freq, s.head_dim / 2)?;
    as_i32(OP, "q elements", s.n_tokens * s.n_q_heads * s.head_dim)?;
    if s.n_tokens == 0 {
        return Ok(());
    }
    let f = dev.function(&variant(), "rope")?;
    let cfg = LaunchConfig {
        grid_dim: (as_i32(OP, "n_tokens", s.n_tokens)? as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let nq = as_i32(OP, "n_q_heads", s.n_q_heads)?;
    let nkv = as_i32(OP, "n_kv_heads", s.n_kv_heads)?;
    let hd = as_i32(OP, "head_dim", s.head_dim)?;
    let inter = i32::from(s.layout == RopeLayout::Interleaved);
    let mut b = dev.stream().launch_builder(&f);
    b.arg(q).arg(k).arg(positions).arg(inv_freq);
    b.arg(&nq).arg(&nkv).arg(&hd).arg(&inter);
    // SAFETY: argument types and counts match the kernel; sizes were checked above.
    unsafe { b.launch(cfg) }.while_(|| "launching rope".into())?;
    Ok(())
}

/// CPU reference: rotates every head of `x` ([n_tokens, n_heads, head_dim]) in place.
pub fn rope_ref(
    x: &mut [f32],
    positions: &[i32],
    inv_freq: &[f64],
    head_dim: usize,
    layout: RopeLayout,
) {
    let half = head_dim / 2;
    let per_token = x.len() / positions.len().max(1);
    for (t, &pos) in positions.iter().enumerate() {
        for head in x[t * per_token..(t + 1) * per_token].chunks_mut(head_dim) {
            for (i, &f) in inv_freq.iter().enumerate().take(half) {
                let (a, b) = match layout {
                    RopeLayout::Neox => (i, i + half),
                    RopeLayout::Interleaved => (2 * i, 2 * i + 1),
                };
                let (s, c) = (pos as f64 * f).sin_cos();
                let (x0, x1) = (head[a] as f64, head[b] as f64);
                head[a] = (x0 * c - x1 * s) as f32;
                head[b] = (x1 * c + x0 * s) as f32;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quarter_turn_rotates_pairs() {
        // inv_freq π/2 at position 1: (x0, x1) -> (-x1, x0).
        let f = [std::f64::consts::FRAC_PI_2];
        let mut neox = [1.0f32, 2.0];
        rope_ref(&mut neox, &[1], &f, 2, RopeLayout::Neox);
        assert!((neox[0] + 2.0).abs() < 1e-6 && (neox[1] - 1.0).abs() < 1e-6);

        let f2 = [std::f64::consts::FRAC_PI_2, 0.0];
        let mut x = [1.0f32, 2.0, 3.0, 4.0];
        rope_ref(&mut x, &[1], &f2, 4, RopeLayout::Interleaved);
        // pair (0,1) rotated by π/2, pair (2,3) unchanged
        assert!((x[0] + 2.0).abs() < 1e-6 && (x[1] - 1.0).abs() < 1e-6);
        assert_eq!(&x[2..], &[3.0, 4.0]);
        let mut y = [1.0f32, 2.0, 3.0, 4.0];
        rope_ref(&mut y, &[1], &f2, 4, RopeLayout::Neox);
        // NEOX pairs (0,2) rotated, (1,3) unchanged
        assert!((y[0] + 3.0).abs() < 1e-6 && (y[2] - 1.0).abs() < 1e-6);
        assert_eq!((y[1], y[3]), (2.0, 4.0));
    }

    #[test]
    fn position_zero_is_identity() {
        let mut x = [0.5f32, -1.5, 2.5, 3.0];
        rope_ref(&mut x, &[0], &[1.0, 0.01], 4, RopeLayout::Neox);
        assert_eq!(x, [0.5, -1.5, 2.5, 3.0]);
    }
}
