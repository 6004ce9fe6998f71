#!/usr/bin/env bash
# shrink-logs.sh DIR [LIMIT_BYTES]: shrink the raw measurement logs under DIR to what the notes
# cite. Every log larger than LIMIT_BYTES (default 16384) loses the lines no table or note
# reads: tracing INFO/DEBUG/TRACE lines, per-test "... ok" lines, "running N tests" headers,
# empty test-binary summaries (0 passed, 0 failed, 0 ignored) and the spinner's progress
# steps; runs of blank lines become one. Result rows (OK, DRILL, PERF, DISAGREE, busbw and
# criterion lines), warnings, errors and "test result" totals stay. The full logs remain in
# git history (docs/measurements/README.md names the commit).
set -euo pipefail
dir=${1:?usage: shrink-logs.sh DIR [LIMIT_BYTES]}
limit=${2:-16384}
drop='[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9:.]+Z +(INFO|DEBUG|TRACE) '
drop+='|SPINNER_STEP '
drop+='|^ *running [0-9]+ tests?$'
drop+='|^test [^ ]+ \.\.\. ok$'
drop+='|^test result: ok\. 0 passed; 0 failed; 0 ignored; 0 measured;'
before=0 after=0
while IFS= read -r -d '' f; do
    size=$(stat -c %s "$f")
    (( size > limit )) || continue
    tmp=$(mktemp)
    { grep -avE "$drop" "$f" || true; } | cat -s > "$tmp"
    before=$(( before + size )); after=$(( after + $(stat -c %s "$tmp") ))
    cat "$tmp" > "$f"; rm -f "$tmp"
done < <(find "$dir" -type f ! -name '*.md' -print0)
echo "shrank logs over $limit bytes: $before -> $after bytes"
