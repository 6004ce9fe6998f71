//! Replays the `cargo fuzz` corpus of the out-of-band channel's frame header
//! (`fuzz/corpus/oob_frame_header/`) through the decoder with the properties the fuzz target
//! checks, so every input a fuzzer kept stays covered by `cargo test`.

use std::fs;
use std::path::PathBuf;

use nodetour_tools::oob::{HEADER_LEN, MAX_PAYLOAD, decode_header, encode_frame};

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
fn oob_frame_header_corpus() {
    for (name, data) in corpus("oob_frame_header") {
        let header = &data[..data.len().min(HEADER_LEN)];
        if let Ok((kind, len)) = decode_header(header) {
            assert!(len <= MAX_PAYLOAD, "{name}");
            let frame = encode_frame(kind, &vec![0; len as usize]).unwrap();
            assert_eq!(&frame[..HEADER_LEN], header, "{name}");
        }
    }
}
