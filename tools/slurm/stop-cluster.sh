#!/usr/bin/env bash
# Stop the single-node SLURM cluster that tools/slurm/start-cluster.sh started.
#
# Only processes whose pids start-cluster.sh recorded in $PROBES_SLURM_STATE/pids/ are stopped,
# and only if the pid still runs the program it was recorded for; a munged or slurm daemon
# started by anything else is left alone. The slurm.conf and gres.conf that start-cluster.sh
# wrote are removed too: with a slurm.conf naming a controller that is down, every `scontrol`
# (and so every `snakemake` command line, whose SLURM plugin asks scontrol for MinJobAge) hangs
# for about 10 s. Logs, spool and the job completion log stay in the state dir.
set -euo pipefail

STATE="${PROBES_SLURM_STATE:-/var/tmp/probes-slurm}"
CONF_DIR="${PROBES_SLURM_CONF_DIR:-/etc/slurm}"
MARKER="# written by tools/slurm/start-cluster.sh"
PIDS="$STATE/pids"

log() { echo "stop-cluster: $*" >&2; }

# slurmd first (it reports to slurmctld), munged last (both daemons authenticate through it).
for name in slurmd slurmctld munged; do
    file="$PIDS/$name.pid"
    [[ -s "$file" ]] || continue
    pid="$(cat "$file")"
    if [[ -r "/proc/$pid/comm" && "$(cat "/proc/$pid/comm")" == "$name" ]]; then
        kill -TERM "$pid"
        for _ in $(seq 100); do [[ -d "/proc/$pid" ]] || break; sleep 0.1; done
        if [[ -d "/proc/$pid" ]]; then
            log "$name (pid $pid) ignored SIGTERM for 10 s; sending SIGKILL"
            kill -KILL "$pid" 2>/dev/null || true
        fi
        log "$name: stopped (pid $pid)"
    else
        log "$name: pid $pid is no longer $name; nothing to stop"
    fi
    rm -f "$file"
done

for conf in slurm.conf gres.conf; do
    if [[ -f "$CONF_DIR/$conf" ]] && grep -qF "$MARKER" "$CONF_DIR/$conf"; then
        rm -f "$CONF_DIR/$conf"
        log "removed $CONF_DIR/$conf"
    fi
done
