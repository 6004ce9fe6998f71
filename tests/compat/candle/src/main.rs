//! The same program as plain-cudarc's, in this feature set's graph.
include!("../../plain-cudarc/src/main.rs");
