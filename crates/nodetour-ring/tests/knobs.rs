//! The knob table is the one reader of the environment: no `Default` reads it, every declared
//! variable is documented in docs/knobs.md's table (a user's settings also in the README's),
//! and the library's sources read the environment nowhere else.

use std::path::{Path, PathBuf};
use std::process::Command;

use nodetour_core::knobs::{Env, KNOBS};
use nodetour_ring::comm::Options;
use nodetour_ring::net_link::NetOptions;

fn defaults() -> String {
    format!(
        "{:?} | {:?} | {:?}",
        Options::default(),
        nodetour_core::Config::default(),
        NetOptions::default()
    )
}

/// Prints the defaults, and whether the environment (read on purpose) is malformed: run again
/// by `no_default_reads_the_environment` as a child with every variable poisoned.
#[test]
fn print_defaults_under_a_poisoned_environment() {
    println!("DEFAULTS {}", defaults());
    println!("FROM_ENV_FAILS {}", Options::from_env().is_err());
}

#[test]
fn no_default_reads_the_environment() {
    let mut child = Command::new(std::env::current_exe().unwrap());
    child.args([
        "--exact",
        "print_defaults_under_a_poisoned_environment",
        "--nocapture",
        "--test-threads",
        "1",
    ]);
    for k in KNOBS {
        child.env(k.name, "poison!");
        if let Some(old) = k.old_name {
            child.env(old, "poison!");
        }
    }
    let out = child.output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line = |tag: &str| {
        text.lines()
            .find_map(|l| l.split_once(tag).map(|(_, rest)| rest))
            .unwrap_or_else(|| panic!("no {tag} in {text}"))
            .to_owned()
    };
    assert_eq!(
        line("FROM_ENV_FAILS "),
        "true",
        "the child did not see the poison"
    );
    assert_eq!(line("DEFAULTS "), defaults());
}

/// The `| `NODETOUR_...` | ... |` rows of the table in `path` (from the repository's root).
fn table_rows(path: &str) -> Vec<String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    std::fs::read_to_string(root.join(path))
        .unwrap()
        .lines()
        .filter(|l| l.starts_with("| `NODETOUR_"))
        .map(str::to_owned)
        .collect()
}

/// Every `NODETOUR_` name of a row's first cell is declared.
fn rows_are_declared(rows: &[String], path: &str) {
    for row in rows {
        let first = row.split('|').nth(1).unwrap();
        for name in first.split('`').filter(|w| w.starts_with("NODETOUR_")) {
            assert!(
                KNOBS
                    .iter()
                    .any(|k| k.name == name || k.old_name == Some(name)),
                "{path} row {name} is not declared"
            );
        }
    }
}

#[test]
fn every_declared_variable_is_in_the_settings_tables_and_every_row_is_declared() {
    let (all, readme) = (table_rows("docs/knobs.md"), table_rows("README.md"));
    let listed =
        |rows: &[String], name: &str| rows.iter().any(|r| r.contains(&format!("`{name}`")));
    for k in KNOBS {
        assert!(
            listed(&all, k.name),
            "{} is declared but not in docs/knobs.md",
            k.name
        );
        if k.audience == nodetour_core::knobs::Audience::User {
            assert!(
                listed(&readme, k.name),
                "{} is a user's setting not in the README",
                k.name
            );
        }
    }
    rows_are_declared(&all, "docs/knobs.md");
    rows_are_declared(&readme, "README.md");
    // The declared default of each variable with one is what Env yields where it is unset.
    let env = Env::empty();
    for k in KNOBS.iter().filter(|k| !k.default.is_empty()) {
        if let nodetour_core::knobs::Kind::Count { .. } = k.kind {
            assert_eq!(
                env.count(k.name).unwrap().to_string(),
                k.default,
                "{}",
                k.name
            );
        }
    }
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

#[test]
fn the_library_reads_the_environment_only_through_the_knob_table() {
    let crates = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut files = Vec::new();
    for c in ["nodetour-core", "nodetour-net", "nodetour-ring"] {
        rust_files(&crates.join(c).join("src"), &mut files);
    }
    let mut found = Vec::new();
    for f in files {
        let name = f.file_name().unwrap().to_string_lossy().into_owned();
        if name == "knobs.rs" || name.ends_with("_tests.rs") {
            continue;
        }
        let text = std::fs::read_to_string(&f).unwrap();
        // Unit tests (at the end of a file) may set up what they read.
        let code = text.split("#[cfg(test)]").next().unwrap();
        for (i, line) in code.lines().enumerate() {
            if line.contains("env::var") && !line.trim_start().starts_with("//") {
                found.push(format!("{}:{}: {}", f.display(), i + 1, line.trim()));
            }
        }
    }
    assert!(
        found.is_empty(),
        "environment read outside the knob table:\n{}",
        found.join("\n")
    );
}

// What `Options` reads through the public API (moved from the crate's unit tests).

fn lookup<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
    move |k| {
        vars.iter()
            .find(|(n, _)| *n == k)
            .map(|(_, v)| (*v).to_owned())
    }
}

#[test]
fn the_environment_sets_every_field_and_bad_values_name_themselves() {
    let o = Options::from_lookup(lookup(&[
        ("NODETOUR_TIMEOUT_MS", "2500"),
        ("NODETOUR_TRANSPORT", "tcp"),
        ("NODETOUR_IB_DEVICES", "mlx5_0, mlx5_1"),
        ("NODETOUR_SLOTS", "8"),
        ("NODETOUR_PIECE_BYTES", "65536"),
        ("NODETOUR_RING_BLOCKS", "32"),
        ("NODETOUR_SHM_PIPELINE", "8"),
    ]))
    .unwrap();
    assert_eq!(o.gpu_ring.max_blocks, 32);
    assert_eq!((o.gpu_ring.shm_pipeline, o.gpu_ring.ipc_pipeline), (8, 1));
    assert_eq!(o.timeout(), std::time::Duration::from_millis(2500));
    assert_eq!(
        o.transport,
        Some(nodetour_core::transport::TransportKind::Tcp)
    );
    assert_eq!(o.devices, ["mlx5_0", "mlx5_1"]);
    assert_eq!((o.slots, o.piece_bytes), (8, 65536));
    assert_eq!(Options::from_lookup(|_| None).unwrap(), Options::default());
    for (k, v) in [
        ("NODETOUR_TRANSPORT", "carrier-pigeon"),
        ("NODETOUR_SLOTS", "0"),
        ("NODETOUR_SLOT_BYTES", "big"),
        ("NODETOUR_TIMEOUT_MS", "-1"),
        ("NODETOUR_NET_LANDING", "nic"),
        ("NODETOUR_ONE_KERNEL", "sometimes"),
        ("NODETOUR_ONE_KERNEL_MAX", "0"),
        ("NODETOUR_RING_BLOCKS", "lots"),
        ("NODETOUR_IPC_PIPELINE", "0"),
    ] {
        let e = Options::from_lookup(lookup(&[(k, v)])).unwrap_err();
        assert!(e.to_string().contains(k), "{e}");
    }
}

#[test]
fn the_agreement_column_of_the_knob_table_is_the_agreement_check() {
    use nodetour_core::knobs::Agreement;
    let declared: Vec<&str> = KNOBS
        .iter()
        .filter(|k| k.agreement == Agreement::MustAgree)
        .map(|k| k.name)
        .collect();
    let checked: Vec<&str> = nodetour_ring::comm::MUST_AGREE
        .iter()
        .copied()
        .filter(|n| n.starts_with("NODETOUR_"))
        .collect();
    assert_eq!(declared, checked);
}
