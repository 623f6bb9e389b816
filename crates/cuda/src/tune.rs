//! The GPU side of `entrollm tune` and `--budget`: the device's identity for tune files, the
//! memory the engine takes beside its weights, and a [`LaunchTimer`] that times each launch's
//! forms with the cold-cache protocol (weight copies covering 2× L2, CUDA-graph replays, median
//! of 5 bursts of ≥ 400 µs: [`crate::timing`]).

use crate::device::GpuDevice;
use crate::error::DriverContext;
use crate::forms::report::LoadReport;
use crate::forms::{self, Policy, Upload};
use crate::linear::{DtansScratch, GpuLinear, SharedScratch};
use crate::ops::forward::GemvFusion;
use crate::timing::{copies_for, time_cold};
use entrollm_model::coding_plan::Launch;
use entrollm_model::weights::{Bf16, Dense, Linear};
use entrollm_model::ModelConfig;
use entrollm_tune::tuner::{LaunchTimer, TimedLaunch, Timing};
use entrollm_tune::{DeviceId, DeviceKind, TuneError};
use std::sync::{Arc, Mutex};

fn tune_err(e: impl std::fmt::Display) -> TuneError {
    TuneError::Tune(format!("GPU: {e}"))
}

/// The CUDA driver's version, `major.minor`.
fn driver_version() -> Option<String> {
    let mut v: std::ffi::c_int = 0;
    // SAFETY: a plain query into a local; the library is loaded (a device was opened).
    let r = unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut v) };
    (r == cudarc::driver::sys::CUresult::CUDA_SUCCESS)
        .then(|| format!("{}.{}", v / 1000, v % 1000 / 10))
}

/// What a tune file made on `dev` is tied to: GPU name, SM count, driver.
pub fn device_id(dev: &GpuDevice) -> DeviceId {
    DeviceId {
        kind: DeviceKind::Cuda,
        name: dev.info().name.clone(),
        threads: None,
        sm_count: Some(dev.info().sm_count),
        driver: driver_version(),
    }
}

/// Bytes the GPU engine takes beside its weights for a context of `ctx` tokens, reserved before a
/// budget is spent on weights: the BF16 KV cache, the engine's workspace
/// ([`crate::engine::workspace_bound`]) and room for the CUDA graphs and the allocator's
/// rounding. The engine's `memory()` reports what it took.
pub fn reserved_bytes(c: &ModelConfig, ctx: usize) -> u64 {
    let kv = 2 * c.num_layers * ctx * c.kv_dim() * 2;
    let graphs = 256 << 20;
    (kv + crate::engine::workspace_bound(c, ctx) + graphs) as u64
}

/// How much faster than a form's own launch configuration for a shape (chosen from whole decode
/// steps) another must time alone to be chosen: launches timed alone mislead by a few per cent.
pub const LAUNCH_GAIN: f64 = 1.03;

/// Times a launch's forms on one GPU.
pub struct GpuTimer {
    dev: Arc<GpuDevice>,
    scratch: SharedScratch,
}

impl GpuTimer {
    pub fn open(ordinal: usize) -> Result<Self, TuneError> {
        let dev = Arc::new(GpuDevice::open(ordinal).map_err(tune_err)?);
        // Room for the largest launch of a 70B model; prefill is not timed (no dequant workspace).
        let scratch = DtansScratch::new(&dev, 1 << 18, 1 << 16, 0).map_err(tune_err)?;
        Ok(GpuTimer {
            dev,
            scratch: Arc::new(Mutex::new(scratch)),
        })
    }

    /// The launch as the engine uploads it, each form as it is held (`forms::Policy::AS_HELD`);
    /// `None` when no GPU form holds it exactly (the tuner leaves the point out).
    fn upload(&self, parts: &[Arc<dyn Linear>], halves: bool) -> crate::Result<Option<GpuLinear>> {
        let refs: Vec<&dyn Linear> = parts.iter().map(|p| &**p).collect();
        let up = Upload {
            dev: &self.dev,
            scratch: &self.scratch,
            policy: Policy::AS_HELD,
            what: "tuned launch",
        };
        forms::upload(&up, &refs, halves, &mut LoadReport::default())
    }
}

impl LaunchTimer for GpuTimer {
    fn device(&self) -> DeviceId {
        device_id(&self.dev)
    }

    fn protocol(&self) -> String {
        format!(
            "cuda: weight copies covering 2x L2 ({} MiB), CUDA-graph replays, median of 5 bursts \
             of >= 400 us; the batch-1 product as the decode step launches it",
            self.dev.info().l2_bytes >> 20
        )
    }

    /// Each of the form's launch configurations in turn ([`GpuLinear::launch_configs`]), with
    /// the fusions the decode step runs the launch with (the RMSNorm where the form normalises
    /// inside its GEMV, SwiGLU for gate/up, the residual add for o and down); another
    /// configuration than the form's own for the shape is kept only where it is at least
    /// [`LAUNCH_GAIN`] faster.
    fn time(
        &self,
        launch: &TimedLaunch,
        make: &dyn Fn() -> Result<Vec<Arc<dyn Linear>>, TuneError>,
    ) -> Result<Option<Timing>, TuneError> {
        let parts = make()?;
        // The decode step gathers embeddings from a dense BF16 table only; a tied head is that
        // table.
        if launch.gather && !parts[0].as_any().is::<Dense<Bf16>>() {
            return Ok(None);
        }
        if !launch.products {
            // A row gather of one token: negligible beside the products; timed as one launch of
            // the embedding kernel would be, which the step overhead already holds.
            return Ok(Some(2.0.into()));
        }
        let halves = parts.len() == 2 && parts[0].rows() == parts[1].rows() && !launch.gather;
        let Some(first) = self.upload(&parts, halves).map_err(tune_err)? else {
            return Ok(None);
        };
        let bytes = first.stored_bytes().max(1);
        let copies = copies_for(bytes, self.dev.info().l2_bytes);
        let mut linears = vec![first];
        for _ in 1..copies {
            match self.upload(&parts, halves).map_err(tune_err)? {
                Some(l) => linears.push(l),
                None => return Ok(None),
            }
        }
        let (rows, cols) = (linears[0].rows(), linears[0].cols());
        let s = self.dev.stream();
        let x = s
            .clone_htod(&vec![0.01f32; cols])
            .while_(|| "uploading the timing input".into())
            .map_err(tune_err)?;
        let mut y = s
            .alloc_zeros::<f32>(rows)
            .while_(|| "allocating the timing output".into())
            .map_err(tune_err)?;
        let fusion = GemvFusion {
            accumulate: matches!(launch.launch, Launch::O | Launch::Down),
            swiglu: halves,
        };
        let normed = matches!(launch.launch, Launch::Qkv | Launch::GateUp | Launch::LmHead)
            && linears[0].norm_in_gemv();
        let gamma = s
            .clone_htod(&vec![1.0f32; cols])
            .while_(|| "uploading the timing norm".into())
            .map_err(tune_err)?;
        let norm = normed.then_some((&gamma, 1e-5f32));
        // (The form's own configuration first: the one the others must beat.)
        let configs = linears[0].launch_configs();
        let mut best: Option<Timing> = None;
        for config in configs
            .iter()
            .map(Some)
            .chain(configs.is_empty().then_some(None))
        {
            if let Some(c) = config {
                for l in &mut linears {
                    l.set_launch_config(c).map_err(tune_err)?;
                }
            }
            let (us, _) = time_cold(&self.dev, copies, bytes, |c| {
                linears[c].matvec_fused(&self.dev, &x, norm, fusion, &mut y)
            })
            .map_err(tune_err)?;
            let gain = if best.is_none() { 1.0 } else { LAUNCH_GAIN };
            if best.as_ref().is_none_or(|b| us * gain < b.us) {
                best = Some(Timing {
                    us,
                    launch_config: config.cloned(),
                });
            }
        }
        Ok(best)
    }

    /// A decode step of the GPU engine on `w` as it is held (CUDA graph, greedy; nothing packed
    /// at load, so the step runs the forms the launches were timed in), less its launches' tuned
    /// latencies in their current forms. A model whose weights do not fit in device memory as
    /// held (a 70B model tuned in BF16) is measured with its first k and k/2 layers, and the
    /// overhead extrapolated linearly in the layers (it is per-layer kernels plus a fixed part).
    fn step_overhead_us(
        &self,
        w: &entrollm_model::ModelWeights,
        launches: &[entrollm_tune::LaunchTune],
    ) -> Result<Option<f64>, TuneError> {
        let overhead = |w: &entrollm_model::ModelWeights| -> Result<Option<f64>, TuneError> {
            let Some(weights_us) = entrollm_tune::tuner::current_forms_us(w, launches) else {
                return Ok(None);
            };
            let step = self.step_us(w).map_err(tune_err)?;
            Ok(Some((step - weights_us).max(0.0)))
        };
        let layers = w.layers.len();
        let (free, _) = crate::engine_coded::free_memory(&self.dev).map_err(tune_err)?;
        let room = (free as f64 * 0.9) as usize;
        let fixed = w.embed.stored_bytes()
            + if Arc::ptr_eq(&w.embed, &w.lm_head) {
                0
            } else {
                w.lm_head.stored_bytes()
            }
            + reserved_bytes(&w.config, 128) as usize;
        let per_layer =
            (w.stored_bytes() - w.embed.stored_bytes() - w.lm_head.stored_bytes()) / layers.max(1);
        if fixed + per_layer * layers <= room {
            return overhead(w);
        }
        let k = room.saturating_sub(fixed) / per_layer.max(1);
        if k < 4 {
            return Ok(None);
        }
        let (Some(ok), Some(oh)) = (
            overhead(&first_layers(w, k))?,
            overhead(&first_layers(w, k / 2))?,
        ) else {
            return Ok(None);
        };
        let per = (ok - oh) / (k - k / 2) as f64;
        Ok(Some((ok + per * (layers - k) as f64).max(0.0)))
    }
}

impl GpuTimer {
    /// Median µs of a greedy decode step of the GPU engine on `w` as held (after 8 warm-up steps).
    fn step_us(&self, w: &entrollm_model::ModelWeights) -> crate::Result<f64> {
        let (model, _) =
            crate::GpuModel::upload_served(&self.dev, w, crate::linear::Serving::AS_HELD)?;
        let mut e = crate::GpuEngine::new(Arc::clone(&self.dev), model, 128)?;
        let prompt: Vec<u32> = (1..9).collect();
        let mut tok = e.prefill_greedy(&prompt)?;
        let mut times = Vec::with_capacity(48);
        for i in 0..56 {
            let t0 = std::time::Instant::now();
            tok = e.step_greedy(tok)?;
            if i >= 8 {
                times.push(t0.elapsed().as_secs_f64() * 1e6);
            }
        }
        times.sort_by(f64::total_cmp);
        Ok(times[times.len() / 2])
    }
}

/// `w` with its first `k` layers only (the same matrices).
fn first_layers(w: &entrollm_model::ModelWeights, k: usize) -> entrollm_model::ModelWeights {
    let mut config = w.config.clone();
    config.num_layers = k;
    entrollm_model::ModelWeights {
        config,
        embed: Arc::clone(&w.embed),
        layers: w.layers[..k].to_vec(),
        final_norm: w.final_norm.clone(),
        lm_head: Arc::clone(&w.lm_head),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use entrollm_model::synth::SynthShape;

    #[test]
    fn the_reserve_covers_what_the_engine_took() {
        // `memory()` of the engine serving the 70B shape with a 131,072-token cache on the H200
        // (bench/RESULTS.md): KV cache 42 949 672 960 B, workspace 4 465 780 756 B with prefill
        // buffers for 8192 tokens of 409 604 B each; the reserve counts 2048 of them.
        let c = SynthShape::Llama33_70B.config();
        let (kv, workspace) = (42_949_672_960u64, 4_465_780_756 - 6144 * 409_604);
        let r = reserved_bytes(&c, 131072);
        assert!(r >= kv + workspace, "{r}");
        assert!(r < kv + workspace + (300 << 20), "{r}");
    }
}
