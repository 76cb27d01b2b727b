#!/usr/bin/env bash
# start_local_slurm.sh - a real Slurm cluster on this one machine, for the tests of slurm/*.sh:
# munged + slurmctld + one slurmd per (emulated) node, all on 127.0.0.1, as plain background
# daemons (no systemd, no cgroups). Needs root; missing packages come from
# scripts/install_test_deps.sh (Debian/Ubuntu apt).
#
# Idempotent: called again with the same settings it finds its daemons by pid file and only
# re-checks that the nodes are idle (well under a second). Other settings: our slurm daemons
# restart with a clean state (slurmctld -c). Stop with scripts/stop_local_slurm.sh.
#
# Settings (environment):
#   SLURM_LOCAL_DIR          config / state / logs / pid files        [/tmp/megatron-grpo-slurm]
#   SLURM_LOCAL_NODES        number of nodes; 1 = this host's name,   [1]
#                            >1 = node1..nodeN, one slurmd each (names go to /etc/hosts as 127.0.0.1)
#   SLURM_LOCAL_CPUS         CPUs each node claims                    [nproc]
#   SLURM_LOCAL_MEM_MB       memory each node claims (MB)             [what slurmd -C reports]
#   SLURM_LOCAL_GPUS         fake GPUs per node (gres gpu on char devices with /dev/null's
#                            numbers): GPU scripts are accepted, Slurm sets CUDA_VISIBLE_DEVICES,
#                            but there is no GPU behind them           [0]
#   SLURM_LOCAL_MIN_JOB_AGE  MinJobAge; <= 5 makes `sbatch --wait` poll every 2 s instead of
#                            2, 10, 42, 74 ... s                       [5]
#   SLURM_LOCAL_CTLD_PORT / SLURM_LOCAL_SLURMD_PORT   ports (node i uses SLURMD_PORT+i-1) [6817/6818]
#   SLURM_LOCAL_TIMEOUT      seconds to wait for idle nodes           [60]
#   SLURM_LOCAL_OWNER_PID    the cluster lives only as long as this process (scripts/test.sh
#                            passes its $$): a detached watcher runs stop_local_slurm.sh once the
#                            process is gone, also after kill -9            [unset: until stopped]
#
# Afterwards:  source "$SLURM_LOCAL_DIR/env.sh"  (exports SLURM_CONF); /etc/slurm/slurm.conf is
# also written when it is absent or ours, so plain `sbatch` works too.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DIR=${SLURM_LOCAL_DIR:-/tmp/megatron-grpo-slurm}
NODES=${SLURM_LOCAL_NODES:-1}
CPUS=${SLURM_LOCAL_CPUS:-$(nproc)}
MEM_MB=${SLURM_LOCAL_MEM_MB:-}
GPUS=${SLURM_LOCAL_GPUS:-0}
MIN_JOB_AGE=${SLURM_LOCAL_MIN_JOB_AGE:-5}
CTLD_PORT=${SLURM_LOCAL_CTLD_PORT:-6817}
SLURMD_PORT=${SLURM_LOCAL_SLURMD_PORT:-6818}
TIMEOUT=${SLURM_LOCAL_TIMEOUT:-60}
TAG="# written by megatron-grpo scripts/start_local_slurm.sh ($DIR)"

say() { echo "[start_local_slurm] $*"; }
die() { echo "[start_local_slurm] ERROR: $*" >&2; exit 1; }
NODE_NAMES=()
die_logs() {  # die, with the ends of our daemons' logs
    echo "[start_local_slurm] ERROR: $*" >&2
    local f
    for f in "$DIR"/log/*.log /var/log/munge/munged.log; do
        [ -f "$f" ] || continue
        echo "---- tail $f" >&2; tail -n 15 "$f" >&2
    done
    exit 1
}

[ "$(id -u)" = 0 ] || die "needs root (munged, slurmd and SlurmUser=root)"
for v in NODES CPUS GPUS MIN_JOB_AGE CTLD_PORT SLURMD_PORT TIMEOUT; do
    [[ ${!v} =~ ^[0-9]+$ ]] || die "SLURM_LOCAL_$v must be a non-negative integer, got '${!v}'"
done
[ "$NODES" -ge 1 ] || die "SLURM_LOCAL_NODES must be >= 1"

# ---------------------------------------------------------------------------- packages
have_pkgs() {
    local c
    for c in slurmctld slurmd sbatch munged; do command -v "$c" >/dev/null || return 1; done
    # Slurm's mpi/pmix plugin dlopen()s libpmix.so, which only libpmix-dev ships; without it
    # `srun --mpi=pmix` hangs the node, and installing it later needs a slurmd restart.
    dpkg-query -W -f='${Status}' libpmix-dev 2>/dev/null | grep -q "install ok installed"
}
if ! have_pkgs; then
    say "Slurm packages missing: running scripts/install_test_deps.sh"
    bash "$REPO/scripts/install_test_deps.sh"
fi
command -v slurmctld >/dev/null || die "slurmctld still missing after install_test_deps.sh"

# ---------------------------------------------------------------------------- config
mkdir -p "$DIR"/{etc,state,spool,log,run}
HOST=$(hostname -s)
if [ "$NODES" = 1 ]; then
    NODE_NAMES=("$HOST"); NODELIST=$HOST
else
    for ((i = 1; i <= NODES; i++)); do NODE_NAMES+=("node$i"); done
    NODELIST="node[1-$NODES]"
fi
for n in "${NODE_NAMES[@]}"; do   # MASTER_ADDR=<first node> must resolve
    getent hosts "$n" >/dev/null || echo "127.0.0.1 $n $TAG" >> /etc/hosts
done
[ -n "$MEM_MB" ] || MEM_MB=$(slurmd -C | sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' | head -n 1)
[ -n "$MEM_MB" ] || MEM_MB=1000

GRES_NODE=""; GRES_TYPES=""; GRES_CONF=""
if [ "$GPUS" -gt 0 ]; then
    mkdir -p "$DIR/fakegpu"
    for ((i = 0; i < GPUS; i++)); do
        [ -c "$DIR/fakegpu/nvidia$i" ] || { rm -f "$DIR/fakegpu/nvidia$i"; mknod "$DIR/fakegpu/nvidia$i" c 1 3; }
    done
    GRES_NODE=" Gres=gpu:$GPUS"; GRES_TYPES="GresTypes=gpu"
    GRES_CONF=$(printf '%s\nAutoDetect=off\nNodeName=%s Name=gpu File=%s/fakegpu/nvidia[0-%d]\n' \
        "$TAG" "$NODELIST" "$DIR" $((GPUS - 1)))
fi

NODE_LINES=""
for ((i = 0; i < NODES; i++)); do
    NODE_LINES+="NodeName=${NODE_NAMES[$i]} NodeHostname=$HOST NodeAddr=127.0.0.1 Port=$((SLURMD_PORT + i))"
    NODE_LINES+=" CPUs=$CPUS RealMemory=$MEM_MB$GRES_NODE State=UNKNOWN"$'\n'
done

# EnforcePartLimits=ALL: a job this cluster can never run fails at submit instead of pending for
# ever (which would hang sbatch --wait). config_overrides: nodes may claim more than the machine
# has. task/none + proctrack/linuxproc: no cgroups needed.
CONF_TEXT="$TAG
ClusterName=megatrongrpo
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SlurmdParameters=config_overrides
ReturnToService=2
EnforcePartLimits=ALL
MinJobAge=$MIN_JOB_AGE
KillWait=10
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
$GRES_TYPES
${NODE_LINES}PartitionName=debug Nodes=$NODELIST Default=YES MaxTime=INFINITE State=UP"

CONF=$DIR/etc/slurm.conf
CHANGED=0
[ "$(cat "$CONF" 2>/dev/null || true)" = "$CONF_TEXT" ] || { printf '%s\n' "$CONF_TEXT" > "$CONF"; CHANGED=1; }
if [ -n "$GRES_CONF" ]; then
    [ "$(cat "$DIR/etc/gres.conf" 2>/dev/null || true)" = "$GRES_CONF" ] || { printf '%s\n' "$GRES_CONF" > "$DIR/etc/gres.conf"; CHANGED=1; }
elif [ -e "$DIR/etc/gres.conf" ]; then
    rm -f "$DIR/etc/gres.conf"; CHANGED=1
fi
# Each slurmd reads its own folder (symlinks to the shared files) with an mpi.conf giving it its
# own PMIx temp dir: two emulated nodes on one host would otherwise collide on
# /tmp/spmix_appdir_<uid>_<job>.<step> and `srun --mpi=pmix -N2` fails.
for n in "${NODE_NAMES[@]}"; do
    mkdir -p "$DIR/etc/$n" "$DIR/pmix/$n" "$DIR/spool/$n"
    ln -sfn ../slurm.conf "$DIR/etc/$n/slurm.conf"
    if [ -e "$DIR/etc/gres.conf" ]; then ln -sfn ../gres.conf "$DIR/etc/$n/gres.conf"; else rm -f "$DIR/etc/$n/gres.conf"; fi
    printf 'PMIxCliTmpDirBase=%s\n' "$DIR/pmix/$n" > "$DIR/etc/$n/mpi.conf"
done
printf 'export SLURM_CONF=%q\n' "$CONF" > "$DIR/env.sh"
export SLURM_CONF=$CONF
mkdir -p /etc/slurm
for f in slurm.conf gres.conf; do
    if [ -e "/etc/slurm/$f" ] && ! grep -qF "$TAG" "/etc/slurm/$f"; then
        say "leaving /etc/slurm/$f alone (not ours): use SLURM_CONF=$CONF"; continue
    fi
    if [ -e "$DIR/etc/$f" ]; then cp "$DIR/etc/$f" "/etc/slurm/$f"; else rm -f "/etc/slurm/$f"; fi
done

# ---------------------------------------------------------------------------- daemons
# alive PID COMM: running with that name; a zombie does not count (PID 1 may reap late here).
alive() {
    [ "$(cat "/proc/$1/comm" 2>/dev/null)" = "$2" ] || return 1
    local state
    state=$(sed 's/^.*) //' "/proc/$1/stat" 2>/dev/null | cut -d' ' -f1)
    [ -n "$state" ] && [ "$state" != Z ] && [ "$state" != X ]
}
pid_of() {  # pid_of NAME COMM: the pid in OUR pid file, if alive with that name
    local pid
    pid=$(cat "$DIR/run/$1.pid" 2>/dev/null) || return 1
    [[ $pid =~ ^[0-9]+$ ]] && alive "$pid" "$2" && echo "$pid"
}
stop_one() {  # stop_one NAME COMM: TERM, wait up to 10 s, KILL. The pid is read once: slurmd
    local pid i   # removes its pid file as soon as TERM arrives.
    if pid=$(pid_of "$1" "$2"); then
        kill -TERM "$pid" 2>/dev/null || true
        for i in $(seq 50); do alive "$pid" "$2" || break; sleep 0.2; done
        alive "$pid" "$2" && kill -KILL "$pid" 2>/dev/null
    fi
    rm -f "$DIR/run/$1.pid"
}
our_slurmds() { local f; for f in "$DIR"/run/slurmd-*.pid; do [ -e "$f" ] && basename "$f" .pid; done; return 0; }

munge_ok() { munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }
if ! munge_ok; then
    if [ ! -s /etc/munge/munge.key ]; then
        mkdir -p /etc/munge
        if command -v mungekey >/dev/null; then mungekey --create --force --keyfile=/etc/munge/munge.key
        else dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none; fi
    fi
    mkdir -p /run/munge /var/lib/munge /var/log/munge
    chown -R munge:munge /etc/munge /run/munge /var/lib/munge /var/log/munge
    chmod 700 /etc/munge; chmod 400 /etc/munge/munge.key; chmod 755 /run/munge
    runuser -u munge -- /usr/sbin/munged || die_logs "munged did not start"
    for _ in $(seq 50); do munge_ok && break; sleep 0.1; done
    munge_ok || die_logs "munged runs but 'munge -n | unmunge' fails"
    cp /run/munge/munged.pid "$DIR/run/munged.pid"   # we started it, so stop_local_slurm.sh stops it
    say "munged started"
fi

if [ "$CHANGED" = 1 ]; then
    for pf in $(our_slurmds); do stop_one "$pf" slurmd; done
    stop_one slurmctld slurmctld
fi
for pf in $(our_slurmds); do   # slurmds of nodes no longer in the config
    keep=0; for n in "${NODE_NAMES[@]}"; do [ "$pf" = "slurmd-$n" ] && keep=1; done
    [ "$keep" = 1 ] || stop_one "$pf" slurmd
done
port_busy() { ss -Hltn "sport = :$1" 2>/dev/null | grep -q .; }
if ! pid_of slurmctld slurmctld >/dev/null; then
    port_busy "$CTLD_PORT" && die "port $CTLD_PORT is taken by a process this script did not start (set SLURM_LOCAL_CTLD_PORT)"
    slurmctld -c -f "$CONF" || die_logs "slurmctld did not start"
    say "slurmctld started"
fi
for ((i = 0; i < NODES; i++)); do
    n=${NODE_NAMES[$i]}
    pid_of "slurmd-$n" slurmd >/dev/null && continue
    port_busy $((SLURMD_PORT + i)) && die "port $((SLURMD_PORT + i)) is taken by a process this script did not start (set SLURM_LOCAL_SLURMD_PORT)"
    slurmd -f "$DIR/etc/$n/slurm.conf" -N "$n" || die_logs "slurmd $n did not start"
    say "slurmd $n started"
done

# ---------------------------------------------------------------------------- wait for idle nodes
deadline=$(($(date +%s) + TIMEOUT)); states="?"; resumed=0
while :; do
    [ "$(date +%s)" -lt "$deadline" ] || die_logs "nodes not idle after ${TIMEOUT}s (last: $states)"
    sleep 0.3
    pid_of slurmctld slurmctld >/dev/null || die_logs "slurmctld died"
    scontrol ping >/dev/null 2>&1 || { states="controller not answering"; continue; }
    states=$(sinfo -h -N -o '%N=%T' 2>/dev/null | sort -u | tr '\n' ' ')
    ready=$(sinfo -h -N -o '%N %T' 2>/dev/null | sort -u | awk '$2 ~ /^(idle|mixed|allocated)$/' | wc -l)
    [ "$ready" -ge "$NODES" ] && break
    if [[ $states =~ down|drain|fail ]] && [ "$resumed" = 0 ]; then
        scontrol update NodeName="$NODELIST" State=RESUME >/dev/null 2>&1 || true; resumed=1
    fi
done
out=$(timeout 60 srun -N "$NODES" -n "$NODES" -t 1 hostname 2>&1) || die_logs "smoke test 'srun hostname' failed: $out"

# ---------------------------------------------------------------------------- owner watcher
# The daemons detach (init is their parent), so no parent-death signal reaches them. A watcher in
# its own session (a Ctrl-C or kill of the owner's process group spares it) stops the cluster once
# the owner has ended; the owner's start time tells a reused pid apart.
start_time() { sed 's/^.*) //' "/proc/$1/stat" 2>/dev/null | cut -d' ' -f20; }
OWNER=${SLURM_LOCAL_OWNER_PID:-}
if [ -n "$OWNER" ]; then
    owner_start=""
    [[ $OWNER =~ ^[0-9]+$ ]] && owner_start=$(start_time "$OWNER")
    [ -n "$owner_start" ] || die "SLURM_LOCAL_OWNER_PID=$OWNER is not a running process"
    old=$(cat "$DIR/run/watcher.pid" 2>/dev/null || true)
    if [[ $old =~ ^[0-9]+$ ]] && tr '\0' ' ' < "/proc/$old/cmdline" 2>/dev/null | grep -qF "megatron-grpo-slurm-watcher $DIR "; then
        kill "$old" 2>/dev/null || true
    fi
    # shellcheck disable=SC2016  # the watcher's own variables, expanded by the watcher
    setsid bash -c 'dir=$1 owner=$2 start=$3 stop=$4
        while [ "$(sed "s/^.*) //" "/proc/$owner/stat" 2>/dev/null | cut -d" " -f20)" = "$start" ]; do sleep 1; done
        echo "[slurm watcher] process $owner ended: stopping the cluster"
        SLURM_LOCAL_DIR=$dir exec bash "$stop"' megatron-grpo-slurm-watcher "$DIR" "$OWNER" "$owner_start" \
        "$REPO/scripts/stop_local_slurm.sh" < /dev/null >> "$DIR/log/watcher.log" 2>&1 &
    echo $! > "$DIR/run/watcher.pid"
    say "the cluster stops when process $OWNER ends (watcher pid $!)"
fi
say "ready: $states(SLURM_CONF=$CONF; source $DIR/env.sh)"
