//! The committed C header must equal what cbindgen generates from the sources now.
//! Regenerate with `GLAKE_BLESS=1 cargo test --test header`.

#[test]
fn committed_header_is_current() {
    let dir = env!("CARGO_MANIFEST_DIR");
    let config = cbindgen::Config::from_file(format!("{dir}/cbindgen.toml")).unwrap();
    let bindings = cbindgen::Builder::new()
        .with_crate(dir)
        .with_config(config)
        .generate()
        .unwrap();
    let mut fresh = Vec::new();
    bindings.write(&mut fresh);
    let path = format!("{dir}/include/glake.h");
    if std::env::var_os("GLAKE_BLESS").is_some() {
        std::fs::write(&path, &fresh).unwrap();
    }
    let committed = std::fs::read(&path).unwrap_or_default();
    assert!(
        committed == fresh,
        "include/glake.h is stale: regenerate with `GLAKE_BLESS=1 cargo test --test header`"
    );
}
