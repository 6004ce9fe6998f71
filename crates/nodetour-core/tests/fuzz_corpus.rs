//! Replays the `cargo fuzz` corpora (`fuzz/corpus/<target>/`) through the decoders with the
//! same properties the fuzz targets check, so every input a fuzzer ever kept stays covered by
//! `cargo test` on machines without a fuzzer.

use std::fs;
use std::path::PathBuf;

use nodetour_core::verbs::EndpointDescription;

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
fn endpoint_decode_corpus() {
    let mut accepted = 0;
    for (name, data) in corpus("endpoint_decode") {
        if let Ok(d) = EndpointDescription::decode(&data) {
            assert_eq!(
                d.encode().unwrap(),
                data,
                "{name}: decode/encode round trip"
            );
            accepted += 1;
        }
    }
    assert!(accepted >= 1, "the corpus holds valid descriptions too");
}

#[test]
fn transport_grants_corpus() {
    use nodetour_core::transport::SlotGrant;
    use nodetour_core::transport::gpu::IpcGrant;
    use nodetour_core::transport::wire::WriteHeader;
    let mut accepted = 0;
    for (name, data) in corpus("transport_grants") {
        if let Ok(g) = SlotGrant::decode(&data) {
            assert_eq!(&g.encode()[..], &data[..], "{name}");
            accepted += 1;
        }
        if let Ok(g) = IpcGrant::decode(&data) {
            assert_eq!(&g.encode()[..], &data[..], "{name}");
            accepted += 1;
        }
        if let Ok(h) = WriteHeader::decode(&data) {
            assert_eq!(&h.encode()[..], &data[..], "{name}");
            accepted += 1;
        }
        if let Ok(n) = nodetour_core::memory::ShmName::decode(&data) {
            assert_eq!(&n.encode()[..], &data[..], "{name}");
            assert!(!n.component().contains('/'), "{name}");
            accepted += 1;
        }
        for setup in [
            nodetour_core::transport::setup::NeighbourSetup::decode(&data).map(|s| s.encode()),
            nodetour_core::transport::setup::GpuNeighbourSetup::decode(&data).map(|s| s.encode()),
        ]
        .into_iter()
        .flatten()
        {
            assert_eq!(setup, data, "{name}");
            accepted += 1;
        }
    }
    assert!(accepted >= 4, "{accepted}");
}
