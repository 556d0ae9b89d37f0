//! Builds tests/abi.cpp against this crate's libgmlake.so with the system C++ compiler and
//! runs it on the host backend: the library called exactly as PyTorch calls it, C++ exceptions
//! and std::function filters included.

mod common;

#[test]
fn pytorch_calling_convention_on_the_host_backend() {
    let binary = common::build("abi.cpp", "gmlake_abi", &[]);
    common::run(&binary, &[], "plug-in ABI checks passed");
}
