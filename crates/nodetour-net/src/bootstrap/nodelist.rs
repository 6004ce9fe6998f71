//! Slurm's compressed host lists (`SLURM_STEP_NODELIST`, `SLURM_JOB_NODELIST`): `n[01-03,07]`,
//! `gpu[1-2],cpu7`, `rack[1-2]-n[01-02]`, expanded in Slurm's order. Pure, bounded: a list
//! that would name more than [`MAX_HOSTS`] hosts, or is malformed, is an error (it comes from
//! the environment, but nothing here trusts its size).

/// The most hosts an expansion may name.
pub const MAX_HOSTS: usize = 1 << 16;

/// The hosts of `list`, in order (`Err` says what is wrong with it).
pub fn expand(list: &str) -> Result<Vec<String>, String> {
    let mut hosts = Vec::new();
    for item in split_top(list)? {
        if item.is_empty() {
            return Err(format!("an empty host name in {list:?}"));
        }
        let mut names = vec![String::new()];
        let mut rest = item;
        while let Some((prefix, spec, after)) = bracket(rest, list)? {
            let choices = ranges(spec, list)?;
            let mut next = Vec::with_capacity(names.len() * choices.len());
            for n in &names {
                for c in &choices {
                    next.push(format!("{n}{prefix}{c}"));
                }
            }
            if next.len() > MAX_HOSTS {
                return Err(format!("{list:?} names more than {MAX_HOSTS} hosts"));
            }
            names = next;
            rest = after;
        }
        if rest.contains(']') {
            return Err(format!("a ']' without '[' in {list:?}"));
        }
        hosts.extend(names.into_iter().map(|n| n + rest));
        if hosts.len() > MAX_HOSTS {
            return Err(format!("{list:?} names more than {MAX_HOSTS} hosts"));
        }
    }
    Ok(hosts)
}

/// The first host of `list` without expanding the rest (where rank 0 runs under block and
/// cyclic distribution: task 0 is on the step's first node).
pub fn first(list: &str) -> Result<String, String> {
    let item = split_top(list)?
        .into_iter()
        .next()
        .filter(|i| !i.is_empty())
        .ok_or_else(|| format!("no host in {list:?}"))?;
    let one: String = {
        let mut out = String::new();
        let mut rest = item;
        while let Some((prefix, spec, after)) = bracket(rest, list)? {
            out.push_str(prefix);
            out.push_str(&ranges_first(spec, list)?);
            rest = after;
        }
        out + rest
    };
    Ok(one)
}

/// The text before the first `[...]` of `rest`, what is inside it, and what follows it.
fn bracket<'s>(rest: &'s str, list: &str) -> Result<Option<(&'s str, &'s str, &'s str)>, String> {
    let Some(open) = rest.find('[') else {
        return Ok(None);
    };
    let close = rest[open..]
        .find(']')
        .map(|c| open + c)
        .ok_or_else(|| format!("an unclosed '[' in {list:?}"))?;
    Ok(Some((
        &rest[..open],
        &rest[open + 1..close],
        &rest[close + 1..],
    )))
}

/// The items of `list` split at commas outside brackets.
fn split_top(list: &str) -> Result<Vec<&str>, String> {
    let (mut items, mut depth, mut start) = (Vec::new(), 0u32, 0);
    for (i, c) in list.char_indices() {
        match c {
            '[' => {
                if depth > 0 {
                    return Err(format!("nested '[' in {list:?}"));
                }
                depth = 1;
            }
            ']' => {
                if depth == 0 {
                    return Err(format!("a ']' without '[' in {list:?}"));
                }
                depth = 0;
            }
            ',' if depth == 0 => {
                items.push(list[start..i].trim());
                start = i + 1;
            }
            c if c.is_whitespace() => return Err(format!("a space in {list:?}")),
            _ => {}
        }
    }
    if depth > 0 {
        return Err(format!("an unclosed '[' in {list:?}"));
    }
    items.push(list[start..].trim());
    Ok(items)
}

/// `01-03,07` as `01 02 03 07` (zero padding kept at the width of the range's start).
fn ranges(spec: &str, list: &str) -> Result<Vec<String>, String> {
    let mut out = Vec::new();
    for part in spec.split(',') {
        let (lo, hi, width) = bounds(part, list)?;
        if (hi - lo) as usize >= MAX_HOSTS - out.len().min(MAX_HOSTS) {
            return Err(format!("{list:?} names more than {MAX_HOSTS} hosts"));
        }
        out.extend((lo..=hi).map(|n| format!("{n:0width$}")));
    }
    Ok(out)
}

/// The first of [`ranges`], without the others.
fn ranges_first(spec: &str, list: &str) -> Result<String, String> {
    let part = spec.split(',').next().unwrap_or_default();
    let (lo, _, width) = bounds(part, list)?;
    Ok(format!("{lo:0width$}"))
}

/// `a-b` (or `a`) as numbers and the width of `a`.
fn bounds(part: &str, list: &str) -> Result<(u64, u64, usize), String> {
    let bad = || format!("a bad range {part:?} in {list:?}");
    let (a, b) = part.split_once('-').unwrap_or((part, part));
    let digits = |s: &str| !s.is_empty() && s.len() <= 18 && s.bytes().all(|c| c.is_ascii_digit());
    if !digits(a) || !digits(b) {
        return Err(bad());
    }
    let (lo, hi): (u64, u64) = (a.parse().map_err(|_| bad())?, b.parse().map_err(|_| bad())?);
    if hi < lo {
        return Err(bad());
    }
    Ok((lo, hi, a.len()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slurm_lists_expand_in_order_with_their_padding() {
        assert_eq!(expand("n[01-03,07]").unwrap(), ["n01", "n02", "n03", "n07"]);
        assert_eq!(
            expand("gpu[1-2],cpu7,io[009-010]").unwrap(),
            ["gpu1", "gpu2", "cpu7", "io009", "io010"]
        );
        assert_eq!(
            expand("rack[1-2]-n[01-02]").unwrap(),
            ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]
        );
        assert_eq!(expand("node-[3-4]-ib").unwrap(), ["node-3-ib", "node-4-ib"]);
        assert_eq!(expand("solo").unwrap(), ["solo"]);
        assert_eq!(first("n[07-09],a1").unwrap(), "n07");
        assert_eq!(first("rack[2-3]-n[05,01]").unwrap(), "rack2-n05");
        assert_eq!(first("solo,other").unwrap(), "solo");
        for list in ["n[01-03,07]", "gpu[1-2],cpu7", "rack[1-2]-n[01-02]", "x"] {
            assert_eq!(first(list).unwrap(), expand(list).unwrap()[0], "{list}");
        }
    }

    #[test]
    fn malformed_or_huge_lists_are_errors() {
        for bad in [
            "",
            "n[01-",
            "n01]",
            "n[3-1]",
            "n[a-b]",
            "n[[1]]",
            "a,,b",
            "n[1-2",
            "a b",
            "n[]",
            "n[1-99999999]",
        ] {
            assert!(expand(bad).is_err(), "{bad:?}");
        }
        assert!(
            expand("a[0-255]-b[0-255]-c[0-3]").is_err(),
            "more than MAX_HOSTS"
        );
        assert!(first("").is_err());
    }
}
