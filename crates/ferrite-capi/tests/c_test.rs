//! The C API from C: builds examples/c/test_capi.c with the system C compiler (`$CC`, else `cc`)
//! against the shared library cargo built for this test run, runs it and expects exit status 0
//! (its checks: matmul, attention and the norms against naive C references on host memory, and
//! bad input answered with error codes whose messages name the argument); then the README's
//! example, examples/c/hello.c.
//!
//! The compile flags come from ferrite.pc.in, filled in for the build tree and read back through
//! `pkg-config` when it is installed (so the pkg-config file is exercised too). The header is
//! also compiled alone as strict C99 and, where a C++ compiler exists, as C++.

use std::path::{Path, PathBuf};
use std::process::Command;

const CRATE: &str = env!("CARGO_MANIFEST_DIR");

/// The folder holding the libferrite_capi.so cargo built for this run: this test executable
/// lives in `<target>/<profile>/deps`, where cargo writes the library (a copy sits one level up).
fn lib_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("the test executable's path");
    let deps = exe.parent().expect("the deps folder");
    let candidates = [
        deps.to_path_buf(),
        deps.parent().unwrap_or(deps).to_path_buf(),
    ];
    let found = candidates
        .iter()
        .filter_map(|d| {
            let so = d.join("libferrite_capi.so");
            let t = std::fs::metadata(&so).and_then(|m| m.modified()).ok()?;
            Some((t, d.clone()))
        })
        .max();
    match found {
        Some((_, d)) => d,
        None => panic!(
            "libferrite_capi.so not found next to {} (looked in {candidates:?})",
            exe.display()
        ),
    }
}

fn compiler(var: &str, default: &str) -> String {
    std::env::var(var)
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| default.to_string())
}

fn run(cmd: &mut Command, what: &str) -> String {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("{what}: could not start {cmd:?}: {e}"));
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{cmd:?}\n{text}",
        out.status
    );
    text
}

/// ferrite.pc for the build tree, written into `dir`.
fn write_pc(dir: &Path, lib: &Path) {
    let include = Path::new(CRATE).join("include");
    let pc = std::fs::read_to_string(Path::new(CRATE).join("ferrite.pc.in"))
        .unwrap()
        .replace("@prefix@", CRATE)
        .replace("@libdir@", &lib.display().to_string())
        .replace("@includedir@", &include.display().to_string())
        .replace("@version@", env!("CARGO_PKG_VERSION"));
    std::fs::write(dir.join("ferrite.pc"), pc).unwrap();
}

/// `cc` flags to compile against ferrite and link its shared library: from pkg-config when it
/// is installed, else the same flags written out.
fn ferrite_flags(pc_dir: &Path, lib: &Path) -> Vec<String> {
    let pkg = Command::new("pkg-config")
        .env("PKG_CONFIG_PATH", pc_dir)
        .args(["--cflags", "--libs", "ferrite"])
        .output();
    match pkg {
        Ok(o) if o.status.success() => String::from_utf8_lossy(&o.stdout)
            .split_whitespace()
            .map(str::to_string)
            .collect(),
        _ => {
            eprintln!("note: pkg-config not available; using the flags of ferrite.pc.in directly");
            vec![
                format!("-I{}", Path::new(CRATE).join("include").display()),
                format!("-L{}", lib.display()),
                "-lferrite_capi".into(),
            ]
        }
    }
}

#[test]
fn c_program_on_host_memory() {
    // Needs the source tree (the GPU suite's bundle leaves this binary out and runs the C
    // program through scripts/gpu-suite/capi.sh instead).
    assert!(
        Path::new(CRATE).join("examples/c/test_capi.c").exists(),
        "{CRATE}/examples/c/test_capi.c is not here: this test runs from the source tree"
    );
    let lib = lib_dir();
    let work = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("ferrite-capi-c");
    std::fs::create_dir_all(&work).unwrap();
    write_pc(&work, &lib);
    let flags = ferrite_flags(&work, &lib);
    assert!(
        flags.iter().any(|f| f == "-lferrite_capi"),
        "pkg-config gave {flags:?}"
    );
    let cc = compiler("CC", "cc");

    // The header alone: strict C99, every warning an error.
    let probe = work.join("header_only.c");
    std::fs::write(
        &probe,
        "#include \"ferrite.h\"\nint main(void) { return ferrite_version() == 0; }\n",
    )
    .unwrap();
    run(
        Command::new(&cc)
            .args([
                "-std=c99",
                "-pedantic",
                "-Wall",
                "-Wextra",
                "-Werror",
                "-fsyntax-only",
            ])
            .arg(format!("-I{}", Path::new(CRATE).join("include").display()))
            .arg(&probe),
        "compiling ferrite.h as C99",
    );
    // And as C++ (the header's extern "C" guards), where a C++ compiler is installed.
    let cxx = compiler("CXX", "c++");
    if Command::new(&cxx).arg("--version").output().is_ok() {
        run(
            Command::new(&cxx)
                .args([
                    "-x",
                    "c++",
                    "-std=c++11",
                    "-Wall",
                    "-Werror",
                    "-fsyntax-only",
                ])
                .arg(format!("-I{}", Path::new(CRATE).join("include").display()))
                .arg(&probe),
            "compiling ferrite.h as C++",
        );
    } else {
        eprintln!("note: no C++ compiler ({cxx}); the header's C++ check is skipped");
    }

    // The test program, linked against the shared library found at run time through its rpath.
    let exe = work.join("test_capi");
    run(
        Command::new(&cc)
            .args(["-std=c11", "-O1", "-Wall", "-Wextra", "-Werror"])
            .arg(Path::new(CRATE).join("examples/c/test_capi.c"))
            .arg("-o")
            .arg(&exe)
            .args(&flags)
            .arg(format!("-Wl,-rpath,{}", lib.display()))
            .arg("-lm"),
        "compiling examples/c/test_capi.c",
    );
    let out = run(&mut Command::new(&exe), "examples/c/test_capi.c");
    println!("{out}");
    assert!(out.contains("all checks passed"), "{out}");

    // The README's example, as strict C99.
    let hello = work.join("hello");
    run(
        Command::new(&cc)
            .args(["-std=c99", "-pedantic", "-Wall", "-Wextra", "-Werror"])
            .arg(Path::new(CRATE).join("examples/c/hello.c"))
            .arg("-o")
            .arg(&hello)
            .args(&flags)
            .arg(format!("-Wl,-rpath,{}", lib.display())),
        "compiling examples/c/hello.c",
    );
    let out = run(&mut Command::new(&hello), "examples/c/hello.c");
    assert_eq!(out, "4 5\n10 11\n");
}
