//! Pre-tokenisation: cutting text into the pieces that BPE then encodes one at a time.
//!
//! A [`PreTokenizer`] is a sequence of steps, each of which splits every current piece further,
//! exactly like Hugging Face's `pre_tokenizers.Sequence`:
//! - [`PreStep::Digits`]: HF `Digits` — numeric characters (`char::is_numeric`, i.e. Unicode
//!   Nd/Nl/No) isolated one by one (`individual_digits`) or as runs.
//! - [`PreStep::Split`]: HF `Split(Regex, Isolated)` and the regex of HF `ByteLevel(use_regex)`:
//!   matches and the gaps between them both become pieces; each piece is matched on its own, so
//!   the end of a piece is the end of the haystack.
//!
//! The GPT-2 family of patterns ends in `\s+(?!\S)|\s+`. The `regex` crate has no lookahead, so
//! that tail is rewritten to one named group `(?P<ws>\s+)` and the lookahead is applied by hand:
//! a greedy `\s+` match always ends at a non-space or at the end of the piece; when it ends at a
//! non-space and spans more than one character, `\s+(?!\S)` would have backtracked by exactly one
//! character, so the match is shortened by its last character (a one-character run falls through
//! to plain `\s+` and is kept). Any other lookaround is rejected when the pattern is compiled.
//!
//! Cost: one regex scan per piece per step, O(text length); pieces are byte ranges into the
//! original text, so no strings are copied.

use std::ops::Range;

use regex::Regex;

use super::error::TokenizerError;

/// GPT-2's pre-tokenizer regex (HF `ByteLevel(use_regex=true)`), used by SmolLM2 after `Digits`.
pub(crate) const GPT2_PATTERN: &str =
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";

/// Llama-3's pre-tokenizer regex (also llama.cpp's `llama-bpe`).
pub(crate) const LLAMA3_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The lookahead tail that [`SplitRegex`] emulates.
const LOOKAHEAD_TAIL: &str = r"\s+(?!\S)|\s+";
/// Name of the group that replaces [`LOOKAHEAD_TAIL`].
const WS_GROUP: &str = "tandem_ws";

/// A compiled split regex with the `\s+(?!\S)` emulation described in the module docs.
#[derive(Debug, Clone)]
pub(crate) struct SplitRegex {
    re: Regex,
    /// Whether the pattern had the lookahead tail (and so has the [`WS_GROUP`] group).
    emulates_lookahead: bool,
}

impl SplitRegex {
    /// Compile `pattern`, rewriting its `\s+(?!\S)|\s+` tail; other lookaround is an error.
    pub(crate) fn new(pattern: &str) -> Result<Self, TokenizerError> {
        let emulates_lookahead = pattern.contains(LOOKAHEAD_TAIL);
        let rewritten = pattern.replace(LOOKAHEAD_TAIL, &format!(r"(?P<{WS_GROUP}>\s+)"));
        if ["(?!", "(?=", "(?<=", "(?<!"]
            .iter()
            .any(|l| rewritten.contains(l))
        {
            return Err(TokenizerError::BadRegex {
                pattern: pattern.to_owned(),
                reason: r"lookaround other than a trailing `\s+(?!\S)|\s+`".to_owned(),
            });
        }
        let re = Regex::new(&rewritten).map_err(|e| TokenizerError::BadRegex {
            pattern: pattern.to_owned(),
            reason: e.to_string(),
        })?;
        Ok(Self {
            re,
            emulates_lookahead,
        })
    }

    /// Split `piece` (which starts at byte `base` of the text) into matches and gaps.
    fn split(&self, piece: &str, base: usize, out: &mut Vec<Range<usize>>) {
        let mut pos = 0;
        let mut search = 0;
        while search < piece.len() {
            let Some(m) = self.re.find_at(piece, search) else {
                break;
            };
            let (start, mut end) = (m.start(), m.end());
            if start == end {
                // An empty match splits nothing; step over one character (HF ignores them too).
                search = end + piece[end..].chars().next().map_or(1, char::len_utf8);
                continue;
            }
            if self.emulates_lookahead && end < piece.len() && self.matched_ws_tail(piece, start) {
                let last = piece[start..end]
                    .chars()
                    .next_back()
                    .map_or(0, char::len_utf8);
                if end - last > start {
                    end -= last;
                }
            }
            if start > pos {
                out.push(base + pos..base + start);
            }
            out.push(base + start..base + end);
            pos = end;
            search = end;
        }
        if pos < piece.len() {
            out.push(base + pos..base + piece.len());
        }
    }

    /// Whether the match starting at `start` came from the rewritten `\s+` tail.
    fn matched_ws_tail(&self, piece: &str, start: usize) -> bool {
        // Only an all-whitespace match can come from the tail; check cheaply before captures.
        let rest = &piece[start..];
        if !rest.starts_with(char::is_whitespace) {
            return false;
        }
        self.re
            .captures_at(piece, start)
            .is_some_and(|c| c.name(WS_GROUP).is_some())
    }
}

/// One step of a [`PreTokenizer`].
#[derive(Debug, Clone)]
pub(crate) enum PreStep {
    /// Isolate numeric characters: each one alone (`individual`) or as contiguous runs.
    Digits {
        /// One piece per numeric character rather than per run.
        individual: bool,
    },
    /// Split on a regex, keeping matches and gaps as pieces.
    Split(SplitRegex),
}

impl PreStep {
    fn split(&self, piece: &str, base: usize, out: &mut Vec<Range<usize>>) {
        match self {
            Self::Split(re) => re.split(piece, base, out),
            Self::Digits { individual } => {
                let mut run_start = 0;
                let mut run_numeric = false;
                for (i, c) in piece.char_indices() {
                    let numeric = c.is_numeric();
                    let boundary =
                        i > run_start && (numeric != run_numeric || (numeric && *individual));
                    if boundary {
                        out.push(base + run_start..base + i);
                        run_start = i;
                    }
                    if i == run_start {
                        run_numeric = numeric;
                    }
                }
                if run_start < piece.len() {
                    out.push(base + run_start..base + piece.len());
                }
            }
        }
    }
}

/// A sequence of pre-tokenisation steps (see the module docs).
#[derive(Debug, Clone)]
pub(crate) struct PreTokenizer {
    steps: Vec<PreStep>,
}

impl PreTokenizer {
    /// A pre-tokenizer running `steps` in order.
    pub(crate) fn new(steps: Vec<PreStep>) -> Self {
        Self { steps }
    }

    /// SmolLM2 / StarCoder: `Digits(individual_digits=true)` then the GPT-2 regex.
    pub(crate) fn smollm() -> Self {
        Self::new(vec![
            PreStep::Digits { individual: true },
            Self::regex_step(GPT2_PATTERN),
        ])
    }

    /// GPT-2: the GPT-2 regex alone.
    pub(crate) fn gpt2() -> Self {
        Self::new(vec![Self::regex_step(GPT2_PATTERN)])
    }

    /// Llama-3: the Llama-3 regex alone.
    pub(crate) fn llama3() -> Self {
        Self::new(vec![Self::regex_step(LLAMA3_PATTERN)])
    }

    fn regex_step(pattern: &str) -> PreStep {
        PreStep::Split(SplitRegex::new(pattern).expect("built-in pre-tokenizer patterns compile"))
    }

    /// Cut `text` into pieces, returned as byte ranges of `text` in order, covering all of it.
    pub(crate) fn split(&self, text: &str) -> Vec<Range<usize>> {
        let mut pieces: Vec<Range<usize>> = Vec::new();
        if !text.is_empty() {
            pieces.push(0..text.len());
        }
        for step in &self.steps {
            let mut next = Vec::with_capacity(pieces.len() * 2);
            for r in pieces {
                step.split(&text[r.clone()], r.start, &mut next);
            }
            pieces = next;
        }
        pieces
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pieces<'a>(pre: &PreTokenizer, text: &'a str) -> Vec<&'a str> {
        pre.split(text).into_iter().map(|r| &text[r]).collect()
    }

    #[test]
    fn whitespace_run_before_a_word_leaves_one_space_for_the_word() {
        let pre = PreTokenizer::gpt2();
        assert_eq!(pieces(&pre, "x   a"), ["x", "  ", " a"]);
        assert_eq!(pieces(&pre, "a  \n\tc"), ["a", "  \n", "\t", "c"]);
        assert_eq!(pieces(&pre, "end   "), ["end", "   "]);
        assert_eq!(pieces(&pre, "\na"), ["\n", "a"]);
    }

    #[test]
    fn nbsp_is_whitespace_like_in_oniguruma() {
        let pre = PreTokenizer::gpt2();
        assert_eq!(pieces(&pre, "\u{a0}\u{a0}b"), ["\u{a0}", "\u{a0}", "b"]);
    }

    #[test]
    fn contractions_and_punctuation_split_like_gpt2() {
        let pre = PreTokenizer::gpt2();
        assert_eq!(pieces(&pre, "it's OK!!"), ["it", "'s", " OK", "!!"]);
        assert_eq!(pieces(&pre, "'S'sok"), ["'", "S", "'s", "ok"]);
    }

    #[test]
    fn smollm_isolates_every_numeric_character() {
        let pre = PreTokenizer::smollm();
        assert_eq!(pieces(&pre, "x 123"), ["x", " ", "1", "2", "3"]);
        assert_eq!(pieces(&pre, "a½b٣Ⅻ"), ["a", "½", "b", "٣", "Ⅻ"]);
    }

    #[test]
    fn digit_runs_stay_together_without_individual_digits() {
        let pre = PreTokenizer::new(vec![PreStep::Digits { individual: false }]);
        assert_eq!(pieces(&pre, "ab12cd3"), ["ab", "12", "cd", "3"]);
    }

    #[test]
    fn llama3_groups_digits_in_threes_and_newlines_together() {
        let pre = PreTokenizer::llama3();
        assert_eq!(pieces(&pre, "1234567 x"), ["123", "456", "7", " x"]);
        assert_eq!(pieces(&pre, "a \n\nb"), ["a", " \n\n", "b"]);
    }

    #[test]
    fn pieces_cover_the_text_without_gaps() {
        let pre = PreTokenizer::smollm();
        let text = "Héllo,  wörld 42!\t\n 日本語 🎉🎉 it'll";
        let ranges = pre.split(text);
        let mut pos = 0;
        for r in &ranges {
            assert_eq!(r.start, pos);
            assert!(r.end > r.start);
            pos = r.end;
        }
        assert_eq!(pos, text.len());
    }

    #[test]
    fn other_lookaround_is_rejected() {
        let err = SplitRegex::new(r"a(?=b)").unwrap_err();
        assert!(matches!(err, TokenizerError::BadRegex { .. }), "{err}");
    }
}
