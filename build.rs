//! Gives the shared library a versioned soname (libglake.so.MAJOR, or .0.MINOR before 1.0), so
//! that the installed package can carry the usual version symlinks. Only when `GLAKE_SONAME` is
//! set (the CMake build sets it): cargo passes a dependency's cdylib link arguments on to the
//! cdylibs that depend on it, and libgmlake.so must not take glake's soname.

fn main() {
    let major = std::env::var("CARGO_PKG_VERSION_MAJOR").unwrap_or_else(|_| "0".into());
    let minor = std::env::var("CARGO_PKG_VERSION_MINOR").unwrap_or_else(|_| "0".into());
    let soversion = if major == "0" {
        format!("0.{minor}")
    } else {
        major
    };
    println!("cargo:rerun-if-env-changed=GLAKE_SONAME");
    let wanted = std::env::var_os("GLAKE_SONAME").is_some();
    if wanted && std::env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("linux") {
        println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libglake.so.{soversion}");
    }
    println!("cargo:rerun-if-changed=build.rs");
}
