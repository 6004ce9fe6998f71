//! Build script of the facade package. It only declares what Cargo should watch; it never
//! probes hardware or system libraries (those are found at run time, so one binary runs on
//! machines with and without RDMA devices or GPUs).
fn main() {
    println!("cargo::rerun-if-changed=build.rs");
}
