//! Property tests for the `fi_info -v` parser: mutated real dumps and
//! arbitrary text never make it panic, and whatever it accepts prints and
//! parses back to the same values.

use efabus_core::caps::{parse_fi_info_dump, to_fi_info_text};
use proptest::prelude::*;

const FIXTURES: [&str; 3] = [
    include_str!("fixtures/efa-fi_info-v.txt"),
    include_str!("fixtures/libfabric-1.17-udp-dgram-lo.txt"),
    include_str!("fixtures/libfabric-1.17-sockets-rdm-lo.txt"),
];

/// One edit to a dump, with positions taken modulo the current size.
#[derive(Debug, Clone)]
enum Edit {
    DeleteLine(usize),
    DuplicateLine(usize),
    SwapLines(usize, usize),
    Indent(usize, bool),
    SetChar(usize, usize, char),
    InsertText(usize, usize, String),
    TruncateLine(usize, usize),
    InsertLine(usize, String),
}

fn edit() -> impl Strategy<Value = Edit> {
    let text = "[ -~é]{0,12}";
    let chars = prop::sample::select(vec![
        ':', ' ', '[', ']', ',', '-', '0', '9', 'x', 'F', '_', '(', ')', '.', 'é', '\t',
    ]);
    prop_oneof![
        any::<usize>().prop_map(Edit::DeleteLine),
        any::<usize>().prop_map(Edit::DuplicateLine),
        (any::<usize>(), any::<usize>()).prop_map(|(a, b)| Edit::SwapLines(a, b)),
        (any::<usize>(), any::<bool>()).prop_map(|(a, more)| Edit::Indent(a, more)),
        (any::<usize>(), any::<usize>(), chars).prop_map(|(l, c, ch)| Edit::SetChar(l, c, ch)),
        (any::<usize>(), any::<usize>(), text).prop_map(|(l, c, s)| Edit::InsertText(l, c, s)),
        (any::<usize>(), any::<usize>()).prop_map(|(l, c)| Edit::TruncateLine(l, c)),
        (any::<usize>(), "( {0,20})[a-z_]{1,10}: [ -~]{0,10}")
            .prop_map(|(l, s)| Edit::InsertLine(l, s)),
    ]
}

/// Byte index of the `n`th char boundary of `line` (modulo its length).
fn boundary(line: &str, n: usize) -> usize {
    let bounds: Vec<usize> = line
        .char_indices()
        .map(|(i, _)| i)
        .chain([line.len()])
        .collect();
    bounds[n % bounds.len()]
}

fn apply(lines: &mut Vec<String>, edit: &Edit) {
    if lines.is_empty() {
        return;
    }
    let n = lines.len();
    match edit {
        Edit::DeleteLine(i) => {
            lines.remove(i % n);
        }
        Edit::DuplicateLine(i) => {
            let line = lines[i % n].clone();
            lines.insert(i % n, line);
        }
        Edit::SwapLines(a, b) => lines.swap(a % n, b % n),
        Edit::Indent(i, more) => {
            let line = &mut lines[i % n];
            if *more {
                line.insert(0, ' ');
            } else if line.starts_with(' ') {
                line.remove(0);
            }
        }
        Edit::SetChar(i, c, ch) => {
            let line = &mut lines[i % n];
            let at = boundary(line, *c);
            let end = line[at..]
                .chars()
                .next()
                .map_or(at, |old| at + old.len_utf8());
            line.replace_range(at..end, &ch.to_string());
        }
        Edit::InsertText(i, c, text) => {
            let line = &mut lines[i % n];
            let at = boundary(line, *c);
            line.insert_str(at, text);
        }
        Edit::TruncateLine(i, c) => {
            let line = &mut lines[i % n];
            let at = boundary(line, *c);
            line.truncate(at);
        }
        Edit::InsertLine(i, text) => lines.insert(i % (n + 1), text.clone()),
    }
}

/// An edit that keeps the layout valid but puts in values this build has
/// never seen: new flag names, enum names, numbers, unknown fields.
#[derive(Debug, Clone)]
enum ValueEdit {
    AddFlag(usize, String),
    SetEnum(usize, String),
    SetNumber(usize, u8),
    AddField(usize, String, String),
}

fn value_edit() -> impl Strategy<Value = ValueEdit> {
    let name = "FI_[A-Z][A-Z_]{0,12}";
    prop_oneof![
        (any::<usize>(), name).prop_map(|(i, n)| ValueEdit::AddFlag(i, n)),
        (any::<usize>(), name).prop_map(|(i, n)| ValueEdit::SetEnum(i, n)),
        (any::<usize>(), any::<u8>()).prop_map(|(i, v)| ValueEdit::SetNumber(i, v)),
        (any::<usize>(), "[a-z][a-z_]{0,12}", "[ -~]{0,16}")
            .prop_map(|(i, k, v)| ValueEdit::AddField(i, format!("zz_{k}"), v)),
    ]
}

/// Apply to the first line from `start` (cyclically) that the edit fits;
/// `nth` is the edit's place among those applied, which keeps the fields
/// edits add apart (two of one name in one block are rightly refused).
fn apply_value_edit(lines: &mut [String], edit: &ValueEdit, nth: usize) {
    let n = lines.len();
    let start = match edit {
        ValueEdit::AddFlag(i, _)
        | ValueEdit::SetEnum(i, _)
        | ValueEdit::SetNumber(i, _)
        | ValueEdit::AddField(i, _, _) => i % n,
    };
    for k in 0..n {
        let at = (start + k) % n;
        let line = &lines[at];
        let Some((key, value)) = line.split_once(": ") else {
            continue;
        };
        let replaced = match edit {
            ValueEdit::AddFlag(_, flag) if value.starts_with('[') && value.ends_with(" ]") => {
                let inner = value[1..value.len() - 2].trim();
                if inner.is_empty() {
                    format!("{key}: [ {flag} ]")
                } else {
                    format!("{key}: [ {inner}, {flag} ]")
                }
            }
            ValueEdit::SetEnum(_, name) if value.starts_with("FI_") => format!("{key}: {name}"),
            ValueEdit::SetNumber(_, v) if value.parse::<u64>().is_ok() => format!("{key}: {v}"),
            ValueEdit::AddField(_, k2, v2) if !value.is_empty() => {
                let indent = &line[..line.len() - line.trim_start().len()];
                format!("{line}\n{indent}{k2}{nth}: {v2}")
            }
            _ => continue,
        };
        lines[at] = replaced;
        return;
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    #[test]
    fn mutated_dumps_never_panic_and_accepted_ones_round_trip(
        which in 0..FIXTURES.len(),
        edits in prop::collection::vec(edit(), 1..6),
    ) {
        let mut lines: Vec<String> = FIXTURES[which].lines().map(str::to_string).collect();
        for e in &edits {
            apply(&mut lines, e);
        }
        let text = lines.join("\n");
        match parse_fi_info_dump(&text) {
            Ok(infos) => {
                let printed = to_fi_info_text(&infos);
                let again = parse_fi_info_dump(&printed);
                prop_assert_eq!(again.as_ref(), Ok(&infos), "printed:\n{}", printed);
            }
            Err(err) => {
                prop_assert!(err.line >= 1 && err.line <= lines.len().max(1) + 1, "{}", err);
                prop_assert!(!err.expected.is_empty());
            }
        }
    }

    #[test]
    fn unseen_values_round_trip(
        which in 0..FIXTURES.len(),
        edits in prop::collection::vec(value_edit(), 1..8),
    ) {
        let mut lines: Vec<String> = FIXTURES[which].lines().map(str::to_string).collect();
        for (nth, e) in edits.iter().enumerate() {
            apply_value_edit(&mut lines, e, nth);
        }
        let text = lines.join("\n");
        let infos = parse_fi_info_dump(&text);
        prop_assert!(infos.is_ok(), "{:?}\n{}", infos, text);
        let infos = infos.unwrap_or_default();
        let printed = to_fi_info_text(&infos);
        prop_assert_eq!(parse_fi_info_dump(&printed), Ok(infos));
    }

    #[test]
    fn arbitrary_text_never_panics(text in "(fi_info:\n)?[ -~\n\t]{0,400}") {
        let _ = parse_fi_info_dump(&text);
    }
}

#[test]
fn deep_indentation_is_refused_without_exhausting_the_stack() {
    let mut text = String::from("fi_info:\n");
    for depth in 1..2_000 {
        text.push_str(&" ".repeat(depth));
        text.push_str("k:\n");
    }
    let err = parse_fi_info_dump(&text).expect_err("far too deep");
    assert!(err.expected.contains("levels of indentation"), "{err}");
}
