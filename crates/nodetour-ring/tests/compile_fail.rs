//! The ownership rules of the non-blocking GPU collective, proved by programs that must not
//! compile: a buffer in flight is owned by its handle (no use until `wait` gives it back), and
//! the ring cannot queue another collective while a handle borrows it.

#[test]
fn ui() {
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/ui/*.rs");
}
