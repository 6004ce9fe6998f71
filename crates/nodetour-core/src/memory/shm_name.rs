//! The name of a shared-memory file as it crosses between processes: a fixed directory chosen by
//! a tag (never a path) and one path component that matches a strict pattern. What a peer
//! announces is decoded here, so no byte of it ever becomes a path by itself.

use std::ffi::CString;
use std::fmt;
use std::path::PathBuf;

use crate::error::{Error, Result};

/// The directories shared files live in. Only these; a peer picks one by tag.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ShmDir {
    /// `/dev/hugepages` (hugetlbfs, 2 MiB pages).
    HugePages,
    /// `/dev/shm` (tmpfs, base pages).
    Tmpfs,
}

impl ShmDir {
    /// The directory.
    pub fn path(self) -> &'static str {
        match self {
            ShmDir::HugePages => "/dev/hugepages",
            ShmDir::Tmpfs => "/dev/shm",
        }
    }

    fn tag(self) -> u8 {
        match self {
            ShmDir::HugePages => 1,
            ShmDir::Tmpfs => 2,
        }
    }

    fn from_tag(tag: u8) -> Option<ShmDir> {
        match tag {
            1 => Some(ShmDir::HugePages),
            2 => Some(ShmDir::Tmpfs),
            _ => None,
        }
    }
}

/// `nodetour-<pid>-<16 hex digits>` in one of the [`ShmDir`]s.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ShmName {
    dir: ShmDir,
    component: String,
}

const PREFIX: &str = "nodetour-";
/// Longest encoded name: tag, length, `nodetour-` + 10-digit pid + `-` + 16 hex digits.
const MAX_COMPONENT: usize = PREFIX.len() + 10 + 1 + 16;

impl ShmName {
    /// A fresh name for this process: its pid and 64 random bits.
    pub fn fresh(dir: ShmDir) -> ShmName {
        let random = u64::from_be_bytes(crate::random::bytes());
        ShmName {
            dir,
            component: format!("{PREFIX}{}-{random:016x}", std::process::id()),
        }
    }

    /// Validates a name: one path component of exactly the pattern `fresh` makes.
    pub fn new(dir: ShmDir, component: &str) -> Result<ShmName> {
        let bad = |why: &str| Error::Decode {
            what: "shared-memory name",
            reason: format!("{component:?}: {why}"),
        };
        let rest = component
            .strip_prefix(PREFIX)
            .ok_or_else(|| bad("does not start with nodetour-"))?;
        let (pid, random) = rest
            .split_once('-')
            .ok_or_else(|| bad("no -<random> part"))?;
        if pid.is_empty() || pid.len() > 10 || !pid.bytes().all(|b| b.is_ascii_digit()) {
            return Err(bad("the process id is not 1-10 decimal digits"));
        }
        if random.len() != 16
            || !random
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        {
            return Err(bad("the random part is not 16 lowercase hex digits"));
        }
        Ok(ShmName {
            dir,
            component: component.to_owned(),
        })
    }

    /// The directory.
    pub fn dir(&self) -> ShmDir {
        self.dir
    }

    /// The file name (one component, no `/`).
    pub fn component(&self) -> &str {
        &self.component
    }

    pub(crate) fn c_component(&self) -> CString {
        CString::new(self.component.as_str()).expect("validated: no NUL")
    }

    /// The full path (for messages and `exists` checks; opening goes through the directory).
    pub fn path(&self) -> PathBuf {
        PathBuf::from(self.dir.path()).join(&self.component)
    }

    /// Encodes: directory tag, length, component.
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(2 + self.component.len());
        b.push(self.dir.tag());
        b.push(self.component.len() as u8);
        b.extend_from_slice(self.component.as_bytes());
        b
    }

    /// Decodes what a peer announced, validating every byte.
    pub fn decode(b: &[u8]) -> Result<ShmName> {
        let bad = |reason: String| Error::Decode {
            what: "shared-memory name",
            reason,
        };
        let [tag, len, rest @ ..] = b else {
            return Err(bad(format!("{} bytes", b.len())));
        };
        let dir = ShmDir::from_tag(*tag).ok_or_else(|| bad(format!("directory tag {tag}")))?;
        if *len as usize != rest.len() || rest.len() > MAX_COMPONENT {
            return Err(bad(format!(
                "length {len} for {} bytes (at most {MAX_COMPONENT})",
                rest.len()
            )));
        }
        let s = std::str::from_utf8(rest).map_err(|_| bad("not UTF-8".into()))?;
        ShmName::new(dir, s)
    }
}

impl fmt::Display for ShmName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.dir.path(), self.component)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fresh_names_round_trip() {
        for dir in [ShmDir::HugePages, ShmDir::Tmpfs] {
            let n = ShmName::fresh(dir);
            assert_eq!(ShmName::decode(&n.encode()).unwrap(), n);
            assert!(n.path().starts_with(dir.path()));
        }
    }

    #[test]
    fn traversal_and_odd_names_are_refused() {
        for bad in [
            "",
            "..",
            "../etc/passwd",
            "nodetour-1-../../etc",
            "nodetour-1/0123456789abcdef",
            "nodetour-12-0123456789ABCDEF",
            "nodetour--0123456789abcdef",
            "nodetour-12345678901-0123456789abcdef",
            "nodetour-12-0123456789abcde",
            "nodetour-12-0123456789abcdef0",
            "nodetour-12-0123456789abcdef\0",
            "other-12-0123456789abcdef",
        ] {
            assert!(ShmName::new(ShmDir::Tmpfs, bad).is_err(), "{bad:?}");
        }
        let good = ShmName::new(ShmDir::Tmpfs, "nodetour-12-0123456789abcdef").unwrap();
        let mut b = good.encode();
        b[0] = 9;
        assert!(ShmName::decode(&b).is_err(), "unknown directory tag");
        let mut b = good.encode();
        b[1] += 1;
        assert!(ShmName::decode(&b).is_err(), "length mismatch");
        assert!(ShmName::decode(&[]).is_err() && ShmName::decode(&[2]).is_err());
        let mut b = vec![2, 3];
        b.extend_from_slice(b"/..");
        assert!(ShmName::decode(&b).is_err());
    }
}
