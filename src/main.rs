//! The `efabus` command: see `efabus --help`.

use clap::Parser;
use efabus_broker::cli::{run, Cli};

fn main() {
    let cli = Cli::parse();
    if let Err(failure) = run(cli) {
        eprintln!("efabus: error: {}", failure.message);
        std::process::exit(failure.code);
    }
}
