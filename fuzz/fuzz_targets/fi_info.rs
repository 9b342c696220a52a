//! The `fi_info -v` parser on arbitrary text: it never panics, errors name
//! a line of the input, and what it accepts prints in the fi_info layout
//! and parses back to the same infos.

#![no_main]

use efabus_core::caps::{parse_fi_info_dump, to_fi_info_text};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    match parse_fi_info_dump(text) {
        Ok(infos) => {
            let printed = to_fi_info_text(&infos);
            let again = parse_fi_info_dump(&printed);
            assert_eq!(again.as_ref(), Ok(&infos), "printed:\n{printed}");
        }
        Err(err) => {
            assert!(
                err.line >= 1 && err.line <= text.lines().count().max(1) + 1,
                "{err}"
            );
        }
    }
});
