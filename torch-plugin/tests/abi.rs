//! Builds tests/abi.cpp against this crate's libgmlake.so with the system C++ compiler and
//! runs it on the host backend: the library called exactly as PyTorch calls it, C++ exceptions
//! and std::function filters included.

use std::path::PathBuf;
use std::process::Command;

fn library_dir() -> PathBuf {
    // Cargo builds the cdylib for tests next to the test executable (target/<profile>/deps).
    let exe = std::env::current_exe().expect("test executable path");
    exe.parent().expect("deps directory").to_path_buf()
}

#[test]
fn pytorch_calling_convention_on_the_host_backend() {
    let lib = library_dir();
    assert!(
        lib.join("libgmlake.so").is_file(),
        "libgmlake.so missing in {}",
        lib.display()
    );
    let source = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/abi.cpp");
    let binary = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("gmlake_abi");
    let compiler = std::env::var("CXX").unwrap_or_else(|_| "c++".to_string());
    let built = Command::new(&compiler)
        .args(["-std=c++17", "-Wall", "-Wextra", "-o"])
        .arg(&binary)
        .arg(&source)
        .arg(format!("-L{}", lib.display()))
        .arg(format!("-Wl,-rpath,{}", lib.display()))
        .arg("-lgmlake")
        .status()
        .expect("a C++ compiler (set CXX)");
    assert!(built.success(), "compiling {}", source.display());
    let output = Command::new(&binary)
        .env("GLAKE_BACKEND", "host")
        .env("GLAKE_HOST_MEMORY", "1G")
        .output()
        .expect("running the ABI test");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "stdout:\n{stdout}\nstderr:\n{stderr}"
    );
    assert!(stdout.contains("plug-in ABI checks passed"));
}
