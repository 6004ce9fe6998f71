//! What the doctor inspects: the operating system ([`system`]), PCIe topology and ACS
//! ([`pci`]), and the pure per-GPU verdict ([`mod@verdict`]). Readers take the root of the tree so
//! captured fixture trees test them; live probes (CUDA, verbs) are gathered by the caller and
//! passed in as data.

pub mod pci;
pub mod system;
pub mod verdict;

pub use pci::{AcsState, Distance, PciLevel};
pub use system::{SystemFacts, read_system};
pub use verdict::{Facts, GpuFacts, NicFacts, Problem, Verdict, verdict};
