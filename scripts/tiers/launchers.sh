#!/usr/bin/env bash
# launchers.sh: real launchers start a job that forms nodetour's communicator from their own
# environment (no MASTER_ADDR, no NODETOUR_*) and checks its allreduces on every rank:
#   - Open MPI's mpirun -n 4 (--allow-run-as-root --oversubscribe);
#   - Slurm's srun -n 4, on a one-machine Slurm started here (munged, slurmctld, slurmd, no
#     systemd, no cgroups), then a second step of the same job at once (job and step ids
#     choose the rendezvous port: two steps never collide), then stopped by its pid files.
# Usage: scripts/tiers/launchers.sh [BINARY]   (default target/release/examples/allreduce_check)
# Each launcher this machine lacks prints "SKIP <reason>"; with NODETOUR_REQUIRE_LAUNCHERS=1 a
# missing launcher is a failure. Needs root for Slurm (CI runs as root). Exit status: failures.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
bin=${1:-target/release/examples/allreduce_check}
failed=0
skip() {
    echo "SKIP $*"
    [[ ${NODETOUR_REQUIRE_LAUNCHERS:-0} == 1 ]] && failed=$((failed + 1))
}
# expect N OUTPUT: N ranks printed ALLREDUCE OK.
expect() {
    local got
    got=$(grep -c '^ALLREDUCE OK' <<<"$2")
    if [[ $got != "$1" ]]; then
        echo "launchers: $got of $1 ranks reported ALLREDUCE OK"
        return 1
    fi
}
# The jobs read only their launcher's variables.
unset MASTER_ADDR MASTER_PORT NODETOUR_MASTER_ADDR NODETOUR_PORT NODETOUR_RANK NODETOUR_WORLD_SIZE

echo "== mpirun -n 4 (Open MPI)"
if command -v mpirun >/dev/null; then
    out=$(timeout 300 mpirun --allow-run-as-root --oversubscribe -n 4 "$bin" --all 2>&1)
    rc=$?
    grep -E 'ALLREDUCE OK|rror' <<<"$out"
    { [[ $rc == 0 ]] && expect 4 "$out"; } || { echo "mpirun job failed (exit $rc)"; failed=$((failed + 1)); }
else
    skip "mpirun: Open MPI is not installed (apt-get install openmpi-bin)"
fi

echo "== srun -n 4 (Slurm on this machine)"
slurm_run() {
    local dir=$1 host conf
    host=$(hostname -s)
    conf=$dir/slurm.conf
    mkdir -p "$dir/state" "$dir/spool"
    cat >"$conf" <<EOF
ClusterName=nodetour
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
ProctrackType=proctrack/pgid
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
NodeName=$host NodeAddr=127.0.0.1 CPUs=4 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=30 State=UP
EOF
    export SLURM_CONF=$conf
    # munge: a key (the package makes one; else here), its run directory, the daemon as munge.
    if [[ ! -s /etc/munge/munge.key ]]; then
        dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
        chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
    fi
    install -d -o munge -g munge -m 0755 /run/munge
    if ! munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then
        runuser -u munge -- /usr/sbin/munged || { echo "munged did not start"; return 1; }
    fi
    slurmctld -f "$conf" || { echo "slurmctld did not start"; return 1; }
    slurmd -f "$conf" || { echo "slurmd did not start"; return 1; }
    local i
    for i in $(seq 1 60); do
        sinfo -h -o '%t' 2>/dev/null | grep -qE '^(idle|mix|alloc)' && break
        sleep 1
    done
    sinfo -h -o '%N %t %c' || true
    local out rc
    out=$(timeout 300 srun -n 4 --time=10 "$bin" --all 2>&1)
    rc=$?
    grep -E 'ALLREDUCE OK|rror' <<<"$out"
    { [[ $rc == 0 ]] && expect 4 "$out"; } || { echo "srun job failed (exit $rc)"; tail -5 "$dir/slurmd.log"; return 1; }
    # Two steps of one job, one after the other and then side by side: each step's port.
    out=$(timeout 300 salloc -n 4 --time=10 bash -c "
        srun -n 2 '$bin' & srun -n 2 '$bin' & wait" 2>&1)
    rc=$?
    grep -E 'ALLREDUCE OK|rror' <<<"$out"
    { [[ $rc == 0 ]] && expect 4 "$out"; } || { echo "two concurrent steps failed (exit $rc)"; return 1; }
}
slurm_stop() {
    local dir=$1 f
    for f in "$dir/slurmd.pid" "$dir/slurmctld.pid"; do
        [[ -s $f ]] && kill "$(cat "$f")" 2>/dev/null
    done
    sleep 1
}
if ! command -v srun >/dev/null || ! command -v slurmctld >/dev/null; then
    skip "srun: Slurm is not installed (apt-get install slurmctld slurmd slurm-client munge)"
elif [[ $(id -u) != 0 ]]; then
    skip "srun: starting a one-machine Slurm needs root"
else
    dir=$(mktemp -d /tmp/nodetour-slurm.XXXXXX)
    if ! slurm_run "$dir"; then
        failed=$((failed + 1))
    fi
    slurm_stop "$dir"
fi
echo "launchers: $failed failed"
exit $((failed > 0))
