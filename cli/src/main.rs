//! The `efabus` command: see `efabus --help`. This crate owns the command
//! line, built on the public API of efabus-broker: [`cli`] parses the
//! arguments and runs `serve`, `pub`, `sub` and `req`, [`caps`] runs
//! `caps`, [`bench`] runs `bench`, and [`monitor`] runs `stats` and
//! `conns` against a broker's monitoring listener. It also sets the process's allocator.

mod bench;
mod caps;
mod cli;
mod monitor;

use clap::Parser;
use cli::{run, Cli};

/// jemalloc gives freed memory back to the system within seconds (glibc's
/// allocator keeps most of it mapped), so a broker's footprint falls back
/// after a burst of peers or a slow consumer's backlog.
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

fn main() {
    // Before any thread exists: the environment is process-wide.
    efabus_transports::fabric::apply_provider_env_defaults();
    // Background threads return freed pages on their own clock; without
    // them jemalloc only does so while the process keeps allocating, so an
    // idle broker would hold on to its peak.
    if let Err(err) = tikv_jemalloc_ctl::background_thread::write(true) {
        eprintln!("efabus: warning: jemalloc background threads unavailable: {err}");
    }
    let cli = Cli::parse();
    if let Err(failure) = run(cli) {
        eprintln!("efabus: error: {}", failure.message);
        std::process::exit(failure.code);
    }
}
