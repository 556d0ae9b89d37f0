//! Helpers of the C++ tests: each is a program built against this crate's libgmlake.so with the
//! system C++ compiler and run on the host backend.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// Where Cargo builds the cdylib for tests: next to the test executable (target/<profile>/deps).
pub fn library_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    exe.parent().expect("deps directory").to_path_buf()
}

/// Compiles `tests/<source>` (C++17, warnings on) into `name`, linked to libgmlake.so, with
/// `includes` (relative to the workspace root) on the include path.
pub fn build(source: &str, name: &str, includes: &[&str]) -> PathBuf {
    let lib = library_dir();
    assert!(
        lib.join("libgmlake.so").is_file(),
        "libgmlake.so missing in {}",
        lib.display()
    );
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let source = crate_dir.join("tests").join(source);
    let binary = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(name);
    let compiler = std::env::var("CXX").unwrap_or_else(|_| "c++".to_string());
    let mut command = Command::new(&compiler);
    command.args(["-std=c++17", "-Wall", "-Wextra", "-pthread", "-o"]);
    command.arg(&binary).arg(&source);
    for include in includes {
        command.arg(format!(
            "-I{}",
            crate_dir.join("..").join(include).display()
        ));
    }
    let built = command
        .arg(format!("-L{}", lib.display()))
        .arg(format!("-Wl,-rpath,{}", lib.display()))
        .arg("-lgmlake")
        .status()
        .expect("a C++ compiler (set CXX)");
    assert!(built.success(), "compiling {}", source.display());
    binary
}

/// Runs `binary` with `args` on the host backend (1 GiB of device memory), asserting that it
/// succeeds and prints `expected`. The library of this build comes first on the search path:
/// `cargo test` puts target/<profile> on `LD_LIBRARY_PATH`, which outranks the binary's
/// run path, and the libgmlake.so of an earlier `cargo build` there may be stale.
pub fn run(binary: &Path, args: &[&str], expected: &str) -> Output {
    let mut search = std::ffi::OsString::from(library_dir());
    if let Some(rest) = std::env::var_os("LD_LIBRARY_PATH") {
        search.push(":");
        search.push(rest);
    }
    let output = Command::new(binary)
        .args(args)
        .env("LD_LIBRARY_PATH", search)
        .env("GLAKE_BACKEND", "host")
        .env("GLAKE_HOST_MEMORY", "1G")
        .output()
        .expect("running a C++ test");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "{} {args:?}\nstdout:\n{stdout}\nstderr:\n{stderr}",
        binary.display()
    );
    assert!(stdout.contains(expected), "stdout:\n{stdout}");
    output
}
