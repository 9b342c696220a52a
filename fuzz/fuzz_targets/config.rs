//! The configuration parser on arbitrary text: it never panics, and a
//! configuration it accepts prints back to TOML that parses to the same
//! configuration.

#![no_main]

use efabus_broker::Config;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(config) = Config::from_toml_str(text, "fuzz.toml") else {
        return;
    };
    // Printing may fail for values TOML cannot hold; what prints must
    // read back the same.
    if let Ok(printed) = toml::to_string(&config) {
        match Config::from_toml_str(&printed, "printed") {
            Ok(again) => assert_eq!(again, config, "printed:\n{printed}"),
            Err(err) => panic!("printed config does not parse: {err}\n{printed}"),
        }
    }
});
