//! The model's weights on the device: every matrix uploaded once, row-major `[out × in]` (the
//! host `Weight`'s panels unpacked), in the dtype the host holds (f32 for the exactness check,
//! bf16 for serving; `--dtype auto` on CUDA loads bf16, see `EngineArgs::load_dtype`). Norm
//! weights are f32. One dtype for all matrices: the forward converts each GEMM input once.
//!
//! Upload cost: each matrix is widened row by row on the host (on every core), converted, and
//! copied; the host copy of one matrix at a time is the peak extra host memory.
//!
//! A tensor-parallel rank uploads only its [`Shard`]'s slice of each layer: the rows of its
//! heads and intermediate features of the column-parallel matrices (`[q; k; v]`, `[gate; up]`),
//! the matching columns of the row-parallel ones (O, down). One rank of one uploads everything,
//! as is.

use cudarc::driver::{CudaSlice, CudaView, DeviceRepr};
use tandem_kernels::{Weight, WeightDtype};
use tandem_kernels_cuda::{CudaDevice, CudaError};

use super::shard::{Shard, slice_matrix};
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

    /// Uploads `shard`'s slice of `w`; fails before allocating anything when a matrix's dtype
    /// has no GPU path.
    pub fn upload(dev: &CudaDevice, w: &ModelWeights, shard: Shard) -> Result<DevWeights, EngineError> {
        let c = &w.config;
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
                let all_rows = |m: &Weight| [0..m.rows()];
                Ok(DevLayer {
                    attn_norm: dev.upload(&l.attn_norm)?,
                    qkv: part(dev, &l.qkv, &shard.qkv_rows(c), 0..l.qkv.cols())?,
                    o_proj: part(dev, &l.o_proj, &all_rows(&l.o_proj), shard.o_cols(c))?,
                    mlp_norm: dev.upload(&l.mlp_norm)?,
                    gate_up: part(dev, &l.gate_up, &shard.gate_up_rows(c), 0..l.gate_up.cols())?,
                    down: part(dev, &l.down, &all_rows(&l.down), shard.down_cols(c))?,
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

/// Rows `rows` (concatenated) and columns `cols` of `w` on the device: a rank's slice, or
/// (every row and column) the matrix itself.
fn part(dev: &CudaDevice, w: &Weight, rows: &[std::ops::Range<usize>], cols: std::ops::Range<usize>) -> Result<DevMatrix, CudaError> {
    let whole = rows.len() == 1 && rows[0] == (0..w.rows()) && cols == (0..w.cols());
    if whole {
        return matrix(dev, w);
    }
    let n: usize = rows.iter().map(|r| r.len()).sum();
    let elems = match w.dtype() {
        WeightDtype::F32 => DevElems::F32(upload(dev, slice_matrix(&unpack(w, |v| v), w.cols(), rows, cols.clone()))?),
        _ => DevElems::Bf16(upload(
            dev,
            slice_matrix(&unpack(w, |v| half::bf16::from_f32(v).to_bits()), w.cols(), rows, cols.clone()),
        )?),
    };
    Ok(DevMatrix { rows: n, cols: cols.len(), elems })
}

fn matrix(dev: &CudaDevice, w: &Weight) -> Result<DevMatrix, CudaError> {
    let elems = match w.dtype() {
        WeightDtype::F32 => DevElems::F32(upload(dev, unpack(w, |v| v))?),
        // The host holds bf16: widening was exact, so narrowing again is too.
        _ => DevElems::Bf16(upload(dev, unpack(w, |v| half::bf16::from_f32(v).to_bits()))?),
    };
    Ok(DevMatrix { rows: w.rows(), cols: w.cols(), elems })
}
