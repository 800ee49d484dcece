//! The real model's tokenizer on arbitrary input (issue 12's fuzzed ingress): random bytes
//! (read lossily, as an ingress would), random code points (controls, combining marks, CJK,
//! emoji, lone special-token fragments such as `<|im_`), and random token ids (in range and
//! not). Properties: nothing panics; encoding loses only the bytes the vocabulary has no token
//! for (`decode(encode(s))` is `s` without them: SmolLM2 lacks 21 of the 256, see the crate
//! docs); every id is in the vocabulary; streaming detokenisation, token by token, yields
//! exactly `decode`.
//!
//! Deterministic: `TANDEM_SEED=N` reproduces a run; `TANDEM_FUZZ_CASES=N` runs longer.

use std::path::PathBuf;

use tandem_tokenizer::{GgufMetadata, Tokenizer};

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

const FRAGMENTS: &[&str] = &[
    "<|im_start|>", "<|im_end|>", "<|im_", "|>", "<|", "<|endoftext|>", "\u{200d}", "e\u{301}",
    "🦀", "👩\u{200d}💻", "漢字", "\r\n", "\t", "  ", "'s", "'LL", "123456", "\u{feff}", "\u{0}",
];

fn random_text(rng: &mut Rng) -> String {
    let mut s = String::new();
    for _ in 0..rng.below(24) {
        match rng.below(4) {
            0 => {
                let bytes: Vec<u8> = (0..rng.below(12)).map(|_| rng.next() as u8).collect();
                s.push_str(&String::from_utf8_lossy(&bytes));
            }
            1 => s.push_str(FRAGMENTS[rng.below(FRAGMENTS.len() as u64) as usize]),
            2 => {
                if let Some(c) = char::from_u32(rng.below(0x11_0000) as u32) {
                    s.push(c);
                }
            }
            _ => s.push((b' ' + rng.below(95) as u8) as char),
        }
    }
    s
}

fn tokenizer() -> Tokenizer {
    let path = std::env::var_os("TANDEM_MODEL").map_or_else(
        || {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
                .join(".cache/tandem/models/SmolLM2-135M-Instruct.Q4_1.gguf")
        },
        PathBuf::from,
    );
    let meta = GgufMetadata::read(&path)
        .unwrap_or_else(|e| panic!("the tokenizer fuzz needs the model ({e}); run scripts/setup.sh"));
    Tokenizer::from_gguf(&meta).expect("the model's tokenizer loads")
}

#[test]
fn arbitrary_text_round_trips_and_arbitrary_ids_decode_without_panicking() {
    let t = tokenizer();
    let seed = std::env::var("TANDEM_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(0x70c);
    let cases: u64 = std::env::var("TANDEM_FUZZ_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20_000);
    let mut rng = Rng(seed);
    let vocab = t.vocab_size() as u32;
    // Bytes with a token of their own (the rest are dropped by design).
    let mut has_token = [false; 256];
    for id in 0..vocab {
        if let Some(&[b]) = t.token_bytes(id) {
            has_token[b as usize] = true;
        }
    }
    let dropped = has_token.iter().filter(|h| !**h).count();
    assert!(dropped < 32, "{dropped} bytes without a token: not a byte-level vocabulary");
    for case in 0..cases {
        let text = random_text(&mut rng);
        let ids = t.encode(&text);
        let ctx = || format!("seed {seed} case {case}: {text:?} -> {ids:?}");
        assert!(ids.iter().all(|&id| id < vocab), "{}", ctx());
        let kept: Vec<u8> = text.bytes().filter(|&b| has_token[b as usize]).collect();
        let expected = String::from_utf8_lossy(&kept);
        let decoded = t.decode(&ids);
        assert_eq!(decoded, expected, "{}", ctx());
        // Streaming, token by token, gives the same text.
        let mut stream = t.decode_stream();
        let mut streamed: String = ids.iter().filter_map(|&id| stream.push(id)).collect();
        streamed.extend(stream.finish());
        assert_eq!(streamed, decoded, "{}", ctx());

        // Random ids, some beyond the vocabulary: decode and stream agree, nothing panics.
        let ids: Vec<u32> = (0..rng.below(16))
            .map(|_| match rng.below(4) {
                0 => rng.next() as u32,
                _ => rng.below(u64::from(vocab)) as u32,
            })
            .collect();
        let whole = t.decode(&ids);
        let mut stream = t.decode_stream();
        let mut streamed: String = ids.iter().filter_map(|&id| stream.push(id)).collect();
        streamed.extend(stream.finish());
        assert_eq!(streamed, whole, "seed {seed} case {case}: ids {ids:?}");
    }
}
