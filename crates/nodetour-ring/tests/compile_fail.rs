//! The ownership rules of the non-blocking device collective, proved by programs that must not
//! compile: a buffer in flight is owned by its handle (no use until `wait` gives it back), and
//! the communicator cannot be closed or dropped while a handle borrows it; and a slot region's
//! bytes have one writer's lock (no second handle to them is handed out).

#[test]
fn ui() {
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/ui/*.rs");
}
