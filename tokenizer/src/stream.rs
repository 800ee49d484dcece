//! Incremental detokenisation for streaming generated text.
//!
//! A byte-level token can end in the middle of a multi-byte UTF-8 character (emoji and CJK are
//! often split across two or three tokens), so a stream cannot decode token by token. The
//! [`DecodeStream`] keeps the undecoded bytes and releases text as soon as it is complete.
//!
//! Invariant: the concatenation of everything returned by [`DecodeStream::push`] and
//! [`DecodeStream::finish`] equals `Tokenizer::decode` of all pushed ids, always (not only for
//! valid UTF-8): bytes are released in the same chunks `String::from_utf8_lossy` uses, an invalid
//! sequence becoming one U+FFFD as soon as it is known to be invalid and an incomplete tail being
//! held back (at most 3 bytes) until the next token completes it or `finish` flushes it.
//!
//! Cost: O(bytes of the pushed token) per push, no allocation beyond the returned `String`.

use super::Tokenizer;

/// Incremental detokenizer for one sequence, created by [`Tokenizer::decode_stream`].
#[derive(Debug)]
pub struct DecodeStream<'a> {
    tokenizer: &'a Tokenizer,
    /// Bytes received but not yet returned: always an incomplete UTF-8 prefix (< 4 bytes)
    /// between calls.
    pending: Vec<u8>,
}

impl<'a> DecodeStream<'a> {
    pub(crate) fn new(tokenizer: &'a Tokenizer) -> Self {
        Self {
            tokenizer,
            pending: Vec::new(),
        }
    }

    /// Add the token `id`; returns the text that became complete, or `None` if none did (a
    /// character is still partial, or the token has no bytes, e.g. an unknown id).
    pub fn push(&mut self, id: u32) -> Option<String> {
        if let Some(bytes) = self.tokenizer.token_bytes(id) {
            self.pending.extend_from_slice(bytes);
        }
        let mut text = String::new();
        let mut consumed = 0;
        for chunk in self.pending.utf8_chunks() {
            text.push_str(chunk.valid());
            consumed += chunk.valid().len();
            let invalid = chunk.invalid();
            if invalid.is_empty() {
                continue;
            }
            let chunk_end = consumed + invalid.len();
            if chunk_end == self.pending.len() && could_complete(invalid) {
                // An incomplete character at the end: wait for the next token.
                break;
            }
            text.push(char::REPLACEMENT_CHARACTER);
            consumed = chunk_end;
        }
        self.pending.drain(..consumed);
        (!text.is_empty()).then_some(text)
    }

    /// Flush the held-back bytes (a character the stream ended inside) lossily.
    pub fn finish(&mut self) -> Option<String> {
        let text = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        (!text.is_empty()).then_some(text)
    }
}

/// Whether `tail`, an invalid chunk at the end of the buffer, is a proper prefix of some valid
/// UTF-8 character (so more bytes could make it valid).
fn could_complete(tail: &[u8]) -> bool {
    let Some(&lead) = tail.first() else {
        return false;
    };
    let width = match lead {
        0xC2..=0xDF => 2,
        0xE0..=0xEF => 3,
        0xF0..=0xF4 => 4,
        _ => return false,
    };
    if tail.len() >= width {
        return false;
    }
    // `utf8_chunks` reports an invalid chunk that ends the buffer as the longest prefix that
    // could still be valid, so a short chunk from a valid lead byte is an incomplete character;
    // check the second byte's range anyway (it is what distinguishes E0/ED/F0/F4 prefixes).
    match (lead, tail.get(1)) {
        (_, None) => true,
        (0xE0, Some(b)) => (0xA0..=0xBF).contains(b),
        (0xED, Some(b)) => (0x80..=0x9F).contains(b),
        (0xF0, Some(b)) => (0x90..=0xBF).contains(b),
        (0xF4, Some(b)) => (0x80..=0x8F).contains(b),
        (_, Some(b)) => (0x80..=0xBF).contains(b),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn incomplete_tails_are_recognised() {
        assert!(could_complete(&[0xF0, 0x9F]));
        assert!(could_complete(&[0xE6]));
        assert!(!could_complete(&[0xFF]));
        assert!(!could_complete(&[0x80]));
        assert!(!could_complete(&[0xE0, 0x80]));
        assert!(!could_complete(&[0xC3, 0xA9]));
    }
}
