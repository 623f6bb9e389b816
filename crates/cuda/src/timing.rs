//! Cold-cache timing of a launch (the protocol of DESIGN.md "How we measure"): the weight matrix
//! is copied until the copies cover more than 2× L2 and launches rotate through them, a burst of
//! ≥ 400 µs of launches is captured in one CUDA graph, and the per-launch time is the median of 5
//! timed graph replays (after 2 warm-up replays). `--budget` times each launch's forms with it
//! (`tune`); the benchmarks of entrollm-check do too.

use cudarc::driver::sys::{CUevent_flags, CUgraphInstantiate_flags, CUstreamCaptureMode};

use crate::device::GpuDevice;
use crate::error::{DriverContext, GpuError, Result};

const BURST_SECONDS: f64 = 400e-6;
const TIMED_REPLAYS: usize = 5;

/// Number of weight copies whose total exceeds 2× L2.
pub fn copies_for(weight_bytes: usize, l2_bytes: u64) -> usize {
    (2 * l2_bytes as usize) / weight_bytes.max(1) + 1
}

/// Times `launch(copy_index)` under the cold-cache protocol; returns (median µs per launch,
/// launches per burst).
pub fn time_cold(
    dev: &GpuDevice,
    copies: usize,
    weight_bytes: usize,
    mut launch: impl FnMut(usize) -> Result<()>,
) -> Result<(f64, usize)> {
    // Warm-up outside the graph: compiles/loads kernels and creates library state.
    for c in 0..copies {
        launch(c)?;
    }
    dev.synchronize()?;
    let est = weight_bytes as f64 / 3.0e12;
    let launches = ((BURST_SECONDS / est).ceil() as usize)
        .div_ceil(copies)
        .max(1)
        * copies;
    let stream = dev.stream();
    stream
        .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .while_(|| "beginning graph capture".into())?;
    let mut captured = Ok(());
    for i in 0..launches {
        captured = launch(i % copies);
        if captured.is_err() {
            break;
        }
    }
    let graph = stream
        .end_capture(CUgraphInstantiate_flags(0))
        .while_(|| "ending graph capture".into())?;
    captured?;
    let graph = graph.ok_or_else(|| GpuError::invalid("bench", "captured graph is empty"))?;
    let ctx = dev.context();
    let timing = Some(CUevent_flags::CU_EVENT_DEFAULT);
    let (start, end) = (
        ctx.new_event(timing)
            .while_(|| "creating an event".into())?,
        ctx.new_event(timing)
            .while_(|| "creating an event".into())?,
    );
    for _ in 0..2 {
        graph.launch().while_(|| "replaying the graph".into())?;
    }
    let mut per_launch_us = Vec::with_capacity(TIMED_REPLAYS);
    for _ in 0..TIMED_REPLAYS {
        start
            .record(stream)
            .while_(|| "recording an event".into())?;
        graph.launch().while_(|| "replaying the graph".into())?;
        end.record(stream).while_(|| "recording an event".into())?;
        let ms = start
            .elapsed_ms(&end)
            .while_(|| "reading event time".into())?;
        per_launch_us.push(ms as f64 * 1e3 / launches as f64);
    }
    per_launch_us.sort_by(f64::total_cmp);
    Ok((per_launch_us[TIMED_REPLAYS / 2], launches))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_cover_twice_l2() {
        let l2 = 60u64 << 20;
        // Llama-3.1-8B's launches (n, k).
        for (n, k) in [
            (6144, 4096),
            (4096, 4096),
            (28_672, 4096),
            (4096, 14_336),
            (128_256, 4096),
        ] {
            let bytes = n * k * 2;
            let c = copies_for(bytes, l2);
            assert!(c * bytes > 2 * l2 as usize, "{n}x{k}: {c} copies");
            assert!(c >= 1);
        }
        assert_eq!(copies_for(1 << 30, l2), 1);
    }
}
