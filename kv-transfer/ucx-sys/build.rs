//! Generates raw UCP bindings from the system's UCX headers (Debian `libucx-dev`, 1.13).
//!
//! Finds UCX through `pkg-config ucx` when it is there (falling back to the Debian default
//! paths), links `ucp` and `ucs`, and runs bindgen over `wrapper.h` with an allowlist of the UCP
//! API, so the generated file holds only what the safe wrapper in `tandem-kv-transfer` calls.

use std::env;
use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=wrapper.h");
    println!("cargo:rerun-if-env-changed=UCX_DIR");

    let mut include_dirs: Vec<PathBuf> = Vec::new();
    if let Ok(dir) = env::var("UCX_DIR") {
        let dir = PathBuf::from(dir);
        include_dirs.push(dir.join("include"));
        println!(
            "cargo:rustc-link-search=native={}",
            dir.join("lib").display()
        );
    } else if let Some(flags) = pkg_config(&["--cflags-only-I", "--libs-only-L", "ucx"]) {
        for flag in flags.split_whitespace() {
            if let Some(inc) = flag.strip_prefix("-I") {
                include_dirs.push(PathBuf::from(inc));
            } else if let Some(lib) = flag.strip_prefix("-L") {
                println!("cargo:rustc-link-search=native={lib}");
            }
        }
    }
    println!("cargo:rustc-link-lib=dylib=ucp");
    println!("cargo:rustc-link-lib=dylib=ucs");

    let mut builder = bindgen::Builder::default()
        .header("wrapper.h")
        .allowlist_function("ucp_.*")
        .allowlist_function("ucs_status_string")
        .allowlist_type("ucp_.*")
        .allowlist_type("ucs_status_t")
        .allowlist_var("UCP_.*")
        .allowlist_var("UCS_.*")
        .prepend_enum_name(false)
        .derive_default(true)
        .layout_tests(false)
        .generate_comments(false)
        .parse_callbacks(Box::new(bindgen::CargoCallbacks::new()));
    for dir in &include_dirs {
        builder = builder.clang_arg(format!("-I{}", dir.display()));
    }
    let bindings = builder.generate().unwrap_or_else(|e| {
        panic!(
            "bindgen could not parse <ucp/api/ucp.h> ({e}); install Debian's libucx-dev and \
             libclang-dev, or point UCX_DIR at a UCX install"
        )
    });
    let out = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    bindings
        .write_to_file(out.join("bindings.rs"))
        .expect("write bindings.rs into OUT_DIR");
}

fn pkg_config(args: &[&str]) -> Option<String> {
    let out = Command::new("pkg-config").args(args).output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}
