//! `tandem-kv-peer`: the child-process side of the two-process tests and of
//! `tandem bench-transfer` (see `tandem_kv_transfer::peer`), plus `bench` to run the benchmark
//! without the `tandem` CLI.

fn main() -> anyhow::Result<()> {
    // Logs go to stderr, and only when asked for: stdout carries the line protocol.
    if let Ok(filter) = std::env::var("RUST_LOG") {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
            .with_writer(std::io::stderr)
            .try_init();
    }
    tandem_kv_transfer::peer::run_cli(std::env::args_os())
}
