#!/usr/bin/env bash
# launch-local.sh: start N processes of COMMAND on this machine with the environment torchrun
# gives (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), for tests,
# examples and users without a launcher.
#   scripts/launch-local.sh -n N [--timeout SECONDS] [--token TOKEN] [--hosts H] -- COMMAND [ARGS...]
# --hosts H splits this machine into H "hosts" (NODETOUR_HOST_ID=hostK for rank R, K = R*H/N:
# consecutive ranks share a host), so that the paths between hosts run here.
# Each rank's output is prefixed with "[rank R] ". The exit status is 0 when every rank exits 0;
# otherwise the first failing rank's status. When one rank fails, the others are left to notice
# (that is what the liveness mesh is for) and are killed only at the timeout (default 300 s).
# NODETOUR_JOB_TOKEN is set to --token, or to a fresh random token, unless already set.
set -euo pipefail
n=
timeout_s=300
token=${NODETOUR_JOB_TOKEN:-}
hosts=
while (($#)); do
    case $1 in
        -n) n=$2; shift 2 ;;
        --timeout) timeout_s=$2; shift 2 ;;
        --token) token=$2; shift 2 ;;
        --hosts) hosts=$2; shift 2 ;;
        --) shift; break ;;
        *) echo "usage: $0 -n N [--timeout S] [--token T] [--hosts H] -- COMMAND [ARGS...]" >&2; exit 2 ;;
    esac
done
[[ -n $n && $n -ge 1 && $# -ge 1 ]] || { echo "usage: $0 -n N [--timeout S] [--token T] [--hosts H] -- COMMAND [ARGS...]" >&2; exit 2; }
[[ -n $token ]] || token=$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')
# Free ports for torchrun's MASTER_PORT and for nodetour's rendezvous (NODETOUR_PORT; its
# default, MASTER_PORT + 17, might be taken), found while both are held so they differ.
# (No process substitution: minimal systems such as the test VM have no /dev/fd.)
ports=$(python3 -c 'import socket
a, b = socket.socket(), socket.socket()
a.bind(("127.0.0.1", 0)); b.bind(("127.0.0.1", 0))
print(a.getsockname()[1], b.getsockname()[1])' 2>/dev/null || echo $((20000 + RANDOM % 20000)) $((40000 + RANDOM % 20000)))
port=${ports% *}
nport=${ports#* }
[[ -n ${NODETOUR_PORT:-} ]] && nport=$NODETOUR_PORT
pids=()
for ((r = 0; r < n; r++)); do
    (
        set -o pipefail
        [[ -n $hosts ]] && export NODETOUR_HOST_ID=host$((r * hosts / n))
        RANK=$r WORLD_SIZE=$n LOCAL_RANK=$r LOCAL_WORLD_SIZE=$n MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
            NODETOUR_PORT=$nport NODETOUR_JOB_TOKEN=$token timeout --kill-after=5 "$timeout_s" "$@" 2>&1 | sed -u "s/^/[rank $r] /"
    ) &
    pids+=($!)
done
rc=0
for ((r = 0; r < n; r++)); do
    s=0
    wait "${pids[$r]}" || s=$?
    if ((rc == 0 && s != 0)); then rc=$s; fi
done
exit "$rc"
