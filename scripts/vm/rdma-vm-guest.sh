#!/bin/sh
# rdma-vm-guest.sh: the half of scripts/vm/rdma-vm.sh that runs INSIDE the throw-away VM.
#
# Not meant to be run by hand. rdma-vm.sh copies this file into its initramfs as /init:
#   /init          stage 1: PID 1 of the initramfs, under busybox sh. Loads the 9p modules,
#                  mounts the host's root filesystem read-only with tmpfs and the --rw
#                  directories on top, runs stage 2 chrooted into it, then powers off.
#   ... stage2     stage 2: the host's own bash, chrooted into the host root. Creates the
#                  soft-RoCE (rdma_rxe) devices, waits until they are usable, runs COMMAND.
#
# Plain POSIX sh on purpose: stage 1 runs under busybox, before the host root (and so the
# host's bash) is mounted.
#
# The host side and this script talk through the "vmio" 9p share, a per-run host directory
# mounted at $VMIO:
#   vm.conf  host -> guest  NODES=1|2
#   rw.list  host -> guest  one host directory per line; its 9p tags are rw0, rw1, ...
#   job.sh   host -> guest  exports for COMMAND, CWD=..., "set -- COMMAND ARGS..."
#   started  guest -> host  written when COMMAND starts (its host mtime gives the boot time)
#   rc       guest -> host  COMMAND's exit status, or 97 when the soft-RoCE setup failed;
#                           missing when the VM died first (the host then reports 125)
# /dev/console is ttyS1, which the host copies to the caller's stderr; COMMAND's output goes
# to ttyS0, which the host copies to the caller's stdout.

VMIO=/run/nodetour-vm
ROOT=/newroot
GID_INDEX=1 # rxe's GID table: 0 = the MAC-based fe80:: GID, 1 = the IPv4-mapped RoCE v2 GID

say() { echo "rdma-vm(guest): $*" >&2; }

# ---------------------------------------------------------------- stage 1 (busybox, PID 1)

# PID 1 must never exit (the kernel panics), so every failure ends in a power-off; the host
# sees no rc file and reports 125.
halt() {
    sync
    # Hide the kernel's "reboot: Power down" line from the caller's stderr.
    echo 0 >/proc/sys/kernel/printk 2>/dev/null
    poweroff -f
    sleep 5 # poweroff -f does not return; this only keeps PID 1 alive if it ever does
}

mount_9p() { # TAG DIR [EXTRA-OPTIONS]
    mount -t 9p -o "trans=virtio,version=9p2000.L,msize=512000${3:+,$3}" "$1" "$2"
}

stage1() {
    PATH=/bin:/sbin
    export PATH
    /bin/busybox --install -s /bin
    mount -t devtmpfs devtmpfs /dev
    # In case the kernel could not open an initial console for us.
    exec </dev/null >/dev/console 2>&1
    mount -t proc proc /proc
    mount -t sysfs sysfs /sys

    # rdma-vm.sh put the modules needed to reach the host root in /modules, listed in load
    # order (dependencies first): none of them is built into Debian's kernel.
    while read -r mod; do
        insmod "/modules/$mod" || say "insmod $mod failed"
    done </modules/order

    # cache=loose: the root is read-only and the VM short-lived, so caching everything is
    # both safe and by far the fastest.
    mount_9p hostroot "$ROOT" ro,cache=loose || { say "cannot mount the host root over 9p"; halt; }
    mount -t proc proc "$ROOT/proc"
    mount -t sysfs sysfs "$ROOT/sys"
    mount -t devtmpfs devtmpfs "$ROOT/dev"
    mkdir -p "$ROOT/dev/pts" "$ROOT/dev/shm"
    mount -t devpts -o mode=0620,ptmxmode=0666 devpts "$ROOT/dev/pts"
    for d in tmp var/tmp dev/shm; do
        mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs "$ROOT/$d" || say "no tmpfs on /$d"
    done
    for d in run var/log; do
        mount -t tmpfs -o mode=0755,nosuid,nodev tmpfs "$ROOT/$d" || say "no tmpfs on /$d"
    done

    mkdir -p "$ROOT$VMIO"
    mount_9p vmio "$ROOT$VMIO" || { say "cannot mount the vmio share"; halt; }

    # --rw directories. A directory below one of the tmpfs above has no mount point yet
    # (mkdir makes it); elsewhere it already exists in the read-only root. cache=mmap rather
    # than the default cache=none so that programs can mmap files there (shared writable
    # mappings fail with cache=none).
    i=0
    while IFS= read -r dir; do
        [ -n "$dir" ] || continue
        mkdir -p "$ROOT$dir" 2>/dev/null
        mount_9p "rw$i" "$ROOT$dir" cache=mmap || { say "cannot mount --rw $dir"; halt; }
        i=$((i + 1))
    done <"$ROOT$VMIO/rw.list"

    # Pitfall: when rxe asks for a module (it wants the "crc32" crypto driver while
    # "rdma link add" runs), the kernel execs /sbin/modprobe in the root of PID 1, i.e. this
    # initramfs, not in the chroot. Without this forwarder the request fails and
    # "rdma link add" reports "No such file or directory".
    mkdir -p /sbin
    printf '#!/bin/sh\nexec chroot %s /sbin/modprobe "$@"\n' "$ROOT" >/sbin/modprobe
    chmod 0755 /sbin/modprobe

    hostname nodetour-vm
    cp /init "$ROOT/run/rdma-vm-guest.sh"
    env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        chroot "$ROOT" /bin/bash /run/rdma-vm-guest.sh stage2
    halt
}

# ---------------------------------------------------------------- stage 2 (host bash, chroot)

# 10.99.0.1 -> 0000:0000:0000:0000:0000:ffff:0a63:0001, as in /sys/class/infiniband/*/gids.
mapped_gid() {
    echo "$1" | awk -F. '{ printf "0000:0000:0000:0000:0000:ffff:%02x%02x:%02x%02x\n", $1, $2, $3, $4 }'
}

# Runs in a subshell under set -e: any failing step aborts the setup with its own message.
create_devices() {
    modprobe rdma_rxe
    modprobe veth
    # rxe on a veth: with the peer end up the carrier is up, so the port goes ACTIVE; we
    # only want the netdev, nothing is plugged into the other end in the one-node case.
    ip link add vethA type veth peer name vethB
    # IPv6 would add more GIDs to the table; keep it to the two we know.
    sysctl -qw net.ipv6.conf.vethA.disable_ipv6=1 net.ipv6.conf.vethB.disable_ipv6=1
    if [ "$NODES" = 1 ]; then
        # Both endpoints on rxe0: rxe carries QP-to-QP traffic of one device on its internal
        # loopback path, and rdma_cm works.
        ip addr add 10.99.0.1/24 dev vethA
        ip link set vethA up
        ip link set vethB up
        rdma link add rxe0 type rxe netdev vethA
        return
    fi
    # Two devices, both in this one network namespace: the 6.1 rxe has no netns support
    # (its UDP socket and route lookups live in init_net, and completions fail with
    # LOC_QP_OP_ERR), so separate namespaces are not an option. Left alone, the kernel would
    # deliver packets between two local addresses through lo; policy routing makes RoCEv2
    # (UDP 4791) and the TCP side channel really cross the veth pair:
    #   - the "local" table moves from rule 0 to rule 100, so that it no longer wins first;
    #   - locally generated traffic (iif lo) to the peer address leaves through "its" veth;
    #   - traffic arriving on a veth still reaches the local table and is delivered;
    #   - rp_filter off and accept_local on, because those packets carry a local source.
    # rdma_cm does not cope with this (its connects are REJECTED); plain verbs do.
    for i in all default vethA vethB; do
        sysctl -qw "net.ipv4.conf.$i.rp_filter=0" "net.ipv4.conf.$i.accept_local=1"
    done
    ip addr add 10.99.0.1/32 dev vethA
    ip addr add 10.99.0.2/32 dev vethB
    ip link set vethA up
    ip link set vethB up
    ip rule add pref 100 lookup local
    ip rule del pref 0 lookup local
    ip rule add pref 10 iif lo to 10.99.0.2 lookup 100
    ip rule add pref 11 iif lo to 10.99.0.1 lookup 101
    ip route add 10.99.0.2 dev vethA src 10.99.0.1 table 100
    ip route add 10.99.0.1 dev vethB src 10.99.0.2 table 101
    rdma link add rxe0 type rxe netdev vethA
    rdma link add rxe1 type rxe netdev vethB
}

# Waits (20 s at most: TCG is slow) until DEV's port is ACTIVE and GID[GID_INDEX] is the
# RoCE v2 GID of IP: a QP created before that would fail to connect.
wait_port() { # DEV IP
    port=/sys/class/infiniband/$1/ports/1
    want=$(mapped_gid "$2")
    n=0
    while :; do
        state=$(cat "$port/state" 2>/dev/null)
        gid=$(cat "$port/gids/$GID_INDEX" 2>/dev/null)
        type=$(cat "$port/gid_attrs/types/$GID_INDEX" 2>/dev/null)
        case $state in *ACTIVE*)
            [ "$gid" = "$want" ] && [ "$type" = "RoCE v2" ] && return 0 ;;
        esac
        n=$((n + 1))
        if [ "$n" -gt 100 ]; then
            say "$1: not ready after 20 s: port state '${state:-none}'," \
                "GID[$GID_INDEX] '${gid:-none}' (${type:-no type}), expected $want (RoCE v2)"
            return 1
        fi
        sleep 0.2
    done
}

# shellcheck disable=SC2120 # its arguments come from job.sh ("set -- COMMAND ARGS...")
run_command() {
    # COMMAND writes into a FIFO (so it sees a pipe: no tty, no colour codes) that cat copies
    # to ttyS0. Not a plain "| cat" pipeline: a background process left behind by COMMAND
    # would keep that pipe open, and the VM would hang until the timeout.
    out=/run/nodetour-vm-out
    mkfifo "$out"
    cat "$out" >/dev/ttyS0 &
    cat_pid=$!
    cut -d' ' -f1 /proc/uptime >"$VMIO/started"
    (
        # shellcheck source=/dev/null # written by rdma-vm.sh for each run
        . "$VMIO/job.sh"
        export NODETOUR_VM=1 NODETOUR_VM_NODES="$NODES" \
            NODETOUR_VM_DEV0="$DEV0" NODETOUR_VM_DEV1="$DEV1" \
            NODETOUR_VM_IP0="$IP0" NODETOUR_VM_IP1="$IP1" NODETOUR_VM_GID_INDEX="$GID_INDEX"
        cd "$CWD" || exit 126
        unset OLDPWD
        exec "$@"
    ) </dev/null >"$out" 2>&1
    rc=$?
    # Give the output 10 s to drain, then cut off whatever still holds the FIFO open.
    n=0
    while kill -0 "$cat_pid" 2>/dev/null && [ "$n" -lt 50 ]; do
        sleep 0.2
        n=$((n + 1))
    done
    if kill -0 "$cat_pid" 2>/dev/null; then
        say "COMMAND exited, but processes it left behind still hold its output; cutting them off"
        kill "$cat_pid"
    fi
    echo "$rc" >"$VMIO/rc"
}

stage2() {
    # shellcheck source=/dev/null # written by rdma-vm.sh for each run
    . "$VMIO/vm.conf"
    # Root has CAP_IPC_LOCK anyway; this also covers programs that check the limit first.
    # shellcheck disable=SC3045 # stage 2 runs under bash
    ulimit -l unlimited 2>/dev/null
    ip link set lo up
    if [ "$NODES" = 1 ]; then
        DEV0=rxe0 DEV1=rxe0 IP0=10.99.0.1 IP1=10.99.0.1
    else
        DEV0=rxe0 DEV1=rxe1 IP0=10.99.0.1 IP1=10.99.0.2
    fi
    # Not inside an "if": set -e would be ignored there.
    (
        set -e
        create_devices
    )
    ok=$?
    [ "$ok" = 0 ] && wait_port "$DEV0" "$IP0" && wait_port "$DEV1" "$IP1"
    ok=$?
    if [ "$ok" != 0 ]; then
        say "soft-RoCE setup failed (see above); COMMAND was not run"
        echo 97 >"$VMIO/rc"
        return
    fi
    if [ "$NODES" = 1 ]; then
        topo="$DEV0 on vethA $IP0"
    else
        topo="$DEV0 on vethA $IP0, $DEV1 on vethB $IP1"
    fi
    say "$topo: ACTIVE, GID index $GID_INDEX; up after $(cut -d' ' -f1 /proc/uptime) s"
    # shellcheck disable=SC2119
    run_command
}

case ${1:-} in
    stage2) stage2 ;;
    *)
        if [ "$$" = 1 ]; then
            stage1
        else
            echo "usage: run by scripts/vm/rdma-vm.sh inside its VM, not by hand" >&2
            exit 2
        fi
        ;;
esac
