//! The on-disk PTX cache: compile once, then hits; the key separates arch and source; a
//! corrupt or unreadable entry is recompiled (and a cache that cannot be written is no error).

use crate::common;

use tandem_kernels_cuda::{Arch, CacheOutcome, PtxCache, SOURCES};

const SRC: &str = "extern \"C\" __global__ void scale(float* x, float a, int n) {\n    int i = blockIdx.x * blockDim.x + threadIdx.x;\n    if (i < n) x[i] = x[i] * a;\n}\n";

#[test]
fn first_call_compiles_second_is_a_hit() {
    let cache = PtxCache::new(common::temp_dir("hit"));
    let (a, how) = cache.get_or_compile("scale.cu", SRC, Arch::SM_90).unwrap();
    assert_eq!(how, CacheOutcome::Compiled);
    assert_eq!((cache.compiles(), cache.hits()), (1, 0));
    let (b, how) = cache.get_or_compile("scale.cu", SRC, Arch::SM_90).unwrap();
    assert_eq!(how, CacheOutcome::Hit);
    assert_eq!((cache.compiles(), cache.hits()), (1, 1));
    assert_eq!(a.ptx, b.ptx);
    assert!(b.ptx.contains(".entry scale("));
    let path = cache.path_for("scale.cu", SRC, Arch::SM_90).unwrap();
    assert!(path.exists(), "{}", path.display());
    let name = path.file_name().unwrap().to_str().unwrap();
    assert!(name.starts_with("scale_cu.sm_90.nvrtc"), "{name}");
    // A second cache object on the same directory (a restart) hits too.
    let again = PtxCache::new(cache.dir());
    assert_eq!(
        again
            .get_or_compile("scale.cu", SRC, Arch::SM_90)
            .unwrap()
            .1,
        CacheOutcome::Hit
    );
    std::fs::remove_dir_all(cache.dir()).unwrap();
}

#[test]
fn arch_and_source_are_part_of_the_key() {
    let cache = PtxCache::new(common::temp_dir("key"));
    let p90 = cache.path_for("scale.cu", SRC, Arch::SM_90).unwrap();
    let p80 = cache.path_for("scale.cu", SRC, Arch::SM_80).unwrap();
    let other = SRC.replace("x[i] * a", "x[i] * a + 1.0f");
    let p90b = cache.path_for("scale.cu", &other, Arch::SM_90).unwrap();
    assert_ne!(p90, p80);
    assert_ne!(p90, p90b);
    assert_eq!(
        cache
            .get_or_compile("scale.cu", SRC, Arch::SM_90)
            .unwrap()
            .1,
        CacheOutcome::Compiled
    );
    let (ptx80, how) = cache.get_or_compile("scale.cu", SRC, Arch::SM_80).unwrap();
    assert_eq!(how, CacheOutcome::Compiled);
    assert!(ptx80.ptx.contains(".target sm_80"));
    assert_eq!(
        cache
            .get_or_compile("scale.cu", &other, Arch::SM_90)
            .unwrap()
            .1,
        CacheOutcome::Compiled
    );
    assert_eq!((cache.compiles(), cache.hits()), (3, 0));
    for p in [&p90, &p80, &p90b] {
        assert!(p.exists());
    }
    std::fs::remove_dir_all(cache.dir()).unwrap();
}

#[test]
fn a_corrupt_entry_is_recompiled_then_served() {
    let cache = PtxCache::new(common::temp_dir("corrupt"));
    let (good, _) = cache.get_or_compile("scale.cu", SRC, Arch::SM_90).unwrap();
    let path = cache.path_for("scale.cu", SRC, Arch::SM_90).unwrap();
    for damage in [
        |b: &mut Vec<u8>| b.truncate(b.len() / 2),
        |b: &mut Vec<u8>| {
            let n = b.len();
            b[n - 10] ^= 0x20
        },
        |b: &mut Vec<u8>| *b = b"not ptx at all".to_vec(),
        |b: &mut Vec<u8>| b.clear(),
    ] {
        let mut bytes = std::fs::read(&path).unwrap();
        damage(&mut bytes);
        std::fs::write(&path, bytes).unwrap();
        let (ptx, how) = cache.get_or_compile("scale.cu", SRC, Arch::SM_90).unwrap();
        assert_eq!(how, CacheOutcome::Recompiled);
        assert_eq!(ptx.ptx, good.ptx);
        assert_eq!(
            cache
                .get_or_compile("scale.cu", SRC, Arch::SM_90)
                .unwrap()
                .1,
            CacheOutcome::Hit
        );
    }
    assert_eq!(
        (cache.compiles(), cache.recompiles(), cache.hits()),
        (5, 4, 4)
    );
    std::fs::remove_dir_all(cache.dir()).unwrap();
}

#[test]
fn an_unreadable_entry_or_unwritable_cache_still_returns_ptx() {
    let cache = PtxCache::new(common::temp_dir("unreadable"));
    let path = cache.path_for("scale.cu", SRC, Arch::SM_90).unwrap();
    // A directory where the file should be: the read fails (not NotFound) and so does the write.
    std::fs::create_dir_all(&path).unwrap();
    let (ptx, how) = cache.get_or_compile("scale.cu", SRC, Arch::SM_90).unwrap();
    assert_eq!(how, CacheOutcome::Recompiled);
    assert!(ptx.ptx.contains(".entry scale("));
    // No temporary files are left behind.
    let leftovers: Vec<_> = std::fs::read_dir(cache.dir())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(leftovers.len(), 1, "{leftovers:?}");
    std::fs::remove_dir_all(cache.dir()).unwrap();
}

#[test]
fn every_crate_source_is_cached() {
    let cache = PtxCache::new(common::temp_dir("all"));
    for src in SOURCES {
        let text = src.full_text();
        assert_eq!(
            cache
                .get_or_compile(src.name, &text, Arch::SM_90)
                .unwrap()
                .1,
            CacheOutcome::Compiled
        );
        assert_eq!(
            cache
                .get_or_compile(src.name, &text, Arch::SM_90)
                .unwrap()
                .1,
            CacheOutcome::Hit
        );
    }
    assert_eq!(
        std::fs::read_dir(cache.dir()).unwrap().count(),
        SOURCES.len()
    );
    std::fs::remove_dir_all(cache.dir()).unwrap();
}
