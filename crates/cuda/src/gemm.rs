//! Prefill GEMMs through cuBLASLt: `Y[m, n] = β·Y + X[m, k] · Wᵀ` with W BF16 [n, k] row-major (the
//! weight layout of every linear), X BF16 [m, k] row-major and Y f32 [m, n] row-major, f32
//! accumulation. The algorithm of each shape (n, k, m, β) is chosen once by cuBLASLt's heuristic
//! and kept in a plan; later calls of the same shape reuse it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cudarc::cublaslt::result as lt;
use cudarc::cublaslt::sys;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};

use crate::device::GpuDevice;
use crate::error::{DriverContext, GpuError, Result};

/// cuBLASLt workspace: NVIDIA's recommendation for Hopper.
pub const WORKSPACE_BYTES: usize = 32 << 20;

fn lt_err(context: impl Into<String>) -> impl FnOnce(lt::CublasError) -> GpuError {
    let context = context.into();
    move |e| GpuError::Cublas {
        context,
        status: format!("{:?}", e.0),
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct PlanKey {
    n: usize,
    k: usize,
    m: usize,
    accumulate: bool,
}

/// Descriptors and the chosen algorithm of one GEMM shape.
struct Plan {
    desc: sys::cublasLtMatmulDesc_t,
    a: sys::cublasLtMatrixLayout_t,
    b: sys::cublasLtMatrixLayout_t,
    c: sys::cublasLtMatrixLayout_t,
    algo: sys::cublasLtMatmulAlgo_t,
}

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: created once in `Gemm::plan`, destroyed once here.
        unsafe {
            let _ = lt::destroy_matrix_layout(self.a);
            let _ = lt::destroy_matrix_layout(self.b);
            let _ = lt::destroy_matrix_layout(self.c);
            let _ = lt::destroy_matmul_desc(self.desc);
        }
    }
}

/// A cuBLASLt handle with its workspace and the plans chosen so far.
pub struct Gemm {
    handle: sys::cublasLtHandle_t,
    stream: Arc<CudaStream>,
    workspace: CudaSlice<u8>,
    plans: Mutex<HashMap<PlanKey, Plan>>,
}

impl Drop for Gemm {
    fn drop(&mut self) {
        self.plans.lock().unwrap_or_else(|p| p.into_inner()).clear();
        // SAFETY: created in `Gemm::new`, destroyed once.
        let _ = unsafe { lt::destroy_handle(self.handle) };
    }
}

impl Gemm {
    pub fn new(dev: &GpuDevice) -> Result<Self> {
        // SAFETY: only tries to dlopen libcublasLt.
        if !unsafe { sys::is_culib_present() } {
            return Err(GpuError::Cublas {
                context: "loading libcublasLt".into(),
                status: "libcublasLt.so not found on the library path".into(),
            });
        }
        let handle = lt::create_handle().map_err(lt_err("creating a cuBLASLt handle"))?;
        let workspace = dev
            .stream()
            .alloc_zeros::<u8>(WORKSPACE_BYTES)
            .while_(|| "allocating the cuBLASLt workspace".into())?;
        Ok(Gemm {
            handle,
            stream: Arc::clone(dev.stream()),
            workspace,
            plans: Mutex::new(HashMap::new()),
        })
    }

    pub fn workspace_bytes(&self) -> usize {
        WORKSPACE_BYTES
    }

    fn plan(&self, key: PlanKey) -> Result<sys::cublasLtMatmulAlgo_t> {
        let mut plans = self.plans.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(p) = plans.get(&key) {
            return Ok(p.algo);
        }
        let what = format!(
            "planning GEMM [{} x {}] · [{} x {}]ᵀ",
            key.m, key.k, key.n, key.k
        );
        let (n, k, m) = (key.n as u64, key.k as u64, key.m as u64);
        // Column-major view: W row-major [n, k] is col-major k × n (ld k), used transposed;
        // X row-major [m, k] is col-major k × m; Y row-major [m, n] is col-major n × m.
        let bf16 = sys::cudaDataType_t::CUDA_R_16BF;
        let f32t = sys::cudaDataType_t::CUDA_R_32F;
        let a = lt::create_matrix_layout(bf16, k, n, k as i64).map_err(lt_err(what.clone()))?;
        let b = lt::create_matrix_layout(bf16, k, m, k as i64).map_err(lt_err(what.clone()))?;
        let c = lt::create_matrix_layout(f32t, n, m, n as i64).map_err(lt_err(what.clone()))?;
        let desc = lt::create_matmul_desc(sys::cublasComputeType_t::CUBLAS_COMPUTE_32F, f32t)
            .map_err(lt_err(what.clone()))?;
        let mut plan = Plan {
            desc,
            a,
            b,
            c,
            // SAFETY: plain-data struct; overwritten by the heuristic below before any use.
            algo: unsafe { std::mem::zeroed() },
        };
        let trans: i32 = 1; // CUBLAS_OP_T
                            // SAFETY: the descriptor is live; the attribute is a 32-bit operation code.
        unsafe {
            lt::set_matmul_desc_attribute(
                plan.desc,
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
                (&trans as *const i32).cast(),
                std::mem::size_of::<i32>(),
            )
        }
        .map_err(lt_err(what.clone()))?;
        let pref = lt::create_matmul_pref().map_err(lt_err(what.clone()))?;
        let ws = WORKSPACE_BYTES as u64;
        // SAFETY: live preference; the attribute is a u64 byte count.
        let heuristic = unsafe {
            lt::set_matmul_pref_attribute(
                pref,
                sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                (&ws as *const u64).cast(),
                std::mem::size_of::<u64>(),
            )
            .and_then(|()| {
                lt::get_matmul_algo_heuristic(
                    self.handle,
                    plan.desc,
                    plan.a,
                    plan.b,
                    plan.c,
                    plan.c,
                    pref,
                )
            })
        };
        // SAFETY: created above.
        let _ = unsafe { lt::destroy_matmul_pref(pref) };
        plan.algo = heuristic.map_err(lt_err(what))?.algo;
        let algo = plan.algo;
        plans.insert(key, plan);
        Ok(algo)
    }

    /// `y[..m·n] = (accumulate ? y : 0) + x[..m·k] · wᵀ`, w BF16 [n, k], x BF16 [m, k], y f32 [m, n].
    #[allow(clippy::too_many_arguments)]
    pub fn matmul(
        &self,
        w: &impl DevicePtr<u16>,
        x: &impl DevicePtr<u16>,
        y: &mut impl DevicePtrMut<f32>,
        m: usize,
        n: usize,
        k: usize,
        accumulate: bool,
    ) -> Result<()> {
        if m == 0 || n == 0 || k == 0 {
            return Err(GpuError::invalid(
                "gemm",
                format!("empty shape m {m} n {n} k {k}"),
            ));
        }
        if w.len() < n * k || x.len() < m * k || y.len() < m * n {
            return Err(GpuError::invalid(
                "gemm",
                format!(
                    "buffers w {} / x {} / y {} too small for m {m} n {n} k {k}",
                    w.len(),
                    x.len(),
                    y.len()
                ),
            ));
        }
        let key = PlanKey {
            n,
            k,
            m,
            accumulate,
        };
        let algo = self.plan(key)?;
        let plans = self.plans.lock().unwrap_or_else(|p| p.into_inner());
        let p = plans.get(&key).expect("planned above");
        let (alpha, beta) = (1.0f32, if accumulate { 1.0f32 } else { 0.0 });
        let s = &self.stream;
        let (w_ptr, _w) = w.device_ptr(s);
        let (x_ptr, _x) = x.device_ptr(s);
        let (y_ptr, _y) = y.device_ptr_mut(s);
        let (ws_ptr, _ws) = self.workspace.device_ptr(s);
        // SAFETY: pointers are live device buffers at least as large as the layouts describe
        // (checked above); the plan's descriptors are live while `plans` is locked.
        unsafe {
            lt::matmul(
                self.handle,
                p.desc,
                (&alpha as *const f32).cast(),
                (&beta as *const f32).cast(),
                w_ptr as *const _,
                p.a,
                x_ptr as *const _,
                p.b,
                y_ptr as *const _,
                p.c,
                y_ptr as *mut _,
                p.c,
                &algo,
                ws_ptr as *mut _,
                WORKSPACE_BYTES,
                s.cu_stream() as *mut _,
            )
        }
        .map_err(lt_err(format!("cublasLtMatmul m {m} n {n} k {k}")))
    }
}

/// CPU reference (f64 accumulation) of [`Gemm::matmul`]: returns `y0 + x · wᵀ` (y0 None: 0).
pub fn gemm_ref(
    w: &[u16],
    x: &[u16],
    y0: Option<&[f32]>,
    m: usize,
    n: usize,
    k: usize,
) -> Vec<f32> {
    use rayon::prelude::*;
    let wf: Vec<f32> = w.iter().map(|&b| crate::ops::bf16_to_f32(b)).collect();
    let xf: Vec<f32> = x.iter().map(|&b| crate::ops::bf16_to_f32(b)).collect();
    (0..m * n)
        .into_par_iter()
        .map(|i| {
            let (r, c) = (i / n, i % n);
            let dot: f64 = xf[r * k..(r + 1) * k]
                .iter()
                .zip(&wf[c * k..(c + 1) * k])
                .map(|(&a, &b)| a as f64 * b as f64)
                .sum();
            (dot + y0.map_or(0.0, |y| y[i] as f64)) as f32
        })
        .collect()
}
