//! What a user must see, whether or not their program listens to `tracing`.
//!
//! nodetour logs through `tracing`; a program that installs no subscriber sees none of it. The
//! few things a user must not miss (a job running unauthenticated, device memory staged through
//! the host instead of the direct path, and why) go through [`warn`]: a `tracing` warning, and
//! a line on standard error where no subscriber has been installed.

/// Warns: through `tracing`, and on standard error where the program installed no `tracing`
/// subscriber (there the event would reach no one).
pub fn warn(message: std::fmt::Arguments<'_>) {
    tracing::warn!("{message}");
    if !tracing::dispatcher::has_been_set() {
        eprintln!("nodetour: warning: {message}");
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_warning_without_a_subscriber_is_written_and_never_panics() {
        // No global subscriber in this test binary: the line goes to standard error.
        assert!(!tracing::dispatcher::has_been_set());
        super::warn(format_args!("a test warning {}", 1));
    }
}
