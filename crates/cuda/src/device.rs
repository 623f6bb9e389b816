//! Device discovery and the per-device runtime: context, stream, loaded kernel modules.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use cudarc::driver::sys::CUdevice_attribute as Attr;
use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr};
use cudarc::nvrtc::Ptx;

use crate::error::{DriverContext, GpuError, Result};
use crate::jit::{cached_cubin, default_cache_dir, KernelVariant};

/// What the runtime needs to know about a GPU to compile for it and size its launches.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    pub ordinal: usize,
    pub name: String,
    pub compute_capability: (i32, i32),
    pub sm_count: u32,
    pub l2_bytes: u64,
    pub total_memory_bytes: u64,
}

impl DeviceInfo {
    /// NVRTC architecture name, e.g. `sm_90` for an H100/H200.
    pub fn arch(&self) -> String {
        format!(
            "sm_{}{}",
            self.compute_capability.0, self.compute_capability.1
        )
    }
}

/// Number of CUDA devices, or [`GpuError::NoDevice`] saying why there are none (no driver library,
/// `cuInit` failure, zero devices). Never panics, so callers can fall back to the CPU.
pub fn device_count() -> Result<usize> {
    // SAFETY: only tries to dlopen libcuda by its usual names. cudarc panics on first use of a
    // missing library, so this check must come before any driver call.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(GpuError::NoDevice(
            "libcuda.so.1 not found (no NVIDIA driver on this machine)".into(),
        ));
    }
    let n = CudaContext::device_count()
        .map_err(|e| GpuError::NoDevice(format!("cuInit/cuDeviceGetCount failed: {e}")))?;
    if n <= 0 {
        return Err(GpuError::NoDevice(
            "the NVIDIA driver is loaded but reports no GPU".into(),
        ));
    }
    Ok(n as usize)
}

/// One GPU with its own stream (not the legacy default stream, so work can be captured into CUDA
/// graphs) and a cache of compiled kernel modules.
pub struct GpuDevice {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    info: DeviceInfo,
    cache_dir: Option<PathBuf>,
    modules: Mutex<HashMap<KernelVariant, Arc<CudaModule>>>,
    /// Looked-up functions, so launches (also inside graph capture) make no driver lookups.
    functions: Mutex<HashMap<(KernelVariant, String), CudaFunction>>,
    /// Diagnostic builds only ([`GpuDevice::open_traced`]): the kernels' pdl_wait records
    /// (common.cuh).
    trace: Option<Mutex<CudaSlice<u64>>>,
}

/// Records the trace buffer holds (32 bytes each).
pub const TRACE_CAPACITY: usize = 1 << 20;

impl TraceRecord {
    /// The records of a trace buffer as common.cuh's `pdl_wait` writes it: word 0 the count, then
    /// four words a record (arrival, release, SM | block x << 16 | block y << 40, grid x | grid y
    /// << 24 | threads << 48). Counts past the buffer (records dropped) are capped.
    pub fn parse(raw: &[u64]) -> Vec<TraceRecord> {
        let Some(&count) = raw.first().filter(|_| raw.len() >= 4) else {
            return Vec::new();
        };
        let n = (count as usize).min(raw.len().saturating_sub(4) / 4);
        raw[4..4 + 4 * n]
            .chunks_exact(4)
            .map(|r| TraceRecord {
                arrived_ns: r[0],
                released_ns: r[1],
                sm: (r[2] & 0xffff) as u32,
                block: (((r[2] >> 16) & 0xff_ffff) as u32, (r[2] >> 40) as u32),
                grid: ((r[3] & 0xff_ffff) as u32, ((r[3] >> 24) & 0xff_ffff) as u32),
                threads: (r[3] >> 48) as u32,
            })
            .collect()
    }
}

/// One block's record in a traced build: when its thread 0 reached `pdl_wait` and when the wait
/// returned (the GPU's global timer, ns), its SM, block and launch shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TraceRecord {
    pub arrived_ns: u64,
    pub released_ns: u64,
    pub sm: u32,
    pub block: (u32, u32),
    pub grid: (u32, u32),
    pub threads: u32,
}

impl std::fmt::Debug for GpuDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuDevice")
            .field("info", &self.info)
            .finish()
    }
}

impl GpuDevice {
    /// Opens GPU `ordinal` with the default kernel cache directory.
    pub fn open(ordinal: usize) -> Result<Self> {
        Self::open_with_cache(ordinal, default_cache_dir())
    }

    /// Opens GPU `ordinal` for a diagnostic run: every kernel is built with a trace in `pdl_wait`
    /// (each block's arrival at the wait and release from it), read by
    /// [`GpuDevice::trace_records`]. The traced build's timings are not the engine's.
    pub fn open_traced(ordinal: usize) -> Result<Self> {
        Self::open_inner(ordinal, default_cache_dir(), true)
    }

    /// Opens GPU `ordinal`; compiled kernels are cached in `cache_dir` (None: no disk cache).
    pub fn open_with_cache(ordinal: usize, cache_dir: Option<PathBuf>) -> Result<Self> {
        Self::open_inner(ordinal, cache_dir, false)
    }

    fn open_inner(ordinal: usize, cache_dir: Option<PathBuf>, traced: bool) -> Result<Self> {
        let count = device_count()?;
        if ordinal >= count {
            return Err(GpuError::NoDevice(format!(
                "device {ordinal} requested but only {count} present"
            )));
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| {
            GpuError::NoDevice(format!("creating a context on device {ordinal}: {e}"))
        })?;
        // One stream per device: cudarc's per-buffer event tracking (for multi-stream use) would
        // only add event records to every launch and to captured graphs.
        // SAFETY: called before any buffer of this context exists.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().while_(|| "creating a stream".into())?;
        let attr = |a: Attr, what: &str| {
            ctx.attribute(a)
                .while_(|| format!("reading device attribute {what}"))
        };
        let mut total = 0usize;
        // SAFETY: the context is current on this thread after CudaContext::new.
        unsafe { cudarc::driver::sys::cuDeviceTotalMem_v2(&mut total, ctx.cu_device()) }
            .result()
            .while_(|| "reading total device memory".into())?;
        let info = DeviceInfo {
            ordinal,
            name: ctx.name().while_(|| "reading the device name".into())?,
            compute_capability: ctx
                .compute_capability()
                .while_(|| "reading the compute capability".into())?,
            sm_count: attr(Attr::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, "SM count")? as u32,
            l2_bytes: attr(Attr::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE, "L2 size")? as u64,
            total_memory_bytes: total as u64,
        };
        let trace = if traced {
            Some(Mutex::new(
                stream
                    .alloc_zeros::<u64>(4 + 4 * TRACE_CAPACITY)
                    .while_(|| "allocating the trace buffer".into())?,
            ))
        } else {
            None
        };
        Ok(GpuDevice {
            ctx,
            stream,
            info,
            cache_dir,
            modules: Mutex::new(HashMap::new()),
            functions: Mutex::new(HashMap::new()),
            trace,
        })
    }

    /// Whether kernels are built with the pdl_wait trace ([`GpuDevice::open_traced`]).
    pub fn tracing(&self) -> bool {
        self.trace.is_some()
    }

    /// Empties the trace buffer (traced builds; otherwise nothing).
    pub fn trace_reset(&self) -> Result<()> {
        if let Some(t) = self.trace.as_ref() {
            let mut t = t.lock().unwrap_or_else(|p| p.into_inner());
            self.stream
                .memset_zeros(&mut *t)
                .while_(|| "clearing the trace buffer".into())?;
        }
        Ok(())
    }

    /// The records since the last [`Self::trace_reset`], in the order blocks wrote them (traced
    /// builds; otherwise none).
    pub fn trace_records(&self) -> Result<Vec<TraceRecord>> {
        let Some(t) = self.trace.as_ref() else {
            return Ok(Vec::new());
        };
        let t = t.lock().unwrap_or_else(|p| p.into_inner());
        let raw = self
            .stream
            .clone_dtoh(&*t)
            .while_(|| "reading the trace buffer".into())?;
        Ok(TraceRecord::parse(&raw))
    }

    /// Sets a traced module's `trace_buf` and `trace_cap` (common.cuh) to the device's buffer.
    fn point_module_at_trace(&self, m: &Arc<CudaModule>, t: &CudaSlice<u64>) -> Result<()> {
        let (ptr, _sync) = t.device_ptr(&self.stream);
        for (name, value) in [("trace_buf", ptr), ("trace_cap", TRACE_CAPACITY as u64)] {
            let mut g = m
                .get_global(name, &self.stream)
                .while_(|| format!("looking up the traced module's {name}"))?;
            // SAFETY: both globals are 8-byte integers (common.cuh).
            let mut g64 = unsafe { g.transmute_mut::<u64>(1) }
                .ok_or_else(|| GpuError::invalid("trace", "the trace globals are not 8 bytes"))?;
            self.stream
                .memcpy_htod(&[value], &mut g64)
                .while_(|| format!("setting the traced module's {name}"))?;
        }
        Ok(())
    }

    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The stream every `launch_*` wrapper enqueues on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    pub fn synchronize(&self) -> Result<()> {
        self.stream
            .synchronize()
            .while_(|| "synchronizing the stream (a kernel may have faulted)".into())
    }

    /// Kernel `function` of `variant`, compiling (or reading the cubin cache) on first use.
    pub fn function(&self, variant: &KernelVariant, function: &str) -> Result<CudaFunction> {
        let traced;
        let variant = if self.trace.is_some() {
            let mut v = variant.clone();
            v.defines.push(("ENTROLLM_TRACE", 1));
            traced = v;
            &traced
        } else {
            variant
        };
        let key = (variant.clone(), function.to_string());
        if let Some(f) = self
            .functions
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&key)
        {
            return Ok(f.clone());
        }
        let module = {
            let mut modules = self.modules.lock().unwrap_or_else(|p| p.into_inner());
            match modules.get(variant) {
                Some(m) => m.clone(),
                None => {
                    let cubin =
                        cached_cubin(variant, &self.info.arch(), self.cache_dir.as_deref())?;
                    let m = self
                        .ctx
                        .load_module(Ptx::from_binary(cubin))
                        .while_(|| format!("loading the cubin of {}", variant.source.name))?;
                    if let Some(t) = self.trace.as_ref() {
                        let t = t.lock().unwrap_or_else(|p| p.into_inner());
                        self.point_module_at_trace(&m, &t)?;
                    }
                    modules.insert(variant.clone(), m.clone());
                    m
                }
            }
        };
        let f = module
            .load_function(function)
            .while_(|| format!("looking up `{function}` in {}", variant.source.name))?;
        self.functions
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(key, f.clone());
        Ok(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trace_records_unpack_as_written() {
        let rec = |sm: u64, bx: u64, by: u64, gx: u64, gy: u64, t: u64| {
            [
                100 + bx,
                200 + bx,
                sm | bx << 16 | by << 40,
                gx | gy << 24 | t << 48,
            ]
        };
        let mut raw = vec![2u64, 0, 0, 0];
        raw.extend(rec(131, 16031, 0, 16032, 1, 128));
        raw.extend(rec(7, 3, 7, 10, 8, 256));
        raw.extend(rec(1, 1, 1, 1, 1, 1)); // past the count: not a record
        let r = TraceRecord::parse(&raw);
        assert_eq!(r.len(), 2);
        assert_eq!(
            (r[0].sm, r[0].block, r[0].grid, r[0].threads),
            (131, (16031, 0), (16032, 1), 128)
        );
        assert_eq!((r[1].arrived_ns, r[1].released_ns), (103, 203));
        assert_eq!(
            (r[1].block, r[1].grid, r[1].threads),
            ((3, 7), (10, 8), 256)
        );
        // A count past the buffer (records dropped on the device) reads what is there.
        raw[0] = 1000;
        assert_eq!(TraceRecord::parse(&raw).len(), 3);
        assert!(TraceRecord::parse(&[]).is_empty());
        assert!(TraceRecord::parse(&[5, 0]).is_empty());
    }

    #[test]
    fn no_driver_is_a_clear_error_not_a_panic() {
        // On machines with a GPU this opens it; on CPU-only machines (CI) it must say why not.
        match GpuDevice::open(0) {
            Ok(dev) => assert!(dev.info().sm_count > 0),
            Err(GpuError::NoDevice(msg)) => assert!(!msg.is_empty()),
            Err(e) => panic!("unexpected error kind: {e}"),
        }
    }

    #[test]
    fn absurd_ordinal_is_no_device() {
        assert!(matches!(
            GpuDevice::open(1 << 20),
            Err(GpuError::NoDevice(_))
        ));
    }

    #[test]
    fn arch_name() {
        let info = DeviceInfo {
            ordinal: 0,
            name: "H200".into(),
            compute_capability: (9, 0),
            sm_count: 132,
            l2_bytes: 60 << 20,
            total_memory_bytes: 0,
        };
        assert_eq!(info.arch(), "sm_90");
    }
}
