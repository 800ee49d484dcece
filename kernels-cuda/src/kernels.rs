//! [`CudaKernels`]: every kernel of [`crate::SOURCES`] loaded on one device, with one typed
//! launch wrapper per kernel.
//!
//! Each wrapper checks the buffer lengths and shapes it is given against each other (a
//! [`CudaError::Shape`] names the argument), takes its launch shape from [`crate::launch`], and
//! queues the kernel on the device's stream. Nothing is synchronised: results are visible to
//! later work on the same stream, and to the host after [`CudaDevice::synchronize`] or a copy.
//!
//! What the wrappers cannot check, because the values live on the device: positions below the
//! RoPE table's length, slots inside the pool, block ids inside the pool, token ids inside the
//! vocabulary, context lengths within the block tables. The kernels skip (RoPE/KV write) or zero
//! (embedding) out-of-range entries rather than touch memory outside their buffers; the engine
//! validates them on the host, where it builds them.

use crate::SOURCES;
use crate::buffers::{DecodeWorkspace, DeviceKvPool, DeviceRopeTable, SampleRow};
use crate::device::CudaDevice;
use crate::error::{CudaError, check_len};
use crate::launch::{self, DecodePlan};
use crate::ptx::PtxCache;
use cudarc::driver::sys::CUfunction_attribute_enum;
use cudarc::driver::{
    CudaFunction, CudaSlice, CudaStream, DeviceRepr, LaunchConfig, PushKernelArg,
};
use std::collections::HashMap;
use std::sync::Arc;
use tandem_kv_layout::{KvDtype, KvLayout};

/// Every kernel of the crate, loaded on one device.
#[derive(Debug)]
pub struct CudaKernels {
    functions: HashMap<&'static str, CudaFunction>,
    stream: Arc<CudaStream>,
    sm_count: usize,
}

fn to_i32(op: &'static str, what: &'static str, v: usize) -> Result<i32, CudaError> {
    i32::try_from(v).map_err(|_| CudaError::Shape {
        op,
        what,
        expected: i32::MAX as usize,
        got: v,
    })
}

/// A dimension that must be at least 1.
fn check_nonzero(op: &'static str, what: &'static str, v: usize) -> Result<(), CudaError> {
    if v == 0 {
        return Err(CudaError::Shape { op, what, expected: 1, got: 0 });
    }
    Ok(())
}

/// The rows of `logits` (`vocab` > 0 and a whole number of rows, else a shape error).
fn logit_rows(op: &'static str, logits: &CudaSlice<f32>, vocab: usize) -> Result<usize, CudaError> {
    check_nonzero(op, "vocab", vocab)?;
    check_len(op, "logits (a multiple of vocab)", logits.len().next_multiple_of(vocab), logits.len())?;
    Ok(logits.len() / vocab)
}

fn check_grid_yz(op: &'static str, what: &'static str, v: usize) -> Result<(), CudaError> {
    if v > launch::MAX_GRID_YZ {
        return Err(CudaError::Shape {
            op,
            what,
            expected: launch::MAX_GRID_YZ,
            got: v,
        });
    }
    Ok(())
}

fn check_heads(op: &'static str, n_heads: usize, layout: &KvLayout) -> Result<(), CudaError> {
    if n_heads == 0 || !n_heads.is_multiple_of(layout.num_kv_heads) {
        return Err(CudaError::Shape {
            op,
            what: "n_heads (a multiple of kv_heads)",
            expected: n_heads
                .next_multiple_of(layout.num_kv_heads)
                .max(layout.num_kv_heads),
            got: n_heads,
        });
    }
    if layout.head_dim > launch::MAX_HEAD_DIM {
        return Err(CudaError::Unsupported {
            op,
            what: format!(
                "head_dim {} (max {})",
                layout.head_dim,
                launch::MAX_HEAD_DIM
            ),
        });
    }
    Ok(())
}

impl CudaKernels {
    /// Compiles (or reads from `cache`) every source for `dev`'s arch and loads it.
    pub fn load(dev: &CudaDevice, cache: &PtxCache) -> Result<CudaKernels, CudaError> {
        let sm_count = dev
            .context()
            .attribute(
                cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            )
            .map_err(|e| CudaError::driver("cuDeviceGetAttribute(multiprocessor count)", e))?
            .max(1) as usize;
        let mut functions = HashMap::new();
        for src in SOURCES {
            let (compiled, outcome) =
                cache.get_or_compile(src.name, &src.full_text(), dev.arch())?;
            tracing::debug!(source = src.name, ?outcome, "CUDA source ready");
            let module = dev
                .context()
                .load_module(cudarc::nvrtc::Ptx::from_src(compiled.ptx))
                .map_err(|e| CudaError::driver("cuModuleLoadData", e))?;
            for &name in src.functions {
                let f = module
                    .load_function(name)
                    .map_err(|e| CudaError::driver("cuModuleGetFunction", e))?;
                if name.starts_with("paged_attn_prefill") {
                    f.set_attribute(
                        CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                        launch::prefill_smem_bytes(launch::MAX_HEAD_DIM) as i32,
                    )
                    .map_err(|e| {
                        CudaError::driver("cuFuncSetAttribute(max dynamic shared memory)", e)
                    })?;
                }
                functions.insert(name, f);
            }
        }
        Ok(CudaKernels {
            functions,
            stream: dev.stream().clone(),
            sm_count,
        })
    }

    /// Multiprocessors of the device (decode splits aim at two blocks each).
    pub fn sm_count(&self) -> usize {
        self.sm_count
    }

    fn f(&self, name: &'static str) -> &CudaFunction {
        self.functions
            .get(name)
            .unwrap_or_else(|| panic!("kernel `{name}` is listed in SOURCES and was loaded"))
    }

    /// `out = rms_norm(x) * w` over rows of `w.len()`.
    pub fn rms_norm(
        &self,
        x: &CudaSlice<f32>,
        w: &CudaSlice<f32>,
        eps: f32,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        const OP: &str = "rms_norm";
        let n = w.len();
        check_nonzero(OP, "weight length", n)?;
        check_len(
            OP,
            "x (a multiple of weight.len())",
            x.len().next_multiple_of(n),
            x.len(),
        )?;
        check_len(OP, "out", x.len(), out.len())?;
        let rows = x.len() / n;
        if rows == 0 {
            return Ok(());
        }
        let n32 = to_i32(OP, "n", n)?;
        let mut b = self.stream.launch_builder(self.f("rms_norm_f32"));
        b.arg(x).arg(w).arg(out).arg(&n32).arg(&eps);
        launch(OP, &mut b, launch::rms_norm(rows, n))
    }

    /// `out = silu(gate) * up`, `gate_up` rows `[gate (inter) | up (inter)]`.
    pub fn silu_mul(
        &self,
        gate_up: &CudaSlice<f32>,
        m: usize,
        inter: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        const OP: &str = "silu_mul";
        check_len(OP, "gate_up (m * 2 * inter)", m * 2 * inter, gate_up.len())?;
        check_len(OP, "out (m * inter)", m * inter, out.len())?;
        if m * inter == 0 {
            return Ok(());
        }
        let (m32, i32_) = (to_i32(OP, "m", m)?, to_i32(OP, "inter", inter)?);
        let mut b = self.stream.launch_builder(self.f("silu_mul_f32"));
        b.arg(gate_up).arg(out).arg(&m32).arg(&i32_);
        launch(OP, &mut b, launch::elementwise(m * inter))
    }

    /// `a += b`.
    pub fn add_inplace(
        &self,
        a: &mut CudaSlice<f32>,
        b_: &CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        const OP: &str = "add_inplace";
        check_len(OP, "b", a.len(), b_.len())?;
        if a.is_empty() {
            return Ok(());
        }
        let n = a.len() as i64;
        let cfg = launch::elementwise(a.len());
        let mut b = self.stream.launch_builder(self.f("add_inplace_f32"));
        b.arg(a).arg(b_).arg(&n);
        launch(OP, &mut b, cfg)
    }

    /// `out[r] = argmax(logits[r])` for rows of `vocab` (lowest index on ties, NaN never wins).
    pub fn argmax(
        &self,
        logits: &CudaSlice<f32>,
        vocab: usize,
        out: &mut CudaSlice<i32>,
    ) -> Result<(), CudaError> {
        const OP: &str = "argmax";
        let rows = logit_rows(OP, logits, vocab)?;
        check_len(OP, "out (rows)", rows, out.len())?;
        if rows == 0 {
            return Ok(());
        }
        let v32 = to_i32(OP, "vocab", vocab)?;
        let mut b = self.stream.launch_builder(self.f("argmax_f32"));
        b.arg(logits).arg(out).arg(&v32);
        launch(OP, &mut b, launch::argmax(rows, vocab))
    }

    /// `out[r]` = the token row `r` of `logits` samples with `specs[r]`: exactly
    /// tandem-kernels `sample::sample` (greedy rows: the argmax).
    pub fn sample(
        &self,
        logits: &CudaSlice<f32>,
        vocab: usize,
        specs: &CudaSlice<SampleRow>,
        out: &mut CudaSlice<i32>,
    ) -> Result<(), CudaError> {
        const OP: &str = "sample";
        let rows = logit_rows(OP, logits, vocab)?;
        check_len(OP, "specs (rows)", rows, specs.len())?;
        check_len(OP, "out (rows)", rows, out.len())?;
        if rows == 0 {
            return Ok(());
        }
        let v32 = to_i32(OP, "vocab", vocab)?;
        let shift = tandem_kernels::sample::weight_shift(vocab) as i32;
        let mut b = self.stream.launch_builder(self.f("sample_rows"));
        b.arg(logits).arg(specs).arg(&v32).arg(&shift).arg(out);
        launch(OP, &mut b, launch::sample(rows, vocab))
    }

    /// `out[t] = table[ids[t]]` (f32 table `[vocab × hidden]`).
    pub fn embed_f32(
        &self,
        ids: &CudaSlice<i32>,
        table: &CudaSlice<f32>,
        hidden: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        self.embed("embed_f32", ids, table, hidden, out)
    }

    /// `out[t] = f32(table[ids[t]])` (bf16 table as u16 bits, `[vocab × hidden]`).
    pub fn embed_bf16(
        &self,
        ids: &CudaSlice<i32>,
        table: &CudaSlice<u16>,
        hidden: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        self.embed("embed_bf16", ids, table, hidden, out)
    }

    fn embed<T>(
        &self,
        name: &'static str,
        ids: &CudaSlice<i32>,
        table: &CudaSlice<T>,
        hidden: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        check_nonzero(name, "hidden", hidden)?;
        check_len(
            name,
            "table (a multiple of hidden)",
            table.len().next_multiple_of(hidden),
            table.len(),
        )?;
        check_len(name, "out (tokens * hidden)", ids.len() * hidden, out.len())?;
        if ids.is_empty() {
            return Ok(());
        }
        let (t32, h32, v32) = (
            to_i32(name, "tokens", ids.len())?,
            to_i32(name, "hidden", hidden)?,
            to_i32(name, "vocab", table.len() / hidden)?,
        );
        let mut b = self.stream.launch_builder(self.f(name));
        b.arg(ids).arg(table).arg(out).arg(&t32).arg(&h32).arg(&v32);
        launch(name, &mut b, launch::elementwise(ids.len() * hidden))
    }

    /// bf16 bits of `x` (round to nearest even).
    pub fn f32_to_bf16(&self, x: &CudaSlice<f32>, out: &mut CudaSlice<u16>) -> Result<(), CudaError> {
        self.convert("f32_to_bf16", x, out)
    }

    /// f32 values of bf16 bits `x`.
    pub fn bf16_to_f32(&self, x: &CudaSlice<u16>, out: &mut CudaSlice<f32>) -> Result<(), CudaError> {
        self.convert("bf16_to_f32", x, out)
    }

    /// An elementwise conversion kernel `name(x, out, n)` over equal-length buffers.
    fn convert<A: DeviceRepr, B: DeviceRepr>(
        &self,
        name: &'static str,
        x: &CudaSlice<A>,
        out: &mut CudaSlice<B>,
    ) -> Result<(), CudaError> {
        check_len(name, "out", x.len(), out.len())?;
        if x.is_empty() {
            return Ok(());
        }
        let n = x.len() as i64;
        let mut b = self.stream.launch_builder(self.f(name));
        b.arg(x).arg(out).arg(&n);
        launch(name, &mut b, launch::elementwise(x.len()))
    }

    /// RoPE on `q` (`[T × n_heads × hd]`, in place) and `k`, then `k` (rotated) and `v`
    /// (`[T × kv_heads × hd]`) written to `slots` of `layer` (`slots[t] = block * bs + offset`).
    #[allow(clippy::too_many_arguments)]
    pub fn rope_write_kv(
        &self,
        q: &mut CudaSlice<f32>,
        k: &CudaSlice<f32>,
        v: &CudaSlice<f32>,
        n_heads: usize,
        rope: &DeviceRopeTable,
        positions: &CudaSlice<i32>,
        slots: &CudaSlice<i64>,
        pool: &mut DeviceKvPool,
        layer: usize,
    ) -> Result<(), CudaError> {
        const OP: &str = "rope_write_kv";
        let g = pool.check(OP, layer)?;
        let l = pool.layout;
        let t = positions.len();
        check_len(OP, "head_dim (rope table)", l.head_dim, rope.head_dim)?;
        check_len(OP, "slots (T)", t, slots.len())?;
        check_len(
            OP,
            "q (T * n_heads * head_dim)",
            t * n_heads * l.head_dim,
            q.len(),
        )?;
        check_len(
            OP,
            "k (T * kv_heads * head_dim)",
            t * l.num_kv_heads * l.head_dim,
            k.len(),
        )?;
        check_len(
            OP,
            "v (T * kv_heads * head_dim)",
            t * l.num_kv_heads * l.head_dim,
            v.len(),
        )?;
        if t == 0 {
            return Ok(());
        }
        let (nh, maxp) = (
            to_i32(OP, "n_heads", n_heads)?,
            to_i32(OP, "max_positions", rope.max_positions)?,
        );
        to_i32(OP, "tokens", t)?;
        let name = match l.dtype {
            KvDtype::F32 => "rope_write_kv_f32",
            KvDtype::F16 => "rope_write_kv_f16",
            _ => "rope_write_kv_bf16",
        };
        let cfg = launch::rope_write_kv(t, n_heads, l.num_kv_heads, l.head_dim);
        let mut b = self.stream.launch_builder(self.f(name));
        b.arg(q)
            .arg(k)
            .arg(v)
            .arg(&rope.cos)
            .arg(&rope.sin)
            .arg(positions)
            .arg(slots)
            .arg(&mut *pool.bytes)
            .arg(&g)
            .arg(&nh)
            .arg(&maxp);
        launch(OP, &mut b, cfg)
    }

    /// Decode attention, one query per sequence: `q`, `out` `[num_seqs × n_heads × hd]`;
    /// `block_tables` `[num_seqs × max_blocks]`; `ctx_lens[i]` = tokens sequence `i` attends
    /// to (its position + 1), at most `max_ctx`. Returns the split used.
    #[allow(clippy::too_many_arguments)]
    pub fn paged_attn_decode(
        &self,
        q: &CudaSlice<f32>,
        n_heads: usize,
        pool: &DeviceKvPool,
        layer: usize,
        block_tables: &CudaSlice<u32>,
        max_blocks: usize,
        ctx_lens: &CudaSlice<i32>,
        max_ctx: usize,
        scale: f32,
        ws: &mut DecodeWorkspace,
        out: &mut CudaSlice<f32>,
    ) -> Result<DecodePlan, CudaError> {
        const OP: &str = "paged_attn_decode";
        let g = pool.check(OP, layer)?;
        let l = pool.layout;
        check_heads(OP, n_heads, &l)?;
        let num_seqs = ctx_lens.len();
        let hd = l.head_dim;
        check_len(
            OP,
            "q (num_seqs * n_heads * head_dim)",
            num_seqs * n_heads * hd,
            q.len(),
        )?;
        check_len(OP, "out", q.len(), out.len())?;
        check_len(
            OP,
            "block_tables (num_seqs * max_blocks)",
            num_seqs * max_blocks,
            block_tables.len(),
        )?;
        if max_ctx > max_blocks * l.block_size_tokens {
            return Err(CudaError::Shape {
                op: OP,
                what: "max_ctx (<= max_blocks * block_size)",
                expected: max_blocks * l.block_size_tokens,
                got: max_ctx,
            });
        }
        if num_seqs > ws.max_seqs || n_heads != ws.n_heads || hd != ws.head_dim {
            return Err(CudaError::Shape {
                op: OP,
                what: "workspace (max_seqs, n_heads, head_dim) too small",
                expected: num_seqs * n_heads * hd,
                got: ws.max_seqs * ws.n_heads * ws.head_dim,
            });
        }
        check_grid_yz(OP, "num_seqs", num_seqs)?;
        let plan = launch::decode_plan(
            max_ctx,
            l.block_size_tokens,
            num_seqs,
            n_heads,
            self.sm_count,
            ws.max_splits,
        );
        if num_seqs == 0 {
            return Ok(plan);
        }
        let (nh, mb, bps, ns) = (
            to_i32(OP, "n_heads", n_heads)?,
            to_i32(OP, "max_blocks", max_blocks)?,
            to_i32(OP, "blocks_per_split", plan.blocks_per_split)?,
            to_i32(OP, "num_splits", plan.num_splits)?,
        );
        let hd32 = hd as i32;
        let name = match l.dtype {
            KvDtype::F32 => "paged_attn_decode_f32",
            KvDtype::F16 => "paged_attn_decode_f16",
            _ => "paged_attn_decode_bf16",
        };
        let mut b = self.stream.launch_builder(self.f(name));
        b.arg(q)
            .arg(&mut ws.part_acc)
            .arg(&mut ws.part_ml)
            .arg(&*pool.bytes)
            .arg(&g)
            .arg(block_tables)
            .arg(&mb)
            .arg(ctx_lens)
            .arg(&nh)
            .arg(&scale)
            .arg(&bps);
        launch(OP, &mut b, launch::decode(plan, num_seqs, n_heads))?;
        let mut b = self
            .stream
            .launch_builder(self.f("paged_attn_decode_reduce"));
        b.arg(&ws.part_acc)
            .arg(&ws.part_ml)
            .arg(out)
            .arg(&nh)
            .arg(&hd32)
            .arg(&ns);
        launch(
            "paged_attn_decode_reduce",
            &mut b,
            launch::decode_reduce(num_seqs, n_heads, hd),
        )?;
        Ok(plan)
    }

    /// Prefill attention over query chunks: sequence `i` has `q_lens[i]` queries in rows
    /// `q_rows[i]..` of `q` / `out` (`[rows × n_heads × hd]`) at positions `first_pos[i] + j`,
    /// attending causally to the pool through row `i` of `block_tables` (`[num_seqs ×
    /// max_blocks]`). `max_q_len` ≥ every `q_lens[i]` (it sizes the grid).
    #[allow(clippy::too_many_arguments)]
    pub fn paged_attn_prefill(
        &self,
        q: &CudaSlice<f32>,
        n_heads: usize,
        pool: &DeviceKvPool,
        layer: usize,
        block_tables: &CudaSlice<u32>,
        max_blocks: usize,
        q_rows: &CudaSlice<i32>,
        q_lens: &CudaSlice<i32>,
        first_pos: &CudaSlice<i32>,
        max_q_len: usize,
        scale: f32,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        const OP: &str = "paged_attn_prefill";
        let g = pool.check(OP, layer)?;
        let l = pool.layout;
        check_heads(OP, n_heads, &l)?;
        let num_seqs = q_lens.len();
        let row = n_heads * l.head_dim;
        check_len(
            OP,
            "q (a multiple of n_heads * head_dim)",
            q.len().next_multiple_of(row),
            q.len(),
        )?;
        check_len(OP, "out", q.len(), out.len())?;
        check_len(OP, "q_rows (num_seqs)", num_seqs, q_rows.len())?;
        check_len(OP, "first_pos (num_seqs)", num_seqs, first_pos.len())?;
        check_len(
            OP,
            "block_tables (num_seqs * max_blocks)",
            num_seqs * max_blocks,
            block_tables.len(),
        )?;
        check_grid_yz(OP, "num_seqs", num_seqs)?;
        check_grid_yz(OP, "n_heads", n_heads)?;
        if num_seqs == 0 || max_q_len == 0 {
            return Ok(());
        }
        let (nh, mb) = (
            to_i32(OP, "n_heads", n_heads)?,
            to_i32(OP, "max_blocks", max_blocks)?,
        );
        let name = match l.dtype {
            KvDtype::F32 => "paged_attn_prefill_f32",
            KvDtype::F16 => "paged_attn_prefill_f16",
            _ => "paged_attn_prefill_bf16",
        };
        let mut b = self.stream.launch_builder(self.f(name));
        b.arg(q)
            .arg(out)
            .arg(&*pool.bytes)
            .arg(&g)
            .arg(block_tables)
            .arg(&mb)
            .arg(q_rows)
            .arg(q_lens)
            .arg(first_pos)
            .arg(&nh)
            .arg(&scale);
        launch(
            OP,
            &mut b,
            launch::prefill(max_q_len, n_heads, num_seqs, l.head_dim),
        )
    }
}

/// Queues a built launch, mapping the driver's error.
fn launch(
    op: &'static str,
    b: &mut cudarc::driver::LaunchArgs<'_>,
    cfg: LaunchConfig,
) -> Result<(), CudaError> {
    // SAFETY: every wrapper passes the kernel's arguments in its declared order and types, with
    // buffer lengths checked against the shapes the kernel indexes by; the grid comes from
    // `launch`, which the kernels' bounds checks (`i < n`, `j0 >= qlen`) are written for.
    unsafe { b.launch(cfg) }
        .map(|_| ())
        .map_err(|e| CudaError::driver(op, e))
}

