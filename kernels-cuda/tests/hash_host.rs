//! `hash.cu` (the device's slab checksums) is XXH3-64: compiled here by the host's C compiler
//! (`cc`, the same one cc-rs uses; `TANDEM_HOST_CHECK` swaps `__umul64hi` for a 128-bit product)
//! and compared with the CPU's XXH3 on every length class, at aligned and unaligned starts. The
//! GPU test (`tests/gpu/ipc.rs`) runs the same source on the device against the same reference.

use std::io::Write;
use std::process::Command;

use tandem_kernels_cuda::HASH_SOURCE;

const DRIVER: &str = r#"
#include <stdio.h>
#include <stdlib.h>
int main(int argc, char** argv) {
    FILE* f = fopen(argv[1], "rb");
    if (!f) return 2;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    unsigned char* buf = (unsigned char*)malloc(n + 8);
    if (fread(buf, 1, n, f) != (size_t)n) return 3;
    unsigned long long off, len;
    while (scanf("%llu %llu", &off, &len) == 2) {
        printf("%016llx\n", tandem_xxh3_64(buf + off, len));
    }
    return 0;
}
"#;

#[test]
fn the_device_hash_source_is_xxh3_64_on_every_length_class_and_alignment() {
    let dir = std::env::temp_dir().join(format!("tandem-hash-host-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let src = dir.join("hash_check.c");
    let exe = dir.join("hash_check");
    let text = format!(
        "#define TANDEM_HOST_CHECK 1\n#define __device__\n#define __forceinline__ static inline\n{HASH_SOURCE}\n{DRIVER}"
    );
    std::fs::write(&src, text).unwrap();
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let out = Command::new(&cc)
        .args(["-x", "c", "-std=gnu11", "-O2", "-Wall", "-Werror", "-o"])
        .arg(&exe)
        .arg(&src)
        .output()
        .unwrap_or_else(|e| panic!("`{cc}` (the C compiler scripts/setup.sh installs) did not run: {e}"));
    assert!(
        out.status.success(),
        "hash.cu does not compile as host C:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let mut data = vec![0u8; 70_000];
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    for b in &mut data {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x as u8;
    }
    let bin = dir.join("data.bin");
    std::fs::write(&bin, &data).unwrap();
    // Every length to 1,100 (each short class, the mid sizes, the first long blocks), then
    // KV slab sizes (512 B to 64 KiB); starts aligned and not.
    let mut cases: Vec<(usize, usize)> = (0..=1100).map(|len| (8, len)).collect();
    cases.extend((0..=300).map(|len| (3, len)));
    for len in [1023, 1024, 1025, 2048, 4096, 6144, 12_288, 16_385, 65_536] {
        cases.push((0, len));
        cases.push((5, len));
    }
    let mut child = Command::new(&exe)
        .arg(&bin)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    {
        let mut stdin = child.stdin.take().unwrap();
        for (off, len) in &cases {
            writeln!(stdin, "{off} {len}").unwrap();
        }
    }
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success());
    let lines: Vec<String> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(str::to_string)
        .collect();
    assert_eq!(lines.len(), cases.len());
    for ((off, len), got) in cases.iter().zip(&lines) {
        let want = xxhash_rust::xxh3::xxh3_64(&data[*off..off + len]);
        assert_eq!(got, &format!("{want:016x}"), "length {len} at offset {off}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
