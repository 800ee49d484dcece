//! Unit tests of the assembled tokenizer over a small hand-made vocabulary.

use super::*;

/// All 256 byte tokens (ids 0..256 in table order of the byte), then merged tokens, then
/// `<|im_end|>` as a control token.
fn toy() -> Tokenizer {
    let mut tokens: Vec<Option<String>> = (0..=255u8)
        .map(|b| Some(byte_level::byte_to_char(b).to_string()))
        .collect();
    let merged = [
        "he", "ll", "hell", "hello", "Ġw", "Ġwo", "Ġwor", "Ġworl", "Ġworld", "Ã©",
    ];
    tokens.extend(merged.iter().map(|t| Some((*t).to_owned())));
    tokens.push(Some("<|im_end|>".to_owned()));
    let im_end = tokens.len() as u32 - 1;
    let merges = vec![
        ("h", "e"),
        ("l", "l"),
        ("he", "ll"),
        ("hell", "o"),
        ("Ġ", "w"),
        ("Ġw", "o"),
        ("Ġwo", "r"),
        ("Ġwor", "l"),
        ("Ġworl", "d"),
        ("Ã", "©"),
    ];
    Tokenizer::from_spec(TokenizerSpec {
        tokens,
        added: vec![AddedToken {
            content: "<|im_end|>".to_owned(),
            id: im_end,
            lstrip: false,
            rstrip: false,
        }],
        merges,
        pre: PreTokenizer::smollm(),
        ignore_merges: false,
        eos: im_end,
        bos: None,
        chat_template: None,
    })
    .expect("toy vocabulary is valid")
}

#[test]
fn merges_apply_within_pieces_and_not_across_them() {
    let t = toy();
    let ids = t.encode("hello world");
    let texts: Vec<_> = ids.iter().map(|&id| t.token_text(id).unwrap()).collect();
    assert_eq!(texts, ["hello", "Ġworld"]);
    // "hel lo": no merge may cross the piece boundary at the space.
    let texts: Vec<_> = t
        .encode("hel lo")
        .iter()
        .map(|&id| t.token_text(id).unwrap())
        .collect();
    assert_eq!(texts, ["he", "l", "Ġ", "l", "o"]);
}

#[test]
fn decode_inverts_encode_when_every_byte_has_a_token() {
    let t = toy();
    for s in [
        "hello world",
        "é\u{0}\u{7f} \t\n",
        "日本語 🎉",
        "",
        "<|im_end|>x",
    ] {
        assert_eq!(t.decode(&t.encode(s)), s);
    }
}

#[test]
fn control_token_text_maps_to_its_id_and_decodes_literally() {
    let t = toy();
    let eos = t.eos_token_id();
    assert_eq!(
        t.encode("hello<|im_end|>"),
        [t.token_id("hello").unwrap(), eos]
    );
    assert_eq!(t.token_bytes(eos), Some(&b"<|im_end|>"[..]));
    assert_eq!(t.token_id("<|im_end|>"), Some(eos));
}

#[test]
fn unknown_ids_have_no_bytes_and_decode_to_nothing() {
    let t = toy();
    let past_end = t.vocab_size() as u32;
    assert_eq!(t.token_bytes(past_end), None);
    assert_eq!(t.decode(&[past_end, t.token_id("hello").unwrap()]), "hello");
    assert_eq!(t.token_text(past_end), None);
}

#[test]
fn stream_pieces_concatenate_to_decode_even_for_invalid_utf8() {
    let t = toy();
    let e_acute = t.token_id("Ã©").unwrap();
    let lead = t.token_id("Ã").unwrap(); // 0xC3 alone
    let cont = t.token_id("©").unwrap(); // 0xA9 alone
    let ff = t.token_id("ÿ").unwrap(); // 0xFF, never valid
    let cases: [&[u32]; 4] = [
        &[lead, cont, e_acute],
        &[lead, ff, cont],
        &[cont, lead],
        &[ff, lead, lead, cont],
    ];
    for ids in cases {
        let mut stream = t.decode_stream();
        let mut text: String = ids.iter().filter_map(|&id| stream.push(id)).collect();
        text.extend(stream.finish());
        assert_eq!(text, t.decode(ids), "ids {ids:?}");
    }
}

#[test]
fn stream_holds_back_a_partial_character() {
    let t = toy();
    let mut stream = t.decode_stream();
    assert_eq!(stream.push(t.token_id("Ã").unwrap()), None);
    assert_eq!(stream.push(t.token_id("©").unwrap()).as_deref(), Some("é"));
    assert_eq!(stream.finish(), None);
}

#[test]
fn merge_with_unknown_result_is_rejected() {
    let tokens = (0..=255u8)
        .map(|b| Some(byte_level::byte_to_char(b).to_string()))
        .collect();
    let err = Tokenizer::from_spec(TokenizerSpec {
        tokens,
        added: Vec::new(),
        merges: vec![("a", "b")],
        pre: PreTokenizer::gpt2(),
        ignore_merges: false,
        eos: 0,
        bos: None,
        chat_template: None,
    })
    .unwrap_err();
    assert!(
        matches!(
            err,
            TokenizerError::BadMerge {
                index: 0,
                reason: BadMergeReason::UnknownMerged,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn merge_rules_must_be_two_tokens() {
    assert_eq!(parse_merge("Ġ t"), Some(("Ġ", "t")));
    assert_eq!(parse_merge("abc"), None);
    assert_eq!(parse_merge("a b c"), None);
    assert_eq!(parse_merge(" a"), None);
}

#[test]
fn tokenizer_is_send_and_sync() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Tokenizer>();
}
