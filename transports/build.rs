//! Finds libfabric >= 1.17 and compiles the C shim around its inline API.
//!
//! Search order: pkg-config, then `EFABUS_LIBFABRIC_DIR` (a prefix with
//! `include/` and `lib/` or `lib64/`), then `/opt/amazon/efa` (the EFA
//! installer's prefix). When none is usable the crate still builds without
//! the `efabus_libfabric` cfg, and the fabric transport reports at run time
//! why it is unavailable. `EFABUS_DISABLE_LIBFABRIC=1` forces that build.
//!
//! The library is not linked: the shim loads it at the first fabric call
//! (`dlopen`), so a process that never touches the fabric does not pay for
//! loading it (the distribution builds pull in psm, whose constructor
//! spends about 200 ms timing the CPU). The few functions libfabric exports
//! (the rest of its API is inline) are looked up at the symbol versions
//! that linking against these headers would have bound, so a newer library
//! serves them as it would a linked program. For headers newer than the
//! table below knows, or a prefix without `libfabric.so.1`, the library is
//! linked as before.

use std::env;
use std::fs;
use std::path::{Path, PathBuf};

const MIN_MAJOR: u32 = 1;
const MIN_MINOR: u32 = 17;
const EFA_PREFIX: &str = "/opt/amazon/efa";

/// Where libfabric was found: header directories, library directories
/// (empty: the linker's and loader's own), its version, and how it was
/// found.
struct Found {
    include_dirs: Vec<PathBuf>,
    lib_dirs: Vec<PathBuf>,
    version: (u32, u32),
    origin: String,
}

/// The symbol version `fi_getinfo`, `fi_freeinfo` and `fi_dupinfo` have by
/// default in libfabric's releases (`DEFAULT_SYMVER`/`CURRENT_ABI` in its
/// sources), which is what a program linked against that release's headers
/// binds: the struct layouts those headers describe. `None` past the last
/// release known here.
fn info_symbol_version((major, minor): (u32, u32)) -> Option<&'static str> {
    match (major, minor) {
        (1, 17..=19) => Some("FABRIC_1.3"),
        (1, 20..=22) => Some("FABRIC_1.7"),
        (2, 0..=4) => Some("FABRIC_1.8"),
        (2, 5..=6) => Some("FABRIC_1.9"),
        _ => None,
    }
}

fn main() {
    println!("cargo::rustc-check-cfg=cfg(efabus_libfabric)");
    println!("cargo::rustc-check-cfg=cfg(efabus_libfabric_at_first_use)");
    println!("cargo::rerun-if-changed=csrc/shim.c");
    println!("cargo::rerun-if-changed=csrc/shim.h");
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rerun-if-env-changed=EFABUS_LIBFABRIC_DIR");
    println!("cargo::rerun-if-env-changed=EFABUS_DISABLE_LIBFABRIC");
    println!("cargo::rerun-if-env-changed=PKG_CONFIG_PATH");

    let mut tried = Vec::new();
    let found = if disabled() {
        tried.push("disabled by EFABUS_DISABLE_LIBFABRIC".to_string());
        None
    } else {
        find(&mut tried)
    };

    match found {
        Some(found) => {
            let mut build = cc::Build::new();
            build.file("csrc/shim.c").include("csrc").warnings(true);
            for dir in &found.include_dirs {
                build.include(dir);
            }
            let (major, minor) = found.version;
            build.define("EFABUS_FI_HEADER_MAJOR", major.to_string().as_str());
            build.define("EFABUS_FI_HEADER_MINOR", minor.to_string().as_str());
            // The loader opens libfabric.so.1: a directory holding only
            // libfabric.so or libfabric.a is linked against instead.
            let loaded_at_first_use = info_symbol_version(found.version).filter(|_| {
                found
                    .lib_dirs
                    .first()
                    .is_none_or(|dir| dir.join("libfabric.so.1").exists())
            });
            if let Some(symbol_version) = loaded_at_first_use {
                build.define(
                    "EFABUS_FI_INFO_ABI",
                    format!("\"{symbol_version}\"").as_str(),
                );
                if let Some(dir) = found.lib_dirs.first() {
                    build.define(
                        "EFABUS_FI_LIBRARY_DIR",
                        format!("{:?}", dir.display().to_string()).as_str(),
                    );
                }
            }
            build.compile("efabus_fi_shim");
            // After the shim, so static-before-shared link order resolves it.
            if loaded_at_first_use.is_some() {
                // dlopen lives in libc from glibc 2.34, in libdl before.
                println!("cargo::rustc-link-lib=dl");
                println!("cargo::rustc-cfg=efabus_libfabric_at_first_use");
            } else {
                for dir in &found.lib_dirs {
                    println!("cargo::rustc-link-search=native={}", dir.display());
                    // This package's own tests and examples run without
                    // LD_LIBRARY_PATH.
                    println!("cargo::rustc-link-arg=-Wl,-rpath,{}", dir.display());
                }
                println!("cargo::rustc-link-lib=fabric");
                println!(
                    "cargo::warning=libfabric {major}.{minor} is linked, so every process loads \
                     it as it starts: loading it at first use needs a release up to 2.6 (whose \
                     symbol versions efabus knows) and a libfabric.so.1"
                );
            }
            println!("cargo::rustc-cfg=efabus_libfabric");
            println!("cargo::rustc-env=EFABUS_LIBFABRIC_ORIGIN={}", found.origin);
        }
        None => {
            let reason = format!(
                "libfabric >= {MIN_MAJOR}.{MIN_MINOR} not found at build time ({}): \
                 install libfabric-dev or set EFABUS_LIBFABRIC_DIR",
                tried.join("; ")
            );
            println!("cargo::rustc-env=EFABUS_LIBFABRIC_MISSING={reason}");
            println!("cargo::warning={reason}");
        }
    }
}

fn disabled() -> bool {
    env::var("EFABUS_DISABLE_LIBFABRIC")
        .map(|v| !v.is_empty() && v != "0")
        .unwrap_or(false)
}

fn find(tried: &mut Vec<String>) -> Option<Found> {
    let min = format!("{MIN_MAJOR}.{MIN_MINOR}");
    match pkg_config::Config::new()
        .atleast_version(&min)
        .cargo_metadata(false)
        // System directories left out (Debian's .pc names them): the
        // loader's own search, LD_LIBRARY_PATH first, finds the library.
        .print_system_libs(false)
        .print_system_cflags(false)
        .probe("libfabric")
    {
        Ok(lib) => match dotted_version(&lib.version) {
            Some(version) => {
                return Some(Found {
                    include_dirs: lib.include_paths.clone(),
                    lib_dirs: lib.link_paths.clone(),
                    version,
                    origin: format!("pkg-config libfabric {}", lib.version),
                })
            }
            None => tried.push(format!("pkg-config: version {:?} unreadable", lib.version)),
        },
        Err(err) => tried.push(format!("pkg-config: {}", first_line(&err.to_string()))),
    }

    if let Ok(dir) = env::var("EFABUS_LIBFABRIC_DIR") {
        match from_prefix(Path::new(&dir)) {
            Ok(found) => return Some(found),
            Err(why) => tried.push(format!("EFABUS_LIBFABRIC_DIR={dir}: {why}")),
        }
    } else {
        tried.push("EFABUS_LIBFABRIC_DIR unset".to_string());
    }

    match from_prefix(Path::new(EFA_PREFIX)) {
        Ok(found) => Some(found),
        Err(why) => {
            tried.push(format!("{EFA_PREFIX}: {why}"));
            None
        }
    }
}

/// Uses a prefix holding `include/rdma/fabric.h` and `lib*/libfabric.so`.
fn from_prefix(prefix: &Path) -> Result<Found, String> {
    let include = prefix.join("include");
    let header = include.join("rdma").join("fabric.h");
    let text = fs::read_to_string(&header).map_err(|e| format!("{}: {e}", header.display()))?;
    let (major, minor) = header_version(&text)
        .ok_or_else(|| format!("{}: no FI_MAJOR/MINOR_VERSION", header.display()))?;
    if (major, minor) < (MIN_MAJOR, MIN_MINOR) {
        return Err(format!("headers are libfabric {major}.{minor}"));
    }
    let lib_dir = ["lib", "lib64"]
        .iter()
        .map(|d| prefix.join(d))
        .find(|d| {
            ["libfabric.so.1", "libfabric.so", "libfabric.a"]
                .iter()
                .any(|file| d.join(file).exists())
        })
        .ok_or_else(|| "no libfabric.so.1, .so or .a in lib/ or lib64/".to_string())?;
    Ok(Found {
        include_dirs: vec![include],
        lib_dirs: vec![lib_dir],
        version: (major, minor),
        origin: format!("{} (libfabric {major}.{minor})", prefix.display()),
    })
}

fn header_version(text: &str) -> Option<(u32, u32)> {
    let value = |name: &str| {
        text.lines().find_map(|line| {
            let rest = line.trim().strip_prefix("#define")?.trim();
            let rest = rest.strip_prefix(name)?;
            rest.trim().parse::<u32>().ok()
        })
    };
    Some((value("FI_MAJOR_VERSION")?, value("FI_MINOR_VERSION")?))
}

/// "1.17.0" as (1, 17).
fn dotted_version(text: &str) -> Option<(u32, u32)> {
    let mut parts = text.split('.');
    Some((parts.next()?.parse().ok()?, parts.next()?.parse().ok()?))
}

fn first_line(text: &str) -> &str {
    text.lines().next().unwrap_or(text)
}
