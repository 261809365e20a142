#!/usr/bin/env bash
# A real SLURM cluster on this one machine, for tests: `start`, `stop`, `status`.
#
#   scripts/slurm-local.sh start    install Debian's slurmctld/slurmd/slurm-client/munge if missing, write
#                                   /etc/slurm/slurm.conf, start munged, slurmctld and slurmd without systemd,
#                                   wait until every node is idle. Does nothing if the cluster already runs.
#   scripts/slurm-local.sh stop     cancel all jobs, kill the daemons by the pids they recorded, remove their
#                                   state (the next start is fresh: job ids start at 1 again). Logs are kept.
#   scripts/slurm-local.sh status   print the daemons and `sinfo`; exit 0 only if the cluster is up.
#
# Needs root (the daemons run as root, munged as the munge user) and apt-get for the install step.
# No cgroups, no systemd, no accounting database: ProctrackType=proctrack/linuxproc, TaskPlugin=task/none.
# There is no slurmdbd, so `sacct` does not work: finished jobs stay visible to `scontrol show job` for
# MinJobAge (1 h), and each finished job is logged as one line in $SLURM_LOCAL_DIR/log/jobcomp.log.
#
# One node by default, named after `hostname -s`. SLURM_LOCAL_NODES=N>1 starts N slurmd daemons on this
# machine (Debian builds SLURM with multiple-slurmd support), nodes node1..nodeN, all on 127.0.0.1: a job
# may then span "nodes" (-N 2), each step's SLURMD_NODENAME names its node, all processes run here.
#
# Environment (all optional):
#   SLURM_LOCAL_DIR          state, spool, logs and pid files                  [/var/lib/slurm-local]
#   SLURM_LOCAL_NODES        number of nodes                                   [1]
#   SLURM_LOCAL_CPUS         CPUs each node advertises (may exceed the cores)  [8]
#   SLURM_LOCAL_CRED_EXPIRE  AuthInfo cred_expire, seconds; it is also how long a requeued job is held
#                            before it may start again                         [unset: SLURM's 120]
#   SLURM_LOCAL_TIMEOUT      seconds to wait for the nodes to be idle          [60]
set -euo pipefail

BASE="${SLURM_LOCAL_DIR:-/var/lib/slurm-local}"
NNODES="${SLURM_LOCAL_NODES:-1}"
CPUS="${SLURM_LOCAL_CPUS:-8}"
CRED_EXPIRE="${SLURM_LOCAL_CRED_EXPIRE:-}"
WAIT="${SLURM_LOCAL_TIMEOUT:-60}"
CONF=/etc/slurm/slurm.conf
MARK="# Written by slurm-local.sh"
MUNGE_KEY=/etc/munge/munge.key
PACKAGES=(slurmctld slurmd slurm-client munge)
HOST="$(hostname -s)"
RUN="$BASE/run"
LOG="$BASE/log"
SLURMD_PORT0=6818   # node i listens on SLURMD_PORT0 + i - 1

say() { echo "slurm-local: $*"; }
die() { echo "slurm-local: error: $*" >&2; exit 1; }

[[ "$NNODES" =~ ^[1-9][0-9]?$ ]] || die "SLURM_LOCAL_NODES must be a number from 1 to 99, not '$NNODES'"
[[ "$CPUS" =~ ^[1-9][0-9]*$ ]] || die "SLURM_LOCAL_CPUS must be a positive number, not '$CPUS'"
if [ "$NNODES" -eq 1 ]; then NODES=("$HOST"); else NODES=(); for i in $(seq "$NNODES"); do NODES+=("node$i"); done; fi

alive() { # alive PIDFILE: the pid recorded there is a live process
  local pid
  [ -s "$1" ] || return 1
  pid="$(cat "$1" 2>/dev/null)" || return 1
  [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null
}

node_states() { sinfo -h -N -o '%N %T' 2>/dev/null | sort -u; }   # "NAME STATE" per node

munge_works() { munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }

port_busy() { # port_busy PORT: something listens on 127.0.0.1/any:PORT (bash /dev/tcp probe, no extra tools)
  (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}

install_packages() {
  local missing=()
  command -v slurmctld >/dev/null 2>&1 || missing+=(slurmctld)
  command -v slurmd >/dev/null 2>&1 || missing+=(slurmd)
  command -v sbatch >/dev/null 2>&1 || missing+=(slurm-client)
  command -v munged >/dev/null 2>&1 || missing+=(munge)
  [ ${#missing[@]} -eq 0 ] && return 0
  command -v apt-get >/dev/null 2>&1 || die "missing ${missing[*]} and no apt-get to install them"
  export DEBIAN_FRONTEND=noninteractive
  local t0=$SECONDS
  local apt=(apt-get install -y -qq --no-install-recommends -o Dpkg::Use-Pty=0 "${PACKAGES[@]}")
  : >"$LOG/apt.log"
  # apt-get update only when the package lists do not know the packages, or an install from them fails.
  if ! apt-cache show slurmctld >/dev/null 2>&1; then
    apt-get update -qq >>"$LOG/apt.log" 2>&1 || { tail -n 20 "$LOG/apt.log" >&2; die "apt-get update failed"; }
  fi
  if ! "${apt[@]}" >>"$LOG/apt.log" 2>&1; then
    apt-get update -qq >>"$LOG/apt.log" 2>&1 || true
    "${apt[@]}" >>"$LOG/apt.log" 2>&1 || { tail -n 20 "$LOG/apt.log" >&2; die "apt-get install ${PACKAGES[*]} failed (log: $LOG/apt.log)"; }
  fi
  say "installed ${PACKAGES[*]} in $((SECONDS - t0)) s"
}

write_conf() {
  if [ -e "$CONF" ] && ! grep -qF "$MARK" "$CONF"; then
    die "$CONF exists and was not written by this script; refusing to overwrite it (move it away first)"
  fi
  local mem_mb i
  mem_mb=$(awk -v n="$NNODES" '/^MemTotal:/ {print int($2 / 1024 * 0.9 / n)}' /proc/meminfo)
  mkdir -p /etc/slurm
  {
    cat <<EOF
$MARK ($(date -u +%Y-%m-%dT%H:%M:%SZ)): a test cluster on one machine, no cgroups, no accounting database.
ClusterName=localcluster
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
${CRED_EXPIRE:+AuthInfo=cred_expire=$CRED_EXPIRE}
MpiDefault=none
MailProg=/bin/true
StateSaveLocation=$BASE/state
SlurmdSpoolDir=$BASE/spool/%n
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd-%n.pid
SlurmctldLogFile=$LOG/slurmctld.log
SlurmdLogFile=$LOG/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
# No cgroups: plain /proc process tracking, no task binding.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$LOG/jobcomp.log
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
# Schedule at once: no batch delay (default 3 s), backfill every 1 s (default 30 s), the main loop every 2 s (default 60 s).
SchedulerParameters=batch_sched_delay=0,bf_interval=1,sched_interval=2
PreemptType=preempt/none
# Nodes may advertise more CPUs than the machine has.
SlurmdParameters=config_overrides
ReturnToService=2
JobRequeue=1
# Short timeouts for tests.
KillWait=2
MessageTimeout=10
SlurmdTimeout=30
SlurmctldTimeout=30
InactiveLimit=0
Waittime=0
MinJobAge=3600
EOF
    for i in "${!NODES[@]}"; do
      echo "NodeName=${NODES[$i]} NodeHostname=$HOST NodeAddr=127.0.0.1 Port=$((SLURMD_PORT0 + i)) CPUs=$CPUS RealMemory=$mem_mb State=UNKNOWN"
    done
    echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP"
  } | grep -v '^$' >"$CONF"
}

start_munge() {
  if munge_works; then
    say "munged already answers; using it"
    return 0
  fi
  if [ ! -s "$MUNGE_KEY" ]; then
    mkdir -p "$(dirname "$MUNGE_KEY")"
    if command -v mungekey >/dev/null 2>&1; then
      mungekey --create --keyfile="$MUNGE_KEY"
    else
      dd if=/dev/urandom of="$MUNGE_KEY" bs=1 count=1024 status=none
    fi
    say "created munge key $MUNGE_KEY"
  fi
  chown munge:munge "$(dirname "$MUNGE_KEY")" "$MUNGE_KEY"
  chmod 0700 "$(dirname "$MUNGE_KEY")"
  chmod 0400 "$MUNGE_KEY"
  install -d -o munge -g munge -m 0755 /run/munge
  install -d -o munge -g munge -m 0700 /var/log/munge
  install -d -o munge -g munge -m 0711 /var/lib/munge
  rm -f /run/munge/munged.pid
  runuser -u munge -- /usr/sbin/munged </dev/null >>"$LOG/munged.out" 2>&1 \
    || { cat "$LOG/munged.out" >&2; die "munged did not start (see /var/log/munge/munged.log)"; }
  local i
  for i in $(seq 50); do [ -s /run/munge/munged.pid ] && munge_works && break; sleep 0.1; done
  munge_works || die "munged started but does not answer (see /var/log/munge/munged.log)"
  cp /run/munge/munged.pid "$RUN/munged.pid"   # recorded here means ours: `stop` ends it
  say "started munged (pid $(cat "$RUN/munged.pid"))"
}

start_daemon() { # start_daemon PIDFILE OUTFILE COMMAND...: the command daemonizes itself and writes PIDFILE
  local pidfile=$1 out=$2; shift 2
  local log="$LOG/$(basename "$out" .out).log"
  "$@" </dev/null >>"$out" 2>&1 || { tail -n 20 "$out" "$log" >&2 2>/dev/null; die "$* did not start"; }
  local i
  for i in $(seq 50); do alive "$pidfile" && break; sleep 0.1; done
  alive "$pidfile" || { tail -n 20 "$out" "$log" >&2 2>/dev/null; die "$* did not stay up"; }
}

cluster_up() {
  local n
  alive "$RUN/slurmctld.pid" || return 1
  for n in "${NODES[@]}"; do alive "$RUN/slurmd-$n.pid" || return 1; done
  # every node answers (idle, mixed, allocated or completing), none down/drained/invalid
  [ "$(node_states | grep -cE ' (idle|mix|mixed|alloc|allocated|comp|completing)$')" -eq "${#NODES[@]}" ]
}

do_start() {
  [ "$(id -u)" -eq 0 ] || die "must run as root (the SLURM daemons run as root here)"
  if cluster_up 2>/dev/null; then
    say "already running: $(node_states | tr '\n' ' ')"
    return 0
  fi
  local t0=$SECONDS n port i
  # A half-started cluster from before: clear it.
  if compgen -G "$RUN/*.pid" >/dev/null; then do_stop; fi
  mkdir -p "$RUN" "$LOG"
  install_packages
  for port in 6817 $(seq "$SLURMD_PORT0" $((SLURMD_PORT0 + NNODES - 1))); do
    port_busy "$port" && die "port $port is already in use (another slurmctld/slurmd, e.g. a systemd service?)"
  done
  write_conf
  rm -rf "$BASE/state" "$BASE/spool"
  mkdir -p "$BASE/state"
  for n in "${NODES[@]}"; do mkdir -p "$BASE/spool/$n"; : >"$LOG/slurmd-$n.log"; done
  : >"$LOG/slurmctld.log"
  start_munge
  start_daemon "$RUN/slurmctld.pid" "$LOG/slurmctld.out" slurmctld -f "$CONF"
  for n in "${NODES[@]}"; do
    start_daemon "$RUN/slurmd-$n.pid" "$LOG/slurmd-$n.out" slurmd -f "$CONF" -N "$n"
  done
  local deadline=$((SECONDS + WAIT)) idle=0
  while [ $SECONDS -lt $deadline ]; do
    idle=$(node_states | grep -c ' idle$' || true)
    [ "$idle" -eq "${#NODES[@]}" ] && break
    sleep 0.2
  done
  if [ "$idle" -ne "${#NODES[@]}" ]; then
    {
      echo "only $idle of ${#NODES[@]} nodes idle after ${WAIT} s:"
      node_states
      scontrol show node 2>&1 | grep -E "NodeName=|State=|Reason=" || true
      echo "--- $LOG/slurmctld.log (tail)"; tail -n 15 "$LOG/slurmctld.log" 2>/dev/null || true
      echo "--- $LOG/slurmd-${NODES[0]}.log (tail)"; tail -n 15 "$LOG/slurmd-${NODES[0]}.log" 2>/dev/null || true
    } >&2
    die "cluster did not come up"
  fi
  local pids=""
  for n in "${NODES[@]}"; do pids+=" $n:$(cat "$RUN/slurmd-$n.pid")"; done
  say "started slurmctld (pid $(cat "$RUN/slurmctld.pid")) and slurmd (pid$pids)"
  say "${#NODES[@]} node(s) idle (${NODES[*]}, $CPUS CPUs each), partition debug; config $CONF, logs $LOG ($((SECONDS - t0)) s)"
}

stop_pidfiles() { # stop_pidfiles PIDFILE...: TERM the recorded pids together, KILL what is left after 10 s
  local f pid i pids=() names=()
  for f in "$@"; do
    [ -e "$f" ] || continue
    pid="$(cat "$f" 2>/dev/null || true)"
    if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
      kill -TERM "$pid" 2>/dev/null || true
      pids+=("$pid"); names+=("$(basename "$f" .pid)($pid)")
    fi
    rm -f "$f"
  done
  [ ${#pids[@]} -eq 0 ] && return 0
  for i in $(seq 100); do
    for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && break; pid=""; done
    [ -z "$pid" ] && break
    sleep 0.1
  done
  for pid in "${pids[@]}"; do
    if kill -0 "$pid" 2>/dev/null; then kill -KILL "$pid" 2>/dev/null || true; fi
  done
  say "stopped ${names[*]}"
}

do_stop() {
  [ "$(id -u)" -eq 0 ] || die "must run as root"
  local i jobs
  # Jobs first, so that slurmd still runs to end their processes.
  if alive "$RUN/slurmctld.pid"; then
    jobs="$(squeue -h -o %i 2>/dev/null || true)"
    if [ -n "$jobs" ]; then
      scancel --quiet $jobs 2>/dev/null || true
      for i in $(seq 100); do [ -z "$(squeue -h -o %i 2>/dev/null)" ] && break; sleep 0.1; done
      say "cancelled jobs: $(echo $jobs)"
    fi
  fi
  if ! compgen -G "$RUN/*.pid" >/dev/null; then
    say "not running"
  else
    # munged only if this script started it (its pid is recorded only then).
    stop_pidfiles "$RUN"/slurmd-*.pid "$RUN/slurmctld.pid" "$RUN/munged.pid"
  fi
  rm -rf "$BASE/state" "$BASE/spool"
}

do_status() {
  local rc=0 f
  if alive "$RUN/munged.pid"; then say "munged running (pid $(cat "$RUN/munged.pid"))"
  elif munge_works; then say "munged running (not started by this script)"
  else say "munged not running"; rc=1; fi
  for f in "$RUN/slurmctld.pid" "$RUN"/slurmd-*.pid; do
    if alive "$f"; then say "$(basename "$f" .pid) running (pid $(cat "$f"))"
    else say "$(basename "$f" .pid) not running"; rc=1; fi
  done
  if [ $rc -eq 0 ]; then sinfo -N 2>&1 || rc=1; fi
  return $rc
}

case "${1:-}" in
  start) do_start ;;
  stop) do_stop ;;
  status) do_status ;;
  *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
