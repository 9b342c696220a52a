//! Message headers in NATS's form: a header block that starts with a
//! version line (`NATS/1.0`, optionally a status code and description) and
//! holds `Name: value` lines, each ended by CRLF, then an empty line.
//!
//! Brokers carry a block as it was published (see [`crate::codec`]'s
//! `FLAG_HEADERS`); this module builds and reads blocks for applications,
//! and checks the ones that arrive from NATS clients.

use bytes::Bytes;
use thiserror::Error;

/// The version line every block starts with.
pub const VERSION_LINE: &str = "NATS/1.0";
/// The block a request gets back when nothing is subscribed to its
/// subject (status 503, as NATS sends it).
pub const NO_RESPONDERS: &[u8] = b"NATS/1.0 503\r\n\r\n";

/// Why bytes are not a header block.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum HeadersError {
    /// The block does not start with [`VERSION_LINE`].
    #[error("headers do not start with NATS/1.0")]
    Version,
    /// The block does not end with an empty line (CRLF CRLF).
    #[error("headers do not end with an empty line")]
    Unterminated,
    /// A line is not `Name: value`, or a name holds a space or colon.
    #[error("header line {0:?} is not `Name: value`")]
    Line(String),
    /// The status after the version is not a three-digit code.
    #[error("header status {0:?} is not a three-digit code")]
    Status(String),
    /// The block is not UTF-8.
    #[error("headers are not UTF-8")]
    Utf8,
}

/// A parsed or built header block.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Headers {
    status: Option<u16>,
    description: String,
    entries: Vec<(String, String)>,
}

impl Headers {
    /// An empty block (version line only).
    pub fn new() -> Self {
        Self::default()
    }

    /// Add a header; a name may appear more than once.
    pub fn insert(&mut self, name: impl Into<String>, value: impl Into<String>) -> &mut Self {
        self.entries.push((name.into(), value.into()));
        self
    }

    /// The first value of `name` (names compare exactly, as NATS's own
    /// clients compare them).
    pub fn get(&self, name: &str) -> Option<&str> {
        self.entries
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    /// Every value of `name`, in order.
    pub fn get_all<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a str> + 'a {
        self.entries
            .iter()
            .filter(move |(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    /// Every header, in order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &str)> {
        self.entries.iter().map(|(n, v)| (n.as_str(), v.as_str()))
    }

    /// The status code of the version line (503 for "no responders").
    pub fn status(&self) -> Option<u16> {
        self.status
    }

    /// The status's description, empty when there is none.
    pub fn description(&self) -> &str {
        &self.description
    }

    /// Set the status code and description of the version line.
    pub fn set_status(&mut self, code: u16, description: impl Into<String>) -> &mut Self {
        self.status = Some(code);
        self.description = description.into();
        self
    }

    /// The block on the wire.
    pub fn to_block(&self) -> Bytes {
        let mut text = String::from(VERSION_LINE);
        if let Some(code) = self.status {
            text.push_str(&format!(" {code:03}"));
            if !self.description.is_empty() {
                text.push(' ');
                text.push_str(&self.description);
            }
        }
        text.push_str("\r\n");
        for (name, value) in &self.entries {
            text.push_str(name);
            text.push_str(": ");
            text.push_str(value);
            text.push_str("\r\n");
        }
        text.push_str("\r\n");
        Bytes::from(text)
    }

    /// Read a block.
    pub fn parse(block: &[u8]) -> Result<Headers, HeadersError> {
        check_block(block)?;
        let text = std::str::from_utf8(block).map_err(|_| HeadersError::Utf8)?;
        let mut lines = text[..text.len() - 4].split("\r\n");
        let first = lines.next().unwrap_or_default();
        let mut headers = Headers::new();
        let rest = first[VERSION_LINE.len()..].trim_start();
        if !rest.is_empty() {
            let (code, description) = rest.split_once(' ').unwrap_or((rest, ""));
            let valid = code.len() == 3 && code.bytes().all(|b| b.is_ascii_digit());
            let status = code.parse().ok().filter(|_| valid);
            let status = status.ok_or_else(|| HeadersError::Status(code.to_string()))?;
            headers.set_status(status, description.trim());
        }
        for line in lines {
            let (name, value) = line
                .split_once(':')
                .filter(|(name, _)| valid_name(name))
                .ok_or_else(|| HeadersError::Line(line.to_string()))?;
            headers.insert(name, value.trim());
        }
        Ok(headers)
    }
}

fn valid_name(name: &str) -> bool {
    !name.is_empty() && name.bytes().all(|b| b.is_ascii_graphic() && b != b':')
}

/// Check the frame of a block (version line first, empty line last)
/// without reading its lines: what a broker checks before carrying one.
pub fn check_block(block: &[u8]) -> Result<(), HeadersError> {
    if !block.starts_with(VERSION_LINE.as_bytes()) {
        return Err(HeadersError::Version);
    }
    // The version line's own CRLF and the empty line's.
    if block.len() < VERSION_LINE.len() + 4 || !block.ends_with(b"\r\n\r\n") {
        return Err(HeadersError::Unterminated);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_built_block_parses_back() {
        let mut headers = Headers::new();
        headers.insert("Trace-Id", "abc").insert("Trace-Id", "def");
        headers.insert("X", "1 2");
        let block = headers.to_block();
        assert_eq!(
            &block[..],
            b"NATS/1.0\r\nTrace-Id: abc\r\nTrace-Id: def\r\nX: 1 2\r\n\r\n"
        );
        let back = Headers::parse(&block).expect("parses");
        assert_eq!(back, headers);
        assert_eq!(back.get_all("Trace-Id").collect::<Vec<_>>(), ["abc", "def"]);
        assert_eq!(back.get("x"), None, "names compare exactly");
    }

    #[test]
    fn status_lines_parse() {
        let no = Headers::parse(NO_RESPONDERS).expect("parses");
        assert_eq!((no.status(), no.description()), (Some(503), ""));
        let idle = Headers::parse(b"NATS/1.0 100 Idle Heartbeat\r\n\r\n").expect("parses");
        assert_eq!(
            (idle.status(), idle.description()),
            (Some(100), "Idle Heartbeat")
        );
        let mut built = Headers::new();
        built.set_status(503, "");
        assert_eq!(&built.to_block()[..], NO_RESPONDERS);
    }

    #[test]
    fn malformed_blocks_are_refused() {
        assert_eq!(
            Headers::parse(b"HTTP/1.1\r\n\r\n"),
            Err(HeadersError::Version)
        );
        assert_eq!(
            Headers::parse(b"NATS/1.0\r\n"),
            Err(HeadersError::Unterminated)
        );
        assert_eq!(Headers::parse(b"NATS/1.0"), Err(HeadersError::Unterminated));
        assert!(matches!(
            Headers::parse(b"NATS/1.0\r\nno colon\r\n\r\n"),
            Err(HeadersError::Line(_))
        ));
        assert!(matches!(
            Headers::parse(b"NATS/1.0 5x3\r\n\r\n"),
            Err(HeadersError::Status(_))
        ));
        assert_eq!(
            Headers::parse(b"NATS/1.0\r\nA: \xff\r\n\r\n"),
            Err(HeadersError::Utf8)
        );
    }
}
