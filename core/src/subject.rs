//! Subject and pattern syntax: validation, limits and the reference matcher.
//!
//! This module owns the rules for what a subject is, shared by every part of
//! efabus that accepts one (publish, subscribe, the wire codec, the index).
//!
//! # Syntax
//!
//! A subject is a sequence of *tokens* separated by `.`, e.g. `metrics.host7.cpu`.
//!
//! - Tokens are non-empty: `a..b`, `.a` and `a.` are invalid.
//! - Tokens contain no whitespace (any Unicode white space, including `' '`,
//!   `'\t'`, `'\r'`, `'\n'`) and no NUL.
//! - Two tokens are wildcards, and only when they make up a *whole* token:
//!   - `*` matches exactly one token;
//!   - `>` matches one or more trailing tokens and may only be the last token.
//!
//!   As in NATS, `*` or `>` inside a longer token is an ordinary character:
//!   `a*`, `*b`, `>>` and `a>` are literal tokens, valid both in subjects and
//!   in patterns, and they only match themselves.
//! - A *subject* (what a message is published on) must be literal: no
//!   wildcard tokens. A *pattern* (what a subscription asks for) may contain
//!   wildcard tokens.
//!
//! Lengths are counted in bytes of the UTF-8 encoding. Both limits are
//! configuration ([`SubjectLimits`]) with safe defaults.
//!
//! # Validation order
//!
//! Checks run from the cheapest to the most detailed, and the first failing
//! one is reported: length, emptiness, token count, then each token from the
//! left (empty, NUL, whitespace, wildcard placement). So an over-long subject
//! is reported as [`SubjectError::TooLong`] whatever its content.

use thiserror::Error;

/// The token separator.
pub const SEPARATOR: char = '.';
/// The single-token wildcard.
pub const SINGLE_WILDCARD: &str = "*";
/// The trailing multi-token wildcard.
pub const FULL_WILDCARD: &str = ">";
/// What reply subjects start with (`_INBOX.<inbox>.<token>`), as NATS
/// clients and efabus's own make them.
pub const INBOX_PREFIX: &str = "_INBOX.";

/// Size limits applied to subjects, patterns and queue names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SubjectLimits {
    /// Largest accepted length in bytes.
    pub max_len: usize,
    /// Largest accepted number of tokens.
    pub max_tokens: usize,
}

impl SubjectLimits {
    /// Default [`max_len`](Self::max_len): 512 bytes.
    pub const DEFAULT_MAX_LEN: usize = 512;
    /// Default [`max_tokens`](Self::max_tokens): 32 tokens.
    pub const DEFAULT_MAX_TOKENS: usize = 32;
}

impl Default for SubjectLimits {
    fn default() -> Self {
        Self {
            max_len: Self::DEFAULT_MAX_LEN,
            max_tokens: Self::DEFAULT_MAX_TOKENS,
        }
    }
}

/// Why a subject or pattern was rejected. Token indexes count from 0.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum SubjectError {
    /// The subject is the empty string.
    #[error("subject is empty")]
    Empty,
    /// Two separators in a row, or a separator at either end.
    #[error("token {index} is empty")]
    EmptyToken {
        /// Index of the empty token.
        index: usize,
    },
    /// A token contains a white space character.
    #[error("token {index} contains white space {ch:?}")]
    Whitespace {
        /// Index of the offending token.
        index: usize,
        /// The first white space character found in it.
        ch: char,
    },
    /// A token contains a NUL character.
    #[error("token {index} contains a NUL character")]
    Nul {
        /// Index of the offending token.
        index: usize,
    },
    /// A subject to publish on contains a wildcard token.
    #[error("token {index} is a wildcard, which a publish subject cannot contain")]
    WildcardInSubject {
        /// Index of the wildcard token.
        index: usize,
    },
    /// A `>` token is not the last token.
    #[error("token {index} is '>', which is only allowed as the last token")]
    FullWildcardNotLast {
        /// Index of the misplaced `>`.
        index: usize,
    },
    /// Longer than [`SubjectLimits::max_len`].
    #[error("subject is {len} bytes long, the limit is {max}")]
    TooLong {
        /// Length in bytes.
        len: usize,
        /// The configured limit.
        max: usize,
    },
    /// More tokens than [`SubjectLimits::max_tokens`].
    #[error("subject has {tokens} tokens, the limit is {max}")]
    TooDeep {
        /// Number of tokens.
        tokens: usize,
        /// The configured limit.
        max: usize,
    },
}

/// Why a queue group name was rejected.
///
/// A queue name is a single opaque word: non-empty, at most
/// [`SubjectLimits::max_len`] bytes, without white space or NUL. Dots and
/// wildcard characters have no meaning in it and are allowed.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum QueueNameError {
    /// The queue name is the empty string.
    #[error("queue name is empty")]
    Empty,
    /// The name contains a white space character at byte `offset`.
    #[error("queue name contains white space {ch:?} at byte {offset}")]
    Whitespace {
        /// Byte offset of the character.
        offset: usize,
        /// The white space character.
        ch: char,
    },
    /// The name contains a NUL character at byte `offset`.
    #[error("queue name contains a NUL character at byte {offset}")]
    Nul {
        /// Byte offset of the character.
        offset: usize,
    },
    /// Longer than [`SubjectLimits::max_len`].
    #[error("queue name is {len} bytes long, the limit is {max}")]
    TooLong {
        /// Length in bytes.
        len: usize,
        /// The configured limit.
        max: usize,
    },
}

/// One token of a pattern, classified.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Token<'a> {
    /// A token that only matches itself.
    Literal(&'a str),
    /// `*`: exactly one token.
    Single,
    /// `>`: one or more trailing tokens.
    Full,
}

impl<'a> Token<'a> {
    /// Classifies one token (whole-token rule: only `*` and `>` themselves are wildcards).
    pub fn classify(token: &'a str) -> Self {
        match token {
            SINGLE_WILDCARD => Token::Single,
            FULL_WILDCARD => Token::Full,
            other => Token::Literal(other),
        }
    }

    /// True for `*` and `>`.
    pub fn is_wildcard(self) -> bool {
        !matches!(self, Token::Literal(_))
    }
}

/// Splits a subject or pattern into classified tokens.
///
/// No validation is done; use it on validated input.
pub fn tokens(s: &str) -> impl Iterator<Item = Token<'_>> + '_ {
    s.split(SEPARATOR).map(Token::classify)
}

/// Checks a subject to publish on: valid syntax, within limits, no wildcards.
pub fn validate_subject(subject: &str, limits: &SubjectLimits) -> Result<(), SubjectError> {
    validate(subject, limits, false)
}

/// Checks a subscription pattern: valid syntax, within limits, `>` only last.
pub fn validate_pattern(pattern: &str, limits: &SubjectLimits) -> Result<(), SubjectError> {
    validate(pattern, limits, true)
}

/// Checks a queue group name (see [`QueueNameError`] for the rules).
pub fn validate_queue_name(name: &str, limits: &SubjectLimits) -> Result<(), QueueNameError> {
    if name.len() > limits.max_len {
        return Err(QueueNameError::TooLong {
            len: name.len(),
            max: limits.max_len,
        });
    }
    if name.is_empty() {
        return Err(QueueNameError::Empty);
    }
    for (offset, ch) in name.char_indices() {
        if ch == '\0' {
            return Err(QueueNameError::Nul { offset });
        }
        if ch.is_whitespace() {
            return Err(QueueNameError::Whitespace { offset, ch });
        }
    }
    Ok(())
}

/// True when `subject` is a reply inbox: each request has its own, so
/// it is matched once or twice and never again.
pub fn is_inbox(subject: &str) -> bool {
    subject.starts_with(INBOX_PREFIX)
}

/// True when `s` contains no wildcard token (it may still be invalid).
pub fn is_literal(s: &str) -> bool {
    !tokens(s).any(Token::is_wildcard)
}

fn validate(s: &str, limits: &SubjectLimits, allow_wildcards: bool) -> Result<(), SubjectError> {
    if s.len() > limits.max_len {
        return Err(SubjectError::TooLong {
            len: s.len(),
            max: limits.max_len,
        });
    }
    if s.is_empty() {
        return Err(SubjectError::Empty);
    }
    // Counting separators is a byte scan; it bounds the work before the
    // per-token checks below.
    let count = s.bytes().filter(|&b| b == b'.').count() + 1;
    if count > limits.max_tokens {
        return Err(SubjectError::TooDeep {
            tokens: count,
            max: limits.max_tokens,
        });
    }
    for (index, token) in s.split(SEPARATOR).enumerate() {
        if token.is_empty() {
            return Err(SubjectError::EmptyToken { index });
        }
        check_chars(token, index)?;
        match Token::classify(token) {
            Token::Literal(_) => {}
            _ if !allow_wildcards => return Err(SubjectError::WildcardInSubject { index }),
            Token::Full if index + 1 != count => {
                return Err(SubjectError::FullWildcardNotLast { index })
            }
            _ => {}
        }
    }
    Ok(())
}

fn check_chars(token: &str, index: usize) -> Result<(), SubjectError> {
    // Fast path for the common token made of visible ASCII only; anything
    // else (controls, non-ASCII) gets the full Unicode check.
    if token.bytes().all(|b| b.is_ascii_graphic()) {
        return Ok(());
    }
    for ch in token.chars() {
        if ch == '\0' {
            return Err(SubjectError::Nul { index });
        }
        if ch.is_whitespace() {
            return Err(SubjectError::Whitespace { index, ch });
        }
    }
    Ok(())
}

/// The reference matcher: does `pattern` match the literal `subject`?
///
/// A direct, token-by-token reading of the rules, kept simple on purpose: the
/// index is tested against it. Both inputs are expected to be valid (see
/// [`validate_pattern`], [`validate_subject`]); on invalid input the answer
/// is unspecified, but the function never panics.
pub fn pattern_matches(pattern: &str, subject: &str) -> bool {
    let mut subject_tokens = subject.split(SEPARATOR);
    for token in tokens(pattern) {
        match token {
            // `>` needs at least one remaining token.
            Token::Full => return subject_tokens.next().is_some(),
            Token::Single => {
                if subject_tokens.next().is_none() {
                    return false;
                }
            }
            Token::Literal(lit) => {
                if subject_tokens.next() != Some(lit) {
                    return false;
                }
            }
        }
    }
    subject_tokens.next().is_none()
}

/// Whether every subject `inner` matches, `outer` matches too (both
/// valid patterns): `orders.>` covers `orders.*.eu` and `orders.eu`, `*.eu`
/// covers `orders.eu` but not `orders.>`.
pub fn pattern_covers(outer: &str, inner: &str) -> bool {
    let outer: Vec<Token<'_>> = tokens(outer).collect();
    let inner: Vec<Token<'_>> = tokens(inner).collect();
    for (i, token) in outer.iter().enumerate() {
        match (token, inner.get(i)) {
            // `>` covers one or more tokens of anything.
            (Token::Full, Some(_)) => return true,
            (_, None) | (_, Some(Token::Full)) => return false,
            (Token::Single, Some(_)) => {}
            (Token::Literal(a), Some(Token::Literal(b))) if a == b => {}
            (Token::Literal(_), Some(_)) => return false,
        }
    }
    outer.len() == inner.len()
}

/// Whether some subject matches both patterns (both valid): `orders.*`
/// and `*.secret` overlap on `orders.secret`; `orders.eu` and `orders.us`
/// do not.
pub fn patterns_overlap(a: &str, b: &str) -> bool {
    let a: Vec<Token<'_>> = tokens(a).collect();
    let b: Vec<Token<'_>> = tokens(b).collect();
    let mut i = 0;
    loop {
        match (a.get(i), b.get(i)) {
            (None, None) => return true,
            // `>` takes the rest, as long as at least one token is left.
            (Some(Token::Full), Some(_)) | (Some(_), Some(Token::Full)) => return true,
            (None, Some(_)) | (Some(_), None) => return false,
            (Some(Token::Literal(x)), Some(Token::Literal(y))) if x != y => return false,
            _ => i += 1,
        }
    }
}

/// A validated subscription pattern.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Pattern(Box<str>);

impl Pattern {
    /// Validates `pattern` against `limits` and keeps it.
    pub fn parse(pattern: &str, limits: &SubjectLimits) -> Result<Self, SubjectError> {
        validate_pattern(pattern, limits)?;
        Ok(Self(pattern.into()))
    }

    /// The pattern text.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The classified tokens.
    pub fn tokens(&self) -> impl Iterator<Item = Token<'_>> + '_ {
        tokens(&self.0)
    }

    /// True when the pattern has no wildcard token (it matches one subject).
    pub fn is_literal(&self) -> bool {
        is_literal(&self.0)
    }

    /// Whether this pattern matches the literal `subject` (reference matcher).
    pub fn matches(&self, subject: &str) -> bool {
        pattern_matches(&self.0, subject)
    }
}

impl std::fmt::Display for Pattern {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl AsRef<str> for Pattern {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn covering_and_overlapping_patterns() {
        let covers = [
            ("orders.>", "orders.eu", true),
            ("orders.>", "orders.*.eu", true),
            ("orders.>", "orders.>", true),
            ("orders.>", "orders", false),
            ("orders.*", "orders.eu", true),
            ("orders.*", "orders.>", false),
            ("orders.*", "orders.eu.x", false),
            ("*.eu", "orders.eu", true),
            ("orders.eu", "orders.*", false),
            ("orders.eu", "orders.eu", true),
            (">", "anything.at.all", true),
        ];
        for (outer, inner, want) in covers {
            assert_eq!(pattern_covers(outer, inner), want, "{outer} covers {inner}");
        }
        let overlaps = [
            ("orders.*", "*.secret", true),
            ("orders.eu", "orders.us", false),
            ("orders.>", "orders.secret", true),
            ("orders.>", "orders", false),
            ("orders.*", "orders.a.b", false),
            ("a.>", "*.b.c", true),
            ("a.b", "a.b.c", false),
            (">", "x", true),
        ];
        for (a, b, want) in overlaps {
            assert_eq!(patterns_overlap(a, b), want, "{a} overlaps {b}");
            assert_eq!(patterns_overlap(b, a), want, "{b} overlaps {a}");
        }
    }

    proptest::proptest! {
        /// The two agree with the reference matcher on concrete subjects:
        /// a subject both patterns match means they overlap, and one the
        /// inner matches but the outer does not means no cover.
        #[test]
        fn covers_and_overlaps_agree_with_matching(
            a in "(x|y|\\*)(\\.(x|y|\\*)){0,2}(\\.>)?",
            b in "(x|y|\\*)(\\.(x|y|\\*)){0,2}(\\.>)?",
            subject in "(x|y|z)(\\.(x|y|z)){0,4}",
        ) {
            let (in_a, in_b) = (pattern_matches(&a, &subject), pattern_matches(&b, &subject));
            if in_a && in_b {
                proptest::prop_assert!(patterns_overlap(&a, &b));
            }
            if in_b && !in_a {
                proptest::prop_assert!(!pattern_covers(&a, &b));
            }
        }
    }

    fn lim() -> SubjectLimits {
        SubjectLimits::default()
    }

    #[test]
    fn defaults() {
        assert_eq!(lim().max_len, 512);
        assert_eq!(lim().max_tokens, 32);
    }

    #[test]
    fn valid_subjects() {
        for s in [
            "a",
            "a.b.c",
            "metrics.host7.cpu",
            "a*.b>",
            ">>",
            "**",
            "é.ü",
            "a-b_c:d",
        ] {
            assert_eq!(validate_subject(s, &lim()), Ok(()), "{s}");
            assert_eq!(validate_pattern(s, &lim()), Ok(()), "{s}");
        }
    }

    #[test]
    fn valid_patterns() {
        for p in ["*", ">", "a.*", "a.>", "*.*.>", "a.*.c", "*.b.>"] {
            assert_eq!(validate_pattern(p, &lim()), Ok(()), "{p}");
        }
    }

    #[test]
    fn empty_subject_and_tokens() {
        assert_eq!(validate_subject("", &lim()), Err(SubjectError::Empty));
        assert_eq!(validate_pattern("", &lim()), Err(SubjectError::Empty));
        let cases = [
            (".", 0),
            (".a", 0),
            ("a.", 1),
            ("a..b", 1),
            ("a.b.", 2),
            ("*..>", 1),
        ];
        for (s, index) in cases {
            assert_eq!(
                validate_pattern(s, &lim()),
                Err(SubjectError::EmptyToken { index }),
                "{s:?}"
            );
        }
    }

    #[test]
    fn whitespace_and_nul() {
        let cases = [
            ("a b", 0, ' '),
            ("a.b\tc", 1, '\t'),
            ("a.b.\r", 2, '\r'),
            ("\n", 0, '\n'),
            ("a.x\u{a0}y", 1, '\u{a0}'),
            ("a.\u{2003}", 1, '\u{2003}'),
            ("a.\u{b}", 1, '\u{b}'),
        ];
        for (s, index, ch) in cases {
            assert_eq!(
                validate_subject(s, &lim()),
                Err(SubjectError::Whitespace { index, ch }),
                "{s:?}"
            );
        }
        assert_eq!(
            validate_subject("a.b\0", &lim()),
            Err(SubjectError::Nul { index: 1 })
        );
        // Other control characters are not white space and are accepted.
        assert_eq!(validate_subject("a\u{1}", &lim()), Ok(()));
    }

    #[test]
    fn wildcards_in_subjects() {
        assert_eq!(
            validate_subject("a.*", &lim()),
            Err(SubjectError::WildcardInSubject { index: 1 })
        );
        assert_eq!(
            validate_subject(">", &lim()),
            Err(SubjectError::WildcardInSubject { index: 0 })
        );
        assert_eq!(
            validate_subject("a.b.>", &lim()),
            Err(SubjectError::WildcardInSubject { index: 2 })
        );
    }

    #[test]
    fn full_wildcard_must_be_last() {
        assert_eq!(
            validate_pattern(">.a", &lim()),
            Err(SubjectError::FullWildcardNotLast { index: 0 })
        );
        assert_eq!(
            validate_pattern("a.>.>", &lim()),
            Err(SubjectError::FullWildcardNotLast { index: 1 })
        );
    }

    #[test]
    fn limits() {
        let l = SubjectLimits {
            max_len: 8,
            max_tokens: 3,
        };
        assert_eq!(validate_subject("abcdefgh", &l), Ok(()));
        assert_eq!(
            validate_subject("abcdefghi", &l),
            Err(SubjectError::TooLong { len: 9, max: 8 })
        );
        assert_eq!(validate_subject("a.b.c", &l), Ok(()));
        assert_eq!(
            validate_pattern("a.b.c.>", &l),
            Err(SubjectError::TooDeep { tokens: 4, max: 3 })
        );
        // Length is checked first, then depth, then the tokens.
        assert_eq!(
            validate_subject("a b......", &l),
            Err(SubjectError::TooLong { len: 9, max: 8 })
        );
        assert_eq!(
            validate_subject("a b....", &l),
            Err(SubjectError::TooDeep { tokens: 5, max: 3 })
        );
        // Length counts bytes, not characters.
        assert_eq!(
            validate_subject("ééééé", &l),
            Err(SubjectError::TooLong { len: 10, max: 8 })
        );
    }

    #[test]
    fn queue_names() {
        assert_eq!(validate_queue_name("workers", &lim()), Ok(()));
        assert_eq!(validate_queue_name("a.b*>", &lim()), Ok(()));
        assert_eq!(validate_queue_name("", &lim()), Err(QueueNameError::Empty));
        assert_eq!(
            validate_queue_name("ab c", &lim()),
            Err(QueueNameError::Whitespace { offset: 2, ch: ' ' })
        );
        assert_eq!(
            validate_queue_name("a\0", &lim()),
            Err(QueueNameError::Nul { offset: 1 })
        );
        let long = "q".repeat(513);
        assert_eq!(
            validate_queue_name(&long, &lim()),
            Err(QueueNameError::TooLong { len: 513, max: 512 })
        );
    }

    #[test]
    fn reference_matcher() {
        let yes = [
            ("a", "a"),
            ("a.b", "a.b"),
            ("*", "a"),
            ("a.*", "a.b"),
            ("*.b", "a.b"),
            ("*.*", "a.b"),
            (">", "a"),
            (">", "a.b.c"),
            ("a.>", "a.b"),
            ("a.>", "a.b.c"),
            ("a.*.>", "a.b.c"),
            ("a*", "a*"),
            ("a.>>", "a.>>"),
        ];
        let no = [
            ("a", "b"),
            ("a", "a.b"),
            ("a.b", "a"),
            ("*", "a.b"),
            ("a.*", "a"),
            ("a.*", "a.b.c"),
            ("a.>", "a"),
            ("a.*.>", "a.b"),
            ("a*", "ab"),
            ("a*", "a"),
            ("a.>>", "a.b"),
        ];
        for (p, s) in yes {
            assert!(pattern_matches(p, s), "{p} should match {s}");
        }
        for (p, s) in no {
            assert!(!pattern_matches(p, s), "{p} should not match {s}");
        }
    }

    #[test]
    fn tokens_and_pattern_type() {
        let toks: Vec<_> = tokens("a.*.b*.>").collect();
        assert_eq!(
            toks,
            [
                Token::Literal("a"),
                Token::Single,
                Token::Literal("b*"),
                Token::Full
            ]
        );
        let p = Pattern::parse("a.*", &lim()).unwrap();
        assert!(!p.is_literal());
        assert!(p.matches("a.x"));
        assert_eq!(p.to_string(), "a.*");
        assert!(Pattern::parse("a*.b>", &lim()).unwrap().is_literal());
        assert_eq!(
            Pattern::parse("a..b", &lim()),
            Err(SubjectError::EmptyToken { index: 1 })
        );
    }
}
