//! Shared-memory regions left behind by dead processes.
//!
//! libfabric's `shm` provider names an endpoint's region after its process
//! id (`/dev/shm/PID:N:M`) and will not open an endpoint whose region name
//! exists already: `fi_enable` fails with `-FI_EBUSY`. A process killed
//! before it closed its endpoints leaves its regions behind. A later
//! process that gets the same id then could not open `shm` at all, and its
//! peers would fall back to TCP. Before a `shm` endpoint opens, regions
//! named after this process and older than it are removed: no live process
//! owns them.

use std::path::Path;
use std::time::{Duration, SystemTime};

/// Where the `shm` provider keeps its regions.
const REGIONS: &str = "/dev/shm";

/// Removes this process's stale `shm` regions; returns how many.
pub(crate) fn remove_stale_regions() -> usize {
    match process_start() {
        Some(started) => remove_stale_in(Path::new(REGIONS), std::process::id(), started),
        None => 0,
    }
}

/// Removes the files in `dir` named `PID:...` for `pid` and last modified
/// before `started`.
fn remove_stale_in(dir: &Path, pid: u32, started: SystemTime) -> usize {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    let prefix = format!("{pid}:");
    let mut removed = 0;
    for entry in entries.flatten() {
        let name = entry.file_name();
        if !name.to_str().is_some_and(|name| name.starts_with(&prefix)) {
            continue;
        }
        let stale = entry
            .metadata()
            .and_then(|meta| meta.modified())
            .is_ok_and(|modified| modified < started);
        if stale && std::fs::remove_file(entry.path()).is_ok() {
            tracing::info!(region = ?entry.path(), "removed a shm region a dead process left");
            removed += 1;
        }
    }
    removed
}

/// When this process started, from `/proc`: the boot time (whole seconds,
/// rounded down, so the result is never later than the true start) plus
/// the start's clock ticks after boot (100 per second on Linux's ABI).
fn process_start() -> Option<SystemTime> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // The command name, in parentheses, may hold spaces: count fields after
    // its closing parenthesis. Field 22 (`starttime`) is the 20th there.
    let after_name = &stat[stat.rfind(')')? + 1..];
    let ticks: u64 = after_name.split_whitespace().nth(19)?.parse().ok()?;
    let boot: u64 = std::fs::read_to_string("/proc/stat")
        .ok()?
        .lines()
        .find_map(|line| line.strip_prefix("btime "))?
        .trim()
        .parse()
        .ok()?;
    let since_epoch = Duration::from_secs(boot) + Duration::from_millis(ticks * 10);
    Some(SystemTime::UNIX_EPOCH + since_epoch)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_this_process_s_regions_older_than_it_go() {
        let dir = std::env::temp_dir().join(format!(
            "efabus-stale-shm-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let started = SystemTime::now() - Duration::from_secs(60);
        let old = started - Duration::from_secs(3600);
        for (name, modified) in [
            ("123:0:0", old),
            ("123:1:0", SystemTime::now()),
            ("1234:0:0", old),
            ("x123:0:0", old),
        ] {
            let file = std::fs::File::create(dir.join(name)).unwrap();
            file.set_modified(modified).unwrap();
        }
        assert_eq!(remove_stale_in(&dir, 123, started), 1);
        let mut left: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        left.sort();
        assert_eq!(left, ["1234:0:0", "123:1:0", "x123:0:0"]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn this_process_started_within_the_last_day() {
        let started = process_start().expect("/proc says when");
        let age = SystemTime::now().duration_since(started).unwrap();
        assert!(age < Duration::from_secs(86_400), "{age:?}");
    }
}
