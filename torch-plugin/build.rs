//! Compiles the C++ half of the plug-in: the code that throws C++ exceptions and holds
//! PyTorch's `std::function` stream filters, which Rust cannot do.
fn main() {
    println!("cargo:rerun-if-changed=src/trampoline.cpp");
    println!("cargo:rerun-if-changed=build.rs");
    // Its own soname (programs that link it record this name).
    if std::env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("linux") {
        println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libgmlake.so");
    }
    cc::Build::new()
        .cpp(true)
        .std("c++17")
        .file("src/trampoline.cpp")
        .warnings(true)
        .extra_warnings(true)
        .compile("gmlake_trampoline");
}
