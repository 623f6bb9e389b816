//! A launch's parts in one of the coded GPU forms that keep them apart on the device (ggml blocks,
//! integer codes, lossy tiles): row-stacked, gate/up as `halves`, with the shared scratch their
//! fused products and prefill copies use. What those forms share, once.

use super::{check_scratch, fused_product, workspace_matmul};
use crate::device::GpuDevice;
use crate::error::{GpuError, Result};
use crate::linear::{DtansScratch, SharedScratch};
use crate::ops::forward::GemvFusion;
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};
use std::sync::{Arc, MutexGuard};

/// One part on the device, as its form uploaded it.
pub(crate) trait Part: Sized {
    fn rows(&self) -> usize;
    fn cols(&self) -> usize;
    /// Bytes a batch-1 product reads.
    fn stored_bytes(&self) -> usize;
    /// Bytes of device memory allocated for it.
    fn device_bytes(&self) -> usize;
    /// A device copy.
    fn duplicate(&self, dev: &GpuDevice) -> Result<Self>;
}

/// [`Part`] for a device type whose fields `rows` and `cols` and inherent `stored_bytes`,
/// `device_bytes` and `duplicate` say it.
macro_rules! part {
    ($t:ty) => {
        impl $crate::forms::stacked::Part for $t {
            fn rows(&self) -> usize {
                self.rows
            }
            fn cols(&self) -> usize {
                self.cols
            }
            fn stored_bytes(&self) -> usize {
                <$t>::stored_bytes(self)
            }
            fn device_bytes(&self) -> usize {
                <$t>::device_bytes(self)
            }
            fn duplicate(&self, dev: &$crate::device::GpuDevice) -> $crate::error::Result<Self> {
                <$t>::duplicate(self, dev)
            }
        }
    };
}
pub(crate) use part;

/// Row-stacked parts with the shared scratch.
pub(crate) struct Stacked<P> {
    pub parts: Vec<P>,
    pub halves: bool,
    pub scratch: SharedScratch,
}

impl<P: Part> Stacked<P> {
    /// `experts`: the parts are stacks of this many experts, whose products (and prefill's
    /// copies) are an expert's at a time, so the scratch needs one expert's shape (1: none).
    /// `what` names the form in errors.
    pub fn new(
        what: &'static str,
        parts: Vec<P>,
        halves: bool,
        scratch: SharedScratch,
        experts: usize,
    ) -> Result<Self> {
        let first = parts
            .first()
            .ok_or_else(|| GpuError::invalid(what, "no parts"))?;
        let rows = parts.iter().map(P::rows).sum::<usize>() / experts.max(1);
        check_scratch(what, &scratch, (rows, first.cols()))?;
        Ok(Stacked {
            parts,
            halves,
            scratch,
        })
    }

    pub fn rows(&self) -> usize {
        self.parts.iter().map(P::rows).sum()
    }

    pub fn cols(&self) -> usize {
        self.parts[0].cols()
    }

    pub fn stored_bytes(&self) -> usize {
        self.parts.iter().map(P::stored_bytes).sum()
    }

    pub fn device_bytes(&self) -> usize {
        self.parts.iter().map(P::device_bytes).sum()
    }

    pub fn lock(&self) -> MutexGuard<'_, DtansScratch> {
        self.scratch.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A device copy of every part, the same scratch.
    pub fn duplicate(&self, dev: &GpuDevice) -> Result<Self> {
        Ok(Stacked {
            parts: self
                .parts
                .iter()
                .map(|p| p.duplicate(dev))
                .collect::<Result<Vec<_>>>()?,
            halves: self.halves,
            scratch: Arc::clone(&self.scratch),
        })
    }

    /// `f(part, first row)` for each part, in order.
    pub fn each_at_row(&self, mut f: impl FnMut(&P, usize) -> Result<()>) -> Result<()> {
        let mut at = 0;
        for p in &self.parts {
            f(p, at)?;
            at += p.rows();
        }
        Ok(())
    }

    /// The batch-1 product with the decode step's fusions ([`fused_product`]), the parts' own
    /// products given by `product(input, y, error word)`.
    #[allow(clippy::too_many_arguments)]
    pub fn fused(
        &self,
        dev: &GpuDevice,
        what: &'static str,
        x: &CudaSlice<f32>,
        norm: Option<(&CudaSlice<f32>, f32)>,
        fusion: GemvFusion,
        y: &mut CudaSlice<f32>,
        product: impl FnOnce(&CudaSlice<f32>, &mut CudaSlice<f32>, &mut CudaSlice<u32>) -> Result<()>,
    ) -> Result<()> {
        let shape = (self.rows(), self.cols());
        let mut guard = self.lock();
        fused_product(
            dev,
            what,
            &mut guard,
            shape,
            self.halves,
            x,
            norm,
            fusion,
            y,
            product,
        )
    }

    /// Prefill through a BF16 copy in the workspace ([`workspace_matmul`]): `copy(part, scratch,
    /// first weight)` writes each part's weights at its offset.
    #[allow(clippy::too_many_arguments)]
    pub fn matmul(
        &self,
        what: &'static str,
        gemm: &crate::gemm::Gemm,
        x: &impl DevicePtr<u16>,
        y: &mut impl DevicePtrMut<f32>,
        m: usize,
        accumulate: bool,
        mut copy: impl FnMut(&P, &mut DtansScratch, usize) -> Result<()>,
    ) -> Result<()> {
        let shape = (self.rows(), self.cols());
        workspace_matmul(what, &self.scratch, shape, gemm, x, y, m, accumulate, |s| {
            let mut at = 0;
            for p in &self.parts {
                copy(p, s, at)?;
                at += p.rows() * p.cols();
            }
            Ok(())
        })
    }
}
