//! The model's weights on the device: every matrix uploaded once, row-major `[out × in]` (the
//! host `Weight`'s panels unpacked), in the dtype the host holds (f32 for the exactness check,
//! bf16 for serving; `--dtype auto` on CUDA loads bf16, see `EngineArgs::load_dtype`). Norm
//! weights are f32. One dtype for all matrices: the forward converts each GEMM input once.
//!
//! Upload cost: each matrix is widened row by row on the host (on every core), converted, and
//! copied; the host copy of one matrix at a time is the peak extra host memory.

use cudarc::driver::{CudaSlice, CudaView, DeviceRepr};
use tandem_kernels::{Weight, WeightDtype};
use tandem_kernels_cuda::{CudaDevice, CudaError};

use crate::error::EngineError;
use crate::loader::ModelWeights;

/// A matrix's elements on the device.
pub(super) enum DevElems {
    /// f32 values.
    F32(CudaSlice<f32>),
    /// bf16 bits.
    Bf16(CudaSlice<u16>),
}

/// One `[rows × cols]` row-major matrix on the device.
pub(super) struct DevMatrix {
    pub rows: usize,
    pub cols: usize,
    pub elems: DevElems,
}

impl DevMatrix {
    /// Rows `r0..r1` (a view; rows are contiguous), as f32.
    pub fn rows_f32(&self, r0: usize, r1: usize) -> Option<CudaView<'_, f32>> {
        match &self.elems {
            DevElems::F32(s) => Some(s.slice(r0 * self.cols..r1 * self.cols)),
            DevElems::Bf16(_) => None,
        }
    }

    /// Rows `r0..r1` as bf16 bits.
    pub fn rows_bf16(&self, r0: usize, r1: usize) -> Option<CudaView<'_, u16>> {
        match &self.elems {
            DevElems::Bf16(s) => Some(s.slice(r0 * self.cols..r1 * self.cols)),
            DevElems::F32(_) => None,
        }
    }
}

/// One decoder layer on the device.
pub(super) struct DevLayer {
    pub attn_norm: CudaSlice<f32>,
    pub qkv: DevMatrix,
    pub o_proj: DevMatrix,
    pub mlp_norm: CudaSlice<f32>,
    pub gate_up: DevMatrix,
    pub down: DevMatrix,
}

/// Every weight of the model on the device.
pub(super) struct DevWeights {
    /// The matrices' dtype (f32 or bf16).
    pub dtype: WeightDtype,
    pub embed: DevMatrix,
    pub layers: Vec<DevLayer>,
    pub final_norm: CudaSlice<f32>,
    /// `None` when tied to the embedding.
    pub lm_head: Option<DevMatrix>,
}

impl DevWeights {
    /// The LM head (the embedding when tied).
    pub fn head(&self) -> &DevMatrix {
        self.lm_head.as_ref().unwrap_or(&self.embed)
    }

    /// Uploads `w`; fails before allocating anything when a matrix's dtype has no GPU path.
    pub fn upload(dev: &CudaDevice, w: &ModelWeights) -> Result<DevWeights, EngineError> {
        let dtype = w.embed.dtype();
        if !matches!(dtype, WeightDtype::F32 | WeightDtype::Bf16) {
            return Err(EngineError::InvalidConfig {
                field: "dtype",
                value: dtype.as_str().to_string(),
                reason: "no GPU kernel for these weights on CUDA: load with --dtype bf16 (or auto), or f32".into(),
            });
        }
        let mats = w.layers.iter().flat_map(|l| [&l.qkv, &l.o_proj, &l.gate_up, &l.down]);
        if let Some(m) = mats.chain(w.lm_head.as_ref()).find(|m| m.dtype() != dtype) {
            return Err(EngineError::InvalidConfig {
                field: "dtype",
                value: m.dtype().as_str().to_string(),
                reason: format!(
                    "CUDA runs every matrix in one dtype, and this model mixes {} and {}: load with --dtype bf16 or f32",
                    dtype.as_str(),
                    m.dtype().as_str()
                ),
            });
        }
        let layers = w
            .layers
            .iter()
            .map(|l| {
                Ok(DevLayer {
                    attn_norm: dev.upload(&l.attn_norm)?,
                    qkv: matrix(dev, &l.qkv)?,
                    o_proj: matrix(dev, &l.o_proj)?,
                    mlp_norm: dev.upload(&l.mlp_norm)?,
                    gate_up: matrix(dev, &l.gate_up)?,
                    down: matrix(dev, &l.down)?,
                })
            })
            .collect::<Result<Vec<_>, CudaError>>()?;
        Ok(DevWeights {
            dtype,
            embed: matrix(dev, &w.embed)?,
            layers,
            final_norm: dev.upload(&w.final_norm)?,
            lm_head: w.lm_head.as_ref().map(|h| matrix(dev, h)).transpose()?,
        })
    }
}

/// `w` unpacked to row-major elements (`conv` of each exactly widened f32), rows spread over
/// the machine's cores.
fn unpack<T: Copy + Default + Send>(w: &Weight, conv: impl Fn(f32) -> T + Sync) -> Vec<T> {
    let (rows, cols) = (w.rows(), w.cols());
    let mut out = vec![T::default(); rows * cols];
    if cols == 0 {
        return out;
    }
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(rows.max(1));
    let rows_per = rows.div_ceil(threads).max(1);
    std::thread::scope(|s| {
        for (ci, chunk) in out.chunks_mut(rows_per * cols).enumerate() {
            let conv = &conv;
            s.spawn(move || {
                let mut row = vec![0f32; cols];
                for (i, dst) in chunk.chunks_mut(cols).enumerate() {
                    w.row_to_f32(ci * rows_per + i, &mut row);
                    for (d, &v) in dst.iter_mut().zip(&row) {
                        *d = conv(v);
                    }
                }
            });
        }
    });
    out
}

fn upload<T: DeviceRepr + cudarc::driver::ValidAsZeroBits>(dev: &CudaDevice, host: Vec<T>) -> Result<CudaSlice<T>, CudaError> {
    dev.upload(&host)
}

fn matrix(dev: &CudaDevice, w: &Weight) -> Result<DevMatrix, CudaError> {
    let elems = match w.dtype() {
        WeightDtype::F32 => DevElems::F32(upload(dev, unpack(w, |v| v))?),
        // The host holds bf16: widening was exact, so narrowing again is too.
        _ => DevElems::Bf16(upload(dev, unpack(w, |v| half::bf16::from_f32(v).to_bits()))?),
    };
    Ok(DevMatrix { rows: w.rows(), cols: w.cols(), elems })
}
