#!/usr/bin/env bash
# etcd from Debian's packages, for the launcher.store=etcd tests, and a user per job on a shared cluster.
#   scripts/ops/etcd-local.sh install
#       install etcd-server, etcd-client and openssl if missing (root, apt-get). The members are not started
#       here: each test starts its own cluster on namespace hosts, with certificates made for that run.
#   scripts/ops/etcd-local.sh auth-on ROOT_PASSWORD_FILE
#       once per cluster: a root user (its password in ROOT_PASSWORD_FILE, made owner-only with a random one if
#       the file does not exist), then etcd's authentication on.
#   scripts/ops/etcd-local.sh add-job NAME PREFIX PASSWORD_FILE [ROOT_PASSWORD_FILE]
#       once per job: a role that reaches only PREFIX (the job's launcher.etcd.prefix) and a user NAME with it,
#       whose password goes to PASSWORD_FILE (owner-only, made with a random one if it does not exist). Give
#       ROOT_PASSWORD_FILE once authentication is on. Prints the job's launcher.etcd overrides.
# Which cluster: etcdctl's own variables, ETCDCTL_ENDPOINTS, ETCDCTL_CACERT, ETCDCTL_CERT and ETCDCTL_KEY.
# Passwords never go on a command line (which every local user can read in /proc): etcdctl reads a new user's from
# its stdin, and root's from ETCDCTL_PASSWORD, which only its owner can read.
# Why a user per job: every certificate the cluster's CA signed may otherwise list, read, write and delete every
# key, another job's included (docs/multi-host.md#another-job-on-the-same-etcd, docs/security.md).
set -euo pipefail
die() { echo "etcd-local: $*" >&2; exit 1; }
usage="usage: scripts/ops/etcd-local.sh install | auth-on ROOT_PASSWORD_FILE | add-job NAME PREFIX PASSWORD_FILE [ROOT_PASSWORD_FILE]"

# The password in file $1, made (owner-only, 32 random hex digits) if the file does not exist.
password_in() {
  if [ ! -e "$1" ]; then
    (umask 077 && openssl rand -hex 16 > "$1") || die "cannot write $1"
  fi
  [ -f "$1" ] || die "$1 is not a file"
  case "$(stat -c %a "$1")" in
    ?00) ;;
    *) die "$1 can be read by others (mode $(stat -c %a "$1")): chmod 600 $1" ;;
  esac
  head -n 1 "$1"
}

ctl() {
  [ -n "${ETCDCTL_ENDPOINTS:-}" ] || die "set ETCDCTL_ENDPOINTS (and ETCDCTL_CACERT, ETCDCTL_CERT, ETCDCTL_KEY) to the cluster's"
  etcdctl --dial-timeout=5s "$@"
}

case "${1:-}" in
install)
  missing=()
  command -v etcd >/dev/null 2>&1 || missing+=(etcd-server)
  command -v etcdctl >/dev/null 2>&1 || missing+=(etcd-client)
  command -v openssl >/dev/null 2>&1 || missing+=(openssl)
  [ ${#missing[@]} -eq 0 ] && exit 0
  command -v apt-get >/dev/null 2>&1 || die "missing ${missing[*]} and no apt-get to install them"
  export DEBIAN_FRONTEND=noninteractive
  log=$(mktemp)
  apt=(apt-get install -y -qq --no-install-recommends -o Dpkg::Use-Pty=0 "${missing[@]}")
  if ! "${apt[@]}" >>"$log" 2>&1; then
    apt-get update -qq >>"$log" 2>&1 || true
    "${apt[@]}" >>"$log" 2>&1 || { tail -n 20 "$log" >&2; die "apt-get install ${missing[*]} failed"; }
  fi
  # The package enables a system service; the tests' members run on their own ports per host, so none is wanted.
  pkill -x etcd 2>/dev/null || true
  echo "etcd-local: installed ${missing[*]}"
  ;;
auth-on)
  [ $# -eq 2 ] || die "$usage"
  root=$(password_in "$2")
  printf '%s\n' "$root" | ctl user add root --interactive=false >/dev/null
  ctl user grant-role root root >/dev/null
  ctl auth enable >/dev/null
  echo "etcd-local: authentication is on; root's password is in $2"
  ;;
add-job)
  [ $# -eq 4 ] || [ $# -eq 5 ] || die "$usage"
  name=$2 prefix=$3 file=$4
  case "$prefix" in */) ;; *) die "PREFIX must end with / (got '$prefix'): the role's range is every key that starts with it" ;; esac
  password=$(password_in "$file")
  if [ $# -eq 5 ]; then
    ETCDCTL_USER=root ETCDCTL_PASSWORD=$(password_in "$5")
    export ETCDCTL_USER ETCDCTL_PASSWORD
  fi
  ctl role add "$name" >/dev/null
  ctl role grant-permission "$name" --prefix=true readwrite "$prefix" >/dev/null
  printf '%s\n' "$password" | ctl user add "$name" --interactive=false >/dev/null
  ctl user grant-role "$name" "$name" >/dev/null
  echo "launcher.etcd.prefix=$prefix launcher.etcd.user=$name launcher.etcd.password_file=$(realpath "$file")"
  ;;
*)
  die "$usage"
  ;;
esac
