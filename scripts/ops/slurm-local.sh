#!/usr/bin/env bash
# A real SLURM cluster on this one machine, for tests: `start`, `stop`, `status`.
#
#   scripts/ops/slurm-local.sh install  install Debian's SLURM and munge packages if missing, start nothing
#                                   (CI's first step: it fails here, not in a skipped test)
#   scripts/ops/slurm-local.sh start    install Debian's slurmctld/slurmd/slurm-client/munge if missing, write
#                                   /etc/slurm/slurm.conf, start munged, slurmctld and slurmd without systemd,
#                                   wait until every node is idle. Does nothing if the cluster already runs.
#   scripts/ops/slurm-local.sh stop     cancel all jobs, kill the daemons by the pids they recorded, remove their
#                                   state (the next start is fresh: job ids start at 1 again). Logs are kept.
#   scripts/ops/slurm-local.sh status   print the daemons and `sinfo`; exit 0 only if the cluster is up.
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
# Hosts mode, SLURM_LOCAL_HOSTS=N: a cluster of N "hosts" built by scripts/ops/hosts.sh (network, PID, UTS and
# mount namespaces; prefix EF_HOSTS_PREFIX [efs], subnet EF_HOSTS_SUBNET [10.232.0], so it does not meet the
# hosts of other tests). Node hI is host hI at $EF_HOSTS_SUBNET.I with its own munged and slurmd; slurmctld
# runs on h1 too. Each host sees $SLURM_LOCAL_DIR/etc on /etc/slurm, an /etc/hosts naming h1..hN, and its
# own munge socket directory on /run/munge (bind mounts in its mount namespace), so `sbatch`, `srun` and
# `scontrol` just work there, and this machine's own /etc/slurm and munged are left alone: the two kinds of
# cluster can run side by side.
# Clients run on a host: `scripts/ops/hosts.sh run h1 sbatch ...` (with the same EF_HOSTS_* in the environment).
# `hosts.sh off h2` powers a node off (slurmd, munged, steps, workers die at once; slurmctld marks it DOWN
# after SLURM_LOCAL_MESSAGE_TIMEOUT, below); `start` again powers every lost host on and restarts its daemons,
# and the node returns to service (ReturnToService=2) while the controller and the jobs keep running.
# `stop` kills every process of every host (`hosts.sh down`: daemons, jobs, steps) and removes the state.
#
# Environment (all optional):
#   SLURM_LOCAL_DIR          state, spool, logs and pid files  [/var/lib/slurm-local; hosts: /var/lib/slurm-local-hosts]
#   SLURM_LOCAL_NODES        number of nodes                                   [1]
#   SLURM_LOCAL_HOSTS        number of namespace hosts, one node each (hosts mode, see above)       [unset]
#   SLURM_LOCAL_CPUS         CPUs each node advertises (may exceed the cores)  [8]
#   SLURM_LOCAL_CRED_EXPIRE  AuthInfo cred_expire, seconds; it is also how long a requeued job is held
#                            before it may start again                         [unset: SLURM's 120]
#   SLURM_LOCAL_TIMEOUT      seconds to wait for the nodes to be idle          [60]
#   SLURM_LOCAL_SLURMD_TIMEOUT  SlurmdTimeout, seconds                                              [30]
#   SLURM_LOCAL_MESSAGE_TIMEOUT MessageTimeout, seconds: a ping of a dead node fails only after about this
#                            long, and a node is DOWN after two failed pings. A powered-off host's node is
#                            DOWN after ~30 s with the defaults, ~6 s with SLURMD_TIMEOUT=4 and this 2   [10]
set -euo pipefail

say() { echo "slurm-local: $*"; }
die() { echo "slurm-local: error: $*" >&2; exit 1; }

HOSTS_N="${SLURM_LOCAL_HOSTS:-}"   # empty: the cluster on this machine; N: hosts mode
NNODES="${HOSTS_N:-${SLURM_LOCAL_NODES:-1}}"
CPUS="${SLURM_LOCAL_CPUS:-8}"
CRED_EXPIRE="${SLURM_LOCAL_CRED_EXPIRE:-}"
WAIT="${SLURM_LOCAL_TIMEOUT:-60}"
SLURMD_TIMEOUT="${SLURM_LOCAL_SLURMD_TIMEOUT:-30}"
MESSAGE_TIMEOUT="${SLURM_LOCAL_MESSAGE_TIMEOUT:-10}"
HOSTS_SH="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/hosts.sh"
if [ -n "$HOSTS_N" ]; then
  BASE="${SLURM_LOCAL_DIR:-/var/lib/slurm-local-hosts}"
  CONF="$BASE/etc/slurm.conf"   # /etc/slurm/slurm.conf on every host (a bind mount)
  export EF_HOSTS_PREFIX="${EF_HOSTS_PREFIX:-efs}" EF_HOSTS_SUBNET="${EF_HOSTS_SUBNET:-10.232.0}"
else
  BASE="${SLURM_LOCAL_DIR:-/var/lib/slurm-local}"
  CONF=/etc/slurm/slurm.conf
fi
MARK="# Written by slurm-local.sh"
MUNGE_KEY=/etc/munge/munge.key
PACKAGES=(slurmctld slurmd slurm-client munge)
HOST="$(hostname -s)"
RUN="$BASE/run"
LOG="$BASE/log"
SLURMD_PORT0=6818   # node i listens on SLURMD_PORT0 + i - 1 (one machine; each host has its own 6818)

[[ "$NNODES" =~ ^[1-9][0-9]?$ ]] || die "SLURM_LOCAL_${HOSTS_N:+HOSTS}${HOSTS_N:-NODES} must be a number from 1 to 99, not '$NNODES'"
[[ "$CPUS" =~ ^[1-9][0-9]*$ ]] || die "SLURM_LOCAL_CPUS must be a positive number, not '$CPUS'"
[[ "$SLURMD_TIMEOUT" =~ ^[1-9][0-9]*$ ]] || die "SLURM_LOCAL_SLURMD_TIMEOUT must be a positive number, not '$SLURMD_TIMEOUT'"
[[ "$MESSAGE_TIMEOUT" =~ ^[1-9][0-9]*$ ]] || die "SLURM_LOCAL_MESSAGE_TIMEOUT must be a positive number, not '$MESSAGE_TIMEOUT'"
if [ -n "$HOSTS_N" ]; then NODES=(); for i in $(seq "$NNODES"); do NODES+=("h$i"); done
elif [ "$NNODES" -eq 1 ]; then NODES=("$HOST"); else NODES=(); for i in $(seq "$NNODES"); do NODES+=("node$i"); done; fi

alive() { # alive PIDFILE: the pid recorded there is a live process
  local pid
  [ -s "$1" ] || return 1
  pid="$(cat "$1" 2>/dev/null)" || return 1
  [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null
}

on_host() { bash "$HOSTS_SH" run "$@"; }   # on_host H CMD...: run CMD on namespace host H

client() { # client CMD...: a SLURM client command where the cluster's config is: on h1 in hosts mode
  if [ -n "$HOSTS_N" ]; then on_host h1 "$@"; else "$@"; fi
}

host_alive() { # host_alive H PIDFILE: the pid recorded there is a live process of host H (pids are per host)
  [ -s "$2" ] || return 1
  # Not a zombie (an orphan waits, a moment, for the host's init to reap it).
  on_host "$1" sh -c 'read -r pid <"$1" && read -r _ _ s _ <"/proc/$pid/stat" && [ "$s" != Z ]' sh "$2" 2>/dev/null
}

running() { # running HOST PIDFILE: alive on HOST ("" = this machine)
  if [ -z "$1" ]; then alive "$2"; else host_alive "$1" "$2"; fi
}

node_states() { client sinfo -h -N -o '%N %T' 2>/dev/null | sort -u; }   # "NAME STATE" per node

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
  mkdir -p "$(dirname "$CONF")"
  local ctld="$HOST(127.0.0.1)" what="one machine"
  [ -n "$HOSTS_N" ] && ctld="h1($EF_HOSTS_SUBNET.1)" what="$NNODES namespace hosts (scripts/ops/hosts.sh)"
  {
    cat <<EOF
$MARK ($(date -u +%Y-%m-%dT%H:%M:%SZ)): a test cluster on $what, no cgroups, no accounting database.
ClusterName=localcluster
SlurmctldHost=$ctld
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
MessageTimeout=$MESSAGE_TIMEOUT
SlurmdTimeout=$SLURMD_TIMEOUT
SlurmctldTimeout=30
InactiveLimit=0
Waittime=0
MinJobAge=3600
EOF
    for i in "${!NODES[@]}"; do
      if [ -n "$HOSTS_N" ]; then
        echo "NodeName=${NODES[$i]} NodeAddr=$EF_HOSTS_SUBNET.$((i + 1)) CPUs=$CPUS RealMemory=$mem_mb State=UNKNOWN"
      else
        echo "NodeName=${NODES[$i]} NodeHostname=$HOST NodeAddr=127.0.0.1 Port=$((SLURMD_PORT0 + i)) CPUs=$CPUS RealMemory=$mem_mb State=UNKNOWN"
      fi
    done
    echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP"
  } | grep -v '^$' >"$CONF"
}

munge_key() { # create the munge key if there is none; every munged here (and on the hosts) shares it
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
}

start_munge() {
  if munge_works; then
    say "munged already answers; using it"
    return 0
  fi
  munge_key
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

start_daemon() { # start_daemon HOST PIDFILE OUTFILE COMMAND...: on HOST ("" = here), the command daemonizes
  local host=$1 pidfile=$2 out=$3; shift 3   # itself and writes PIDFILE
  local log="$LOG/$(basename "$out" .out).log" pre=()
  [ -n "$host" ] && { pre=(bash "$HOSTS_SH" run "$host"); rm -f "$pidfile"; }  # a stale pid may be reused there
  "${pre[@]}" "$@" </dev/null >>"$out" 2>&1 || { tail -n 20 "$out" "$log" >&2 2>/dev/null; die "$* did not start${host:+ on $host}"; }
  local i
  for i in $(seq 50); do running "$host" "$pidfile" && break; sleep 0.1; done
  running "$host" "$pidfile" || { tail -n 20 "$out" "$log" >&2 2>/dev/null; die "$* did not stay up${host:+ on $host}"; }
}

cluster_up() {
  local n ctld_host=""
  [ -n "$HOSTS_N" ] && ctld_host=h1
  running "$ctld_host" "$RUN/slurmctld.pid" || return 1
  for n in "${NODES[@]}"; do running "${HOSTS_N:+$n}" "$RUN/slurmd-$n.pid" || return 1; done
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
  start_daemon "" "$RUN/slurmctld.pid" "$LOG/slurmctld.out" slurmctld -f "$CONF"
  for n in "${NODES[@]}"; do
    start_daemon "" "$RUN/slurmd-$n.pid" "$LOG/slurmd-$n.out" slurmd -f "$CONF" -N "$n"
  done
  wait_idle "$t0"
}

# wait_idle T0 [answering]: wait until every node is idle (with `answering`: idle, allocated, mixed or
# completing), else show why and fail. T0: when the start began, for the message.
wait_idle() {
  local t0=$1 n deadline=$((SECONDS + WAIT)) idle=0 want=' idle$'
  [ "${2:-}" = answering ] && want=' (idle|mix|mixed|alloc|allocated|comp|completing)$'
  while [ $SECONDS -lt $deadline ]; do
    idle=$(node_states | grep -cE "$want" || true)
    [ "$idle" -eq "${#NODES[@]}" ] && break
    sleep 0.2
  done
  if [ "$idle" -ne "${#NODES[@]}" ]; then
    {
      echo "only $idle of ${#NODES[@]} nodes ${2:-idle} after ${WAIT} s:"
      node_states
      client scontrol show node 2>&1 | grep -E "NodeName=|State=|Reason=" || true
      echo "--- $LOG/slurmctld.log (tail)"; tail -n 15 "$LOG/slurmctld.log" 2>/dev/null || true
      echo "--- $LOG/slurmd-${NODES[0]}.log (tail)"; tail -n 15 "$LOG/slurmd-${NODES[0]}.log" 2>/dev/null || true
    } >&2
    die "cluster did not come up"
  fi
  local pids=""
  for n in "${NODES[@]}"; do pids+=" $n:$(cat "$RUN/slurmd-$n.pid")"; done
  say "slurmctld (pid $(cat "$RUN/slurmctld.pid")${HOSTS_N:+ on h1}) and slurmd (pid$pids) up"
  say "${#NODES[@]} node(s) ${2:-idle} (${NODES[*]}, $CPUS CPUs each), partition debug; config $CONF, logs $LOG ($((SECONDS - t0)) s)"
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

# ---------------------------------------------------------------------------------------------- hosts mode
start_host() { # start_host H: power H on if it is off; its mounts, then its munged (slurmd comes after slurmctld)
  local h=$1 d="$BASE/hosts/$1" i
  bash "$HOSTS_SH" on "$h"
  install -d -o munge -g munge -m 0755 "$d/munge"
  # Each host's own /etc/slurm, /etc/hosts and /run/munge: the cluster's config, the hosts' names (as a
  # cluster's DNS would give them; slurmctld looks its clients up), and a munge socket of its own (a
  # powered-off host loses its munged as a real one would). And /sys/fs/cgroup: `ip netns exec` mounts a
  # fresh /sys without it, and slurmd 22.05 refuses to start unless it finds cgroup v1's tmpfs with the
  # name=systemd hierarchy in it (the machine's own; proctrack/linuxproc never makes a cgroup). Once per
  # power-on: a mount namespace is born with the host.
  on_host "$h" sh -c 'mkdir -p /etc/slurm /run/munge &&
    { mountpoint -q /etc/slurm || mount --bind "$1" /etc/slurm; } &&
    { mountpoint -q /etc/hosts || mount --bind "$2" /etc/hosts; } &&
    { mountpoint -q /run/munge || mount --bind "$3" /run/munge; } &&
    { mountpoint -q /sys/fs/cgroup || { mount -t tmpfs -o mode=0755 cgroup /sys/fs/cgroup &&
      mkdir /sys/fs/cgroup/systemd && mount -t cgroup -o none,name=systemd cgroup /sys/fs/cgroup/systemd; }; }' \
    sh "$(dirname "$CONF")" "$BASE/hosts/etc-hosts" "$d/munge" \
    || die "could not mount /etc/slurm, /etc/hosts, /run/munge and /sys/fs/cgroup on host $h"
  on_host "$h" sh -c 'munge -n | unmunge' >/dev/null 2>&1 && return 0
  rm -f "$d/munge/munge.socket.2" "$d/munge/munge.socket.2.lock" "$d/munge/munged.pid"
  touch "$LOG/munged-$h.log" && chown munge:munge "$LOG/munged-$h.log"
  # --origin: the address this host's credentials name, without a name lookup.
  on_host "$h" runuser -u munge -- /usr/sbin/munged --origin="$EF_HOSTS_SUBNET.${h#h}" \
    --seed-file="$d/munge/munged.seed" --log-file="$LOG/munged-$h.log" </dev/null >>"$LOG/munged.out" 2>&1 \
    || { tail -n 5 "$LOG/munged-$h.log" >&2; die "munged did not start on host $h"; }
  for i in $(seq 50); do on_host "$h" sh -c 'munge -n | unmunge' >/dev/null 2>&1 && return 0; sleep 0.1; done
  die "munged on host $h does not answer (see $LOG/munged-$h.log)"
}

start_slurmd() { # start_slurmd H: slurmd of node H on host H, unless it runs
  host_alive "$1" "$RUN/slurmd-$1.pid" && return 0
  mkdir -p "$BASE/spool/$1"
  start_daemon "$1" "$RUN/slurmd-$1.pid" "$LOG/slurmd-$1.out" slurmd -f /etc/slurm/slurm.conf -N "$1"
}

do_start_hosts() {
  [ "$(id -u)" -eq 0 ] || die "must run as root (network namespaces, and the SLURM daemons run as root here)"
  local t0=$SECONDS n
  if [ -s "$CONF" ] && [ "$(grep -c '^NodeName=' "$CONF")" -eq "$NNODES" ] && host_alive h1 "$RUN/slurmctld.pid"; then
    if cluster_up 2>/dev/null; then
      say "already running: $(node_states | tr '\n' ' ')"
      return 0
    fi
    # The controller runs (so do the jobs): power on the hosts that are off, restart what died on them.
    for n in "${NODES[@]}"; do start_host "$n"; start_slurmd "$n"; done
    wait_idle "$t0" answering   # jobs may run on: nodes answer, not necessarily idle
    return 0
  fi
  do_stop_hosts quiet
  mkdir -p "$RUN" "$LOG"
  install_packages
  munge_key
  bash "$HOSTS_SH" up "$NNODES" >/dev/null
  write_conf
  mkdir -p "$BASE/hosts"
  { echo "127.0.0.1 localhost"; for n in "${NODES[@]}"; do echo "$EF_HOSTS_SUBNET.${n#h} $n"; done; } >"$BASE/hosts/etc-hosts"
  mkdir -p "$BASE/state"
  for n in "${NODES[@]}"; do : >"$LOG/slurmd-$n.log"; done
  : >"$LOG/slurmctld.log"
  for n in "${NODES[@]}"; do start_host "$n"; done
  start_daemon h1 "$RUN/slurmctld.pid" "$LOG/slurmctld.out" slurmctld -f /etc/slurm/slurm.conf
  for n in "${NODES[@]}"; do start_slurmd "$n"; done
  wait_idle "$t0"
}

do_stop_hosts() {
  [ "$(id -u)" -eq 0 ] || die "must run as root"
  # Powering every host off ends the daemons, the jobs and their steps at once: nothing of them is left
  # for a later start to meet, and nothing outside the hosts is touched.
  bash "$HOSTS_SH" down >/dev/null
  rm -f "$RUN"/*.pid
  rm -rf "$BASE/state" "$BASE/spool" "$BASE/hosts"
  [ "${1:-}" = quiet ] || say "hosts $EF_HOSTS_PREFIX-h* powered off and removed"
}

do_status_hosts() {
  local rc=0 n
  bash "$HOSTS_SH" list
  if host_alive h1 "$RUN/slurmctld.pid"; then say "slurmctld running on h1"; else say "slurmctld not running"; rc=1; fi
  for n in "${NODES[@]}"; do
    if ! on_host "$n" true 2>/dev/null; then say "host $n is off (start powers it on)"; rc=1; continue; fi
    if on_host "$n" sh -c 'munge -n | unmunge' >/dev/null 2>&1; then say "munged running on $n"
    else say "munged not running on $n"; rc=1; fi
    if host_alive "$n" "$RUN/slurmd-$n.pid"; then say "slurmd running on $n"; else say "slurmd not running on $n"; rc=1; fi
  done
  if [ $rc -eq 0 ]; then client sinfo -N 2>&1 || rc=1; fi
  return $rc
}

case "${HOSTS_N:+hosts-}${1:-}" in
  install) mkdir -p "$LOG"; install_packages ;;
  start) do_start ;;
  stop) do_stop ;;
  status) do_status ;;
  hosts-start) do_start_hosts ;;
  hosts-stop) do_stop_hosts ;;
  hosts-status) do_status_hosts ;;
  *) echo "usage: $0 install|start|stop|status" >&2; exit 2 ;;
esac
