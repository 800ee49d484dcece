//! Every CUDA source compiles with NVRTC (no GPU needed), cleanly, for the target and the oldest
//! supported arch; a broken source is a typed error whose log names the line. These tests fail,
//! never skip, when NVRTC is missing (scripts/test.sh puts the pinned wheel on the loader path).

use tandem_kernels_cuda::ptx::{self, compile};
use tandem_kernels_cuda::{Arch, CudaError, CudaLib, KernelSource, SOURCES, libs};

#[test]
fn nvrtc_is_loadable_and_recent() {
    if let Err(e) = libs::require(CudaLib::Nvrtc) {
        panic!("{e}");
    }
    let (major, minor) = ptx::nvrtc_version().unwrap();
    assert!(major >= 12, "NVRTC {major}.{minor} is older than 12");
}

#[test]
fn every_source_compiles_for_sm_90_and_sm_80_without_warnings() {
    for arch in [Arch::SM_90, Arch::SM_80] {
        for src in SOURCES {
            let out = compile(src.name, &src.full_text(), arch).unwrap_or_else(|e| panic!("{e}"));
            assert!(
                out.log.trim().is_empty(),
                "{} for {arch}: NVRTC log is not empty:\n{}",
                src.name,
                out.log
            );
            assert!(
                out.ptx.contains(&format!(".target {arch}")),
                "{} PTX targets {arch}",
                src.name
            );
            for f in src.functions {
                assert!(
                    out.ptx.contains(&format!(".entry {f}(")),
                    "{}: kernel `{f}` missing (or name-mangled) in the PTX",
                    src.name
                );
            }
        }
    }
}

#[test]
fn every_kernel_name_is_listed_once() {
    let mut names: Vec<&str> = SOURCES
        .iter()
        .flat_map(|s| s.functions.iter().copied())
        .collect();
    let n = names.len();
    names.sort();
    names.dedup();
    assert_eq!(names.len(), n, "a kernel is listed twice");
    for src in SOURCES {
        let defined = src.body.matches("extern \"C\" __global__").count();
        let via_macro = src.body.contains("#define TANDEM_");
        assert!(
            via_macro || defined == src.functions.len(),
            "{}: {defined} kernels defined, {} listed",
            src.name,
            src.functions.len()
        );
    }
}

#[test]
fn a_broken_source_is_a_compile_error_naming_its_line() {
    let src = "extern \"C\" __global__ void k(float* x) {\n    x[0] = 1.0f;\n    x[1] = undefined_thing;\n}\n";
    match compile("broken.cu", src, Arch::SM_90) {
        Err(CudaError::Compile {
            source_name,
            arch,
            log,
            ..
        }) => {
            assert_eq!(source_name, "broken.cu");
            assert_eq!(arch, "sm_90");
            assert!(
                log.contains("broken.cu(3)"),
                "log does not name line 3:\n{log}"
            );
            assert!(log.contains("undefined_thing"), "{log}");
        }
        other => panic!("expected a Compile error, got {other:?}"),
    }
}

#[test]
fn errors_in_a_kernel_body_are_reported_at_its_own_line_not_the_preludes() {
    let bad = KernelSource {
        name: "bad.cu",
        body: "// one\nextern \"C\" __global__ void k() { int x = ; }\n",
        functions: &["k"],
    };
    let err = compile(bad.name, &bad.full_text(), Arch::SM_90).unwrap_err();
    let msg = err.to_string();
    assert_eq!(err.error_type(), "compile");
    assert!(msg.contains("bad.cu(2)"), "{msg}");
}
