#!/usr/bin/env bash
# Several "hosts" on this one machine, for multi-host tests and by hand: network namespaces with their own
# hostname, process tree and address on a private subnet, joined by a bridge.
#
#   scripts/ops/hosts.sh up N [RATE]   hosts h1..hN at $SUBNET.1..N (RATE, e.g. 1gbit, limits every host's link)
#   scripts/ops/hosts.sh down          kill everything on the hosts and remove them (safe to run twice)
#   scripts/ops/hosts.sh run H CMD...  run CMD on host H (its network, hostname, processes), in this directory
#   scripts/ops/hosts.sh off H         power H off: SIGKILL every process of H at once (its namespace's init)
#   scripts/ops/hosts.sh on H          power H on again: an empty host with the same name and address
#   scripts/ops/hosts.sh cut H         partition H: its link goes down, so peers see silence (no RST, no FIN)
#   scripts/ops/hosts.sh heal H        bring H's link up again
#   scripts/ops/hosts.sh rate H RATE   limit H's link both ways (tbf), e.g. 100mbit; RATE=none removes the limit
#   scripts/ops/hosts.sh addr H        print H's address
#   scripts/ops/hosts.sh list          the hosts, their init pid and link state
#
# A host is `ip netns` namespace $PREFIX-hI with one veth (eth0) to a bridge in namespace $PREFIX-sw; nothing
# is added to this machine's own network. Its processes live in a PID, UTS and mount namespace whose init is
# a small loop that reaps orphans: killing that init is a power-off (the kernel kills every process of the
# host), and a pid of one host means nothing on another, as on real machines. Files are shared (one
# filesystem), like a cluster's shared directory. Needs root.
#
# Environment: EF_HOSTS_PREFIX (namespace names, default "ef"), EF_HOSTS_SUBNET (first three octets of a
# private /24 that nothing else here uses, default 10.231.0).
set -euo pipefail

PREFIX="${EF_HOSTS_PREFIX:-ef}"
SUBNET="${EF_HOSTS_SUBNET:-10.231.0}"
STATE="/run/elasticflow-hosts/$PREFIX"
SW="$PREFIX-sw"

die() { echo "hosts.sh: error: $*" >&2; exit 1; }
REAPER='import os, time
while True:
    try:
        os.wait()
    except ChildProcessError:
        time.sleep(1)'

[ "$(id -u)" -eq 0 ] || die "needs root (network namespaces); run it with sudo"

ns() { echo "$PREFIX-$1"; }                   # ns h2 -> ef-h2
index() { [[ "$1" =~ ^h([1-9][0-9]?)$ ]] || die "no host '$1' (hosts are h1, h2, ...)"; echo "${BASH_REMATCH[1]}"; }
init_pid() {
  local f="$STATE/$1.pid"
  [ -s "$f" ] && kill -0 "$(cat "$f")" 2>/dev/null || die "host $1 is off or not up (scripts/ops/hosts.sh up N; on H)"
  cat "$f"
}

power_on() { # power_on H: start H's init in its namespaces and record its pid
  local h="$1" pid
  [ -s "$STATE/$h.pid" ] && kill -0 "$(cat "$STATE/$h.pid")" 2>/dev/null && return 0
  # The init reaps: a process whose parent died is re-parented to it, and its exit must not stay a zombie
  # (a zombie still answers `kill -0`, so "is the daemon alive" checks would be fooled). It forks nothing
  # itself: a pid recorded before a power-off must not name one of its own children after the power-on.
  setsid ip netns exec "$(ns "$h")" unshare --uts --pid --mount --fork --mount-proc \
    sh -c "hostname $h; exec python3 -c '$REAPER'" </dev/null >/dev/null 2>&1 &
  local launcher=$!
  for _ in $(seq 1000); do  # up to 20 s: on a loaded machine the namespace's first exec can take seconds
    pid="$(pgrep -P "$launcher" -x python3 || true)"
    [ -n "$pid" ] && break
    sleep 0.02
  done
  [ -n "$pid" ] || die "host $h did not start"
  echo "$pid" >"$STATE/$h.pid"
}

set_rate() { # set_rate H RATE: tbf on the host's egress and on its bridge port (the host's ingress)
  local h="$1" rate="$2" i
  i="$(index "$h")"
  for dev in "$(ns "$h") eth0" "$SW v$i"; do
    set -- $dev
    ip netns exec "$1" tc qdisc del dev "$2" root 2>/dev/null || true
    if [ "$rate" != none ]; then
      # burst: at least rate/HZ bytes or tbf cannot reach its rate; latency bounds the queue.
      ip netns exec "$1" tc qdisc add dev "$2" root tbf rate "$rate" burst 256kb latency 50ms
    fi
  done
}

up() {
  local n="${1:?usage: hosts.sh up N [RATE]}" rate="${2:-none}"
  [[ "$n" =~ ^[1-9][0-9]?$ ]] || die "N must be a number of hosts from 1 to 99, not '$n'"
  down quiet
  mkdir -p "$STATE"
  ip netns add "$SW"
  ip -n "$SW" link add br0 type bridge
  ip -n "$SW" link set br0 up
  for i in $(seq "$n"); do
    local h="h$i"
    ip netns add "$(ns "$h")"
    ip link add "$PREFIX-v$i" type veth peer name eth0 netns "$(ns "$h")"
    ip link set "$PREFIX-v$i" netns "$SW" name "v$i"
    ip -n "$SW" link set "v$i" master br0 up
    ip -n "$(ns "$h")" addr add "$SUBNET.$i/24" dev eth0
    ip -n "$(ns "$h")" link set eth0 up
    ip -n "$(ns "$h")" link set lo up
    power_on "$h"
    [ "$rate" = none ] || set_rate "$h" "$rate"
    echo "$h $SUBNET.$i"
  done
}

down() {
  local f n p
  for f in "$STATE"/*.pid; do
    [ -e "$f" ] && kill -9 "$(cat "$f")" 2>/dev/null || true
  done
  for n in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^$PREFIX-(h[0-9]+|sw)$" || true); do
    # Anything still running in it (a process started with `ip netns exec` by hand) goes with it.
    for p in $(ip netns pids "$n" 2>/dev/null); do kill -9 "$p" 2>/dev/null || true; done
    ip netns del "$n" 2>/dev/null || true
  done
  rm -rf "$STATE"
  [ "${1:-}" = quiet ] || echo "hosts down"
}

cmd="${1:-}"
shift || true
case "$cmd" in
  up) up "$@" ;;
  down) down ;;
  run)
    h="${1:?usage: hosts.sh run H CMD...}"; shift
    [ $# -gt 0 ] || die "usage: hosts.sh run H CMD..."
    pid="$(init_pid "$h")"
    exec nsenter -t "$pid" --net --uts --pid --mount --wd="$PWD" -- "$@" ;;
  off) kill -9 "$(init_pid "${1:?usage: hosts.sh off H}")"; rm -f "$STATE/$1.pid" ;;
  on) index "${1:?usage: hosts.sh on H}" >/dev/null; power_on "$1" ;;
  cut) ip -n "$SW" link set "v$(index "${1:?usage: hosts.sh cut H}")" down ;;
  heal) ip -n "$SW" link set "v$(index "${1:?usage: hosts.sh heal H}")" up ;;
  rate) set_rate "${1:?usage: hosts.sh rate H RATE}" "${2:?usage: hosts.sh rate H RATE}" ;;
  addr) echo "$SUBNET.$(index "${1:?usage: hosts.sh addr H}")" ;;
  list)
    for f in "$STATE"/*.pid; do
      [ -e "$f" ] || continue
      h="$(basename "$f" .pid)"
      echo "$h $SUBNET.$(index "$h") init=$(cat "$f") link=$(ip -n "$SW" -br link show "v$(index "$h")" | awk '{print $2}')"
    done ;;
  *) die "usage: hosts.sh up N [RATE] | down | run H CMD... | off H | on H | cut H | heal H | rate H RATE | addr H | list" ;;
esac
