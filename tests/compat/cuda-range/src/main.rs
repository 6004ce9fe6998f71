// The same program as plain-cudarc's, at either end of the CUDA versions.
include!("../../plain-cudarc/src/main.rs");
