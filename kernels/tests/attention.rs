//! Paged attention against the f64 oracle for every KV dtype, and its bitwise invariances:
//! batch composition, chunked prefill, thread count and ISA.

use crate::common;
use common::*;
use tandem_kernels::{
    AttnSeq, Exec, KernelError, KvCacheMut, KvCacheRef, KvDtype, KvLayout, paged_attention_on,
    reference, write_kv,
};

const DTYPES: [KvDtype; 4] = [KvDtype::F32, KvDtype::F16, KvDtype::Bf16, KvDtype::Int8];

/// A pool holding `lens[s]` tokens for each sequence, blocks handed out in a shuffled order.
struct Fixture {
    layout: KvLayout,
    num_blocks: usize,
    bytes: Vec<u8>,
    tables: Vec<Vec<u32>>,
}

impl Fixture {
    fn new(
        dtype: KvDtype,
        kv_heads: usize,
        head_dim: usize,
        bs: usize,
        lens: &[usize],
        seed: u64,
    ) -> Fixture {
        let layout = KvLayout::new(2, kv_heads, head_dim, bs, dtype, 0).unwrap();
        let mut rng = Rng::new(seed);
        let need: usize = lens.iter().map(|l| l.div_ceil(bs)).sum();
        let num_blocks = need + 3;
        let mut ids: Vec<u32> = (0..num_blocks as u32).collect();
        for i in (1..ids.len()).rev() {
            ids.swap(i, rng.below(i + 1));
        }
        // Stale garbage everywhere first (a recycled pool), including NaN patterns.
        let mut bytes: Vec<u8> = (0..layout.pool_bytes(num_blocks))
            .map(|_| rng.next_u64() as u8)
            .collect();
        let mut tables = Vec::new();
        let mut next = 0;
        for &len in lens {
            let table: Vec<u32> = ids[next..next + len.div_ceil(bs)].to_vec();
            next += table.len();
            let row = kv_heads * head_dim;
            let k = rng.vec(len * row, 1.5);
            let v = rng.vec(len * row, 1.5);
            let slots: Vec<usize> = (0..len)
                .map(|t| table[t / bs] as usize * bs + t % bs)
                .collect();
            let mut c = KvCacheMut::new(&layout, num_blocks, &mut bytes);
            write_kv(&mut c, 1, &k, &v, &slots).unwrap();
            tables.push(table);
        }
        Fixture {
            layout,
            num_blocks,
            bytes,
            tables,
        }
    }

    fn cache(&self) -> KvCacheRef<'_> {
        KvCacheRef::new(&self.layout, self.num_blocks, &self.bytes)
    }
}

fn run(exec: &Exec<'_>, f: &Fixture, q: &[f32], n_heads: usize, seqs: &[AttnSeq<'_>]) -> Vec<f32> {
    let mut out = vec![f32::NAN; q.len()];
    let scale = 1.0 / (f.layout.head_dim as f32).sqrt();
    paged_attention_on(exec, &f.cache(), 1, q, n_heads, seqs, scale, &mut out).unwrap();
    out
}

#[test]
fn attention_matches_the_f64_reference_for_every_kv_dtype() {
    for dtype in DTYPES {
        for &(n_heads, kv_heads, hd, bs) in &[
            (9usize, 3usize, 64usize, 16usize),
            (4, 4, 20, 5),
            (8, 2, 33, 7),
            (6, 2, 20, 32),
        ] {
            let lens = [37usize, 1, 70];
            let f = Fixture::new(dtype, kv_heads, hd, bs, &lens, 30);
            // seq 0: prefill chunk of its last 12 tokens; seq 1: its only token; seq 2: decode.
            let seqs = [
                AttnSeq {
                    block_table: &f.tables[0],
                    q_row: 0,
                    q_len: 12,
                    first_pos: 25,
                },
                AttnSeq {
                    block_table: &f.tables[1],
                    q_row: 12,
                    q_len: 1,
                    first_pos: 0,
                },
                AttnSeq {
                    block_table: &f.tables[2],
                    q_row: 13,
                    q_len: 1,
                    first_pos: 69,
                },
            ];
            let q = Rng::new(31).vec(14 * n_heads * hd, 1.0);
            let mut want = vec![0.0; q.len()];
            reference::paged_attention(
                &f.cache(),
                1,
                &q,
                n_heads,
                &seqs,
                1.0 / (hd as f32).sqrt(),
                &mut want,
            );
            let mut first: Option<Vec<f32>> = None;
            for exec in all_execs() {
                let got = run(&exec, &f, &q, n_heads, &seqs);
                let what = format!(
                    "{dtype} h={n_heads}/{kv_heads} hd={hd} bs={bs} {} {}t",
                    exec.isa(),
                    exec.pool().threads()
                );
                assert_close(&got, &want, 2e-6, 2e-5, &what);
                match &first {
                    None => first = Some(got),
                    Some(fst) => assert_bits_eq(&got, fst, &what),
                }
            }
        }
    }
}

#[test]
fn a_decode_query_gives_the_same_bits_alone_or_batched_with_any_neighbours() {
    for dtype in DTYPES {
        let lens = [50usize, 300, 17, 129, 64];
        let f = Fixture::new(dtype, 3, 64, 16, &lens, 40);
        let n_heads = 9;
        let row = n_heads * 64;
        let mut rng = Rng::new(41);
        let qs: Vec<Vec<f32>> = lens.iter().map(|_| rng.vec(row, 1.0)).collect();
        let probe = 1; // the 300-token sequence
        let alone_seq = [AttnSeq {
            block_table: &f.tables[probe],
            q_row: 0,
            q_len: 1,
            first_pos: lens[probe] - 1,
        }];
        let alone = run(&isas()[0], &f, &qs[probe], n_heads, &alone_seq);
        for batch in [vec![1, 0], vec![4, 3, 1, 2, 0], vec![2, 1]] {
            let q: Vec<f32> = batch.iter().flat_map(|&s| qs[s].clone()).collect();
            let seqs: Vec<AttnSeq<'_>> = batch
                .iter()
                .enumerate()
                .map(|(r, &s)| AttnSeq {
                    block_table: &f.tables[s],
                    q_row: r,
                    q_len: 1,
                    first_pos: lens[s] - 1,
                })
                .collect();
            let at = batch.iter().position(|&s| s == probe).unwrap();
            for exec in all_execs() {
                let out = run(&exec, &f, &q, n_heads, &seqs);
                assert_bits_eq(
                    &out[at * row..(at + 1) * row],
                    &alone,
                    &format!("{dtype} batch {batch:?} {}", exec.isa()),
                );
            }
        }
    }
}

#[test]
fn chunked_prefill_gives_the_same_bits_as_one_chunk() {
    // Float dtypes only: Int8 blocks requantize as tokens arrive (crate docs).
    for dtype in [KvDtype::F32, KvDtype::F16, KvDtype::Bf16] {
        let len = 100;
        let f = Fixture::new(dtype, 3, 64, 16, &[len], 50);
        let n_heads = 9;
        let row = n_heads * 64;
        let q = Rng::new(51).vec(len * row, 1.0);
        let whole = [AttnSeq {
            block_table: &f.tables[0],
            q_row: 0,
            q_len: len,
            first_pos: 0,
        }];
        let want = run(&fast(), &f, &q, n_heads, &whole);
        for cuts in [vec![0, 1, 100], vec![0, 16, 33, 100], vec![0, 64, 99, 100]] {
            for exec in all_execs() {
                let mut got = Vec::new();
                for w in cuts.windows(2) {
                    let (a, b) = (w[0], w[1]);
                    let seqs = [AttnSeq {
                        block_table: &f.tables[0],
                        q_row: 0,
                        q_len: b - a,
                        first_pos: a,
                    }];
                    got.extend(run(&exec, &f, &q[a * row..b * row], n_heads, &seqs));
                }
                assert_bits_eq(
                    &got,
                    &want,
                    &format!(
                        "{dtype} cuts {cuts:?} {} {}t",
                        exec.isa(),
                        exec.pool().threads()
                    ),
                );
            }
        }
    }
}

#[test]
fn bad_block_tables_and_rows_are_typed_errors() {
    let f = Fixture::new(KvDtype::F16, 2, 8, 4, &[10], 60);
    let cache = f.cache();
    let q = vec![0.0; 3 * 4 * 8];
    let mut out = vec![0.0; q.len()];
    let exec = fast();
    let call = |seqs: &[AttnSeq<'_>], n_heads: usize, out: &mut [f32]| {
        paged_attention_on(&exec, &cache, 1, &q[..out.len()], n_heads, seqs, 1.0, out)
    };
    let short = &f.tables[0][..2];
    assert_eq!(
        call(
            &[AttnSeq {
                block_table: short,
                q_row: 0,
                q_len: 1,
                first_pos: 9
            }],
            4,
            &mut out
        ),
        Err(KernelError::BlockTableTooShort {
            op: "paged_attention",
            seq: 0,
            last_pos: 9,
            needed_blocks: 3,
            table_blocks: 2
        })
    );
    let bogus = [0u32, 999];
    assert!(matches!(
        call(
            &[AttnSeq {
                block_table: &bogus,
                q_row: 0,
                q_len: 1,
                first_pos: 5
            }],
            4,
            &mut out
        ),
        Err(KernelError::BlockOutOfRange { block: 999, .. })
    ));
    assert!(matches!(
        call(
            &[AttnSeq {
                block_table: &f.tables[0],
                q_row: 2,
                q_len: 2,
                first_pos: 0
            }],
            4,
            &mut out
        ),
        Err(KernelError::QueryRowsOutOfRange {
            first_row: 2,
            end_row: 4,
            total_rows: 3,
            ..
        })
    ));
    let two = [
        AttnSeq {
            block_table: &f.tables[0],
            q_row: 0,
            q_len: 2,
            first_pos: 0,
        },
        AttnSeq {
            block_table: &f.tables[0],
            q_row: 1,
            q_len: 1,
            first_pos: 3,
        },
    ];
    assert!(matches!(
        call(&two, 4, &mut out),
        Err(KernelError::QueryRowsOverlap { .. })
    ));
    let mut out3 = vec![0.0; 3 * 3 * 8];
    assert!(matches!(
        call(
            &[AttnSeq {
                block_table: &f.tables[0],
                q_row: 0,
                q_len: 1,
                first_pos: 0
            }],
            3,
            &mut out3
        ),
        Err(KernelError::NotDivisible {
            numerator: 3,
            denominator: 2,
            ..
        })
    ));
}
