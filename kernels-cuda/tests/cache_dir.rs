//! Where the PTX cache lives by default. The only test of this binary: it changes the process
//! environment, which no other test may read concurrently.

use std::path::PathBuf;
use tandem_kernels_cuda::ptx::default_dir;

#[test]
fn tandem_ptx_cache_then_xdg_then_home() {
    // SAFETY: this binary runs this one test, on one thread; nothing else reads the environment.
    unsafe {
        std::env::set_var("TANDEM_PTX_CACHE", "/tmp/tandem-ptx-explicit");
        std::env::set_var("XDG_CACHE_HOME", "/tmp/xdg");
        std::env::set_var("HOME", "/tmp/home");
    }
    assert_eq!(default_dir(), PathBuf::from("/tmp/tandem-ptx-explicit"));
    // SAFETY: as above.
    unsafe { std::env::remove_var("TANDEM_PTX_CACHE") };
    assert_eq!(default_dir(), PathBuf::from("/tmp/xdg/tandem/ptx"));
    // SAFETY: as above.
    unsafe { std::env::set_var("XDG_CACHE_HOME", "") };
    assert_eq!(default_dir(), PathBuf::from("/tmp/home/.cache/tandem/ptx"));
}
