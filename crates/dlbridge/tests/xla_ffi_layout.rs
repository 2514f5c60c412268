//! `dlbridge::xla_ffi` against the header jaxlib ships (`jax.ffi.include_dir()`): a C file printing
//! every size, offset, `*_STRUCT_SIZE` and the API version is compiled with the system C compiler
//! and its output compared with Rust's values. The header is found through `XLA_FFI_INCLUDE_DIR`,
//! or the jaxlib of the workspace's `.venv` (or of `python3`).
//!
//! A Rust user's `cargo test` needs no Python: without the header (or a C compiler) the test says
//! so on stderr and checks nothing. `make test` sets `DLBRIDGE_REQUIRE_XLA_HEADERS=1`, which makes
//! that a failure, so the layout is always checked there.

use std::io::Write;
use std::path::PathBuf;
use std::process::Command;

/// Set (to `1`) where the header must be found: its absence fails the test instead of skipping it.
const REQUIRE: &str = "DLBRIDGE_REQUIRE_XLA_HEADERS";

fn include_dir() -> Result<PathBuf, String> {
    if let Some(dir) = std::env::var_os("XLA_FFI_INCLUDE_DIR") {
        let dir = PathBuf::from(dir);
        return if dir.join("xla/ffi/api/c_api.h").is_file() {
            Ok(dir)
        } else {
            Err(format!("XLA_FFI_INCLUDE_DIR={} has no xla/ffi/api/c_api.h", dir.display()))
        };
    }
    let venv = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../.venv/bin/python");
    let code = "import importlib.util, os; s = importlib.util.find_spec('jaxlib'); \
                print(os.path.join(os.path.dirname(s.origin), 'include'))";
    for python in [venv.as_os_str(), "python3".as_ref()] {
        if let Ok(out) = Command::new(python).args(["-c", code]).output()
            && out.status.success()
        {
            let dir = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
            if dir.join("xla/ffi/api/c_api.h").is_file() {
                return Ok(dir);
            }
        }
    }
    Err("xla/ffi/api/c_api.h not found: install jaxlib (make's .venv has it) or set XLA_FFI_INCLUDE_DIR"
        .into())
}

/// Without what the test needs: a failure when [`REQUIRE`] is set, else a skip said on stderr
/// (written past the test harness's capture, so `cargo test` shows it).
fn unavailable(why: &str) {
    if std::env::var_os(REQUIRE).is_some_and(|v| v == "1") {
        panic!("{why} ({REQUIRE}=1: the layout must be checked)");
    }
    let _ = writeln!(
        std::io::stderr(),
        "xla_ffi_layout: SKIPPED, nothing checked: {why} (set {REQUIRE}=1 to make this a failure)"
    );
}

#[test]
#[cfg_attr(miri, ignore = "runs the C compiler")]
fn every_size_and_offset_matches_jaxlibs_header() {
    let include = match include_dir() {
        Ok(dir) => dir,
        Err(why) => return unavailable(&why),
    };
    let table = dlbridge::xla_ffi::layout_table();
    let mut c = String::from(
        "#include <stddef.h>\n#include <stdio.h>\n#include \"xla/ffi/api/c_api.h\"\nint main(void) {\n",
    );
    for (name, _) in &table {
        let expr = if let Some((ty, field)) = name.split_once('.') {
            format!("offsetof({ty}, {field})")
        } else if name.ends_with("_STRUCT_SIZE") || name.starts_with("XLA_FFI_API_") {
            format!("(size_t)({name})")
        } else {
            format!("sizeof({name})")
        };
        c += &format!("  printf(\"{name} %zu\\n\", (size_t){expr});\n");
    }
    c += "  return 0;\n}\n";
    let dir = std::env::temp_dir().join(format!("dlbridge-xla-layout-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (src, exe) = (dir.join("layout.c"), dir.join("layout"));
    std::fs::write(&src, c).unwrap();
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let status = match Command::new(&cc).arg("-I").arg(&include).arg(&src).arg("-o").arg(&exe).status() {
        Ok(status) => status,
        Err(e) => {
            std::fs::remove_dir_all(&dir).ok();
            return unavailable(&format!("the C compiler {cc} could not run: {e}"));
        }
    };
    assert!(status.success(), "{cc} failed on {}", src.display());
    let out = Command::new(&exe).output().unwrap();
    std::fs::remove_dir_all(&dir).ok();
    let printed = String::from_utf8(out.stdout).unwrap();
    let c_values: Vec<(String, usize)> = printed
        .lines()
        .map(|l| {
            let (n, v) = l.rsplit_once(' ').unwrap();
            (n.to_owned(), v.parse().unwrap())
        })
        .collect();
    assert_eq!(c_values.len(), table.len());
    let mismatches: Vec<String> = table
        .iter()
        .zip(&c_values)
        .filter(|((_, rust), (_, c))| rust != c)
        .map(|((name, rust), (_, c))| format!("{name}: Rust {rust}, C {c}"))
        .collect();
    assert!(mismatches.is_empty(), "layout differs from jaxlib's header:\n{}", mismatches.join("\n"));
}
