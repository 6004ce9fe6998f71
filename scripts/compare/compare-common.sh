# compare-common.sh: sourced by write-bw-compare.sh and write-lat-compare.sh (inside the VM):
# the VM's topology and the helpers both comparisons use.
: "${NODETOUR_VM_DEV0:?run inside scripts/vm/rdma-vm.sh}"
BIN=${NODETOUR_BIN:-target/release/nodetour}
RUNS=${RUNS:-3}
GID=${NODETOUR_VM_GID_INDEX:-1}
SRV_DEV=$NODETOUR_VM_DEV1 CLI_DEV=$NODETOUR_VM_DEV0 SRV_IP=$NODETOUR_VM_IP1
results=$(mktemp)

# Waits until something listens on TCP port $1 (up to 60 s): a fixed sleep races a slow start.
wait_listen() {
  local i
  for i in $(seq 600); do
    ss -ltn 2>/dev/null | grep -q ":$1 " && return 0
    sleep 0.1
  done
  echo "nothing listens on port $1 after 60 s" >&2; return 1
}

median() { sort -g | awk '{v[NR]=$1} END {if (NR==0) print "nan"; else if (NR%2) print v[(NR+1)/2]; else print (v[NR/2]+v[NR/2+1])/2}'; }

# The median of column 3 of the results lines "$1 $2 value".
median_of() { awk -v s="$1" -v k="$2" '$1==s && $2==k {print $3}' "$results" | median; }

ratio() { awk -v o="$1" -v p="$2" 'BEGIN{printf "%.2f", (p>0)?o/p:0}'; }
