//! Added (special / control) tokens matched literally in the text before pre-tokenisation.
//!
//! `<|im_start|>`, `<|im_end|>`, `<|endoftext|>` and the other control tokens are never produced
//! by BPE merges; when their text appears literally in the input it maps to their id, as Hugging
//! Face's `AddedVocabulary` does. Matching is leftmost-longest: scanning left to right, the
//! first position where some token matches wins, and among tokens matching there the longest.
//! `lstrip` / `rstrip` tokens also swallow the whitespace on that side (never across an earlier
//! match). Text between matches is returned for ordinary encoding.
//!
//! Cost: a 256-entry first-byte filter, then one `starts_with` per token whose first byte
//! matches; O(text length × matching tokens), negligible next to BPE for the handful of control
//! tokens real vocabularies have.

/// One added token.
#[derive(Debug, Clone)]
pub(crate) struct AddedToken {
    /// The literal text that maps to the token.
    pub(crate) content: String,
    /// The token's id.
    pub(crate) id: u32,
    /// Swallow whitespace to the left of a match.
    pub(crate) lstrip: bool,
    /// Swallow whitespace to the right of a match.
    pub(crate) rstrip: bool,
}

/// A span of text after added-token splitting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Segment<'a> {
    /// Ordinary text, to be pre-tokenised and BPE-encoded.
    Text(&'a str),
    /// A literal occurrence of an added token.
    Added(u32),
}

/// The set of added tokens of a vocabulary.
#[derive(Debug, Clone)]
pub(crate) struct AddedTokens {
    /// Longest first, so the first match at a position is the longest.
    tokens: Vec<AddedToken>,
    first_byte: [bool; 256],
}

impl AddedTokens {
    /// A matcher over `tokens` (empty contents are ignored: they would match everywhere).
    pub(crate) fn new(mut tokens: Vec<AddedToken>) -> Self {
        tokens.retain(|t| !t.content.is_empty());
        tokens.sort_by(|a, b| b.content.len().cmp(&a.content.len()).then(a.id.cmp(&b.id)));
        let mut first_byte = [false; 256];
        for t in &tokens {
            first_byte[t.content.as_bytes()[0] as usize] = true;
        }
        Self { tokens, first_byte }
    }

    /// Whether `id` is one of the added tokens.
    pub(crate) fn contains_id(&self, id: u32) -> bool {
        self.tokens.iter().any(|t| t.id == id)
    }

    /// Split `text` into ordinary text and added-token occurrences, in order.
    pub(crate) fn split<'a>(&self, text: &'a str) -> Vec<Segment<'a>> {
        let mut segments = Vec::new();
        let bytes = text.as_bytes();
        let mut done = 0; // end of the last emitted segment
        let mut i = 0;
        while i < bytes.len() {
            if !self.first_byte[bytes[i] as usize] {
                i += 1;
                continue;
            }
            let Some(token) = self
                .tokens
                .iter()
                .find(|t| text[i..].starts_with(t.content.as_str()))
            else {
                i += 1;
                continue;
            };
            let mut start = i;
            let mut end = i + token.content.len();
            if token.lstrip {
                start = done + text[done..start].trim_end().len();
            }
            if token.rstrip {
                end = text.len() - text[end..].trim_start().len();
            }
            if start > done {
                segments.push(Segment::Text(&text[done..start]));
            }
            segments.push(Segment::Added(token.id));
            done = end;
            i = end;
        }
        if done < text.len() {
            segments.push(Segment::Text(&text[done..]));
        }
        segments
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn token(content: &str, id: u32) -> AddedToken {
        AddedToken {
            content: content.to_owned(),
            id,
            lstrip: false,
            rstrip: false,
        }
    }

    #[test]
    fn control_tokens_split_out_of_text() {
        let added = AddedTokens::new(vec![token("<|im_start|>", 1), token("<|im_end|>", 2)]);
        assert_eq!(
            added.split("<|im_start|>user\nhi<|im_end|>\n"),
            [
                Segment::Added(1),
                Segment::Text("user\nhi"),
                Segment::Added(2),
                Segment::Text("\n")
            ]
        );
        assert_eq!(added.split("<|im_sta"), [Segment::Text("<|im_sta")]);
        assert_eq!(added.split(""), []);
    }

    #[test]
    fn longest_token_wins_at_the_same_position() {
        let added = AddedTokens::new(vec![token("<a>", 5), token("<a><b>", 6)]);
        assert_eq!(
            added.split("x<a><b>"),
            [Segment::Text("x"), Segment::Added(6)]
        );
        assert_eq!(
            added.split("<a><c>"),
            [Segment::Added(5), Segment::Text("<c>")]
        );
    }

    #[test]
    fn strip_flags_swallow_adjacent_whitespace() {
        let mut t = token("<mask>", 9);
        t.lstrip = true;
        t.rstrip = true;
        let added = AddedTokens::new(vec![t]);
        assert_eq!(
            added.split("a  <mask> \tb"),
            [Segment::Text("a"), Segment::Added(9), Segment::Text("b")]
        );
        assert!(added.contains_id(9));
        assert!(!added.contains_id(1));
    }
}
