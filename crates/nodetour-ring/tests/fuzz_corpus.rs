//! Replays the `ring_notifications` fuzz corpus (`fuzz/corpus/ring_notifications/`) through the
//! same driver the fuzz target runs, so every input a fuzzer kept stays covered by `cargo test`.

use std::fs;
use std::path::PathBuf;

#[test]
fn ring_notifications_corpus() {
    let dir =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus/ring_notifications");
    let mut n = 0;
    for entry in fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let data = fs::read(entry.unwrap().path()).unwrap();
        nodetour_ring::fuzzing::drive(&data);
        nodetour_ring::fuzzing::descriptors(&data);
        n += 1;
    }
    assert!(n > 0, "the corpus is empty");
}

#[test]
fn comm_announcement_corpus() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus/comm_announcement");
    let mut decoded = 0;
    for entry in fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let data = fs::read(entry.unwrap().path()).unwrap();
        decoded += nodetour_ring::fuzzing::announcements(&data);
    }
    assert!(decoded > 0, "no input of the corpus decodes");
}

#[test]
fn net_notes_corpus() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus/net_notes");
    let mut actions = 0;
    for entry in fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let data = fs::read(entry.unwrap().path()).unwrap();
        actions += nodetour_ring::fuzzing::net_notes(&data);
    }
    assert!(actions > 0, "no input of the corpus moves the link");
}
