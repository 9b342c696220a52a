//! `efabus caps`: transport capabilities in fi_info layout.

use clap::Args;

use crate::cli::Failure;

#[derive(Debug, Args)]
pub struct CapsArgs {
    /// Print every attribute, as `fi_info -v` does.
    #[arg(short, long)]
    pub verbose: bool,
}

pub fn run(_args: CapsArgs) -> Result<(), Failure> {
    Ok(())
}
