//! Replays the `cargo fuzz` corpus of the out-of-band channel's frame header
//! (`fuzz/corpus/oob_frame_header/`) through the decoder with the properties the fuzz target
//! checks, so every input a fuzzer kept stays covered by `cargo test`.

use std::path::Path;

use nodetour_tools::oob::{HEADER_LEN, MAX_PAYLOAD, decode_header, encode_frame};

#[test]
fn oob_frame_header_corpus() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus/oob_frame_header");
    let entries = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("corpus {} is missing: {e}", dir.display()));
    let mut inputs = 0;
    for entry in entries {
        let path = entry.unwrap().path();
        let data = std::fs::read(&path).unwrap();
        let header = &data[..data.len().min(HEADER_LEN)];
        if let Ok((kind, len)) = decode_header(header) {
            assert!(len <= MAX_PAYLOAD, "{}", path.display());
            let frame = encode_frame(kind, &vec![0; len as usize]).unwrap();
            assert_eq!(&frame[..HEADER_LEN], header, "{}", path.display());
        }
        inputs += 1;
    }
    assert!(inputs > 0, "corpus {} is empty", dir.display());
}
