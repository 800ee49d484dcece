//! Finding the CUDA libraries before cudarc touches them.
//!
//! cudarc (with `dynamic-loading`) opens each library on its first call and **panics** when it
//! is missing. So every entry point of this crate first asks [`require`], which tries the same
//! file names cudarc will try (`cudarc::get_lib_name_candidates`: `libnvrtc.so`,
//! `libnvrtc.so.13`, ...), through the same dynamic loader (`dlopen`, so `LD_LIBRARY_PATH`,
//! the `ld.so` cache and the default directories), and turns absence into a typed error that
//! names what was tried. After `require(lib)` succeeds, cudarc's own load of `lib` succeeds too.
//!
//! There is no `CUDA_PATH` lookup: cudarc does not do one, so a directory has to be on the
//! loader's path. `scripts/test.sh` puts the NVRTC wheel's `lib/` there.

use crate::error::{CudaError, CudaLib};

/// Names cudarc tries for `lib`, in its order.
pub fn candidates(lib: CudaLib) -> Vec<String> {
    match lib {
        // cudarc tries "cuda" then "nvcuda" (Windows); both are listed so the error is complete.
        CudaLib::Driver => ["cuda", "nvcuda"]
            .iter()
            .flat_map(|n| cudarc::get_lib_name_candidates(n))
            .collect(),
        CudaLib::Nvrtc => cudarc::get_lib_name_candidates("nvrtc"),
        CudaLib::Cublas => cudarc::get_lib_name_candidates("cublas"),
        CudaLib::Nccl => cudarc::get_lib_name_candidates("nccl"),
    }
}

/// Whether cudarc can load `lib` (it would not panic).
pub fn is_present(lib: CudaLib) -> bool {
    // SAFETY: each `is_culib_present` only dlopens (and closes) candidate names; loading a CUDA
    // library runs no code of ours. These are the documented checks for the panicking loaders.
    unsafe {
        match lib {
            CudaLib::Driver => cudarc::driver::sys::is_culib_present(),
            CudaLib::Nvrtc => cudarc::nvrtc::sys::is_culib_present(),
            CudaLib::Cublas => cudarc::cublas::sys::is_culib_present(),
            CudaLib::Nccl => cudarc::nccl::sys::is_culib_present(),
        }
    }
}

/// `Ok` when `lib` can be loaded; otherwise the typed error naming every file name tried.
pub fn require(lib: CudaLib) -> Result<(), CudaError> {
    if is_present(lib) {
        return Ok(());
    }
    let names = candidates(lib);
    let ld_library_path = std::env::var(crate::env::LD_LIBRARY_PATH).ok();
    Err(match lib {
        CudaLib::Driver => CudaError::NoDriver {
            library: "libcuda.so.1",
            names,
            ld_library_path,
        },
        _ => CudaError::LibraryMissing {
            lib,
            names,
            ld_library_path,
            hint: hint(lib),
        },
    })
}

fn hint(lib: CudaLib) -> &'static str {
    match lib {
        CudaLib::Nvrtc => {
            "; install it with `pip install nvidia-cuda-nvrtc==13.0.88` (scripts/setup.sh does, into \
             .tandem/venv) and put its nvidia/cu13/lib on LD_LIBRARY_PATH (scripts/test.sh does)"
        }
        CudaLib::Nccl => {
            "; NCCL often ships only as libnccl.so.2: a libnccl.so symlink in a directory on \
             LD_LIBRARY_PATH fixes that"
        }
        _ => "",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn candidates_include_the_versioned_sonames() {
        assert!(
            candidates(CudaLib::Driver)
                .iter()
                .any(|n| n == "libcuda.so.1")
        );
        assert!(
            candidates(CudaLib::Nvrtc)
                .iter()
                .any(|n| n == "libnvrtc.so.13")
        );
        assert!(
            candidates(CudaLib::Cublas)
                .iter()
                .any(|n| n == "libcublas.so.13")
        );
    }

    #[test]
    fn a_missing_library_names_every_candidate() {
        if is_present(CudaLib::Nccl) {
            return;
        }
        match require(CudaLib::Nccl) {
            Err(CudaError::LibraryMissing {
                lib: CudaLib::Nccl,
                names,
                hint,
                ..
            }) => {
                assert_eq!(names, candidates(CudaLib::Nccl));
                assert!(hint.contains("libnccl.so.2"));
            }
            other => panic!("expected LibraryMissing(nccl), got {other:?}"),
        }
    }
}
