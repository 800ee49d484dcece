//! The GPT-2 byte ↔ unicode table used by byte-level BPE vocabularies.
//!
//! Byte-level BPE stores every token as a string of "visible" characters, one per byte: the
//! 188 printable Latin-1 bytes (`!`..=`~`, `¡`..=`¬`, `®`..=`ÿ`) stand for themselves and the
//! other 68 bytes (controls, space, `\x7f`..`\xa0`, soft hyphen) are shifted to U+0100..U+0143 in
//! byte order, so `b' '` is `Ġ` (U+0120) and `b'\n'` is `Ċ` (U+010A). This is the table of
//! OpenAI's `bytes_to_unicode()`, written out here as `const` code.
//!
//! Invariant: the table is a bijection between the 256 bytes and 256 characters, all below
//! U+0144, so the reverse lookup is a 324-entry array. Both lookups are O(1) and allocation-free.

/// One past the largest character the table produces (U+0143).
const CHAR_LIMIT: usize = 0x144;

/// Whether `b` is one of the bytes that stand for themselves.
const fn is_printable(b: u8) -> bool {
    matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF)
}

/// `BYTE_TO_CHAR[b]` is the character byte `b` is written as.
const BYTE_TO_CHAR: [char; 256] = {
    let mut table = ['\0'; 256];
    let mut shifted = 0u32;
    let mut b = 0usize;
    while b < 256 {
        let code = if is_printable(b as u8) {
            b as u32
        } else {
            shifted += 1;
            255 + shifted
        };
        table[b] = match char::from_u32(code) {
            Some(c) => c,
            None => panic!("byte-level table produced a surrogate"),
        };
        b += 1;
    }
    table
};

/// `CHAR_TO_BYTE[c]` is the byte written as character `c`, or -1 for characters not in the table.
const CHAR_TO_BYTE: [i16; CHAR_LIMIT] = {
    let mut table = [-1i16; CHAR_LIMIT];
    let mut b = 0usize;
    while b < 256 {
        table[BYTE_TO_CHAR[b] as usize] = b as i16;
        b += 1;
    }
    table
};

/// The character that byte `b` is written as in a byte-level vocabulary.
pub(crate) fn byte_to_char(b: u8) -> char {
    BYTE_TO_CHAR[b as usize]
}

/// The byte that character `c` stands for, or `None` if `c` is not in the table.
pub(crate) fn char_to_byte(c: char) -> Option<u8> {
    let code = c as usize;
    if code >= CHAR_LIMIT {
        return None;
    }
    u8::try_from(CHAR_TO_BYTE[code]).ok()
}

/// The raw bytes a vocabulary string stands for, as Hugging Face's `ByteLevel` decoder computes
/// them: the mapped bytes if every character is in the table, else the string's own UTF-8.
pub(crate) fn token_string_to_bytes(token: &str) -> Vec<u8> {
    token
        .chars()
        .map(char_to_byte)
        .collect::<Option<Vec<u8>>>()
        .unwrap_or_else(|| token.as_bytes().to_vec())
}

/// The vocabulary string for raw bytes (each byte mapped through the table).
pub(crate) fn bytes_to_token_string(bytes: &[u8]) -> String {
    bytes.iter().map(|&b| byte_to_char(b)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_is_a_bijection_over_all_bytes() {
        let mut seen = std::collections::HashSet::new();
        for b in 0..=255u8 {
            let c = byte_to_char(b);
            assert!(seen.insert(c), "character {c:?} used twice");
            assert_eq!(char_to_byte(c), Some(b));
        }
        assert_eq!(seen.len(), 256);
    }

    #[test]
    fn table_matches_gpt2_for_known_bytes() {
        assert_eq!(byte_to_char(b' '), 'Ġ');
        assert_eq!(byte_to_char(b'\n'), 'Ċ');
        assert_eq!(byte_to_char(b'\t'), 'ĉ');
        assert_eq!(byte_to_char(0), 'Ā');
        assert_eq!(byte_to_char(b'a'), 'a');
        assert_eq!(byte_to_char(0xA0), 'ł');
        assert_eq!(byte_to_char(0xAD), 'Ń');
        assert_eq!(byte_to_char(0xC3), 'Ã');
    }

    #[test]
    fn characters_outside_the_table_have_no_byte() {
        assert_eq!(char_to_byte(' '), None);
        assert_eq!(char_to_byte('\u{144}'), None);
        assert_eq!(char_to_byte('日'), None);
    }

    #[test]
    fn token_strings_round_trip_through_bytes() {
        let bytes = "héllo wörld\n日本".as_bytes();
        let token = bytes_to_token_string(bytes);
        assert_eq!(token_string_to_bytes(&token), bytes);
        // A string with characters outside the table decodes to its own UTF-8.
        assert_eq!(token_string_to_bytes("<|im_end|>"), b"<|im_end|>");
        assert_eq!(token_string_to_bytes("▁日"), "▁日".as_bytes());
    }
}
