//! Tensor-parallel addressing (Megatron-style), shaped for NCCL: which slice of every weight and
//! of the KV one rank of `world` holds, and where the forward's all-reduces go.
//!
//! ```text
//!  column-parallel (split output features)     row-parallel (split input features)
//!  q, k, v: the rank's heads' rows             o_proj: the columns of the rank's heads
//!  gate, up: rows r·I/w .. (r+1)·I/w           down: the same columns of the intermediate
//!  KV pool: the rank's KV heads                then: x += all_reduce(Σ partials)
//! ```
//!
//! A row-parallel GEMM writes each rank's partial; rank 0 folds the residual into its epilogue
//! (`Out::Add`), the others overwrite (`Out::Set`), and a sum all-reduce of `x` leaves every rank
//! with `x + Σ partials`: the unsharded layer. The embedding, norms and LM head are replicated.
//!
//! Today a forward runs one rank of one ([`Shard::SINGLE`], [`SingleRank`]): every range is the
//! whole matrix and no all-reduce is issued, so the GPU runs exactly the unsharded layer. A
//! multi-GPU build adds a [`Collective`] over NCCL (cudarc's `nccl`, the design's "nccl-rs") and
//! passes each rank its [`Shard`]; nothing else changes. [`HostAllReduce`] runs several ranks in
//! one process (one GPU or more) with the sum staged through host memory: slow, but it checks
//! the sharding on the device against the unsharded forward without NCCL (engine/tests/cuda.rs).
//!
//! # Invariants
//! - `world` divides the attention heads, the KV heads and the intermediate size (checked by
//!   [`Shard::new`], before anything is uploaded).
//! - A rank's q heads are the ones whose KV heads it holds (grouped-query attention stays local).

use std::ops::Range;
use std::sync::{Arc, Barrier, Mutex};

use cudarc::driver::CudaSlice;
use tandem_kernels_cuda::{CudaError, Out};

use crate::config::ModelConfig;
use crate::error::EngineError;

/// One rank of a tensor-parallel group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shard {
    /// This rank, `0..world`.
    pub rank: usize,
    /// Ranks in the group.
    pub world: usize,
}

impl Shard {
    /// The whole model on one GPU.
    pub const SINGLE: Shard = Shard { rank: 0, world: 1 };

    /// Rank `rank` of `world` for model `c`; refused when `world` does not divide its heads,
    /// KV heads and intermediate size, naming the numbers.
    pub fn new(rank: usize, world: usize, c: &ModelConfig) -> Result<Shard, EngineError> {
        let bad = |reason: String| EngineError::InvalidConfig {
            field: "tensor_parallel",
            value: format!("rank {rank} of {world}"),
            reason,
        };
        if world == 0 || rank >= world {
            return Err(bad("the rank must be below the group size, which must be at least 1".into()));
        }
        for (what, n) in [
            ("attention heads", c.num_attention_heads),
            ("KV heads", c.kv_heads()),
            ("intermediate size", c.intermediate_size),
        ] {
            if !n.is_multiple_of(world) {
                return Err(bad(format!("{world} does not divide the model's {n} {what}")));
            }
        }
        Ok(Shard { rank, world })
    }

    fn part(&self, n: usize) -> Range<usize> {
        let per = n / self.world;
        self.rank * per..(self.rank + 1) * per
    }

    /// Query heads this rank computes.
    pub fn heads(&self, c: &ModelConfig) -> usize {
        c.num_attention_heads / self.world
    }

    /// KV heads this rank holds (its KV pool's `num_kv_heads`).
    pub fn kv_heads(&self, c: &ModelConfig) -> usize {
        c.kv_heads() / self.world
    }

    /// Intermediate (MLP) features this rank computes.
    pub fn inter(&self, c: &ModelConfig) -> usize {
        c.intermediate_size / self.world
    }

    /// Rows of the fused `[q; k; v]` matrix this rank holds, as `[q, k, v]` row ranges.
    pub fn qkv_rows(&self, c: &ModelConfig) -> [Range<usize>; 3] {
        let hd = c.head_dim();
        let (q_w, kv_w) = (c.num_attention_heads * hd, c.kv_heads() * hd);
        let q = self.part(q_w);
        let k = self.part(kv_w);
        [q, q_w + k.start..q_w + k.end, q_w + kv_w + k.start..q_w + kv_w + k.end]
    }

    /// Rows of the fused `[gate; up]` matrix this rank holds, as `[gate, up]` row ranges.
    pub fn gate_up_rows(&self, c: &ModelConfig) -> [Range<usize>; 2] {
        let i = c.intermediate_size;
        let p = self.part(i);
        [p.clone(), i + p.start..i + p.end]
    }

    /// Columns of the O projection this rank holds (its heads' outputs).
    pub fn o_cols(&self, c: &ModelConfig) -> Range<usize> {
        self.part(c.num_attention_heads * c.head_dim())
    }

    /// Columns of the down projection this rank holds (its intermediate features).
    pub fn down_cols(&self, c: &ModelConfig) -> Range<usize> {
        self.part(c.intermediate_size)
    }

    /// How this rank's row-parallel GEMMs write `x`: rank 0 adds its partial to the residual,
    /// the others write theirs for the all-reduce to sum.
    pub fn row_parallel_out(&self) -> Out {
        if self.rank == 0 { Out::Add } else { Out::Set }
    }
}

/// The group's collectives on the device (the forward's one: a sum all-reduce of `x`).
pub trait Collective: Send {
    /// This rank's place in the group.
    fn shard(&self) -> Shard;

    /// `buf = Σ over ranks of buf`, queued on the device's stream.
    fn all_reduce_sum(&self, buf: &mut CudaSlice<f32>) -> Result<(), CudaError>;

    /// True when the all-reduce can be captured into a CUDA graph (NCCL's can; one staged
    /// through the host cannot, and decode then runs without graphs).
    fn capturable(&self) -> bool;
}

/// A group of one: the sum over one rank is the buffer itself.
#[derive(Clone, Copy, Debug, Default)]
pub struct SingleRank;

impl Collective for SingleRank {
    fn shard(&self) -> Shard {
        Shard::SINGLE
    }

    fn all_reduce_sum(&self, _buf: &mut CudaSlice<f32>) -> Result<(), CudaError> {
        Ok(())
    }

    fn capturable(&self) -> bool {
        true
    }
}

/// A sum all-reduce among ranks in one process, staged through host memory (each rank on its
/// own thread; a call blocks until every rank of the group made it). For checking the sharding
/// without NCCL, not for serving.
pub struct HostAllReduce {
    shard: Shard,
    group: Arc<HostGroup>,
}

struct HostGroup {
    sum: Mutex<Vec<f32>>,
    barrier: Barrier,
}

impl HostAllReduce {
    /// One member per rank of a group of `world`.
    pub fn group(world: usize) -> Vec<HostAllReduce> {
        let group = Arc::new(HostGroup { sum: Mutex::new(Vec::new()), barrier: Barrier::new(world) });
        (0..world)
            .map(|rank| HostAllReduce { shard: Shard { rank, world }, group: Arc::clone(&group) })
            .collect()
    }
}

impl Collective for HostAllReduce {
    fn shard(&self) -> Shard {
        self.shard
    }

    fn all_reduce_sum(&self, buf: &mut CudaSlice<f32>) -> Result<(), CudaError> {
        let stream = Arc::clone(buf.stream());
        let sync = |s: &Arc<cudarc::driver::CudaStream>| s.synchronize().map_err(|e| CudaError::driver("cuStreamSynchronize", e));
        let mut host = stream.clone_dtoh(buf).map_err(|e| CudaError::driver("cuMemcpyDtoH (all-reduce)", e))?;
        sync(&stream)?;
        let g = &self.group;
        {
            let mut sum = g.sum.lock().expect("all-reduce poisoned");
            if sum.len() < host.len() {
                sum.resize(host.len(), 0.0);
            }
            for (s, v) in sum.iter_mut().zip(&host) {
                *s += v;
            }
        }
        g.barrier.wait(); // every rank has added
        let n = host.len();
        host.copy_from_slice(&g.sum.lock().expect("all-reduce poisoned")[..n]);
        if g.barrier.wait().is_leader() {
            g.sum.lock().expect("all-reduce poisoned").fill(0.0);
        }
        g.barrier.wait(); // zeroed before anyone adds again
        stream.memcpy_htod(&host, buf).map_err(|e| CudaError::driver("cuMemcpyHtoD (all-reduce)", e))?;
        sync(&stream)
    }

    fn capturable(&self) -> bool {
        false
    }
}

/// Rows `ranges` (concatenated, in order) and columns `cols` of a row-major `[rows × cols_all]`
/// matrix: a rank's slice of a weight, on the host before upload.
pub fn slice_matrix<T: Copy>(m: &[T], cols_all: usize, ranges: &[Range<usize>], cols: Range<usize>) -> Vec<T> {
    let mut out = Vec::with_capacity(ranges.iter().map(|r| r.len()).sum::<usize>() * cols.len());
    for r in ranges {
        for row in r.clone() {
            out.extend_from_slice(&m[row * cols_all + cols.start..row * cols_all + cols.end]);
        }
    }
    out
}

/// A one-layer config of `heads` × `hd` with `kv_heads` and `inter` MLP features (unit tests).
#[cfg(test)]
pub(super) fn tiny_config(heads: usize, kv_heads: usize, hd: usize, inter: usize) -> ModelConfig {
    ModelConfig {
        hidden_size: heads * hd,
        intermediate_size: inter,
        num_hidden_layers: 1,
        num_attention_heads: heads,
        num_key_value_heads: Some(kv_heads),
        head_dim: Some(hd),
        vocab_size: 10,
        rope_theta: 1e4,
        rms_norm_eps: 1e-5,
        max_position_embeddings: 64,
        tie_word_embeddings: true,
        bos_token_id: None,
        eos_token_id: vec![],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `y[m × n] = x[m × k] · Wᵀ` for a row-major `W` `[n × k]`, in f64.
    fn matmul(x: &[f64], m: usize, w: &[f64], n: usize, k: usize) -> Vec<f64> {
        let mut y = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                y[i * n + j] = (0..k).map(|t| x[i * k + t] * w[j * k + t]).sum();
            }
        }
        y
    }

    fn values(n: usize, seed: u64) -> Vec<f64> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((s >> 11) as f64 / (1u64 << 53) as f64) * 2.0 - 1.0
            })
            .collect()
    }

    #[test]
    fn one_rank_holds_every_row_and_column() {
        let c = tiny_config(9, 3, 8, 48);
        let s = Shard::new(0, 1, &c).unwrap();
        assert_eq!(s, Shard::SINGLE);
        let (q_w, kv_w) = (9 * 8, 3 * 8);
        assert_eq!(s.qkv_rows(&c), [0..q_w, q_w..q_w + kv_w, q_w + kv_w..q_w + 2 * kv_w]);
        assert_eq!(s.gate_up_rows(&c), [0..48, 48..96]);
        assert_eq!((s.o_cols(&c), s.down_cols(&c)), (0..q_w, 0..48));
        assert_eq!((s.heads(&c), s.kv_heads(&c), s.inter(&c)), (9, 3, 48));
        assert_eq!(s.row_parallel_out(), Out::Add);
    }

    /// The addressing is the unsharded layer: column-parallel slices reassemble the full
    /// projection (each rank's q heads beside its own KV heads), and the row-parallel partials,
    /// with the residual added once, sum to the full residual update.
    #[test]
    fn sharded_projections_reassemble_the_unsharded_layer() {
        let (heads, kv_heads, hd, inter, m) = (6, 2, 4, 12, 3);
        let c = tiny_config(heads, kv_heads, hd, inter);
        let (h, q_w, kv_w) = (c.hidden_size, heads * hd, kv_heads * hd);
        let qkv = values((q_w + 2 * kv_w) * h, 1);
        let o = values(h * q_w, 2);
        let gate_up = values(2 * inter * h, 3);
        let down = values(h * inter, 4);
        let x = values(m * h, 5);
        let attn = values(m * q_w, 6);
        let act = values(m * inter, 7);
        let resid = values(m * h, 8);
        let full_qkv = matmul(&x, m, &qkv, q_w + 2 * kv_w, h);
        let full_gu = matmul(&x, m, &gate_up, 2 * inter, h);
        let full_o = matmul(&attn, m, &o, h, q_w);
        let full_down = matmul(&act, m, &down, h, inter);
        for world in [1, 2] {
            // The all-reduce: the sum over ranks of each rank's x.
            let mut o_sum = vec![0.0; m * h];
            let mut down_sum = vec![0.0; m * h];
            for rank in 0..world {
                let s = Shard::new(rank, world, &c).unwrap();
                // Column-parallel: the rank's rows give exactly those output features.
                let rows = s.qkv_rows(&c);
                let w = slice_matrix(&qkv, h, &rows, 0..h);
                let y = matmul(&x, m, &w, w.len() / h, h);
                let want_cols: Vec<usize> = rows.iter().flat_map(|r| r.clone()).collect();
                for i in 0..m {
                    for (j, &col) in want_cols.iter().enumerate() {
                        assert!((y[i * want_cols.len() + j] - full_qkv[i * (q_w + 2 * kv_w) + col]).abs() < 1e-12);
                    }
                }
                // GQA stays local: the rank's q heads map to its own KV heads.
                let (qh, kvh) = (s.heads(&c), s.kv_heads(&c));
                for local_q in 0..qh {
                    let global_q = rank * qh + local_q;
                    let global_kv = global_q / (heads / kv_heads);
                    assert_eq!(global_kv / kvh, rank, "q head {global_q} reads KV head {global_kv}");
                }
                let gu_rows = s.gate_up_rows(&c);
                let w = slice_matrix(&gate_up, h, &gu_rows, 0..h);
                let y = matmul(&x, m, &w, 2 * s.inter(&c), h);
                let gu_cols: Vec<usize> = gu_rows.iter().flat_map(|r| r.clone()).collect();
                for i in 0..m {
                    for (j, &col) in gu_cols.iter().enumerate() {
                        assert!((y[i * gu_cols.len() + j] - full_gu[i * 2 * inter + col]).abs() < 1e-12);
                    }
                }
                // Row-parallel: the rank's columns times its slice of the input.
                for (wm, input, k_all, cols, sum) in [
                    (&o, &attn, q_w, s.o_cols(&c), &mut o_sum),
                    (&down, &act, inter, s.down_cols(&c), &mut down_sum),
                ] {
                    let w = slice_matrix(wm, k_all, &[0..h], cols.clone());
                    let xin = slice_matrix(input, k_all, &[0..m], cols.clone());
                    let part = matmul(&xin, m, &w, h, cols.len());
                    // What this rank's x holds before the all-reduce: rank 0 the residual plus
                    // its partial (Out::Add), the others their partial alone (Out::Set).
                    let mine: Vec<f64> = match s.row_parallel_out() {
                        Out::Add => resid.iter().zip(&part).map(|(r, p)| r + p).collect(),
                        Out::Set => part,
                    };
                    for (acc, v) in sum.iter_mut().zip(mine) {
                        *acc += v;
                    }
                }
            }
            for i in 0..m * h {
                assert!((o_sum[i] - (resid[i] + full_o[i])).abs() < 1e-12);
                assert!((down_sum[i] - (resid[i] + full_down[i])).abs() < 1e-12);
            }
        }
    }

    #[test]
    fn a_group_size_that_does_not_divide_the_model_is_refused_naming_the_numbers() {
        let c = tiny_config(9, 3, 8, 48);
        let e = Shard::new(0, 2, &c).unwrap_err().to_string();
        assert!(e.contains("9 attention heads") && e.contains("rank 0 of 2"), "{e}");
        assert!(Shard::new(1, 1, &c).is_err());
        assert!(Shard::new(0, 0, &c).is_err());
        assert_eq!(Shard::new(2, 3, &c).unwrap().qkv_rows(&c)[0], 48..72);
    }
}
