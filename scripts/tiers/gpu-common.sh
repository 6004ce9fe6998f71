# gpu-common.sh: sourced by the GPU tier's scripts (gpu-tier.sh, gpu-one-kernel.sh, gpu-net.sh).
#
# ranks_report N WORD CMD...: runs CMD (a launcher of N ranks), shows its output, and passes only
# when CMD exited 0 and exactly N lines carry WORD (each rank's own report, e.g. "GPU_RING OK"):
# a rank that printed SKIP and exited 0, or never reported, fails the check instead of passing
# on the launcher's exit status alone.
ranks_report() {
    local n=$1 word=$2 out rc got
    shift 2
    out=$("$@" 2>&1)
    rc=$?
    echo "$out"
    got=$(grep -c -- "$word" <<<"$out")
    if [[ $rc != 0 || $got != "$n" ]]; then
        echo "ranks_report: $got of $n ranks reported \"$word\" (exit status $rc): $*"
        return 1
    fi
}

# log_reports N WORD FILE: exactly N lines of FILE carry WORD (the ranks of one run whose
# output went to FILE).
log_reports() {
    local got
    got=$(grep -c -- "$2" "$3")
    [[ $got == "$1" ]] || { echo "log_reports: $got of $1 reports \"$2\" in $3"; return 1; }
}
