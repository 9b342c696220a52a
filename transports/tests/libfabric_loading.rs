//! libfabric is loaded at the first fabric call, not with the process, and
//! loading it leaves the process's signal handlers as they were. A file of
//! its own: it needs a process that has not loaded the library yet.

use efabus_transports::fabric::{
    load_libfabric, probe_like_fi_info, EpKind, LIBFABRIC_LOADED_AT_FIRST_USE,
};

fn libfabric_mapped() -> bool {
    std::fs::read_to_string("/proc/self/maps")
        .expect("read /proc/self/maps")
        .contains("libfabric.so")
}

/// Set by the C library itself on every action it installs (its return
/// trampoline), so a handler put back by `sigaction` differs from one
/// never touched only by this flag.
const SA_RESTORER: i32 = 0x0400_0000;

/// Each standard signal's handler and flags.
fn signal_handlers() -> Vec<(i32, usize, i32)> {
    (1..32)
        .filter(|&sig| sig != libc::SIGKILL && sig != libc::SIGSTOP)
        .map(|sig| {
            // SAFETY: a zeroed sigaction is a valid out-parameter; a null
            // new action only reads the current one.
            let mut action: libc::sigaction = unsafe { std::mem::zeroed() };
            let read = unsafe { libc::sigaction(sig, std::ptr::null(), &mut action) };
            assert_eq!(read, 0, "sigaction({sig})");
            (sig, action.sa_sigaction, action.sa_flags & !SA_RESTORER)
        })
        .collect()
}

#[test]
fn libfabric_is_loaded_at_first_use_and_keeps_the_signal_handlers() {
    if !LIBFABRIC_LOADED_AT_FIRST_USE {
        eprintln!("skipping: this build links libfabric (or has none)");
        return;
    }
    assert!(
        !libfabric_mapped(),
        "libfabric was loaded before any fabric call"
    );
    let handlers = signal_handlers();

    let loaded = load_libfabric().expect("libfabric loads");
    assert!(libfabric_mapped());
    // It says which file it is, and that file is on this host.
    assert!(loaded.path.contains("libfabric.so"), "{loaded}");
    assert!(std::path::Path::new(&loaded.path).exists(), "{loaded}");
    assert!(loaded.version >= (1, 17), "{loaded}");
    assert!(loaded.built_with >= (1, 17), "{loaded}");
    // psm, which distribution builds pull in, installs handlers for
    // SIGINT, SIGTERM, SIGSEGV, SIGILL and others as it loads.
    assert_eq!(
        signal_handlers(),
        handlers,
        "loading libfabric changed the signal handlers"
    );
    // The library found serves calls: `udp` is built into every libfabric.
    let entries = probe_like_fi_info("udp", EpKind::Dgram, Some("127.0.0.1")).expect("fi_getinfo");
    assert!(!entries.is_empty());
    // The first `fi_getinfo` starts libfabric's providers.
    assert_eq!(
        signal_handlers(),
        handlers,
        "starting libfabric's providers changed the signal handlers"
    );
}
