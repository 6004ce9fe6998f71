//! Replays the `bootstrap_message` fuzz corpus (`fuzz/corpus/bootstrap_message/`) through the
//! bootstrap's decoder with the properties the fuzz target checks, so every input a fuzzer ever
//! kept stays covered by `cargo test` on machines without a fuzzer.

use std::fs;
use std::path::PathBuf;

fn corpus(target: &str) -> Vec<(String, Vec<u8>)> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fuzz/corpus")
        .join(target);
    let mut files: Vec<_> = fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("corpus {} is missing: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    let inputs: Vec<_> = files
        .into_iter()
        .map(|p| (p.display().to_string(), fs::read(&p).unwrap()))
        .collect();
    assert!(!inputs.is_empty(), "corpus {target} is empty");
    inputs
}

#[test]
fn bootstrap_message_corpus() {
    use nodetour_net::bootstrap::wire::Message;
    let mut accepted = 0;
    for (name, data) in corpus("bootstrap_message") {
        if let Ok(m) = Message::decode(&data) {
            assert_eq!(
                m.encode().unwrap(),
                data,
                "{name}: decode/encode round trip"
            );
            accepted += 1;
        }
    }
    assert!(
        accepted >= 5,
        "the corpus holds valid messages too ({accepted})"
    );
}
