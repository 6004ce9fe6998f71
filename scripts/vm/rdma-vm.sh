#!/usr/bin/env bash
# rdma-vm.sh: run a command inside a throw-away QEMU VM that has soft-RoCE (rdma_rxe)
# devices, so that nodetour's verbs code can be tested on a machine without RDMA hardware.
#
# Usage: scripts/vm/rdma-vm.sh [OPTIONS] [--] COMMAND [ARGS...]
#        scripts/vm/rdma-vm.sh --check
#
# Options:
#   --nodes 1|2        1 (default): one device, rxe0 on vethA (10.99.0.1), used by both
#                      endpoints (rxe's internal loopback path; rdma_cm works).
#                      2: rxe0 on vethA (10.99.0.1) and rxe1 on vethB (10.99.0.2); RoCEv2
#                      packets really cross the veth pair. Plain verbs only: rdma_cm
#                      connects are rejected in this mode.
#   --timeout SECONDS  limit for the whole VM, boot included (default 1200)
#   --cpus N           guest CPUs (default 2)
#   --mem SIZE         guest memory, in QEMU's syntax (default 2G)
#   --rw DIR           make the host directory DIR writable inside (repeatable)
#   --check            only check that the VM can run here, without booting it: prints
#                      "ok" (exit status 0) or one line "SKIP <reason>" (exit status 3)
#
# The guest runs Debian's kernel from /boot on this machine's own root filesystem, shared
# read-only over virtio-9p, so binaries built on the host run unchanged. /tmp /run /var/tmp
# /var/log /dev/shm are empty private tmpfs inside: keep what COMMAND needs in the project
# tree, or pass its directory with --rw. COMMAND runs as root in the caller's current
# directory, with stdin from /dev/null and this environment:
#   - PATH HOME CARGO_HOME RUSTUP_HOME CARGO_TARGET_DIR RUST_BACKTRACE RUST_LOG, every
#     NODETOUR_* variable, and the variables named in NODETOUR_VM_ENV (if set here);
#   - the topology: NODETOUR_VM=1, NODETOUR_VM_NODES, NODETOUR_VM_DEV0, NODETOUR_VM_DEV1,
#     NODETOUR_VM_IP0, NODETOUR_VM_IP1 and NODETOUR_VM_GID_INDEX (1, the IPv4-mapped RoCE v2
#     GID). With --nodes 1, DEV1 = DEV0 and IP1 = IP0.
# COMMAND's stdout and stderr (a pipe inside, so no colour codes) come out on stdout. The
# guest's console and this script's own messages go to stderr.
#
# Exit status: COMMAND's; 97 when the soft-RoCE setup failed inside; 124 on timeout; 125
# when the VM could not start or died without reporting a status; 2 on a usage error;
# 128+N when interrupted by signal N.
#
# Environment:
#   NODETOUR_VM_ACCEL   tcg (default) or kvm
#   NODETOUR_VM_KERNEL  kernel image to boot (default: the newest /boot/vmlinuz-* whose
#                       modules include rdma_rxe)
#   NODETOUR_VM_ENV     names of more variables to pass into the guest (space or comma
#                       separated)
#
# Needs qemu-system-x86, a Debian kernel package, kmod, cpio, busybox-static, iproute2,
# rdma-core and friends: scripts/install-deps.sh installs them.
set -euo pipefail

script_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)
guest_script=$script_dir/rdma-vm-guest.sh

# Modules the initramfs needs to reach the host root; the rest loads from the host root.
initramfs_modules=(virtio_pci 9pnet_virtio 9p)
# Modules the guest loads from the host root; checked up front by --check.
guest_modules=(rdma_rxe veth)
# Set by the guest for COMMAND: never passed in from here.
topology_vars=(NODETOUR_VM NODETOUR_VM_NODES NODETOUR_VM_DEV0 NODETOUR_VM_DEV1
    NODETOUR_VM_IP0 NODETOUR_VM_IP1 NODETOUR_VM_GID_INDEX)
# Mounted over by the guest, so the host's contents are not visible there.
guest_private_dirs=(/tmp /run /var/tmp /var/log /dev /proc /sys)

say() { echo "rdma-vm: $*" >&2; }

usage_error() {
    say "$*"
    say "usage: $0 [--nodes 1|2] [--timeout SECONDS] [--cpus N] [--mem SIZE] [--rw DIR]... [--check] -- COMMAND [ARGS...]"
    exit 2
}

# POSIX single quoting: the guest sources what we write with bash, but nothing here may
# depend on bash-only quoting such as $'...'.
shquote() {
    local s=${1//\'/\'\\\'\'}
    printf "'%s'" "$s"
}

is_under() { # PATH DIR
    [[ $1 == "$2" || $1 == "$2"/* ]]
}

# ---------------------------------------------------------------- prerequisites

# Sets kernel and kver, or leaves the reason in skip_reason and returns 1.
find_kernel() {
    local candidates=() k v
    if [[ -n ${NODETOUR_VM_KERNEL:-} ]]; then
        candidates=("$NODETOUR_VM_KERNEL")
    else
        # Newest first; the host's running kernel is irrelevant (it need not even have
        # modules on disk).
        mapfile -t candidates < <(compgen -G '/boot/vmlinuz-*' | sort -rV)
    fi
    if ((${#candidates[@]} == 0)); then
        skip_reason="no kernel image /boot/vmlinuz-* (install linux-image-amd64: scripts/install-deps.sh)"
        return 1
    fi
    skip_reason=
    for k in "${candidates[@]}"; do
        v=${k##*/vmlinuz-}
        if [[ ! -r $k ]]; then
            skip_reason=${skip_reason:-"kernel image $k is not readable"}
        elif [[ ! -d /lib/modules/$v ]]; then
            skip_reason=${skip_reason:-"no /lib/modules/$v for kernel image $k"}
        elif ! modprobe -S "$v" --show-depends rdma_rxe >/dev/null 2>&1; then
            skip_reason=${skip_reason:-"no rdma_rxe module under /lib/modules/$v"}
        else
            kernel=$k kver=$v
            return 0
        fi
    done
    return 1
}

# Sets skip_reason and returns 1 when the VM cannot run here.
check_prereqs() {
    local m
    skip_reason=
    if [[ $(uname -m) != x86_64 ]]; then
        skip_reason="the VM shares this machine's root filesystem, which must be x86_64 (this is $(uname -m))"
        return 1
    fi
    if ! command -v qemu-system-x86_64 >/dev/null; then
        skip_reason="qemu-system-x86_64 not found (install qemu-system-x86: scripts/install-deps.sh)"
        return 1
    fi
    for m in modprobe cpio gzip timeout; do
        if ! command -v "$m" >/dev/null; then
            skip_reason="$m not found (scripts/install-deps.sh installs what is needed)"
            return 1
        fi
    done
    find_kernel || return 1
    for m in "${initramfs_modules[@]}" "${guest_modules[@]}"; do
        if ! modprobe -S "$kver" --show-depends "$m" >/dev/null 2>&1; then
            skip_reason="no $m module for kernel $kver"
            return 1
        fi
    done
    # The initramfs has no C library: its busybox must be the static one.
    # (ldd fails on a static binary, so look at what it says, not at its exit status.)
    busybox=$(command -v busybox || true)
    if [[ -z $busybox || ! $(LC_ALL=C ldd "$busybox" 2>&1 || true) =~ (not a dynamic|statically linked) ]]; then
        skip_reason="no static busybox (install busybox-static: scripts/install-deps.sh)"
        return 1
    fi
    if [[ ${NODETOUR_VM_ACCEL:-tcg} == kvm && ! -w /dev/kvm ]]; then
        skip_reason="NODETOUR_VM_ACCEL=kvm but /dev/kvm is not usable"
        return 1
    fi
}

# ---------------------------------------------------------------- initramfs

# A tiny initramfs: static busybox, the 9p/virtio modules and rdma-vm-guest.sh as /init.
# Cached per kernel version and per content of the two scripts, so editing either one
# rebuilds it; it takes about a second.
initramfs() {
    local cache_dir hash out
    cache_dir=/var/tmp/nodetour-rdma-vm-$(id -u)
    # Private to this user (concurrent runs may both try to make it).
    mkdir -m 0700 "$cache_dir" 2>/dev/null || [[ -d $cache_dir ]]
    hash=$(cat "${BASH_SOURCE[0]}" "$guest_script" | sha256sum | cut -c1-16)
    out=$cache_dir/initrd-$kver-$hash.cpio.gz
    if [[ ! -s $out ]]; then
        build_initramfs "$cache_dir" "$out"
        # Older builds (scripts edited since): drop them after a week.
        find "$cache_dir" -maxdepth 1 -name 'initrd-*.cpio.gz' -mtime +7 -delete 2>/dev/null || true
    fi
    initrd=$out
}

# Copies the modules the initramfs needs into DIR, with DIR/order listing their load order.
# (It runs where set -e does not apply: every step checks for itself.)
copy_modules() { # DIR
    local m f name
    # --show-depends lists each module's dependencies first, so concatenating the lists
    # (without repeats) gives a valid load order.
    for m in "${initramfs_modules[@]}"; do
        modprobe -S "$kver" --show-depends "$m" || return
    done | awk '$1 == "insmod" && !seen[$2]++ { print $2 }' |
        while read -r f; do
            # busybox insmod cannot read compressed modules: store them uncompressed.
            name=${f##*/}
            case $f in
                *.ko.xz) xz -dc "$f" >"$1/${name%.xz}" ;;
                *.ko.zst) zstd -qdc "$f" >"$1/${name%.zst}" ;;
                *.ko.gz) gzip -dc "$f" >"$1/${name%.gz}" ;;
                *) cp "$f" "$1/$name" ;;
            esac || return
            echo "${name%.ko*}.ko" >>"$1/order"
        done
}

build_initramfs() { # CACHE_DIR OUT
    local dir tmp=$2.tmp.$$
    dir=$(mktemp -d "$1/build.XXXXXX")
    mkdir -p "$dir"/{bin,sbin,dev,proc,sys,newroot,modules}
    cp "$busybox" "$dir/bin/busybox"
    ln -s busybox "$dir/bin/sh"
    install -m 0755 "$guest_script" "$dir/init"
    if ! copy_modules "$dir/modules" ||
        ! (cd "$dir" && find . -print0 | LC_ALL=C sort -z | cpio --null -o -H newc -R 0:0 --quiet) |
        gzip -1 >"$tmp"; then
        rm -rf "$dir" "$tmp"
        say "building the initramfs failed (see above)"
        exit 125
    fi
    mv -f "$tmp" "$2" # atomic: concurrent runs never see a partial file
    rm -rf "$dir"
}

# ---------------------------------------------------------------- per-run files

# job.sh: what COMMAND gets, sourced by the guest in the subshell that execs COMMAND.
write_job() { # COMMAND [ARGS...]
    local name extra=() names=() a
    local -A exported=() seen=() skip=()
    for name in $(compgen -e); do exported[$name]=1; done
    for name in "${topology_vars[@]}"; do skip[$name]=1; done
    names=(PATH HOME CARGO_HOME RUSTUP_HOME CARGO_TARGET_DIR RUST_BACKTRACE RUST_LOG)
    for name in "${!exported[@]}"; do
        [[ $name == NODETOUR_* ]] && names+=("$name")
    done
    a=${NODETOUR_VM_ENV:-}
    read -r -a extra <<<"${a//,/ }"
    names+=("${extra[@]}")
    for name in "${names[@]}"; do
        if [[ ! $name =~ ^[A-Za-z_][A-Za-z0-9_]*$ ]]; then
            usage_error "NODETOUR_VM_ENV: '$name' is not a variable name"
        fi
        # Only what is in our environment: never this script's own variables.
        [[ -n ${exported[$name]:-} && -z ${skip[$name]:-} && -z ${seen[$name]:-} ]] || continue
        seen[$name]=1
        printf 'export %s=%s\n' "$name" "$(shquote "${!name}")"
    done
    printf 'CWD=%s\n' "$(shquote "$cwd")"
    printf 'set --'
    for a in "$@"; do printf ' %s' "$(shquote "$a")"; done
    printf '\n'
}

# ---------------------------------------------------------------- main

nodes=1 timeout_s=1200 cpus=2 mem=2G check=0
rw_dirs=()
while (($# > 0)); do
    case $1 in
        --nodes | --timeout | --cpus | --mem | --rw)
            (($# >= 2)) || usage_error "$1 needs a value"
            opt=$1 val=$2
            shift 2
            ;;
        --nodes=* | --timeout=* | --cpus=* | --mem=* | --rw=*)
            opt=${1%%=*} val=${1#*=}
            shift
            ;;
        --check)
            check=1
            shift
            continue
            ;;
        -h | --help) sed -n '2,/^set -euo/{/^#/s/^# \{0,1\}//p}' "${BASH_SOURCE[0]}" && exit 0 ;;
        --) shift && break ;;
        -*) usage_error "unknown option $1" ;;
        *) break ;;
    esac
    case $opt in
        --nodes)
            [[ $val == [12] ]] || usage_error "--nodes must be 1 or 2"
            nodes=$val
            ;;
        --timeout)
            [[ $val =~ ^[1-9][0-9]*$ ]] || usage_error "--timeout must be a number of seconds"
            timeout_s=$val
            ;;
        --cpus)
            [[ $val =~ ^[1-9][0-9]*$ ]] || usage_error "--cpus must be a positive number"
            cpus=$val
            ;;
        --mem)
            [[ $val =~ ^[1-9][0-9]*[KMGTkmgt]?$ ]] || usage_error "--mem: bad size '$val' (example: 2G)"
            mem=$val
            ;;
        --rw)
            [[ -d $val ]] || usage_error "--rw $val: no such directory"
            val=$(cd "$val" && pwd -P)
            [[ $val != / ]] || usage_error "--rw /: the whole root cannot be writable"
            [[ $val != *$'\n'* ]] || usage_error "--rw: a directory name with a newline"
            rw_dirs+=("$val")
            ;;
    esac
done

if ((check)); then
    if check_prereqs; then
        echo ok
        exit 0
    fi
    echo "SKIP $skip_reason"
    exit 3
fi

(($# > 0)) || usage_error "no COMMAND given"
if ! check_prereqs; then
    say "cannot run the VM here: $skip_reason"
    exit 125
fi

# The caller's directory must exist inside. Below a directory the guest mounts over (a
# checkout under /tmp, say) it is shared into the guest like a --rw directory.
cwd=$(pwd -P)
for d in "${guest_private_dirs[@]}"; do
    is_under "$cwd" "$d" || continue
    for r in "${rw_dirs[@]}"; do is_under "$cwd" "$r" && continue 2; done
    case $d in
        /dev | /proc | /sys)
            say "the current directory $cwd is below $d: run from elsewhere"
            exit 2
            ;;
    esac
    say "the current directory $cwd is below $d, which the guest mounts over: sharing it (as --rw $cwd)"
    rw_dirs+=("$cwd")
done

# shellcheck disable=SC2054 # the commas belong to QEMU's option syntax
case ${NODETOUR_VM_ACCEL:-tcg} in
    # KVM is not the default: on our CI machines /dev/kvm is a nested "PVM" hypervisor under
    # which Debian's kernel hangs in its decompressor (and -cpu host aborts on MSR 0x10a).
    # TCG, QEMU's software emulation, is slow but works everywhere.
    tcg) accel=(-accel tcg,thread=multi -cpu max) ;;
    kvm) accel=(-accel kvm -cpu host) ;;
    *) usage_error "NODETOUR_VM_ACCEL must be tcg or kvm" ;;
esac

initramfs

io=$(mktemp -d "${TMPDIR:-/tmp}/nodetour-rdma-vm.XXXXXX")
qemu_pid='' out_pid='' con_pid='' caught=''
# shellcheck disable=SC2317 # cleanup and on_signal run from traps
cleanup() {
    local p
    for p in $qemu_pid $out_pid $con_pid; do kill "$p" 2>/dev/null || true; done
    rm -rf "$io"
}
trap cleanup EXIT
# Ctrl-C reaches only us: timeout(1) runs QEMU in a process group of its own. Before the
# VM starts, just stop; once it runs, stop it (timeout passes the signal on to QEMU) and
# report after it is gone.
# shellcheck disable=SC2317
on_signal() {
    caught=$1
    [[ -n $qemu_pid ]] || exit $((128 + $(kill -l "$1")))
    kill -TERM "$qemu_pid" 2>/dev/null || true
}
trap 'on_signal INT' INT
trap 'on_signal TERM' TERM
trap 'on_signal HUP' HUP

echo "NODES=$nodes" >"$io/vm.conf"
: >"$io/rw.list"
((${#rw_dirs[@]} == 0)) || printf '%s\n' "${rw_dirs[@]}" >"$io/rw.list"
write_job "$@" >"$io/job.sh"

# QEMU option values are comma separated: a comma in a path is written twice.
fsdev() { # ID PATH [OPTIONS]
    printf -- '-fsdev\0local,id=%s,path=%s,security_model=none,multidevs=remap%s\0' "$1" "${2//,/,,}" "${3:+,$3}"
    printf -- '-device\0virtio-9p-pci,fsdev=%s,mount_tag=%s\0' "$1" "$1"
}
mapfile -d '' shares < <(
    fsdev hostroot / readonly=on
    fsdev vmio "$io"
    for i in "${!rw_dirs[@]}"; do fsdev "rw$i" "${rw_dirs[$i]}"; done
)

# Two serial ports: ttyS0 carries COMMAND's output to our stdout, ttyS1 is the guest's
# console (kernel messages, the guest scripts' own lines) and goes to our stderr along with
# QEMU's. Both come through FIFOs read by sed, which strips the tty's CRs and, unlike tr,
# does not hold output back in a buffer.
mkfifo "$io/out" "$io/console"
LC_ALL=C sed -u 's/\r//g' <"$io/out" &
out_pid=$!
LC_ALL=C sed -u 's/\r//g' <"$io/console" >&2 &
con_pid=$!

t0=$(date +%s.%N)
# quiet loglevel=4: warnings and worse from the guest kernel; panic=-1 with -no-reboot: a
# panicking guest ends QEMU at once instead of hanging until the timeout.
timeout --kill-after=10 "$timeout_s" qemu-system-x86_64 \
    -nodefaults -no-user-config -machine q35 "${accel[@]}" \
    -smp "$cpus" -m "$mem" -display none -no-reboot \
    -kernel "$kernel" -initrd "$initrd" \
    -append "console=ttyS1 quiet loglevel=4 panic=-1 rdinit=/init" \
    -serial stdio -chardev "file,id=console,path=${io//,/,,}/console" -serial chardev:console \
    "${shares[@]}" \
    </dev/null >"$io/out" 2>"$io/console" &
qemu_pid=$!

while :; do
    qrc=0
    wait "$qemu_pid" || qrc=$?
    # A trapped signal interrupts wait while QEMU is still shutting down: wait again.
    [[ -n $caught ]] && kill -0 "$qemu_pid" 2>/dev/null && continue
    break
done
qemu_pid=
t1=$(date +%s.%N)
wait "$out_pid" "$con_pid" || true
out_pid='' con_pid=''

elapsed() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.1f", b - a }'; }
if [[ -s $io/rc ]]; then
    rc=$(<"$io/rc")
elif [[ -n $caught ]]; then
    rc=$((128 + $(kill -l "$caught")))
    say "interrupted (SIG$caught)"
elif ((qrc == 124 || qrc == 137)); then
    rc=124
    say "TIMEOUT: the VM ran for more than $timeout_s s"
else
    rc=125
    say "the VM ended without reporting COMMAND's exit status (QEMU exit status $qrc)"
fi
if [[ -e $io/started ]]; then
    boot="boot $(elapsed "$t0" "$(date -r "$io/started" +%s.%N)") s"
else
    boot="no boot"
fi
say "exit status $rc; $boot, wall $(elapsed "$t0" "$t1") s (nodes $nodes, ${NODETOUR_VM_ACCEL:-tcg}, $cpus cpus, $mem, kernel $kver)"
exit "$rc"
