//! The borrow rules the API relies on, proved by programs that must not compile:
//! memory a NIC or peer may write is never reachable as a slice while registered, GPU memory
//! offers no host copies, and a registered buffer cannot be used behind the region's back.

#[test]
fn ui() {
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/ui/*.rs");
}
