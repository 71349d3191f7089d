//! The checked-in header is what cbindgen makes of this crate.

#[test]
fn header_is_current() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    // Needs the source tree (the GPU suite's run.sh skips it in the bundle).
    assert!(
        dir.join("cbindgen.toml").exists(),
        "{} is not here: this test runs from the source tree",
        dir.display()
    );
    let config = cbindgen::Config::from_file(dir.join("cbindgen.toml")).expect("cbindgen.toml");
    let bindings = cbindgen::Builder::new()
        .with_config(config)
        .with_src(dir.join("src/lib.rs"))
        .generate()
        .expect("cbindgen could not generate the header");
    let mut made = Vec::new();
    bindings.write(&mut made);
    let made = String::from_utf8(made).unwrap();
    let path = dir.join("include/ferrite.h");
    if std::env::var("FERRITE_BLESS").is_ok_and(|v| v == "1") {
        std::fs::write(&path, &made).unwrap();
        return;
    }
    let have = std::fs::read_to_string(&path).unwrap_or_default();
    if have != made {
        let line = have
            .lines()
            .zip(made.lines())
            .position(|(a, b)| a != b)
            .unwrap_or(have.lines().count().min(made.lines().count()));
        panic!(
            "crates/ferrite-capi/include/ferrite.h is not what cbindgen makes of src/ (first \
             difference at line {}). Refresh it with\n    FERRITE_BLESS=1 cargo test -p \
             ferrite-capi header\nand commit the result.",
            line + 1
        );
    }
}
