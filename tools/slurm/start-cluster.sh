#!/usr/bin/env bash
# Start a real single-node SLURM cluster on this Debian machine, as root, without systemd.
#
#   tools/slurm/start-cluster.sh           install if needed, configure, start, wait until idle
#   tools/slurm/start-cluster.sh --status  exit 0 if the cluster this script started is up and idle
#
# Idempotent: a daemon this script started and that is still alive is left alone; a munged that
# already answers (e.g. a system one) is used, not replaced. Pids of what it starts go into
# $PROBES_SLURM_STATE/pids/; tools/slurm/stop-cluster.sh stops exactly those and removes the
# slurm.conf/gres.conf written here (they carry a marker line; a foreign one is never touched).
#
# The node advertises one fake GPU (GRES gpu:1 backed by /dev/null), so jobs that ask for
# --gpus=1 are scheduled and get CUDA_VISIBLE_DEVICES from SLURM, as on a real GPU node.
#
# Environment:
#   PROBES_SLURM_STATE     state dir (pids, logs, spool, job completion log) [/var/tmp/probes-slurm]
#   PROBES_SLURM_CONF_DIR  where slurm.conf and gres.conf go [/etc/slurm]; an existing slurm.conf
#                          not written by this script is never overwritten
#   PROBES_SLURM_WAIT_S    seconds to wait for the node to become idle [90]
#
# Exit codes: 0 up and idle; 1 failed; 3 SLURM is not installed and cannot be installed here
# (not root, no apt-get, or apt-get failed), so callers such as the test may skip.
set -euo pipefail

STATE="${PROBES_SLURM_STATE:-/var/tmp/probes-slurm}"
CONF_DIR="${PROBES_SLURM_CONF_DIR:-/etc/slurm}"
WAIT_S="${PROBES_SLURM_WAIT_S:-90}"
MARKER="# written by tools/slurm/start-cluster.sh"
PIDS="$STATE/pids"
NODE="$(hostname -s)"
PARTITION="main"

log() { echo "start-cluster: $*" >&2; }
die() { log "ERROR: $*"; exit "${2:-1}"; }

# A pid file names a live process running the expected program (guards against pid reuse).
alive() {
    local name="$1" pid
    [[ -s "$PIDS/$name.pid" ]] || return 1
    pid="$(cat "$PIDS/$name.pid")"
    [[ -r "/proc/$pid/comm" ]] && [[ "$(cat "/proc/$pid/comm")" == "$name" ]]
}

# Pids running a program, from /proc (no procps needed).
pids_of() {
    local comm
    for comm in /proc/[0-9]*/comm; do
        if [[ "$(cat "$comm" 2>/dev/null)" == "$1" ]]; then basename "$(dirname "$comm")"; fi
    done | tr '\n' ' ' | sed 's/ $//'
}

node_state() {
    sinfo --noheader --nodes="$NODE" --format=%T 2>/dev/null | head -n 1 | tr -d '[:space:]*~#'
}

if [[ "${1:-}" == "--status" ]]; then
    alive slurmctld && alive slurmd && [[ "$(node_state)" == idle || "$(node_state)" == mixed ||
        "$(node_state)" == allocated ]] && { log "up (node $NODE: $(node_state))"; exit 0; }
    log "not running"
    exit 1
fi

[[ "$(id -u)" == 0 ]] || die "must run as root (it installs packages and starts daemons)" 3

# --- 1. packages --------------------------------------------------------------------------------
missing=()
for bin in munged slurmctld slurmd sinfo sbatch squeue scontrol; do
    command -v "$bin" >/dev/null 2>&1 || [[ -x "/usr/sbin/$bin" ]] || missing+=("$bin")
done
if ((${#missing[@]})); then
    command -v apt-get >/dev/null 2>&1 || die "missing ${missing[*]} and no apt-get to install them" 3
    log "installing slurmctld slurmd slurm-client munge (missing: ${missing[*]})"
    export DEBIAN_FRONTEND=noninteractive
    { apt-get update -qq && apt-get install -y -qq --no-install-recommends \
        slurmctld slurmd slurm-client munge; } >&2 || die "apt-get install failed" 3
fi

mkdir -p "$PIDS" "$STATE/log" "$STATE/ctld" "$STATE/slurmd"

# --- 2. munge -----------------------------------------------------------------------------------
munge_works() { munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }
if alive munged; then
    log "munged: already running (pid $(cat "$PIDS/munged.pid"))"
elif munge_works; then
    log "munged: one not started by this script answers; using it"
else
    [[ -s /etc/munge/munge.key ]] || {
        log "creating /etc/munge/munge.key"
        (umask 077 && dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none)
        chown munge:munge /etc/munge/munge.key
    }
    install -d -o munge -g munge -m 0755 /run/munge
    install -d -o munge -g munge -m 0700 /var/lib/munge /var/log/munge
    # setsid and setpriv exec in place, so $! is munged's own pid.
    setsid setpriv --reuid=munge --regid=munge --init-groups /usr/sbin/munged --foreground \
        </dev/null >>"$STATE/log/munged.out" 2>&1 &
    echo $! >"$PIDS/munged.pid"
    for _ in $(seq 50); do munge_works && break; sleep 0.1; done
    munge_works || die "munged did not come up; see $STATE/log/munged.out and /var/log/munge"
    log "munged: started (pid $(cat "$PIDS/munged.pid"))"
fi

# --- 3. config ----------------------------------------------------------------------------------
cpus="$(nproc)"
# RealMemory a little under what is free now: slurmd drains a node that claims more than it has.
avail_mb=$(($(awk '/^MemAvailable:/ {print $2}' /proc/meminfo) / 1024))
real_mb=$((avail_mb * 9 / 10))

mkdir -p "$CONF_DIR"
if [[ -e "$CONF_DIR/slurm.conf" ]] && ! grep -qF "$MARKER" "$CONF_DIR/slurm.conf"; then
    die "$CONF_DIR/slurm.conf exists and was not written by this script; not touching it"
fi
new_conf="$(mktemp)"
cat >"$new_conf" <<CONF
$MARKER: a single-node test cluster with one fake GPU.
ClusterName=probes
SlurmctldHost=$NODE(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
# No cgroups and no systemd here: track processes by parent pid, no task confinement.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SlurmdParameters=config_overrides
ReturnToService=2
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/slurmd
SlurmctldPidFile=$STATE/ctld/slurmctld.pid
SlurmdPidFile=$STATE/slurmd/slurmd.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd.log
# No slurmdbd, so no accounting database (and gres/gpu cannot be a tracked TRES): finished
# jobs stay visible to squeue/scontrol for MinJobAge seconds (Snakemake's squeue status checks
# rely on that), and each one is appended to the job completion log.
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/filetxt
JobCompLoc=$STATE/log/jobcomp.log
MinJobAge=600
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
GresTypes=gpu
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$real_mb Gres=gpu:1 State=UNKNOWN
PartitionName=$PARTITION Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
CONF
conf_changed=0
if ! cmp -s "$new_conf" "$CONF_DIR/slurm.conf" 2>/dev/null; then
    # RealMemory follows free memory; rewrite only when something else changed, so a rerun
    # does not restart daemons over a few megabytes.
    if [[ -e "$CONF_DIR/slurm.conf" ]] &&
        diff <(grep -v '^NodeName=' "$new_conf") <(grep -v '^NodeName=' "$CONF_DIR/slurm.conf") \
            >/dev/null && grep -q "^NodeName=$NODE .*CPUs=$cpus " "$CONF_DIR/slurm.conf"; then
        :
    else
        install -m 0644 "$new_conf" "$CONF_DIR/slurm.conf"
        conf_changed=1
    fi
fi
rm -f "$new_conf"
printf '%s\nAutoDetect=off\nNodeName=%s Name=gpu File=/dev/null\n' "$MARKER" "$NODE" \
    >"$CONF_DIR/gres.conf.new"
if cmp -s "$CONF_DIR/gres.conf.new" "$CONF_DIR/gres.conf" 2>/dev/null; then
    rm -f "$CONF_DIR/gres.conf.new"
else
    mv "$CONF_DIR/gres.conf.new" "$CONF_DIR/gres.conf"
    conf_changed=1
fi

# --- 4. daemons ---------------------------------------------------------------------------------
start_daemon() {
    local name="$1"
    shift
    if alive "$name"; then
        if ((conf_changed)); then
            log "$name: config changed; restarting pid $(cat "$PIDS/$name.pid")"
            stop_pid "$name"
        else
            log "$name: already running (pid $(cat "$PIDS/$name.pid"))"
            return
        fi
    fi
    local other
    other="$(pids_of "$name")"
    [[ -z "$other" ]] || die "a $name not started by this script is running (pid $other); stop it first"
    setsid "$@" </dev/null >>"$STATE/log/$name.out" 2>&1 &
    echo $! >"$PIDS/$name.pid"
    sleep 0.5
    alive "$name" || die "$name exited at once; see $STATE/log/$name.out and $STATE/log/$name.log"
    log "$name: started (pid $(cat "$PIDS/$name.pid"))"
}

stop_pid() {
    local name="$1" pid
    pid="$(cat "$PIDS/$name.pid")"
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 100); do [[ -d "/proc/$pid" ]] || break; sleep 0.1; done
    rm -f "$PIDS/$name.pid"
}

start_daemon slurmctld /usr/sbin/slurmctld -D
for _ in $(seq 50); do scontrol ping 2>/dev/null | grep -q UP && break; sleep 0.2; done
start_daemon slurmd /usr/sbin/slurmd -D

# --- 5. wait until the node is idle -------------------------------------------------------------
deadline=$((SECONDS + WAIT_S))
state=""
while ((SECONDS < deadline)); do
    state="$(node_state)"
    case "$state" in
    idle | mixed | allocated) break ;;
    drain* | down* | fail*)
        # A node left down by an earlier run (e.g. the machine rebooted) is brought back once.
        scontrol update nodename="$NODE" state=resume 2>/dev/null || true
        ;;
    esac
    sleep 1
done
case "$state" in
idle | mixed | allocated)
    log "node $NODE is $state: $(grep -o "^NodeName=$NODE .*" "$CONF_DIR/slurm.conf" | cut -d' ' -f3-5); partition $PARTITION"
    ;;
*)
    sinfo -R >&2 || true
    die "node $NODE is '${state:-unknown}' after ${WAIT_S}s; see $STATE/log/slurmd.log and slurmctld.log"
    ;;
esac
