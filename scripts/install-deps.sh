#!/usr/bin/env bash
# install-deps.sh: install the Debian/Ubuntu packages that nodetour needs to build and to run
# its soft-RoCE VM tests (scripts/vm/rdma-vm.sh). Idempotent: installs only what is missing, and
# touches apt (update included) only then.
#
# Usage: scripts/install-deps.sh [--build-only]
#   --build-only  only what the build needs (headers for the verbs bindings, libclang for
#                 bindgen, pkg-config), not the VM tier nor Open MPI (the host paths' reference)
#
# Runs apt-get as root, through sudo when not root. Prints one line per action.
set -euo pipefail

say() { echo "install-deps: $*"; }

build_pkgs=(libibverbs-dev librdmacm-dev libclang-dev pkg-config)
# The VM tier: QEMU, a kernel with rdma_rxe and the 9p modules (the VM boots it from /boot),
# what rdma-vm.sh builds its initramfs with (kmod, cpio, static busybox), what the guest
# sets up soft-RoCE with (iproute2, rdma-core) and the verbs userspace and tools.
vm_pkgs=(qemu-system-x86 kmod cpio busybox-static iproute2 rdma-core ibverbs-providers
    ibverbs-utils rdmacm-utils perftest valgrind)

# The test tier's reference for the host paths: Open MPI over tcp (scripts/compare/mpi-compare.sh);
# and the real launchers the launcher tier starts jobs with (scripts/tiers/launchers.sh):
# Open MPI's mpirun and a one-machine Slurm.
# The Python tier's virtual environment (scripts/python.sh: torch and maturin from PyPI).
test_pkgs=(openmpi-bin libopenmpi-dev slurmctld slurmd slurm-client munge python3-venv)

build_only=0
case ${1:-} in
    "") ;;
    --build-only) build_only=1 ;;
    -h | --help) sed -n '2,/^set -euo/{/^#/s/^# \{0,1\}//p}' "${BASH_SOURCE[0]}" && exit 0 ;;
    *)
        echo "usage: $0 [--build-only]" >&2
        exit 2
        ;;
esac
(($# <= 1)) || {
    echo "usage: $0 [--build-only]" >&2
    exit 2
}

if ! command -v apt-get >/dev/null || ! command -v dpkg-query >/dev/null; then
    say "apt-get/dpkg-query not found: this script knows only Debian and Ubuntu" >&2
    exit 1
fi

pkgs=("${build_pkgs[@]}")
if ((!build_only)); then
    pkgs+=("${test_pkgs[@]}")
    if [[ $(dpkg --print-architecture) != amd64 ]]; then
        # The VM boots an x86_64 kernel over this machine's own root filesystem.
        say "skipping the VM packages: the VM tier needs an amd64 machine"
    else
        # The kernel the VM boots. Ubuntu's linux-image-generic also pulls in
        # linux-modules-extra, which is where rdma_rxe lives there.
        os=
        if [[ -r /etc/os-release ]]; then
            # shellcheck source=/dev/null
            os=$(. /etc/os-release && echo " ${ID:-} ${ID_LIKE:-} ") || os=
        fi
        if [[ $os == *" ubuntu "* ]]; then
            pkgs+=(linux-image-generic)
        else
            pkgs+=(linux-image-amd64)
        fi
        pkgs+=("${vm_pkgs[@]}")
    fi
fi

installed() {
    [[ $(dpkg-query -W -f='${db:Status-Status}' "$1" 2>/dev/null) == installed ]]
}

missing=()
for p in "${pkgs[@]}"; do
    installed "$p" || missing+=("$p")
done
if ((${#missing[@]} == 0)); then
    say "all ${#pkgs[@]} packages already installed"
    exit 0
fi
say "missing: ${missing[*]}"

as_root=()
if ((EUID != 0)); then
    if ! command -v sudo >/dev/null; then
        say "not root and no sudo: cannot install ${missing[*]}" >&2
        exit 1
    fi
    as_root=(sudo)
fi

# apt's own output goes to a log, shown only when something fails.
log=$(mktemp "${TMPDIR:-/tmp}/install-deps.XXXXXX")
trap 'rm -f "$log"' EXIT
run_apt() {
    # The lock timeout makes us wait for another apt/dpkg (unattended upgrades, a parallel
    # job) instead of failing at once.
    if ! "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive \
        apt-get -o DPkg::Lock::Timeout=600 "$@" >"$log" 2>&1; then
        say "apt-get $1 failed:" >&2
        tail -n 30 "$log" >&2
        exit 1
    fi
}

say "apt-get update"
run_apt update -qq
say "apt-get install ${missing[*]}"
run_apt install -y -q --no-install-recommends "${missing[@]}"

still=()
for p in "${missing[@]}"; do
    installed "$p" || still+=("$p")
done
if ((${#still[@]} > 0)); then
    say "still not installed after apt-get: ${still[*]}" >&2
    exit 1
fi
say "installed ${missing[*]}"
