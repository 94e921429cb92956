#!/usr/bin/env bash
# A real Slurm cluster on this one host, for the tests of `reel launch slurm` (marker `slurm`).
#
#   ops/slurm/local_cluster.sh start    install slurm-wlm + munge if missing, then start munged,
#                                       slurmctld and one slurmd per virtual node (n1..n4); waits
#                                       until every node is idle. Running it again is a no-op when
#                                       the cluster is up with the same slurm.conf.
#   ops/slurm/local_cluster.sh stop     stop, by PID, every daemon this script started
#   ops/slurm/local_cluster.sh status   sinfo
#
# Why it looks like this (checked on Debian bookworm, Slurm 22.05, no systemd, gVisor kernel):
# - a heterogeneous job starts only when each component gets its own node, so there are 4 nodes;
# - SlurmctldHost must equal `hostname -s`, so slurm.conf is generated here, at run time;
# - no cgroups under this kernel: proctrack/linuxproc, task/none.
# The Slurm commands read /etc/slurm/slurm.conf, so that is where the config goes; a slurm.conf
# this script did not write is never overwritten. State, spool and logs: $REEL_SLURM_STATE.
set -euo pipefail

STATE=${REEL_SLURM_STATE:-/tmp/reel-slurm}
CONF=/etc/slurm/slurm.conf
MARKER="# written by reel ops/slurm/local_cluster.sh"
NODES=(n1 n2 n3 n4)
FIRST_PORT=17001

log() { echo "local_cluster: $*" >&2; }

install_packages() {  # with no daemon started or enabled by the install: this script starts its own
    command -v slurmctld >/dev/null && command -v munged >/dev/null && return
    log "installing slurm-wlm and munge"
    bash "$(dirname "$0")/../apt_install.sh" slurm-wlm munge
}

render_conf() {
    local host port=$FIRST_PORT node
    host=$(hostname -s)
    cat <<EOF
$MARKER
ClusterName=localcluster
SlurmctldHost=$host
AuthType=auth/munge
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$STATE/state
SlurmdSpoolDir=$STATE/spool-%n
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd-%n.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=2,bf_hetjob_immediate
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
SlurmdParameters=config_overrides
EOF
    for node in "${NODES[@]}"; do
        echo "NodeName=$node NodeHostname=$host NodeAddr=127.0.0.1 Port=$port CPUs=4 RealMemory=6000 State=UNKNOWN"
        port=$((port + 1))
    done
    echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=60 DefaultTime=10 State=UP OverSubscribe=YES"
}

alive() { [[ -f $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

all_alive() {
    local node
    alive "$STATE/slurmctld.pid" || return 1
    for node in "${NODES[@]}"; do alive "$STATE/slurmd-$node.pid" || return 1; done
}

start_munge() {
    munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && return
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    chown munge:munge /run/munge /var/log/munge /var/lib/munge
    [[ -f /etc/munge/munge.key ]] || su -s /bin/sh munge -c "mungekey --create"
    su -s /bin/sh munge -c /usr/sbin/munged
    touch "$STATE/munged.started"  # so that `stop` stops only a munged this script started
    local _
    for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && return; sleep 0.1; done
    log "munged did not start"; exit 1
}

wait_idle() {
    local _ states
    for _ in $(seq 120); do
        states=$(sinfo -h -N -o '%t' 2>/dev/null | sort -u | tr '\n' ' ')
        [[ $states == "idle " ]] && return
        sleep 0.5
    done
    log "nodes did not become idle (states: ${states:-none}); see $STATE/log"; exit 1
}

start() {
    install_packages
    if [[ -f $CONF ]] && ! grep -qxF "$MARKER" "$CONF"; then
        log "$CONF was not written by this script; refusing to replace it"; exit 1
    fi
    mkdir -p "$STATE/state" "$STATE/log"
    local wanted
    wanted=$(render_conf)
    if [[ -f $CONF && $(cat "$CONF") == "$wanted" ]] && all_alive; then
        log "already running (${#NODES[@]} nodes)"; wait_idle; return
    fi
    stop_daemons  # node definitions changed or a daemon died: slurmctld must restart
    mkdir -p /etc/slurm
    printf '%s\n' "$wanted" > "$CONF"
    start_munge
    slurmctld -i
    local node
    for node in "${NODES[@]}"; do
        mkdir -p "$STATE/spool-$node"
        slurmd -N "$node"
    done
    wait_idle
    log "up: ${#NODES[@]} nodes, partition debug (state in $STATE)"
}

stop_pidfile() {
    local pidfile=$1 pid _
    [[ -f $pidfile ]] || return 0
    pid=$(cat "$pidfile")
    if kill -0 "$pid" 2>/dev/null; then
        kill -TERM "$pid"
        for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -0 "$pid" 2>/dev/null && kill -KILL "$pid"
    fi
    rm -f "$pidfile"
}

stop_daemons() {
    local node
    for node in "${NODES[@]}"; do stop_pidfile "$STATE/slurmd-$node.pid"; done
    stop_pidfile "$STATE/slurmctld.pid"
}

stop() {
    stop_daemons
    if [[ -f $STATE/munged.started ]]; then
        stop_pidfile /run/munge/munged.pid
        rm -f "$STATE/munged.started"
    fi
    log "stopped"
}

case "${1:-start}" in
    start) start ;;
    stop) stop ;;
    status) sinfo ;;
    *) echo "usage: $0 [start|stop|status]" >&2; exit 2 ;;
esac
