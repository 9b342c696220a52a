//! Finds libfabric >= 1.17 and compiles the C shim around its inline API.
//!
//! Search order: pkg-config, then `EFABUS_LIBFABRIC_DIR` (a prefix with
//! `include/` and `lib/` or `lib64/`), then `/opt/amazon/efa` (the EFA
//! installer's prefix). When none is usable the crate still builds without
//! the `efabus_libfabric` cfg, and the fabric transport reports at run time
//! why it is unavailable. `EFABUS_DISABLE_LIBFABRIC=1` forces that build.

use std::env;
use std::fs;
use std::path::{Path, PathBuf};

const MIN_MAJOR: u32 = 1;
const MIN_MINOR: u32 = 17;
const EFA_PREFIX: &str = "/opt/amazon/efa";

/// Where libfabric was found: header directories, and how it was found.
struct Found {
    include_dirs: Vec<PathBuf>,
    origin: String,
}

fn main() {
    println!("cargo::rustc-check-cfg=cfg(efabus_libfabric)");
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
            build.compile("efabus_fi_shim");
            // After the shim, so static-before-shared link order resolves it.
            println!("cargo::rustc-link-lib=fabric");
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
        .probe("libfabric")
    {
        Ok(lib) => {
            // Debian's .pc has no -I: its headers are on the default path.
            return Some(Found {
                include_dirs: lib.include_paths.clone(),
                origin: format!("pkg-config libfabric {}", lib.version),
            });
        }
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
        .find(|d| d.join("libfabric.so").exists() || d.join("libfabric.a").exists())
        .ok_or_else(|| "no lib/libfabric.so or lib64/libfabric.so".to_string())?;
    println!("cargo::rustc-link-search=native={}", lib_dir.display());
    // Lets this package's own tests and examples run without LD_LIBRARY_PATH.
    println!("cargo::rustc-link-arg=-Wl,-rpath,{}", lib_dir.display());
    Ok(Found {
        include_dirs: vec![include],
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

fn first_line(text: &str) -> &str {
    text.lines().next().unwrap_or(text)
}
