//! What the bench binaries share: telling a measuring run from a test run.

/// Whether criterion runs this binary as a test (`cargo test --benches`,
/// `cargo test --all-targets`, or `cargo bench -- --test`): each benchmark
/// then runs once, unmeasured, so the benches only need small inputs.
///
/// Criterion decides the same way: `cargo bench` passes `--bench`, and
/// without it (or with `--test` besides) the run is a test.
pub fn test_mode() -> bool {
    let mut bench = false;
    let mut test = false;
    for arg in std::env::args().skip(1) {
        match arg.as_str() {
            "--bench" => bench = true,
            "--test" => test = true,
            _ => {}
        }
    }
    !bench || test
}
