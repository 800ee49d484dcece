//! `tandem-decode-node`: see the crate docs and README. Exits non-zero (after a log line on
//! stderr) when the node cannot start, e.g. when the cluster refuses its KV layout.

use std::process::ExitCode;

fn main() -> ExitCode {
    match tandem_decode_node::main_with_args(std::env::args_os().collect()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tandem-decode-node: {e:#}");
            ExitCode::FAILURE
        }
    }
}
