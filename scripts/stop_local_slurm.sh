#!/usr/bin/env bash
# stop_local_slurm.sh - stop what scripts/start_local_slurm.sh started: jobs are cancelled, then
# the daemons are stopped by the pids in $SLURM_LOCAL_DIR/run (never by process name); step
# daemons of OUR slurmds (they hold our slurmd log open) are killed if they hang. munged only
# if start_local_slurm.sh started it, and the owner watcher of SLURM_LOCAL_OWNER_PID (unless that
# watcher is what runs this script). Idempotent.
#   SLURM_LOCAL_DIR    [/tmp/megatron-grpo-slurm]
#   SLURM_LOCAL_PURGE  1: also delete $SLURM_LOCAL_DIR, our /etc/slurm files and /etc/hosts lines [0]
set -uo pipefail

DIR=${SLURM_LOCAL_DIR:-/tmp/megatron-grpo-slurm}
PURGE=${SLURM_LOCAL_PURGE:-0}
TAG="# written by megatron-grpo scripts/start_local_slurm.sh ($DIR)"
export SLURM_CONF=$DIR/etc/slurm.conf
say() { echo "[stop_local_slurm] $*"; }

alive() {
    [ "$(cat "/proc/$1/comm" 2>/dev/null)" = "$2" ] || return 1
    local state
    state=$(sed 's/^.*) //' "/proc/$1/stat" 2>/dev/null | cut -d' ' -f1)
    [ -n "$state" ] && [ "$state" != Z ] && [ "$state" != X ]
}
pid_of() {
    local pid
    pid=$(cat "$DIR/run/$1.pid" 2>/dev/null) || return 1
    [[ $pid =~ ^[0-9]+$ ]] && alive "$pid" "$2" && echo "$pid"
}
# slurmstepd processes of our slurmds: no pid file, and their environ is overwritten by the
# process title; they are ours when their cwd is $DIR/log or they hold $DIR/log/slurmd-*.log open.
kill_our_stepds() {
    local p pid fd ours
    for p in /proc/[0-9]*; do
        case "$(cat "$p/comm" 2>/dev/null)" in slurmstepd*) ;; *) continue ;; esac
        pid=${p#/proc/}; ours=0
        [ "$(readlink "$p/cwd" 2>/dev/null)" = "$DIR/log" ] && ours=1
        for fd in "$p"/fd/*; do
            case "$(readlink "$fd" 2>/dev/null)" in "$DIR"/log/slurmd-*.log) ours=1; break ;; esac
        done
        if [ "$ours" = 1 ]; then kill -KILL "$pid" 2>/dev/null && say "killed stray slurmstepd $pid"; fi
    done
    return 0
}
stop_one() {  # read the pid once (slurmd deletes its pid file on TERM), TERM, wait 15 s, KILL
    local pid i
    if ! pid=$(pid_of "$1" "$2"); then rm -f "$DIR/run/$1.pid"; return 0; fi
    kill -TERM "$pid" 2>/dev/null
    for i in $(seq 75); do
        alive "$pid" "$2" || break
        [ "$2" = slurmd ] && [ "$i" = 10 ] && kill_our_stepds   # a slurmd waits for hung steps
        sleep 0.2
    done
    if alive "$pid" "$2"; then kill -KILL "$pid" 2>/dev/null; say "$1: pid $pid killed"; else say "$1: pid $pid stopped"; fi
    rm -f "$DIR/run/$1.pid"
}

watcher=$(cat "$DIR/run/watcher.pid" 2>/dev/null || true)
if [[ $watcher =~ ^[0-9]+$ ]] && [ "$watcher" != $$ ] \
        && tr '\0' ' ' < "/proc/$watcher/cmdline" 2>/dev/null | grep -qF "megatron-grpo-slurm-watcher $DIR "; then
    kill "$watcher" 2>/dev/null && say "owner watcher: pid $watcher stopped"
fi
rm -f "$DIR/run/watcher.pid"

if pid_of slurmctld slurmctld >/dev/null && [ -f "$SLURM_CONF" ]; then
    jobs=$(squeue -h -o %i 2>/dev/null | tr '\n' ' ')
    if [ -n "${jobs// /}" ]; then
        say "cancelling jobs: $jobs"
        read -r -a job_ids <<< "$jobs"
        scancel "${job_ids[@]}" 2>/dev/null
        for _ in $(seq 25); do [ -z "$(squeue -h -o %i 2>/dev/null)" ] && break; sleep 0.2; done
    fi
fi
for f in "$DIR"/run/slurmd-*.pid; do [ -e "$f" ] && stop_one "$(basename "$f" .pid)" slurmd; done
kill_our_stepds
stop_one slurmctld slurmctld
stop_one munged munged

if [ "$PURGE" = 1 ]; then
    for f in /etc/slurm/slurm.conf /etc/slurm/gres.conf; do
        grep -qsF "$TAG" "$f" && rm -f "$f" && say "removed $f"
    done
    if grep -qF "$TAG" /etc/hosts; then
        grep -vF "$TAG" /etc/hosts > /etc/hosts.megatron-grpo.tmp && cat /etc/hosts.megatron-grpo.tmp > /etc/hosts
        rm -f /etc/hosts.megatron-grpo.tmp; say "removed our /etc/hosts lines"
    fi
    rm -rf "$DIR" && say "removed $DIR"
fi
exit 0
