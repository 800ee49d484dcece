//! Worker-pool dispatch latency: one `run` of one tiny task per thread, i.e. the fixed cost
//! every parallel kernel call pays (decode issues ~20,000 of them a second).
//!
//! Run: `cargo bench -p tandem-kernels --bench pool`.

use criterion::{Criterion, criterion_group, criterion_main};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;
use tandem_kernels::global_pool;

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("pool");
    g.warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_millis(1500));
    let pool = global_pool();
    let hits = AtomicUsize::new(0);
    g.bench_function(
        format!(
            "dispatch {} tasks on {} threads",
            pool.threads(),
            pool.threads()
        ),
        |b| {
            b.iter(|| {
                pool.run(pool.threads(), &|_| {
                    hits.fetch_add(1, Ordering::Relaxed);
                })
            })
        },
    );
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
