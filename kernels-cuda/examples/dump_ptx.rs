//! Compiles every kernel source for an arch (default sm_90) and writes the PTX to a directory,
//! for reading (register use, local memory) without a GPU: `cargo run -p tandem-kernels-cuda
//! --example dump_ptx -- /tmp/ptx 90`.

use tandem_kernels_cuda::{Arch, SOURCES, ptx};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let dir = std::path::PathBuf::from(args.next().unwrap_or_else(|| "ptx-out".into()));
    let cc: u32 = args.next().map(|s| s.parse()).transpose()?.unwrap_or(90);
    let arch = Arch {
        major: cc / 10,
        minor: cc % 10,
    };
    std::fs::create_dir_all(&dir)?;
    for src in SOURCES {
        let out = ptx::compile(src.name, &src.full_text(), arch)?;
        let path = dir.join(format!("{}.{arch}.ptx", src.name.trim_end_matches(".cu")));
        std::fs::write(&path, &out.ptx)?;
        println!(
            "{} ({} bytes){}",
            path.display(),
            out.ptx.len(),
            if out.log.is_empty() {
                String::new()
            } else {
                format!("\n{}", out.log)
            }
        );
    }
    Ok(())
}
