//! Random bytes from the kernel (`getrandom(2)`): job tokens, handshake nonces, and the names
//! of shared memory and cache files. The one place that asks the kernel, below the modules that
//! use it (memory, the kernel cache, the bootstrap's authentication).

/// `N` random bytes. Panics only if the kernel refuses (`getrandom` failing with anything but
/// `EINTR`, which no supported kernel does).
pub fn bytes<const N: usize>() -> [u8; N] {
    let mut n = [0u8; N];
    let mut at = 0;
    while at < n.len() {
        // SAFETY: writes at most n.len() - at bytes into n[at..].
        let got = unsafe { libc::getrandom(n[at..].as_mut_ptr().cast(), n.len() - at, 0) };
        if got > 0 {
            at += got as usize;
        } else if std::io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
            panic!("getrandom failed: {}", std::io::Error::last_os_error());
        }
    }
    n
}

#[cfg(test)]
mod tests {
    #[test]
    fn two_draws_differ() {
        assert_ne!(super::bytes::<16>(), super::bytes::<16>());
    }
}
