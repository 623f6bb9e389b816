//! dtANS-LLM kernels (`kernels/dtans_mvm.cu`): the fused decode-matvec `mvm` (several matrices that
//! share an input in one launch), `decode` to the source elements and `dequant` to BF16 weights (for
//! prefill GEMMs), and their selftest against the codec's CPU decoder and matvec.
//!
//! Tolerances: decode and dequant are bit-exact; mvm is within 1e-5 of the codec's f64 matvec in L2
//! relative to the rows' Σ|w·x| (f32 accumulation in a different order; per-slice partial sums
//! added with f32 atomics).

use cudarc::driver::sys::CUfunction_attribute_enum;
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig, PushKernelArg};
use entrollm_codec::dtans::{Coding, DtansTensor, Mode};
use entrollm_codec::matvec::Dequant;
use entrollm_codec::Payload;

use crate::coded::GpuDtans;
use crate::device::GpuDevice;
use crate::error::{DriverContext, GpuError, Result};
use crate::jit::{KernelSource, KernelVariant};
use crate::selftest::{download, upload, CaseResult, Rng, SelftestReport};

pub static DTANS: KernelSource = KernelSource {
    name: "dtans_mvm.cu",
    source: include_str!("../../kernels/dtans_mvm.cu"),
};

/// Most matrices in one launch (the kernel's `DT_MAXMATS`).
pub const MAX_MATS: usize = 4;

/// Dynamic shared memory one block may use on sm_80/sm_90 parts (227 KiB on the H100/H200).
pub const MAX_SHARED_BYTES: usize = 227 * 1024;

/// What a launch produces.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DtansOut {
    /// y = W·x (f32).
    Mvm,
    /// The source elements (u16 for 16-bit payloads, one code byte otherwise).
    Decode,
    /// BF16 weights (scales/mins applied).
    Dequant,
}

/// Launch tuning: warps (tiles, one 32-row band each) per block, and the resident warps per SM
/// the register allocation must allow (0: no cap; else `__launch_bounds__` caps registers).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DtansConfig {
    pub warps: u32,
    pub min_warps: u32,
    /// Interleaved copies of the decoding table in shared memory (a power of two, at most 128 bytes
    /// of copies per slot; 0: as many as fit in 32 KiB): lane l reads copy l mod rep, which spreads
    /// a warp's random lookups over the banks.
    pub rep: u32,
    /// Quartets per unrolled iteration (2, 4 or 8; 0: 8). Group dequantisation assumes 8.
    pub unroll: u32,
    /// Byte-permute table addressing and a 32-bit test of the accumulator's high word
    /// (about 10 fewer instructions per quartet).
    pub fast: bool,
    /// Bytes per shared-memory table entry (the kernel's `DT_EB`): 16 `{r, d, v0, v1}` (every
    /// payload), 4 (BF16: the codec's entry, one wavefront per warp lookup with 32 copies) or 8
    /// (BF16 Pair: two words with the exponents in place); 0: [`DtansConfig::entry_bytes`]'s default.
    pub entry: u32,
}

impl DtansConfig {
    pub const DEFAULT: DtansConfig = DtansConfig {
        warps: 4,
        min_warps: 0,
        rep: 0,
        unroll: 0,
        fast: false,
        entry: 0,
    };

    pub const fn warps(warps: u32) -> Self {
        DtansConfig {
            warps,
            min_warps: 0,
            rep: 0,
            unroll: 0,
            fast: false,
            entry: 0,
        }
    }

    /// Whether the kernel compiles for `kind` with this unroll (whole companion words and raw
    /// units per iteration), entry size and table copies.
    pub fn fits(&self, kind: &DtansKind) -> bool {
        let uq = if self.unroll == 0 { 8 } else { self.unroll };
        if ![2, 4, 8].contains(&uq) {
            return false;
        }
        let cbits = kind.log2_m as u32 - 8;
        let eb = self.entry_bytes(kind);
        let rep_ok = self.rep == 0 || (self.rep.is_power_of_two() && self.rep * eb <= 128);
        let entry_ok = match self.entry {
            0 | 16 => true,
            4 => kind.bf16,
            8 => kind.bf16 && kind.k == 2,
            _ => false,
        };
        rep_ok
            && entry_ok
            && (uq * 4 * cbits) % 32 == 0
            && (!kind.bf16 || (4 * kind.k * uq) % 16 == 0)
            && (kind.sc / kind.k / 4) % uq == 0
    }

    /// Bytes per shared table entry for `kind`: as configured, else 4 for BF16 Single (fewer
    /// shared-memory wavefronts per lookup: faster on the large Llama-8B launches, H200
    /// 2026-11-30) and 16 otherwise (BF16 Pair: 16 was faster than 4 and 8 on every launch).
    pub fn entry_bytes(&self, kind: &DtansKind) -> u32 {
        match self.entry {
            0 if kind.bf16 && kind.k == 1 => 4,
            0 => 16,
            e => e,
        }
    }

    /// The table copies for `kind`'s table of 2^log2_m entries: as configured, else as many as fit
    /// in 32 KiB up to 128 bytes per slot (32 copies of 4-byte entries: a bank per lane).
    pub fn table_copies(&self, kind: &DtansKind) -> u32 {
        if self.rep != 0 {
            return self.rep;
        }
        let eb = self.entry_bytes(kind);
        (32768u32 / (eb << kind.log2_m)).clamp(1, 128 / eb)
    }
}

impl std::fmt::Display for DtansConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "w{}", self.warps)?;
        if self.min_warps > 0 {
            write!(f, "m{}", self.min_warps)?;
        }
        if self.rep > 0 {
            write!(f, "r{}", self.rep)?;
        }
        if self.unroll > 0 {
            write!(f, "u{}", self.unroll)?;
        }
        if self.fast {
            write!(f, "f")?;
        }
        if self.entry > 0 {
            write!(f, "e{}", self.entry)?;
        }
        Ok(())
    }
}

/// The compile-time shape of a kernel: everything in a tensor's coding the kernel specialises on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DtansKind {
    pub k: u32,
    pub log2_m: u8,
    pub sc: u32,
    pub bf16: bool,
    pub code_bits: u32,
    /// Groups smaller than a slice (compile-time group size), else 0.
    pub small_group: u32,
}

impl DtansKind {
    /// `group`: columns per dequantisation group, if any (a group of at least `cols` is one per row).
    pub fn of(payload: Payload, coding: &Coding, cols: usize, group: Option<usize>) -> Self {
        DtansKind {
            k: coding.mode.values_per_symbol() as u32,
            log2_m: coding.log2_m,
            sc: coding.sc,
            bf16: payload == Payload::Bf16,
            code_bits: payload.code_bits(),
            small_group: match group {
                Some(g) if g < coding.sc as usize && g < cols => g as u32,
                _ => 0,
            },
        }
    }

    fn of_tensor(t: &GpuDtans) -> Self {
        Self::of(
            t.payload,
            &t.coding,
            t.cols,
            t.groups.as_ref().map(|g| g.group),
        )
    }

    pub fn variant(&self, cfg: DtansConfig, out: DtansOut) -> KernelVariant {
        KernelVariant::new(
            &DTANS,
            vec![
                ("DT_K", self.k as i64),
                ("DT_LOG2M", self.log2_m as i64),
                ("DT_SC", self.sc as i64),
                ("DT_WARPS", cfg.warps as i64),
                ("DT_MINW", cfg.min_warps as i64),
                ("DT_REP", cfg.table_copies(self) as i64),
                ("DT_EB", cfg.entry_bytes(self) as i64),
                (
                    "DT_UQ",
                    if cfg.unroll == 0 {
                        8
                    } else {
                        cfg.unroll as i64
                    },
                ),
                ("DT_FAST", cfg.fast as i64),
                ("DT_BF16", self.bf16 as i64),
                ("DT_CB", self.code_bits as i64),
                ("DT_GS", self.small_group as i64),
                (
                    "DT_OUT",
                    match out {
                        DtansOut::Mvm => 0,
                        DtansOut::Decode => 1,
                        DtansOut::Dequant => 2,
                    },
                ),
            ],
        )
    }

    /// Dynamic shared memory of a launch: table, activation slice and group sums (mvm), two 1 KiB
    /// chunk buffers per warp, and (decode/dequant) a warp's staged outputs of one iteration: 32
    /// rows of `DT_SW` bytes plus one store unit of padding (the kernel's `DT_STAGE`).
    pub fn shared_bytes(&self, cfg: DtansConfig, out: DtansOut) -> usize {
        let table =
            ((cfg.entry_bytes(self) as usize) << self.log2_m) * cfg.table_copies(self) as usize;
        let uq = if cfg.unroll == 0 { 8 } else { cfg.unroll } as usize;
        let (act, stage) = match out {
            DtansOut::Mvm => {
                let groups = self.sc.checked_div(self.small_group).unwrap_or(1) as usize;
                (4 * self.sc as usize + 4 * groups.div_ceil(4) * 4, 0)
            }
            DtansOut::Decode | DtansOut::Dequant => {
                let es = if out == DtansOut::Dequant || self.bf16 {
                    2
                } else {
                    1
                };
                let row = 4 * self.k as usize * uq * es;
                (0, 32 * (row + row.min(16)))
            }
        };
        table + act + (2048 + stage) * cfg.warps as usize
    }
}

/// The kernel's `DtMat` (layout must match `kernels/dtans_mvm.cu`).
#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
struct DtMat {
    entries: u64,
    lut: u64,
    tiles: u64,
    stream: u64,
    companion: u64,
    raw: u64,
    scales: u64,
    mins: u64,
    out: u64,
    stream_len: u64,
    rows: i32,
    bands: i32,
    block0: i32,
    offset: f32,
}

/// The kernel's `DtParams`, passed by value.
#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
struct DtParams {
    x: u64,
    err: u64,
    cols: i32,
    slices: i32,
    n_mats: i32,
    group: i32,
    m: [DtMat; MAX_MATS],
}

// SAFETY: plain-old-data with the C layout of the kernel's parameter struct.
unsafe impl DeviceRepr for DtParams {}

/// Checks that `mats` can share one launch: 1..=4 of them, same payload, mode, table size, slice
/// width, columns and group layout.
fn check_launch(op: &'static str, mats: &[&GpuDtans]) -> Result<DtansKind> {
    let first = mats
        .first()
        .ok_or_else(|| GpuError::invalid(op, "no matrices to launch"))?;
    if mats.len() > MAX_MATS {
        return Err(GpuError::invalid(
            op,
            format!("{} matrices in one launch (at most {MAX_MATS})", mats.len()),
        ));
    }
    let kind = DtansKind::of_tensor(first);
    let group = |t: &GpuDtans| t.groups.as_ref().map(|g| g.group);
    for t in &mats[1..] {
        if DtansKind::of_tensor(t) != kind
            || t.payload != first.payload
            || t.cols != first.cols
            || group(t) != group(first)
        {
            return Err(GpuError::invalid(
                op,
                format!(
                    "matrices of one launch must share payload, mode, M, sc, columns and groups: \
                     {:?} {:?} {}×{} vs {:?} {:?} {}×{}",
                    first.payload,
                    first.coding,
                    first.rows,
                    first.cols,
                    t.payload,
                    t.coding,
                    t.rows,
                    t.cols
                ),
            ));
        }
    }
    Ok(kind)
}

#[allow(clippy::too_many_arguments)]
fn launch(
    dev: &GpuDevice,
    op: &'static str,
    cfg: DtansConfig,
    out_kind: DtansOut,
    mats: &[&GpuDtans],
    x: Option<&CudaSlice<f32>>,
    outs: &[u64],
    err: Option<&mut CudaSlice<u32>>,
) -> Result<()> {
    let kind = check_launch(op, mats)?;
    if cfg.warps == 0
        || cfg.warps > 32
        || cfg.min_warps > 64
        || !cfg.fits(&kind)
        || (cfg.unroll != 0 && cfg.unroll != 8 && mats[0].groups.is_some())
    {
        return Err(GpuError::invalid(
            op,
            format!("launch configuration {cfg} does not fit {kind:?}"),
        ));
    }
    let first = mats[0];
    let stream = dev.stream();
    let mut p = DtParams {
        cols: first.cols as i32,
        slices: first.cols.div_ceil(first.coding.sc as usize) as i32,
        n_mats: mats.len() as i32,
        group: first.groups.as_ref().map_or(0, |g| g.group as i32),
        ..Default::default()
    };
    let (x_ptr, _gx) = match x {
        Some(x) => {
            let (p, g) = x.device_ptr(stream);
            (p, Some(g))
        }
        None => (0, None),
    };
    p.x = x_ptr;
    let mut guards = Vec::new();
    let mut blocks = 0usize;
    for (i, t) in mats.iter().enumerate() {
        let bands = t.rows.div_ceil(32);
        let (e, g1) = t.entries.device_ptr(stream);
        let (l, g2) = t.lut.device_ptr(stream);
        let (ti, g3) = t.tiles.device_ptr(stream);
        let (s, g4) = t.stream.device_ptr(stream);
        let (c, g5) = t.companion.device_ptr(stream);
        let (r, g6) = t.raw.device_ptr(stream);
        guards.extend([g1, g2, g3, g4, g5, g6]);
        let (sc, mn) = match &t.groups {
            Some(g) => {
                let (a, ga) = g.scales.device_ptr(stream);
                guards.push(ga);
                let m = match &g.mins {
                    Some(m) => {
                        let (b, gb) = m.device_ptr(stream);
                        guards.push(gb);
                        b
                    }
                    None => 0,
                };
                (a, m)
            }
            None => (0, 0),
        };
        p.m[i] = DtMat {
            entries: e,
            lut: l,
            tiles: ti,
            stream: s,
            companion: c,
            raw: r,
            scales: sc,
            mins: mn,
            out: outs[i],
            stream_len: t.stream_len as u64,
            rows: t.rows as i32,
            bands: bands as i32,
            block0: blocks as i32,
            offset: t.groups.as_ref().map_or(0.0, |g| g.offset),
        };
        blocks += bands.div_ceil(cfg.warps as usize);
    }
    if blocks > i32::MAX as usize || p.slices > 65_535 {
        return Err(GpuError::invalid(
            op,
            format!("grid of {blocks}×{} blocks is too large", p.slices),
        ));
    }
    let (err_ptr, _ge) = match err {
        Some(e) => {
            if e.is_empty() {
                return Err(GpuError::invalid(op, "error word buffer is empty"));
            }
            let (p, g) = e.device_ptr_mut(stream);
            (p, Some(g))
        }
        None => (0, None),
    };
    p.err = err_ptr;
    let variant = kind.variant(cfg, out_kind);
    let f = dev.function(&variant, "dtans_kernel")?;
    let shared = kind.shared_bytes(cfg, out_kind);
    if shared > MAX_SHARED_BYTES {
        return Err(GpuError::invalid(
            op,
            format!(
                "launch configuration {cfg} needs {shared} bytes of shared memory per block \
                 (at most {MAX_SHARED_BYTES}): fewer warps or table copies"
            ),
        ));
    }
    if shared > 48 * 1024 {
        f.set_attribute(
            CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            shared as i32,
        )
        .while_(|| format!("allowing {shared} bytes of shared memory for {op}"))?;
    }
    let lc = LaunchConfig {
        grid_dim: (blocks as u32, p.slices as u32, 1),
        block_dim: (cfg.warps * 32, 1, 1),
        shared_mem_bytes: shared as u32,
    };
    let mut b = stream.launch_builder(&f);
    b.arg(&p);
    // SAFETY: `p` matches the kernel's parameter struct; every pointer is a live device buffer whose
    // size was checked against the tensors' geometry (GpuDtans::upload and the callers).
    unsafe { b.launch(lc) }.while_(|| {
        format!(
            "launching {op} {:?} k{} M2^{} sc{} w{} on {} matrices",
            first.payload,
            kind.k,
            kind.log2_m,
            kind.sc,
            cfg.warps,
            mats.len()
        )
    })?;
    drop(guards);
    Ok(())
}

/// `ys[i][..rows_i] = mats[i] · x` for up to four matrices with the same coding and input, in one
/// launch. `err`, if given, gets 1 OR-ed in when a stream is inconsistent (corrupt data).
pub fn launch_mvm(
    dev: &GpuDevice,
    cfg: DtansConfig,
    mats: &[&GpuDtans],
    x: &CudaSlice<f32>,
    ys: &mut [&mut CudaSlice<f32>],
    err: Option<&mut CudaSlice<u32>>,
) -> Result<()> {
    const OP: &str = "dtans mvm";
    check_launch(OP, mats)?;
    if ys.len() != mats.len() {
        return Err(GpuError::invalid(
            OP,
            format!("{} outputs for {} matrices", ys.len(), mats.len()),
        ));
    }
    super::check_len(OP, "x", x, mats[0].cols)?;
    let slices = mats[0].cols.div_ceil(mats[0].coding.sc as usize);
    let stream = dev.stream();
    let mut outs = Vec::with_capacity(ys.len());
    for (t, y) in mats.iter().zip(ys.iter_mut()) {
        super::check_len(OP, "y", y, t.rows)?;
        if slices > 1 {
            stream
                .memset_zeros(&mut y.slice_mut(0..t.rows))
                .while_(|| "zeroing y".into())?;
        }
        outs.push(y.device_ptr_mut(stream).0);
    }
    launch(dev, OP, cfg, DtansOut::Mvm, mats, Some(x), &outs, err)
}

/// `y[off_i .. off_i + rows_i] = mats[i] · x` with the matrices' outputs stacked in one buffer
/// (`off_i` = the rows before matrix i): q/k/v or [gate; up] stored as separate tensors, in one
/// launch.
pub fn launch_mvm_stacked(
    dev: &GpuDevice,
    cfg: DtansConfig,
    mats: &[&GpuDtans],
    x: &CudaSlice<f32>,
    y: &mut CudaSlice<f32>,
    err: Option<&mut CudaSlice<u32>>,
) -> Result<()> {
    const OP: &str = "dtans mvm (stacked)";
    check_launch(OP, mats)?;
    super::check_len(OP, "x", x, mats[0].cols)?;
    let total: usize = mats.iter().map(|t| t.rows).sum();
    super::check_len(OP, "y", y, total)?;
    let stream = dev.stream();
    if mats[0].cols.div_ceil(mats[0].coding.sc as usize) > 1 {
        stream
            .memset_zeros(&mut y.slice_mut(0..total))
            .while_(|| "zeroing y".into())?;
    }
    let base = y.device_ptr_mut(stream).0;
    let mut outs = Vec::with_capacity(mats.len());
    let mut off = 0u64;
    for t in mats {
        outs.push(base + 4 * off);
        off += t.rows as u64;
    }
    launch(dev, OP, cfg, DtansOut::Mvm, mats, Some(x), &outs, err)
}

/// Materialises `t` as BF16 weights into `out` starting at element `offset` (rows of a stacked
/// matrix), for prefill GEMMs.
pub fn launch_dequant_at(
    dev: &GpuDevice,
    cfg: DtansConfig,
    t: &GpuDtans,
    out: &mut CudaSlice<u16>,
    offset: usize,
    err: Option<&mut CudaSlice<u32>>,
) -> Result<()> {
    const OP: &str = "dtans dequant";
    super::check_len(OP, "out", out, offset + t.rows * t.cols)?;
    let o = out.device_ptr_mut(dev.stream()).0 + 2 * offset as u64;
    launch(dev, OP, cfg, DtansOut::Dequant, &[t], None, &[o], err)
}

/// Decodes `t` into its source elements (`t.decoded_bytes()` bytes: little-endian u16 for 16-bit
/// payloads, one code byte otherwise), row-major.
pub fn launch_decode(
    dev: &GpuDevice,
    cfg: DtansConfig,
    t: &GpuDtans,
    out: &mut CudaSlice<u8>,
    err: Option<&mut CudaSlice<u32>>,
) -> Result<()> {
    const OP: &str = "dtans decode";
    super::check_len(OP, "out", out, t.decoded_bytes())?;
    let o = out.device_ptr_mut(dev.stream()).0;
    launch(dev, OP, cfg, DtansOut::Decode, &[t], None, &[o], err)
}

/// Materialises `t` as BF16 weights [rows × cols] (scales and mins applied), for prefill GEMMs.
pub fn launch_dequant(
    dev: &GpuDevice,
    cfg: DtansConfig,
    t: &GpuDtans,
    out: &mut CudaSlice<u16>,
    err: Option<&mut CudaSlice<u32>>,
) -> Result<()> {
    const OP: &str = "dtans dequant";
    super::check_len(OP, "out", out, t.rows * t.cols)?;
    let o = out.device_ptr_mut(dev.stream()).0;
    launch(dev, OP, cfg, DtansOut::Dequant, &[t], None, &[o], err)
}

/// The BF16 weights the CPU reference gives (`dequant` semantics) for `t` under `dq`.
pub fn dequant_ref(t: &DtansTensor, dq: &Dequant) -> Result<Vec<u16>> {
    let bytes = t
        .decode()
        .map_err(|e| GpuError::invalid("dtans dequant_ref", e.to_string()))?;
    let eb = t.payload.element_bytes();
    Ok((0..t.rows * t.cols)
        .map(|i| {
            let (code, raw) = if eb == 2 {
                t.payload
                    .split_element(u16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]]))
            } else {
                (bytes[i], 0)
            };
            let v = t.payload.to_f32(code, raw);
            if t.payload == Payload::Bf16 && matches!(dq, Dequant::None) {
                return u16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]]);
            }
            let w = dq.apply(t.payload, i / t.cols, i % t.cols, t.cols, v);
            half::bf16::from_f32(w).to_bits()
        })
        .collect())
}

/// Kernel variants the selftest and the tuned Llama-8B launches use (compiled in CI by
/// tools/nvrtc-check).
pub fn builtin_variants() -> Vec<KernelVariant> {
    let mut v = Vec::new();
    let mut add = |kind: DtansKind, warps: DtansConfig, outs: &[DtansOut]| {
        for &out in outs {
            let var = kind.variant(warps, out);
            if !v.contains(&var) {
                v.push(var);
            }
        }
    };
    let all = [DtansOut::Mvm, DtansOut::Decode, DtansOut::Dequant];
    for kind in selftest_kinds() {
        add(kind, DtansConfig::DEFAULT, &all);
        for grouped in [false, true] {
            for cfg in selftest_store_configs(&kind, grouped) {
                add(kind, cfg, &[DtansOut::Decode, DtansOut::Dequant]);
            }
        }
        for cfg in selftest_mvm_configs(&kind) {
            add(kind, cfg, &[DtansOut::Mvm]);
        }
    }
    for (_, _, cols, coding, cfg, _) in crate::bench_coded::tuned_launches() {
        let kind = DtansKind::of(Payload::Bf16, &coding, cols, None);
        add(kind, cfg, &[DtansOut::Mvm]);
        add(
            kind,
            DtansConfig::DEFAULT,
            &[DtansOut::Dequant, DtansOut::Decode],
        );
    }
    v
}

/// Every variant the timing sweep (`tests/dtans_gpu.rs`) launches: the built-in ones, and each
/// bench coding with each fitting [`bench_configs`] entry.
pub fn sweep_variants() -> Vec<KernelVariant> {
    let mut v = builtin_variants();
    for kind in bench_kinds() {
        let cfgs = bench_configs()
            .into_iter()
            .filter(|c| c.fits(&kind))
            .map(|c| (c, DtansOut::Mvm))
            .chain([4, 8].map(|w| (DtansConfig::warps(w), DtansOut::Dequant)));
        for (cfg, out) in cfgs {
            let var = kind.variant(cfg, out);
            if !v.contains(&var) {
                v.push(var);
            }
        }
    }
    v
}

/// Launch configurations the timing sweeps (unroll 4 only where the coding allows it).
pub fn bench_configs() -> Vec<DtansConfig> {
    let mut v = Vec::new();
    for fast in [false, true] {
        for (warps, min_warps, unroll) in [
            (4, 0, 0),
            (8, 0, 0),
            (16, 0, 0),
            (8, 24, 0),
            (8, 0, 4),
            (16, 0, 4),
        ] {
            v.push(DtansConfig {
                warps,
                min_warps,
                rep: 0,
                unroll,
                fast,
                entry: 16,
            });
        }
    }
    v
}

/// Launches the selftest's mvm runs with: for bf16, 1, 4 and 8 warps per block (default entries),
/// 16-byte entries (4 warps, and 8 with `fast`), and the small entries (Pair: 4 and 8 bytes;
/// Single: 4 bytes in 16 copies, two lanes per bank); the default otherwise.
fn selftest_mvm_configs(kind: &DtansKind) -> Vec<DtansConfig> {
    if kind.bf16 {
        let mut v: Vec<DtansConfig> = [1, 4, 8].map(DtansConfig::warps).to_vec();
        v.push(DtansConfig {
            entry: 16,
            ..DtansConfig::warps(4)
        });
        v.push(DtansConfig {
            fast: true,
            entry: 16,
            ..DtansConfig::warps(8)
        });
        v.push(DtansConfig {
            entry: 4,
            rep: if kind.k == 1 && kind.log2_m <= 10 {
                16
            } else {
                0
            },
            ..DtansConfig::warps(8)
        });
        if kind.k == 2 {
            v.push(DtansConfig {
                entry: 8,
                ..DtansConfig::warps(8)
            });
        }
        v
    } else {
        vec![DtansConfig::DEFAULT]
    }
}

/// The entry-size comparison of `dtans_gpu_entry_timing` for a launch whose engine configuration
/// is `base` (its warps, unroll and copies): 16-byte entries (plain and `fast`), the small entries (4 bytes, Pair also 8; Single
/// also 4 bytes in 16 copies) and the default entries with 4, 8 and 16 warps.
pub fn entry_timing_configs(kind: &DtansKind, base: DtansConfig) -> Vec<DtansConfig> {
    let base = DtansConfig {
        fast: false,
        entry: 0,
        ..base
    };
    let mut v = vec![
        DtansConfig { entry: 16, ..base },
        DtansConfig {
            entry: 16,
            fast: true,
            ..base
        },
        DtansConfig { entry: 4, ..base },
    ];
    if kind.k == 2 {
        v.push(DtansConfig { entry: 8, ..base });
    } else {
        v.push(DtansConfig {
            entry: 4,
            rep: 16,
            ..base
        });
    }
    for warps in [4, 8, 16] {
        if warps != base.warps {
            v.push(DtansConfig {
                warps,
                entry: 0,
                ..base
            });
        }
    }
    v.retain(|c| c.fits(kind));
    v
}

/// Launches the selftest's decode and dequant runs with: the default (4 warps, unroll 8; bf16 also
/// with the other entry sizes) and 8 warps with the smallest unroll the kind compiles for (the
/// narrowest staged rows of the transposed stores; matrices with dequant groups run at unroll 8
/// only).
fn selftest_store_configs(kind: &DtansKind, grouped: bool) -> Vec<DtansConfig> {
    let mut v = vec![DtansConfig::DEFAULT];
    if kind.bf16 {
        // The other entry size (bf16 default: Single 4 bytes, Pair 16).
        v.push(DtansConfig {
            entry: if kind.k == 1 { 16 } else { 4 },
            ..DtansConfig::DEFAULT
        });
    }
    let unrolls: &[u32] = if grouped { &[8] } else { &[2, 4] };
    if let Some(cfg) = unrolls
        .iter()
        .map(|&unroll| DtansConfig {
            unroll,
            ..DtansConfig::warps(8)
        })
        .find(|c| c.fits(kind))
    {
        v.push(cfg);
    }
    v
}

/// One selftest coding: payload, coding, dequant group (None: no dequant; usize::MAX: per row).
#[derive(Clone, Copy, Debug)]
struct Case {
    payload: Payload,
    mode: Mode,
    log2_m: u8,
    sc: u32,
    t: Option<u16>,
    group: Option<usize>,
    mins: bool,
    signed: bool,
}

fn selftest_cases() -> Vec<Case> {
    let mut v = Vec::new();
    let bf = |mode, log2_m, sc, t| Case {
        payload: Payload::Bf16,
        mode,
        log2_m,
        sc,
        t,
        group: None,
        mins: false,
        signed: false,
    };
    for log2_m in [8u8, 9, 10, 12] {
        let cap = match log2_m {
            8 => 16,
            9 => 22,
            10 => 32,
            _ => 64,
        };
        v.push(bf(Mode::Pair, log2_m, 2048, Some(cap)));
        v.push(bf(Mode::Pair, log2_m, 64, Some(cap / 2)));
        v.push(bf(Mode::Single, log2_m, 512, None));
    }
    v.push(bf(Mode::Single, 8, 64, Some(6))); // many escapes
    v.push(bf(Mode::Pair, 8, 256, Some(8)));
    v.push(bf(Mode::Pair, 8, 512, Some(16)));
    v.push(bf(Mode::Pair, 8, 1024, Some(16)));
    let int = |bits, mode, log2_m, sc, group, mins, signed| Case {
        payload: Payload::Int(bits),
        mode,
        log2_m,
        sc,
        t: None,
        group: Some(group),
        mins,
        signed,
    };
    v.push(int(4, Mode::Pair, 8, 2048, 32, true, false)); // Q4_1-like
    v.push(int(4, Mode::Pair, 9, 256, 64, true, false));
    v.push(int(4, Mode::Pair, 10, 512, 128, false, true));
    v.push(int(8, Mode::Single, 8, 1024, 32, false, true)); // Q8_0-like
    v.push(int(8, Mode::Single, 10, 256, 256, false, true));
    v.push(int(3, Mode::Single, 8, 128, usize::MAX, true, false));
    v.push(Case {
        payload: Payload::Fp8E4m3,
        mode: Mode::Single,
        log2_m: 8,
        sc: 1024,
        t: None,
        group: Some(usize::MAX),
        mins: false,
        signed: false,
    });
    v.push(Case {
        payload: Payload::Fp8E4m3,
        mode: Mode::Pair,
        log2_m: 12,
        sc: 512,
        t: Some(40),
        group: Some(usize::MAX),
        mins: false,
        signed: false,
    });
    v.push(Case {
        payload: Payload::Fp8E4m3,
        mode: Mode::Single,
        log2_m: 9,
        sc: 128,
        t: Some(20),
        group: None,
        mins: false,
        signed: false,
    });
    v
}

fn case_kind(c: &Case, cols: usize) -> DtansKind {
    let coding = Coding {
        mode: c.mode,
        log2_m: c.log2_m,
        sc: c.sc,
        t: c.t,
    };
    DtansKind::of(
        c.payload,
        &coding,
        cols,
        c.group.map(|g| if g == usize::MAX { cols } else { g }),
    )
}

fn selftest_kinds() -> Vec<DtansKind> {
    let mut v: Vec<DtansKind> = Vec::new();
    for c in selftest_cases() {
        // Per-row groups are never smaller than a slice in the selftest shapes' kernels.
        let k = case_kind(&c, usize::MAX / 2);
        if !v.contains(&k) {
            v.push(k);
        }
    }
    v
}

/// The BF16 codings the timing sweeps (`bench_coded::bench_codings`).
pub fn bench_kinds() -> Vec<DtansKind> {
    crate::bench_coded::BENCH_SLICE_WIDTHS
        .into_iter()
        .flat_map(crate::bench_coded::bench_codings)
        .map(|c| DtansKind::of(Payload::Bf16, &c, 4096, None))
        .collect()
}

/// Model-like codes for a payload: BF16 ~ N(0, 0.02) with a few extremes; ints from a peaked
/// distribution; FP8 from N(0, 1) scaled into range.
fn random_elements(rng: &mut Rng, payload: Payload, n: usize) -> Vec<u8> {
    match payload {
        Payload::Bf16 => {
            let mut out = Vec::with_capacity(2 * n);
            for i in 0..n {
                let v = match rng.below(1000) {
                    0 => 0.0,
                    1 => rng.normal() * 40.0,
                    2 => rng.normal() * 1e-6,
                    _ => rng.normal() * 0.02,
                };
                let bits = if i % 4099 == 7 {
                    0x8000 // -0.0
                } else {
                    half::bf16::from_f32(v).to_bits()
                };
                out.extend_from_slice(&bits.to_le_bytes());
            }
            out
        }
        Payload::Int(bits) => {
            let top = (1u32 << bits) as f32;
            (0..n)
                .map(|_| {
                    let v = (rng.normal() * top / 6.0 + top / 2.0).round();
                    v.clamp(0.0, top - 1.0) as u8
                })
                .collect()
        }
        Payload::Fp8E4m3 => (0..n)
            .map(|_| entrollm_codec::payload::f32_to_fp8_e4m3(rng.normal() * 4.0))
            .collect(),
        _ => (0..n)
            .map(|_| rng.below(payload.alphabet() as u64) as u8)
            .collect(),
    }
}

struct DtansChecker<'a> {
    dev: &'a GpuDevice,
    rng: Rng,
    cases: Vec<CaseResult>,
    err: CudaSlice<u32>,
}

impl DtansChecker<'_> {
    fn record(&mut self, kernel: String, shape: String, rel: f64, tolerance: f64) {
        self.cases.push(CaseResult {
            kernel,
            shape,
            rel_l2: rel,
            tolerance,
        });
    }

    fn err_word(&mut self) -> Result<u32> {
        let e = download(self.dev, &self.err)?[0];
        self.dev
            .stream()
            .memset_zeros(&mut self.err)
            .while_(|| "clearing the error word".into())?;
        Ok(e)
    }

    /// A coded random matrix and its dequant arrays.
    fn make(
        &mut self,
        c: &Case,
        rows: usize,
        cols: usize,
    ) -> Result<(DtansTensor, Vec<f32>, Option<Vec<f32>>)> {
        let bytes = random_elements(&mut self.rng, c.payload, rows * cols);
        let (codes, raw) = c
            .payload
            .symbolize(&bytes)
            .map_err(|e| GpuError::invalid("dtans selftest", e.to_string()))?;
        let coding = Coding {
            mode: c.mode,
            log2_m: c.log2_m,
            sc: c.sc,
            t: c.t,
        };
        let t = DtansTensor::encode(c.payload, rows, cols, &codes, &raw, coding)
            .map_err(|e| GpuError::invalid("dtans selftest", e.to_string()))?;
        let (scales, mins) = match c.group {
            None => (Vec::new(), None),
            Some(g) => {
                let g = if g == usize::MAX { cols } else { g };
                let n = rows * cols.div_ceil(g);
                let s: Vec<f32> = (0..n)
                    .map(|_| 0.01 + self.rng.unit() as f32 * 0.02)
                    .collect();
                let m = c
                    .mins
                    .then(|| (0..n).map(|_| self.rng.normal() * 0.05).collect());
                (s, m)
            }
        };
        Ok((t, scales, mins))
    }

    fn case(&mut self, c: Case, shapes: &[(usize, usize)]) -> Result<()> {
        let label = format!(
            "{:?} {:?} M2^{} sc{} t{:?}{}",
            c.payload,
            c.mode,
            c.log2_m,
            c.sc,
            c.t,
            match c.group {
                None => String::new(),
                Some(usize::MAX) => " g=row".into(),
                Some(g) => format!(" g{g}{}", if c.mins { "+min" } else { "" }),
            }
        );
        // Three matrices with the same coding and columns but different rows/tables: one launch.
        for &(rows, cols) in shapes {
            let mut ts = Vec::new();
            for r in [rows, rows / 2 + 1, 33] {
                ts.push(self.make(&c, r, cols)?);
            }
            let dqs: Vec<Dequant> = ts
                .iter()
                .map(|(_, s, m)| match c.group {
                    None => Dequant::None,
                    Some(g) => Dequant::Groups {
                        group: if g == usize::MAX { cols } else { g },
                        scales: s,
                        mins: m.as_deref(),
                        offset: if c.signed { 0.0 } else { 8.0 },
                        signed: c.signed,
                    },
                })
                .collect();
            let gpu: Vec<GpuDtans> = ts
                .iter()
                .zip(&dqs)
                .map(|((t, _, _), dq)| GpuDtans::upload(self.dev, t, dq))
                .collect::<Result<_>>()?;
            let shape = |t: &DtansTensor| {
                format!(
                    "{label} {}×{} ({:.2} b/w)",
                    t.rows,
                    t.cols,
                    t.bits_per_weight()
                )
            };
            // decode and dequant, bit-exact, on the first matrix (outputs poisoned first).
            let (t0, g0) = (&ts[0].0, &gpu[0]);
            let want = t0
                .decode()
                .map_err(|e| GpuError::invalid("dtans selftest", e.to_string()))?;
            let want_dq = dequant_ref(t0, &dqs[0])?;
            for cfg in selftest_store_configs(&DtansKind::of_tensor(g0), g0.groups.is_some()) {
                let mut out = upload(self.dev, &vec![0xA5u8; want.len()])?;
                launch_decode(self.dev, cfg, g0, &mut out, Some(&mut self.err))?;
                let got = download(self.dev, &out)?;
                let bad = got.iter().zip(&want).filter(|(a, b)| a != b).count();
                let e = self.err_word()?;
                self.record(
                    format!("dtans decode {cfg}"),
                    format!("{} err {e}", shape(t0)),
                    if e == 0 { bad as f64 } else { f64::INFINITY },
                    0.0,
                );
                let mut out = upload(self.dev, &vec![0x7FC1u16; want_dq.len()])?;
                launch_dequant(self.dev, cfg, g0, &mut out, Some(&mut self.err))?;
                let got = download(self.dev, &out)?;
                let bad = got.iter().zip(&want_dq).filter(|(a, b)| a != b).count();
                let e = self.err_word()?;
                self.record(
                    format!("dtans dequant {cfg}"),
                    format!("{} err {e}", shape(t0)),
                    if e == 0 { bad as f64 } else { f64::INFINITY },
                    0.0,
                );
            }
            // mvm of all three in one launch, with each warp count.
            let x = self.rng.normals(cols, 1.0);
            let x_d = upload(self.dev, &x)?;
            // Per row Σ|w·x|: the scale of f32 summation error (rows whose terms cancel are held to
            // what their terms allow, not to their small sum).
            let mags: Vec<Vec<f64>> = ts
                .iter()
                .zip(&dqs)
                .map(|((t, _, _), dq)| {
                    Ok(dequant_ref(t, dq)?
                        .chunks(t.cols)
                        .map(|row| {
                            row.iter()
                                .zip(&x)
                                .map(|(&w, &v)| (super::bf16_to_f32(w) as f64 * v as f64).abs())
                                .sum()
                        })
                        .collect())
                })
                .collect::<Result<_>>()?;
            for cfg in selftest_mvm_configs(&DtansKind::of_tensor(g0)) {
                let mut ys: Vec<CudaSlice<f32>> = ts
                    .iter()
                    .map(|(t, _, _)| upload(self.dev, &vec![f32::NAN; t.rows]))
                    .collect::<Result<_>>()?;
                {
                    let mut yr: Vec<&mut CudaSlice<f32>> = ys.iter_mut().collect();
                    let mats: Vec<&GpuDtans> = gpu.iter().collect();
                    launch_mvm(self.dev, cfg, &mats, &x_d, &mut yr, Some(&mut self.err))?;
                }
                let e = self.err_word()?;
                for ((((t, _, _), dq), y), mag) in ts.iter().zip(&dqs).zip(&ys).zip(&mags) {
                    let got = download(self.dev, y)?;
                    let mut want = vec![0f32; t.rows];
                    t.matvec(&x, &mut want, dq)
                        .map_err(|e| GpuError::invalid("dtans selftest", e.to_string()))?;
                    let rel = if e == 0 && got.len() == want.len() {
                        let err: f64 = got
                            .iter()
                            .zip(&want)
                            .map(|(&g, &w)| (g as f64 - w as f64).powi(2))
                            .sum();
                        let scale: f64 = mag.iter().map(|m| m * m).sum();
                        (err / scale.max(f64::MIN_POSITIVE)).sqrt()
                    } else {
                        f64::INFINITY
                    };
                    self.record(
                        format!("dtans mvm {cfg}"),
                        format!("{} err {e}", shape(t)),
                        rel,
                        1e-5,
                    );
                }
            }
        }
        Ok(())
    }
}

/// Every compiled kind on fresh random matrices of ragged and regular shapes: decode and dequant
/// bit-exact against the codec's CPU decoder, mvm (three matrices per launch, 1/4/8 warps per
/// block) within 1e-5 of the codec's f64 matvec in L2 relative to ‖Σ|w·x|‖ over rows (the scale of
/// f32 summation error: a 1×100 row whose terms cancel measured 2.8e-5 relative to its own small
/// sum on the H200), and no error flag.
pub fn selftest(dev: &GpuDevice, seed: u64) -> Result<SelftestReport> {
    let mut c = DtansChecker {
        dev,
        rng: Rng::new(seed),
        cases: Vec::new(),
        err: upload(dev, &[0u32])?,
    };
    for case in selftest_cases() {
        let sc = case.sc as usize;
        // Ragged: a last slice of 8 columns, rows not a multiple of 32, rows whose BF16 start is
        // not 16-byte aligned (sc + 3: transposed stores element by element), one short row.
        let shapes = [
            (70, sc * 2 + 8),
            (129, 3 * sc),
            (45, sc + 3),
            (1, 100),
            (300, 4096),
        ];
        for &(rows, cols) in &shapes {
            if let Some(g) = case.group.filter(|&g| g != usize::MAX) {
                if g > cols
                    || crate::coded::check_group(
                        &Coding {
                            mode: case.mode,
                            log2_m: case.log2_m,
                            sc: case.sc,
                            t: case.t,
                        },
                        cols,
                        g,
                    )
                    .is_err()
                {
                    continue;
                }
            }
            c.case(case, &[(rows, cols)])?;
        }
    }
    let report = SelftestReport {
        device: format!("{} ({})", dev.info().name, dev.info().arch()),
        cases: c.cases,
    };
    if report.failures().next().is_some() {
        return Err(GpuError::Selftest(report.to_string()));
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn params_layout_matches_the_kernel() {
        assert_eq!(std::mem::size_of::<DtMat>(), 96);
        assert_eq!(std::mem::size_of::<DtParams>(), 32 + 4 * 96);
        assert_eq!(std::mem::align_of::<DtParams>(), 8);
    }

    #[test]
    fn variants_are_distinct_and_named() {
        let v = builtin_variants();
        let names: std::collections::HashSet<_> =
            v.iter().map(|v| v.cache_file_name("sm_90")).collect();
        assert_eq!(names.len(), v.len());
        assert!(v.len() >= 20);
    }

    #[test]
    fn shared_memory_fits_the_device() {
        for k in selftest_kinds().into_iter().chain(bench_kinds()) {
            for out in [DtansOut::Mvm, DtansOut::Decode, DtansOut::Dequant] {
                let b = k.shared_bytes(DtansConfig::warps(8), out);
                assert!(b <= 227 * 1024, "{k:?} {out:?}: {b}");
            }
        }
    }

    #[test]
    fn entry_sizes_follow_the_payload() {
        let kind = |bf16, k, log2_m| DtansKind {
            k,
            log2_m,
            sc: 1024,
            bf16,
            code_bits: 8,
            small_group: 0,
        };
        let (single, pair, int) = (kind(true, 1, 8), kind(true, 2, 8), kind(false, 2, 8));
        let d = DtansConfig::DEFAULT;
        for (k, eb, copies) in [(single, 4, 32), (pair, 16, 8), (int, 16, 8)] {
            assert_eq!(d.entry_bytes(&k), eb);
            assert_eq!(d.table_copies(&k), copies);
            assert_eq!(
                k.shared_bytes(d, DtansOut::Mvm),
                32768 + 4 * 1024 + 16 + 2048 * 4
            );
            assert!(d.fits(&k));
        }
        assert_eq!(d.table_copies(&kind(true, 1, 12)), 2);
        assert!(!DtansConfig { entry: 4, ..d }.fits(&int));
        assert!(!DtansConfig { entry: 8, ..d }.fits(&single));
        assert!(!DtansConfig { entry: 5, ..d }.fits(&pair));
        assert!(!DtansConfig {
            entry: 16,
            rep: 16,
            ..d
        }
        .fits(&pair));
        assert!(!DtansConfig {
            entry: 4,
            rep: 3,
            ..d
        }
        .fits(&pair));
        assert!(DtansConfig {
            entry: 4,
            rep: 32,
            ..d
        }
        .fits(&pair));
    }

    #[test]
    fn dequant_ref_of_bf16_is_the_elements() {
        let mut rng = Rng::new(3);
        let bytes = random_elements(&mut rng, Payload::Bf16, 64 * 70);
        let (codes, raw) = Payload::Bf16.symbolize(&bytes).unwrap();
        let coding = Coding {
            mode: Mode::Pair,
            log2_m: 8,
            sc: 64,
            t: Some(16),
        };
        let t = DtansTensor::encode(Payload::Bf16, 64, 70, &codes, &raw, coding).unwrap();
        let d = dequant_ref(&t, &Dequant::None).unwrap();
        let want: Vec<u16> = bytes
            .chunks(2)
            .map(|c| u16::from_le_bytes([c[0], c[1]]))
            .collect();
        assert_eq!(d, want);
    }
}
